"""twell_jax/ops/pallas_forward.py (glue of the Pallas kernels) vs the dense formula, in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.twell_pack import PackBlockSizes
from twell_jax import ops
from twell_jax.ops import pallas_forward, planner
from oracles import TOL, dense_forward as dense, rel_err, sparse_gate_inputs


def config(**kw):
    return ops.SparseFFNConfig(tile=32, slots=4, pack_block_sizes=PackBlockSizes(16, 16, 4, 2), **kw)


def make_inputs(dtype, m=37, d=45, h=150, dense_rows=(), seed=0):
    """~1% of the gate fires: no tile of a normal token overflows; `dense_rows` activate every neuron."""
    return sparse_gate_inputs(dtype, m, d, h, dense_rows=dense_rows, seed=seed)


@pytest.mark.parametrize("dtype,dense_rows,expect_branch", [
    (jnp.float32, (), "sparse"),  # no overflow
    (jnp.bfloat16, (2, 30), "fix_rows"),  # 2 overflowing rows <= overflow_rows=3: gathered + recomputed
    (jnp.float32, (0, 1, 2, 5, 9), "dense"),  # 5 > 3 rows: the whole call falls back to dense
])
def test_gated_forward_matches_dense(dtype, dense_rows, expect_branch):
    x, wg, wu, wd = make_inputs(dtype, dense_rows=dense_rows)
    y, aux = pallas_forward.gated_ffn_forward(x, wg, wu, wd, config(overflow_rows=3), interpret=True)
    y_ref, l1_ref, l0_ref = dense(x, wg, wu, wd)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, y_ref) < TOL[dtype]
    assert abs(float(aux["l1"]) - float(l1_ref)) <= TOL[dtype] * float(l1_ref)
    assert float(aux["l0"]) == pytest.approx(float(l0_ref), rel=1e-6 if dtype == jnp.float32 else 1e-2)
    assert int(aux["row_overflow"]) == len(dense_rows)
    assert (int(aux["tile_overflow"]) > 0) == bool(dense_rows)
    assert int(aux["dense_fallback"]) == (expect_branch == "dense")
    for key in ("l1", "l0"):
        assert aux[key].dtype == jnp.float32 and aux[key].shape == ()
    for key in ("tile_overflow", "row_overflow", "dense_fallback"):
        assert aux[key].dtype == jnp.int32 and aux[key].shape == ()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ffn_and_auto_forward_match_dense(dtype):
    x, w_act, _, wd = make_inputs(dtype, dense_rows=(7,))
    y_ref, l1_ref, _ = dense(x, w_act, None, wd)
    y, aux = pallas_forward.ffn_forward(x, w_act, wd, config(), interpret=True)
    assert rel_err(y, y_ref) < TOL[dtype] and int(aux["row_overflow"]) == 1
    assert float(aux["l1"]) == pytest.approx(float(l1_ref), rel=TOL[dtype])
    # auto: a few actives per token here; a threshold above picks sparse, 0 picks dense. The dense
    # formula runs at JAX's default precision as plain JAX does (TF32 for f32 on a GPU, where it
    # missed 1e-5 against the oracle): compared at full precision.
    for max_active, dense_chosen in ((1000.0, 0), (0.0, 1)):
        with jax.default_matmul_precision("highest"):
            y, aux = pallas_forward.auto_ffn_forward(x, w_act, wd, config(auto_max_active=max_active),
                                                     interpret=True)
        assert rel_err(y, y_ref) < TOL[dtype]
        assert int(aux["dense_fallback"]) == dense_chosen


def test_auto_gated_forward_matches_dense():
    x, wg, wu, wd = make_inputs(jnp.float32)
    y_ref, _, l0_ref = dense(x, wg, wu, wd)
    y, aux = pallas_forward.auto_gated_ffn_forward(x, wg, wu, wd, config(auto_max_active=1000.0),
                                                   interpret=True)
    assert rel_err(y, y_ref) < 1e-5 and int(aux["dense_fallback"]) == 0
    assert float(aux["l0"]) == pytest.approx(float(l0_ref))
    # Default threshold = the cost model's crossover: negative for this tiny shape, so dense.
    assert planner.crossover_active_per_token(37, 45, 150) < 0
    with jax.default_matmul_precision("highest"):  # the dense formula at JAX's default precision (above)
        y, aux = pallas_forward.auto_gated_ffn_forward(x, wg, wu, wd, config(), interpret=True)
    assert rel_err(y, y_ref) < 1e-5 and int(aux["dense_fallback"]) == 1


def HintConfig(expected_active_per_token, auto_max_active=None):
    """The op config carrying a measured active count."""
    return config(expected_active_per_token=expected_active_per_token, auto_max_active=auto_max_active)


@pytest.mark.parametrize("hint,dense_chosen", [(1.0, 0), (5.0, 1)])
def test_auto_with_hint_decides_statically(hint, dense_chosen):
    x, wg, wu, wd = make_inputs(jnp.float32)
    cfg = HintConfig(hint, auto_max_active=3.0)
    with jax.default_matmul_precision("highest"):  # a dense plan: JAX's default precision (above)
        y, aux = pallas_forward.auto_gated_ffn_forward(x, wg, wu, wd, cfg, interpret=True)
    y_ref, l1_ref, l0_ref = dense(x, wg, wu, wd)
    assert rel_err(y, y_ref) < 1e-5 and int(aux["dense_fallback"]) == dense_chosen
    assert float(aux["l0"]) == pytest.approx(float(l0_ref))
    assert float(aux["l1"]) == pytest.approx(float(l1_ref), rel=1e-5)
    # Static: no dense/sparse branch on the device. The only cond left is the sparse path's
    # overflow switch (one lax.switch); without a hint the sample's 2-way cond wraps it.
    def n_conds(c):
        jaxpr = str(jax.make_jaxpr(lambda *a: pallas_forward.auto_gated_ffn_forward(
            *a, c, interpret=True))(x, wg, wu, wd))
        return jaxpr.count(" cond["), "pallas_call" in jaxpr

    assert n_conds(cfg) == ((0, False) if dense_chosen else (1, True))
    assert n_conds(HintConfig(None, auto_max_active=3.0)) == (2, True)
    with pytest.raises(ValueError, match="expected_active_per_token"):
        HintConfig(-1.0)  # validated once, by the op config


def test_the_glue_takes_only_the_typed_op_config():
    x, wg, wu, wd = make_inputs(jnp.float32, m=4, d=8, h=16)
    with pytest.raises(ValueError, match="config must be a twell_jax.ops.SparseFFNConfig"):
        pallas_forward.gated_ffn_forward(x, wg, wu, wd, {"tile": 32}, interpret=True)
    with pytest.raises(ValueError, match="pack_block_sizes must be None or a twell_jax.pallas_kernels.twell_pack.PackBlockSizes"):
        ops.SparseFFNConfig(pack_block_sizes=(16, 16, 4, 2))


def test_calibrate_and_crossover():
    x, wg, _, _ = make_inputs(jnp.float32)
    _, _, l0_ref = dense(x, wg, wg, wg)
    assert pallas_forward.calibrate_active_per_token(x, wg) == pytest.approx(float(l0_ref))
    assert pallas_forward.calibrate_active_per_token(x.reshape(1, 37, 45), wg,
                                                     max_tokens=37) == pytest.approx(float(l0_ref))
    with pytest.raises(ValueError, match="w_gate_HxD"):
        pallas_forward.calibrate_active_per_token(x, wg[:, :3])
    # The paper's shape: sparse pays off below ~50 actives at large M, less at small M.
    k_large = planner.crossover_active_per_token(16384, 2048, 5632)
    k_small = planner.crossover_active_per_token(2048, 2048, 5632)
    assert 40 < k_large < 60 and k_small < 29 < k_large


def test_without_gpu_the_pallas_path_raises_a_clear_error():
    if pallas_forward.available():
        pytest.skip("a GPU is present")
    x, wg, wu, wd = make_inputs(jnp.float32, m=4, d=8, h=16)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*interpret=True"):
        pallas_forward.gated_ffn_forward(x, wg, wu, wd, config(), interpret=False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        pallas_forward.auto_ffn_forward(x, wu, wd, None, interpret=False)


def test_bad_arguments_raise_value_error():
    x, wg, wu, wd = make_inputs(jnp.float32, m=4, d=8, h=16)
    with pytest.raises(ValueError, match="w_up_HxD"):
        pallas_forward.gated_ffn_forward(x, wg, wu[:, :5], wd, config(), interpret=True)
    with pytest.raises(ValueError, match="x_MxD"):
        pallas_forward.ffn_forward(x[0], wu, wd, config(), interpret=True)


@pytest.mark.parametrize("gated", [True, False])
def test_ops_end_to_end_with_pallas_backend(gated):
    x, wg, wu, wd = make_inputs(jnp.float32, dense_rows=(3,))
    x3 = x.reshape(1, 37, 45)
    if gated:
        y, aux = ops.gated_ffn(x3, wg, wu, wd, backend="pallas", config=config(), interpret=True)
        y_ref, _, _ = dense(x, wg, wu, wd)
    else:
        y, aux = ops.ffn(x3, wg, wd, backend="pallas", config=config(), interpret=True)
        y_ref, _, _ = dense(x, wg, None, wd)
    assert y.shape == x3.shape
    assert rel_err(y.reshape(37, 45), y_ref) < 1e-5
    assert int(aux["row_overflow"]) == 1


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dense_rows,max_active", [((), 1000.0), ((2, 30), 1000.0),
                                                   ((0, 1, 2, 5, 9), 1000.0), ((), 0.0)])
def test_neuron_counts_on_every_branch(gated, dense_rows, max_active):
    """Per-neuron / per-token counts: stored slots of clean rows, recomputed overflow rows (fix-up),
    the all-dense fallback and auto's dense branch all give the exact gate > 0 counts."""
    x, wg, wu, wd = make_inputs(jnp.float32, dense_rows=dense_rows)
    cfg = config(overflow_rows=3, neuron_counts=True, auto_max_active=max_active)
    if gated:
        _, aux = pallas_forward.auto_gated_ffn_forward(x, wg, wu, wd, cfg, interpret=True)
    else:
        _, aux = pallas_forward.auto_ffn_forward(x, wg, wd, cfg, interpret=True)
    active = np.asarray(jnp.einsum("md,hd->mh", x, wg, precision=jax.lax.Precision.HIGHEST)) > 0
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), active.sum(0))
    np.testing.assert_array_equal(np.asarray(aux["token_active_count"]), active.sum(1))
    assert int(aux["row_overflow"]) == len(dense_rows) or max_active == 0.0


@pytest.mark.parametrize("overflowing,wide,expect", [
    (2, 6, (1, 0)),  # in the first block (2 rows)
    (5, 6, (1, 0)),  # past the first block, within the wide one: fixed there, no dense fallback
    (7, 6, (1, 1)),  # past both: the whole call recomputed densely
])
def test_overflow_rows_wide_block(overflowing, wide, expect):
    """Rows past `overflow_rows` go to the second block (`overflow_rows_wide`) before the dense fallback;
    exact in every case (the rows' outputs, l1 and the neuron counts)."""
    rows = tuple(range(0, 3 * overflowing, 3))
    x, wg, wu, wd = make_inputs(jnp.float32, dense_rows=rows)
    cfg = config(overflow_rows=2, overflow_rows_wide=wide, neuron_counts=True)
    y, aux = pallas_forward.gated_ffn_forward(x, wg, wu, wd, cfg, interpret=True)
    y_ref, l1_ref, l0_ref = dense(x, wg, wu, wd)
    assert rel_err(y, y_ref) < TOL[jnp.float32]
    assert float(aux["l1"]) == pytest.approx(float(l1_ref), rel=TOL[jnp.float32])
    assert float(aux["l0"]) == pytest.approx(float(l0_ref), rel=1e-6)
    active_MxH = (jnp.einsum("md,hd->mh", x, wg, precision="highest") > 0)
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), np.asarray(active_MxH.sum(0)))
    assert (int(aux["row_overflow"] > 0), int(aux["dense_fallback"])) == expect
    assert int(aux["row_overflow"]) == overflowing


def test_overflow_rows_wide_refusal():
    with pytest.raises(ValueError, match="overflow_rows_wide"):
        ops.SparseFFNConfig(overflow_rows=8, overflow_rows_wide=4)
    with pytest.raises(ValueError, match="overflow_rows_wide"):
        ops.SparseFFNConfig(overflow_rows_wide=0)
