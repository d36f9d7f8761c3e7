"""The quality study behind `twell compare`: a dense twin and sparse `twell` models at several L1
values, trained on the same tokens in the same order (same data, seed and steps), then one table
(console, markdown, JSON) and one PNG.

Reported per run, from what the training loop already wrote (summary.json, metrics.jsonl): the
validation CE and its gap to the twin, mean active FFN neurons per token (and the share of d_ff)
over all layers, per layer (validation) and per token position (the training steps' position
profile, averaged over the last quarter of the logged steps), the dead-neuron share at the end
(runs with and without `sparsity.reinit_dead` when asked), and tokens/s. With `--tasks` (lm-eval,
`inference/harness.py`) also each run's accuracy on downstream tasks: the paper's accuracy column,
the twin's dense FFN against the sparse runs' op (evaluated once a run has finished, every run on
the same task objects, loaded once; its results JSON in `<run>/lm_eval/`, read back when a
resumed study has it already). Every run must share the twin's tokenizer (`check_same_tokenizer`).

`out_dir` holds `compare_plan.json` (what the study trains: written first, so a directory is
recognisably a comparison) and one run directory per run. An interrupted study (SIGTERM, a crash,
a time limit) continues with `twell compare --out DIR --resume`: finished runs are kept, an
interrupted one resumes from its newest checkpoint, the rest start.

A run of a plan may start from a trained run's parameters instead of an initialisation
(`StudyRun.init_run`, recorded in the plan; experiments/backend_equivalence.py's --init-run).

Several processes (jax.distributed, docs/parallel.md) run a study together: every process checks
`out_dir` and plans the same study (a digest of the plan compared), process 0 alone writes
`compare_plan.json` and the report (the others check that they see the plan), whether a run is
done, resumed or new is process 0's view, and each run trains as a multi-process `twell train`
(its own checks and agreements). lm-eval tasks (`--tasks`) run in one process only.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from twell_jax import compile_cache
from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib
from twell_jax.config import FFN_KIND_TABLE, ExperimentConfig

PLAN_FILE = "compare_plan.json"
PLAN_VERSION = 1
TWIN = "dense"
DENSE_TWIN_KINDS = ("relu_gated", "swiglu")
REINIT_CHOICES = ("off", "on", "both")
POSITION_TAIL = 0.25  # the per-position profile averages the last quarter of the logged steps


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One run of the study: its directory name under out_dir, its full config and what it starts from."""

    key: str
    cfg: ExperimentConfig
    # A trained run directory (absolute path): the run starts from the parameters of its newest
    # intact checkpoint, with a fresh optimizer state, instead of the init of `cfg.train.seed`
    # (`check_init_run` says which runs fit). Only when it starts: a resumed run continues from
    # its own checkpoint. None: the init.
    init_run: str | None = None


def l1_key(l1: float, reinit: bool) -> str:
    return f"twell-l1-{l1:g}" + ("-reinit" if reinit else "")


def study_runs(cfg: ExperimentConfig, *, l1_values: list[float] | None = None, dense_kind: str | None = None,
               reinit: str | None = None, l1_warmup_steps: int | None = None) -> list[StudyRun]:
    """The dense twin (`dense_kind`, no L1, no re-initialisation) then one sparse run per L1 (and per
    re-initialisation setting with reinit="both"); everything else is `cfg`'s, so every run reads
    the same tokens in the same order. None = the config's value (its l1_coef, its reinit_dead)."""
    dense_kind = dense_kind or DENSE_TWIN_KINDS[0]
    if dense_kind not in DENSE_TWIN_KINDS:
        raise ValueError(f"--dense-kind={dense_kind!r}: expected one of {DENSE_TWIN_KINDS}")
    if reinit is not None and reinit not in REINIT_CHOICES:
        raise ValueError(f"--reinit-dead={reinit!r}: expected one of {REINIT_CHOICES}")
    l1_values = [cfg.sparsity.l1_coef] if not l1_values else list(l1_values)
    bad = [v for v in l1_values if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0)]
    if bad or len(set(l1_values)) != len(l1_values):
        raise ValueError(f"--l1 {l1_values}: expected distinct finite L1 coefficients >= 0")
    # Each run's directory is named by l1_key (6 significant digits): values it cannot tell apart
    # would share one directory.
    keys = [l1_key(v, False) for v in l1_values]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--l1 {l1_values}: {sorted({k for k in keys if keys.count(k) > 1})} name several of these "
                         "values (run directories carry 6 significant digits); give values that differ there")
    sparsity = cfg.sparsity
    if l1_warmup_steps is not None:
        if l1_warmup_steps < 0:
            raise ValueError(f"--l1-warmup-steps={l1_warmup_steps}: expected >= 0")
        sparsity = dataclasses.replace(sparsity, l1_warmup_start=0, l1_warmup_end=l1_warmup_steps)
    reinits = {None: [sparsity.reinit_dead], "off": [False], "on": [True], "both": [False, True]}[reinit]
    sparse_kind = cfg.model.ffn_kind if cfg.model.kind.sparse_op else "twell"
    runs = [StudyRun(TWIN, dataclasses.replace(
        cfg, name=f"{cfg.name}-{TWIN}", model=dataclasses.replace(cfg.model, ffn_kind=dense_kind),
        sparsity=dataclasses.replace(sparsity.without_l1(), reinit_dead=False)))]
    for l1 in l1_values:
        for flag in reinits:
            key = l1_key(l1, flag)
            runs.append(StudyRun(key, dataclasses.replace(
                cfg, name=f"{cfg.name}-{key}", model=dataclasses.replace(cfg.model, ffn_kind=sparse_kind),
                sparsity=dataclasses.replace(sparsity, l1_coef=float(l1), reinit_dead=flag))))
    return runs


# ----------------------------------------------------------------------------- the plan on disk


def _plan_dict(runs: list[StudyRun], options: dict[str, Any]) -> dict[str, Any]:
    return {"version": PLAN_VERSION, "options": options,
            "runs": [{"key": r.key, "config": config_lib.to_dict(r.cfg), "init_run": r.init_run} for r in runs]}


def check_out_dir(out_dir: Path, *, resume: bool) -> None:
    """A new study needs a missing or empty `out_dir`; --resume needs a comparison directory. A
    training run (config.json / checkpoints/ without a plan) is refused either way."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir}: not a directory")
    has_plan = (out_dir / PLAN_FILE).is_file()
    if not has_plan and ((out_dir / run_dir_lib.CONFIG_FILE).is_file()
                         or (out_dir / run_dir_lib.CHECKPOINT_SUBDIR).is_dir()):
        raise ValueError(f"--out {out_dir}: that directory is a training run of `twell train`, not a comparison "
                         f"(no {PLAN_FILE}); pick another --out")
    if resume and not has_plan:
        raise FileNotFoundError(f"--resume: {out_dir} holds no comparison ({PLAN_FILE} is missing); start one "
                                "with `twell compare --out DIR` (no --resume)")
    if not resume and has_plan:
        raise ValueError(f"--out {out_dir} holds a comparison: continue it with --resume, or pick another --out")
    if not resume and out_dir.is_dir() and any(out_dir.iterdir()):
        raise ValueError(f"--out {out_dir} is not empty; pick another --out (a comparison starts in a new or "
                         "empty directory)")


def load_plan(out_dir: Path) -> tuple[list[StudyRun], dict[str, Any]]:
    """(the runs, the study options) saved in `out_dir`'s plan."""
    path = out_dir / PLAN_FILE
    plan = run_dir_lib.read_json_file(path, "comparison plan")
    version = plan.get("version") if isinstance(plan, dict) else None
    if version != PLAN_VERSION:
        raise ValueError(f"{path}: version {version!r}, expected {PLAN_VERSION}")
    try:
        runs = [StudyRun(r["key"], config_lib.from_dict(r["config"]), r.get("init_run")) for r in plan["runs"]]
        if any(r.init_run is not None and not isinstance(r.init_run, str) for r in runs):
            raise TypeError("init_run must be a path or null")
        return runs, plan["options"]
    except (KeyError, TypeError, ValueError) as err:  # a damaged or hand-edited plan
        raise ValueError(f"{path}: not a valid comparison plan ({type(err).__name__}: {err})") from None


def resumed_runs(out_dir: Path, overrides: list[str], options: dict[str, Any]) -> list[StudyRun]:
    """The saved plan with `overrides` (config.RESUMABLE_FIELDS only) applied to every run. A study
    option given (not None) that differs from the saved one is refused: the runs must train as planned."""
    runs, saved = load_plan(out_dir)
    changed = {k: v for k, v in options.items() if v is not None and v != saved.get(k)}
    if changed:
        flag = {"l1_values": "--l1", "dense_kind": "--dense-kind", "reinit": "--reinit-dead",
                "l1_warmup_steps": "--l1-warmup-steps"}
        planned = ", ".join(f"{flag.get(k, k)} {v}" for k, v in saved.items())
        given = ", ".join(f"{flag.get(k, k)} {v}" for k, v in changed.items())
        raise ValueError(f"--resume: {out_dir} was planned with {planned}; {given} differ (leave the study "
                         "options out when resuming)")
    fixed = sorted({o.split("=", 1)[0].strip() for o in overrides} - config_lib.RESUMABLE_FIELDS)
    if fixed:
        raise ValueError(f"--set {', '.join(fixed)}: cannot change when resuming a comparison (every run must "
                         "train as planned); fields that may change: " + ", ".join(sorted(config_lib.RESUMABLE_FIELDS)))
    return [dataclasses.replace(r, cfg=config_lib.apply_overrides(r.cfg, overrides)) for r in runs]


def _run_state(run_dir: Path, cfg: ExperimentConfig) -> str:
    """"done" (summary at train.steps), "resume" (a checkpoint to continue from) or "new"."""
    summary = run_dir_lib.read_summary(run_dir)
    if summary is not None and summary.get("steps", -1) >= cfg.train.steps:
        return "done"
    if run_dir_lib.has_steps(run_dir / run_dir_lib.CHECKPOINT_SUBDIR):
        return "resume"
    return "new"


def init_run_config(init_run: str | Path) -> ExperimentConfig:
    """The saved config of the trained run `init_run` (a run directory of `twell train` holding a
    checkpoint); errors name --init-run."""
    from twell_jax.training import checkpoint as ckpt_lib

    if not run_dir_lib.has_steps(run_dir_lib.checkpoint_dir(init_run)):
        raise ValueError(f"--init-run {init_run}: no checkpoint there (expected the directory of a trained run, "
                         f"with {run_dir_lib.CHECKPOINT_SUBDIR}/<step>/)")
    return ckpt_lib.load_run_config(run_dir_lib.run_dir_of(init_run))


def check_init_run(init_run: str | Path, cfg: ExperimentConfig) -> None:
    """Raise ValueError, naming --init-run and every field that differs, unless the parameters of
    the trained run `init_run` fit `cfg`'s model: the same architecture (config.ARCHITECTURE_FIELDS)
    and an FFN of the same layout and activation (gated or not, ReLU or SiLU: `twell` can start
    from a `relu_gated` run, not from a `swiglu` one)."""
    have, want = init_run_config(init_run).model, cfg.model
    differ = [(f"model.{f}", getattr(have, f), getattr(want, f)) for f in config_lib.ARCHITECTURE_FIELDS
              if getattr(have, f) != getattr(want, f)]
    if (have.kind.gated, have.kind.relu) != (want.kind.gated, want.kind.relu):
        differ.append(("model.ffn_kind", have.ffn_kind, want.ffn_kind))
    if differ:
        raise ValueError(f"--init-run {init_run}: its model does not fit the study's ("
                         + "; ".join(f"{name}: the run has {old!r}, the study {new!r}" for name, old, new in differ)
                         + ")")


# ----------------------------------------------------------------------------- the study


def run_study(runs: list[StudyRun], out_dir: str | Path, *, resume: bool = False,
              options: dict[str, Any] | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train every run of the plan under `out_dir/<key>` (keeping finished ones when `resume`),
    then write compare.json, compare.md and compare.png into `out_dir`; returns the report.
    `options`: the study options recorded in the plan (what --resume checks against). A run that
    starts (not one resumed) from a trained run's parameters (`init_run`) is checked to fit it
    before anything trains."""
    from twell_jax.training import parallel
    from twell_jax.training.train import TrainingInterrupted

    out_dir = Path(out_dir)
    with parallel.all_or_none("checking the comparison directory"):  # every process, or none goes on
        check_out_dir(out_dir, resume=resume)
        states = [_run_state(out_dir / run.key, run.cfg) if resume else "new" for run in runs]
        for run, state in zip(runs, states):
            if run.init_run is not None and state == "new":
                check_init_run(run.init_run, run.cfg)
    # Whether a run is kept, resumed or started decides what every process trains: process 0's view.
    states = parallel.lead_value("the states of the comparison's runs", lambda: states)
    plan = json.dumps(_plan_dict(runs, options or {}), indent=1)
    parallel.check_same("the comparison plan (a digest of its compare_plan.json)",
                        hashlib.sha256(plan.encode()).hexdigest()[:16],
                        "start every process with the same study (--config, --set, --l1 and the other options)")
    if not resume:
        _write_plan(out_dir, plan)
    for i, (run, state) in enumerate(zip(runs, states), 1):
        run_dir = out_dir / run.key
        what = f"{run.cfg.model.ffn_kind}, L1 {run.cfg.sparsity.l1_coef:g}" + (
            ", re-initialising dead neurons" if run.cfg.sparsity.reinit_dead else "")
        if state == "done":
            echo(f"[twell] compare: run {i}/{len(runs)} {run.key} ({what}) finished earlier: kept")
            continue
        echo(f"[twell] compare: run {i}/{len(runs)} {run.key} ({what}) -> {run_dir}"
             + (" (resuming from its checkpoint)" if state == "resume" else ""))
        start = time.perf_counter()
        try:
            _trainer(run, run_dir, state, study_resumed=resume, echo=echo).run()
        except TrainingInterrupted as err:  # the message names the command that continues the study
            err.args = (f"{err.signal_name} received: run {run.key} stopped after step {err.step}; continue the "
                        f"comparison with: twell compare --out {out_dir} --resume",)
            raise
        echo(f"[twell] compare: {run.key} trained in {time.perf_counter() - start:.0f}s")
    with parallel.all_or_none("writing the comparison's report"):  # every process reads it, process 0 writes it
        return write_report(runs, out_dir, echo=echo, write_files=parallel.is_lead())


def _write_plan(out_dir: Path, plan: str) -> None:
    """Start the study in `out_dir` with its compare_plan.json: process 0 writes it, and every other
    process of a multi-process run must then see it (--out on a shared file system), else every
    process raises, naming the directory, and the plan is removed again."""
    import jax

    from twell_jax.training import parallel

    with parallel.all_or_none("writing the comparison plan"):
        if parallel.is_lead():
            out_dir.mkdir(parents=True, exist_ok=True)
            run_dir_lib.atomic_write_text(out_dir / PLAN_FILE, plan)
    try:
        with parallel.all_or_none("checking that every process sees the comparison directory"):
            if not parallel.is_lead() and not (out_dir / PLAN_FILE).is_file():
                raise ValueError(f"--out {out_dir.absolute()}: process {jax.process_index()} does not see the "
                                 f"comparison process 0 started there ({PLAN_FILE}): every process of a multi-process "
                                 "run needs --out on a file system they share, at the same path")
    except BaseException:
        if parallel.is_lead():
            (out_dir / PLAN_FILE).unlink(missing_ok=True)  # the study's caller removes the directory left empty
        raise


def _trainer(run: StudyRun, run_dir: Path, state: str, *, study_resumed: bool,
             echo: Callable[[str], None]) -> Any:
    """The Trainer of one run in `state` ("resume": from its own checkpoint; "new": from
    `run.init_run`'s parameters when it has one, else from the init)."""
    from twell_jax.training.run_tokenizer import run_tokenizer_hash
    from twell_jax.training import checkpoint as ckpt_lib
    from twell_jax.training.train import InitFromParams, Trainer

    # "new" in an existing directory: a run killed before its first checkpoint; start it again.
    common = dict(resume=state == "resume", overwrite=study_resumed and state == "new", echo=echo)
    if run.init_run is None or state == "resume":
        return Trainer(run.cfg, run_dir, **common)
    params, _, step = ckpt_lib.restore_params(run.init_run, warn=echo)
    echo(f"[twell] compare: {run.key} starts from the parameters of {run.init_run} (step {step}) with a fresh "
         "optimizer state")
    init_tokenizer = (run_tokenizer_hash(run_dir_lib.run_dir_of(run.init_run), warn=echo),
                      f"--init-run {run.init_run}")
    # Its state takes them over; its data must tokenize as theirs did.
    return InitFromParams(run.cfg, run_dir, init_params=params, init_tokenizer=init_tokenizer, **common)


def run_report(run: StudyRun, run_dir: Path) -> dict[str, Any]:
    """One run's row: its summary.json plus the training curves and the position profile from
    metrics.jsonl (each logged step's `position_profile` [layers, buckets])."""
    summary = run_dir_lib.read_summary(run_dir)
    if summary is None:
        raise FileNotFoundError(f"{run_dir} has no {run_dir_lib.SUMMARY_FILE}: the run {run.key} has not finished; "
                                "continue the comparison with --resume")
    records = run_dir_lib.read_metrics(run_dir)
    train_records = [r for r in records if "ce" in r]
    profiles = [np.asarray(r["position_profile"], np.float64) for r in train_records if "position_profile" in r]
    position = None
    if profiles:
        tail = profiles[-max(1, int(round(POSITION_TAIL * len(profiles)))):]
        position = np.mean(tail, axis=0)  # [layers, buckets]
    cfg = run.cfg
    d_ff = cfg.model.d_ff
    return {
        "key": run.key, "ffn_kind": cfg.model.ffn_kind,
        "ffn_backend": FFN_KIND_TABLE[cfg.model.ffn_kind].backend(cfg.model.ffn_backend),
        "l1_coef": cfg.sparsity.l1_coef, "reinit_dead": cfg.sparsity.reinit_dead,
        "l1_warmup": [cfg.sparsity.l1_warmup_start, cfg.sparsity.l1_warmup_end],
        "steps": summary["steps"], "planned_steps": cfg.train.steps,
        "tokens": summary["steps"] * cfg.train.global_batch * cfg.seq_len,
        "val_loss": summary["val_loss"], "val_perplexity": summary["val_perplexity"],
        "active_per_token": summary["val_l0_mean"], "active_share": summary["val_l0_mean"] / d_ff,
        "active_per_layer": summary["val_l0_per_layer"],
        "active_per_position": None if position is None else position.mean(axis=0).tolist(),
        "active_per_layer_position": None if position is None else position.tolist(),
        "position_buckets": cfg.sparsity.position_buckets, "seq_len": cfg.seq_len,
        "dead_share": summary["dead_share_mean"], "dead_share_per_layer": summary["dead_share_per_layer"],
        "tokens_per_s": summary["tokens_per_s"], "d_ff": d_ff, "n_layers": cfg.model.n_layers,
        "curve_steps": [r["step"] for r in train_records], "curve_ce": [r["ce"] for r in train_records],
    }


def check_same_tokenizer(runs: list[StudyRun], out_dir: Path, *, echo: Callable[[str], None] = print) -> str | None:
    """The hash of the tokenizer every run of the study was trained with (the dense twin's; None
    without one); a ValueError naming both hashes when a run's differs (e.g. data.source changed on
    --resume before it started). A run whose tokenizer is unknown is warned about and not compared."""
    from twell_jax.data import tokenizer as tokenizer_lib
    from twell_jax.training.run_tokenizer import run_tokenizer_hash

    twin_dir = out_dir / runs[0].key
    twin = run_tokenizer_hash(twin_dir, warn=echo)
    for run in runs[1:]:
        run_dir = out_dir / run.key
        tokenizer_lib.check_same_tokenizer(
            run_tokenizer_hash(run_dir, warn=echo), f"the tokenizer of run {run.key} ({run_dir})", twin,
            f"the dense twin's ({twin_dir})", f"their figures are not comparable; train it again with the twin's data "
            f"(remove {run_dir}, then twell compare --out {out_dir} --resume without changing data.*)")
    return twin


def write_report(runs: list[StudyRun], out_dir: Path, *, echo: Callable[[str], None] = print,
                 task_results: dict[str, dict[str, Any]] | None = None, write_files: bool = True) -> dict[str, Any]:
    """compare.json, compare.md and compare.png from the runs' own files, once every run is known
    to share the twin's tokenizer (`check_same_tokenizer`); returns the report (the `twell compare`
    command prints its table on stdout). `task_results`: per run key, its lm-eval results
    (`task_accuracy`), which add the accuracy columns. `write_files=False`: the report only (the
    processes of a multi-process run but process 0)."""
    tokenizer = check_same_tokenizer(runs, out_dir, echo=echo)
    rows = [run_report(run, out_dir / run.key) for run in runs]
    twin = rows[0]
    for row in rows:
        row["ce_gap_to_twin"] = (row["val_loss"] - twin["val_loss"]) / twin["val_loss"]
        row["equal_tokens"] = row["tokens"] == twin["tokens"]
        if task_results is not None:
            row.update(task_results[row["key"]])
    report = {"twin": twin["key"], "runs": rows, "out_dir": str(out_dir), "tokenizer_hash": tokenizer}
    if not write_files:
        return report
    table = markdown_table(rows)
    (out_dir / "compare.json").write_text(json.dumps(report, indent=1))
    (out_dir / "compare.md").write_text(table + "\n")
    png = out_dir / "compare.png"
    plot(rows, png)
    unequal = [r["key"] for r in rows if not r["equal_tokens"]]
    if unequal:
        echo(f"[twell] compare: WARNING: {', '.join(unequal)} trained on other token counts than the twin "
             "(stopped early?): their CE gaps are not at equal tokens")
    echo(f"[twell] compare: wrote {png}, {out_dir / 'compare.md'}, {out_dir / 'compare.json'}")
    return report


TABLE_HEADER = ("run", "FFN", "L1", "re-init", "tokens", "val CE", "gap to twin", "active/token",
                "% of d_ff", "dead", "tokens/s")


# With --tasks: the mean accuracy over the tasks and its difference to the twin's (points).
TASK_HEADER = ("accuracy", "acc vs twin")


def table_cells(row: dict[str, Any], twin: dict[str, Any] | None = None) -> tuple[str, ...]:
    gap = "-" if row["key"] == TWIN else f"{100 * row['ce_gap_to_twin']:+.2f}%"
    tokens = f"{row['tokens']:,}" + ("" if row["equal_tokens"] else " (!)")
    tps = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}"
    cells = (row["key"], f"{row['ffn_kind']} ({row['ffn_backend']})", f"{row['l1_coef']:g}",
             "yes" if row["reinit_dead"] else "no", tokens, f"{row['val_loss']:.4f}", gap,
             f"{row['active_per_token']:.1f}", f"{100 * row['active_share']:.2f}%",
             f"{100 * row['dead_share']:.1f}%", tps)
    if "mean_acc" not in row:
        return cells
    acc, twin_acc = row["mean_acc"], (twin or row).get("mean_acc")
    delta = ("-" if row["key"] == TWIN or acc is None or twin_acc is None
             else f"{100 * (acc - twin_acc):+.2f} pt")
    return cells + ("-" if acc is None else f"{100 * acc:.2f}%", delta)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = TABLE_HEADER + (TASK_HEADER if any("mean_acc" in r for r in rows) else ())
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(table_cells(r, rows[0])) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Four panels: validation CE against active neurons per token (a point per sparse run, the twin
    as a line), training CE curves, active neurons per layer, active neurons per token position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax_front, ax_curve, ax_layer, ax_pos = axes.ravel()
    twin, sparse = rows[0], rows[1:]
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(1, len(sparse))))
    for row, color in zip(sparse, colors):
        ax_front.scatter([max(row["active_per_token"], 1e-2)], [row["val_loss"]], color=color, s=60,
                         marker="s" if row["reinit_dead"] else "o", label=row["key"])
    ax_front.axhline(twin["val_loss"], color="black", linestyle="--",
                     label=f"dense twin ({twin['ffn_kind']}): {twin['val_loss']:.4f}")
    ax_front.set_xscale("log")
    ax_front.set_xlabel(f"mean active FFN neurons per token (of d_ff = {twin['d_ff']})")
    ax_front.set_ylabel("validation CE (nats/token)")
    ax_front.set_title("quality against sparsity")
    ax_front.legend(fontsize=7)
    styled = [(twin, "black")] + list(zip(sparse, colors))
    for row, color in styled:
        ax_curve.plot(row["curve_steps"], row["curve_ce"], color=color, alpha=0.8, label=row["key"])
        layers = np.arange(len(row["active_per_layer"]))
        ax_layer.plot(layers, np.maximum(row["active_per_layer"], 1e-2), color=color, marker="o", label=row["key"])
        if row["active_per_position"] is not None:
            buckets = len(row["active_per_position"])
            starts = np.arange(buckets) * row["seq_len"] / buckets
            ax_pos.plot(starts, np.maximum(row["active_per_position"], 1e-2), color=color, marker="o", label=row["key"])
    ax_curve.set_xlabel("optimizer step")
    ax_curve.set_ylabel("training CE")
    ax_curve.set_title("training curves (same tokens, same order)")
    ax_curve.legend(fontsize=7)
    for ax, xlabel, title in ((ax_layer, "layer", "active neurons per layer (validation)"),
                              (ax_pos, "token position (bucket start)",
                               "active neurons per position (training, last quarter of logged steps)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean active neurons per token")
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax_layer.set_xticks(np.arange(twin["n_layers"]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`twell compare`'s study options (the CLI adds --config, --set and --out)."""
    parser.add_argument("--l1", type=float, nargs="+", default=None, metavar="COEF",
                        help="L1 coefficients of the sparse runs, e.g. --l1 0 1e-5 2e-5 5e-5 (default: the "
                             "config's sparsity.l1_coef)")
    parser.add_argument("--dense-kind", choices=DENSE_TWIN_KINDS, default=None,
                        help="FFN of the dense twin (trained without L1; default relu_gated, the paper's)")
    parser.add_argument("--reinit-dead", choices=REINIT_CHOICES, default=None,
                        help="sparse runs re-initialise dead neurons: off, on, or both (a run of each per "
                             "L1); default: the config's sparsity.reinit_dead")
    parser.add_argument("--l1-warmup-steps", type=int, default=None, metavar="N",
                        help="ramp the L1 from 0 at step 0 to its value at step N (sets "
                             "sparsity.l1_warmup_start=0, l1_warmup_end=N)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the comparison in --out: finished runs are kept, an interrupted one "
                             "resumes from its checkpoint (--set: resumable fields only)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs the study would train, and exit")
    parser.add_argument("--tasks", default=None, metavar="NAMES",
                        help="also evaluate every finished run on lm-eval tasks (as `twell eval --tasks`: names, "
                             "`paper`, or a task YAML) and add the accuracy column; needs pip install "
                             "'twell-jax[eval]'")
    parser.add_argument("--tasks-limit", type=int, default=None, metavar="N",
                        help="with --tasks: at most N documents per task (a quick look, not the tasks' score)")


def task_accuracy(runs: list[StudyRun], out_dir: Path, selection: Any, *, limit: int | None = None,
                  loaded_tasks: tuple[Any, list[Any]] | None = None,
                  echo: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Per run key: {"mean_acc", "task_acc": {task: acc}, "lm_eval_results": path} of the run's
    final checkpoint on the selected lm-eval tasks (`harness.evaluate_run`; a results file of that
    step and these tasks already in the run directory is read back). `loaded_tasks`:
    `harness.load_tasks(selection)`, loaded once for every run (None: each run loads them)."""
    from twell_jax.inference import harness

    out = {}
    for run in runs:
        run_dir = out_dir / run.key
        step = run_dir_lib.read_summary(run_dir)["steps"]
        results, path = harness.evaluate_run(run_dir, selection, step=step, limit=limit, reuse=True, echo=echo,
                                             loaded_tasks=loaded_tasks, flag="--tasks")
        summary = harness.summarize(results)
        out[run.key] = {"mean_acc": summary["mean_acc"],
                        "task_acc": {task: row["acc"] for task, row in summary["tasks"].items()},
                        "lm_eval_results": str(path)}
    return out


def compare(cfg: ExperimentConfig, out_dir: str | Path, *, l1_values: list[float] | None = None,
            dense_kind: str | None = None, reinit: str | None = None, l1_warmup_steps: int | None = None,
            echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Plan the study for `cfg` (see `study_runs`) and run it into a new `out_dir`."""
    options = dict(l1_values=l1_values, dense_kind=dense_kind, reinit=reinit, l1_warmup_steps=l1_warmup_steps)
    return run_study(study_runs(cfg, **options), out_dir, options=options, echo=echo)


def main_from_args(args: argparse.Namespace, load_config: Callable[[str, list[str]], ExperimentConfig],
                   echo: Callable[[str], None] = print) -> dict[str, Any]:
    """`twell compare`: plan (or, with --resume, reload) the study, then train and report it; with
    --dry-run only plan it ({"dry_run": True, "out_dir", "plan": what compare_plan.json would hold})."""
    from twell_jax.training import parallel

    options = dict(l1_values=args.l1, dense_kind=args.dense_kind, reinit=args.reinit_dead,
                   l1_warmup_steps=args.l1_warmup_steps)
    selection = None
    if args.tasks_limit is not None and (args.tasks is None or args.tasks_limit < 1):
        raise ValueError("--tasks-limit needs --tasks" if args.tasks is None
                         else f"--tasks-limit must be >= 1, got {args.tasks_limit}")
    if args.tasks is not None:  # checked before anything trains
        from twell_jax.inference import lm_eval_harness

        selection = lm_eval_harness().select_tasks(args.tasks)
    with parallel.all_or_none("planning the comparison"):  # a multi-process run: every process, or none goes on
        if args.resume:
            if args.out is None:
                raise ValueError("--resume needs --out DIR (the comparison to continue)")
            out = Path(args.out)
            check_out_dir(out, resume=True)
            if args.config is not None:
                raise ValueError(f"--config {args.config!r}: leave it out with --resume (the comparison's saved plan "
                                 "is used)")
            runs = resumed_runs(out, args.set, options)
        else:
            cfg = load_config(args.config or "tiny", args.set)
            runs = study_runs(cfg, **options)
            if args.out:
                out = Path(args.out)
            elif args.dry_run:  # nothing is written: the name a real run would start from
                out = Path("runs") / f"compare-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            else:  # reserved atomically (by process 0), so two studies started in the same second never share one
                out = Path(parallel.lead_value("the comparison directory", lambda: str(run_dir_lib.default_run_dir(
                    dataclasses.replace(cfg, name=f"compare-{cfg.name}")))))
            check_out_dir(out, resume=False)
    first = runs[0].cfg
    echo(f"[twell] compare: {len(runs)} runs of {first.train.steps} steps x {first.train.global_batch} x "
         f"{first.seq_len} tokens, data {first.data.source!r} (seed {first.data.seed}) -> {out.absolute()}"
         + compile_cache.describe())
    for run in runs:
        echo(f"  {run.key}: ffn {run.cfg.model.ffn_kind} ({run.cfg.model.ffn_backend}), L1 "
             f"{run.cfg.sparsity.l1_coef:g} (warm-up steps {run.cfg.sparsity.l1_warmup_start}-"
             f"{run.cfg.sparsity.l1_warmup_end}), reinit_dead {run.cfg.sparsity.reinit_dead}")
    if args.dry_run:
        echo("[twell] compare: --dry-run: nothing trained")
        return {"dry_run": True, "out_dir": str(out.absolute()), "plan": _plan_dict(runs, options)}
    try:
        # The tasks and their data (a download), before the first run trains: once for every run.
        loaded_tasks = None if selection is None else lm_eval_harness().load_tasks(selection)
        report = run_study(runs, out, resume=args.resume, options=options, echo=echo)
        if selection is None:
            return report
        return write_report(runs, out, echo=echo, task_results=task_accuracy(
            runs, out, selection, limit=args.tasks_limit, loaded_tasks=loaded_tasks, echo=echo))
    except BaseException:
        if not args.resume and parallel.is_lead() and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a study that failed before writing anything leaves no directory behind
        raise


# ----------------------------------------------------------------------------- per-layer profiles

PROFILE_POINTS = 8  # relative depths at which two runs' per-layer profiles are compared


def layer_profile(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's per-layer activity from its summary.json: the share of d_ff active per
    token on the validation split and the dead-neuron share, per layer, with its size and steps."""
    summary = run_dir_lib.read_summary(run_dir)
    path = Path(run_dir) / run_dir_lib.SUMMARY_FILE
    if summary is None:
        raise ValueError(f"{run_dir} has no {run_dir_lib.SUMMARY_FILE}: give the directory of a finished run")
    active = summary.get("val_l0_per_layer")
    if not active:
        raise ValueError(f"{path} has no val_l0_per_layer (a run of a relu-family FFN with an evaluation)")
    d_ff = summary["d_ff"]
    dead = summary.get("dead_share_per_layer") or [float("nan")] * len(active)
    return {"run": str(run_dir), "d_ff": d_ff, "n_layers": len(active), "steps": summary.get("steps"),
            "val_loss": summary.get("val_loss"), "active_share": [a / d_ff for a in active],
            "dead_share": list(dead)}


def _at_depths(values: list[float], points: int) -> np.ndarray:
    """Per-layer values read at `points` relative depths (layer i sits at (i + 0.5) / L)."""
    n = len(values)
    return np.interp((np.arange(points) + 0.5) / points, (np.arange(n) + 0.5) / n, np.asarray(values, np.float64))


def profile_distance(a: dict[str, Any], b: dict[str, Any], points: int = PROFILE_POINTS) -> dict[str, Any]:
    """How far run b's per-layer profile is from run a's (`layer_profile` dicts; the sizes may differ:
    both are read at `points` relative depths). level_ratio: b's mean active share over a's;
    shape_distance: the total-variation distance of the two profiles normalised to sum 1 (0 = the
    same shape, 1 = disjoint); per_depth_ratio: b over a at each depth; dead_gap: b's mean dead
    share minus a's (dead shares only where both runs report them)."""
    pa, pb = _at_depths(a["active_share"], points), _at_depths(b["active_share"], points)
    shape = 0.5 * float(np.sum(np.abs(pa / max(pa.sum(), 1e-30) - pb / max(pb.sum(), 1e-30))))
    da, db = _at_depths(a["dead_share"], points), _at_depths(b["dead_share"], points)
    return {"points": points, "depths": ((np.arange(points) + 0.5) / points).tolist(),
            "active_share_a": pa.tolist(), "active_share_b": pb.tolist(),
            "per_depth_ratio": (pb / np.maximum(pa, 1e-30)).tolist(),
            "level_ratio": float(pb.mean() / max(pa.mean(), 1e-30)), "shape_distance": shape,
            "dead_share_a": da.tolist(), "dead_share_b": db.tolist(),
            "dead_gap": float(np.nanmean(db) - np.nanmean(da)) if np.isfinite(da).any() and np.isfinite(db).any()
            else None}
