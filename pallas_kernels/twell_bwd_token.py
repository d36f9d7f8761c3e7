"""Token-major backward kernel (Pallas, Triton backend): a token's active neurons -> dx and per-entry values.

For every token i and every active neuron j of its list (pattern entries that are not "hot"):

    gated:      u = x_i . U_j          h = round(a * u)       (a = packed relu(gate) value)
                dt = gy_i . W_j + l1_scale * sign(h)
                dr = dt * a  (grad of the up activation)   dg = dt * u  (grad of the gate pre-activation)
                dx_i += dr U_j + dg G_j
                entry values (t, d_up, d_gate) = (h, dr, dg)
    non-gated:  h = a                  dt = gy_i . W_j + l1_scale * sign(h)
                dx_i += dt G_j         entry values (t, d_act) = (h, dt)

`round` is the activation dtype (the dense formula rounds h to x's dtype before the down
projection and the L1 norm). G is the packed ("act") weight: the gate weight gated, the op's up
weight non-gated (its relu gives the pattern); U the up weight beside the gate (gated only), W the
down weight, all neuron-major [H, D].

Input: per token a compact list (`token_lists`, a Pallas kernel, from the TwELL pattern): n_i
entries, their neuron ids, packed values, and neuron-major (CSR) positions, the latter from the
counting-sort transpose's `dest` (twell_transpose.py), which runs first on the pattern alone. The
values come in rank order, [M, W]: the training forward's fused FFN writes each entry's a and
(gated) u there (`twell_ffn.sparse_ffn(ranked_width=)`), what it keeps instead of the pack's
[M, NT, S] values; a backward that recomputes the pattern ranks a with `rank_values` and computes u
here. Entries of "hot" neurons are left out of the lists: a dense tail
(twell_jax/ops/pallas_backward.py) owns their dx terms and weight gradients, so the kernel moves
none of their bytes, and it walks no empty tiles.

One program handles `block_t` tokens: gy_i (and x_i, to compute u) stay in registers, dx_i
accumulates in fp32 registers (from `dx_init`, the dense tails' terms, when given), each entry
costs one gather of each row it needs, and its values are written straight to its CSR position
(scatter stores: each position is written by one lane, no atomics). Gated, by default in two
launches (`TokenBwdBlockSizes.split`): the entries (W_j, and U_j unless u is given), then dx (U_j,
G_j); in one launch W_j, U_j and G_j per entry. Non-gated: one launch, W_j and G_j. All arithmetic
is fp32 ("tensor-core exact"), dx is rounded once to x's dtype.
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
                                   next_pow2 as _next_pow2, pad_rows, round_up, stored_ranks,
                                   validate_packed_operands, validate_pattern)


@dataclasses.dataclass(frozen=True)
class TokenBwdBlockSizes:
    """Static launch parameters of the token-major backward kernel."""

    # One token per program, 2 warps (H100, k 29, experiments/bench_ffn_train.py --sweep-blocks;
    # BENCHMARKS.md): 2 and 4 warps tie, 8 warps are slower, and 2 or 4 tokens per program slower
    # still (rows with fewer entries idle while the block's longest list runs).
    block_t: int = 1  # token rows per program (power of two)
    num_warps: int = 2  # warps per program
    num_stages: int = 1  # pipelining depth of the slot loop (dynamic trip counts: 1 = none)
    # Gated only: two launches instead of one, the entries (gathering W_down rows, and W_up rows
    # when u is not given) and then dx (W_up and W_gate rows). One launch gathers rows of all three
    # weights, whose working set (3 x 23 MB at D 2048, H 5632, bf16) exceeds the H100's 50 MB L2
    # cache, so its gathers come from HBM; each of the two launches gathers from at most two
    # weights, as the forward's fused FFN does. The non-gated kernel gathers from two weights
    # already and ignores this.
    split: bool = True

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_t) or self.block_t > 64:
            raise ValueError(f"TokenBwdBlockSizes.block_t must be a power of two <= 64, got {self.block_t}")
        if not isinstance(self.split, bool):
            raise ValueError(f"TokenBwdBlockSizes.split must be a bool, got {self.split!r}")
        check_launch_sizes(self)


@dataclasses.dataclass(frozen=True)
class ListsBlockSizes:
    """Static launch parameters of the list-building kernel (`token_lists`)."""

    block_rows: int = 32  # token rows per program (power of two): faster than 16 (H100, k 29; BENCHMARKS.md)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # pipelining depth of the tile loop

    def __post_init__(self) -> None:
        if isinstance(self.block_rows, bool) or not isinstance(self.block_rows, int) \
                or not _is_pow2(self.block_rows) or self.block_rows > 256:
            raise ValueError(f"ListsBlockSizes.block_rows must be a power of two <= 256, got "
                             f"{self.block_rows!r}")
        check_launch_sizes(self)


def _list_columns(width: int, slots: int) -> int:
    """Columns of the list kernels' outputs (`rank_values`, `token_lists`), [M, this]. A store
    covers one tile's S slots of a row; its masked-off lanes need addresses of their own (the
    interpreter's masked store is a read-modify-write scatter, where a dead lane sharing a live
    lane's address could clobber it). With S <= W they take the row's columns after the store's
    live ones, modulo W (`_wrap`): S distinct columns, none a live one, so the outputs are the
    lists' own [M, W] and need no slice (a slice of a kernel's output is a copy). With S > W each
    dead lane takes its own column past W: [M, W + S]."""
    return width if slots <= width else width + slots


def _wrap(col_BRxS: jax.Array, dead_BRxS: jax.Array, k_BRxS: jax.Array, width: int, slots: int
          ) -> jax.Array:
    """The store columns of `_list_columns`: the live lanes' columns (< W) as they are; the dead
    lanes' (col_BRxS: consecutive after the live ones) modulo W, or with S > W column W + k."""
    if slots <= width:
        return col_BRxS & (width - 1)
    return jnp.where(dead_BRxS, width + k_BRxS, col_BRxS)


def _rank_values_kernel(values_ref, counts_ref, out_ref, *, slots: int, n_tiles: int,
                        width: int) -> None:
    """values [BR, NT, S], counts [BR, NT] -> out [BR, _list_columns]: the live values of each row
    in rank order (a row's entries past W are not stored: none when the caller's rows hold at
    most W)."""
    block_rows = counts_ref.shape[0]
    row_BRxS = lax.broadcasted_iota(jnp.int32, (block_rows, slots), 0)
    k_BRxS = lax.broadcasted_iota(jnp.int32, (block_rows, slots), 1)

    def tile_step(t, first_BR):
        live_BR = jnp.minimum(plgpu.load(counts_ref.at[:, t]), slots)
        rank_BRxS = first_BR[:, None] + k_BRxS
        live_BRxS = (k_BRxS < live_BR[:, None]) & (rank_BRxS < width)
        v_BRxS = plgpu.load(values_ref.at[:, t, :], mask=live_BRxS, other=0)
        # The S ranks are consecutive: dead lanes' columns are distinct from every live one.
        plgpu.store(out_ref.at[row_BRxS, _wrap(rank_BRxS, ~live_BRxS, k_BRxS, width, slots)],
                    v_BRxS, mask=live_BRxS)
        return first_BR + live_BR

    lax.fori_loop(0, n_tiles, tile_step, jnp.zeros((block_rows,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("width", "block_sizes", "interpret", "debug"))
def rank_values(values: jax.Array, counts: jax.Array, width: int, *,
                block_sizes: ListsBlockSizes = ListsBlockSizes(), interpret: bool = False,
                debug: bool = False) -> jax.Array:
    """[M, W] (values' dtype, W = next_pow2(width)): row i's stored values (slot < min(count, S),
    tiles ascending) in rank order r = 0, 1, ...: the ranks `dest` and `token_lists` use. Slots
    past a row's stored count are unspecified; rows must hold at most W stored entries (the
    caller zeroes the counts of the others: the token tail; more are not written)."""
    validate_packed_operands(jnp.zeros((values.shape[0], 1), values.dtype), values,
                             jnp.zeros(values.shape, jnp.int32), counts)
    m, n_tiles, slots = values.shape
    w = _next_pow2(width)
    br = block_sizes.block_rows
    m_pad = round_up(max(m, 1), br)
    values, counts = pad_rows(m_pad, values, counts)
    out = pl.pallas_call(
        functools.partial(_rank_values_kernel, slots=slots, n_tiles=n_tiles, width=w),
        grid=(m_pad // br,),
        in_specs=[pl.BlockSpec((br, n_tiles, slots), lambda i: (i, 0, 0)),
                  pl.BlockSpec((br, n_tiles), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((br, _list_columns(w, slots)), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m_pad, _list_columns(w, slots)), values.dtype),
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_bwd_rank_values",
    )(values, counts)
    return out[:m, :w]


@functools.partial(jax.jit, static_argnames=("width",))
def rank_values_reference(values: jax.Array, counts: jax.Array, width: int) -> jax.Array:
    """Plain-jnp `rank_values` (slots past a row's count hold 0)."""
    m, n_tiles, slots = values.shape
    w = _next_pow2(width)
    rank_MxTxS, live_MxTxS = stored_ranks(counts, slots)
    rank_MxK = jnp.where(live_MxTxS, rank_MxTxS, w).reshape(m, -1)
    rows_MxK = jnp.broadcast_to(jnp.arange(m)[:, None], rank_MxK.shape)
    return jnp.zeros((m, w), values.dtype).at[rows_MxK, rank_MxK].set(values.reshape(m, -1), mode="drop")


def _lists_kernel(*refs, has_hot: bool, has_u: bool, slots: int, n_tiles: int, width: int,
                  tile: int | None) -> None:
    """Refs: ranked values [BR, W], (ranked u [BR, W] f32), indices [BR, NT, S] (int32 neuron ids,
    or with `tile` uint8 offsets inside it), counts [BR, NT] (int32 or int16), dest [BR, W],
    (hot [H] int32); outputs n [BR], cols, a, pos, (u) [BR, _list_columns]."""
    refs = list(refs)
    values_ref = refs.pop(0)
    u_in_ref = refs.pop(0) if has_u else None
    indices_ref, counts_ref, dest_ref = refs[:3]
    del refs[:3]
    hot_ref = refs.pop(0) if has_hot else None
    n_ref, cols_ref, a_ref, pos_ref = refs[:4]
    u_ref = refs[4] if has_u else None
    block_rows = counts_ref.shape[0]
    row_BRxS = lax.broadcasted_iota(jnp.int32, (block_rows, slots), 0)
    k_BRxS = lax.broadcasted_iota(jnp.int32, (block_rows, slots), 1)

    def tile_step(t, carry):
        first_BR, out_BR = carry  # the row's stored entries so far; its listed entries so far
        live_BR = jnp.minimum(plgpu.load(counts_ref.at[:, t]).astype(jnp.int32), slots)
        live_BRxS = k_BRxS < live_BR[:, None]
        j_BRxS = plgpu.load(indices_ref.at[:, t, :], mask=live_BRxS, other=0).astype(jnp.int32)
        if tile is not None:  # offsets inside tile t: the neuron id
            j_BRxS = j_BRxS + t * tile
        keep_BRxS = live_BRxS
        if has_hot:
            keep_BRxS = keep_BRxS & (plgpu.load(hot_ref.at[j_BRxS], mask=live_BRxS, other=1) == 0)
        keep_i32 = keep_BRxS.astype(jnp.int32)
        kept_before_BRxS = jnp.cumsum(keep_i32, axis=1) - keep_i32
        n_keep_BR = jnp.sum(keep_i32, axis=1)
        # The kept lanes compacted, the dead ones after them: a permutation of S consecutive
        # columns from out_BR, which `_wrap` keeps distinct in the output's columns.
        col_BRxS = out_BR[:, None] + jnp.where(keep_BRxS, kept_before_BRxS,
                                               n_keep_BR[:, None] + k_BRxS - kept_before_BRxS)
        col_BRxS = _wrap(col_BRxS, ~keep_BRxS, k_BRxS, width, slots)
        rank_BRxS = jnp.minimum(first_BR[:, None] + k_BRxS, width - 1)
        a_BRxS = plgpu.load(values_ref.at[row_BRxS, rank_BRxS], mask=keep_BRxS, other=0)
        pos_BRxS = plgpu.load(dest_ref.at[row_BRxS, rank_BRxS], mask=keep_BRxS, other=0)
        outs = [(cols_ref, j_BRxS), (a_ref, a_BRxS), (pos_ref, pos_BRxS)]
        if has_u:
            outs.append((u_ref, plgpu.load(u_in_ref.at[row_BRxS, rank_BRxS], mask=keep_BRxS, other=0)))
        for ref, v in outs:
            plgpu.store(ref.at[row_BRxS, col_BRxS], v, mask=keep_BRxS)
        return first_BR + live_BR, out_BR + n_keep_BR

    zeros = jnp.zeros((block_rows,), jnp.int32)
    _, n_BR = lax.fori_loop(0, n_tiles, tile_step, (zeros, zeros))
    n_ref[...] = n_BR


@functools.partial(jax.jit, static_argnames=("tile", "block_sizes", "interpret", "debug"))
def token_lists(ranked_MxW: jax.Array, indices: jax.Array, counts: jax.Array, dest_MxW: jax.Array,
                hot_H: jax.Array | None = None, *, ranked_u_MxW: jax.Array | None = None,
                tile: int | None = None, block_sizes: ListsBlockSizes = ListsBlockSizes(),
                interpret: bool = False, debug: bool = False) -> tuple[jax.Array, ...]:
    """The token-major kernel's input: per row, its stored entries (slot < min(count, S), tiles
    ascending) that are not hot, compacted: (n_M int32 [M], cols_MxW int32, a_MxW (ranked_MxW's
    dtype), pos_MxW int32), W = dest_MxW.shape[1]; for the entry of rank r among the row's stored
    entries, a = ranked_MxW[i, r] (`rank_values` of the pack) and pos = dest[i, r]. With
    ranked_u_MxW (f32 [M, W] in rank order: the forward's u = x . U_j, `sparse_ffn`'s ranked
    output) a fifth array u_MxW, compacted alike. Slots >= n are unspecified. Rows must hold at
    most W stored entries (the caller zeroes the counts of the others: the token tail). One Pallas
    kernel: per row block, a walk over the tiles with an in-register prefix sum and scatter stores
    (no XLA scatter).

    The pattern as the pack writes it (int32 neuron ids and counts) or as the training forward
    keeps it (uint8 offsets inside the tile, with `tile` = the pack's, and int16 counts:
    `common.validate_pattern`), read as it is. dest_MxW may have more than M rows (`neuron_lists`
    with padded=True: rows past M are not read)."""
    m = indices.shape[0]
    offsets = validate_pattern(indices, counts, tile)
    _, n_tiles, slots = indices.shape
    if not _is_pow2(slots):
        raise ValueError(f"indices must have a power-of-two number of slots S, got {indices.shape}")
    width = dest_MxW.shape[1]
    if dest_MxW.ndim != 2 or dest_MxW.shape[0] < m or dest_MxW.dtype != jnp.int32 or not _is_pow2(width):
        raise ValueError(f"dest_MxW must be int32 [M' >= M={m}, W] with W a power of two, got "
                         f"{dest_MxW.dtype}{dest_MxW.shape}")
    if ranked_MxW.shape != (m, width) or not jnp.issubdtype(ranked_MxW.dtype, jnp.floating):
        raise ValueError(f"ranked_MxW must be float {(m, width)} like dest_MxW's lists (rank_values), "
                         f"got {ranked_MxW.dtype}{ranked_MxW.shape}")
    values = ranked_MxW
    if ranked_u_MxW is not None and (ranked_u_MxW.shape != (m, width)
                                     or ranked_u_MxW.dtype != jnp.float32):
        raise ValueError(f"ranked_u_MxW must be None or float32 {(m, width)} like ranked_MxW, got "
                         f"{ranked_u_MxW.dtype}{ranked_u_MxW.shape}")
    if hot_H is not None and (hot_H.ndim != 1 or hot_H.dtype not in (jnp.bool_, jnp.int32)):
        raise ValueError(f"hot_H must be None or bool/int32 [H], got {hot_H.dtype}{hot_H.shape}")
    br = block_sizes.block_rows
    m_pad = round_up(m, br)
    # Padded rows have count 0: they list nothing.
    values, indices, counts, dest_MxW = pad_rows(m_pad, values, indices, counts, dest_MxW)
    u_in = list(pad_rows(m_pad, ranked_u_MxW)) if ranked_u_MxW is not None else []
    hot = [hot_H.astype(jnp.int32)] if hot_H is not None else []  # Triton refs hold no i1
    out_w = _list_columns(width, slots)
    row_w_spec = pl.BlockSpec((br, width), lambda i: (i, 0))
    list_spec = pl.BlockSpec((br, out_w), lambda i: (i, 0))
    n_M, cols, a, pos, *u = pl.pallas_call(
        functools.partial(_lists_kernel, has_hot=bool(hot), has_u=bool(u_in), slots=slots,
                          n_tiles=n_tiles, width=width, tile=tile if offsets else None),
        grid=(m_pad // br,),
        in_specs=[row_w_spec, *[row_w_spec] * len(u_in),
                  pl.BlockSpec((br, n_tiles, slots), lambda i: (i, 0, 0)),
                  pl.BlockSpec((br, n_tiles), lambda i: (i, 0)),
                  row_w_spec,
                  *[pl.BlockSpec(v.shape, lambda i: (0,)) for v in hot]],
        out_specs=[pl.BlockSpec((br,), lambda i: (i,)), list_spec, list_spec, list_spec,
                   *[list_spec] * len(u_in)],
        out_shape=[jax.ShapeDtypeStruct((m_pad,), jnp.int32),
                   jax.ShapeDtypeStruct((m_pad, out_w), jnp.int32),
                   jax.ShapeDtypeStruct((m_pad, out_w), values.dtype),
                   jax.ShapeDtypeStruct((m_pad, out_w), jnp.int32),
                   *[jax.ShapeDtypeStruct((m_pad, out_w), jnp.float32)] * len(u_in)],
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_bwd_token_lists",
    )(values, *u_in, indices, counts, dest_MxW, *hot)
    return (n_M[:m], cols[:m, :width], a[:m, :width], pos[:m, :width],
            *[v[:m, :width] for v in u])


@jax.jit
def token_lists_reference(ranked_MxW: jax.Array, indices: jax.Array, counts: jax.Array,
                          dest_MxW: jax.Array, hot_H: jax.Array | None = None,
                          ranked_u_MxW: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Plain-jnp version of `token_lists` (XLA scatters; slots >= n hold 0)."""
    m, n_tiles, slots = indices.shape
    width = dest_MxW.shape[1]
    rank_MxTxS, live_MxTxS = stored_ranks(counts, slots)
    j_MxTxS = indices
    keep_MxTxS = live_MxTxS if hot_H is None else live_MxTxS & ~hot_H.astype(bool)[j_MxTxS]
    keep_i32 = keep_MxTxS.astype(jnp.int32)
    keep_T = jnp.sum(keep_i32, axis=2)
    slot_MxTxS = ((jnp.cumsum(keep_T, axis=1) - keep_T)[:, :, None]
                  + jnp.cumsum(keep_i32, axis=2) - keep_i32)
    slot_MxTxS = jnp.where(keep_MxTxS, slot_MxTxS, width).reshape(m, -1)  # dropped
    rows_MxK = jnp.broadcast_to(jnp.arange(m)[:, None], slot_MxTxS.shape)
    rank_MxK = jnp.clip(rank_MxTxS.reshape(m, -1), 0, width - 1)
    pos_MxK = jnp.take_along_axis(dest_MxW, rank_MxK, axis=1)
    a_MxK = jnp.take_along_axis(ranked_MxW, rank_MxK, axis=1)

    def compact(v_MxK, dtype):
        return jnp.zeros((m, width), dtype).at[rows_MxK, slot_MxTxS].set(v_MxK.astype(dtype), mode="drop")

    u = ((compact(jnp.take_along_axis(ranked_u_MxW, rank_MxK, axis=1), jnp.float32),)
         if ranked_u_MxW is not None else ())
    return (jnp.sum(keep_T, axis=1).astype(jnp.int32), compact(j_MxTxS.reshape(m, -1), jnp.int32),
            compact(a_MxK, ranked_MxW.dtype), compact(pos_MxK, jnp.int32), *u)


def _token_bwd_kernel(*refs, gated: bool, has_init: bool, has_u: bool, d: int, d_block: int,
                      e_cap: int, h_dtype, part: str) -> None:
    """Refs by `part`:
    "both":    x, gy [BT, D], n [BT], cols, a, pos [BT, W], w_act, (w_up), w_down [H, D],
               l1_scale [1], (dx_init [BT, D] f32); outputs dx [BT, D], then 3 (gated: t, d_up,
               d_gate) or 2 (t, d_act) f32 [E_cap + BT] neuron-major value arrays (written at pos;
               the tail past E_cap takes dead lanes).
    "entries": (gated) x, gy, n, cols, a, pos, w_up, w_down, l1_scale; outputs the 3 value arrays.
    "dx":      (gated) n, cols, pos, w_act, w_up, d_up, d_gate [E_cap + BT] (what "entries"
               wrote), (dx_init); output dx.
    has_u (gated, "both" and "entries"): a ref u [BT, W] f32 (each entry's x . U_j, kept by the
    forward) follows pos, and the kernel reads u there instead of computing it."""
    refs = list(refs)

    def take(k):
        out = refs[:k]
        del refs[:k]
        return out

    if part == "dx":
        n_ref, cols_ref, pos_ref, w_act_ref, w_up_ref, d_up_ref, d_gate_ref = take(7)
        x_ref = gy_ref = a_ref = w_down_ref = scale_ref = None
    else:
        x_ref, gy_ref, n_ref, cols_ref, a_ref, pos_ref = take(6)
        u_ref = take(1)[0] if has_u else None
        w_act_ref = take(1)[0] if part == "both" else None
        w_up_ref = take(1)[0] if gated else None
        w_down_ref, scale_ref = take(2)
    init_ref = take(1)[0] if has_init and part != "entries" else None
    dx_ref = take(1)[0] if part != "entries" else None
    entry_refs = refs
    block_t = n_ref.shape[0]
    col_D = lax.broadcasted_iota(jnp.int32, (d_block,), 0)
    col_ok_1xD = (col_D < d)[None, :]
    col_1xD = col_D[None, :]
    full_d = d == d_block
    lane_BT = lax.broadcasted_iota(jnp.int32, (block_t,), 0)

    def load_own(ref):
        return plgpu.load(ref.at[:, pl.ds(0, d_block)], mask=None if full_d else col_ok_1xD,
                          other=None if full_d else 0).astype(jnp.float32)

    if part != "dx":
        # x only serves u = x . U_j: not loaded when the forward's u is given.
        x_BTxD = None if has_u else load_own(x_ref)
        gy_BTxD = load_own(gy_ref)
        l1_scale = jnp.sum(scale_ref[...])  # a [1] block: sum -> scalar (value slicing is not lowered)
    n_BT = n_ref[...]

    def gather(ref, j_BT, live_BT):
        # Masked-off rows move no bytes; `other=0` keeps the products below finite.
        return plgpu.load(ref.at[j_BT[:, None], col_1xD], mask=live_BT[:, None] & col_ok_1xD,
                          other=0).astype(jnp.float32)

    def entry_step(e, dx_BTxD):
        live_BT = e < n_BT
        j_BT = plgpu.load(cols_ref.at[:, e])
        pos_BT = plgpu.load(pos_ref.at[:, e])
        # Dead lanes read from / write to distinct addresses past E_cap (a masked store whose
        # masked-off lanes alias live ones can clobber them in interpret mode).
        at_BT = jnp.where(live_BT, pos_BT, e_cap + lane_BT)
        if part == "dx":
            d_up_BT = plgpu.load(d_up_ref.at[at_BT], mask=live_BT, other=0)
            d_gate_BT = plgpu.load(d_gate_ref.at[at_BT], mask=live_BT, other=0)
            up_rows = gather(w_up_ref, j_BT, live_BT)
            act_rows = gather(w_act_ref, j_BT, live_BT)
            return dx_BTxD + jnp.where(live_BT[:, None],
                                       d_up_BT[:, None] * up_rows + d_gate_BT[:, None] * act_rows, 0.0)
        a_BT = plgpu.load(a_ref.at[:, e]).astype(jnp.float32)
        w_rows = gather(w_down_ref, j_BT, live_BT)
        act_rows = gather(w_act_ref, j_BT, live_BT) if part == "both" else None
        dt_BT = jnp.sum(gy_BTxD * w_rows, axis=1)
        if gated:
            # The up rows: for u (unless kept) and, in one launch, for dx.
            up_rows = gather(w_up_ref, j_BT, live_BT) if part == "both" or not has_u else None
            if has_u:
                u_BT = plgpu.load(u_ref.at[:, e])
            else:
                u_BT = jnp.sum(x_BTxD * up_rows, axis=1)
            h_BT = (a_BT * u_BT).astype(h_dtype).astype(jnp.float32)
        else:
            h_BT = a_BT
        dt_BT = dt_BT + l1_scale * jnp.sign(h_BT)
        if gated:
            d_up_BT, d_gate_BT = dt_BT * a_BT, dt_BT * u_BT
            if part == "both":
                dx_BTxD = dx_BTxD + jnp.where(
                    live_BT[:, None], d_up_BT[:, None] * up_rows + d_gate_BT[:, None] * act_rows, 0.0)
            new_values = (h_BT, d_up_BT, d_gate_BT)
        else:
            dx_BTxD = dx_BTxD + jnp.where(live_BT[:, None], dt_BT[:, None] * act_rows, 0.0)
            new_values = (h_BT, dt_BT)
        for ref, v_BT in zip(entry_refs, new_values):
            plgpu.store(ref.at[at_BT], v_BT, mask=live_BT)
        return dx_BTxD

    if part == "entries":
        lax.fori_loop(0, jnp.max(n_BT), entry_step, jnp.zeros((), jnp.float32))
        return
    dx0 = load_own(init_ref) if has_init else jnp.zeros((block_t, d_block), jnp.float32)
    dx_BTxD = lax.fori_loop(0, jnp.max(n_BT), entry_step, dx0)
    plgpu.store(dx_ref.at[:, pl.ds(0, d_block)], dx_BTxD.astype(dx_ref.dtype),
                mask=None if full_d else jnp.broadcast_to(col_ok_1xD, dx_BTxD.shape))


def validate_token_bwd_args(x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW, w_act_HxD, w_up_HxD,
                            w_down_HxD, dx_init) -> None:
    """Raise ValueError naming the offending argument."""
    if x_MxD.ndim != 2:
        raise ValueError(f"x_MxD must be 2-D [M, D], got shape {x_MxD.shape}")
    m, d = x_MxD.shape
    if gy_MxD.shape != x_MxD.shape or gy_MxD.dtype != x_MxD.dtype:
        raise ValueError(f"gy_MxD must be {x_MxD.dtype}{x_MxD.shape} like x_MxD, got "
                         f"{gy_MxD.dtype}{gy_MxD.shape}")
    if n_M.shape != (m,) or n_M.dtype != jnp.int32:
        raise ValueError(f"n_M must be int32 [M={m}], got {n_M.dtype}{n_M.shape}")
    if cols_MxW.ndim != 2 or cols_MxW.shape[0] != m or cols_MxW.dtype != jnp.int32 \
            or not _is_pow2(cols_MxW.shape[1]):
        raise ValueError(f"cols_MxW must be int32 [M={m}, W] with W a power of two, got "
                         f"{cols_MxW.dtype}{cols_MxW.shape}")
    if a_MxW.shape != cols_MxW.shape:
        raise ValueError(f"a_MxW must be {cols_MxW.shape} like cols_MxW, got {a_MxW.shape}")
    if pos_MxW.shape != cols_MxW.shape or pos_MxW.dtype != jnp.int32:
        raise ValueError(f"pos_MxW must be int32 {cols_MxW.shape} like cols_MxW, got "
                         f"{pos_MxW.dtype}{pos_MxW.shape}")
    h = w_act_HxD.shape[0] if w_act_HxD.ndim == 2 else None
    for name, w in (("w_act_HxD", w_act_HxD), ("w_up_HxD", w_up_HxD), ("w_down_HxD", w_down_HxD)):
        if w is not None and (w.ndim != 2 or w.shape != (h, d) or w.dtype != x_MxD.dtype):
            raise ValueError(f"{name} must be {x_MxD.dtype}[H, D={d}] like w_act_HxD, got "
                             f"{w.dtype}{w.shape}")
    if dx_init is not None and (dx_init.shape != (m, d) or dx_init.dtype != jnp.float32):
        raise ValueError(f"dx_init must be None or float32 {(m, d)}, got {dx_init.dtype}{dx_init.shape}")


def _token_bwd_triton(x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW, w_act_HxD, w_up_HxD,
                      w_down_HxD, scale_1, dx_init, u_MxW, *, block_sizes: TokenBwdBlockSizes,
                      interpret: bool, debug: bool):
    m, d = x_MxD.shape
    width = cols_MxW.shape[1]
    bt = block_sizes.block_t
    gated = w_up_HxD is not None
    e_cap = m * width
    kernel = functools.partial(_token_bwd_kernel, gated=gated, d=d, d_block=_next_pow2(d),
                               e_cap=e_cap, h_dtype=x_MxD.dtype)
    full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    row_spec = pl.BlockSpec((bt, d), lambda i: (i, 0))
    n_spec = pl.BlockSpec((bt,), lambda i: (i,))
    list_spec = pl.BlockSpec((bt, width), lambda i: (i, 0))
    scale_spec = pl.BlockSpec((1,), lambda i: (0,))
    e_shape = jax.ShapeDtypeStruct((e_cap + bt,), jnp.float32)
    dx_shape = jax.ShapeDtypeStruct((m, d), x_MxD.dtype)
    init = [dx_init] if dx_init is not None else []
    u = [u_MxW] if u_MxW is not None else []

    def call(part, name, in_specs, out_specs, out_shape, *operands):
        return pl.pallas_call(
            functools.partial(kernel, has_init=bool(init), has_u=bool(u), part=part),
            grid=(m // bt,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
            compiler_params=compiler_params(block_sizes), interpret=interpret, debug=debug,
            name=name)(*operands)

    if gated and block_sizes.split:
        # Two launches, each gathering rows of at most two weights (their working set fits the
        # L2 cache at the paper's shapes, where three do not): the entries (W_down rows, and W_up
        # rows for u unless given), then dx (W_up and W_gate rows, each entry's d_up and d_gate
        # read back at its position).
        entries = call("entries", "twell_bwd_token_entries",
                       [row_spec, row_spec, n_spec, list_spec, list_spec, list_spec,
                        *[list_spec] * len(u), full(w_up_HxD), full(w_down_HxD), scale_spec],
                       [full(e_shape)] * 3, [e_shape] * 3,
                       x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW, *u, w_up_HxD, w_down_HxD,
                       scale_1)
        dx_MxD = call("dx", "twell_bwd_token_dx",
                      [n_spec, list_spec, list_spec, full(w_act_HxD), full(w_up_HxD),
                       full(e_shape), full(e_shape), *[row_spec] * len(init)],
                      row_spec, dx_shape,
                      n_M, cols_MxW, pos_MxW, w_act_HxD, w_up_HxD, entries[1], entries[2], *init)
        return (dx_MxD, *entries)
    weights = (w_act_HxD, w_up_HxD, w_down_HxD) if gated else (w_act_HxD, w_down_HxD)
    n_values = 3 if gated else 2
    return call("both", "twell_bwd_token_gated" if gated else "twell_bwd_token",
                [row_spec, row_spec, n_spec, list_spec, list_spec, list_spec, *[list_spec] * len(u),
                 *[full(w) for w in weights], scale_spec, *[row_spec] * len(init)],
                [row_spec, *[full(e_shape)] * n_values], [dx_shape, *[e_shape] * n_values],
                x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW, *u, *weights, scale_1, *init)


@functools.partial(jax.jit, static_argnames=("padded", "block_sizes", "interpret", "debug"))
def token_backward(x_MxD: jax.Array, gy_MxD: jax.Array, n_M: jax.Array, cols_MxW: jax.Array,
                   a_MxW: jax.Array, pos_MxW: jax.Array, w_act_HxD: jax.Array,
                   w_up_HxD: jax.Array | None, w_down_HxD: jax.Array, l1_scale: jax.Array, *,
                   dx_init: jax.Array | None = None, u_MxW: jax.Array | None = None,
                   padded: bool = False, block_sizes: TokenBwdBlockSizes = TokenBwdBlockSizes(),
                   interpret: bool = False, debug: bool = False
                   ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Token-major backward over per-token lists (module doc; `token_lists` builds them).

    dx_init (f32 [M, D], optional): added to dx before its one rounding (the dense tails' terms).
    u_MxW (f32 [M, W] in list order, gated only, optional): each entry's u = x_i . U_j as the
    forward computed it (`sparse_ffn`'s ranked output, compacted by `token_lists`); the kernel then
    reads it instead of computing it, and the entries' launch gathers W_down rows alone.
    Returns (dx [M, D] in x's dtype, the entry values at their neuron-major positions: (t, d_up,
    d_gate) gated or (t, d_act) when w_up_HxD is None, each f32 [M * W]; positions no listed entry
    maps to are unspecified). Any M (padded to block_t). `padded`: the value arrays as the kernel
    wrote them, longer by its dead lanes' padding (at least M * W + block_t; `neuron_backward`
    takes them so: slicing them would copy them)."""
    validate_token_bwd_args(x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW, w_act_HxD, w_up_HxD,
                            w_down_HxD, dx_init)
    if u_MxW is not None and (w_up_HxD is None or u_MxW.shape != cols_MxW.shape
                              or u_MxW.dtype != jnp.float32):
        raise ValueError(f"u_MxW must be None, or float32 {cols_MxW.shape} like cols_MxW with w_up_HxD "
                         f"given (gated), got {u_MxW.dtype}{u_MxW.shape}"
                         + ("" if w_up_HxD is not None else " without w_up_HxD"))
    m = x_MxD.shape[0]
    m_pad = round_up(m, block_sizes.block_t)
    # Padded rows have n = 0: they read nothing and write no entry.
    x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW = pad_rows(m_pad, x_MxD, gy_MxD, n_M, cols_MxW, a_MxW,
                                                            pos_MxW)
    if dx_init is not None:
        (dx_init,) = pad_rows(m_pad, dx_init)
    if u_MxW is not None:
        (u_MxW,) = pad_rows(m_pad, u_MxW)
    scale_1 = jnp.reshape(l1_scale.astype(jnp.float32), (1,))
    dx_MxD, *entries = _token_bwd_triton(
        x_MxD, gy_MxD, n_M, cols_MxW, a_MxW, pos_MxW, w_act_HxD, w_up_HxD, w_down_HxD, scale_1,
        dx_init, u_MxW, block_sizes=block_sizes, interpret=interpret, debug=debug)
    e = m * cols_MxW.shape[1]
    return dx_MxD[:m], tuple(entries) if padded else tuple(v[:e] for v in entries)


@jax.jit
def token_backward_reference(x_MxD: jax.Array, gy_MxD: jax.Array, n_M: jax.Array,
                             cols_MxW: jax.Array, a_MxW: jax.Array, pos_MxW: jax.Array,
                             w_act_HxD: jax.Array, w_up_HxD: jax.Array | None, w_down_HxD: jax.Array,
                             l1_scale: jax.Array, dx_init: jax.Array | None = None,
                             u_MxW: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Plain-jnp version of `token_backward` (same entries, fp32 arithmetic, same outputs at every
    listed position; others 0)."""
    m, width = cols_MxW.shape
    hi = lax.Precision.HIGHEST
    live_MxW = jnp.arange(width)[None, :] < n_M[:, None]
    j_MxW = jnp.where(live_MxW, cols_MxW, 0)
    a_MxW = jnp.where(live_MxW, a_MxW.astype(jnp.float32), 0.0)
    x32, gy32 = x_MxD.astype(jnp.float32), gy_MxD.astype(jnp.float32)
    act_rows = w_act_HxD.astype(jnp.float32)[j_MxW]  # [M, W, D]
    dt_MxW = jnp.einsum("md,mkd->mk", gy32, w_down_HxD.astype(jnp.float32)[j_MxW], precision=hi)
    if w_up_HxD is not None:
        up_rows = w_up_HxD.astype(jnp.float32)[j_MxW]
        if u_MxW is None:
            u_MxW = jnp.einsum("md,mkd->mk", x32, up_rows, precision=hi)
        u_MxW = jnp.where(live_MxW, u_MxW, 0.0)
        h_MxW = (a_MxW * u_MxW).astype(x_MxD.dtype).astype(jnp.float32)
    else:
        h_MxW = a_MxW
    dt_MxW = jnp.where(live_MxW, dt_MxW + l1_scale.astype(jnp.float32) * jnp.sign(h_MxW), 0.0)
    if w_up_HxD is not None:
        d_up_MxW, d_gate_MxW = dt_MxW * a_MxW, dt_MxW * u_MxW
        dx = (jnp.einsum("mk,mkd->md", d_up_MxW, up_rows, precision=hi)
              + jnp.einsum("mk,mkd->md", d_gate_MxW, act_rows, precision=hi))
        values_MxW = (h_MxW, d_up_MxW, d_gate_MxW)
    else:
        dx = jnp.einsum("mk,mkd->md", dt_MxW, act_rows, precision=hi)
        values_MxW = (h_MxW, dt_MxW)
    if dx_init is not None:
        dx = dx + dx_init
    at_MxW = jnp.where(live_MxW, pos_MxW, m * width)  # dropped
    return dx.astype(x_MxD.dtype), tuple(
        jnp.zeros((m * width,), jnp.float32).at[at_MxW].set(v, mode="drop") for v in values_MxW)
