"""Training objective: next-token cross-entropy plus the L1 penalty on FFN hidden activations.

loss = CE + lambda(step) * mean over layers of aux["l1"], where aux["l1"] is the op's per-layer
mean over tokens of sum over neurons of |h| (docs/training.md, "L1 penalty"). lambda ramps linearly from 0 between
`l1_warmup_start` and `l1_warmup_end` (docs/training.md, "L1 warm-up") when that window is non-empty.
With per-layer targets (`sparsity.target_active`) each layer's lambda is scaled by a factor the step
adapts (`adapt_l1_control`; docs/training.md, "Per-layer targets").
"""
from __future__ import annotations

import math

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
    """CE + lambda * mean over layers of the per-layer L1 (the gradient each layer sees is lambda/L).
    `l1_coef` may be per layer ([L]: `layer_l1_coefficients`): CE + mean over layers of lambda_l * l1_l."""
    if jnp.ndim(l1_coef) == 0:
        return ce + l1_coef * jnp.mean(l1_per_layer_L)
    return ce + jnp.mean(l1_coef * l1_per_layer_L)


# ---------------------------------------------------------------- per-layer targets (sparsity.target_active)
# The state of the adaptation (the train state's "l1_control"): "shape" f32[L], each layer's log-factor,
# mean 0 over the layers; "level" f32 scalar <= 0, the log-factor common to all layers. Layer l's
# coefficient is lambda(step) * exp(level + shape_l).
L1_CONTROL_SHAPE_LIMIT = math.log(64.0)  # a layer's factor stays within 1/64 .. 64 of the common level
L1_CONTROL_LEVEL_FLOOR = math.log(1e-4)  # the common level never lowers the schedule's lambda below 1e-4 x


def l1_control_init(n_layers: int) -> dict[str, jax.Array]:
    """Every factor 1: the run starts as one without targets."""
    return {"shape": jnp.zeros((n_layers,), jnp.float32), "level": jnp.zeros((), jnp.float32)}


def layer_l1_coefficients(l1_coef: jax.Array, control: dict[str, jax.Array]) -> jax.Array:
    """lambda_l = lambda * exp(level + shape_l): f32[L]."""
    return l1_coef * jnp.exp(control["level"] + control["shape"])


def moving_targets(cfg: SparsityConfig, d_ff: int, step: jax.Array) -> jax.Array:
    """The targets the adaptation holds the layers to at optimizer step `step`: f32[L].

    With `target_approach_steps` = N > 0 they move from d_ff / 2 (about a ReLU layer's activity at
    initialisation) to `target_active`, linearly in log(1 + active) over the N steps from
    `l1_warmup_start`: the level then lowers the penalty whenever the schedule would take the layers
    down faster than that. N = 0: the targets themselves from the first step."""
    target_L = jnp.asarray(cfg.target_active, jnp.float32)
    if not cfg.target_approach_steps:
        return target_L
    done = jnp.clip((step.astype(jnp.float32) - cfg.l1_warmup_start) / cfg.target_approach_steps, 0.0, 1.0)
    start = jnp.log1p(jnp.maximum(jnp.float32(d_ff / 2), target_L))
    return jnp.expm1(start + done * (jnp.log1p(target_L) - start))


def adapt_l1_control(control: dict[str, jax.Array], active_L: jax.Array, target_L: jax.Array,
                     rate: float) -> dict[str, jax.Array]:
    """One step of the adaptation, from the step's measured active neurons per token of each layer
    (`active_L`) against the targets. With e_l = log(1 + active_l) - log(1 + target_l), clipped to
    [-1, 1]:
    - shape: shape_l += rate * (e_l - mean(e)), then centred and clipped to +-log 64: a layer more
      active than the others relative to its target gets a larger share of the penalty. It acts
      from the first step, and being centred it cannot wind up while the schedule ramps lambda.
    - level: level += rate * mean(e), clipped to [log 1e-4, 0]: while the layers are above their
      targets on average it stays at 0 (the schedule's lambda as it is: no wind-up); once the
      schedule has brought them below, it lowers every layer's penalty to hold them there.
    A deterministic function of the step's metrics (the same on every process of a run)."""
    error_L = jnp.clip(jnp.log1p(active_L.astype(jnp.float32)) - jnp.log1p(target_L), -1.0, 1.0)
    mean_error = jnp.mean(error_L)
    shape_L = control["shape"] + rate * (error_L - mean_error)
    shape_L = jnp.clip(shape_L - jnp.mean(shape_L), -L1_CONTROL_SHAPE_LIMIT, L1_CONTROL_SHAPE_LIMIT)
    level = jnp.clip(control["level"] + rate * mean_error, L1_CONTROL_LEVEL_FLOOR, 0.0)
    return {"shape": shape_L, "level": level}
