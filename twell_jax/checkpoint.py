"""Orbax checkpoints of a training run: train state, config and data-iterator position together.

Each checkpoint (one Orbax step directory under `<run>/checkpoints/`) holds two items:
- "state": the train-state pytree {params, opt_state, step, since_active} (Orbax StandardSave,
  restored straight into the target shardings);
- "meta": JSON with the full config, the Grain iterator state (`iterator.get_state()`), the step and
  the metric history so far (so a resumed run's logs and curves continue seamlessly).

Orbax writes into a temporary directory and renames it on success, so a save killed midway leaves
the previous checkpoint as the latest usable one (the leftover tmp directory is ignored).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from twell_jax import config as config_lib

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_dir(run_dir: str | Path) -> Path:
    """`<run>/checkpoints` for a run dir; a path that already is a checkpoints dir is returned as is."""
    run_dir = Path(run_dir).absolute()
    if run_dir.name == CHECKPOINT_SUBDIR or not (run_dir / CHECKPOINT_SUBDIR).exists() and _has_steps(run_dir):
        return run_dir
    return run_dir / CHECKPOINT_SUBDIR


def _has_steps(path: Path) -> bool:
    return path.is_dir() and any(child.name.isdigit() for child in path.iterdir())


class CheckpointStore:
    """Thin wrapper over `ocp.CheckpointManager` for the (state, meta) pair."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2, create: bool = True):
        self.directory = Path(directory).absolute()
        if not create and not self.directory.exists():
            raise FileNotFoundError(f"no checkpoint directory at {self.directory}")
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save synchronously-committed (returns once the step directory is final)."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._resolve(step)
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore into `abstract_state` (ShapeDtypeStructs carrying the target shardings)."""
        step = self._resolve(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        return step

    def close(self) -> None:
        self._manager.close()


# Config sections whose differences make a checkpoint unusable (parameter shapes or semantics).
_MUST_MATCH_PREFIXES = ("model.",)
_MUST_MATCH_FIELDS = ("data.seq_len", "data.vocab_size", "data.tokenizer", "data.source")


def check_compatible(saved_config: dict[str, Any], current: config_lib.ExperimentConfig) -> None:
    """Raise ValueError naming every model field that differs between a checkpoint and `current`.

    Fields outside the model that change the data stream (seq_len, vocab, tokenizer, source) are
    also errors; other differences (steps, logging cadence...) are allowed and only logged.
    """
    differences = config_lib.diff(saved_config, config_lib.to_dict(current))
    fatal = [d for d in differences
             if d[0].startswith(_MUST_MATCH_PREFIXES) and d[0] not in ("model.remat", "model.ffn_backend",
                                                                       "model.ffn_op_config", "model.ffn_interpret",
                                                                       "model.attention_impl", "model.ffn_expected_active")
             or d[0] in _MUST_MATCH_FIELDS]
    if fatal:
        lines = "; ".join(f"{path}: checkpoint has {old!r}, config has {new!r}" for path, old, new in fatal)
        raise ValueError(f"checkpoint does not match the requested model config ({lines})")
    for path, old, new in differences:
        logger.info("config differs from checkpoint (allowed): %s %r -> %r", path, old, new)


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree` placed with `shardings` (the restore target)."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)
