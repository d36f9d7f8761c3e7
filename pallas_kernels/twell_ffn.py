"""Fused sparse FFN kernel (Pallas, Triton backend): packed gate (TwELL) -> dense output.

Gated:      y_i = sum_{j active in row i} a_ij * (x_i . U_j) * W_j
Non-gated:  y_i = sum_{j active in row i} a_ij * W_j          (a = packed relu(x U^T))

a_ij is the packed value (activation dtype), U_j / W_j are rows of the neuron-major [H, D] weights.
One program handles `block_t` token rows; it keeps x rows and the fp32 output rows in registers,
walks the NT tiles of its rows, and for slot k = 0 .. max(min(count, S)) - 1 gathers the [block_t, D]
rows U[j] and W[j] of the k-th active neuron of each of its rows (masked for rows that have fewer).
The hidden activation never reaches HBM.

Split (gated; `FFNBlockSizes.split`, by default when the training forward asks for the ranked
entries): the same walk in two launches, each gathering rows of one weight matrix, so that each
launch's row gathers come from an L2-resident table half the size: "up" computes u = x_i . U_j,
h = a u, l1 and the ranked entries, and writes h (fp32) into the stored slots of an [M, NT, S]
array beside the pack; "down" reads h back and accumulates y. The same bits as one launch; the
fp32 h is the only extra traffic (the entries' slots only).

Precision ("tensor-core exact", the default and only mode): inputs and weights are upcast to fp32,
products and sums are fp32 (so x . U_j is what a tensor-core GEMM with fp32 accumulation gives, up to
summation order), h = fp32(a) * u is NOT rounded, the down-projection accumulates in fp32, and only
y is rounded to the output dtype. (The CUDA reference's default rounds every product to bf16.)

Only slots < min(count, S) are read: entries of overflowing tiles beyond S are NOT included here;
the caller (twell_jax/ops/pallas_forward.py) recomputes those rows exactly.

Per-row l1 (sum over active neurons of |h|) is returned too so the op reports l1 without the
hidden activation.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .twell_bwd_token import rank_values_reference
from .common import (check_launch_sizes, compiler_params, is_pow2 as _is_pow2,
                                   next_pow2 as _next_pow2, pad_rows, round_up, stored_ranks,
                                   validate_packed_operands)




@dataclasses.dataclass(frozen=True)
class FFNBlockSizes:
    """Static launch parameters of the fused sparse FFN kernel."""

    # Round 1 (H200, BENCHMARKS.md): one token per program with 4 warps beat 2..8 tokens per
    # program (masked lanes of rows with fewer actives waste gather bandwidth) and 2 or 8 warps.
    block_t: int = 1  # token rows per program (power of two)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # pipelining depth of the slot loop (dynamic trip counts: 1 = none)
    # Slots per tile handled without waiting for the tile's count (round 2). The kernel is
    # latency bound: round 1 walked tile t as load count -> loop k < count: load (j, a) -> load
    # rows U[j], W[j] -> reduce -> FMA, three dependent global loads per neuron and one per tile.
    # Now the count and the first `head_slots` (j, a) of tile t+1 are loaded during tile t (loop
    # carry), so tile t starts with its row gathers at once; its head slots are processed
    # unconditionally (row loads masked off for slots >= count: no bytes move, h = 0) and only the
    # slots beyond them take the dynamic loop. 0 = round 1's kernel.
    # Measured (H200, round 2, git history of BENCHMARKS.md, not on the current page): no gain at
    # 29 actives and slower at 112: the kernel is bound by the row gathers, not by these loads.
    # Default 0.
    head_slots: int = 0
    # Gated only: two launches instead of one, each gathering rows of ONE weight matrix, so each
    # launch's gathers are served by L2 from a table half the size: first u = x . U_j and
    # h = a * u of every stored entry (written fp32 beside the pack's values), then
    # y = sum h W_j. The same arithmetic in the same order as one launch (the same bits).
    # None: split when the ranked (a, u) are asked for (the training forward), one launch
    # otherwise (BENCHMARKS.md, "Forward + backward": the piece rows and the same-machine before/after).
    split: bool | None = None

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_t) or self.block_t > 64:
            raise ValueError(f"FFNBlockSizes.block_t must be a power of two <= 64, got {self.block_t}")
        check_launch_sizes(self)
        if not isinstance(self.head_slots, int) or not 0 <= self.head_slots <= 4:
            raise ValueError(f"FFNBlockSizes.head_slots must be an int in [0, 4], got "
                             f"{self.head_slots!r}")
        if self.split is not None and not isinstance(self.split, bool):
            raise ValueError(f"FFNBlockSizes.split must be None or a bool, got {self.split!r}")


def _ffn_kernel(*refs, gated: bool, slots: int, n_tiles: int, d: int, d_block: int,
                head_slots: int, ranked_width: int, phase: str) -> None:
    """phase "fused": refs x [BT, D], counts [BT, NT], values/indices [BT, NT, S], (w_up [H, D]),
    w_down [H, D]; outputs y [BT, D], l1 [BT], and with ranked_width W > 0: a (values' dtype),
    (u f32, gated) [BT, W] in rank order.
    phase "up" (gated, the split's first launch): refs x, counts, values, indices, w_up; outputs
    h [BT, NT, S] f32 (stored slots only), l1, ranked.
    phase "down" (the split's second launch): refs counts, h [BT, NT, S] f32, indices, w_down;
    output y."""
    refs = list(refs)
    x_ref = refs.pop(0) if phase != "down" else None
    counts_ref, values_ref, indices_ref = refs[:3]  # "down": values_ref holds h
    del refs[:3]
    w_up_ref = refs.pop(0) if gated and phase != "down" else None
    w_down_ref = refs.pop(0) if phase != "up" else None
    y_ref = refs.pop(0) if phase != "up" else None
    h_ref = refs.pop(0) if phase == "up" else None
    l1_ref = refs.pop(0) if phase != "down" else None
    ranked_refs = refs  # (a, u) gated, (a,) non-gated; empty without ranked_width
    block_t = counts_ref.shape[0]
    row_BT = lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    n_head = min(head_slots, slots)
    col_D = lax.broadcasted_iota(jnp.int32, (d_block,), 0)
    # D need not be a power of two: the row tensors are d_block = next_pow2(D) wide, masked.
    col_ok_1xD = (col_D < d)[None, :]
    # Row gathers index with two broadcast int arrays (rows x columns): the interpret-mode
    # discharge does not support mixing an int-array index with a slice.
    col_1xD = col_D[None, :]
    full_d = d == d_block
    x_BTxD = None if x_ref is None else plgpu.load(
        x_ref.at[:, pl.ds(0, d_block)], mask=None if full_d else col_ok_1xD,
        other=None if full_d else 0).astype(jnp.float32)

    def load_rows(j_BT, live_BT):
        row_mask = live_BT[:, None] & col_ok_1xD  # all off: the load moves no bytes
        u_rows = (plgpu.load(w_up_ref.at[j_BT[:, None], col_1xD], mask=row_mask, other=0)
                  if w_up_ref is not None else None)
        w_rows = (plgpu.load(w_down_ref.at[j_BT[:, None], col_1xD], mask=row_mask, other=0)
                  if w_down_ref is not None else None)
        return u_rows, w_rows

    def accumulate(acc_BTxD, l1_BT, a_BT, u_rows, w_rows, live_BT, rank_BT, tile, k):
        if phase == "down":  # a_BT is the entry's h, computed by the "up" launch
            h_BT = jnp.where(live_BT, a_BT, 0.0)
            return acc_BTxD + h_BT[:, None] * w_rows.astype(jnp.float32), l1_BT
        h_BT = a_BT.astype(jnp.float32)
        u_BT = jnp.sum(x_BTxD * u_rows.astype(jnp.float32), axis=1) if gated else None
        if gated:
            h_BT = h_BT * u_BT
        if ranked_refs:
            # The entry's a (and u) at its rank among the row's stored entries (what the training
            # backward's token lists read); ranks past W are not stored (such rows are the
            # backward's token tail). A dead lane's address is its own row's last column: the lanes
            # of one store are distinct rows, so it never meets a live lane's address (the
            # interpreter's masked store is a read-modify-write of every lane's address).
            stored_BT = live_BT & (rank_BT < ranked_width)
            col_BT = jnp.where(stored_BT, rank_BT, ranked_width - 1)
            for ref, v_BT in zip(ranked_refs, (a_BT, u_BT)):
                plgpu.store(ref.at[row_BT, col_BT], v_BT.astype(ref.dtype), mask=stored_BT)
        h_BT = jnp.where(live_BT, h_BT, 0.0)
        if phase == "up":
            # Each lane its own row's (tile, slot): distinct addresses, dead lanes masked.
            plgpu.store(h_ref.at[row_BT, jnp.broadcast_to(tile, (block_t,)),
                                 jnp.broadcast_to(k, (block_t,))], h_BT, mask=live_BT)
            return acc_BTxD, l1_BT + jnp.abs(h_BT)
        return acc_BTxD + h_BT[:, None] * w_rows.astype(jnp.float32), l1_BT + jnp.abs(h_BT)

    def load_tile_head(tile):
        # Past the last tile (the prefetch of the final step) the address is clamped; the values
        # are never used.
        tile = jnp.minimum(tile, n_tiles - 1)
        count_BT = plgpu.load(counts_ref.at[:, tile])
        slot_ids = [jnp.int32(k) for k in range(n_head)]  # traced ints: refs reject Python ints
        heads = tuple((plgpu.load(indices_ref.at[:, tile, k]), plgpu.load(values_ref.at[:, tile, k]))
                      for k in slot_ids)  # k < S: in bounds whatever the count
        return count_BT, heads

    def tile_step(t, carry):
        acc_BTxD, l1_BT, first_BT, count_BT, heads = carry  # first: stored entries of earlier tiles
        next_head = load_tile_head(t + 1)  # in flight while this tile computes
        live_count_BT = jnp.minimum(count_BT, slots)
        # Head slots: all row gathers issued first, then the arithmetic.
        lives = [k < live_count_BT for k in range(n_head)]
        rows = [load_rows(j_BT, live_BT) for (j_BT, _), live_BT in zip(heads, lives)]
        for k, ((_, a_BT), (u_rows, w_rows), live_BT) in enumerate(zip(heads, rows, lives)):
            acc_BTxD, l1_BT = accumulate(acc_BTxD, l1_BT, a_BT, u_rows, w_rows, live_BT,
                                         first_BT + k, t, jnp.int32(k))

        def slot_step(k, carry):
            acc_BTxD, l1_BT = carry
            live_BT = k < live_count_BT
            j_BT = plgpu.load(indices_ref.at[:, t, k])
            a_BT = plgpu.load(values_ref.at[:, t, k])
            u_rows, w_rows = load_rows(j_BT, live_BT)
            return accumulate(acc_BTxD, l1_BT, a_BT, u_rows, w_rows, live_BT, first_BT + k, t, k)

        acc_BTxD, l1_BT = lax.fori_loop(n_head, jnp.maximum(jnp.max(live_count_BT), n_head),
                                        slot_step, (acc_BTxD, l1_BT))
        return acc_BTxD, l1_BT, first_BT + live_count_BT, *next_head

    acc_width = 1 if phase == "up" else d_block  # "up" accumulates no output row
    init = (jnp.zeros((block_t, acc_width), jnp.float32), jnp.zeros((block_t,), jnp.float32),
            jnp.zeros((block_t,), jnp.int32), *load_tile_head(0))
    acc_BTxD, l1_BT, _, _, _ = lax.fori_loop(0, n_tiles, tile_step, init)
    if y_ref is not None:
        plgpu.store(y_ref.at[:, pl.ds(0, d_block)], acc_BTxD.astype(y_ref.dtype),
                    mask=None if full_d else jnp.broadcast_to(col_ok_1xD, acc_BTxD.shape))
    if l1_ref is not None:
        l1_ref[...] = l1_BT


def validate_ffn_args(x_MxD, values, indices, counts, w_up_HxD, w_down_HxD) -> None:
    """Raise ValueError naming the offending argument."""
    validate_packed_operands(x_MxD, values, indices, counts)
    d = x_MxD.shape[1]
    for name, w in (("w_up_HxD", w_up_HxD), ("w_down_HxD", w_down_HxD)):
        if w is not None and (w.ndim != 2 or w.shape[1] != d or w.dtype != x_MxD.dtype):
            raise ValueError(f"{name} must be {x_MxD.dtype}[H, D={d}], got {w.dtype}{w.shape}")


def _ffn_call(phase: str, inputs: tuple, *, m: int, d: int, n_tiles: int, slots: int, gated: bool,
              x_dtype, values_dtype, block_sizes: FFNBlockSizes, ranked_width: int, interpret: bool,
              debug: bool):
    """One pallas_call of `_ffn_kernel` in `phase`; inputs in the kernel's ref order."""
    bt = block_sizes.block_t
    kernel = functools.partial(_ffn_kernel, gated=gated, slots=slots, n_tiles=n_tiles, d=d,
                               d_block=_next_pow2(d), head_slots=block_sizes.head_slots,
                               ranked_width=ranked_width, phase=phase)
    row_spec = pl.BlockSpec((bt, d), lambda i: (i, 0))
    pack_spec = pl.BlockSpec((bt, n_tiles, slots), lambda i: (i, 0, 0))
    n_weights = 1 if phase != "fused" or not gated else 2
    in_specs = ([] if phase == "down" else [row_spec]) + [
        pl.BlockSpec((bt, n_tiles), lambda i: (i, 0)), pack_spec, pack_spec] + [
        pl.BlockSpec((inputs[-1].shape[0], d), lambda i: (0, 0)) for _ in range(n_weights)]
    out_specs, out_shape = [], []
    if phase != "up":
        out_specs.append(row_spec)
        out_shape.append(jax.ShapeDtypeStruct((m, d), x_dtype))
    if phase == "up":
        out_specs.append(pack_spec)
        out_shape.append(jax.ShapeDtypeStruct((m, n_tiles, slots), jnp.float32))
    if phase != "down":
        out_specs.append(pl.BlockSpec((bt,), lambda i: (i,)))
        out_shape.append(jax.ShapeDtypeStruct((m,), jnp.float32))
        ranked_dtypes = ((values_dtype, jnp.float32) if gated else (values_dtype,)) if ranked_width else ()
        out_specs += [pl.BlockSpec((bt, ranked_width), lambda i: (i, 0)) for _ in ranked_dtypes]
        out_shape += [jax.ShapeDtypeStruct((m, ranked_width), dt) for dt in ranked_dtypes]
    name = {"fused": "twell_gated_ffn" if gated else "twell_ffn", "up": "twell_ffn_up",
            "down": "twell_ffn_down"}[phase]
    return pl.pallas_call(kernel, grid=(m // bt,), in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, compiler_params=compiler_params(block_sizes),
                          interpret=interpret, debug=debug, name=name)(*inputs)


def launches(block_sizes: FFNBlockSizes, gated: bool, ranked_width: int) -> tuple[str, ...]:
    """The kernel phases one `sparse_ffn` call runs: ("up", "down") split, ("fused",) otherwise."""
    split = block_sizes.split if block_sizes.split is not None else ranked_width > 0
    return ("up", "down") if gated and split else ("fused",)


def _ffn_triton(x_MxD, values, indices, counts, w_up_HxD, w_down_HxD, *, block_sizes: FFNBlockSizes,
                ranked_width: int, interpret: bool, debug: bool):
    m, d = x_MxD.shape
    gated = w_up_HxD is not None
    call = functools.partial(_ffn_call, m=m, d=d, n_tiles=values.shape[1], slots=values.shape[2],
                             gated=gated, x_dtype=x_MxD.dtype, values_dtype=values.dtype,
                             block_sizes=block_sizes, ranked_width=ranked_width,
                             interpret=interpret, debug=debug)
    if launches(block_sizes, gated, ranked_width) == ("fused",):
        weights = (w_up_HxD, w_down_HxD) if gated else (w_down_HxD,)
        return call("fused", (x_MxD, counts, values, indices, *weights))
    h, l1_M, *ranked = call("up", (x_MxD, counts, values, indices, w_up_HxD))
    (y_MxD,) = call("down", (counts, h, indices, w_down_HxD))
    return (y_MxD, l1_M, *ranked)


def _check_ranked_width(ranked_width: int) -> None:
    if isinstance(ranked_width, bool) or not isinstance(ranked_width, int) or ranked_width < 0 \
            or (ranked_width and not _is_pow2(ranked_width)):
        raise ValueError(f"ranked_width must be 0 or a power of two, got {ranked_width!r}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "ranked_width", "interpret", "debug"))
def sparse_ffn(x_MxD: jax.Array, values: jax.Array, indices: jax.Array, counts: jax.Array,
               w_up_HxD: jax.Array | None, w_down_HxD: jax.Array, *,
               block_sizes: FFNBlockSizes = FFNBlockSizes(), ranked_width: int = 0,
               interpret: bool = False, debug: bool = False) -> tuple:
    """Fused sparse FFN from a packed gate: returns (y [M, D] in x's dtype, l1_per_row [M] f32),
    and with ranked_width W > 0 (a power of two) a third element: each row's stored entries in
    rank order (tiles, then slots ascending: what `twell_bwd_token.rank_values` gives) up to W,
    (a [M, W] in values' dtype, u [M, W] f32 = x . U_j) gated or (a,) non-gated, what the
    training backward keeps. Columns past a row's stored entries are unspecified.

    w_up_HxD=None selects the non-gated variant (h = packed value). Any M (padded to block_t).
    """
    validate_ffn_args(x_MxD, values, indices, counts, w_up_HxD, w_down_HxD)
    _check_ranked_width(ranked_width)
    m = x_MxD.shape[0]
    # Padded rows have count 0: they read nothing and produce y = 0.
    x_MxD, values, indices, counts = pad_rows(round_up(m, block_sizes.block_t), x_MxD, values, indices,
                                              counts)
    y_MxD, l1_M, *ranked = _ffn_triton(x_MxD, values, indices, counts, w_up_HxD, w_down_HxD,
                                       block_sizes=block_sizes, ranked_width=ranked_width,
                                       interpret=interpret, debug=debug)
    if not ranked_width:
        return y_MxD[:m], l1_M[:m]
    return y_MxD[:m], l1_M[:m], tuple(r[:m] for r in ranked)


@functools.partial(jax.jit, static_argnames=("ranked_width",))
def sparse_ffn_reference(x_MxD: jax.Array, values: jax.Array, indices: jax.Array,
                         counts: jax.Array, w_up_HxD: jax.Array | None,
                         w_down_HxD: jax.Array, ranked_width: int = 0) -> tuple:
    """Plain-jnp version of `sparse_ffn` (same slots read, fp32 arithmetic; ranked columns past a
    row's stored entries hold 0)."""
    _check_ranked_width(ranked_width)
    m, n_tiles, slots = values.shape
    live = stored_ranks(counts, slots)[1]
    a = jnp.where(live, values.astype(jnp.float32), 0.0)
    x32 = x_MxD.astype(jnp.float32)
    u = None
    if w_up_HxD is not None:
        u_rows = w_up_HxD.astype(jnp.float32)[indices]  # [M, NT, S, D]
        u = jnp.einsum("md,mtsd->mts", x32, u_rows, precision=lax.Precision.HIGHEST)
        h = a * u
    else:
        h = a
    y = jnp.einsum("mts,mtsd->md", h, w_down_HxD.astype(jnp.float32)[indices],
                   precision=lax.Precision.HIGHEST)
    out = (y.astype(x_MxD.dtype), jnp.sum(jnp.abs(h), axis=(1, 2)))
    if not ranked_width:
        return out
    parts = (rank_values_reference(values, counts, ranked_width),)
    if u is not None:
        parts += (rank_values_reference(u, counts, ranked_width),)
    return (*out, parts)
