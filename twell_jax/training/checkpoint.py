"""A run directory and its Orbax checkpoints: what is saved, how it is verified, how it is restored.

A run directory (`twell train --out DIR`) holds ONE run:
- `config.json`: the run's config, the source of truth on `--resume` (written atomically, and only
  once the run has been validated, so a command that fails never replaces it);
- `tokenizer.json` + `data_fingerprint.json`: the tokenizer the run was trained with and its data's
  `source_fingerprint` (the SHA-256 of the corpus's document text in source order; for the
  synthetic source, of its settings), so evaluation, resumption and generation never re-train a
  tokenizer, and a changed corpus is reported;
- `checkpoints/<step>/`: one Orbax step directory per checkpoint with three items:
  "params" (the model parameters, restorable alone: evaluation needs no optimizer), "train"
  ({opt_state, step, since_active}) and "meta" (JSON: config, data-iterator position, step, metric
  history, and a checksum of every array of the other two items);
- `metrics.jsonl`, `tensorboard/`, `summary.json` (see twell_jax/training/metrics.py and train.py);
- `twell.lock` while a process trains in it (`RunLock`: one process at a time).

A multi-process run (docs/parallel.md) has one run directory on a shared file system: process 0
holds the lock and writes the files above; every process checks that it sees that directory
(`check_shared_run_dir`), and Orbax saves and restores each checkpoint with every process.

Nothing else: `--overwrite` deletes only these entries, and only in a directory that holds nothing
else (`check_new_run_dir`), so a directory that is not a run is never emptied.

Orbax writes into a temporary directory and renames it on success, so a save killed midway leaves
the previous checkpoint as the latest (the tmp directory is ignored). A restore checks Orbax's own
errors, the checksums and the finiteness of the parameters; a corrupt checkpoint is named in the
error, and `restore(step=None)` falls back to the newest intact one with a warning.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from twell_jax import config as config_lib

if TYPE_CHECKING:  # pragma: no cover - typing only (the data package is not needed to read a run)
    from twell_jax.data import DataSource

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
FINGERPRINT_FILE = "data_fingerprint.json"
# Where a resume moves the checkpoints after the one it continues from (corrupt ones, or newer ones
# abandoned by `--step`): out of Orbax's sight, never deleted.
QUARANTINE_SUBDIR = "superseded_checkpoints"
# Items of a checkpoint besides "meta": the parameters alone, then what only training needs.
PARAMS_ITEM, TRAIN_ITEM = "params", "train"
# 1: a single "state" item without checksums (no longer readable); 2: the blocks one dict per layer
# ({"blocks": {0: ..., 1: ...}}, before the layers were stacked and scanned: converted on restore);
# 3: the blocks stacked over layers ({"blocks": {name: [L, ...]}}).
CHECKPOINT_FORMAT = 3
LAYER_LIST_FORMAT = 2


def _has_blocks(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("blocks"), dict)


def _per_layer_targets(tree: Any) -> Any:
    """`tree` (restore targets in the stacked layout; params, or a train state whose optimizer
    moments mirror them) with every "blocks" entry as format 2 wrote it: one dict per layer, each
    leaf without the leading layer axis."""
    def unstack(node: Any) -> Any:
        if not _has_blocks(node):
            return node
        blocks = node["blocks"]
        n_layers = jax.tree.leaves(blocks)[0].shape[0]
        return {**node, "blocks": {layer: jax.tree.map(
            lambda leaf, layer=layer: jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype,
                                                            sharding=getattr(leaf, "sharding", None)), blocks)
            for layer in range(n_layers)}}

    return jax.tree.map(unstack, tree, is_leaf=_has_blocks)


def _stack_per_layer(tree: Any) -> Any:
    """The inverse of `_per_layer_targets` on restored arrays: every per-layer "blocks" dict stacked."""
    from twell_jax.model import stack_layers

    def stack(node: Any) -> Any:
        if not _has_blocks(node):
            return node
        blocks = node["blocks"]
        return {**node, "blocks": stack_layers([blocks[layer] for layer in sorted(blocks, key=int)])}

    return jax.tree.map(stack, tree, is_leaf=_has_blocks)


class CorruptCheckpointError(ValueError):
    """A checkpoint that cannot be read or fails verification; the message names its directory."""


def _brief(err: Exception) -> str:
    """The gist of a library error (Orbax/TensorStore errors carry kilobytes of spec JSON)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}{' ...' if len(text) > 300 else ''}"


# ----------------------------------------------------------------------------- run directory files


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


# What twell writes into a run directory (besides atomic_write_text's `.<name>.tmp-*` files): the
# only entries `--overwrite` may delete. Anything else in a directory makes it "not a run".
LOCK_FILE = "twell.lock"
WANDB_SUBDIR = "wandb"  # train.wandb_project: the W&B run's local files (training/metrics.py)
PROFILE_SUBDIR = "profile"  # train.profile_steps: the profiler's trace (training/profiling.py)
LM_EVAL_SUBDIR = "lm_eval"  # `twell eval --tasks`: lm-eval's results JSON (inference/harness.py)
RUN_ENTRIES = frozenset({CONFIG_FILE, TOKENIZER_FILE, FINGERPRINT_FILE, "metrics.jsonl", "summary.json",
                         "tensorboard", CHECKPOINT_SUBDIR, QUARANTINE_SUBDIR, LOCK_FILE, WANDB_SUBDIR,
                         PROFILE_SUBDIR, LM_EVAL_SUBDIR})


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
               if unknown else "no config.json written by twell")
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


def check_shared_run_dir(run_dir: str | Path, lock: RunLock | None) -> None:
    """A multi-process run: every process must see the run directory that process 0 locked (`lock`,
    None on the other processes), else every process raises a ValueError naming the directory. Run
    before anything is written to it but the lock, so a refused run leaves nothing behind. Where
    the file system has no flock (no lock file to look at) nothing is checked."""
    from twell_jax.training import parallel

    if not parallel.multi_process():
        return
    holder = parallel.lead_value("the run directory's lock", lambda: lock.holder if lock is not None else None)
    with parallel.all_or_none("checking that every process sees the run directory"):
        if parallel.is_lead() or holder is None:
            return
        path = Path(run_dir) / LOCK_FILE
        try:
            seen = path.read_text().strip()
        except OSError as err:
            seen = f"nothing ({err.strerror})"
        if seen != holder:
            raise ValueError(f"--out {Path(run_dir).absolute()}: process {jax.process_index()} does not see the run "
                             f"directory process 0 locked ({path.name} holds {holder!r} there, {seen!r} here): every "
                             "process of a multi-process run needs --out on a file system they share, at the same "
                             "path (run from the same directory, or give an absolute --out)")


def read_json_file(path: str | Path, what: str) -> Any:
    """json.load with an error that names the file (an empty or truncated file included)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{what} {path} is not valid JSON ({err}); the file is damaged") from None


def load_run_config(run_dir: str | Path) -> config_lib.ExperimentConfig:
    """The saved config of the run in `run_dir` (its config.json, else its newest checkpoint's)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if path.is_file():
        values = read_json_file(path, "run config")
        where = str(path)
    else:
        store = CheckpointStore(checkpoint_dir(run_dir), create=False)
        try:
            values, where = store.restore_meta()["config"], str(store.directory)
        finally:
            store.close()
    try:
        return config_lib.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the config saved in {where} is not valid: {err}") from None


def save_tokenizer(run_dir: str | Path, tokenizer_path: str | Path) -> Path:
    """Copy the run's tokenizer.json into the run directory (atomically); returns the copy."""
    target = Path(run_dir) / TOKENIZER_FILE
    atomic_write_text(target, Path(tokenizer_path).read_text())
    return target


def saved_tokenizer(run_dir: str | Path) -> Path | None:
    """The tokenizer.json saved with the run, or None (runs without a real tokenizer)."""
    path = Path(run_dir) / TOKENIZER_FILE
    return path if path.is_file() else None


def check_corpus_fingerprint(run_dir: str | Path, data: DataSource, warn: Callable[[str], None]) -> None:
    """Compare the data's `source_fingerprint` (SHA-256 of the corpus's document text) with the one
    saved in the run; warn (old/new) when they differ."""
    path = Path(run_dir) / FINGERPRINT_FILE
    new = data.source_fingerprint
    if not path.is_file():
        return
    old = read_json_file(path, "data fingerprint").get("corpus")
    if old != new:
        warn(f"[twell] warning: the corpus differs from the one this run was trained on (fingerprint "
             f"{old} -> {new}, {path}): the data source changed since; results are not comparable")


def save_corpus_fingerprint(run_dir: str | Path, data: DataSource) -> None:
    """Record the data's `source_fingerprint` in the run (`data_fingerprint.json`)."""
    atomic_write_text(Path(run_dir) / FINGERPRINT_FILE, json.dumps({"corpus": data.source_fingerprint}, indent=2))


# ----------------------------------------------------------------------------- checksums


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32 checksum of an array's bits. Integer sums wrap modulo 2**32 and are associative, so
    the value does not depend on sharding or reduction order (a float sum would)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
    # Position-dependent weights: swapped or shifted values change the sum.
    mixed = (bits ^ (bits >> 15)) * (index * jnp.uint32(2654435761) + jnp.uint32(1))
    return jnp.sum(mixed, dtype=jnp.uint32)


@jax.jit
def _leaf_checksums(leaves: list[jax.Array]) -> list[jax.Array]:
    """`_leaf_checksum` of each leaf, as one program (module-level: jit's cache survives across calls)."""
    return [_leaf_checksum(x) for x in leaves]


@jax.jit
def _leaves_finite(leaves: list[jax.Array]) -> list[jax.Array]:
    """Whether each leaf is all finite, as one program (module-level for the same reason)."""
    return [jnp.all(jnp.isfinite(x)) for x in leaves]


def tree_checksums(tree: Any) -> dict[str, int]:
    """{key path: uint32 checksum} of every array leaf of `tree` (computed on the devices)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = jax.device_get(_leaf_checksums([x for _, x in leaves]))
    return {jax.tree_util.keystr(path): int(s) for (path, _), s in zip(leaves, sums)}


def _nonfinite_leaves(tree: Any) -> list[str]:
    """Key paths of the floating leaves of `tree` that hold a NaN or an infinity."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    finite = jax.device_get(_leaves_finite([x for _, x in leaves]))
    return [jax.tree_util.keystr(p) for (p, _), ok in zip(leaves, finite) if not ok]


# ----------------------------------------------------------------------------- the store


def checkpoint_dir(run_dir: str | Path) -> Path:
    """`<run>/checkpoints` for a run dir; a path that already is a checkpoints dir is returned as is."""
    run_dir = Path(run_dir).absolute()
    if run_dir.name == CHECKPOINT_SUBDIR or not (run_dir / CHECKPOINT_SUBDIR).exists() and has_steps(run_dir):
        return run_dir
    return run_dir / CHECKPOINT_SUBDIR


def has_steps(path: Path) -> bool:
    """True when `path` is a directory holding at least one checkpoint step directory."""
    return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


class CheckpointStore:
    """Verified save/restore of (params, train state, meta) over `ocp.CheckpointManager`."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2, create: bool = True):
        self.directory = Path(directory).absolute()
        if not create and not self.directory.exists():
            raise FileNotFoundError(f"no checkpoint directory at {self.directory}")
        self._options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
        self._manager = ocp.CheckpointManager(self.directory, options=self._options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, params: Any, train_state: Any, meta: dict[str, Any]) -> None:
        """Save and wait until the step directory is final; `meta` gets the arrays' checksums."""
        meta = {**meta, "format": CHECKPOINT_FORMAT,
                "checksums": {PARAMS_ITEM: tree_checksums(params), TRAIN_ITEM: tree_checksums(train_state)}}
        self._manager.save(step, args=ocp.args.Composite(**{
            PARAMS_ITEM: ocp.args.StandardSave(params), TRAIN_ITEM: ocp.args.StandardSave(train_state),
            "meta": ocp.args.JsonSave(meta)}), force=True)
        self._manager.wait_until_finished()

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step` (default: the latest); a damaged file is named."""
        step = self._resolve(step)
        path = self.step_dir(step) / "meta"
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as err:  # noqa: BLE001 (Orbax raises many kinds; all mean "unreadable")
            raise CorruptCheckpointError(f"checkpoint metadata {path} cannot be read ({_brief(err)}); the "
                                         "checkpoint is damaged") from None
        if not isinstance(meta, dict) or "config" not in meta:
            raise CorruptCheckpointError(f"checkpoint metadata {path} holds no config; the checkpoint is damaged")
        if meta.get("format") not in (CHECKPOINT_FORMAT, LAYER_LIST_FORMAT):
            raise CorruptCheckpointError(f"checkpoint {self.step_dir(step)} has format {meta.get('format', 1)}, "
                                         f"this version reads formats {LAYER_LIST_FORMAT} (converted) and "
                                         f"{CHECKPOINT_FORMAT} only")
        return meta

    def restore(self, targets: dict[str, Any], step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore the items named in `targets` ({"params": abstract, "train": abstract}, abstract =
        ShapeDtypeStructs carrying the target shardings) of checkpoint `step`, verified."""
        where = self.step_dir(step)
        meta = self.restore_meta(step)
        per_layer = meta["format"] == LAYER_LIST_FORMAT  # written before the layers were stacked
        if per_layer:
            targets = {name: _per_layer_targets(abstract) for name, abstract in targets.items()}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                **{name: ocp.args.StandardRestore(abstract) for name, abstract in targets.items()}))
        except Exception as err:  # noqa: BLE001
            raise CorruptCheckpointError(f"checkpoint {where} cannot be read ({_brief(err)})") from None
        items = {name: restored[name] for name in targets}
        for name, tree in items.items():
            expected = meta["checksums"].get(name, {})
            actual = tree_checksums(tree)
            bad = sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
            if bad:
                raise CorruptCheckpointError(f"checkpoint {where} is corrupt: item {name!r} fails its checksum "
                                             f"at {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
        if PARAMS_ITEM in items and (bad := _nonfinite_leaves(items[PARAMS_ITEM])):
            raise CorruptCheckpointError(f"checkpoint {where} holds non-finite parameters at {', '.join(bad[:4])}")
        if per_layer:  # verified as written, then converted to the stacked layout
            items = {name: _stack_per_layer(tree) for name, tree in items.items()}
        return items, meta

    def restore_verified(self, targets: dict[str, Any], step: int | None = None, *,
                         warn: Callable[[str], None] = logger.warning) -> tuple[dict[str, Any], dict[str, Any], int]:
        """`restore` of checkpoint `step`; with step=None the newest checkpoint that passes
        verification, warning about each newer one that does not. Returns (items, meta, step)."""
        if step is not None:
            if step not in self.all_steps():
                raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (steps: "
                                        f"{self.all_steps() or 'none'})")
            return (*self.restore(targets, step), step)
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        failures = []
        for candidate in reversed(steps):
            try:
                return (*self.restore(targets, candidate), candidate)
            except CorruptCheckpointError as err:
                failures.append(str(err))
                warn(f"[twell] warning: {err}; trying an older checkpoint")
        raise CorruptCheckpointError(f"no intact checkpoint in {self.directory}: " + "; ".join(failures))

    def quarantine_after(self, step: int, run_dir: str | Path) -> list[Path]:
        """Move every checkpoint newer than `step` to `<run>/superseded_checkpoints/` (kept for
        inspection; Orbax would otherwise count them as the latest). Returns their new paths."""
        from twell_jax.training import parallel

        moved = []
        newer_steps = [s for s in self.all_steps() if s > step]
        for newer in newer_steps if parallel.is_lead() else []:  # a multi-process run: process 0 moves them
            target = Path(run_dir) / QUARANTINE_SUBDIR / f"{newer}-{uuid.uuid4().hex[:6]}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.step_dir(newer)), target)
            moved.append(target)
        if newer_steps:  # the manager caches the step list: reopen it (every process, once they are moved)
            parallel.barrier("moving newer checkpoints aside")
            self._manager.close()
            self._manager = ocp.CheckpointManager(self.directory, options=self._options)
        return moved

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        return step

    def close(self) -> None:
        self._manager.close()


def check_compatible(saved_config: dict[str, Any], current: config_lib.ExperimentConfig) -> None:
    """Raise ValueError naming every field that differs between a run's saved config and `current`
    and may not change when a run continues (everything outside config_lib.RESUMABLE_FIELDS)."""
    fatal = [d for d in config_lib.diff(saved_config, config_lib.to_dict(current))
             if d[0] not in config_lib.RESUMABLE_FIELDS]
    if fatal:
        lines = "; ".join(f"{path}: checkpoint has {old!r}, config has {new!r}" for path, old, new in fatal)
        raise ValueError(f"checkpoint does not match the requested config ({lines}); only "
                         f"{', '.join(sorted(config_lib.RESUMABLE_FIELDS))} may change when a run continues")


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` placed with `shardings` (the restore target)."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


def restore_params_with_meta(run_dir: str | Path, step: int | None = None, *,
                             mesh: jax.sharding.Mesh | None = None,
                             warn: Callable[[str], None] = logger.warning) -> tuple[Any, dict[str, Any], int]:
    """(params, checkpoint meta, step) of a run's checkpoint, without an optimizer: verified,
    replicated over `mesh` (default: the first device); step=None = the newest intact checkpoint."""
    from flax import nnx

    from twell_jax.model import init_model

    run_dir = Path(run_dir)
    store = CheckpointStore(checkpoint_dir(run_dir), create=False)
    try:
        if step is not None and step not in store.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {store.directory} (steps: "
                                    f"{store.all_steps() or 'none'})")
        cfg = config_lib.from_dict(store.restore_meta(step)["config"]) if step is not None else \
            load_run_config(store.directory.parent)
        abstract = nnx.to_pure_dict(nnx.split(nnx.eval_shape(lambda: init_model(cfg.model, cfg.train.seed)))[1])
        sharding = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
                    else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), abstract)
        items, meta, step = store.restore_verified({PARAMS_ITEM: target}, step, warn=warn)
    finally:
        store.close()
    return items[PARAMS_ITEM], meta, step


def restore_params(run_dir: str | Path, step: int | None = None, *, mesh: jax.sharding.Mesh | None = None,
                   warn: Callable[[str], None] = logger.warning) -> tuple[Any, config_lib.ExperimentConfig, int]:
    """(params, config, step): `restore_params_with_meta` for callers that need no metadata."""
    params, meta, step = restore_params_with_meta(run_dir, step, mesh=mesh, warn=warn)
    return params, config_lib.from_dict(meta["config"]), step
