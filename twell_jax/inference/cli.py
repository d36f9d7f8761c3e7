"""`twell generate`: load a run and continue prompts, printing tokens as they come."""
from __future__ import annotations

import argparse
import sys

from twell_jax.inference.generate import generate
from twell_jax.inference.load import load_run


def run_generate(args: argparse.Namespace) -> None:
    """Stream a single prompt's continuation to stdout; print each continuation of a batch after it."""
    loaded = load_run(args.checkpoint, step=args.step, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"{args.checkpoint} has no tokenizer (no tokenizer.json and none rebuildable from its "
                         "data config): text prompts cannot be encoded")
    print(f"[twell] generate: {args.checkpoint} step {loaded.step}, {loaded.config.model.ffn_kind} "
          f"({loaded.config.model.ffn_backend}), {args.dtype}", file=sys.stderr)
    single = len(args.prompt) == 1

    def stream(row: int, token: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if single:
        sys.stdout.write(args.prompt[0])
    result = generate(loaded, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=stream if single else None)
    if single:
        sys.stdout.write("\n")
    else:
        for prompt, text in zip(args.prompt, result.texts or []):
            print(f"--- {prompt!r}\n{prompt}{text}")
    reasons = ", ".join(f"{r} after {len(t)} tokens" for r, t in zip(result.finish_reasons, result.tokens))
    print(f"[twell] stopped: {reasons}", file=sys.stderr)
