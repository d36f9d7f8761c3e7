"""Grouped-query attention (model.n_kv_heads), Llama-3 RoPE scaling (model.rope_scaling) and an
untied output head (model.tie_embeddings=false) in the model: the forward and its gradient against
multi-head attention with each KV head repeated, the scaled RoPE frequencies band by band, the KV
cache of the KV heads only, the decode kernels' step (interpret mode) against the XLA decode and
the forward, and the parameter count and memory figures that the dry run and the logs report.
(tests/test_inference_hf.py checks all three against transformers' logits.)"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from twell_jax.config import DataConfig, DecodeConfig, ExperimentConfig, ModelConfig, RopeScaling, SparsityConfig
from twell_jax.inference import decode_engine
from twell_jax.model import (describe_execution, init_cache, init_model, rope, rope_frequencies, rope_tables,
                             split_model)

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}
CFG = ModelConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16,
                  compute_dtype="float32", ffn_kind="swiglu", ffn_backend="dense", tie_embeddings=False,
                  rope_scaling=SCALING, init_std=0.1)


def _repeat_kv(w_LxDxJ: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[L, D, N_kv*K] -> [L, D, N*K]: each KV head's columns repeated for its G query heads."""
    layers, d, _ = w_LxDxJ.shape
    group = cfg.n_heads // cfg.kv_heads
    return jnp.repeat(w_LxDxJ.reshape(layers, d, cfg.kv_heads, cfg.head_dim), group, axis=2).reshape(layers, d, -1)


def test_grouped_attention_is_multi_head_attention_with_each_kv_head_repeated():
    """Query head n reads KV head n // G (transformers' repeat_kv): the forward equals a multi-head
    model whose k/v weights repeat each KV head's, and the gradient of a KV head's weights is the
    sum of its copies' gradients (what training the shared head means)."""
    model = init_model(CFG, seed=1)
    graphdef, params = split_model(model)
    mha_cfg = dataclasses.replace(CFG, n_kv_heads=None)
    mha_graphdef, _ = split_model(init_model(mha_cfg, seed=1))
    tokens = jax.random.randint(jax.random.key(0), (2, 11), 0, CFG.vocab_size)

    def widen(p):
        attn = {**p["blocks"]["attn"], "w_k": _repeat_kv(p["blocks"]["attn"]["w_k"], CFG),
                "w_v": _repeat_kv(p["blocks"]["attn"]["w_v"], CFG)}
        return {**p, "blocks": {**p["blocks"], "attn": attn}}

    def loss(p, gd):
        return jnp.mean(nnx.merge(gd, p)(tokens)[0] ** 2)

    assert params["blocks"]["attn"]["w_k"].shape == (2, 64, 32) and params["lm_head"].shape == (61, 64)
    # f32 on the CPU; the two programs sum in their own orders (a wrong head mapping is off by ~0.1)
    np.testing.assert_allclose(model(tokens)[0], nnx.merge(mha_graphdef, widen(params))(tokens)[0], rtol=1e-5,
                               atol=2e-6)
    grads = jax.grad(loss)(params, graphdef)
    wide_grads = jax.grad(lambda p: loss(widen(p), mha_graphdef))(params)  # the chain rule through the repeat
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, wide_grads)
    assert float(jnp.abs(grads["blocks"]["attn"]["w_k"]).max()) > 0 and float(jnp.abs(grads["lm_head"]).max()) > 0
    assert float(jnp.abs(grads["embed"] - grads["lm_head"]).max()) > 0  # two matrices, two gradients


def test_llama3_scaling_keeps_high_frequencies_slows_low_ones_and_blends_between():
    """Llama 3.1's rule (its paper's code, restated): wavelength 2 pi / f below original /
    high_freq_factor: f kept; above original / low_freq_factor: f / factor; between: the linear
    blend in original / wavelength. At head dim 16 and theta 5e5 with original 64 each band holds
    a frequency (the transformers fixture's setting)."""
    scaling = RopeScaling.from_dict({**SCALING, "original_max_position_embeddings": 64})
    plain = np.asarray(rope_frequencies(16, 5e5), np.float64)
    scaled = np.asarray(rope_frequencies(16, 5e5, scaling), np.float64)
    np.testing.assert_allclose(plain, 5e5 ** (-np.arange(8) / 8), rtol=1e-6)
    wavelength = 2 * math.pi / plain
    high, low = wavelength < 64 / 4, wavelength > 64 / 1
    middle = ~high & ~low
    assert high.sum() == 1 and middle.sum() == 1 and low.sum() == 6
    np.testing.assert_allclose(scaled[high], plain[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    smooth = (64 / wavelength[middle] - 1) / (4 - 1)
    np.testing.assert_allclose(scaled[middle], (1 - smooth) * plain[middle] / 8 + smooth * plain[middle], rtol=1e-5)
    assert np.all(plain[middle] / 8 < scaled[middle]) and np.all(scaled[middle] < plain[middle])
    # rope and rope_tables rotate by these frequencies
    positions = jnp.arange(5)[None]
    cos, _ = rope_tables(positions, 16, 5e5, scaling)
    np.testing.assert_allclose(cos[0], np.cos(np.arange(5)[:, None] * scaled[None]), atol=1e-6)
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 16))
    assert float(jnp.abs(rope(x, 5e5, None, scaling) - rope(x, 5e5)).max()) > 1e-3


def test_the_cache_holds_the_kv_heads_and_decoding_equals_the_forward():
    model = init_model(CFG, seed=2)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, CFG.vocab_size)
    cache = init_cache(CFG, 2, 12)
    assert cache.k_LxBxTxNxK.shape == (2, 2, 12, 2, 16)
    start = jnp.zeros((2,), jnp.int32)
    prompt, cache, _ = model.decode(tokens[:, :7], cache, jnp.int32(0), start, all_logits=True)
    steps = []
    for t in range(7, 12):
        logits, cache, _ = model.decode(tokens[:, t:t + 1], cache, jnp.int32(t), start)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate([prompt, jnp.stack(steps, 1)], 1), model(tokens)[0], atol=2e-6)


# The decode kernels' step (interpret mode): the sparse kind through the Pallas backend.
KERNEL_CFG = dataclasses.replace(CFG, ffn_kind="twell", ffn_backend="pallas", ffn_interpret=True,
                                 ffn_op_config={"tile": 16, "slots": 16, "ell_width": 64})


@pytest.mark.parametrize("variant", ["transposed", "stored", "head_dim_12"])
@pytest.mark.fast_params("transposed")
def test_the_decode_kernels_step_equals_the_xla_steps_and_the_forward(variant):
    """Grouped heads, the untied head and the scaled RoPE through the decode kernels: q/k/v in one
    [L, D + 2 N_kv K, D] product (transposed copies) or three stored ones, the attention kernel's
    programs each serving a KV head's G query heads (or, at a head dim that is not a power of two,
    the XLA attention over the grouped cache), the LM head's kernel reading lm_head; left-padded rows."""
    cfg = dataclasses.replace(KERNEL_CFG, **({"d_model": 48, "n_heads": 4, "n_kv_heads": 1} if variant == "head_dim_12"
                                             else {}))
    config = DecodeConfig(kernels="pallas", transposed=variant != "stored")
    tokens = jax.random.randint(jax.random.key(5), (3, 9), 0, cfg.vocab_size)
    start = jnp.asarray([0, 2, 4], jnp.int32)

    def run(config):
        model = init_model(cfg, seed=4)
        prepared = decode_engine.prepare_decode(model, config)
        cache = init_cache(cfg, 3, 9)
        _, cache, _ = decode_engine.decode(model, tokens[:, :6], cache, jnp.int32(0), start, config=config)
        out = []
        for t in range(6, 9):
            logits, cache, _ = decode_engine.decode(model, tokens[:, t:t + 1], cache, jnp.int32(t), start,
                                                    config=config, prepared=prepared)
            out.append(logits)
        return jnp.stack(out, 1), cache, model

    got, cache, model = run(config)
    prepared = decode_engine.prepare_decode(model, config)
    assert decode_engine.uses_kernels(model, config) and (prepared is None) == (variant == "stored")
    if variant == "transposed":
        assert prepared.w_qkv.shape == (2, 64 + 2 * 32, 64)
    want, want_cache, _ = run(DecodeConfig(kernels="xla"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cache.k_LxBxTxNxK, want_cache.k_LxBxTxNxK, atol=1e-6)
    full, _ = model(tokens)
    np.testing.assert_allclose(got[0], full[0, 6:], rtol=1e-4, atol=1e-5)  # the unpadded row


@pytest.mark.parametrize("change", [{}, {"n_kv_heads": None}, {"tie_embeddings": True}, {"n_kv_heads": 1},
                                    {"ffn_kind": "twell"}])
def test_parameter_count_memory_and_descriptions_count_kv_heads_and_the_head(change):
    """ModelConfig.num_params (the logs, the memory estimate, the FLOPs) equals the model's own
    parameters, as the dry run counts them (cli._param_count); the KV heads shrink k/v, the KV cache,
    the training activations and a decode step's bytes; the start-up line names the heads."""
    from twell_jax.bench.inference import decode_floor_bytes
    from twell_jax.cli import _param_count
    from twell_jax.training.preflight import memory_estimate

    cfg = dataclasses.replace(CFG, **change)
    assert cfg.num_params() == _param_count(cfg)
    mha = dataclasses.replace(cfg, n_kv_heads=None)
    saved = 2 * cfg.n_layers * cfg.d_model * (cfg.d_model - cfg.kv_dim)  # k and v of every layer
    assert mha.num_params() - cfg.num_params() == saved
    untied = cfg.vocab_size * cfg.d_model if not cfg.tie_embeddings else 0
    assert cfg.num_params() - dataclasses.replace(cfg, tie_embeddings=True).num_params() == untied
    exp = ExperimentConfig(model=cfg, sparsity=SparsityConfig(l1_coef=1e-3 if cfg.kind.l1 else 0.0),
                           data=DataConfig(source="synthetic", vocab_size=cfg.vocab_size, seq_len=16))
    exp_mha = dataclasses.replace(exp, model=mha)
    assert (memory_estimate(exp, 1)["activations_per_micro_batch"] < memory_estimate(exp_mha, 1)[
        "activations_per_micro_batch"]) == (cfg.kv_heads < cfg.n_heads)
    kv_bytes = 2 * cfg.n_layers * 1 * 100 * (mha.kv_dim - cfg.kv_dim) * 2
    assert decode_floor_bytes(mha, 1, 100, 2) - decode_floor_bytes(cfg, 1, 100, 2) == saved * 2 + kv_bytes
    line = describe_execution(cfg, seq_len=16)
    assert ("4 heads (1 KV heads)" if cfg.kv_heads == 1 else "4 heads (2 KV heads)" if cfg.kv_heads == 2
            else "4 heads,") in line, line


def test_the_plain_baseline_refuses_what_it_does_not_model():
    from twell_jax.bench.plain_llama import reference_init

    for field, value in (("n_kv_heads", 2), ("tie_embeddings", False), ("rope_scaling", SCALING)):
        cfg = dataclasses.replace(ModelConfig(), **{field: value})
        with pytest.raises(ValueError, match=f"plain-JAX baseline has model.{field}="):
            reference_init(cfg, jax.random.key(0))
