"""The `twell` command: train / eval / compare.

    twell train --config tiny [--set model.n_layers=2 train.steps=50] [--out DIR] [--resume]
    twell eval --checkpoint runs/tiny-20250101-120000 [--set train.eval_batches=32]
    twell compare --config tiny [--set ...] [--out DIR]
    twell generate --checkpoint RUN --prompt "def main(" [--max-new-tokens 64 --temperature 0.8 --top-k 50]
    twell configs            (list presets)
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from twell_jax import config as config_lib


def _load_config(name: str, overrides: list[str]) -> config_lib.ExperimentConfig:
    from configs import get_config

    return config_lib.apply_overrides(get_config(name), overrides)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twell", description="Activation-sparse transformer LMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", default="tiny", help="preset name (see `twell configs`)")
        p.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE",
                       help="config overrides, e.g. --set model.n_layers=2 train.steps=50")
        p.add_argument("--out", default=None, help="output directory (default runs/<name>-<timestamp>)")

    p_train = sub.add_parser("train", help="train a model")
    add_config_args(p_train)
    p_train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")

    p_eval = sub.add_parser("eval", help="validation loss + perplexity of a checkpoint")
    p_eval.add_argument("--checkpoint", required=True, help="run directory (or its checkpoints/ dir)")
    p_eval.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p_eval.add_argument("--set", nargs="*", default=[], help="eval-time overrides, e.g. train.eval_batches=32")

    p_compare = sub.add_parser("compare", help="train the dense relu_gated twin and the sparse twell model, compare")
    add_config_args(p_compare)

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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "configs":
        from configs import list_configs

        for name in list_configs():
            print(name)
        return 0
    try:
        if args.command == "train":
            from twell_jax.train import default_run_dir, train

            cfg = _load_config(args.config, args.set)
            if args.resume and args.out is None:
                raise ValueError("--resume needs --out DIR (the run directory to continue)")
            out = Path(args.out) if args.out else default_run_dir(cfg)
            print(f"[twell] train: config {args.config!r}" + (f" with overrides {args.set}" if args.set else ""))
            result = train(cfg, out, resume=args.resume)
            print(json.dumps({k: result.summary[k] for k in ("val_loss", "val_perplexity", "val_l0_mean",
                                                            "val_sparsity", "tokens_per_s")}, indent=2))
        elif args.command == "eval":
            from twell_jax.evaluate import evaluate_checkpoint

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
    except (ValueError, FileNotFoundError, FloatingPointError) as err:
        print(f"twell {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
