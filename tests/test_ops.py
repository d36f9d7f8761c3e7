"""The public FFN op: every CPU backend against the dense formula (forward, aux, gradients with the
L1 term), the exact paths (tails, dense fallback), transformations, meshes, and input checks."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType

from twell_jax import ops
from twell_jax.ops import dispatch
from oracles import TOL, dense_forward, rel_err

L1_COEF = 0.37

CONFIGS = {
    "default": ops.SparseFFNConfig(),
    # Small tiles, slots and widths: tile overflow, token tails and neuron tails all in use, and
    # capacities large enough that nothing falls back.
    "tight": ops.SparseFFNConfig(tile=8, slots=2, ell_width=4, tail_rows=1.0, transpose_ell_width=3,
                                 transpose_tail_rows=1.0),
    # No token tail: any token with more than 2 actives (or a tile overflow) forces the dense path.
    "fallback_fwd": ops.SparseFFNConfig(tile=8, slots=2, ell_width=2, tail_rows=0),
    # The forward stays sparse but the neuron-major transposes have no tail: dense backward.
    "fallback_bwd": ops.SparseFFNConfig(ell_width=64, tail_rows=1.0, transpose_ell_width=1,
                                        transpose_tail_rows=0),
}


def make_inputs(gated: bool, m: int, d: int, h: int, dtype, zero_fraction: float, seed: int,
                adversarial: str = "none"):
    """Random inputs whose activation pattern has about `zero_fraction` zeros.

    x[:, 0] = 1 is a bias column; the activating weight's column 0 is a per-neuron threshold, so
    each pre-activation is N(shift, (d-1)/d) and is positive with probability 1 - zero_fraction.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    x[:, 0] = 1.0
    weights = [(rng.standard_normal((h, d)) / np.sqrt(d)).astype(np.float32) for _ in range(3 if gated else 2)]
    spread = np.sqrt((d - 1) / d) if d > 1 else 1e-3
    if zero_fraction <= 0.0:
        shift = 50.0
    elif zero_fraction >= 1.0:
        shift = -50.0
    else:
        # P(shift + N(0, spread^2) <= 0) = zero_fraction
        shift = -statistics.NormalDist().inv_cdf(zero_fraction) * spread
    weights[0][:, 0] = shift
    if adversarial == "zero_and_dense_rows":
        x[::7] = 0.0  # all-zero tokens: nothing active
        assert abs(shift) > 0.1, "dense rows need a non-zero threshold to flip"
        x[3::11, 0] = 100.0 / shift  # pre-activation about 100: every neuron active
    elif adversarial == "hot_neuron":
        weights[0][5 % h, 0] = 50.0  # one neuron active in every token
    elif adversarial == "dense_first_tokens":
        x[: max(1, m // 5), 0] = 0.0  # threshold off: about half the neurons fire
    return jnp.asarray(x, dtype), tuple(jnp.asarray(w, dtype) for w in weights)


def dense_formula(gated: bool, x, weights):
    """The op's math in f32 (HIGHEST precision) from (possibly bf16) inputs: (y, l1, l0, g)."""
    return dense_forward(x, weights[0], weights[1] if gated else None, weights[-1], with_pre=True)


def loss_of(y, l1, cot):
    return jnp.sum(y.astype(jnp.float32) * cot) + L1_COEF * l1


@functools.partial(jax.jit, static_argnums=(0,))
def oracle(gated, x, weights, cot):
    def loss(x_, w_):
        y, l1, _, _ = dense_formula(gated, x_, w_)
        return loss_of(y, l1, cot)

    y, l1, l0, g = dense_formula(gated, x, weights)
    return y, l1, l0, g, jax.grad(loss, argnums=(0, 1))(x.astype(jnp.float32), weights)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def run_op(gated, backend, config, x, weights, cot):
    fn = ops.gated_ffn if gated else ops.ffn

    def loss(x_, w_):
        y, aux = fn(x_, *w_, backend=backend, config=config)
        return loss_of(y, aux["l1"], cot), (y, aux)

    (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights)
    return y, aux, grads


def expected_counts(g: np.ndarray, config: ops.SparseFFNConfig) -> dict[str, int]:
    """tile_overflow, row_overflow and dense_fallback from the activation pattern (the spec)."""
    m, h = g.shape
    active = g > 0
    n_tiles = -(-h // config.tile)
    padded = np.zeros((m, n_tiles * config.tile), bool)
    padded[:, :h] = active
    tile_counts = padded.reshape(m, n_tiles, config.tile).sum(-1)
    row_nnz, col_nnz = active.sum(1), active.sum(0)
    tile_rows = (tile_counts > config.slots).any(1)
    cap = config.tail_capacity(m)
    fwd_fallback = np.sum((row_nnz > config.ell_width) | tile_rows) > cap
    bwd_fallback = (np.sum(row_nnz > config.ell_width) > cap
                    or np.sum(col_nnz > config.hot_threshold(m)) > config.transpose_tail_capacity(h))
    return {"tile_overflow": int(np.sum(tile_counts > config.slots)),
            "row_overflow": int(np.sum(row_nnz > config.ell_width)),
            "dense_fallback": int(fwd_fallback or bwd_fallback)}


def check_against_oracle(gated, backend, config_name, m, d, h, dtype, zero_fraction, seed=0,
                         adversarial="none"):
    config = CONFIGS[config_name]
    x, weights = make_inputs(gated, m, d, h, dtype, zero_fraction, seed, adversarial)
    cot = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((m, d)), jnp.float32)
    y, aux, (dx, dws) = run_op(gated, backend, config, x, weights, cot)
    y_ref, l1_ref, l0_ref, g, (dx_ref, dws_ref) = oracle(gated, x, weights, cot)
    tol = TOL[dtype]
    assert y.shape == x.shape and y.dtype == dtype
    assert set(aux) == set(ops.AUX_KEYS)
    assert rel_err(y, y_ref) < tol, rel_err(y, y_ref)
    np.testing.assert_allclose(float(aux["l1"]), float(l1_ref), rtol=tol, atol=1e-6)
    np.testing.assert_allclose(float(aux["l0"]), float(l0_ref), rtol=1e-6)
    assert aux["l1"].dtype == jnp.float32 and aux["l0"].dtype == jnp.float32
    names = ("w_gate", "w_up", "w_down") if gated else ("w_up", "w_down")
    for name, grad, ref in zip(("x",) + names, (dx,) + tuple(dws), (dx_ref,) + tuple(dws_ref)):
        assert grad.dtype == dtype, name
        assert rel_err(grad, ref) < tol, (name, rel_err(grad, ref))
    if backend == "reference":
        expected = expected_counts(np.asarray(g), config)
        assert {k: int(aux[k]) for k in expected} == expected
    return aux


# gated, config, M, D, H, dtype, zero fraction, adversarial
# (gated, "tight", 37, 19, 45, float32, 0.5, "none"): test_tight_config_really_uses_the_overflow_paths.
CASES = [
    (True, "default", 1, 7, 300, jnp.float32, 0.99, "none"),
    (True, "tight", 101, 33, 70, jnp.bfloat16, 0.9, "zero_and_dense_rows"),
    (True, "tight", 64, 24, 37, jnp.float32, 0.0, "none"),
    (True, "default", 29, 16, 50, jnp.float32, 1.0, "none"),
    (True, "default", 211, 8, 130, jnp.float32, 0.999, "dense_first_tokens"),
    (False, "tight", 53, 11, 40, jnp.float32, 0.5, "hot_neuron"),
    (False, "default", 30, 20, 260, jnp.bfloat16, 0.99, "dense_first_tokens"),
]


@pytest.mark.parametrize("gated, config_name, m, d, h, dtype, zero_fraction, adversarial", CASES)
def test_reference_matches_dense_formula(gated, config_name, m, d, h, dtype, zero_fraction, adversarial):
    # dense_fallback is checked against the capacity rule inside (the dense-first-tokens case
    # with the default config overflows its tail and must fall back).
    check_against_oracle(gated, "reference", config_name, m, d, h, dtype, zero_fraction,
                         adversarial=adversarial)


def test_tight_config_really_uses_the_overflow_paths():
    """The reference against the dense formula with the "tight" config (the first of CASES'
    family), which must hit tile overflow and row overflow without falling back."""
    aux = check_against_oracle(True, "reference", "tight", 37, 19, 45, jnp.float32, 0.5)
    assert int(aux["tile_overflow"]) > 0 and int(aux["row_overflow"]) > 0
    assert int(aux["dense_fallback"]) == 0


@pytest.mark.parametrize("gated, config_name", [(True, "fallback_fwd"), (False, "fallback_fwd"),
                                                (True, "fallback_bwd")])
def test_capacity_overflow_falls_back_to_the_exact_dense_path(gated, config_name):
    aux = check_against_oracle(gated, "reference", config_name, 40, 12, 33, jnp.float32, 0.7)
    assert int(aux["dense_fallback"]) == 1


@settings(max_examples=2, deadline=None, derandomize=True)
@given(gated=st.booleans(), m=st.sampled_from([2, 13, 97]), d=st.sampled_from([5, 24]),
       h=st.sampled_from([11, 70]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       zero_fraction=st.sampled_from([0.0, 0.5, 0.99, 0.999, 1.0]), seed=st.integers(0, 1000))
def test_reference_random_shapes(gated, m, d, h, dtype, zero_fraction, seed):
    check_against_oracle(gated, "reference", "tight", m, d, h, dtype, zero_fraction, seed=seed)


@pytest.mark.parametrize("backend", ["dense", "auto"])
@pytest.mark.parametrize("gated", [True, False])
def test_dense_and_auto_backends(backend, gated):
    # On this CPU machine "auto" has no GPU and must take the dense backend.
    aux = check_against_oracle(gated, backend, "default", 23, 9, 31, jnp.float32, 0.5)
    assert [int(aux[k]) for k in ("tile_overflow", "row_overflow", "dense_fallback")] == [0, 0, 0]


def test_reference_is_deterministic():
    x, weights = make_inputs(True, 37, 19, 45, jnp.float32, 0.5, seed=4)
    cot = jnp.ones((37, 19), jnp.float32)
    first = run_op(True, "reference", CONFIGS["tight"], x, weights, cot)
    again = run_op(True, "reference", CONFIGS["tight"], x, weights, cot)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batch_dims_vmap_and_checkpoint():
    config = CONFIGS["tight"]
    x, weights = make_inputs(True, 24, 10, 21, jnp.float32, 0.6, seed=2)
    x_3d = x.reshape(3, 8, 10)

    def call(x_):
        return ops.gated_ffn(x_, *weights, backend="reference", config=config)

    y_3d, _ = jax.jit(call)(x_3d)
    y_flat, aux_flat = jax.jit(call)(x)
    assert y_3d.shape == (3, 8, 10)
    np.testing.assert_allclose(y_3d.reshape(24, 10), y_flat, rtol=1e-6, atol=1e-6)

    y_vmap, aux_vmap = jax.jit(jax.vmap(call))(x_3d)
    call_jit = jax.jit(call)
    for i in range(3):
        y_i, aux_i = call_jit(x_3d[i])
        np.testing.assert_allclose(y_vmap[i], y_i, rtol=1e-6, atol=1e-6)
        for key in ops.AUX_KEYS:
            np.testing.assert_allclose(aux_vmap[key][i], aux_i[key], rtol=1e-6)

    def loss(ws):
        y, aux = ops.gated_ffn(x, *ws, backend="reference", config=config)
        return jnp.sum(y ** 2) + L1_COEF * aux["l1"]

    plain = jax.jit(jax.grad(loss))(weights)
    remat = jax.jit(jax.grad(jax.checkpoint(loss)))(weights)
    for a, b in zip(plain, remat):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n_devices", [1, 2, 8])
def test_data_parallel_mesh_matches_unsharded(n_devices, monkeypatch):
    assert len(jax.devices()) >= 8, "tests/conftest.py must simulate 8 CPU devices"
    config = CONFIGS["tight"]
    gated = True
    x, weights = make_inputs(gated, 13, 9, 20, jnp.float32, 0.6, seed=5)  # 13 tokens: padding
    cot = jnp.asarray(np.random.default_rng(6).standard_normal((13, 9)), jnp.float32)
    y, aux, grads = run_op(gated, "reference", config, x, weights, cot)
    shard_counts = []
    original = dispatch._sharded_call
    monkeypatch.setattr(dispatch, "_sharded_call", lambda *a: shard_counts.append(a[-1]) or original(*a))
    mesh = jax.make_mesh((n_devices,), ("data",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n_devices])
    with jax.set_mesh(mesh):  # the mesh is part of jit's cache key: this traces afresh
        y_s, aux_s, grads_s = run_op(gated, "reference", config, x, weights, cot)
    assert shard_counts == ([n_devices] if n_devices > 1 else [])
    np.testing.assert_allclose(y_s, y, rtol=1e-5, atol=1e-6)
    for key in ("l1", "l0"):
        np.testing.assert_allclose(aux_s[key], aux[key], rtol=1e-6)
    for key in ("tile_overflow", "row_overflow", "dense_fallback"):
        assert int(aux_s[key]) == int(aux[key]), key
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads)):
        assert rel_err(a, b) < 1e-5


def test_empty_batch():
    x = jnp.zeros((0, 8), jnp.float32)
    _, weights = make_inputs(True, 4, 8, 16, jnp.float32, 0.5, seed=0)
    y, aux = ops.gated_ffn(x, *weights, backend="reference")
    assert y.shape == (0, 8) and float(aux["l1"]) == 0.0


@pytest.mark.parametrize("change, match", [
    (dict(backend="sparse"), "backend"),
    (dict(x=jnp.ones((4, 8), jnp.float16)), "x must be float32 or bfloat16"),
    (dict(x=jnp.ones((4, 8), jnp.int32)), "x must be float32 or bfloat16"),
    (dict(x=jnp.ones((4, 9))), "w_gate must be \\[H, D=9\\]"),
    (dict(w_up=jnp.ones((16, 8), jnp.bfloat16)), "w_up must have x's dtype"),
    (dict(w_down=jnp.ones((15, 8))), "w_down has H=15"),
    (dict(w_gate=jnp.ones((16, 8, 1))), "w_gate must be a 2-D"),
    (dict(config={"tile": 8}), "config must be a SparseFFNConfig"),
    (dict(interpret="yes"), "interpret"),
])
def test_bad_input_raises_value_error(change, match):
    args = dict(x=jnp.ones((4, 8)), w_gate=jnp.ones((16, 8)), w_up=jnp.ones((16, 8)),
                w_down=jnp.ones((16, 8)), backend="reference", config=None, interpret=False)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ops.gated_ffn(args.pop("x"), args.pop("w_gate"), args.pop("w_up"), args.pop("w_down"), **args)


def test_ffn_validates_too():
    with pytest.raises(ValueError, match="w_down must be \\[H, D=8\\]"):
        ops.ffn(jnp.ones((4, 8)), jnp.ones((16, 8)), jnp.ones((16, 7)), backend="dense")


def test_hot_threshold_is_tokens_or_a_fraction_of_them():
    """The neuron-major ELL width: an int as given; a fraction of the call's tokens, rounded up,
    at least HOT_THRESHOLD_FLOOR (the default 1/64: 256 at M 16384, 1024 at 65536)."""
    from twell_jax.ops.config import HOT_THRESHOLD_FLOOR

    assert ops.SparseFFNConfig(transpose_ell_width=40).hot_threshold(16384) == 40
    default = ops.SparseFFNConfig()
    assert [default.hot_threshold(m) for m in (16384, 65536, 16385)] == [256, 1024, 257]
    assert default.hot_threshold(6) == default.hot_threshold(2048) == HOT_THRESHOLD_FLOOR == 32
    assert ops.SparseFFNConfig(transpose_ell_width=0.5).hot_threshold(101) == 51


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile=0), "tile"), (dict(slots=300), "slots"), (dict(ell_width=0), "ell_width"),
    (dict(tail_rows=1.5), "tail_rows"), (dict(tail_rows=-1), "tail_rows"),
    (dict(transpose_tail_rows="all"), "transpose_tail_rows"), (dict(transpose_ell_width=True), "transpose_ell_width"),
    (dict(transpose_ell_width=0), "transpose_ell_width"), (dict(transpose_ell_width=0.0), "transpose_ell_width"),
    (dict(transpose_ell_width=1.5), "transpose_ell_width"),
    (dict(data_axis=3), "data_axis"), (dict(overflow_rows=0), "overflow_rows"),
    (dict(auto_max_active=-1.0), "auto_max_active"), (dict(auto_max_active=True), "auto_max_active"),
    (dict(expected_active_per_token=-0.5), "expected_active_per_token"),
    (dict(expected_active_per_token=True), "expected_active_per_token"),
    (dict(expected_active_per_token=float("nan")), "expected_active_per_token"),
    (dict(auto_sample_rows=0), "auto_sample_rows"),
])
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.SparseFFNConfig(**kwargs)


def test_config_capacities():
    config = ops.SparseFFNConfig(tail_rows=0.1, transpose_tail_rows=7)
    assert config.tail_capacity(101) == 11 and config.tail_capacity(0) == 0
    assert config.transpose_tail_capacity(100) == 7 and config.transpose_tail_capacity(5) == 5
    assert hash(config) == hash(ops.SparseFFNConfig(tail_rows=0.1, transpose_tail_rows=7))


def test_inside_a_caller_shard_map_the_op_runs_locally():
    """A caller that already shard_maps over "data" gets the per-shard op (no nested shard_map)."""
    config = CONFIGS["tight"]
    x, weights = make_inputs(True, 16, 9, 20, jnp.float32, 0.6, seed=7)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    spec = jax.sharding.PartitionSpec

    def local(x_loc):
        y, _ = ops.gated_ffn(x_loc, *weights, backend="reference", config=config)
        return y

    with jax.set_mesh(mesh):
        y = jax.jit(jax.shard_map(local, in_specs=spec("data"), out_specs=spec("data")))(x)
    y_ref, _ = ops.gated_ffn(x, *weights, backend="reference", config=config)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)


COUNTS_CASES = [  # backend, config, gated, M, D, H, zero fraction, adversarial
    ("dense", "default", True, 23, 9, 31, 0.5, "none"),
    ("dense", "default", False, 30, 8, 40, 0.0, "none"),
    ("reference", "tight", True, 101, 33, 70, 0.9, "zero_and_dense_rows"),
    ("reference", "tight", False, 53, 11, 40, 0.5, "hot_neuron"),
    ("reference", "fallback_fwd", True, 40, 12, 33, 0.7, "none"),  # the dense fallback path
    ("reference", "default", True, 29, 16, 50, 1.0, "none"),  # all zero
]


@pytest.mark.parametrize("backend, config_name, gated, m, d, h, zero_fraction, adversarial", COUNTS_CASES)
def test_neuron_counts_from_the_op(backend, config_name, gated, m, d, h, zero_fraction, adversarial):
    """config.neuron_counts adds exact per-neuron and per-token active counts (gate > 0), with the
    rest of the op unchanged."""
    config = dataclasses.replace(CONFIGS[config_name], neuron_counts=True)
    x, weights = make_inputs(gated, m, d, h, jnp.float32, zero_fraction, seed=3, adversarial=adversarial)
    fn = ops.gated_ffn if gated else ops.ffn
    x_3d = x.reshape(1, m, d)
    y, aux = jax.jit(lambda x_, w_: fn(x_, *w_, backend=backend, config=config))(x_3d, weights)
    y_plain, aux_plain = jax.jit(lambda x_, w_: fn(x_, *w_, backend=backend, config=CONFIGS[config_name]))(
        x_3d, weights)
    *_, g = dense_formula(gated, x, weights)
    active = np.asarray(g) > 0
    assert set(aux) == set(ops.AUX_KEYS) | set(ops.COUNT_KEYS) and set(aux_plain) == set(ops.AUX_KEYS)
    assert aux["neuron_active_count"].shape == (h,) and aux["token_active_count"].shape == (1, m)
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), active.sum(0))
    np.testing.assert_array_equal(np.asarray(aux["token_active_count"])[0], active.sum(1))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_plain))
    for key in ops.AUX_KEYS:
        np.testing.assert_array_equal(np.asarray(aux[key]), np.asarray(aux_plain[key]))


@pytest.mark.parametrize("n_devices", [1, 8])
def test_neuron_counts_under_a_data_mesh(n_devices):
    config = dataclasses.replace(CONFIGS["tight"], neuron_counts=True)
    x, weights = make_inputs(True, 13, 9, 20, jnp.float32, 0.6, seed=5)  # 13 tokens: padding
    call = jax.jit(lambda x_, w_: ops.gated_ffn(x_, *w_, backend="reference", config=config))
    mesh = jax.make_mesh((n_devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n_devices])
    with jax.set_mesh(mesh):
        _, aux = call(x, weights)
    active = np.asarray(dense_formula(True, x, weights)[3]) > 0
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), active.sum(0))
    np.testing.assert_array_equal(np.asarray(aux["token_active_count"]), active.sum(1))


def test_neuron_counts_flag_is_validated():
    with pytest.raises(ValueError, match="neuron_counts must be a bool"):
        ops.SparseFFNConfig(neuron_counts=1)


@pytest.mark.parametrize("hint, sparse_chosen", [(None, None), (1.0, True), (1000.0, False)])
def test_auto_on_a_gpu_decides_outside_the_custom_vjp(hint, sparse_chosen, monkeypatch):
    """"auto" as it runs on a GPU (simulated: Pallas in interpret mode): forward, aux and gradients
    match the oracle on either path; a dense decision at trace time is exactly the "dense" backend
    (plain autodiff, no Pallas call), a sparse one is the Pallas forward + dense backward, and
    without a hint both are compiled behind a cond on the sampled active count."""
    pytest.importorskip("twell_jax.pallas_kernels.twell_ffn")
    from twell_jax.ops import pallas_forward, planner

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    if hint is not None:
        # The training cost model at these toy shapes always says dense (launch costs dominate):
        # stand in a decision that follows the hint, as the H100-fitted model does at M 16384.
        monkeypatch.setattr(planner, "choose_training_path",
                            lambda m, d, h, k, gated, **_: (k < 8.0, False))
    config = ops.SparseFFNConfig(tile=16, slots=4, auto_max_active=8.0, expected_active_per_token=hint,
                                 neuron_counts=True)
    x, weights = make_inputs(True, 13, 16, 40, jnp.float32, 0.9, seed=1)  # ~4 actives per token
    cot = jnp.asarray(np.random.default_rng(2).standard_normal((13, 16)), jnp.float32)

    def loss(x_, w_):
        y, aux = ops.gated_ffn(x_, *w_, backend="auto", config=config, interpret=True)
        return loss_of(y, aux["l1"], cot), (y, aux)

    grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (y, aux)), grads = grad_fn(x, weights)
    y_ref, l1_ref, l0_ref, g, grads_ref = oracle(True, x, weights, cot)
    assert rel_err(y, y_ref) < 1e-5 and float(aux["l0"]) == pytest.approx(float(l0_ref))
    np.testing.assert_allclose(float(aux["l1"]), float(l1_ref), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), np.sum(np.asarray(g) > 0, axis=0))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert rel_err(a, b) < 1e-5
    jaxpr = str(jax.make_jaxpr(loss)(x, weights))
    if sparse_chosen is None:
        assert "cond[" in jaxpr and "pallas_call" in jaxpr and int(aux["dense_fallback"]) == 0
    else:
        assert ("pallas_call" in jaxpr) == sparse_chosen and ("custom_vjp_call" in jaxpr) == sparse_chosen
        assert int(aux["dense_fallback"]) == (not sparse_chosen)


def test_check_finite_off_builds_no_nan_cond():
    """check_finite=False: neither the forward nor the backward branches on the NaN flag (the
    sparse paths' own capacity conds stay): exactly two conds fewer under grad."""
    x, weights = make_inputs(True, 13, 16, 40, jnp.float32, 0.7, seed=1)
    cot = jnp.ones((13, 16), jnp.float32)

    def n_conds(check_finite: bool) -> int:
        config = dataclasses.replace(CONFIGS["tight"], check_finite=check_finite)

        def loss(x_, w_):
            y, aux = ops.gated_ffn(x_, *w_, backend="reference", config=config)
            return loss_of(y, aux["l1"], cot)

        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, weights)).count("cond[")

    assert n_conds(True) - n_conds(False) == 2


def test_auto_dense_recompute_keeps_no_activations(monkeypatch):
    """"auto" planning a layer dense with auto_dense_recompute: the dense formula inside the op's
    custom_vjp (same y and gradients as the oracle, aux of a dense call), whose residual is x
    alone (`saved_residuals`: no [M, H] tensor), where plain autodiff keeps the activations."""
    pytest.importorskip("twell_jax.pallas_kernels.twell_bwd_token")
    from twell_jax.ops import pallas_forward, planner

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    monkeypatch.setattr(planner, "choose_training_path", lambda *a, **k: (False, False))
    base = ops.SparseFFNConfig(expected_active_per_token=4.0)
    recompute = dataclasses.replace(base, auto_dense_recompute=True)
    for config in (base, recompute):
        assert ops.auto_decision(True, config, (13, 16, 40, 4)) == ("dense", "dense")
    x, weights = make_inputs(True, 13, 16, 40, jnp.float32, 0.7, seed=1)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal((13, 16)), jnp.float32)

    def loss(x_, w_):
        y, aux = ops.gated_ffn(x_, *w_, backend="auto", config=recompute)
        return loss_of(y, aux["l1"], cot), (y, aux)

    (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights)
    y_ref, _, _, _, grads_ref = oracle(True, x, weights, cot)
    assert rel_err(y, y_ref) < 1e-5 and int(aux["dense_fallback"]) == 1
    assert int(aux["backward_tail_rows"]) == 0 and int(aux["backward_hot_neurons"]) == 0
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert rel_err(a, b) < 1e-5

    def saved(config) -> str:  # jax's listing of the residuals autodiff keeps, one per line
        def layer(x_, w_):
            y, aux = ops.gated_ffn(x_, *w_, backend="auto", config=config)
            return loss_of(y, aux["l1"], cot)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(layer, x, weights)
        return out.getvalue()

    assert "[13,40]" in saved(base)  # plain autodiff keeps [M, H] activations
    kept = saved(recompute)
    assert "[13,16]" in kept and "[13,40]" not in kept


def test_training_plan_with_a_dense_forward(monkeypatch):
    """A training "auto" plan whose forward is dense and backward sparse (Pallas, interpret mode):
    the forward is the dense formula with no NaN cond around it (both branches would be the same);
    y and the gradients match the oracle. (A NaN input under this plan propagates as in dense:
    test_nan_policy.py, test_a_dense_forward_then_the_pallas_backward_propagates_like_dense.)"""
    pytest.importorskip("twell_jax.pallas_kernels.twell_bwd_token")
    from twell_jax.ops import pallas_forward, planner

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    monkeypatch.setattr(planner, "choose_training_path", lambda *a, **k: (False, True))
    config = ops.SparseFFNConfig(tile=16, slots=4, ell_width=8, tail_rows=1.0, transpose_ell_width=4,
                                 transpose_tail_rows=1.0, expected_active_per_token=4.0)
    assert ops.auto_decision(True, config, (13, 16, 40, 4), interpret=True) == ("dense", "pallas")
    x, weights = make_inputs(True, 13, 16, 40, jnp.float32, 0.7, seed=1)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal((13, 16)), jnp.float32)

    def forward(x_, w_):
        return ops.gated_ffn(x_, *w_, backend="auto", config=config, interpret=True)

    def loss(x_, w_):
        y, aux = forward(x_, w_)
        return loss_of(y, aux["l1"], cot), y

    assert "cond[" not in str(jax.make_jaxpr(forward)(x, weights))
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights)
    y_ref, _, _, _, grads_ref = oracle(True, x, weights, cot)
    assert rel_err(y, y_ref) < 1e-5
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert rel_err(a, b) < 1e-5
