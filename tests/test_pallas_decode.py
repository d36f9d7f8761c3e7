"""Decode-size sparse FFN: pallas_kernels/twell_decode.py (interpret mode) and its glue
twell_jax/ops/pallas_decode.py, against the plain-jnp references and the dense formula."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.twell_decode import (DecodeBlockSizes, compact_active, compact_active_reference,
                                         sparse_decode_ffn, sparse_decode_ffn_reference)
from twell_jax import ops
from twell_jax.ops import pallas_decode, planner
from oracles import TOL as TOL_DENSE, dense_forward as dense, rel_err, sparse_gate_inputs

# rel. error (Frobenius) vs the kernel's own reference (TOL_DENSE: vs the fp32 HIGHEST dense
# formula). bf16 rounds h once (like the op's dense backend): a rounding flip of h moves y by ~1
# bf16 ulp.
TOL_REF = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3}
SMALL = DecodeBlockSizes(block_n=16, block_k=16, block_h=16, block_d=16, max_block_m=16)


def make_inputs(dtype, m=8, d=45, h=150, pattern="sparse", seed=0):
    return sparse_gate_inputs(dtype, m, d, h, pattern=pattern, seed=seed)


def config(capacity=None, block_sizes=SMALL, expected=None):
    return ops.SparseFFNConfig(decode_capacity=capacity, decode_block_sizes=block_sizes,
                               expected_active_per_token=expected)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,density", [(1, 1.0), (7, 0.0), (150, 0.05), (151, 1.0), (257, 0.5)])
def test_compact_active_is_a_stable_partition(h, density):
    rng = np.random.default_rng(h)
    active = rng.random(h) < density
    counts = (active * rng.integers(1, 9, size=h)).astype(np.int32)  # tokens per neuron, as the glue
    order, n = compact_active(jnp.asarray(counts), interpret=True)
    order_ref, n_ref = compact_active_reference(jnp.asarray(active))
    np.testing.assert_array_equal(np.asarray(compact_active(jnp.asarray(active), interpret=True)[0]),
                                  np.asarray(order))
    expected = np.concatenate([np.flatnonzero(active), np.flatnonzero(~active)])
    length = 1 << max(0, (h - 1).bit_length())
    assert order.shape == (length,) and n.shape == (1,) and order.dtype == jnp.int32
    assert int(n[0]) == int(active.sum()) == int(n_ref[0])
    np.testing.assert_array_equal(np.asarray(order)[:h], expected)
    np.testing.assert_array_equal(np.asarray(order)[h:], h - 1)  # padding lanes, clamped
    np.testing.assert_array_equal(np.asarray(order), np.asarray(order_ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m", [1, 3, 20])  # 20 > max_block_m: two token blocks
@pytest.mark.fast_params("20-True-bfloat16", "20-False-float32", "3-True-float32", "1-False-bfloat16")
def test_sparse_decode_ffn_matches_reference(dtype, gated, m):
    x, wg, wu, wd = make_inputs(dtype, m=m, d=37, h=151, seed=m)
    g = jnp.einsum("md,hd->mh", x, wg, preferred_element_type=jnp.float32)
    order, n = compact_active(jnp.any(g > 0, axis=0), interpret=True)
    assert int(n[0]) <= 48  # capacity 48 >= n here; 3 chunks, so some run past n
    w_up = wu if gated else None
    h_k, y_k = sparse_decode_ffn(x, g, order, n, w_up, wd, capacity=48, block_sizes=SMALL,
                                 interpret=True)
    h_r, y_r = sparse_decode_ffn_reference(x, g, order, n, w_up, wd, capacity=48)
    assert h_k.shape == (m, 48) and h_k.dtype == dtype and y_k.shape == x.shape and y_k.dtype == dtype
    assert rel_err(h_k, h_r) <= TOL_REF[dtype] and rel_err(y_k, y_r) <= TOL_REF[dtype]
    assert not np.any(np.asarray(h_k, np.float32)[:, int(n[0]):])  # nothing past the list
    y_d, _, _ = dense(x, wg, w_up, wd)
    assert rel_err(y_k, y_d) <= TOL_DENSE[dtype]


@pytest.mark.parametrize("gated", [True, False])
def test_sparse_decode_ffn_reads_only_the_capacity(gated):
    # Token 0 fires all 151 neurons: n > capacity 32. The kernels must read order[:32] only
    # (the glue then discards this output for the exact dense one).
    x, wg, wu, wd = make_inputs(jnp.float32, m=3, d=37, h=151, pattern="dense_token")
    g = jnp.einsum("md,hd->mh", x, wg, preferred_element_type=jnp.float32)
    order, n = compact_active(jnp.any(g > 0, axis=0), interpret=True)
    assert int(n[0]) == 151
    w_up = wu if gated else None
    h_k, y_k = sparse_decode_ffn(x, g, order, n, w_up, wd, capacity=32, block_sizes=SMALL,
                                 interpret=True)
    h_r, y_r = sparse_decode_ffn_reference(x, g, order, n, w_up, wd, capacity=32)
    assert h_k.shape == (3, 32)
    assert rel_err(h_k, h_r) <= TOL_REF[jnp.float32] and rel_err(y_k, y_r) <= TOL_REF[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_triton_for_cuda(dtype, capsys):
    # The Pallas -> Triton IR lowering runs without a GPU (cross-platform export): every
    # primitive the kernels use (cumsum, scatter store, row gathers, dynamic loops) must have a
    # Triton lowering rule. Compiling the IR to PTX still needs the GPU.
    from jax import export

    def forward(x, w_gate, w_up, w_down):
        g = jnp.einsum("md,hd->mh", x, w_gate, preferred_element_type=jnp.float32)
        order, n = compact_active(jnp.sum(g > 0, axis=0, dtype=jnp.int32), debug=True)
        return sparse_decode_ffn(x, g, order, n, w_up, w_down, capacity=5632, debug=True)

    x = jax.ShapeDtypeStruct((8, 2048), dtype)
    w = jax.ShapeDtypeStruct((5632, 2048), dtype)
    exported = export.export(jax.jit(forward), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(x, w, w, w)
    module = exported.mlir_module()
    for name in ("twell_decode_compact", "twell_decode_hidden", "twell_decode_down"):
        assert name in module
    # debug=True prints each Triton module; MLIR prints an op that fails verification in the
    # generic quoted form. An scf.for with bounds of mixed types did (and failed on the H100).
    printed = capsys.readouterr().out
    assert printed.count("scf.for") >= 2 and '"scf.for"' not in printed


def test_decode_block_sizes_validation():
    with pytest.raises(ValueError, match="block_n"):
        DecodeBlockSizes(block_n=8)
    with pytest.raises(ValueError, match="block_d"):
        DecodeBlockSizes(block_d=48)
    with pytest.raises(ValueError, match="num_warps"):
        DecodeBlockSizes(num_warps=3)
    assert DecodeBlockSizes().block_m(1) == 16 and DecodeBlockSizes().block_m(256) == 64


def test_sparse_decode_ffn_rejects_bad_arguments():
    x, wg, wu, wd = make_inputs(jnp.float32, m=2)
    g = jnp.zeros((2, 150), jnp.float32)
    order, n = jnp.zeros((32,), jnp.int32), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="capacity"):
        sparse_decode_ffn(x, g, order[:20], n, wu, wd, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="capacity"):
        sparse_decode_ffn(x, g, order, n, wu, wd, capacity=48, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="g_MxH"):
        sparse_decode_ffn(x, g.astype(jnp.bfloat16), order, n, wu, wd, interpret=True)
    with pytest.raises(ValueError, match="w_up_HxD"):
        sparse_decode_ffn(x, g, order, n, wu[:, :5], wd, interpret=True)
    with pytest.raises(ValueError, match="n_active"):
        sparse_decode_ffn(x, g, order, n[0], wu, wd, interpret=True)


# ---------------------------------------------------------------------------------------------
# glue
# ---------------------------------------------------------------------------------------------

def run(implementation, gated, x, wg, wu, wd, cfg):
    if gated:
        return pallas_decode.decode_gated_ffn_forward(x, wg, wu, wd, config=cfg,
                                                       implementation=implementation, interpret=True)
    return pallas_decode.decode_ffn_forward(x, wg, wd, config=cfg, implementation=implementation,
                                             interpret=True)


@pytest.mark.parametrize("implementation", ["triton", "xla"])
@pytest.mark.parametrize("dtype,m,pattern,capacity,fallback", [
    (jnp.float32, 1, "sparse", None, 0),
    (jnp.bfloat16, 3, "sparse", 16, 0),
    (jnp.bfloat16, 8, "all_zero", None, 0),
    (jnp.float32, 8, "one_hot", 16, 0),
    (jnp.float32, 3, "dense_token", None, 0),  # every neuron active: default capacity covers H
    (jnp.bfloat16, 3, "dense_token", 32, 1),  # 150 actives > capacity 32: exact dense fallback
])
@pytest.mark.parametrize("gated", [True, False])
def test_decode_forward_matches_dense(implementation, dtype, m, pattern, capacity, fallback, gated):
    x, wg, wu, wd = make_inputs(dtype, m=m, pattern=pattern, seed=m)
    if implementation == "xla" and capacity is None and pattern == "dense_token":
        capacity = 150  # the xla default capacity is sized for sparse calls: cover H explicitly
    y, aux = run(implementation, gated, x, wg, wu, wd, config(capacity))
    y_ref, l1_ref, l0_ref = dense(x, wg, wu if gated else None, wd)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, y_ref) <= TOL_DENSE[dtype]
    if pattern == "all_zero":
        assert not np.any(np.asarray(y, np.float32)) and float(aux["l1"]) == 0.0
    assert float(aux["l1"]) == pytest.approx(float(l1_ref), rel=TOL_DENSE[dtype], abs=1e-6)
    assert float(aux["l0"]) == pytest.approx(float(l0_ref), rel=1e-6 if dtype == jnp.float32 else 2e-2)
    assert int(aux["dense_fallback"]) == fallback
    assert int(aux["tile_overflow"]) == 0 and int(aux["row_overflow"]) == 0
    for key in ("l1", "l0"):
        assert aux[key].dtype == jnp.float32 and aux[key].shape == ()
    for key in ("tile_overflow", "row_overflow", "dense_fallback"):
        assert aux[key].dtype == jnp.int32 and aux[key].shape == ()


@pytest.mark.parametrize("implementation", ["triton", "xla"])
@pytest.mark.parametrize("m,pattern,capacity,fallback", [
    (3, "sparse", None, 0), (8, "all_zero", None, 0), (8, "one_hot", 16, 0),
    (3, "dense_token", 32, 1),  # the counts survive the dense fallback
])
def test_decode_forward_neuron_counts(implementation, m, pattern, capacity, fallback):
    """config.neuron_counts: the per-neuron and per-token counts of gate > 0, from the gate the
    decode path computes (the op's dispatch no longer recomputes it)."""
    x, wg, wu, wd = make_inputs(jnp.float32, m=m, pattern=pattern, seed=m)
    cfg = ops.SparseFFNConfig(decode_capacity=capacity, decode_block_sizes=SMALL, neuron_counts=True)
    _, aux = run(implementation, True, x, wg, wu, wd, cfg)
    active = np.asarray(jnp.einsum("md,hd->mh", x, wg, precision=jax.lax.Precision.HIGHEST)) > 0
    np.testing.assert_array_equal(np.asarray(aux["neuron_active_count"]), active.sum(0))
    np.testing.assert_array_equal(np.asarray(aux["token_active_count"]), active.sum(1))
    assert aux["neuron_active_count"].dtype == jnp.int32 and int(aux["dense_fallback"]) == fallback
    _, aux = run(implementation, False, x[:0], wg, wu, wd, cfg)  # empty call: zero counts
    assert aux["token_active_count"].shape == (0,) and not np.any(np.asarray(aux["neuron_active_count"]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_forward_prime_shapes_and_default_blocks(dtype):
    # Prime D and H, default (GPU) block sizes: D < block_k, H < one list chunk of the xla default.
    x, wg, wu, wd = make_inputs(dtype, m=5, d=37, h=151, seed=3)
    y_ref, _, _ = dense(x, wg, wu, wd)
    for implementation in ("triton", "xla"):
        y, aux = run(implementation, True, x, wg, wu, wd, None)
        assert rel_err(y, y_ref) <= TOL_DENSE[dtype] and int(aux["dense_fallback"]) == 0


def test_decode_forward_is_bitwise_deterministic():
    x, wg, wu, wd = make_inputs(jnp.bfloat16, m=8, seed=5)
    fn = jax.jit(lambda *a: run("triton", True, *a, config())[0])
    y1, y2 = fn(x, wg, wu, wd), fn(x, wg, wu, wd)
    np.testing.assert_array_equal(np.asarray(y1.view(jnp.uint16)), np.asarray(y2.view(jnp.uint16)))


def test_decode_forward_defaults_of_the_op_config():
    x, wg, wu, wd = make_inputs(jnp.bfloat16, m=3, seed=7)
    y_ref, _, _ = dense(x, wg, wu, wd)
    cfg = ops.SparseFFNConfig(expected_active_per_token=2.0)  # decode_* fields left at None
    for implementation in ("triton", "xla"):
        y, aux = jax.jit(lambda *a: pallas_decode.decode_gated_ffn_forward(
            *a, config=cfg, implementation=implementation, interpret=True))(x, wg, wu, wd)
        assert rel_err(y, y_ref) <= TOL_DENSE[jnp.bfloat16] and int(aux["dense_fallback"]) == 0


def test_decode_forward_empty_and_bad_input():
    x, wg, wu, wd = make_inputs(jnp.float32, m=2)
    y, aux = pallas_decode.decode_gated_ffn_forward(x[:0], wg, wu, wd, implementation="xla")
    assert y.shape == (0, x.shape[1]) and float(aux["l0"]) == 0.0
    with pytest.raises(ValueError, match="implementation"):
        pallas_decode.decode_gated_ffn_forward(x, wg, wu, wd, implementation="cuda")
    with pytest.raises(ValueError, match="decode_capacity"):
        ops.SparseFFNConfig(decode_capacity=0)
    with pytest.raises(ValueError, match="decode_block_sizes"):
        ops.SparseFFNConfig(decode_block_sizes=(16, 16))
    with pytest.raises(ValueError, match="config must be"):
        pallas_decode.decode_ffn_forward(x, wg, wd, config={"decode_capacity": 8}, implementation="xla")
    with pytest.raises(ValueError, match="w_up_HxD"):
        pallas_decode.decode_gated_ffn_forward(x, wg, wu.astype(jnp.bfloat16), wd,
                                                implementation="xla")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="interpret=True"):
            pallas_decode.decode_gated_ffn_forward(x, wg, wu, wd)  # triton without a GPU


# ---------------------------------------------------------------------------------------------
# cost model
# ---------------------------------------------------------------------------------------------

def test_dense_cost_model_matches_issue_13_measurements():
    # H100, D 2048, H 5632, bf16, XLA dense (issue 13): tokens per call -> us.
    for m, measured_us in ((1, 35.7), (8, 36.2), (64, 44.7), (256, 66.6)):
        assert planner.dense_time_us(m, 2048, 5632) == pytest.approx(measured_us, rel=0.05)


def test_prefer_decode_path():
    d, h = 2048, 5632
    # Fitted on the H100 (BENCHMARKS.md): the decode path won at 1 and 8 tokens, lost at 64.
    for m in (1, 8):
        assert planner.prefer_decode_path(m, d, h, 29.0, True)
    for m in (64, 256, 1024, 65536):  # the union of 64+ tokens: the gathers cost more than dense
        assert not planner.prefer_decode_path(m, d, h, 29.0, True)
    assert not planner.prefer_decode_path(1, d, h, 2816.0, True)  # half the neurons active
    assert not planner.prefer_decode_path(1, d, h, None, True)  # no hint: caller decides
    # The NaN/Inf pass reads every weight (dense's bytes) plus a cond: measured 0.4x dense.
    assert not planner.prefer_decode_path(1, d, h, 29.0, True, check_finite=True)
    assert planner.expected_union(1, 29.0, h) == pytest.approx(29.0)
    assert planner.expected_union(10**6, 29.0, h) == pytest.approx(h)
    with pytest.raises(ValueError):
        planner.expected_union(1, -1.0, h)


# ---------------------------------------------------------------------------------------------
# benchmark script (tiny shapes, interpret mode; its timings are not checked)
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_ffn_decode_interpret(tmp_path):
    import json

    from twell_jax.bench import ffn_decode as module

    results = module.main(["--interpret", "--out", str(tmp_path)])
    assert [row["m"] for row in results["rows"]] == [1, 8]
    for row in results["rows"]:
        assert not [key for key in row if key.endswith("_error")], row
        for name in ("dense", "decode", "decode_xla", "pallas", "auto"):
            assert row[f"{name}_err"] < 2e-2 and row[f"{name}_us"] > 0
        assert row["decode_aux"]["dense_fallback"] == 0 and row["union"] >= 1
    saved = json.loads((tmp_path / "bench_ffn_decode.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(results["rows"]))
    first_fields = [line.split()[0] for line in (tmp_path / "table_decode.txt").read_text().splitlines()
                    if line.strip()]
    assert [f for f in first_fields if f.isdigit()] == ["1", "8"]  # one line per measured row
