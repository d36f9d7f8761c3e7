"""The sparse op's "auto" hints of a run: which configs get them, and where a run's hints are read.

A model whose sparse op runs backend "auto" with no user hint (`manages_auto_hints`) is given
`model.ffn_expected_active` (per-layer mean active FFN neurons per token) from telemetry, so that
"auto" decides dense vs sparse per layer at trace time. The trainer saves the hints it compiled
with in each checkpoint's meta ("auto_hints"); `run_hints` is the one reader of a run's hints for
evaluation, inference and resumption: the checkpoint's saved hints, else the last per-layer l0 the
run logged in metrics.jsonl up to that step. A run that tracks neurons also hints each layer's
expected dense tails of the sparse backward (`model.ffn_expected_tails`, from the telemetry of
`ops.backward_tail_shares`; saved in the checkpoint's config; `run_tail_hints` reads them back: the
checkpoint's, else the last shares logged in metrics.jsonl up to that step). Only training prices
them, so evaluation and inference do without.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from twell_jax import ops
from twell_jax import run_dir as run_dir_lib
from twell_jax.config import ExperimentConfig, ModelConfig
from twell_jax.training import checkpoint as ckpt_lib


def manages_auto_hints(model: ModelConfig) -> bool:
    """True when the sparse op runs backend "auto" and the user set no `expected_active_per_token`
    hint (neither `model.ffn_expected_active` nor one in `model.ffn_op_config`): the hints are then
    filled from telemetry (by the trainer, and by `with_auto_hints` for eval/inference)."""
    return (model.kind.sparse_op and model.ffn_backend == "auto" and not model.ffn_expected_active
            and "expected_active_per_token" not in model.ffn_op_config)


Tails = tuple[tuple[float, float, float], ...]  # per layer (token tail, hot neurons, hot entries)


def with_hints(cfg: ExperimentConfig, hints: Sequence[float],
               tails: Sequence[Sequence[float]] | None = None) -> ExperimentConfig:
    """`cfg` with `model.ffn_expected_active` = `hints` (one per layer) and, when given,
    `model.ffn_expected_tails` = `tails` (one (token tail, hot neurons, hot entries) triple of
    shares per layer: the sparse backward's expected dense tails)."""
    fields: dict[str, Any] = {"ffn_expected_active": tuple(float(v) for v in hints)}
    if tails is not None:
        fields["ffn_expected_tails"] = normalise_tails(tails)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))


def describe_tails(tails: Tails) -> str:
    """"0.6%/3.1%, ..." (token-tail share / hot-neuron share per layer), for log lines."""
    return ", ".join(f"{t[0]:.1%}/{t[1]:.1%}" for t in tails)


# How far outside [0, 1] a measured share may land by rounding alone: the shares are averages of fp32
# sums over steps (a `2b` run's mean of shares of 1.0 came out a hair above 1 and its config was refused).
SHARE_ROUNDING = 1e-4


def _share(value: float) -> float:
    value = float(value)
    if -SHARE_ROUNDING <= value <= 1.0 + SHARE_ROUNDING:
        return min(max(value, 0.0), 1.0)
    return value  # not rounding: left for ModelConfig to refuse with the whole triple named


def normalise_tails(tails: Sequence[Sequence[float]]) -> Tails:
    """Tail hints as a tuple of float triples (from lists, numpy rows, ...), each share within
    rounding of [0, 1] clipped into it."""
    return tuple(tuple(_share(v) for v in layer) for layer in tails)


def saved_tail_hints(meta: dict[str, Any] | None, n_layers: int) -> Tails | None:
    """The tail hints a checkpoint was trained with (its meta's step config), or None (none saved:
    a run without neuron tracking, or one saved before the hints existed)."""
    model = ((meta or {}).get("config") or {}).get("model") or {}
    tails = model.get("ffn_expected_tails")
    if isinstance(tails, list) and len(tails) == n_layers and n_layers:
        return normalise_tails(tails)
    return None


def expected_active_from_run(run_dir: str | Path, n_layers: int,
                             up_to_step: int | None = None) -> tuple[float, ...] | None:
    """The latest per-layer mean active neurons per token a run logged (validation or training
    record of its metrics.jsonl, at or before `up_to_step` when given), or None when it has none
    for `n_layers` layers."""
    def read(record: dict[str, Any]) -> tuple[float, ...] | None:
        for key in ("val_l0_per_layer", "l0_per_layer"):
            values = record.get(key)
            if isinstance(values, list) and len(values) == n_layers:
                return tuple(float(v) for v in values)
        return None

    return _latest_logged(run_dir, up_to_step, read)


def active_by_position_from_run(run_dir: str | Path, n_layers: int, max_seq_len: int,
                                up_to_step: int | None = None) -> tuple[tuple[float, ...], ...] | None:
    """The latest per-layer activity by position bucket a run logged at a validation
    (`val_active_by_position`, at or before `up_to_step` when given) for `n_layers` layers and the
    buckets of `max_seq_len`, or None (a run that logged none: one that does not track neurons, or
    one trained before the profile was logged)."""
    buckets = len(ops.planner.position_buckets(max_seq_len)) - 1

    def read(record: dict[str, Any]) -> tuple[tuple[float, ...], ...] | None:
        rows = record.get("val_active_by_position")
        if (isinstance(rows, list) and len(rows) == n_layers
                and all(isinstance(row, list) and len(row) == buckets for row in rows)):
            return tuple(tuple(float(v) for v in row) for row in rows)
        return None

    return _latest_logged(run_dir, up_to_step, read)


def with_position_hints(cfg: ExperimentConfig, run_dir: str | Path, step: int | None = None, *,
                        echo: Callable[[str], None] = print) -> ExperimentConfig:
    """`cfg` with `model.ffn_active_by_position` from the run's last validation profile at or before
    `step`, where "auto" is planned from the run's hints (`with_auto_hints` set them): inference
    then gives each program the activity of its own row length (short rows are denser: their first
    positions fire several times the mean). Unchanged (with a line saying so) for a run without one."""
    model = cfg.model
    if not (model.kind.sparse_op and model.ffn_backend == "auto" and model.ffn_expected_active
            and "expected_active_per_token" not in model.ffn_op_config and not model.ffn_active_by_position):
        return cfg
    profile = active_by_position_from_run(run_dir, model.n_layers, model.max_seq_len, up_to_step=step)
    if profile is None:
        echo("[twell] the run logged no validation activity by position: 'auto' plans rows of every length "
             "with the hints above (rows much shorter than the training sequences fire more)")
        return cfg
    lengths = [n for n in (128, 512, model.max_seq_len) if n <= model.max_seq_len]
    echo("[twell] 'auto' hints by row length (the run's validation activity by position): " + "; ".join(
        f"{n} tokens {', '.join(f'{ops.planner.active_for_length(row, n, model.max_seq_len):.1f}' for row in profile)}"
        for n in dict.fromkeys(lengths)))
    return dataclasses.replace(cfg, model=dataclasses.replace(model, ffn_active_by_position=profile))


def _latest_logged(run_dir: str | Path, up_to_step: int | None,
                   read: Callable[[dict[str, Any]], Any]) -> Any:
    """The last non-None read(record) over the records of the run's metrics.jsonl (those at or
    before `up_to_step` when given), or None (no such record, or no file)."""
    latest = None
    for record in run_dir_lib.read_metrics(run_dir, up_to_step):
        value = read(record)
        if value is not None:
            latest = value
    return latest


def _checkpoint_meta(run_dir: Path, step: int | None) -> dict[str, Any] | None:
    """The meta of checkpoint `step` (default: the latest) of the run, or None when it has none."""
    directory = run_dir_lib.checkpoint_dir(run_dir)
    if not run_dir_lib.has_steps(directory):
        return None
    store = ckpt_lib.CheckpointStore(directory, create=False)
    try:
        return store.restore_meta(step)
    finally:
        store.close()


def tails_from_shares(shares: dict[str, Any], suffix: str = "") -> Tails:
    """Per-layer tail hints from per-layer telemetry: shares[key + suffix] ([L] each) for the keys of
    `ops.TAIL_SHARE_KEYS` (the model's aux; suffix "_per_layer": the trainer's metrics)."""
    return normalise_tails(zip(*(np.asarray(shares[key + suffix], np.float64).tolist()
                                 for key in ops.TAIL_SHARE_KEYS)))


def tails_from_run(run_dir: str | Path, n_layers: int, up_to_step: int | None = None) -> Tails | None:
    """The latest per-layer tail shares a run logged in metrics.jsonl (its training records'
    token_tail_share_per_layer, hot_neuron_share_per_layer and hot_entry_share_per_layer, at or
    before `up_to_step` when given) as tail hints, or None when it logged none."""
    def read(record: dict[str, Any]) -> Tails | None:
        values = [record.get(f"{key}_per_layer") for key in ops.TAIL_SHARE_KEYS]
        if all(isinstance(v, list) and len(v) == n_layers for v in values):
            return tails_from_shares(record, "_per_layer")
        return None

    return _latest_logged(run_dir, up_to_step, read)


def run_tail_hints(run_dir: str | Path, step: int | None = None, *, n_layers: int,
                   meta: dict[str, Any] | None = None) -> Tails | None:
    """The tail hints of the run in `run_dir` at checkpoint `step` (default: the latest): those that
    checkpoint was trained with (`saved_tail_hints`), else the last tail shares logged at or before
    that step (`tails_from_run`), else None."""
    run_dir = Path(run_dir)
    if meta is None:
        meta = _checkpoint_meta(run_dir, step)
    saved = saved_tail_hints(meta, n_layers)
    if saved is not None:
        return saved
    return tails_from_run(run_dir, n_layers, up_to_step=(meta or {}).get("step", step))


def run_hints_and_source(run_dir: str | Path, step: int | None = None, *, n_layers: int | None = None,
                         meta: dict[str, Any] | None = None) -> tuple[tuple[float, ...], str] | None:
    """`run_hints` and a few words saying where the hints come from (for log lines)."""
    run_dir = Path(run_dir)
    if meta is None:
        meta = _checkpoint_meta(run_dir, step)
    meta = meta or {}
    step = meta.get("step", step)
    if n_layers is None:
        n_layers = (meta["config"]["model"]["n_layers"] if "config" in meta
                    else ckpt_lib.load_run_config(run_dir).model.n_layers)
    saved = meta.get("auto_hints")
    if isinstance(saved, list) and len(saved) == n_layers:
        return tuple(float(v) for v in saved), f"saved with the checkpoint of step {step}"
    logged = expected_active_from_run(run_dir, n_layers, up_to_step=step)
    if logged is not None:
        return logged, f"the run's last logged l0 in {run_dir_lib.METRICS_FILE}"
    return None


def run_hints(run_dir: str | Path, step: int | None = None, *, n_layers: int | None = None,
              meta: dict[str, Any] | None = None) -> tuple[float, ...] | None:
    """The per-layer "auto" hints of the run in `run_dir` at checkpoint `step` (default: the latest):
    the hints that checkpoint was trained with (its meta's "auto_hints"), else the last per-layer l0
    logged in metrics.jsonl at or before that step, else None. `meta`: that checkpoint's meta when
    the caller has already read it (it is not read again); `n_layers`: default from the run's config."""
    found = run_hints_and_source(run_dir, step, n_layers=n_layers, meta=meta)
    return None if found is None else found[0]


def with_auto_hints(cfg: ExperimentConfig, run_dir: str | Path, step: int | None = None, *,
                    meta: dict[str, Any] | None = None,
                    echo: Callable[[str], None] = print) -> ExperimentConfig:
    """`cfg` with `model.ffn_expected_active` = `run_hints` of checkpoint `step` when the sparse op
    runs backend "auto" and no hint is set: "auto" then decides dense vs sparse per layer at trace
    time instead of sampling tokens on the device (speed only; the results are the same)."""
    model = cfg.model
    if not manages_auto_hints(model):
        return cfg
    found = run_hints_and_source(run_dir, step, n_layers=model.n_layers, meta=meta)
    if found is None:
        echo("[twell] no per-layer activity telemetry in the run: 'auto' samples tokens on the device")
        return cfg
    hints, source = found
    echo(f"[twell] 'auto' backend hints (expected active neurons/token per layer, {source}): "
         f"{', '.join(f'{v:.1f}' for v in hints)}")
    return with_hints(cfg, hints)
