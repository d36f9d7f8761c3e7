"""experiments/bench_eval.py (twell_jax/bench/eval_speed.py): `twell eval --tasks` against lm-eval's
`hf` backend on the exported run. On the CPU: the arguments, reading an accuracy out of either
side's results, and (slow tier, where lm-eval and transformers are installed) the whole benchmark on
a micro run, both sides giving the same accuracy."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from twell_jax.bench import eval_speed


def test_the_accuracy_is_found_in_either_sides_results():
    task = eval_speed.TASK
    lm_eval_doc = {"results": {task: {"alias": task, "acc,none": 0.625, "acc_stderr,none": 0.1}}}
    assert eval_speed._find_acc(lm_eval_doc) == 0.625
    ours = {"tasks": [{"name": "x"}], "lm_eval": {"results": {task: {"acc,none": 0.5}}}}
    assert eval_speed._find_acc(ours) == 0.5
    assert math.isnan(eval_speed._find_acc({"results": {"other": {"acc,none": 1.0}}}))  # another task's: none


def test_a_run_ending_on_a_partial_batch_is_noted():
    assert eval_speed.partial_batch_note(2000, 64, 32) is None  # 8000 and 256 requests: whole batches
    note = eval_speed.partial_batch_note(400, 50, 32)  # 200 requests: 6 batches of 32 and one of 8
    assert note.startswith("--warm-items 50 ends on a batch of 8 of --batch-size 32 rows") and "--items" not in note
    assert "--items 7 ends on a batch of 12" in eval_speed.partial_batch_note(7, 2, 16)


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "x", "--items", "10", "--warm-items", "10"], "--warm-items must be >= 1 and less than --items"),
    (["--checkpoint", "x", "--batch-size", "0"], "must be >= 1"),
    (["--checkpoint", "x", "--backends", "cuda"], "--backends must list distinct op backends"),
    (["--checkpoint", "x", "--backends", "dense,dense"], "--backends must list distinct op backends"),
    (["--checkpoint", "x", "--backends", ","], "--backends must list distinct op backends"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        eval_speed.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_benchmark_runs_both_sides_on_a_micro_run(tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    run = tmp_path / "run"
    trained = subprocess.run([sys.executable, "-m", "twell_jax.cli", "train", "--config", "micro", "--set",
                              "train.steps=3", "--out", str(run)], capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "twell_jax.bench.eval_speed", "--checkpoint", str(run), "--items", "6",
                           "--warm-items", "2", "--batch-size", "4", "--context-tokens", "8", "--choice-tokens", "4",
                           "--device", "cpu", "--backends", "dense,reference", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench_eval.json").read_text())
    assert list(result["sides"]) == ["ours@dense", "ours@reference", "hf"]
    assert set(result["vs_hf_per_item"]) == {"ours@dense", "ours@reference"} and "speedup_per_item" not in result
    assert result["vs_hf_per_item"]["ours@dense"] == pytest.approx(
        result["sides"]["hf"]["ms_per_item"] / result["sides"]["ours@dense"]["ms_per_item"])
    # Each side ran with its backend (its command log) ...
    assert "model.ffn_backend=reference" in (out / "ours@reference_6.log").read_text()
    # ... after an untimed run on all the items that filled the side's own compilation cache, which
    # both timed runs read.
    assert result["sides"]["ours@dense"]["prime_s"] > 0 and "prime_s" not in result["sides"]["hf"]
    cache = out / "xla_cache" / "ours@dense"
    assert any(cache.iterdir()) and f"--compile-cache {cache}" in (out / "ours@dense_2.log").read_text()
    hf = result["sides"]["hf"]
    # ... and the same model and requests give the same accuracy (float32 here, so no tie flips).
    for side in ("ours@dense", "ours@reference"):
        assert result["sides"][side]["acc"] == hf["acc"] and 0 <= hf["acc"] <= 1
    assert result["items"] == 6 and "| hf / side per item |" in done.stdout and "| ours@reference |" in done.stdout
    lines = (out / "task" / f"{eval_speed.TASK}.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(len(json.loads(line)["choices"]) == 4 for line in lines)
