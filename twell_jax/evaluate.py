"""Evaluate a saved checkpoint: validation loss, perplexity, per-layer activity and dead neurons."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from twell_jax import checkpoint as ckpt_lib
from twell_jax import config as config_lib
from twell_jax.config import ExperimentConfig
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
    cfg = with_auto_hints(cfg, ckpt_dir.parent, echo)
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


def expected_active_from_run(run_dir: str | Path, n_layers: int) -> tuple[float, ...] | None:
    """The latest per-layer mean active neurons per token a run logged (validation or training
    record of its metrics.jsonl), or None when it has none for `n_layers` layers."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    latest = None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key in ("val_l0_per_layer", "l0_per_layer"):
            values = record.get(key)
            if isinstance(values, list) and len(values) == n_layers:
                latest = tuple(float(v) for v in values)
                break
    return latest


def with_auto_hints(cfg: ExperimentConfig, run_dir: str | Path,
                    echo: Callable[[str], None] = print) -> ExperimentConfig:
    """`cfg` with `model.ffn_expected_active` filled from the run's telemetry when the sparse op runs
    with backend "auto" and no hint is set: "auto" then decides dense vs sparse per layer at trace
    time instead of sampling tokens on the device (speed only; the results are the same)."""
    model = cfg.model
    if (model.ffn_kind not in ("twell", "relu") or model.ffn_backend != "auto" or model.ffn_expected_active
            or "expected_active_per_token" in model.ffn_op_config):
        return cfg
    hints = expected_active_from_run(run_dir, model.n_layers)
    if hints is None:
        echo("[twell] no per-layer activity telemetry in the run: 'auto' samples tokens on the device")
        return cfg
    echo("[twell] 'auto' backend hints (expected active neurons/token per layer, from the run's "
         f"metrics.jsonl): {', '.join(f'{v:.1f}' for v in hints)}")
    return dataclasses.replace(cfg, model=dataclasses.replace(model, ffn_expected_active=hints))

