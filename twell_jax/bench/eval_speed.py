"""Speed of downstream evaluation: `twell eval --tasks` (our lm-eval adapter, the model's own JAX
forward) against lm-eval's own `hf` backend (PyTorch, `transformers`) on the same run exported to
Hugging Face, on the same GPU, at the same batch size.

    python experiments/bench_eval.py --checkpoint RUN --items 2000 --batch-size 32 --out DIR
    python experiments/bench_eval.py --checkpoint RUN --items 8 --warm-items 4 --out DIR   # a quick check

A local multiple-choice task (lm-eval's json loader, no download) of --items items is made from the
run's validation text: each item's context is --context-tokens tokens of it, its four choices
--choice-tokens tokens each: the text that follows (the answer) and three continuations taken from
elsewhere. The run is exported (`twell hf export`, bfloat16) into --out; then each side runs as a
command of its own, in its own process, once on --warm-items items and once on --items items:

    ours  twell eval --checkpoint RUN --tasks TASK.yaml --batch-size B --dtype bfloat16 --json
          --compile-cache OUT/xla_cache/SIDE [--set model.ffn_backend=NAME]   (once per --backends NAME, e.g.
          auto,dense: the sparse kernels against the dense path; default: once, the run's backend)
    hf    python -m lm_eval --model hf --model_args pretrained=EXPORT,dtype=bfloat16 --tasks TASK
          --include_path DIR --batch_size B --device DEVICE --output_path ...

Per item = (wall(items) - wall(warm items)) / (items - warm items): the start-up (imports, loading
the model) cancels, what remains is the time each item adds. Our side compiles nothing in either
timed run: an untimed first run on all the items fills a persistent compilation cache of that
side's own (every program, `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`), which both timed runs
load; without it a batch shape met only in the longer run (a longer power-of-two length bucket, a
last partial batch) would count its compile as per-item time, more for the kernels' programs than
for the dense path's. A run whose requests (4 per item) are not a whole number of batches is still
noted (the defaults avoid it). The wall times and each side's accuracy (which must agree: the same model, the same
requests) go to bench_eval.json in --out, with hf's time per item over each of our sides'
(`vs_hf_per_item`); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TASK = "twell_speed_mc"


def make_task(run_dir: str, where: Path, items: int, context_tokens: int, choice_tokens: int, seed: int) -> Path:
    """The task YAML (and its jsonl) of `items` items from the run's validation text."""
    from twell_jax.inference.load import load_tokenizer_for_run, validation_tokens
    from twell_jax.training.checkpoint import load_run_config

    tokenizer = load_tokenizer_for_run(run_dir, load_run_config(run_dir))  # the text only: no weights
    if tokenizer is None:
        raise ValueError(f"{run_dir} has no tokenizer: the task is text")
    span = context_tokens + choice_tokens
    rows = validation_tokens(run_dir, 64, cycle=True)
    pieces = [row[i:i + span] for row in rows for i in range(0, len(row) - span + 1, span)]
    if len(pieces) < 4:
        raise ValueError(f"{run_dir}'s validation text holds {len(pieces)} pieces of {span} tokens: too few")
    rng = random.Random(seed)
    where.mkdir(parents=True, exist_ok=True)
    data = where / f"{TASK}.jsonl"
    with open(data, "w") as f:
        for n in range(items):
            piece = pieces[n % len(pieces)]
            others = rng.sample([p for i, p in enumerate(pieces) if i != n % len(pieces)], 3)
            answer = rng.randrange(4)
            choices = [tokenizer.decode(list(p[context_tokens:])) for p in others]
            choices.insert(answer, tokenizer.decode(list(piece[context_tokens:])))
            f.write(json.dumps({"question": tokenizer.decode(list(piece[:context_tokens])),
                                "choices": choices, "answer": answer}) + "\n")
    yaml = where / f"{TASK}.yaml"
    yaml.write_text(textwrap.dedent(f"""\
        task: {TASK}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
          cache_dir: {where / 'hf_datasets'}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: acc
        """))
    return yaml


def partial_batch_note(items: int, warm_items: int, batch_size: int, choices: int = 4) -> str | None:
    """Why the start-up may not cancel exactly: a run whose requests are not a whole number of batches
    ends on a smaller batch, a program of its own (loaded from the primed cache in that run alone;
    None when both runs are whole)."""
    partial = {f"--{name} {n}": (choices * n) % batch_size
               for name, n in (("warm-items", warm_items), ("items", items)) if (choices * n) % batch_size}
    if not partial:
        return None
    runs = ", ".join(f"{run} ends on a batch of {rows}" for run, rows in partial.items())
    return (f"{runs} of --batch-size {batch_size} rows ({choices} requests per item): a program met in one run "
            "alone does not cancel in the per-item time; give item counts whose requests fill whole batches")


def _timed(argv: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    seconds = time.perf_counter() - start
    log.write_text(f"$ {' '.join(argv)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]} (log {log})")
    return seconds, done.stdout


def side_name(backend: str | None) -> str:
    """The result's key of our side: "ours" (the run's own op backend) or "ours@BACKEND"."""
    return "ours" if backend is None else f"ours@{backend}"


def ours(run_dir: str, yaml: Path, limit: int, batch: int, out: Path, timeout: float,
         backend: str | None = None, cache: Path | None = None, tag: str = "") -> tuple[float, float]:
    """`twell eval --tasks` on `limit` items: (wall seconds, acc); `backend` overrides the run's
    model.ffn_backend (None: the run's); `cache`: the persistent compilation cache it reads and
    writes, every program in it however short its compile (None: off)."""
    sets = [] if backend is None else ["--set", f"model.ffn_backend={backend}"]
    seconds, stdout = _timed([sys.executable, "-m", "twell_jax.cli", "eval", "--checkpoint", run_dir,
                              "--tasks", str(yaml), "--limit", str(limit), "--batch-size", str(batch),
                              "--dtype", "bfloat16", "--json", "--compile-cache", str(cache or "off"), *sets],
                             out / f"{side_name(backend)}_{limit}{tag}.log", timeout,
                             env={"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} if cache else None)
    result = json.loads(stdout)
    return seconds, _find_acc(result)


def hf(export: Path, yaml: Path, limit: int, batch: int, device: str, out: Path, timeout: float) -> tuple[float, float]:
    results = out / f"hf_{limit}"
    seconds, _ = _timed([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                         f"pretrained={export},dtype=bfloat16", "--tasks", TASK, "--include_path", str(yaml.parent),
                         "--limit", str(limit), "--batch_size", str(batch), "--device", device,
                         "--output_path", str(results)], out / f"hf_{limit}.log", timeout)
    files = sorted(results.rglob("results*.json"))
    if not files:
        raise RuntimeError(f"lm_eval wrote no results under {results}")
    return seconds, _find_acc(json.loads(files[-1].read_text()))


def _find_acc(tree) -> float:
    """The task's acc in a results document (lm-eval's, or twell eval's --json)."""
    if isinstance(tree, dict):
        if TASK in tree and isinstance(tree[TASK], dict):
            for key, value in tree[TASK].items():
                if key.split(",")[0] == "acc" and isinstance(value, (int, float)):
                    return float(value)
        for value in tree.values():
            found = _find_acc(value)
            if found == found:  # not nan
                return found
    elif isinstance(tree, list):
        for value in tree:
            found = _find_acc(value)
            if found == found:
                return found
    return float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a trained run (with its tokenizer)")
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--warm-items", type=int, default=64, help="the start-up run's items")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=96)
    parser.add_argument("--choice-tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda:0", help="lm-eval's hf backend's device")
    parser.add_argument("--backends", default=None, metavar="NAME,...",
                        help="our side once per op backend (model.ffn_backend set for `twell eval`), e.g. "
                             "auto,dense: the sparse kernels against the dense path (default: once, the run's own)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if not 1 <= args.warm_items < args.items:
        parser.error("--warm-items must be >= 1 and less than --items")
    if min(args.batch_size, args.context_tokens, args.choice_tokens) < 1:
        parser.error("--batch-size, --context-tokens and --choice-tokens must be >= 1")
    backends: list[str | None] = [None]
    if args.backends is not None:
        from twell_jax.ops import backend_names
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in backends if b not in backend_names()]
        if not backends or unknown or len(set(backends)) != len(backends):
            parser.error(f"--backends must list distinct op backends of {backend_names()}, got {args.backends!r}")
    note = partial_batch_note(args.items, args.warm_items, args.batch_size)
    if note:
        print(f"[bench_eval] note: {note}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    yaml = make_task(args.checkpoint, out / "task", args.items, args.context_tokens, args.choice_tokens, args.seed)
    export = out / "export"
    _timed([sys.executable, "-m", "twell_jax.cli", "hf", "export", "--checkpoint", args.checkpoint, "--out",
            str(export), "--dtype", "bfloat16"], out / "export.log", args.timeout)
    result: dict = dict(checkpoint=args.checkpoint, items=args.items, warm_items=args.warm_items, device=args.device,
                        batch_size=args.batch_size, context_tokens=args.context_tokens,
                        choice_tokens=args.choice_tokens, choices=4, sides={})

    for side, backend in [(side_name(b), b) for b in backends] + [("hf", None)]:
        extra = {}
        if side == "hf":
            def run(n: int) -> tuple[float, float]:
                return hf(export, yaml, n, args.batch_size, args.device, out, args.timeout)
        else:
            # Primed: one untimed run on all the items fills a compilation cache of this side's own
            # with every program the timed runs meet, so neither timed run compiles (a shape met
            # only in the longer run would otherwise count its compile as per-item time).
            cache = out / "xla_cache" / side

            def run(n: int, tag: str = "") -> tuple[float, float]:
                return ours(args.checkpoint, yaml, n, args.batch_size, out, args.timeout, backend, cache, tag)

            extra["prime_s"], _ = run(args.items, "_prime")
        warm_s, warm_acc = run(args.warm_items)
        full_s, acc = run(args.items)
        result["sides"][side] = dict(warm_s=warm_s, full_s=full_s, acc=acc, warm_acc=warm_acc,
                                     ms_per_item=1e3 * (full_s - warm_s) / (args.items - args.warm_items), **extra)
        print(f"[bench_eval] {side}: {warm_s:.1f} s for {args.warm_items} items, {full_s:.1f} s for {args.items}, "
              f"acc {acc:.4f}", flush=True)
    s = result["sides"]
    # hf's time per item over each of our sides'.
    result["vs_hf_per_item"] = {k: s["hf"]["ms_per_item"] / v["ms_per_item"] for k, v in s.items() if k != "hf"}
    (out / "bench_eval.json").write_text(json.dumps(result, indent=1))
    print("\n".join([f"| side | ms/item | start-up s ({args.warm_items} items) | acc ({args.items} items) | hf / side per item |",
                     "|---|---|---|---|---|"]
                    + [f"| {k} | {v['ms_per_item']:.2f} | {v['warm_s']:.1f} | {v['acc']:.4f} | "
                       + (f"{result['vs_hf_per_item'][k]:.2f}x |" if k != "hf" else " |") for k, v in s.items()]))


if __name__ == "__main__":
    main()
