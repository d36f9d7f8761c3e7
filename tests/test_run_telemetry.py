"""What a run records around its steps (twell_jax/training/metrics.py, profiling.py): MFU from the
device table, the optional Weights & Biases sink (offline mode: no network) and the profiler window
train.profile_steps."""
import dataclasses
import glob
import json
import sys

import pytest

from twell_jax import config as config_lib
from twell_jax.cli import main
from twell_jax.config import ModelConfig, TrainConfig
from twell_jax.training import metrics


def test_peak_flops_table_and_model_flops():
    assert metrics.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert metrics.peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert metrics.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert metrics.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    for unknown in ("cpu", "TFRT_CPU_0", "NVIDIA H100 NVL", "NVIDIA GeForce RTX 4090", ""):
        assert metrics.peak_bf16_flops(unknown) is None  # no made-up number: MFU is left out
    cfg = ModelConfig(vocab_size=49152, d_model=2048, n_layers=8, n_heads=32, d_ff=5632, max_seq_len=2048)
    assert metrics.model_flops_per_token(cfg, 2048) == 6 * cfg.num_params() + 12 * 8 * 2048 * 2048
    # Untied: one more [V, D] matrix, but the input embedding is a gather; the output head's product is
    # the same one the tied model runs with its embedding: the same FLOPs.
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    assert untied.num_params() == cfg.num_params() + 49152 * 2048
    assert metrics.model_flops_per_token(untied, 2048) == metrics.model_flops_per_token(cfg, 2048)
    assert metrics.mfu(1000.0, 3e9, 1e13) == pytest.approx(0.3)
    assert metrics.mfu(1000.0, 3e9, None) is None


@pytest.mark.parametrize("field,value,message", [
    ("profile_steps", "10", "train.profile_steps must be 'START:END'"),
    ("profile_steps", "5:5", "train.profile_steps must be 'START:END'"),
    ("profile_steps", "0:3", "train.profile_steps must be 'START:END'"),
    ("profile_steps", "50:60", "train.profile_steps='50:60' starts after the last step (train.steps=4)"),
    ("wandb_project", "team/project", "train.wandb_project must be a W&B project name"),
])
def test_bad_telemetry_fields_are_errors_naming_them(capsys, field, value, message):
    assert main(["train", "--config", "micro", "--set", f"train.{field}={value}", "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_wandb_missing_is_an_error_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ValueError, match=r"train.wandb_project='p': the wandb package is not installed"):
        metrics.MetricsSink(tmp_path, tensorboard=False, total_steps=1, start_step=0, progress_bar=False,
                            wandb_project="p")


def test_a_run_logs_mfu_to_wandb_and_traces_its_profile_window(tmp_path, monkeypatch):
    """A bf16 micro run on a device kind given a peak (the CPU has none): every record's MFU is
    tokens/s per device x model FLOPs per token / peak; the same records reach an offline W&B run;
    steps 2-3 are traced into <run>/profile/."""
    pytest.importorskip("wandb")
    from twell_jax.training import train as train_lib

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(train_lib, "peak_bf16_flops", lambda kind: 1e9)
    out = tmp_path / "run"
    assert main(["train", "--config", "micro", "--out", str(out), "--set", "model.compute_dtype=bfloat16",
                 "train.profile_steps=2:4", "train.wandb_project=twell-tests",
                 f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "ce" in r]
    cfg = config_lib.from_dict(json.loads((out / "config.json").read_text()))
    per_token = metrics.model_flops_per_token(cfg.model, cfg.seq_len)
    assert len(steps) == 4
    for r in steps:
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * per_token / 1e9, rel=1e-9)
    assert json.loads((out / "summary.json").read_text())["mfu"] > 0
    traces = glob.glob(str(out / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1
    (log,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(log, "rb").read()
    for tag in (b"train/mfu", b"train/loss", b"train/l0/layer_1", b"val/val_loss", b"twell-tests"):
        assert tag in data, tag
    run_id = (out / "wandb" / "twell_run_id").read_text().strip()
    assert log.endswith(f"run-{run_id}.wandb")


def test_profile_window_syncs_and_resumes_inside_the_window(tmp_path):
    from twell_jax.training.profiling import ProfileWindow

    window = ProfileWindow(TrainConfig(steps=20, profile_steps="5:8").profile_window, tmp_path, start_step=0,
                           enabled=False)
    assert [s for s in range(1, 21) if window.needs_sync(s)] == [4, 7]
    resumed = ProfileWindow((5, 8), tmp_path, start_step=5, enabled=False)  # resumed after step 5
    assert resumed.first == 6 and [s for s in range(6, 21) if resumed.needs_sync(s)] == [7]
    assert ProfileWindow((5, 8), tmp_path, start_step=7, enabled=False).first is None  # nothing left
    assert ProfileWindow(None, tmp_path, start_step=0, enabled=True).needs_sync(1) is False
