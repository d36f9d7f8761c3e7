"""experiments/bench_data_parallel.py's profiler window (--trace-steps): every run is traced, and a
bad window is a one-line usage error before anything runs (the overlap figures themselves:
tests/test_kernel_trace.py)."""
from __future__ import annotations

import pytest

from twell_jax.bench import data_parallel
from twell_jax.configs import get_config


def test_the_window_goes_to_every_run():
    base = get_config("micro")
    assert data_parallel.bench_config(base, "relu_gated", 1, 2, 6, "3:5").train.profile_steps == "3:5"
    assert data_parallel.bench_config(base, "relu_gated", 2, 2, 6, "3:5").train.profile_steps == "3:5"
    assert data_parallel.bench_config(base, "relu_gated", 2, 2, 6).train.profile_steps == ""


@pytest.mark.parametrize("window, says", [("5", "START:END"), ("4:3", "START:END"), ("9:10", "after the last step")])
def test_a_bad_trace_window_is_a_usage_error(window, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        data_parallel.main(["--config", "micro", "--devices", "1", "--steps", "6", "--warmup", "1",
                            "--trace-steps", window, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--trace-steps:" in err and says in err
    assert not (tmp_path / "out").exists()


def test_gpu_time_efficiency_takes_the_slowest_gpu():
    one = {"collectives": [{"step_ms": 190.0}]}
    two = {"collectives": [{"step_ms": 195.0}, {"step_ms": 200.0}]}
    assert data_parallel.gpu_time_efficiency(two, one) == pytest.approx(0.95)
    assert data_parallel.gpu_time_efficiency(two, {"collectives": []}) is None  # a CPU trace: no GPU planes
    assert data_parallel.gpu_time_efficiency({}, one) is None  # not traced


def test_accumulation_steps_scale_the_global_batch_and_reach_the_trainer():
    """--accum N: N micro-batches per optimizer step on each device (the preset's real layout at its
    global batch), which the trainer's batch layout resolves back to N accumulation steps."""
    from twell_jax.training import parallel

    base = get_config("micro")
    cfg = data_parallel.bench_config(base, "relu_gated", 2, 3, 6, accum=4)
    assert (cfg.train.global_batch, cfg.train.micro_batch) == (24, 3)
    assert parallel.check_batch_layout(cfg.train.global_batch, cfg.train.micro_batch, 2) == 4
    assert data_parallel.bench_config(base, "relu_gated", 2, 3, 6).train.global_batch == 6


def test_a_bad_accum_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        data_parallel.main(["--config", "micro", "--devices", "1", "--accum", "0", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "--accum must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
