"""experiments/bench_metrics_fetch.py refuses bad options before its first training run (exit 2, one
line naming the option), instead of failing after every run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench_metrics_fetch.py"


@pytest.mark.parametrize("args,message", [(["--steps", "1"], "--steps must be >= 2"),
                                          (["--repeats", "0"], "--repeats must be >= 1"),
                                          (["--out", "FILE"], "is a file")])
def test_bad_options_are_refused_before_any_run(tmp_path, args, message):
    a_file = tmp_path / "taken.json"
    a_file.write_text("{}")
    args = [str(a_file) if a == "FILE" else a for a in args]
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", "micro", *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert a_file.read_text() == "{}"
