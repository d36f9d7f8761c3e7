"""What the trainer's deferred metrics fetch saves: the same training run with a step's metrics
fetched once the next step is dispatched (the default) and with a fetch right after each dispatch
(a `should_stop` hook that never stops makes every step a boundary: the synchronous loop), on the
same preset, steps, batches and device. Runs alternate (deferred, sync, deferred, sync, ...); each
run's throughput is its steps over the wall time between its first and last step's processing
(compilation, evaluation and saving excluded). Prints a table; writes JSON with --out.

    python experiments/bench_metrics_fetch.py --config small --steps 60 --repeats 3 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from twell_jax.configs import get_config  # noqa: E402
from twell_jax import config as config_lib  # noqa: E402
from twell_jax.training.train import Hooks, Trainer  # noqa: E402

MODES = ("deferred", "sync")


def timed_run(cfg: config_lib.ExperimentConfig, mode: str, root: Path) -> dict[str, float]:
    """One run of `cfg` in `mode`; its steps/s between the first and the last step processed."""
    stamps: list[float] = []
    hooks = Hooks(on_step=lambda record: stamps.append(time.perf_counter()), save_final=False,
                  should_stop=(lambda record: None) if mode == "sync" else None)
    result = Trainer(cfg, Path(tempfile.mkdtemp(dir=root)), hooks=hooks, echo=lambda _: None).run()
    seconds = stamps[-1] - stamps[0]
    return {"steps_per_s": (len(stamps) - 1) / seconds, "median_step_time_s": result.summary["median_step_time_s"],
            "final_train_ce": result.summary["final_train_ce"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", help="preset (configs/)")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported")
    parser.add_argument("--out", default=None, help="directory for bench_metrics_fetch.json")
    args = parser.parse_args()
    # Checked before any run: a bad value would otherwise fail only after every run, with a traceback.
    if args.steps < 2:
        parser.error("--steps must be >= 2 (throughput is measured between the first and the last step)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a file; give a directory for bench_metrics_fetch.json")
    cfg = config_lib.apply_overrides(get_config(args.config), [
        f"train.steps={args.steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.log_every=10",
        "train.progress_bar=false", "train.tensorboard=false", "train.auto_refresh_every=0",
        "train.auto_trial_steps=0", "train.eval_batches=1", *args.set])
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(timed_run(cfg, mode, Path(root)))
    rows = {mode: {"steps_per_s": statistics.median(r["steps_per_s"] for r in runs[mode]),
                   "median_step_time_s": statistics.median(r["median_step_time_s"] for r in runs[mode])}
            for mode in MODES}
    same = len({r["final_train_ce"] for mode in MODES for r in runs[mode]}) == 1
    device = f"{jax.devices()[0].device_kind} x {len(jax.devices())}"
    print(f"{args.config}, {args.steps} steps, {args.repeats} runs per mode, {device}; same final CE in every run: {same}")
    print(f"{'mode':<10} {'steps/s':>9} {'median step s':>14}")
    for mode in MODES:
        print(f"{mode:<10} {rows[mode]['steps_per_s']:>9.3f} {rows[mode]['median_step_time_s']:>14.5f}")
    speedup = rows["deferred"]["steps_per_s"] / rows["sync"]["steps_per_s"]
    print(f"deferred / sync throughput: {speedup:.3f}x")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_metrics_fetch.json").write_text(json.dumps({
            "config": args.config, "overrides": args.set, "steps": args.steps, "repeats": args.repeats,
            "device": device, "date": time.strftime("%Y-%m-%d"), "rows": rows, "runs": runs,
            "deferred_over_sync": speedup, "same_final_ce": same}, indent=2))


if __name__ == "__main__":
    main()
