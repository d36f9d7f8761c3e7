"""The sparse FFN op: public functions, backend dispatch, custom_vjp.

CONTRACT (other modules rely on it; keep it stable):

    gated_ffn(x, w_gate, w_up, w_down, *, backend="auto", config=None, interpret=False) -> (y, aux)
        y = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down
    ffn(x, w_up, w_down, *, backend="auto", config=None, interpret=False) -> (y, aux)
        y = relu(x @ w_up.T) @ w_down

    x: [..., D]; every weight is neuron-major [H, D]; all the same float dtype (f32 or bf16).
    y: same shape and dtype as x.
    aux: dict of scalars
        "l1": f32, mean over tokens of sum over neurons of |h| (differentiable: add lambda*l1 to the loss)
        "l0": f32, mean number of active neurons per token
        "tile_overflow": int32, (row, tile) pairs whose non-zeros exceed the TwELL slots
        "row_overflow": int32, rows whose non-zeros exceed the ELL width (sent to the dense tail)
        "dense_fallback": int32, 1 if the call fell back to the exact dense path (tail capacity exceeded)
    backend: "dense" | "reference" | "pallas" | "auto"

This file is a placeholder contract with the dense backend only; the sparse backends land next.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("dense", "reference", "pallas", "auto")
AUX_KEYS = ("l1", "l0", "tile_overflow", "row_overflow", "dense_fallback")


def _dense_aux(h: jax.Array, active: jax.Array) -> dict[str, jax.Array]:
    tokens = max(1, h.size // h.shape[-1])
    zero = jnp.zeros((), jnp.int32)
    return {
        "l1": jnp.sum(jnp.abs(h.astype(jnp.float32))) / tokens,
        "l0": jnp.sum(active.astype(jnp.float32)) / tokens,
        "tile_overflow": zero,
        "row_overflow": zero,
        "dense_fallback": zero,
    }


def gated_ffn(x, w_gate, w_up, w_down, *, backend="auto", config=None, interpret=False):
    g = jnp.einsum("...d,hd->...h", x, w_gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("...d,hd->...h", x, w_up, preferred_element_type=jnp.float32)
    p = jax.nn.relu(g)
    h = (p * u).astype(x.dtype)
    y = jnp.einsum("...h,hd->...d", h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)
    return y, _dense_aux(h, g > 0)


def ffn(x, w_up, w_down, *, backend="auto", config=None, interpret=False):
    u = jnp.einsum("...d,hd->...h", x, w_up, preferred_element_type=jnp.float32)
    h = jax.nn.relu(u).astype(x.dtype)
    y = jnp.einsum("...h,hd->...d", h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)
    return y, _dense_aux(h, u > 0)
