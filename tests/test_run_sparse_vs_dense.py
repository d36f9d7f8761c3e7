"""End-to-end test of experiments/run_sparse_vs_dense.py on CPU: 2 simulated devices, the micro model,
random tokens. Each run is a subprocess of a subprocess, so these tests time nothing; they check what
the script records, merges and reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "experiments" / "run_sparse_vs_dense.py"
# micro: global batch 8, so a micro-batch of 4 gives 2 accumulation steps on 1 device, 1 on 2.
# train.steps=1000: the curve runs must be stopped by the time limit (0.05 min = 1.5 s per FFN kind).
COMMON = ["--config", "micro", "--micro-batch", "4", "--timing-steps", "3", "--minutes", "0.05",
          "--data", "synthetic", "--set", "train.steps=1000"]


def run_script(args: list[str], out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO_ROOT, timeout=300)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("svd_first")
    return run_script(COMMON + ["--devices", "1,2"], out), out


def test_records_both_kinds_on_both_counts(first_run):
    proc, out = first_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "sparse_vs_dense.json").read_text())
    runs = {(r["ffn_kind"], r["num_devices"]): r for r in report["runs"]}
    assert set(runs) == {("relu_gated", 1), ("relu_gated", 2), ("twell", 1), ("twell", 2)}
    assert report["complete"] and report["device_kind"] == "cpu" and report["devices_visible"] == 2
    for (kind, n), r in runs.items():
        assert "error" not in r, r.get("error")
        assert r["role"] == ("curve" if n == 2 else "timing")
        assert r["accum_steps"] == 8 // (4 * n) and r["global_batch"] == 8 and r["micro_batch"] == 4
        assert r["l1_coef"] == (0.0 if kind == "relu_gated" else 1e-3)
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["median_step_s"])
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / n)
        assert r["timed_steps"] == r["steps_done"] - 2
        assert r["peak_memory_bytes"] is None or isinstance(r["peak_memory_bytes"], int)
        assert len(r["peak_memory_bytes_per_device"]) == n
        assert r["compile_s"] > 0 and r["val_loss"] > 0 and r["val_l0_mean"] is not None
        assert len(r["curves"]["ce"]) == len(r["curves"]["l0_mean"]) == r["steps_done"] > 0
        assert (out / "runs" / r["name"] / "metrics.jsonl").exists()
        # Efficiency against the same kind's own 1- and 2-device runs.
        one = runs[(kind, 1)]
        assert r["eff_vs_1"] == pytest.approx(r["tokens_per_s"] / (n * one["tokens_per_s"]))
        if n == 2:
            assert r["eff_vs_2"] == pytest.approx(1.0)
        else:
            assert r["eff_vs_2"] is None
        dense = runs[("relu_gated", n)]
        assert r["tokens_per_s_vs_dense"] == pytest.approx(r["tokens_per_s"] / dense["tokens_per_s"])
    for kind in ("relu_gated", "twell"):
        timing, curve = runs[(kind, 1)], runs[(kind, 2)]
        assert timing["steps_done"] == 3 and not timing["stopped_by_time_limit"]
        assert curve["time_limit_s"] == pytest.approx(1.5)
        assert curve["stopped_by_time_limit"] and 0 < curve["steps_done"] < 1000


def test_writes_markdown_plot_and_prints_table_last(first_run):
    proc, out = first_run
    report = json.loads((out / "sparse_vs_dense.json").read_text())
    markdown_rows = [line for line in (out / "sparse_vs_dense.md").read_text().splitlines() if line.startswith("|")]
    tail = proc.stdout.strip().splitlines()[-8:]  # the table is the last thing printed
    for r in report["runs"]:  # one table row per run, in the file and on stdout
        cells = (r["ffn_kind"], f"{r['tokens_per_s']:,.0f}", f"{r['median_step_s']:.3f}")
        assert sum(all(c in row for c in cells) for row in markdown_rows) == 1, r["name"]
        assert sum(all(c in line for c in cells) for line in tail) == 1, r["name"]
    assert (out / "curves.png").stat().st_size > 0


def test_baseline_merge_reports_efficiency_against_earlier_runs(first_run, tmp_path):
    proc, out = first_run
    assert proc.returncode == 0
    baseline = out / "sparse_vs_dense.json"
    second = run_script(COMMON + ["--devices", "2", "--ffn-kinds", "twell", "--baseline", str(baseline)], tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    report = json.loads((tmp_path / "sparse_vs_dense.json").read_text())
    assert [(r["ffn_kind"], r["num_devices"], r["role"]) for r in report["runs"]] == [("twell", 2, "curve")]
    run = report["runs"][0]
    earlier_one = next(r for r in json.loads(baseline.read_text())["runs"]
                       if r["ffn_kind"] == "twell" and r["num_devices"] == 1)
    assert run["eff_vs_1"] == pytest.approx(run["tokens_per_s"] / (2 * earlier_one["tokens_per_s"]))
    assert str(baseline) in run["eff_vs_1_ref"]
    # This invocation's 2-device run is the 2-device reference, not the baseline's.
    assert run["eff_vs_2"] == pytest.approx(1.0) and "this run" in run["eff_vs_2_ref"]
    merged = {(r["ffn_kind"], r["num_devices"]) for r in report["baseline_runs"]}
    assert merged == {("relu_gated", 1), ("relu_gated", 2), ("twell", 1), ("twell", 2)}
    assert all(r["source"] == str(baseline) for r in report["baseline_runs"])
    assert not report["warnings"]  # same device kind, config and batch layout
    markdown = (tmp_path / "sparse_vs_dense.md").read_text()
    assert "sparse_vs_dense.json" in markdown and markdown.count("| twell (L1 0.001) | 2 |") == 2


@pytest.mark.parametrize("args, message", [
    (["--devices", "1,4", "--micro-batch", "2"], "only 2"),  # after the device probe
    (["--devices", "1,2", "--micro-batch", "3"], "not divisible"),  # before any device is touched
    (["--devices", "1,2", "--timing-steps", "2"], "--timing-steps=2"),
])
def test_bad_arguments_fail_clearly(tmp_path, args, message):
    proc = run_script(COMMON + args, tmp_path)  # argparse: a repeated option's last value wins
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "sparse_vs_dense.json").exists()


def test_fitted_time_limit_shares_what_is_left(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_sparse_vs_dense", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    base = module.base_config("micro", "synthetic", [])
    plan = [module.PlannedRun(f"{kind}-2gpu-curve", kind, 2, "curve",
                              module.run_config(base, kind, 2, 4, "curve", 3, 100.0))
            for kind in ("relu_gated", "twell")]
    assert plan[0].cfg.train.time_limit_s == 100.0 and plan[0].cfg.sparsity.l1_coef == 0.0
    # Nothing measured yet: DEFAULT_RUN_OVERHEAD_S per run left, the rest split over the 2 curve runs.
    remaining = module.END_RESERVE_S + 2 * module.DEFAULT_RUN_OVERHEAD_S + 2 * 30.0
    assert module.fitted_time_limit(plan[0], plan, remaining, []) == pytest.approx(30.0)
    # A measured run: 1.1 x its largest fixed cost (wall - loop) instead.
    done = [{"wall_s": 50.0, "loop_s": 30.0}, {"wall_s": 12.0, "loop_s": 2.0}]
    assert module.fitted_time_limit(plan[1], plan[1:], module.END_RESERVE_S + 22.0 + 40.0, done) == pytest.approx(40.0)
    # Never above the planned limit, never 0 (time_limit_s=0 would mean no limit at all).
    assert module.fitted_time_limit(plan[0], plan, 1e6, []) == 100.0
    assert module.fitted_time_limit(plan[0], plan, 1.0, []) == 1.0
