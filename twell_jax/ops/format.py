"""TwELL: the tiled ELL packing of an activation matrix, in pure JAX.

An [M, H] activation matrix (M tokens, H hidden neurons) is cut into NT = ceil(H / T) column tiles
of width T. Each (row, tile) pair keeps up to S (column, value) slots, in ascending column order,
plus the TRUE number of non-zeros of that pair:

    dense [M, H]                    tile 0 (cols 0..T-1)        tile 1 (cols T..2T-1)   ...
    row i: . 5 . . 7 . | . . 2 . .  ->

    values  [M, NT, S]   row i: [ [5, 7, 0, 0], [2, 0, 0, 0], ... ]   unused slots exactly 0
    indices [M, NT, S]   row i: [ [1, 4, 0, 0], [T+2, 0, 0, 0], ...]  GLOBAL column, unused slots 0
    counts  [M, NT]      row i: [  2,            1,           ... ]   true count, may exceed S

Because unused slots hold value 0 and index 0, a consumer may gather weight rows by `indices`
without masking (a zero value contributes nothing). When a tile overflows (count > S) the first S
non-zeros (lowest columns) are kept and `counts` stays true, so the overflow is visible on the
device: `overflow_count` and `row_overflow_mask` report it and the op recomputes those rows
exactly. Compaction is by rank (a prefix sum over the tile) and a scatter to unique slots: no
atomics, so the pack is deterministic bit for bit.

The reference CUDA code stores the same thing as uint32 words (count in word 0, then
`index | bf16_bits << 16`); `to_reference_words` / `from_reference_words` convert for bf16 data.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TwELL:
    """Packed [n_rows, n_cols] matrix; see the module docstring for the layout."""

    values: jax.Array  # [M, NT, S] activation dtype; unused slots exactly 0
    indices: jax.Array  # [M, NT, S] int32 global column; unused slots 0
    counts: jax.Array  # [M, NT] int32 true non-zeros per (row, tile); may exceed S
    n_cols: int = dataclasses.field(metadata=dict(static=True))  # H
    tile: int = dataclasses.field(metadata=dict(static=True))  # T

    @property
    def n_rows(self) -> int:
        return self.values.shape[0]

    @property
    def n_tiles(self) -> int:
        return self.values.shape[1]

    @property
    def slots(self) -> int:
        return self.values.shape[2]


def compact_columns(mask_BxN: jax.Array, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Deterministic per-row compaction of the True columns of a boolean matrix.

    Returns (cols_BxW int32 ascending column ids, unused slots 0; valid_BxW bool; count_B int32 true
    number of True entries, may exceed `width`). The slot of an entry is its rank among the row's
    True entries (an inclusive prefix sum minus one); entries of rank >= width are not stored.
    """
    n_batch, n = mask_BxN.shape
    rank_BxN = jnp.cumsum(mask_BxN, axis=1, dtype=jnp.int32) - 1
    # Entries that are not stored get the out-of-range slot `width` and are dropped by the
    # scatter; every stored slot receives exactly one write, so the scatter is deterministic.
    slot_BxN = jnp.where(mask_BxN & (rank_BxN < width), rank_BxN, width)
    row_BxN = jnp.broadcast_to(jnp.arange(n_batch, dtype=jnp.int32)[:, None], (n_batch, n))
    col_BxN = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (n_batch, n))
    cols_BxW = jnp.zeros((n_batch, width), jnp.int32).at[row_BxN, slot_BxN].set(col_BxN, mode="drop")
    count_B = jnp.sum(mask_BxN, axis=1, dtype=jnp.int32)
    valid_BxW = jnp.arange(width, dtype=jnp.int32)[None, :] < count_B[:, None]
    return jnp.where(valid_BxW, cols_BxW, 0), valid_BxW, count_B


def _check_dense(dense: jax.Array, name: str) -> None:
    if dense.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [rows, cols] matrix, got shape {dense.shape}")
    if not any(dense.dtype == d for d in _FLOAT_DTYPES):
        raise ValueError(f"{name} must have a float dtype, got {dense.dtype}")


def pack(dense: jax.Array, *, tile: int = 256, slots: int = 32) -> TwELL:
    """Pack the non-zeros of `dense` [M, H] into TwELL (NaN counts as a non-zero).

    Args:
      dense: [M, H] float matrix (typically relu(x @ w_gate.T)).
      tile: columns per tile T (>= 1). H need not be a multiple of T: the last tile is padded.
      slots: stored slots per (row, tile) S, 1 <= S <= T.
    """
    _check_dense(dense, "dense")
    if not isinstance(tile, (int, np.integer)) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    if not isinstance(slots, (int, np.integer)) or not 1 <= slots <= tile:
        raise ValueError(f"slots must be an int with 1 <= slots <= tile ({tile}), got {slots!r}")
    n_rows, n_cols = dense.shape
    n_tiles = max(1, math.ceil(n_cols / tile))
    padded_MxP = jnp.pad(dense, ((0, 0), (0, n_tiles * tile - n_cols)))
    tiles_BxT = padded_MxP.reshape(n_rows * n_tiles, tile)
    local_BxS, valid_BxS, count_B = compact_columns(tiles_BxT != 0, slots)
    values_BxS = jnp.where(valid_BxS, jnp.take_along_axis(tiles_BxT, local_BxS, axis=1), 0)
    tile_start_B = (jnp.arange(n_rows * n_tiles, dtype=jnp.int32) % n_tiles) * tile
    indices_BxS = jnp.where(valid_BxS, local_BxS + tile_start_B[:, None], 0)
    return TwELL(
        values=values_BxS.reshape(n_rows, n_tiles, slots).astype(dense.dtype),
        indices=indices_BxS.reshape(n_rows, n_tiles, slots),
        counts=count_B.reshape(n_rows, n_tiles),
        n_cols=n_cols,
        tile=tile,
    )


def stored_mask(packed: TwELL) -> jax.Array:
    """bool [M, NT, S]: which slots hold a stored entry (slot < min(count, S))."""
    return jnp.arange(packed.slots, dtype=jnp.int32) < packed.counts[..., None]


def unpack(packed: TwELL) -> jax.Array:
    """Dense [M, H] matrix of the STORED entries.

    Exact inverse of `pack` when `overflow_count(packed) == 0`. For overflowing (row, tile) pairs
    only the first S non-zeros were stored, so the result misses the rest: check
    `row_overflow_mask` and recompute those rows from their source when exactness matters.
    """
    n_rows = packed.n_rows
    valid_MxNTxS = stored_mask(packed)
    # Non-stored slots are sent out of range and dropped; stored columns are unique per row.
    cols = jnp.where(valid_MxNTxS, packed.indices, packed.n_cols).reshape(n_rows, -1)
    rows = jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32)[:, None], cols.shape)
    dense = jnp.zeros((n_rows, packed.n_cols), packed.values.dtype)
    return dense.at[rows, cols].set(packed.values.reshape(n_rows, -1), mode="drop")


def overflow_count(packed: TwELL) -> jax.Array:
    """int32 scalar: number of (row, tile) pairs whose true count exceeds the slots."""
    return jnp.sum(packed.counts > packed.slots, dtype=jnp.int32)


def row_overflow_mask(packed: TwELL) -> jax.Array:
    """bool [M]: rows with at least one overflowing tile (their pack is incomplete)."""
    return jnp.any(packed.counts > packed.slots, axis=1)


def row_nnz(packed: TwELL) -> jax.Array:
    """int32 [M]: true number of non-zeros per row (sum of the true tile counts)."""
    return jnp.sum(packed.counts, axis=1, dtype=jnp.int32)


def to_reference_words(packed: TwELL) -> jax.Array:
    """uint32 [M, NT * (S + 1)] in the reference CUDA encoding (bf16 values, H <= 65536 only).

    Per tile: word 0 = true count, words 1..S = `index | bf16_bits << 16`, unused words 0.
    (The reference has S - 1 payload words per S-word segment; here the segment is S + 1 words.)
    """
    if packed.values.dtype != jnp.bfloat16:
        raise ValueError(f"packed.values must be bfloat16 for the reference encoding, got {packed.values.dtype}")
    if packed.n_cols > 65536:
        raise ValueError(f"packed.n_cols must be <= 65536 for 16-bit indices, got {packed.n_cols}")
    bits = jax.lax.bitcast_convert_type(packed.values, jnp.uint16).astype(jnp.uint32)
    entries = packed.indices.astype(jnp.uint32) | (bits << 16)
    entries = jnp.where(stored_mask(packed), entries, jnp.uint32(0))
    words = jnp.concatenate([packed.counts.astype(jnp.uint32)[..., None], entries], axis=-1)
    return words.reshape(packed.n_rows, -1)


def from_reference_words(words: jax.Array, *, n_cols: int, tile: int = 256) -> TwELL:
    """Inverse of `to_reference_words` (values come back as bfloat16)."""
    n_tiles = max(1, math.ceil(n_cols / tile))
    if words.ndim != 2 or words.shape[1] % n_tiles:
        raise ValueError(f"words must be [M, {n_tiles} * (S + 1)] for n_cols={n_cols}, tile={tile}; got {words.shape}")
    seg = words.astype(jnp.uint32).reshape(words.shape[0], n_tiles, -1)
    counts = seg[..., 0].astype(jnp.int32)
    entries = seg[..., 1:]
    packed = TwELL(
        values=jax.lax.bitcast_convert_type((entries >> 16).astype(jnp.uint16), jnp.bfloat16),
        indices=(entries & 0xFFFF).astype(jnp.int32),
        counts=counts,
        n_cols=n_cols,
        tile=tile,
    )
    valid = stored_mask(packed)
    return dataclasses.replace(
        packed,
        values=jnp.where(valid, packed.values, jnp.zeros((), jnp.bfloat16)),
        indices=jnp.where(valid, packed.indices, 0),
    )
