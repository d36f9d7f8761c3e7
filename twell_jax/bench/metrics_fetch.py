"""What the trainer's deferred metrics fetch saves: the same training run with a step's metrics
fetched once the next step is dispatched (the default) and with a fetch right after each dispatch
(a `should_stop` hook that never stops makes every step a boundary: the synchronous loop), on the
same preset, steps, batches and device. Runs alternate (deferred, sync, deferred, sync, ...); each
run's throughput is its steps over the wall time between its first and last step's processing
(compilation, evaluation and saving excluded). Prints a table; writes JSON with --out.

The two modes train the same model on the same batches, but on a GPU two runs of the SAME mode end
at slightly different losses (non-deterministic reductions: e.g. the scatter-add of the embedding
gradient). So the final training CE is compared against that noise: its spread (max - min) within
each mode, the difference between the modes' means, and whether that difference is within the
larger within-mode spread.

    python experiments/bench_metrics_fetch.py --config small --steps 60 --repeats 3 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from twell_jax.configs import get_config
from twell_jax import config as config_lib
from twell_jax.training.train import Hooks, Trainer

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


def final_ce_spread(runs: dict[str, list[dict[str, float]]]) -> dict:
    """The final training CE of every run, judged against run-to-run noise: per mode its min, max,
    mean and spread (max - min); |mean(deferred) - mean(sync)|; and whether that difference is
    within the larger within-mode spread (with one run per mode the spread is 0, so only an exact
    tie is "within")."""
    per_mode = {}
    for mode in MODES:
        ces = [r["final_train_ce"] for r in runs[mode]]
        per_mode[mode] = {"min": min(ces), "max": max(ces), "mean": statistics.fmean(ces),
                          "spread": max(ces) - min(ces)}
    between = abs(per_mode["deferred"]["mean"] - per_mode["sync"]["mean"])
    within = max(m["spread"] for m in per_mode.values())
    return {"per_mode": per_mode, "between_modes": between, "within_mode_spread": within,
            "between_within_spread": between <= within}


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    """The medians per mode, the deferred / sync throughput and the final-CE comparison."""
    rows = {mode: {"steps_per_s": statistics.median(r["steps_per_s"] for r in runs[mode]),
                   "median_step_time_s": statistics.median(r["median_step_time_s"] for r in runs[mode])}
            for mode in MODES}
    return {"rows": rows, "deferred_over_sync": rows["deferred"]["steps_per_s"] / rows["sync"]["steps_per_s"],
            "final_ce": final_ce_spread(runs)}


def ce_line(final_ce: dict) -> str:
    """One printed line: the final CE per mode (range, spread) and the between-mode difference."""
    modes = ", ".join(f"{mode} {m['min']:.4f}-{m['max']:.4f} (spread {m['spread']:.4f})"
                      for mode, m in final_ce["per_mode"].items())
    verdict = ("within the run-to-run spread" if final_ce["between_within_spread"]
               else "LARGER than the run-to-run spread")
    return (f"final train CE: {modes}; between the modes' means {final_ce['between_modes']:.4f}: {verdict} "
            f"({final_ce['within_mode_spread']:.4f})")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", help="preset (configs/)")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported")
    parser.add_argument("--out", default=None, help="directory for bench_metrics_fetch.json")
    args = parser.parse_args(argv)
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
    summary = summarize(runs)
    rows = summary["rows"]
    device = f"{jax.devices()[0].device_kind} x {len(jax.devices())}"
    print(f"{args.config}, {args.steps} steps, {args.repeats} runs per mode, {device}")
    print(f"{'mode':<10} {'steps/s':>9} {'median step s':>14}")
    for mode in MODES:
        print(f"{mode:<10} {rows[mode]['steps_per_s']:>9.3f} {rows[mode]['median_step_time_s']:>14.5f}")
    print(f"deferred / sync throughput: {summary['deferred_over_sync']:.3f}x")
    print(ce_line(summary["final_ce"]))
    result = {"config": args.config, "overrides": args.set, "steps": args.steps, "repeats": args.repeats,
              "device": device, "date": time.strftime("%Y-%m-%d"), **summary, "runs": runs}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_metrics_fetch.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
