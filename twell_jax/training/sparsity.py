"""Sparsity telemetry (per-layer L0, dead neurons, position profile) and dead-row re-initialisation.

Dead-neuron tracking (docs/training.md, "Dead neurons"; on the device, no host syncs): the train state holds
`since_active` int32[L, H], per layer and neuron the number of tokens seen since the neuron last
fired (gate pre-activation > 0). After every micro-batch, neurons that fired at least once reset to
0 and the others grow by the micro-batch's token count (saturating at COUNTER_CAP so int32 never
wraps). A neuron is dead when its counter is >= the window (`sparsity.dead_window_tokens`, default one
optimizer step's tokens). Under `jax.jit` over a data-parallel mesh the activity counts are global
(GSPMD reduces them over the batch), so every device sees the same dead mask.

Re-initialisation rule [OURS] (docs/training.md; the reference code has none), applied after the optimizer
update every `sparsity.reinit_every` steps when `sparsity.reinit_dead`:
  for each layer and each neuron j with since_active[l, j] >= window:
    - re-sample row j of the gate weight (w_gate; w_up for the non-gated "relu" FFN) from
      N(0, init_std^2) with a key derived from (seed, step, layer);
    - zero row j of that weight's Adam first and second moments (so the stale moments do not
      immediately push the fresh row back);
    - reset since_active[l, j] to 0 (the neuron gets a full window to fire again).
  w_up / w_down rows are left alone.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from twell_jax.config import ModelConfig

COUNTER_CAP = 2**30  # saturation value of the "tokens since last active" counters


def init_counters(cfg: ModelConfig) -> jax.Array:
    """since_active counters int32[L, H], all 0 (every neuron starts alive)."""
    return jnp.zeros((cfg.n_layers, cfg.d_ff), jnp.int32)


def update_counters(since_LxH: jax.Array, active_count_LxH: jax.Array, tokens: int) -> jax.Array:
    """Reset neurons that fired in this micro-batch, age the others by `tokens` (saturating)."""
    aged = jnp.minimum(since_LxH, COUNTER_CAP - tokens) + tokens
    return jnp.where(active_count_LxH > 0, 0, aged).astype(jnp.int32)


def dead_mask(since_LxH: jax.Array, window_tokens: int) -> jax.Array:
    """bool[L, H]: neurons that have not fired for at least `window_tokens` tokens."""
    return since_LxH >= window_tokens


def dead_share(since_LxH: jax.Array, window_tokens: int) -> jax.Array:
    """f32[L]: fraction of each layer's neurons that are dead."""
    return jnp.mean(dead_mask(since_LxH, window_tokens).astype(jnp.float32), axis=-1)


def position_profile(position_active_LxS: jax.Array, buckets: int) -> jax.Array:
    """f32[L, buckets]: mean active neurons per token, averaged within equal position buckets.

    Positions are split as evenly as possible (bucket b covers [b*S/n, (b+1)*S/n)); with more
    buckets than positions, empty buckets are dropped (n = min(buckets, S)).
    """
    seq_len = position_active_LxS.shape[-1]
    n = min(buckets, seq_len)
    bucket_S = (jnp.arange(seq_len) * n) // seq_len
    one_hot_SxN = jax.nn.one_hot(bucket_S, n, dtype=jnp.float32)
    sums_LxN = position_active_LxS.astype(jnp.float32) @ one_hot_SxN
    return sums_LxN / jnp.sum(one_hot_SxN, axis=0)


def _map_adam_moments(opt_state: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` to the mu and nu trees of every ScaleByAdamState inside a (chained) optax state."""
    if isinstance(opt_state, optax.ScaleByAdamState):
        return opt_state._replace(mu=fn(opt_state.mu), nu=fn(opt_state.nu))
    if isinstance(opt_state, tuple):
        children = [_map_adam_moments(child, fn) for child in opt_state]
        return type(opt_state)(*children) if hasattr(opt_state, "_fields") else tuple(children)
    return opt_state


def reinit_dead_rows(
    params: dict[str, Any],
    opt_state: Any,
    since_LxH: jax.Array,
    *,
    cfg: ModelConfig,
    window_tokens: int,
    key: jax.Array,
) -> tuple[dict[str, Any], Any, jax.Array, jax.Array]:
    """Apply the re-initialisation rule of the module docstring.

    Returns (params, opt_state, since_active, number of re-initialised neurons).
    """
    from twell_jax.model import gate_key

    name = gate_key(cfg)
    dead_LxH = dead_mask(since_LxH, window_tokens)
    layer_keys = jax.random.split(key, cfg.n_layers)

    def with_rows(tree: dict[str, Any], rows_LxHxD: Callable[[jax.Array], jax.Array]) -> dict[str, Any]:
        # The blocks are stacked over layers (twell_jax.model): one where over [L, H, D].
        ffn = dict(tree["blocks"]["ffn"])
        w_LxHxD = ffn[name]
        ffn[name] = jnp.where(dead_LxH[:, :, None], rows_LxHxD(w_LxHxD), w_LxHxD)
        return {**tree, "blocks": {**tree["blocks"], "ffn": ffn}}

    def fresh(w_LxHxD: jax.Array) -> jax.Array:
        draw = jax.vmap(lambda k: jax.random.normal(k, w_LxHxD.shape[1:], jnp.float32))(layer_keys)
        return (cfg.init_std * draw).astype(w_LxHxD.dtype)

    new_params = with_rows(params, fresh)
    new_opt_state = _map_adam_moments(opt_state, lambda tree: with_rows(tree, jnp.zeros_like))
    new_since = jnp.where(dead_LxH, 0, since_LxH)
    return new_params, new_opt_state, new_since, jnp.sum(dead_LxH, dtype=jnp.int32)
