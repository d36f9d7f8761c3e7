"""The sparse algorithm in pure JAX (the "reference" backend, the oracle of the kernels): TwELL
pack of the gate, hybrid ELL + dense tail, SDDMM / SpMM forward and the sparse hybrid backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from twell_jax.ops import format as twell_format
from twell_jax.ops import hybrid
from twell_jax.ops.config import Aux, SparseFFNConfig, Weights
from twell_jax.ops.dense import dense_backward, dense_ffn
from twell_jax.ops.implementation import Implementation, runs_anywhere
from twell_jax.ops.tails import TailPolicy

_HIGHEST = jax.lax.Precision.HIGHEST


def _activation(gated: bool, x_MxD: jax.Array, weights: Weights) -> jax.Array:
    """f32 [M, H]: relu of the gate (gated) or up (non-gated) pre-activation; its non-zeros are
    the pattern."""
    return jax.nn.relu(jnp.einsum("md,hd->mh", x_MxD, weights[0], preferred_element_type=jnp.float32,
                                  precision=_HIGHEST))


def _backward_tails(act_MxH: jax.Array, config: SparseFFNConfig) -> tuple[jax.Array, jax.Array]:
    """(token-tail rows, hot neurons) of the backward's hybrids, int32, by the tail rule
    (`TailPolicy`) on the activation's counts: a neuron's entries over every row, as the transposed
    hybrid (`hybrid.transpose_many`, which holds the token tail too) counts them."""
    active = act_MxH != 0
    policy = TailPolicy(config)
    return (jnp.sum(policy.token_tail(jnp.sum(active, axis=1)), dtype=jnp.int32),
            jnp.sum(policy.hot(jnp.sum(active, axis=0), act_MxH.shape[0]), dtype=jnp.int32))


def _needs_dense_backward(act_MxH: jax.Array, config: SparseFFNConfig,
                          tails: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """bool scalar: the backward's hybrids would exceed a tail capacity (`tails`: the
    `_backward_tails` of act_MxH when the caller has them)."""
    token_tail, neuron_tail = _backward_tails(act_MxH, config) if tails is None else tails
    return TailPolicy(config).over_capacity(token_tail, neuron_tail, *act_MxH.shape)


def reference_forward(gated: bool, x_MxD: jax.Array, weights: Weights,
                      config: SparseFFNConfig) -> tuple[jax.Array, Aux]:
    """Sparse forward in pure JAX: TwELL pack -> hybrid P -> SDDMM (up) -> SpMM (down)."""
    n_tokens = x_MxD.shape[0]
    act_MxH = _activation(gated, x_MxD, weights)
    packed = twell_format.pack(act_MxH, tile=config.tile, slots=config.slots)
    # Rows with an overflowing tile are recomputed exactly into the tail; here the dense
    # activation already exists, so recomputing is a row gather (a kernel pipeline would redo
    # relu(x[rows] @ W^T) for those rows only).
    pattern = hybrid.from_twell(packed, **TailPolicy(config).token_hybrid(n_tokens),
                                recompute_rows=lambda rows: act_MxH[rows])

    def sparse_branch() -> tuple[jax.Array, jax.Array]:
        if gated:
            up = hybrid.sddmm(x_MxD, weights[1], pattern)
            h = hybrid.map_values(lambda p, u: (p * u).astype(x_MxD.dtype), pattern, up)
        else:
            h = hybrid.map_values(lambda p: p.astype(x_MxD.dtype), pattern)
        y = hybrid.spmm(h, weights[-1]).astype(x_MxD.dtype)
        return y, hybrid.sum_values(h, jnp.abs) / n_tokens

    def dense_branch() -> tuple[jax.Array, jax.Array]:
        y, aux = dense_ffn(gated, x_MxD, weights)
        return y, aux["l1"]

    forward_fallback = pattern.tail_overflow > 0
    y, l1 = jax.lax.cond(forward_fallback, dense_branch, sparse_branch)
    tails = _backward_tails(act_MxH, config)
    fallback = forward_fallback | _needs_dense_backward(act_MxH, config, tails)
    aux = {
        "l1": l1,
        "l0": jnp.sum(pattern.row_nnz, dtype=jnp.float32) / n_tokens,
        "tile_overflow": twell_format.overflow_count(packed),
        "row_overflow": jnp.sum(pattern.row_nnz > config.ell_width, dtype=jnp.int32),
        "dense_fallback": fallback.astype(jnp.int32),
    }
    aux["backward_tail_rows"], aux["backward_hot_neurons"] = tails
    if config.neuron_counts:
        aux["neuron_active_count"] = jnp.sum(act_MxH > 0, axis=0, dtype=jnp.int32)
        aux["token_active_count"] = pattern.row_nnz.astype(jnp.int32)
    return y, aux


def reference_backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array,
                       gl1: jax.Array, config: SparseFFNConfig) -> tuple[jax.Array, Weights]:
    """Gradients of <gy, y> + gl1 * l1 on the hybrid format (docs/format.md), recomputing the
    pattern from (x, weights). Falls back to the dense backward when a tail would overflow."""
    n_tokens, n_neurons = x_MxD.shape[0], weights[0].shape[0]
    act_MxH = _activation(gated, x_MxD, weights)

    def sparse_branch() -> tuple[jax.Array, Weights]:
        policy = TailPolicy(config)
        p = hybrid.from_dense(act_MxH, **policy.token_hybrid(n_tokens))
        w_down = weights[-1]
        # dt = gY . W_j on the pattern, plus the L1 term: d(gl1 * sum|t| / M)/dt = gl1/M * sign(t).
        dt_raw = hybrid.sddmm(gy_MxD, w_down, p)
        if gated:
            w_gate, w_up, _ = weights
            up = hybrid.sddmm(x_MxD, w_up, p)
            h = hybrid.map_values(lambda a, u: (a * u).astype(x_MxD.dtype), p, up)
        else:
            (w_up, _) = weights
            h = hybrid.map_values(lambda a: a.astype(x_MxD.dtype), p)
        scale = gl1.astype(jnp.float32) / n_tokens
        dt = hybrid.map_values(lambda d, t: d + scale * jnp.sign(t.astype(jnp.float32)), dt_raw, h)
        transposed = policy.neuron_hybrid(n_tokens, n_neurons)
        if gated:
            # relu' = 1 exactly on the pattern, so dg (pre-activation) = dt * u there.
            d_up = hybrid.map_values(lambda d, a: d * a, dt, p)
            d_gate = hybrid.map_values(lambda d, u: d * u, dt, up)
            dx = hybrid.spmm(d_up, w_up) + hybrid.spmm(d_gate, w_gate)
            h_t, d_up_t, d_gate_t = hybrid.transpose_many([h, d_up, d_gate], **transposed)
            grads = (hybrid.spmm(d_gate_t, x_MxD), hybrid.spmm(d_up_t, x_MxD), hybrid.spmm(h_t, gy_MxD))
        else:
            dx = hybrid.spmm(dt, w_up)
            h_t, dt_t = hybrid.transpose_many([h, dt], **transposed)
            grads = (hybrid.spmm(dt_t, x_MxD), hybrid.spmm(h_t, gy_MxD))
        return dx.astype(x_MxD.dtype), tuple(g.astype(w.dtype) for g, w in zip(grads, weights))

    def dense_branch() -> tuple[jax.Array, Weights]:
        return dense_backward(gated, x_MxD, weights, gy_MxD, gl1)

    return jax.lax.cond(_needs_dense_backward(act_MxH, config), dense_branch, sparse_branch)


def _forward(gated: bool, x_MxD: jax.Array, weights: Weights, config: SparseFFNConfig, interpret: bool,
             keep: bool) -> tuple[jax.Array, Aux, None]:
    y, aux = reference_forward(gated, x_MxD, weights, config)
    return y, aux, None


def _backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array, gl1: jax.Array,
              config: SparseFFNConfig, interpret: bool, residual: None,
              non_finite: jax.Array | None) -> tuple[jax.Array, Weights]:
    """`reference_backward`, or the dense backward on a non-finite input (the NaN policy)."""
    def sparse() -> tuple[jax.Array, Weights]:
        return reference_backward(gated, x_MxD, weights, gy_MxD, gl1, config)

    if non_finite is None:  # config.check_finite off: no cond in the program
        return sparse()
    return jax.lax.cond(non_finite, lambda: dense_backward(gated, x_MxD, weights, gy_MxD, gl1), sparse)


REFERENCE = Implementation("reference", _forward, _backward, runs_anywhere, reports_tails=True)
