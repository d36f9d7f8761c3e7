"""Training: the jit-compiled data-parallel step with gradient accumulation, and the `Trainer` loop.

All mesh plumbing lives in `Trainer.__init__` (one place): a 1-D "data" mesh over
`train.num_devices` devices (`twell_jax.training.parallel.make_mesh`), params / optimizer state replicated
(or FSDP-sharded with `train.fsdp`), the batch split over "data". The step is `jax.jit` with
NamedSharding in/out shardings and the state donated, compiled once before the loop (its memory
analysis logged) and run under `jax.set_mesh(mesh)` so the sparse op can `shard_map` its kernels.

One optimizer step = `accum` micro-batches of `train.micro_batch` sequences per device, scanned with
`jax.lax.scan`, gradients averaged. The loop fetches each step's metrics as soon as the step is
done (the step time is the interval between two completions), passes them through the NaN/Inf
guard and hands them to the run's one `MetricsSink` and to the caller's `Hooks`.

A run directory holds one run (twell_jax/training/checkpoint.py): a new run refuses a non-empty directory
unless told to overwrite; `resume=True` continues from the newest intact checkpoint (or `step`),
with the run's saved config as the reference. SIGINT/SIGTERM finish the current step, checkpoint
and raise `TrainingInterrupted`.

Training "auto" hints. When the sparse op runs backend "auto" and the user gave no hint
(`manages_auto_hints`), the trainer supplies `model.ffn_expected_active` itself, so that "auto"
decides dense vs sparse per layer at trace time and compiles exactly one path (without a hint it
compiles both behind a device-side branch, which costs time and memory). A fresh run measures each
layer's mean active neurons per token with one forward on the first micro-batch of its first batch
(through the dense backend: same counts; a model at initialisation is ~50% active, so the step
compiled is exactly the dense one); a resumed run takes the hints its checkpoint was saved with
(`hints.run_hints`: else the last l0 in metrics.jsonl, else a measurement). Every
`train.auto_refresh_every` steps the mean of the steps' l0_per_layer since the last re-plan (fetched
for logging anyway: no extra host sync; a mean, so one noisy step does not flip a layer) gives new
per-layer decisions (`auto_decisions`, which is `ops.auto_decision`, i.e. the op's own plan); only
when one changes are the hints replaced by that mean, the
graphdef rebuilt (params keep their structure) and the step recompiled, once, with a log line
naming every layer's decision. The hints in use go into every metrics record
(`auto_hints_per_layer`) and into the checkpoints' config. A run that tracks neurons (a ReLU model,
`sparsity.track_neurons`) hints each layer's expected dense tails of the sparse backward too
(`model.ffn_expected_tails`, `auto_tail_hints_per_layer`): the token-tail, hot-neuron and
hot-entry shares the step measures from the op's counts for any plan (`ops.backward_tail_shares`,
logged as `token_tail_share_per_layer`, ...), measured and averaged like l0, so that the cost model
prices the tails of the layer's real pattern (dense first tokens, hot neurons) and not only its
mean active count.

The plan is then checked on the run (`plan_trial.py`, `train.auto_trial_steps`): a plan with a
sparse piece runs that many timed steps, the dense program (compiled once per run) as many, and the
sparse plan is kept only at >= 0.98x dense's median step time; otherwise the dense program runs
until the next re-plan, which checks again. Each record names the program its step ran
(`ffn_plan`); the summary lists the trials (`auto_plan_trials`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from twell_jax.training import checkpoint as ckpt_lib
from twell_jax import config as config_lib
from twell_jax import ops
from twell_jax.training import parallel
from twell_jax.config import ExperimentConfig, ModelConfig
from twell_jax.data import DataSource, build_experiment_data
from twell_jax.training.hints import (Tails, describe_tails, manages_auto_hints, normalise_tails,
                                      tails_from_shares, with_hints)
from twell_jax.training.plan_trial import PlanTrial
from twell_jax.training.loss import cross_entropy, l1_coefficient, total_loss
from twell_jax.training.metrics import MetricsSink, check_finite, device_peak_memory_bytes, to_python
from twell_jax.model import apply_model, build_op_config, describe_execution, init_model, split_model
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
           f"set optim.schedule_steps >= train.steps (or 0: the schedule then ends at train.steps)")
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


Decision = tuple[str, str]  # (forward, backward) of one layer's op call, as ops.auto_decision names them


def auto_decisions(cfg: ExperimentConfig, hints: Sequence[float], num_devices: int,
                   tails: Tails | None = None) -> tuple[Decision, ...]:
    """Per layer, the (forward, backward) path that backend "auto" compiles for the training step's
    FFN calls (one micro-batch of `train.micro_batch` sequences per device) with these hints (and
    these tail hints, when given)."""
    model = with_hints(cfg, hints, tails).model
    itemsize = jnp.dtype(model.compute_dtype).itemsize
    decisions = []
    for layer in range(model.n_layers):
        op_config = build_op_config(model, layer)
        # The op splits the micro-batch over the mesh's data axis (when its config names it).
        per_shard = cfg.train.micro_batch * (1 if op_config.data_axis == parallel.DATA_AXIS else num_devices)
        shape = (per_shard * cfg.seq_len, model.d_model, model.d_ff, itemsize)
        decisions.append(ops.auto_decision(model.kind.gated, op_config, shape, model.ffn_interpret))
    return tuple(decisions)


def describe_decisions(decisions: Sequence[Decision]) -> str:
    """"layer 0 dense/dense, layer 1 pallas/dense, ..." (forward/backward per layer)."""
    return ", ".join(f"layer {i} {fwd}/{bwd}" for i, (fwd, bwd) in enumerate(decisions))


def measure_activity(graphdef: nnx.GraphDef, params: Any, tokens_BxT: jax.Array, *,
                     tails: bool) -> tuple[tuple[float, ...], Tails | None]:
    """Each layer's mean active FFN neurons per token (the model's aux l0) on one forward of
    `tokens_BxT` (inputs tokens[:, :-1], as in training), and with `tails` (a ReLU model) each
    layer's expected dense tails of the sparse backward (`tails_from_shares`), else None."""
    keys = ("l0", *(ops.TAIL_SHARE_KEYS if tails else ()))
    forward = jax.jit(lambda p, t: {k: v for k, v in apply_model(graphdef, p, t[:, :-1], track_neurons=tails)[1].items()
                                    if k in keys})
    aux = jax.device_get(forward(params, tokens_BxT))
    l0 = tuple(float(v) for v in np.asarray(aux["l0"]))
    return l0, (tails_from_shares(aux) if tails else None)


def abstract_graphdef(model: ModelConfig, seed: int) -> nnx.GraphDef:
    """The graphdef of `model` (static structure and attributes, hints included), built without
    allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: init_model(model, seed)))[0]


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
    killing the process. Only the main thread can install handlers; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:  # a second signal: give up the graceful stop, die as asked
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Builds mesh, model, optimizer, data and checkpoint store for one run; `run()` trains.

    resume=True continues the run in `run_dir`: `cfg` may differ from the run's saved config only in
    config.RESUMABLE_FIELDS; `resume_step` picks a checkpoint (default: the newest intact one).
    A new run needs an empty (or missing) `run_dir`, or `overwrite=True`.
    """

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, *, resume: bool = False,
                 resume_step: int | None = None, overwrite: bool = False,
                 data_builder: Callable[[ExperimentConfig], DataSource] = build_experiment_data,
                 echo: Callable[[str], None] = print, hooks: Hooks | None = None):
        self.run_dir = Path(run_dir)
        self.resume, self.resume_step, self.overwrite = resume, resume_step, overwrite
        self.echo = echo
        self.hooks = hooks or Hooks()
        self.store = None
        self.auto_hints: tuple[float, ...] | None = None  # the "auto" hints compiled in (managed runs)
        self.auto_tails: Tails | None = None  # and their tail hints (runs that track neurons)
        self.decisions: tuple[Decision, ...] | None = None  # their per-layer (forward, backward)
        # Sums of the per-layer l0 (and tail shares [L, 3]) of the steps since the last re-plan, and
        # the number of steps (managed runs).
        self._l0_sum: np.ndarray | None = None
        self._tails_sum: np.ndarray | None = None
        self._l0_steps = 0
        self.step_builds = 0  # how many times the train step was compiled in this process
        # The A/B of a sparse "auto" plan against the dense program (plan_trial.py): the trial under
        # way, the plan kept by the last one, the dense executable (compiled once), the record.
        self.trial: PlanTrial | None = None
        self.plan_in_use = "auto"
        self._dense_compiled: Any = None
        self.trials: list[dict[str, Any]] = []
        check_op_config(cfg)
        check_run_name(cfg.name)
        if resume:
            ckpt_dir = self.run_dir / ckpt_lib.CHECKPOINT_SUBDIR
            if not ckpt_lib.has_steps(ckpt_dir):
                raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir.absolute()} (is --out the run "
                                        "directory of the run to continue?)")
            saved = ckpt_lib.load_run_config(self.run_dir)
            if not cfg.optim.schedule_steps:  # keep the run's schedule unless one is asked for
                cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_steps=saved.schedule_steps))
            ckpt_lib.check_compatible(config_lib.to_dict(saved), cfg)
            check_schedule_covers_steps(cfg, resume=True)
            self._saved_cfg = saved
        else:
            cfg = config_lib.with_fixed_schedule(cfg)
            check_schedule_covers_steps(cfg, resume=False)
            ckpt_lib.check_new_run_dir(self.run_dir, overwrite=overwrite)  # raises, naming the directory
        # One process at a time in a run directory (multi-host runs: the lead process holds it).
        created = not self.run_dir.exists()
        self._lock = ckpt_lib.RunLock(self.run_dir, warn=echo) if jax.process_index() == 0 else None
        try:
            self._build(cfg, resume, overwrite, data_builder)
        except BaseException:
            self.release()
            if created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
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

        self.data = data_builder(with_saved_tokenizer(cfg, self.run_dir) if resume else cfg)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"the tokenizer has {self.data.vocab_size} tokens but model.vocab_size="
                             f"{cfg.model.vocab_size}; raise model.vocab_size")
        if resume:
            ckpt_lib.check_corpus_fingerprint(self.run_dir, self.data, echo)

        abstract_model = nnx.eval_shape(lambda: init_model(cfg.model, tc.seed))
        self.graphdef, abstract_state = nnx.split(abstract_model)
        abstract_params = nnx.to_pure_dict(abstract_state)
        self.optimizer = build_optimizer(cfg.optim, cfg.schedule_steps)
        abstract_train_state = {
            "params": abstract_params,
            "opt_state": jax.eval_shape(self.optimizer.init, abstract_params),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "since_active": jax.ShapeDtypeStruct((cfg.model.n_layers, cfg.model.d_ff), jnp.int32),
        }
        self.state_shardings = parallel.param_shardings(self.mesh, abstract_train_state, fsdp=tc.fsdp)
        self.abstract_state = abstract_train_state
        self.manage_hints = manages_auto_hints(cfg.model)
        # Everything that can be checked has been: only now may a new run take over the directory.
        if not resume:
            ckpt_lib.prepare_new_run_dir(self.run_dir, overwrite=overwrite)
            if self.data.tokenizer_json_path:
                ckpt_lib.save_tokenizer(self.run_dir, self.data.tokenizer_json_path)
            ckpt_lib.save_corpus_fingerprint(self.run_dir, self.data)
            ckpt_lib.atomic_write_text(self.run_dir / ckpt_lib.CONFIG_FILE, config_lib.to_json(cfg))
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
        ckpt_lib.atomic_write_text(self.run_dir / ckpt_lib.CONFIG_FILE, config_lib.to_json(self.cfg))
        for moved in self.store.quarantine_after(step, self.run_dir):
            self.echo(f"[twell] warning: continuing from step {step}: newer checkpoint moved to {moved}")
        return {"params": items[ckpt_lib.PARAMS_ITEM], **items[ckpt_lib.TRAIN_ITEM]}, meta

    def save(self, state: TrainState, history: list[dict[str, Any]]) -> None:
        # The config with the "auto" hints in use: what evaluation / inference of this step should run.
        meta = {"config": config_lib.to_dict(self.step_cfg), "data_iter": _json_ready(self.data.train_iter.get_state()),
                "step": int(state["step"]), "history": history,
                "auto_hints": list(self.auto_hints) if self.auto_hints is not None else None,
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
        cfg, tc, hooks = self.cfg, self.cfg.train, self.hooks
        tokens_per_step = tc.global_batch * cfg.seq_len
        self._describe(tokens_per_step)
        history: list[dict[str, Any]] = []
        with jax.set_mesh(self.mesh), _StopSignals() as signals:
            meta: dict[str, Any] = {}
            if self.resume:
                state, meta = self.restore_state()
                self.data.train_iter.set_state(_from_json_ready(meta["data_iter"]))
                history = meta.get("history", [])
                self.echo(f"[twell] resumed from step {int(state['step'])} ({self.store.directory})")
            else:
                state = self.init_state()
            if self.manage_hints:
                hints, tails, source = self._initial_hints(state, meta)
                self._use_hints(hints, tails)
                self.echo(f"[twell] 'auto' backend hints (mean active FFN neurons/token per layer, {source}): "
                          f"{', '.join(f'{v:.1f}' for v in hints)}"
                          + (f"; backward tails (token-tail / hot-neuron share) {describe_tails(tails)}" if tails else "")
                          + f"; plan: {describe_decisions(self.decisions)}"
                          + (f"; re-planned every {tc.auto_refresh_every} steps" if tc.auto_refresh_every else ""))
            start_step = int(state["step"])
            compiled, compile_s = self._compile(state)
            compiled_auto = compiled  # the "auto" plan's executable (`compiled` may be dense's)
            eval_fn = jax.jit(make_eval_step(self.step_cfg, self.graphdef))
            sink = MetricsSink(self.run_dir, tensorboard=tc.tensorboard, total_steps=tc.steps,
                               start_step=start_step, progress_bar=tc.progress_bar, echo=self.echo)
            self.echo(f"[twell] metrics: {sink.jsonl_path}"
                      + (f", TensorBoard: {self.run_dir / 'tensorboard'}" if tc.tensorboard else ""))
            last_val: dict[str, Any] = {}
            last_record: dict[str, Any] = {}
            step_times: list[float] = []
            stop_reason = None
            end_step = tc.steps if stop_after_step is None else min(tc.steps, stop_after_step)
            self._maybe_start_trial(start_step, sink)
            try:
                mark = loop_start = time.perf_counter()
                for step_no in range(start_step + 1, end_step + 1):
                    batch = parallel.host_to_global(next(self.data.train_iter), self.mesh)
                    plan = self.plan_in_use if self.trial is None else self.trial.arm()
                    if self.trial is not None and plan == "dense" and self._dense_compiled is None:
                        compile_s += self._compile_dense(state)
                        mark = time.perf_counter()  # compilation is not step time
                    runner = compiled if self.trial is None else (
                        compiled_auto if plan == "auto" else self._dense_compiled)
                    state, device_metrics = runner(state, batch)
                    host = to_python(jax.device_get(device_metrics))  # waits for this step
                    now = time.perf_counter()
                    step_times.append(now - mark)
                    check_finite(step_no, host, GUARDED_METRICS)
                    if self.trial is not None:
                        self.trial.add(step_times[-1])
                        if self.trial.decided:
                            compiled = compiled_auto if self._end_trial(step_no, sink) == "auto" else self._dense_compiled
                    logged = step_no % tc.log_every == 0 or step_no == end_step
                    last_record = self._record(step_no, host, step_times[-1], tokens_per_step, memory=logged)
                    if self.manage_hints:
                        last_record["ffn_plan"] = plan
                    history.append(compact_record(last_record))
                    sink.progress(step_no, {"loss": host["loss"], "ce": host["ce"],
                                            "l0": float(np.mean(host["l0_per_layer"])),
                                            "tok/s": int(last_record["tokens_per_s"])})
                    if logged:
                        sink.write(last_record)
                    if hooks.on_step is not None:
                        hooks.on_step(last_record)
                    if self.manage_hints:
                        self._observe(host)
                    if (self.manage_hints and tc.auto_refresh_every and step_no % tc.auto_refresh_every == 0
                            and step_no < end_step):
                        if self._refresh_hints(step_no, sink):
                            compiled, seconds = self._compile(state)
                            compiled_auto = compiled
                            self.plan_in_use = "auto"
                            compile_s += seconds
                            eval_fn = jax.jit(make_eval_step(self.step_cfg, self.graphdef))
                            self._maybe_start_trial(step_no, sink)
                        elif self.plan_in_use == "dense":  # the patterns move: check the plan again
                            self._maybe_start_trial(step_no, sink)
                    if tc.eval_every and step_no % tc.eval_every == 0 and step_no != tc.steps:
                        last_val = self._eval_and_log(sink, eval_fn, state, step_no)
                    if tc.checkpoint_every and step_no % tc.checkpoint_every == 0 and step_no != end_step:
                        self.save(state, history)
                        sink.message(f"[twell] step {step_no}: checkpoint -> {self.store.directory}")
                    if signals.received:
                        stop_reason = signals.received
                    elif hooks.should_stop is not None and step_no < end_step and (
                            why := hooks.should_stop(last_record)):
                        stop_reason = "hook"
                        sink.message(f"[twell] step {step_no}: stopping ({why})")
                    elif tc.time_limit_s and time.perf_counter() - loop_start >= tc.time_limit_s and step_no < end_step:
                        stop_reason = "time_limit"
                        sink.message(f"[twell] step {step_no}: train.time_limit_s={tc.time_limit_s:g} reached, "
                                     f"stopping ({end_step - step_no} of {end_step} steps not run)")
                    if stop_reason:
                        break
                    mark = time.perf_counter()  # evaluations and saves are not step time

                finished = int(state["step"])
                if hooks.save_final and self.store.latest_step() != finished:
                    self.save(state, history)
                    sink.message(f"[twell] checkpoint at step {finished} -> {self.store.directory}")
                if stop_reason not in (None, "time_limit", "hook") and finished < end_step:
                    raise TrainingInterrupted(stop_reason, finished, self.run_dir.absolute(), hooks.save_final)
                if finished >= tc.steps or stop_reason in ("time_limit", "hook"):
                    last_val = self._eval_and_log(sink, eval_fn, state, finished)
            finally:
                sink.close()
            summary = self._summary(state, history, last_val, step_times, compile_s)
            summary["stopped_by_time_limit"] = stop_reason == "time_limit"
            summary["stopped_by_hook"] = stop_reason == "hook"
            ckpt_lib.atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            self.echo(f"[twell] summary: {self.run_dir / 'summary.json'}")
        return TrainResult(run_dir=self.run_dir, history=history, summary=summary, state=state,
                           last_metrics=last_record or None)

    # ------------------------------------------------------------------ "auto" hints
    @property
    def step_cfg(self) -> ExperimentConfig:
        """The config the step is compiled with: `cfg` plus the "auto" hints in use (if any)."""
        return self.cfg if self.auto_hints is None else with_hints(self.cfg, self.auto_hints, self.auto_tails)

    def _initial_hints(self, state: TrainState, meta: dict[str, Any]
                       ) -> tuple[tuple[float, ...], Tails | None, str]:
        """(hints, tail hints or None, where they come from) for the first compile of a managed run:
        measured with the parameters the run starts from (a resumed run's trained ones: the hints a
        checkpoint was compiled with may be those measured at initialisation, long out of date)."""
        where = f"the parameters of step {int(state['step'])}" if self.resume else "the initial parameters"
        return (*self._measure_first_batch(state), f"measured with {where} on the first micro-batch of the next batch")

    def _measure_first_batch(self, state: TrainState) -> tuple[tuple[float, ...], Tails | None]:
        """Mean active neurons per token per layer of the current params on the first micro-batch
        of the batch the loop will train on next (the data iterator is rewound afterwards), and the
        layers' tail hints (runs that track neurons)."""
        iterator = self.data.train_iter
        position = iterator.get_state()
        tokens = np.asarray(next(iterator)["tokens"], np.int32)
        iterator.set_state(position)
        # One micro-batch (this process's rows of it): the memory of a step's forward, not more.
        rows = self.cfg.train.micro_batch * max(1, self.num_devices // jax.process_count())
        placed = parallel.host_to_global({"tokens": tokens[:rows]}, self.mesh)
        # The dense backend: the same l0 exactly (a backend never changes results), without
        # compiling "auto"'s two hint-less paths just to count.
        dense = dataclasses.replace(self.cfg.model, ffn_backend="dense")
        return measure_activity(abstract_graphdef(dense, self.cfg.train.seed), state["params"],
                                placed["tokens"], tails=tracks_neurons(self.cfg))

    def _use_hints(self, hints: Sequence[float], tails: Tails | None,
                   decisions: tuple[Decision, ...] | None = None) -> None:
        """Compile with these hints (and tail hints) from now on: their decisions (`decisions` when
        the caller has them already) and the graphdef built with them."""
        self.auto_hints = tuple(float(v) for v in hints)
        self.auto_tails = None if tails is None else normalise_tails(tails)
        self.decisions = decisions or auto_decisions(self.cfg, self.auto_hints, self.num_devices, self.auto_tails)
        self.graphdef = abstract_graphdef(self.step_cfg.model, self.cfg.train.seed)

    def _maybe_start_trial(self, step_no: int, sink: MetricsSink) -> None:
        """Start an A/B of the compiled "auto" plan against dense (plan_trial.py) when the plan has a
        sparse piece and train.auto_trial_steps > 0."""
        steps = self.cfg.train.auto_trial_steps
        if not (self.manage_hints and steps and any(d != ("dense", "dense") for d in self.decisions)):
            return
        self.trial = PlanTrial(steps)
        sink.message(f"[twell] step {step_no}: timing the 'auto' plan against the dense program over the "
                     f"next {2 * (steps + 1)} steps (train.auto_trial_steps={steps})")

    def _compile_dense(self, state: TrainState) -> float:
        """Compile the dense program (the op's dense backend) once per run; its compile seconds."""
        dense = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, ffn_backend="dense"))
        self._dense_compiled, seconds = self._compile(state, dense)
        return seconds

    def _end_trial(self, step_no: int, sink: MetricsSink) -> str:
        """Close the trial: the plan to run until the next re-plan ("auto" or "dense")."""
        trial, self.trial = self.trial, None
        verdict, medians = trial.verdict(), trial.medians()
        self.plan_in_use = verdict
        self.trials.append({"step": step_no, "auto_step_s": medians["auto"], "dense_step_s": medians["dense"],
                            "auto_vs_dense": trial.speed_ratio(), "kept": verdict,
                            "decisions": [list(d) for d in self.decisions]})
        sink.message(f"[twell] step {step_no}: 'auto' plan {medians['auto']:.4f} s/step, dense "
                     f"{medians['dense']:.4f} s/step ({trial.speed_ratio():.3f}x dense): "
                     + ("keeping the 'auto' plan" if verdict == "auto" else
                        f"running the dense program (the plan is under {trial.floor:g}x dense)"))
        return verdict

    def _observe(self, host: dict[str, Any]) -> None:
        """Add one step's per-layer l0 (and tail shares, when the step reports them) to the means
        the next re-plan decides from."""
        l0 = np.asarray(host["l0_per_layer"], np.float64)
        self._l0_sum = l0 if self._l0_sum is None else self._l0_sum + l0
        if all(f"{key}_per_layer" in host for key in ops.TAIL_SHARE_KEYS):
            tails = np.asarray(tails_from_shares(host, "_per_layer"))
            self._tails_sum = tails if self._tails_sum is None else self._tails_sum + tails
        self._l0_steps += 1

    def _refresh_hints(self, step_no: int, sink: MetricsSink) -> bool:
        """Re-plan from the mean l0 (and tail shares) of the steps since the last re-plan, so that
        one noisy step near a dense/sparse threshold does not flip the plan; True when some layer's
        decision changed (the caller then recompiles). Unchanged decisions keep the hints: no
        recompile."""
        mean_l0 = (self._l0_sum / self._l0_steps).tolist()
        mean_tails = None if self._tails_sum is None else normalise_tails(self._tails_sum / self._l0_steps)
        # The next re-plan averages the steps after this one.
        self._l0_sum, self._tails_sum, self._l0_steps = None, None, 0
        decisions = auto_decisions(self.cfg, mean_l0, self.num_devices, mean_tails)
        if decisions == self.decisions:
            return False
        changed = [i for i, (old, new) in enumerate(zip(self.decisions, decisions)) if old != new]
        self._use_hints(mean_l0, mean_tails, decisions)
        sink.message(f"[twell] step {step_no}: 'auto' plan changed in layer(s) {changed}; recompiling the step "
                     f"with hints {', '.join(f'{v:.1f}' for v in self.auto_hints)}"
                     + (f", backward tails {describe_tails(mean_tails)}" if mean_tails else "")
                     + f": {describe_decisions(decisions)}")
        return True

    def _describe(self, tokens_per_step: int) -> None:
        cfg, tc = self.cfg, self.cfg.train
        self.echo(f"[twell] run dir: {self.run_dir.absolute()}")
        self.echo(f"[twell] model: {cfg.model.ffn_kind} FFN (backend {cfg.model.kind.backend(cfg.model.ffn_backend)}), "
                  f"{cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.n_layers} layers, d_model "
                  f"{cfg.model.d_model}, d_ff {cfg.model.d_ff}; L1 coef {cfg.sparsity.l1_coef:g}")
        self.echo(f"[twell] {describe_execution(cfg.model, cfg.seq_len)}")
        self.echo(f"[twell] devices: {self.num_devices} x {jax.devices()[0].platform}; global batch "
                  f"{tc.global_batch} x {cfg.seq_len} tokens = {tokens_per_step} tokens/step; micro-batch "
                  f"{tc.micro_batch}/device, {self.accum_steps} accumulation step(s)")

    def _compile(self, state: TrainState, cfg: ExperimentConfig | None = None) -> tuple[Any, float]:
        """The train step compiled for `cfg` (default: the step config with the hints in use)."""
        self.step_builds += 1
        graphdef = self.graphdef if cfg is None else abstract_graphdef(cfg.model, self.cfg.train.seed)
        train_step = make_train_step(cfg or self.step_cfg, graphdef, self.optimizer, self.accum_steps)
        jitted = jax.jit(train_step, in_shardings=(self.state_shardings, {"tokens": self.batch_sharding}),
                         out_shardings=(self.state_shardings, self.replicated), donate_argnames=("state",))
        batch_spec = {"tokens": jax.ShapeDtypeStruct((self.cfg.train.global_batch, self.cfg.seq_len + 1), jnp.int32,
                                                     sharding=self.batch_sharding)}
        t0 = time.perf_counter()
        compiled = jitted.lower(state, batch_spec).compile()
        compile_s = time.perf_counter() - t0
        self.echo(f"[twell] train step compiled in {compile_s:.1f}s; {_memory_analysis_text(compiled)}")
        return compiled, compile_s

    def _record(self, step_no: int, host: dict[str, Any], step_time: float, tokens_per_step: int, *,
                memory: bool) -> dict[str, Any]:
        """A step's full record; `memory`: add the device's peak memory (read for logged records
        only: the peak so far is a running maximum, so the end of the run has the run's peak)."""
        record = {"step": step_no, **host, "step_time_s": step_time,
                  **parallel.tokens_per_second(tokens_per_step, step_time, self.num_devices)}
        peak = device_peak_memory_bytes() if memory else None
        if peak is not None:
            record["peak_memory_bytes"] = peak
        if self.auto_hints is not None:
            record["auto_hints_per_layer"] = list(self.auto_hints)
        if self.auto_tails is not None:
            record["auto_tail_hints_per_layer"] = [list(t) for t in self.auto_tails]
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

    def _summary(self, state: TrainState, history: list[dict[str, Any]], val: dict[str, Any],
                 step_times: list[float], compile_s: float) -> dict[str, Any]:
        cfg = self.cfg
        dead = dead_share_per_layer(cfg, state["since_active"])
        # Skip the first steps (warm caches, async start) in the speed figure.
        steady = step_times[min(2, len(step_times) - 1):] if step_times else []
        median_step = float(np.median(steady)) if steady else float("nan")
        l0 = val.get("l0_per_layer")
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
            "peak_memory_bytes": device_peak_memory_bytes(), "compile_time_s": compile_s,
            "step_builds": self.step_builds,
            "auto_hints_per_layer": list(self.auto_hints) if self.auto_hints is not None else None,
            "ffn_plan_in_use": self.plan_in_use if self.manage_hints else None,
            "auto_plan_trials": self.trials,
            "final_train_ce": history[-1]["ce"] if history else None,
        }


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
          echo: Callable[[str], None] = print, **kwargs: Any) -> TrainResult:
    """Convenience wrapper: build a Trainer for `cfg` and run it (kwargs go to `Trainer`)."""
    reserved = run_dir is None
    run_dir = default_run_dir(cfg) if reserved else Path(run_dir)
    try:
        return Trainer(cfg, run_dir, resume=resume, echo=echo, **kwargs).run()
    except BaseException:
        if reserved and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # the directory default_run_dir reserved, unused
        raise
