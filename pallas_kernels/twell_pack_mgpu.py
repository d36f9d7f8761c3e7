"""Pack kernel on Pallas Mosaic GPU (Hopper): the gate GEMM on wgmma + ReLU + the TwELL pack in the
epilogue, with the same outputs as `twell_pack.pack_gate` (the Triton kernel), bit for bit:

    counts  [M, NT]     int32   number of strictly positive acc in the tile (may exceed `slots`)
    indices [M, NT, S]  int32   global column of the k-th positive element, ascending; unused 0
    values  [M, NT, S]  dtype   acc rounded to the activation dtype; unused 0

A persistent, warp-specialized kernel: one program per SM loops over (128-row block, tile of
`tile` hidden columns) pairs, the tile varying fastest; warpgroups 0 and 1 each own 64 rows (a
wgmma M of 64; an fp32 accumulator [64, tile]) and warpgroup 2 issues the TMA copies of the K
pipeline (x rows and w's [tile, 64] block, w read through a transposed view: it stays
neuron-major). The epilogue ("compact", the default) gives each positive element its slot from
bit masks of the positive columns that the four threads sharing a row swap by shuffles, each
thread storing its own (`_compact_epilogue`); "scan" is `twell_pack`'s ("extract by successive
minimum": one int32 key (tile-local column << 16 | value bits) per element, slot k = the row's
smallest key above slot k-1's, for min(largest count in the block, S) slots), slower: its loop
runs over the whole tile once per slot. Either writes the slots to shared memory, copied out by
TMA. The counts are written tile-major ([NT, M]: a TMA row of 64 counts) and transposed by the
wrapper. By default the programs run in clusters of two (`MgpuPackBlockSizes.cluster`): the two
take row blocks 2i and 2i + 1 of the same tile, and each step's W block reaches both from one
multicast TMA copy.

Scope: 16-bit activations (bf16/f16) only (the fp32 pack needs the value's 32 bits beside the
column), H % tile == 0 and D % 64 == 0 after the wrapper's padding, Hopper (sm_90a) GPUs.
`available()` says whether this JAX has the Mosaic GPU API the kernel is written against. No CPU
interpreter covers it on JAX 0.10 (`plgpu` has no `InterpretGPUParams` there), so it is tested on
the GPU against `pack_gate_reference` and the Triton kernel (tests/test_pack_mgpu.py).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .common import round_up

try:  # the Mosaic GPU Pallas API (JAX >= 0.7 ships it; its names move between versions)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover (every supported JAX has the module)
    plgpu = None

_NEEDED = ("kernel", "wgmma", "ACC", "SMEM", "BlockSpec", "transpose_ref",
           "copy_smem_to_gmem", "commit_smem", "wait_smem_to_gmem", "TilingTransform", "SwizzleTransform",
           "broadcasted_iota", "Layout", "emit_pipeline_warp_specialized", "nd_loop")


def available() -> bool:
    """Whether this JAX's Pallas Mosaic GPU module has every name the kernel uses."""
    return plgpu is not None and all(hasattr(plgpu, name) for name in _NEEDED)


EPILOGUES = ("compact", "scan")


@dataclasses.dataclass(frozen=True)
class MgpuPackBlockSizes:
    """Static launch parameters of the Mosaic GPU pack kernel (rows per block 128, K step 64: fixed)."""

    # K steps in flight (shared-memory stages of x [128, 64] and w [tile, 64]; 5 no longer fit)
    max_concurrent_steps: int = 4
    # the TwELL epilogue: "compact" (each thread places its own positives, from bit masks shared
    # within its quad) or "scan" (successive minima over the whole tile, as the Triton kernel)
    epilogue: str = "compact"
    # CTAs per cluster: 2 (the default) = the two programs of a cluster take row blocks 2i and 2i + 1
    # of the same tile and share each step's W block by one multicast TMA copy (half W's L2 reads:
    # faster on the H100, the same bits); 1 = each program loads its own
    cluster: int = 2

    def __post_init__(self) -> None:
        if self.cluster not in (1, 2) or isinstance(self.cluster, bool):
            raise ValueError(f"MgpuPackBlockSizes.cluster must be 1 or 2, got {self.cluster!r}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"MgpuPackBlockSizes.epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if isinstance(self.max_concurrent_steps, bool) or not isinstance(self.max_concurrent_steps, int) \
                or not 1 <= self.max_concurrent_steps <= 4:
            raise ValueError(f"MgpuPackBlockSizes.max_concurrent_steps must be an int in [1, 4], "
                             f"got {self.max_concurrent_steps!r}")


BLOCK_M = 128  # token rows per block: two compute warpgroups of 64
BLOCK_K = 64  # K step: 64 16-bit values, one 128-byte swizzled row


_INT32_MAX = 2**31 - 1
# The compaction's elements (of one row of a thread) per loop: the fastest of 8, 16, 32, 64 on the
# GPU (one H200, M 16384, k 29 and 110; the same bits at each)
COMPACT_CHUNK = 32


def _epilogue_keys(acc, counts_smem, *, tile: int, slots: int, dtype) -> jax.Array:
    """keys [BM, S] int32 of the first S active columns (-1 where none) of one tile's fp32
    accumulator, by successive minimum (module doc); the counts [BM] go to `counts_smem`, whence the
    loop's bound (the block's largest count) is read back from there, since a cross-warp reduction
    (`jnp.max`) would use the kernel's one reduction scratch, which two compute warpgroups share."""
    block_m = acc.shape[0]
    layout = plgpu.Layout.WGMMA
    col = plgpu.broadcasted_iota(jnp.int32, (block_m, tile), 1, layout=layout)
    active = acc > 0.0
    counts = jnp.sum(jnp.where(active, 1, 0).astype(jnp.int32), axis=1)
    counts_smem[...] = counts
    plgpu.commit_smem()  # the warpgroup's counts visible to all its threads
    largest = counts_smem[0]
    for row in range(1, block_m):
        largest = jnp.maximum(largest, counts_smem[row])
    bits = lax.bitcast_convert_type(acc.astype(dtype), jnp.int16).astype(jnp.int32) & 0xFFFF
    keys = jnp.where(active, (col << 16) | bits, _INT32_MAX)
    n_extract = jnp.minimum(largest, slots)
    slot = plgpu.broadcasted_iota(jnp.int32, (block_m, slots), 1, layout=layout)

    def rows(v, width):  # a row reduction's [BM] across `width` columns (no [BM, 1] shapes here)
        return lax.broadcast_in_dim(v, (block_m, width), (0,))

    def extract(k, carry):
        last, out = carry
        key = jnp.min(jnp.where(keys > rows(last, tile), keys, _INT32_MAX), axis=1)
        # a row without a k-th active column keeps -1 (its key is INT32_MAX)
        out = jnp.where((slot == k) & (rows(key, slots) < _INT32_MAX), rows(key, slots), out)
        return key, out

    # -1 everywhere, in the loop's own layouts (a row reduction's, the tile's): a splat constant
    # would carry a layout the loop's results do not have.
    init = (counts * 0 - 1, slot * 0 - 1)
    _, out = lax.fori_loop(0, n_extract, extract, init)
    return out


def _register_rows(layout, shape: tuple[int, int]) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """The registers of one thread of a warpgroup array in `layout` over `shape` [64, tile], by row:
    {row offset: [(column offset, register index), ...]} relative to the thread's first element, from
    the layout's own tiling (as its `thread_idxs` computes places). NotImplementedError unless it is
    the wgmma layout the compaction is written for: two rows a thread, a pair of adjacent columns in
    every 8-column group, at most 64 columns of a row a thread (its 64-bit mask)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415

    tile = shape[1]
    strides = layout.tiling.tile_strides(tuple(mgpu_utils.get_contiguous_strides(shape)))
    by_row: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for reg_idx in np.ndindex(layout.registers_shape(shape)):
        offset = sum(i * s for i, s in zip(reg_idx, strides))
        row, col = divmod(offset, tile)
        by_row.setdefault(row, []).append((col, reg_idx))
    if (tile // 4 > 64 or layout.vector_length != 2 or len(by_row) != 2
            or any(sorted(c for c, _ in regs) != list(range(0, tile, 8)) for regs in by_row.values())):
        raise NotImplementedError(f"the compaction epilogue expects the wgmma layout (two rows a thread, "
                                  f"a pair of columns in every 8, at most 64 columns of a row a thread), "
                                  f"got {layout} over {shape}")
    return by_row


def compact_epilogue_available(tile: int = 256) -> bool:
    """Whether this JAX's Mosaic GPU has what `_compact_epilogue` is built from (`plgpu.inline_mgpu`,
    the wgmma layout's register structure, shuffles, loops and bit counts of its IR builders); where
    it has not, `pack_gate_mgpu` runs the "scan" epilogue instead, with a warning."""
    try:
        from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415
        from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
        from jaxlib.mlir.dialects import math as mlir_math  # noqa: PLC0415

        if not (available() and hasattr(plgpu, "inline_mgpu") and hasattr(mgpu, "fori")
                and hasattr(mgpu, "when") and hasattr(mgpu_utils, "shfl_bfly")
                and hasattr(mlir_math, "ctpop") and hasattr(mlir_math, "cttz")):
            return False
        _register_rows(mgpu.WGMMA_LAYOUT, (64, tile))
    except (ImportError, AttributeError, TypeError, NotImplementedError):
        return False
    return True


def _compact_epilogue(tile: int, slots: int, chunk_size: int = COMPACT_CHUNK):
    """The TwELL compaction of one warpgroup's [64, tile] fp32 accumulator, written with Mosaic GPU's
    own IR (`plgpu.inline_mgpu`). Each thread holds, of the wgmma layout, two rows and in each of
    them the two adjacent columns 2q, 2q + 1 of every 8-column group (q = its place in the quad of
    four threads that share the rows). Per row it builds a bit mask of its positive elements (64
    bits at tile 256) and swaps it with the quad's three other threads (shuffles); then a loop per
    chunk of `chunk_size` of its elements visits only the positive ones (lowest bit first, both
    rows in each step), and gives each its slot = the positive columns before it in the row,
    counted from the four masks, and stores (value, tile-local column + 1) where slot < `slots`
    into the shared output tiles, which the caller zeroed. The slots are ascending by column by
    construction, each (row, slot) is written by one thread, nothing depends on timing. The
    quad's first thread stores the row's true count in `counts_ref`. (Code per element instead of
    the loops was predicated by the compiler: every element paid for the rare positive one.)"""
    from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
    from jaxlib.mlir import ir  # noqa: PLC0415
    from jaxlib.mlir.dialects import arith, memref, vector  # noqa: PLC0415
    from jaxlib.mlir.dialects import math as mlir_math  # noqa: PLC0415

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def compact(_ctx, acc, values_ref, indices_ref, counts_ref):
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()
        layout = acc.layout
        shape = tuple(acc.shape)
        regs = acc.registers
        out_type = ir.MemRefType(values_ref.type).element_type
        by_row = _register_rows(layout, shape)
        row0, col0 = next(iter(layout.thread_idxs(shape)))
        quad_pos = arith.divui(arith.index_cast(i32, col0), mgpu.c(2, i32))  # 0..3: the thread's pair
        zero_f = mgpu.c(0.0, ir.F32Type.get())

        def c64(bits: int):  # an i64 constant from its 64 bits
            return mgpu.c(bits - (1 << 64) if bits >= 1 << 63 else bits, i64)

        zero64 = c64(0)

        def low_bits(n_bits):  # the mask of the first n_bits (an i64 value, 0..64) bits
            shifted = arith.subi(arith.shli(c64(1), n_bits), c64(1))  # (poison at 64: not selected)
            return arith.select(arith.cmpi(arith.CmpIPredicate.uge, n_bits, c64(64)), c64(-1 + (1 << 64)), shifted)

        def popc(x):
            return mlir_math.ctpop(x)

        peer_before = [arith.cmpi(arith.CmpIPredicate.ult, arith.xori(quad_pos, mgpu.c(d, i32)), quad_pos)
                       for d in (1, 2, 3)]
        rows = []  # per row of the thread: (row, its mask, the peers' masks, its elements' values)
        for srow, entries in sorted(by_row.items()):
            entries.sort()
            mask = zero64
            values = []
            for g, (_, reg_idx) in enumerate(entries):
                reg = regs[reg_idx]
                for e in range(2):
                    a = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
                    live = arith.cmpf(arith.CmpFPredicate.OGT, a, zero_f)
                    mask = arith.ori(mask, arith.select(live, c64(1 << (2 * g + e)), zero64))
                    values.append(a)
            peers = [mgpu_utils.shfl_bfly(mask, d) for d in (1, 2, 3)]
            total = popc(mask)
            for p in peers:
                total = arith.addi(total, popc(p))
            row = arith.addi(row0, mgpu.c(srow, index))
            with mgpu.when(arith.cmpi(arith.CmpIPredicate.eq, quad_pos, mgpu.c(0, i32))):
                memref.store(arith.trunci(i32, total), counts_ref, [row])
            rows.append((row, mask, peers, values))

        def place(row, mask, peers, chunk_values, chunk, left):
            """Stores the lowest positive element left in `left` (if any) at its slot."""
            bit64 = mlir_math.cttz(left)  # 64 when none is left
            bit = arith.trunci(i32, bit64)
            j = arith.andi(arith.subi(bit, mgpu.c(chunk, i32)), mgpu.c(len(chunk_values) - 1, i32))
            level = chunk_values  # the element's value: a select tree on j's bits
            for b in range(len(chunk_values).bit_length() - 1):
                odd = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(j, mgpu.c(1 << b, i32)), mgpu.c(0, i32))
                level = [arith.select(odd, level[n + 1], level[n]) for n in range(0, len(level), 2)]
            group = arith.shrui(bit, mgpu.c(1, i32))
            # positives before it: its own earlier bits, and the peers' pairs of earlier groups (and
            # of this group where the peer's pair comes first)
            slot = popc(arith.andi(mask, low_bits(bit64)))
            earlier = low_bits(arith.extui(i64, arith.shli(group, mgpu.c(1, i32))))
            through = low_bits(arith.extui(i64, arith.addi(arith.shli(group, mgpu.c(1, i32)), mgpu.c(2, i32))))
            for p, first in zip(peers, peer_before):
                slot = arith.addi(slot, popc(arith.andi(p, arith.select(first, through, earlier))))
            slot = arith.trunci(i32, slot)
            store = arith.andi(arith.cmpi(arith.CmpIPredicate.ne, left, zero64),
                               arith.cmpi(arith.CmpIPredicate.ult, slot, mgpu.c(slots, i32)))
            with mgpu.when(store):
                at = [row, arith.index_cast(index, slot)]
                memref.store(arith.truncf(out_type, level[0]), values_ref, at)
                # tile-local column + 1 = 8 group + 2 quad_pos + (bit & 1) + 1
                col = arith.addi(arith.addi(arith.shli(group, mgpu.c(3, i32)), arith.shli(quad_pos, mgpu.c(1, i32))),
                                 arith.addi(arith.andi(bit, mgpu.c(1, i32)), mgpu.c(1, i32)))
                memref.store(col, indices_ref, at)
            return arith.andi(left, arith.subi(left, c64(1)))

        n_elems = len(rows[0][3])
        for chunk in range(0, n_elems, chunk_size):
            # one loop per chunk, over the positive elements only (lowest bit first, both rows of
            # the thread in each step): no code per element, so nothing for the compiler to predicate
            chunk_bits = c64(((1 << chunk_size) - 1) << chunk)
            lefts = [arith.andi(mask, chunk_bits) for _, mask, _, _ in rows]
            steps = arith.maxui(popc(lefts[0]), popc(lefts[1]))

            @mgpu.fori(arith.trunci(i32, steps), lefts)
            def _(_i, left, chunk=chunk):
                return [place(row, mask, peers, values[chunk:chunk + chunk_size], chunk, lft)
                        for (row, mask, peers, values), lft in zip(rows, left)]

    return compact


def _write_tile(acc, smem, gmem, rows, t_idx, *, tile: int, slots: int, dtype, epilogue: str) -> None:
    """The epilogue of one [rows, tile] accumulator: its TwELL slots and counts into the shared
    buffers `smem` (values, indices, counts) by `epilogue` ("compact": `_compact_epilogue`, the
    buffers zeroed before and the columns offset by the tile after; "scan": `_epilogue_keys`), then
    TMA copies of them to `gmem` (the caller waits before it reuses the buffers)."""
    values_smem, indices_smem, counts_smem = smem
    values_gmem, indices_gmem, counts_gmem = gmem
    if epilogue == "compact":
        values_smem[...] = jnp.zeros(values_smem.shape, dtype)
        indices_smem[...] = jnp.zeros(indices_smem.shape, jnp.int32)
        plgpu.commit_smem()  # (a warpgroup barrier) every zero lands before any thread's slots
        _compact_epilogue(tile, slots)(acc, values_smem, indices_smem, counts_smem)
        plgpu.commit_smem()
        local = indices_smem[...]  # tile-local column + 1; 0 = unused slot
        indices_smem[...] = jnp.where(local > 0, local - 1 + t_idx * tile, 0)
    else:
        keys = _epilogue_keys(acc, counts_smem, tile=tile, slots=slots, dtype=dtype)
        stored = keys >= 0
        values_smem[...] = lax.bitcast_convert_type(jnp.where(stored, keys & 0xFFFF, 0).astype(jnp.int16), dtype)
        indices_smem[...] = jnp.where(stored, (keys >> 16) + t_idx * tile, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(values_smem, values_gmem.at[rows, t_idx])
    plgpu.copy_smem_to_gmem(indices_smem, indices_gmem.at[rows, t_idx])
    plgpu.copy_smem_to_gmem(counts_smem, counts_gmem.at[t_idx, rows])


def _pack_body(x_gmem, w_gmem, values_gmem, indices_gmem, counts_gmem, *, tile: int, slots: int,
                  block_k: int, n_k: int, n_m: int, n_tiles: int, max_concurrent_steps: int,
                  epilogue: str, cluster: int) -> None:
    """The kernel: each program (one per SM, grid axis "sm") loops over (128-row block, tile) pairs,
    the tile varying fastest; warpgroups 0 and 1 ("wg") compute 64 rows each, warpgroup 2 issues the
    TMA copies."""
    dtype = x_gmem.dtype
    swizzle = 128 if block_k * jnp.dtype(dtype).itemsize >= 128 else 64
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    half = 64

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(n_k,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((2 * half, block_k), lambda k: (0, k), transforms=transforms,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((tile, block_k), lambda k: (0, k), transforms=transforms,
                                      memory_space=plgpu.SMEM,
                                      collective_axes=("cluster",) if cluster > 1 else ())],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=max_concurrent_steps,
            compute_context=context)

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        values_smem=plgpu.SMEM((2, half, slots), dtype),
        indices_smem=plgpu.SMEM((2, half, slots), jnp.int32),
        counts_smem=plgpu.SMEM((2, half), jnp.int32),
        collective_axes="wg")
    def scope(allocations, values_smem, indices_smem, counts_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((n_m // cluster * n_tiles,), collective_axes="sm")
        def tiles(info):
            (linear,) = info.index
            m_idx, t_idx = lax.div(linear, n_tiles), lax.rem(linear, n_tiles)
            if cluster > 1:  # the cluster's programs: row blocks 2i and 2i + 1 of one tile
                m_idx = m_idx * cluster + lax.axis_index("cluster")

            def context(run_pipeline):
                def acc_scope(acc_ref):
                    run_pipeline(acc_ref)
                    acc = acc_ref[...]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's copies left the buffers
                    _write_tile(acc, (values_smem.at[wg], indices_smem.at[wg], counts_smem.at[wg]),
                                (values_gmem, indices_gmem, counts_gmem),
                                pl.ds(m_idx * 2 * half + wg * half, half), t_idx, tile=tile, slots=slots,
                                dtype=dtype, epilogue=epilogue)

                pl.run_scoped(acc_scope, plgpu.ACC((half, tile), jnp.float32))

            def mma(_, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * half, half)], plgpu.transpose_ref(w_smem, (1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            pipeline(mma, context)(x_gmem.at[pl.ds(m_idx * 2 * half, 2 * half), :],
                                   w_gmem.at[pl.ds(t_idx * tile, tile), :], allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _sm_count() -> int:
    """Streaming multiprocessors of the default device (the persistent layout's program count)."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132)


def _pack_mgpu(x_MxD: jax.Array, w_HxD: jax.Array, *, tile: int, slots: int,
               block_sizes: MgpuPackBlockSizes) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The launch on aligned shapes (M % (BLOCK_M * cluster), D % BLOCK_K, H % tile == 0)."""
    m, d = x_MxD.shape
    h = w_HxD.shape[0]
    n_tiles = h // tile

    def twell_pack_mgpu(*refs):  # the kernel's name in profiles
        _pack_body(*refs, tile=tile, slots=slots, block_k=BLOCK_K, n_k=d // BLOCK_K, n_m=m // BLOCK_M,
                      n_tiles=n_tiles, max_concurrent_steps=block_sizes.max_concurrent_steps,
                      epilogue=block_sizes.epilogue, cluster=block_sizes.cluster)

    out_types = (jax.ShapeDtypeStruct((m, n_tiles, slots), x_MxD.dtype),
                 jax.ShapeDtypeStruct((m, n_tiles, slots), jnp.int32),
                 jax.ShapeDtypeStruct((n_tiles, m), jnp.int32))
    cluster = block_sizes.cluster
    programs = min(_sm_count() // cluster, (m // BLOCK_M // cluster) * n_tiles)
    clusters = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
    launch = plgpu.kernel(twell_pack_mgpu, out_type=out_types, grid=(programs,), grid_names=("sm",),
                          num_threads=3, thread_name="wg", **clusters)
    values, indices, counts_t = launch(x_MxD, w_HxD)
    return values, indices, counts_t.T


def validate_mgpu_pack_args(x_MxD: jax.Array, w_HxD: jax.Array, tile: int, slots: int) -> None:
    """Raise ValueError naming the offending argument (the Triton kernel's checks, plus this
    kernel's own limits)."""
    from .twell_pack import validate_pack_args  # noqa: PLC0415 (one set of shared checks)

    validate_pack_args(x_MxD, w_HxD, tile, slots)
    if x_MxD.dtype == jnp.float32:
        raise ValueError("the Mosaic GPU pack takes 16-bit activations (bf16/f16), got float32 x_MxD "
                         "(the Triton pack takes fp32)")
    if tile != 256 or not 8 <= slots <= 128:
        raise ValueError(f"the Mosaic GPU pack wants tile 256 and 8 <= slots <= 128 (one wgmma N; the "
                         f"output rows' TMA width), got tile {tile}, slots {slots}")


@functools.partial(jax.jit, static_argnames=("tile", "slots", "block_sizes"))
def pack_gate_mgpu(x_MxD: jax.Array, w_HxD: jax.Array, *, tile: int = 256, slots: int = 32,
                   block_sizes: MgpuPackBlockSizes = MgpuPackBlockSizes()
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TwELL pack of relu(x @ w.T) on Mosaic GPU: (values[M,NT,S], indices[M,NT,S], counts[M,NT]),
    the same as `twell_pack.pack_gate`. Any M, D, H (zero padding, exact as there)."""
    if not available():
        raise RuntimeError("this JAX's Pallas Mosaic GPU module lacks names the kernel uses "
                           f"({', '.join(n for n in _NEEDED if plgpu is None or not hasattr(plgpu, n))})")
    validate_mgpu_pack_args(x_MxD, w_HxD, tile, slots)
    if block_sizes.epilogue == "compact" and not compact_epilogue_available(tile):
        warnings.warn("this JAX's Mosaic GPU lacks what the pack's compaction epilogue is built from "
                      "(plgpu.inline_mgpu, the wgmma register layout it expects, or its IR builders): "
                      "running the 'scan' epilogue (the same outputs, slower)", RuntimeWarning, stacklevel=2)
        block_sizes = dataclasses.replace(block_sizes, epilogue="scan")
    m, d = x_MxD.shape
    h = w_HxD.shape[0]
    m_pad, d_pad, h_pad = round_up(m, BLOCK_M * block_sizes.cluster), round_up(d, BLOCK_K), round_up(h, tile)
    if (m_pad, d_pad) != (m, d):
        x_MxD = jnp.pad(x_MxD, ((0, m_pad - m), (0, d_pad - d)))
    if (h_pad, d_pad) != (h, d):
        w_HxD = jnp.pad(w_HxD, ((0, h_pad - h), (0, d_pad - d)))
    values, indices, counts = _pack_mgpu(x_MxD, w_HxD, tile=tile, slots=slots, block_sizes=block_sizes)
    if m_pad != m:
        values, indices, counts = values[:m], indices[:m], counts[:m]
    return values, indices, counts
