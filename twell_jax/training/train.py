"""Training: the jit-compiled data-parallel step with gradient accumulation, and the `Trainer` loop.

All mesh plumbing lives in `Trainer.__init__` (one place): a 1-D "data" mesh over
`train.num_devices` devices (`twell_jax.training.parallel.make_mesh`), params / optimizer state replicated
(or FSDP-sharded with `train.fsdp`), the batch split over "data". The step is `jax.jit` with
NamedSharding in/out shardings and the state donated, compiled before the loop (its memory
analysis logged) and run under `jax.set_mesh(mesh)` so the sparse op can `shard_map` its kernels.

One optimizer step = `accum` micro-batches of `train.micro_batch` sequences per device, scanned with
`jax.lax.scan`, gradients averaged. The loop fetches a step's metrics once the next step is
dispatched (no host sync per step: the device always has the next step queued), in step order, so
the logs are those of a synchronous loop; a step whose end needs its state or its metrics (the
last one, evaluations, checkpoints, re-plans and plan trials, a `should_stop` hook, a signal or the
time limit) is finished before the next is dispatched. A step's time is the interval between two
completions. Each step's metrics pass the NaN/Inf guard (which names that step) and go to the run's
one `MetricsSink` and to the caller's `Hooks`.

A run directory holds one run (twell_jax/training/checkpoint.py): a new run refuses a non-empty directory
unless it holds a twell run and is told to overwrite; `resume=True` continues from the newest
intact checkpoint (or `step`), with the run's saved config as the reference, and is refused when
nothing is left to train or its last steps would run at learning rate 0. One process at a time
holds the directory (`checkpoint.RunLock`). SIGINT/SIGTERM finish the current step, checkpoint
and raise `TrainingInterrupted`; a second one aborts at once. A model whose parameters and
optimizer state cannot fit the device's memory is refused before the directory is touched
(`check_fits_memory`).

Which program the step compiles (the sparse op's "auto" hints, re-plans, the A/B of a sparse plan
against dense) is the op-planning policy of `planning.PlanController`; the trainer calls it at the
start, per step and at a step's boundary.

Several processes (jax.distributed, docs/parallel.md) train in one run directory on a shared file
system: process 0 reserves and locks it and alone writes its files; every process checks the run,
and one that fails stops them all (`parallel.all_or_none`); their configs, device counts and data
must be equal (`check_processes_agree`, `check_processes_read_same_data`); Orbax saves and restores
with every process. Each stop is agreed by a vote inside the step (`with_stop_vote`), so every
process stops after the same step.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from twell_jax.training import checkpoint as ckpt_lib
from twell_jax import config as config_lib
from twell_jax import ops
from twell_jax.training import parallel
from twell_jax.config import ExperimentConfig
from twell_jax.data import DataSource, build_experiment_data
from twell_jax.training.planning import PlanController, abstract_graphdef, measure_activity  # noqa: F401 (re-exported)
from twell_jax.training.loss import cross_entropy, l1_coefficient, total_loss
from twell_jax.training.metrics import MetricsSink, check_finite, device_memory_limit_bytes, device_peak_memory_bytes, to_python
from twell_jax.training.metrics import mfu, model_flops_per_token, peak_bf16_flops
from twell_jax.training.profiling import ProfileWindow
from twell_jax.model import apply_model, describe_execution, init_model, split_model
from twell_jax.training.optimizer import build_optimizer, learning_rate_schedule
from twell_jax.training.sparsity import dead_share, init_counters, position_profile, reinit_dead_rows, update_counters

logger = logging.getLogger(__name__)

TrainState = dict[str, Any]  # {"params", "opt_state", "step": int32, "since_active": int32[L, H]}

# optax.tree.norm on newer optax (global_norm is deprecated there), global_norm on older ones.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

# Metrics checked by the NaN/Inf guard, in the order they are reported.
GUARDED_METRICS = ("loss", "ce", "l1", "grad_norm", "l0_per_layer")


def check_run_name(name: str) -> None:
    """`name` labels a run and names its default directory: one plain path component."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ValueError(f"name={name!r}: a run name must be one plain directory name (no '/', '\\', "
                         "'..' or surrounding spaces); use --out to choose where the run goes")


def default_run_dir(cfg: ExperimentConfig, root: str | Path = "runs") -> Path:
    """A new, empty runs/<name>-<YYYYmmdd-HHMMSS>[-<n>], created here (mkdir is atomic: two runs
    started in the same second get different directories)."""
    check_run_name(cfg.name)
    base = Path(root) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ValueError(f"no free run directory name under {Path(root).absolute()} for {base.name}; pass --out")


def zero_lr_from(cfg: ExperimentConfig) -> int | None:
    """The first step index at which the learning rate is 0 for good (a cosine schedule to
    optim.min_lr_ratio = 0 ends there; `optimizer.learning_rate_schedule`), or None (never)."""
    if cfg.optim.schedule != "cosine" or cfg.optim.min_lr_ratio > 0:
        return None
    horizon = cfg.schedule_steps
    return max(horizon, min(cfg.optim.warmup_steps, horizon) + 1)


def check_schedule_covers_steps(cfg: ExperimentConfig, *, resume: bool) -> None:
    """Refuse a run whose last steps would train at learning rate 0 (past the end of a cosine
    schedule to 0: the parameters would not move), naming the field that fixes it."""
    zero = zero_lr_from(cfg)
    if zero is None or cfg.train.steps <= zero:
        return
    fix = (f"pass --set optim.schedule_steps={cfg.train.steps} to stretch the schedule to the new end (from the "
           "step resumed on, the learning rate follows the stretched cosine)" if resume else
           "set optim.schedule_steps >= train.steps (or 0: the schedule then ends at train.steps)")
    raise ValueError(f"train.steps={cfg.train.steps} runs past the end of the learning-rate schedule "
                     f"(optim.schedule_steps={cfg.schedule_steps}, a cosine to optim.min_lr_ratio=0): steps "
                     f"{zero + 1}-{cfg.train.steps} would train at learning rate 0 and change nothing; {fix}")


def check_resume_steps(cfg: ExperimentConfig, run_dir: Path, start_step: int) -> None:
    """A resume from `start_step` must have steps left to train (train.steps above it)."""
    if cfg.train.steps > start_step:
        return
    more = "optim.schedule_steps=N " if zero_lr_from(cfg) is not None else ""
    what = "is finished" if cfg.train.steps == start_step else f"is past train.steps={cfg.train.steps}"
    raise ValueError(f"--resume: the run in {run_dir.absolute()} {what} (its checkpoint is at step {start_step}); "
                     f"nothing to train and nothing was changed; to train further pass --set train.steps=N "
                     f"{more}with N > {start_step}")


def check_op_config(cfg: ExperimentConfig) -> None:
    """`model.ffn_op_config` holds valid SparseFFNConfig fields (checked by constructing one)."""
    try:
        ops.SparseFFNConfig(**cfg.model.ffn_op_config)
    except TypeError as err:
        known = ", ".join(f.name for f in dataclasses.fields(ops.SparseFFNConfig))
        raise ValueError(f"model.ffn_op_config={cfg.model.ffn_op_config!r}: {err} (known keys: {known})") from None
    except ValueError as err:
        raise ValueError(f"model.ffn_op_config={cfg.model.ffn_op_config!r}: {err}") from None


def check_vocab(cfg: ExperimentConfig, tokenizer_vocab: int, echo: Callable[[str], None]) -> None:
    """The tokenizer's `tokenizer_vocab` ids fit the embedding (model.vocab_size rows; an id past it
    would index outside the embedding), else a ValueError naming the field; and a warning when a
    BPE trained here learned fewer tokens than data.vocab_size asked for (a corpus too small for more
    merges): the embedding keeps its model.vocab_size rows, and the rows no token uses never train.
    The run's vocabulary is left as configured, so that a config means the same model whatever corpus
    it meets."""
    if tokenizer_vocab > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer_vocab} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}; raise model.vocab_size")
    if not cfg.data.is_synthetic and cfg.data.tokenizer == "bpe" and tokenizer_vocab < cfg.data.vocab_size:
        echo(f"[twell] warning: the BPE learned {tokenizer_vocab} tokens of the data.vocab_size="
             f"{cfg.data.vocab_size} asked for (the corpus is too small for more merges); the embedding keeps "
             f"model.vocab_size={cfg.model.vocab_size} rows, {cfg.model.vocab_size - tokenizer_vocab} of which no "
             f"token uses; --set data.vocab_size={tokenizer_vocab} model.vocab_size={tokenizer_vocab} fits it")


def schedule_warnings(cfg: ExperimentConfig) -> list[str]:
    """One line for each warm-up longer than the run: the learning rate's (clipped to the schedule, so
    the rate rises for the whole run and never decays) and the L1 coefficient's (never reached)."""
    steps, optim, sparsity = cfg.train.steps, cfg.optim, cfg.sparsity
    lines = []
    if optim.warmup_steps > steps:
        lines.append(f"[twell] warning: optim.warmup_steps={optim.warmup_steps} exceeds train.steps={steps}: the "
                     "learning rate rises for the whole run (the warm-up is clipped) and never decays; lower "
                     "optim.warmup_steps")
    if sparsity.l1_coef > 0 and max(sparsity.l1_warmup_start, sparsity.l1_warmup_end) > steps:
        lines.append(f"[twell] warning: the L1 warm-up (sparsity.l1_warmup_start={sparsity.l1_warmup_start}, "
                     f"l1_warmup_end={sparsity.l1_warmup_end}) ends after train.steps={steps}: the L1 coefficient "
                     f"never reaches sparsity.l1_coef={sparsity.l1_coef:g}; lower them")
    return lines


# Bytes a training run keeps per parameter besides the activations: the f32 master copy, AdamW's two
# f32 moments (optimizer.build_optimizer) and the f32 gradient the micro-batches accumulate into.
_PARAM_BYTES, _ADAM_BYTES, _GRAD_BYTES = 4, 8, 4


def memory_estimate(cfg: ExperimentConfig, num_devices: int) -> dict[str, int]:
    """A rough estimate of one device's memory for training `cfg` over `num_devices` devices, in bytes:
    the f32 parameters, AdamW's state and the gradients (sharded over the devices with train.fsdp,
    else a full copy on each), and the activations one micro-batch keeps for its backward without
    rematerialisation (per layer: the block's [tokens, d_model] tensors, the FFN's hidden
    activations, the attention probabilities; then the f32 logits and their softmax). XLA's own
    figure is the compiled step's memory analysis, which the run logs."""
    m, tc = cfg.model, cfg.train
    shards = num_devices if tc.fsdp else 1
    params = m.num_params()
    tokens = tc.micro_batch * cfg.seq_len
    act = 2 if m.compute_dtype == "bfloat16" else 4
    per_layer = tokens * (6 * m.d_model + 2 * m.kv_dim + (3 if m.kind.gated else 2) * m.d_ff) * act \
        + tc.micro_batch * m.n_heads * cfg.seq_len ** 2 * act
    estimate = {"parameters": -(-params * _PARAM_BYTES // shards),
                "optimizer_state": -(-params * _ADAM_BYTES // shards),
                "gradients": -(-params * _GRAD_BYTES // shards),
                "activations_per_micro_batch": m.n_layers * per_layer + 2 * tokens * m.vocab_size * 4}
    estimate["total"] = sum(estimate.values())
    return estimate


def device_memory_bytes(num_devices: int) -> tuple[int | None, str]:
    """(bytes one device may use, where the figure comes from): the GPU allocator's limit
    (memory_stats' bytes_limit), or on a CPU the host's available memory shared by the mesh's
    devices of this process; (None, why) where neither is known."""
    limit = device_memory_limit_bytes()
    platform = jax.local_devices()[0].platform
    if limit:
        return limit, f"{platform} device memory JAX may use"
    if platform != "cpu":
        return None, f"{platform}: memory not reported"
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None, "cpu: host memory not reported"
    local = max(1, min(num_devices, jax.local_device_count()))
    return available // local, "host memory available" + (f", shared by {local} CPU devices" if local > 1 else "")


def _bytes_text(value: int) -> str:
    return f"{value / 2**30:.3g} GiB" if value >= 2**30 else f"{value / 2**20:.3g} MiB"


def describe_memory(estimate: dict[str, int]) -> str:
    """The estimate in one line, naming what it counts."""
    return (f"~{_bytes_text(estimate['total'])} per device: parameters {_bytes_text(estimate['parameters'])} + "
            f"AdamW state {_bytes_text(estimate['optimizer_state'])} + gradients {_bytes_text(estimate['gradients'])} "
            f"(f32) + activations {_bytes_text(estimate['activations_per_micro_batch'])} per micro-batch "
            "(no remat; rough)")


def check_fits_memory(cfg: ExperimentConfig, num_devices: int) -> tuple[dict[str, int], int | None, str]:
    """(`memory_estimate`, the device memory, its source); a ValueError naming both when the
    parameters and optimizer state alone exceed the device memory. Only that clear case is refused:
    XLA's allocation would abort the process later with a C++ trace, after the run directory was made."""
    estimate = memory_estimate(cfg, num_devices)
    available, source = device_memory_bytes(num_devices)
    state = estimate["parameters"] + estimate["optimizer_state"]
    if available is not None and state > available:
        m = cfg.model
        raise ValueError(f"the model cannot fit: {m.num_params():.3g} parameters (model.d_model={m.d_model}, "
                         f"n_layers={m.n_layers}, d_ff={m.d_ff}, vocab_size={m.vocab_size}) need "
                         f"{_bytes_text(state)} per device for the f32 parameters and AdamW state alone "
                         f"(~{_bytes_text(estimate['total'])} with gradients and activations), but a device has "
                         f"{_bytes_text(available)} ({source}); shrink the model"
                         + (" or shard it with train.fsdp=true" if num_devices > 1 and not cfg.train.fsdp else ""))
    return estimate, available, source


def check_processes_agree(cfg: ExperimentConfig) -> None:
    """A multi-process run: every process must have the same number of devices (each loads an equal
    share of the batch) and the same config (the same program, the same stop); otherwise every
    process raises the same ValueError, naming the processes and fields that differ."""
    if not parallel.multi_process():
        return
    parallel.check_same("devices per process", jax.local_device_count(),
                        "start every process with the same number of devices (the batch is split evenly "
                        "over the processes)")
    lead = parallel.lead_value("process 0's config", lambda: config_lib.to_dict(cfg))
    mine = "; ".join(f"{path} {new!r} (process 0: {old!r})"
                     for path, old, new in config_lib.diff(lead, config_lib.to_dict(cfg)))
    differ = [f"process {p}: {text}" for p, text in enumerate(parallel.gather("the config", mine)) if text]
    if differ:
        raise ValueError(f"the processes were started with different configs ({'; '.join(differ)}); start every "
                         "process with the same command (--config, --set, --out, --resume)")


def check_processes_read_same_data(data: DataSource) -> None:
    """A multi-process run: every process must read the same corpus with the same tokenizer (each
    reads its slice of the same shuffled order); otherwise every process raises the same ValueError."""
    if not parallel.multi_process():
        return
    from twell_jax.data.tokenizer import file_sha256  # noqa: PLC0415

    tokenizer = file_sha256(data.tokenizer_json_path)[:16] if data.tokenizer_json_path else None
    parallel.check_same("the data", {"corpus": str(data.source_fingerprint)[:24], "vocab": data.vocab_size,
                                     "tokenizer": tokenizer},
                        "every process must read the same corpus and tokenizer (data.source and data.tokenizer "
                        "on a file system they share, or identical copies)")


def checked_run_config(cfg: ExperimentConfig, run_dir: Path | None, *, resume: bool,
                       overwrite: bool) -> tuple[ExperimentConfig, ExperimentConfig | None]:
    """The checks a run makes before it touches anything (what `twell train --dry-run` runs too):
    (the config to train with, its schedule fixed; the saved config of the run resumed, or None).
    A resume needs a checkpoint in `run_dir` and a compatible config; a new run a `run_dir` it may
    use (`checkpoint.check_new_run_dir`; None: a new runs/<name>-<time>)."""
    check_op_config(cfg)
    check_run_name(cfg.name)
    if not resume:
        cfg = config_lib.with_fixed_schedule(cfg)
        check_schedule_covers_steps(cfg, resume=False)
        if run_dir is not None:
            ckpt_lib.check_new_run_dir(run_dir, overwrite=overwrite)  # raises, naming the directory
        return cfg, None
    if run_dir is None:
        raise ValueError("--resume needs --out DIR (the run directory to continue)")
    ckpt_dir = run_dir / ckpt_lib.CHECKPOINT_SUBDIR
    if not ckpt_lib.has_steps(ckpt_dir):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir.absolute()} (is --out the run "
                                "directory of the run to continue?)")
    saved = ckpt_lib.load_run_config(run_dir)
    if not cfg.optim.schedule_steps:  # keep the run's schedule unless one is asked for
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_steps=saved.schedule_steps))
    ckpt_lib.check_compatible(config_lib.to_dict(saved), cfg)
    check_schedule_covers_steps(cfg, resume=True)
    return cfg, saved


def dead_window(cfg: ExperimentConfig) -> int:
    """Tokens without firing after which a neuron counts as dead (default: one optimizer step)."""
    return cfg.sparsity.dead_window_tokens or cfg.train.global_batch * cfg.seq_len


def tracks_neurons(cfg: ExperimentConfig) -> bool:
    """True when the step updates the per-neuron activity counters (dead neurons, position profile):
    asked for, and meaningful only for exactly sparse (ReLU) activations."""
    return cfg.sparsity.track_neurons and cfg.model.is_relu_family


def dead_share_per_layer(cfg: ExperimentConfig, since_LxH: Any) -> list[float] | None:
    """Each layer's share of dead neurons from the counters (`sparsity.dead_share`), or None when the
    run does not track neurons (its counters never move: a share of 0 would be a false claim)."""
    if not tracks_neurons(cfg):
        return None
    return [float(v) for v in np.asarray(jax.device_get(dead_share(since_LxH, dead_window(cfg))))]


def accumulate_gradients(cfg: ExperimentConfig, graphdef: nnx.GraphDef, params: Any, tokens_BxT: jax.Array,
                         since_LxH: jax.Array, l1_coef: jax.Array, accum_steps: int) -> tuple[Any, jax.Array, dict]:
    """Mean gradient of the loss over `accum_steps` equal micro-batches of `tokens_BxT` (a lax.scan).

    Returns (grads, updated since_active counters, per-micro-batch metrics stacked on axis 0).
    """
    track = tracks_neurons(cfg)
    rows, width = tokens_BxT.shape
    micro_rows = rows // accum_steps
    micro_tokens = micro_rows * (width - 1)
    # Row r = i * accum + a goes to micro-batch a: each device's contiguous block of rows splits
    # into its own micro-batches, so the reshape needs no cross-device data movement.
    micro_AxMxT = tokens_BxT.reshape(micro_rows, accum_steps, width).swapaxes(0, 1)

    def loss_fn(p: Any, tokens_MxT: jax.Array) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        logits, aux = apply_model(graphdef, p, tokens_MxT[:, :-1], track_neurons=track)
        ce, _ = cross_entropy(logits, tokens_MxT[:, 1:])
        return total_loss(ce, aux["l1"], l1_coef), (ce, aux)

    def micro_step(carry: tuple, tokens_MxT: jax.Array) -> tuple[tuple, dict]:
        grad_sum, since = carry
        (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_MxT)
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        if track:
            since = update_counters(since, aux["neuron_active_count"], micro_tokens)
        out = {"loss": loss, "ce": ce, "l1_per_layer": aux["l1"], "l0_per_layer": aux["l0"],
               "tile_overflow_per_layer": aux["tile_overflow"], "row_overflow_per_layer": aux["row_overflow"],
               "dense_fallback_per_layer": aux["dense_fallback"],
               "backward_tail_rows_per_layer": aux["backward_tail_rows"],
               "backward_hot_neurons_per_layer": aux["backward_hot_neurons"]}
        if track:
            out["position_active"] = aux["position_active"]
            out.update({f"{key}_per_layer": aux[key] for key in ops.TAIL_SHARE_KEYS})
        return (grad_sum, since), out

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grad_sum, since), per_micro = jax.lax.scan(micro_step, (zeros, since_LxH), micro_AxMxT)
    return jax.tree.map(lambda g: g / accum_steps, grad_sum), since, per_micro


def make_train_step(cfg: ExperimentConfig, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    accum_steps: int) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict]]:
    """The pure step function (state, batch) -> (state, metrics); jit it with shardings."""
    track = tracks_neurons(cfg)
    lr_schedule = learning_rate_schedule(cfg.optim, cfg.schedule_steps)
    window = dead_window(cfg)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        l1_coef = l1_coefficient(cfg.sparsity, state["step"])
        params = state["params"]
        grads, since, per_micro = accumulate_gradients(cfg, graphdef, params, batch["tokens"],
                                                       state["since_active"], l1_coef, accum_steps)
        grad_norm = _global_norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        step = state["step"] + 1
        reinit_count = jnp.zeros((), jnp.int32)
        if cfg.sparsity.reinit_dead:
            def do_reinit(operands: tuple) -> tuple:
                p, o, s = operands
                key = jax.random.fold_in(jax.random.key(cfg.train.seed), step)
                return reinit_dead_rows(p, o, s, cfg=cfg.model, window_tokens=window, key=key)

            def skip(operands: tuple) -> tuple:
                return (*operands, jnp.zeros((), jnp.int32))

            params, opt_state, since, reinit_count = jax.lax.cond(
                step % cfg.sparsity.reinit_every == 0, do_reinit, skip, (params, opt_state, since))

        mean = lambda x: jnp.mean(x, axis=0)  # noqa: E731 (average over micro-batches)
        total = lambda x: jnp.sum(x, axis=0)  # noqa: E731
        metrics = {
            "loss": mean(per_micro["loss"]), "ce": mean(per_micro["ce"]),
            "l1": jnp.mean(per_micro["l1_per_layer"]), "l1_coef": l1_coef,
            "lr": lr_schedule(state["step"]), "grad_norm": grad_norm,
            "l1_per_layer": mean(per_micro["l1_per_layer"]), "l0_per_layer": mean(per_micro["l0_per_layer"]),
            "tile_overflow_per_layer": total(per_micro["tile_overflow_per_layer"]),
            "row_overflow_per_layer": total(per_micro["row_overflow_per_layer"]),
            "dense_fallback_per_layer": total(per_micro["dense_fallback_per_layer"]),
            # The sparse backward's dense tails (mean per micro-batch; -1: not counted, ops doc).
            "backward_tail_rows_per_layer": mean(per_micro["backward_tail_rows_per_layer"].astype(jnp.float32)),
            "backward_hot_neurons_per_layer": mean(per_micro["backward_hot_neurons_per_layer"].astype(jnp.float32)),
        }
        if track:
            metrics["dead_share_per_layer"] = dead_share(since, window)
            metrics["position_profile"] = position_profile(mean(per_micro["position_active"]),
                                                           cfg.sparsity.position_buckets)
            # The sparse backward's expected dense tails, for any plan (the "auto" tail hints).
            metrics.update({f"{key}_per_layer": mean(per_micro[f"{key}_per_layer"]) for key in ops.TAIL_SHARE_KEYS})
        if cfg.sparsity.reinit_dead:
            metrics["reinit_count"] = reinit_count
        new_state = {"params": params, "opt_state": opt_state, "step": step, "since_active": since}
        return new_state, metrics

    return train_step


# A multi-process run's stop vote (`with_stop_vote`): what a process may stop for, in the order that
# wins when several processes vote differently, and its key in the batch and the metrics.
STOP_REASONS = ("SIGINT", "SIGTERM", "time_limit")
STOP_VOTE = "stop_vote"


def with_stop_vote(train_step: Callable) -> Callable:
    """`train_step` for a multi-process run: the batch also holds each device's stop vote
    (bool[devices, len(STOP_REASONS)], each process's rows its own) and the metrics say which reasons
    any process voted for. A signal or the time limit reaches each process at its own moment, and a
    process that stops alone leaves the others waiting in a collective. The vote rides in the step's
    program (one small all-reduce beside the gradients', no host sync of its own) and every process
    reads the same answer with the step's metrics, so all stop after the same step."""

    def voting_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        state, metrics = train_step(state, {key: value for key, value in batch.items() if key != STOP_VOTE})
        return state, {**metrics, STOP_VOTE: jnp.any(batch[STOP_VOTE], axis=0)}

    return voting_step


def make_eval_step(cfg: ExperimentConfig, graphdef: nnx.GraphDef) -> Callable:
    """(params, tokens_BxT) -> sums over the batch of CE and per-layer active neurons, and the token count."""

    def eval_step(params: Any, tokens_BxT: jax.Array) -> dict[str, jax.Array]:
        logits, aux = apply_model(graphdef, params, tokens_BxT[:, :-1])
        ce_BxS = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxT[:, 1:])
        tokens = jnp.float32(ce_BxS.size)
        return {"ce_sum": jnp.sum(ce_BxS), "tokens": tokens, "l0_sum_per_layer": aux["l0"] * tokens}

    return eval_step


@dataclasses.dataclass
class TrainResult:
    """What a finished (or stopped) run produced."""

    run_dir: Path
    history: list[dict[str, Any]]  # one compact record per optimizer step (scalars, layer means)
    summary: dict[str, Any]  # final validation metrics, sparsity, speed, memory
    state: TrainState | None = None
    last_metrics: dict[str, Any] | None = None  # the full record of the last step (per-layer lists too)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Extension points of `Trainer.run` (every callback is optional)."""

    on_step: Callable[[dict[str, Any]], None] | None = None  # each step's full record, as logged
    on_eval: Callable[[int, dict[str, Any]], None] | None = None  # (step, validation metrics)
    on_checkpoint: Callable[[int, Path], None] | None = None  # (step, checkpoint directory) after a save
    # After each step, given its record: a reason (non-empty text) ends the run there, which is then
    # saved and evaluated like a run that reached train.time_limit_s (e.g. "trained until sparse").
    should_stop: Callable[[dict[str, Any]], str | None] | None = None
    # Save a checkpoint at the end (and on SIGINT/SIGTERM). False for throw-away runs such as
    # benchmarks, whose optimizer state would cost seconds and gigabytes to write.
    save_final: bool = True


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped the run after a step; its message says how to resume."""

    def __init__(self, signal_name: str, step: int, run_dir: Path, saved: bool):
        self.signal_name, self.step, self.run_dir, self.saved = signal_name, step, run_dir, saved
        how = (f"checkpoint saved; continue with: twell train --out {run_dir} --resume" if saved
               else "no checkpoint saved (Hooks.save_final=False)")
        super().__init__(f"{signal_name} received: stopped after step {step}; {how}")


class _StopSignals:
    """Within the block, SIGINT/SIGTERM set a flag (the loop stops after the current step) instead of
    killing the process, acknowledged at once on stderr; a second one aborts: `on_abort` (the
    trainer gives up its run directory's lock), then the process exits with 128 + the signal's number.

    Python runs a signal handler only between bytecodes of the main thread, never while that thread
    is inside a long native call such as XLA compiling the step, so a handler alone would say nothing
    until the compile ends and could not abort it. The signals are also written to a wakeup pipe
    (`signal.set_wakeup_fd`) that a watcher thread reads and acts on (XLA releases the GIL while it
    compiles). Only the main thread can install handlers; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_abort: Callable[[], None] | None = None) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._on_abort = on_abort
        self._pipe: tuple[int, int] | None = None  # (read, write) ends of the wakeup pipe
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._watcher is not None:
            return  # the watcher thread has this signal from the wakeup pipe and acts on it
        if self.received is not None:  # a second signal: give up the graceful stop, die as asked
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self._signalled(signum)

    def _signalled(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            again = "Ctrl-C" if signum == signal.SIGINT else name
            _to_stderr(f"[twell] {name} received: stopping after this step / compile; "
                       f"{again} again to abort")
            return
        _to_stderr(f"[twell] {name} received again: aborting now (no checkpoint of the steps since the last one)")
        try:
            if self._on_abort is not None:
                self._on_abort()
            sys.stdout.flush()  # os._exit skips the interpreter's own flush
        finally:
            # os._exit: the main thread may be inside XLA, where no exception would reach it.
            os._exit(128 + signum)

    def _watch(self, read_fd: int) -> None:
        numbers = {int(sig) for sig in self.SIGNALS}
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            for byte in data:
                if byte == 0:  # __exit__'s sentinel: the block is over
                    return
                if byte in numbers:
                    self._signalled(byte)
            if not data:
                return

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            read_fd, write_fd = os.pipe()
        except OSError:
            return self  # the handlers alone: the stop is acknowledged once the main thread runs Python
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="twell-stop-signals", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            read_fd, write_fd = self._pipe
            try:
                os.write(write_fd, b"\0")
            except OSError:
                pass
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            self._watcher, self._pipe = None, None
            os.close(read_fd)
            os.close(write_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _to_stderr(line: str) -> None:
    """`line` on stderr now (a signal's acknowledgement, from the watcher thread)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream: nobody left to tell
        pass


class Trainer:
    """Builds mesh, model, optimizer, data and checkpoint store for one run; `run()` trains.

    resume=True continues the run in `run_dir`: `cfg` may differ from the run's saved config only in
    config.RESUMABLE_FIELDS; `resume_step` picks a checkpoint (default: the newest intact one); it
    is refused when its last steps would train at learning rate 0 (`check_schedule_covers_steps`)
    or nothing is left to train (`check_resume_steps`). A new run needs an empty (or missing)
    `run_dir`, or `overwrite=True` and a directory holding a twell run (checkpoint.check_new_run_dir).
    From construction to the end of `run()` the trainer holds the directory's lock (`release()`
    gives it up without running).
    """

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, *, resume: bool = False,
                 resume_step: int | None = None, overwrite: bool = False,
                 data_builder: Callable[[ExperimentConfig], DataSource] = build_experiment_data,
                 echo: Callable[[str], None] = print, hooks: Hooks | None = None):
        self._created_at = time.perf_counter()  # the start-up report counts from here
        self.startup: dict[str, float] = {}  # seconds of each start-up phase (`_report_startup`)
        self.first_step_done_s: float | None = None  # seconds from the creation to the first step done
        self.run_dir = Path(run_dir)
        self.resume, self.resume_step, self.overwrite = resume, resume_step, overwrite
        self.echo = echo
        self.hooks = hooks or Hooks()
        self.store = None
        self.step_builds = 0  # how many times the train step was compiled in this process
        # A multi-process run: a check that fails on one process stops every process (all_or_none).
        with parallel.all_or_none("checking the run"):
            cfg, self._saved_cfg = checked_run_config(cfg, self.run_dir, resume=resume, overwrite=overwrite)
            # A model that cannot fit is refused before the run directory is made (XLA would abort the process).
            check_fits_memory(cfg, parallel.mesh_size(parallel.make_mesh(cfg.train.num_devices)))
        check_processes_agree(cfg)
        # One process at a time in a run directory (multi-process runs: process 0 holds it for all).
        created = not self.run_dir.exists()
        self._lock = None
        try:
            with parallel.all_or_none("locking the run directory"):
                self._lock = ckpt_lib.RunLock(self.run_dir, warn=echo) if parallel.is_lead() else None
            ckpt_lib.check_shared_run_dir(self.run_dir, self._lock)
            with parallel.all_or_none("preparing the run"):
                self._build(cfg, resume, overwrite, data_builder)
        except BaseException:
            self.release()
            if created and parallel.is_lead() and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()  # a failed command leaves nothing behind
            raise

    def release(self) -> None:
        """Give up the run directory's lock (run() does at its end; idempotent)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    def _build(self, cfg: ExperimentConfig, resume: bool, overwrite: bool,
               data_builder: Callable[[ExperimentConfig], DataSource]) -> None:
        """Mesh, data, abstract state, optimizer; then (everything checked) the run directory."""
        echo = self.echo
        self.cfg = cfg
        tc = cfg.train
        # ---- mesh plumbing (the one place that knows about devices)
        self.mesh = parallel.make_mesh(tc.num_devices)
        self.num_devices = parallel.mesh_size(self.mesh)
        self.accum_steps = parallel.check_batch_layout(tc.global_batch, tc.micro_batch, self.num_devices)
        if tc.eval_batch_size % self.num_devices:
            raise ValueError(f"train.eval_batch_size={tc.eval_batch_size} must be divisible by the "
                             f"{self.num_devices} devices")
        self.batch_sharding = parallel.batch_sharding(self.mesh)
        self.replicated = parallel.replicated(self.mesh)
        # MFU: the model FLOPs of a token over the device's peak bf16 FLOP/s (None: a device kind without a
        # figure, e.g. a CPU, or a model that does not compute in bf16: no MFU is logged).
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.seq_len)
        self.peak_flops = (peak_bf16_flops(str(getattr(jax.devices()[0], "device_kind", "")))
                           if cfg.model.compute_dtype == "bfloat16" else None)

        t0 = time.perf_counter()
        self.data = data_builder(with_saved_tokenizer(cfg, self.run_dir) if resume else cfg)
        self.startup["data"] = time.perf_counter() - t0
        check_vocab(cfg, self.data.vocab_size, echo)
        check_processes_read_same_data(self.data)
        if resume:
            ckpt_lib.check_corpus_fingerprint(self.run_dir, self.data, echo)

        abstract_model = nnx.eval_shape(lambda: init_model(cfg.model, tc.seed))
        abstract_params = nnx.to_pure_dict(nnx.split(abstract_model)[1])
        self.optimizer = build_optimizer(cfg.optim, cfg.schedule_steps)
        abstract_train_state = {
            "params": abstract_params,
            "opt_state": jax.eval_shape(self.optimizer.init, abstract_params),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "since_active": jax.ShapeDtypeStruct((cfg.model.n_layers, cfg.model.d_ff), jnp.int32),
        }
        self.state_shardings = parallel.param_shardings(self.mesh, abstract_train_state, fsdp=tc.fsdp)
        self.abstract_state = abstract_train_state
        # The op-planning policy ("auto" hints, re-plans, the plan trial): planning.py.
        self.planner = PlanController(cfg, num_devices=self.num_devices, mesh=self.mesh, data=self.data,
                                      compile_step=self._compile, track_tails=tracks_neurons(cfg))
        # Everything that can be checked has been: only now may a new run take over the directory
        # (process 0 alone writes the run's files; the others use them).
        if not resume and parallel.is_lead():
            ckpt_lib.prepare_new_run_dir(self.run_dir, overwrite=overwrite)
            if self.data.tokenizer_json_path:
                ckpt_lib.save_tokenizer(self.run_dir, self.data.tokenizer_json_path)
            ckpt_lib.save_corpus_fingerprint(self.run_dir, self.data)
            ckpt_lib.atomic_write_text(self.run_dir / ckpt_lib.CONFIG_FILE, config_lib.to_json(cfg))
        # Orbax opens the checkpoints on every process together, after --overwrite removed the old ones.
        parallel.barrier("preparing the run directory")
        self.store = ckpt_lib.CheckpointStore(self.run_dir / ckpt_lib.CHECKPOINT_SUBDIR,
                                              max_to_keep=tc.keep_checkpoints)

    # ------------------------------------------------------------------ state
    def init_state(self) -> TrainState:
        cfg = self.cfg

        def init() -> TrainState:
            params = split_model(init_model(cfg.model, cfg.train.seed))[1]
            return {"params": params, "opt_state": self.optimizer.init(params),
                    "step": jnp.zeros((), jnp.int32), "since_active": init_counters(cfg.model)}

        return jax.jit(init, out_shardings=self.state_shardings)()

    def restore_state(self) -> tuple[TrainState, dict[str, Any]]:
        """The verified state of checkpoint `resume_step` (default: the newest intact one); newer
        checkpoints are moved aside so that this run's next saves become the latest."""
        shardings = self.state_shardings
        targets = {
            ckpt_lib.PARAMS_ITEM: ckpt_lib.abstract_with_shardings(self.abstract_state["params"], shardings["params"]),
            ckpt_lib.TRAIN_ITEM: ckpt_lib.abstract_with_shardings(
                {k: v for k, v in self.abstract_state.items() if k != "params"},
                {k: v for k, v in shardings.items() if k != "params"}),
        }
        items, meta, step = self.store.restore_verified(targets, self.resume_step, warn=self.echo)
        # Only now is the step resumed from known (a damaged newest checkpoint falls back): a run
        # with nothing left to train stops here, with nothing in its directory changed.
        check_resume_steps(self.cfg, self.run_dir, step)
        saved = self._saved_cfg
        if self.cfg.schedule_steps != saved.schedule_steps:
            old_lr, new_lr = (float(learning_rate_schedule(c.optim, c.schedule_steps)(step)) for c in (saved, self.cfg))
            self.echo(f"[twell] learning-rate schedule re-planned: optim.schedule_steps {saved.schedule_steps} -> "
                      f"{self.cfg.schedule_steps}; learning rate of step {step + 1}: {old_lr:.3g} -> {new_lr:.3g}")
        if parallel.is_lead():  # a multi-process run: process 0 writes the run's files
            ckpt_lib.atomic_write_text(self.run_dir / ckpt_lib.CONFIG_FILE, config_lib.to_json(self.cfg))
        for moved in self.store.quarantine_after(step, self.run_dir):
            self.echo(f"[twell] warning: continuing from step {step}: newer checkpoint moved to {moved}")
        return {"params": items[ckpt_lib.PARAMS_ITEM], **items[ckpt_lib.TRAIN_ITEM]}, meta

    def save(self, state: TrainState, history: list[dict[str, Any]]) -> None:
        # The config with the "auto" hints in use: what evaluation / inference of this step should run.
        meta = {"config": config_lib.to_dict(self.planner.step_cfg),
                "data_iter": _json_ready(self.data.train_iter.get_state()),
                "step": int(state["step"]), "history": history, **self.planner.checkpoint_fields(),
                "dead_share_per_layer": dead_share_per_layer(self.cfg, state["since_active"])}
        self.store.save(int(state["step"]), state["params"],
                        {k: v for k, v in state.items() if k != "params"}, meta)
        if self.hooks.on_checkpoint is not None:
            self.hooks.on_checkpoint(int(state["step"]), self.store.step_dir(int(state["step"])))

    def evaluate(self, eval_fn: Callable, params: Any, step: int) -> dict[str, Any]:
        return evaluate_params(self.cfg, self.data, eval_fn, params, self.mesh, step=step)

    # ------------------------------------------------------------------ loop
    def run(self, *, stop_after_step: int | None = None) -> TrainResult:
        """Train to `train.steps` (or stop after `stop_after_step`, as if killed, for tests); the
        run directory's lock is released at the end, however the run ends."""
        try:
            return self._run(stop_after_step)
        finally:
            self.release()

    def _run(self, stop_after_step: int | None) -> TrainResult:
        tc = self.cfg.train
        self._describe(tc.global_batch * self.cfg.seq_len)
        with jax.set_mesh(self.mesh), _StopSignals(on_abort=self.release) as signals:
            t0 = time.perf_counter()
            state, history = self._start_state()
            start_step = int(jax.block_until_ready(state["step"]))
            self.startup["restore" if self.resume else "init"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            loop = _Loop(history=history, compile_s=self.planner.start(state, resumed=self.resume, echo=self.echo),
                         end_step=tc.steps if stop_after_step is None else min(tc.steps, stop_after_step))
            self.startup["train step compile"] = loop.compile_s
            self.startup["hints"] = time.perf_counter() - t0 - loop.compile_s
            eval_fn = self._eval_fn()
            sink = MetricsSink(self.run_dir, tensorboard=tc.tensorboard, total_steps=tc.steps,
                               start_step=start_step, progress_bar=tc.progress_bar, echo=self.echo,
                               files=parallel.is_lead(), wandb_project=tc.wandb_project,
                               config=config_lib.to_dict(self.cfg))
            self.echo(f"[twell] metrics: {sink.jsonl_path}"
                      + (f", TensorBoard: {self.run_dir / 'tensorboard'}" if tc.tensorboard else "")
                      + (f", W&B project {tc.wandb_project!r}" if tc.wandb_project else ""))
            self.profile = ProfileWindow(tc.profile_window, self.run_dir, start_step=start_step,
                                         enabled=parallel.is_lead())
            self.planner.maybe_start_trial(start_step, sink.message)
            try:
                pending = None  # the step dispatched last whose metrics are not fetched yet
                loop.mark = loop.start = time.perf_counter()
                for step_no in range(start_step + 1, loop.end_step + 1):
                    runner, plan, compile_s = self.planner.runner(state)
                    if compile_s:
                        loop.compile_s += compile_s
                        loop.mark = time.perf_counter()  # compilation is not step time
                    self.profile.before_step(step_no, sink.message)
                    batch = parallel.host_to_global(self._next_batch(loop, signals), self.mesh)
                    first_dispatch = time.perf_counter()
                    state, device_metrics = runner(state, batch)
                    if step_no == start_step + 1:
                        self._report_startup(state, first_dispatch, sink.message)
                    if pending is not None:  # the previous step's metrics, fetched while this one runs
                        self._finish_step(loop, sink, *pending)
                    pending = (step_no, device_metrics, plan)
                    if not self._at_boundary(loop, step_no, signals):
                        continue
                    self._finish_step(loop, sink, *pending)
                    pending = None
                    self.profile.after_step(step_no, sink.message)
                    changed, compile_s = self.planner.replan(step_no, loop.end_step, state, sink.message)
                    if changed:
                        loop.compile_s += compile_s
                        eval_fn = self._eval_fn()
                    self._boundary(loop, sink, eval_fn, state, step_no, signals)
                    if loop.stop_reason:
                        break
                    loop.mark = time.perf_counter()  # evaluations and saves are not step time
                self._end(loop, sink, eval_fn, state)
            finally:
                self.profile.stop()
                sink.close()
            summary = self._summary(state, loop)
            if parallel.is_lead():  # a multi-process run: process 0 writes the run's files
                ckpt_lib.atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            self.echo(f"[twell] summary: {self.run_dir / 'summary.json'}")
        return TrainResult(run_dir=self.run_dir, history=loop.history, summary=summary, state=state,
                           last_metrics=loop.last_record or None)

    def _report_startup(self, state: TrainState, dispatched: float, message: Callable[[str], None]) -> None:
        """Once, after the first step: where the time from the Trainer's creation to the end of
        the first step went (the rest: building the mesh, the optimizer and the run directory)."""
        jax.block_until_ready(state["step"])
        self.startup["first step"] = time.perf_counter() - dispatched
        total = time.perf_counter() - self._created_at
        phases = {name: seconds for name, seconds in self.startup.items() if seconds >= 0.05}
        rest = total - sum(self.startup.values())
        self.first_step_done_s = total
        message("[twell] start-up: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phases.items())
                + f", other {max(rest, 0.0):.1f}s; first step done {total:.1f}s after start")

    def _start_state(self) -> tuple[TrainState, list[dict[str, Any]]]:
        """The state to train from (restored, with the data iterator's position, or initialised)
        and the run's history so far."""
        if not self.resume:
            return self.init_state(), []
        state, meta = self.restore_state()
        self.data.train_iter.set_state(_from_json_ready(meta["data_iter"]))
        self.echo(f"[twell] resumed from step {int(state['step'])} ({self.store.directory})")
        return state, meta.get("history", [])

    def _eval_fn(self) -> Callable:
        step_cfg = self.planner.step_cfg
        return jax.jit(make_eval_step(step_cfg, abstract_graphdef(step_cfg.model, self.cfg.train.seed)))

    def _at_boundary(self, loop: "_Loop", step_no: int, signals: "_StopSignals") -> bool:
        """True when step `step_no` is finished before the next is dispatched: something at its end
        needs its state or its metrics (the last step, an evaluation, a checkpoint, a re-plan or a
        trial step, a should_stop hook) or the run stops after it (a signal, the time limit).
        Other steps' metrics are fetched once the next step is dispatched: no host sync per step."""
        tc = self.cfg.train
        return (step_no == loop.end_step or self.planner.needs_sync(step_no, loop.end_step)
                or self.profile.needs_sync(step_no) or bool(tc.eval_every and step_no % tc.eval_every == 0)
                or bool(tc.checkpoint_every and step_no % tc.checkpoint_every == 0)
                or self.hooks.should_stop is not None or self._stopping(loop, signals) is not None)

    def _local_stop(self, loop: "_Loop", signals: "_StopSignals") -> str | None:
        """What this process alone would stop for now: a signal's name, "time_limit" or None."""
        tc = self.cfg.train
        if signals.received:
            return signals.received
        if tc.time_limit_s and time.perf_counter() - loop.start >= tc.time_limit_s:
            return "time_limit"
        return None

    def _stopping(self, loop: "_Loop", signals: "_StopSignals") -> str | None:
        """Why the run stops after the step in hand (a signal's name, "time_limit"), or None. In a
        multi-process run a process's own reasons only go into its stop vote (`_next_batch`): the
        answer is what the processes agreed on in the last step fetched, the same on every process,
        so that all stop after the same step and save the same checkpoint."""
        return loop.agreed_stop if parallel.multi_process() else self._local_stop(loop, signals)

    def _next_batch(self, loop: "_Loop", signals: "_StopSignals") -> dict[str, Any]:
        """This process's rows of the next batch; in a multi-process run with its stop vote too, one
        row per local device (`with_stop_vote`)."""
        local = next(self.data.train_iter)
        if not parallel.multi_process():
            return local
        reason = self._local_stop(loop, signals)
        vote = np.tile(np.array([reason == name for name in STOP_REASONS]), (jax.local_device_count(), 1))
        return {**local, STOP_VOTE: vote}

    def _hook_stop(self, loop: "_Loop") -> str | None:
        """The should_stop hook's reason to stop after this step; process 0's in a multi-process run."""
        if not parallel.multi_process():
            return self.hooks.should_stop(loop.last_record)
        return parallel.lead_value("the should_stop hook's answer",
                                   lambda: self.hooks.should_stop(loop.last_record) or None)

    def _finish_step(self, loop: "_Loop", sink: MetricsSink, step_no: int, device_metrics: dict,
                     plan: str | None) -> None:
        """Fetch step `step_no`'s metrics (waiting for that step only), check them (the NaN/Inf
        guard names this step), time the step, log it and hand it to the hooks."""
        host = to_python(jax.device_get(device_metrics))
        vote = host.pop(STOP_VOTE, None)  # a multi-process run: what any process voted to stop for
        if vote is not None and loop.agreed_stop is None:
            loop.agreed_stop = next((name for name, voted in zip(STOP_REASONS, vote) if voted), None)
        now = time.perf_counter()
        loop.step_times.append(now - loop.mark)
        loop.mark = now
        check_finite(step_no, host, GUARDED_METRICS)
        self.planner.timed(step_no, loop.step_times[-1], sink.message)
        logged = step_no % self.cfg.train.log_every == 0 or step_no == loop.end_step
        loop.last_record = self._record(step_no, host, loop.step_times[-1], memory=logged)
        loop.last_record.update(self.planner.record_fields(plan))
        loop.history.append(compact_record(loop.last_record))
        sink.progress(step_no, {"loss": host["loss"], "ce": host["ce"], "l0": float(np.mean(host["l0_per_layer"])),
                                "tok/s": int(loop.last_record["tokens_per_s"])})
        if logged:
            sink.write(loop.last_record)
        if self.hooks.on_step is not None:
            self.hooks.on_step(loop.last_record)
        self.planner.observe(host)

    def _boundary(self, loop: "_Loop", sink: MetricsSink, eval_fn: Callable, state: TrainState, step_no: int,
                  signals: "_StopSignals") -> None:
        """After a finished step: evaluate and checkpoint on their cadence, then decide whether to
        stop (a signal, a should_stop hook, the time limit)."""
        tc, hooks = self.cfg.train, self.hooks
        if tc.eval_every and step_no % tc.eval_every == 0 and step_no != tc.steps:
            loop.last_val = self._eval_and_log(sink, eval_fn, state, step_no)
        if tc.checkpoint_every and step_no % tc.checkpoint_every == 0 and step_no != loop.end_step:
            self.save(state, loop.history)
            sink.message(f"[twell] step {step_no}: checkpoint -> {self.store.directory}")
        stop = self._stopping(loop, signals)
        if stop is not None and stop != "time_limit":
            loop.stop_reason = stop
        elif hooks.should_stop is not None and step_no < loop.end_step and (why := self._hook_stop(loop)):
            loop.stop_reason = "hook"
            sink.message(f"[twell] step {step_no}: stopping ({why})")
        elif stop == "time_limit" and step_no < loop.end_step:
            loop.stop_reason = "time_limit"
            sink.message(f"[twell] step {step_no}: train.time_limit_s={tc.time_limit_s:g} reached, "
                         f"stopping ({loop.end_step - step_no} of {loop.end_step} steps not run)")

    def _end(self, loop: "_Loop", sink: MetricsSink, eval_fn: Callable, state: TrainState) -> None:
        """The final checkpoint, the interruption (a signal) or the final evaluation."""
        finished, end_step = int(state["step"]), loop.end_step
        if self.hooks.save_final and self.store.latest_step() != finished:
            self.save(state, loop.history)
            sink.message(f"[twell] checkpoint at step {finished} -> {self.store.directory}")
        if loop.stop_reason not in (None, "time_limit", "hook") and finished < end_step:
            raise TrainingInterrupted(loop.stop_reason, finished, self.run_dir.absolute(), self.hooks.save_final)
        if finished >= self.cfg.train.steps or loop.stop_reason in ("time_limit", "hook"):
            loop.last_val = self._eval_and_log(sink, eval_fn, state, finished)

    def _describe(self, tokens_per_step: int) -> None:
        cfg, tc = self.cfg, self.cfg.train
        self.echo(f"[twell] run dir: {self.run_dir.absolute()}")
        self.echo(f"[twell] model: {cfg.model.ffn_kind} FFN (backend {cfg.model.kind.backend(cfg.model.ffn_backend)}), "
                  f"{cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.n_layers} layers, d_model "
                  f"{cfg.model.d_model}, d_ff {cfg.model.d_ff}, {cfg.model.heads_text()}; L1 coef "
                  f"{cfg.sparsity.l1_coef:g}")
        self.echo(f"[twell] {describe_execution(cfg.model, cfg.seq_len)}")
        for warning in schedule_warnings(cfg):
            self.echo(warning)
        limit = device_memory_limit_bytes()
        usable = f" ({limit / 2**30:.1f} GiB usable each)" if limit else ""
        self.echo(f"[twell] devices: {self.num_devices} x {jax.devices()[0].platform}{usable}; global batch "
                  f"{tc.global_batch} x {cfg.seq_len} tokens = {tokens_per_step} tokens/step; micro-batch "
                  f"{tc.micro_batch}/device, {self.accum_steps} accumulation step(s)")
        if parallel.multi_process():  # e.g. a launcher that gave each process one GPU of its host
            self.echo(f"[twell] processes: this is process {jax.process_index()} of {jax.process_count()}, "
                      f"{jax.local_device_count()} device(s) each; process 0 writes the run's files")

    def _compile(self, state: TrainState, cfg: ExperimentConfig) -> tuple[Any, float]:
        """The train step compiled for `cfg` (the planner's step config, or its dense program)."""
        self.step_builds += 1
        train_step = make_train_step(cfg, abstract_graphdef(cfg.model, self.cfg.train.seed), self.optimizer,
                                     self.accum_steps)
        batch_shardings = {"tokens": self.batch_sharding}
        batch_spec = {"tokens": jax.ShapeDtypeStruct((self.cfg.train.global_batch, self.cfg.seq_len + 1), jnp.int32,
                                                     sharding=self.batch_sharding)}
        if parallel.multi_process():
            train_step = with_stop_vote(train_step)
            batch_shardings[STOP_VOTE] = self.batch_sharding
            batch_spec[STOP_VOTE] = jax.ShapeDtypeStruct((self.num_devices, len(STOP_REASONS)), jnp.bool_,
                                                         sharding=self.batch_sharding)
        jitted = jax.jit(train_step, in_shardings=(self.state_shardings, batch_shardings),
                         out_shardings=(self.state_shardings, self.replicated), donate_argnames=("state",))
        t0 = time.perf_counter()
        compiled = jitted.lower(state, batch_spec).compile()
        compile_s = time.perf_counter() - t0
        self.echo(f"[twell] train step compiled in {compile_s:.1f}s; {_memory_analysis_text(compiled)}")
        return compiled, compile_s

    def _record(self, step_no: int, host: dict[str, Any], step_time: float, *, memory: bool) -> dict[str, Any]:
        """A step's full record; `memory`: add the device's peak memory (read for logged records
        only: the peak so far is a running maximum, so the end of the run has the run's peak)."""
        tokens_per_step = self.cfg.train.global_batch * self.cfg.seq_len
        record = {"step": step_no, **host, "step_time_s": step_time,
                  **parallel.tokens_per_second(tokens_per_step, step_time, self.num_devices)}
        utilisation = mfu(record["tokens_per_s_per_device"], self.flops_per_token, self.peak_flops)
        if utilisation is not None:
            record["mfu"] = utilisation
        peak = device_peak_memory_bytes() if memory else None
        if peak is not None:
            record["peak_memory_bytes"] = peak
        return record

    def _eval_and_log(self, sink: MetricsSink, eval_fn: Callable, state: TrainState, step_no: int) -> dict[str, Any]:
        val = self.evaluate(eval_fn, state["params"], step_no)
        sink.write({"step": step_no, **{f"val_{k}": v for k, v in val.items()}})
        sink.message(f"[twell] step {step_no}: validation loss {val['loss']:.4f}, perplexity "
                     f"{val['perplexity']:.2f}, mean active FFN neurons/token {np.mean(val['l0_per_layer']):.1f} "
                     f"of {self.cfg.model.d_ff}")
        if self.hooks.on_eval is not None:
            self.hooks.on_eval(step_no, val)
        return val

    def _summary(self, state: TrainState, loop: "_Loop") -> dict[str, Any]:
        cfg, history, val, step_times = self.cfg, loop.history, loop.last_val, loop.step_times
        dead = dead_share_per_layer(cfg, state["since_active"])
        # Skip the first steps (warm caches, async start) in the speed figure.
        steady = step_times[min(2, len(step_times) - 1):] if step_times else []
        median_step = float(np.median(steady)) if steady else float("nan")
        l0 = val.get("l0_per_layer")
        plan = self.planner.summary_fields()
        return {
            "name": cfg.name, "ffn_kind": cfg.model.ffn_kind, "ffn_backend": cfg.model.ffn_backend,
            "l1_coef": cfg.sparsity.l1_coef, "d_ff": cfg.model.d_ff, "n_layers": cfg.model.n_layers,
            "steps": int(state["step"]), "num_devices": self.num_devices,
            "val_loss": val.get("loss"), "val_perplexity": val.get("perplexity"),
            "val_l0_per_layer": l0, "val_l0_mean": float(np.mean(l0)) if l0 is not None else None,
            "val_sparsity": (1.0 - float(np.mean(l0)) / cfg.model.d_ff) if l0 is not None else None,
            "dead_share_per_layer": dead, "dead_share_mean": float(np.mean(dead)) if dead is not None else None,
            "median_step_time_s": median_step,
            "tokens_per_s": cfg.train.global_batch * cfg.seq_len / median_step if steady else None,
            "mfu": (mfu(cfg.train.global_batch * cfg.seq_len / median_step / self.num_devices, self.flops_per_token,
                        self.peak_flops) if steady else None),
            "peak_memory_bytes": device_peak_memory_bytes(), "compile_time_s": loop.compile_s,
            "startup_s": {name: round(seconds, 3) for name, seconds in self.startup.items()},
            "first_step_done_s": self.first_step_done_s,
            "step_builds": self.step_builds,
            "auto_hints_per_layer": plan["auto_hints_per_layer"], "ffn_plan_in_use": plan["ffn_plan_in_use"],
            "auto_plan_trials": plan["auto_plan_trials"],
            "final_train_ce": history[-1]["ce"] if history else None,
            "stopped_by_time_limit": loop.stop_reason == "time_limit", "stopped_by_hook": loop.stop_reason == "hook",
        }


class InitFromParams(Trainer):
    """A Trainer whose new run starts from given parameters (an imported model's: `twell train
    --init-from`; a trained run's: `compare.StudyRun.init_run`) instead of an initialisation; the
    optimizer state, the step and the dead-neuron counters start fresh as in any new run.

    `init_params`: the plain dict of `model.split_model` for `cfg.model`, in any dtype (cast to the
    state's). They start a new run only: a resumed run continues from its own checkpoint.
    """

    def __init__(self, *args: Any, init_params: Any, **kwargs: Any):
        if kwargs.get("resume"):
            raise ValueError("init_params start a new run; resume=True continues one from its checkpoint")
        self._init_params = init_params
        super().__init__(*args, **kwargs)

    def init_state(self) -> TrainState:
        state = super().init_state()  # optimizer moments start at zero whatever the parameters
        params = jax.tree.map(lambda have, want: jnp.asarray(have, want.dtype), self._init_params, state["params"])
        self._init_params = None  # the run's state holds them now: no second copy for the whole run
        return {**state, "params": jax.device_put(params, self.state_shardings["params"])}


@dataclasses.dataclass
class _Loop:
    """The training loop's running state (one `Trainer.run`)."""

    history: list[dict[str, Any]]  # compact records, one per step (restored ones first)
    compile_s: float  # compile seconds so far
    end_step: int  # the last step this run trains
    step_times: list[float] = dataclasses.field(default_factory=list)
    last_record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the last step's full record
    last_val: dict[str, Any] = dataclasses.field(default_factory=dict)  # the last validation
    stop_reason: str | None = None  # a signal's name, "hook" or "time_limit"
    agreed_stop: str | None = None  # a multi-process run: the first stop reason the processes voted for
    start: float = 0.0  # perf_counter at the loop's start (the time limit counts from here)
    mark: float = 0.0  # perf_counter the next step's time counts from


def compact_record(record: dict[str, Any]) -> dict[str, Any]:
    """The scalars of a step record plus layer means: what the in-memory/checkpointed history keeps
    (the per-layer lists stay in metrics.jsonl, so a 30k-step history stays small)."""
    compact = {k: v for k, v in record.items() if isinstance(v, (int, float))}
    for key in ("l0_per_layer", "dead_share_per_layer"):
        if key in record:
            compact[key.replace("_per_layer", "_mean")] = float(np.mean(record[key]))
    return compact


def evaluate_params(cfg: ExperimentConfig, data: DataSource, eval_fn: Callable, params: Any, mesh: Any, *,
                    step: int = 0) -> dict[str, Any]:
    """Validation loss, perplexity and per-layer mean active neurons over the held-out batches.

    Uses the first `train.eval_batches` full batches of `train.eval_batch_size` sequences (global)
    in the data pipeline's fixed validation order, so every evaluation sees the same tokens. A
    non-finite result raises FloatingPointError (naming `step`) instead of being reported.
    """
    ce_sum, tokens, l0_sum = 0.0, 0.0, None
    for batch in data.val_batches(cfg.train.eval_batch_size, max_batches=cfg.train.eval_batches):
        placed = parallel.host_to_global({"tokens": np.asarray(batch["tokens"], np.int32)}, mesh)
        out = jax.device_get(eval_fn(params, placed["tokens"]))
        ce_sum += float(out["ce_sum"])
        tokens += float(out["tokens"])
        l0 = np.asarray(out["l0_sum_per_layer"], np.float64)
        l0_sum = l0 if l0_sum is None else l0_sum + l0
    if tokens == 0:
        raise ValueError("the validation split produced no batches; lower train.eval_batch_size or raise "
                         "data.val_fraction")
    loss = ce_sum / tokens
    check_finite(step, {"val_loss": loss, "val_l0_per_layer": l0_sum}, ("val_loss", "val_l0_per_layer"),
                 hint="the parameters evaluated are broken (a diverged run or a damaged checkpoint)")
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens,
            "l0_per_layer": (l0_sum / tokens).tolist()}


def _memory_analysis_text(compiled: Any) -> str:
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (not every backend implements it)
        analysis = None
    if analysis is None:
        return "memory analysis: not available on this backend"
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    parts = [f"{name.replace('_size_in_bytes', '')} {getattr(analysis, name, 0) / 2**20:.1f} MiB"
             for name in fields if hasattr(analysis, name)]
    return "memory analysis: " + ", ".join(parts)


def _json_ready(value: Any) -> Any:
    """Grain iterator states are dicts of ints/strings (or bytes); make them JSON-serialisable."""
    if isinstance(value, bytes):
        return {"__bytes__": value.decode("latin-1")}
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json_ready(value: Any) -> Any:
    """Inverse of `_json_ready`."""
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return value["__bytes__"].encode("latin-1")
        return {k: _from_json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json_ready(v) for v in value]
    return value


def with_saved_tokenizer(cfg: ExperimentConfig, run_dir: str | Path) -> ExperimentConfig:
    """`cfg` reading the tokenizer saved in `run_dir` (when there is one) instead of re-training it:
    what a resumed or evaluated run builds its data with (its saved config is left unchanged)."""
    saved = ckpt_lib.saved_tokenizer(run_dir)
    if saved is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(saved.absolute())))


def train(cfg: ExperimentConfig, run_dir: str | Path | None = None, *, resume: bool = False,
          echo: Callable[[str], None] = print, trainer_cls: type[Trainer] = Trainer, **kwargs: Any) -> TrainResult:
    """Convenience wrapper: build a `trainer_cls` (a Trainer) for `cfg` and run it (kwargs go to it);
    run_dir None reserves a new runs/<name>-<time>, removed again if the run fails before using it.
    In a multi-process run process 0 reserves it and every process trains in that one."""
    reserved = run_dir is None
    run_dir = Path(parallel.lead_value("the run directory", lambda: str(default_run_dir(cfg)))) if reserved \
        else Path(run_dir)
    try:
        return trainer_cls(cfg, run_dir, resume=resume, echo=echo, **kwargs).run()
    except BaseException:
        if reserved and parallel.is_lead() and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # the directory default_run_dir reserved, unused
        raise
