"""Evaluate a saved checkpoint (or any parameters): validation loss, perplexity, per-layer activity
and dead neurons; `evaluate_params` is also the trainer's evaluation.

Restores the parameters alone (checkpoint.restore_params_with_meta: no optimizer, no Trainer),
gives backend "auto" the checkpoint's hints (hints.with_auto_hints), builds the data with the
tokenizer saved in the run, and evaluates on the run's validation split, or with split="all" on
every sequence of the corpus (another corpus's whole text, not only its held-out share).

Several processes (jax.distributed, docs/parallel.md) evaluate together: each reads its rows of every
batch and the sums are over the global batch, so the result is a one-process evaluation's. Before
Orbax reads the checkpoint with every process, they check that they see the same files
(`preflight.check_processes_see_same_checkpoints`) and the same config; a process that cannot read
the run or build the data stops them all (`parallel.all_or_none`); the "auto" hints, which choose the
compiled program, are process 0's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np

from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib
from twell_jax.ops import planner as ops_planner
from twell_jax.config import ExperimentConfig
from twell_jax.data import DataSource, build_data
from twell_jax.training.shared_data import build_experiment_data, build_once
from twell_jax.data.batching import val_batches
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax.training import parallel
from twell_jax.training.hints import with_auto_hints, with_hints
from twell_jax.training.metrics import check_finite
from twell_jax.training.planning import abstract_graphdef
from twell_jax.training.preflight import (check_processes_agree, check_processes_read_same_data,
                                          check_processes_see_same_checkpoints)
from twell_jax.training.step import make_eval_step

# "val": the corpus's validation split (data.val_fraction of it, chosen at training time); "all":
# every full evaluation batch of the whole corpus, in the corpus's order.
SPLITS = ("val", "all")


@dataclasses.dataclass
class WholeCorpus:
    """A corpus's every sequence as the "validation" batches (a DataSource for evaluate_params).

    `max_batches`: at most this many batches (None = all of them), whatever evaluate_params asks."""

    bundle: Any  # a DataBundle built with val_fraction=0 (everything in its train_sequences)
    max_batches: int | None

    @property
    def source_fingerprint(self) -> str:
        return self.bundle.source_fingerprint

    @property
    def tokenizer_json_path(self) -> str | None:
        return self.bundle.tokenizer_json_path

    @property
    def vocab_size(self) -> int:
        return self.bundle.vocab_size

    def val_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, Any]]:
        del max_batches  # the whole corpus, or self.max_batches
        return val_batches(self.bundle.train_sequences, batch_size=batch_size, max_batches=self.max_batches,
                           process_index=self.bundle.process_index, process_count=self.bundle.process_count,
                           describe=f"the whole corpus, {self.bundle.num_train_tokens} tokens")


def evaluate_params(cfg: ExperimentConfig, data: DataSource, eval_fn: Callable, params: Any, mesh: Any, *,
                    step: int = 0) -> dict[str, Any]:
    """Validation loss, perplexity and per-layer mean active neurons over the held-out batches.

    Uses the first `train.eval_batches` full batches of `train.eval_batch_size` sequences (global)
    in the data pipeline's fixed validation order, so every evaluation sees the same tokens. A
    non-finite result raises FloatingPointError (naming `step`) instead of being reported.
    """
    ce_sum, tokens, l0_sum, position_sum, rows = 0.0, 0.0, None, None, 0.0
    for batch in data.val_batches(cfg.train.eval_batch_size, max_batches=cfg.train.eval_batches):
        placed = parallel.host_to_global({"tokens": np.asarray(batch["tokens"], np.int32)}, mesh)
        out = jax.device_get(eval_fn(params, placed["tokens"]))
        ce_sum += float(out["ce_sum"])
        tokens += float(out["tokens"])
        l0 = np.asarray(out["l0_sum_per_layer"], np.float64)
        l0_sum = l0 if l0_sum is None else l0_sum + l0
        if "position_active_sum" in out:  # a run that tracks neurons (make_eval_step)
            by_position = np.asarray(out["position_active_sum"], np.float64)
            position_sum = by_position if position_sum is None else position_sum + by_position
            rows += float(out["rows"])
    if tokens == 0:
        raise ValueError("the validation split produced no batches; lower train.eval_batch_size or raise "
                         "data.val_fraction")
    loss = ce_sum / tokens
    check_finite(step, {"val_loss": loss, "val_l0_per_layer": l0_sum}, ("val_loss", "val_l0_per_layer"),
                 hint="the parameters evaluated are broken (a diverged run or a damaged checkpoint)")
    result = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens,
              "l0_per_layer": (l0_sum / tokens).tolist()}
    if position_sum is not None:
        # Per layer, the mean active count by position bucket (ops.planner.position_buckets): what
        # inference plans rows shorter than the validation sequences by (model.ffn_active_by_position).
        result["active_by_position"] = [list(row) for row in ops_planner.active_by_position(
            position_sum / rows, cfg.model.max_seq_len)]
    return result


def split_data(cfg: ExperimentConfig, split: str, *, limit_batches: bool,
               data_builder: Callable[[ExperimentConfig], DataSource] = build_experiment_data) -> DataSource:
    """The data an evaluation reads: the validation split of `cfg.data` ("val"), or the whole
    corpus ("all"; `limit_batches`: stop after train.eval_batches batches, else read every one)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "val":
        try:
            return data_builder(cfg)
        except ValueError as err:
            if "raise data.val_fraction" not in str(err):
                raise
            # The split was drawn when the run was trained: raising data.val_fraction is not an option here.
            text = str(err).replace("raise data.val_fraction", "evaluate the whole corpus (`twell eval --split all`)")
            raise ValueError(f"{text} (data.val_fraction is the run's own: it picked the held-out documents when "
                             "the run was trained)") from None
    bundle = build_data(dataclasses.replace(cfg.data, val_fraction=0.0), global_batch=cfg.train.global_batch,
                        process_index=jax.process_index(), process_count=jax.process_count(),
                        coordinate=build_once)
    return WholeCorpus(bundle, cfg.train.eval_batches if limit_batches else None)


def _agreed_hints(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with process 0's "auto" hints (`model.ffn_expected_active`): they choose the program each
    layer compiles, which must be the same on every process. Unchanged in a one-process run."""
    if not parallel.multi_process():
        return cfg
    hints = parallel.lead_value("the 'auto' hints", lambda: list(cfg.model.ffn_expected_active))
    if tuple(hints) == tuple(cfg.model.ffn_expected_active):
        return cfg
    return with_hints(cfg, hints)


def _summarise(result: dict[str, Any], cfg: ExperimentConfig, echo: Callable[[str], None]) -> dict[str, Any]:
    result["l0_mean"] = float(np.mean(result["l0_per_layer"]))
    result["sparsity"] = 1.0 - result["l0_mean"] / cfg.model.d_ff
    # The "auto" hints the evaluation compiled with (None: none were set or found).
    result["auto_hints_per_layer"] = list(cfg.model.ffn_expected_active) or None
    echo(f"[twell] validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over "
         f"{int(result['tokens'])} tokens; mean active FFN neurons/token {result['l0_mean']:.1f} of "
         f"{cfg.model.d_ff} ({100 * result['sparsity']:.1f}% zero)")
    return result


def evaluate_checkpoint(path: str | Path, *, step: int | None = None, overrides: list[str] | None = None,
                        split: str = "val", echo: Callable[[str], None] = print,
                        data_builder: Callable[[ExperimentConfig], DataSource] = build_experiment_data) -> dict[str, Any]:
    """Restore the run at `path` (a run dir or its checkpoints/ dir) and evaluate it on the validation
    split (`split="all"`: on the whole corpus, every batch unless train.eval_batches is overridden).

    `step` picks a checkpoint (default: the newest intact one, with a warning for each newer one
    that fails verification). `overrides` may change only config.RESUMABLE_FIELDS (e.g.
    train.eval_batches=32, train.num_devices=1, data.source=<the moved corpus, or another one>). A
    non-finite loss raises FloatingPointError.
    """
    # A multi-process run: every process finds the checkpoints, and sees the same files there, before
    # Orbax reads them together (a process that cannot would leave the others waiting inside Orbax).
    with parallel.all_or_none("finding the checkpoint"):
        ckpt_dir = run_dir_lib.checkpoint_dir(path)
        if not ckpt_dir.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {ckpt_dir}" + (
                " (every process needs the run on a file system they share, at the same path)"
                if parallel.multi_process() else ""))
        seen = ckpt_lib.saved_files_digest(ckpt_dir) if parallel.multi_process() else {}
    check_processes_see_same_checkpoints(ckpt_dir, seen)
    run_dir = ckpt_dir.parent
    with parallel.all_or_none("reading the run's config"):
        saved = ckpt_lib.load_run_config(run_dir)
        cfg = config_lib.apply_overrides(saved, overrides or [])
        ckpt_lib.check_compatible(config_lib.to_dict(saved), cfg)
        mesh = parallel.make_mesh(cfg.train.num_devices)
    check_processes_agree(cfg)
    limit = any(item.split("=", 1)[0].strip() == "train.eval_batches" for item in overrides or [])
    with jax.set_mesh(mesh):
        params, meta, step = ckpt_lib.restore_params_with_meta(run_dir, step, mesh=mesh, warn=echo)
        # The hints that checkpoint was trained with (its meta, already read), else its logged l0.
        cfg = _agreed_hints(with_auto_hints(cfg, run_dir, step, meta=meta, echo=echo))
        echo(f"[twell] evaluating {ckpt_dir} (step {step}, config {cfg.name!r}, split {split!r})")
        with parallel.all_or_none("building the evaluation data"):
            data = split_data(run_dir_lib.with_saved_tokenizer(cfg, run_dir), split, limit_batches=limit,
                              data_builder=data_builder)
        check_processes_read_same_data(data)
        run_dir_lib.check_corpus_fingerprint(run_dir, data.source_fingerprint, echo)
        graphdef = abstract_graphdef(cfg.model, cfg.train.seed)
        result = evaluate_params(cfg, data, jax.jit(make_eval_step(cfg, graphdef)), params, mesh, step=step)
    result["step"] = step
    result["split"] = split
    result["dead_share_per_layer"] = meta["dead_share_per_layer"]
    return _summarise(result, cfg, echo)


def evaluate_model(cfg: ExperimentConfig, params: Any, *, split: str = "val", limit_batches: bool = False,
                   echo: Callable[[str], None] = print,
                   data_builder: Callable[[ExperimentConfig], DataSource] = build_experiment_data) -> dict[str, Any]:
    """Evaluate `params` (the plain dict of `model.split_model`, e.g. an imported Hugging Face
    model's) of the model `cfg.model` on `cfg.data`'s validation split or whole corpus."""
    with parallel.all_or_none("building the mesh"):
        mesh = parallel.make_mesh(cfg.train.num_devices)
    check_processes_agree(cfg)
    if parallel.multi_process():  # every process imported the whole model itself: the same weights
        checksums = json.dumps(ckpt_lib.tree_checksums(params), sort_keys=True)
        parallel.check_same("the weights (a digest of every array's checksum)",
                            hashlib.sha256(checksums.encode()).hexdigest()[:16],
                            "every process must import the same checkpoint (--hf on a file system they share, or "
                            "identical copies)")
    with jax.set_mesh(mesh):
        params = jax.device_put(params, parallel.replicated(mesh))
        echo(f"[twell] evaluating {cfg.name!r} on {cfg.data.source!r} (split {split!r})")
        with parallel.all_or_none("building the evaluation data"):
            data = split_data(cfg, split, limit_batches=limit_batches, data_builder=data_builder)
        check_processes_read_same_data(data)
        graphdef = abstract_graphdef(cfg.model, cfg.train.seed)
        result = evaluate_params(cfg, data, jax.jit(make_eval_step(cfg, graphdef)), params, mesh)
    result["step"] = None
    result["split"] = split
    return _summarise(result, cfg, echo)


__all__ = ["SPLITS", "WholeCorpus", "evaluate_checkpoint", "evaluate_model", "evaluate_params", "split_data"]
