"""Multi-process runs: the data caches are built once, by process 0, while the other processes wait
(`build_once`, which the trainer hands to `data.build_data` as its `coordinate`).

Process 0 builds the tokenizer and the token cache in `data.cache_dir` (a thread runs `build`) and
tells the others where it is every `REPORT_EVERY_S` seconds (`parallel.lead_value`); the others print that, and
once process 0 is done they open the published caches: only process 0 reads and tokenizes the
corpus. The caches are byte for byte those of a one-process build (it is the same build), so a run
of P processes trains on the batches of a one-process run of the same global batch.

Bounds: a process 0 that fails sends its error to the others at once (they stop with it), one that
dies or hangs is noticed by the next report not coming within TWELL_AGREE_TIMEOUT_S (reports come
every `REPORT_EVERY_S` seconds or more often), and a build that takes longer than
TWELL_DATA_TIMEOUT_S stops every process with an error naming that variable.

A process that does not see process 0's `data.cache_dir` (checked with a probe file: the directory
is not on a file system they share) builds its own copy meanwhile, as every process used to.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax

from twell_jax.config import DataConfig, ExperimentConfig
from twell_jax.data.bundle import DataBundle, build_experiment_data as build_data_for
from twell_jax.data.cache_dir import BuildProgress, log
from twell_jax.training import parallel

# How long the other processes wait for process 0's data build, in all (it reports on the way).
BUILD_TIMEOUT_VARIABLE, DEFAULT_BUILD_TIMEOUT_S = "TWELL_DATA_TIMEOUT_S", 6 * 3600.0
# Seconds between process 0's reports: each must come within TWELL_AGREE_TIMEOUT_S, so at most a
# quarter of it.
REPORT_EVERY_S = 30.0
_WHAT = "process 0's data build"


def build_timeout_s() -> float:
    """TWELL_DATA_TIMEOUT_S, or its default: a positive number of seconds."""
    return parallel.env_seconds(BUILD_TIMEOUT_VARIABLE, DEFAULT_BUILD_TIMEOUT_S)


def build_once(cfg: DataConfig, build: Callable[[BuildProgress | None], DataBundle]) -> DataBundle:
    """`build(progress)` run by process 0 alone first, then (finding its caches) by the others; in a
    run of one process, `build(None)`. Every process of the run must call it (it is an agreement)."""
    if not parallel.multi_process():
        return build(None)
    timeout = build_timeout_s()  # a bad value stops every process here, before anything is built
    me, count = jax.process_index(), jax.process_count()
    cache_root = os.path.expanduser(cfg.cache_dir)
    own = None
    if not _sees_lead_cache_dir(cache_root):  # never on process 0
        log(cfg, f"process {me} of {count}: data.cache_dir={cfg.cache_dir!r} is not the directory process 0 "
                 "builds the data caches in (not on a file system they share): this process builds its own copy")
        own = build(None)
    if parallel.is_lead():
        return _build_and_report(build, timeout)
    if own is None:
        log(cfg, f"process {me} of {count}: waiting for process 0 to build the data caches in {cache_root} (at "
                 f"most {timeout:g} s, {BUILD_TIMEOUT_VARIABLE})")
    while not (status := parallel.lead_value(_WHAT, _only_on_process_0))["done"]:
        if own is None:  # a process with its own copy only takes the reports (they are an agreement)
            log(cfg, f"process {me} of {count}: process 0 builds the data ({status['progress']}; "
                     f"{status['seconds']} s so far)")
    if own is not None:
        return own
    bundle = build(None)
    if bundle.built_tokenizer or bundle.built_tokens:
        log(cfg, f"process {me} of {count}: did not find the caches process 0 built ({status['cache_path']}) and "
                 f"built its own ({bundle.cache_path}): the processes list data.source differently (paths, "
                 "sizes or modification times of its files)")
    return bundle


def _only_on_process_0() -> Any:  # pragma: no cover - lead_value computes on process 0 alone
    raise AssertionError("process 0 computes the data build's reports")


def _sees_lead_cache_dir(cache_root: str) -> bool:
    """Whether this process sees the `data.cache_dir` of process 0 (True on process 0): process 0
    writes a probe file there, every process looks for it, then process 0 removes it."""

    def make_probe() -> str:
        os.makedirs(cache_root, exist_ok=True)
        name = f".shared-probe-{uuid.uuid4().hex}"
        with open(os.path.join(cache_root, name), "w"):
            pass
        return name

    probe = os.path.join(cache_root, parallel.lead_value("process 0's data.cache_dir", make_probe))
    sees = parallel.is_lead() or os.path.isfile(probe)
    parallel.gather("who sees process 0's data.cache_dir", sees)  # everyone has looked
    if parallel.is_lead():
        os.remove(probe)
    return sees


def _build_and_report(build: Callable[[BuildProgress | None], DataBundle], timeout: float) -> DataBundle:
    """Process 0: `build` in a thread, a report to the others every `_report_every_s()` seconds and
    when it ends (its error, or passing `timeout` seconds, raised here, reaches them through
    `lead_value`)."""

    progress = BuildProgress()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["bundle"] = build(progress)
        except BaseException as error:  # noqa: BLE001 (raised on the main thread below)
            outcome["error"] = error

    every = _report_every_s()
    started = time.monotonic()
    thread = threading.Thread(target=run, name="twell-data-build", daemon=True)
    thread.start()

    def report() -> dict[str, Any]:
        running = thread.is_alive()
        if "error" in outcome:
            raise outcome["error"]
        seconds = time.monotonic() - started
        if running and seconds > timeout:
            raise ValueError(f"process 0 has built the data for {seconds:.1f} s ({progress.describe()}), longer than "
                             f"{BUILD_TIMEOUT_VARIABLE}={timeout:g} s: raise it for a corpus this large, or build the "
                             "caches beforehand with `python -m twell_jax.data` (docs/data.md)")
        return {"done": not running, "progress": progress.describe(), "seconds": round(seconds),
                "cache_path": outcome["bundle"].cache_path if not running else None}

    while True:
        thread.join(every)
        if parallel.lead_value(_WHAT, report)["done"]:
            return outcome["bundle"]


def _report_every_s() -> float:
    """REPORT_EVERY_S, or a quarter of TWELL_AGREE_TIMEOUT_S when that is shorter (the others wait
    at most that long for each report)."""

    try:
        agree = parallel.env_seconds(parallel.AGREE_TIMEOUT_VARIABLE, parallel.DEFAULT_AGREE_TIMEOUT_S)
    except ValueError:  # lead_value reports the bad value itself
        agree = parallel.DEFAULT_AGREE_TIMEOUT_S
    return min(REPORT_EVERY_S, agree / 4)


def build_experiment_data(cfg: ExperimentConfig) -> DataBundle:
    """`data.build_experiment_data` with the caches built once in a multi-process run
    (`build_once`): the trainer's, evaluation's and the CLI's data builder."""
    return build_data_for(cfg, coordinate=build_once)
