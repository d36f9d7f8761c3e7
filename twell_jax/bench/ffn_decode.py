"""Benchmark of the FFN at decode sizes (1..1024 tokens per call), on one GPU (issue 13's table).

    PYTHONUNBUFFERED=1 python experiments/bench_ffn_decode.py [--out DIR] [--interpret]

D 2048, H 5632, bf16, ~29 active gate neurons per token (the synthetic sparsity of
experiments/bench_ffn.py, whose generator is imported). Variants, each timed as `--calls` (100)
calls inside ONE jit (lax.fori_loop feeding x + 1e-3 y back into the next call, so nothing is
hoisted or cached; `--unroll` (10) calls per loop iteration: see calls_in_one_jit), per-call time = loop time / calls, median of `--repeats` loops, variants
interleaved:

    dense        the XLA dense FFN (bf16 operands, fp32 accumulation): the op's "dense" formula
    plain_jax    relu(x Wg^T) * (x Wu^T) @ Wd in plain jnp, outside the op (the baseline's check)
    decode       twell_jax.ops.pallas_decode.decode_gated_ffn_forward, implementation="triton"
    decode_xla   the same with implementation="xla" (row gathers + small XLA dots)
    pallas       ops.gated_ffn(backend="pallas") (pack + one program per token)
    auto         ops.gated_ffn(backend="auto") with expected_active_per_token = 29
    auto_unchecked  the same with check_finite=False (generation from verified weights)

Every variant is first checked against the dense output (relative error) and the decode path's
aux is recorded. Beside the times: the HBM floors (bytes / 3.35e12 B/s: all three matrices for
dense; W_gate plus the U and W rows of the call's active-neuron union for sparse) and the
decode cost model's predictions (to refit `planner.DecodeCosts`, the H100 entry of
`planner.COST_MODELS`). Prints a short table
last; JSON to --out. `--interpret`: tiny shapes through the Pallas interpreter (a test runs it).
`--sweep`: also time the decode path's launch variants (SWEEP: block sizes, a bounded capacity)
to pick DecodeBlockSizes defaults; e.g. `--sweep --tokens 1,8,64`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from twell_jax.bench import ffn as bench_ffn  # the synthetic-sparsity generator; reads .D / .H
from twell_jax.pallas_kernels.twell_decode import DecodeBlockSizes
from twell_jax.ops import pallas_decode, planner
from twell_jax import ops

HBM_BYTES_PER_S = 3.35e12  # H100 SXM
K_ACTIVE = 29.0


def rel_err(a: jax.Array, b: jax.Array) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


# --sweep: decode-path launch variants (name -> DecodeBlockSizes overrides, capacity per token).
# "cap64m" bounds the active list at 64 per token: smaller grids, but a lax.cond (exact dense
# fallback) enters the program.
SWEEP = {
    "dec_bk256": (dict(block_k=256), None),
    "dec_bk128_s2": (dict(block_k=128, num_stages=2), None),  # the defaults before 2026-11-22
    "dec_bd32": (dict(block_d=32), None),
    "dec_bh16": (dict(block_h=16), None),
    "dec_w8": (dict(num_warps=8), None),
    "dec_cap64m": ({}, 64),
}


def decode_variant(interpret: bool, overrides: dict, capacity_per_token: int | None):
    def fn(x, w_gate, w_up, w_down):
        config = ops.SparseFFNConfig(
            decode_block_sizes=DecodeBlockSizes(**overrides),
            decode_capacity=None if capacity_per_token is None else capacity_per_token * x.shape[0])
        return pallas_decode.decode_gated_ffn_forward(x, w_gate, w_up, w_down, config=config,
                                                       implementation="triton",
                                                       interpret=interpret)[0]
    return fn


def variants(interpret: bool, sweep: bool = False) -> dict:
    """name -> fn(x, w_gate, w_up, w_down) -> y."""
    hint = ops.SparseFFNConfig(expected_active_per_token=K_ACTIVE)
    unchecked = ops.SparseFFNConfig(expected_active_per_token=K_ACTIVE, check_finite=False)
    extra = {name: decode_variant(interpret, *spec) for name, spec in SWEEP.items()} if sweep else {}
    base = {
        "dense": lambda x, g, u, d: ops.gated_ffn(x, g, u, d, backend="dense")[0],
        # Plain JAX of the same shapes, outside the op: shows the op's dense row is a fair baseline.
        "plain_jax": lambda x, g, u, d: (jax.nn.relu(x @ g.T) * (x @ u.T)) @ d,
        "decode": lambda x, g, u, d: pallas_decode.decode_gated_ffn_forward(
            x, g, u, d, implementation="triton", interpret=interpret)[0],
        "decode_xla": lambda x, g, u, d: pallas_decode.decode_gated_ffn_forward(
            x, g, u, d, implementation="xla")[0],
        "pallas": lambda x, g, u, d: ops.gated_ffn(x, g, u, d, backend="pallas",
                                                   interpret=interpret)[0],
        "auto": lambda x, g, u, d: ops.gated_ffn(x, g, u, d, backend="auto", config=hint,
                                                 interpret=interpret)[0],
        # What generation runs: load_run verified the weights once, so no per-call NaN/Inf pass.
        "auto_unchecked": lambda x, g, u, d: ops.gated_ffn(x, g, u, d, backend="auto", config=unchecked,
                                                           interpret=interpret)[0],
    }
    return base | extra


def calls_in_one_jit(fn, calls: int, unroll: int = 1):
    """jit(x, weights) -> x after `calls` dependent calls of fn, `unroll` calls per loop iteration.

    Measured on the H100 (BENCHMARKS.md): 1 or 10 calls per iteration barely changed the
    variants without a lax.cond, and those with one (pallas; auto with its NaN/Inf check) a lot;
    10 is closer to a model step, where the layers' calls run back to back."""
    def loop(x, w_gate, w_up, w_down):
        def body(_, x):
            y = fn(x, w_gate, w_up, w_down)
            return (x + y * 1e-3).astype(x.dtype)  # a true dependency: nothing can be hoisted
        return lax.fori_loop(0, calls, body, x, unroll=unroll)
    return jax.jit(loop)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--interpret", action="store_true",
                        help="tiny shapes in the Pallas interpreter (CPU check of the script)")
    parser.add_argument("--calls", type=int, default=100, help="calls per jitted loop")
    parser.add_argument("--unroll", type=int, default=10,
                        help="calls per loop iteration (see calls_in_one_jit)")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per variant")
    parser.add_argument("--tokens", default="1,8,64,256,1024", help="tokens per call, comma list")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the decode launch variants of SWEEP (to pick defaults)")
    args = parser.parse_args(argv)
    d, h, k_active = 2048, 5632, K_ACTIVE
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.interpret:
        d, h, k_active, tokens, args.calls, args.repeats, args.unroll = 64, 96, 3.0, [1, 8], 2, 1, 2
    if min(tokens) < 1 or args.calls < 1 or args.repeats < 1 or args.unroll < 1:
        raise SystemExit("--tokens entries, --calls, --unroll and --repeats must be >= 1")
    if args.calls % args.unroll:
        raise SystemExit(f"--calls ({args.calls}) must be a multiple of --unroll ({args.unroll})")
    bench_ffn.D, bench_ffn.H = d, h  # make_inputs reads the module's shape globals
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__, "d": d, "h": h,
                     "k": k_active, "calls": args.calls, "unroll": args.unroll, "rows": []}
    fns = variants(args.interpret, args.sweep)
    key = jax.random.PRNGKey(0)
    table = [f"{'tokens':>6} {'union':>6} {'l0':>5} " + " ".join(f"{n + ' us':>14}" for n in fns)
             + f" {'floor dense':>11} {'floor sparse':>12} {'model dense':>11} {'model dec':>9}"
             f" {'prefer':>6}"]
    for m in tokens:
        xs, wg, wu, wd = bench_ffn.make_inputs(jax.random.fold_in(key, m), m, k_active, n_sets=1)
        x = xs[0]
        g = jnp.einsum("md,hd->mh", x, wg, preferred_element_type=jnp.float32)
        union = int(jnp.sum(jnp.any(g > 0, axis=0)))
        l0 = float(jnp.mean(jnp.sum(g > 0, axis=1)))
        row = dict(m=m, union=union, l0=l0,
                   floor_dense_us=(3 * h * d * 2 + 2 * m * d * 2) / HBM_BYTES_PER_S * 1e6,
                   floor_sparse_us=((h + 2 * union) * d * 2 + 2 * m * d * 2) / HBM_BYTES_PER_S * 1e6,
                   model_dense_us=planner.dense_time_us(m, d, h),
                   model_decode_us=planner.decode_time_us(m, d, h, l0),
                   prefer_decode=planner.prefer_decode_path(m, d, h, k_active, True))
        # Correctness first: one call of each variant against dense.
        y_dense = jax.jit(fns["dense"])(x, wg, wu, wd)
        _, aux = jax.jit(lambda *a: pallas_decode.decode_gated_ffn_forward(
            *a, implementation="triton", interpret=args.interpret))(x, wg, wu, wd)
        row["decode_aux"] = {name: float(v) for name, v in aux.items()}
        loops = {}
        for name, fn in fns.items():
            try:
                err = rel_err(jax.jit(fn)(x, wg, wu, wd), y_dense)
                row[f"{name}_err"] = err
                if not err < 2e-2:
                    raise AssertionError(f"{name} differs from dense: rel err {err:.3g}")
                loop = calls_in_one_jit(fn, args.calls, args.unroll)
                jax.block_until_ready(loop(x, wg, wu, wd))  # compile + warm up
                loops[name] = loop
            except Exception as e:  # noqa: BLE001  (record and go on with the other variants)
                row[f"{name}_error"] = repr(e)[:300]
        samples = {name: [] for name in loops}
        for _ in range(args.repeats):
            for name, loop in loops.items():
                t0 = time.perf_counter()
                jax.block_until_ready(loop(x, wg, wu, wd))
                samples[name].append((time.perf_counter() - t0) * 1e6 / args.calls)
        for name, s in samples.items():
            row[f"{name}_us"] = statistics.median(s)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "bench_ffn_decode.json").write_text(json.dumps(results, indent=1))
        dense_us = row.get("dense_us", float("nan"))
        cells = []
        for name in fns:
            t = row.get(f"{name}_us")
            cells.append(f"{'error':>14}" if t is None else
                         f"{t:>7.1f} ({dense_us / t:4.2f}x)" if name != "dense" else f"{t:>14.1f}")
        table.append(f"{m:>6} {union:>6} {l0:>5.1f} " + " ".join(cells)
                     + f" {row['floor_dense_us']:>11.1f} {row['floor_sparse_us']:>12.1f}"
                     f" {row['model_dense_us']:>11.1f} {row['model_decode_us']:>9.1f}"
                     f" {str(row['prefer_decode']):>6}")
    print("\n".join(["", f"=== FFN at decode sizes ({results['device']}, bf16, D={d}, H={h}, "
                     f"~{k_active:g} active/token, {args.calls} calls per jit, {args.unroll} per loop "
                     "iteration; us per call, "
                     "(x) = dense / variant) ==="] + table))
    (out_dir / "table_decode.txt").write_text("\n".join(table) + "\n")
    return results


if __name__ == "__main__":
    main()
