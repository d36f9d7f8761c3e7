"""The decode matrix-vector kernel (pallas_kernels/decode_matvec.py) against XLA on the shapes of one
decode step of the paper's models (d_model 2048, d_ff 5632, vocab 49152): microseconds per call,
the bandwidth reached (weight bytes / time) and the ratio to XLA's dot of the same operands, over
a sweep of block sizes (split_k included). Each figure is a call's time in a chain of dependent
calls over --layers stacked weight copies (more bytes than the L2 cache: each call reads its weights
from memory, as a decode step's layers do), from the difference of two chain lengths, so the
program's launch cancels. The best variant per shape is printed last; --out gets every row as JSON.

    python experiments/bench_decode_matvec.py --rows 1,8 --out $OUT/bench_decode_matvec.json
    python experiments/bench_decode_matvec.py --dry-run     # tiny shapes on CPU (interpret mode)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp


from twell_jax.pallas_kernels.common import is_pow2
from twell_jax.pallas_kernels.decode_matvec import (MANY_ROWS, ROLES, MatvecBlockSizes,
                                                    decode_matvec, role_block_sizes)

# (name, N, K, layout, gated, parts): the products of a decode step, as the model calls them
# (`twell_jax/inference/decode_engine.py`; its roles are `decode_matvec.ROLES`): q/k/v as three parts of
# one launch ("qkv"; "qkv_one" is the same bytes as one [K, 3N] weight), the output projection, the
# gated gate/up, W_down, the LM head, the sparse layers' gate; "down_nk" is W_down transposed, as
# decode.transposed reads it (and out, and q/k/v as one [3N, K] weight, then read as "nk":
# shapes "out_nk", "qkv_nk").
SHAPES = (("qkv", 2048, 2048, "kn", False, 3), ("qkv_one", 6144, 2048, "kn", False, 1),
          ("out", 2048, 2048, "kn", False, 1), ("gate_up", 5632, 2048, "nk", True, 1),
          ("down", 2048, 5632, "kn", False, 1), ("down_nk", 2048, 5632, "nk", False, 1),
          ("head", 49152, 2048, "nk", False, 1), ("gate", 5632, 2048, "nk", False, 1),
          ("qkv_nk", 6144, 2048, "nk", False, 1), ("out_nk", 2048, 2048, "nk", False, 1))
# The shape that measures each of decode_matvec.ROLES: the shape of the role's name ("down_nk_switch":
# W_down transposed, as "down_nk"; "gate_few_rows": the gate).
ROLE_SHAPES = {role: role.removesuffix("_switch").removesuffix("_few_rows") for role in ROLES}
# (block_n, block_k) per layout. A "kn" tile [bk, bn] reads bk rows of bn contiguous elements: wide
# and short tiles (rows of 64-512 B), with split_k for programs when N / block_n is small. An "nk"
# tile [bn, bk] reads bn rows of bk contiguous elements: narrow and long ones.
TILES = {"kn": ((32, 128), (32, 256), (64, 64), (64, 128), (128, 32), (128, 64), (256, 16), (256, 32)),
         "nk": ((16, 256), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256))}
SWEEPS = {layout: [MatvecBlockSizes(block_n=bn, block_k=bk, num_warps=nw, num_stages=3, split_k=sk)
                   for (bn, bk), nw, sk in itertools.product(tiles, (4, 8), (1, 4, 8))]
          for layout, tiles in TILES.items()}


def per_call_us(fn, x, w, gate, *, layers: int, reps: int, min_seconds: float) -> float:
    """Microseconds per call of fn(x, w, gate, layer) as a decode step runs it: a chain of calls
    over `layers` distinct weights (the stacks hold more bytes than the GPU's L2 cache, so each call
    reads its weights from memory, as each layer of a step does), each call's input depending on the
    last one's output, compiled as one program. The chain is timed at `reps` and at 2 x `reps`
    passes over the layers and the difference is divided by the extra calls: the program's launch
    and fixed costs cancel, and no loop construct is timed."""
    def program(passes: int):
        def chain(x, w, g):
            acc = jnp.float32(0)
            for _ in range(passes):
                for layer in range(layers):
                    first = fn(x, w, g, layer)[0, 0].astype(jnp.float32)
                    acc = acc + first
                    x = x + (first * 1e-30).astype(x.dtype)  # the next call needs this one's output
            return acc
        return jax.jit(chain)

    def seconds(run) -> float:  # the best of 3 windows: other work on the machine only adds time
        jax.block_until_ready(run(x, w, gate))
        best = float("inf")
        for _ in range(3):
            calls, start = 0, time.perf_counter()
            while True:
                out = run(x, w, gate)
                calls += 1
                if calls >= 3 and time.perf_counter() - start >= min_seconds / 3:
                    break
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - start) / calls)
        return best

    once, twice = seconds(program(reps)), seconds(program(2 * reps))
    return 1e6 * (twice - once) / (reps * layers)


def stacked(key, shape, layers: int, dtype=jnp.bfloat16) -> jax.Array:
    return jax.random.normal(key, (layers, *shape), dtype)


def fastest(rows: list[dict], name: str, m: int) -> dict | None:
    """The fastest measured variant of shape `name` at m rows, or None."""
    cand = [r for r in rows if r.get("shape") == name and r["m"] == m and "us" in r]
    return min(cand, key=lambda r: r["us"]) if cand else None


def write_blocks(path: str, rows: list[dict], role_shapes: dict[str, str], m: int) -> list[str]:
    """Each role's fastest blocks at m rows, as JSON for `bench_inference.py --matvec-blocks`."""
    roles = {}
    for role, name in role_shapes.items():
        b = fastest(rows, name, m)
        if b:
            roles[role] = {f: b[f] for f in ("block_n", "block_k", "max_block_m", "num_warps", "num_stages",
                                             "split_k", "programs_n")}
    Path(path).write_text(json.dumps({"device": jax.devices()[0].device_kind, "m": m, "roles": roles}, indent=1) + "\n")
    return sorted(roles)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8", help="token rows per call (the decode batch)")
    parser.add_argument("--shapes", default=",".join(shape[0] for shape in SHAPES),
                        help="which of the shapes to sweep (comma-separated)")
    parser.add_argument("--min-seconds", type=float, default=0.05)
    parser.add_argument("--layers", type=int, default=8,
                        help="weight copies per stack: their bytes must pass the L2 cache (50 MB on an H100)")
    parser.add_argument("--reps", type=int, default=4, help="passes over the layers in the shorter timed chain")
    parser.add_argument("--peak-gbs", type=float, default=3350.0, help="HBM bandwidth for the share column")
    parser.add_argument("--programs", default="0", metavar="P,...",
                        help="MatvecBlockSizes.programs_n values swept with every block (0 = one program per "
                             "block_n columns; e.g. 132,264 on an H100: one or two programs per SM)")
    parser.add_argument("--stages", default=None, metavar="S,...",
                        help="num_stages values swept with every block (software-pipelining depth; default 3, "
                             "1 in the dry run)")
    parser.add_argument("--max-block-m", default=None, metavar="M,...",
                        help="MatvecBlockSizes.max_block_m values swept with every block (token rows a program "
                             "holds, powers of two >= 16; default each block's own: 16, or its role's)")
    parser.add_argument("--block-k", default=None, metavar="K,...",
                        help="with --role-blocks-only: block_k values swept with each role's blocks (a deeper "
                             "row block may need a shorter K step to fit shared memory)")
    parser.add_argument("--role-blocks-only", action="store_true",
                        help="sweep only each shape's roles' current blocks at each --rows value (decode_matvec.role_block_sizes) over "
                             "--stages and --programs, not the block sizes")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--blocks-out", default=None, metavar="FILE",
                        help="write each role's fastest blocks at the first --rows value as JSON, for "
                             "`bench_inference.py --matvec-blocks FILE` (the choice measured in a model step)")
    args = parser.parse_args(argv)
    wanted = [name for name in args.shapes.split(",") if name]
    unknown = sorted(set(wanted) - {shape[0] for shape in SHAPES})
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected some of {[shape[0] for shape in SHAPES]}")
    try:
        programs = [int(p) for p in args.programs.split(",") if p]
    except ValueError:
        programs = []
    if not programs or min(programs) < 0:
        parser.error(f"--programs {args.programs!r}: expected integers >= 0, comma-separated")
    try:
        stages = [int(v) for v in (args.stages or ("1" if args.dry_run else "3")).split(",") if v]
    except ValueError:
        stages = []
    if not stages or not all(1 <= v <= 8 for v in stages):
        parser.error(f"--stages {args.stages!r}: expected integers in [1, 8], comma-separated")
    def pow2_list(flag: str, text: str | None) -> list[int | None]:
        if text is None:
            return [None]
        try:
            values = [int(v) for v in text.split(",") if v]
        except ValueError:
            values = []
        if not values or not all(v >= 16 and is_pow2(v) for v in values):
            parser.error(f"{flag} {text!r}: expected powers of two >= 16, comma-separated")
        return values
    block_ms = pow2_list("--max-block-m", args.max_block_m)
    block_ks = pow2_list("--block-k", args.block_k)
    if args.block_k is not None and not args.role_blocks_only:
        parser.error("--block-k sweeps the roles' own blocks: it needs --role-blocks-only (the full sweep's "
                     "tiles already vary block_k)")

    def varied(sizes: MatvecBlockSizes, **fields) -> list[MatvecBlockSizes]:
        """sizes at each --stages, --programs and --max-block-m value (and given fields)."""
        return [dataclasses.replace(sizes, num_stages=st, programs_n=p, **fields,
                                    **({"max_block_m": bm} if bm else {}))
                for st in stages for p in programs for bm in block_ms]
    sweeps = dict(SWEEPS)
    shapes, interpret = [shape for shape in SHAPES if shape[0] in wanted], False
    role_shapes = ROLE_SHAPES
    if args.dry_run:
        shapes = (("tiny", 40, 48, "kn", False, 1), ("tiny_gated", 40, 48, "nk", True, 1),
                  ("tiny_parts", 32, 48, "kn", False, 3))
        tiny = [MatvecBlockSizes(block_n=16, block_k=16, num_stages=1, split_k=sk) for sk in (1, 2)]
        sweeps, programs = {"nk": tiny, "kn": tiny}, sorted(set(programs) | {0, 3})
        role_shapes = {"out": "tiny", "gate_up": "tiny_gated", "qkv": "tiny_parts"}
        interpret, args.min_seconds, args.layers, args.reps = True, 0.0, 2, 1
    sweeps = {layout: [v for sizes in variants for v in varied(sizes)] for layout, variants in sweeps.items()}
    rows = []
    first_m = int(args.rows.split(",")[0])
    key = jax.random.key(0)
    for m in [int(r) for r in args.rows.split(",") if r]:
        for name, n, k, layout, gated, parts in shapes:
            kx, kw, kg = jax.random.split(jax.random.fold_in(key, n * k * parts + m), 3)
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            shape = (n, k) if layout == "nk" else (k, n)
            # [L, ...] stacks read at a layer, as the model's decode step reads them
            w = stacked(kw, shape, args.layers)
            if parts > 1:
                w = tuple(stacked(jax.random.fold_in(kw, p), shape, args.layers) for p in range(parts))
            gate = stacked(kg, shape, args.layers) if gated else None
            nbytes = 2 * n * k * (2 if gated else parts)
            spec = "mk,nk->mn" if layout == "nk" else "mk,kn->mn"
            # XLA's dot on each layer's weights (a static index of the stack; were XLA to copy the slice, its
            # time would include the copy: its bandwidth on the H100, near the HBM peak, says it did not)
            if gated:
                xla = lambda x, w, g, i: jax.nn.relu(jnp.einsum(spec, x, g[i])) * jnp.einsum(spec, x, w[i])
            elif parts > 1:
                xla = lambda x, w, g, i: jnp.concatenate([jnp.einsum(spec, x, p[i]) for p in w], axis=1)
            else:
                xla = lambda x, w, g, i: jnp.einsum(spec, x, w[i])
            timing = dict(layers=args.layers, reps=args.reps, min_seconds=args.min_seconds)
            xla_us = per_call_us(xla, x, w, gate, **timing)
            want = jax.jit(xla, static_argnums=3)(x, w, gate, 1).astype(jnp.float32)
            sweep = sweeps[layout]
            if args.role_blocks_only:  # this shape's roles' blocks, at each --stages, --programs, --max-block-m
                current = {role_block_sizes(role, m) for role, shape in role_shapes.items() if shape == name}
                sweep = list(dict.fromkeys(v for c in current for bk in block_ks
                                           for v in varied(c, **({"block_k": bk} if bk else {}))))
            for sizes in sweep:
                if (gated and sizes.split_k > 1) or (parts > 1 and (n % sizes.block_n or sizes.programs_n)) or (
                        sizes.programs_n and -(-n * parts // sizes.programs_n) > sizes.block_n):
                    continue  # refused by the kernel: a split gate; parts not a multiple of block_n or
                    # with programs_n; more columns a program than block_n
                fn = lambda x, w, g, i, s=sizes: decode_matvec(
                    x, w, layer=jnp.full((1,), i, jnp.int32), layout=layout, gate=g,
                    activation="relu" if gated else None, block_sizes=s, interpret=interpret)
                try:
                    got = jax.jit(fn, static_argnums=3)(x, w, gate, 1).astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                    us = per_call_us(fn, x, w, gate, **timing)
                except Exception as exc:  # a variant that does not compile: recorded, not fatal
                    rows.append({"shape": name, "m": m, "sizes": str(sizes), "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                rows.append({"shape": name, "m": m, "n": n, "k": k, "layout": layout, "gated": gated, "parts": parts,
                             "block_n": sizes.block_n, "block_k": sizes.block_k, "max_block_m": sizes.max_block_m,
                             "num_warps": sizes.num_warps,
                             "num_stages": sizes.num_stages, "split_k": sizes.split_k,
                             "programs_n": sizes.programs_n, "us": us, "xla_us": xla_us, "vs_xla": xla_us / us,
                             "gb_s": nbytes / us / 1e3, "peak_share": nbytes / us / 1e3 / args.peak_gbs,
                             "rel_err_vs_xla": err})
            best = fastest(rows, name, m)
            if best is None:  # every variant failed to compile: their errors are in the rows
                print(f"[matvec] m {m} {name}: no variant ran", flush=True)
            else:
                print(f"[matvec] m {m} {name}: best bn {best['block_n']} bk {best['block_k']} w{best['num_warps']} "
                      f"s{best['num_stages']} split {best['split_k']} programs {best['programs_n']} {best['us']:.1f} us ({best['gb_s']:.0f} GB/s) vs XLA {xla_us:.1f} us", flush=True)
            if args.blocks_out and m == first_m:  # after every shape, as --out
                write_blocks(args.blocks_out, rows, role_shapes, m)
            if args.out:  # after every shape: a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print("\n| m | shape | best blocks | us | GB/s | share of peak | XLA us | vs XLA |\n|---|---|---|---|---|---|---|---|")
    for m in sorted({r["m"] for r in rows}):
        for name, *_ in shapes:
            b = fastest(rows, name, m)
            if b:
                print(f"| {m} | {name} | {b['block_n']}/{b['block_k']}/w{b['num_warps']}/s{b['num_stages']}/k{b['split_k']}/p{b['programs_n']} | "
                      f"{b['us']:.1f} | {b['gb_s']:.0f} | {b['peak_share']:.0%} | {b['xla_us']:.1f} | {b['vs_xla']:.2f}x |")
        table = "ROLE_BLOCK_SIZES_MANY_ROWS" if m > MANY_ROWS else "ROLE_BLOCK_SIZES"
        print(f"\n# decode_matvec.{table}: each role's fastest blocks at m {m}")
        for role, name in role_shapes.items():
            b = fastest(rows, name, m)
            if b:
                print(f'    "{role}": MatvecBlockSizes(block_n={b["block_n"]}, block_k={b["block_k"]}, '
                      f'num_warps={b["num_warps"]}, num_stages={b["num_stages"]}, split_k={b["split_k"]}, '
                      f'programs_n={b["programs_n"]}, max_block_m={b["max_block_m"]}),')
    if args.blocks_out:
        print(f"[matvec] wrote {args.blocks_out}: {write_blocks(args.blocks_out, rows, role_shapes, first_m)}")
    return rows


if __name__ == "__main__":
    main()
