"""Exploration (issue 12): what bounds the token-major backward kernel at k 29 on the H100?

Times pallas_kernels.twell_bwd_token.token_backward on bench_ffn's synthetic k-29 pattern (M 16384,
D 2048, H 5632) with: the default launch (other launches: bench_ffn_train.py --sweep-blocks); the
same pattern with its neuron ids folded into the first H/4 neurons (same entry count, a weight working set that fits in L2: if
the kernel were bound by L2 misses it would speed up ~2x); the non-gated variant (2 gathered rows
and one reduction per entry instead of 3 and 2); and the per-token list builders (the kernel at
8, 16 and 32 rows per program against the XLA reference). Prints a table; JSON under --out."""
from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from twell_jax.bench import ffn as bench_ffn
from twell_jax.pallas_kernels.twell_bwd_token import (ListsBlockSizes, TokenBwdBlockSizes, rank_values, token_backward,
                                            token_lists, token_lists_reference)
from twell_jax.pallas_kernels.twell_pack import pack_gate
from twell_jax.pallas_kernels.twell_transpose import neuron_lists
from twell_jax import ops


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=float, default=29.0)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    m, d, h = 16384, bench_ffn.D, bench_ffn.H
    xs, wg, wu, wd = bench_ffn.make_inputs(jax.random.PRNGKey(0), m, args.k)
    gy = (jax.random.normal(jax.random.PRNGKey(7), (m, d), jnp.float32)).astype(xs[0].dtype)
    values, indices, counts = jax.jit(lambda x, w: pack_gate(x, w, tile=256, slots=32))(xs[0], wg)
    tail = ops.TailPolicy(ops.SparseFFNConfig(slots=32, ell_width=128)).pack_token_tail(counts)
    counts = jnp.where(tail[:, None], 0, counts)
    nnz = int(jnp.sum(jnp.minimum(counts, 32)))
    dest = {}  # per folding: the neuron-major positions the kernel writes to
    print(f"entries {nnz} ({nnz / m:.1f} per token), tail rows {int(jnp.sum(tail))}", flush=True)
    scale = jnp.float32(1e-3 / m)
    dest1 = neuron_lists(indices, counts, h, width=128)[3]
    hot_H = jnp.zeros((h,), bool).at[::7].set(True)  # a hot mask, so the lookups are timed too
    lists_ms = {}
    for name, fn in (("xla", token_lists_reference), ("kernel", token_lists),
                     *[(f"kernel/{br}rows",
                        functools.partial(token_lists, block_sizes=ListsBlockSizes(block_rows=br)))
                       for br in (8, 16)]):
        lists_ms[name] = bench_ffn.bench(jax.jit(fn), [(rank_values(values, counts, 128), indices, counts, dest1, hot_H)], repeats=10)
        print(f"token_lists {name}: {lists_ms[name]:.3f} ms", flush=True)
    rows = []

    def run(name, idx, bs, gated=True, fold=1):
        if fold not in dest:
            if fold == 1:
                dest[fold] = neuron_lists(idx, counts, h, width=128)[3]
            else:  # folded ids break the pack's tile ranges: token-major positions, in bounds
                nnz_M = jnp.sum(jnp.minimum(counts, 32), axis=1)
                slot_MxW = jnp.arange(128, dtype=jnp.int32)[None, :]
                dest[fold] = jnp.where(slot_MxW < nnz_M[:, None],
                                       jnp.arange(m, dtype=jnp.int32)[:, None] * 128 + slot_MxW, -1)
        lists = token_lists(rank_values(values, counts, 128), idx, counts, dest[fold])
        fn = jax.jit(lambda x, g, *lists: token_backward(
            x, g, *lists, wg, wu if gated else None, wd, scale, block_sizes=bs))
        ms = bench_ffn.bench(fn, [(x, gy, *lists) for x in xs[:1]], repeats=10)
        rows_per_entry = 3 if gated else 2
        gbps = nnz * rows_per_entry * d * 2 / (ms * 1e-3) / 1e9
        rows.append(dict(name=name, ms=ms, gb_s=gbps))
        print(f"{name:<32} {ms:8.3f} ms  {gbps:8.0f} GB/s of row gathers", flush=True)

    run("gated, default launch", indices, TokenBwdBlockSizes())
    run("gated, ids folded into H/4, 2 warps", indices % (h // 4), TokenBwdBlockSizes(), fold=4)
    run("non-gated, 2 warps", indices, TokenBwdBlockSizes(), gated=False)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "explore_token_kernel.json").write_text(json.dumps(
        dict(device=str(jax.devices()[0]), k=args.k, entries=nnz, token_lists_ms=lists_ms, rows=rows),
        indent=1))
    print(f"\n=== token-major kernel, M 16384 D 2048 H 5632 bf16 (lists: {lists_ms}) ===")
    for r in rows:
        print(f"{r['name']:<32} {r['ms']:8.3f} ms {r['gb_s']:8.0f} GB/s")


if __name__ == "__main__":
    main()
