"""The decode kernels' one-token step (`Transformer._decode_step_kernels`, model.decode_kernels)
against the full forward and the XLA decode path: dense, sparse and SwiGLU models, batch 1 and
left-padded rows, both sides of the device-side dense switch, the stacked weights read in place."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import model as model_lib
from twell_jax.config import ModelConfig
from twell_jax.model import init_cache, init_model

BASE = ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=2, d_ff=64, max_seq_len=16,
                   compute_dtype="float32", ffn_kind="twell", ffn_backend="pallas", ffn_interpret=True,
                   decode_kernels="pallas", ffn_op_config={"tile": 16, "slots": 16, "ell_width": 64},
                   decode_transposed=False)  # the stored layout; the default, transposed, has its own tests below
KINDS = {"sparse": {}, "dense_twin": {"ffn_kind": "relu_gated", "ffn_backend": "dense"},
         "swiglu": {"ffn_kind": "swiglu", "ffn_backend": "dense"},
         "relu": {"ffn_kind": "relu", "ffn_backend": "pallas"}}


def _run(cfg, tokens, start, prompt):
    """Prefill `prompt` tokens by the XLA path, then decode the rest one token per step; the
    step logits [B, steps, V] and the per-step aux."""
    model = init_model(cfg, seed=4)
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    _, cache, _ = model.decode(tokens[:, :prompt], cache, jnp.int32(0), start)
    out, auxes = [], []
    for t in range(prompt, tokens.shape[1]):
        logits, cache, aux = model.decode(tokens[:, t:t + 1], cache, jnp.int32(t), start)
        out.append(logits)
        auxes.append(aux)
    return jnp.stack(out, 1), auxes, model


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch,padded", [(1, False), (3, True)])
def test_kernel_steps_equal_the_xla_steps_and_the_forward(kind, batch, padded):
    cfg = dataclasses.replace(BASE, **KINDS[kind])
    tokens = jax.random.randint(jax.random.key(batch), (batch, 10), 0, cfg.vocab_size)
    start = jnp.asarray([0, 2, 4][:batch] if padded else [0] * batch, jnp.int32)
    got, auxes, model = _run(cfg, tokens, start, prompt=6)
    assert model._decode_with_kernels()
    want, want_aux, _ = _run(dataclasses.replace(cfg, decode_kernels="xla"), tokens, start, prompt=6)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5, err_msg=kind)
        assert a["l0"].shape == (cfg.n_layers,)
    # Rows without padding: the full forward's logits at those positions.
    full, _ = model(tokens)
    for row in range(batch):
        if int(start[row]) == 0:
            np.testing.assert_allclose(got[row], full[row, 6:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("limit", [0, 10_000])
def test_both_sides_of_the_dense_switch(monkeypatch, limit):
    """Several rows: a union limit of 0 sends every sparse layer to the dense products, a large one
    keeps the sparse kernels; both give the XLA path's logits."""
    monkeypatch.setattr(model_lib.planner, "decode_union_limit", lambda *a, **k: limit)
    tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, BASE.vocab_size)
    start = jnp.zeros((2,), jnp.int32)
    got, _, model = _run(BASE, tokens, start, prompt=5)
    assert all(model.decode_layer_sparse(2, jnp.float32))
    want, _, _ = _run(dataclasses.replace(BASE, decode_kernels="xla"), tokens, start, prompt=5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_greedy_tokens_match_the_xla_path():
    cfg = dataclasses.replace(BASE, compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(9), (2, 10), 0, cfg.vocab_size)
    start = jnp.zeros((2,), jnp.int32)
    got, _, _ = _run(cfg, tokens, start, prompt=4)
    want, _, _ = _run(dataclasses.replace(cfg, decode_kernels="xla"), tokens, start, prompt=4)
    assert float(jnp.max(jnp.abs(got - want))) <= 0.05 * float(jnp.max(jnp.abs(want)))


def test_the_choice_of_path():
    model = init_model(dataclasses.replace(BASE, decode_kernels="xla"), seed=0)
    assert not model._decode_with_kernels()
    cpu = init_model(dataclasses.replace(BASE, ffn_interpret=False), seed=0)
    with pytest.raises(ValueError, match="decode_kernels='pallas' needs a GPU"):
        cpu._decode_with_kernels()
    auto = init_model(dataclasses.replace(BASE, decode_kernels="auto"), seed=0)
    assert auto._decode_with_kernels() == (jax.default_backend() == "gpu")
    with pytest.raises(ValueError, match="decode_kernels"):
        ModelConfig(decode_kernels="cuda")


def test_qkv_in_three_launches_when_d_model_is_not_a_multiple_of_block_n(monkeypatch):
    from twell_jax.pallas_kernels import decode_matvec

    monkeypatch.setitem(decode_matvec.ROLE_BLOCK_SIZES, "qkv", decode_matvec.MatvecBlockSizes(block_n=64, block_k=16))
    cfg = dataclasses.replace(BASE, **KINDS["dense_twin"])
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
    start = jnp.zeros((2,), jnp.int32)
    got, _, _ = _run(cfg, tokens, start, prompt=5)
    want, _, _ = _run(dataclasses.replace(cfg, decode_kernels="xla"), tokens, start, prompt=5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_head_dim_that_is_not_a_power_of_two_attends_through_xla():
    cfg = dataclasses.replace(BASE, d_model=36, n_heads=3, **KINDS["dense_twin"])  # head dim 12
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, cfg.vocab_size)
    start = jnp.asarray([0, 3], jnp.int32)
    got, _, _ = _run(cfg, tokens, start, prompt=5)
    want, _, _ = _run(dataclasses.replace(cfg, decode_kernels="xla"), tokens, start, prompt=5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sparse", "dense_twin"])
def test_transposed_weight_copies_give_the_same_steps(kind, monkeypatch):
    """model.decode_transposed: the step reads q/k/v, out and the dense W_down from
    `prepare_decode`'s output-major copies (layout "nk"; q/k/v as one weight): the XLA path's
    logits, padded rows included; without the option, or off the kernel path, there are no copies."""
    cfg = dataclasses.replace(BASE, decode_transposed=True, **KINDS[kind])
    model = init_model(cfg, seed=4)
    prepared = model.prepare_decode()
    attn = model.blocks.attn
    np.testing.assert_array_equal(prepared["w_qkv"], jnp.concatenate(
        [jnp.swapaxes(w[...], 1, 2) for w in (attn.w_q, attn.w_k, attn.w_v)], axis=1))
    np.testing.assert_array_equal(prepared["w_down"], jnp.swapaxes(model.blocks.ffn.w_down[...], 1, 2))
    tokens = jax.random.randint(jax.random.key(5), (3, 9), 0, cfg.vocab_size)
    start = jnp.asarray([0, 1, 3], jnp.int32)
    cache = init_cache(cfg, 3, 9)
    _, cache, _ = model.decode(tokens[:, :5], cache, jnp.int32(0), start)
    from twell_jax.pallas_kernels import decode_matvec

    layouts = []
    original = decode_matvec.decode_matvec
    monkeypatch.setattr(decode_matvec, "decode_matvec",
                        lambda *a, **k: layouts.append(k.get("layout", "nk")) or original(*a, **k))
    stored = init_model(dataclasses.replace(cfg, decode_transposed=False), seed=4)
    for m, p in ((stored, None), (model, prepared)):  # every product reads an output-major weight with the copies
        layouts.clear()
        jax.make_jaxpr(lambda c: m.decode(tokens[:, 5:6], c, jnp.int32(5), start, prepared=p))(cache)
        assert ("kn" in layouts) == (p is None), layouts
    with pytest.raises(ValueError, match="pass the copies of prepare_decode"):  # never silently the stored ones
        model.decode(tokens[:, 5:6], cache, jnp.int32(5), start)
    step = jax.jit(lambda c, t, i, p: model.decode(t, c, i, start, prepared=p)[:2])
    got = []
    for t in range(5, 9):
        logits, cache = step(cache, tokens[:, t:t + 1], jnp.int32(t), prepared)
        got.append(logits)
    want, _, _ = _run(dataclasses.replace(cfg, decode_kernels="xla"), tokens, start, prompt=5)
    np.testing.assert_allclose(jnp.stack(got, 1), want, rtol=1e-4, atol=1e-5)
    assert stored.prepare_decode() is None
    assert init_model(dataclasses.replace(cfg, decode_kernels="xla"), 0).prepare_decode() is None
    with pytest.raises(ValueError, match="prepare_decode"):
        model.decode(tokens[:, 5:6], cache, jnp.int32(5), start, prepared={"w_qkv": prepared["w_qkv"]})
    with pytest.raises(ValueError, match="decode_transposed must be true or false"):
        ModelConfig(decode_transposed="yes")
