"""The `twell` CLI end to end on the micro preset: train, eval, compare, errors."""
from __future__ import annotations

import json

import pytest

from twell_jax.cli import main


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "twell_data_cache")


def test_train_then_eval(tmp_path, cache_dir, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", "micro", "--out", str(out),
                 "--set", f"data.cache_dir={cache_dir}", "train.steps=2"]) == 0
    text = capsys.readouterr().out
    assert f"run dir: {out.absolute()}" in text and "val_loss" in text
    assert (out / "config.json").exists() and (out / "metrics.jsonl").exists() and (out / "summary.json").exists()
    assert (out / "checkpoints" / "2").is_dir()

    assert main(["eval", "--checkpoint", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(text[text.index("{"):])
    summary = json.loads((out / "summary.json").read_text())
    assert result["step"] == 2
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)  # same params, same val batches
    # eval hands the run's last per-layer activity to the "auto" backend as trace-time hints.
    hints = ", ".join(f"{v:.1f}" for v in summary["val_l0_per_layer"])
    assert f"'auto' backend hints (expected active neurons/token per layer, from the run's metrics.jsonl): {hints}" in text


def test_compare_writes_table_png_and_summaries(tmp_path, cache_dir, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--config", "micro", "--out", str(out),
                 "--set", f"data.cache_dir={cache_dir}", "train.steps=2"]) == 0
    text = capsys.readouterr().out
    assert "relative CE change" in text and "FFN activation sparsity" in text
    for name in ("compare.png", "compare.md", "compare.json"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "compare.json").read_text())
    assert summary["dense"]["ffn_kind"] == "relu_gated" and summary["dense"]["l1_coef"] == 0.0
    assert summary["twell"]["ffn_kind"] == "twell" and summary["twell"]["l1_coef"] > 0
    assert (out / "dense" / "checkpoints").is_dir() and (out / "twell" / "checkpoints").is_dir()


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
