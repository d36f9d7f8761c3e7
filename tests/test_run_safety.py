"""Issue 26 (run safety): a resume never trains silently at learning rate 0, never re-runs a finished
run, `--overwrite` never empties a directory that is not a twell run, one process at a time in a run
directory, unique default directories, plain run names, and a resumed run plans with hints measured
on its trained parameters. Micro model, fake data (test_train.FakeData) where the CLI is not needed."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from test_train import FakeData, micro_cfg
from twell_jax.cli import main
from twell_jax import run_dir as run_dir_lib
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax.training import preflight
from twell_jax.training.optimizer import learning_rate_schedule
from twell_jax.training.planning import PlanController
from twell_jax.training.train import Trainer

REPO = Path(__file__).resolve().parents[1]


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> bytes)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step micro run (micro: cosine to 0 over its 4 steps) and its final state."""
    run = tmp_path_factory.mktemp("safety") / "run"
    result = Trainer(micro_cfg("train.tensorboard=false"), run, data_builder=FakeData).run()
    return run, result


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


# ----------------------------------------------------------------------------- item 1: lr 0 after the schedule


@pytest.mark.slow
def test_resume_past_the_schedule_is_refused_naming_the_field_then_stretched(finished, tmp_path):
    run = _copy(finished[0], tmp_path)
    before = _snapshot(run)
    with pytest.raises(ValueError, match=r"steps 5-8 would train at learning rate 0.*--set optim\.schedule_steps=8"):
        Trainer(micro_cfg("train.steps=8"), run, resume=True, data_builder=FakeData)
    assert _snapshot(run) == before
    assert not (run / run_dir_lib.LOCK_FILE).exists()
    # With the schedule stretched explicitly the steps train: a non-zero lr and parameters that move.
    messages: list[str] = []
    result = Trainer(micro_cfg("train.steps=8", "optim.schedule_steps=8"), run, resume=True,
                     data_builder=FakeData, echo=messages.append).run()
    assert [r["step"] for r in result.history] == list(range(1, 9))
    assert all(r["lr"] > 0 for r in result.history[4:])
    assert any("optim.schedule_steps 4 -> 8" in m for m in messages)
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                         finished[1].state["params"], result.state["params"])
    assert all(jax.tree.leaves(moved))


def test_a_new_run_past_its_own_schedule_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"optim\.schedule_steps >= train\.steps"):
        Trainer(micro_cfg("train.steps=6", "optim.schedule_steps=4"), tmp_path / "r", data_builder=FakeData)
    assert not (tmp_path / "r").exists()
    # A constant schedule, or a cosine to a non-zero floor, has no zero-lr steps: allowed.
    assert preflight.zero_lr_from(micro_cfg("optim.schedule=constant", "optim.schedule_steps=2")) is None
    assert preflight.zero_lr_from(micro_cfg("optim.min_lr_ratio=0.1")) is None


@pytest.mark.parametrize("warmup,horizon", [(2, 4), (0, 4), (5, 3), (1, 1), (0, 1)])
def test_zero_lr_from_is_where_the_schedule_reaches_0(warmup, horizon):
    cfg = micro_cfg(f"optim.warmup_steps={warmup}", f"optim.schedule_steps={horizon}", f"train.steps={horizon}")
    zero = preflight.zero_lr_from(cfg)
    lr = learning_rate_schedule(cfg.optim, cfg.schedule_steps)
    assert float(lr(zero - 1)) > 0 and all(float(lr(i)) == 0.0 for i in range(zero, zero + 3))


def test_cli_dry_run_of_a_resume_past_the_schedule_exits_2_and_changes_nothing(finished, tmp_path, capsys):
    """A dry run checks as the resume does (the resume itself: test_run_trust.py,
    test_resume_uses_the_saved_config_and_never_trains_at_lr_0)."""
    run = _copy(finished[0], tmp_path)
    before = _snapshot(run)
    assert main(["train", "--out", str(run), "--resume", "--set", "train.steps=8", "--dry-run"]) == 2
    assert "--set optim.schedule_steps=8" in capsys.readouterr().err
    assert _snapshot(run) == before


# ----------------------------------------------------------------------------- item 10: finished runs


@pytest.mark.parametrize("steps,words", [(4, "is finished"), (2, "is past train.steps=2")])
def test_resume_of_a_finished_run_or_below_its_step_changes_nothing(finished, tmp_path, capsys, steps, words):
    run = _copy(finished[0], tmp_path)
    before = _snapshot(run)
    assert main(["train", "--out", str(run), "--resume", "--set", f"train.steps={steps}"]) == 2
    err = capsys.readouterr().err
    assert words in err and "step 4" in err and "train.steps=N" in err
    assert _snapshot(run) == before  # config.json, metrics.jsonl, summary.json: byte for byte


# ----------------------------------------------------------------------------- item 2: --overwrite


def test_overwrite_never_empties_a_directory_that_is_not_a_run(tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("x")
    argv = ["train", "--config", "micro", "--out", str(precious)]
    for extra in ([], ["--overwrite"], ["--dry-run"], ["--dry-run", "--overwrite"]):  # a dry run checks as the run
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert "thesis.tex" in err and "not a twell run" in err and "--overwrite" not in err
        assert _snapshot(precious) == {"thesis.tex": b"x"}
    # A config.json that twell did not write does not make a run either.
    (precious / "thesis.tex").unlink()
    (precious / "config.json").write_text('{"learning_rate": 3}')
    assert main([*argv, "--overwrite"]) == 2
    assert "no config.json written by twell" in capsys.readouterr().err
    assert (precious / "config.json").read_text() == '{"learning_rate": 3}'


def test_overwrite_refuses_a_run_with_foreign_files_and_replaces_a_clean_one(finished, tmp_path):
    run = _copy(finished[0], tmp_path)
    (run / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="is a file"):
        Trainer(micro_cfg(), tmp_path / "file", data_builder=FakeData)
    with pytest.raises(ValueError, match="notes.txt"):
        Trainer(micro_cfg(), run, overwrite=True, data_builder=FakeData)
    assert (run / "notes.txt").read_text() == "mine" and (run / "summary.json").exists()
    (run / "notes.txt").unlink()
    Trainer(micro_cfg("train.steps=1", "train.tensorboard=false"), run, overwrite=True, data_builder=FakeData).run()
    assert ckpt_lib.CheckpointStore(run / "checkpoints", create=False).all_steps() == [1]


# ----------------------------------------------------------------------------- item 3: the lock


def test_a_second_trainer_in_a_locked_run_is_refused_naming_the_pid(tmp_path):
    first = Trainer(micro_cfg("train.steps=1"), tmp_path / "r", data_builder=FakeData)
    lock = tmp_path / "r" / run_dir_lib.LOCK_FILE
    assert lock.read_text().startswith(f"pid {os.getpid()} ")
    with pytest.raises(run_dir_lib.RunLockedError, match=rf"{lock}.*pid {os.getpid()}"):
        Trainer(micro_cfg("train.steps=1"), tmp_path / "r", overwrite=True, data_builder=FakeData)
    first.run()
    assert not lock.exists()  # released at the end of the run
    Trainer(micro_cfg("train.steps=2"), tmp_path / "r", resume=True, data_builder=FakeData).run()


def test_cli_refuses_a_run_locked_by_another_process_and_takes_over_a_stale_lock(finished, tmp_path, capsys):
    run = _copy(finished[0], tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from twell_jax.run_dir import RunLock; "
         "held = RunLock(sys.argv[1]); print('locked', flush=True); time.sleep(600)", str(run)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _snapshot(run)
        argv = ["train", "--out", str(run), "--resume", "--set", "train.steps=8", "optim.schedule_steps=8"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert str(run / run_dir_lib.LOCK_FILE) in err and f"pid {holder.pid} " in err
        assert _snapshot(run) == before
    finally:
        holder.kill()  # like kill -9: the kernel drops the flock, the file stays behind
        holder.wait()
    assert f"pid {holder.pid} " in (run / run_dir_lib.LOCK_FILE).read_text()
    messages: list[str] = []
    trainer = Trainer(micro_cfg("train.steps=5", "optim.schedule_steps=5"), run, resume=True,
                      data_builder=FakeData, echo=messages.append)
    assert any("taking over the lock" in m and f"pid {holder.pid} " in m for m in messages)
    trainer.release()
    assert not (run / run_dir_lib.LOCK_FILE).exists()


# ----------------------------------------------------------------------------- item 11: names and hints


def test_default_run_dirs_are_unique_within_a_second(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")
    cfg = micro_cfg()
    dirs = [run_dir_lib.default_run_dir(cfg, tmp_path) for _ in range(3)]
    assert [d.name for d in dirs] == ["micro-20260101-000000", "micro-20260101-000000-2", "micro-20260101-000000-3"]
    assert all(d.is_dir() and not any(d.iterdir()) for d in dirs)


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ""])
def test_a_run_name_with_a_path_is_refused(tmp_path, name, capsys):
    with pytest.raises(ValueError, match="name="):
        Trainer(micro_cfg(f"name={name}"), tmp_path / "r", data_builder=FakeData)
    assert not (tmp_path / "r").exists()
    assert main(["train", "--config", "micro", "--set", f"name={name}"]) == 2
    assert "a run name must be one plain directory name" in capsys.readouterr().err


def test_a_resumed_run_plans_with_hints_measured_on_its_trained_parameters(finished, tmp_path, monkeypatch):
    run = _copy(finished[0], tmp_path)
    initial = finished[1].last_metrics["auto_hints_per_layer"]  # measured at initialisation, never re-planned
    measured = []
    original = PlanController.measure

    def spy(self, state):
        measured.append((int(state["step"]), original(self, state)))
        return measured[-1][1]

    monkeypatch.setattr(PlanController, "measure", spy)
    result = Trainer(micro_cfg("train.steps=5", "optim.schedule_steps=5"), run, resume=True,
                     data_builder=FakeData).run()
    assert [step for step, _ in measured] == [4]  # on the restored (trained) parameters
    assert result.last_metrics["auto_hints_per_layer"] == list(measured[0][1][0])
    assert result.last_metrics["auto_hints_per_layer"] != initial


def test_a_file_system_without_flock_warns_and_trains(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    messages: list[str] = []
    lock = run_dir_lib.RunLock(tmp_path, warn=messages.append)
    assert any("does not support flock" in m for m in messages)
    assert not (tmp_path / run_dir_lib.LOCK_FILE).exists()
    lock.release()


def test_a_failed_init_from_run_leaves_no_reserved_run_directory(tmp_path, monkeypatch, capsys):
    """`twell train --init-from` without --out reserves runs/<name>-<time> like any new run; a run
    that fails before training removes it again (as `train()` does for the other runs)."""
    import types

    from twell_jax import cli
    from twell_jax.model import init_model

    cfg = micro_cfg("data.source=synthetic")
    imported = types.SimpleNamespace(config=cfg, model=init_model(cfg.model, 0), tokenizer=None)
    monkeypatch.setattr(cli, "_imported", lambda *args, **kwargs: imported)

    def fail(self, *args, **kwargs):
        raise ValueError("data.source: a failure while building the run")

    monkeypatch.setattr(Trainer, "_build", fail)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--config", "micro", "--init-from", "hf_dir", "--set", "data.source=synthetic"])
    assert code == 2 and "a failure while building the run" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
