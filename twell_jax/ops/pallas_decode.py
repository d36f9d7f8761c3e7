"""Decode-size forward of the sparse FFN op (1 to a few hundred tokens per call).

    g = x W_gate^T                      XLA (a memory-bound GEMV at decode sizes: reads W_gate once)
    union of the active neurons         any(g > 0) over the call's tokens, compacted on the device
                                        into a stable, deterministic list (prefix sum)
    h, y over the active neurons        pallas_kernels.twell_decode (implementation="triton") or row
                                        gathers + small XLA dots (implementation="xla")

Each active neuron's U and W rows are read once per call, whatever the number of tokens, and the
work is spread over the active neurons instead of one program per token (pallas_forward's fused
kernel), which puts a one-token call on one SM. Rounding: h is rounded once to the activation
dtype and y accumulated in fp32, like the dense formula, but g and u stay fp32 here while the dense
formula rounds its GEMM outputs to x's dtype first; so in bf16 y differs from the dense backend by
rounding (the tests bound it: tests/test_pallas_decode.py, TOL_DENSE).

Exactness: the active list has a static capacity C (`config.decode_capacity`; None: every neuron
for "triton", whose kernels skip the unused part of the list at run time, and
min(H, max(64, 2 M k)) for "xla", which gathers all C rows). When a call has more than C active
neurons a `lax.cond` runs the op's dense formula (`ops.dense_ffn`), and aux["dense_fallback"] = 1.
When C covers H no cond is built (a cond may cost a host round trip).

Aux (the op's contract): l1 and l0 exact; tile_overflow = row_overflow = 0 (no packed format here);
dense_fallback = 1 when the capacity was exceeded; with config.neuron_counts the per-neuron and
per-token counts, from the gate this path computes anyway.

Config: a `twell_jax.ops.SparseFFNConfig` (validated there) or None for its defaults; the glue
reads decode_capacity, decode_block_sizes (None: DecodeBlockSizes()) and expected_active_per_token
(only to size the "xla" default capacity).

"auto" plans this path where `planner.prefer_decode_path` (its cost model, beside the others in
twell_jax/ops/planner.py) predicts it beats the dense FFN (docs/kernels.md, "Decode path").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from twell_jax.pallas_kernels.twell_decode import (DecodeBlockSizes, compact_active, compact_active_reference,
                                         sparse_decode_ffn, sparse_decode_ffn_reference)
from twell_jax.ops.config import SparseFFNConfig
from twell_jax.ops.dense import dense_ffn
from twell_jax.ops.pallas_forward import require_runnable, validate_operands, weight_tuple

# The kernels the decode path runs: "triton" (pallas_kernels.twell_decode: what the op plans) or
# "xla" (row gathers and small XLA dots: a comparison for experiments/bench_ffn_decode.py).
DECODE_KERNELS = ("triton", "xla")

Aux = dict[str, jax.Array]


def _capacity(config: SparseFFNConfig, m: int, h: int, block_sizes: DecodeBlockSizes,
              implementation: str) -> int:
    """Static length of the active list (a multiple of block_sizes.chunk)."""
    capacity = config.decode_capacity
    if capacity is None:
        if implementation == "triton":
            capacity = h
        else:
            per_token = config.expected_active_per_token
            capacity = int(max(64, 2 * m * (32 if per_token is None else per_token)))
    chunk = block_sizes.chunk
    return -(-min(capacity, h) // chunk) * chunk


def _decode_forward(x_MxD: jax.Array, w_act_HxD: jax.Array, w_up_HxD: jax.Array | None,
                    w_down_HxD: jax.Array, config: SparseFFNConfig, implementation: str,
                    interpret: bool) -> tuple[jax.Array, Aux]:
    m = x_MxD.shape[0]
    h = w_act_HxD.shape[0]
    gated = w_up_HxD is not None
    weights = weight_tuple(w_act_HxD, w_up_HxD, w_down_HxD)
    if m == 0:  # nothing to compact: the dense formula (aux all zero, dense_fallback 0)
        return dense_ffn(gated, x_MxD, weights, neuron_counts=config.neuron_counts)
    zero = jnp.zeros((), jnp.int32)
    block_sizes = config.decode_block_sizes or DecodeBlockSizes()
    capacity = _capacity(config, m, h, block_sizes, implementation)
    # f32 gate: its sign is the dense formula's pattern (rounding g to x's dtype keeps the sign).
    g_MxH = jnp.einsum("md,hd->mh", x_MxD, w_act_HxD, preferred_element_type=jnp.float32)
    # Tokens on which each neuron fires: non-zero = in the union; one reduction gives l0 too.
    active_MxH = g_MxH > 0
    count_H = jnp.sum(active_MxH, axis=0, dtype=jnp.int32)
    l0 = jnp.sum(count_H, dtype=jnp.float32) / m
    if implementation == "triton":
        order_L, n_active = compact_active(count_H, interpret=interpret)
    else:
        order_L, n_active = compact_active_reference(count_H)
    if capacity > order_L.shape[0]:  # tiny H: the list is shorter than one kernel chunk
        order_L = jnp.pad(order_L, (0, capacity - order_L.shape[0]), constant_values=h - 1)

    def sparse() -> tuple[jax.Array, jax.Array]:
        if implementation == "triton":
            h_MxC, y_MxD = sparse_decode_ffn(x_MxD, g_MxH, order_L, n_active, w_up_HxD, w_down_HxD,
                                             capacity=capacity, block_sizes=block_sizes,
                                             interpret=interpret)
        else:
            h_MxC, y_MxD = sparse_decode_ffn_reference(x_MxD, g_MxH, order_L, n_active, w_up_HxD,
                                                       w_down_HxD, capacity=capacity,
                                                       precision=lax.Precision.DEFAULT)
        return y_MxD, jnp.sum(jnp.abs(h_MxC.astype(jnp.float32))) / m

    def dense() -> tuple[jax.Array, jax.Array]:  # the op's dense formula (recomputes the gate)
        y_MxD, aux = dense_ffn(gated, x_MxD, weights)
        return y_MxD, aux["l1"]

    if capacity >= h:  # every neuron fits: no overflow is possible, no cond
        overflow = jnp.zeros((), jnp.bool_)
        y_MxD, l1 = sparse()
    else:
        overflow = n_active[0] > capacity
        y_MxD, l1 = lax.cond(overflow, dense, sparse)
    aux = {"l1": l1, "l0": l0, "tile_overflow": zero, "row_overflow": zero,
           "dense_fallback": overflow.astype(jnp.int32), "backward_tail_rows": zero,
           "backward_hot_neurons": zero}
    if config.neuron_counts:  # from the gate computed anyway: no second gate GEMM
        aux["neuron_active_count"] = count_H
        aux["token_active_count"] = jnp.sum(active_MxH, axis=1, dtype=jnp.int32)
    return y_MxD, aux


def _entry(x_MxD: jax.Array, weights: dict[str, jax.Array], config: SparseFFNConfig | None,
           implementation: str, interpret: bool) -> tuple[jax.Array, Aux]:
    if config is None:
        config = SparseFFNConfig()
    elif not isinstance(config, SparseFFNConfig):
        raise ValueError(f"config must be a twell_jax.ops.SparseFFNConfig or None, got {type(config).__name__}")
    if implementation not in DECODE_KERNELS:
        raise ValueError(f"implementation must be one of {DECODE_KERNELS}, got {implementation!r}")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if implementation == "triton":
        require_runnable(interpret)
    validate_operands(x_MxD, weights)
    w = list(weights.values())
    if len(w) == 2:
        w.insert(1, None)  # non-gated: no up projection beside the activation
    return _decode_forward(x_MxD, *w, config, implementation, interpret)


def decode_gated_ffn_forward(x_MxD: jax.Array, w_gate_HxD: jax.Array, w_up_HxD: jax.Array,
                             w_down_HxD: jax.Array, *, config: SparseFFNConfig | None = None,
                             implementation: str = "triton",
                             interpret: bool = False) -> tuple[jax.Array, Aux]:
    """y = (relu(x W_gate^T) * (x W_up^T)) W_down over the union of active neurons; (y, aux)."""
    return _entry(x_MxD, dict(w_gate_HxD=w_gate_HxD, w_up_HxD=w_up_HxD, w_down_HxD=w_down_HxD),
                  config, implementation, interpret)


def decode_ffn_forward(x_MxD: jax.Array, w_up_HxD: jax.Array, w_down_HxD: jax.Array, *,
                       config: SparseFFNConfig | None = None, implementation: str = "triton",
                       interpret: bool = False) -> tuple[jax.Array, Aux]:
    """y = relu(x W_up^T) W_down over the union of active neurons; (y, aux)."""
    return _entry(x_MxD, dict(w_up_HxD=w_up_HxD, w_down_HxD=w_down_HxD), config, implementation,
                  interpret)
