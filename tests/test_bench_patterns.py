"""The trained-like synthetic pattern (twell_jax/bench/patterns.py) and the bounds of the pieces
(twell_jax/bench/bounds.py): the fit recovers the parameters a pattern was drawn with, the drawn
pattern has the asked mean, skew and position profile, the gather probe equals its reference."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.bench import bounds, patterns

SHAPE = patterns.PatternShape(neuron_sigma=1.0, dead_share=0.1, seq_len=64,
                              position_density=(6.0, 3.0, 2.0, 1.5, 1.2, 1.0, 0.9))


def test_position_buckets_double_from_the_first_token():
    assert patterns.position_buckets(64) == [0, 1, 2, 4, 8, 16, 32, 64]
    assert patterns.position_buckets(1) == [0, 1]
    assert patterns.position_buckets(48) == [0, 1, 2, 4, 8, 16, 32, 48]
    assert list(patterns.bucket_of_position(8)) == [0, 1, 2, 2, 3, 3, 3, 3]


def test_a_drawn_pattern_has_the_asked_mean_skew_and_profile_and_the_fit_recovers_them():
    m, d, h, k = 64 * 64, 64, 1024, 24.0
    xs, wg, wu, wd = patterns.shaped_inputs(jax.random.PRNGKey(3), m, k, SHAPE, d, h, jnp.float32, n_sets=1)
    assert xs[0].shape == (m, d) and wg.shape == wu.shape == wd.shape == (h, d)
    active_M, neuron_H = patterns.exact_activity(xs[0], wg)
    assert active_M.mean() == pytest.approx(k, rel=0.1)
    fit = patterns.fit_shape(active_M, neuron_H, SHAPE.seq_len)
    assert fit.dead_share == pytest.approx(SHAPE.dead_share, abs=0.01)  # dead: never fire
    assert fit.neuron_sigma == pytest.approx(SHAPE.neuron_sigma, abs=0.2)
    # SHAPE's densities average 1.147 over the positions: drawn rescaled to a mean of 1, the first
    # token about 6 / 1.147 = 5.2x the mean, the last bucket 0.78x (64 sequences: noisy).
    assert fit.position_density[0] == pytest.approx(6.0 / 1.147, rel=0.25)
    assert fit.position_density[-1] == pytest.approx(0.9 / 1.147, rel=0.15)
    # Skewed: the top 10% of the live neurons hold far more than 10% of the entries.
    assert patterns.skew_stats(neuron_H)["top10_entry_share"] > 0.25
    # The uniform pattern of the same mean is not skewed that way.
    flat = patterns.PatternShape(0.0, 0.0, 64, (1.0,) * 7)
    xs, wg, *_ = patterns.shaped_inputs(jax.random.PRNGKey(4), m, k, flat, d, h, jnp.float32, n_sets=1)
    _, flat_H = patterns.exact_activity(xs[0], wg)
    assert patterns.skew_stats(flat_H)["top10_entry_share"] < 0.2  # Poisson noise alone: ~0.18


def test_exact_activity_counts_strictly_positive_pre_activations():
    x = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w = jnp.asarray([[1.0, 0.0], [-1.0, 1.0], [0.0, 0.0]])  # the last neuron is exactly 0: inactive
    per_token, per_neuron = patterns.exact_activity(x, w)
    assert per_token.tolist() == [1, 1, 1] and per_neuron.tolist() == [2, 1, 0]


def test_shape_json_round_trip_median_and_errors():
    again = patterns.PatternShape.from_json(json.loads(json.dumps(SHAPE.to_json())))
    assert again == SHAPE
    other = patterns.PatternShape(3.0, 0.3, 64, (2.0,) * 7)
    med = patterns.shape_of_layers([SHAPE, other, other])
    assert med.neuron_sigma == 3.0 and med.dead_share == 0.3 and med.position_density == (2.0,) * 7
    assert patterns.TRAINED_LIKE.seq_len == 512 and "small" in patterns.TRAINED_LIKE.source
    with pytest.raises(ValueError, match="position_density must hold 7"):
        patterns.PatternShape(1.0, 0.0, 64, (1.0,) * 3)
    with pytest.raises(ValueError, match="dead_share"):
        patterns.PatternShape(1.0, 1.0, 64, (1.0,) * 7)
    with pytest.raises(ValueError, match="unknown fields"):
        patterns.PatternShape.from_json(SHAPE.to_json() | {"sigma": 1})
    with pytest.raises(ValueError, match="whole sequences"):
        patterns.fit_shape(np.ones(100), np.ones(8), 64)
    with pytest.raises(ValueError, match="no active neurons"):
        patterns.fit_shape(np.zeros(64), np.zeros(8), 64)
    with pytest.raises(ValueError, match="0 < k < h"):
        patterns.shaped_inputs(jax.random.PRNGKey(0), 8, 0.0, SHAPE, 8, 16)


@pytest.mark.parametrize("d", [32, 40])  # a power of two, and not (masked columns)
def test_gather_probe_equals_its_reference(d):
    table = jax.random.normal(jax.random.PRNGKey(0), (24, d)).astype(jnp.bfloat16)
    idx = jax.random.randint(jax.random.PRNGKey(1), (5, 4), 0, 24, jnp.int32)
    got = bounds.gather_probe(table, idx, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(bounds.gather_probe_reference(table, idx), np.float32))
    with pytest.raises(ValueError, match="int32 idx"):
        bounds.gather_probe(table, idx.astype(jnp.float32), interpret=True)


def test_piece_traffic_and_attainment():
    m, d, h, k = 16384, 2048, 5632, 29.0
    t = bounds.piece_traffic(m, d, h, k)
    # The fused FFN gathers two weight rows per entry: 3.9 GB at k 29; the token-major backward three.
    assert t["fused_ffn"]["gather"] == pytest.approx(2 * m * k * d * 2) and t["fused_ffn"]["gather_tables"] == 2
    assert t["token_major"]["gather"] == pytest.approx(1.5 * t["fused_ffn"]["gather"])
    rates = dict(gather_2_bytes_per_ms=6.0e9, gather_1_bytes_per_ms=7.0e9, hbm_bytes_per_ms=3.0e9, xla_gate_ms=0.5)
    a = bounds.attainment(t, {"fused_ffn": 0.8, "pack": 0.6, "neuron_major": 0.7}, rates)
    assert set(a) == {"fused_ffn", "pack", "neuron_major"}
    want = t["fused_ffn"]["gather"] / 6.0e9 + t["fused_ffn"]["hbm"] / 3.0e9
    assert a["fused_ffn"]["bound_ms"] == pytest.approx(want) and a["fused_ffn"]["fraction"] == pytest.approx(want / 0.8)
    assert a["pack"]["fraction"] == pytest.approx(0.5 / 0.6)
    assert a["neuron_major"]["bound_ms"] == pytest.approx(
        t["neuron_major"]["gather"] / 6.0e9 + t["neuron_major"]["hbm"] / 3.0e9)
    # The tails' entries leave the sparse kernels' traffic.
    tails = bounds.piece_traffic(m, d, h, k, token_entries=0.5 * m * k, neuron_entries=0.25 * m * k)
    assert tails["token_major"]["gather"] == pytest.approx(0.5 * t["token_major"]["gather"])
    assert tails["neuron_major"]["gather"] == pytest.approx(0.25 * t["neuron_major"]["gather"])
    assert tails["fused_ffn"] == t["fused_ffn"]
    # The pattern as each piece reads it: the transpose's first pass the pack's int32 ids and
    # counts, its second pass and the kept backward's lists the kept uint8 offsets and int16
    # counts (the pack's form again for tiles over 256 lanes), the recomputing lists the pack's.
    n_tiles, slots, lists = 22, 32, m * k * (4 + 4 + 2)
    pattern, kept = m * n_tiles * (slots * 4 + 4), m * n_tiles * (slots + 2)
    assert t["transpose"]["hbm"] == pytest.approx(pattern + kept + lists)
    assert t["token_major"]["hbm"] - kept == pytest.approx(2 * m * d * 2 + 2 * lists)
    assert t["token_major_recompute"]["hbm"] - pattern == pytest.approx(3 * m * d * 2 + 2 * lists)
    wide = bounds.piece_traffic(m, d, 2 * h, k, tile=512)  # 22 tiles of 512 lanes: int32 kept
    assert wide["transpose"]["hbm"] == pytest.approx(2 * pattern + lists)


def test_the_benchmarks_shape_argument(tmp_path, capsys):
    from twell_jax.bench import ffn_train
    assert ffn_train.load_shape("trained") is patterns.TRAINED_LIKE
    results = tmp_path / "bench_ffn_train.json"  # a --checkpoint run's results: its median fit
    results.write_text(json.dumps({"rows": [], "shape_fit": SHAPE.to_json()}))
    assert ffn_train.load_shape(str(results)) == SHAPE
    bare = tmp_path / "shape.json"
    bare.write_text(json.dumps(SHAPE.to_json()))
    assert ffn_train.load_shape(str(bare)) == SHAPE
    with pytest.raises(Exception, match="no such file"):
        ffn_train.load_shape(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"neuron_sigma": 1.0}))
    with pytest.raises(Exception, match="not a PatternShape"):
        ffn_train.load_shape(str(bad))
    with pytest.raises(SystemExit):
        ffn_train.main(["--checkpoint", "x", "--shape", "trained"])
    assert "--shape is for the synthetic mode" in capsys.readouterr().err
