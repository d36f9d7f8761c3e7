"""Model: shapes, layouts, causality, remat equivalence, telemetry consistency, input validation."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import get_config
from twell_jax.config import ModelConfig
from twell_jax.model import apply_model, init_model, rope, split_model

# Prime-ish small shapes: D=24 (3 heads of 8), H=37, V=61, S=11.
CFG = ModelConfig(vocab_size=61, d_model=24, n_layers=2, n_heads=3, d_ff=37, max_seq_len=16,
                  compute_dtype="float32", ffn_kind="twell", ffn_backend="dense")
KINDS = ("swiglu", "relu_gated", "twell", "relu")


def _tokens(batch=3, seq=11, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, CFG.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_and_layout(kind):
    cfg = dataclasses.replace(CFG, ffn_kind=kind)
    model = init_model(cfg, seed=0)
    ffn = model.blocks[0].ffn
    assert ffn.w_up[...].shape == (37, 24) and ffn.w_down[...].shape == (37, 24)  # neuron-major [H, D]
    assert hasattr(ffn, "w_gate") == (kind != "relu")
    logits, aux = model(_tokens(), track_neurons=True)
    assert logits.shape == (3, 11, 61) and logits.dtype == jnp.float32
    for key in ("l1", "l0", "tile_overflow", "row_overflow", "dense_fallback"):
        assert aux[key].shape == (2,), key
    if kind != "swiglu":
        assert aux["neuron_active_count"].shape == (2, 37)
        assert aux["position_active"].shape == (2, 11)
        # telemetry agrees with the op's l0: mean over tokens of active neurons
        np.testing.assert_allclose(np.sum(aux["neuron_active_count"], axis=1) / 33, aux["l0"], rtol=1e-6)
        np.testing.assert_allclose(np.mean(aux["position_active"], axis=1), aux["l0"], rtol=1e-5)
    assert float(jnp.std(model.embed[...])) == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize("kind", KINDS)
def test_causality(kind):
    """Changing token t must not change the logits at positions < t."""
    model = init_model(dataclasses.replace(CFG, ffn_kind=kind), seed=1)
    tokens = _tokens(batch=2)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 5) % CFG.vocab_size)
    before, _ = model(tokens)
    after, _ = model(changed)
    np.testing.assert_array_equal(np.asarray(before[:, :7]), np.asarray(after[:, :7]))
    assert not np.allclose(before[:, 7:], after[:, 7:])


def test_remat_matches_no_remat():
    graphdef, params = split_model(init_model(CFG, seed=2))
    graphdef_remat, _ = split_model(init_model(dataclasses.replace(CFG, remat=True), seed=2))
    tokens = _tokens()

    def loss(gd):
        def fn(p):
            logits, aux = apply_model(gd, p, tokens)
            return jnp.mean(logits ** 2) + jnp.mean(aux["l1"])
        return jax.jit(jax.value_and_grad(fn))(params)

    (v0, g0), (v1, g1) = loss(graphdef), loss(graphdef_remat)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_bf16_compute_keeps_fp32_master_weights():
    model = init_model(dataclasses.replace(CFG, compute_dtype="bfloat16"), seed=0)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(split_model(model)[1]))
    logits, aux = model(_tokens())
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))
    assert aux["l1"].dtype == jnp.float32


def test_rope_is_a_rotation_of_halves():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    y = rope(x, theta=10_000.0)
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)  # position 0: identity
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # non-interleaved: dims i and i + K/2 rotate together by angle pos * theta^(-i/(K/2))
    pos, i = 3, 1
    angle = pos * 10_000.0 ** (-i / 4)
    a, b = x[0, pos, 0, i], x[0, pos, 0, i + 4]
    np.testing.assert_allclose(y[0, pos, 0, i], a * np.cos(angle) - b * np.sin(angle), rtol=1e-5)
    np.testing.assert_allclose(y[0, pos, 0, i + 4], b * np.cos(angle) + a * np.sin(angle), rtol=1e-5)


def test_bad_inputs():
    model = init_model(CFG, seed=0)
    with pytest.raises(ValueError, match="tokens must be"):
        model(jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(jnp.zeros((1, 17), jnp.int32))


def test_per_layer_auto_hints_reach_each_layers_op_config(tmp_path):
    import json

    from twell_jax.evaluate import expected_active_from_run, with_auto_hints

    cfg = get_config("micro")
    assert all(block.ffn.op_config is None for block in init_model(cfg.model, 0).blocks)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 1, "l0_per_layer": [9.0, 8.0]}, {"step": 2, "val_l0_per_layer": [3.5, 7.25]},
        {"step": 2, "l0_per_layer": [1.0]})))  # wrong layer count: ignored
    assert expected_active_from_run(tmp_path, 2) == (3.5, 7.25)
    hinted = with_auto_hints(cfg, tmp_path, echo=lambda _: None)
    assert hinted.model.ffn_expected_active == (3.5, 7.25)
    model = init_model(hinted.model, 0)
    assert [b.ffn.op_config.expected_active_per_token for b in model.blocks] == [3.5, 7.25]
    # A hint in ffn_op_config applies to every layer and wins; non-auto backends get no hints.
    fixed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_op_config={"expected_active_per_token": 2.0}))
    assert with_auto_hints(fixed, tmp_path, echo=lambda _: None) is fixed
    ref = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_backend="reference"))
    assert with_auto_hints(ref, tmp_path, echo=lambda _: None) is ref
    with pytest.raises(ValueError, match="ffn_expected_active"):
        dataclasses.replace(cfg.model, ffn_expected_active=(1.0,))
