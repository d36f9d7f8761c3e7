"""Train a model until its FFN layers are sparse: the checkpoint the model-level sparse benchmarks use.

    python experiments/train_to_sparse.py --config 0.5b --minutes 10 --out runs/0.5b-sparse
    python experiments/train_to_sparse.py --config 0.5b --lr 1e-3 --profile none --target-active 40 --data stdlib \
        --l1 5e-3 --l1-ramp-steps 2000 --out runs/0.5b-sparser           # the older checkpoints' recipe
    python experiments/train_to_sparse.py --dry-run --out /tmp/sparse-dry      # micro shapes on CPU (the test)

The result is an ordinary `twell train` run directory (config.json, verified checkpoints,
metrics.jsonl, the tokenizer), so `twell eval`, `twell generate`, `load_run` and the benchmarks take
it as it is. What this script adds to the preset:
- the sparse kind (`twell`) trained through the op's `dense` backend: the same function and
  gradients as every other backend, one compiled program for the whole run (no re-planning while
  the layers sparsify), and the fastest step while most neurons are still active;
- the L1 coefficient ramped linearly from 0 at step 0 to `--l1` at `--l1-ramp-steps` (default 1e-3
  in 300 steps, the quality study's `small` schedule): a short run needs a much stronger penalty than
  the paper's 2e-5 over 30000 steps of 1M tokens;
- a peak learning rate of 3e-4 (`--lr`): with Adam each parameter moves by about the learning
  rate per step whatever its gradient's size, so once the L1 term dominates a gate row's gradient
  the row is pushed below zero on every input within a few steps: at the preset's 1e-3 a `0.5b`
  lost most of its middle layers' neurons, at 3e-4 far fewer, at a lower validation loss
  (BENCHMARKS.md, "Checkpoints at the paper's sparsity": checkpoints A and D);
- the `installed` corpus by default (`--data`): large enough that a run of minutes sees each
  token once;
- per-layer targets (`--profile`, default "small"): the active neurons per token the paper reports
  for the preset (`--target-active`, PAPER_ACTIVE) spread over the layers in the shape of a
  trained model's profile (SMALL_STUDY_PROFILE: rising with depth), the L1 penalty of each layer
  adapted every step towards its target (`sparsity.target_active`; docs/training.md, "Per-layer
  targets"): a short strong schedule alone sparsifies the first layers least and the others far
  past the paper's mean (a `0.5b` stopped at 31.6 active/token with 125 in layer 0, 9-38 in the
  others and 55% dead neurons). The run stops once every layer has been within `--tolerance` of its
  target for `--patience` consecutive steps. `--profile none` is the older recipe: no per-layer
  targets, a stop once the layers' mean has been at or under `--target-active` for `--patience`
  steps (checkpoints sparser than trained models);
- otherwise `--steps` or `--minutes` ends the run. Either way the run is checkpointed and evaluated.
Printed last: the step and L1 coefficient reached, the validation loss, why a run that missed its
goal missed it (the mean above the goal: still inside the L1 ramp, or `--l1` too weak; the mean at
the goal with layers outside their tolerance, named, with their dead shares where those are high),
the validation tokens' mean activity where it differs by over 10% from the last training batch's
(the goal is measured on training batches), the per-layer active neurons per token (training
batch and validation) beside their targets, and each layer's share of dead neurons. `--summary`
gets that and the logged trajectory, `--plot` a picture of both.
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


# The active FFN neurons per token the paper reports after training at its L1 (arXiv 2603.23198, its
# text on activity: 39 at 0.5B, 29 at 1.5B, 24 at 2B). It gives no figure at 1B: 29, the 1.5B one.
PAPER_ACTIVE = {"0.5b": 39.0, "1b": 29.0, "1.5b": 29.0, "2b": 24.0}

# The per-layer profile of a trained model at about the paper's sparsity: the quality study's `small`
# (8 layers) trained with L1 1e-3, 28.3 active/token on average, 6.2% dead neurons (`twell compare
# --config small --l1 1e-3 3e-3 1e-2 --l1-warmup-steps 300 --set data.source=installed
# train.steps=6000`, H100, 2026-11-24; validation active neurons per token of each layer). Rising
# with depth, layer 1 the least active, the last about twice the mean.
SMALL_STUDY_PROFILE = (23.33, 13.26, 17.55, 28.01, 24.46, 31.02, 35.85, 52.96)
PROFILES = {"small": SMALL_STUDY_PROFILE, "flat": (1.0,)}


def parse_profile(text: str) -> tuple[float, ...] | None:
    """--profile: a name of PROFILES, comma-separated numbers > 0, or "none" (None)."""
    if text == "none":
        return None
    if text in PROFILES:
        return PROFILES[text]
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"expected none, {', '.join(PROFILES)} or comma-separated numbers, got {text!r}") from None
    if any(not 0 < v < float("inf") for v in values):
        raise ValueError(f"the numbers must be > 0 and finite, got {text!r}")
    return values


def layer_targets(profile: tuple[float, ...], n_layers: int, mean: float) -> tuple[float, ...]:
    """Per-layer targets of the profile's shape over `n_layers` layers with mean `mean`: the profile
    read at each layer's relative depth (linear between the profile's layers, its end values
    beyond them), then scaled."""
    if not profile or any(not v > 0 for v in profile):
        raise ValueError(f"a profile needs numbers > 0, got {profile!r}")
    source = (np.arange(len(profile)) + 0.5) / len(profile)
    shape = np.interp((np.arange(n_layers) + 0.5) / n_layers, source, np.asarray(profile, np.float64))
    return tuple(float(v) for v in shape * (mean / shape.mean()))


def plot(reached: dict[str, Any], trajectory: list[dict[str, float]], path: Path) -> None:
    """Two panels: each layer's active neurons per token (training batch, validation, the targets)
    with its dead share, and the run's trajectory (the layers' mean and, with targets, the worst
    layer's relative error, against the step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_layers, ax_steps) = plt.subplots(1, 2, figsize=(13, 4.5))
    layers = np.arange(len(reached["val_l0_per_layer"]))
    ax_layers.plot(layers, reached["val_l0_per_layer"], "o-", label="validation")
    if reached["train_l0_per_layer"]:
        ax_layers.plot(layers, reached["train_l0_per_layer"], ".--", label="last training batch")
    if reached["target_active_per_layer"]:
        ax_layers.plot(layers, reached["target_active_per_layer"], "k_", markersize=14, mew=2, label="target")
    ax_layers.set_xticks(layers[::max(1, len(layers) // 20)])
    ax_layers.set_xlabel("layer")
    ax_layers.set_ylabel("active FFN neurons per token")
    ax_layers.set_title(f"{reached['config']}, step {reached['steps']} ({reached['profile']} profile)")
    ax_layers.legend(fontsize=8, loc="upper left")
    if reached["dead_share_per_layer"]:
        ax_dead = ax_layers.twinx()
        ax_dead.bar(layers, reached["dead_share_per_layer"], alpha=0.2, color="gray")
        ax_dead.set_ylabel("dead share (bars)")
        ax_dead.set_ylim(0, 1)
    steps = [t["step"] for t in trajectory]
    ax_steps.plot(steps, [t["l0_mean"] for t in trajectory], label="layers' mean")
    ax_steps.axhline(reached["target_active"], color="black", linestyle="--", label="target mean")
    ax_steps.set_yscale("log")
    ax_steps.set_xlabel("step")
    ax_steps.set_ylabel("active FFN neurons per token")
    if trajectory and "worst_layer_error" in trajectory[0]:
        ax_error = ax_steps.twinx()
        ax_error.plot(steps, [t["worst_layer_error"] for t in trajectory], color="tab:red", alpha=0.6)
        ax_error.set_yscale("log")
        ax_error.set_ylabel("worst layer's relative error (red)")
    ax_steps.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ProfileReached:
    """`Hooks.should_stop` with per-layer targets: stop once every layer's active count of the step's
    batch has been within `tolerance` (relative) of its target for `patience` steps in a row; keeps
    the trajectory of every step."""

    def __init__(self, targets: tuple[float, ...], tolerance: float, patience: int):
        self.targets, self.tolerance, self.patience = np.asarray(targets), tolerance, patience
        self.streak = 0
        self.trajectory: list[dict[str, float]] = []

    def __call__(self, record: dict[str, Any]) -> str | None:
        active = np.asarray(record["l0_per_layer"], np.float64)
        worst = float(np.max(np.abs(active / self.targets - 1.0)))
        self.trajectory.append({"step": record["step"], "ce": float(record["ce"]), "l0_mean": float(active.mean()),
                                "worst_layer_error": worst})
        self.streak = self.streak + 1 if worst <= self.tolerance else 0
        if self.streak >= self.patience:
            return (f"every layer's active FFN neurons/token within {self.tolerance:.0%} of its target for "
                    f"{self.patience} consecutive steps (mean {active.mean():.1f})")
        return None


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


# The fields --profile and --approach-steps set (a --set of them, applied last, wins).
PROFILE_FIELDS = ("sparsity.target_active", "sparsity.target_approach_steps")


def build_config(args: argparse.Namespace, profile_sets: list[str] | None = None) -> ExperimentConfig:
    """The preset with the script's training settings, then `profile_sets` (the per-layer targets),
    then the user's --set overrides; without `profile_sets` the user's settings of PROFILE_FIELDS
    are left out too (the model's shape, to size the targets from)."""
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
    user = list(args.set) if profile_sets is not None else [
        item for item in args.set if item.split("=", 1)[0].strip() not in PROFILE_FIELDS]
    return config_lib.apply_overrides(base, sets + (profile_sets or []) + user)


def explain_outcome(reached: dict[str, Any], target_mean: float, tolerance: float, ramp_steps: int) -> list[str]:
    """What the summary `reached` says beyond its verdict: why a run missed its goal and what to
    change, and how the validation tokens' activity compares with the training batches' (the goal
    is measured on the latter). Lines to print."""
    train, val = reached["train_l0_per_layer"], reached["val_l0_per_layer"]
    targets, dead = reached["target_active_per_layer"], reached["dead_share_per_layer"]
    if not train:
        return []
    lines = []
    train_mean = float(np.mean(train))
    if not reached["reached_target"]:
        if train_mean > target_mean * (1 + (tolerance if targets else 0.0)):
            ramp_done = reached["steps"] >= ramp_steps
            lines.append(f"the layers average {train_mean:.1f} active/token, above {target_mean:g}: "
                         + ("the L1 schedule reached --l1 without getting there: raise --l1" if ramp_done else
                            f"the run ended inside the L1 ramp (step {reached['steps']} of --l1-ramp-steps "
                            f"{ramp_steps}): give it more --steps / --minutes, or a stronger --l1"))
        elif targets:
            def outside(sign: int) -> list[int]:
                return [i for i, (v, t) in enumerate(zip(train, targets)) if sign * (v - t) > tolerance * t]

            above, below = outside(1), outside(-1)
            parts = ([f"layer(s) {', '.join(map(str, above))} above"] if above else []) + (
                [f"layer(s) {', '.join(map(str, below))} below"] if below else [])
            lines.append(f"the layers average {train_mean:.1f} active/token, within {tolerance:.0%} of "
                         f"{target_mean:g}, but {' and '.join(parts) or 'no layer'} their targets by more than "
                         f"{tolerance:.0%} on the last training batch: the per-layer adaptation had not held "
                         "them there for --patience steps when the run stopped (more --steps / --minutes)")
            dead_below = [i for i in below if dead and dead[i] >= 0.2]
            if dead_below:
                lines.append("below their targets with many dead neurons: layer(s) "
                             + ", ".join(f"{i} ({dead[i]:.0%} dead)" for i in dead_below)
                             + ": a lower penalty does not revive a neuron that no longer fires "
                             "(docs/training.md, \"Per-layer targets (ours)\")")
    if val:
        val_mean = float(np.mean(val))
        if train_mean > 0 and abs(val_mean / train_mean - 1) > 0.1:
            lines.append(f"on its validation tokens the layers average {val_mean:.1f} active/token, "
                         f"{val_mean / train_mean:.2f}x the last training batch's ({train_mean:.1f}), on which the "
                         "goal is measured")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from twell_jax.training import parallel

    parallel.prepare_process()  # the twell commands' memory share and XLA options, before any device use
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="0.5b", help="preset (configs/); --dry-run uses micro")
    parser.add_argument("--out", required=True, help="run directory to create (must be empty or absent)")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    parser.add_argument("--target-active", type=float, default=None,
                        help="mean over layers of active FFN neurons per token to train to (default: the "
                             "paper's at its sizes, 39 at 0.5b, 29 at 1b and 1.5b, 24 at 2b; else 40)")
    parser.add_argument("--profile", default="small",
                        help="per-layer targets of this shape with that mean, the L1 penalty adapted per layer "
                             "(sparsity.target_active): 'small' (a trained model's profile: the quality study's), "
                             "'flat', or comma-separated numbers (any scale, read over relative depth); 'none': "
                             "no per-layer targets, stop at the mean (the checkpoints sparser than trained)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="with a profile: stop when every layer is within this relative error of its target "
                             "(default 0.15)")
    parser.add_argument("--patience", type=int, default=20, help="consecutive steps meeting the target")
    parser.add_argument("--approach-steps", type=int, default=0,
                        help="with a profile: move the targets from half of each layer's neurons to their "
                             "final values over this many steps (sparsity.target_approach_steps; 0: hold the "
                             "final targets from the first step)")
    parser.add_argument("--l1", type=float, default=1e-3,
                        help="L1 coefficient at the end of the ramp (the quality study's trained `small`'s)")
    parser.add_argument("--l1-ramp-steps", type=int, default=300, help="steps of the linear L1 ramp from 0")
    parser.add_argument("--steps", type=int, default=3000, help="most optimizer steps (also the lr schedule)")
    parser.add_argument("--minutes", type=float, default=0.0, help="wall-clock limit of the loop (0 = none)")
    parser.add_argument("--lr", type=float, default=3e-4,
                        help="peak learning rate (at the presets' 1e-3 most neurons of a `0.5b`'s middle layers died)")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step (default: the micro-batch; 8 at the paper's sizes)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per device (default: the preset's; 8 at the paper's sizes)")
    parser.add_argument("--data", default="installed",
                        help="data.source (default: every installed package's sources, 138M tokens on the GPU "
                             "image: a run of a few thousand steps sees no token twice; 'stdlib', 2.4M tokens "
                             "there, is seen ~16 times by 2400 steps of 0.5b and came out less sparse than asked)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE",
                        help="further config overrides, applied last")
    parser.add_argument("--summary", default=None, help="write the result and trajectory as JSON here")
    parser.add_argument("--plot", default=None, help="draw the per-layer profile against the targets and the "
                                                     "trajectory into this PNG")
    parser.add_argument("--dry-run", action="store_true", help="micro shapes, synthetic tokens, CPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.config, args.data = "micro", "synthetic"
    for name in ("patience", "steps", "l1_ramp_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.target_active is None:
        args.target_active = PAPER_ACTIVE.get(args.config, 40.0)
    try:
        profile = parse_profile(args.profile)
    except ValueError as err:
        parser.error(f"--profile: {err}")
    if profile is None and args.tolerance is not None:
        parser.error("--tolerance applies to per-layer targets; --profile none stops at the mean (--target-active)")
    if args.approach_steps and profile is None:
        parser.error("--approach-steps moves per-layer targets; --profile none has none")
    if args.approach_steps < 0:
        parser.error("--approach-steps must be >= 0")
    args.tolerance = 0.15 if args.tolerance is None else args.tolerance
    if not args.target_active > 0 or not args.l1 > 0 or args.minutes < 0 or not 0 < args.tolerance < 1:
        parser.error("--target-active and --l1 must be > 0, --minutes >= 0, --tolerance in (0, 1)")
    if args.global_batch is None:
        args.global_batch = args.micro_batch or (RECIPE_MICRO_BATCH if args.config in RECIPE_REMAT
                                                 else get_config(args.config).train.micro_batch)
    try:
        cfg = build_config(args)
    except ValueError as err:
        parser.error(f"--set: {err}")
    targets = None
    if profile is not None:
        targets = layer_targets(profile, cfg.model.n_layers, args.target_active)
        try:
            cfg = build_config(args, ["sparsity.target_active=" + ",".join(f"{t:.4g}" for t in targets),
                                      f"sparsity.target_approach_steps={args.approach_steps}"])
        except ValueError as err:  # a target past d_ff
            parser.error(f"--target-active {args.target_active:g} with --profile {args.profile}: {err}")
        targets = tuple(float(t) for t in cfg.sparsity.target_active)  # as the run's config holds them
        print(f"[train_to_sparse] per-layer targets ({args.profile} profile, mean {args.target_active:g}): "
              + " ".join(f"{t:.1f}" for t in targets), flush=True)

    stop = (SparseEnough(args.target_active, args.patience) if targets is None
            else ProfileReached(targets, args.tolerance, args.patience))
    result = Trainer(cfg, args.out, overwrite=args.overwrite, hooks=Hooks(should_stop=stop)).run()
    summary = result.summary
    last = result.last_metrics or {}
    reached = {
        "run_dir": str(Path(args.out).absolute()), "config": args.config, "target_active": args.target_active,
        "profile": args.profile, "target_active_per_layer": list(targets) if targets else None,
        "reached_target": bool(summary.get("stopped_by_hook")), "steps": summary["steps"],
        "l1_coef_reached": float(l1_coefficient(cfg.sparsity, np.int32(summary["steps"] - 1))),
        # With targets: each layer's coefficient after the last step's adaptation.
        "l1_coef_per_layer_reached": last.get("l1_coef_per_layer"),
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
    if args.plot:
        plot(reached, stop.trajectory, Path(args.plot))
    fmt = lambda values: " ".join(f"{v:.1f}" for v in values) if values else "n/a"  # noqa: E731
    goal = (f"<= {args.target_active:g} active/token" if targets is None else
            f"every layer within {args.tolerance:.0%} of its target ({args.profile} profile, mean {args.target_active:g})")
    print(f"[train_to_sparse] {'reached' if reached['reached_target'] else 'did NOT reach'} {goal} at step "
          f"{reached['steps']} (L1 {reached['l1_coef_reached']:.3g}"
          + (f", per layer {' '.join(f'{v:.3g}' for v in reached['l1_coef_per_layer_reached'])}"
             if reached["l1_coef_per_layer_reached"] else "") + f"); val loss {reached['val_loss']:.4f}")
    for line in explain_outcome(reached, args.target_active, args.tolerance, args.l1_ramp_steps):
        print(f"[train_to_sparse] {line}")
    dead = reached["dead_share_per_layer"]
    print("| layer-mean active | train batch | validation |" + (" target |" if targets else "") + " dead share |\n"
          + "|---|---|---|" + ("---|" if targets else "") + "---|\n"
          + f"| {np.mean(reached['train_l0_per_layer'] or [np.nan]):.1f} | {fmt(reached['train_l0_per_layer'])} | "
          f"{fmt(reached['val_l0_per_layer'])} |" + (f" {fmt(targets)} |" if targets else "")
          + (f" {' '.join(f'{v:.2f}' for v in dead)} |" if dead else " n/a |"))
    return reached


if __name__ == "__main__":
    main()
