"""Evaluate a saved checkpoint: validation loss, perplexity, per-layer activity and dead neurons.

Restores the parameters alone (checkpoint.restore_params_with_meta: no optimizer, no Trainer),
gives backend "auto" the checkpoint's hints (hints.with_auto_hints), builds the data with the
tokenizer saved in the run, and evaluates on the run's validation split.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from twell_jax import config as config_lib
from twell_jax.config import ExperimentConfig
from twell_jax.data import DataSource, build_experiment_data
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax.training import parallel
from twell_jax.training.hints import expected_active_from_run, with_auto_hints
from twell_jax.training.train import abstract_graphdef, evaluate_params, make_eval_step, with_saved_tokenizer


def evaluate_checkpoint(path: str | Path, *, step: int | None = None, overrides: list[str] | None = None,
                        echo: Callable[[str], None] = print,
                        data_builder: Callable[[ExperimentConfig], DataSource] = build_experiment_data) -> dict[str, Any]:
    """Restore the run at `path` (a run dir or its checkpoints/ dir) and evaluate it on the validation split.

    `step` picks a checkpoint (default: the newest intact one, with a warning for each newer one
    that fails verification). `overrides` may change only config.RESUMABLE_FIELDS (e.g.
    train.eval_batches=32, train.num_devices=1, data.source=<the moved corpus>). A non-finite
    loss raises FloatingPointError.
    """
    ckpt_dir = ckpt_lib.checkpoint_dir(path)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {ckpt_dir}")
    run_dir = ckpt_dir.parent
    saved = ckpt_lib.load_run_config(run_dir)
    cfg = config_lib.apply_overrides(saved, overrides or [])
    ckpt_lib.check_compatible(config_lib.to_dict(saved), cfg)
    mesh = parallel.make_mesh(cfg.train.num_devices)
    with jax.set_mesh(mesh):
        params, meta, step = ckpt_lib.restore_params_with_meta(run_dir, step, mesh=mesh, warn=echo)
        # The hints that checkpoint was trained with (its meta, already read), else its logged l0.
        cfg = with_auto_hints(cfg, run_dir, step, meta=meta, echo=echo)
        echo(f"[twell] evaluating {ckpt_dir} (step {step}, config {cfg.name!r})")
        data = data_builder(with_saved_tokenizer(cfg, run_dir))
        ckpt_lib.check_corpus_fingerprint(run_dir, data, echo)
        graphdef = abstract_graphdef(cfg.model, cfg.train.seed)
        result = evaluate_params(cfg, data, jax.jit(make_eval_step(cfg, graphdef)), params, mesh, step=step)
    result["step"] = step
    result["l0_mean"] = float(np.mean(result["l0_per_layer"]))
    result["sparsity"] = 1.0 - result["l0_mean"] / cfg.model.d_ff
    result["dead_share_per_layer"] = meta["dead_share_per_layer"]
    # The "auto" hints the evaluation compiled with (None: none were set or found).
    result["auto_hints_per_layer"] = list(cfg.model.ffn_expected_active) or None
    echo(f"[twell] validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over "
         f"{int(result['tokens'])} tokens; mean active FFN neurons/token {result['l0_mean']:.1f} of "
         f"{cfg.model.d_ff} ({100 * result['sparsity']:.1f}% zero)")
    return result


# Older import site of the run-hint readers (twell_jax/training/hints.py holds them).
__all__ = ["evaluate_checkpoint", "with_auto_hints", "expected_active_from_run"]
