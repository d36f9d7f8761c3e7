"""Decode-size sparse FFN kernels (Pallas, Triton backend): work spread over the active neurons.

At 1 to a few hundred tokens per call, one program per token (twell_ffn) puts the whole call on a
few SMs. Here the unit of work is the active NEURON instead, and each active neuron's U and W rows
are read from HBM once per call, whatever the number of tokens M:

    compact_active   active flags [L] -> order [L] int32 (a stable partition: active neuron ids
                     ascending, then the inactive ones) and n [1] int32 = number of actives.
                     One program: in-kernel cumsum, every lane stores to its own distinct slot
                     (a permutation: no mask, no atomics).
    compact_active_rows  the same from the gate's product g [B, H] itself: the per-neuron count of
                     rows with g > 0 (the union's flags) and the number of active (row, neuron)
                     pairs computed in the same one-program kernel (one launch fewer than an XLA
                     reduction followed by compact_active).
    hidden           grid (C / block_n, M / block_m): program c gathers the U rows of the active
                     neurons order[c*bn : (c+1)*bn] and computes, for all its tokens,
                     u = x U_c^T (tensor-core dot, fp32 accumulation over D in block_k steps) and
                     h = round(relu(g[:, order_c]) * u) into h [M, C]. relu(g) = 0 exactly for a
                     token on which the neuron is silent, so h is masked per token for free.
                     Programs whose chunk starts at or past n run no K loop and store zeros.
    down             grid (D / block_d, M / block_m): y[:, dblock] = h[:, :n] . W[order[:n], dblock]
                     with a dynamic K loop over ceil(n / block_h) neuron steps. No split over the
                     neurons, so no partial outputs, no reduction pass, no atomics.
    tiles            `sparse_decode_ffn_tiles`: the fused kernel over the sparse gate's tile lists
                     (decode_matvec.py, tile_lists=True: each column tile's active neurons packed in
                     the gate product's epilogue, TwELL) instead of `compact_active`'s one list; each
                     step of block_h list positions finds its tiles from an in-register prefix sum of
                     the tiles' counts. No compaction launch; x may be normalised on load.
    down_tiles       `sparse_decode_down_tiles`: the down product over the gate's tile lists AND their
                     packed hidden values (decode_matvec.py, tile_values=True: the gate's launch
                     computed each listed neuron's h from its W_up row), the residual in the
                     epilogue; grid (D / block_d, M / block_m), each step of block_h list positions
                     loads their values and W_down rows (no up product here). The model's decode step
                     at one row (decode.sparse_ffn "packed").
    fused            `sparse_decode_ffn_fused`: hidden and down in ONE launch, grid (D / block_d,
                     M / block_m); program (j, i) walks the active list in block_h steps and, per
                     step, computes those neurons' h itself (the U rows . x loop over D in block_k
                     steps, rounded where `hidden` rounds it) before adding h . W[order, dblock];
                     an optional residual is added in fp32 before the one rounding of y. It trades
                     redundant hidden work (each of the D / block_d programs recomputes all of h;
                     the U rows then come from L2) for one launch fewer and no h round trip
                     through HBM. Meant for decode's few active neurons, where the two launches
                     are latency-bound (H100, 0.5b, batch 1: faster a layer than `hidden` and
                     `down` plus the residual's XLA add, and the model's step faster with it in an
                     earlier build: git history of BENCHMARKS.md, not a current figure). It loses with
                     many actives: each program runs
                     ceil(n / block_h) x ceil(D / block_k) sequential steps that `hidden` spreads
                     over C / block_n programs.

Rounding follows the op's dense formula (twell_jax/ops/dense.py): g and u in fp32, h rounded once to the
activation dtype, y accumulated in fp32 and rounded once. Deterministic: every loop has a fixed
order and nothing is accumulated across programs.

Non-gated FFN: h = round(relu(g[:, order])) (no U rows); the caller builds it and runs `down` only
(`sparse_decode_ffn` with w_up_HxD=None does that; the fused kernel gathers it in place).

Capacity: the kernels read only order[:min(n, C)] for a static C (a multiple of
max(block_n, block_h)); h is [M, C]. Actives beyond C are NOT read here: the caller checks
n <= C (twell_jax/ops/pallas_decode.py falls back to the exact dense formula otherwise). No operand
is padded: rows >= M, columns >= D and dead list entries are masked lanes of the gathers.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .common import (check_launch_sizes, compiler_params, is_pow2 as _is_pow2, rows_inv_rms,
                     next_pow2 as _next_pow2, round_up, store_partition)
from .twell_pack import _dot_precision


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Static launch parameters of the decode kernels. block_k and num_stages are the best of the
    `bench_ffn_decode.py --sweep` variants on the H100 (BENCHMARKS.md: faster than 128 / 2 at 1
    and 8 tokens per call); the rest spread a one-token call over >= 32 programs in `down`."""

    block_n: int = 16  # hidden: active neurons per program (power of two, >= 16 for the dot)
    block_k: int = 512  # hidden: D step of the u = x U^T loop (power of two, >= 16)
    block_h: int = 32  # down: active neurons per K step (power of two, >= 16)
    block_d: int = 64  # down: output columns per program (power of two, >= 16)
    max_block_m: int = 64  # both: token rows per program, at most (power of two, >= 16)
    num_warps: int = 4  # warps per program (both kernels)
    num_stages: int = 1  # software-pipelining depth of the K loops

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "block_h", "block_d", "max_block_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not _is_pow2(value) or value < 16:
                raise ValueError(f"DecodeBlockSizes.{name} must be a power of two >= 16, got {value!r}")
        check_launch_sizes(self)

    @property
    def chunk(self) -> int:
        """The capacity C must be a multiple of this (both kernels step through order_C)."""
        return max(self.block_n, self.block_h)

    def block_m(self, m: int) -> int:
        """Token rows per program for a call with m tokens (>= 16: tensor-core dot minimum)."""
        return max(16, min(self.max_block_m, _next_pow2(m)))


# ----------------------------------------------------------------------------------------------
# compact_active
# ----------------------------------------------------------------------------------------------

def _compact_kernel(active_ref, order_ref, n_ref, *, h: int) -> None:
    """Refs: active [H] (non-zero = active), order [L] int32, n [1] int32. One program."""
    lane_L = lax.broadcasted_iota(jnp.int32, (order_ref.shape[0],), 0)
    # Lanes >= H (padding to a power of two) are inactive; their (masked) addresses are clamped.
    active_L = plgpu.load(active_ref.at[jnp.minimum(lane_L, h - 1)], mask=lane_L < h, other=0) != 0
    store_partition(active_L, order_ref, n_ref, h=h)


def _compact_rows_kernel(g_ref, order_ref, n_ref, pairs_ref, *, b: int, h: int, block_r: int) -> None:
    """Refs: g [B, H] f32 (whole), order [L] int32, n [1] int32, pairs [1] int32. One program:
    count_L = the rows with g > 0 per neuron, accumulated over a static loop of block_r-row loads
    (rows >= B and lanes >= H masked, read as 0: never > 0); then `compact_active`'s partition of
    count_L > 0, and pairs = sum(count_L)."""
    length = order_ref.shape[0]
    lane_L = lax.broadcasted_iota(jnp.int32, (length,), 0)
    row_R = lax.broadcasted_iota(jnp.int32, (block_r,), 0)
    count_L = jnp.zeros((length,), jnp.int32)
    for first in range(0, b, block_r):
        rows_R = first + row_R
        # Masked lanes' addresses are clamped into g (interpret mode gathers them all).
        g_RxL = plgpu.load(g_ref.at[jnp.minimum(rows_R, b - 1)[:, None], jnp.minimum(lane_L, h - 1)[None, :]],
                           mask=(rows_R < b)[:, None] & (lane_L < h)[None, :], other=0.0)
        count_L = count_L + jnp.sum((g_RxL > 0).astype(jnp.int32), axis=0)
    pairs_ref[...] = jnp.broadcast_to(jnp.sum(count_L), (1,))
    store_partition(count_L > 0, order_ref, n_ref, h=h)


def _compact_compiler_params(length: int) -> plgpu.CompilerParams:
    """The compaction kernels' launch: ~16 lanes per thread at H = 5632 (L = 8192), so six live
    [L] vectors stay in registers."""
    return plgpu.CompilerParams(num_warps=max(1, min(16, length // 512)), num_stages=1)


@functools.partial(jax.jit, static_argnames=("interpret", "debug"))
def compact_active(active_H: jax.Array, *, interpret: bool = False,
                   debug: bool = False) -> tuple[jax.Array, jax.Array]:
    """Stable partition of the active neurons: (order [L] int32, n [1] int32), L = next_pow2(H).

    order[:n] are the active neuron ids ascending, order[n:] the inactive ones (clamped to H - 1
    for the padding lanes >= H). active_H: bool or int [H], non-zero = active (e.g. the per-neuron
    count of active tokens: no conversion pass needed)."""
    if active_H.ndim != 1 or active_H.shape[0] < 1:
        raise ValueError(f"active_H must be 1-D [H] with H >= 1, got shape {active_H.shape}")
    if active_H.dtype == jnp.bool_:
        active_H = active_H.astype(jnp.int32)  # Triton refs hold no i1
    h = active_H.shape[0]
    length = _next_pow2(h)
    return pl.pallas_call(
        functools.partial(_compact_kernel, h=h),
        grid=(1,),
        in_specs=[pl.BlockSpec((h,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((length,), lambda i: (0,)), pl.BlockSpec((1,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((length,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)],
        compiler_params=_compact_compiler_params(length),
        interpret=interpret,
        debug=debug,
        name="twell_decode_compact",
    )(active_H)


@jax.jit
def compact_active_reference(active_H: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp `compact_active` (same prefix-sum partition, XLA cumsum + scatter): same outputs."""
    h = active_H.shape[0]
    length = _next_pow2(h)
    one_L = jnp.pad((active_H != 0).astype(jnp.int32), (0, length - h))
    lane_L = jnp.arange(length, dtype=jnp.int32)
    n = jnp.sum(one_L)
    active_before_L = jnp.cumsum(one_L) - one_L
    slot_L = jnp.where(one_L > 0, active_before_L, n + lane_L - active_before_L)
    order_L = jnp.zeros((length,), jnp.int32).at[slot_L].set(jnp.minimum(lane_L, h - 1),
                                                              unique_indices=True)
    return order_L, n.reshape(1)


def _check_rows_arg(g_BxH: jax.Array) -> None:
    if g_BxH.ndim != 2 or g_BxH.dtype != jnp.float32 or min(g_BxH.shape) < 1:
        raise ValueError(f"g_BxH must be float32 [B, H] with B >= 1 and H >= 1, got {g_BxH.dtype}{g_BxH.shape}")


@functools.partial(jax.jit, static_argnames=("interpret", "debug"))
def compact_active_rows(g_BxH: jax.Array, *, interpret: bool = False,
                        debug: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`compact_active` of the union of the rows' active neurons, from the gate's product itself:
    (order [L] int32, n [1] int32, pairs [1] int32), L = next_pow2(H); order and n as
    `compact_active(sum(g_BxH > 0, axis=0))`, pairs = the number of (row, neuron) with g > 0.

    One launch: the per-neuron count over the rows (an XLA reduction with its own launch before)
    is computed inside the compaction kernel. g_BxH: float32 [B, H], finite (a NaN is not > 0
    here, but NaN is outside the contract); -0.0 and 0.0 are not active."""
    _check_rows_arg(g_BxH)
    b, h = g_BxH.shape
    length = _next_pow2(h)
    # Rows per load: ~16 lanes per thread (512 per warp), at least one row, at most B padded.
    params = _compact_compiler_params(length)
    block_r = max(1, min(_next_pow2(b), 512 * params.num_warps // length))
    one = pl.BlockSpec((1,), lambda i: (0,))
    return pl.pallas_call(
        functools.partial(_compact_rows_kernel, b=b, h=h, block_r=block_r),
        grid=(1,),
        in_specs=[pl.BlockSpec((b, h), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((length,), lambda i: (0,)), one, one],
        out_shape=[jax.ShapeDtypeStruct((length,), jnp.int32)] + [jax.ShapeDtypeStruct((1,), jnp.int32)] * 2,
        compiler_params=params,
        interpret=interpret,
        debug=debug,
        name="twell_decode_compact_rows",
    )(g_BxH)


@jax.jit
def compact_active_rows_reference(g_BxH: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp `compact_active_rows` (`compact_active_reference` of the per-neuron counts): same
    outputs."""
    _check_rows_arg(g_BxH)
    count_H = jnp.sum(g_BxH > 0, axis=0, dtype=jnp.int32)
    order_L, n = compact_active_reference(count_H)
    return order_L, n, jnp.sum(count_H).reshape(1)


# ----------------------------------------------------------------------------------------------
# hidden and down
# ----------------------------------------------------------------------------------------------

def _up_product(x_ref, w_up_ref, rows_BM: jax.Array, row_ok_BM: jax.Array, w_rows_BN: jax.Array,
                live_BN: jax.Array, trips: jax.Array, *, d: int, block_k: int,
                precision: lax.Precision, norm: tuple | None = None) -> jax.Array:
    """u [BM, BN] fp32 = x[rows] . w_up[w_rows]^T, a loop of `trips` (int32) block_k steps over D.
    norm = (inv_rms [BM] fp32, scale_ref [(L*)D] fp32, first int32): each x tile is RMS-normalised
    on load as decode_matvec's prologue does it (x * inv_rms * scale[first + cols], rounded to x's
    dtype), so x is the layer's un-normalised input.
    Gathers index with two broadcast int arrays (rows x columns): the interpret-mode discharge does
    not support mixing an int-array index with a slice. Masked lanes (dead neurons, rows >= M,
    columns >= D) move no bytes, so x and the weights need no padding."""
    col_BK = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def k_step(k, acc_BMxBN):
        cols_BK = k * block_k + col_BK
        col_ok_BK = cols_BK < d
        x_BMxBK = plgpu.load(x_ref.at[rows_BM[:, None], cols_BK[None, :]],
                             mask=row_ok_BM[:, None] & col_ok_BK[None, :], other=0)
        if norm is not None:
            inv_rms_BM, scale_ref, first = norm
            scale_BK = plgpu.load(scale_ref.at[first + cols_BK], mask=col_ok_BK, other=0.0)
            x_BMxBK = (x_BMxBK.astype(jnp.float32) * inv_rms_BM[:, None] * scale_BK[None, :]).astype(x_ref.dtype)
        u_BNxBK = plgpu.load(w_up_ref.at[w_rows_BN[:, None], cols_BK[None, :]],
                             mask=live_BN[:, None] & col_ok_BK[None, :], other=0)
        return acc_BMxBN + lax.dot_general(x_BMxBK, u_BNxBK, (((1,), (1,)), ((), ())),
                                           precision=precision, preferred_element_type=jnp.float32)

    # Both bounds explicitly int32: Triton's scf.for rejects bounds of different types (a weakly
    # typed Python 0 against a traced bound failed on the H100; interpret mode does not check).
    return lax.fori_loop(jnp.int32(0), trips.astype(jnp.int32), k_step,
                         jnp.zeros((rows_BM.shape[0], w_rows_BN.shape[0]), jnp.float32))


def _down_steps(h_of_step, w_down_ref, ids_of_step, n: jax.Array, base: jax.Array, cols_BD: jax.Array, *,
                d: int, block_m: int, block_h: int, precision: lax.Precision) -> jax.Array:
    """acc [BM, BD] fp32 = sum over the active list in block_h steps of h . w_down[base + j, cols]:
    ceil(n / block_h) steps, ids_of_step(t) -> j [BH] (the step's neuron ids, any value on lanes
    past n), h_of_step(t, j_BH, live_BH) -> h [BM, BH] in the weights' dtype (0 on dead lanes).
    No split over the neurons: no partial outputs, no atomics."""
    step_BH = lax.broadcasted_iota(jnp.int32, (block_h,), 0)

    def h_step(t, acc_BMxBD):
        j_BH = ids_of_step(t)
        live_BH = t * block_h + step_BH < n
        w_BHxBD = plgpu.load(w_down_ref.at[(base + j_BH)[:, None], cols_BD[None, :]],
                             mask=live_BH[:, None] & (cols_BD < d)[None, :], other=0)
        return acc_BMxBD + lax.dot_general(h_of_step(t, j_BH, live_BH), w_BHxBD, (((1,), (0,)), ((), ())),
                                           precision=precision, preferred_element_type=jnp.float32)

    # n >= 0: truncation is the ceiling division. Both bounds int32 (see `_up_product`).
    n_steps = lax.div(n + jnp.int32(block_h - 1), jnp.int32(block_h)).astype(jnp.int32)
    return lax.fori_loop(jnp.int32(0), n_steps, h_step, jnp.zeros((block_m, cols_BD.shape[0]), jnp.float32))


def _hidden_kernel(n_ref, layer_ref, order_ref, x_ref, g_ref, w_up_ref, h_ref, *, m: int, d: int, h: int,
                   capacity: int, block_k: int, n_k: int, precision: lax.Precision) -> None:
    """Program (c, i): neurons order[c*BN : (c+1)*BN] x tokens [i*BM, (i+1)*BM).
    Refs: n [1], layer [1] (the weights' rows start at layer * H in a stack; 0 without one),
    order [BN], x [M, D], g [M, H], w_up [(L*)H, D] (the last three whole), h [BM, BN]."""
    block_m, block_n = h_ref.shape
    chunk, row_block = pl.program_id(0), pl.program_id(1)
    # Entries past the capacity are never read.
    n = jnp.minimum(jnp.max(n_ref[...]), jnp.int32(capacity)).astype(jnp.int32)
    base = jnp.max(layer_ref[...]).astype(jnp.int32) * h
    j_BN = order_ref[...]
    live_BN = chunk * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0) < n
    rows_BM = row_block * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    row_ok_BM = rows_BM < m
    # A chunk past the last active neuron runs no K loop (dynamic trip count) and stores zeros.
    trips = jnp.where(chunk * block_n < n, jnp.int32(n_k), jnp.int32(0))
    u_BMxBN = _up_product(x_ref, w_up_ref, rows_BM, row_ok_BM, base + j_BN, live_BN, trips, d=d,
                          block_k=block_k, precision=precision)
    g_BMxBN = plgpu.load(g_ref.at[rows_BM[:, None], j_BN[None, :]],
                         mask=row_ok_BM[:, None] & live_BN[None, :], other=0.0)
    h_ref[...] = (jnp.maximum(g_BMxBN, 0.0) * u_BMxBN).astype(h_ref.dtype)


def _down_kernel(n_ref, layer_ref, order_ref, h_ref, w_down_ref, y_ref, *, d: int, h: int, capacity: int,
                 block_h: int, precision: lax.Precision) -> None:
    """Program (j, i): output columns [j*BD, (j+1)*BD) x tokens [i*BM, (i+1)*BM).
    Refs: n [1], layer [1] (as `_hidden_kernel`), order [>= C] (whole), h [BM, C],
    w_down [(L*)H, D] (whole), y [BM, BD]."""
    block_m, block_d = y_ref.shape
    n = jnp.minimum(jnp.max(n_ref[...]), jnp.int32(capacity)).astype(jnp.int32)
    base = jnp.max(layer_ref[...]).astype(jnp.int32) * h
    cols_BD = pl.program_id(0) * block_d + lax.broadcasted_iota(jnp.int32, (block_d,), 0)
    # h is zero past n (written so by `hidden`).
    acc_BMxBD = _down_steps(lambda t, j_BH, live_BH: h_ref[:, pl.ds(t * block_h, block_h)], w_down_ref,
                            lambda t: order_ref[pl.ds(t * block_h, block_h)], n, base, cols_BD, d=d,
                            block_m=block_m, block_h=block_h, precision=precision)
    y_ref[...] = acc_BMxBD.astype(y_ref.dtype)


def _output_block(m: int, d: int, block_m: int, block_d: int) -> tuple[jax.Array, ...]:
    """Program (j, i)'s rows [i*BM, (i+1)*BM) and output columns [j*BD, (j+1)*BD) of y [M, D], each
    with its in-bounds mask: (rows_BM, row_ok_BM, cols_BD, col_ok_BD)."""
    rows_BM = pl.program_id(1) * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    cols_BD = pl.program_id(0) * block_d + lax.broadcasted_iota(jnp.int32, (block_d,), 0)
    return rows_BM, rows_BM < m, cols_BD, cols_BD < d


def _store_output(acc_BMxBD: jax.Array, residual_ref, y_ref, rows_BM: jax.Array, row_ok_BM: jax.Array,
                  cols_BD: jax.Array, col_ok_BD: jax.Array) -> None:
    """y[rows, cols] = round(acc + residual) (the residual, when given, added in fp32 before the one
    rounding), a masked store into the whole [M, D] output (rows >= M and columns >= D lie past
    its end: no live lane's address)."""
    mask = row_ok_BM[:, None] & col_ok_BD[None, :]
    if residual_ref is not None:
        acc_BMxBD = acc_BMxBD + plgpu.load(residual_ref.at[rows_BM[:, None], cols_BD[None, :]], mask=mask,
                                           other=0).astype(jnp.float32)
    plgpu.store(y_ref.at[rows_BM[:, None], cols_BD[None, :]], acc_BMxBD.astype(y_ref.dtype), mask=mask)


def _tile_list_reader(count_ref, ids_ref, *, tile: int, block_h: int, limit: int | None):
    """(n, ids_of_step, slots_of_step) over the gate's tile lists (`decode_matvec(tile_lists=True)`: tile t's
    active neurons are ids[t*tile : t*tile + count[t]]). Their concatenation is the list that
    `_down_steps` walks: position p lies in the last tile whose first position (an exclusive
    prefix sum of count, in registers) is <= p. Found per lane by a [BH, T] comparison, so a
    step reads its BH ids with one gather and no loop over the tiles (slots_of_step(t): those
    positions' slots in ids, and which are live: where packed values lie beside them). n = the
    list's length, 0 above `limit` (the sparse side of the dense switch reads nothing)."""
    n_tiles = count_ref.shape[0]
    lane_T = lax.broadcasted_iota(jnp.int32, (_next_pow2(n_tiles),), 0)
    count_T = plgpu.load(count_ref.at[jnp.minimum(lane_T, n_tiles - 1)], mask=lane_T < n_tiles, other=0)
    first_T = jnp.cumsum(count_T) - count_T  # padding lanes: the total, never <= a live position
    n = jnp.sum(count_T).astype(jnp.int32)
    if limit is not None:
        n = jnp.where(n > limit, jnp.int32(0), n)
    step_BH = lax.broadcasted_iota(jnp.int32, (block_h,), 0)

    def slots_of_step(t):  # (the step's slots in ids [BH], live [BH])
        p_BH = t * block_h + step_BH
        before_BHxT = first_T[None, :] <= p_BH[:, None]
        tile_BH = jnp.sum(before_BHxT.astype(jnp.int32), axis=1) - 1
        first_BH = jnp.max(jnp.where(before_BHxT, first_T[None, :], 0), axis=1)
        return jnp.clip(tile_BH * tile + p_BH - first_BH, 0, ids_ref.shape[0] - 1), p_BH < n

    def ids_of_step(t):
        slot_BH, live_BH = slots_of_step(t)
        return plgpu.load(ids_ref.at[slot_BH], mask=live_BH, other=0)

    return n, ids_of_step, slots_of_step


def _fused_kernel(n_ref, layer_ref, order_ref, x_ref, g_ref, *refs, m: int, d: int, h: int, capacity: int,
                  block_h: int, block_k: int, n_k: int, gated: bool, has_residual: bool,
                  precision: lax.Precision, tile: int = 0, has_norm: bool = False, eps: float = 0.0,
                  limit: int | None = None, block_m: int = 16, block_d: int = 128) -> None:
    """Program (j, i): output columns [j*BD, (j+1)*BD) x tokens [i*BM, (i+1)*BM), `hidden` and
    `down` in one: each step of BH active neurons computes their h itself, then adds h . W.
    Refs: n [1], layer [1], order [>= C], x [M, D], g [M, H] (whole, as `_hidden_kernel`), then
    norm scale [(L*)D] (has_norm), w_up [(L*)H, D] (gated only), w_down [(L*)H, D], residual
    [M, D] (if given), y [M, D] (whole: a masked store of the program's block). tile > 0: n is
    the gate's count [T] and order its ids [T * tile] (`_tile_list_reader`; no capacity: every
    active neuron is listed)."""
    refs = list(refs)
    scale_ref = refs.pop(0) if has_norm else None
    w_up_ref = refs.pop(0) if gated else None
    w_down_ref = refs.pop(0)
    residual_ref = refs.pop(0) if has_residual else None
    (y_ref,) = refs
    layer = jnp.max(layer_ref[...]).astype(jnp.int32)
    base = layer * h
    if tile:
        n, ids_of_step, _ = _tile_list_reader(n_ref, order_ref, tile=tile, block_h=block_h, limit=limit)
    else:
        n = jnp.minimum(jnp.max(n_ref[...]), jnp.int32(capacity)).astype(jnp.int32)
        ids_of_step = lambda t: order_ref[pl.ds(t * block_h, block_h)]  # noqa: E731
    rows_BM, row_ok_BM, cols_BD, col_ok_BD = _output_block(m, d, block_m, block_d)
    norm = None
    if has_norm:  # decode_matvec's RMSNorm prologue (common.rows_inv_rms); no active neuron (or the
        # dense side of the switch): no up product, so no pass
        norm = (rows_inv_rms(x_ref, rows_BM, row_ok_BM, k=d, eps=eps, live=n > 0,
                              rows=min(m, block_m)), scale_ref, layer * d)

    def h_of_step(t, j_BH, live_BH):
        # Masked lanes (dead entries past n, rows >= M) read as 0.
        g_BMxBH = plgpu.load(g_ref.at[rows_BM[:, None], j_BH[None, :]],
                             mask=row_ok_BM[:, None] & live_BH[None, :], other=0.0)
        act_BMxBH = jnp.maximum(g_BMxBH, 0.0)
        if gated:  # every step holds a live neuron: the full D loop
            act_BMxBH = act_BMxBH * _up_product(x_ref, w_up_ref, rows_BM, row_ok_BM, base + j_BH, live_BH,
                                                jnp.int32(n_k), d=d, block_k=block_k, precision=precision,
                                                norm=norm)
        # Rounded once to the activation dtype, as `_hidden_kernel` stores it (0 on dead lanes).
        return act_BMxBH.astype(x_ref.dtype)

    acc_BMxBD = _down_steps(h_of_step, w_down_ref, ids_of_step, n, base, cols_BD, d=d, block_m=block_m,
                            block_h=block_h, precision=precision)
    _store_output(acc_BMxBD, residual_ref, y_ref, rows_BM, row_ok_BM, cols_BD, col_ok_BD)


def _values_down_kernel(count_ref, layer_ref, ids_ref, values_ref, w_down_ref, *refs, m: int, d: int, h: int,
                        block_h: int, has_residual: bool, precision: lax.Precision, tile: int,
                        limit: int | None, block_m: int, block_d: int) -> None:
    """Program (j, i): output columns [j*BD, (j+1)*BD) x rows [i*BM, (i+1)*BM) of
    y = residual + values . W_down[ids] over the tile lists (`_tile_list_reader`): each step of BH
    listed neurons loads their hidden values from their slots (no up product: the gate's launch
    made them) and adds h . W. Refs: count [T], layer [1], ids [T * S], values [M, T * S],
    w_down [(L*)H, D], residual [M, D] (if given), y [M, D] (whole: a masked store)."""
    residual_ref = refs[0] if has_residual else None
    y_ref = refs[-1]
    base = jnp.max(layer_ref[...]).astype(jnp.int32) * h
    n, ids_of_step, slots_of_step = _tile_list_reader(count_ref, ids_ref, tile=tile, block_h=block_h, limit=limit)
    rows_BM, row_ok_BM, cols_BD, col_ok_BD = _output_block(m, d, block_m, block_d)

    def h_of_step(t, j_BH, live_BH):
        slot_BH, _ = slots_of_step(t)  # the values lie beside the ids
        return plgpu.load(values_ref.at[rows_BM[:, None], slot_BH[None, :]],
                          mask=row_ok_BM[:, None] & live_BH[None, :], other=0)

    acc_BMxBD = _down_steps(h_of_step, w_down_ref, ids_of_step, n, base, cols_BD, d=d, block_m=block_m,
                            block_h=block_h, precision=precision)
    _store_output(acc_BMxBD, residual_ref, y_ref, rows_BM, row_ok_BM, cols_BD, col_ok_BD)


def _check_operands(x_MxD, g_MxH, w_up_HxD, w_down_HxD) -> None:
    """Raise ValueError naming the offending argument (the operands of every decode FFN kernel,
    one layer's shapes)."""
    if x_MxD.ndim != 2 or x_MxD.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x_MxD must be float32 or bfloat16 [M, D], got {x_MxD.dtype}{x_MxD.shape}")
    m, d = x_MxD.shape
    if w_down_HxD.ndim != 2 or w_down_HxD.shape[1] != d or w_down_HxD.dtype != x_MxD.dtype:
        raise ValueError(f"w_down_HxD must be {x_MxD.dtype}[H, D={d}], got "
                         f"{w_down_HxD.dtype}{w_down_HxD.shape}")
    h = w_down_HxD.shape[0]
    if w_up_HxD is not None and (w_up_HxD.shape != (h, d) or w_up_HxD.dtype != x_MxD.dtype):
        raise ValueError(f"w_up_HxD must be {x_MxD.dtype}[H={h}, D={d}], got "
                         f"{w_up_HxD.dtype}{w_up_HxD.shape}")
    if g_MxH.shape != (m, h) or g_MxH.dtype != jnp.float32:
        raise ValueError(f"g_MxH must be float32 [M={m}, H={h}], got {g_MxH.dtype}{g_MxH.shape}")


def validate_decode_args(x_MxD, g_MxH, order, n_active, w_up_HxD, w_down_HxD, capacity: int,
                         block_sizes: DecodeBlockSizes) -> None:
    """Raise ValueError naming the offending argument."""
    _check_operands(x_MxD, g_MxH, w_up_HxD, w_down_HxD)
    _check_list_args(order, n_active, capacity, block_sizes)


def _check_list_args(order, n_active, capacity: int, block_sizes: DecodeBlockSizes) -> None:
    """Raise ValueError naming the offending argument (a compacted list: `compact_active`'s)."""
    if order.ndim != 1 or order.dtype != jnp.int32:
        raise ValueError(f"order must be int32 [L], got {order.dtype}{order.shape}")
    if capacity < 1 or capacity % block_sizes.chunk or capacity > order.shape[0]:
        raise ValueError(f"capacity must be a positive multiple of {block_sizes.chunk} "
                         f"(DecodeBlockSizes.chunk) and <= len(order) = {order.shape[0]}, got "
                         f"{capacity}")
    if n_active.shape != (1,) or n_active.dtype != jnp.int32:
        raise ValueError(f"n_active must be int32 [1], got {n_active.dtype}{n_active.shape}")


def _check_tile_list_args(ids: jax.Array, count: jax.Array, h: int, limit: int | None) -> int:
    """The slots per tile S of the gate's tile lists (ids [T * S], count [T] of
    `decode_matvec(..., tile_lists=True)` over H neurons), after raising ValueError naming a bad
    argument (`limit` included: None or an int >= 0)."""
    if count.ndim != 1 or count.dtype != jnp.int32 or count.shape[0] < 1:
        raise ValueError(f"count must be int32 [T] (decode_matvec's tile_lists), got {count.dtype}{count.shape}")
    n_tiles = count.shape[0]
    tile = ids.shape[0] // n_tiles if ids.ndim == 1 else 0
    if (ids.ndim != 1 or ids.dtype != jnp.int32 or tile < 1 or tile * n_tiles != ids.shape[0]
            or not h <= n_tiles * tile):
        raise ValueError(f"ids must be int32 [T * S] covering H={h} neurons in T={n_tiles} tiles of S slots "
                         f"(decode_matvec's tile_lists), got {ids.dtype}{ids.shape}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    return tile


def _weights_in_place(x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer: jax.Array | None):
    """Validate the operands (ValueError naming the offending one); return (w_up, w_down, layer):
    the weights as [(L*)H, D] and layer [1] int32 (0 without one; the kernels start at row
    layer * H). A stack [L, H, D] is flattened, not sliced, so the kernels read the layer's rows
    in place."""
    if layer is None:
        _check_operands(x_MxD, g_MxH, w_up_HxD, w_down_HxD)
        return w_up_HxD, w_down_HxD, jnp.zeros((1,), jnp.int32)
    if layer.shape != (1,) or layer.dtype != jnp.int32:
        raise ValueError(f"layer must be int32 [1], got {layer.dtype}{layer.shape}")
    if w_down_HxD.ndim != 3 or (w_up_HxD is not None and w_up_HxD.shape != w_down_HxD.shape):
        raise ValueError(f"with layer, w_up and w_down must be stacks [L, H, D], got "
                         f"{None if w_up_HxD is None else w_up_HxD.shape} and {w_down_HxD.shape}")
    one = lambda w: None if w is None else jax.ShapeDtypeStruct(w.shape[1:], w.dtype)  # noqa: E731
    _check_operands(x_MxD, g_MxH, one(w_up_HxD), one(w_down_HxD))
    flat = lambda w: None if w is None else w.reshape(-1, w.shape[-1])  # noqa: E731
    return flat(w_up_HxD), flat(w_down_HxD), layer


def _check_residual(residual_MxD, x_MxD) -> None:
    if residual_MxD is not None and (residual_MxD.shape != x_MxD.shape or residual_MxD.dtype != x_MxD.dtype):
        raise ValueError(f"residual_MxD must be {x_MxD.dtype}{x_MxD.shape} like x_MxD, got "
                         f"{residual_MxD.dtype}{residual_MxD.shape}")


@functools.partial(jax.jit, static_argnames=("capacity", "block_sizes", "interpret", "debug"))
def sparse_decode_ffn(x_MxD: jax.Array, g_MxH: jax.Array, order: jax.Array, n_active: jax.Array,
                      w_up_HxD: jax.Array | None, w_down_HxD: jax.Array, *,
                      capacity: int | None = None, layer: jax.Array | None = None,
                      block_sizes: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False,
                      debug: bool = False) -> tuple[jax.Array, jax.Array]:
    """Sparse FFN over the active-neuron list: returns (h [M, C] in x's dtype, y [M, D]).

    g_MxH: fp32 pre-activation of the gate (gated) or of the up projection (non-gated,
    w_up_HxD=None). order, n_active: `compact_active`'s partition and active count. Only
    order[:min(n, C)] is read, C = capacity (static; None = len(order)); h is 0 beyond. Any M, D, H.
    `layer` (int32 [1]): the weights are stacks [L, H, D] read in place at that layer (the decode
    loop over stacked layers: no copy of the layer's rows).
    """
    capacity = order.shape[0] if capacity is None else capacity
    w_up_HxD, w_down_HxD, layer = _weights_in_place(x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer)
    _check_list_args(order, n_active, capacity, block_sizes)
    m, d = x_MxD.shape
    h = g_MxH.shape[1]
    bm = block_sizes.block_m(m)
    m_pad = round_up(m, bm)
    precision = _dot_precision(x_MxD.dtype)
    n_spec = pl.BlockSpec((1,), lambda *_: (0,))
    if w_up_HxD is not None:
        bk, bn = block_sizes.block_k, block_sizes.block_n
        h_MpxC = pl.pallas_call(
            functools.partial(_hidden_kernel, m=m, d=d, h=h, capacity=capacity, block_k=bk,
                              n_k=-(-d // bk), precision=precision),
            grid=(capacity // bn, m_pad // bm),
            in_specs=[n_spec, n_spec,
                      pl.BlockSpec((bn,), lambda c, i: (c,)),
                      pl.BlockSpec(x_MxD.shape, lambda c, i: (0, 0)),
                      pl.BlockSpec(g_MxH.shape, lambda c, i: (0, 0)),
                      pl.BlockSpec(w_up_HxD.shape, lambda c, i: (0, 0))],
            out_specs=pl.BlockSpec((bm, bn), lambda c, i: (i, c)),
            out_shape=jax.ShapeDtypeStruct((m_pad, capacity), x_MxD.dtype),
            compiler_params=compiler_params(block_sizes),
            interpret=interpret,
            debug=debug,
            name="twell_decode_hidden",
        )(n_active, layer, order, x_MxD, g_MxH, w_up_HxD)
    else:
        live_C = jnp.arange(capacity) < n_active[0]
        h_MxC = jnp.where(live_C, jax.nn.relu(jnp.take(g_MxH, order[:capacity], axis=1)), 0.0)
        h_MpxC = jnp.pad(h_MxC.astype(x_MxD.dtype), ((0, m_pad - m), (0, 0)))
    bd = block_sizes.block_d
    d_out = round_up(d, bd)
    y_MpxDp = pl.pallas_call(
        functools.partial(_down_kernel, d=d, h=h, capacity=capacity, block_h=block_sizes.block_h,
                          precision=precision),
        grid=(d_out // bd, m_pad // bm),
        in_specs=[n_spec, n_spec,
                  pl.BlockSpec(order.shape, lambda j, i: (0,)),
                  pl.BlockSpec((bm, capacity), lambda j, i: (i, 0)),
                  pl.BlockSpec(w_down_HxD.shape, lambda j, i: (0, 0))],
        out_specs=pl.BlockSpec((bm, bd), lambda j, i: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, d_out), x_MxD.dtype),
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_decode_down",
    )(n_active, layer, order, h_MpxC, w_down_HxD)
    # Slices of the padded outputs: XLA fuses them into their consumers.
    return h_MpxC[:m], y_MpxDp[:m, :d]


def _launch_fused(lists: tuple[jax.Array, jax.Array], x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer,
                  residual_MxD, norm_scale, block_sizes: DecodeBlockSizes, interpret: bool, debug: bool,
                  **kernel_kwargs) -> jax.Array:
    """The fused kernel's launch, shared by the compacted list (`sparse_decode_ffn_fused`) and the
    gate's tile lists (`sparse_decode_ffn_tiles`): lists = (n or count, order or ids)."""
    m, d = x_MxD.shape
    bm, bd, bk = block_sizes.block_m(m), block_sizes.block_d, block_sizes.block_k
    m_pad, d_out = round_up(m, bm), round_up(d, bd)
    operands = [lists[0], layer, lists[1], x_MxD, g_MxH]
    operands += [w for w in (norm_scale, w_up_HxD, w_down_HxD, residual_MxD) if w is not None]
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, i: (0,) * a.ndim)  # noqa: E731
    # The output is exactly [M, D], each program's block stored with a mask (rows >= M and columns
    # >= D past its end: distinct addresses, no live lane's): a padded output's slice feeding the
    # next layer's kernel would be a copy launch of its own.
    return pl.pallas_call(
        functools.partial(_fused_kernel, m=m, d=d, h=g_MxH.shape[1], block_h=block_sizes.block_h, block_k=bk,
                          n_k=-(-d // bk), gated=w_up_HxD is not None, has_residual=residual_MxD is not None,
                          has_norm=norm_scale is not None, precision=_dot_precision(x_MxD.dtype), block_m=bm,
                          block_d=bd, **kernel_kwargs),
        grid=(d_out // bd, m_pad // bm),
        in_specs=[whole(a) for a in operands],
        out_specs=whole(x_MxD),
        out_shape=jax.ShapeDtypeStruct((m, d), x_MxD.dtype),
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_decode_tiles" if kernel_kwargs.get("tile") else "twell_decode_fused",
    )(*operands)


@functools.partial(jax.jit, static_argnames=("capacity", "block_sizes", "interpret", "debug"))
def sparse_decode_ffn_fused(x_MxD: jax.Array, g_MxH: jax.Array, order: jax.Array,
                            n_active: jax.Array, w_up_HxD: jax.Array | None, w_down_HxD: jax.Array,
                            *, capacity: int | None = None, layer: jax.Array | None = None,
                            residual_MxD: jax.Array | None = None,
                            block_sizes: DecodeBlockSizes = DecodeBlockSizes(),
                            interpret: bool = False, debug: bool = False) -> jax.Array:
    """`sparse_decode_ffn`'s y [M, D] (+ residual_MxD, added in fp32 before the one rounding) in
    one launch, without h in HBM: grid (D / block_d, M / block_m), each program recomputing the
    h of all the active neurons it needs. Same arguments, same capacity rule; block_h and block_k
    are the steps over the active list and over D (block_n is not used)."""
    capacity = order.shape[0] if capacity is None else capacity
    w_up_HxD, w_down_HxD, layer = _weights_in_place(x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer)
    _check_list_args(order, n_active, capacity, block_sizes)
    _check_residual(residual_MxD, x_MxD)
    return _launch_fused((n_active, order), x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer, residual_MxD, None,
                         block_sizes, interpret, debug, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("eps", "limit", "block_sizes", "interpret", "debug"))
def sparse_decode_ffn_tiles(x_MxD: jax.Array, g_MxH: jax.Array, ids: jax.Array, count: jax.Array,
                            w_up_HxD: jax.Array | None, w_down_HxD: jax.Array, *,
                            layer: jax.Array | None = None, norm_scale: jax.Array | None = None,
                            eps: float = 1e-6, residual_MxD: jax.Array | None = None,
                            limit: int | None = None, block_sizes: DecodeBlockSizes = DecodeBlockSizes(),
                            interpret: bool = False, debug: bool = False) -> jax.Array:
    """`sparse_decode_ffn_fused` over the gate's tile lists instead of a compacted list: ids
    [T * S] int32 and count [T] int32 of `decode_matvec(..., tile_lists=True)` (tile t's active
    neurons are ids[t*S : t*S + count[t]], ascending). The kernel walks the tiles' lists in
    order, which lists the active neurons ascending as `compact_active` does, so the sums run
    in the same order and no compaction launch is needed (TwELL in a decode step: the gate's
    epilogue packs, the fused up/down kernel reads the packs). Every active neuron is listed:
    no capacity.

    x_MxD is the layer's input: with norm_scale (fp32 [D], or [L, D] with layer) the up product
    reads RMSNorm(x) * scale, normalised on load as decode_matvec's prologue does (no normalised
    copy of x is made); without it, x itself (non-gated FFNs read no x). limit (static): a
    union of more than `limit` neurons reads none (y = residual, or zeros): the sparse side of a
    device-side switch to the dense products."""
    w_up_HxD, w_down_HxD, layer = _weights_in_place(x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer)
    h, d = g_MxH.shape[1], x_MxD.shape[1]
    tile = _check_tile_list_args(ids, count, h, limit)
    if norm_scale is not None:
        if w_up_HxD is None:
            raise ValueError("norm_scale needs w_up_HxD: only the gated FFN's up product reads x")
        want = (d,) if layer is None else (w_down_HxD.shape[0] // h, d)  # a stack's scales with its weights
        if norm_scale.shape != want or norm_scale.dtype != jnp.float32:
            raise ValueError(f"norm_scale must be float32 {want}, got {norm_scale.dtype}{norm_scale.shape}")
        norm_scale = norm_scale.reshape(-1)
    _check_residual(residual_MxD, x_MxD)
    return _launch_fused((count, ids), x_MxD, g_MxH, w_up_HxD, w_down_HxD, layer, residual_MxD, norm_scale,
                         block_sizes, interpret, debug, capacity=0, tile=tile, eps=float(eps), limit=limit)


@functools.partial(jax.jit, static_argnames=("limit", "block_sizes", "interpret", "debug"))
def sparse_decode_down_tiles(values: jax.Array, ids: jax.Array, count: jax.Array, w_down_HxD: jax.Array, *,
                             layer: jax.Array | None = None, residual_MxD: jax.Array | None = None,
                             limit: int | None = None, block_sizes: DecodeBlockSizes = DecodeBlockSizes(),
                             interpret: bool = False, debug: bool = False) -> jax.Array:
    """y [M, D] = residual + sum over the listed neurons j of values[:, slot(j)] . W_down[j], the
    down product of the gate's packed tiles (`decode_matvec(..., tile_lists=True,
    tile_values=True)`: ids [T * S] int32, count [T] int32 and the hidden values [M, T * S] beside
    them, so no up product here), fp32 accumulation in `sparse_decode_ffn_tiles`'s order
    (ascending neurons, block_h at a time), the residual added before the one rounding. One launch,
    grid (D / block_d, M / block_m); `layer` (int32 [1]) reads a stack [L, H, D] in place; limit
    (static): a union of more than `limit` neurons reads none (y = residual, or zeros), the sparse
    side of a device-side switch to the dense products. y is in the values' dtype."""
    if values.ndim != 2 or values.dtype not in (jnp.float32, jnp.bfloat16) or values.shape[1] != ids.shape[0]:
        raise ValueError(f"values must be float32 or bfloat16 [M, T * S = len(ids) = {ids.shape[0]}], got "
                         f"{values.dtype}{values.shape}")
    m = values.shape[0]
    stacked = layer is not None
    if stacked and (layer.shape != (1,) or layer.dtype != jnp.int32):
        raise ValueError(f"layer must be int32 [1], got {layer.dtype}{layer.shape}")
    if w_down_HxD.ndim != (3 if stacked else 2) or w_down_HxD.dtype != values.dtype:
        raise ValueError(f"w_down_HxD must be {values.dtype} (the values' dtype) "
                         f"{'[L, H, D] with layer' if stacked else '[H, D] without layer'}, got "
                         f"{w_down_HxD.dtype}{w_down_HxD.shape}")
    if not stacked:
        layer = jnp.zeros((1,), jnp.int32)
    h, d = w_down_HxD.shape[-2:]
    tile = _check_tile_list_args(ids, count, h, limit)
    if residual_MxD is not None and (residual_MxD.shape != (m, d) or residual_MxD.dtype != values.dtype):
        raise ValueError(f"residual_MxD must be {values.dtype}[M={m}, D={d}], got "
                         f"{residual_MxD.dtype}{residual_MxD.shape}")
    w_down = w_down_HxD.reshape(-1, d)
    bm, bd = block_sizes.block_m(m), block_sizes.block_d
    operands = [count, layer, ids, values, w_down] + ([residual_MxD] if residual_MxD is not None else [])
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, i: (0,) * a.ndim)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_values_down_kernel, m=m, d=d, h=h, block_h=block_sizes.block_h,
                          has_residual=residual_MxD is not None, precision=_dot_precision(values.dtype), tile=tile,
                          limit=limit, block_m=bm, block_d=bd),
        grid=(round_up(d, bd) // bd, round_up(m, bm) // bm),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((m, d), lambda j, i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, d), values.dtype),
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_decode_down_tiles",
    )(*operands)


@functools.partial(jax.jit, static_argnames=("capacity", "precision"))
def sparse_decode_ffn_reference(x_MxD: jax.Array, g_MxH: jax.Array, order: jax.Array,
                                n_active: jax.Array, w_up_HxD: jax.Array | None,
                                w_down_HxD: jax.Array, *, capacity: int | None = None,
                                precision: lax.Precision = lax.Precision.HIGHEST
                                ) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp `sparse_decode_ffn` (row gathers + small dots; same rounding points).

    Also the "xla" implementation of twell_jax/ops/pallas_decode.py, with precision DEFAULT. The dots
    take fp32 copies of the gathered rows: exact for 16-bit operands (their products fit in the
    fp32 and TF32 mantissas), and it avoids XLA:CPU's missing bf16 x bf16 -> f32 dot thunk."""
    f32 = jnp.float32
    order_C = order[:order.shape[0] if capacity is None else capacity]
    live_C = jnp.arange(order_C.shape[0]) < n_active[0]
    act_MxC = jax.nn.relu(jnp.take(g_MxH, order_C, axis=1))
    if w_up_HxD is not None:
        u_rows_CxD = jnp.take(w_up_HxD, order_C, axis=0).astype(f32)
        act_MxC = act_MxC * jnp.einsum("md,cd->mc", x_MxD.astype(f32), u_rows_CxD,
                                       precision=precision)
    h_MxC = jnp.where(live_C, act_MxC, 0.0).astype(x_MxD.dtype)
    w_rows_CxD = jnp.take(w_down_HxD, order_C, axis=0).astype(f32)
    y_MxD = jnp.einsum("mc,cd->md", h_MxC.astype(f32), w_rows_CxD, precision=precision)
    return h_MxC, y_MxD.astype(x_MxD.dtype)
