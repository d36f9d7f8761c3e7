"""Neuron-major backward kernel (Pallas, Triton backend): the weight gradients from neuron-major lists.

Input: the backward's per-entry values sorted by neuron (a CSR: neuron j owns the entries
[start_j, start_j + count_j) of `tokens_E` and of each value array, tokens ascending), and the
token rows x [M, D], gy [M, D]. For every neuron j:

    gated:      dW_down_j = sum_e t_e gy_{i_e}    dW_up_j = sum_e d_up_e x_{i_e}    dW_gate_j = sum_e d_gate_e x_{i_e}
    non-gated:  dW_down_j = sum_e t_e gy_{i_e}    dW_act_j = sum_e d_act_e x_{i_e}

plus an optional f32 `init` row per output (the dense tails' contributions), so each gradient is
rounded once. One program handles `block_n` neurons; per entry it gathers x_i and gy_i once (x_i
serves both dW_up and dW_gate), accumulates in fp32 registers in list order (fixed, so the result
is deterministic) and writes the rows in the weights' dtype. Neurons with count 0 (no entry, or
"hot" neurons that the caller handles in a dense tail) write their init row (or 0).

Launch order (`NeuronBwdBlockSizes.longest_first`, default on): program p takes the p-th neuron of
`longest_first_order` (by decreasing bit length of its count, ties by index) instead of neuron p.
A program's time grows with its neuron's list, and on a trained pattern the lists are very unequal
(skewed neurons); programs start in id order, so the longest lists start first and the short ones
fill in behind them instead of a few long ones running alone at the end. Each neuron's sums are
the same whatever the order (bit for bit).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .common import (check_launch_sizes, compiler_params, is_pow2 as _is_pow2,
                                   next_pow2 as _next_pow2, pad_rows, round_up)




@dataclasses.dataclass(frozen=True)
class NeuronBwdBlockSizes:
    """Static launch parameters of the neuron-major backward kernel."""

    # One neuron per program, 4 warps: the fastest of block_n 1/2/4 x 2/4/8 warps on the H100 at
    # k 29 (2 or 8 warps and 2 or more neurons per program were slower; BENCHMARKS.md,
    # experiments/bench_ffn_train.py --sweep-blocks).
    block_n: int = 1  # neurons per program (power of two)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # pipelining depth of the entry loop (dynamic trip counts: 1 = none)
    longest_first: bool = True  # programs take the neurons by decreasing count (module doc)

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_n) or self.block_n > 64:
            raise ValueError(f"NeuronBwdBlockSizes.block_n must be a power of two <= 64, got {self.block_n}")
        if not isinstance(self.longest_first, bool):
            raise ValueError(f"NeuronBwdBlockSizes.longest_first must be a bool, got {self.longest_first!r}")
        check_launch_sizes(self)


def longest_first_order(count_H: jax.Array, max_count: int) -> jax.Array:
    """int32 [H]: the neurons by decreasing bit length of their count (counts 2^b .. 2^(b+1) - 1
    share bucket b + 1, count 0 is bucket 0), ascending by index inside a bucket: a permutation,
    deterministic. Counts above `max_count` (the caller's bound, M for a neuron's entries over M
    tokens; none in valid lists) join the top bucket.

    Buckets within a factor of two are longest-first enough for the launch order (the longest
    lists still start first), and a key of at most 32 values needs no comparison sort: a counting
    sort is a cumsum over a [buckets, H] one-hot (each neuron's place in its bucket) plus the
    buckets' starts, then ONE scatter of the ids to their places: small elementwise and scan
    fusions. It replaces XLA's comparison sort (`argsort`: several kernels, each a sorting
    network over the whole array); a single-operand sort of a combined (key, index) int32 would
    still be that sort. What the transpose computes (count_H, the per-chunk histograms, start_H's
    cumsum over H) holds no order by count; only its scan could be shared, at the price of tying
    the transpose to this launch order (and its counts include the hot neurons skipped here)."""
    h = count_H.shape[0]
    if h == 0:
        return jnp.zeros((0,), jnp.int32)
    n_buckets = max_count.bit_length() + 1
    bits_H = jnp.minimum(32 - lax.clz(jnp.maximum(count_H, 0)), n_buckets - 1)  # bit length
    key_H = (n_buckets - 1) - bits_H  # 0 = the longest lists
    one_BxH = (key_H[None, :] == lax.broadcasted_iota(jnp.int32, (n_buckets, h), 0)).astype(jnp.int32)
    upto_BxH = jnp.cumsum(one_BxH, axis=1)  # members of the bucket at or before each neuron
    size_B = upto_BxH[:, -1]
    first_B = jnp.cumsum(size_B) - size_B
    place_H = first_B[key_H] + jnp.take_along_axis(upto_BxH, key_H[None, :], axis=0)[0] - 1
    return jnp.zeros((h,), jnp.int32).at[place_H].set(jnp.arange(h, dtype=jnp.int32),
                                                      unique_indices=True)


def _neuron_bwd_kernel(*refs, gated: bool, has_init: bool, ordered: bool, d: int, d_block: int) -> None:
    """Refs: (ordered: the program's neurons [BN]), x, gy [M, D], start, count ([BN], ordered: [H]),
    tokens [E], values (gated: t, d_up, d_gate; else t, d_act) [E], (init rows per output: [BN, D]
    f32, ordered [H, D]); outputs in order (act, (up), down): [BN, D], ordered [H, D] (each
    program writes its neurons' rows)."""
    n_out = 3 if gated else 2
    refs = list(refs)
    order_ref = refs.pop(0) if ordered else None
    x_ref, gy_ref, start_ref, count_ref, tokens_ref, *rest = refs
    value_refs, rest = rest[:n_out], rest[n_out:]
    init_refs = rest[:n_out] if has_init else ()
    out_refs = rest[n_out:] if has_init else rest
    col_D = lax.broadcasted_iota(jnp.int32, (d_block,), 0)
    col_ok_1xD = (col_D < d)[None, :]
    col_1xD = col_D[None, :]
    full_d = d == d_block
    if ordered:
        j_BN = order_ref[...]
        block_n = j_BN.shape[0]
        start_BN = plgpu.load(start_ref.at[j_BN])
        count_BN = plgpu.load(count_ref.at[j_BN])
    else:
        block_n = start_ref.shape[0]
        start_BN = start_ref[...]
        count_BN = count_ref[...]
    if gated:
        t_ref, d_up_ref, d_gate_ref = value_refs
    else:
        t_ref, d_act_ref = value_refs

    def gather(ref, i_BN, live_BN):
        return plgpu.load(ref.at[i_BN[:, None], col_1xD], mask=live_BN[:, None] & col_ok_1xD,
                          other=0).astype(jnp.float32)

    def entry_step(e, accs):
        live_BN = e < count_BN
        # Dead lanes point at entry 0: in bounds, and the masked load moves nothing.
        idx_BN = jnp.where(live_BN, start_BN + e, 0)
        i_BN = plgpu.load(tokens_ref.at[idx_BN], mask=live_BN, other=0)
        x_rows = gather(x_ref, i_BN, live_BN)
        gy_rows = gather(gy_ref, i_BN, live_BN)

        def value(ref):
            return plgpu.load(ref.at[idx_BN], mask=live_BN, other=0.0)[:, None]

        if gated:
            acc_act, acc_up, acc_down = accs
            return (acc_act + value(d_gate_ref) * x_rows, acc_up + value(d_up_ref) * x_rows,
                    acc_down + value(t_ref) * gy_rows)
        acc_act, acc_down = accs
        return acc_act + value(d_act_ref) * x_rows, acc_down + value(t_ref) * gy_rows

    rows_mask = None if full_d else jnp.broadcast_to(col_ok_1xD, (block_n, d_block))

    def rows(ref):  # this program's rows of an [H, D] (ordered) or [BN, D] ref
        return ref.at[j_BN[:, None], col_1xD] if ordered else ref.at[:, pl.ds(0, d_block)]

    if has_init:
        init = tuple(plgpu.load(rows(r), mask=rows_mask, other=None if full_d else 0.0) for r in init_refs)
    else:
        init = tuple(jnp.zeros((block_n, d_block), jnp.float32) for _ in range(n_out))
    accs = lax.fori_loop(0, jnp.max(count_BN), entry_step, init)
    for ref, acc in zip(out_refs, accs):
        plgpu.store(rows(ref), acc.astype(ref.dtype), mask=rows_mask)


def validate_neuron_bwd_args(x_MxD, gy_MxD, start_H, count_H, tokens_E, values_E, init) -> None:
    """Raise ValueError naming the offending argument."""
    if x_MxD.ndim != 2:
        raise ValueError(f"x_MxD must be 2-D [M, D], got shape {x_MxD.shape}")
    if gy_MxD.shape != x_MxD.shape or gy_MxD.dtype != x_MxD.dtype:
        raise ValueError(f"gy_MxD must be {x_MxD.dtype}{x_MxD.shape} like x_MxD, got "
                         f"{gy_MxD.dtype}{gy_MxD.shape}")
    if start_H.ndim != 1 or start_H.dtype != jnp.int32:
        raise ValueError(f"start_H must be int32 [H], got {start_H.dtype}{start_H.shape}")
    if count_H.shape != start_H.shape or count_H.dtype != jnp.int32:
        raise ValueError(f"count_H must be int32 {start_H.shape}, got {count_H.dtype}{count_H.shape}")
    if tokens_E.ndim != 1 or tokens_E.dtype != jnp.int32 or tokens_E.shape[0] < 1:
        raise ValueError(f"tokens_E must be int32 [E >= 1], got {tokens_E.dtype}{tokens_E.shape}")
    if len(values_E) not in (2, 3):
        raise ValueError(f"values_E must hold 3 (gated: t, d_up, d_gate) or 2 (t, d_act) arrays, "
                         f"got {len(values_E)}")
    for v in values_E:
        if v.ndim != 1 or v.shape != values_E[0].shape or v.dtype != jnp.float32 or v.shape[0] < 1:
            raise ValueError(f"values_E must be f32 [E' >= 1], all of one length, got "
                             f"{[(w.dtype, w.shape) for w in values_E]}")
    if init is not None:
        want = (start_H.shape[0], x_MxD.shape[1])
        if len(init) != len(values_E) or any(r.shape != want or r.dtype != jnp.float32 for r in init):
            raise ValueError(f"init must be None or {len(values_E)} f32 {want} arrays, got "
                             f"{[(r.dtype, r.shape) for r in init]}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "debug"))
def neuron_backward(x_MxD: jax.Array, gy_MxD: jax.Array, start_H: jax.Array, count_H: jax.Array,
                    tokens_E: jax.Array, values_E: tuple[jax.Array, ...],
                    init: tuple[jax.Array, ...] | None = None, *,
                    block_sizes: NeuronBwdBlockSizes = NeuronBwdBlockSizes(),
                    interpret: bool = False, debug: bool = False) -> tuple[jax.Array, ...]:
    """Weight gradients from neuron-major lists (module doc): (dW_act, dW_up, dW_down) for 3 value
    arrays (t, d_up, d_gate), (dW_act, dW_down) for 2 (t, d_act); each [H, D] in x's dtype.
    tokens_E and the value arrays may be of different lengths, each longer than the lists (the
    transpose's and the token-major kernel's outputs with their padding, `padded=True`): only
    positions [start_j, start_j + count_j) are read."""
    validate_neuron_bwd_args(x_MxD, gy_MxD, start_H, count_H, tokens_E, values_E, init)
    gated = len(values_E) == 3
    h = start_H.shape[0]
    d = x_MxD.shape[1]
    bn = block_sizes.block_n
    h_pad = round_up(h, bn)
    # Padded neurons have count 0: they read nothing and write zeros.
    start_H, count_H = pad_rows(h_pad, start_H, count_H)
    if init is not None:
        init = pad_rows(h_pad, *init)
    n_out = len(values_E)
    ordered = block_sizes.longest_first
    kernel = functools.partial(_neuron_bwd_kernel, gated=gated, has_init=init is not None, ordered=ordered,
                               d=d, d_block=_next_pow2(d))
    full = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)  # noqa: E731
    row_spec = pl.BlockSpec((bn, d), lambda j: (j, 0))
    vec_spec = pl.BlockSpec((bn,), lambda j: (j,))
    init = tuple(init) if init is not None else ()
    out_shape = [jax.ShapeDtypeStruct((h_pad, d), x_MxD.dtype)] * n_out
    if ordered:
        # The longest lists first; the padded neurons (count 0) in the last bucket.
        order = longest_first_order(count_H, x_MxD.shape[0])
        in_specs = [vec_spec, full(x_MxD), full(gy_MxD), full(start_H), full(count_H), full(tokens_E),
                    *[full(v) for v in values_E], *[full(r) for r in init]]
        out_specs = [full(o) for o in out_shape]
        operands = (order,)
    else:
        in_specs = [full(x_MxD), full(gy_MxD), vec_spec, vec_spec, full(tokens_E),
                    *[full(v) for v in values_E], *[row_spec] * len(init)]
        out_specs = [row_spec] * n_out
        operands = ()
    outs = pl.pallas_call(
        kernel,
        grid=(h_pad // bn,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_bwd_neuron_gated" if gated else "twell_bwd_neuron",
    )(*operands, x_MxD, gy_MxD, start_H, count_H, tokens_E, *values_E, *init)
    return tuple(o[:h] for o in outs)


@jax.jit
def neuron_backward_reference(x_MxD: jax.Array, gy_MxD: jax.Array, start_H: jax.Array,
                              count_H: jax.Array, tokens_E: jax.Array,
                              values_E: tuple[jax.Array, ...],
                              init: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, ...]:
    """Plain-jnp version of `neuron_backward` (fp32, entries owned by no neuron ignored; tokens_E
    and values_E cut to their common length, past which no neuron owns an entry)."""
    e = min(tokens_E.shape[0], values_E[0].shape[0])
    tokens_E, values_E = tokens_E[:e], tuple(v[:e] for v in values_E)
    e_idx = jnp.arange(e)
    # Owner neuron of each entry (H: none); CSR ranges do not overlap.
    owned_HxE = (e_idx[None, :] >= start_H[:, None]) & (e_idx[None, :] < (start_H + count_H)[:, None])
    hi = lax.Precision.HIGHEST
    x_rows = x_MxD.astype(jnp.float32)[tokens_E]
    gy_rows = gy_MxD.astype(jnp.float32)[tokens_E]
    sources = (x_rows, x_rows, gy_rows) if len(values_E) == 3 else (x_rows, gy_rows)
    # values order (t, d_up, d_gate) / (t, d_act) -> outputs (act, up, down) / (act, down)
    ordered = (values_E[2], values_E[1], values_E[0]) if len(values_E) == 3 else (values_E[1], values_E[0])
    outs = []
    for k, (v_E, rows) in enumerate(zip(ordered, sources)):
        acc = jnp.einsum("he,ed->hd", jnp.where(owned_HxE, v_E[None, :], 0.0), rows, precision=hi)
        if init is not None:
            acc = acc + init[k]
        outs.append(acc.astype(x_MxD.dtype))
    return tuple(outs)
