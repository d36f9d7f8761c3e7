"""The op-planning policy of a training run: which program the sparse op's backend "auto" compiles,
kept up to date with the run's own telemetry. `Trainer` owns one `PlanController` and calls it at
four points (start, before a step, after a step's metrics, at a step's boundary); everything about
hints, re-planning, the plan trial and recompiling is here.

Hints. When the sparse op runs backend "auto" and the user gave no hint (`manages_auto_hints`), the
controller supplies `model.ffn_expected_active` itself, so that "auto" decides dense vs sparse per
layer at trace time and compiles exactly one path (without a hint it compiles both behind a
device-side branch, which costs time and memory). A run measures each layer's mean active neurons
per token with one forward on the first micro-batch of the batch it trains next, with the
parameters it starts from (through the dense backend: the same counts): a fresh run's initial ones
(~50% active, so the step compiled is exactly the dense one), a resumed run's trained ones (the
hints its checkpoint was compiled with may be those measured at initialisation, long out of date).
Every `train.auto_refresh_every` steps the mean of the steps' l0_per_layer since the last re-plan
(fetched for logging anyway: no extra host sync; a mean, so one noisy step does not flip a layer)
gives new per-layer decisions (`auto_decisions`, which is `ops.auto_decision`, i.e. the op's own
plan); only when one changes are the hints replaced by that mean and the step recompiled, once,
with a log line naming every layer's decision. The hints in use go into every metrics record
(`auto_hints_per_layer`) and into the checkpoints' config. A run that tracks neurons (a ReLU model,
`sparsity.track_neurons`) hints each layer's expected dense tails of the sparse backward too
(`model.ffn_expected_tails`, `auto_tail_hints_per_layer`): the token-tail, hot-neuron and hot-entry
shares the step measures from the op's counts for any plan (`ops.backward_tail_shares`, logged as
`token_tail_share_per_layer`, ...), measured and averaged like l0, so that the cost model prices the
tails of the layer's real pattern and not only its mean active count.

Several processes. Every decision here changes the program each process compiles, and processes
that compile different programs deadlock in their first collective. So process 0 decides and the
others take its values (`parallel.lead_value`): the hints measured at the start and at each
re-plan, and the step times a trial's verdict is drawn from.

The trial. A plan with a sparse piece is then checked on the run (`plan_trial.py`,
`train.auto_trial_steps`): that many timed steps with it, the dense program (compiled once per run)
as many, and the sparse plan is kept only at >= 0.98x dense's median step time; otherwise the dense
program runs until the next re-plan, which checks again. Each record names the program its step
ran (`ffn_plan`); the summary lists the trials (`auto_plan_trials`). The steps of a trial, and
re-plan steps, are finished synchronously (`needs_sync`): their times and metrics decide the next
step's program.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import ops
from twell_jax.config import ExperimentConfig, ModelConfig
from twell_jax.data import DataSource
from twell_jax.model import apply_model, build_op_config, init_model
from twell_jax.training import parallel
from twell_jax.training.hints import (Tails, describe_tails, manages_auto_hints, normalise_tails,
                                      tails_from_shares, with_hints)
from twell_jax.training.plan_trial import PlanTrial

Decision = tuple[str, str]  # (forward, backward) of one layer's op call, as ops.auto_decision names them
# The trainer's compiler: (state, config) -> (executable of that config's train step, compile seconds).
CompileStep = Callable[[Any, ExperimentConfig], tuple[Any, float]]


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
        # The op splits the batch over all the mesh's axes, or (data_axis None) sees all of it: a
        # data_axis naming only some of parallel.BATCH_AXES is refused before training (preflight).
        per_shard = cfg.train.micro_batch * (num_devices if op_config.data_axis is None else 1)
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


class PlanController:
    """The plan of one run's train step. For a run that does not manage "auto" hints (`active`
    False) it compiles the step once and does nothing else.

    Calls, in order: `start` (hints, first compile), then per step `runner` (the executable to
    run), `timed` (the step's seconds: the trial), `observe` (its metrics), and at a step's boundary
    `replan` (on re-plan steps). `step_cfg` is the config the step in use was compiled with."""

    def __init__(self, cfg: ExperimentConfig, *, num_devices: int, mesh: Any, data: DataSource,
                 compile_step: CompileStep, track_tails: bool):
        self.cfg, self.num_devices, self.mesh, self.data = cfg, num_devices, mesh, data
        self._compile_step = compile_step
        self.track_tails = track_tails
        self.active = manages_auto_hints(cfg.model)
        self.auto_hints: tuple[float, ...] | None = None  # the "auto" hints compiled in (managed runs)
        self.auto_tails: Tails | None = None  # and their tail hints (runs that track neurons)
        self.decisions: tuple[Decision, ...] | None = None  # their per-layer (forward, backward)
        # Sums of the per-layer l0 (and tail shares [L, 3]) of the steps since the last re-plan, and
        # the number of steps.
        self._l0_sum: np.ndarray | None = None
        self._tails_sum: np.ndarray | None = None
        self._l0_steps = 0
        # The A/B of a sparse plan against the dense program: the trial under way, the plan kept by
        # the last one, the executables (the plan's; dense's, compiled once), the record.
        self.trial: PlanTrial | None = None
        self.plan_in_use = "auto"
        self._compiled: Any = None
        self._dense_compiled: Any = None
        self.trials: list[dict[str, Any]] = []

    @property
    def step_cfg(self) -> ExperimentConfig:
        """The config the step is compiled with: `cfg` plus the "auto" hints in use (if any)."""
        return self.cfg if self.auto_hints is None else with_hints(self.cfg, self.auto_hints, self.auto_tails)

    # ------------------------------------------------------------------ start
    def start(self, state: Any, *, resumed: bool, echo: Callable[[str], None]) -> float:
        """Set the first hints (managed runs: measured with `state`'s parameters, logged) and
        compile the step; its compile seconds."""
        if self.active:
            hints, tails = self.measure(state)
            hints, tails = self._lead_hints("the 'auto' hints", hints, tails)
            self.use_hints(hints, tails)
            where = f"the parameters of step {int(state['step'])}" if resumed else "the initial parameters"
            refresh = self.cfg.train.auto_refresh_every
            echo(f"[twell] 'auto' backend hints (mean active FFN neurons/token per layer, measured with {where} on "
                 f"the first micro-batch of the next batch): {', '.join(f'{v:.1f}' for v in hints)}"
                 + (f"; backward tails (token-tail / hot-neuron share) {describe_tails(tails)}" if tails else "")
                 + f"; plan: {describe_decisions(self.decisions)}"
                 + (f"; re-planned every {refresh} steps" if refresh else ""))
        self._compiled, seconds = self._compile_step(state, self.step_cfg)
        return seconds

    def measure(self, state: Any) -> tuple[tuple[float, ...], Tails | None]:
        """Mean active neurons per token per layer of `state`'s params on the first micro-batch of
        the batch the loop will train on next (the data iterator is rewound afterwards), and the
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
                                placed["tokens"], tails=self.track_tails)

    @staticmethod
    def _lead_hints(what: str, hints: Sequence[float], tails: Tails | None) -> tuple[Sequence[float], Tails | None]:
        """Process 0's hints and tail hints on every process (a single process: these)."""
        if not parallel.multi_process():
            return hints, tails
        agreed = parallel.lead_value(what, lambda: {
            "hints": [float(v) for v in hints],
            "tails": None if tails is None else [[float(v) for v in t] for t in tails]})
        return agreed["hints"], None if agreed["tails"] is None else tuple(tuple(t) for t in agreed["tails"])

    def use_hints(self, hints: Sequence[float], tails: Tails | None,
                  decisions: tuple[Decision, ...] | None = None) -> None:
        """Plan with these hints (and tail hints) from now on: their decisions (`decisions` when the
        caller has them already). The caller compiles `step_cfg`."""
        self.auto_hints = tuple(float(v) for v in hints)
        self.auto_tails = None if tails is None else normalise_tails(tails)
        self.decisions = decisions or auto_decisions(self.cfg, self.auto_hints, self.num_devices, self.auto_tails)

    # ------------------------------------------------------------------ per step
    def needs_sync(self, step_no: int, end_step: int) -> bool:
        """True when step `step_no` must be finished before the next is dispatched: its time or its
        metrics decide the next step's program (a trial step, a re-plan step)."""
        return self.active and (self.trial is not None or self._replans_at(step_no, end_step))

    def runner(self, state: Any) -> tuple[Any, str | None, float]:
        """(the executable the next step runs, the plan it is ("auto"/"dense"; None for a run that
        does not manage hints), compile seconds spent here: the dense program's first compile)."""
        if not self.active:
            return self._compiled, None, 0.0
        plan = self.plan_in_use if self.trial is None else self.trial.arm()
        seconds = 0.0
        if plan == "dense" and self._dense_compiled is None:
            dense = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, ffn_backend="dense"))
            self._dense_compiled, seconds = self._compile_step(state, dense)
        return (self._compiled if plan == "auto" else self._dense_compiled), plan, seconds

    def timed(self, step_no: int, seconds: float, message: Callable[[str], None]) -> None:
        """The step just finished took `seconds`: feed the trial under way, closing it when decided."""
        if self.trial is None:
            return
        self.trial.add(seconds)
        if not self.trial.decided:
            return
        trial, self.trial = self.trial, None
        # Each process timed its own steps: process 0's times decide for all.
        medians = parallel.lead_value("the plan trial's step times", trial.medians)
        verdict, ratio = trial.verdict(medians), trial.speed_ratio(medians)
        self.plan_in_use = verdict
        self.trials.append({"step": step_no, "auto_step_s": medians["auto"], "dense_step_s": medians["dense"],
                            "auto_vs_dense": ratio, "kept": verdict,
                            "decisions": [list(d) for d in self.decisions]})
        message(f"[twell] step {step_no}: 'auto' plan {medians['auto']:.4f} s/step, dense "
                f"{medians['dense']:.4f} s/step ({ratio:.3f}x dense): "
                + ("keeping the 'auto' plan" if verdict == "auto" else
                   f"running the dense program (the plan is under {trial.floor:g}x dense)"))

    def record_fields(self, plan: str | None) -> dict[str, Any]:
        """What a step's record says about its plan: the hints in use, the program it ran."""
        fields: dict[str, Any] = {}
        if self.auto_hints is not None:
            fields["auto_hints_per_layer"] = list(self.auto_hints)
        if self.auto_tails is not None:
            fields["auto_tail_hints_per_layer"] = [list(t) for t in self.auto_tails]
        if self.active:
            fields["ffn_plan"] = plan
        return fields

    def observe(self, host: dict[str, Any]) -> None:
        """Add one step's per-layer l0 (and tail shares, when the step reports them) to the means
        the next re-plan decides from."""
        if not self.active:
            return
        l0 = np.asarray(host["l0_per_layer"], np.float64)
        self._l0_sum = l0 if self._l0_sum is None else self._l0_sum + l0
        if all(f"{key}_per_layer" in host for key in ops.TAIL_SHARE_KEYS):
            tails = np.asarray(tails_from_shares(host, "_per_layer"))
            self._tails_sum = tails if self._tails_sum is None else self._tails_sum + tails
        self._l0_steps += 1

    # ------------------------------------------------------------------ re-planning
    def _replans_at(self, step_no: int, end_step: int) -> bool:
        every = self.cfg.train.auto_refresh_every
        return bool(every) and step_no % every == 0 and step_no < end_step

    def replan(self, step_no: int, end_step: int, state: Any, message: Callable[[str], None]) -> tuple[bool, float]:
        """At step `step_no`'s boundary (every train.auto_refresh_every steps): re-plan, recompile
        when a decision changed, and start a trial of a sparse plan (or re-check a dense verdict).
        Returns (whether `step_cfg` changed, compile seconds)."""
        if not (self.active and self._replans_at(step_no, end_step)):
            return False, 0.0
        if self.refresh_hints(step_no, message):
            self._compiled, seconds = self._compile_step(state, self.step_cfg)
            self.plan_in_use = "auto"
            self.maybe_start_trial(step_no, message)
            return True, seconds
        if self.plan_in_use == "dense":  # the patterns move: check the plan again
            self.maybe_start_trial(step_no, message)
        return False, 0.0

    def refresh_hints(self, step_no: int, message: Callable[[str], None]) -> bool:
        """Re-plan from the mean l0 (and tail shares) of the steps since the last re-plan, so that
        one noisy step near a dense/sparse threshold does not flip the plan; True when some layer's
        decision changed (the caller then recompiles). Unchanged decisions keep the hints."""
        mean_l0 = (self._l0_sum / self._l0_steps).tolist()
        mean_tails = None if self._tails_sum is None else normalise_tails(self._tails_sum / self._l0_steps)
        mean_l0, mean_tails = self._lead_hints("the re-planned 'auto' hints", mean_l0, mean_tails)
        # The next re-plan averages the steps after this one.
        self._l0_sum, self._tails_sum, self._l0_steps = None, None, 0
        decisions = auto_decisions(self.cfg, mean_l0, self.num_devices, mean_tails)
        if decisions == self.decisions:
            return False
        changed = [i for i, (old, new) in enumerate(zip(self.decisions, decisions)) if old != new]
        self.use_hints(mean_l0, mean_tails, decisions)
        message(f"[twell] step {step_no}: 'auto' plan changed in layer(s) {changed}; recompiling the step "
                f"with hints {', '.join(f'{v:.1f}' for v in self.auto_hints)}"
                + (f", backward tails {describe_tails(mean_tails)}" if mean_tails else "")
                + f": {describe_decisions(decisions)}")
        return True

    def maybe_start_trial(self, step_no: int, message: Callable[[str], None]) -> None:
        """Start an A/B of the compiled "auto" plan against dense (plan_trial.py) when the plan has a
        sparse piece and train.auto_trial_steps > 0."""
        steps = self.cfg.train.auto_trial_steps
        if not (self.active and steps and any(d != ("dense", "dense") for d in self.decisions)):
            return
        self.trial = PlanTrial(steps)
        message(f"[twell] step {step_no}: timing the 'auto' plan against the dense program over the "
                f"next {2 * (steps + 1)} steps (train.auto_trial_steps={steps})")

    # ------------------------------------------------------------------ results
    def checkpoint_fields(self) -> dict[str, Any]:
        """What a checkpoint's meta records of the plan: the hints its step was compiled with."""
        return {"auto_hints": list(self.auto_hints) if self.auto_hints is not None else None}

    def summary_fields(self) -> dict[str, Any]:
        return {"auto_hints_per_layer": list(self.auto_hints) if self.auto_hints is not None else None,
                "ffn_plan_in_use": self.plan_in_use if self.active else None,
                "auto_plan_trials": self.trials}
