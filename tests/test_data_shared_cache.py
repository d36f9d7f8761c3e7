"""Multi-process data builds (twell_jax/training/shared_data.py): in a run of two jax.distributed CPU
processes on 127.0.0.1, process 0 alone builds the tokenizer and token caches, byte for byte those
of a one-process build, while process 1 waits (reporting process 0's progress) and then opens them;
process 0's failure or a build past TWELL_DATA_TIMEOUT_S stops both with one message; a process
that does not share data.cache_dir builds its own copy. Each process is a small script calling
`build_data` (not `twell train`: no model is compiled), under a hard timeout."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from twell_jax.config import DataConfig
from twell_jax.data import build_data
from twell_jax.training import shared_data

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # per launch of two processes; a normal one takes seconds
GLOBAL_BATCH, STEPS = 4, 3
WORDS = "alpha beta gamma delta sparse dense kernel tile gate relu".split()

# One process of the run: builds the data for its slice of GLOBAL_BATCH and prints what it got as
# JSON (or the error). `lead_sleep_s` holds process 0's tokenization back (the wait's tests).
_WORKER = """
import json, sys, time
from twell_jax.training import parallel
parallel.initialize_distributed()
import jax
from twell_jax.config import DataConfig
from twell_jax.data import build_data, cache as cache_lib
from twell_jax.training.shared_data import build_once
spec = json.loads(sys.argv[1])
if spec.get("lead_sleep_s") and jax.process_index() == 0:
    encode_chunks = cache_lib.encode_chunks
    def slow(*args, **kwargs):
        time.sleep(spec["lead_sleep_s"])
        yield from encode_chunks(*args, **kwargs)
    cache_lib.encode_chunks = slow
try:
    with parallel.all_or_none("building the data"):
        bundle = build_data(DataConfig(**spec["data"]), global_batch=spec["global_batch"],
                            process_index=jax.process_index(), process_count=jax.process_count(),
                            coordinate=build_once)
except ValueError as error:
    print(json.dumps({"error": str(error)}))
    sys.exit(3)
print(json.dumps({"cache_path": bundle.cache_path, "tokenizer": bundle.tokenizer_json_path,
                  "built_tokens": bundle.built_tokens, "built_tokenizer": bundle.built_tokenizer,
                  "batches": [next(bundle.train_iter)["tokens"].tolist() for _ in range(spec["steps"])]}))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_two(data: dict, cwds: list[Path], lead_sleep_s: float = 0.0, **env_extra: str) -> list[tuple[int, dict, str]]:
    """(exit status, the JSON it printed, stderr) of each of two processes joined in one run."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                                "TWELL_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **env_extra)
    spec = json.dumps({"data": data, "global_batch": GLOBAL_BATCH, "steps": STEPS, "lead_sleep_s": lead_sleep_s})
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, spec], cwd=cwd, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**env, "JAX_PROCESS_ID": str(index)})
             for index, cwd in enumerate(cwds)]
    deadline, results = time.monotonic() + LAUNCH_TIMEOUT_S, []
    try:
        for index, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {index} still running after {LAUNCH_TIMEOUT_S} s (a hang)")
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"process {index} exited {proc.returncode} without a result:\n{err[-3000:]}"
            results.append((proc.returncode, json.loads(lines[-1]), err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _write_corpus(path: Path, num_docs: int = 400) -> None:
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(10, 80))))}) + "\n"
                            for _ in range(num_docs)))


def _data(source: Path | str, cache_dir: Path | str) -> dict:
    return dict(source=str(source), cache_dir=str(cache_dir), vocab_size=300, seq_len=15, val_fraction=0.1,
                tokenize_workers=1)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_process_0_builds_the_caches_once_and_they_equal_a_one_process_build(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus)
    single = build_data(DataConfig(**_data(corpus, tmp_path / "one"), progress=False), global_batch=GLOBAL_BATCH)
    one_batches = [next(single.train_iter)["tokens"] for _ in range(STEPS)]

    shared = tmp_path / "shared"
    (code0, lead, err0), (code1, other, err1) = _run_two(_data(corpus, shared), [tmp_path, tmp_path])
    assert (code0, code1) == (0, 0), err0[-3000:] + err1[-3000:]
    # Process 0 trained the BPE and tokenized; process 1 read nothing and opened the same caches.
    assert (lead["built_tokenizer"], lead["built_tokens"]) == (True, True)
    assert (other["built_tokenizer"], other["built_tokens"]) == (False, False)
    assert other["cache_path"] == lead["cache_path"] and other["tokenizer"] == lead["tokenizer"]
    assert "process 1 of 2: waiting for process 0 to build the data caches in" in err1
    assert "tokenized" not in err1 and "training a byte-level BPE" not in err1, err1
    # Byte for byte the one-process build (tokenizer and token cache), published once, no probe left.
    assert Path(lead["tokenizer"]).read_bytes() == Path(single.tokenizer_json_path).read_bytes()
    assert _files(Path(lead["cache_path"])) == _files(Path(single.cache_path))
    assert [p.name for p in (shared / "tokens").iterdir()] == [Path(lead["cache_path"]).name]
    assert not [p for p in shared.iterdir() if p.name.startswith(".")]
    # Each process's rows, stacked in process order, are the one-process batch.
    for step in range(STEPS):
        np.testing.assert_array_equal(np.concatenate([lead["batches"][step], other["batches"][step]]),
                                      one_batches[step])


def test_an_error_of_process_0_stops_both_with_its_message(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus)
    with open(corpus, "a") as handle:
        handle.write("{not json\n")
    (code0, lead, _), (code1, other, _) = _run_two(_data(corpus, tmp_path / "cache"), [tmp_path, tmp_path])
    assert (code0, code1) == (3, 3)
    assert lead["error"].startswith(f"{corpus}:401: not valid JSON (")
    # Process 1 did not read the corpus: it reports process 0's error.
    assert other["error"] == f"process 0 of 2 failed: {lead['error']}"


@pytest.mark.slow
def test_a_build_past_the_timeout_is_reported_on_the_way_then_stops_both(tmp_path):
    """Reports every half second here (a quarter of TWELL_AGREE_TIMEOUT_S), then one message on
    both processes naming TWELL_DATA_TIMEOUT_S; nothing is published."""
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus)
    started = time.monotonic()
    (code0, lead, _), (code1, other, err1) = _run_two(_data(corpus, tmp_path / "cache"), [tmp_path, tmp_path],
                                                      lead_sleep_s=30.0, TWELL_DATA_TIMEOUT_S="4",
                                                      TWELL_AGREE_TIMEOUT_S="2")
    assert (code0, code1) == (3, 3)
    assert lead["error"].startswith("process 0 has built the data for ")
    assert "s (tokenizing: 0 of 400 documents), longer than TWELL_DATA_TIMEOUT_S=4 s: raise it" in lead["error"]
    assert other["error"] == f"process 0 of 2 failed: {lead['error']}"
    reports = re.findall(r"process 1 of 2: process 0 builds the data \(tokenizing: 0 of 400 documents; (\d+) s so far\)",
                         err1)
    assert len(reports) >= 3 and reports == sorted(reports, key=int), err1[-3000:]
    assert time.monotonic() - started < 25  # not the 30 s that process 0's tokenization was held back
    assert not list((tmp_path / "cache" / "tokens").glob("*/meta.json"))


@pytest.mark.slow
def test_a_process_that_does_not_share_the_cache_dir_builds_its_own_copy(tmp_path):
    """data.cache_dir relative, the processes in different working directories (two hosts with
    their own disks): each builds its copy, and the copies are the same bytes."""
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (code0, lead, err0), (code1, other, err1) = _run_two(_data(corpus, "cache"), [tmp_path / "a", tmp_path / "b"])
    assert (code0, code1) == (0, 0), err0[-3000:] + err1[-3000:]
    assert lead["built_tokens"] and other["built_tokens"]
    assert "data.cache_dir='cache' is not the directory process 0 builds the data caches in" in err1
    # Its own copy built, it takes process 0's reports without printing them as if it were waiting.
    assert "waiting for process 0" not in err1 and "process 0 builds the data (" not in err1
    assert _files(tmp_path / "a" / lead["cache_path"]) == _files(tmp_path / "b" / other["cache_path"])
    assert lead["batches"] != other["batches"]  # each its own slice


def test_the_build_timeout_is_read_from_its_variable(monkeypatch):
    # The parsing is parallel.env_seconds' (tests/test_multiprocess.py): here, which variable.
    value = "0"
    monkeypatch.setenv(shared_data.BUILD_TIMEOUT_VARIABLE, value)
    with pytest.raises(ValueError, match=f"^environment variable TWELL_DATA_TIMEOUT_S must be a positive number "
                                         f"of seconds, got '{value}'$"):
        shared_data.build_timeout_s()
    monkeypatch.setenv(shared_data.BUILD_TIMEOUT_VARIABLE, "90")
    assert shared_data.build_timeout_s() == 90.0
