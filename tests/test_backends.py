"""The op's registry (twell_jax/ops/backends.py), planner keys and tail rule: a backend added in one
place runs through gated_ffn; plan_key separates what traces differently; unknown devices plan like
the fallback kind."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import ops
from twell_jax.ops import backends, planner
from twell_jax.ops.dense import dense_backward, dense_ffn
from twell_jax.ops.implementation import runs_anywhere


def _inputs(m=7, d=12, h=19, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ws = tuple(jnp.asarray(rng.standard_normal((h, d)) * 0.3, jnp.float32) for _ in range(3))
    return x, ws


def test_a_registered_toy_backend_runs_through_gated_ffn():
    """One Implementation and one register call: gated_ffn(backend="toy") runs its forward and its
    backward inside the op's custom_vjp (the backward here doubles the dense gradients, so the test
    sees that it, not autodiff, produced them)."""
    traced = []

    def forward(gated, x, weights, config, interpret, keep):
        traced.append(("forward", keep))
        y, aux = dense_ffn(gated, x, weights, neuron_counts=config.neuron_counts)
        return y, aux, None

    def backward(gated, x, weights, gy, gl1, config, interpret, residual, non_finite):
        traced.append(("backward", non_finite is not None))
        dx, dws = dense_backward(gated, x, weights, gy, gl1)
        return 2 * dx, tuple(2 * g for g in dws)

    toy = ops.Implementation("toy", forward, backward, runs_anywhere)
    ops.register(toy)
    try:
        assert "toy" in ops.backend_names()
        with pytest.raises(ValueError, match="already registered"):
            ops.register(toy)
        with pytest.raises(ValueError, match="cannot be named 'auto'"):
            ops.register(dataclasses.replace(toy, name="auto"))
        x, ws = _inputs()

        def loss(backend, x_, ws_):
            y, aux = ops.gated_ffn(x_, *ws_, backend=backend)
            return jnp.sum(y * y) + aux["l1"], y

        (_, y_toy), g_toy = jax.value_and_grad(lambda a, b: loss("toy", a, b), argnums=(0, 1), has_aux=True)(x, ws)
        (_, y_dense), g_dense = jax.value_and_grad(lambda a, b: loss("dense", a, b), argnums=(0, 1),
                                                   has_aux=True)(x, ws)
        np.testing.assert_allclose(y_toy, y_dense, rtol=1e-6, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g_toy), jax.tree.leaves(g_dense)):
            np.testing.assert_allclose(a, 2 * b, rtol=1e-5, atol=1e-5)
        assert ("forward", True) in traced and ("backward", True) in traced
    finally:
        backends.unregister("toy")
    assert "toy" not in ops.backend_names()
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.gated_ffn(*_inputs()[:1], *_inputs()[1], backend="toy")


def test_backend_names_are_the_registry_and_the_model_config_asks_it_live():
    """ModelConfig validates model.ffn_backend against the registry as it is when the config is
    made: a backend registered after the config module was imported is accepted, and refused again
    once it is gone."""
    from twell_jax.config import ModelConfig

    assert ops.BACKENDS == ("dense", "reference", "pallas", "auto") == ops.backend_names()
    assert "decode" not in ops.BACKENDS  # planned by "auto" only
    with pytest.raises(ValueError, match="model.ffn_backend must be one of"):
        ModelConfig(ffn_backend="toy")
    ops.register(ops.Implementation("toy", lambda *a: None, lambda *a: None, runs_anywhere))
    try:
        assert ModelConfig(ffn_backend="toy").ffn_backend == "toy"
    finally:
        backends.unregister("toy")
    with pytest.raises(ValueError, match="model.ffn_backend must be one of"):
        ModelConfig(ffn_backend="toy")


def test_plan_key_groups_what_traces_alike(monkeypatch):
    """Equal plans under configs differing only in planner-only hints share a key; a different plan,
    shape or traced knob (decode_capacity, check_finite) does not."""
    from twell_jax.ops import pallas_forward

    shape = (16384, 2048, 5632, 2)
    cpu = ops.SparseFFNConfig(expected_active_per_token=10.0)
    assert ops.plan_key(True, "auto", cpu, shape) == ops.plan_key(True, "dense", None, shape)  # CPU: dense
    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    a = ops.SparseFFNConfig(expected_active_per_token=10.0, expected_hot_neurons=0.01)
    b = ops.SparseFFNConfig(expected_active_per_token=12.0)
    assert ops.auto_decision(True, a, shape) == ops.auto_decision(True, b, shape) == ("pallas", "pallas")
    assert ops.plan_key(True, "auto", a, shape) == ops.plan_key(True, "auto", b, shape)
    hash(ops.plan_key(True, "auto", a, shape))
    dense = ops.SparseFFNConfig(expected_active_per_token=2816.0)
    assert ops.auto_decision(True, dense, shape) == ("dense", "dense")
    assert ops.plan_key(True, "auto", dense, shape) != ops.plan_key(True, "auto", a, shape)
    assert ops.plan_key(True, "auto", a, (8192, *shape[1:])) != ops.plan_key(True, "auto", a, shape)
    assert (ops.plan_key(True, "auto", dataclasses.replace(a, decode_capacity=64), shape)
            != ops.plan_key(True, "auto", a, shape))
    decode = (1, 2048, 5632, 2)
    unchecked = ops.SparseFFNConfig(expected_active_per_token=29.0, check_finite=False)
    assert ops.auto_decision(True, unchecked, decode) == ("decode", "dense")
    assert (ops.plan_key(True, "auto", unchecked, decode)
            != ops.plan_key(True, "auto", dataclasses.replace(unchecked, decode_capacity=128), decode))
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.plan_key(True, "fast", a, shape)
    # A key is pure: a backend that cannot run here (no GPU) still has one; the call reports it.
    assert ops.plan_key(True, "pallas", None, shape) != ops.plan_key(True, "pallas", None, shape, interpret=True)


def test_forward_only_plans_price_the_forward_alone(monkeypatch):
    """`forward_only` (inference: no backward to price): "auto" runs the sparse forward up to the
    forward model's crossover, where the training plan, pricing forward + backward, stays dense."""
    from twell_jax.ops import pallas_forward

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    shape = (8192, 2048, 5632, 2)
    # The forward model's margin: sparse while its time is <= SAFETY x dense, so below the bare crossover.
    ks = np.arange(1.0, 60.0, 0.5)
    edge = max(k for k in ks if planner.choose_forward_path(*shape[:3], k, True))
    assert edge < planner.crossover_active_per_token(*shape[:3])
    assert not planner.choose_forward_path(*shape[:3], edge + 0.5, True)
    train = ops.SparseFFNConfig(expected_active_per_token=edge)
    infer = dataclasses.replace(train, forward_only=True)
    assert ops.auto_decision(True, train, shape) == ("dense", "dense")  # forward + backward priced: dense here
    assert ops.auto_decision(True, infer, shape) == ("pallas", "dense")
    assert ops.plan_key(True, "auto", infer, shape) != ops.plan_key(True, "auto", train, shape)
    above = dataclasses.replace(infer, expected_active_per_token=edge + 0.5)
    assert ops.auto_decision(True, above, shape) == ("dense", "dense")
    assert ops.auto_decision(True, dataclasses.replace(above, auto_max_active=edge + 1), shape) == ("pallas", "dense")
    assert ops.plan_key(True, "auto", above, shape) == ops.plan_key(True, "auto", train, shape)  # the dense backend
    assert ops.auto_decision(True, dataclasses.replace(infer, check_finite=False), (1, *shape[1:])) == (
        "decode", "dense")  # decode sizes keep the decode path
    with pytest.raises(ValueError, match="forward_only must be a bool"):
        ops.SparseFFNConfig(forward_only=1)


def test_cost_models_are_keyed_by_device_kind_with_a_fallback(monkeypatch):
    assert planner.device_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert planner.device_kind("NVIDIA H200") == "H200"
    assert planner.device_kind("NVIDIA A100-SXM4-80GB") == planner.FALLBACK_KIND
    assert planner.device_kind("cpu") == planner.FALLBACK_KIND
    for costs in planner.COST_MODELS.values():
        for part in (costs.forward, costs.backward, costs.decode):
            assert part.fit.date and part.fit.gpu and part.fit.command
    # A kind with its own models gets them; any other kind the fallback's. A second entry whose
    # sparse backward costs 1000x more makes the two lookups give different plans.
    args = (16384, 2048, 5632, 5.0, True)  # a trained layer's activity: the H100 models plan it sparse
    slow = dataclasses.replace(planner.H100, backward=dataclasses.replace(planner.H100.backward, bwd_fixed_ms=1e3))
    monkeypatch.setitem(planner.COST_MODELS, "B200", slow)
    assert planner.device_kind("NVIDIA B200") == "B200" and planner.costs("NVIDIA B200") is slow
    assert planner.choose_training_path(*args, kind="NVIDIA H100 80GB HBM3")[1] is True  # sparse backward
    assert planner.choose_training_path(*args, kind="NVIDIA B200")[1] is False
    assert (planner.choose_training_path(*args, kind="some future GPU")
            == planner.choose_training_path(*args, kind="NVIDIA H100 80GB HBM3"))


def test_one_tail_rule_for_telemetry_reference_and_pallas():
    """TailPolicy's token tail of a pack equals that of its per-token counts when no tile
    overflows; its shares count what the reference's aux counts."""
    config = ops.SparseFFNConfig(tile=8, slots=4, ell_width=5, transpose_ell_width=3, neuron_counts=True)
    policy = ops.TailPolicy(config)
    counts = jnp.asarray([[1, 2], [4, 2], [3, 3], [0, 0], [5, 0]], jnp.int32)  # row 4 overflows a tile
    np.testing.assert_array_equal(policy.pack_token_tail(counts), [False, True, True, False, True])
    np.testing.assert_array_equal(policy.token_tail(jnp.sum(counts, axis=1)), [False, True, True, False, False])
    # Thresholds that split both tails (10-21 actives per token, 3-10 entries per neuron here): 8 of
    # the 13 tokens and 16 of the 29 neurons are in a tail, so a rule off by one side would differ.
    config = dataclasses.replace(config, ell_width=14, transpose_ell_width=6)
    policy = ops.TailPolicy(config)
    x, ws = _inputs(m=13, d=16, h=29, seed=3)
    _, aux = ops.gated_ffn(x, *ws, backend="reference", config=config)
    assert (int(aux["backward_tail_rows"]), int(aux["backward_hot_neurons"])) == (8, 16)
    shares = policy.shares(aux["token_active_count"], aux["neuron_active_count"])
    assert float(shares["token_tail_share"]) * 13 == pytest.approx(int(aux["backward_tail_rows"]))
    assert float(shares["hot_neuron_share"]) * 29 == pytest.approx(int(aux["backward_hot_neurons"]))


def test_each_builtin_states_where_it_runs_and_its_cost():
    shape, config = (16384, 2048, 5632, 2), ops.SparseFFNConfig(expected_active_per_token=29.0)
    assert backends.get("dense").unavailable(False) is None and backends.get("reference").unavailable(False) is None
    assert backends.get("pallas").unavailable(True) is None  # the interpreter runs anywhere
    assert "needs a GPU" in backends.get("pallas").unavailable(False)  # this CPU
    assert backends.get("dense").cost(shape, config, True) == planner.dense_times_ms(16384, 2048, 5632, True)
    assert backends.get("pallas").cost(shape, config, True) == planner.sparse_times_ms(16384, 2048, 5632, 29.0, True,
                                                                                      config=config)
    assert backends.get("decode").cost((1, 2048, 5632, 2), config, True)[0] == pytest.approx(
        planner.decode_time_us(1, 2048, 5632, 29.0) / 1e3)
    assert backends.get("reference").cost is None  # the oracle: never planned
    with pytest.raises(RuntimeError, match="backend='pallas' needs a GPU"):
        ops.gated_ffn(*_inputs()[:1], *_inputs()[1], backend="pallas")


@pytest.mark.parametrize("interpret", [False, True])
def test_pallas_names_a_failed_kernel_import_not_a_missing_gpu(monkeypatch, interpret):
    """As before the registry: a jax build whose Pallas cannot be imported is reported as such
    (backend='pallas' with or without interpret), not as 'needs a GPU' or a bare ImportError."""
    import sys

    from twell_jax import ops as ops_package

    monkeypatch.delattr(ops_package, "pallas_forward", raising=False)
    monkeypatch.setitem(sys.modules, "twell_jax.ops.pallas_forward", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match="backend='pallas' needs twell_jax.ops.pallas_forward, which failed to import"):
        ops.gated_ffn(*_inputs()[:1], *_inputs()[1], backend="pallas", interpret=interpret)
