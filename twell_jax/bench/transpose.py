"""Benchmark of the sparse backward's transpose: the counting-sort kernels against XLA's sort.

    PYTHONUNBUFFERED=1 python experiments/bench_transpose.py [--sweep] [--interpret]

A synthetic TwELL pattern (M 16384, NT 22 tiles of 256 = H 5632, S 32, width 128, each neuron
live with probability k/H, k = 29: uniformly random neurons, ~29 live entries per row; rows over
`width` get counts 0 as the backward's caller does). Variants, timed interleaved (median ms per
call, experiments/bench_ffn.py's bench_interleaved):

    reference    pallas_kernels.twell_transpose.neuron_lists_reference: compaction to the ELL,
                 stable sort of M * W ids, binary search, inverse permutation (dest)
    xla_sort     twell_transpose.sort_lists: the stable sort + binary search of the backward's
                 transpose before the counting sort (without its value gathers),
                 its input (the token-major ELL's neuron ids) precomputed: what the kernel replaces
    kernel       neuron_lists with the default TransposeBlockSizes
    kernel/...   (--sweep) other block sizes

Every kernel variant is first checked equal to the reference (start, count, dest; tokens up to
the number of entries); a mismatch stops the script. `--interpret`: a small shape through the
Pallas interpreter on the CPU (a test runs it); its times mean nothing.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from twell_jax.bench import ffn as bench_ffn  # bench_interleaved
from twell_jax.pallas_kernels.common import next_pow2
from twell_jax.pallas_kernels.twell_transpose import (TransposeBlockSizes, neuron_lists,
                                            neuron_lists_reference, sort_lists)

# Smaller blocks: fewer registers per thread, more programs resident to hide the load latency of
# the slot loops; longer chunks: fewer programs, fewer partial histograms.
SWEEP = (TransposeBlockSizes(block_rows=8, chunk_rows=128),
         TransposeBlockSizes(block_rows=16, chunk_rows=128),
         TransposeBlockSizes(block_rows=16, chunk_rows=256),
         TransposeBlockSizes(block_rows=32, chunk_rows=512),
         TransposeBlockSizes(block_rows=32, chunk_rows=256, num_warps=8),
         TransposeBlockSizes(block_rows=64, chunk_rows=512, num_warps=8))


def synthetic_pattern(key: jax.Array, m: int, n_tiles: int, tile: int, slots: int, k_active: float,
                      width: int) -> tuple[jax.Array, jax.Array]:
    """(indices [M, NT, S], counts [M, NT]) of a TwELL pack whose neurons are live independently
    with probability k_active / H (first S per tile kept, true counts); rows with more than
    `width` live entries get counts 0 (the backward's token tail)."""
    active_MxNTxT = jax.random.uniform(key, (m, n_tiles, tile)) < k_active / (n_tiles * tile)
    counts_MxNT = jnp.sum(active_MxNTxT, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~active_MxNTxT, axis=-1, stable=True)[..., :slots].astype(jnp.int32)
    keep = jnp.take_along_axis(active_MxNTxT, order, axis=-1)
    tile_start = (jnp.arange(n_tiles, dtype=jnp.int32) * tile)[None, :, None]
    indices = jnp.where(keep, order + tile_start, 0)
    live_M = jnp.sum(jnp.minimum(counts_MxNT, slots), axis=1)
    return indices, jnp.where((live_M > width)[:, None], 0, counts_MxNT)


def check_equal(out: tuple, ref: tuple, name: str) -> None:
    """Exit with a message unless the kernel's lists equal the reference's."""
    n_total = int(jnp.sum(ref[1]))
    for label, a, b in zip(("start", "count", "tokens", "dest"), out, ref):
        if label == "tokens":
            a, b = a[:n_total], b[:n_total]
        if a.shape != b.shape or not bool(jnp.array_equal(a, b)):
            sys.exit(f"{name}: {label} differs from the reference")


def main(argv: list[str] | None = None) -> list[tuple[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--tiles", type=int, default=22, help="NT")
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--k", type=float, default=29.0, help="expected live entries per row")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP's block sizes")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run at a small shape")
    args = parser.parse_args(argv)
    variants = {"kernel": TransposeBlockSizes()}
    if args.interpret:
        args.m, args.tiles, args.tile, args.slots, args.width, args.k = 70, 3, 16, 4, 8, 5.0
        variants = {"kernel": TransposeBlockSizes(block_rows=8, chunk_rows=32)}
        bench_ffn.INTERPRET = True
    elif args.sweep:
        variants.update({f"kernel/{b.block_rows}x{b.chunk_rows}w{b.num_warps}": b for b in SWEEP})
    h, w = args.tiles * args.tile, next_pow2(args.width)
    patterns = [synthetic_pattern(jax.random.PRNGKey(seed), args.m, args.tiles, args.tile, args.slots,
                                  args.k, args.width) for seed in range(3)]
    ref_fn = jax.jit(lambda i, c: neuron_lists_reference(i, c, h, width=args.width))
    sort_fn = jax.jit(lambda cols: sort_lists(cols, h))
    # Each argument set: (indices, counts, the token-major ELL's neuron ids with H in empty slots:
    # the sort's input, rebuilt from the reference's lists: the entry at CSR position p belongs to
    # the neuron whose range holds p).
    arg_sets = []
    for indices, counts in patterns:
        ref = ref_fn(indices, counts)
        neuron_E = jnp.repeat(jnp.arange(h, dtype=jnp.int32), ref[1], total_repeat_length=ref[2].shape[0])
        cols = jnp.where(ref[3] >= 0, neuron_E[jnp.maximum(ref[3], 0)], h)
        start, count, _ = sort_fn(cols)
        if not (bool(jnp.array_equal(start, ref[0])) and bool(jnp.array_equal(count, ref[1]))):
            sys.exit("xla_sort: start/count differ from the reference")
        arg_sets.append((indices, counts, cols))

    fns = {"xla_sort": lambda i, c, cols: sort_fn(cols), "reference": lambda i, c, cols: ref_fn(i, c)}
    for name, bs in variants.items():
        kernel_fn = jax.jit(lambda i, c, bs=bs: neuron_lists(i, c, h, width=args.width, block_sizes=bs,
                                                             interpret=args.interpret))
        for indices, counts, _ in arg_sets:
            check_equal(kernel_fn(indices, counts), ref_fn(indices, counts), name)
        fns[name] = lambda i, c, cols, f=kernel_fn: f(i, c)
    times = bench_ffn.bench_interleaved(fns, arg_sets)
    live = float(jnp.mean(jnp.sum(jnp.minimum(arg_sets[0][1], args.slots), axis=1)))
    print(f"\nM {args.m}  NT {args.tiles}  tile {args.tile}  H {h}  S {args.slots}  W {w}  "
          f"live/row {live:.1f}  device {jax.devices()[0].device_kind}"
          f"{'  (interpret: times mean nothing)' if args.interpret else ''}")
    print(f"{'variant':<24}{'ms':>9}{'vs xla_sort':>13}")
    rows = list(times.items())
    for name, ms in rows:
        print(f"{name:<24}{ms:>9.3f}{times['xla_sort'] / ms:>12.2f}x")
    return rows


if __name__ == "__main__":
    main()
