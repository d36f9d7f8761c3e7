"""The `twell` CLI end to end on the micro preset: train, eval, compare, errors."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from twell_jax.cli import main


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "twell_data_cache")


@pytest.fixture(scope="module")
def compared(tmp_path_factory, cache_dir):
    """One `twell compare` (a dense and a sparse 2-step run) for the eval tests (`twell train` itself
    is exercised by tests/test_run_trust.py, `twell compare` by tests/test_compare.py)."""
    out = tmp_path_factory.mktemp("cli") / "cmp"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["compare", "--config", "micro", "--out", str(out),
                     "--set", f"data.cache_dir={cache_dir}", "train.steps=2"]) == 0
    return out, printed.getvalue()


def test_eval_reproduces_the_runs_validation(compared, capsys):
    run = compared[0] / "twell-l1-0.001"  # the sparse run (micro's L1); the study's own tests: test_compare.py
    assert main(["eval", "--checkpoint", str(run)]) == 0
    text = capsys.readouterr().out
    result = json.loads(text[text.index("{"):])
    summary = json.loads((run / "summary.json").read_text())
    assert result["step"] == 2
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)  # same params, same val batches
    # eval hands the "auto" backend the hints the checkpoint was trained with (trace-time plan).
    assert result["auto_hints_per_layer"] == summary["auto_hints_per_layer"] is not None


@pytest.mark.parametrize("argv,message", [
    (["train", "--config", "micro", "--set", "model.n_layers=x"], "model.n_layers expects an int"),
    (["train", "--config", "nope"], "unknown config 'nope'"),
    (["train", "--config", "micro", "--resume"], "--resume needs --out"),
])
def test_errors_are_reported_cleanly(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_eval_of_missing_checkpoint(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
