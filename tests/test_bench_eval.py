"""experiments/bench_eval.py (twell_jax/bench/eval_speed.py): `twell eval --tasks` against lm-eval's
`hf` backend on the exported run, each side timed inside its own process (eval_side.py). On the CPU:
the arguments, reading an accuracy out of either side's results, and (slow tier, where lm-eval and
transformers are installed) the whole benchmark on a micro run, both sides giving the same accuracy."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from twell_jax.bench import eval_side, eval_speed


def test_the_accuracy_is_found_in_either_sides_results():
    task = eval_speed.TASK
    lm_eval_doc = {"results": {task: {"alias": task, "acc,none": 0.625, "acc_stderr,none": 0.1}}}
    assert eval_speed.find_acc(lm_eval_doc) == 0.625
    ours = {"tasks": [{"name": "x"}], "lm_eval": {"results": {task: {"acc,none": 0.5}}}}
    assert eval_speed.find_acc(ours) == 0.5
    assert math.isnan(eval_speed.find_acc({"results": {"other": {"acc,none": 1.0}}}))  # another task's: none


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "x", "--repeats", "0"], "--repeats, --batch-size, --context-tokens and --choice-tokens must be >= 1"),
    (["--checkpoint", "x", "--items", "0"], "must be >= 1"),
    (["--checkpoint", "x", "--items", "8", "--base-items", "8"], "--base-items must be >= 1 and less than --items (8)"),
    (["--checkpoint", "x", "--base-items", "0"], "--base-items must be >= 1"),
    (["--checkpoint", "x", "--batch-size", "0"], "must be >= 1"),
    (["--checkpoint", "x", "--backends", "cuda"], "--backends must list distinct op backends"),
    (["--checkpoint", "x", "--backends", "dense,dense"], "--backends must list distinct op backends"),
    (["--checkpoint", "x", "--backends", ","], "--backends must list distinct op backends"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        eval_speed.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["ours", "--tasks", "t.yaml", "--items", "4", "--base-items", "2", "--batch-size", "2"],
     "ours takes --checkpoint, hf takes --export"),
    (["hf", "--checkpoint", "x", "--tasks", "t.yaml", "--items", "4", "--base-items", "2", "--batch-size", "2"],
     "ours takes --checkpoint"),
    (["ours", "--checkpoint", "x", "--export", "e", "--tasks", "t.yaml", "--items", "4", "--base-items", "2",
      "--batch-size", "2"], "hf takes --export"),
    (["ours", "--checkpoint", "x", "--tasks", "t.yaml", "--items", "4", "--base-items", "2", "--batch-size", "2",
      "--repeats", "0"], "must be >= 1"),
    (["ours", "--checkpoint", "x", "--tasks", "t.yaml", "--items", "4", "--base-items", "4", "--batch-size", "2"],
     "--base-items less than --items"),
])
def test_a_side_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        eval_side.main(argv)
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
                           "--base-items", "2", "--repeats", "2", "--batch-size", "4", "--context-tokens", "8", "--choice-tokens", "4",
                           "--device", "cpu", "--backends", "dense,reference", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench_eval.json").read_text())
    assert list(result["sides"]) == ["ours@dense", "ours@reference", "hf"]
    sides = result["sides"]
    for name, side in sides.items():
        # Timed inside its process: two runs of each size after untimed ones; per item = the
        # difference of the medians (of two: their means) over the 4 items between the sizes.
        assert len(side["seconds"]) == len(side["base_seconds"]) == 2 and side["warm_s"] > 0 and side["load_s"] > 0
        full, base = sum(side["seconds"]) / 2, sum(side["base_seconds"]) / 2
        assert side["ms_per_item"] == pytest.approx(1e3 * (full - base) / 4)
        assert side["fixed_s"] == pytest.approx(full - 6 * (full - base) / 4)
        assert side["process_s"] > side["load_s"] + side["warm_s"] + sum(side["seconds"]) + sum(side["base_seconds"])
    assert result["vs_hf_per_item"]["ours@dense"] == pytest.approx(
        sides["hf"]["ms_per_item"] / sides["ours@dense"]["ms_per_item"])
    assert result["vs_first_per_item"]["ours@dense"] == 1.0 and result["vs_first_per_item"]["ours@reference"] == (
        pytest.approx(sides["ours@dense"]["ms_per_item"] / sides["ours@reference"]["ms_per_item"]))
    # What each layer's FFN forward ran, per program of the scorer: the side's backend in every layer.
    for name, backend in (("ours@dense", "dense"), ("ours@reference", "reference")):
        forwards = sides[name]["ffn_forwards"]
        assert forwards and all(v == [backend] * 2 for v in forwards.values()), forwards  # micro: 2 layers
        assert (f"{name}: each layer's FFN forward in the {next(iter(forwards))} (rows x length) program: "
                f"{backend} {backend}") in done.stdout
    assert "ffn_forwards" not in sides["hf"] and "ffn_activity" not in sides["hf"]
    # ... and each layer's activity on validation rows of each program's shape, with the hints the
    # run's "auto" would plan them by (none here: the sides run dense and reference).
    for name in ("ours@dense", "ours@reference"):
        activity = sides[name]["ffn_activity"]
        assert set(activity) == set(sides[name]["ffn_forwards"])
        assert all(len(v["active"]) == 2 and all(a > 0 for a in v["active"]) for v in activity.values())
    for shape, seen in sides["ours@dense"]["ffn_activity"].items():  # the same counts, either backend
        assert seen["active"] == pytest.approx(sides["ours@reference"]["ffn_activity"][shape]["active"], rel=1e-6)
    # Each side ran with its backend (its command log) ...
    assert "--backend reference" in (out / "ours@reference.log").read_text()
    # ... and the same model and requests give the same accuracy, in every run (float32 here, so no
    # tie flips).
    hf = sides["hf"]
    for side in ("ours@dense", "ours@reference", "hf"):
        assert sides[side]["accs"] == [hf["acc"]] * 3 and 0 <= hf["acc"] <= 1
    assert result["items"] == 6 and "| hf / side |" in done.stdout and "| ours@reference |" in done.stdout
    lines = (out / "task" / f"{eval_speed.TASK}.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(len(json.loads(line)["choices"]) == 4 for line in lines)


def test_ffn_forwards_resolves_auto_per_layer_and_program_shape(monkeypatch):
    """What bench_eval reports our side ran: per traced (rows, length) program, each layer's FFN
    forward as the planner resolves "auto" from that layer's hint for rows of that length
    (forward-only, as load_run sets)."""
    from types import SimpleNamespace

    from twell_jax import ops
    from twell_jax.bench.eval_side import ffn_forwards
    from twell_jax.ops import pallas_forward

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    def hinted(*ks):
        return tuple(ops.SparseFFNConfig(expected_active_per_token=k, forward_only=True) for k in ks)

    # Rows of 128 tokens and more: hints 20 and 60; shorter rows fire more: 60 and 60.
    model = SimpleNamespace(compute_dtype="bfloat16", d_model=2048, d_ff=5632, through_op=True, backend="auto",
                            gated=True, interpret=False,
                            op_configs_for=lambda length: hinted(20.0, 60.0) if length >= 128 else hinted(60.0, 60.0))
    program = SimpleNamespace(shapes=[(64, 128), (32, 64), (64, 128), (128, 64)])
    plans = ffn_forwards(SimpleNamespace(model=model, _score_program=program))
    # 8192 tokens: the hint 20 is under the forward edge (~27), 60 over (rows of 64: both 60); 2048
    # tokens: dense wins at any k.
    assert plans == {"32x64": ["dense", "dense"], "64x128": ["pallas", "dense"], "128x64": ["dense", "dense"]}
    assert ffn_forwards(SimpleNamespace(model=model, _score_program=None)) == {}
    twin = SimpleNamespace(**{**vars(model), "through_op": False})
    assert ffn_forwards(SimpleNamespace(model=twin, _score_program=program))["64x128"] == ["dense", "dense"]
