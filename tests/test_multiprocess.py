"""Multi-process runs (issue 43): `twell train`, `twell eval` and `twell compare` started as two
processes joined by jax.distributed on 127.0.0.1 (CPU devices, Gloo collectives), the way
docs/parallel.md launches them on several hosts.

The tests that start processes of the CLI run each under a hard timeout: a run that hangs fails here
instead of blocking CI. Those that train are in the slow tier; refusals that need no training
(different configs or arguments, an unreachable coordinator, a checkpoint the processes do not see
alike) stay in the fast one. The others check the single-process side of the same code (the
agreement helpers are no-ops there, the stop vote's wrapper, the sink of a process that writes no
files, the agreed verdict on a checkpoint).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.training import parallel as par
from twell_jax.training import step as step_lib
from twell_jax.training.metrics import MetricsSink

REPO = Path(__file__).resolve().parents[1]
# The CLI's micro preset on synthetic tokens, sized for 2 devices in all (one per process, or two in
# one process): micro_batch 2 x 2 devices x 2 accumulation steps = the preset's global batch of 8.
RUN_SETTINGS = ["data.source=synthetic", "train.num_devices=2", "train.micro_batch=2", "optim.schedule_steps=6"]
# Fast CPU compiles for tiny shapes, as tests/conftest.py sets for the test process itself.
_FAST_XLA = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
             "--xla_cpu_use_fusion_emitters=false")
LAUNCH_TIMEOUT_S = 180  # per launch; a normal one takes seconds
REFUSAL_TIMEOUT_S = 120  # a refusal comes before any training


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(devices: int, **extra: str) -> dict[str, str]:
    """The test's environment for a CLI process with `devices` CPU devices and no launcher variables
    (no compilation cache: two processes writing the same entries at once is not what is tested)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                                "JAX_COMPILATION_CACHE", "TWELL_"))}
    env.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {_FAST_XLA}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def _start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "twell_jax.cli", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _start_group(per_process: list[list[str]], cwd: Path, devices: int = 1, **extra: str) -> list[subprocess.Popen]:
    """One CLI process of `devices` CPU devices per argument list, joined as process 0, 1, ... of one
    jax.distributed run."""
    address = f"127.0.0.1:{_free_port()}"
    return [_start(args, _env(devices, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(len(per_process)),
                              JAX_PROCESS_ID=str(index), **extra), cwd)
            for index, args in enumerate(per_process)]


def _finish(procs: list[subprocess.Popen], timeout: float = LAUNCH_TIMEOUT_S) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process; every process is killed after `timeout` seconds
    in all, and the test fails naming the ones that had not finished."""
    deadline = time.monotonic() + timeout
    results, hung = [], []
    try:
        for index, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                hung.append(index)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if hung:
        tails = "\n".join(f"--- process {i} stderr:\n{results[i][2][-2000:]}" for i in hung)
        pytest.fail(f"process(es) {hung} still running after {timeout:g} s (a hang):\n{tails}")
    return results


def _run_group(per_process: list[list[str]], cwd: Path, timeout: float = LAUNCH_TIMEOUT_S, devices: int = 1,
               **extra: str) -> list[tuple[int, str, str]]:
    return _finish(_start_group(per_process, cwd, devices, **extra), timeout)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


def _train_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "loss" in r]


def _assert_ok(results: list[tuple[int, str, str]]) -> None:
    for index, (code, _, err) in enumerate(results):
        assert code == 0, f"process {index} exited {code}:\n{err[-3000:]}"


# ============================================================================= two processes (slow)


@pytest.mark.slow
def test_two_processes_train_resume_and_match_one_process(tmp_path):
    """The documented launch (a shared --out): two processes train 3 steps and checkpoint, resume
    to 6, and match one process of 2 devices trained 6 steps straight: the same losses, one record
    per step in metrics.jsonl, the run's files written once."""
    run = tmp_path / "two"
    first = _run_group([["train", "--config", "micro", "--set", *RUN_SETTINGS, "train.steps=3", "--out", str(run),
                         "--json"]] * 2, tmp_path)
    _assert_ok(first)
    for _, out, _ in first:  # the results on stdout are JSON (Gloo's own lines went to stderr)
        assert json.loads(out)["run_dir"] == str(run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json", "data_fingerprint.json",
                                                      "metrics.jsonl", "summary.json"]
    _assert_ok(_run_group([["train", "--out", str(run), "--resume", "--set", "train.steps=6"]] * 2, tmp_path))

    one = tmp_path / "one"
    single = _finish([_start(["train", "--config", "micro", "--set", *RUN_SETTINGS, "train.steps=6", "--out", str(one)],
                             _env(2), tmp_path)])
    _assert_ok(single)

    two_records, one_records = _train_records(run), _train_records(one)
    assert [r["step"] for r in two_records] == list(range(1, 7))  # each step once: process 0 alone writes
    assert [r["step"] for r in one_records] == list(range(1, 7))
    for key in ("loss", "ce", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in two_records], [r[key] for r in one_records], rtol=1e-6,
                                   err_msg=f"{key}: two processes vs one")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["num_devices"] == 2
    assert summary["val_loss"] == pytest.approx(json.loads((one / "summary.json").read_text())["val_loss"], rel=1e-6)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]


@pytest.mark.slow
def test_two_processes_of_two_devices_train_hybrid_like_one_replicated_process(tmp_path):
    """The two-level mesh across processes: 2 processes x 2 CPU devices with train.sharding=hybrid
    (FSDP over each process's 2 devices, data parallel across the processes: a data 2 x fsdp 2 mesh)
    train, checkpoint and evaluate with the losses of one process of 4 devices replicated, and every
    process prints that layout."""
    settings = ["data.source=synthetic", "train.num_devices=4", "train.micro_batch=2", "train.steps=3",
                "optim.schedule_steps=3"]
    run = tmp_path / "hybrid"
    results = _run_group([["train", "--config", "micro", "--set", *settings, "train.sharding=hybrid",
                           "--out", str(run)]] * 2, tmp_path, devices=2)
    _assert_ok(results)
    for _, out, err in results:
        assert ("[twell] sharding: hybrid (mesh data 2 x fsdp 2): train.sharding=hybrid, FSDP groups of one "
                "process's 2 devices") in out + err
    one = tmp_path / "one"
    _assert_ok(_finish([_start(["train", "--config", "micro", "--set", *settings, "train.sharding=replicate",
                                "--out", str(one)], _env(4), tmp_path)]))
    hybrid_records, one_records = _train_records(run), _train_records(one)
    assert [r["step"] for r in hybrid_records] == [r["step"] for r in one_records] == [1, 2, 3]
    for key in ("loss", "ce", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in hybrid_records], [r[key] for r in one_records], rtol=1e-5,
                                   err_msg=f"{key}: hybrid over two processes vs one replicated process")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_devices"] == 4 and summary["val_loss"] == pytest.approx(
        json.loads((one / "summary.json").read_text())["val_loss"], rel=1e-5)
    assert [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()] == [3]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
    """A signal that reaches one process only: both stop after the same step (the stop vote), save
    that step's checkpoint together and exit 143, and metrics.jsonl holds each step once."""
    run = tmp_path / "run"
    args = ["train", "--config", "micro", "--set", *RUN_SETTINGS, "train.steps=5000", "optim.schedule_steps=5000",
            "--out", str(run)]
    procs = _start_group([args, args], tmp_path)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    metrics = run / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            _finish(procs, timeout=5)
            pytest.fail("the run did not start training")
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    results = _finish(procs)
    steps = set()
    for index, (code, _, err) in enumerate(results):
        assert code == 143, f"process {index} exited {code}:\n{err[-3000:]}"
        line = next(l for l in err.splitlines() if "SIGTERM received: stopped after step" in l)
        steps.add(int(line.split("stopped after step ")[1].split(";")[0]))
    assert len(steps) == 1, f"the processes stopped after different steps: {steps}"
    stopped = steps.pop()
    assert stopped < 5000
    assert [r["step"] for r in _train_records(run)] == list(range(1, stopped + 1))
    assert stopped in [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]


def test_processes_with_different_configs_all_refuse_and_leave_nothing(tmp_path):
    run = tmp_path / "run"
    base = ["train", "--config", "micro", "--set", *RUN_SETTINGS, "--out", str(run)]
    started = time.monotonic()
    results = _run_group([base, [*base, "--set", "train.steps=5"]], tmp_path, REFUSAL_TIMEOUT_S)
    elapsed = time.monotonic() - started
    lines = []
    for index, (code, _, err) in enumerate(results):
        assert code == 2, f"process {index} exited {code}:\n{err[-3000:]}"
        assert len(_error_lines(err)) == 1, err[-3000:]
        lines.append(_error_lines(err)[0])
    assert lines[0] == lines[1]  # the same line on every process
    assert "different configs" in lines[0] and "process 1: train.steps 5 (process 0: 4)" in lines[0]
    assert not run.exists()
    assert elapsed < 60  # the bound docs/parallel.md states: within seconds to a minute


@pytest.mark.slow
def test_processes_that_read_different_corpora_all_refuse(tmp_path):
    """The same config whose data.source names a different file on each host (simulated: each
    process in its own working directory): the data fingerprints differ, every process refuses."""
    words = ["alpha", "beta", "gamma", "delta", "def", "main", "x", "y"]
    for name, seed in (("a", 0), ("b", 1)):
        rng = np.random.default_rng(seed)
        (tmp_path / name).mkdir()
        (tmp_path / name / "corpus.jsonl").write_text("".join(
            json.dumps({"text": " ".join(rng.choice(words, 60))}) + "\n" for _ in range(300)))
    run = tmp_path / "run"
    args = ["train", "--config", "micro", "--set", *RUN_SETTINGS, "data.source=corpus.jsonl", "data.val_fraction=0.3",
            f"data.cache_dir={tmp_path / 'cache'}", "--out", str(run)]
    address = f"127.0.0.1:{_free_port()}"
    procs = [_start(args, _env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index)),
                    tmp_path / name) for index, name in enumerate("ab")]
    lines = []
    for index, (code, _, err) in enumerate(_finish(procs, REFUSAL_TIMEOUT_S)):
        assert code == 2, f"process {index} exited {code}:\n{err[-3000:]}"
        lines += [line for line in _error_lines(err) if "the processes differ in the data" in line]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert not run.exists()


@pytest.mark.slow
def test_a_batch_the_devices_do_not_divide_is_refused_by_every_process(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--config", "micro", "--set", *RUN_SETTINGS, "train.global_batch=6", "train.eval_batch_size=6",
            "--out", str(run)]
    results = _run_group([args, args], tmp_path, REFUSAL_TIMEOUT_S)
    for index, (code, _, err) in enumerate(results):
        assert code == 2, f"process {index} exited {code}:\n{err[-3000:]}"
        assert [line for line in _error_lines(err) if "global_batch=6 is not divisible" in line], err[-3000:]
    assert not run.exists()


@pytest.mark.slow
def test_run_directories_the_processes_do_not_share_are_refused(tmp_path):
    """--out on a file system that is not shared (simulated: two different directories): every
    process refuses, naming the directory, and process 0 removes the directory it locked."""
    base = ["train", "--config", "micro", "--set", *RUN_SETTINGS, "--out"]
    results = _run_group([[*base, str(tmp_path / "a")], [*base, str(tmp_path / "b")]], tmp_path, REFUSAL_TIMEOUT_S)
    for index, (code, _, err) in enumerate(results):
        assert code == 2, f"process {index} exited {code}:\n{err[-3000:]}"
        assert [line for line in _error_lines(err) if "does not see the run directory" in line], err[-3000:]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_unreachable_coordinator_is_one_line_and_exit_2_within_the_timeout(tmp_path):
    started = time.monotonic()
    proc = _start(["train", "--config", "micro", "--out", str(tmp_path / "run")],
                  _env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2",
                       JAX_PROCESS_ID="1", TWELL_INIT_TIMEOUT_S="3"), tmp_path)
    [(code, _, err)] = _finish([proc], REFUSAL_TIMEOUT_S)
    assert code == 2, err[-3000:]
    [line] = _error_lines(err)
    assert line.startswith("twell: error: process 1 of 2 could not join the multi-process run within 3 s"), err
    assert "nothing answers at JAX_COORDINATOR_ADDRESS=127.0.0.1:" in err and "TWELL_INIT_TIMEOUT_S" in err
    assert time.monotonic() - started < 60
    assert not (tmp_path / "run").exists()


# A process blocked where no agreement point reaches it (in a collective, as here in a long sleep)
# while another one failed: process 0 publishes its failure (as the CLI does for every error) and
# exits, which holds it at JAX's shutdown barrier until process 1 comes (the service stays up).
_BLOCKED_PEER = """
import sys, time
from twell_jax.training import parallel
parallel.initialize_distributed()
import jax
if jax.process_index() == 0:
    parallel.publish_failure("broke on purpose")
    sys.exit(2)
time.sleep(90)
print("still running", flush=True)
"""


def test_a_process_blocked_while_another_failed_stops_with_its_message(tmp_path):
    address, started = f"127.0.0.1:{_free_port()}", time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", _BLOCKED_PEER], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=_env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(index), TWELL_PEER_FAILURE_GRACE_S="2"))
             for index in (0, 1)]
    [(code_0, _, err_0), (code_1, out, err)] = _finish(procs, 45)
    assert code_1 == 2 and "still running" not in out, err[-3000:]
    [line] = _error_lines(err)
    assert line == ("twell: error: process 0 failed (broke on purpose); process 1 stopped waiting for it after 2 s "
                    "(TWELL_PEER_FAILURE_GRACE_S)")
    assert code_0 == 2, err_0[-3000:]  # both met at JAX's shutdown barrier: neither was aborted
    assert time.monotonic() - started < 40


# ============================================================================= eval and compare as two processes


def _json_result(results: list[tuple[int, str, str]], command: str) -> dict:
    """Process 0's JSON result; every other process printed none and said so on stderr."""
    _assert_ok(results)
    for index, (_, out, err) in enumerate(results[1:], 1):
        assert out == "", f"process {index} printed a result:\n{out[-2000:]}"
        assert f"[twell] {command}: process {index} of {len(results)} done; process 0 prints the result" in err
    return json.loads(results[0][1])


@pytest.mark.slow
def test_two_processes_evaluate_a_checkpoint_like_one_process(tmp_path):
    """`twell eval` launched as two processes (each reads its rows of every batch): the validation
    split's loss is the one the one-process run logged for that checkpoint, and --split all equals a
    one-process eval of the same checkpoint, within 1e-6 relative; only process 0 prints."""
    run = tmp_path / "run"
    _assert_ok(_finish([_start(["train", "--config", "micro", "--set", *RUN_SETTINGS, "train.steps=3", "--out",
                                str(run)], _env(2), tmp_path)]))
    summary = json.loads((run / "summary.json").read_text())

    val = _json_result(_run_group([["eval", "--checkpoint", str(run), "--json"]] * 2, tmp_path), "eval")
    assert val["step"] == 3 and val["split"] == "val"
    assert val["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    np.testing.assert_allclose(val["l0_per_layer"], summary["val_l0_per_layer"], rtol=1e-6)

    every = ["eval", "--checkpoint", str(run), "--split", "all", "--set", "train.eval_batches=3", "--json"]
    two = _json_result(_run_group([every] * 2, tmp_path), "eval")
    one = _json_result(_finish([_start(every, _env(2), tmp_path)]), "eval")
    assert two["split"] == "all" and two["tokens"] == one["tokens"] == 3 * 8 * 16  # 3 batches of 8 x 16 tokens
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6) and two["loss"] != pytest.approx(val["loss"], rel=1e-6)
    np.testing.assert_allclose(two["l0_per_layer"], one["l0_per_layer"], rtol=1e-6)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json", "data_fingerprint.json",
                                                      "metrics.jsonl", "summary.json"]  # eval wrote nothing


@pytest.mark.slow
def test_two_processes_evaluate_a_hugging_face_checkpoint_like_one_process(tmp_path):
    """`twell eval --hf` as two processes: each imports the checkpoint (their weights' checksums
    agree) and evaluates its rows; the result is a one-process eval's."""
    args = ["eval", "--hf", str(REPO / "tests" / "fixtures" / "llama_relu"), "--set", "data.source=synthetic",
            "train.eval_batch_size=8", "train.eval_batches=2", "--json"]
    two = _json_result(_run_group([args] * 2, tmp_path), "eval")
    one = _json_result(_finish([_start(args, _env(2), tmp_path)]), "eval")
    assert two["step"] is None and two["tokens"] == one["tokens"] > 0
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    np.testing.assert_allclose(two["l0_per_layer"], one["l0_per_layer"], rtol=1e-6)


@pytest.mark.slow
def test_two_processes_compare_like_one_process(tmp_path):
    """`twell compare` of the micro preset as two processes: each run trains as a two-process run,
    process 0 alone writes the plan and the report and prints it, and the report equals a
    one-process study of the same global batch (losses and curves within 1e-6 relative)."""
    settings = ["--config", "micro", "--set", *RUN_SETTINGS, "train.steps=3"]
    two_dir, one_dir = tmp_path / "two", tmp_path / "one"
    results = _run_group([["compare", *settings, "--out", str(two_dir), "--json"]] * 2, tmp_path)
    two = _json_result(results, "compare")
    assert not [line for line in results[1][2].splitlines() if "compare: wrote" in line]  # process 0 writes it
    one = _json_result(_finish([_start(["compare", *settings, "--out", str(one_dir), "--json"], _env(2), tmp_path)]),
                       "compare")

    assert json.loads((two_dir / "compare.json").read_text()) == two
    assert sorted(p.name for p in two_dir.iterdir()) == sorted(p.name for p in one_dir.iterdir()) == [
        "compare.json", "compare.md", "compare.png", "compare_plan.json", "dense", "twell-l1-0.001"]
    assert (two_dir / "compare_plan.json").read_text() == (one_dir / "compare_plan.json").read_text()
    assert [r["key"] for r in two["runs"]] == [r["key"] for r in one["runs"]] == ["dense", "twell-l1-0.001"]
    for row_two, row_one in zip(two["runs"], one["runs"]):
        assert row_two["tokens"] == row_one["tokens"] == 3 * 8 * 16 and row_two["steps"] == 3
        for key in ("val_loss", "ce_gap_to_twin", "active_per_token", "dead_share"):
            assert row_two[key] == pytest.approx(row_one[key], rel=1e-6, abs=1e-9), f"{row_two['key']}: {key}"
        np.testing.assert_allclose(row_two["curve_ce"], row_one["curve_ce"], rtol=1e-6)
        np.testing.assert_allclose(row_two["active_per_layer"], row_one["active_per_layer"], rtol=1e-6)
        assert [r["step"] for r in _train_records(two_dir / row_two["key"])] == [1, 2, 3]  # each step once
    # --resume of the finished study, two processes: every run is kept (process 0's view), the same report.
    resumed = _run_group([["compare", "--out", str(two_dir), "--resume", "--json"]] * 2, tmp_path)
    assert _json_result(resumed, "compare") == two
    assert "run 1/2 dense (relu_gated, L1 0) finished earlier: kept" in resumed[1][2]


def _same_line_everywhere(results: list[tuple[int, str, str]], expected: str) -> str:
    """Every process exited 2 with one error line holding `expected`; that line (process 0's)."""
    lines = []
    for index, (code, out, err) in enumerate(results):
        assert code == 2, f"process {index} exited {code}:\n{err[-3000:]}"
        assert out == "" and len(_error_lines(err)) == 1, err[-3000:]
        lines.append(_error_lines(err)[0])
        assert expected in lines[-1], lines[-1]
    return lines[0]


def test_eval_processes_started_with_different_arguments_all_refuse(tmp_path):
    started = time.monotonic()
    base = ["eval", "--checkpoint", str(tmp_path / "run")]
    results = _run_group([base, [*base, "--step", "3", "--set", "train.eval_batches=1"]], tmp_path, REFUSAL_TIMEOUT_S)
    line = _same_line_everywhere(results, "the processes were started with different arguments (process 1: ")
    assert "--set ['train.eval_batches=1'] (process 0: [])" in line and "--step 3 (process 0: None)" in line
    assert len({_error_lines(err)[0] for _, _, err in results}) == 1  # the same line on every process
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("process_1_sees", ["nothing", pytest.param("another step", marks=pytest.mark.slow),
                                            "another checkpoint"])
def test_eval_of_a_checkpoint_the_processes_do_not_see_alike_is_refused_by_every_process(tmp_path, process_1_sees):
    """The same `--checkpoint run` relative to each process's own working directory (a file system
    that is not shared, simulated): every process refuses with one line before Orbax reads anything."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    meta = tmp_path / "a" / "run" / "checkpoints" / "3" / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text('{"step": 3}')
    (tmp_path / "a" / "run" / "config.json").write_text("{}")
    if process_1_sees != "nothing":
        shutil.copytree(tmp_path / "a" / "run", tmp_path / "b" / "run")
        if process_1_sees == "another step":
            (tmp_path / "b" / "run" / "checkpoints" / "3").rename(tmp_path / "b" / "run" / "checkpoints" / "6")
        else:
            (tmp_path / "b" / "run" / "checkpoints" / "3" / "meta" / "metadata").write_text('{"step": 3, "x": 1}')
    address = f"127.0.0.1:{_free_port()}"
    procs = [_start(["eval", "--checkpoint", "run"],
                    _env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index)),
                    tmp_path / name) for index, name in enumerate("ab")]
    expected = {"nothing": "no checkpoint directory at",
                "another step": "(process 1: no step 3; step 6 that process 0 lacks)",
                "another checkpoint": "(process 1: other contents of step 3)"}[process_1_sees]
    _same_line_everywhere(_finish(procs, REFUSAL_TIMEOUT_S), expected)


@pytest.mark.slow
def test_compare_refuses_lm_eval_tasks_and_an_out_the_processes_do_not_share(tmp_path):
    """--tasks in a two-process launch is refused on every process, naming why; a study whose --out
    the processes do not share (each its own working directory) is refused once process 0 wrote its
    plan, which it removes again: nothing is left."""
    settings = ["compare", "--config", "micro", "--set", *RUN_SETTINGS, "--out", "study"]
    line = _same_line_everywhere(_run_group([[*settings, "--tasks", "arc_easy"]] * 2, tmp_path, REFUSAL_TIMEOUT_S),
                                 "--tasks: lm-eval tasks run in one process")
    assert "--resume --tasks" in line and not (tmp_path / "study").exists()

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    address = f"127.0.0.1:{_free_port()}"
    procs = [_start(settings, _env(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                                   JAX_PROCESS_ID=str(index)), tmp_path / name) for index, name in enumerate("ab")]
    _same_line_everywhere(_finish(procs, REFUSAL_TIMEOUT_S), "process 1 does not see the comparison process 0 started")
    assert not any((tmp_path / "a").iterdir()) and not any((tmp_path / "b").iterdir())


# ============================================================================= one process


def test_agreement_helpers_are_no_ops_in_one_process():
    assert not par.multi_process() and par.is_lead()
    calls = []
    assert par.lead_value("a value", lambda: calls.append(1) or (1, 2)) == (1, 2)  # unchanged: no JSON
    assert calls == [1]
    assert par.gather("values", {"a": 1}) == [{"a": 1}]
    par.check_same("a value", 3, "hint")
    par.check_like_lead("a value", 3, lambda lead, mine: calls.append(2) or "differs", "problem", "hint")
    assert calls == [1]  # nothing compared, nothing raised
    par.barrier("a place")
    with par.all_or_none("a block"):
        pass
    with pytest.raises(KeyError):
        with par.all_or_none("a block"):
            raise KeyError("raised as is")
    par.publish_failure("nothing to tell")  # no coordinator: nothing happens


@pytest.mark.parametrize("variable", [par.INIT_TIMEOUT_VARIABLE, par.PEER_GRACE_VARIABLE])
@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_timeouts_from_the_environment_must_be_positive_seconds(monkeypatch, value, variable):
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("must not start"))
    with pytest.raises(ValueError, match=f"{variable} must be a positive number of seconds"):
        par.initialize_distributed()


def test_initialize_distributed_gives_jax_a_longer_timeout_than_its_own(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv(par.INIT_TIMEOUT_VARIABLE, "7")
    par.initialize_distributed()
    [kwargs] = calls
    # JAX's own timeout ends in a C++ abort: the watchdog (7 s) must fire first.
    assert kwargs["initialization_timeout"] > 7


def test_the_join_timeout_message_names_the_address_that_does_not_answer(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    text = par._join_timed_out("jax_env", 9)
    assert text.startswith("process 3 of 4 could not join the multi-process run within 9 s")
    assert f"nothing answers at JAX_COORDINATOR_ADDRESS=127.0.0.1:{port}" in text
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    assert "waits for all 4 processes" in par._join_timed_out("jax_env", 9)


def test_the_stop_vote_reports_what_any_device_voted_for():
    def step(state, batch):
        assert set(batch) == {"tokens"}  # the vote never reaches the model's step
        return state + 1, {"loss": jnp.sum(batch["tokens"]).astype(jnp.float32)}

    voting = jax.jit(step_lib.with_stop_vote(step))
    tokens = jnp.ones((4, 3), jnp.int32)
    vote = np.zeros((4, len(step_lib.STOP_REASONS)), bool)
    state, metrics = voting(jnp.int32(0), {"tokens": tokens, step_lib.STOP_VOTE: vote})
    assert int(state) == 1 and float(metrics["loss"]) == 12.0
    assert not np.any(metrics[step_lib.STOP_VOTE])
    vote[2, step_lib.STOP_REASONS.index("SIGTERM")] = True
    _, metrics = voting(jnp.int32(0), {"tokens": tokens, step_lib.STOP_VOTE: vote})
    assert list(np.asarray(metrics[step_lib.STOP_VOTE])) == [name == "SIGTERM" for name in step_lib.STOP_REASONS]


def test_a_sink_without_files_writes_nothing_and_still_says_messages(tmp_path):
    said = []
    sink = MetricsSink(tmp_path, tensorboard=True, total_steps=4, start_step=0, progress_bar=True,
                       echo=said.append, files=False)
    sink.write({"step": 1, "loss": 1.0})
    sink.message("a message")
    sink.close()
    assert list(tmp_path.iterdir()) == []
    assert said == ["a message"]


def test_the_plan_trial_decides_on_process_0s_step_times(monkeypatch):
    """Each process times its own trial steps; the verdict must be drawn from process 0's times
    (`parallel.lead_value`), or the processes could compile different programs."""
    from twell_jax.training.plan_trial import PlanTrial
    from twell_jax.training.planning import PlanController

    asked = []
    monkeypatch.setattr(par, "lead_value", lambda what, compute: asked.append(what) or {"auto": 1.0, "dense": 2.0})
    planner = PlanController.__new__(PlanController)  # only the trial's state is needed here
    planner.trial, planner.trials, planner.plan_in_use = PlanTrial(1), [], "auto"
    planner.decisions = (("pallas", "dense"),)
    for seconds in (9.0, 9.0, 1.0, 1.0):  # this process: the sparse plan 9x slower than dense
        planner.timed(7, seconds, lambda _: None)
    assert asked == ["the plan trial's step times"]
    assert planner.plan_in_use == "auto" and planner.trials[0]["auto_vs_dense"] == 2.0


def test_a_checkpoint_another_process_fails_to_verify_is_passed_over_by_every_process(tmp_path, monkeypatch):
    """Which checkpoint a run restores is agreed: one that another process fails to verify (simulated:
    process 1's verdict on step 2) is not used here either, whatever this process read, and the
    newest one every process verified is restored; a --step that another process cannot verify is
    an error naming that process."""
    from twell_jax.training import checkpoint as ckpt_lib

    store = ckpt_lib.CheckpointStore(tmp_path / "checkpoints")
    for step in (1, 2):
        store.save(step, {"w": jnp.arange(5.0) + step}, {"n": jnp.int32(step)}, {"config": {}, "step": step})
    asked = []

    def gather(what, value):  # process 1 verifies every checkpoint but step 2
        asked.append(what)
        return [value, "checkpoint 2 fails its checksum" if what == "verifying checkpoint 2" else None]

    monkeypatch.setattr(par, "gather", gather)
    monkeypatch.setattr(par, "multi_process", lambda: True)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {ckpt_lib.PARAMS_ITEM: {"w": jax.ShapeDtypeStruct((5,), jnp.float32, sharding=one_device)}}
    warned = []
    items, meta, step = store.restore_verified(target, warn=warned.append)
    assert step == 1 and meta["step"] == 1 and asked == ["verifying checkpoint 2", "verifying checkpoint 1"]
    np.testing.assert_array_equal(items[ckpt_lib.PARAMS_ITEM]["w"], np.arange(5.0) + 1)
    assert warned == ["[twell] warning: checkpoint 2 fails its checksum (on process 1); trying an older checkpoint"]
    with pytest.raises(ckpt_lib.CorruptCheckpointError, match=r"checkpoint 2 fails its checksum \(on process 1\)"):
        store.restore_verified(target, step=2)
    store.close()


def test_the_files_digest_names_the_config_and_each_step_and_tells_contents_apart(tmp_path):
    from twell_jax.training import checkpoint as ckpt_lib

    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (3, 12):
        (checkpoints / str(step) / "meta").mkdir(parents=True)
        (checkpoints / str(step) / "meta" / "metadata").write_text(f'{{"step": {step}}}')
    (checkpoints / "12.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save: not a step
    seen = ckpt_lib.saved_files_digest(checkpoints)
    assert list(seen) == ["config.json", "step 3", "step 12"] and seen["config.json"] is None
    assert seen["step 3"] != seen["step 12"] and None not in (seen["step 3"], seen["step 12"])
    (checkpoints / "3" / "meta" / "metadata").write_text('{"step": 3} ')
    assert ckpt_lib.saved_files_digest(checkpoints)["step 3"] != seen["step 3"]
