"""Decode-size matrix-vector products (Pallas, Triton backend), with the small ops around them fused.

A decode step multiplies a few token rows (M = the batch, 1 to 64) by every weight matrix of the
model once: a memory-bound GEMV whose cost is reading the weights. XLA emits these as reductions
or small GEMMs that fell well short of an H100's 3.35 TB/s (BENCHMARKS.md, Decode), and the
norms, activations and residual adds around them as separate kernels. This kernel reads the
weight once at full width and
does the rest in its prologue and epilogue:

    out = round( residual + round( act(round(xn . gate)) * round(xn . w) ) )      (all optional)
    xn  = round(x * rsqrt(mean(x^2) + eps) * norm_scale)     (RMSNorm prologue, fp32 as the model)

Every rounding is the model's (twell_jax/model.py: the norm in fp32 rounded to x's dtype; the dense
FFN formula of twell_jax/ops/dense.py: GEMM outputs rounded to x's dtype, the gating product
rounded once; the residual add of two rounded values), so a decode step built from it computes what
the model's XLA path computes up to the order of the fp32 sums.

Layouts: w is "nk" ([N, K], output-major: the FFN's neuron-major gate/up weights and the tied
embedding as the LM head) or "kn" ([K, N], x @ w: the attention projections and W_down). Stacked
weights ([L, N, K] / [L, K, N], and norm scales [L, K]) with a traced `layer` (int32 [1]) are read
in place at that layer: the decode loop over the stacked layers (lax.scan) hands the whole stack
to the kernel, so no layer's weights are copied out of it (XLA's slice of a scanned operand feeding
a GEMM is a copy: a sizeable share of the 0.5b model's step, BENCHMARKS.md, Decode).

Grid (cdiv(N, block_n), cdiv(M, block_m)): program (j, i) owns output columns [j*bn, (j+1)*bn)
of rows [i*bm, (i+1)*bm) (with MatvecBlockSizes.programs_n, exactly that many column programs of
W = cdiv(N, programs_n) <= bn columns each: [j*W, (j+1)*W), the other lanes masked); it loops
over K in block_k steps (a tensor-core dot of [bm, bk] x [bk, bn], fp32 accumulation; bm >= 16
is the dot's minimum, rows >= M are masked lanes that move no bytes). The norm's sum of squares is
a first pass over the program's x rows (x is KBs: L2-resident), in steps of NORM_BLOCK_K.
No operand is padded, nor the output: it is exactly [M, N], stored with a row and column mask
(a padded output's slice feeding the next kernel would be a copy launch of its own: XLA cannot
fuse a slice into a custom call). Nothing is accumulated across programs (deterministic; the
down product's tile partials below are summed in one fixed order).

tile_lists=True (the sparse layers' gate): the epilogue also packs, per column tile, the neurons
with out > 0 in any row as ids and a count (`tile_lists_reference`), the TwELL layout of one
decode step, which twell_decode.sparse_decode_ffn_tiles reads instead of a compacted list.
tile_values=True (with up=W_up) also packs each listed neuron's hidden value beside its id, from
that neuron's W_up row alone (a second, short phase after the K loop in the tiles that have active
neurons), which twell_decode.sparse_decode_down_tiles reads for the down product.
down=W_down (a few rows, decode.sparse_ffn "packed_down") makes that down product in the same
launch: each tile adds its neurons' W_down rows (read with their W_up rows) into an fp32 partial
of its own, then, after a grid barrier (an acquire-release arrival count and a spin; only where the
GPU holds every program at once, `_grid_is_resident`), every program sums all the tiles' partials,
in one fixed order, for a block of the output columns and adds the residual. The partials are
written once and summed once, so the result is still deterministic; no value is summed by atomics.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .common import (NORM_BLOCK_K, check_launch_sizes, compiler_params, is_pow2, next_pow2,  # noqa: F401
                     round_up, rows_inv_rms, store_partition)
from .twell_pack import _dot_precision

LAYOUTS = ("nk", "kn")
BF16_ITEMSIZE = 2  # the operand size the block sizes below are tuned for (`MatvecBlockSizes.fitted`)
ACTIVATIONS = (None, "relu", "silu")
# tile_values: the elements of W_up a step of the hidden values' epilogue holds in registers (fp32):
# values_chunk(K) active neurons' rows whole, 4 at the 0.5b model's width (2048), fewer when wider.
VALUES_STEP_ELEMENTS = 8192


def values_chunk(k: int) -> int:
    """Active neurons per step of the tile values' epilogue at width K: a power of two in [1, 4]."""
    return max(1, min(4, VALUES_STEP_ELEMENTS // next_pow2(k)))


@dataclasses.dataclass(frozen=True)
class MatvecBlockSizes:
    """Static launch parameters (powers of two >= 16 for the block extents)."""

    block_n: int = 32  # output columns per program
    block_k: int = 256  # K step of the dot loop
    max_block_m: int = 16  # token rows per program, at most
    num_warps: int = 4
    num_stages: int = 3
    # > 1: the K loop split over this many programs per output block (more programs for a narrow
    # N: 2048 columns in blocks of 32 are 64 programs on 132 SMs); their fp32 partials are summed
    # and the epilogue applied in XLA (one small fusion). Not with a gate.
    split_k: int = 1
    # > 0: exactly this many column programs, each owning ceil(N / programs_n) <= block_n
    # consecutive columns (its block's other lanes masked: they move no bytes), so a launch fills
    # the SMs evenly (5632 columns in blocks of 32 are 176 programs on 132 SMs: 44 SMs run two
    # and the others idle half the time; 264 programs of 22 columns run two on every SM). 0:
    # ceil(N / block_n) programs of block_n columns. One weight part only (no q/k/v triple).
    programs_n: int = 0

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "max_block_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not is_pow2(value) or value < 16:
                raise ValueError(f"MatvecBlockSizes.{name} must be a power of two >= 16, got {value!r}")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"MatvecBlockSizes.split_k must be an int >= 1, got {self.split_k!r}")
        if isinstance(self.programs_n, bool) or not isinstance(self.programs_n, int) or self.programs_n < 0:
            raise ValueError(f"MatvecBlockSizes.programs_n must be an int >= 0 (0 = one program per block_n "
                             f"columns), got {self.programs_n!r}")
        check_launch_sizes(self)

    def block_m(self, m: int) -> int:
        return max(16, min(self.max_block_m, next_pow2(m)))

    def pipeline_bytes(self, m: int, itemsize: int, n_parts: int = 1) -> int:
        """Shared memory of the K loop's software pipeline at m rows: num_stages buffers of an x
        block [block_m, block_k] and `n_parts` weight blocks [block_k, block_n] of `itemsize` bytes."""
        return self.num_stages * (self.block_m(m) + n_parts * self.block_n) * self.block_k * itemsize

    def fitted(self, m: int, itemsize: int, n_parts: int = 1) -> "MatvecBlockSizes":
        """These sizes for operands of `itemsize` bytes: the sizes here are tuned (and compile) for
        bf16, and at fp32 the same pipeline needs twice the shared memory (the H100's limit was
        exceeded: the output projection's four stages of [256, 64] fp32 blocks). The pipeline is
        kept within its bf16 size, first by fewer stages (down to 2), then by a shorter K step
        (down to 16); unchanged for 2-byte operands."""
        limit = self.pipeline_bytes(m, BF16_ITEMSIZE, n_parts)
        sizes = self
        while sizes.pipeline_bytes(m, itemsize, n_parts) > limit:
            if sizes.num_stages > 2:
                sizes = dataclasses.replace(sizes, num_stages=sizes.num_stages - 1)
            elif sizes.block_k > 16:
                sizes = dataclasses.replace(sizes, block_k=sizes.block_k // 2)
            else:
                break
        return sizes

    def columns(self, n: int) -> tuple[int, int]:
        """(column programs, columns each owns) for an output of n columns; ValueError when
        programs_n asks for more than block_n columns a program."""
        if not self.programs_n:
            return -(-n // self.block_n), self.block_n
        width = -(-n // self.programs_n)
        if width > self.block_n:
            raise ValueError(f"MatvecBlockSizes.programs_n={self.programs_n} gives {width} columns a program for "
                             f"N={n}, more than block_n={self.block_n}")
        return -(-n // width), width


# What a call without block_sizes uses: among the variants of `experiments/bench_decode_matvec.py
# --rows 1` (H100, a sweep whose timings still held the per-call overhead of its loop's own
# work) within 10% of the best summed time over the qkv, output, gate/up and down shapes, the one
# whose three-part q/k/v launch fits the H100's shared memory (block_k 512 did not: 244 KiB).
DEFAULT_BLOCK_SIZES = MatvecBlockSizes(block_n=32, block_k=256, num_warps=8, num_stages=3)
# The products of a model's decode step (`twell_jax/inference/decode_engine.py`) by role, each with its
# block sizes: q/k/v (three parts, one launch), the attention output projection, the gated
# gate/up, W_down, the LM head, the sparse layers' gate; and "qkv_nk", "out_nk", "down_nk": the
# first three read from decode.transposed's output-major copies (another layout, other best
# tiles). The `nk` roles hold the fastest blocks of `experiments/bench_decode_matvec.py --rows 1
# --reps 2 --shapes qkv_nk,down_nk,gate_up,out_nk,head,gate --blocks-out FILE` (H100;
# experiments/results/bench_decode_matvec_nk_h100_2026-11-24.json, BENCHMARKS.md). The `kn` roles
# (q/k/v, output and W_down as stored, read only with decode.transposed off) keep
# DEFAULT_BLOCK_SIZES: their sweep ran with the old loop timing, whose figures were not usable.
# programs_n (an even load on the SMs) swept for q/k/v, gate/up and the gate (`--programs 0,132,264`,
# H100): within noise of these blocks alone, and no faster in the model's step; not used.
# num_stages (the K loop's software-pipelining depth; those sweeps held it at 3) swept at these blocks
# (`--role-blocks-only --stages 2,3,4,5 --rows 1,4`, H100,
# experiments/results/bench_decode_matvec_stages_h100_2026-11-25.json): 4 stages were faster than 3
# for q/k/v, the output projection (at 1 and 4 rows), gate/up and W_down in the switch; W_down and
# the LM head within noise of 3, kept. The sparse gate: `GATE_FEW_ROWS`.
# max_block_m 32 for the dense products (q/k/v, the output projection, gate/up, W_down, the LM head):
# a step of 17-32 rows reads each weight once, where blocks of 16 read it once per 16 rows; the
# gates keep 16 ("tiles" and "packed" need every row in one gate program) and so does the switch's
# W_down (64 above MANY_ROWS rows, below). The twin's step (0.5b, H100, a random init, in alternation
# with plain JAX): at 32 rows a little faster than with blocks of 16, 16 rows unchanged (one block
# either way); experiments/results/bench_inference_0.5b_decode_rows32_h100_2026-11-25.json. At 64
# rows blocks of 32 read each weight twice (the twin slower than plain JAX): above
# MANY_ROWS rows the dense products take ROLE_BLOCK_SIZES_MANY_ROWS (below).
# "down_nk_switch": W_down in the device switch's dense side (a sparse layer's step at several rows),
# disabled on most steps: one launch (no split-K partials summed in XLA, a launch of its own even
# when disabled), 128 column programs.
ROLES = ("qkv", "out", "gate_up", "down", "head", "gate", "gate_few_rows", "qkv_nk", "out_nk", "down_nk",
         "down_nk_switch")
ROLE_BLOCK_SIZES: dict[str, MatvecBlockSizes] = {
    "qkv": DEFAULT_BLOCK_SIZES, "out": DEFAULT_BLOCK_SIZES, "down": DEFAULT_BLOCK_SIZES,
    "gate_up": MatvecBlockSizes(block_n=32, block_k=128, num_warps=4, num_stages=4, split_k=1, max_block_m=32),
    "head": MatvecBlockSizes(block_n=32, block_k=256, num_warps=4, num_stages=3, split_k=1, max_block_m=32),
    "gate": MatvecBlockSizes(block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=1),
    "gate_few_rows": MatvecBlockSizes(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=1),
    "qkv_nk": MatvecBlockSizes(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=1, max_block_m=32),
    "out_nk": MatvecBlockSizes(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4, max_block_m=32),
    "down_nk": MatvecBlockSizes(block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=4, max_block_m=32),
    "down_nk_switch": MatvecBlockSizes(block_n=16, block_k=256, num_warps=4, num_stages=4, split_k=1),
}


# A step of more than MANY_ROWS rows runs the dense products with these blocks: 64 rows a program
# (a step of 33-64 rows reads each weight once), block_k 128 so that the deeper row block's
# pipeline fits shared memory (64 rows x 256 at 4 stages asked for 256 KiB), each role's fastest of
# `experiments/bench_decode_matvec.py --rows 64 --shapes qkv_nk,out_nk,gate_up,down_nk,head
# --role-blocks-only --max-block-m 32,64 --stages 3,4 --block-k 128,256` (H100,
# experiments/results/bench_decode_matvec_rows64_h100_2026-11-25.json): at 64 rows each role beat
# its blocks of 32, and all but the LM head (on par) beat XLA's dot; the switch's W_down (one
# launch: split_k 1, 16 columns a program) too. The twin's step at 64 and at 48 rows is then
# faster than plain JAX (in alternation; BENCHMARKS.md, Decode;
# experiments/results/bench_inference_0.5b_decode_batch3264_h100_2026-11-25.json, a trained
# checkpoint, and bench_inference_0.5b_decode_rows64_h100_2026-11-25.json, a random init).
# At one row they would not be these roles' best (their K loops swept there), so
# steps of up to MANY_ROWS rows keep ROLE_BLOCK_SIZES. A role not named here keeps its entry there
# (the gates: "tiles" and "packed" need every row in one gate program, up to 16; the stored-layout
# "kn" roles, read only with decode.transposed off).
MANY_ROWS = 32
ROLE_BLOCK_SIZES_MANY_ROWS: dict[str, MatvecBlockSizes] = {
    "gate_up": MatvecBlockSizes(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=1, max_block_m=64),
    "head": MatvecBlockSizes(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=1, max_block_m=64),
    "qkv_nk": MatvecBlockSizes(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1, max_block_m=64),
    "out_nk": MatvecBlockSizes(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4, max_block_m=64),
    "down_nk": MatvecBlockSizes(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4, max_block_m=64),
    "down_nk_switch": MatvecBlockSizes(block_n=16, block_k=256, num_warps=4, num_stages=4, split_k=1, max_block_m=64),
}


# Rows of a decode step up to which the sparse gate runs as role "gate_few_rows" (`gate_role`): its
# K loop one stage deeper. With the tile values' epilogue (`packed`; H100,
# experiments/bench_decode_ffn_step.py --gate-blocks, 32 and 96 active neurons spread): 4 stages
# were faster than 3 at 1 and 2 rows; in the model's step at 4 rows they were slower (the
# epilogue's four unrolled rows and the deeper pipeline compete for registers). BENCHMARKS.md, Decode.
GATE_FEW_ROWS = 2


def gate_role(rows: int) -> str:
    """The sparse gate's role at a decode step of `rows` rows."""
    return "gate_few_rows" if rows <= GATE_FEW_ROWS else "gate"


def role_block_sizes(role: str, rows: int = 1) -> MatvecBlockSizes:
    """The block sizes of a decode-step role (ROLES) at a step of `rows` rows: above MANY_ROWS
    those of ROLE_BLOCK_SIZES_MANY_ROWS where it names the role, else ROLE_BLOCK_SIZES'."""
    if role not in ROLE_BLOCK_SIZES:
        raise ValueError(f"role must be one of {tuple(ROLE_BLOCK_SIZES)}, got {role!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1 (the decode step's rows), got {rows!r}")
    if rows > MANY_ROWS and role in ROLE_BLOCK_SIZES_MANY_ROWS:
        return ROLE_BLOCK_SIZES_MANY_ROWS[role]
    return ROLE_BLOCK_SIZES[role]


def _act(v: jax.Array, activation: str | None) -> jax.Array:
    if activation == "relu":
        return jnp.maximum(v, 0.0)
    if activation == "silu":
        return v * jax.nn.sigmoid(v)
    return v


def _matvec_kernel(*refs, m: int, n: int, k: int, layout: str, has_layer: bool, has_norm: bool,
                   has_gate: bool, has_residual: bool, has_enable: bool, n_parts: int, activation: str | None,
                   eps: float, block_m: int, block_n: int, block_k: int, n_k: int, precision: lax.Precision,
                   split_k: int = 1, n_k_split: int = 0, tile_lists: bool = False, width: int = 0,
                   tile_values: bool = False, has_up: bool = False, enable_above: int = 0,
                   down: str | None = None, has_down_residual: bool = False, programs: int = 0,
                   down_limit: int | None = None) -> None:
    refs = list(refs)
    layer_ref = refs.pop(0) if has_layer else None
    enable_ref = refs.pop(0) if has_enable else None
    x_ref = refs.pop(0)
    w_refs = [refs.pop(0) for _ in range(n_parts)]
    gate_ref = refs.pop(0) if has_gate else None
    up_ref = refs.pop(0) if has_up else None
    down_ref = refs.pop(0) if down else None
    scale_ref = refs.pop(0) if has_norm else None
    res_ref = refs.pop(0) if has_residual else None
    down_res_ref = refs.pop(0) if has_down_residual else None
    if down == "barrier":
        refs.pop(0)  # the arrival counters' input: aliased to the last output
    # list_refs: ids, count, pairs (tile_lists), values (tile_values), partials (down), y and the
    # counters (down "barrier")
    o_ref, list_refs = refs[0], refs[1:]
    layer = jnp.max(layer_ref[...]).astype(jnp.int32) if has_layer else jnp.int32(0)
    enabled = True
    if has_enable:  # the device-side switch (decode_matvec's docstring): sum(enable) > enable_above
        n_enable = enable_ref.shape[0]
        lane_E = lax.broadcasted_iota(jnp.int32, (next_pow2(n_enable),), 0)
        enable_E = plgpu.load(enable_ref.at[jnp.minimum(lane_E, n_enable - 1)], mask=lane_E < n_enable, other=0)
        enabled = jnp.sum(enable_E) > enable_above
    rows_BM = pl.program_id(1) * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    row_ok_BM = rows_BM < m
    width = width or block_n  # columns this program owns (MatvecBlockSizes.columns)
    lane_BN = lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    cols_BN = pl.program_id(0) * width + lane_BN
    col_ok_BN = (cols_BN < n * n_parts) & (lane_BN < width)
    # The output is exactly [m, n * n_parts] (split: [S * m, ...]), stored with a mask: no padded
    # rows for XLA to slice off (a slice feeding another kernel is a copy launch of its own).
    out_cols_BN, out_ok_BMxBN = cols_BN, row_ok_BM[:, None] & col_ok_BN[None, :]
    # Several parts (w = (w_q, w_k, w_v)): output columns [p*n, (p+1)*n) are part p's; a program's
    # columns lie in one part (n % block_n == 0), whose loads are the only live ones (masked-off
    # loads move no bytes).
    part = (pl.program_id(0) * width) // n
    cols_BN = cols_BN - part * n
    col_ok_BN = col_ok_BN & (cols_BN < n)
    step_BK = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def load_x(t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        ks_BK = t * block_k + step_BK
        k_ok_BK = ks_BK < k
        # other= on every masked load that feeds a sum (interpret mode leaves masked lanes undefined).
        x_BMxBK = plgpu.load(x_ref.at[rows_BM[:, None], ks_BK[None, :]],
                             mask=row_ok_BM[:, None] & k_ok_BK[None, :], other=0)
        return x_BMxBK, ks_BK, k_ok_BK

    inv_rms_BM = None
    if has_norm:  # in steps of its own, wider than the dot's (common.rows_inv_rms)
        inv_rms_BM = rows_inv_rms(x_ref, rows_BM, row_ok_BM, k=k, eps=eps, live=enabled, rows=min(m, block_m))

    def load_w(ref, ks_BK: jax.Array, k_ok_BK: jax.Array, live=True) -> jax.Array:
        cols_ok_BN = col_ok_BN & live
        if layout == "nk":  # rows layer*N + n of the flattened [L*N, K]
            return plgpu.load(ref.at[(layer * n + cols_BN)[:, None], ks_BK[None, :]],
                              mask=cols_ok_BN[:, None] & k_ok_BK[None, :], other=0)
        return plgpu.load(ref.at[(layer * k + ks_BK)[:, None], cols_BN[None, :]],  # [L*K, N]
                          mask=k_ok_BK[:, None] & cols_ok_BN[None, :], other=0)

    def dot(x_BMxBK: jax.Array, w: jax.Array) -> jax.Array:
        dims = (((1,), (1,)), ((), ())) if layout == "nk" else (((1,), (0,)), ((), ()))
        return lax.dot_general(x_BMxBK, w, dims, precision=precision, preferred_element_type=jnp.float32)

    k_first = pl.program_id(2) * n_k_split if split_k > 1 else jnp.int32(0)

    def k_step(i, accs):
        t = k_first + i
        x_BMxBK, ks_BK, k_ok_BK = load_x(t)
        if has_norm:
            scale_BK = plgpu.load(scale_ref.at[layer * k + ks_BK], mask=k_ok_BK, other=0.0)
            x_BMxBK = (x_BMxBK.astype(jnp.float32) * inv_rms_BM[:, None] * scale_BK[None, :]).astype(x_ref.dtype)
        if n_parts == 1:
            w_tile = load_w(w_refs[0], ks_BK, k_ok_BK)
        else:  # one live part: the others' lanes are all masked (zeros, no traffic)
            w_tile = load_w(w_refs[0], ks_BK, k_ok_BK, part == 0)
            for p in range(1, n_parts):
                w_tile = w_tile + load_w(w_refs[p], ks_BK, k_ok_BK, part == p)
        acc_BMxBN = accs[0] + dot(x_BMxBK, w_tile)
        if not has_gate:
            return (acc_BMxBN,)
        return acc_BMxBN, accs[1] + dot(x_BMxBK, load_w(gate_ref, ks_BK, k_ok_BK))

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    # Disabled: no K loop and no norm pass (the output is the residual, or zeros): the device-side
    # switch between this dense product and a sparse one without a host round trip. Both loop
    # bounds int32.
    trips = jnp.int32(n_k)
    if split_k > 1:  # this program's share of the K blocks
        trips = jnp.clip(jnp.int32(n_k) - k_first, 0, n_k_split).astype(jnp.int32)
    if has_enable:
        trips = jnp.where(enabled, trips, jnp.int32(0)).astype(jnp.int32)
    accs = lax.fori_loop(jnp.int32(0), trips, k_step, (zeros, zeros) if has_gate else (zeros,))
    if split_k > 1:  # the raw fp32 partial: summed and finished in XLA (`_epilogue`)
        plgpu.store(o_ref.at[(pl.program_id(2) * m + rows_BM)[:, None], out_cols_BN[None, :]], accs[0],
                    mask=out_ok_BMxBN)
        return
    dt = x_ref.dtype
    res_BMxBN = None
    if has_residual:
        res_BMxBN = plgpu.load(res_ref.at[rows_BM[:, None], cols_BN[None, :]],
                               mask=row_ok_BM[:, None] & col_ok_BN[None, :], other=0)
    out_BMxBN = _epilogue(accs, dt, activation, res_BMxBN, o_ref.dtype)
    plgpu.store(o_ref.at[rows_BM[:, None], out_cols_BN[None, :]], out_BMxBN, mask=out_ok_BMxBN)
    if not tile_lists:
        return
    # This column tile's active neurons, packed (TwELL): module docstring.
    ids_ref, count_ref, pairs_ref = list_refs[:3]
    on_BMxBN = ((out_BMxBN > 0) & row_ok_BM[:, None] & col_ok_BN[None, :]).astype(jnp.int32)
    pairs_ref[...] = jnp.broadcast_to(jnp.sum(on_BMxBN), (1,))
    active_BN = jnp.sum(on_BMxBN, axis=0) > 0
    # With the down product count is whole (its sum read after the barrier, against down_limit).
    slot_BN, n_active = store_partition(active_BN, ids_ref, None if down else count_ref, h=n,
                                        first=pl.program_id(0) * width)
    if down:
        plgpu.store(count_ref.at[jnp.full((1,), pl.program_id(0), jnp.int32)], jnp.broadcast_to(n_active, (1,)))
    if not tile_values:
        return
    # Each listed neuron's hidden value beside its id: h = round(relu(g) * u), u = xn . up[neuron]
    # (fp32, unrounded: `twell_decode`'s hidden kernel's formula), or round(relu(g)) without up.
    # The tile's active neurons in slot order, `values_chunk` at a time (ceil(count / chunk) steps,
    # usually 0 or 1 in a decode step): their up rows are read whole in one load (every byte in
    # flight at once: the chain of dependent loads after the gate's K loop is the cost here) and
    # each row's u is an fp32 multiply-and-sum with that row of xn (no tensor-core dot: its 16-wide
    # minimum would hold 16 rows of up in registers for one or two live ones).
    act_BMxBN = jnp.maximum(out_BMxBN.astype(jnp.float32), 0.0)
    chunk = values_chunk(k)
    lane_S = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    row_BM = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    ks_K = lax.broadcasted_iota(jnp.int32, (next_pow2(k),), 0)
    k_ok_K = ks_K < k
    first, slot_base = pl.program_id(0) * width, pl.program_id(0) * block_n  # outside the loop (interpret mode)
    row_first = pl.program_id(1) * block_m
    part_first = pl.program_id(0) * m  # this tile's rows of the down product's partials
    xn_rows = []  # each live row of xn, fp32 [K] (x is L2-resident), loaded once for every step
    if has_up:
        scale_K = plgpu.load(scale_ref.at[layer * k + ks_K], mask=k_ok_K, other=0.0) if has_norm else None
        for r in range(min(m, block_m)):
            x_K = plgpu.load(x_ref.at[row_first + r, ks_K], mask=k_ok_K, other=0)
            if has_norm:
                inv_rms = jnp.sum(jnp.where(row_BM == r, inv_rms_BM, 0.0))
                x_K = (x_K.astype(jnp.float32) * inv_rms * scale_K).astype(dt)
            xn_rows.append(x_K.astype(jnp.float32))

    def chunk_step(c, carry):
        slots_S = c * chunk + lane_S
        live_S = slots_S < n_active
        pick_BNxS = slot_BN[:, None] == slots_S[None, :]
        neuron_S = first + jnp.sum(jnp.where(pick_BNxS, lane_BN[:, None], 0), axis=0)
        rows_SxK = (layer * n + neuron_S)[:, None], ks_K[None, :]
        if has_up:
            up_SxK = plgpu.load(up_ref.at[rows_SxK], mask=live_S[:, None] & k_ok_K[None, :],
                                other=0).astype(jnp.float32)
        if down:  # their W_down rows, in the same wave of loads as their up rows
            down_SxK = plgpu.load(down_ref.at[rows_SxK], mask=live_S[:, None] & k_ok_K[None, :],
                                  other=0).astype(jnp.float32)
        for r in range(min(m, block_m)):
            act_BN = jnp.sum(jnp.where((row_BM == r)[:, None], act_BMxBN, 0.0), axis=0)  # row r of relu(g)
            h_S = jnp.sum(jnp.where(pick_BNxS, act_BN[:, None], 0.0), axis=0)  # gathered into slot order
            if has_up:
                h_S = h_S * jnp.sum(up_SxK * xn_rows[r][None, :], axis=1)
            # Live slots only (the masked lanes' slots are distinct from them).
            plgpu.store(list_refs[3].at[row_first + r, slot_base + slots_S], h_S.astype(dt), mask=live_S)
            if down:  # the tile's partial down product of row r: sum over its neurons of round(h) * W_down
                # (dead slots add 0), accumulated over the steps in its own row of the partials
                part_K = jnp.sum(h_S.astype(dt).astype(jnp.float32)[:, None] * down_SxK, axis=0)
                at = list_refs[4].at[part_first + r, ks_K]
                part_K = part_K + plgpu.load(at, mask=jnp.broadcast_to(c > 0, ks_K.shape), other=0.0)
                plgpu.store(at, part_K)  # [T * M, next_pow2(K)]: no lane past its row
        return carry

    n_chunks = lax.div(n_active + jnp.int32(chunk - 1), jnp.int32(chunk)).astype(jnp.int32)
    lax.fori_loop(jnp.int32(0), n_chunks, chunk_step, jnp.int32(0))
    if not down:
        return
    # A tile without active neurons stores a zero partial: the sum reads every tile's without first
    # reading the counts (one dependent load fewer after the barrier).
    zeros_K, none_K = jnp.zeros(ks_K.shape, jnp.float32), jnp.broadcast_to(n_active == 0, ks_K.shape)
    for r in range(min(m, block_m)):
        plgpu.store(list_refs[4].at[part_first + r, ks_K], zeros_K, mask=none_K)
    if down != "barrier":
        return
    # Grid barrier (every program resident: `_grid_is_resident`): the CTA's stores done, one
    # arrival at this layer's counter (acquire-release, GPU scope), then a spin until every program
    # of this launch has arrived (the last to arrive does not wait); after it every tile's partials
    # are visible to every program. The counter starts at a multiple of the launch's programs and
    # ends at the next one, so launches one after another may share it (no reset between them).
    sync_ref = list_refs[-1]
    slot = layer if has_layer else jnp.int32(0)
    plgpu.debug_barrier()
    before = plgpu.atomic_add(sync_ref, (slot,), jnp.int32(1))
    target = (lax.div(before, jnp.int32(programs)) + 1) * programs
    lax.while_loop(lambda seen: seen < target,
                   lambda seen: plgpu.atomic_add(sync_ref, (slot,), jnp.int32(0)), before + 1)
    plgpu.debug_barrier()
    down_residual = down_res_ref if has_down_residual else None
    _sum_tile_partials(count_ref, list_refs[4], down_residual, list_refs[5], m=m, k=k, n_tiles=programs,
                       block=_sum_block(k, programs), limit=down_limit)


def _sum_block(k: int, programs: int) -> int:
    """Output columns per program of the partials' sum: a power of two >= 16, `programs` of them
    covering K (the programs past K's last block store nothing)."""
    return max(16, next_pow2(-(-k // programs)))


def _sum_tile_partials(count_ref, part_ref, res_ref, y_ref, *, m: int, k: int, n_tiles: int, block: int,
                       limit: int | None = None) -> None:
    """Inside a kernel, program j: y[:, cols] = round(residual + sum over the tiles of their partial
    down products) for columns [j*block, (j+1)*block) (fp32 sum over the tiles in one fixed order:
    deterministic). Refs: count [T] (read only with a limit), partials [T * M, >= K] fp32 (tile t's
    row r at t * M + r; zeros for a tile without active neurons), residual [M, K] or None, y [M, K].
    limit: a union (sum of the counts) above it reads no partial, y = the residual (or zeros): the
    sparse side of the device switch to the dense products."""
    lane_T = lax.broadcasted_iota(jnp.int32, (next_pow2(n_tiles),), 0)
    live_T = lane_T < n_tiles
    if limit is not None:
        count_T = plgpu.load(count_ref.at[jnp.minimum(lane_T, n_tiles - 1)], mask=live_T, other=0)
        live_T = live_T & (jnp.sum(count_T) <= limit)
    cols_B = pl.program_id(0) * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    col_ok_B = cols_B < k
    for r in range(m):
        part_TxB = plgpu.load(part_ref.at[(lane_T * m + r)[:, None], cols_B[None, :]],
                              mask=live_T[:, None] & col_ok_B[None, :], other=0.0)
        y_B = jnp.sum(part_TxB, axis=0)
        if res_ref is not None:
            y_B = y_B + plgpu.load(res_ref.at[r, cols_B], mask=col_ok_B, other=0).astype(jnp.float32)
        plgpu.store(y_ref.at[r, cols_B], y_B.astype(y_ref.dtype), mask=col_ok_B)


def _sum_partials_kernel(count_ref, part_ref, *refs, m: int, k: int, n_tiles: int, block: int,
                         has_residual: bool, limit: int | None) -> None:
    """The partials' sum as a launch of its own (the down product's second launch where no grid
    barrier runs: interpret mode, or more programs than the device holds at once)."""
    _sum_tile_partials(count_ref, part_ref, refs[0] if has_residual else None, refs[-1], m=m, k=k, n_tiles=n_tiles,
                       block=block, limit=limit)


def _check(x_MxK, w, layer, layout, norm_scale, gate, activation, residual, out_dtype,
           enable=None, block_n: int | None = None, split_k: int = 1, enable_above: int = 0) -> tuple[int, int, int]:
    """(N of one part, K, L) after raising ValueError naming the offending argument; `w` is one
    weight or a tuple of parts of one shape (their outputs side by side)."""
    parts = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    w = parts[0]
    if any(p.shape != w.shape or p.dtype != w.dtype for p in parts):
        raise ValueError(f"the parts of w must share one shape and dtype, got {[(p.dtype, p.shape) for p in parts]}")
    if len(parts) > 1 and gate is not None:
        raise ValueError("gate needs a single w (not parts)")
    if gate is not None and split_k > 1:
        raise ValueError("a gate cannot be used with MatvecBlockSizes.split_k > 1")
    if enable is not None and (enable.ndim != 1 or enable.shape[0] < 1 or enable.dtype != jnp.int32):
        raise ValueError(f"enable must be int32 [E] (E >= 1), got {enable.dtype}{enable.shape}")
    if isinstance(enable_above, bool) or not isinstance(enable_above, int) or enable_above < 0:
        raise ValueError(f"enable_above must be an int >= 0, got {enable_above!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x_MxK.ndim != 2 or x_MxK.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x_MxK must be float32 or bfloat16 [M, K], got {x_MxK.dtype}{x_MxK.shape}")
    stacked = layer is not None
    if w.ndim != (3 if stacked else 2) or w.dtype != x_MxK.dtype:
        want = "[L, N, K] / [L, K, N] with layer=" if stacked else "[N, K] / [K, N] without layer"
        raise ValueError(f"w must be {x_MxK.dtype} {want}, got {w.dtype}{w.shape}")
    n_layers = w.shape[0] if stacked else 1
    n, k = (w.shape[-2], w.shape[-1]) if layout == "nk" else (w.shape[-1], w.shape[-2])
    if k != x_MxK.shape[1]:
        raise ValueError(f"w {w.shape} ({layout}) has K={k} but x_MxK has K={x_MxK.shape[1]}")
    if stacked and (layer.shape != (1,) or layer.dtype != jnp.int32):
        raise ValueError(f"layer must be int32 [1], got {layer.dtype}{layer.shape}")
    if gate is not None and (gate.shape != w.shape or gate.dtype != w.dtype):
        raise ValueError(f"gate must be {w.dtype}{w.shape} like w, got {gate.dtype}{gate.shape}")
    if norm_scale is not None:
        want_scale = (n_layers, k) if stacked else (k,)
        if norm_scale.shape != want_scale or norm_scale.dtype != jnp.float32:
            raise ValueError(f"norm_scale must be float32 {want_scale}, got {norm_scale.dtype}{norm_scale.shape}")
    if len(parts) > 1 and block_n is not None and n % block_n:
        raise ValueError(f"parts of w need N={n} to be a multiple of block_n={block_n}")
    if residual is not None and residual.shape != (x_MxK.shape[0], n * len(parts)):
        raise ValueError(f"residual must be [M={x_MxK.shape[0]}, N={n * len(parts)}], got {residual.shape}")
    if out_dtype is not None and jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    return n, k, n_layers


@functools.partial(jax.jit, static_argnames=("layout", "activation", "eps", "out_dtype", "block_sizes",
                                             "tile_lists", "tile_values", "enable_above", "down_limit", "interpret",
                                             "debug"))
def decode_matvec(x_MxK: jax.Array, w: jax.Array | tuple[jax.Array, ...], *, layer: jax.Array | None = None,
                  layout: str = "nk", norm_scale: jax.Array | None = None, eps: float = 1e-6,
                  gate: jax.Array | None = None, activation: str | None = None,
                  residual: jax.Array | None = None, enable: jax.Array | None = None, enable_above: int = 0,
                  out_dtype=None, block_sizes: MatvecBlockSizes | None = None, tile_lists: bool = False,
                  tile_values: bool = False, up: jax.Array | None = None, down: jax.Array | None = None,
                  down_residual: jax.Array | None = None, down_limit: int | None = None,
                  sync: jax.Array | None = None, interpret: bool = False,
                  debug: bool = False) -> jax.Array | tuple[jax.Array, ...]:
    """[M, N] = residual + act(xn . gate) * (xn . w) (module docstring), each part optional;
    xn = RMSNorm(x) with `norm_scale` when given, else x. Output in `out_dtype` (default x's).
    `w` may be a tuple of equal-shaped parts (e.g. (w_q, w_k, w_v)): their outputs side by side,
    [M, parts * N], from one launch. `enable` (int32 [E]): the products run only when
    sum(enable) > `enable_above` (static, default 0: a flag [1] of 0 or 1), else the output is the
    residual, or zeros, and neither the weights nor x are read: a device-side switch, no host
    round trip (e.g. enable = a sparse gate's per-tile counts, enable_above = the union above
    which the dense products run).

    tile_lists=True (the sparse layers' gate in a decode step): returns (out [M, N], ids [T * bn]
    int32, count [T] int32, pairs [T] int32) for the T column programs (`MatvecBlockSizes.columns`:
    tile t = its W columns, W = block_n unless programs_n says fewer): tile t's neurons with
    out > 0 in ANY row (the union of the rows' active neurons) are ids[t*bn : t*bn + count[t]],
    ascending, the rest of its bn slots the lanes after them (ids clamped to N - 1); pairs[t] =
    the (row, neuron) pairs with out > 0. Packed in the product's
    epilogue, per tile (TwELL: no extra launch, no sync between programs); read by
    twell_decode.sparse_decode_ffn_tiles. Needs one row block (M <= the block sizes' max_block_m),
    one part, split_k 1, and no gate, activation, residual or enable.

    tile_values=True (with tile_lists; the sparse FFN's gate and up products in one launch): a fifth
    output, values [M, T * bn] in x's dtype, each listed neuron's hidden value at its id's slot,
    h = round(relu(out) * (xn . up[neuron])) with the up product in fp32 (`up`: the gated FFN's
    W_up, shaped as w, layout "nk"), or round(relu(out)) without `up`; the slots after count[t]
    are not written (no reader reads them). A tile with active neurons reads only their up rows,
    whole, `values_chunk(K)` at a time; its rows are an unrolled loop (M <= max_block_m), so it is
    meant for a few rows. Read by twell_decode.sparse_decode_down_tiles.

    down=W_down (with tile_values; shaped as w, a row per neuron): the down product in the same
    launch, a sixth output y [M, K] = round(down_residual + sum over the listed neurons j of
    values[:, slot(j)] . W_down[j]) in x's dtype: each tile adds its active neurons' W_down rows
    (read with their up rows) into an fp32 partial of its own, and the tiles' partials are summed
    in one fixed order (deterministic, no atomic sums) by every program for a block of y's columns
    after a grid barrier, where `sync` (the arrival counters: int32 [L] with `layer`, else [1], the
    layer's at a multiple of the launch's programs, e.g. zeros; each launch adds that many, so
    calls one after another may share them; returned as a seventh output, to pass to the next
    call) is given, the device is a GPU and every program of the launch is resident at once
    (`_grid_is_resident`); else by a second launch, and `sync` is returned as given. down_limit
    (static): a union (sum of count) above it reads no partial, y = down_residual (or zeros), the
    sparse side of a device switch to the dense products (`enable=count, enable_above=limit` on
    their launches). The sparse FFN of a decode step of a few rows in one launch ("packed_down")."""
    block_sizes = block_sizes or DEFAULT_BLOCK_SIZES
    n, k, n_layers = _check(x_MxK, w, layer, layout, norm_scale, gate, activation, residual, out_dtype,
                            enable, block_sizes.block_n, block_sizes.split_k, enable_above)
    parts = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    m = x_MxK.shape[0]
    # fp32 operands: the pipeline kept within the shared memory the (bf16-tuned) sizes take at bf16.
    block_sizes = block_sizes.fitted(m, jnp.dtype(parts[0].dtype).itemsize,
                                     len(parts) + (gate is not None))
    bm, bn, bk = block_sizes.block_m(m), block_sizes.block_n, block_sizes.block_k
    m_pad = round_up(m, bm)
    if block_sizes.programs_n and len(parts) > 1:
        raise ValueError(f"MatvecBlockSizes.programs_n={block_sizes.programs_n} needs one weight part (a "
                         f"program's columns in one part), got {len(parts)}")
    programs, width = block_sizes.columns(n * len(parts))
    if tile_lists:
        _check_tile_lists(m, bm, len(parts), gate, activation, residual, enable, block_sizes.split_k)
    if tile_values and not tile_lists:
        raise ValueError("tile_values needs tile_lists=True (the values are packed beside the tile lists' ids)")
    for name, rows in (("up", up), ("down", down)):
        if rows is not None and (not tile_values or rows.shape != parts[0].shape or rows.dtype != parts[0].dtype
                                 or layout != "nk"):
            raise ValueError(f"{name} must be {parts[0].dtype}{parts[0].shape} like w (layout 'nk': a row per "
                             f"neuron), with tile_values=True; got {rows.dtype}{rows.shape} with "
                             f"tile_values={tile_values}, layout {layout!r}")
    if down is None and (down_residual is not None or sync is not None or down_limit is not None):
        raise ValueError("down_residual, down_limit and sync belong to the down product: pass down=W_down")
    if down_limit is not None and (isinstance(down_limit, bool) or not isinstance(down_limit, int) or down_limit < 0):
        raise ValueError(f"down_limit must be an int >= 0 or None, got {down_limit!r}")
    if down_residual is not None and (down_residual.shape != (m, k) or down_residual.dtype != x_MxK.dtype):
        raise ValueError(f"down_residual must be {x_MxK.dtype}[M={m}, K={k}], got "
                         f"{down_residual.dtype}{down_residual.shape}")
    want_sync = (n_layers if layer is not None else 1,)
    if sync is not None and (sync.shape != want_sync or sync.dtype != jnp.int32):
        raise ValueError(f"sync must be int32 {want_sync} (one arrival counter per layer, e.g. zeros), got "
                         f"{sync.dtype}{sync.shape}")
    barrier = sync is not None and not interpret and _grid_is_resident(programs * (m_pad // bm))
    flat = (n_layers * parts[0].shape[-2], parts[0].shape[-1])  # [L*N, K] or [L*K, N]: a bitcast
    operands = (([layer] if layer is not None else []) + ([enable] if enable is not None else [])
                + [x_MxK] + [p.reshape(flat) for p in parts])
    if gate is not None:
        operands.append(gate.reshape(flat))
    if up is not None:
        operands.append(up.reshape(flat))
    if down is not None:
        operands.append(down.reshape(flat))
    if norm_scale is not None:
        operands.append(norm_scale.reshape(-1))
    if residual is not None:
        operands.append(residual)
    if down_residual is not None:
        operands.append(down_residual)
    if barrier:
        operands.append(sync)
    whole = [pl.BlockSpec(op.shape, lambda *_, nd=op.ndim: (0,) * nd) for op in operands]
    n_k, split = -(-k // bk), block_sizes.split_k
    kernel = functools.partial(
        _matvec_kernel, m=m, n=n, k=k, layout=layout, has_layer=layer is not None,
        has_norm=norm_scale is not None, has_gate=gate is not None, has_residual=residual is not None,
        has_enable=enable is not None, n_parts=len(parts), activation=activation, eps=float(eps), block_m=bm,
        block_n=bn, block_k=bk, n_k=n_k, precision=_dot_precision(x_MxK.dtype), split_k=split,
        n_k_split=-(-n_k // split), width=width, has_up=up is not None, enable_above=enable_above,
        down=None if down is None else "barrier" if barrier else "partials",
        has_down_residual=down_residual is not None, programs=programs * (m_pad // bm), down_limit=down_limit)
    n_out = n * len(parts)
    if split > 1:  # fp32 partials [S * m, n_out]: split s owns rows [s * m, (s + 1) * m)
        partials = pl.pallas_call(
            kernel,
            grid=(programs, m_pad // bm, split),
            in_specs=whole,
            out_specs=pl.BlockSpec((split * m, n_out), lambda j, i, s: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((split * m, n_out), jnp.float32),
            compiler_params=compiler_params(block_sizes),
            interpret=interpret,
            debug=debug,
            name="twell_decode_matvec_split",
        )(*operands)
        acc = jnp.sum(partials.reshape(split, m, n_out), axis=0)
        return _epilogue((acc,), x_MxK.dtype, activation, residual, out_dtype)
    out_specs = [pl.BlockSpec((m, n_out), lambda j, i: (0, 0))]
    out_shape = [jax.ShapeDtypeStruct((m, n_out), jnp.dtype(out_dtype or x_MxK.dtype))]
    whole_out = lambda shape, dtype: (pl.BlockSpec(shape, lambda j, i: (0,) * len(shape)),  # noqa: E731
                                      jax.ShapeDtypeStruct(shape, dtype))
    if tile_lists:  # ids [T * bn], count [T], pairs [T]: program j writes tile j's (count whole with down=)
        count_spec = pl.BlockSpec((1,), lambda j, i: (j,))
        if down is not None:
            count_spec = whole_out((programs,), jnp.int32)[0]
        out_specs += [pl.BlockSpec((bn,), lambda j, i: (j,)), count_spec, pl.BlockSpec((1,), lambda j, i: (j,))]
        out_shape += [jax.ShapeDtypeStruct((programs * bn,), jnp.int32)] + [
            jax.ShapeDtypeStruct((programs,), jnp.int32)] * 2
    extra = []  # (spec, shape) of each output after the lists, all whole
    if tile_values:  # values [M, T * bn] (program j stores its tile's slots, a masked row block)
        extra.append(whole_out((m, programs * bn), x_MxK.dtype))
    if down is not None:  # the down product's partials [T * M, next_pow2(K)] fp32 (tile t's rows at t * M)
        extra.append(whole_out((programs * m, next_pow2(k)), jnp.float32))
    if barrier:  # y [M, K] and the counters
        extra += [whole_out((m, k), x_MxK.dtype), whole_out(sync.shape, jnp.int32)]
    out_specs += [spec for spec, _ in extra]
    out_shape += [shape for _, shape in extra]
    outs = pl.pallas_call(
        functools.partial(kernel, tile_lists=tile_lists, tile_values=tile_values),
        grid=(programs, m_pad // bm),
        in_specs=whole,
        out_specs=out_specs,
        out_shape=out_shape,
        # The counters updated in place (their input is the last operand, their output the last)
        input_output_aliases={len(operands) - 1: len(out_shape) - 1} if barrier else {},
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name=("twell_decode_gate_down" if down is not None else "twell_decode_gate_values" if tile_values
              else "twell_decode_gate_lists") if tile_lists else "twell_decode_matvec",
    )(*operands)
    if not tile_lists:
        return outs[0]
    if down is None:
        return tuple(outs)
    if barrier:  # (out, ids, count, pairs, values, y, sync): the partials stay inside
        return tuple(outs[:5]) + tuple(outs[6:])
    block = _sum_block(k, 64)  # the partials' sum in a second launch: 64 programs
    sum_operands = [outs[2], outs[5]] + ([down_residual] if down_residual is not None else [])
    y = pl.pallas_call(
        functools.partial(_sum_partials_kernel, m=m, k=k, n_tiles=programs, block=block,
                          has_residual=down_residual is not None, limit=down_limit),
        grid=(-(-k // block),),
        in_specs=[pl.BlockSpec(a.shape, lambda j, nd=a.ndim: (0,) * nd) for a in sum_operands],
        out_specs=pl.BlockSpec((m, k), lambda j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, k), x_MxK.dtype),
        compiler_params=compiler_params(DEFAULT_BLOCK_SIZES),
        interpret=interpret,
        debug=debug,
        name="twell_decode_down_partials",
    )(*sum_operands)
    return tuple(outs[:5]) + (y,) + ((sync,) if sync is not None else ())


def _grid_is_resident(programs: int) -> bool:
    """Whether a launch of `programs` programs has every one resident at once on this process's
    device, so a grid barrier cannot wait on a program that never starts: a GPU with at least
    that many SMs (each SM holds at least one program of any launch; a kernel running beside it
    only delays the programs whose SMs it holds, as it ends on its own). Read at trace time."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and 0 < programs <= int(getattr(device, "core_count", 0) or 0)


def _check_tile_lists(m: int, block_m: int, n_parts: int, gate, activation, residual, enable, split_k: int) -> None:
    """Raise ValueError unless `decode_matvec(tile_lists=True)` can pack its tiles in one program each."""
    if m > block_m:
        raise ValueError(f"tile_lists needs every row in one program: M={m} > the block sizes' max_block_m "
                         f"({block_m})")
    unsupported = {"a tuple of parts for w": n_parts > 1, "gate": gate is not None, "activation": activation is not None,
                   "residual": residual is not None, "enable": enable is not None, "split_k > 1": split_k > 1}
    named = [what for what, given in unsupported.items() if given]
    if named:
        raise ValueError(f"tile_lists cannot be combined with {', '.join(named)}")


def tile_lists_reference(out_MxN: jax.Array, tile: int, width: int | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_matvec(tile_lists=True)`'s (ids, count, pairs) from its output [M, N], in jnp: per
    tile of `width` columns (default `tile`: MatvecBlockSizes.columns) in `tile` slots, the stable
    partition of the neurons with out > 0 in any row."""
    m, n = out_MxN.shape
    width = width or tile
    n_tiles = -(-n // width)
    on_MxTxW = jnp.pad(out_MxN > 0, ((0, 0), (0, n_tiles * width - n))).reshape(m, n_tiles, width)
    on_MxTxS = jnp.pad(on_MxTxW, ((0, 0), (0, 0), (0, tile - width)))  # lanes past the width: off
    active_TxS = jnp.any(on_MxTxS, axis=0)
    # Stable sort on "inactive": the active lanes first, each group in lane order.
    perm_TxS = jnp.argsort(~active_TxS, axis=1, stable=True).astype(jnp.int32)
    ids = jnp.minimum(perm_TxS + jnp.arange(n_tiles, dtype=jnp.int32)[:, None] * width, n - 1)
    return (ids.reshape(-1), jnp.sum(active_TxS, axis=1, dtype=jnp.int32),
            jnp.sum(on_MxTxS, axis=(0, 2), dtype=jnp.int32))


def tile_values_reference(out_MxN: jax.Array, ids: jax.Array, count: jax.Array, xn_MxK: jax.Array,
                          up_NxK: jax.Array | None) -> jax.Array:
    """`decode_matvec(tile_lists=True, tile_values=True)`'s values [M, T * S] in jnp, from its output
    out [M, N] and lists (ids [T * S], count [T]): at a listed slot, round(relu(out[:, id]) *
    (xn . up[id])) with the product in fp32 (or round(relu(out[:, id])) without up_NxK); 0 after a
    tile's count (slots the kernel does not write). xn_MxK: x as the kernel reads it (normalised
    when it has a norm prologue), in the values' dtype; up_NxK: one layer's W_up ([N, K], "nk")."""
    n_tiles = count.shape[0]
    tile = ids.shape[0] // n_tiles
    live = (jnp.arange(ids.shape[0]) % tile) < jnp.repeat(count, tile)
    act = jnp.maximum(jnp.take(out_MxN.astype(jnp.float32), ids, axis=1), 0.0)
    if up_NxK is not None:
        act = act * jnp.einsum("mk,sk->ms", xn_MxK.astype(jnp.float32), jnp.take(up_NxK, ids, axis=0).astype(jnp.float32),
                               precision=lax.Precision.HIGHEST)
    return jnp.where(live[None, :], act, 0.0).astype(xn_MxK.dtype)


def _epilogue(accs: tuple[jax.Array, ...], dt, activation: str | None, residual: jax.Array | None,
              out_dtype) -> jax.Array:
    """The output from the fp32 products (u,) or (u, g): with a gate, the dense formula
    act(round(g)) * round(u) rounded once; else round(u), through the activation (rounded) when
    one is given; then + residual, in `out_dtype` (default x's). One copy for the kernel, the split
    path's XLA finish and the reference."""
    out = accs[0].astype(dt).astype(jnp.float32)
    if len(accs) > 1:
        out = (_act(accs[1].astype(dt).astype(jnp.float32), activation) * out).astype(dt).astype(jnp.float32)
    elif activation is not None:
        out = _act(out, activation).astype(dt).astype(jnp.float32)
    if residual is not None:
        out = out + residual.astype(jnp.float32)
    return out.astype(jnp.dtype(out_dtype or dt))


def decode_matvec_reference(x_MxK: jax.Array, w: jax.Array, *, layer: jax.Array | None = None,
                            layout: str = "nk", norm_scale: jax.Array | None = None, eps: float = 1e-6,
                            gate: jax.Array | None = None, activation: str | None = None,
                            residual: jax.Array | None = None, enable: jax.Array | None = None,
                            enable_above: int = 0, out_dtype=None) -> jax.Array:
    """The same in jnp, with the model's roundings (the kernel's oracle)."""
    _check(x_MxK, w, layer, layout, norm_scale, gate, activation, residual, out_dtype, enable,
           enable_above=enable_above)
    if isinstance(w, (tuple, list)):
        return jnp.concatenate([decode_matvec_reference(
            x_MxK, p, layer=layer, layout=layout, norm_scale=norm_scale, eps=eps, activation=activation,
            residual=None if residual is None else jnp.split(residual, len(w), axis=1)[i], enable=enable,
            enable_above=enable_above, out_dtype=out_dtype) for i, p in enumerate(w)], axis=1)
    dt = x_MxK.dtype
    if layer is not None:
        w = w[layer[0]]
        gate = None if gate is None else gate[layer[0]]
        norm_scale = None if norm_scale is None else norm_scale[layer[0]]
    x = x_MxK
    if norm_scale is not None:
        x32 = x.astype(jnp.float32)
        x = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * norm_scale).astype(dt)

    def mm(weight: jax.Array) -> jax.Array:
        spec = "mk,nk->mn" if layout == "nk" else "mk,kn->mn"
        product = jnp.einsum(spec, x, weight, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
        return product if enable is None else jnp.where(jnp.sum(enable) > enable_above, product, 0.0)

    accs = (mm(w),) if gate is None else (mm(w), mm(gate))
    return _epilogue(accs, dt, activation, residual, out_dtype)
