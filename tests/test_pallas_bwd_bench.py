"""experiments/bench_ffn_train.py --dry-run: the benchmark script runs end to end on CPU (Pallas
interpreter, tiny shapes) and its correctness check holds, with --trace (on the CPU: each traced
program's profile says there were no GPU events) and --sweep-blocks (every launch variant's outputs
equal to the default's bit for bit); and its backward pieces call the kernels as the op's backward
does (the kept pattern, padded outputs, tails), giving its gradients bit for bit. It times nothing
that is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from test_ops import make_inputs
from twell_jax import ops
from twell_jax.bench import ffn_train as bench_ffn_train
from twell_jax.ops import pallas_backward
from twell_jax.pallas_kernels.twell_pack import PackBlockSizes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_ffn_train_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # one CPU device is enough
    proc = subprocess.run([sys.executable, "-m", "twell_jax.bench.ffn_train",
                           "--dry-run", "--trace", "--sweep-blocks", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_ffn_train.json").read_text())["rows"]
    assert rows and all("error" not in r for r in rows), rows
    assert [r["kind"] for r in rows] == ["sweep_blocks", "train"]
    sweep, row = rows
    # --sweep-blocks: every launch ran, the default once and marked, all outputs equal bit for bit
    # (the token kernel in one launch instead of two: equal up to the last bits of its sums).
    for kernel, block, blocks in (("token", "block_t", [1, 1, 2]), ("neuron", "block_n", [1, 2])):
        variants = sweep[kernel]
        assert sorted(v["block_sizes"][block] for v in variants) == blocks, variants
        assert sum(v["default"] for v in variants) == 1
        for v in variants:
            one_launch = not v["block_sizes"].get("split", True)
            assert v["ms"] > 0 and (v["max_abs"] < 1e-5 if one_launch else v["equal"] and v["n_diff"] == 0), v
    assert [v["block_sizes"]["split"] for v in sweep["token"]].count(False) == 1
    packs = sweep["pack"]  # the launch order changes no bit of the pack
    assert sorted(v["block_sizes"]["group_m"] for v in packs) == sorted([0, PackBlockSizes().group_m]), packs
    assert sum(v["default"] for v in packs) == 1 and sweep["xla_gate_ms"] > 0
    assert all(v["equal"] and v["n_diff"] == 0 and v["ms"] > 0 for v in packs), packs
    # --trace: the three programs profiled; the CPU has no GPU events, and the profile says so.
    assert set(row["trace"]) == {"xla_bf16", "pallas", "auto"}
    for profile in row["trace"].values():
        assert profile["kernels"] == [] and "no GPU events" in profile["reason"], profile
    table = (tmp_path / "table.txt").read_text()
    assert "--sweep-blocks token kernel" in table and "kernels of pallas" in table
    assert "--sweep-blocks pack kernel" in table and "XLA relu(x W_gate^T)" in table
    assert set(row["ms"]) == {"xla_bf16", "dense", "pallas", "auto"}  # the dry run's (DRY_RUN_SKIPPED)
    # The forward alone, as training runs it (with the residuals) and as inference runs it.
    for key in ("fwd_ms", "infer_ms"):
        assert set(row[key]) == {"xla_bf16", "dense", "pallas", "auto"} and min(row[key].values()) > 0
    assert "forward alone, ms" in table
    for backend, errs in row["errors"].items():  # bf16 gradients within bf16 rounding of xla_bf16
        for name, e in errs.items():
            assert e["rel"] < 3e-2, (backend, name, e)
    assert set(row["piece_ms"]) >= {"token_major", "token_major_recompute", "fused_ffn_ranked",
                                    "transpose", "neuron_major"}
    assert set(row["temp_mb"]) == set(row["ms"])  # compiled memory of every backend it timed
    assert (tmp_path / "table.txt").stat().st_size > 0  # the printed table is saved too


# ---------------------------------------------------------------------------------------------
# The per-piece timings call the kernels as the op's backward does
# ---------------------------------------------------------------------------------------------

PIECES_CONFIG = ops.SparseFFNConfig(
    tile=16, slots=4, ell_width=8, tail_rows=0.5, transpose_ell_width=6, transpose_tail_rows=0.5,
    backward=pallas_backward.BackwardConfig(token_tail_chunk=4, neuron_tail_chunk=4))


def _pieces_inputs():
    """A gated f32 layer whose pattern has a token tail (dense first tokens) and a hot neuron."""
    x, weights = make_inputs(True, 29, 16, 48, jnp.float32, 0.9, seed=5, adversarial="dense_first_tokens")
    w_gate = weights[0].at[7, 0].set(50.0)  # neuron 7 fires on every token: hot
    gy = jnp.asarray(np.random.default_rng(6).standard_normal((29, 16)) / 5, jnp.float32)
    return x, (w_gate, *weights[1:]), gy


def _outside_kernels(jaxpr) -> list:
    """The equations of a jaxpr and of its sub-jaxprs (jit, cond, loops), not inside a kernel."""
    eqns = []
    for eqn in jaxpr.eqns:
        eqns.append(eqn)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    eqns += _outside_kernels(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    eqns += _outside_kernels(sub)
    return eqns


def _kernel_operands(fn, *args) -> tuple[list[list], int]:
    """(the operand dtypes of each Pallas kernel `fn` launches, in order; how many 3-D uint8
    arrays it widens outside its kernels)."""
    eqns = _outside_kernels(jax.make_jaxpr(fn)(*args).jaxpr)
    calls = [[v.aval.dtype for v in eqn.invars] for eqn in eqns if eqn.primitive.name == "pallas_call"]
    widened = sum(eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.uint8
                  and eqn.invars[0].aval.ndim == 3 for eqn in eqns)
    return calls, widened


def test_pieces_call_the_kernels_as_the_ops_backward():
    """bench_ffn_train's backward pieces take what the op's backward gives its kernels: the kept
    pattern as stored (uint8 offsets, int16 counts: the transpose's second pass and the lists read
    it, nothing widens it), the transpose's and the token-major kernel's padded outputs, the hot
    neurons left out and f32 inits with tails, and a neuron-major launch order with no sort; chained
    with the op's own tails they give the op backward's dx and weight gradients bit for bit (and
    so does the token-major piece that recomputes the pattern). The sweep compares the token
    kernel's values at the listed positions, which `listed_positions` finds."""
    x, weights, gy = _pieces_inputs()
    m, d = x.shape
    h = weights[0].shape[0]
    config, bc = PIECES_CONFIG, PIECES_CONFIG.backward
    p = bench_ffn_train.piece_fns(config, True, h)
    bi = bench_ffn_train.backward_inputs(p, x, weights, config)
    w = 8  # next_pow2(ell_width)

    # What the backward reads: the Kept's uint8 offsets and int16 counts.
    kept = bi.kept
    assert kept.offsets.dtype == jnp.uint8 and kept.counts.dtype == jnp.int16
    assert bi.prepared[1].dtype == jnp.uint8 and bi.prepared[2].dtype == jnp.int16
    assert bi.packed_in[1].dtype == jnp.int32  # the pack's, for the forward's first pass
    tail, kernel_counts = p["tail_mask"](kept.counts)  # the tail mask piece: the kept counts
    assert kernel_counts.dtype == jnp.int16
    np.testing.assert_array_equal(kernel_counts, bi.prepared[2])
    np.testing.assert_array_equal(tail, bi.prepared[3])
    hot = np.asarray(ops.TailPolicy(config).hot(bi.lists[1], m))
    assert bi.tails and np.asarray(bi.prepared[3]).any() and hot.any()  # both tails on this pattern
    # The transpose: the first pass on the pack's int32 ids, the second on the kept uint8 offsets
    # and int16 counts; the lists padded (longer than M * W tokens, M rows of dest).
    calls, widened = _kernel_operands(p["transpose"], bi.packed_in, bi.prepared)
    assert len(calls) == 2 and widened == 0, calls
    assert jnp.int32 in calls[0] and jnp.uint8 not in calls[0]
    assert jnp.uint8 in calls[1] and jnp.int16 in calls[1]
    assert bi.lists[2].shape[0] > m * w and bi.lists[3].shape[0] > m
    # The token-major piece: the lists' kernel on the kept pattern, then the kernel; padded values.
    token_args = (x, *weights, gy, bi.prepared, bi.lists, kept, bi.dx_init)
    calls, widened = _kernel_operands(p["token"], *token_args)
    assert widened == 0 and sum(jnp.uint8 in c for c in calls) == 1, calls
    dx_init, inits = pallas_backward.hot_neuron_backward(  # the op's tails, chained as it does
        True, x, gy, weights, bench_ffn_train.l1_scale(m), bi.prepared[3], jnp.asarray(hot),
        config.transpose_tail_capacity(h), bc.neuron_tail_chunk, bc.small_tail_chunk,
        pallas_backward.token_tail_backward(
            True, x, gy, weights, bench_ffn_train.l1_scale(m), bi.prepared[3], config.tail_capacity(m),
            bc.token_tail_chunk, bc.small_tail_chunk,
            (jnp.zeros((m, d), jnp.float32), tuple(jnp.zeros((h, d), jnp.float32) for _ in weights))))
    token_args = token_args[:-1] + (dx_init,)
    dx, values_E = p["token"](*token_args)
    assert all(v.shape[0] > m * w for v in values_E)
    # The neuron-major piece: no sort for its launch order (longest_first_order, not argsort).
    neuron_args = (x, gy, bi.lists, values_E, inits)
    assert not any(e.primitive.name == "sort" for e in _outside_kernels(jax.make_jaxpr(p["neuron"])(*neuron_args).jaxpr))
    grads = p["neuron"](*neuron_args)

    want_dx, want_grads = jax.jit(lambda *a: pallas_backward.backward(
        True, *a, jnp.float32(bench_ffn_train.L1_COEF), config, True, kept,
        lambda: (jnp.full_like(x, jnp.nan), tuple(jnp.full_like(v, jnp.nan) for v in weights))))(
        x, weights, gy)
    for got, want in zip((dx, *grads), (want_dx, *want_grads)):
        assert got.dtype == want.dtype and not np.isnan(np.asarray(want)).any()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    dx_recompute, values_recompute = p["token"](x, *weights, gy, bi.packed_in, bi.lists, None, dx_init)
    np.testing.assert_array_equal(np.asarray(dx_recompute), np.asarray(dx))

    # The positions the token kernel writes: each non-hot neuron's [start, start + count).
    listed = bench_ffn_train.listed_positions(bi.lists, m, config)
    start, count = np.asarray(bi.lists[0]), np.asarray(bi.lists[1])
    want = [p_ for j in range(h) if not hot[j] for p_ in range(start[j], start[j] + count[j])]
    np.testing.assert_array_equal(listed, want)
    assert 0 < len(listed) < count.sum()  # the hot neuron's entries left out
    for a, b in zip(values_E, values_recompute):
        np.testing.assert_array_equal(np.asarray(a)[listed], np.asarray(b)[listed])
