"""Train a model until its FFN layers are sparse: the checkpoint the model-level sparse benchmarks use.

    python experiments/train_to_sparse.py --config 0.5b --target-active 40 --minutes 6 --out runs/0.5b-sparse
    python experiments/train_to_sparse.py --dry-run --out /tmp/sparse-dry      # micro shapes on CPU (the test)

The result is an ordinary `twell train` run directory (config.json, verified checkpoints,
metrics.jsonl, the tokenizer), so `twell eval`, `twell generate`, `load_run` and the benchmarks take
it as it is. What this script adds to the preset:
- the sparse kind (`twell`) trained through the op's `dense` backend: the same function and
  gradients as every other backend, one compiled program for the whole run (no re-planning while
  the layers sparsify), and the fastest step while most neurons are still active;
- the L1 coefficient ramped linearly from 0 at step 0 to `--l1` at `--l1-ramp-steps`: a short
  schedule needs a much stronger penalty than the paper's 2e-5 over 30000 steps of 1M tokens, and
  with the stop below the ramp ends at about the weakest coefficient that reaches the target;
- a stop (`Hooks.should_stop`) once the mean over layers of the active neurons per token has been
  at or under `--target-active` for `--patience` consecutive steps; otherwise `--steps` or
  `--minutes` ends the run. Either way the run is checkpointed and evaluated.
Printed last: the step and L1 coefficient reached, the validation loss and the per-layer active
neurons per token (training batch and validation). `--summary` gets that and the logged trajectory.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from twell_jax.configs import get_config
from twell_jax import config as config_lib
from twell_jax.config import ExperimentConfig
from twell_jax.training.loss import l1_coefficient
from twell_jax.training.train import Hooks, Trainer

# --dry-run: the micro preset's shapes, a handful of steps, synthetic tokens.
DRY_RUN_SETS = ["train.eval_batch_size=4", "train.eval_batches=1"]


class SparseEnough:
    """`Hooks.should_stop`: stop once the layer-mean active count of the step's batch has been
    <= `target` for `patience` steps in a row; keeps the trajectory of every step."""

    def __init__(self, target: float, patience: int):
        self.target, self.patience = target, patience
        self.streak = 0
        self.trajectory: list[dict[str, float]] = []

    def __call__(self, record: dict[str, Any]) -> str | None:
        mean_active = float(np.mean(record["l0_per_layer"]))
        self.trajectory.append({"step": record["step"], "ce": float(record["ce"]), "l0_mean": mean_active})
        self.streak = self.streak + 1 if mean_active <= self.target else 0
        if self.streak >= self.patience:
            return (f"mean active FFN neurons/token {mean_active:.1f} <= {self.target:g} for {self.patience} "
                    "consecutive steps")
        return None


# The recipe of the benchmark checkpoints at the paper's sizes (BENCHMARKS.md cites these runs): 8
# sequences per step and these remat policies, whatever the presets' measured execution (which is
# the sparse backends' and the twin's in long runs). This script trains through the dense path, whose
# `2b` step at remat none peaks close to an 80 GB H100's memory (BENCHMARKS.md): full keeps a margin.
RECIPE_MICRO_BATCH = 8
RECIPE_REMAT = {"0.5b": "none", "1b": "none", "1.5b": "none", "2b": "full"}


def build_config(args: argparse.Namespace) -> ExperimentConfig:
    """The preset with the script's training settings, then the user's --set overrides."""
    base = get_config(args.config)
    recipe = []
    if args.config in RECIPE_REMAT:
        recipe = [f"model.remat={RECIPE_REMAT[args.config]}", f"train.micro_batch={RECIPE_MICRO_BATCH}",
                  f"train.global_batch={RECIPE_MICRO_BATCH}"]
    sets = recipe + [
        "model.ffn_kind=twell", "model.ffn_backend=dense", f"data.source={args.data}",
        f"data.vocab_size={base.model.vocab_size}",
        f"train.steps={args.steps}", f"train.time_limit_s={args.minutes * 60:g}",
        "train.eval_every=0", "train.checkpoint_every=0", "train.log_every=10", "data.val_fraction=0.05",
        "train.eval_batch_size=8", "train.eval_batches=16",
        f"optim.warmup_steps={args.warmup_steps}", f"optim.lr={args.lr:g}",
        f"sparsity.l1_coef={args.l1:g}", "sparsity.l1_warmup_start=0", f"sparsity.l1_warmup_end={args.l1_ramp_steps}",
    ]
    if args.data != "synthetic":
        sets.append("data.tokenizer=bpe")
    if args.global_batch:
        sets.append(f"train.global_batch={args.global_batch}")
    if args.micro_batch:
        sets.append(f"train.micro_batch={args.micro_batch}")
    if args.dry_run:
        sets += DRY_RUN_SETS
    return config_lib.apply_overrides(base, sets + list(args.set))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from twell_jax.training import parallel

    parallel.prepare_process()  # the twell commands' memory share and XLA options, before any device use
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="0.5b", help="preset (configs/); --dry-run uses micro")
    parser.add_argument("--out", required=True, help="run directory to create (must be empty or absent)")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    parser.add_argument("--target-active", type=float, default=40.0,
                        help="stop at this mean over layers of active FFN neurons per token")
    parser.add_argument("--patience", type=int, default=20, help="consecutive steps at or under the target")
    parser.add_argument("--l1", type=float, default=5e-3, help="L1 coefficient at the end of the ramp")
    parser.add_argument("--l1-ramp-steps", type=int, default=2000, help="steps of the linear L1 ramp from 0")
    parser.add_argument("--steps", type=int, default=3000, help="most optimizer steps (also the lr schedule)")
    parser.add_argument("--minutes", type=float, default=0.0, help="wall-clock limit of the loop (0 = none)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step (default: the micro-batch; 8 at the paper's sizes)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per device (default: the preset's; 8 at the paper's sizes)")
    parser.add_argument("--data", default="stdlib", help="data.source (default: the Python standard library)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE",
                        help="further config overrides, applied last")
    parser.add_argument("--summary", default=None, help="write the result and trajectory as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="micro shapes, synthetic tokens, CPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.config, args.data = "micro", "synthetic"
    for name in ("patience", "steps", "l1_ramp_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.target_active > 0 or not args.l1 > 0 or args.minutes < 0:
        parser.error("--target-active and --l1 must be > 0, --minutes >= 0")
    if args.global_batch is None:
        args.global_batch = args.micro_batch or (RECIPE_MICRO_BATCH if args.config in RECIPE_REMAT
                                                 else get_config(args.config).train.micro_batch)
    cfg = build_config(args)

    stop = SparseEnough(args.target_active, args.patience)
    result = Trainer(cfg, args.out, overwrite=args.overwrite, hooks=Hooks(should_stop=stop)).run()
    summary = result.summary
    last = result.last_metrics or {}
    reached = {
        "run_dir": str(Path(args.out).absolute()), "config": args.config, "target_active": args.target_active,
        "reached_target": bool(summary.get("stopped_by_hook")), "steps": summary["steps"],
        "l1_coef_reached": float(l1_coefficient(cfg.sparsity, np.int32(summary["steps"] - 1))),
        "val_loss": summary["val_loss"], "val_l0_per_layer": summary["val_l0_per_layer"],
        "train_l0_per_layer": [float(v) for v in last.get("l0_per_layer", [])],
        "dead_share_per_layer": summary["dead_share_per_layer"], "tokens_per_s": summary["tokens_per_s"],
        # Where the start-up went (the trainer's start-up line): seconds per phase, and to the first step done.
        "startup_s": summary["startup_s"], "first_step_done_s": summary["first_step_done_s"],
        # Every 10th step and the last one (once, also when it is a 10th).
        "trajectory": stop.trajectory[:-1:10] + stop.trajectory[-1:],
    }
    if args.summary:
        Path(args.summary).write_text(json.dumps(reached, indent=2))
    fmt = lambda values: " ".join(f"{v:.1f}" for v in values) if values else "n/a"  # noqa: E731
    print(f"[train_to_sparse] {'reached' if reached['reached_target'] else 'did NOT reach'} <= "
          f"{args.target_active:g} active/token at step {reached['steps']} (L1 {reached['l1_coef_reached']:.3g}); "
          f"val loss {reached['val_loss']:.4f}")
    print(f"| layer-mean active | train batch | validation |\n|---|---|---|\n"
          f"| {np.mean(reached['train_l0_per_layer'] or [np.nan]):.1f} | {fmt(reached['train_l0_per_layer'])} | "
          f"{fmt(reached['val_l0_per_layer'])} |")
    return reached


if __name__ == "__main__":
    main()
