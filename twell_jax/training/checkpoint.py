"""A run's Orbax checkpoints: what is saved, how it is verified, how it is restored.

The run directory around them (its files, names, lock) is `twell_jax/run_dir.py`'s. A checkpoint
is `<run>/checkpoints/<step>/`, one Orbax step directory with three items: "params" (the model
parameters, restorable alone: evaluation needs no optimizer), "train" ({opt_state, step,
since_active}) and "meta" (JSON: config, data-iterator position (`iterator_state_to_json`), step,
metric history, and a checksum of every array of the other two items).

In a multi-process run (docs/parallel.md) Orbax saves and restores each checkpoint with every
process. A checkpoint is used only when every process verified it (`restore_verified`), and a
reader first compares what each process sees (`saved_files_digest`, before Orbax reads anything).

Orbax writes into a temporary directory and renames it on success, so a save killed midway leaves
the previous checkpoint as the latest (the tmp directory is ignored). A restore checks Orbax's own
errors, the checksums and the finiteness of the parameters; a corrupt checkpoint is named in the
error, and `restore(step=None)` falls back to the newest intact one with a warning.
"""
from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib
from twell_jax.data.tokenizer import file_sha256
from twell_jax.run_dir import DamagedFileError, checkpoint_dir
from twell_jax.training import parallel

logger = logging.getLogger(__name__)

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


class CorruptCheckpointError(DamagedFileError):
    """A checkpoint that cannot be read or fails verification; the message names its directory."""


def _brief(err: Exception) -> str:
    """The gist of a library error (Orbax/TensorStore errors carry kilobytes of spec JSON)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}{' ...' if len(text) > 300 else ''}"


def load_run_config(run_dir: str | Path) -> config_lib.ExperimentConfig:
    """The saved config of the run in `run_dir` (its config.json, else its newest checkpoint's)."""
    saved = run_dir_lib.saved_config(run_dir)
    if saved is not None:
        return saved
    store = CheckpointStore(checkpoint_dir(run_dir), create=False)
    try:
        values, where = store.restore_meta()["config"], str(store.directory)
    finally:
        store.close()
    return run_dir_lib.config_from_values(values, where)


def iterator_state_to_json(value: Any) -> Any:
    """A Grain iterator state (dicts of ints/strings, or bytes) made JSON-serialisable for the meta."""
    if isinstance(value, bytes):
        return {"__bytes__": value.decode("latin-1")}
    if isinstance(value, dict):
        return {k: iterator_state_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [iterator_state_to_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def iterator_state_from_json(value: Any) -> Any:
    """Inverse of `iterator_state_to_json`."""
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return value["__bytes__"].encode("latin-1")
        return {k: iterator_state_from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [iterator_state_from_json(v) for v in value]
    return value


def _file_digest(path: Path) -> str | None:
    """SHA-256 of a file's bytes (the first 16 hex digits), or None when it cannot be read."""
    try:
        return file_sha256(str(path))[:16]
    except OSError:
        return None


# The file Orbax's JsonSave writes in the "meta" item's directory (JsonCheckpointHandler's default).
_META_FILENAME = "metadata"


def saved_files_digest(directory: str | Path) -> dict[str, str | None]:
    """What this process sees of a run's saved state, read from the files alone (no Orbax: in a
    multi-process run Orbax reads collectively, so the processes compare this first): a digest of
    the run's config.json and, per checkpoint step, of that step's meta (the config, the step and
    every array's checksum, so equal digests mean the same arrays). `directory`: the run's
    checkpoints/ directory. None for a file that cannot be read."""
    directory = Path(directory)
    seen = {run_dir_lib.CONFIG_FILE: _file_digest(directory.parent / run_dir_lib.CONFIG_FILE)}
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())
    seen.update({f"step {step}": _file_digest(directory / str(step) / "meta" / _META_FILENAME) for step in steps})
    return seen


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
            return (*self._restore_everywhere(targets, step), step)
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        failures = []
        for candidate in reversed(steps):
            try:
                return (*self._restore_everywhere(targets, candidate), candidate)
            except CorruptCheckpointError as err:
                failures.append(str(err))
                warn(f"[twell] warning: {err}; trying an older checkpoint")
        raise CorruptCheckpointError(f"no intact checkpoint in {self.directory}: " + "; ".join(failures))

    def _restore_everywhere(self, targets: dict[str, Any], step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """`restore`, whose verdict every process of a multi-process run shares: a checkpoint one
        process fails to verify fails on all (naming that process), so all fall back to the same
        older step and compile the same program."""
        try:
            restored, failure = self.restore(targets, step), None
        except CorruptCheckpointError as err:
            restored, failure = None, str(err)
        failed = [(p, text) for p, text in enumerate(parallel.gather(f"verifying checkpoint {step}", failure)) if text]
        if not failed:
            return restored
        process, text = next(((p, t) for p, t in failed if p == jax.process_index()), failed[0])
        raise CorruptCheckpointError(text if not parallel.multi_process() else f"{text} (on process {process})")

    def quarantine_after(self, step: int, run_dir: str | Path) -> list[Path]:
        """Move every checkpoint newer than `step` to `<run>/superseded_checkpoints/` (kept for
        inspection; Orbax would otherwise count them as the latest). Returns their new paths."""
        moved = []
        newer_steps = [s for s in self.all_steps() if s > step]
        for newer in newer_steps if parallel.is_lead() else []:  # a multi-process run: process 0 moves them
            target = Path(run_dir) / run_dir_lib.QUARANTINE_SUBDIR / f"{newer}-{uuid.uuid4().hex[:6]}"
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
