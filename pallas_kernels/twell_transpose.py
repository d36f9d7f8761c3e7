"""Transpose kernel (Pallas, Triton backend): a TwELL pack's pattern -> neuron-major CSR lists.

The sparse backward's token-major kernel ranks each row's live entries r = 0, 1, ... (tiles
ascending, slots ascending: r = sum_{t' < t} min(counts[i, t'], S) + k); the neuron-major kernel
wants, per neuron j, its entries in ascending token order. This module computes, from the pattern
alone (indices [M, NT, S], counts [M, NT]), the CSR and the permutation between the two:

    count_H [H]       entries of neuron j                     start_H [H]  exclusive prefix sum
    tokens_E [M*W]    row of the entry at CSR position p      (p >= total entries: unspecified)
    dest_MxW [M, W]   CSR position of row i's entry of rank r (r >= the row's live count: -1)

The pattern as the pack writes it (int32 neuron ids and counts) or as the training forward keeps
it (`pallas_backward.Kept`: uint8 offsets inside the tile, neuron - t * tile, and int16 counts),
read as it is: the kernels widen each load to int32 in registers and compare offsets with the
lane itself, so the backward makes no int32 copy of the kept pattern.

W = next_pow2(width). This is exactly a stable sort by neuron id of the row-major live entries
(`neuron_lists_reference` does it that way), computed as a deterministic counting sort with no
atomics and no sort, in two pallas_calls over the grid (NT tiles, C chunks of `chunk_rows` rows):

1. Histogram. Program (t, c) walks its chunk `block_rows` rows at a time; per block a loop over
   the slots k < max live count of the block builds the block's one-hot O [block_rows, tile]
   (neuron - t*tile == lane, masked by live; a row holds a neuron at most once) and adds its
   column sums to a [tile] register histogram, stored as hist[c, tile t's lanes].
2. XLA, O(C * H + M * NT): count = sum over chunks, start = exclusive cumsum, base[c, j] = start_j
   + entries of neuron j in the chunks before c, first[i, t] = the rank of (row i, tile t)'s slot 0.
3. Rank + scatter. Program (t, c) carries running[tile] = base[c, tile t's lanes]; per block it
   builds O again, holding k + 1 (not 1) at a hit so the slot of every (row, neuron) is known,
   gets each entry's CSR position as running + (exclusive cumsum of O over the block's rows),
   and writes both outputs with ONE masked scatter store each over the [block_rows, tile] tile:
   dest[i, first[i, t] + k] = position and tokens[position] = i; then running += column sums.
   The program of the last tile writes -1 to each row's slots past its live count.

Every position is written by exactly one lane of one program, so the result does not depend on
the order programs run in. Masked-off lanes of a scatter store point at a padding region (one
distinct address per lane) past the lists: the interpreter implements a masked store as a
read-modify-write scatter, in which a dead lane sharing a live lane's address could clobber it.
`neuron_lists` slices the padding off, or with `padded=True` leaves it on for the backward's
kernels, which read only the lists (a slice of a kernel's output is a copy).

Preconditions (the caller's, as for the token-major kernel): the pattern is a TwELL pack's (live
slots of tile t hold neurons in [t*tile, (t+1)*tile), a neuron at most once per row), and no row
has more than `width` live entries (rows that do are passed with counts 0). Violations are not
detected; the stores stay in bounds. tile = next_pow2(ceil(H / NT)), the pack's tile.
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
                                   next_pow2 as _next_pow2, pad_rows, round_up, validate_pattern)

Lists = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # (start_H, count_H, tokens_E, dest_MxW)


@dataclasses.dataclass(frozen=True)
class TransposeBlockSizes:
    """Static launch parameters of the two transpose kernels (histogram, rank + scatter)."""

    # Swept on the H100 (experiments/bench_transpose.py --sweep, M 16384, k 29; BENCHMARKS.md): 8
    # rows x 128-row chunks beat 32 x 256 and XLA's sort: smaller
    # [block_rows, tile] int32 register tiles (8 x 256 over 4 warps: 16 registers per thread each)
    # and 4x the programs.
    block_rows: int = 8  # token rows per inner step (power of two)
    chunk_rows: int = 128  # token rows per program (multiple of block_rows; the grid's chunk axis)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # pipelining depth (dynamic trip counts: 1 = none)

    def __post_init__(self) -> None:
        if (isinstance(self.block_rows, bool) or not isinstance(self.block_rows, int)
                or not _is_pow2(self.block_rows)):
            raise ValueError(f"TransposeBlockSizes.block_rows must be a power of two, got "
                             f"{self.block_rows!r}")
        if (isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int)
                or self.chunk_rows < self.block_rows or self.chunk_rows % self.block_rows):
            raise ValueError(f"TransposeBlockSizes.chunk_rows must be a multiple of block_rows="
                             f"{self.block_rows}, got {self.chunk_rows!r}")
        check_launch_sizes(self)


def pack_tile(n_neurons: int, n_tiles: int) -> int:
    """The pack's tile for H neurons in NT tiles: the power of two T with ceil(H / T) == NT
    (twell_pack: NT = ceil(H / tile), tile a power of two). ValueError when there is none."""
    tile = _next_pow2(-(-n_neurons // n_tiles))
    if -(-n_neurons // tile) != n_tiles:
        raise ValueError(f"n_neurons={n_neurons} cannot fill NT={n_tiles} tiles of a power-of-two "
                         f"width (the pack's NT = ceil(H / tile))")
    return tile


def neuron_ids(indices: jax.Array, tile: int) -> jax.Array:
    """int32 [M, NT, S]: the neuron ids of a pattern's indices (uint8 offsets inside the tile plus
    the tile's first neuron t * tile; int32 ids as they are)."""
    if indices.dtype == jnp.int32:
        return indices
    first_T = jnp.arange(indices.shape[1], dtype=jnp.int32) * tile
    return indices.astype(jnp.int32) + first_T[None, :, None]


def validate_transpose_args(indices: jax.Array, counts: jax.Array, n_neurons: int, width: int
                            ) -> tuple[int, bool]:
    """Raise ValueError naming the offending argument; returns (the pack's tile, whether indices
    are uint8 offsets inside the tile: `common.validate_pattern`)."""
    if indices.ndim != 3:
        raise ValueError(f"indices must be [M, NT, S], got {indices.dtype}{indices.shape}")
    m, n_tiles, slots = indices.shape
    if n_tiles < 1 or slots < 1:
        raise ValueError(f"indices must have NT >= 1 tiles and S >= 1 slots, got shape {indices.shape}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    if isinstance(n_neurons, bool) or not isinstance(n_neurons, int) or n_neurons < 1:
        raise ValueError(f"n_neurons must be an int >= 1, got {n_neurons!r}")
    if m * _next_pow2(width) >= 2**30:
        raise ValueError(f"M * next_pow2(width) = {m * _next_pow2(width)} must be < 2**30 (int32 "
                         f"CSR positions with padding)")
    tile = pack_tile(n_neurons, n_tiles)
    return tile, validate_pattern(indices, counts, tile)


def _lanes(tile: int, offsets: bool) -> jax.Array:
    """int32 [1, tile]: what a slot holds for each lane's neuron in this program's tile t: the
    neuron id t * tile + lane, or with offsets (uint8 indices) the lane itself."""
    lane_1xT = lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    return lane_1xT if offsets else lane_1xT + pl.program_id(0) * tile


def _block_slots(indices_ref, counts_ref, r0: jax.Array, lane_1xT: jax.Array, *, slots: int,
                 block_rows: int) -> tuple[jax.Array, jax.Array]:
    """For rows [r0, r0 + block_rows) of the program's chunk: (int32 [block_rows, tile], k + 1 where
    the row's live slot k holds the lane's neuron (`_lanes`), 0 elsewhere (a row holds a neuron at
    most once); the rows' live slot counts [block_rows]). Indices and counts of any of the
    pattern's dtypes (`common.validate_pattern`) widen to int32 in registers."""
    rows = pl.ds(r0, block_rows)
    live_BR = jnp.minimum(plgpu.load(counts_ref.at[rows]).astype(jnp.int32), slots)

    def slot_step(k, hit_BRxT):
        j_BR = plgpu.load(indices_ref.at[rows, k]).astype(jnp.int32)
        hit = (j_BR[:, None] == lane_1xT) & (k < live_BR)[:, None]
        return jnp.where(hit, k + 1, hit_BRxT)

    slot_BRxT = lax.fori_loop(0, jnp.max(live_BR), slot_step,
                              jnp.zeros((block_rows, lane_1xT.shape[1]), jnp.int32))
    return slot_BRxT, live_BR


def _hist_kernel(indices_ref, counts_ref, hist_ref, *, tile: int, slots: int, block_rows: int,
                 offsets: bool) -> None:
    """Program (t, c). Refs: indices [CR, S] and counts [CR] of tile t, chunk c; out hist [tile]."""
    lane_1xT = _lanes(tile, offsets)
    n_blocks = counts_ref.shape[0] // block_rows

    def block_step(b, hist_T):
        slot_BRxT, _ = _block_slots(indices_ref, counts_ref, b * block_rows, lane_1xT, slots=slots,
                                    block_rows=block_rows)
        return hist_T + jnp.sum((slot_BRxT > 0).astype(jnp.int32), axis=0)

    hist_ref[...] = lax.fori_loop(0, n_blocks, block_step, jnp.zeros((tile,), jnp.int32))


def _rank_kernel(indices_ref, counts_ref, first_ref, base_ref, dest_ref, tokens_ref, *, tile: int,
                 slots: int, block_rows: int, n_tiles: int, width: int, dest_pad: int,
                 tokens_pad: int, offsets: bool) -> None:
    """Program (t, c). Refs: indices [CR, S], counts [CR], first [CR] (rank of slot 0) of tile t,
    chunk c; base [tile] (CSR position of the chunk's first entry per lane's neuron); outputs (whole,
    flat): dest [M_pad * W + pad rounded up to W], tokens [M * W + pad] (pad = block_rows * tile).
    Indices: neuron ids, or with `offsets` uint8 offsets inside tile t (`_lanes`)."""
    t, c = pl.program_id(0), pl.program_id(1)
    chunk_rows = counts_ref.shape[0]
    lane_1xT = _lanes(tile, offsets)
    # A distinct padding address per lane of a [block_rows, tile] store (dead lanes go there).
    spare_BRxT = (lax.broadcasted_iota(jnp.int32, (block_rows, tile), 0) * tile
                  + lax.broadcasted_iota(jnp.int32, (block_rows, tile), 1))
    row_BR = lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    rank_1xW = lax.broadcasted_iota(jnp.int32, (1, width), 1)

    def block_step(b, running_T):
        r0 = b * block_rows
        rows = pl.ds(r0, block_rows)
        slot_BRxT, live_BR = _block_slots(indices_ref, counts_ref, r0, lane_1xT, slots=slots,
                                          block_rows=block_rows)
        hit_BRxT = slot_BRxT > 0
        one_BRxT = hit_BRxT.astype(jnp.int32)
        # Entries of a neuron in earlier rows of the block: an exclusive cumsum over rows.
        pos_BRxT = running_T[None, :] + jnp.cumsum(one_BRxT, axis=0) - one_BRxT
        first_BR = plgpu.load(first_ref.at[rows])
        token_BR = c * chunk_rows + r0 + row_BR
        rank_BRxT = first_BR[:, None] + slot_BRxT - 1
        dest_ok = hit_BRxT & (rank_BRxT < width)
        plgpu.store(dest_ref.at[jnp.where(dest_ok, token_BR[:, None] * width + rank_BRxT,
                                          dest_pad + spare_BRxT)],
                    pos_BRxT, mask=dest_ok)
        tokens_ok = hit_BRxT & (pos_BRxT < tokens_pad)
        plgpu.store(tokens_ref.at[jnp.where(tokens_ok, pos_BRxT, tokens_pad + spare_BRxT)],
                    jnp.broadcast_to(token_BR[:, None], (block_rows, tile)), mask=tokens_ok)
        # The last tile's program knows each row's live count: its slots past it get -1.
        end_BR = first_BR + live_BR
        dead_BRxW = (rank_1xW >= end_BR[:, None]) & (t == n_tiles - 1)
        plgpu.store(dest_ref.at[token_BR[:, None] * width + rank_1xW],
                    jnp.full((block_rows, width), -1, jnp.int32), mask=dead_BRxW)
        return running_T + jnp.sum(one_BRxT, axis=0)

    lax.fori_loop(0, chunk_rows // block_rows, block_step, base_ref[...])


def _histogram(indices: jax.Array, counts: jax.Array, *, tile: int, block_rows: int, chunk_rows: int,
               block_sizes: TransposeBlockSizes, interpret: bool, debug: bool) -> jax.Array:
    """Pass 1: the per-chunk histograms, int32 [C, NT * tile] (M % chunk_rows == 0)."""
    m_pad, n_tiles, slots = indices.shape
    squeezed = pl.Squeezed()
    return pl.pallas_call(
        functools.partial(_hist_kernel, tile=tile, slots=slots, block_rows=block_rows,
                          offsets=indices.dtype == jnp.uint8),
        grid=(n_tiles, m_pad // chunk_rows),
        in_specs=[pl.BlockSpec((chunk_rows, squeezed, slots), lambda t, c: (c, t, 0)),
                  pl.BlockSpec((chunk_rows, squeezed), lambda t, c: (c, t))],
        out_specs=pl.BlockSpec((squeezed, tile), lambda t, c: (c, t)),
        out_shape=jax.ShapeDtypeStruct((m_pad // chunk_rows, n_tiles * tile), jnp.int32),
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_transpose_hist",
    )(indices, counts)


def _transpose_triton(indices: jax.Array, counts: jax.Array, hist_CxHp: jax.Array | None, *,
                      n_neurons: int, tile: int, width: int, n_entries: int, block_rows: int,
                      chunk_rows: int, block_sizes: TransposeBlockSizes, interpret: bool,
                      debug: bool) -> Lists:
    """The two launches and the XLA between them, on M % chunk_rows == 0 (padded rows: count 0).
    n_entries = the caller's M * W (tokens_E's length before its padding); hist_CxHp = pass 1's
    output when the caller has it (`chunk_histograms`), else pass 1 runs here. Returns tokens_E
    and dest as the rank pass wrote them, each longer than its lists by the dead lanes' padding
    (tokens_E [n_entries + block_rows * tile], dest [M + P / W, W]: the padding P rounded up to
    whole rows, so the reshape is free); `neuron_lists` says who slices them."""
    m_pad, n_tiles, slots = indices.shape
    n_chunks = m_pad // chunk_rows
    squeezed = pl.Squeezed()
    grid = (n_tiles, n_chunks)
    pattern_specs = [pl.BlockSpec((chunk_rows, squeezed, slots), lambda t, c: (c, t, 0)),
                     pl.BlockSpec((chunk_rows, squeezed), lambda t, c: (c, t))]
    hist_spec = pl.BlockSpec((squeezed, tile), lambda t, c: (c, t))
    if hist_CxHp is None:
        hist_CxHp = _histogram(indices, counts, tile=tile, block_rows=block_rows,
                               chunk_rows=chunk_rows, block_sizes=block_sizes, interpret=interpret,
                               debug=debug)

    count_Hp = jnp.sum(hist_CxHp, axis=0)
    start_Hp = jnp.cumsum(count_Hp) - count_Hp
    base_CxHp = start_Hp[None, :] + jnp.cumsum(hist_CxHp, axis=0) - hist_CxHp
    live_MxNT = jnp.minimum(counts.astype(jnp.int32), slots)
    first_MxNT = jnp.cumsum(live_MxNT, axis=1) - live_MxNT

    pad = block_rows * tile
    dest_len = m_pad * width + round_up(pad, width)
    dest_flat, tokens_flat = pl.pallas_call(
        functools.partial(_rank_kernel, tile=tile, slots=slots, block_rows=block_rows,
                          n_tiles=n_tiles, width=width, dest_pad=m_pad * width,
                          tokens_pad=n_entries, offsets=indices.dtype == jnp.uint8),
        grid=grid,
        in_specs=[*pattern_specs, pl.BlockSpec((chunk_rows, squeezed), lambda t, c: (c, t)),
                  hist_spec],
        out_specs=[pl.BlockSpec((dest_len,), lambda t, c: (0,)),
                   pl.BlockSpec((n_entries + pad,), lambda t, c: (0,))],
        out_shape=[jax.ShapeDtypeStruct((dest_len,), jnp.int32),
                   jax.ShapeDtypeStruct((n_entries + pad,), jnp.int32)],
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_transpose_rank",
    )(indices, counts, first_MxNT, base_CxHp)
    return start_Hp[:n_neurons], count_Hp[:n_neurons], tokens_flat, dest_flat.reshape(-1, width)


def _chunking(m: int, block_sizes: TransposeBlockSizes) -> tuple[int, int]:
    """(block_rows, chunk_rows) of a pattern of m rows: a chunk is at most m rounded up to
    block_rows rows, so a small m costs one small chunk."""
    if not isinstance(block_sizes, TransposeBlockSizes):
        raise ValueError(f"block_sizes must be a TransposeBlockSizes, got {type(block_sizes).__name__}")
    block_rows = block_sizes.block_rows
    return block_rows, min(block_sizes.chunk_rows, round_up(m, block_rows))


def chunk_histograms_shape(m: int, n_tiles: int, tile: int,
                           block_sizes: TransposeBlockSizes = TransposeBlockSizes()) -> tuple[int, int]:
    """The shape of `chunk_histograms` for a pattern of m rows and n_tiles tiles of `tile` lanes."""
    _, chunk_rows = _chunking(max(m, 1), block_sizes)
    return -(-m // chunk_rows), n_tiles * tile


@functools.partial(jax.jit, static_argnames=("n_neurons", "block_sizes", "interpret", "debug"))
def chunk_histograms(indices: jax.Array, counts: jax.Array, n_neurons: int, *,
                     block_sizes: TransposeBlockSizes = TransposeBlockSizes(),
                     interpret: bool = False, debug: bool = False) -> jax.Array:
    """The transpose's first pass: int32 [C, NT * tile], the live entries of each neuron in each
    chunk of rows (`chunk_histograms_shape`). Summed over chunks: `neuron_histogram`. Given to
    `neuron_lists(..., hist=)` with the same pattern and block sizes, it saves that pass (the
    training forward computes it, for the backward's tail sizes in aux, and keeps it)."""
    tile, _ = validate_transpose_args(indices, counts, n_neurons, 1)
    m = indices.shape[0]
    block_rows, chunk_rows = _chunking(max(m, 1), block_sizes)
    if m == 0:
        return jnp.zeros(chunk_histograms_shape(0, indices.shape[1], tile, block_sizes), jnp.int32)
    indices, counts = pad_rows(round_up(m, chunk_rows), indices, counts)
    return _histogram(indices, counts, tile=tile, block_rows=block_rows, chunk_rows=chunk_rows,
                      block_sizes=block_sizes, interpret=interpret, debug=debug)


@functools.partial(jax.jit, static_argnames=("n_neurons", "width", "padded", "block_sizes", "interpret",
                                             "debug"))
def neuron_lists(indices: jax.Array, counts: jax.Array, n_neurons: int, *, width: int,
                 hist: jax.Array | None = None, padded: bool = False,
                 block_sizes: TransposeBlockSizes = TransposeBlockSizes(), interpret: bool = False,
                 debug: bool = False) -> Lists:
    """Neuron-major CSR lists of a TwELL pattern by a counting sort (module doc).

    Returns (start_H, count_H int32 [H], tokens_E int32 [M * W], dest_MxW int32 [M, W]) with
    W = next_pow2(width); equal to `neuron_lists_reference`. Any M (padded to chunk_rows; a chunk
    is at most M rounded up to block_rows rows, so small M costs one small chunk). The pattern:
    int32 neuron ids or uint8 offsets inside the tile, int32 or int16 counts
    (`common.validate_pattern`). `hist`: the `chunk_histograms` of the same (indices, counts) and
    block sizes, when the caller has them (then the first pass does not run; other values give
    wrong lists). `padded`: tokens_E and dest_MxW as the kernel wrote them, longer (tokens_E
    [M * W + P], dest_MxW [M + P', W]: the dead lanes' padding, past the lists; contents there
    unspecified), for consumers that take them so (`neuron_backward`, `token_lists`): slicing
    them to their lists' lengths would copy them."""
    block_rows, chunk_rows = _chunking(max(indices.shape[0], 1), block_sizes)
    tile, _ = validate_transpose_args(indices, counts, n_neurons, width)
    m = indices.shape[0]
    w = _next_pow2(width)
    if hist is not None:
        expected = chunk_histograms_shape(m, indices.shape[1], tile, block_sizes)
        if hist.shape != expected or hist.dtype != jnp.int32:
            raise ValueError(f"hist must be int32 {expected} (chunk_histograms of this pattern), got "
                             f"{hist.dtype} {hist.shape}")
    if m == 0:
        zeros_H = jnp.zeros((n_neurons,), jnp.int32)
        return zeros_H, zeros_H, jnp.zeros((0,), jnp.int32), jnp.zeros((0, w), jnp.int32)
    indices, counts = pad_rows(round_up(m, chunk_rows), indices, counts)
    start_H, count_H, tokens_E, dest_MxW = _transpose_triton(
        indices, counts, hist, n_neurons=n_neurons, tile=tile, width=w, n_entries=m * w,
        block_rows=block_rows, chunk_rows=chunk_rows, block_sizes=block_sizes,
        interpret=interpret, debug=debug)
    if padded:
        return start_H, count_H, tokens_E, dest_MxW
    return start_H, count_H, tokens_E[:m * w], dest_MxW[:m]


def sort_lists(cols_MxW: jax.Array, n_neurons: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """CSR lists of a token-major ELL by XLA's stable sort (the backward's first transpose):
    (start_H, count_H, perm_E) with perm_E[p] = the flat ELL slot (i * W + r) of the entry at CSR
    position p. Empty slots hold neuron id n_neurons (they sort last); the offsets by a binary
    search in the sorted ids."""
    key_E = cols_MxW.reshape(-1)
    sorted_key_E, perm_E = lax.sort((key_E, jnp.arange(key_E.shape[0], dtype=jnp.int32)),
                                    num_keys=1, is_stable=True)
    bounds_H1 = jnp.searchsorted(sorted_key_E, jnp.arange(n_neurons + 1, dtype=jnp.int32),
                                 side="left").astype(jnp.int32)
    return bounds_H1[:-1], bounds_H1[1:] - bounds_H1[:-1], perm_E


@functools.partial(jax.jit, static_argnames=("n_neurons", "width"))
def neuron_lists_reference(indices: jax.Array, counts: jax.Array, n_neurons: int, *,
                           width: int) -> Lists:
    """Plain-jnp `neuron_lists`: compact each row's live slots to its token-major ELL row (as the
    token-major kernel does), `sort_lists`, dest = the inverse permutation."""
    tile, _ = validate_transpose_args(indices, counts, n_neurons, width)
    indices, counts = neuron_ids(indices, tile), counts.astype(jnp.int32)
    m, n_tiles, slots = indices.shape
    w = _next_pow2(width)
    live_MxK = (jnp.arange(slots)[None, None, :] < jnp.minimum(counts, slots)[:, :, None]).reshape(m, -1)
    rank_MxK = jnp.where(live_MxK, jnp.cumsum(live_MxK, axis=1, dtype=jnp.int32) - 1, w)
    rows_MxK = jnp.broadcast_to(jnp.arange(m)[:, None], rank_MxK.shape)
    cols_MxW = jnp.full((m, w), n_neurons, jnp.int32).at[rows_MxK, rank_MxK].set(
        indices.reshape(m, -1), mode="drop")
    start_H, count_H, perm_E = sort_lists(cols_MxW, n_neurons)
    n_entries = m * w
    position_E = jnp.where(jnp.arange(n_entries, dtype=jnp.int32) < jnp.sum(count_H),
                           jnp.arange(n_entries, dtype=jnp.int32), -1)
    dest_MxW = jnp.zeros((n_entries,), jnp.int32).at[perm_E].set(position_E).reshape(m, w)
    return start_H, count_H, perm_E // w, dest_MxW


@functools.partial(jax.jit, static_argnames=("n_neurons", "block_sizes", "interpret", "debug"))
def neuron_histogram(indices: jax.Array, counts: jax.Array, n_neurons: int, *,
                     block_sizes: TransposeBlockSizes = TransposeBlockSizes(), interpret: bool = False,
                     debug: bool = False) -> jax.Array:
    """int32 [H]: the live entries (slot < min(count, S)) of each neuron in a TwELL pattern: the
    transpose's first pass alone (count_H of `neuron_lists`, without the rank pass; no row-width
    limit). Deterministic, no atomics: an XLA scatter-add of the M * NT * S slots into [H] took
    several ms per layer on the H100 (hot neurons serialize the atomics)."""
    hist_CxHp = chunk_histograms(indices, counts, n_neurons, block_sizes=block_sizes,
                                 interpret=interpret, debug=debug)
    return jnp.sum(hist_CxHp, axis=0)[:n_neurons]
