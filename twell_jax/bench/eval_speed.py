"""Speed of downstream evaluation: `twell eval --tasks` (our lm-eval adapter, the model's own JAX
forward) against lm-eval's own `hf` backend (PyTorch, `transformers`) on the same run exported to
Hugging Face, on the same GPU, at the same batch size.

    python experiments/bench_eval.py --checkpoint RUN --items 4096 --batch-size 64 --backends dense,auto --out DIR
    python experiments/bench_eval.py --checkpoint RUN --items 16 --base-items 8 --repeats 1 --out DIR   # a quick check

A local multiple-choice task (lm-eval's json loader, no download) of --items items is made from the
run's validation text: each item's context is --context-tokens tokens of it, its four choices
--choice-tokens tokens each: the text that follows (the answer) and three continuations taken from
elsewhere. The run is exported (`twell hf export`, bfloat16) into --out. Each side then runs in a
process of its own (`twell_jax/bench/eval_side.py`): our side once per --backends NAME (the run's
model.ffn_backend set to NAME; default: once, the run's own), then lm-eval's `hf` backend. A side
loads its model, evaluates the first --base-items items and all --items items once each untimed
(every program compiles there, caches warm), then both again --repeats times, each evaluation timed
alone inside the process. Per item = (median seconds of all the items - median of the base items)
/ (items - base items): what each item adds (lm-eval building its requests, the model scoring
them, its metrics). What an evaluation costs once whatever its size (lm-eval's record of the
environment, which runs `pip list` and `nvidia-smi`, the aggregation) cancels; it is reported as
`fixed_s`, the start-up (imports, loading, compiling) as `load_s` + `warm_s`, beside it.
The times and each run's accuracy (the same model and requests: equal, up to bfloat16 ties on a GPU)
go to bench_eval.json in --out, with hf's time per item over each of our sides' (`vs_hf_per_item`),
each of our sides' over the first's (`vs_first_per_item`, e.g. auto against dense) and, for each
of our sides, what each layer's FFN forward ran in each (rows x length) program of the scorer
(`ffn_forwards`: "auto" resolved by the planner) and each layer's activity on validation text in
rows of that shape beside the hint it was planned with (`ffn_activity`); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

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


def _timed(argv: list[str], log: Path, timeout: float) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    log.write_text(f"$ {' '.join(argv)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:4]} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]} (log {log})")
    return seconds, done.stdout


def side_name(backend: str | None) -> str:
    """The result's key of our side: "ours" (the run's own op backend) or "ours@BACKEND"."""
    return "ours" if backend is None else f"ours@{backend}"


def run_side(side: str, backend: str | None, args: argparse.Namespace, yaml: Path, export: Path,
             out: Path) -> dict[str, Any]:
    """One side in its own process (eval_side.py): its JSON result, with `ms_per_item` (what an item
    adds, from the medians of the two sizes' runs), `fixed_s` (what an evaluation costs whatever its
    size) and `process_s` (the process's wall time)."""
    which = (["ours", "--checkpoint", args.checkpoint] + ([] if backend is None else ["--backend", backend])
             if side != "hf" else ["hf", "--export", str(export), "--device", args.device])
    argv = [sys.executable, "-m", "twell_jax.bench.eval_side", *which, "--tasks", str(yaml), "--items",
            str(args.items), "--base-items", str(args.base_items), "--batch-size", str(args.batch_size),
            "--repeats", str(args.repeats)]
    process_s, stdout = _timed(argv, out / f"{side}.log", args.timeout)
    result = json.loads(stdout.strip().splitlines()[-1])
    full, base = statistics.median(result["seconds"]), statistics.median(result["base_seconds"])
    per_item = (full - base) / (args.items - args.base_items)
    return dict(result, process_s=process_s, acc=result["accs"][-1], ms_per_item=1e3 * per_item,
                fixed_s=full - per_item * args.items)


def find_acc(tree) -> float:
    """The task's acc in a results document (lm-eval's `simple_evaluate`, or our harness's)."""
    if isinstance(tree, dict):
        if TASK in tree and isinstance(tree[TASK], dict):
            for key, value in tree[TASK].items():
                if key.split(",")[0] == "acc" and isinstance(value, (int, float)):
                    return float(value)
        for value in tree.values():
            found = find_acc(value)
            if found == found:  # not nan
                return found
    elif isinstance(tree, list):
        for value in tree:
            found = find_acc(value)
            if found == found:
                return found
    return float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a trained run (with its tokenizer)")
    parser.add_argument("--items", type=int, default=4096)
    parser.add_argument("--base-items", type=int, default=None,
                        help="the shorter timed run's items (default: --items / 8); per item = the difference")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each size per side (medians count)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context-tokens", type=int, default=96)
    parser.add_argument("--choice-tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda:0", help="lm-eval's hf backend's device")
    parser.add_argument("--backends", default=None, metavar="NAME,...",
                        help="our side once per op backend (model.ffn_backend), e.g. dense,auto: the sparse "
                             "kernels against the dense path (default: once, the run's own)")
    parser.add_argument("--no-hf", dest="hf", action="store_false",
                        help="skip lm-eval's hf side (our backends against each other only; no export)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if min(args.items, args.repeats, args.batch_size, args.context_tokens, args.choice_tokens) < 1:
        parser.error("--items, --repeats, --batch-size, --context-tokens and --choice-tokens must be >= 1")
    if args.base_items is None:
        args.base_items = max(1, args.items // 8)
    if not 1 <= args.base_items < args.items:
        parser.error(f"--base-items must be >= 1 and less than --items ({args.items}), got {args.base_items}")
    backends: list[str | None] = [None]
    if args.backends is not None:
        from twell_jax.ops import backend_names
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in backends if b not in backend_names()]
        if not backends or unknown or len(set(backends)) != len(backends):
            parser.error(f"--backends must list distinct op backends of {backend_names()}, got {args.backends!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    yaml = make_task(args.checkpoint, out / "task", args.items, args.context_tokens, args.choice_tokens, args.seed)
    export = out / "export"
    if args.hf:
        _timed([sys.executable, "-m", "twell_jax.cli", "hf", "export", "--checkpoint", args.checkpoint, "--out",
                str(export), "--dtype", "bfloat16"], out / "export.log", args.timeout)
    result: dict = dict(checkpoint=args.checkpoint, items=args.items, base_items=args.base_items,
                        repeats=args.repeats, device=args.device,
                        batch_size=args.batch_size, context_tokens=args.context_tokens,
                        choice_tokens=args.choice_tokens, choices=4, sides={})
    for side, backend in [(side_name(b), b) for b in backends] + ([("hf", None)] if args.hf else []):
        row = result["sides"][side] = run_side(side, backend, args, yaml, export, out)
        runs = ", ".join(f"{s:.2f}" for s in row["seconds"])
        base_runs = ", ".join(f"{s:.2f}" for s in row["base_seconds"])
        print(f"[bench_eval] {side}: loaded in {row['load_s']:.1f} s, first run {row['warm_s']:.1f} s, timed runs "
              f"{runs} s ({args.items} items), {base_runs} s ({args.base_items} items), acc {row['acc']:.4f}",
              flush=True)
        for shape, forwards in row.get("ffn_forwards", {}).items():
            print(f"[bench_eval] {side}: each layer's FFN forward in the {shape} (rows x length) program: "
                  f"{' '.join(forwards)}", flush=True)
        for shape, seen in row.get("ffn_activity", {}).items():
            print(f"[bench_eval] {side}: active FFN neurons per token on validation rows of the {shape} program's "
                  f"shape, per layer: {' '.join(f'{v:.1f}' for v in seen['active'])}"
                  + (f" (planned with {' '.join(f'{v:.1f}' for v in seen['hint'])})" if seen["hint"] else ""),
                  flush=True)
        if len(set(row["accs"])) > 1:
            print(f"[bench_eval] note: {side}'s runs of the same items gave accuracies {row['accs']} "
                  "(bfloat16 log-likelihood ties decided differently by the GPU's kernels)", flush=True)
    s = result["sides"]
    ours_sides = [k for k in s if k != "hf"]
    # hf's time per item over each of our sides'; each of our sides' speed against the first one's.
    if "hf" in s:
        result["vs_hf_per_item"] = {k: s["hf"]["ms_per_item"] / s[k]["ms_per_item"] for k in ours_sides}
    result["vs_first_per_item"] = {k: s[ours_sides[0]]["ms_per_item"] / s[k]["ms_per_item"] for k in ours_sides}
    (out / "bench_eval.json").write_text(json.dumps(result, indent=1))
    first = ours_sides[0]
    print("\n".join([f"| side | ms/item | fixed s per evaluation | start-up s (load + first run) | acc ({args.items} "
                      f"items) | hf / side | {first} / side |", "|---|---|---|---|---|---|---|"]
                     + [f"| {k} | {v['ms_per_item']:.3f} | {v['fixed_s']:.2f} | {v['load_s'] + v['warm_s']:.1f} | "
                        f"{v['acc']:.4f} | "
                        + (f"{result['vs_hf_per_item'][k]:.3f}x | " if "hf" in s and k != "hf" else " | ")
                        + (f"{result['vs_first_per_item'][k]:.3f}x |" if k != "hf" else " |") for k, v in s.items()]))


if __name__ == "__main__":
    main()
