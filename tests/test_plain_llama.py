"""twell_jax/bench/plain_llama.py: the plain-JAX Llama computes what the library's dense twin computes,
with the same weights (full forward, loss, KV-cached prefill and decode), and refuses parameters
it cannot hold. f32 on CPU, tight tolerances."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.configs import get_config
from twell_jax.bench import plain_llama
from twell_jax.config import DecodeConfig
from twell_jax.inference.decode_engine import decode
from twell_jax.inference.load import model_with_params  # noqa: E402
from twell_jax.model import init_cache, init_model, split_model  # noqa: E402
from twell_jax.training.loss import cross_entropy  # noqa: E402

# Odd widths (d_ff 52, vocab 97) and 3 heads of 8; max_seq_len 24 = the decode cache below.
TINY = dict(vocab_size=97, d_model=24, n_layers=2, n_heads=3, d_ff=52, max_seq_len=24, compute_dtype="float32")
TOL = dict(rtol=1e-5, atol=1e-5)  # f32: the same operations in the same order, up to XLA fusion


@pytest.fixture(scope="module")
def tiny():
    """(twell config, its params as split_model gives them, the dense twin (relu_gated) in f32).
    init_std 0.2 so the logits are far from flat and a wrong layout shows."""
    cfg = dataclasses.replace(get_config("micro").model, **TINY, init_std=0.2)
    params = split_model(init_model(cfg, seed=3))[1]
    twin = model_with_params(dataclasses.replace(cfg, ffn_kind="relu_gated", ffn_backend="dense"), params, "float32")
    return cfg, params, twin


def _tokens(shape: tuple[int, int], seed: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY["vocab_size"])


def test_the_full_forward_equals_the_dense_twins_logits(tiny):
    cfg, params, twin = tiny
    plain = plain_llama.reference_params_from_model(cfg, params, "float32")
    tokens_BxS = _tokens((3, 19), seed=0)
    want_BxSxV, _ = twin(tokens_BxS)
    got_BxSxV = jax.jit(lambda p, t: plain_llama.reference_logits(cfg, p, t, "xla"))(plain, tokens_BxS)
    assert got_BxSxV.shape == (3, 19, 97) and got_BxSxV.dtype == jnp.float32
    np.testing.assert_allclose(got_BxSxV, want_BxSxV, **TOL)
    assert float(jnp.std(want_BxSxV)) > 0.1  # not a flat output that any layout would match


def test_the_loss_equals_the_dense_twins_cross_entropy(tiny):
    cfg, params, twin = tiny
    plain = plain_llama.reference_params_from_model(cfg, params, "float32")
    tokens_BxT = _tokens((2, 17), seed=1)
    want, _ = cross_entropy(twin(tokens_BxT[:, :-1])[0], tokens_BxT[:, 1:])
    for remat in plain_llama.REFERENCE_REMATS:
        got = plain_llama.reference_loss(cfg, remat, None, plain, tokens_BxT)
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.slow
def test_kv_cached_prefill_and_decode_equal_the_full_forward_and_the_models_decode(tiny):
    """A 13-token prefill in chunks of 5 (a partial last chunk), then 11 one-token steps at traced
    positions that fill the 24-slot cache: every step's logits equal the full forward's at that
    position and the model's own decode; the caches end equal."""
    cfg, params, twin = tiny
    plain = plain_llama.reference_params_from_model(cfg, params, "float32")
    length, prefill_len = TINY["max_seq_len"], 13
    tokens_BxS = _tokens((2, length), seed=2)
    full_BxSxV, _ = twin(tokens_BxS)

    logits_BxV, cache = plain_llama.reference_prefill_cache(cfg, plain, tokens_BxS[:, :prefill_len], length,
                                                            chunk=5)
    np.testing.assert_allclose(logits_BxV, full_BxSxV[:, prefill_len - 1], **TOL)
    start_B = jnp.zeros((2,), jnp.int32)
    model_logits_BxV, model_cache, _ = decode(twin, tokens_BxS[:, :prefill_len], init_cache(cfg, 2, length),
                                              jnp.int32(0), start_B, config=DecodeConfig())
    np.testing.assert_allclose(logits_BxV, model_logits_BxV, **TOL)

    step = jax.jit(lambda p, c, t, pos: plain_llama.reference_decode_step(cfg, p, c, t, pos))
    for pos in range(prefill_len, length):
        logits_BxV, cache = step(plain, cache, tokens_BxS[:, pos:pos + 1], jnp.int32(pos))
        model_logits_BxV, model_cache, _ = decode(twin, tokens_BxS[:, pos:pos + 1], model_cache, jnp.int32(pos),
                                                  start_B, config=DecodeConfig())
        np.testing.assert_allclose(logits_BxV, full_BxSxV[:, pos], **TOL)
        np.testing.assert_allclose(logits_BxV, model_logits_BxV, **TOL)
    for got, want in zip(cache, model_cache):
        assert got.shape == want.shape == (2, 2, length, 3, 8)
        np.testing.assert_allclose(got, want, **TOL)


def test_the_conversion_keeps_the_weights_in_the_plain_layout(tiny):
    cfg, params, _ = tiny
    plain = plain_llama.reference_params_from_model(cfg, params)  # default: bf16, as reference_init
    assert {leaf.dtype for leaf in jax.tree.leaves(plain)} == {jnp.dtype(jnp.bfloat16)}
    layer = plain["layers"][1]
    assert layer["wg"].shape == layer["wu"].shape == (24, 52) and layer["wd"].shape == (52, 24)
    ffn = params["blocks"]["ffn"]  # stacked over layers
    np.testing.assert_array_equal(layer["wg"], ffn["w_gate"][1].T.astype(jnp.bfloat16))
    np.testing.assert_array_equal(layer["wd"], ffn["w_down"][1].astype(jnp.bfloat16))
    assert jax.tree.structure(plain) == jax.tree.structure(plain_llama.reference_init(cfg, jax.random.key(0)))


def test_bad_parameters_and_shapes_are_refused(tiny):
    cfg, params, _ = tiny
    for kind in ("swiglu", "relu"):
        with pytest.raises(ValueError, match=f"relu-gated; ffn_kind '{kind}'"):
            plain_llama.reference_params_from_model(dataclasses.replace(cfg, ffn_kind=kind), params)
    missing = {**params, "blocks": {**params["blocks"], "ffn": {
        k: v for k, v in params["blocks"]["ffn"].items() if k != "w_up"}}}
    with pytest.raises(ValueError, match="no entry blocks/ffn/w_up"):
        plain_llama.reference_params_from_model(cfg, missing)
    with pytest.raises(ValueError, match=r"embed has shape \(97, 24\), expected \(98, 24\)"):
        plain_llama.reference_params_from_model(dataclasses.replace(cfg, vocab_size=98), params)
    plain = plain_llama.reference_params_from_model(cfg, params, "float32")
    with pytest.raises(ValueError, match="length <= model.max_seq_len=24"):
        plain_llama.reference_init_cache(cfg, 1, 25, jnp.float32)
    with pytest.raises(ValueError, match=r"prefill needs 1 <= tokens \(9\) <= cache length \(8\)"):
        plain_llama.reference_prefill_cache(cfg, plain, _tokens((1, 9), seed=3), 8)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        plain_llama.reference_prefill_cache(cfg, plain, _tokens((1, 4), seed=3), 8, chunk=0)
    cache = plain_llama.reference_init_cache(cfg, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="batch = the cache's 2 rows"):
        plain_llama.reference_decode_step(cfg, plain, cache, _tokens((3, 1), seed=3), 0)
    with pytest.raises(ValueError, match="remat must be one of"):
        plain_llama.reference_body(cfg, plain, _tokens((1, 4), seed=3), None, remat="ffn")
