"""Training glue of the Pallas kernels: the op-level sparse backward and the training "auto" choice.

The backward of gated_ffn / ffn (the formulas: docs/kernels.md, "Backward") over the hybrid ELL +
dense-tail format (docs/format.md):

    pattern      the forward's TwELL pack of relu(x W_act^T) (kept as a residual, or recomputed by
                 pack_gate when BackwardConfig.keep_gate_pattern is False)
    token tail   rows with an overflowing tile or more than config.ell_width actives (dense first
                 tokens): exact dense backward on those rows, gathered into a static block
    token-major  pallas_kernels.twell_bwd_token: dx of the other rows, and per entry (t, dr, dg)
                 in a token-major ELL [M, W] with the neuron ids
    transpose    XLA stable sort of the ELL entries by neuron id (first version, see below) ->
                 CSR lists (start, count per neuron; tokens ascending inside a neuron)
    neuron tail  "hot" neurons (more than config.transpose_ell_width entries): their weight
                 gradients by dense GEMMs, their columns recomputed [M, C] at a time (rows
                 outside the token tail)
    neuron-major pallas_kernels.twell_bwd_neuron: dW_down, dW_up, dW_gate of the other neurons,
                 starting from the tails' f32 contributions so every gradient is rounded once

Tails are sized on the device with no host sync: the tail rows (neurons) are listed by a
static-size `nonzero` and processed in fixed-size chunks (BackwardConfig.*_tail_chunk) by a loop
whose trip count is the device-side count, so no tail costs nothing, the first token of each
sequence costs one chunk, and the temporary memory is one chunk's whatever the count. Beyond the
config's capacities (tail_capacity(M), transpose_tail_capacity(H)) the exact dense backward runs
for the call (`lax.cond`). Deterministic: fixed reduction orders, a stable sort, scatters to
unique positions, no atomics.

Transpose: a counting sort (histogram, prefix sum, rank scatter) is the natural algorithm, but the
rank of an entry among the entries of its neuron needs either a sort or atomics; this first
version uses XLA's stable sort of M * W int32 keys, and the per-neuron offsets by a binary
search in the sorted keys (no histogram atomics). Not measured against a Pallas counting sort.

Training "auto" (`choose_training_path`): per layer, from the layer's expected active count and
the cost table below, which of the four whole plans (forward and backward each dense or sparse)
runs. No host sync: a static choice at trace time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import next_pow2
from pallas_kernels.twell_bwd_neuron import NeuronBwdBlockSizes, neuron_backward
from pallas_kernels.twell_bwd_token import TokenBwdBlockSizes, token_backward
from pallas_kernels.twell_pack import pack_gate
from twell_jax import ops
from twell_jax.ops import pallas_forward

Weights = tuple[jax.Array, ...]
Pack = tuple[jax.Array, jax.Array, jax.Array]  # (values [M,NT,S], indices [M,NT,S], counts [M,NT])
Aux = dict[str, jax.Array]

# The token tail's GEMMs (dense_rows_backward): tensor cores. Their fp32 operands are either bf16
# values widened (exact in TF32) or fp32 intermediates (dt, dR, dG), which TF32 rounds to 11 bits,
# finer than the bf16 that XLA's dense backward rounds them to. HIGHEST (exact fp32) made a 64-row
# block 0.62 ms on a trained 0.5b, DEFAULT 0.30 ms (BENCHMARKS.md). On the CPU DEFAULT is exact fp32.
# (The hot-neuron tail uses x's dtype directly: hot_neuron_backward.)
_TAIL_PRECISION = lax.Precision.DEFAULT


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Static knobs of the Pallas backward (SparseFFNConfig.backward)."""

    # Keep the forward's TwELL pack for the backward (M * NT * S * (itemsize + 4) bytes: 69 MB at
    # M 16384, H 5632, S 32, bf16) instead of re-running the gate GEMM + pack in the backward
    # (0.72 ms on the H100 at that shape). Measured equal on the H100 at k 29 (fwd+bwd 4.36 ms kept,
    # 4.32 ms recomputed: BENCHMARKS.md), so False saves the memory at no measured cost.
    keep_gate_pattern: bool = True
    # Token-tail rows (an overflowing tile or > ell_width actives) per dense block: the tail runs
    # ceil(rows / chunk) blocks of [chunk, H] (the first tokens of 8 sequences: one block).
    token_tail_chunk: int = 64
    # Hot neurons per dense block of the neuron tail ([M, chunk] columns by GEMMs with x and gy).
    # 256: each block reads x and gy whole, so larger blocks read them fewer times (a trained 0.5b
    # on the H100: 0.47-0.55 ms for 118-243 hot neurons against 0.55-1.02 ms with 64; BENCHMARKS.md).
    neuron_tail_chunk: int = 256
    # Block sizes of the token-major kernel (pallas_kernels.twell_bwd_token).
    token_block_sizes: TokenBwdBlockSizes = TokenBwdBlockSizes()
    # Block sizes of the neuron-major kernel (pallas_kernels.twell_bwd_neuron).
    neuron_block_sizes: NeuronBwdBlockSizes = NeuronBwdBlockSizes()

    def __post_init__(self) -> None:
        if not isinstance(self.keep_gate_pattern, bool):
            raise ValueError(f"BackwardConfig.keep_gate_pattern must be a bool, got {self.keep_gate_pattern!r}")
        for name in ("token_tail_chunk", "neuron_tail_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BackwardConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.token_block_sizes, TokenBwdBlockSizes):
            raise ValueError("BackwardConfig.token_block_sizes must be a TokenBwdBlockSizes, got "
                             f"{type(self.token_block_sizes).__name__}")
        if not isinstance(self.neuron_block_sizes, NeuronBwdBlockSizes):
            raise ValueError("BackwardConfig.neuron_block_sizes must be a NeuronBwdBlockSizes, got "
                             f"{type(self.neuron_block_sizes).__name__}")


# ----------------------------------------------------------------------------------------------
# Cost model of the training step's FFN pieces, for "auto". ONE TABLE, fitted on the H100 (below);
# the forward's constants are pallas_forward's (fitted on an H200, checked on the H100).
# Times in ms; k = active per token.
#   dense backward  = DENSE_LAUNCH_MS + n_bwd_gemms * 2 M D H / DENSE_FLOPS_PER_MS     (6 gated, 4)
#   sparse backward = BWD_FIXED_MS
#                     + M * (TOKEN_MS_PER_TOKEN + k * n_tok_rows * D * b / TOKEN_BYTES_PER_MS)  token-major
#                     + M * W * SORT_MS_PER_SLOT                                               transpose
#                     + H * NEURON_MS_PER_NEURON + M * k * 2 * D * b / NEURON_BYTES_PER_MS     neuron-major
#                     + (pack time, when the pattern is recomputed)
# n_tok_rows = rows gathered per entry by the token-major kernel: 3 (W, U, G) gated, 2 (W, U).
# Fitted on an H100 on 2026-11-22 (BENCHMARKS.md, `bench_ffn_train.py --quick`, M 16384, D 2048,
# H 5632, bf16): the Pallas backward took 2.82 ms at k = 29 and 5.1 ms at k = 56 (fwd+bwd minus
# the forward), i.e. ~0.37 ms fixed + 0.084 ms per active neuron per token: both gather passes
# at an effective ~4 TB/s; XLA's dense backward (6 GEMMs) took 2.46 ms.
# ----------------------------------------------------------------------------------------------
COST_TABLE = dict(
    BWD_FIXED_MS=0.15,
    TOKEN_MS_PER_TOKEN=5.0e-6,
    TOKEN_BYTES_PER_MS=4.0e9,
    SORT_MS_PER_SLOT=5.0e-8,
    NEURON_MS_PER_NEURON=7.0e-6,
    NEURON_BYTES_PER_MS=4.0e9,
    DENSE_BWD_FLOPS_PER_MS=9.2e11,
)
# A plan with a sparse piece is chosen only when its modelled time is at most SAFETY x the dense
# plan's: with model errors up to 1/SAFETY - 1 - 2% (8.9%) the step stays >= 0.98x dense, and
# otherwise the chosen plan IS the dense program (1.00x by construction).
SAFETY = 0.9


def dense_times_ms(m: int, d: int, h: int, gated: bool) -> tuple[float, float]:
    """Modelled (forward, backward) ms of the dense FFN with bf16 operands."""
    flops = 2.0 * m * d * h
    fwd = pallas_forward.DENSE_LAUNCH_MS + (3 if gated else 2) * flops / pallas_forward.DENSE_FLOPS_PER_MS
    bwd = pallas_forward.DENSE_LAUNCH_MS + (6 if gated else 4) * flops / COST_TABLE["DENSE_BWD_FLOPS_PER_MS"]
    return fwd, bwd


def sparse_times_ms(m: int, d: int, h: int, k: float, gated: bool, *, itemsize: int = 2,
                    ell_width: int = 128, keep_pattern: bool = True) -> tuple[float, float]:
    """Modelled (forward, backward) ms of the sparse FFN (pack + fused FFN; Pallas backward)."""
    c = COST_TABLE
    pb = pallas_forward
    pack_ms = 2.0 * m * d * h / pb.PACK_FLOPS_PER_MS
    n_rows = 2 if gated else 1
    fwd = (pb.SPARSE_FIXED_MS + pack_ms + m * pb.FFN_TOKEN_MS * n_rows / 2
           + m * k * n_rows * d * itemsize / pb.FFN_BYTES_PER_MS)
    width = next_pow2(ell_width)  # the token-major ELL's width (pallas_kernels.twell_bwd_token)
    bwd = (c["BWD_FIXED_MS"]
           + m * (c["TOKEN_MS_PER_TOKEN"] + k * (n_rows + 1) * d * itemsize / c["TOKEN_BYTES_PER_MS"])
           + m * width * c["SORT_MS_PER_SLOT"]
           + h * c["NEURON_MS_PER_NEURON"] + m * k * 2 * d * itemsize / c["NEURON_BYTES_PER_MS"]
           + (0.0 if keep_pattern else pack_ms))
    return fwd, bwd


def choose_training_path(m: int, d: int, h: int, expected_active: float, gated: bool, *,
                         itemsize: int = 2, ell_width: int = 128,
                         keep_pattern: bool = True) -> tuple[bool, bool]:
    """(forward sparse?, backward sparse?) for one layer from its expected active count per token.

    The four plans are compared whole, because the pieces are not independent: a dense backward
    after a sparse forward runs inside the op's custom_vjp and recomputes the pre-activations (2
    GEMMs gated, 1 not) that plain autodiff of the dense plan keeps; a sparse backward after a
    dense forward recomputes the pattern (the pack). A plan with a sparse piece wins only if its
    modelled time is <= SAFETY x the dense plan's; otherwise the dense plan runs."""
    if isinstance(expected_active, bool) or not expected_active >= 0:
        raise ValueError(f"expected_active must be a number >= 0, got {expected_active!r}")
    dense_fwd, dense_bwd = dense_times_ms(m, d, h, gated)
    recompute = (2.0 if gated else 1.0) / (3.0 if gated else 2.0) * dense_fwd
    sparse_fwd, sparse_bwd_kept = sparse_times_ms(m, d, h, expected_active, gated, itemsize=itemsize,
                                                  ell_width=ell_width, keep_pattern=keep_pattern)
    _, sparse_bwd_repacked = sparse_times_ms(m, d, h, expected_active, gated, itemsize=itemsize,
                                             ell_width=ell_width, keep_pattern=False)
    plans = {
        (True, True): sparse_fwd + sparse_bwd_kept,
        (True, False): sparse_fwd + dense_bwd + recompute,
        (False, True): dense_fwd + sparse_bwd_repacked,
    }
    best = min(plans, key=plans.get)
    return best if plans[best] <= SAFETY * (dense_fwd + dense_bwd) else (False, False)


# ----------------------------------------------------------------------------------------------
# Forward with the residual the backward wants
# ----------------------------------------------------------------------------------------------

def _split(gated: bool, weights: Weights) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(w_act, w_up or None, w_down): w_act is the weight whose relu gives the pattern."""
    return (weights[0], weights[1], weights[2]) if gated else (weights[0], None, weights[1])


def token_tail_mask(counts_MxNT: jax.Array, slots: int, ell_width: int) -> jax.Array:
    """bool [M]: rows the backward handles densely (an overflowing tile: the pack is incomplete;
    or more than ell_width actives: the token-major ELL cannot hold them)."""
    return (jnp.any(counts_MxNT > slots, axis=1)
            | (jnp.sum(counts_MxNT, axis=1) > ell_width))


def forward(gated: bool, forward_kind: str, x_MxD: jax.Array, weights: Weights, config: ops.SparseFFNConfig,
            interpret: bool) -> tuple[jax.Array, Aux, Pack | None]:
    """The training forward: (y, aux, the pack kept for the backward or None).

    forward_kind "pallas": pack + fused FFN (pallas_forward); "dense": the dense formula (the
    training "auto" when only the backward is sparse). aux["dense_fallback"] also reports a
    backward that will fall back because its token tail exceeds the capacity."""
    pallas_forward._require_runnable(interpret)
    w_act, w_up, w_down = _split(gated, weights)
    m = x_MxD.shape[0]
    s = pallas_forward._settings(config, m)
    if forward_kind == "dense" or m == 0:
        y, aux = ops.dense_fallback_ffn(gated, x_MxD, weights, neuron_counts=s["neuron_counts"])
        return y, aux, None
    if forward_kind != "pallas":
        raise ValueError(f"forward_kind must be 'pallas' or 'dense', got {forward_kind!r}")
    pack = pack_gate(x_MxD, w_act, tile=s["tile"], slots=s["slots"],
                     block_sizes=s["pack_block_sizes"], interpret=interpret)
    y, aux = pallas_forward._sparse_forward(x_MxD, w_act, w_up, w_down, s, interpret, pack=pack)
    n_tail = jnp.sum(token_tail_mask(pack[2], s["slots"], config.ell_width), dtype=jnp.int32)
    aux = dict(aux)
    aux["dense_fallback"] = jnp.maximum(aux["dense_fallback"],
                                        (n_tail > config.tail_capacity(m)).astype(jnp.int32))
    return y, aux, pack if (config.backward or BackwardConfig()).keep_gate_pattern else None


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def _chunked(mask_N: jax.Array, capacity: int, chunk: int, body: Callable[[jax.Array, Any], Any],
             carry: Any) -> Any:
    """Run body(ids_C, carry) over the True positions of mask_N (ascending, at most `capacity`),
    `chunk` at a time; ids past the last are len(mask_N) (callers drop them). The trip count is
    the device-side count: no host sync, nothing runs when the mask is empty."""
    n = mask_N.shape[0]
    padded = max(chunk, -(-capacity // chunk) * chunk)
    ids_P = jnp.nonzero(mask_N, size=padded, fill_value=n)[0].astype(jnp.int32)
    n_chunks = (jnp.minimum(jnp.sum(mask_N, dtype=jnp.int32), capacity) + chunk - 1) // chunk

    def step(c, carry):
        return body(lax.dynamic_slice(ids_P, (c * chunk,), (chunk,)), carry)

    return lax.fori_loop(0, n_chunks, step, carry)


def dense_rows_backward(gated: bool, x_RxD: jax.Array, gy_RxD: jax.Array, weights: Weights,
                        l1_scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Exact dense backward restricted to some rows (zero rows contribute nothing):
    (dx [R, D] f32, f32 weight-gradient contributions in weight order)."""
    w_act, w_up, w_down = _split(gated, weights)
    x32, gy32 = x_RxD.astype(jnp.float32), gy_RxD.astype(jnp.float32)

    def mm_t(a, w):  # a @ w.T
        return jnp.einsum("rd,hd->rh", a, w.astype(jnp.float32), precision=_TAIL_PRECISION)

    def mm(a, w):  # a @ w
        return jnp.einsum("rh,hd->rd", a, w.astype(jnp.float32), precision=_TAIL_PRECISION)

    def outer(a, b):  # a.T @ b
        return jnp.einsum("rh,rd->hd", a, b, precision=_TAIL_PRECISION)

    g = mm_t(x32, w_act)
    p = jax.nn.relu(g)
    on = g > 0
    if gated:
        u = mm_t(x32, w_up)
        h = (p * u).astype(x_RxD.dtype).astype(jnp.float32)
    else:
        h = p.astype(x_RxD.dtype).astype(jnp.float32)
    dt = mm_t(gy32, w_down) + l1_scale * jnp.sign(h)
    if gated:
        d_up = jnp.where(on, dt * p, 0.0)
        d_gate = jnp.where(on, dt * u, 0.0)
        dx = mm(d_up, w_up) + mm(d_gate, w_act)
        return dx, (outer(d_gate, x32), outer(d_up, x32), outer(h, gy32))
    d_act = jnp.where(on, dt, 0.0)
    return mm(d_act, w_act), (outer(d_act, x32), outer(h, gy32))


def token_tail_backward(gated: bool, x_MxD: jax.Array, gy_MxD: jax.Array, weights: Weights,
                        l1_scale: jax.Array, tail_M: jax.Array, capacity: int, chunk: int,
                        carry: tuple[jax.Array, tuple[jax.Array, ...]]
                        ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The dense token tail: the exact backward of the rows in tail_M (at most `capacity`, `chunk`
    rows per dense block). carry = (dx [M, D], f32 weight-gradient accumulators [H, D] in weight
    order): the tail rows' dx rows are set, their weight-gradient contributions added."""
    m = x_MxD.shape[0]

    def chunk_step(rows_C: jax.Array, carry):
        dx, inits = carry
        used_C = (rows_C < m)[:, None]
        safe_C = jnp.minimum(rows_C, m - 1)
        x_CxD = jnp.where(used_C, x_MxD[safe_C], 0)  # zero rows contribute nothing
        gy_CxD = jnp.where(used_C, gy_MxD[safe_C], 0)
        dx_CxD, contribs = dense_rows_backward(gated, x_CxD, gy_CxD, weights, l1_scale)
        return (dx.at[rows_C].set(dx_CxD.astype(dx.dtype), mode="drop"),
                tuple(a + b for a, b in zip(inits, contribs)))

    return _chunked(tail_M, capacity, chunk, chunk_step, carry)


def hot_neuron_backward(gated: bool, x_MxD: jax.Array, gy_MxD: jax.Array, weights: Weights,
                        l1_scale: jax.Array, tail_M: jax.Array, hot_H: jax.Array, capacity: int,
                        chunk: int, inits: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The dense neuron tail: the weight gradients of the hot neurons (hot_H, at most `capacity`,
    `chunk` per block) over the rows NOT in the token tail (tail_M: those rows' contributions come
    from `token_tail_backward`), added to the f32 accumulators `inits` [H, D] (weight order).

    Each block recomputes its neurons' columns with dense GEMMs, [M, chunk] at a time (g, u and
    dt = gy . W_j + l1 term, then dW_j = t^T gY, dU_j = dR^T X, dG_j = dG^T X): the dense formula
    restricted to those columns. Hot neurons fire on hundreds to thousands of tokens, so their
    columns are dense enough for GEMMs; building them from the ELL entries instead took a scatter
    per value array and block (0.33-0.65 ms a block on a trained 0.5b, BENCHMARKS.md).
    Operands in x's dtype with fp32 accumulation, like XLA's dense backward: the GEMMs are skinny
    ([M, D] x [D, chunk]) and read x and gy whole, so fp32 copies of them would double the bytes.
    The per-column values (dR, dG, t) are rounded to x's dtype for the weight-gradient GEMMs, as
    the dense backward rounds them. The columns' pattern is g > 0 of this GEMM, not the pack's
    (the kernels' fp32 sums in another order): the two can differ only where g rounds to about 0,
    where the dense backward is as ambiguous."""
    h = hot_H.shape[0]
    w_act, w_up, w_down = _split(gated, weights)
    dtype, f32 = x_MxD.dtype, jnp.float32
    keep_M1 = ~tail_M[:, None]

    def columns(w_HxD: jax.Array, ids_C: jax.Array, src_MxD: jax.Array) -> jax.Array:
        return jnp.einsum("md,cd->mc", src_MxD, w_HxD[ids_C].astype(dtype), preferred_element_type=f32)

    def chunk_step(hot_C: jax.Array, inits):
        used_C = hot_C < h  # padding ids (= H) read row H - 1 and contribute nothing
        safe_C = jnp.minimum(hot_C, h - 1)
        g_MxC = columns(w_act, safe_C, x_MxD)
        on_MxC = (g_MxC > 0) & keep_M1 & used_C[None, :]
        p_MxC = jnp.where(on_MxC, g_MxC, 0.0)
        if gated:
            u_MxC = columns(w_up, safe_C, x_MxD)
            h_MxC = (p_MxC * u_MxC).astype(dtype).astype(f32)
        else:
            h_MxC = p_MxC.astype(dtype).astype(f32)
        dt_MxC = jnp.where(on_MxC, columns(w_down, safe_C, gy_MxD) + l1_scale * jnp.sign(h_MxC), 0.0)
        if gated:
            pieces = ((dt_MxC * u_MxC, x_MxD), (dt_MxC * p_MxC, x_MxD), (h_MxC, gy_MxD))  # dG, dU, dW
        else:
            pieces = ((dt_MxC, x_MxD), (h_MxC, gy_MxD))
        return tuple(init.at[hot_C].add(jnp.einsum("mc,md->cd", v.astype(dtype), src, preferred_element_type=f32),
                                        mode="drop")
                     for init, (v, src) in zip(inits, pieces))

    return _chunked(hot_H, capacity, chunk, chunk_step, inits)


def neuron_major_lists(cols_MxW: jax.Array, valid_MxW: jax.Array, entries: tuple[jax.Array, ...],
                       n_neurons: int) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """Transpose of a token-major ELL to neuron-major CSR lists: (start [H], count [H], tokens [E],
    values [E] per entry array), E = M * W, entries of neuron j at [start_j, start_j + count_j) in
    ascending token order. A stable sort by neuron id (invalid slots get id H and sort last);
    the offsets by a binary search in the sorted ids. Deterministic, no atomics."""
    width = cols_MxW.shape[1]
    key_E = jnp.where(valid_MxW, cols_MxW, n_neurons).reshape(-1)
    sorted_key_E, perm_E = lax.sort((key_E, jnp.arange(key_E.shape[0], dtype=jnp.int32)),
                                    num_keys=1, is_stable=True)
    bounds_H1 = jnp.searchsorted(sorted_key_E, jnp.arange(n_neurons + 1, dtype=jnp.int32),
                                 side="left").astype(jnp.int32)
    return (bounds_H1[:-1], bounds_H1[1:] - bounds_H1[:-1], perm_E // width,
            tuple(v.reshape(-1)[perm_E] for v in entries))


def backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array, gl1: jax.Array,
             config: ops.SparseFFNConfig, interpret: bool, pack: Pack | None,
             dense_backward: Callable[[], tuple[jax.Array, Weights]]) -> tuple[jax.Array, Weights]:
    """Gradients of <gy, y> + gl1 * l1 (module doc). `pack` = the forward's pack or None
    (recomputed); `dense_backward()` = the op's exact dense backward, run when a tail capacity is
    exceeded. Returns (dx in x's dtype, weight gradients in weight order and dtype)."""
    pallas_forward._require_runnable(interpret)
    bc = config.backward or BackwardConfig()
    w_act, w_up, w_down = _split(gated, weights)
    m, d = x_MxD.shape
    h = w_act.shape[0]
    if m == 0:
        return dense_backward()
    slots = config.slots
    if pack is None:
        pack = pack_gate(x_MxD, w_act, tile=config.tile, slots=slots,
                         block_sizes=config.pack_block_sizes or pallas_forward.PackBlockSizes(),
                         interpret=interpret)
    values, indices, counts = pack
    gy_MxD = gy_MxD.astype(x_MxD.dtype)
    l1_scale = gl1.astype(jnp.float32) / m
    tail_M = token_tail_mask(counts, slots, config.ell_width)
    n_tail = jnp.sum(tail_M, dtype=jnp.int32)
    token_cap = config.tail_capacity(m)
    hot_cap = config.transpose_tail_capacity(h)

    def sparse() -> tuple[jax.Array, Weights]:
        kernel_counts = jnp.where(tail_M[:, None], 0, counts)
        dx_MxD, cols_MxW, entries = token_backward(
            x_MxD, gy_MxD, values, indices, kernel_counts, w_act, w_up, w_down, l1_scale,
            width=config.ell_width, block_sizes=bc.token_block_sizes, interpret=interpret)
        nnz_M = jnp.where(tail_M, 0, jnp.sum(jnp.minimum(counts, slots), axis=1))
        valid_MxW = jnp.arange(cols_MxW.shape[1], dtype=jnp.int32)[None, :] < nnz_M[:, None]
        start_H, count_H, tokens_E, values_E = neuron_major_lists(cols_MxW, valid_MxW, entries, h)
        hot_H = count_H > config.transpose_ell_width
        n_hot = jnp.sum(hot_H, dtype=jnp.int32)
        kernel_count_H = jnp.where(hot_H, 0, count_H)

        def no_tails() -> tuple[jax.Array, Weights]:
            grads = neuron_backward(x_MxD, gy_MxD, start_H, kernel_count_H, tokens_E, values_E,
                                    block_sizes=bc.neuron_block_sizes, interpret=interpret)
            return dx_MxD, grads

        def with_tails() -> tuple[jax.Array, Weights]:
            zeros = tuple(jnp.zeros((h, d), jnp.float32) for _ in weights)
            dx_tail, inits = token_tail_backward(gated, x_MxD, gy_MxD, weights, l1_scale, tail_M, token_cap,
                                                 bc.token_tail_chunk, (dx_MxD, zeros))
            inits = hot_neuron_backward(gated, x_MxD, gy_MxD, weights, l1_scale, tail_M, hot_H, hot_cap,
                                        bc.neuron_tail_chunk, inits)
            grads = neuron_backward(x_MxD, gy_MxD, start_H, kernel_count_H, tokens_E, values_E,
                                    inits, block_sizes=bc.neuron_block_sizes, interpret=interpret)
            return dx_tail, grads

        def finish() -> tuple[jax.Array, Weights]:
            return lax.cond((n_tail > 0) | (n_hot > 0), with_tails, no_tails)

        return lax.cond(n_hot > hot_cap, dense_backward, finish)

    dx, grads = lax.cond(n_tail > token_cap, dense_backward, sparse)
    return dx.astype(x_MxD.dtype), tuple(g.astype(w.dtype) for g, w in zip(grads, weights))
