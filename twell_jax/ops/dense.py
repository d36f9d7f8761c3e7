"""The dense formula of the FFN and its aux: the ONE copy, used by the "dense" backend, every
fallback and fix-up of the sparse paths, the Pallas glue's dense branch and the model's dense kinds."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from twell_jax.ops import planner
from twell_jax.ops.config import Aux, SparseFFNConfig, Weights
from twell_jax.ops.implementation import Implementation, runs_anywhere


def exact_precision(dtype) -> jax.lax.Precision | None:
    """The precision of the sparse paths' partial dense GEMMs (the token tails, the hot-neuron
    tail, the forward's recomputed rows): HIGHEST for f32 operands, whose default on a GPU is TF32
    (about 1e-3 relative, where the kernels' rows beside them are exact f32); the default
    otherwise (16-bit operands multiply exactly either way, so the program is unchanged). The
    dense formula as a whole (the "dense" backend, fallbacks, dense plans) keeps JAX's default,
    as plain JAX does."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _matmul_t(x: jax.Array, w_HxD: jax.Array, precision: jax.lax.Precision | None = None) -> jax.Array:
    """x @ w.T for x [..., D], in the operands' dtype. On a GPU the GEMM accumulates in f32 anyway;
    asking for an f32 output (preferred_element_type) would make the cotangent f32 and so the
    transposed GEMMs of the backward f32 x f32, about 2x slower for bf16 models."""
    return jnp.einsum("...d,hd->...h", x, w_HxD, precision=precision)


DENSE_ACTIVATIONS = ("relu", "silu")


def dense_hidden(gated: bool, x: jax.Array, weights: Weights, activation: str = "relu",
                 precision: jax.lax.Precision | None = None) -> tuple[jax.Array, jax.Array]:
    """(h [..., H] in x's dtype, active [..., H] bool) of the dense formula: the ONE copy, used by
    the "dense" backend, every fallback and fix-up, the Pallas glue's dense branch and the model's
    dense kinds (swiglu through activation="silu").

    The GEMM outputs stay in x's dtype (bf16 operands forward and backward); the gating product
    is formed in f32 and rounded once. `active` is the pattern: gate > 0 for relu (what every
    sparse backend packs), h != 0 for silu (never exactly sparse). `precision`: the GEMMs'
    (`exact_precision` where a sparse path computes some rows)."""
    if activation not in DENSE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {DENSE_ACTIVATIONS}, got {activation!r}")
    g = _matmul_t(x, weights[0], precision)
    act = jax.nn.relu if activation == "relu" else jax.nn.silu
    if gated:
        h = (act(g.astype(jnp.float32)) * _matmul_t(x, weights[1], precision).astype(jnp.float32)).astype(x.dtype)
    else:
        h = act(g.astype(jnp.float32)).astype(x.dtype)
    return h, (g > 0 if activation == "relu" else h != 0)


def dense_aux(h: jax.Array, active: jax.Array, neuron_counts: bool = False) -> Aux:
    """The op's aux of a dense evaluation: l1 from h (f32 accumulation over the x-dtype h, no f32
    copy of [M, H]), l0 and the optional counts from the `active` pattern."""
    tokens = max(1, h.size // max(1, h.shape[-1]))
    zero = jnp.zeros((), jnp.int32)
    aux = {"l1": jnp.sum(jnp.abs(h), dtype=jnp.float32) / tokens,
           "tile_overflow": zero, "row_overflow": zero, "dense_fallback": zero,
           "backward_tail_rows": zero, "backward_hot_neurons": zero}
    if neuron_counts:
        per_token = jnp.sum(active, axis=-1, dtype=jnp.int32)
        aux["token_active_count"] = per_token
        aux["neuron_active_count"] = jnp.sum(active.reshape(-1, active.shape[-1]), axis=0, dtype=jnp.int32)
        aux["l0"] = jnp.sum(per_token, dtype=jnp.float32) / tokens
    else:
        aux["l0"] = jnp.sum(active, dtype=jnp.float32) / tokens
    return aux


def dense_ffn(gated: bool, x: jax.Array, weights: Weights, *, neuron_counts: bool = False,
              activation: str = "relu") -> tuple[jax.Array, Aux]:
    """y and aux of the dense formula, differentiated by plain JAX autodiff (the "dense" backend);
    weights = (w_gate, w_up, w_down) gated, (w_up, w_down) non-gated, all neuron-major [H, D]."""
    h, active = dense_hidden(gated, x, weights, activation)
    y = jnp.einsum("...h,hd->...d", h, weights[-1])
    return y, dense_aux(h, active, neuron_counts)


def dense_fallback_ffn(gated: bool, x: jax.Array, weights: Weights, *,
                       neuron_counts: bool = False) -> tuple[jax.Array, Aux]:
    """`dense_ffn` with aux["dense_fallback"] = 1: what a sparse path returns when it runs the
    dense formula instead (a capacity exceeded, a non-finite input, or "auto" choosing dense)."""
    y, aux = dense_ffn(gated, x, weights, neuron_counts=neuron_counts)
    return y, {**aux, "dense_fallback": jnp.ones((), jnp.int32)}


def dense_backward(gated: bool, x: jax.Array, weights: Weights, gy: jax.Array,
                    gl1: jax.Array) -> tuple[jax.Array, Weights]:
    """Gradients of <gy, y> + gl1 * l1 by autodiff of the dense formula (gy in y's dtype, so every
    backward GEMM has x-dtype operands)."""
    def y_and_l1(x_, weights_):
        y, aux = dense_ffn(gated, x_, weights_)
        return y, aux["l1"]

    _, vjp = jax.vjp(y_and_l1, x, weights)
    return vjp((gy.astype(x.dtype), gl1.astype(jnp.float32)))


def _forward(gated: bool, x_MxD: jax.Array, weights: Weights, config: SparseFFNConfig, interpret: bool,
             keep: bool) -> tuple[jax.Array, Aux, None]:
    """The dense formula as a plan's forward (inside the op's custom_vjp: the backward recomputes)."""
    y, aux = dense_fallback_ffn(gated, x_MxD, weights, neuron_counts=config.neuron_counts)
    return y, aux, None


def _cost(shape: tuple[int, int, int, int], config: SparseFFNConfig, gated: bool) -> tuple[float, float]:
    m, d, h, _ = shape
    return planner.dense_times_ms(m, d, h, gated)


DENSE = Implementation("dense", _forward, None, runs_anywhere, cost=_cost, dense_formula=True)
