"""The sparse backward's tail rule, in one place (`TailPolicy`).

The backward's hybrids (docs/format.md) send to dense "tails" what their ELL parts cannot hold:

    token tail   a token with more than `ell_width` actives (or, in the Pallas pack, an overflowing
                 TwELL tile: its stored slots are incomplete); its rows run the exact dense backward
    hot neurons  a neuron with more than `hot_threshold(M)` entries over the call's M tokens; its
                 columns run dense GEMMs
    capacity     more token-tail rows than `tail_capacity(M)`, or more hot neurons than
                 `transpose_tail_capacity(H)`: the whole call's backward runs the dense formula

Users (each calls this object, none restates the rule):
    reference    `reference.reference_backward` / `reference_forward`'s aux: counts over the dense
                 activation (its transposed hybrid holds every row, so a neuron's count covers the
                 token tail too)
    Pallas       `pallas_backward`: counts from the TwELL pack; the neuron counts exclude the token
                 tail's rows (the kernels never see them)
    telemetry    `TailPolicy.shares`: estimates from the op's per-neuron and per-token counts, as
                 the SparseFFNConfig tail hints want them
    cost model   `TailPolicy.expected`: the tails the hints predict, for `planner`
The thresholds themselves are SparseFFNConfig fields (ell_width, transpose_ell_width, tail_rows,
transpose_tail_rows) resolved by its methods.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from twell_jax.ops.config import TAIL_SHARE_KEYS, SparseFFNConfig


@dataclasses.dataclass(frozen=True)
class TailPolicy:
    """The tail rule of one SparseFFNConfig (module doc)."""

    config: SparseFFNConfig

    def token_tail(self, active_M: jax.Array, tile_overflow_M: jax.Array | None = None) -> jax.Array:
        """bool [M]: tokens the backward handles densely: more than ell_width actives, or (with a
        TwELL pack) an overflowing tile."""
        tail_M = active_M > self.config.ell_width
        return tail_M if tile_overflow_M is None else tail_M | tile_overflow_M

    def pack_token_tail(self, counts_MxNT: jax.Array) -> jax.Array:
        """`token_tail` of a TwELL pack's counts [M, NT] (a tile count above `slots` overflows)."""
        return self.token_tail(jnp.sum(counts_MxNT, axis=1), jnp.any(counts_MxNT > self.config.slots, axis=1))

    def hot(self, entries_H: jax.Array, n_tokens: int) -> jax.Array:
        """bool [H]: neurons with more than hot_threshold(n_tokens) entries."""
        return entries_H > self.config.hot_threshold(n_tokens)

    def over_capacity(self, n_tail: jax.Array, n_hot: jax.Array, n_tokens: int, n_neurons: int) -> jax.Array:
        """bool scalar: a tail exceeds its capacity (the backward then runs the dense formula)."""
        return ((n_tail > self.config.tail_capacity(n_tokens))
                | (n_hot > self.config.transpose_tail_capacity(n_neurons)))

    def token_hybrid(self, n_tokens: int) -> dict[str, int]:
        """The token-major hybrid's parameters (`hybrid.from_dense` / `from_twell`): a row with more
        than ell_width non-zeros goes to the tail, which holds tail_capacity(n_tokens) rows."""
        return dict(ell_width=self.config.ell_width, tail_capacity=self.config.tail_capacity(n_tokens))

    def neuron_hybrid(self, n_tokens: int, n_neurons: int) -> dict[str, int]:
        """The neuron-major (transposed) hybrids' parameters (`hybrid.transpose_many`): a hot
        neuron goes to the tail, which holds transpose_tail_capacity(n_neurons) neurons."""
        return dict(ell_width=self.config.hot_threshold(n_tokens),
                    tail_capacity=self.config.transpose_tail_capacity(n_neurons))

    def shares(self, token_active_count: jax.Array, neuron_active_count: jax.Array,
               n_shards: int = 1) -> dict[str, jax.Array]:
        """Telemetry estimates of the tails as the config's tail hints want them (f32 scalars under
        TAIL_SHARE_KEYS): "token_tail_share" tokens over ell_width / tokens (a token whose tile
        overflows with fewer actives is not counted: rare, slots >= 32); "hot_neuron_share" hot
        neurons / H, M = the tokens per data shard and a neuron's per-shard count estimated as its
        count / n_shards; "hot_entry_share" the hot neurons' entries / all entries (0 with none)."""
        n_tokens = math.prod(token_active_count.shape)
        counts_H = neuron_active_count.astype(jnp.float32)
        hot_H = self.hot(counts_H / n_shards, -(-n_tokens // n_shards))
        entries = jnp.sum(counts_H)
        shares = (jnp.mean(self.token_tail(token_active_count).astype(jnp.float32)),
                  jnp.mean(hot_H.astype(jnp.float32)),
                  jnp.where(entries > 0, jnp.sum(jnp.where(hot_H, counts_H, 0.0)) / jnp.maximum(entries, 1.0),
                            0.0))
        return dict(zip(TAIL_SHARE_KEYS, shares))

    def expected(self, n_tokens: int, n_neurons: int) -> tuple[float, float, float, bool]:
        """(token-tail rows, hot neurons, share of the entries on hot neurons, over capacity?) that
        the config's tail hints (expected_token_tail, expected_hot_neurons, expected_hot_entries)
        predict for a call of n_tokens tokens and n_neurons neurons; zeros without hints."""
        c = self.config
        rows = (c.expected_token_tail or 0.0) * n_tokens
        neurons = (c.expected_hot_neurons or 0.0) * n_neurons
        over = rows > c.tail_capacity(n_tokens) or neurons > c.transpose_tail_capacity(n_neurons)
        return rows, neurons, float(c.expected_hot_entries or 0.0), over
