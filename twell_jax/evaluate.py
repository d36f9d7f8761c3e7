"""Evaluate a saved checkpoint: validation loss, perplexity, per-layer activity and dead neurons."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from twell_jax import checkpoint as ckpt_lib
from twell_jax import config as config_lib
from twell_jax.train import Trainer, dead_window, evaluate_params, make_eval_step


def evaluate_checkpoint(path: str | Path, *, step: int | None = None, overrides: list[str] | None = None,
                        echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Restore the run at `path` (a run dir or its checkpoints/ dir) and evaluate it on the validation split.

    `overrides` may change evaluation-only fields (e.g. train.eval_batches=32, train.num_devices=1).
    """
    ckpt_dir = ckpt_lib.checkpoint_dir(path)
    store = ckpt_lib.CheckpointStore(ckpt_dir, create=False)
    meta = store.restore_meta(step)
    store.close()
    cfg = config_lib.apply_overrides(config_lib.from_dict(meta["config"]), overrides or [])
    echo(f"[twell] evaluating {ckpt_dir} (step {meta['step']}, config {cfg.name!r})")
    trainer = Trainer(cfg, ckpt_dir.parent, echo=echo)
    with jax.set_mesh(trainer.mesh):
        state, _ = trainer.restore_state() if step is None else _restore_step(trainer, step)
        eval_fn = jax.jit(make_eval_step(cfg, trainer.graphdef))
        result = evaluate_params(cfg, trainer.data, eval_fn, state["params"], trainer.mesh)
    since = np.asarray(jax.device_get(state["since_active"]))
    result["step"] = int(meta["step"])
    result["l0_mean"] = float(np.mean(result["l0_per_layer"]))
    result["sparsity"] = 1.0 - result["l0_mean"] / cfg.model.d_ff
    result["dead_share_per_layer"] = (since >= dead_window(cfg)).mean(axis=1).tolist()
    echo(f"[twell] validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over "
         f"{int(result['tokens'])} tokens; mean active FFN neurons/token {result['l0_mean']:.1f} of "
         f"{cfg.model.d_ff} ({100 * result['sparsity']:.1f}% zero)")
    return result


def _restore_step(trainer: Trainer, step: int) -> tuple[Any, dict[str, Any]]:
    meta = trainer.store.restore_meta(step)
    ckpt_lib.check_compatible(meta["config"], trainer.cfg)
    target = ckpt_lib.abstract_with_shardings(trainer.abstract_state, trainer.state_shardings)
    return trainer.store.restore(target, step)
