"""The `twell` command: train / eval / compare.

    twell train --config tiny [--set model.n_layers=2 --set train.steps=50] [--out DIR] [--overwrite]
    twell train --out DIR --resume [--step N] [--set train.steps=500]
    twell eval --checkpoint runs/tiny-20250101-120000 [--step N] [--set train.eval_batches=32]
    twell compare --config tiny [--set ...] [--out DIR]
    twell generate --checkpoint RUN --prompt "def main(" [--max-new-tokens 64 --temperature 0.8 --top-k 50]
    twell configs            (list presets)

Exit status: 0 done, 2 a clear error (bad argument, bad config, missing or corrupt checkpoint,
non-finite loss), 130 / 143 stopped by SIGINT / SIGTERM after checkpointing.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from twell_jax import config as config_lib

EXIT_ERROR = 2
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal number, as a shell reports it


def _load_config(name: str, overrides: list[str]) -> config_lib.ExperimentConfig:
    from twell_jax.configs import get_config

    return config_lib.apply_overrides(get_config(name), overrides)


def check_resumable_overrides(overrides: list[str]) -> None:
    """Only config.RESUMABLE_FIELDS may be set for a run that exists (resume, eval)."""
    fixed = sorted({item.split("=", 1)[0].strip() for item in overrides} - config_lib.RESUMABLE_FIELDS)
    if fixed:
        raise ValueError(f"--set {', '.join(fixed)}: cannot change for an existing run (its saved config.json is "
                         f"the source of truth); fields that may change: "
                         f"{', '.join(sorted(config_lib.RESUMABLE_FIELDS))}")


def resume_config(run_dir: Path, preset: str | None, overrides: list[str]) -> config_lib.ExperimentConfig:
    """The saved config of the run in `run_dir` with `overrides` (resumable fields only) applied."""
    from twell_jax.training import checkpoint as ckpt_lib

    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume: no run directory at {run_dir.absolute()} (check --out)")
    check_resumable_overrides(overrides)
    saved = ckpt_lib.load_run_config(run_dir)
    if preset is not None and preset != saved.name:
        raise ValueError(f"--config {preset!r}: the run in {run_dir} was trained with {saved.name!r}; leave out "
                         "--config when resuming (the run's saved config is used)")
    return config_lib.apply_overrides(saved, overrides)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twell", description="Activation-sparse transformer LMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_set(p: argparse.ArgumentParser, help_text: str) -> None:
        # action="extend": `--set a=1 --set b=2` keeps both (a plain nargs="*" keeps only the last).
        p.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE",
                       help=help_text)

    p_train = sub.add_parser("train", help="train a model (or continue one with --resume)")
    p_train.add_argument("--config", default=None, help="preset name (see `twell configs`; default tiny; "
                         "not needed with --resume)")
    add_set(p_train, "config overrides, e.g. --set model.n_layers=2 train.steps=50 (repeatable)")
    p_train.add_argument("--out", default=None, help="run directory (default runs/<name>-<timestamp>)")
    p_train.add_argument("--resume", action="store_true",
                         help="continue the run in --out from its newest intact checkpoint, with its saved config")
    p_train.add_argument("--step", type=int, default=None, help="with --resume: the checkpoint step to continue from")
    p_train.add_argument("--overwrite", action="store_true", help="replace the run already in --out")

    p_eval = sub.add_parser("eval", help="validation loss + perplexity of a checkpoint")
    p_eval.add_argument("--checkpoint", required=True, help="run directory (or its checkpoints/ dir)")
    p_eval.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest intact one)")
    add_set(p_eval, "eval-time overrides, e.g. train.eval_batches=32 (repeatable)")

    p_compare = sub.add_parser("compare", help="train the dense relu_gated twin and the sparse twell model, compare")
    p_compare.add_argument("--config", default="tiny", help="preset name (see `twell configs`)")
    add_set(p_compare, "config overrides for both runs (repeatable)")
    p_compare.add_argument("--out", default=None, help="output directory (default runs/compare-<name>-<timestamp>)")

    p_gen = sub.add_parser("generate", help="continue prompts with a trained run (KV cache, streamed)")
    p_gen.add_argument("--checkpoint", required=True, help="run directory (or its checkpoints/ dir)")
    p_gen.add_argument("--prompt", action="append", required=True,
                       help="prompt text; repeat for a batch (a single prompt is streamed as it is generated)")
    p_gen.add_argument("--max-new-tokens", type=int, default=64)
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p_gen.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p_gen.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus cut")
    p_gen.add_argument("--seed", type=int, default=0)
    p_gen.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p_gen.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))

    sub.add_parser("configs", help="list the presets")
    return parser


def _train(args: argparse.Namespace) -> None:
    from twell_jax.training import parallel
    from twell_jax.training.train import default_run_dir, train

    # Multi-host launch (SLURM, Open MPI, JAX_COORDINATOR_ADDRESS): before anything touches devices.
    parallel.initialize_distributed()
    if args.step is not None and not args.resume:
        raise ValueError("--step picks the checkpoint to continue from; it needs --resume")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pick one")
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out DIR (the run directory to continue)")
        out = Path(args.out)
        cfg = resume_config(out, args.config, args.set)
        print(f"[twell] train: resuming {out.absolute()} (config {cfg.name!r})"
              + (f" with overrides {args.set}" if args.set else ""))
    else:
        cfg = _load_config(args.config or "tiny", args.set)
        out = Path(args.out) if args.out else default_run_dir(cfg)
        print(f"[twell] train: config {cfg.name!r}" + (f" with overrides {args.set}" if args.set else ""))
    result = train(cfg, out, resume=args.resume, resume_step=args.step, overwrite=args.overwrite)
    print(json.dumps({k: result.summary[k] for k in ("val_loss", "val_perplexity", "val_l0_mean",
                                                    "val_sparsity", "tokens_per_s")}, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "configs":
        from twell_jax.configs import list_configs

        for name in list_configs():
            print(name)
        return 0
    from twell_jax.training.train import TrainingInterrupted

    try:
        if args.command == "train":
            _train(args)
        elif args.command == "eval":
            from twell_jax.training.evaluate import evaluate_checkpoint

            check_resumable_overrides(args.set)
            result = evaluate_checkpoint(args.checkpoint, step=args.step, overrides=args.set)
            print(json.dumps(result, indent=2))
        elif args.command == "compare":
            from twell_jax.compare import compare

            cfg = _load_config(args.config, args.set)
            out = Path(args.out) if args.out else Path("runs") / f"compare-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            print(f"[twell] compare: config {args.config!r}, writing to {out.absolute()}")
            compare(cfg, out)
        elif args.command == "generate":
            from twell_jax.inference.cli import run_generate

            run_generate(args)
    except TrainingInterrupted as err:
        print(f"twell {args.command}: {err}", file=sys.stderr)
        return EXIT_SIGNAL.get(err.signal_name, EXIT_ERROR)
    except (ValueError, FileNotFoundError, FloatingPointError) as err:
        print(f"twell {args.command}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
