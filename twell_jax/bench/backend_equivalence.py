"""Do the sparse kernels train the same model as the dense path? (issue 23) The same run (default
`0.5b`, same seed, data and L1) with the op's `dense` backend and with `pallas`, plus the noise
to judge the difference by: the dense run again with half the micro-batch (same tokens, another
gradient-accumulation / reduction order) and with another data-order seed.

    PYTHONPATH=. python experiments/backend_equivalence.py --steps 300 --l1 2e-4 --set train.global_batch=64
    # from a trained-sparse run's parameters, so that the kernels run in its sparse layers from the first step:
    PYTHONPATH=. python experiments/backend_equivalence.py --init-run runs/0.5b-sparse --steps 200 --l1 5e-4 \
        --set train.global_batch=32 train.micro_batch=8
    # CPU smoke run:
    PYTHONPATH=. python experiments/backend_equivalence.py --config micro --steps 4 --data synthetic \
        --set model.ffn_interpret=true

From an initialisation every layer is dense, and the op takes its exact dense fallback while a
layer has more active neurons than the kernels' capacity: the pallas run's kernels only run once
the L1 has made the layers sparse. `--init-run RUN` starts all four runs from the parameters of
the trained run RUN (a run directory of `twell train` or experiments/train_to_sparse.py: its
newest intact checkpoint) instead, each with a fresh optimizer state and the same seed, data and
L1 as the others. RUN's model must have the study's architecture (--config and --set; the error
names each field that differs). The data then default to RUN's corpus (--data) read with RUN's
saved tokenizer (the token ids its embedding was trained on). Give an --l1 that keeps RUN sparse:
about the coefficient it ended its training at (the `0.5b` checkpoint of train_to_sparse.py
reached 4.35e-4 at step 175: experiments/results/train_to_sparse_0.5b_h100_2026-11-24.json).

The runs are a `twell compare` plan (twell_jax/compare.py) in --out, which records RUN: a call cut
short (SIGTERM, `timeout`) keeps its finished runs and the next call with the same --out continues
the interrupted one from its own checkpoint (--init-run may be left out there). Prints one table,
per pair and over the common steps: the max |loss difference|, the max |CE difference|, the max
|difference| of the mean active count per token (layer mean, and its relative value); then the
same curves smoothed by a 20-step moving average (--window), whose mean and max |difference| are
not dominated by one batch's noise; and, for the pallas run, the share of layer calls (layer x
micro-batch x step) in which the op took its exact dense fallback (a high share means the kernels
did not run yet: start from a sparse --init-run, or raise --l1 or the steps). Writes
$OUT/backend_equivalence.json (with `init_run`, RUN's absolute path or null, and every run's loss
and active curves at every 5th step) and $OUT/backend_equivalence.png (the curves); the runs stay
in --out, one checkpoint each.

    # the figures again from finished runs (a directory holding the plan and <run>/metrics.jsonl):
    PYTHONPATH=. python experiments/backend_equivalence.py --out runs/backend_equivalence --report-only
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from twell_jax.configs import get_config
from twell_jax import compare as compare_lib
from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib

WINDOW = 20  # steps per moving average of the smoothed comparison
CURVE_EVERY = 5  # the JSON keeps every run's curves at every CURVE_EVERY-th step
PAIRS = (("pallas", "dense", "sparse kernels vs dense"),
         ("dense-half-micro-batch", "dense", "noise: reduction order"),
         ("dense-data-seed", "dense", "noise: data order"))


def plan(cfg: config_lib.ExperimentConfig, init_run: str | None = None) -> list[compare_lib.StudyRun]:
    """The four runs: twell with backend dense / pallas, then the two noise runs of the dense one;
    each starts from the parameters of the trained run `init_run` (an absolute path), or from the
    init when None."""
    def variant(name: str, **sections) -> compare_lib.StudyRun:
        replaced = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
        return compare_lib.StudyRun(name, dataclasses.replace(cfg, name=f"{cfg.name}-{name}", **replaced), init_run)

    half = max(1, cfg.train.micro_batch // 2)
    if half == cfg.train.micro_batch:
        raise ValueError(f"train.micro_batch={cfg.train.micro_batch}: cannot be halved for the reduction-order run")
    return [variant("dense", model={"ffn_backend": "dense"}),
            variant("pallas", model={"ffn_backend": "pallas"}),
            variant("dense-half-micro-batch", model={"ffn_backend": "dense"}, train={"micro_batch": half}),
            variant("dense-data-seed", model={"ffn_backend": "dense"}, data={"seed": cfg.data.seed + 1})]


def curves(run_dir: Path) -> dict[int, dict]:
    """step -> its logged training record (metrics.jsonl, as the loop wrote it)."""
    return {r["step"]: r for r in run_dir_lib.read_metrics(run_dir) if "ce" in r}


def final_val_loss(run_dir: Path) -> float | None:
    """The last validation loss in the run's metrics.jsonl (None when it logged none)."""
    losses = [r["val_loss"] for r in run_dir_lib.read_metrics(run_dir) if "val_loss" in r]
    return float(losses[-1]) if losses else None


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Means of `window` consecutive values (len(x) - window + 1 of them; the whole curve's mean
    when it is shorter than the window)."""
    window = max(1, min(window, len(x)))
    return np.convolve(x, np.ones(window) / window, mode="valid")


def compare_pair(a: dict[int, dict], b: dict[int, dict], window: int = WINDOW) -> dict:
    """Run a against run b over their common steps: the raw per-step differences (max |.|) and the
    differences of the `window`-step moving averages (mean and max |.|; active also relative to b's)."""
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError("the two runs logged no common step")
    loss = np.array([[a[s]["loss"], b[s]["loss"]] for s in steps])
    ce = np.array([[a[s]["ce"], b[s]["ce"]] for s in steps])
    active = np.array([[np.mean(a[s]["l0_per_layer"]), np.mean(b[s]["l0_per_layer"])] for s in steps])
    smooth = {name: np.abs(moving_average(v[:, 0], window) - moving_average(v[:, 1], window))
              for name, v in (("loss", loss), ("active", active))}
    smooth_rel_active = smooth["active"] / np.maximum(moving_average(active[:, 1], window), 1e-9)
    return {"steps": len(steps), "last_step": steps[-1],
            "max_abs_loss_diff": float(np.max(np.abs(loss[:, 0] - loss[:, 1]))),
            "max_abs_ce_diff": float(np.max(np.abs(ce[:, 0] - ce[:, 1]))),
            "max_abs_active_diff": float(np.max(np.abs(active[:, 0] - active[:, 1]))),
            "max_rel_active_diff": float(np.max(np.abs(active[:, 0] - active[:, 1]) / np.maximum(active[:, 1], 1e-9))),
            "final_active": active[-1].tolist(),
            "smoothing_window": min(window, len(steps)),
            "smoothed_mean_abs_loss_diff": float(np.mean(smooth["loss"])),
            "smoothed_max_abs_loss_diff": float(np.max(smooth["loss"])),
            "smoothed_mean_abs_active_diff": float(np.mean(smooth["active"])),
            "smoothed_max_abs_active_diff": float(np.max(smooth["active"])),
            "smoothed_mean_rel_active_diff": float(np.mean(smooth_rel_active)),
            "smoothed_max_rel_active_diff": float(np.max(smooth_rel_active))}


def micro_batches_per_step(cfg: config_lib.ExperimentConfig, run_dir: Path, run: dict[int, dict]) -> int:
    """The gradient-accumulation steps of the run (global_batch / (micro_batch x devices)); the device
    count from its summary.json, else from its logged throughput (total over per-device)."""
    devices = None
    summary = run_dir_lib.read_summary(run_dir)
    if summary is not None:
        devices = summary.get("num_devices")
    if devices is None:
        rates = [(r["tokens_per_s"], r["tokens_per_s_per_device"]) for r in run.values()
                 if r.get("tokens_per_s") and r.get("tokens_per_s_per_device")]
        devices = round(rates[0][0] / rates[0][1]) if rates else cfg.train.num_devices
    if devices is None:
        raise ValueError(f"{run_dir}: cannot tell how many devices the run used (no summary.json, no throughput "
                         "in metrics.jsonl, train.num_devices unset)")
    per_step = cfg.train.micro_batch * devices
    if cfg.train.global_batch % per_step:
        raise ValueError(f"{run_dir}: global_batch {cfg.train.global_batch} is not a multiple of micro_batch "
                         f"{cfg.train.micro_batch} x {devices} devices")
    return cfg.train.global_batch // per_step


def fallback_share(run: dict[int, dict], micro_batches: int) -> float | None:
    """The share of the op's calls (layer x micro-batch x step) that took the exact dense fallback.
    A step's `dense_fallback_per_layer` is each layer's count over the step's micro-batches (the loop
    sums them), so it is divided by the micro-batches per step as well as averaged."""
    flags = [r["dense_fallback_per_layer"] for r in run.values() if "dense_fallback_per_layer" in r]
    if not flags:
        return None
    flags = np.asarray(flags)
    if flags.min() < 0 or flags.max() > micro_batches:
        raise ValueError(f"dense fallback counts {flags.min()}..{flags.max()} fall outside 0..{micro_batches} "
                         f"(the micro-batches per step): not counts of the op's calls")
    return float(np.mean(flags)) / micro_batches


def every_nth(run: dict[int, dict], every: int) -> dict[str, list]:
    """The run's loss and layer-mean active count per token at its first step and every `every`th."""
    steps = sorted(run)
    kept = [s for s in steps if s == steps[0] or s % every == 0]
    return {"step": kept, "loss": [float(run[s]["loss"]) for s in kept],
            "active": [float(np.mean(run[s]["l0_per_layer"])) for s in kept]}


def report(out: Path, runs: list[compare_lib.StudyRun] | None = None, *, window: int = WINDOW,
           every: int = CURVE_EVERY) -> dict:
    """The comparison of the runs in `out` (each `<key>/metrics.jsonl`; `runs`: the plan, else the
    one saved in `out`), from their files alone: it can be re-run on saved metrics."""
    if runs is None:
        runs, _ = compare_lib.load_plan(out)
    by_key = {run.key: run for run in runs}
    logged = {key: curves(out / key) for key in by_key}
    rows = [{"pair": f"{a} vs {b}", "what": what, **compare_pair(logged[a], logged[b], window)} for a, b, what in PAIRS]
    noise = max(r["max_abs_loss_diff"] for r in rows[1:])
    smoothed_noise = {q: max(r[f"smoothed_max_abs_{q}_diff"] for r in rows[1:]) for q in ("loss", "active")}
    cfg = by_key["dense"].cfg
    pallas = by_key["pallas"]
    return {"config": cfg.name.removesuffix("-dense"), "init_run": by_key["dense"].init_run,
            "steps": cfg.train.steps, "l1_coef": cfg.sparsity.l1_coef,
            "data": cfg.data.source, "global_batch": cfg.train.global_batch, "seq_len": cfg.seq_len,
            "smoothing_window": min(r["smoothing_window"] for r in rows), "pairs": rows,
            "pallas_dense_fallback_share": fallback_share(
                logged["pallas"], micro_batches_per_step(pallas.cfg, out / pallas.key, logged["pallas"])),
            "pallas_within_noise": rows[0]["max_abs_loss_diff"] <= noise,
            "pallas_within_noise_smoothed": {q: rows[0][f"smoothed_max_abs_{q}_diff"] <= smoothed_noise[q]
                                             for q in ("loss", "active")},
            "final_val_loss": {key: final_val_loss(out / key) for key in by_key},
            "curves_every": every, "curves": {key: every_nth(logged[key], every) for key in by_key}}


def print_report(result: dict) -> None:
    """The table of the pairs (raw and smoothed differences) and the fallback / noise verdict."""
    window = result["smoothing_window"]
    print("| pair | what | steps | max abs loss diff | max abs CE diff | max abs active diff (rel) "
          f"| {window}-step mean loss: mean / max abs diff "
          f"| {window}-step mean active: mean / max abs diff (max rel) |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in result["pairs"]:
        print(f"| {r['pair']} | {r['what']} | {r['steps']} | {r['max_abs_loss_diff']:.3g} | {r['max_abs_ce_diff']:.3g} "
              f"| {r['max_abs_active_diff']:.3g} ({100 * r['max_rel_active_diff']:.2f}%) "
              f"| {r['smoothed_mean_abs_loss_diff']:.3g} / {r['smoothed_max_abs_loss_diff']:.3g} "
              f"| {r['smoothed_mean_abs_active_diff']:.3g} / {r['smoothed_max_abs_active_diff']:.3g} "
              f"({100 * r['smoothed_max_rel_active_diff']:.2f}%) |")
    share = result["pallas_dense_fallback_share"]
    noise = max(r["max_abs_loss_diff"] for r in result["pairs"][1:])
    smoothed = result["pallas_within_noise_smoothed"]
    verdict = lambda within: "within" if within else "OUTSIDE"  # noqa: E731
    print(f"pallas: dense fallback in {'-' if share is None else f'{100 * share:.1f}%'} of the op's calls; "
          f"loss difference {verdict(result['pallas_within_noise'])} the measured noise ({noise:.3g}); "
          f"{window}-step means: loss {verdict(smoothed['loss'])}, active/token {verdict(smoothed['active'])} "
          "the noise pairs' largest")


def plot(result: dict, path: Path) -> None:
    """Two panels against the step: each run's training loss and mean active neurons per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_active) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, curve in result["curves"].items():
        ax_loss.plot(curve["step"], curve["loss"], label=key, lw=1.2)
        ax_active.plot(curve["step"], curve["active"], label=key, lw=1.2)
    ax_loss.set_ylabel("training loss (CE + L1 term)")
    ax_active.set_ylabel("mean active FFN neurons per token (layer mean)")
    ax_active.set_yscale("log")
    for ax in (ax_loss, ax_active):
        ax.set_xlabel(f"optimizer step (every {result['curves_every']}th)")
        ax.legend(fontsize=8)
    start = "an init" if result["init_run"] is None else Path(result["init_run"]).name
    fig.suptitle(f"{result['config']} from {start}: pallas vs dense backend, and the two noise runs "
                 f"(L1 {result['l1_coef']:g}, global batch {result['global_batch']} x {result['seq_len']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def init_run_tokenizer(init_run: str, data: str) -> str:
    """The tokenizer.json saved with the trained run `init_run`: the token ids its embedding was
    trained on, which the study's text (`data`) must be read with."""
    path = run_dir_lib.saved_tokenizer(init_run)
    if path is None:
        raise ValueError(f"--init-run {init_run}: the run saved no {run_dir_lib.TOKENIZER_FILE} (trained on synthetic "
                         f"tokens?), so its embedding fits no tokenizer of --data {data}; use --data synthetic")
    return str(path.absolute())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="0.5b")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--l1", type=float, default=None, help="sparsity.l1_coef (default: the config's)")
    parser.add_argument("--data", default=None,
                        help="data.source (default: --init-run's, read with its tokenizer; without --init-run "
                             "stdlib, with a BPE of the model's vocabulary built once and cached)")
    parser.add_argument("--init-run", default=None, metavar="RUN",
                        help="start every run from the parameters of this trained run directory (its newest "
                             "checkpoint; a fresh optimizer state); default: the config's initialisation")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", default="runs/backend_equivalence",
                        help="directory of the runs (not under $OUT: 0.5b checkpoints are GBs)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: the figures from --out's saved plan and <run>/metrics.jsonl files")
    parser.add_argument("--window", type=int, default=WINDOW, help="steps per moving average (smoothed comparison)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be >= 1")
    out_root = Path(os.environ.get("OUT", "."))
    out = Path(args.out)
    resume = (out / compare_lib.PLAN_FILE).is_file()
    if args.report_only:
        if not resume:
            parser.error(f"--report-only: {out} holds no {compare_lib.PLAN_FILE}")
        if args.init_run is not None:
            parser.error("--init-run: not with --report-only (the plan in --out records what the runs started from)")
        runs = None
    else:
        # The run directory's absolute path (also when given as RUN/checkpoints): what the plan records.
        init_run = None if args.init_run is None else str(run_dir_lib.run_dir_of(args.init_run))
        if resume:  # continuing a study: it starts from what its plan recorded
            planned = compare_lib.load_plan(out)[0][0].init_run
            if args.init_run is not None and init_run != planned:
                parser.error(f"--init-run {args.init_run}: the study in {out} started from "
                             f"{planned or 'an initialisation (no --init-run)'}; leave --init-run out to continue it")
            init_run = planned
        init_cfg = None if init_run is None else compare_lib.init_run_config(init_run)
        data = args.data or (init_cfg.data.source if init_cfg is not None else "stdlib")
        cfg = get_config(args.config)
        base = [f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0",
                "train.checkpoint_every=100", "train.keep_checkpoints=1", "train.eval_batches=2",
                "train.eval_batch_size=8", "train.progress_bar=false", "model.ffn_kind=twell",
                f"data.source={data}"]
        if data != "synthetic":
            tokenizer = "bpe" if init_run is None else init_run_tokenizer(init_run, data)
            base += [f"data.tokenizer={tokenizer}", f"data.vocab_size={cfg.model.vocab_size}", "data.val_fraction=0.02"]
        if args.l1 is not None:
            base.append(f"sparsity.l1_coef={args.l1}")
        runs = plan(config_lib.apply_overrides(cfg, base + args.set), init_run)
        compare_lib.run_study(runs, out, resume=resume)
    result = report(out, runs, window=args.window)
    print_report(result)
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "backend_equivalence.json").write_text(json.dumps(result, indent=1))
    plot(result, out_root / "backend_equivalence.png")
    return result

if __name__ == "__main__":
    main()
