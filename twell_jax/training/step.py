"""The training step and the evaluation step: the pure functions the trainer jit-compiles.

One optimizer step = `accum_steps` micro-batches, scanned with `jax.lax.scan`, gradients averaged
(`accumulate_gradients`); then the optimizer update, the dead-neuron counters and their optional
re-initialisation (`make_train_step`). The step's metrics are built from one table,
`STEP_METRICS`: each metric's name, what it is made of and how it is reduced over the
micro-batches. A multi-process run adds its stop vote to the step (`with_stop_vote`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from twell_jax import ops
from twell_jax.config import ExperimentConfig
from twell_jax.model import apply_model
from twell_jax.training.loss import (adapt_l1_control, cross_entropy, l1_coefficient, l1_control_init,
                                     layer_l1_coefficients, moving_targets, total_loss)
from twell_jax.training.optimizer import learning_rate_schedule
from twell_jax.training.sparsity import (dead_share, init_counters, position_profile, reinit_dead_rows,
                                         update_counters)

# {"params", "opt_state", "step": int32, "since_active": int32[L, H]} and, with sparsity.target_active,
# "l1_control" (loss.adapt_l1_control's state): `state_extras`.
TrainState = dict[str, Any]

# optax.tree.norm on newer optax (global_norm is deprecated there), global_norm on older ones.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

# Metrics checked by the NaN/Inf guard, in the order they are reported.
GUARDED_METRICS = ("loss", "ce", "l1", "grad_norm", "l0_per_layer")


@dataclasses.dataclass(frozen=True)
class StepMetric:
    """One metric of the training step (`STEP_METRICS`)."""

    name: str  # its key in the step's metrics (and in metrics.jsonl)
    # What it is made of: with a reduction, a per-micro-batch value ("loss", "ce" or a key of the
    # model's aux, stacked over the micro-batches); with reduce "step", one value of the whole step.
    source: str
    reduce: str  # a key of REDUCTIONS, or "step" (the step's value as it is)
    # "always"; "tracked": only where the run tracks neurons (`tracks_neurons`); "reinit": only with
    # sparsity.reinit_dead; "targets": only with sparsity.target_active.
    when: str = "always"


def state_extras(cfg: ExperimentConfig) -> dict[str, Any]:
    """The train state's entries besides params, opt_state and step, at their initial values."""
    extras: dict[str, Any] = {"since_active": init_counters(cfg.model)}
    if cfg.sparsity.target_active:
        extras["l1_control"] = l1_control_init(cfg.model.n_layers)
    return extras


# How a per-micro-batch value [micro-batches, ...] becomes the step's.
REDUCTIONS: dict[str, Callable[[jax.Array, ExperimentConfig], jax.Array]] = {
    "mean": lambda x, cfg: jnp.mean(x, axis=0),
    "sum": lambda x, cfg: jnp.sum(x, axis=0),
    "mean_f32": lambda x, cfg: jnp.mean(x.astype(jnp.float32), axis=0),  # integer counts
    "mean_all": lambda x, cfg: jnp.mean(x),  # over the micro-batches and the layers
    "position_buckets": lambda x, cfg: position_profile(jnp.mean(x, axis=0), cfg.sparsity.position_buckets),
}

# The step's metrics, one row each. The step-level sources: "l1_coef" (the L1 coefficient of the
# step), "lr" (its learning rate), "grad_norm" (of the averaged gradient), "dead_share" (each layer's
# share of dead neurons after the step), "reinit_count" (neurons re-initialised by the step).
STEP_METRICS: tuple[StepMetric, ...] = (
    StepMetric("loss", "loss", "mean"),
    StepMetric("ce", "ce", "mean"),
    StepMetric("l1", "l1", "mean_all"),  # the model's penalty is the mean over layers
    StepMetric("l1_coef", "l1_coef", "step"),
    # With sparsity.target_active: each layer's lambda after the step's adaptation (its next step's).
    StepMetric("l1_coef_per_layer", "l1_coef_per_layer", "step", when="targets"),
    StepMetric("lr", "lr", "step"),
    StepMetric("grad_norm", "grad_norm", "step"),
    StepMetric("l1_per_layer", "l1", "mean"),
    StepMetric("l0_per_layer", "l0", "mean"),
    StepMetric("tile_overflow_per_layer", "tile_overflow", "sum"),
    StepMetric("row_overflow_per_layer", "row_overflow", "sum"),
    StepMetric("dense_fallback_per_layer", "dense_fallback", "sum"),
    # The sparse backward's dense tails (mean per micro-batch; -1: not counted, ops doc).
    StepMetric("backward_tail_rows_per_layer", "backward_tail_rows", "mean_f32"),
    StepMetric("backward_hot_neurons_per_layer", "backward_hot_neurons", "mean_f32"),
    StepMetric("dead_share_per_layer", "dead_share", "step", when="tracked"),
    StepMetric("position_profile", "position_active", "position_buckets", when="tracked"),
    # The sparse backward's expected dense tails, for any plan (the "auto" tail hints).
    *(StepMetric(f"{key}_per_layer", key, "mean", when="tracked") for key in ops.TAIL_SHARE_KEYS),
    StepMetric("reinit_count", "reinit_count", "step", when="reinit"),
)


def dead_window(cfg: ExperimentConfig) -> int:
    """Tokens without firing after which a neuron counts as dead (default: one optimizer step)."""
    return cfg.sparsity.dead_window_tokens or cfg.train.global_batch * cfg.seq_len


def tracks_neurons(cfg: ExperimentConfig) -> bool:
    """True when the step updates the per-neuron activity counters (dead neurons, position profile):
    asked for, and meaningful only for exactly sparse (ReLU) activations."""
    return cfg.sparsity.track_neurons and cfg.model.is_relu_family


def step_metrics_of(cfg: ExperimentConfig) -> tuple[StepMetric, ...]:
    """The rows of `STEP_METRICS` a step of `cfg` reports."""
    applies = {"always": True, "tracked": tracks_neurons(cfg), "reinit": cfg.sparsity.reinit_dead,
               "targets": bool(cfg.sparsity.target_active)}
    return tuple(metric for metric in STEP_METRICS if applies[metric.when])


def dead_share_per_layer(cfg: ExperimentConfig, since_LxH: Any) -> list[float] | None:
    """Each layer's share of dead neurons from the counters (`sparsity.dead_share`), or None when the
    run does not track neurons (its counters never move: a share of 0 would be a false claim)."""
    if not tracks_neurons(cfg):
        return None
    return [float(v) for v in np.asarray(jax.device_get(dead_share(since_LxH, dead_window(cfg))))]


def accumulate_gradients(cfg: ExperimentConfig, graphdef: nnx.GraphDef, params: Any, tokens_BxT: jax.Array,
                         since_LxH: jax.Array, l1_coef: jax.Array, accum_steps: int,
                         shards: tuple[Any, int] | None = None) -> tuple[Any, jax.Array, dict]:
    """Mean gradient of the loss over `accum_steps` equal micro-batches of `tokens_BxT` (a lax.scan).

    Returns (grads, updated since_active counters, the per-micro-batch values the step's metrics are
    made of (`STEP_METRICS`' sources), stacked on axis 0).

    `shards` = (mesh axes, their size): called inside a shard_map over those axes with this device's
    rows (`accumulate_then_reduce`); each micro-batch's neuron counts are summed over the devices
    (the dead-neuron counters see the global micro-batch), and the gradients and the metrics'
    sources are left local: the caller reduces them.
    """
    track = tracks_neurons(cfg)
    aux_sources = sorted({metric.source for metric in step_metrics_of(cfg) if metric.reduce != "step"}
                         - {"loss", "ce"})
    rows, width = tokens_BxT.shape
    micro_rows = rows // accum_steps
    micro_tokens = micro_rows * (width - 1) * (1 if shards is None else shards[1])
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
            counts = aux["neuron_active_count"]
            if shards is not None:
                counts = ops.combine_over_shards("sum", counts, shards[0])
            since = update_counters(since, counts, micro_tokens)
        return (grad_sum, since), {"loss": loss, "ce": ce, **{key: aux[key] for key in aux_sources}}

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grad_sum, since), per_micro = jax.lax.scan(micro_step, (zeros, since_LxH), micro_AxMxT)
    return jax.tree.map(lambda g: g / accum_steps, grad_sum), since, per_micro


def accumulate_then_reduce(cfg: ExperimentConfig, graphdef: nnx.GraphDef, params: Any, tokens_BxT: jax.Array,
                           since_LxH: jax.Array, l1_coef: jax.Array, accum_steps: int,
                           shards: tuple[Any, int]) -> tuple[Any, jax.Array, dict]:
    """`accumulate_gradients` with one gradient reduction per optimizer step: inside a shard_map over
    the mesh axes `shards[0]` (of `shards[1]` devices; the weights replicated on each, the rows split),
    each device sums its own micro-batches' gradients and the devices average them once at the end
    (XLA's automatic partitioning, `accumulate_gradients` under jit alone, reduces every micro-batch's
    gradients inside its backward instead: `train.grad_reduce`). The metrics' sources are combined
    over the devices by their kind
    (`ops.SHARD_COMBINE`: counts summed, flags or'ed, means averaged: equal rows per device)."""
    axes, size = shards

    def local(p: Any, tokens: jax.Array, since: jax.Array, coef: jax.Array) -> tuple[Any, jax.Array, dict]:
        grads, since, per_micro = accumulate_gradients(cfg, graphdef, p, tokens, since, coef, accum_steps, shards)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, axes) / size, grads)
        per_micro = {key: ops.combine_over_shards(ops.SHARD_COMBINE.get(key, "mean"), value, axes)
                     for key, value in per_micro.items()}
        return grads, since, per_micro

    replicated, split = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(axes)
    # check_vma=False: the op's Pallas calls inside need no variance annotations (as the op's own
    # shard_map); what leaves is equal on every device (psum'd or computed from psum'd values).
    return jax.shard_map(local, in_specs=(replicated, split, replicated, replicated),
                         out_specs=(replicated, replicated, replicated), axis_names=set(axes),
                         check_vma=False)(params, tokens_BxT, since_LxH, l1_coef)


def make_train_step(cfg: ExperimentConfig, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    accum_steps: int, reduce_once: tuple[Any, int] | None = None
                    ) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict]]:
    """The pure step function (state, batch) -> (state, metrics); jit it with shardings.
    `reduce_once` = (mesh axes, their size): the gradients are reduced once per step
    (`accumulate_then_reduce`) instead of in every micro-batch's backward."""
    track = tracks_neurons(cfg)
    lr_schedule = learning_rate_schedule(cfg.optim, cfg.schedule_steps)
    window = dead_window(cfg)
    reported = step_metrics_of(cfg)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        l1_coef = l1_coefficient(cfg.sparsity, state["step"])
        control = state.get("l1_control")
        params = state["params"]
        coef = l1_coef if control is None else layer_l1_coefficients(l1_coef, control)
        if reduce_once is None:
            grads, since, per_micro = accumulate_gradients(cfg, graphdef, params, batch["tokens"],
                                                           state["since_active"], coef, accum_steps)
        else:
            grads, since, per_micro = accumulate_then_reduce(cfg, graphdef, params, batch["tokens"],
                                                             state["since_active"], coef, accum_steps, reduce_once)
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

        step_values = {"l1_coef": l1_coef, "lr": lr_schedule(state["step"]), "grad_norm": grad_norm,
                       "reinit_count": reinit_count}
        if track:
            step_values["dead_share"] = dead_share(since, window)
        new_state = {"params": params, "opt_state": opt_state, "step": step, "since_active": since}
        if control is not None:
            new_state["l1_control"] = adapt_l1_control(
                control, jnp.mean(per_micro["l0"], axis=0),
                moving_targets(cfg.sparsity, cfg.model.d_ff, state["step"]), cfg.sparsity.target_rate)
            step_values["l1_coef_per_layer"] = layer_l1_coefficients(
                l1_coefficient(cfg.sparsity, step), new_state["l1_control"])
        metrics = {metric.name: step_values[metric.source] if metric.reduce == "step"
                   else REDUCTIONS[metric.reduce](per_micro[metric.source], cfg) for metric in reported}
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
    """(params, tokens_BxT) -> sums over the batch of CE and per-layer active neurons, and the token
    count; where the run tracks neurons, also each layer's active count per position summed over
    the rows ("position_active_sum" [L, S], "rows"): inference's hints by row length."""
    track = tracks_neurons(cfg)

    def eval_step(params: Any, tokens_BxT: jax.Array) -> dict[str, jax.Array]:
        logits, aux = apply_model(graphdef, params, tokens_BxT[:, :-1], track_neurons=track)
        ce_BxS = optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BxT[:, 1:])
        tokens = jnp.float32(ce_BxS.size)
        out = {"ce_sum": jnp.sum(ce_BxS), "tokens": tokens, "l0_sum_per_layer": aux["l0"] * tokens}
        if track:
            rows = jnp.float32(ce_BxS.shape[0])
            out.update(position_active_sum=aux["position_active"] * rows, rows=rows)
        return out

    return eval_step
