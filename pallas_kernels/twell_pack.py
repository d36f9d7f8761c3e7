"""Pack kernel (Pallas, Triton backend): gate GEMM + ReLU + TwELL pack in the epilogue.

For x [M, D] and a neuron-major weight w [H, D] it computes acc = x @ w.T with fp32 accumulation and,
for every (row, tile of `tile` hidden columns), writes the TwELL tile directly from registers:

    counts  [M, NT]     int32   TRUE number of strictly positive acc in the tile (may exceed `slots`)
    indices [M, NT, S]  int32   GLOBAL column of the k-th positive element, ascending; unused slots 0
    values  [M, NT, S]  dtype   acc rounded to the activation dtype;                 unused slots 0

The dense activation never reaches HBM and there is no second pass.

Epilogue design ("extract by successive minimum"). A rank/prefix-sum over the 256 columns of a
[BM, 256] fp32 register tile (cumsum, or a dot with a triangular 0/1 matrix) followed by a masked
scatter costs more than the matmul itself on the H100 (probed during development). Instead the k-th slot of every
row is found by a row-wise MIN: for 16-bit activations each element becomes one int32 key
`(tile-local column << 16) | bits(value rounded to the activation dtype)` (inactive: INT32_MAX), and
slot k is `min(key > key of slot k-1)`; one register reduction per slot gives column AND value.
(fp32 activations need all 32 bits: a min for the column plus a masked sum for the value.) The loop
runs `min(max count in the block, S)` times, so at the sparsities this format is for (~1-3 actives
per 256-column tile) the epilogue is a handful of reductions; it is ascending and deterministic by
construction (no atomics, no scatter), and slots are assembled in a [BM, S] register tile that is
written with ONE block store, unused slots zeroed.

Shapes: the kernel wants M % block_m == 0, D % block_k == 0 and H % tile == 0; `pack_gate` pads
(zero rows/columns are exactly inactive: acc == 0 is not > 0) and slices back, so callers may pass
any shape.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import check_launch_sizes, compiler_params, is_pow2 as _is_pow2, round_up


@dataclasses.dataclass(frozen=True)
class PackBlockSizes:
    """Static launch parameters of the pack kernel."""

    # Defaults measured (BENCHMARKS.md): 128x64 and 8 warps on an H200; the launch order and the
    # pipeline depth on the H100 (`bench_ffn_train.py --sweep-blocks`, M 16384, k 29: grouped
    # faster than the row-major order; 3 and 4 stages within noise once grouped).
    block_m: int = 128  # token rows per program (power of two, >= 16 for the tensor-core dot)
    block_k: int = 64  # K step of the GEMM loop (power of two, >= 16)
    num_warps: int = 8  # warps per program
    num_stages: int = 3  # software-pipelining depth of the K loop
    # Launch order: programs run in groups of `group_m` row blocks, the row block varying fastest
    # inside a group, then the hidden tile. A group's x rows and all of W stay in L2 while it runs;
    # 0 = one group of every row block (each tile sweeps all of x, which at M 16384 is 64 MB, more
    # than the H100's L2, so x is read from HBM once per tile).
    group_m: int = 16

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 16:
                raise ValueError(f"PackBlockSizes.{name} must be a power of two >= 16, got {value}")
        if not isinstance(self.group_m, int) or self.group_m < 0:
            raise ValueError(f"PackBlockSizes.group_m must be an int >= 0, got {self.group_m!r}")
        check_launch_sizes(self)


def program_block(p: jax.Array, n_m: int, n_tiles: int, group_m: int) -> tuple[jax.Array, jax.Array]:
    """(row block, hidden tile) of program p of the 1-D launch (PackBlockSizes.group_m): groups of
    `group_m` row blocks (the last may be smaller), row block fastest inside a group."""
    group_m = n_m if group_m == 0 else min(group_m, n_m)
    per_group = group_m * n_tiles
    # lax.div / lax.rem (truncating; every operand is >= 0): one integer op each in the kernel.
    first = lax.div(p, per_group) * group_m
    size = jnp.minimum(n_m - first, group_m)
    r = lax.rem(p, per_group)
    return first + lax.rem(r, size), lax.div(r, size)


def _dot_precision(dtype: jnp.dtype) -> lax.Precision:
    # f32 inputs: IEEE fp32 products (Triton's default would be TF32, which changes the sign of
    # small pre-activations and hence the active pattern). bf16/f16: exact products on tensor cores.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _pack_kernel(x_ref, w_ref, values_ref, indices_ref, counts_ref, *, block_k: int, n_k: int,
                 tile: int, slots: int, precision: lax.Precision, n_m: int, n_tiles: int,
                 group_m: int) -> None:
    """One program: rows [i*BM, (i+1)*BM) x hidden tile j (program_block). Refs: x [BM, D],
    w [T, D], values/indices [BM, S], counts [BM]."""
    block_m = x_ref.shape[0]
    _, tile_index = program_block(pl.program_id(0), n_m, n_tiles, group_m)

    def gemm_step(k, acc_BMxT):
        x_BMxBK = x_ref[:, pl.ds(k * block_k, block_k)]
        w_TxBK = w_ref[:, pl.ds(k * block_k, block_k)]
        return acc_BMxT + lax.dot_general(
            x_BMxBK, w_TxBK, (((1,), (1,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32)

    acc_BMxT = lax.fori_loop(0, n_k, gemm_step, jnp.zeros((block_m, tile), jnp.float32))

    col_BMxT = lax.broadcasted_iota(jnp.int32, (block_m, tile), 1)
    active_BMxT = acc_BMxT > 0.0  # strict: an exact zero is inactive
    count_BM = jnp.sum(active_BMxT.astype(jnp.int32), axis=1)
    n_extract = jnp.minimum(jnp.max(count_BM), slots)
    slot_BMxS = lax.broadcasted_iota(jnp.int32, (block_m, slots), 1)
    out_dtype = values_ref.dtype

    if jnp.dtype(out_dtype).itemsize == 2:
        # 16-bit activations: one int32 key per element, (tile-local column << 16) | value bits.
        # Positive 16-bit floats have the sign bit clear, so the key is non-negative, ordered by
        # column, and ONE min-reduction per slot yields both the column and the rounded value.
        bits_BMxT = lax.bitcast_convert_type(acc_BMxT.astype(out_dtype), jnp.int16)
        big = jnp.iinfo(jnp.int32).max
        key_BMxT = jnp.where(active_BMxT, (col_BMxT << 16) | bits_BMxT.astype(jnp.int32), big)

        def extract_slot(k, carry):
            last_BM, keys_BMxS = carry
            key_BM = jnp.min(jnp.where(key_BMxT > last_BM[:, None], key_BMxT, big), axis=1)
            keys_BMxS = jnp.where((slot_BMxS == k) & (key_BM < big)[:, None], key_BM[:, None],
                                  keys_BMxS)
            return key_BM, keys_BMxS

        init = (jnp.full((block_m,), -1, jnp.int32), jnp.full((block_m, slots), -1, jnp.int32))
        _, keys_BMxS = lax.fori_loop(0, n_extract, extract_slot, init)
        stored_BMxS = keys_BMxS >= 0
        cols_BMxS = jnp.where(stored_BMxS, keys_BMxS >> 16, -1)
        value_bits_BMxS = jnp.where(stored_BMxS, keys_BMxS & 0xFFFF, 0).astype(jnp.int16)
        values_BMxS = lax.bitcast_convert_type(value_bits_BMxS, out_dtype)
    else:
        # fp32 values need all 32 bits: column by a min-reduction, value by a masked sum.
        def extract_slot(k, carry):
            last_BM, values_BMxS, cols_BMxS = carry
            # The k-th active column = smallest active column right of the (k-1)-th one.
            candidate_BMxT = jnp.where(active_BMxT & (col_BMxT > last_BM[:, None]), col_BMxT, tile)
            col_BM = jnp.min(candidate_BMxT, axis=1)
            # At most one column matches, so the masked sum is exact.
            value_BM = jnp.sum(jnp.where(col_BMxT == col_BM[:, None], acc_BMxT, 0.0), axis=1)
            hit_BMxS = (slot_BMxS == k) & (col_BM < tile)[:, None]
            values_BMxS = jnp.where(hit_BMxS, value_BM[:, None], values_BMxS)
            cols_BMxS = jnp.where(hit_BMxS, col_BM[:, None], cols_BMxS)
            return col_BM, values_BMxS, cols_BMxS

        init = (jnp.full((block_m,), -1, jnp.int32),
                jnp.zeros((block_m, slots), jnp.float32),
                jnp.full((block_m, slots), -1, jnp.int32))
        _, values_BMxS, cols_BMxS = lax.fori_loop(0, n_extract, extract_slot, init)

    values_ref[...] = values_BMxS.astype(values_ref.dtype)
    indices_ref[...] = jnp.where(cols_BMxS >= 0, cols_BMxS + tile_index * tile, 0)
    counts_ref[...] = count_BM


def _pack_triton(x_MxD: jax.Array, w_HxD: jax.Array, *, tile: int, slots: int,
                 block_sizes: PackBlockSizes, interpret: bool, debug: bool):
    """The Pallas-Triton launch on aligned shapes (M % block_m, D % block_k, H % tile == 0)."""
    m, d = x_MxD.shape
    h = w_HxD.shape[0]
    bm, bk = block_sizes.block_m, block_sizes.block_k
    n_tiles, n_m = h // tile, m // bm
    group_m = block_sizes.group_m
    kernel = functools.partial(_pack_kernel, block_k=bk, n_k=d // bk, tile=tile, slots=slots,
                               precision=_dot_precision(x_MxD.dtype), n_m=n_m, n_tiles=n_tiles,
                               group_m=group_m)
    squeezed = pl.Squeezed()

    def at(p):
        return program_block(p, n_m, n_tiles, group_m)

    return pl.pallas_call(
        kernel,
        grid=(n_m * n_tiles,),
        in_specs=[pl.BlockSpec((bm, d), lambda p: (at(p)[0], 0)),
                  pl.BlockSpec((tile, d), lambda p: (at(p)[1], 0))],
        out_specs=[pl.BlockSpec((bm, squeezed, slots), lambda p: (*at(p), 0)),
                   pl.BlockSpec((bm, squeezed, slots), lambda p: (*at(p), 0)),
                   pl.BlockSpec((bm, squeezed), lambda p: at(p))],
        out_shape=[jax.ShapeDtypeStruct((m, n_tiles, slots), x_MxD.dtype),
                   jax.ShapeDtypeStruct((m, n_tiles, slots), jnp.int32),
                   jax.ShapeDtypeStruct((m, n_tiles), jnp.int32)],
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_pack",
    )(x_MxD, w_HxD)


def validate_pack_args(x_MxD: jax.Array, w_HxD: jax.Array, tile: int, slots: int) -> None:
    """Raise ValueError naming the offending argument."""
    if x_MxD.ndim != 2:
        raise ValueError(f"x_MxD must be 2-D [M, D], got shape {x_MxD.shape}")
    if w_HxD.ndim != 2 or w_HxD.shape[1] != x_MxD.shape[1]:
        raise ValueError(f"w_HxD must be [H, D={x_MxD.shape[1]}], got shape {w_HxD.shape}")
    if x_MxD.dtype != w_HxD.dtype or x_MxD.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"x_MxD and w_HxD must share a float dtype (f32/bf16/f16), got "
                         f"{x_MxD.dtype} and {w_HxD.dtype}")
    if not _is_pow2(tile) or not 16 <= tile <= 2**15:
        raise ValueError(f"tile must be a power of two in [16, 32768] for the Triton kernel (the "
                         f"16-bit epilogue keys hold a 15-bit column), got {tile}")
    if not _is_pow2(slots) or slots > tile:
        raise ValueError(f"slots must be a power of two <= tile for the Triton kernel, got {slots}")


@functools.partial(jax.jit, static_argnames=("tile", "slots", "block_sizes", "interpret", "debug"))
def pack_gate(x_MxD: jax.Array, w_HxD: jax.Array, *, tile: int = 256, slots: int = 32,
              block_sizes: PackBlockSizes = PackBlockSizes(), interpret: bool = False,
              debug: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TwELL pack of relu(x @ w.T): returns (values[M,NT,S], indices[M,NT,S] int32, counts[M,NT]).

    Any M, D, H: operands are zero-padded to the kernel's multiples (exact, see module doc) and the
    outputs sliced back to M rows; NT = ceil(H / tile).
    """
    validate_pack_args(x_MxD, w_HxD, tile, slots)
    m, d = x_MxD.shape
    h = w_HxD.shape[0]
    m_pad, d_pad, h_pad = (round_up(m, block_sizes.block_m), round_up(d, block_sizes.block_k),
                           round_up(h, tile))
    if (m_pad, d_pad) != (m, d):
        x_MxD = jnp.pad(x_MxD, ((0, m_pad - m), (0, d_pad - d)))
    if (h_pad, d_pad) != (h, d):
        w_HxD = jnp.pad(w_HxD, ((0, h_pad - h), (0, d_pad - d)))
    values, indices, counts = _pack_triton(x_MxD, w_HxD, tile=tile, slots=slots,
                                           block_sizes=block_sizes, interpret=interpret,
                                           debug=debug)
    if m_pad != m:
        values, indices, counts = values[:m], indices[:m], counts[:m]
    return values, indices, counts


@functools.partial(jax.jit, static_argnames=("tile", "slots"))
def pack_gate_reference(x_MxD: jax.Array, w_HxD: jax.Array, *, tile: int = 256,
                        slots: int = 32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-jnp TwELL pack of relu(x @ w.T) with fp32 accumulation; same outputs as `pack_gate`."""
    m = x_MxD.shape[0]
    h = w_HxD.shape[0]
    n_tiles = -(-h // tile)
    acc_MxH = jnp.einsum("md,hd->mh", x_MxD, w_HxD, preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)
    acc_MxHp = jnp.pad(acc_MxH, ((0, 0), (0, n_tiles * tile - h)))
    acc_MxNTxT = acc_MxHp.reshape(m, n_tiles, tile)
    active = acc_MxNTxT > 0
    counts = jnp.sum(active, axis=-1, dtype=jnp.int32)
    # Stable sort of "inactive" keys puts active columns first, in ascending column order.
    order = jnp.argsort(~active, axis=-1, stable=True)[..., :slots]
    keep = jnp.take_along_axis(active, order, axis=-1)
    values = jnp.where(keep, jnp.take_along_axis(acc_MxNTxT, order, axis=-1), 0).astype(x_MxD.dtype)
    tile_start = (jnp.arange(n_tiles, dtype=jnp.int32) * tile)[None, :, None]
    indices = jnp.where(keep, order.astype(jnp.int32) + tile_start, 0)
    return values, indices, counts
