"""`twell compare` (twell_jax/compare.py): the study's plan (twin + several L1, same tokens), its
report (table, JSON, PNG; per layer and per position), continuation after SIGTERM with --resume,
and the refusals (a training run as --out, a non-empty --out, changed options on --resume)."""
from __future__ import annotations

import json

import pytest

from twell_jax.configs import get_config
from twell_jax import compare as compare_lib
from twell_jax import config as config_lib
from twell_jax.training import train as train_lib
from oracles import run_cli


def _micro(**overrides):
    return config_lib.apply_overrides(get_config("micro"), [f"{k}={v}" for k, v in overrides.items()])


def test_study_plan_same_tokens_several_l1():
    cfg = _micro(**{"sparsity.reinit_dead": "false"})
    runs = compare_lib.study_runs(cfg, l1_values=[0.0, 1e-3, 5e-3], reinit="both", l1_warmup_steps=3)
    assert [r.key for r in runs] == ["dense", "twell-l1-0", "twell-l1-0-reinit", "twell-l1-0.001",
                                     "twell-l1-0.001-reinit", "twell-l1-0.005", "twell-l1-0.005-reinit"]
    twin = runs[0].cfg
    assert twin.model.ffn_kind == "relu_gated" and twin.sparsity.l1_coef == 0 and not twin.sparsity.reinit_dead
    for run in runs[1:]:
        assert run.cfg.model.ffn_kind == "twell"
        assert (run.cfg.sparsity.l1_warmup_start, run.cfg.sparsity.l1_warmup_end) == (0, 3)
        assert run.cfg.sparsity.reinit_dead == run.key.endswith("-reinit")
        # Same tokens in the same order: the runs differ in name, FFN and sparsity only.
        fields = {path.split(".")[0] for path, _, _ in config_lib.diff(twin, run.cfg)}
        assert fields <= {"name", "model", "sparsity"}
        assert {p for p, _, _ in config_lib.diff(twin.model, run.cfg.model)} == {"ffn_kind"}
    # Defaults: the config's L1 and re-initialisation setting, one sparse run.
    default = compare_lib.study_runs(cfg)
    assert [r.key for r in default] == ["dense", "twell-l1-0.001"]
    assert compare_lib.study_runs(cfg, dense_kind="swiglu")[0].cfg.model.ffn_kind == "swiglu"


@pytest.mark.parametrize("options, message", [
    (dict(l1_values=[1e-3, 1e-3]), "distinct"),
    (dict(l1_values=[1e-5, 1.0000001e-5]), "6 significant digits"),  # one run directory name for both
    (dict(l1_values=[-1.0]), ">= 0"),
    (dict(dense_kind="twell"), "--dense-kind"),
    (dict(l1_warmup_steps=-1), "--l1-warmup-steps"),
])
def test_study_plan_errors(options, message):
    with pytest.raises(ValueError, match=message):
        compare_lib.study_runs(_micro(), **options)


def test_refuses_training_runs_and_non_empty_out(tmp_path):
    run = tmp_path / "a_run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    for extra in ([], ["--resume"]):
        code, _, err = run_cli(["compare", "--config", "micro", "--out", str(run), *extra])
        assert code == 2 and "training run of `twell train`, not a comparison" in err, err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    code, _, err = run_cli(["compare", "--config", "micro", "--out", str(other)])
    assert code == 2 and "is not empty" in err and (other / "notes.txt").read_text() == "keep me"
    code, _, err = run_cli(["compare", "--out", str(tmp_path / "none"), "--resume"])
    assert code == 2 and "holds no comparison" in err
    (tmp_path / "a_file").write_text("x")
    code, _, err = run_cli(["compare", "--config", "micro", "--out", str(tmp_path / "a_file")])
    assert code == 2 and "not a directory" in err
    # --dry-run plans and prints, trains and writes nothing.
    code, text, err = run_cli(["compare", "--config", "micro", "--out", str(tmp_path / "dry"), "--l1", "0", "1e-3",
                                "--dry-run"])
    assert code == 0 and text == "" and "twell-l1-0.001" in err and not (tmp_path / "dry").exists()
    code, text, _ = run_cli(["compare", "--config", "micro", "--out", str(tmp_path / "dry"), "--l1", "0", "1e-3",
                              "--dry-run", "--json"])  # --json: the plan as one document on stdout
    plan = json.loads(text)["plan"]
    assert code == 0 and [r["key"] for r in plan["runs"]] == ["dense", "twell-l1-0", "twell-l1-0.001"]
    assert plan["options"]["l1_values"] == [0.0, 1e-3] and not (tmp_path / "dry").exists()
    # A damaged plan is named, whatever is wrong in it.
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    bad_config = '{"version": 1, "runs": [{"key": "dense", "config": {"nope": 1}}], "options": {}}'
    for text in ('{"version": 1}', '[1]', bad_config):
        (damaged / compare_lib.PLAN_FILE).write_text(text)
        code, _, err = run_cli(["compare", "--out", str(damaged), "--resume"])
        assert code == 2 and str(damaged / compare_lib.PLAN_FILE) in err, err
    # --print-config prints a new study's config: with --resume it would be tiny's, whatever was planned.
    code, text, err = run_cli(["compare", "--out", str(tmp_path / "dry"), "--resume", "--print-config"])
    assert code == 2 and text == "" and "compare_plan.json" in err


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory, monkeypatch_module):
    """A 3-run study (twin, L1 0, L1 1e-3; 4 steps, checkpoints every 2) whose second run gets a
    SIGTERM after step 2, then `--resume`."""
    out = tmp_path_factory.mktemp("cmp") / "study"
    cache = tmp_path_factory.getbasetemp() / "twell_data_cache"
    original_run = train_lib.Trainer.run

    def run_stopped_by_sigterm(self, **kwargs):
        if self.run_dir.name != "twell-l1-0":
            return original_run(self, **kwargs)
        original_run(self, stop_after_step=2)  # checkpoint at step 2, as the SIGTERM handler saves it
        raise train_lib.TrainingInterrupted("SIGTERM", 2, self.run_dir, True)

    monkeypatch_module.setattr(train_lib.Trainer, "run", run_stopped_by_sigterm)
    argv = ["compare", "--config", "micro", "--out", str(out), "--l1", "0", "1e-3",
            "--set", f"data.cache_dir={cache}", "train.steps=4", "train.checkpoint_every=2"]
    first = run_cli(argv)
    monkeypatch_module.setattr(train_lib.Trainer, "run", original_run)
    twin_metrics = (out / "dense" / "metrics.jsonl").read_text()
    first = (*first, sorted(p.name for p in out.iterdir()))  # what the interrupted study left
    # Changed study options or fixed fields are refused before anything runs.
    refused = [run_cli(["compare", "--out", str(out), "--resume", "--l1", "5e-3"]),
               run_cli(["compare", "--out", str(out), "--resume", "--set", "model.d_ff=32"]),
               run_cli(argv),  # the same study again without --resume
               run_cli(["compare", "--config", "micro", "--out", str(out), "--resume"])]
    resumed = run_cli(["compare", "--out", str(out), "--resume"])
    return out, first, refused, resumed, twin_metrics


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_sigterm_names_the_resume_command(interrupted_then_resumed):
    out, (code, _, err, left), refused, _, _ = interrupted_then_resumed
    assert code == 143, err
    assert f"continue the comparison with: twell compare --out {out} --resume" in err
    assert left == [compare_lib.PLAN_FILE, "dense", "twell-l1-0"]  # no report, the third run not started
    for code, _, err in refused:
        assert code == 2
    assert "differ (leave the study options out" in refused[0][2] and "; --l1 [0.005] differ" in refused[0][2]
    assert "--set model.d_ff: cannot change when resuming a comparison" in refused[1][2]
    assert "holds a comparison: continue it with --resume" in refused[2][2]
    assert "--config 'micro': leave it out with --resume" in refused[3][2]


def test_resume_keeps_finished_runs_and_continues_the_interrupted_one(interrupted_then_resumed):
    out, _, _, (code, text, err), twin_metrics = interrupted_then_resumed
    assert code == 0, err
    assert "dense (relu_gated, L1 0) finished earlier: kept" in err  # logs on stderr, the table on stdout
    assert "twell-l1-0 (twell, L1 0) -> " in err and "(resuming from its checkpoint)" in err
    assert (out / "dense" / "metrics.jsonl").read_text() == twin_metrics  # not trained again
    steps = [json.loads(line)["step"] for line in (out / "twell-l1-0" / "metrics.jsonl").read_text().splitlines()
             if "ce" in json.loads(line)]
    assert steps == [1, 2, 3, 4]  # steps 1-2 before the signal, 3-4 after the resume, each once


def test_report_table_json_and_plot(interrupted_then_resumed):
    out, _, _, (_, text, _), _ = interrupted_then_resumed
    report = json.loads((out / "compare.json").read_text())
    rows = {r["key"]: r for r in report["runs"]}
    assert list(rows) == ["dense", "twell-l1-0", "twell-l1-0.001"] and report["twin"] == "dense"
    twin = rows["dense"]
    for key, row in rows.items():
        summary = json.loads((out / key / "summary.json").read_text())
        assert row["steps"] == 4 and row["tokens"] == 4 * 8 * 16 and row["equal_tokens"]
        assert row["val_loss"] == summary["val_loss"]
        assert row["ce_gap_to_twin"] == pytest.approx((row["val_loss"] - twin["val_loss"]) / twin["val_loss"])
        assert row["active_per_token"] == summary["val_l0_mean"]
        assert row["active_share"] == pytest.approx(summary["val_l0_mean"] / 64)
        assert len(row["active_per_layer"]) == 2 and len(row["active_per_layer_position"]) == 2
        assert len(row["active_per_position"]) == 8  # sparsity.position_buckets
        assert row["dead_share"] == summary["dead_share_mean"] and row["tokens_per_s"] == summary["tokens_per_s"]
        # One table row per run in compare.md and in the printed table, holding its measured CE.
        cells = (f"| {key} |", f"{row['val_loss']:.4f}")
        md_rows = [line for line in (out / "compare.md").read_text().splitlines() if line.startswith(f"| {key} |")]
        assert len(md_rows) == 1 and all(c in md_rows[0] for c in cells)
        assert sum(all(c in line for c in cells) for line in text.splitlines()) == 1
    assert rows["twell-l1-0.001"]["l1_coef"] == 1e-3 and rows["dense"]["ffn_kind"] == "relu_gated"
    assert (out / "compare.png").stat().st_size > 10_000



def test_default_out_is_reserved_per_study(tmp_path, monkeypatch):
    """A study without --out reserves runs/compare-<name>-<time>[-n] atomically: two started in the
    same second get two directories (each keeps its plan, to be continued with --resume)."""
    import time as time_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time_module, "strftime", lambda fmt, *a: "20260101-000000")
    failing = ["compare", "--config", "micro", "--set", f"data.source={tmp_path / 'no_such_corpus.jsonl'}"]
    for _ in range(2):
        code, _, err = run_cli(failing)
        assert code == 2 and "no_such_corpus" in err, err
    made = sorted(p.name for p in (tmp_path / "runs").glob("compare-*"))
    assert made == ["compare-micro-20260101-000000", "compare-micro-20260101-000000-2"]
    assert all((tmp_path / "runs" / name / "compare_plan.json").is_file() for name in made)
