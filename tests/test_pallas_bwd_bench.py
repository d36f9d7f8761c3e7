"""experiments/bench_ffn_train.py --dry-run: the benchmark script runs end to end on CPU (Pallas
interpreter, tiny shapes) and its correctness check holds, with --trace (on the CPU: each traced
program's profile says there were no GPU events) and --sweep-blocks (every launch variant's outputs
equal to the default's bit for bit). It times nothing that is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twell_jax.pallas_kernels.twell_pack import PackBlockSizes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_ffn_train_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # one CPU device is enough
    proc = subprocess.run([sys.executable, "-m", "twell_jax.bench.ffn_train",
                           "--dry-run", "--trace", "--sweep-blocks", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_ffn_train.json").read_text())["rows"]
    assert rows and all("error" not in r for r in rows), rows
    assert [r["kind"] for r in rows] == ["sweep_blocks", "train"]
    sweep, row = rows
    # --sweep-blocks: every launch ran, the default once and marked, all outputs equal bit for bit
    # (the token kernel in one launch instead of two: equal up to the last bits of its sums).
    for kernel, block, blocks in (("token", "block_t", [1, 1, 2]), ("neuron", "block_n", [1, 2])):
        variants = sweep[kernel]
        assert sorted(v["block_sizes"][block] for v in variants) == blocks, variants
        assert sum(v["default"] for v in variants) == 1
        for v in variants:
            one_launch = not v["block_sizes"].get("split", True)
            assert v["ms"] > 0 and (v["max_abs"] < 1e-5 if one_launch else v["equal"] and v["n_diff"] == 0), v
    assert [v["block_sizes"]["split"] for v in sweep["token"]].count(False) == 1
    packs = sweep["pack"]  # the launch order changes no bit of the pack
    assert sorted(v["block_sizes"]["group_m"] for v in packs) == sorted([0, PackBlockSizes().group_m]), packs
    assert sum(v["default"] for v in packs) == 1 and sweep["xla_gate_ms"] > 0
    assert all(v["equal"] and v["n_diff"] == 0 and v["ms"] > 0 for v in packs), packs
    # --trace: the three programs profiled; the CPU has no GPU events, and the profile says so.
    assert set(row["trace"]) == {"xla_bf16", "pallas", "auto"}
    for profile in row["trace"].values():
        assert profile["kernels"] == [] and "no GPU events" in profile["reason"], profile
    table = (tmp_path / "table.txt").read_text()
    assert "--sweep-blocks token kernel" in table and "kernels of pallas" in table
    assert "--sweep-blocks pack kernel" in table and "XLA relu(x W_gate^T)" in table
    assert set(row["ms"]) == {"xla_bf16", "dense", "pallas", "auto"}  # the dry run's (DRY_RUN_SKIPPED)
    # The forward alone, as training runs it (with the residuals) and as inference runs it.
    for key in ("fwd_ms", "infer_ms"):
        assert set(row[key]) == {"xla_bf16", "dense", "pallas", "auto"} and min(row[key].values()) > 0
    assert "forward alone, ms" in table
    for backend, errs in row["errors"].items():  # bf16 gradients within bf16 rounding of xla_bf16
        for name, e in errs.items():
            assert e["rel"] < 3e-2, (backend, name, e)
    assert set(row["piece_ms"]) >= {"token_major", "token_major_recompute", "fused_ffn_ranked",
                                    "transpose", "neuron_major"}
    assert set(row["temp_mb"]) == set(row["ms"])  # compiled memory of every backend it timed
    assert (tmp_path / "table.txt").stat().st_size > 0  # the printed table is saved too
