"""Hybrid ELL + dense-tail sparse matrices for training, and the products the FFN op needs.

Logical shape [R rows, N cols]. A row with at most W pattern entries lives in the ELL part; a
denser row lives, complete, in one of C dense tail rows (static capacity, so no host sync):

    ell_values [R, W]  ell_cols [R, W]  ell_count [R]     row_nnz [R]   (true pattern size)
    row 0: [a, b, 0, 0]  [3, 9, 0, 0]     2                 2
    row 1: [0, 0, 0, 0]  [0, 0, 0, 0]     0                 7   -> tail slot 0
    row 2: [c, 0, 0, 0]  [5, 0, 0, 0]     1                 1

    tail_values [C, N]   tail_pattern [C, N]   tail_rows [C]  = [1, -1, ...]  (row id or -1)
    tail_overflow: int32 number of rows that needed a tail slot and found none (or that could not
                   be filled exactly); such rows are NOT represented, so any consumer must treat
                   tail_overflow > 0 as "use the exact dense path" (the op does, with lax.cond).

Rules every function here keeps:
- ELL slots are in ascending column order; slots >= ell_count hold value 0 and column 0.
- A row is in the ELL (ell_count = row_nnz <= W) or in the tail (ell_count = 0), never both.
- The tail carries its pattern explicitly, so an on-pattern value that is exactly 0 (e.g. an up
  activation of 0) stays on the pattern through products and transposes; tail values are 0 off
  the pattern.
- Everything is compaction by rank (prefix sums), stable sorts and scatters to unique positions:
  deterministic, no atomics. Hybrids derived from one pattern share ell_cols / ell_count /
  row_nnz / tail_rows / tail_pattern, so elementwise ops are plain ops on aligned value arrays.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from twell_jax.ops import format as twell_format

# ELL slots processed per step of the product loops: bounds the gathered [R, chunk, D] block.
_SLOT_CHUNK = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Hybrid:
    """[R, N] sparse matrix: ELL rows + dense tail rows (see the module docstring)."""

    ell_values: jax.Array  # [R, W] values, 0 in unused slots
    ell_cols: jax.Array  # [R, W] int32 ascending columns, 0 in unused slots
    ell_count: jax.Array  # [R] int32 used ELL slots (row_nnz, or 0 when the row is in the tail)
    row_nnz: jax.Array  # [R] int32 true number of pattern entries of the row
    tail_values: jax.Array  # [C, N] complete rows, 0 off the pattern and in unused slots
    tail_pattern: jax.Array  # [C, N] bool explicit pattern of each tail row
    tail_rows: jax.Array  # [C] int32 row id held by the slot, -1 if unused
    tail_overflow: jax.Array  # int32 scalar: rows that are not represented (see module doc)
    n_cols: int = dataclasses.field(metadata=dict(static=True))  # N

    @property
    def shape(self) -> tuple[int, int]:
        return (self.ell_values.shape[0], self.n_cols)

    @property
    def ell_width(self) -> int:
        return self.ell_values.shape[1]

    @property
    def tail_capacity(self) -> int:
        return self.tail_values.shape[0]


def _check_capacities(ell_width: int, tail_capacity: int) -> None:
    if not isinstance(ell_width, int) or ell_width < 1:
        raise ValueError(f"ell_width must be an int >= 1, got {ell_width!r}")
    if not isinstance(tail_capacity, int) or tail_capacity < 0:
        raise ValueError(f"tail_capacity must be an int >= 0, got {tail_capacity!r}")


def _assign_tail_slots(needs_tail_R: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Give the rows that need a tail slot consecutive slots in ascending row order.

    Returns (slot_R: slot or `capacity` when none, tail_rows_C: row or -1, lost_R: needed a slot
    but the capacity was exhausted).
    """
    rank_R = jnp.cumsum(needs_tail_R, dtype=jnp.int32) - 1
    has_slot_R = needs_tail_R & (rank_R < capacity)
    slot_R = jnp.where(has_slot_R, rank_R, capacity)
    rows_R = jnp.arange(needs_tail_R.shape[0], dtype=jnp.int32)
    tail_rows_C = jnp.full((capacity,), -1, jnp.int32).at[slot_R].set(rows_R, mode="drop")
    return slot_R, tail_rows_C, needs_tail_R & ~has_slot_R


def ell_mask(h: Hybrid) -> jax.Array:
    """bool [R, W]: the ELL slots that hold an entry."""
    return jnp.arange(h.ell_width, dtype=jnp.int32)[None, :] < h.ell_count[:, None]


def _tail_valid(h: Hybrid) -> jax.Array:
    """bool [C, N]: tail entries that are on the pattern of a used slot."""
    return h.tail_pattern & (h.tail_rows >= 0)[:, None]


def from_dense(
    dense_RxN: jax.Array,
    *,
    ell_width: int,
    tail_capacity: int,
    pattern_RxN: jax.Array | None = None,
) -> Hybrid:
    """Hybrid of a dense matrix. Pattern = `pattern_RxN` if given (explicit zeros on it are kept),
    else the non-zeros of `dense_RxN`."""
    _check_capacities(ell_width, tail_capacity)
    if dense_RxN.ndim != 2:
        raise ValueError(f"dense_RxN must be 2-D, got shape {dense_RxN.shape}")
    mask_RxN = dense_RxN != 0 if pattern_RxN is None else pattern_RxN.astype(bool)
    if mask_RxN.shape != dense_RxN.shape:
        raise ValueError(f"pattern_RxN must have shape {dense_RxN.shape}, got {mask_RxN.shape}")
    cols_RxW, valid_RxW, nnz_R = twell_format.compact_columns(mask_RxN, ell_width)
    needs_tail_R = nnz_R > ell_width
    _, tail_rows_C, lost_R = _assign_tail_slots(needs_tail_R, tail_capacity)
    in_ell_RxW = valid_RxW & ~needs_tail_R[:, None]
    ell_values = jnp.take_along_axis(dense_RxN, cols_RxW, axis=1)
    safe_rows_C = jnp.maximum(tail_rows_C, 0)
    tail_pattern = mask_RxN[safe_rows_C] & (tail_rows_C >= 0)[:, None]
    return Hybrid(
        ell_values=jnp.where(in_ell_RxW, ell_values, 0).astype(dense_RxN.dtype),
        ell_cols=jnp.where(in_ell_RxW, cols_RxW, 0),
        ell_count=jnp.where(needs_tail_R, 0, nnz_R),
        row_nnz=nnz_R,
        tail_values=jnp.where(tail_pattern, dense_RxN[safe_rows_C], 0).astype(dense_RxN.dtype),
        tail_pattern=tail_pattern,
        tail_rows=tail_rows_C,
        tail_overflow=jnp.sum(lost_R, dtype=jnp.int32),
        n_cols=dense_RxN.shape[1],
    )


def from_twell(
    packed: twell_format.TwELL,
    *,
    ell_width: int,
    tail_capacity: int,
    recompute_rows: Callable[[jax.Array], jax.Array] | None = None,
) -> Hybrid:
    """Hybrid of a TwELL pack (pattern = the packed non-zeros).

    Rows with more than `ell_width` non-zeros, and rows with an overflowing tile (their pack is
    incomplete), go to the tail. Tail rows are filled by `recompute_rows(rows_C) -> [C, N]` (the
    exact dense rows; entries of unused slots are ignored) when given. Without it they are filled
    from the pack, which is exact only for rows without tile overflow: rows with tile overflow are
    then counted in `tail_overflow` (not represented).
    """
    _check_capacities(ell_width, tail_capacity)
    n_rows, n_cols = packed.n_rows, packed.n_cols
    stored_RxK = twell_format.stored_mask(packed).reshape(n_rows, -1)
    # The flattened slots are already in ascending column order (tile by tile), so compacting
    # the stored slots gives ascending ELL rows.
    pos_RxW, valid_RxW, _ = twell_format.compact_columns(stored_RxK, ell_width)
    nnz_R = twell_format.row_nnz(packed)
    tile_overflow_R = twell_format.row_overflow_mask(packed)
    needs_tail_R = (nnz_R > ell_width) | tile_overflow_R
    _, tail_rows_C, lost_R = _assign_tail_slots(needs_tail_R, tail_capacity)
    in_ell_RxW = valid_RxW & ~needs_tail_R[:, None]
    values_RxK = packed.values.reshape(n_rows, -1)
    cols_RxK = packed.indices.reshape(n_rows, -1)
    used_C = tail_rows_C >= 0
    safe_rows_C = jnp.maximum(tail_rows_C, 0)
    if recompute_rows is None:
        tail_dense_CxN = twell_format.unpack(packed)[safe_rows_C]
        lost_R = lost_R | (needs_tail_R & tile_overflow_R)
    else:
        tail_dense_CxN = recompute_rows(safe_rows_C)
        if tail_dense_CxN.shape != (tail_capacity, n_cols):
            raise ValueError(
                f"recompute_rows must return [{tail_capacity}, {n_cols}], got {tail_dense_CxN.shape}")
    tail_pattern = (tail_dense_CxN != 0) & used_C[:, None]
    dtype = packed.values.dtype
    return Hybrid(
        ell_values=jnp.where(in_ell_RxW, jnp.take_along_axis(values_RxK, pos_RxW, axis=1), 0).astype(dtype),
        ell_cols=jnp.where(in_ell_RxW, jnp.take_along_axis(cols_RxK, pos_RxW, axis=1), 0),
        ell_count=jnp.where(needs_tail_R, 0, nnz_R),
        row_nnz=nnz_R,
        tail_values=jnp.where(tail_pattern, tail_dense_CxN, 0).astype(dtype),
        tail_pattern=tail_pattern,
        tail_rows=tail_rows_C,
        tail_overflow=jnp.sum(lost_R, dtype=jnp.int32),
        n_cols=n_cols,
    )


def to_dense(h: Hybrid) -> jax.Array:
    """Dense [R, N] matrix of the represented entries (rows counted in tail_overflow read 0)."""
    n_rows = h.shape[0]
    rows_RxW = jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32)[:, None], h.ell_cols.shape)
    cols_RxW = jnp.where(ell_mask(h), h.ell_cols, h.n_cols)  # out of range -> dropped
    dense = jnp.zeros(h.shape, h.ell_values.dtype).at[rows_RxW, cols_RxW].set(h.ell_values, mode="drop")
    target_C = jnp.where(h.tail_rows >= 0, h.tail_rows, n_rows)
    return dense.at[target_C].set(h.tail_values.astype(dense.dtype), mode="drop")


def pattern_to_dense(h: Hybrid) -> jax.Array:
    """bool [R, N]: the represented pattern."""
    ones = with_values(h, jnp.ones(h.ell_values.shape, jnp.float32), jnp.ones(h.tail_values.shape, jnp.float32))
    return to_dense(ones) != 0


def with_values(h: Hybrid, ell_values: jax.Array, tail_values: jax.Array) -> Hybrid:
    """A hybrid on `h`'s pattern with new values (masked to the pattern, so off-pattern stays 0)."""
    return dataclasses.replace(
        h,
        ell_values=jnp.where(ell_mask(h), ell_values, jnp.zeros((), ell_values.dtype)),
        tail_values=jnp.where(_tail_valid(h), tail_values, jnp.zeros((), tail_values.dtype)),
    )


def map_values(fn: Callable[..., jax.Array], h: Hybrid, *others: Hybrid) -> Hybrid:
    """Elementwise `fn` over hybrids sharing `h`'s pattern (aligned value arrays)."""
    return with_values(
        h,
        fn(h.ell_values, *(o.ell_values for o in others)),
        fn(h.tail_values, *(o.tail_values for o in others)),
    )


def _chunked_slots(h: Hybrid) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """ELL (values, cols, mask) as [n_chunks, R, chunk] for the product loops."""
    width = h.ell_width
    chunk = min(width, _SLOT_CHUNK)
    pad = (-width) % chunk
    def split(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, ((0, 0), (0, pad)))
        return a.reshape(a.shape[0], -1, chunk).transpose(1, 0, 2)
    return split(h.ell_values), split(h.ell_cols), split(ell_mask(h)), pad


def spmm(h: Hybrid, b_NxD: jax.Array) -> jax.Array:
    """f32 [R, D] = h @ b (f32 accumulation, fixed order: ELL slots ascending, then the tail)."""
    if b_NxD.ndim != 2 or b_NxD.shape[0] != h.n_cols:
        raise ValueError(f"b_NxD must be [{h.n_cols}, D], got {b_NxD.shape}")
    n_rows = h.shape[0]
    vals, cols, mask, _ = _chunked_slots(h)

    def contribution(chunk: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        vals_RxK, cols_RxK, mask_RxK = chunk
        b_RxKxD = b_NxD[cols_RxK].astype(jnp.float32)
        # `where`, not a multiply by 0, so inf/NaN in a row of b never leaks through an empty slot.
        prod = jnp.where(mask_RxK[..., None], vals_RxK.astype(jnp.float32)[..., None] * b_RxKxD, 0.0)
        return jnp.sum(prod, axis=1)

    def step(acc_RxD: jax.Array, chunk: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return acc_RxD + contribution(chunk), None

    # The first chunk seeds the carry (rather than zeros) so that, inside shard_map, the carry
    # has the operands' device-variance type from the start, with no version-specific API.
    first = jax.tree.map(lambda a: a[0], (vals, cols, mask))
    rest = jax.tree.map(lambda a: a[1:], (vals, cols, mask))
    acc_RxD, _ = jax.lax.scan(step, contribution(first), rest)
    tail_CxD = jnp.dot(h.tail_values.astype(jnp.float32), b_NxD.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    target_C = jnp.where(h.tail_rows >= 0, h.tail_rows, n_rows)
    return acc_RxD.at[target_C].add(tail_CxD, mode="drop")


def sddmm(a_RxK: jax.Array, b_NxK: jax.Array, pattern: Hybrid) -> Hybrid:
    """Hybrid on `pattern` holding (a @ b.T) at the pattern entries, f32."""
    n_rows, n_cols = pattern.shape
    if a_RxK.ndim != 2 or a_RxK.shape[0] != n_rows:
        raise ValueError(f"a_RxK must be [{n_rows}, K], got {a_RxK.shape}")
    if b_NxK.shape != (n_cols, a_RxK.shape[1]):
        raise ValueError(f"b_NxK must be [{n_cols}, {a_RxK.shape[1]}], got {b_NxK.shape}")
    a32 = a_RxK.astype(jnp.float32)
    _, cols, mask, pad = _chunked_slots(pattern)

    def step(_: None, chunk: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        cols_RxC, mask_RxC = chunk
        dots = jnp.einsum("rk,rck->rc", a32, b_NxK[cols_RxC].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        return None, jnp.where(mask_RxC, dots, 0.0)

    _, out = jax.lax.scan(step, None, (cols, mask))
    ell_RxW = out.transpose(1, 0, 2).reshape(n_rows, -1)[:, : pattern.ell_width]
    rows_C = jnp.maximum(pattern.tail_rows, 0)
    tail_CxN = jnp.dot(a32[rows_C], b_NxK.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return with_values(pattern, ell_RxW, tail_CxN)


def sum_values(h: Hybrid, fn: Callable[[jax.Array], jax.Array] = lambda v: v) -> jax.Array:
    """f32 scalar: sum of fn(value) over the represented entries."""
    ell = jnp.where(ell_mask(h), fn(h.ell_values.astype(jnp.float32)), 0.0)
    tail = jnp.where(_tail_valid(h), fn(h.tail_values.astype(jnp.float32)), 0.0)
    return jnp.sum(ell) + jnp.sum(tail)


def transpose_many(hs: Sequence[Hybrid], ell_width: int, tail_capacity: int) -> list[Hybrid]:
    """Transpose hybrids that share one pattern ([R, N] -> [N, R]) with one sort.

    The entries are sorted by (column, row) with a stable key sort; an entry's ELL slot in the
    transposed row is its rank inside its column group. Deterministic, no atomics. Transposed rows
    with more than `ell_width` entries go to the tail; rows lost to the tail capacity, plus the
    inputs' own tail_overflow, are counted in the result's tail_overflow.
    """
    _check_capacities(ell_width, tail_capacity)
    if not hs:
        return []
    h0 = hs[0]
    n_rows, n_cols = h0.shape
    ell_rows = jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32)[:, None], h0.ell_cols.shape)
    tail_cols = jnp.broadcast_to(jnp.arange(n_cols, dtype=jnp.int32)[None, :], h0.tail_values.shape)
    tail_rows = jnp.broadcast_to(h0.tail_rows[:, None], h0.tail_values.shape)
    valid_E = jnp.concatenate([ell_mask(h0).ravel(), _tail_valid(h0).ravel()])
    col_E = jnp.where(valid_E, jnp.concatenate([h0.ell_cols.ravel(), tail_cols.ravel()]), n_cols)
    row_E = jnp.where(valid_E, jnp.concatenate([ell_rows.ravel(), tail_rows.ravel()]), n_rows)
    vals_E = [jnp.concatenate([h.ell_values.ravel(), h.tail_values.ravel().astype(h.ell_values.dtype)])
              for h in hs]
    sorted_ops = jax.lax.sort((col_E, row_E, *vals_E), num_keys=2, is_stable=True)
    col_E, row_E, vals_E = sorted_ops[0], sorted_ops[1], sorted_ops[2:]

    # Invalid entries carry column n_cols: segment n_cols is discarded.
    nnz_N = jax.ops.segment_sum(jnp.ones_like(col_E), col_E, num_segments=n_cols + 1)[:n_cols]
    start_N = jnp.cumsum(nnz_N) - nnz_N
    safe_col_E = jnp.minimum(col_E, n_cols - 1)
    rank_E = jnp.arange(col_E.shape[0], dtype=jnp.int32) - start_N[safe_col_E]
    valid_E = col_E < n_cols
    needs_tail_N = nnz_N > ell_width
    slot_N, tail_rows_C, lost_N = _assign_tail_slots(needs_tail_N, tail_capacity)

    in_ell_E = valid_E & ~needs_tail_N[safe_col_E]
    ell_r = jnp.where(in_ell_E, col_E, n_cols)  # out of range -> dropped by the scatter
    ell_cols = jnp.zeros((n_cols, ell_width), jnp.int32).at[ell_r, rank_E].set(row_E, mode="drop")
    in_tail_E = valid_E & needs_tail_N[safe_col_E]
    tail_r = jnp.where(in_tail_E, slot_N[safe_col_E], tail_capacity)
    tail_pattern = jnp.zeros((tail_capacity, n_rows), bool).at[tail_r, row_E].set(True, mode="drop")
    tail_overflow = jnp.sum(lost_N, dtype=jnp.int32) + h0.tail_overflow
    out = []
    for h, v_E in zip(hs, vals_E):
        dtype = h.ell_values.dtype
        out.append(Hybrid(
            ell_values=jnp.zeros((n_cols, ell_width), dtype).at[ell_r, rank_E].set(v_E, mode="drop"),
            ell_cols=ell_cols,
            ell_count=jnp.where(needs_tail_N, 0, nnz_N),
            row_nnz=nnz_N,
            tail_values=jnp.zeros((tail_capacity, n_rows), dtype).at[tail_r, row_E].set(v_E, mode="drop"),
            tail_pattern=tail_pattern,
            tail_rows=tail_rows_C,
            tail_overflow=tail_overflow,
            n_cols=n_rows,
        ))
    return out


def transpose(h: Hybrid, ell_width: int, tail_capacity: int) -> Hybrid:
    """The [N, R] transpose of `h` (see `transpose_many`)."""
    return transpose_many([h], ell_width=ell_width, tail_capacity=tail_capacity)[0]
