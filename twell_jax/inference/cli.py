"""`twell generate`: load a run (or a Hugging Face checkpoint) and continue prompts.

Every argument is checked (and every prompt encoded and fitted to the context) before anything is
printed. A single prompt with one sample streams its continuation to stdout as it is generated;
otherwise each continuation is printed when all are done, or all of them as one JSON document
with --json. Progress and notes go to stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, TextIO

from twell_jax import compile_cache
from twell_jax.config import decode_escapes
from twell_jax.inference.generate import Generator, SamplingConfig
from twell_jax.inference.load import load_run
from twell_jax.run_dir import checkpoint_arg


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The prompts and stop strings, after every check that needs no model."""
    if (args.checkpoint is None) == (args.hf is None):
        raise ValueError("give one of --checkpoint RUN (a trained run) or --hf DIR (a Hugging Face checkpoint)")
    if args.hf is not None and args.step is not None:
        raise ValueError("--step picks a checkpoint of a run; a --hf checkpoint has no steps")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: expected an integer >= 1")
    if args.decode_chunk < 1:
        raise ValueError(f"--decode-chunk {args.decode_chunk}: expected an integer >= 1 (decode steps per device call)")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples {args.num_samples}: expected an integer >= 1")
    if args.num_samples > 1 and args.temperature == 0:
        raise ValueError(f"--num-samples {args.num_samples} with --temperature 0 (greedy) gives identical "
                         "continuations; sample with --temperature > 0")
    try:
        SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as err:
        flag = str(err).split(" ", 1)[0].replace("_", "-")
        raise ValueError(f"--{flag}: {err}") from None
    for i, prompt in enumerate(args.prompt):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:  # bytes that are not UTF-8 reach argv as lone surrogates
            raise ValueError(f"--prompt {i}: not valid UTF-8 text (byte at position {err.start}); pass the prompt "
                             "in UTF-8") from None
        if not prompt:
            raise ValueError(f"--prompt {i} is empty")
    stops = [decode_escapes(s, "--stop") for s in args.stop]
    if any(not s for s in stops):
        raise ValueError("--stop: an empty stop string would stop at once")
    return list(args.prompt), stops


def _load(args: argparse.Namespace) -> Any:
    if args.hf is not None:
        from twell_jax.inference.hf import import_hf

        return import_hf(args.hf, dtype=args.dtype)
    run_dir, step = checkpoint_arg(args.checkpoint, args.step)
    return load_run(run_dir, step=step, dtype=args.dtype)


def run_generate(args: argparse.Namespace, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Generate for `args` (the parsed `twell generate` options); the result is written to `out`."""
    prompts, stops = _check_args(args)
    loaded = _load(args)
    source = args.hf if args.hf is not None else f"{args.checkpoint} step {loaded.step}"
    if loaded.tokenizer is None:
        raise ValueError(f"{source} has no tokenizer (no tokenizer.json and none rebuildable from its data config): "
                         "text prompts cannot be encoded")
    if args.decode_layout is not None:
        transposed = args.decode_layout == "transposed"
        loaded.config = dataclasses.replace(loaded.config, decode=dataclasses.replace(loaded.config.decode,
                                                                                    transposed=transposed))
    generator = loaded._generator = Generator(loaded, chunk=args.decode_chunk)
    # Encode and fit every prompt before anything is printed: a bad prompt stops here.
    try:
        encoded = generator.encode(prompts)
        ids = generator.fit_prompts(encoded, args.max_new_tokens, args.truncate_prompt)
    except ValueError as err:  # the library's argument names, as the command line spells them
        raise ValueError(str(err).replace("max_new_tokens=", "--max-new-tokens ").replace("prompt ", "--prompt ", 1)
                         ) from None
    shown = []
    for i, (prompt, full_ids, kept) in enumerate(zip(prompts, encoded, ids)):
        full = len(full_ids)
        if len(kept) < full:
            print(f"[twell] generate: prompt {i} truncated to its last {len(kept)} of {full} tokens "
                  "(--truncate-prompt left)", file=sys.stderr)
            shown.append(loaded.tokenizer.decode(kept))
        else:
            shown.append(prompt)
    print(f"[twell] generate: {source}, {loaded.config.model.ffn_kind} ({loaded.config.model.ffn_backend}), "
          f"{args.dtype}{compile_cache.describe()}", file=sys.stderr)
    rows = [row for row in ids for _ in range(args.num_samples)]  # each prompt's samples side by side
    streaming = len(rows) == 1 and not args.json

    def stream(row: int, token: int, text: str) -> None:
        out.write(text)
        out.flush()

    if streaming:
        out.write(shown[0])
        out.flush()
    result = generator.generate(rows, args.max_new_tokens,
                                SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed),
                                stream=stream if streaming else None, stop=stops)
    texts = result.texts or []
    report = {"source": source, "step": loaded.step, "prompts": [
        {"prompt": prompt, "prompt_tokens": len(kept), "samples": [
            {"text": texts[r], "tokens": result.tokens[r], "finish_reason": result.finish_reasons[r]}
            for r in range(i * args.num_samples, (i + 1) * args.num_samples)]}
        for i, (prompt, kept) in enumerate(zip(shown, ids))],
        "compile_s": result.compile_s, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
        "decode_steps": result.decode_steps, "decode_chunk": args.decode_chunk,
        "decode_layout": "transposed" if loaded.config.decode.transposed else "stored",
        "decode_tokens_per_s": result.decode_tokens_per_s()}
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    elif streaming:
        out.write("\n")
    else:
        for entry in report["prompts"]:
            for n, sample in enumerate(entry["samples"]):
                label = f" (sample {n + 1} of {args.num_samples})" if args.num_samples > 1 else ""
                out.write(f"--- {entry['prompt']!r}{label}\n{entry['prompt']}{sample['text']}\n")
    out.flush()
    reasons = ", ".join(f"{r} after {len(t)} tokens" for r, t in zip(result.finish_reasons, result.tokens))
    print(f"[twell] stopped: {reasons}", file=sys.stderr)
    speed = result.decode_tokens_per_s()
    if speed is not None:
        print(f"[twell] speed: compile {result.compile_s:.1f}s (not timed below); prefill {result.prefill_s:.3f}s; "
              f"decode {speed:.1f} tokens/s ({len(rows)} row(s) x {result.decode_steps} steps in "
              f"{result.decode_s:.2f}s, {1e3 * result.decode_s / result.decode_steps:.2f} ms/step, "
              f"{args.decode_chunk} steps per device call)", file=sys.stderr)
    return report
