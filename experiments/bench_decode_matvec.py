"""The decode matrix-vector kernel (pallas_kernels/decode_matvec.py) against XLA on the shapes of one
decode step of the paper's models (d_model 2048, d_ff 5632, vocab 49152): microseconds per call,
the bandwidth reached (weight bytes / time) and the ratio to XLA's dot of the same operands, over
a sweep of block sizes (split_k included). Each figure is a call's time inside a device loop of
--iters calls, less the loop's own time per call (a product-free body, measured beside it). The
best variant per shape is printed last; --out gets every row as JSON.

    python experiments/bench_decode_matvec.py --rows 1,8 --out $OUT/bench_decode_matvec.json
    python experiments/bench_decode_matvec.py --dry-run     # tiny shapes on CPU (interpret mode)
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from twell_jax.pallas_kernels.decode_matvec import ROLES, MatvecBlockSizes, decode_matvec  # noqa: E402

# (name, N, K, layout, gated, parts): the products of a decode step, as the model calls them
# (`Transformer._decode_step_kernels`; its roles are `decode_matvec.ROLES`): q/k/v as three parts of
# one launch ("qkv"; "qkv_one" is the same bytes as one [K, 3N] weight), the output projection, the
# gated gate/up, W_down, the LM head, the sparse layers' gate; "down_nk" is W_down transposed, as
# model.decode_transposed reads it (and out, and q/k/v as one [3N, K] weight, then read as "nk":
# shapes "out_nk", "qkv_nk").
SHAPES = (("qkv", 2048, 2048, "kn", False, 3), ("qkv_one", 6144, 2048, "kn", False, 1),
          ("out", 2048, 2048, "kn", False, 1), ("gate_up", 5632, 2048, "nk", True, 1),
          ("down", 2048, 5632, "kn", False, 1), ("down_nk", 2048, 5632, "nk", False, 1),
          ("head", 49152, 2048, "nk", False, 1), ("gate", 5632, 2048, "nk", False, 1),
          ("qkv_nk", 6144, 2048, "nk", False, 1), ("out_nk", 2048, 2048, "nk", False, 1))
# The shape that measures each of decode_matvec.ROLES: the shape of the role's name.
ROLE_SHAPES = {role: role for role in ROLES}
# (block_n, block_k) per layout. A "kn" tile [bk, bn] reads bk rows of bn contiguous elements: wide
# and short tiles (rows of 64-512 B), with split_k for programs when N / block_n is small. An "nk"
# tile [bn, bk] reads bn rows of bk contiguous elements: narrow and long ones.
TILES = {"kn": ((32, 128), (32, 256), (64, 64), (64, 128), (128, 32), (128, 64), (256, 16), (256, 32)),
         "nk": ((16, 256), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256))}
SWEEPS = {layout: [MatvecBlockSizes(block_n=bn, block_k=bk, num_warps=nw, num_stages=3, split_k=sk)
                   for (bn, bk), nw, sk in itertools.product(tiles, (4, 8), (1, 4, 8))]
          for layout, tiles in TILES.items()}


def per_call_us(fn, x, w, gate, *, iters: int, min_seconds: float) -> float:
    """Microseconds per call of fn(x, w, gate) run `iters` times back to back on the device (one
    program: a loop whose next x depends on the last output, so nothing is hoisted), as a decode
    step runs its kernels; the host's dispatch of a single call (tens of us) is not timed."""
    def body(_, carry):
        x_, acc = carry
        acc = acc + fn(x_, w, gate)[0, 0].astype(jnp.float32)
        return x_ + (acc * 0).astype(x_.dtype), acc

    loop = jax.jit(lambda x, w, g: jax.lax.fori_loop(0, iters, body, (x, jnp.float32(0)))[1])
    jax.block_until_ready(loop(x, w, gate))
    calls, start = 0, time.perf_counter()
    while True:
        out = loop(x, w, gate)
        calls += 1
        if calls >= 3 and time.perf_counter() - start >= min_seconds:
            break
    jax.block_until_ready(out)
    return 1e6 * (time.perf_counter() - start) / (calls * iters)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8", help="token rows per call (the decode batch)")
    parser.add_argument("--shapes", default=",".join(shape[0] for shape in SHAPES),
                        help="which of the shapes to sweep (comma-separated)")
    parser.add_argument("--min-seconds", type=float, default=0.05)
    parser.add_argument("--iters", type=int, default=100, help="calls per timed program")
    parser.add_argument("--peak-gbs", type=float, default=3350.0, help="HBM bandwidth for the share column")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    wanted = [name for name in args.shapes.split(",") if name]
    unknown = sorted(set(wanted) - {shape[0] for shape in SHAPES})
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected some of {[shape[0] for shape in SHAPES]}")
    shapes, sweeps, interpret = [shape for shape in SHAPES if shape[0] in wanted], SWEEPS, False
    role_shapes = ROLE_SHAPES
    if args.dry_run:
        shapes = (("tiny", 40, 48, "kn", False, 1), ("tiny_gated", 40, 48, "nk", True, 1),
                  ("tiny_parts", 32, 48, "kn", False, 3))
        tiny = [MatvecBlockSizes(block_n=16, block_k=16, num_stages=1, split_k=sk) for sk in (1, 2)]
        sweeps = {"nk": tiny, "kn": tiny}
        role_shapes = {"out": "tiny", "gate_up": "tiny_gated", "qkv": "tiny_parts"}
        interpret, args.min_seconds, args.iters = True, 0.0, 2
    rows = []
    key = jax.random.key(0)
    for m in [int(r) for r in args.rows.split(",") if r]:
        for name, n, k, layout, gated, parts in shapes:
            kx, kw, kg = jax.random.split(jax.random.fold_in(key, n * k * parts + m), 3)
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            shape = (n, k) if layout == "nk" else (k, n)
            w = jax.random.normal(kw, shape, jnp.bfloat16)
            if parts > 1:
                w = tuple(jax.random.normal(jax.random.fold_in(kw, p), shape, jnp.bfloat16) for p in range(parts))
            gate = jax.random.normal(kg, shape, jnp.bfloat16) if gated else None
            nbytes = 2 * n * k * (2 if gated else parts)
            spec = "mk,nk->mn" if layout == "nk" else "mk,kn->mn"
            if gated:
                xla = jax.jit(lambda x, w, g: (jax.nn.relu(jnp.einsum(spec, x, g)) * jnp.einsum(spec, x, w)))
            elif parts > 1:
                xla = jax.jit(lambda x, w, g: jnp.concatenate([jnp.einsum(spec, x, p) for p in w], axis=1))
            else:
                xla = jax.jit(lambda x, w, g: jnp.einsum(spec, x, w))
            # The timing loop's own work per call (the dependency on the output), measured with a
            # product-free body and subtracted from every figure below.
            loop_us = per_call_us(lambda x, w, g: x[:, :1], x, w, gate, iters=args.iters, min_seconds=args.min_seconds)
            xla_us = per_call_us(xla, x, w, gate, iters=args.iters, min_seconds=args.min_seconds) - loop_us
            want = xla(x, w, gate).astype(jnp.float32)
            for sizes in sweeps[layout]:
                if (gated and sizes.split_k > 1) or (parts > 1 and n % sizes.block_n):
                    continue  # refused by the kernel: a split gate; parts not a multiple of block_n
                fn = jax.jit(lambda x, w, g, s=sizes: decode_matvec(
                    x, w, layout=layout, gate=g, activation="relu" if gated else None, block_sizes=s,
                    interpret=interpret))
                try:
                    err = float(jnp.max(jnp.abs(fn(x, w, gate).astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
                    us = per_call_us(fn, x, w, gate, iters=args.iters, min_seconds=args.min_seconds) - loop_us
                except Exception as exc:  # a variant that does not compile: recorded, not fatal
                    rows.append({"shape": name, "m": m, "sizes": str(sizes), "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": layout, "gated": gated, "parts": parts,
                             "block_n": sizes.block_n, "block_k": sizes.block_k, "num_warps": sizes.num_warps,
                             "num_stages": sizes.num_stages, "split_k": sizes.split_k, "loop_us": loop_us, "us": us, "xla_us": xla_us, "vs_xla": xla_us / us,
                             "gb_s": nbytes / us / 1e3, "peak_share": nbytes / us / 1e3 / args.peak_gbs,
                             "rel_err_vs_xla": err})
            best = min((r for r in rows if r.get("shape") == name and r["m"] == m and "us" in r), key=lambda r: r["us"])
            print(f"[matvec] m {m} {name}: best bn {best['block_n']} bk {best['block_k']} w{best['num_warps']} "
                  f"s{best['num_stages']} split {best['split_k']} {best['us']:.1f} us ({best['gb_s']:.0f} GB/s) vs XLA {xla_us:.1f} us", flush=True)
            if args.out:  # after every shape: a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print("\n| m | shape | best blocks | us | GB/s | share of peak | XLA us | vs XLA |\n|---|---|---|---|---|---|---|---|")
    for m in sorted({r["m"] for r in rows}):
        for name, *_ in shapes:
            cand = [r for r in rows if r.get("shape") == name and r["m"] == m and "us" in r]
            if cand:
                b = min(cand, key=lambda r: r["us"])
                print(f"| {m} | {name} | {b['block_n']}/{b['block_k']}/w{b['num_warps']}/s{b['num_stages']}/k{b['split_k']} | "
                      f"{b['us']:.1f} | {b['gb_s']:.0f} | {b['peak_share']:.0%} | {b['xla_us']:.1f} | {b['vs_xla']:.2f}x |")
        print(f"\n# decode_matvec.ROLE_BLOCK_SIZES: each role's fastest blocks at m {m}")
        for role, name in role_shapes.items():
            cand = [r for r in rows if r.get("shape") == name and r["m"] == m and "us" in r]
            if cand:
                b = min(cand, key=lambda r: r["us"])
                print(f'    "{role}": MatvecBlockSizes(block_n={b["block_n"]}, block_k={b["block_k"]}, '
                      f'num_warps={b["num_warps"]}, num_stages={b["num_stages"]}, split_k={b["split_k"]}),')
    return rows


if __name__ == "__main__":
    main()
