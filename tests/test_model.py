"""Model: shapes, layouts, causality, remat policies, telemetry consistency, the attention choice,
input validation."""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.configs import get_config
from twell_jax.config import ModelConfig
from twell_jax import model as model_lib
from twell_jax.model import apply_model, choose_attention, describe_execution, init_model, rope, split_model

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
    ffn = model.layer(0).ffn
    assert ffn.w_up[...].shape == (37, 24) and ffn.w_down[...].shape == (37, 24)  # neuron-major [H, D]
    assert model.blocks.ffn.w_up[...].shape == (2, 37, 24)  # stacked over layers
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


@pytest.mark.parametrize("policy", ["full", "dots", "ffn"])
def test_remat_policies_match_no_remat(policy):
    graphdef, params = split_model(init_model(CFG, seed=2))
    graphdef_remat, _ = split_model(init_model(dataclasses.replace(CFG, remat=policy), seed=2))
    tokens = _tokens()

    def loss(gd):
        def fn(p):
            logits, aux = apply_model(gd, p, tokens, track_neurons=True)
            return jnp.mean(logits ** 2) + jnp.mean(aux["l1"]), aux["neuron_active_count"]
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)

    ((v0, n0), g0), ((v1, n1), g1) = loss(graphdef), loss(graphdef_remat)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    np.testing.assert_array_equal(n0, n1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_remat_bools_of_old_configs_map_to_policies():
    assert dataclasses.replace(CFG, remat=True).remat == "full"
    assert dataclasses.replace(CFG, remat=False).remat == "none"
    with pytest.raises(ValueError, match="model.remat must be one of"):
        dataclasses.replace(CFG, remat="sometimes")


@pytest.mark.parametrize("backend", ["dense", "reference"])
def test_neuron_telemetry_comes_from_the_op_without_an_extra_gemm(backend):
    """Tracking neurons adds no matmul: the counts are the op's own (same dot_general count)."""
    cfg = dataclasses.replace(CFG, ffn_backend=backend)
    graphdef, params = split_model(init_model(cfg, seed=3))
    tokens = _tokens()

    def n_dots(track):
        def fn(p):
            logits, aux = apply_model(graphdef, p, tokens, track_neurons=track)
            return jnp.sum(logits) + jnp.sum(aux["l1"])
        return jax.jit(fn).lower(params).as_text().count("dot_general")

    assert n_dots(True) == n_dots(False)
    _, aux = apply_model(graphdef, params, tokens, track_neurons=True)
    ref_counts = []
    x = tokens
    model = nnx_merge(graphdef, params)
    # The counts equal relu(gate) > 0 of each layer's FFN input (recomputed here, in f32).
    h = jnp.take(model.embed[...], x, axis=0)
    for layer in range(model.n_layers):
        block = model.layer(layer)
        h = h + block.attn(block.attn_norm(h))
        ffn_in = block.ffn_norm(h)
        fired = jnp.einsum("bsd,hd->bsh", ffn_in, block.ffn.w_gate[...]) > 0
        ref_counts.append(np.asarray(jnp.sum(fired, axis=(0, 1))))
        h = h + block.ffn(ffn_in, model.op_configs[layer])[0]
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), np.stack(ref_counts))


def nnx_merge(graphdef, params):
    from flax import nnx

    return nnx.merge(graphdef, params)


GPU_H100 = ("gpu", "NVIDIA H100 80GB HBM3", (9, 0))


def _ok_probe(seq_len, head_dim, dtype):
    return None


def test_attention_choice():
    bf16 = jnp.bfloat16
    choose = functools.partial(choose_attention, dtype=bf16, head_dim=64, seq_len=2048)
    # CPU: XLA, silently; "cudnn" asked for explicitly is an error naming the shape.
    assert choose("auto", device=("cpu", "cpu", None), probe=_ok_probe) == "xla"
    with pytest.raises(ValueError, match=r"seq 2048.*head dim 64.*not an NVIDIA GPU"):
        choose("cudnn", device=("cpu", "cpu", None), probe=_ok_probe)
    assert choose("xla", device=GPU_H100, probe=_ok_probe) == "xla"
    # An H100 with a shape cuDNN takes: cuDNN for "auto" and "cudnn".
    assert choose("auto", device=GPU_H100, probe=_ok_probe) == "cudnn"
    assert choose("cudnn", device=GPU_H100, probe=_ok_probe) == "cudnn"


@pytest.mark.parametrize("change,reason", [
    (dict(seq_len=2047), "sequence length 2047 is odd"),
    (dict(dtype=jnp.float32), "takes bfloat16/float16"),
    (dict(head_dim=20), "head dim 20 must be a multiple of 8"),
    (dict(head_dim=512), "<= 256"),
])
def test_attention_fallback_on_gpu_warns_once_or_raises(change, reason, caplog):
    args = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=2048, device=GPU_H100, probe=_ok_probe) | change
    with pytest.raises(ValueError, match=reason):
        choose_attention("cudnn", **args)
    model_lib._warned.clear()
    with caplog.at_level(logging.WARNING, logger="twell_jax.model"):
        assert choose_attention("auto", **args) == "xla"
        assert choose_attention("auto", **args) == "xla"
    warnings = [r for r in caplog.records if r.name == "twell_jax.model" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()


@pytest.mark.parametrize("device", [GPU_H100, ("cpu", "cpu", None)])
def test_attention_choice_reports_a_bad_value_before_probing(device):
    def probe_must_not_run(seq_len, head_dim, dtype):
        raise AssertionError("probed cuDNN for an invalid attention_impl")

    with pytest.raises(ValueError, match="attention_impl must be one of .*'flash'"):
        choose_attention("flash", dtype=jnp.bfloat16, head_dim=64, seq_len=2048, device=device,
                         probe=probe_must_not_run)


def test_attention_probe_refusal_falls_back():
    def refusing_probe(seq_len, head_dim, dtype):
        return "NotImplementedError: Unsupported sequence length"

    model_lib._warned.clear()
    args = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=1000, device=GPU_H100, probe=refusing_probe)
    assert choose_attention("auto", **args) == "xla"
    with pytest.raises(ValueError, match="Unsupported sequence length"):
        choose_attention("cudnn", **args)
    # Pre-Hopper GPUs take head dims up to 128 only.
    with pytest.raises(ValueError, match="<= 128"):
        choose_attention("cudnn", dtype=jnp.bfloat16, head_dim=192, seq_len=64,
                         device=("gpu", "NVIDIA A100-SXM4-80GB", (8, 0)), probe=_ok_probe)


def test_describe_execution_names_policy_and_attention():
    line = describe_execution(dataclasses.replace(CFG, remat="dots"), seq_len=11)
    assert "remat 'dots'" in line and "attention xla" in line and "seq 11" in line


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

    from twell_jax.training.hints import expected_active_from_run, with_auto_hints

    cfg = get_config("micro")
    assert all(config is None for config in init_model(cfg.model, 0).op_configs)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 1, "l0_per_layer": [9.0, 8.0]}, {"step": 2, "val_l0_per_layer": [3.5, 7.25]},
        {"step": 2, "l0_per_layer": [1.0]})))  # wrong layer count: ignored
    assert expected_active_from_run(tmp_path, 2) == (3.5, 7.25)
    hinted = with_auto_hints(cfg, tmp_path, echo=lambda _: None)
    assert hinted.model.ffn_expected_active == (3.5, 7.25)
    model = init_model(hinted.model, 0)
    assert [config.expected_active_per_token for config in model.op_configs] == [3.5, 7.25]
    # A hint in ffn_op_config applies to every layer and wins; non-auto backends get no hints.
    fixed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_op_config={"expected_active_per_token": 2.0}))
    assert with_auto_hints(fixed, tmp_path, echo=lambda _: None) is fixed
    ref = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_backend="reference"))
    assert with_auto_hints(ref, tmp_path, echo=lambda _: None) is ref
    with pytest.raises(ValueError, match="ffn_expected_active"):
        dataclasses.replace(cfg.model, ffn_expected_active=(1.0,))
