"""Helpers shared by the kernels' block-size dataclasses, argument checks and launchers."""
from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def is_pow2(n: int) -> bool:
    """True for 1, 2, 4, 8, ... (Triton block extents must be powers of two)."""
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, k: int) -> int:
    """The smallest multiple of k >= n (grids cover a padded extent)."""
    return -(-n // k) * k


class LaunchSizes(Protocol):
    """What every kernel's block-size dataclass carries for the Triton launch."""

    num_warps: int
    num_stages: int


def check_launch_sizes(sizes: LaunchSizes) -> None:
    """Raise ValueError (naming the dataclass and field) unless num_warps is 1, 2, 4, 8 or 16 and
    num_stages is in [1, 8]; called by each block-size dataclass's __post_init__."""
    owner = type(sizes).__name__
    if sizes.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{owner}.num_warps must be 1, 2, 4, 8 or 16, got {sizes.num_warps}")
    if not 1 <= sizes.num_stages <= 8:
        raise ValueError(f"{owner}.num_stages must be in [1, 8], got {sizes.num_stages}")


def compiler_params(sizes: LaunchSizes) -> plgpu.CompilerParams:
    """The explicit Triton CompilerParams every pallas_call passes (JAX 0.11 wants one)."""
    return plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages)


def pad_rows(n_rows: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Each array zero-padded along axis 0 to n_rows (unchanged when it has at least n_rows rows:
    a launcher's grid then reads only its first n_rows)."""
    return tuple(a if a.shape[0] >= n_rows else
                 jnp.pad(a, ((0, n_rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)) for a in arrays)


def validate_pattern(indices: jax.Array, counts: jax.Array, tile: int | None) -> bool:
    """Raise ValueError naming the offending argument unless (indices, counts) is a TwELL pattern
    as the backward's kernels read it: indices [M, NT, S] int32 (neuron ids, as the pack writes
    them) or uint8 (each neuron's offset inside its tile, neuron - t * tile: the training forward's
    kept pattern, which the kernels read as it is stored, with no int32 copy; `tile`, the pack's,
    at most 256), counts [M, NT] int32 or int16. Returns True for offsets."""
    if indices.ndim != 3 or indices.dtype not in (jnp.int32, jnp.uint8):
        raise ValueError(f"indices must be [M, NT, S] int32 (neuron ids) or uint8 (offsets inside the "
                         f"tile), got {indices.dtype}{indices.shape}")
    m, n_tiles, _ = indices.shape
    if counts.shape != (m, n_tiles) or counts.dtype not in (jnp.int32, jnp.int16):
        raise ValueError(f"counts must be int32 or int16 [M={m}, NT={n_tiles}], got "
                         f"{counts.dtype}{counts.shape}")
    offsets = indices.dtype == jnp.uint8
    if offsets and (tile is None or tile > 256):
        raise ValueError(f"uint8 indices (offsets inside the tile) need the pack's tile, at most 256 "
                         f"lanes, got tile={tile!r}")
    return offsets


def validate_packed_operands(x_MxD: jax.Array, values: jax.Array, indices: jax.Array,
                             counts: jax.Array) -> None:
    """Raise ValueError naming the offending argument: x [M, D] and a TwELL pack of M rows
    (values [M, NT, S] with S a power of two, indices int32 like values, counts int32 [M, NT])."""
    if x_MxD.ndim != 2:
        raise ValueError(f"x_MxD must be 2-D [M, D], got shape {x_MxD.shape}")
    m = x_MxD.shape[0]
    if counts.ndim != 2 or counts.shape[0] != m or counts.dtype != jnp.int32:
        raise ValueError(f"counts must be int32 [M={m}, NT], got {counts.dtype}{counts.shape}")
    n_tiles = counts.shape[1]
    if values.ndim != 3 or values.shape[:2] != (m, n_tiles) or not is_pow2(values.shape[2]):
        raise ValueError(f"values must be [M={m}, NT={n_tiles}, S] with S a power of two, got "
                         f"{values.shape}")
    if indices.shape != values.shape or indices.dtype != jnp.int32:
        raise ValueError(f"indices must be int32 {values.shape}, got {indices.dtype}{indices.shape}")


def stored_ranks(counts: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """(rank [M, NT, S] of each slot among its row's stored entries, live [M, NT, S]) of a TwELL
    pattern, by a two-level prefix sum (tiles, then slots): short scans only. The references' rank
    order (the training backward's lists and the fused FFN's ranked outputs)."""
    live_T = jnp.minimum(counts, slots)
    slot_S = jnp.arange(slots)[None, None, :]
    return (jnp.cumsum(live_T, axis=1) - live_T)[:, :, None] + slot_S, slot_S < live_T[:, :, None]


def store_partition(active_L: jax.Array, order_ref, n_ref, *, h: int,
                    first: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: the stable partition of active_L (bool [L]; False on lanes past the last
    neuron) into order [L] int32 (the active lanes' neuron ids first + lane ascending, then the
    inactive ones) and n [1] int32 = the number of active lanes (n_ref None: not stored).
    Lane i is neuron first + i; ids are clamped to h - 1, so padding lanes name a valid row.
    Shared by the decode compaction kernels (twell_decode.py: one list of all H neurons) and the
    sparse gate's tile lists
    (decode_matvec.py: one list per column tile, the TwELL layout of one decode step).
    Returns (slot_L int32, n): lane i went to slot_L[i], where a value of lane i packed beside
    its id goes (decode_matvec's tile values)."""
    length = order_ref.shape[0]
    lane_L = lax.broadcasted_iota(jnp.int32, (length,), 0)
    one_L = active_L.astype(jnp.int32)
    n = jnp.sum(one_L)
    active_before_L = jnp.cumsum(one_L) - one_L  # exclusive prefix: actives left of the lane
    inactive_before_L = lane_L - active_before_L
    # A permutation of [0, L): every lane writes a distinct slot, so no mask is needed (a masked
    # scatter with colliding masked-off lanes can clobber live ones in interpret mode).
    slot_L = jnp.where(active_L, active_before_L, n + inactive_before_L)
    plgpu.store(order_ref.at[slot_L], jnp.minimum(first + lane_L, h - 1))
    if n_ref is not None:  # None: the caller stores n itself
        n_ref[...] = jnp.broadcast_to(n, (1,))
    return slot_L, n


# K elements a step of a norm prologue's sum-of-squares pass loads per row (at most): the pass is
# dependent latency before a kernel's first weight load (x is L2-resident), so few, wide loads.
NORM_BLOCK_K = 512
# Live rows of a program up to which the prologue loads each row whole, one load a row with no loop
# (its latency once), instead of the pass in NORM_BLOCK_K steps over the program's row block. On the
# H100 (`decode_matvec` alone at the 0.5b shapes, timed as experiments/bench_decode_matvec.py times a
# call; BENCHMARKS.md, Decode): at 1 row the whole-row load was faster for q/k/v, the twin's gate/up
# and the LM head; at 8 rows the result was mixed (q/k/v slower, gate/up faster), so only a program
# of one live row takes it.
NORM_ROWWISE_MAX_ROWS = 1


def rows_inv_rms(x_ref, rows_BM: jax.Array, row_ok_BM: jax.Array, *, k: int, eps: float,
                 live: jax.Array | bool = True, rows: int | None = None) -> jax.Array:
    """Inside a kernel: rsqrt(mean(x[r]^2) + eps) of the rows `rows_BM` of x [M, k] (RMSNorm's
    scale, fp32 [BM]; rows off `row_ok_BM` read as 0). `rows` (static): at most this many of the
    block's rows are live, the first ones (min(M, BM) for a program of BM rows; None = BM): up to
    NORM_ROWWISE_MAX_ROWS, each row whole in one load; else one pass over the block in steps of up
    to NORM_BLOCK_K. `live` False (traced): no bytes read, the result then unused. The RMSNorm
    prologue of decode_matvec and of the sparse decode FFN kernels (twell_decode.py)."""
    block = rows_BM.shape[0]
    rows = block if rows is None else min(rows, block)
    if rows <= NORM_ROWWISE_MAX_ROWS:
        lane_K = lax.broadcasted_iota(jnp.int32, (next_pow2(k),), 0)
        row_BM = lax.broadcasted_iota(jnp.int32, (block,), 0)
        ok_BM = (row_ok_BM & live).astype(jnp.int32)
        inv_BM = jnp.zeros((block,), jnp.float32)
        for r in range(rows):
            row = jnp.sum(jnp.where(row_BM == r, rows_BM, 0))
            ok = jnp.sum(jnp.where(row_BM == r, ok_BM, 0)) > 0
            x_K = plgpu.load(x_ref.at[jnp.where(ok, row, 0), lane_K], mask=(lane_K < k) & ok,
                             other=0).astype(jnp.float32)
            inv_BM = jnp.where(row_BM == r, lax.rsqrt(jnp.sum(x_K * x_K) / k + eps), inv_BM)
        return inv_BM
    step = min(next_pow2(k), NORM_BLOCK_K)
    lane_S = lax.broadcasted_iota(jnp.int32, (step,), 0)

    def ss_step(t, ss_BM):
        ks_S = t * step + lane_S
        x_BMxS = plgpu.load(x_ref.at[rows_BM[:, None], ks_S[None, :]],
                            mask=row_ok_BM[:, None] & (ks_S < k)[None, :], other=0).astype(jnp.float32)
        return ss_BM + jnp.sum(x_BMxS * x_BMxS, axis=1)

    trips = jnp.where(live, jnp.int32(-(-k // step)), jnp.int32(0)).astype(jnp.int32)
    ss_BM = lax.fori_loop(jnp.int32(0), trips, ss_step, jnp.zeros(rows_BM.shape, jnp.float32))
    return lax.rsqrt(ss_BM / k + eps)
