"""Exploration (issue 41): can a column-slice design read each weight row fewer times than the
per-token kernels, with the SM's L1 cache as the row store?

The per-token kernels (`twell_ffn`) read the two 4 KB weight rows of every (token, active neuron)
from L2: at uniform k 29 (M 16384, H 5632, D 2048) 1.95 GB per matrix. A block design reuses a row
for the tokens of a block that share it, but the scatter into a [tokens, D] accumulator it needs
has no Triton form (docs/kernels.md, "Designs with reuse, by arithmetic"). This probe tries the
form Triton has: each program owns a slice of D (16 to 64 columns) and walks every token's entry
list, gathering its rows' slices; a slice of the whole W (5632 x 16 bf16 = 180 KB) fits an SM's
L1, so where a program keeps one slice per SM every row slice would come from L2 once per program.

- down: y[t, s] = sum_e h[t, e] W[idx[t, e], s]: `slice_down` (the next step's ids and values
  loaded during this step with `prefetch`), against `token_down` (one program per token, the
  per-token design's product) and XLA's dense [M, H] x [H, D] GEMM of the same h;
- up: part[s, t, e] = x[t, s] . U[idx[t, e], s], summed over the slices (`slice_up`).

Inputs: uniform synthetic lists (each neuron on with probability k/H; ascending ids per row,
padded to --width). Every variant is checked against its jnp reference before it is timed.

    python experiments/explore_slice_kernel.py --out DIR          # one GPU: rows + JSON
    python experiments/explore_slice_kernel.py --interpret --out DIR   # tiny shapes, CPU

Writes DIR/explore_slice_kernel.json ({"device", "rows"}); prints a table.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from twell_jax.pallas_kernels.common import is_pow2


def _full(shape):
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


def _down_kernel(idx_ref, h_ref, cnt_ref, w_ref, y_ref, *, ds, bt, kc, chunk, n_chunks, prefetch):
    """Program (slice s, chunk c of the tokens): blocks of bt tokens, kc entries a step."""
    pid = pl.program_id(0)
    s, c = pid // n_chunks, pid % n_chunks
    col = s * ds + lax.broadcasted_iota(jnp.int32, (ds,), 0)
    it_bt = lax.broadcasted_iota(jnp.int32, (bt,), 0)
    it_kc = lax.broadcasted_iota(jnp.int32, (kc,), 0)

    def lists(rows, cnt, i):
        kcol = i * kc + it_kc
        live = kcol[None, :] < cnt[:, None]
        j = plgpu.load(idx_ref.at[rows[:, None], kcol[None, :]], mask=live, other=0)
        hv = plgpu.load(h_ref.at[rows[:, None], kcol[None, :]], mask=live, other=0.0)
        return j, hv, live

    def gather_add(acc, j, hv, live):
        w = plgpu.load(w_ref.at[j[:, :, None], col[None, None, :]], mask=live[:, :, None], other=0)
        return acc + jnp.sum(hv[:, :, None] * w.astype(jnp.float32), axis=1)

    def block(b, carry):
        rows = c * chunk + b * bt + it_bt
        cnt = plgpu.load(cnt_ref.at[rows])
        n_steps = (jnp.max(cnt) + kc - 1) // kc
        acc = jnp.zeros((bt, ds), jnp.float32)
        if prefetch:
            def step(i, carry):
                acc, *cur = carry
                nxt = lists(rows, cnt, i + 1)  # in flight during this step's gathers
                return (gather_add(acc, *cur), *nxt)
            acc, *_ = lax.fori_loop(0, n_steps, step, (acc, *lists(rows, cnt, 0)))
        else:
            acc = lax.fori_loop(0, n_steps, lambda i, acc: gather_add(acc, *lists(rows, cnt, i)), acc)
        plgpu.store(y_ref.at[rows[:, None], col[None, :]], acc.astype(y_ref.dtype))
        return carry

    lax.fori_loop(0, chunk // bt, block, 0)


def _check(m: int, d: int, width: int, ds: int, bt: int, kc: int, n_chunks: int) -> None:
    for name, v in (("ds", ds), ("bt", bt), ("kc", kc)):
        if not is_pow2(v):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if d % ds or m % (n_chunks * bt) or width % kc:
        raise ValueError(f"shapes M {m}, D {d}, width {width} must be multiples of n_chunks*bt "
                         f"{n_chunks * bt}, ds {ds} and kc {kc}")


@functools.partial(jax.jit, static_argnames=("ds", "bt", "kc", "n_chunks", "warps", "prefetch",
                                             "interpret"))
def slice_down(idx, h, cnt, w, *, ds=16, bt=32, kc=8, n_chunks=1, warps=4, prefetch=False,
               interpret=False):
    """y [M, D] (w's dtype) = sum_e h[t, e] w[idx[t, e]] over e < cnt[t]; fp32 sums."""
    m, width = idx.shape
    n_rows, d = w.shape
    _check(m, d, width, ds, bt, kc, n_chunks)
    if prefetch:  # the last step's prefetch reads one step past the lists (masked off)
        idx, h = (jnp.pad(a, ((0, 0), (0, kc))) for a in (idx, h))
    kern = functools.partial(_down_kernel, ds=ds, bt=bt, kc=kc, chunk=m // n_chunks,
                             n_chunks=n_chunks, prefetch=prefetch)
    return pl.pallas_call(
        kern, grid=((d // ds) * n_chunks,),
        in_specs=[_full(idx.shape), _full(h.shape), _full((m,)), _full((n_rows, d))],
        out_specs=_full((m, d)), out_shape=jax.ShapeDtypeStruct((m, d), w.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="explore_slice_down")(idx, h, cnt, w)


def _up_kernel(idx_ref, cnt_ref, x_ref, u_ref, p_ref, *, ds, bt, kc, chunk, n_chunks):
    pid = pl.program_id(0)
    s, c = pid // n_chunks, pid % n_chunks
    col = s * ds + lax.broadcasted_iota(jnp.int32, (ds,), 0)
    it_bt = lax.broadcasted_iota(jnp.int32, (bt,), 0)
    it_kc = lax.broadcasted_iota(jnp.int32, (kc,), 0)

    def block(b, carry):
        rows = c * chunk + b * bt + it_bt
        cnt = plgpu.load(cnt_ref.at[rows])
        xs = plgpu.load(x_ref.at[rows[:, None], col[None, :]]).astype(jnp.float32)

        def step(i, carry):
            kcol = i * kc + it_kc
            live = kcol[None, :] < cnt[:, None]
            j = plgpu.load(idx_ref.at[rows[:, None], kcol[None, :]], mask=live, other=0)
            rows_u = plgpu.load(u_ref.at[j[:, :, None], col[None, None, :]], mask=live[:, :, None],
                                other=0)
            part = jnp.sum(xs[:, None, :] * rows_u.astype(jnp.float32), axis=2)
            # every lane its own (slice, row, column): distinct addresses, dead lanes hold 0
            plgpu.store(p_ref.at[jnp.broadcast_to(s, (bt, kc)), rows[:, None], kcol[None, :]], part)
            return carry

        lax.fori_loop(0, (jnp.max(cnt) + kc - 1) // kc, step, 0)
        return carry

    lax.fori_loop(0, chunk // bt, block, 0)


@functools.partial(jax.jit, static_argnames=("ds", "bt", "kc", "n_chunks", "warps", "interpret"))
def slice_up(idx, cnt, x, u, *, ds=64, bt=64, kc=4, n_chunks=8, warps=4, interpret=False):
    """[M, width] f32: x[t] . u[idx[t, e]] for e < cnt[t], else 0 (per-slice partials, summed)."""
    m, width = idx.shape
    n_rows, d = u.shape
    _check(m, d, width, ds, bt, kc, n_chunks)
    n_slices = d // ds
    kern = functools.partial(_up_kernel, ds=ds, bt=bt, kc=kc, chunk=m // n_chunks, n_chunks=n_chunks)
    part = pl.pallas_call(
        kern, grid=(n_slices * n_chunks,),
        in_specs=[_full((m, width)), _full((m,)), _full((m, d)), _full((n_rows, d))],
        out_specs=_full((n_slices, m, width)),
        out_shape=jax.ShapeDtypeStruct((n_slices, m, width), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="explore_slice_up")(idx, cnt, x, u)
    live = jnp.arange(width)[None, :] < cnt[:, None]  # columns no step reached are unwritten
    return jnp.where(live, part.sum(0), 0.0)


def _token_kernel(idx_ref, h_ref, cnt_ref, w_ref, y_ref, *, d):
    zero = jnp.int32(0)  # a traced index: refs reject Python ints

    def step(e, acc):
        j = idx_ref[zero, e]
        return acc + h_ref[zero, e] * plgpu.load(w_ref.at[j, pl.ds(0, d)]).astype(jnp.float32)

    acc = lax.fori_loop(0, cnt_ref[zero], step, jnp.zeros((d,), jnp.float32))
    plgpu.store(y_ref.at[zero, pl.ds(0, d)], acc.astype(y_ref.dtype))


@functools.partial(jax.jit, static_argnames=("interpret",))
def token_down(idx, h, cnt, w, *, interpret=False):
    """The per-token design's down product (one program per token gathers its whole rows)."""
    m, width = idx.shape
    d = w.shape[1]
    if not is_pow2(d):
        raise ValueError(f"token_down wants a power-of-two D, got {d}")
    return pl.pallas_call(
        functools.partial(_token_kernel, d=d), grid=(m,),
        in_specs=[pl.BlockSpec((1, width), lambda i: (i, 0)), pl.BlockSpec((1, width), lambda i: (i, 0)),
                  pl.BlockSpec((1,), lambda i: (i,)), _full(w.shape)],
        out_specs=pl.BlockSpec((1, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, d), w.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="explore_token_down")(idx, h, cnt, w)


def down_reference(idx, h, cnt, w):
    live = jnp.arange(idx.shape[1])[None, :] < cnt[:, None]
    return jnp.einsum("me,med->md", jnp.where(live, h, 0.0), w.astype(jnp.float32)[idx],
                      precision=lax.Precision.HIGHEST).astype(w.dtype)


def up_reference(idx, cnt, x, u):
    live = jnp.arange(idx.shape[1])[None, :] < cnt[:, None]
    p = jnp.einsum("md,med->me", x.astype(jnp.float32), u.astype(jnp.float32)[idx],
                   precision=lax.Precision.HIGHEST)
    return jnp.where(live, p, 0.0)


def uniform_lists(key, m: int, n_rows: int, k: float, width: int):
    """idx [M, width] int32 (ascending per row, 0 past the count), cnt [M] (at most width)."""
    on = jax.random.uniform(key, (m, n_rows)) < k / n_rows
    ids = jnp.sort(jnp.where(on, jnp.arange(n_rows)[None, :], n_rows), axis=1)[:, :width]
    cnt = jnp.minimum(on.sum(1), width).astype(jnp.int32)
    return jnp.where(jnp.arange(width)[None, :] < cnt[:, None], ids, 0).astype(jnp.int32), cnt


def _median_ms(fn, *args, n: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


DOWN_VARIANTS = (  # (ds, bt, kc, n_chunks, warps, prefetch)
    (64, 64, 4, 8, 4, False), (64, 128, 2, 16, 4, False), (32, 64, 4, 4, 4, False),
    (32, 64, 4, 16, 4, False), (16, 64, 4, 2, 4, False), (16, 16, 8, 8, 4, False),
    (16, 32, 8, 1, 4, False), (16, 128, 4, 2, 8, True), (16, 256, 4, 1, 16, True),
    (8, 128, 8, 1, 16, True))
UP_VARIANTS = ((64, 64, 4, 8, 4), (64, 32, 8, 4, 4), (32, 32, 8, 2, 4))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=float, nargs="+", default=None,
                   help="mean active neurons per token (default 29; 5 with --interpret)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="tiny shapes through the Pallas interpreter (CPU)")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    args.k = args.k or ([5.0] if args.interpret else [29.0])
    if any(not 0 < k for k in args.k) or args.repeats < 1:
        p.error("--k must be positive and --repeats >= 1")
    if args.interpret:
        m, d, n_rows, width = 64, 64, 128, 16
        down_variants = ((16, 16, 4, 2, 4, False), (8, 8, 8, 1, 4, True), (32, 32, 4, 1, 4, False))
        up_variants = ((16, 16, 4, 2, 4),)
    else:
        if jax.default_backend() != "gpu":
            p.error("needs a GPU (or --interpret)")
        m, d, n_rows, width = 16384, 2048, 5632, 64
        down_variants, up_variants = DOWN_VARIANTS, UP_VARIANTS
    if any(k > width for k in args.k):
        p.error(f"--k must be at most {width} (the lists' width)")
    key = jax.random.PRNGKey(0)
    scale = 1.0 / np.sqrt(d)
    w = (jax.random.normal(key, (n_rows, d)) * scale).astype(jnp.bfloat16)
    u = (jax.random.normal(jax.random.fold_in(key, 1), (n_rows, d)) * scale).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 2), (m, d)).astype(jnp.bfloat16)
    timed = (lambda fn, *a: float("nan")) if args.interpret else \
        (lambda fn, *a: _median_ms(fn, *a, n=args.repeats))
    rows = []

    def add(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for k in args.k:
        idx, cnt = uniform_lists(jax.random.fold_in(key, int(k * 10)), m, n_rows, k, width)
        h = jax.random.normal(jax.random.fold_in(key, 3), (m, width), jnp.float32)
        live = jnp.arange(width)[None, :] < cnt[:, None]
        h_dense = jnp.zeros((m, n_rows), jnp.bfloat16).at[jnp.arange(m)[:, None], idx].add(
            jnp.where(live, h, 0.0).astype(jnp.bfloat16))
        ref_y, ref_u = down_reference(idx, h, cnt, w), up_reference(idx, cnt, x, u)
        base = dict(k=k, mean_count=float(cnt.mean()))
        add(**base, what="xla_dense", ms=timed(jax.jit(jnp.matmul), h_dense, w))
        y = token_down(idx, h, cnt, w, interpret=args.interpret)
        add(**base, what="per_token", ms=timed(token_down, idx, h, cnt, w),
            max_err=float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref_y.astype(jnp.float32)))))
        for ds, bt, kc, nc, warps, pf in down_variants:
            fn = functools.partial(slice_down, ds=ds, bt=bt, kc=kc, n_chunks=nc, warps=warps,
                                   prefetch=pf, interpret=args.interpret)
            y = fn(idx, h, cnt, w)
            add(**base, what="slice_down", ds=ds, bt=bt, kc=kc, n_chunks=nc, warps=warps, prefetch=pf,
                programs=(d // ds) * nc, ms=timed(fn, idx, h, cnt, w),
                max_err=float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref_y.astype(jnp.float32)))))
        for ds, bt, kc, nc, warps in up_variants:
            fn = functools.partial(slice_up, ds=ds, bt=bt, kc=kc, n_chunks=nc, warps=warps,
                                   interpret=args.interpret)
            add(**base, what="slice_up", ds=ds, bt=bt, kc=kc, n_chunks=nc, warps=warps,
                programs=(d // ds) * nc, ms=timed(fn, idx, cnt, x, u),
                max_err=float(jnp.max(jnp.abs(fn(idx, cnt, x, u) - ref_u))))
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  shape=dict(m=m, d=d, h=n_rows, width=width), rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "explore_slice_kernel.json").write_text(json.dumps(result, indent=1))
    print("\n| k | what | ds | bt | kc | chunks | warps | prefetch | ms | max err |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['what']} | {r.get('ds', '')} | {r.get('bt', '')} | {r.get('kc', '')} | "
              f"{r.get('n_chunks', '')} | {r.get('warps', '')} | {r.get('prefetch', '')} | {r['ms']:.3f} | "
              f"{r.get('max_err', '')} |")
    return result


if __name__ == "__main__":
    main()
