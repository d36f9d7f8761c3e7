"""A run directory: the names of what a run writes there, their readers and writers, its lock, and
the `--checkpoint` argument. The one owner of the layout: training writes it, evaluation, inference,
the comparison, the CLI and the scripts read it, all through this module.

A run directory (`twell train --out DIR`) holds ONE run:
- `config.json`: the run's config, the source of truth on `--resume` (written atomically, and only
  once the run has been validated, so a command that fails never replaces it);
- `tokenizer.json` + `data_fingerprint.json`: the tokenizer the run was trained with and its data's
  `source_fingerprint` (the SHA-256 of the corpus's document text in source order; for the
  synthetic source, of its settings) with the tokenizer's hash (`data.tokenizer.tokenizer_record`),
  so evaluation, resumption and generation never re-train a tokenizer, a changed corpus is
  reported, and a different tokenizer is refused where two things must share one;
- `checkpoints/<step>/`: the Orbax checkpoints (`training/checkpoint.py`), and
  `superseded_checkpoints/` where a resume moves those after the step it continues from;
- `metrics.jsonl` (one JSON object per logged step or evaluation, `training/metrics.py`),
  `tensorboard/`, `wandb/`, `profile/`, `lm_eval/` and `summary.json` (the run's final figures);
- `twell.lock` while a process trains in it (`RunLock`: one process at a time).

Nothing else: `--overwrite` deletes only these entries, and only in a directory that holds nothing
else (`check_new_run_dir`), so a directory that is not a run is never emptied.

This module imports only the config (below the data, the model and everything that reads a run),
so that every level above it reads a run the same way.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from twell_jax import config as config_lib
from twell_jax.config import ExperimentConfig

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
FINGERPRINT_FILE = "data_fingerprint.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LOCK_FILE = "twell.lock"
CHECKPOINT_SUBDIR = "checkpoints"
# Where a resume moves the checkpoints after the one it continues from (corrupt ones, or newer ones
# abandoned by `--step`): out of Orbax's sight, never deleted.
QUARANTINE_SUBDIR = "superseded_checkpoints"
TENSORBOARD_SUBDIR = "tensorboard"
WANDB_SUBDIR = "wandb"  # train.wandb_project: the W&B run's local files (training/metrics.py)
PROFILE_SUBDIR = "profile"  # train.profile_steps: the profiler's trace (training/profiling.py)
LM_EVAL_SUBDIR = "lm_eval"  # `twell eval --tasks`: lm-eval's results JSON (inference/harness.py)
# What twell writes into a run directory (besides atomic_write_text's `.<name>.tmp-*` files): the
# only entries `--overwrite` may delete. Anything else in a directory makes it "not a run".
RUN_ENTRIES = frozenset({CONFIG_FILE, TOKENIZER_FILE, FINGERPRINT_FILE, METRICS_FILE, SUMMARY_FILE, LOCK_FILE,
                         CHECKPOINT_SUBDIR, QUARANTINE_SUBDIR, TENSORBOARD_SUBDIR, WANDB_SUBDIR, PROFILE_SUBDIR,
                         LM_EVAL_SUBDIR})


class DamagedFileError(ValueError):
    """A file of a run (or a checkpoint) that cannot be read; the message names it."""


# ----------------------------------------------------------------------------- files


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_json_file(path: str | Path, what: str) -> Any:
    """json.load with an error that names the file (an empty or truncated file included)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFileError(f"{what} {path} is not valid JSON ({err}); the file is damaged") from None


def write_config(run_dir: str | Path, cfg: ExperimentConfig) -> None:
    """The run's config.json (atomically)."""
    atomic_write_text(Path(run_dir) / CONFIG_FILE, config_lib.to_json(cfg))


def saved_config(run_dir: str | Path) -> ExperimentConfig | None:
    """The config in the run's config.json, or None when it has none (a run that kept its config in
    its checkpoints alone: `checkpoint.load_run_config` reads those too); a ValueError naming the
    file when it is not a valid config."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return config_from_values(read_json_file(path, "run config"), str(path))


def config_from_values(values: Any, where: str) -> ExperimentConfig:
    """A saved config's values as an ExperimentConfig; a ValueError naming `where` when invalid."""
    try:
        return config_lib.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the config saved in {where} is not valid: {err}") from None


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """The run's summary.json (atomically); returns its path."""
    path = Path(run_dir) / SUMMARY_FILE
    atomic_write_text(path, json.dumps(summary, indent=2))
    return path


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's summary.json (its final validation metrics, sparsity, speed), or None when it has
    none (a run that has not finished)."""
    path = Path(run_dir) / SUMMARY_FILE
    return read_json_file(path, "run summary") if path.is_file() else None


def metrics_path(run_dir: str | Path) -> Path:
    """The run's metrics.jsonl (one JSON object per line: a logged step, or an evaluation's `val_*`)."""
    return Path(run_dir) / METRICS_FILE


def read_metrics(run_dir: str | Path, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The records of the run's metrics.jsonl in order (those at or before `up_to_step` when
    given); [] when it has none."""
    path = metrics_path(run_dir)
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if up_to_step is not None:
        records = [r for r in records if r.get("step", 0) <= up_to_step]
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """Drop the records of the run's metrics.jsonl with a step after `last_step` (what a resumed run
    will write again); atomic. Returns how many were dropped."""
    path = metrics_path(run_dir)
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= last_step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def save_tokenizer(run_dir: str | Path, tokenizer_path: str | Path) -> Path:
    """Copy the run's tokenizer.json into the run directory (atomically); returns the copy."""
    target = Path(run_dir) / TOKENIZER_FILE
    atomic_write_text(target, Path(tokenizer_path).read_text())
    return target


def saved_tokenizer(run_dir: str | Path) -> Path | None:
    """The tokenizer.json saved with the run, or None (runs without a real tokenizer)."""
    path = Path(run_dir) / TOKENIZER_FILE
    return path if path.is_file() else None


def with_saved_tokenizer(cfg: ExperimentConfig, run_dir: str | Path) -> ExperimentConfig:
    """`cfg` reading the tokenizer saved in `run_dir` (when there is one) instead of re-training it:
    what a resumed or evaluated run builds its data with (its saved config is left unchanged)."""
    saved = saved_tokenizer(run_dir)
    if saved is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(saved.absolute())))


def save_corpus_fingerprint(run_dir: str | Path, fingerprint: str, tokenizer: dict[str, Any]) -> None:
    """Record the data's `source_fingerprint` in the run (`data_fingerprint.json`), with `tokenizer`:
    its tokenizer's identity (`data.tokenizer.tokenizer_record`)."""
    atomic_write_text(Path(run_dir) / FINGERPRINT_FILE, json.dumps({"corpus": fingerprint, **tokenizer}, indent=2))


def read_corpus_fingerprint(run_dir: str | Path) -> dict[str, Any]:
    """The run's `data_fingerprint.json` ({} when it has none); a DamagedFileError naming it."""
    path = Path(run_dir) / FINGERPRINT_FILE
    if not path.is_file():
        return {}
    values = read_json_file(path, "data fingerprint")
    if not isinstance(values, dict):
        raise DamagedFileError(f"data fingerprint {path} is not a JSON object; the file is damaged")
    return values


def check_corpus_fingerprint(run_dir: str | Path, fingerprint: str, warn: Callable[[str], None]) -> None:
    """Compare the data's `source_fingerprint` (SHA-256 of the corpus's document text) with the one
    saved in the run; warn (old/new) when they differ."""
    path = Path(run_dir) / FINGERPRINT_FILE
    old = read_corpus_fingerprint(run_dir).get("corpus")  # None: no file (or no record of the corpus)
    if old is not None and old != fingerprint:
        warn(f"[twell] warning: the corpus differs from the one this run was trained on (fingerprint "
             f"{old} -> {fingerprint}, {path}): the data source changed since; results are not comparable")


# ----------------------------------------------------------------------------- checkpoints' place


def checkpoint_dir(run_dir: str | Path) -> Path:
    """`<run>/checkpoints` for a run dir; a path that already is a checkpoints dir is returned as is."""
    run_dir = Path(run_dir).absolute()
    if run_dir.name == CHECKPOINT_SUBDIR or not (run_dir / CHECKPOINT_SUBDIR).exists() and has_steps(run_dir):
        return run_dir
    return run_dir / CHECKPOINT_SUBDIR


def run_dir_of(path: str | Path) -> Path:
    """The run directory of `path` (a run directory or its checkpoints/ directory)."""
    return checkpoint_dir(path).parent


def has_steps(path: Path) -> bool:
    """True when `path` is a directory holding at least one checkpoint step directory."""
    return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


def checkpoint_arg(path: str, step: int | None) -> tuple[Path, int | None]:
    """(run directory, step) of a --checkpoint argument: a run directory, its checkpoints/ directory,
    or one checkpoint step's directory (RUN/checkpoints/8, which picks step 8)."""
    given = Path(path)
    if given.name.isdigit() and given.parent.name == CHECKPOINT_SUBDIR:
        if not given.is_dir():
            raise FileNotFoundError(f"--checkpoint {path}: no such checkpoint directory")
        if step is not None and step != int(given.name):
            raise ValueError(f"--checkpoint {path} is step {int(given.name)} but --step {step} was given: pick one")
        return given.parent.parent, int(given.name)
    return run_dir_of(given), step


# ----------------------------------------------------------------------------- a new run's directory


def check_run_name(name: str) -> None:
    """`name` labels a run and names its default directory: one plain path component."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ValueError(f"name={name!r}: a run name must be one plain directory name (no '/', '\\', "
                         "'..' or surrounding spaces); use --out to choose where the run goes")


def default_run_dir(cfg: ExperimentConfig, root: str | Path = "runs") -> Path:
    """A new, empty runs/<name>-<YYYYmmdd-HHMMSS>[-<n>], created here (mkdir is atomic: two runs
    started in the same second get different directories)."""
    check_run_name(cfg.name)
    base = Path(root) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ValueError(f"no free run directory name under {Path(root).absolute()} for {base.name}; pass --out")


def _is_run_entry(name: str) -> bool:
    return name in RUN_ENTRIES or (name.startswith(".") and ".tmp-" in name)


def holds_a_run(run_dir: str | Path) -> bool:
    """True when `run_dir` holds a twell run: a config.json that twell wrote (a JSON object with
    the config's sections) and nothing that twell does not write."""
    run_dir = Path(run_dir)
    try:
        values = json.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(values, dict) and {"model", "train", "optim", "data"} <= set(values)
            and all(_is_run_entry(e.name) for e in run_dir.iterdir()))


def check_new_run_dir(run_dir: str | Path, *, overwrite: bool) -> list[Path]:
    """The entries a NEW run in `run_dir` replaces (none: a missing or empty directory); raises
    ValueError for a non-empty directory unless `overwrite` and it holds a twell run
    (`holds_a_run`). A directory with anything else in it is never emptied. The run's lock file
    (`LOCK_FILE`) is neither content nor replaced."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir.absolute()} is a file, not a directory; pick another --out")
    entries = sorted(e for e in run_dir.iterdir() if e.name != LOCK_FILE) if run_dir.is_dir() else []
    if entries and not holds_a_run(run_dir):
        unknown = [e.name for e in entries if not _is_run_entry(e.name)]
        why = (f"files twell did not write: {', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}"
               if unknown else f"no {CONFIG_FILE} written by twell")
        raise ValueError(f"--out {run_dir.absolute()} is not empty and is not a twell run directory ({why}); "
                         "pick another --out (twell never deletes files it did not write)")
    if entries and not overwrite:
        listing = f"{', '.join(e.name for e in entries[:5])}{', ...' if len(entries) > 5 else ''}"
        raise ValueError(f"run directory {run_dir.absolute()} already holds a run ({listing}); continue it with "
                         "--resume, pick another --out, or pass --overwrite to replace it")
    return entries


def prepare_new_run_dir(run_dir: str | Path, *, overwrite: bool) -> None:
    """Make `run_dir` ready for a NEW run (`check_new_run_dir`, then delete the old run's entries;
    call this only after everything that can be validated has been)."""
    for entry in check_new_run_dir(run_dir, overwrite=overwrite):
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    Path(run_dir).mkdir(parents=True, exist_ok=True)


# ----------------------------------------------------------------------------- the lock


class RunLockedError(ValueError):
    """Another live process holds the run directory's lock; the message names the lock and its pid."""


class RunLock:
    """An exclusive lock on a run directory: `fcntl.flock` on `<run>/twell.lock`, which holds the
    holder's pid and host. The kernel releases a flock when its process dies (kill -9 included), so
    a lock file whose lock can be taken was left by a process that is gone: it is taken over with a
    warning. `release()` (also on SIGTERM, through the trainer's finally) deletes the file."""

    def __init__(self, run_dir: str | Path, *, warn: Callable[[str], None] = logger.warning):
        import fcntl
        import socket

        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self.holder: str | None = None  # what the lock file says while held ("pid N on HOST")
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no flock on this file system
                    os.close(fd)
                    self.path.unlink(missing_ok=True)
                    warn(f"[twell] warning: cannot lock {self.path.absolute()} ({err.strerror}): the file system "
                         "does not support flock; nothing stops a second process from training in this directory")
                    return
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunLockedError(f"run directory {self.path.parent.absolute()} is in use: {self.path.absolute()} "
                                     f"is held by {holder}; wait for that run to finish (or stop it) first") from None
            # The holder before us may have deleted the file between our open and our flock: then
            # the lock is on a dead inode; start again on the path's current file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        left = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if left:
            warn(f"[twell] warning: taking over the lock {self.path.absolute()} left by {left}, which is no "
                 "longer running")
        os.ftruncate(fd, 0)
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        os.pwrite(fd, f"{self.holder}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Delete the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a Trainer dropped without run(): its lock goes with it
        try:
            self.release()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing left to report to)
            pass
