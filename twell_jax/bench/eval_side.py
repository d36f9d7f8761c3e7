"""One side of experiments/bench_eval.py, in a process of its own: load the model once, evaluate the
task's first --base-items items and all its --items items once each untimed (every program the
timed runs meet compiles there; lm-eval's and the tokenizer's caches warm), then `--repeats` times
the two again, each evaluation timed alone. Prints one JSON line: {"load_s", "warm_s" (the untimed
evaluation of all the items), "seconds" and "base_seconds" (one per repeat), "accs" (all the
items: the untimed run's, then one per repeat)}.

    python -m twell_jax.bench.eval_side ours --checkpoint RUN --tasks TASK.yaml --items N --base-items n --batch-size B [--backend NAME]
    python -m twell_jax.bench.eval_side hf --export DIR --tasks TASK.yaml --items N --base-items n --batch-size B --device cuda:0

`ours` is what `twell eval --tasks` runs (the run loaded in bfloat16, our lm-eval adapter (which
checks the run's tokenizer), lm-eval's prompt templates kept compiled); `hf` is lm-eval's own `hf` backend
(`HFLM`, PyTorch) on the run's Hugging Face export, as `python -m lm_eval --model hf` builds it. Both
evaluate through lm-eval's `simple_evaluate` with the task objects loaded before each timed run
(reading the task's data is not an item's work), so a timed run holds what each item costs: lm-eval
building the requests, the model scoring them, the metrics.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

from twell_jax.bench.eval_speed import find_acc


Evaluate = Callable[[int], tuple[float, float]]  # one timed evaluation of the first N items: (seconds, acc)
Describe = Callable[[], dict[str, Any]] | None  # what the side ran, read after its evaluations


def ffn_forwards(loaded: Any) -> dict[str, list[str]]:
    """What each layer's FFN forward ran in the scorer's programs: {"ROWSxLENGTH": [implementation
    per layer]} over the (rows, length) shapes it traced; "auto" resolved by the planner as the
    op resolves it (the run's hints for rows of that length, `forward_only` from load_run). Empty before
    a program ran."""
    import jax.numpy as jnp

    from twell_jax import ops

    model, program = loaded.model, loaded._score_program
    shapes = sorted(set(program.shapes)) if program is not None else []
    itemsize = jnp.dtype(model.compute_dtype).itemsize
    plans = {}
    for rows, length in shapes:
        shape = (rows * length, model.d_model, model.d_ff, itemsize)
        plans[f"{rows}x{length}"] = [
            "dense" if not model.through_op
            else ops.auto_decision(model.gated, config, shape, model.interpret)[0] if model.backend == "auto"
            else model.backend for config in model.op_configs_for(length)]
    return plans


def ffn_activity(loaded: Any, run_dir: str) -> dict[str, dict[str, list[float]]]:
    """Per (rows, length) program the scorer traced: each layer's mean active FFN neurons per token
    on the run's validation text cut into rows of that length ("active": what the op met at that
    shape, before the right padding an evaluation adds), beside the hint "auto" planned it with
    ("hint", `op_configs_for(length)`; empty where the run gave none). Untimed, after the evaluations."""
    import jax
    from flax import nnx

    from twell_jax.inference.load import validation_tokens

    model, program = loaded.model, loaded._score_program
    if program is None or not model.through_op:
        return {}
    shapes = sorted(set(program.shapes))

    # The weights as an argument (as ScoreProgram passes them), not constants folded into the program.
    @jax.jit
    def active(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return nnx.merge(program.graphdef, state).hidden_states(tokens, track_neurons=True)[1]["l0"]

    # A row of each validation sequence, from its second token (a row's first position need not be
    # a document's start, as an evaluation's context is not); the split read once for every shape.
    validation = validation_tokens(run_dir, max(rows for rows, _ in shapes), cycle=True)
    activity = {}
    for rows, length in shapes:
        text = validation[:rows, 1:1 + length]
        hints = [config.expected_active_per_token if config is not None else None
                 for config in model.op_configs_for(length)]
        activity[f"{rows}x{text.shape[1]}"] = {
            "active": [float(v) for v in jax.device_get(active(program.state, text))],
            "hint": [] if None in hints else [float(v) for v in hints]}
    return activity


def _ours(args: argparse.Namespace) -> tuple[Evaluate, float, Describe]:
    from twell_jax.inference import harness
    from twell_jax.inference.load import load_run

    selection = harness.select_tasks(args.tasks)
    start = time.perf_counter()
    loaded = load_run(args.checkpoint, dtype="bfloat16",
                      overrides=[] if args.backend is None else [f"model.ffn_backend={args.backend}"])
    load_s = time.perf_counter() - start

    def evaluate(items: int) -> tuple[float, float]:
        tasks = harness.load_tasks(selection)
        start = time.perf_counter()
        results = harness.evaluate_loaded(loaded, selection, batch_size=args.batch_size, limit=items,
                                          progress=False, loaded_tasks=tasks)
        return time.perf_counter() - start, find_acc(results)

    return evaluate, load_s, lambda: {"ffn_forwards": ffn_forwards(loaded),
                                      "ffn_activity": ffn_activity(loaded, args.checkpoint)}


def _hf(args: argparse.Namespace) -> tuple[Evaluate, float, Describe]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from twell_jax.inference import harness

    selection = harness.select_tasks(args.tasks)
    start = time.perf_counter()
    lm = HFLM(pretrained=args.export, dtype="bfloat16", batch_size=args.batch_size, device=args.device)
    load_s = time.perf_counter() - start

    def evaluate(items: int) -> tuple[float, float]:
        manager, objects = harness.load_tasks(selection)
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=objects, task_manager=manager, limit=items,
                                          batch_size=args.batch_size)
        return time.perf_counter() - start, find_acc(results)

    return evaluate, load_s, None


def run(args: argparse.Namespace) -> dict[str, Any]:
    evaluate, load_s, describe = (_ours if args.side == "ours" else _hf)(args)
    evaluate(args.base_items)
    warm_s, warm_acc = evaluate(args.items)
    seconds, base_seconds, accs = [], [], [warm_acc]
    for _ in range(args.repeats):
        base_seconds.append(evaluate(args.base_items)[0])
        s, acc = evaluate(args.items)
        seconds.append(s)
        accs.append(acc)
    # Each run's accuracy: the same items and model, so they agree unless the GPU's kernels are not
    # deterministic (a log-likelihood tie in bfloat16 decided either way); bench_eval says so.
    return dict(load_s=load_s, warm_s=warm_s, seconds=seconds, base_seconds=base_seconds, accs=accs,
                **(describe() if describe is not None else {}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("side", choices=("ours", "hf"))
    parser.add_argument("--checkpoint", help="ours: the trained run")
    parser.add_argument("--backend", default=None, help="ours: model.ffn_backend (default: the run's)")
    parser.add_argument("--export", help="hf: the run's Hugging Face export")
    parser.add_argument("--device", default="cuda:0", help="hf: the torch device")
    parser.add_argument("--tasks", required=True, help="the task YAML")
    parser.add_argument("--items", type=int, required=True)
    parser.add_argument("--base-items", type=int, required=True, help="the shorter run's items (< --items)")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if (args.side == "ours") != (args.checkpoint is not None) or (args.side == "hf") != (args.export is not None):
        parser.error("ours takes --checkpoint, hf takes --export")
    if min(args.items, args.base_items, args.batch_size, args.repeats) < 1 or args.base_items >= args.items:
        parser.error("--items, --base-items, --batch-size and --repeats must be >= 1, --base-items less than --items")
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
