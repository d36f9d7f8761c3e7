"""experiments/bench_ffn_train.py --checkpoint: the capture of each layer's FFN input, the pattern
statistics on a hand-built pattern, the argument checks, and a dry run of the mode on a tiny trained
run (CPU, Pallas interpreter). No timing is asserted."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
from test_sparse_checkpoint_benches import sparse_run  # noqa: F401  (the tiny trained run fixture)

from twell_jax import ops
from twell_jax.bench import ffn_train as bench_ffn_train
from twell_jax.bench import patterns
from twell_jax.config import ModelConfig
from twell_jax.model import FeedForward, init_model  # noqa: E402
from twell_jax.ops import pallas_backward  # noqa: E402

CFG = ModelConfig(vocab_size=61, d_model=24, n_layers=3, n_heads=3, d_ff=40, max_seq_len=16,
                  ffn_kind="twell", ffn_backend="dense", compute_dtype="float32", remat="ffn")


def test_the_capture_is_what_each_ffn_receives_and_feeding_it_reproduces_the_blocks_ffn_output():
    model = init_model(CFG, seed=3)
    tokens_BxS = jax.random.randint(jax.random.key(0), (2, 11), 0, CFG.vocab_size)
    original_call = FeedForward.__call__
    captured = bench_ffn_train.capture_ffn_inputs(model, tokens_BxS, [2, 0])
    # The class's method is restored.
    assert FeedForward.__call__ is original_call
    # Independently, block by block through the public Block call (remat "ffn" included): the
    # FFN's output in the model is the block's output minus its input and its attention branch.
    x_BxSxD = jnp.take(model.embed[...], tokens_BxS, axis=0)
    expected_in, expected_out = {}, {}
    for layer in range(CFG.n_layers):
        blk = model.layer(layer)
        mid_BxSxD = x_BxSxD + blk.attn(blk.attn_norm(x_BxSxD))
        out_BxSxD = blk(x_BxSxD, False)[0]
        expected_in[layer] = blk.ffn_norm(mid_BxSxD).reshape(-1, CFG.d_model)
        expected_out[layer] = (out_BxSxD - mid_BxSxD).reshape(-1, CFG.d_model)
        x_BxSxD = out_BxSxD
    for layer, x_MxD in zip([2, 0], captured):
        assert x_MxD.shape == (22, CFG.d_model) and x_MxD.dtype == jnp.float32
        np.testing.assert_allclose(x_MxD, expected_in[layer], rtol=1e-5, atol=1e-5)
        y_MxD, _ = ops.gated_ffn(x_MxD, *bench_ffn_train.ffn_weights(model, layer), backend="dense")
        np.testing.assert_allclose(y_MxD, expected_out[layer], rtol=1e-4, atol=1e-5)
    # Layers are distinct: layer 2's input is not layer 0's.
    assert not np.allclose(captured[0], captured[1])


def test_the_capture_rejects_bad_layers_and_restores_the_model_on_error():
    model = init_model(CFG, seed=3)
    original_call = FeedForward.__call__
    tokens_BxS = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"layers must be a non-empty list of indices in \[0, 3\)"):
        bench_ffn_train.capture_ffn_inputs(model, tokens_BxS, [3])
    with pytest.raises(ValueError, match="sequence length 17 exceeds"):
        bench_ffn_train.capture_ffn_inputs(model, jnp.zeros((1, 17), jnp.int32), [0])
    assert FeedForward.__call__ is original_call


def test_parse_layers():
    assert bench_ffn_train.parse_layers(None, 3) == [0, 1, 2]
    assert bench_ffn_train.parse_layers("2,0", 3) == [2, 0]
    for text in ("0,3", "1,1", "a", ""):
        with pytest.raises(ValueError, match="--layers"):
            bench_ffn_train.parse_layers(text, 3)


def test_parse_cases():
    assert bench_ffn_train.parse_cases("2048:29,65536:112.5") == [(2048, 29.0), (65536, 112.5)]
    for text in ("2048", "0:29", "2048:0", "a:b", "2048:29,"):
        with pytest.raises(argparse.ArgumentTypeError, match="--cases"):
            bench_ffn_train.parse_cases(text)


def test_pattern_stats_on_a_hand_built_pattern():
    config = ops.SparseFFNConfig(tile=8, slots=4, ell_width=6, transpose_ell_width=5, tail_rows=1,
                                 transpose_tail_rows=4,
                                 backward=pallas_backward.BackwardConfig(token_tail_chunk=64, neuron_tail_chunk=1))
    counts_MxNT = np.array([[1, 0],    # 1 active
                            [4, 2],    # 6 = ell_width: kept
                            [5, 0],    # a tile over its 4 slots: tail
                            [4, 3],    # 7 > ell_width: tail
                            [0, 0],    # none
                            [2, 2]])   # 4
    neuron_count_H = np.array([0, 1, 10, 3, 12, 0, 2, 2])  # 2 above 5 entries: hot
    stats = bench_ffn_train.pattern_stats(counts_MxNT, neuron_count_H, config, seq_len=3)
    assert stats["active_mean"] == pytest.approx(23 / 6) and stats["active_max"] == 7
    assert stats["active_p50"] == pytest.approx(np.median([1, 6, 5, 7, 0, 4]))
    assert stats["first_token_active_mean"] == pytest.approx((1 + 7) / 2)  # rows 0 and 3
    assert (stats["token_tail_rows"], stats["overflow_rows"], stats["wide_rows"]) == (2, 1, 1)
    # Capacity 1 row: 2 tail rows send the whole call to the dense backward; the 1 row the tail
    # can hold would take one small block (16 rows), not a block of token_tail_chunk = 64.
    assert stats["token_tail_capacity"] == 1 and stats["token_fallback"]
    assert (stats["token_tail_blocks"], stats["token_tail_dense_rows"]) == (1, 16)
    assert stats["neuron_entries"] == 30 and stats["neuron_count_max"] == 12 and stats["dead_neurons"] == 2
    assert stats["hot_neurons"] == 2 and stats["hot_entry_share"] == pytest.approx(22 / 30)
    assert (stats["neuron_tail_blocks"], stats["neuron_tail_dense_neurons"], stats["neuron_fallback"]) == (2, 2, False)
    # All silent: no division by zero, nothing in any tail.
    empty = bench_ffn_train.pattern_stats(np.zeros((4, 2), int), np.zeros(8, int), config)
    assert empty["active_mean"] == 0 and empty["hot_entry_share"] == 0 and empty["token_tail_blocks"] == 0
    with pytest.raises(ValueError, match=r"counts_MxNT must be \[M, NT\]"):
        bench_ffn_train.pattern_stats(np.zeros(4), np.zeros(8), config)


@pytest.mark.parametrize("argv,match", [(["--layers", "0"], "need --checkpoint"),
                                        (["--dry-run", "--neuron-tail-chunk", "128"], "are for the GPU run"),
                                        (["--checkpoint", "x", "--quick"], "--quick is for the synthetic"),
                                        (["--repeats", "0"], "--repeats must be >= 1")])
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench_ffn_train.main(argv)
    assert match in capsys.readouterr().err


def test_sweep_overrides_reach_the_op_config():
    base = bench_ffn_train.dry_run_config()
    args = argparse.Namespace(token_tail_chunk=None, neuron_tail_chunk=None, transpose_ell_width=None)
    assert bench_ffn_train.with_sweep_overrides(base, args) == base
    args = argparse.Namespace(token_tail_chunk=None, neuron_tail_chunk=3, transpose_ell_width=40)
    changed = bench_ffn_train.with_sweep_overrides(base, args)
    assert changed.transpose_ell_width == 40 and changed.backward.neuron_tail_chunk == 3
    assert changed.backward.token_tail_chunk == base.backward.token_tail_chunk
    with pytest.raises(ValueError, match="token_tail_chunk"):
        bench_ffn_train.with_sweep_overrides(base, argparse.Namespace(
            token_tail_chunk=0, neuron_tail_chunk=None, transpose_ell_width=None))


@pytest.mark.slow
def test_checkpoint_dry_run(sparse_run, tmp_path):
    run = sparse_run[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # one CPU device is enough
    proc = subprocess.run([sys.executable, "-m", "twell_jax.bench.ffn_train", "--dry-run",
                           "--checkpoint", str(run), "--layers", "1,0", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads((tmp_path / "bench_ffn_train.json").read_text())
    assert saved["source"].startswith("checkpoint") and saved["layers"] == [1, 0] and saved["seq_len"] == 40
    rows = saved["rows"]
    assert [r["layer"] for r in rows] == [1, 0] and all("error" not in r for r in rows), rows
    for row in rows:
        assert row["m"] == 2 * 40 and set(row["ms"]) == (set(bench_ffn_train.CHECKPOINT_BACKENDS)
                                                         - set(bench_ffn_train.DRY_RUN_SKIPPED))
        assert set(row["temp_mb"]) == set(row["ms"])
        for backend, errs in row["errors"].items():  # bf16 gradients within bf16 rounding of xla_bf16
            for name, e in errs.items():
                assert e["rel"] < 3e-2, (backend, name, e)
        stats = row["pattern"]
        # The dry-run config puts this run's pattern in both tails and in the ELL kernels.
        assert 0 < stats["token_tail_rows"] < stats["tokens"] and 0 < stats["hot_neurons"] < stats["neurons"]
        # No tile overflows at slots = tile: every tail row has more than ell_width actives.
        assert stats["overflow_rows"] == 0 and stats["token_tail_rows"] == stats["wide_rows"]
        assert row["hint"] == stats["active_mean"] > 0
        # Both tails, as the backward takes them, match xla_bf16 on their rows.
        assert set(row["piece_errors"]) == {"token_tail_dx", "hot_dw_gate", "hot_dw_up", "hot_dw_down"}
        assert all(e["rel"] < 3e-2 for e in row["piece_errors"].values()), row["piece_errors"]
        assert {"pack", "token_major", "transpose", "neuron_major", "token_tail", "neuron_tail"} <= set(row["piece_ms"])
        assert row["model"]["pallas_ms"] > 0 and len(row["model"]["auto_plan"]) == 2
        # The layer's shape (bench/patterns.py): its fit from the layer's exact activity.
        shape = patterns.PatternShape.from_json(row["shape"])
        assert shape.seq_len == 40 and 0 <= shape.dead_share < 1 and shape.neuron_sigma >= 0
        assert 0 < row["skew"]["top1_entry_share"] <= row["skew"]["top10_entry_share"] <= 1
    # The median fit of the layers, what --shape RESULTS takes.
    assert patterns.PatternShape.from_json(saved["shape_fit"]).seq_len == 40
    table = (tmp_path / "table.txt").read_text().splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("layer |"))
    assert [line.split("|")[0].strip() for line in table[head + 1:head + 3]] == ["1", "0"]
    assert table[-1].startswith("  median: neuron sigma")
