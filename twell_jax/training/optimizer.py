"""AdamW with global-norm clipping, no weight decay on norm scales, warm-up + cosine schedule."""
from __future__ import annotations

from typing import Any

import jax
import optax

from twell_jax.config import OptimConfig
from twell_jax.model import is_decayed


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up 0 -> lr over warmup_steps, then cosine to min_lr_ratio * lr at total_steps (or flat)."""
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(cfg.lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)], [warmup])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay (matrices, embedding), False for norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: is_decayed(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)), params)


def build_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optimizer of docs/training.md, "Optimizer" (clip 1.0, AdamW b=(0.9, 0.95), eps 1e-8, wd 0.1 without norms)."""
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
