"""experiments/bench_metrics_fetch.py (and measure_corpus.py's --out) refuse bad options before the
first training run or corpus pass (exit 2, one line naming the option), instead of failing after all
of them."""
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


def test_measure_corpus_refuses_a_file_as_out_before_reading_the_corpus(tmp_path):
    a_file = tmp_path / "taken.json"
    a_file.write_text("{}")
    script = SCRIPT.parent / "measure_corpus.py"
    done = subprocess.run([sys.executable, str(script), "--source", "synthetic", "--out", str(a_file)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "is a file" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert a_file.read_text() == "{}"
