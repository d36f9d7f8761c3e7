"""Training objective: next-token cross-entropy plus the L1 penalty on FFN hidden activations.

loss = CE + lambda(step) * mean over layers of aux["l1"], where aux["l1"] is the op's per-layer
mean over tokens of sum over neurons of |h| (docs/training.md, "L1 penalty"). lambda ramps linearly from 0 between
`l1_warmup_start` and `l1_warmup_end` (docs/training.md, "L1 warm-up") when that window is non-empty.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from twell_jax.config import SparsityConfig


def l1_coefficient(cfg: SparsityConfig, step: jax.Array) -> jax.Array:
    """lambda at optimizer step `step` (0-based): 0 until start, linear ramp, then cfg.l1_coef."""
    coef = jnp.float32(cfg.l1_coef)
    start, end = cfg.l1_warmup_start, cfg.l1_warmup_end
    if end <= start:
        return jnp.where(step >= start, coef, 0.0) if start > 0 else coef
    ramp = jnp.clip((step.astype(jnp.float32) - start) / (end - start), 0.0, 1.0)
    return coef * ramp


def cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean CE over tokens, summed CE) in fp32."""
    ce_BxS = optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV.astype(jnp.float32), targets_BxS)
    return jnp.mean(ce_BxS), jnp.sum(ce_BxS)


def total_loss(ce: jax.Array, l1_per_layer_L: jax.Array, l1_coef: jax.Array) -> jax.Array:
    """CE + lambda * mean over layers of the per-layer L1 (the gradient each layer sees is lambda/L)."""
    return ce + l1_coef * jnp.mean(l1_per_layer_L)
