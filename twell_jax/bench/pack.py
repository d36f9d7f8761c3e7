"""The pack on Mosaic GPU against the Triton pack and XLA's dense GEMM (issue 41), on one GPU.

    PYTHONUNBUFFERED=1 python experiments/bench_pack.py --out /tmp/bench_pack

For each uniform sparsity k (synthetic: `bench.ffn.make_inputs`, M 16384, D 2048, H 5632, bf16):
the gate GEMM + TwELL pack alone on each backend (`triton`: pallas_kernels/twell_pack.py, `mosaic`:
pallas_kernels/twell_pack_mgpu.py: its default (the compaction epilogue, clusters of 2 sharing W
by multicast, 4 stages), 3 stages, no clusters, and no clusters with the "scan" epilogue (the
kernel before either)) beside XLA's dense `relu(x @ W^T)` (plain
JAX), timed in alternation in this process, with the Mosaic outputs compared bit for bit to the
Triton kernel's; then, at the `--op-k` sparsities, the op's training step (forward + backward, the
`pallas` backend, `SparseFFNConfig.pack_backend` triton or mosaic) and its inference forward beside
the op's dense backend and plain JAX's bf16 FFN of the same shapes
(`bench.ffn_train.xla_bf16_loss_parts`), also in alternation. Needs a Hopper GPU (the Mosaic kernel's only target). Writes OUT/bench_pack.json and
prints a table; exit 1 if a Mosaic output differs from the Triton kernel's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from twell_jax import ops
from twell_jax.bench import ffn as bench_ffn
from twell_jax.bench import ffn_train
from twell_jax.ops import pallas_forward
from twell_jax.pallas_kernels import twell_pack_mgpu as mg
from twell_jax.pallas_kernels.twell_pack import pack_gate

LAYOUTS = {"mosaic": mg.MgpuPackBlockSizes(), "mosaic_3stages": mg.MgpuPackBlockSizes(3),
           "mosaic_cluster1": mg.MgpuPackBlockSizes(cluster=1),
           "mosaic_scan": mg.MgpuPackBlockSizes(epilogue="scan", cluster=1)}


def pack_row(k: float, m: int, repeats: int) -> dict[str, Any]:
    """The pack alone at uniform sparsity k: ms per call of each backend and of XLA's relu GEMM."""
    xs, wg, _, _ = bench_ffn.make_inputs(jax.random.PRNGKey(0), m, k)
    args = [(x, wg) for x in xs]
    fns = {"xla_relu_gemm": bench_ffn.xla_gate, "triton": jax.jit(pack_gate)}
    fns.update({name: jax.jit(functools.partial(mg.pack_gate_mgpu, block_sizes=sizes))
                for name, sizes in LAYOUTS.items()})
    want = fns["triton"](*args[0])
    mismatches = {}
    for name in LAYOUTS:
        got = fns[name](*args[0])
        mismatches[name] = [int(jnp.sum(a != b)) for a, b in zip(got, want)]
    counts = want[2]
    times = bench_ffn.bench_interleaved(fns, args, repeats=repeats)
    return {"k": k, "m": m, "active_per_token": float(jnp.mean(jnp.sum(counts, axis=1))),
            "ms": times, "vs_xla": {name: times["xla_relu_gemm"] / t for name, t in times.items()},
            "mismatches_vs_triton": mismatches}


def op_row(k: float, m: int, repeats: int) -> dict[str, Any]:
    """The op's training step and inference forward with each pack backend, and plain JAX's."""
    xs, wg, wu, wd = bench_ffn.make_inputs(jax.random.PRNGKey(1), m, k)
    gy = jax.random.normal(jax.random.PRNGKey(2), xs[0].shape, jnp.float32).astype(xs[0].dtype)
    configs = {name: ops.SparseFFNConfig(pack_backend=name) for name in ("triton", "mosaic")}
    steps = {name: ffn_train.make_train_step(name, ops.SparseFFNConfig(), False) for name in ("xla_bf16", "dense")}
    steps.update({f"pallas_{name}": ffn_train.make_train_step("pallas", cfg, False) for name, cfg in configs.items()})
    forwards = {name: ffn_train.make_forward(name, ops.SparseFFNConfig(), False, False) for name in ("xla_bf16", "dense")}
    forwards.update({f"pallas_{name}": ffn_train.make_forward("pallas", cfg, False, False)
                     for name, cfg in configs.items()})
    y_t = steps["pallas_triton"](xs[0], wg, wu, wd, gy)
    y_m = steps["pallas_mosaic"](xs[0], wg, wu, wd, gy)
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(y_t, y_m))
    step_ms = bench_ffn.bench_interleaved(steps, [(x, wg, wu, wd, gy) for x in xs], repeats=repeats)
    fwd_ms = bench_ffn.bench_interleaved(forwards, [(x, wg, wu, wd) for x in xs], repeats=repeats)
    return {"k": k, "m": m, "fwd_bwd_ms": step_ms, "inference_fwd_ms": fwd_ms,
            "fwd_bwd_vs_plain": {n: step_ms["xla_bf16"] / t for n, t in step_ms.items()},
            "inference_fwd_vs_plain": {n: fwd_ms["xla_bf16"] / t for n, t in fwd_ms.items()},
            "same_bits_triton_vs_mosaic": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", default="16,29,39,56,110", help="uniform active neurons per token, the pack rows")
    parser.add_argument("--op-k", default="29,39", help="sparsities of the op rows ('' for none)")
    parser.add_argument("--m", type=int, default=16384, help="tokens per call")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (each a batch of 5 calls a variant)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output directory")
    args = parser.parse_args(argv)
    try:
        ks = [float(v) for v in args.k.split(",") if v.strip()]
        op_ks = [float(v) for v in args.op_k.split(",") if v.strip()]
    except ValueError as err:
        parser.error(f"--k / --op-k must be comma-separated numbers ({err})")
    if not ks or any(not 0 < k < bench_ffn.H for k in ks + op_ks):
        parser.error(f"--k and --op-k take sparsities in (0, {bench_ffn.H})")
    if args.m < 1 or args.repeats < 1:
        parser.error("--m and --repeats must be >= 1")
    if not pallas_forward.is_hopper() or not mg.available():
        parser.error(f"needs a Hopper GPU and a JAX with Pallas Mosaic GPU (backend {jax.default_backend()}, "
                     f"jax {jax.__version__})")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                              "m": args.m, "d": bench_ffn.D, "h": bench_ffn.H, "pack": [], "op": []}
    for k in ks:
        row = pack_row(k, args.m, args.repeats)
        report["pack"].append(row)
        print(json.dumps(row), flush=True)
    for k in op_ks:
        row = op_row(k, args.m, args.repeats)
        report["op"].append(row)
        print(json.dumps(row), flush=True)
    (out_dir / "bench_pack.json").write_text(json.dumps(report, indent=1))
    print(f"\n{'k':>5} {'XLA relu GEMM':>14} {'triton':>8} {'mosaic':>8} {'3 stages':>9} {'cluster 1':>9} "
          f"{'scan, 1':>8}   (ms; mosaic vs XLA, vs triton)")
    for r in report["pack"]:
        t = r["ms"]
        print(f"{r['k']:>5.0f} {t['xla_relu_gemm']:>14.3f} {t['triton']:>8.3f} {t['mosaic']:>8.3f} "
              f"{t['mosaic_3stages']:>9.3f} {t['mosaic_cluster1']:>9.3f} {t['mosaic_scan']:>8.3f}   "
              f"{r['vs_xla']['mosaic']:.3f}x, "
              f"{t['triton'] / t['mosaic']:.3f}x")
    for r in report["op"]:
        s, f = r["fwd_bwd_ms"], r["inference_fwd_ms"]
        print(f"op k {r['k']:.0f}: fwd+bwd plain {s['xla_bf16']:.3f}, dense {s['dense']:.3f}, triton "
              f"{s['pallas_triton']:.3f}, mosaic {s['pallas_mosaic']:.3f} ms; inference fwd plain {f['xla_bf16']:.3f}, dense {f['dense']:.3f}, triton "
              f"{f['pallas_triton']:.3f}, mosaic {f['pallas_mosaic']:.3f}; same bits {r['same_bits_triton_vs_mosaic']}")
    bad = [r for r in report["pack"] if any(any(v) for v in r["mismatches_vs_triton"].values())]
    bad += [r for r in report["op"] if not r["same_bits_triton_vs_mosaic"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
