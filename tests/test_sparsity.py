"""Sparsity bookkeeping: L1 schedule, dead-neuron counters, position profile, dead-row re-init."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from twell_jax.config import ModelConfig, OptimConfig, SparsityConfig
from twell_jax.training.loss import l1_coefficient, total_loss
from twell_jax.model import init_model, split_model
from twell_jax.training.optimizer import build_optimizer
from twell_jax.training.sparsity import (COUNTER_CAP, dead_share, position_profile, reinit_dead_rows,
                                update_counters)


def test_l1_warmup_ramp():
    cfg = SparsityConfig(l1_coef=1e-3, l1_warmup_start=10, l1_warmup_end=20)
    values = [float(l1_coefficient(cfg, jnp.int32(s))) for s in (0, 10, 15, 20, 100)]
    np.testing.assert_allclose(values, [0.0, 0.0, 5e-4, 1e-3, 1e-3], rtol=1e-6)
    assert float(l1_coefficient(SparsityConfig(l1_coef=2e-5), jnp.int32(0))) == np.float32(2e-5)
    # loss = CE + lambda * mean over layers
    assert float(total_loss(jnp.float32(2.0), jnp.array([1.0, 3.0]), jnp.float32(0.5))) == 3.0


def test_counters_reset_age_and_saturate():
    since = jnp.array([[0, 5, COUNTER_CAP - 1]], jnp.int32)
    active = jnp.array([[0, 3, 0]], jnp.int32)
    out = update_counters(since, active, tokens=10)
    np.testing.assert_array_equal(out, [[10, 0, COUNTER_CAP]])
    np.testing.assert_allclose(dead_share(out, window_tokens=10), [2 / 3])


def test_position_profile_buckets():
    profile = jnp.arange(8, dtype=jnp.float32)[None, :]  # one layer, 8 positions
    np.testing.assert_allclose(position_profile(profile, 4), [[0.5, 2.5, 4.5, 6.5]])
    np.testing.assert_allclose(position_profile(profile[:, :3], 8), [[0.0, 1.0, 2.0]])  # more buckets than positions


def test_reinit_resets_exactly_the_dead_gate_rows_and_their_moments():
    cfg = ModelConfig(vocab_size=31, d_model=8, n_layers=2, n_heads=2, d_ff=13, max_seq_len=8,
                      compute_dtype="float32")
    _, params = split_model(init_model(cfg, seed=0))
    optimizer = build_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    _, opt_state = optimizer.update(grads, opt_state, params)  # non-zero moments everywhere
    since = jnp.zeros((2, 13), jnp.int32).at[0, 3].set(100).at[1, 0].set(100).at[1, 12].set(99)
    new_params, new_opt, new_since, count = reinit_dead_rows(
        params, opt_state, since, cfg=cfg, window_tokens=100, key=jax.random.key(7))
    assert int(count) == 2
    dead = {0: [3], 1: [0]}
    adam = new_opt[1][0]
    for layer in (0, 1):
        old_gate = np.asarray(params["blocks"]["ffn"]["w_gate"][layer])
        new_gate = np.asarray(new_params["blocks"]["ffn"]["w_gate"][layer])
        alive = np.setdiff1d(np.arange(13), dead[layer])
        np.testing.assert_array_equal(new_gate[alive], old_gate[alive])
        for row in dead[layer]:
            assert not np.allclose(new_gate[row], old_gate[row])
            assert np.all(np.abs(new_gate[row]) < 0.02 * 6)
        for moments in (adam.mu, adam.nu):
            gate_m = np.asarray(moments["blocks"]["ffn"]["w_gate"][layer])
            assert np.all(gate_m[dead[layer]] == 0) and np.all(gate_m[alive] != 0)
            assert np.all(np.asarray(moments["blocks"]["ffn"]["w_up"][layer]) != 0)  # other weights untouched
        np.testing.assert_array_equal(new_params["blocks"]["ffn"]["w_up"][layer],
                                      params["blocks"]["ffn"]["w_up"][layer])
    np.testing.assert_array_equal(new_since, jnp.zeros((2, 13), jnp.int32).at[1, 12].set(99))
    assert int(new_opt[1][0].count) == int(opt_state[1][0].count)
