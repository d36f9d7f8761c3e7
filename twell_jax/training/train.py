"""Training: the `Trainer` loop (and `train`, its one-call wrapper) around the jit-compiled step.

The loop's pieces each have a module: the step and its metrics table (`step.py`), the checks a
run makes before it touches anything (`preflight.py`), the run directory (`twell_jax/run_dir.py`),
checkpoints (`checkpoint.py`), evaluation (`evaluate.py`), the op's "auto" planning
(`planning.py`), the metrics sink (`metrics.py`), stop signals (`signals.py`), meshes and
processes (`parallel.py`).

All mesh plumbing lives in `Trainer.__init__` (one place): a "data" x "fsdp" mesh over
`train.num_devices` devices (`twell_jax.training.parallel.make_mesh`) whose shape is the layout
`train.sharding` resolves to (`preflight.training_layout`, printed at the start), params / optimizer
state split over "fsdp" and replicated over "data", the batch split over both. The step is `jax.jit` with
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

A run directory holds one run (twell_jax/run_dir.py): a new run refuses a non-empty directory
unless it holds a twell run and is told to overwrite; `resume=True` continues from the newest
intact checkpoint (or `step`), with the run's saved config as the reference, and is refused when
nothing is left to train or its last steps would run at learning rate 0. One process at a time
holds the directory (`run_dir.RunLock`). SIGINT/SIGTERM finish the current step, checkpoint
and raise `TrainingInterrupted`; a second one aborts at once. A model whose parameters and
optimizer state cannot fit the device's memory is refused before the directory is touched
(`preflight.check_fits_memory`).

Which program the step compiles (the sparse op's "auto" hints, re-plans, the A/B of a sparse plan
against dense) is the op-planning policy of `planning.PlanController`; the trainer calls it at the
start, per step and at a step's boundary.

Several processes (jax.distributed, docs/parallel.md) train in one run directory on a shared file
system: process 0 reserves and locks it and alone writes its files; every process checks the run,
and one that fails stops them all (`parallel.all_or_none`); their configs, device counts and data
must be equal (`preflight.check_processes_agree`, `check_processes_read_same_data`); Orbax saves and
restores with every process. Each stop is agreed by a vote inside the step (`step.with_stop_vote`),
so every process stops after the same step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib
from twell_jax.config import ExperimentConfig
from twell_jax.data import DataSource
from twell_jax.training.shared_data import build_experiment_data
from twell_jax.data import tokenizer as tokenizer_lib
from twell_jax.model import describe_execution, init_model, split_model
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax.training import parallel
from twell_jax.training.evaluate import evaluate_params
from twell_jax.training.metrics import (MetricsSink, check_finite, device_memory_limit_bytes, device_peak_memory_bytes,
                                        mfu, model_flops_per_token, peak_bf16_flops, to_python)
from twell_jax.training.optimizer import build_optimizer, learning_rate_schedule
from twell_jax.training.planning import PlanController, abstract_graphdef
from twell_jax.training.preflight import (check_fits_memory, check_processes_agree, check_processes_read_same_data,
                                          check_resume_steps, check_shared_run_dir, check_vocab, checked_run_config,
                                          schedule_warnings, training_layout)
from twell_jax.training.profiling import ProfileWindow
from twell_jax.training.signals import StopSignals
from twell_jax.training.step import (GUARDED_METRICS, STOP_REASONS, STOP_VOTE, TrainState, dead_share_per_layer,
                                     make_eval_step, make_train_step, state_extras, tracks_neurons, with_stop_vote)

logger = logging.getLogger(__name__)


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


class Trainer:
    """Builds mesh, model, optimizer, data and checkpoint store for one run; `run()` trains.

    resume=True continues the run in `run_dir`: `cfg` may differ from the run's saved config only in
    config.RESUMABLE_FIELDS; `resume_step` picks a checkpoint (default: the newest intact one); it
    is refused when its last steps would train at learning rate 0 (`check_schedule_covers_steps`)
    or nothing is left to train (`check_resume_steps`). A new run needs an empty (or missing)
    `run_dir`, or `overwrite=True` and a directory holding a twell run (run_dir.check_new_run_dir).
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
            num_devices = parallel.mesh_size(parallel.make_mesh(cfg.train.num_devices))
            # Where the state lives (agreed: every process builds the same mesh).
            self.layout = training_layout(cfg, num_devices)
            # A model that cannot fit is refused before the run directory is made (XLA would abort the process).
            check_fits_memory(cfg, num_devices, self.layout)
        check_processes_agree(cfg)
        # One process at a time in a run directory (multi-process runs: process 0 holds it for all).
        created = not self.run_dir.exists()
        self._lock = None
        try:
            with parallel.all_or_none("locking the run directory"):
                self._lock = run_dir_lib.RunLock(self.run_dir, warn=echo) if parallel.is_lead() else None
            check_shared_run_dir(self.run_dir, self._lock)
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
        self.mesh = parallel.make_mesh(tc.num_devices, self.layout.fsdp_size)
        self.num_devices = parallel.mesh_size(self.mesh)
        self.accum_steps = parallel.check_batch_layout(tc.global_batch, tc.micro_batch, self.num_devices)
        # One gradient reduction per optimizer step (train.grad_reduce "step"): where the weights are
        # replicated and a step accumulates several micro-batches on each of several devices.
        self.reduce_once = ((parallel.BATCH_AXES, self.num_devices)
                            if tc.grad_reduce == "step" and self.layout.fsdp_size == 1 and self.num_devices > 1
                            and self.accum_steps > 1 else None)
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
        self.data = data_builder(run_dir_lib.with_saved_tokenizer(cfg, self.run_dir) if resume else cfg)
        self.startup["data"] = time.perf_counter() - t0
        check_vocab(cfg, self.data.vocab_size, echo)
        check_processes_read_same_data(self.data)
        if resume:
            run_dir_lib.check_corpus_fingerprint(self.run_dir, self.data.source_fingerprint, echo)
        else:  # what a new run records of its tokenizer, checked first against its parameters' own
            tokenizer = tokenizer_lib.tokenizer_record(self.data.tokenizer_json_path)
            self.check_tokenizer(tokenizer["tokenizer"])

        abstract_model = nnx.eval_shape(lambda: init_model(cfg.model, tc.seed))
        abstract_params = nnx.to_pure_dict(nnx.split(abstract_model)[1])
        self.optimizer = build_optimizer(cfg.optim, cfg.schedule_steps)
        abstract_train_state = {
            "params": abstract_params,
            "opt_state": jax.eval_shape(self.optimizer.init, abstract_params),
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            **jax.eval_shape(lambda: state_extras(cfg)),
        }
        self.state_shardings = parallel.param_shardings(self.mesh, abstract_train_state)
        self.abstract_state = abstract_train_state
        # The op-planning policy ("auto" hints, re-plans, the plan trial): planning.py.
        self.planner = PlanController(cfg, num_devices=self.num_devices, mesh=self.mesh, data=self.data,
                                      compile_step=self._compile, track_tails=tracks_neurons(cfg))
        # Everything that can be checked has been: only now may a new run take over the directory
        # (process 0 alone writes the run's files; the others use them).
        if not resume and parallel.is_lead():
            run_dir_lib.prepare_new_run_dir(self.run_dir, overwrite=overwrite)
            if self.data.tokenizer_json_path:
                run_dir_lib.save_tokenizer(self.run_dir, self.data.tokenizer_json_path)
            run_dir_lib.save_corpus_fingerprint(self.run_dir, self.data.source_fingerprint, tokenizer)
            run_dir_lib.write_config(self.run_dir, cfg)
        # Orbax opens the checkpoints on every process together, after --overwrite removed the old ones.
        parallel.barrier("preparing the run directory")
        self.store = ckpt_lib.CheckpointStore(self.run_dir / run_dir_lib.CHECKPOINT_SUBDIR,
                                              max_to_keep=tc.keep_checkpoints)

    def check_tokenizer(self, tokenizer_hash: str | None) -> None:
        """A new run's check of its data's tokenizer (`tokenizer_hash`, None: none) before its
        directory is prepared; nothing to check for a run from an initialisation (InitFromParams
        checks its parameters' own)."""

    # ------------------------------------------------------------------ state
    def init_state(self) -> TrainState:
        cfg = self.cfg

        def init() -> TrainState:
            params = split_model(init_model(cfg.model, cfg.train.seed))[1]
            return {"params": params, "opt_state": self.optimizer.init(params),
                    "step": jnp.zeros((), jnp.int32), **state_extras(cfg)}

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
            run_dir_lib.write_config(self.run_dir, self.cfg)
        for moved in self.store.quarantine_after(step, self.run_dir):
            self.echo(f"[twell] warning: continuing from step {step}: newer checkpoint moved to {moved}")
        return {"params": items[ckpt_lib.PARAMS_ITEM], **items[ckpt_lib.TRAIN_ITEM]}, meta

    def save(self, state: TrainState, history: list[dict[str, Any]]) -> None:
        # The config with the "auto" hints in use: what evaluation / inference of this step should run.
        meta = {"config": config_lib.to_dict(self.planner.step_cfg),
                "data_iter": ckpt_lib.iterator_state_to_json(self.data.train_iter.get_state()),
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
        with jax.set_mesh(self.mesh), StopSignals(on_abort=self.release) as signals:
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
                      + (f", TensorBoard: {self.run_dir / run_dir_lib.TENSORBOARD_SUBDIR}" if tc.tensorboard else "")
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
                run_dir_lib.write_summary(self.run_dir, summary)
            self.echo(f"[twell] summary: {self.run_dir / run_dir_lib.SUMMARY_FILE}")
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
        self.data.train_iter.set_state(ckpt_lib.iterator_state_from_json(meta["data_iter"]))
        self.echo(f"[twell] resumed from step {int(state['step'])} ({self.store.directory})")
        return state, meta.get("history", [])

    def _eval_fn(self) -> Callable:
        step_cfg = self.planner.step_cfg
        return jax.jit(make_eval_step(step_cfg, abstract_graphdef(step_cfg.model, self.cfg.train.seed)))

    def _at_boundary(self, loop: "_Loop", step_no: int, signals: "StopSignals") -> bool:
        """True when step `step_no` is finished before the next is dispatched: something at its end
        needs its state or its metrics (the last step, an evaluation, a checkpoint, a re-plan or a
        trial step, a should_stop hook) or the run stops after it (a signal, the time limit).
        Other steps' metrics are fetched once the next step is dispatched: no host sync per step."""
        tc = self.cfg.train
        return (step_no == loop.end_step or self.planner.needs_sync(step_no, loop.end_step)
                or self.profile.needs_sync(step_no) or bool(tc.eval_every and step_no % tc.eval_every == 0)
                or bool(tc.checkpoint_every and step_no % tc.checkpoint_every == 0)
                or self.hooks.should_stop is not None or self._stopping(loop, signals) is not None)

    def _local_stop(self, loop: "_Loop", signals: "StopSignals") -> str | None:
        """What this process alone would stop for now: a signal's name, "time_limit" or None."""
        tc = self.cfg.train
        if signals.received:
            return signals.received
        if tc.time_limit_s and time.perf_counter() - loop.start >= tc.time_limit_s:
            return "time_limit"
        return None

    def _stopping(self, loop: "_Loop", signals: "StopSignals") -> str | None:
        """Why the run stops after the step in hand (a signal's name, "time_limit"), or None. In a
        multi-process run a process's own reasons only go into its stop vote (`_next_batch`): the
        answer is what the processes agreed on in the last step fetched, the same on every process,
        so that all stop after the same step and save the same checkpoint."""
        return loop.agreed_stop if parallel.multi_process() else self._local_stop(loop, signals)

    def _next_batch(self, loop: "_Loop", signals: "StopSignals") -> dict[str, Any]:
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
                  signals: "StopSignals") -> None:
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
                  f"{cfg.sparsity.l1_coef:g}" + (
                      f", adapted per layer towards sparsity.target_active (mean "
                      f"{sum(cfg.sparsity.target_active) / cfg.model.n_layers:.1f} active/token)"
                      if cfg.sparsity.target_active else ""))
        self.echo(f"[twell] {describe_execution(cfg.model, cfg.seq_len)}")
        for warning in schedule_warnings(cfg):
            self.echo(warning)
        limit = device_memory_limit_bytes()
        usable = f" ({limit / 2**30:.1f} GiB usable each)" if limit else ""
        self.echo(f"[twell] devices: {self.num_devices} x {jax.devices()[0].platform}{usable}; global batch "
                  f"{tc.global_batch} x {cfg.seq_len} tokens = {tokens_per_step} tokens/step; micro-batch "
                  f"{tc.micro_batch}/device, {self.accum_steps} accumulation step(s)")
        self.echo(f"[twell] sharding: {self.layout.describe()}")
        if self.num_devices > 1:
            self.echo("[twell] gradients: " + (
                f"each device sums its {self.accum_steps} micro-batches' gradients, reduced once a step "
                "(train.grad_reduce=step)" if self.reduce_once else
                "reduced in each micro-batch's backward" + (
                    " (train.grad_reduce=micro_batch)" if tc.grad_reduce == "micro_batch"
                    else " (one micro-batch a step)" if self.accum_steps == 1 else " (FSDP: reduce-scattered)")))
        if parallel.multi_process():  # e.g. a launcher that gave each process one GPU of its host
            self.echo(f"[twell] processes: this is process {jax.process_index()} of {jax.process_count()}, "
                      f"{jax.local_device_count()} device(s) each; process 0 writes the run's files")

    def _compile(self, state: TrainState, cfg: ExperimentConfig) -> tuple[Any, float]:
        """The train step compiled for `cfg` (the planner's step config, or its dense program)."""
        self.step_builds += 1
        train_step = make_train_step(cfg, abstract_graphdef(cfg.model, self.cfg.train.seed), self.optimizer,
                                     self.accum_steps, self.reduce_once)
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
            # The layout train.sharding resolved to (its "auto" chose one): the mesh's two axes.
            "mesh": {parallel.DATA_AXIS: self.layout.replicas, parallel.FSDP_AXIS: self.layout.fsdp_size},
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
    `init_tokenizer`: (hash, where) of the tokenizer they were trained with (`data.tokenizer.
    run_tokenizer_hash`; `where` names their source in the error): the run's data must share it.
    """

    def __init__(self, *args: Any, init_params: Any, init_tokenizer: tuple[str | None, str] | None = None,
                 **kwargs: Any):
        if kwargs.get("resume"):
            raise ValueError("init_params start a new run; resume=True continues one from its checkpoint")
        self._init_params = init_params
        self._init_tokenizer = init_tokenizer
        super().__init__(*args, **kwargs)

    def check_tokenizer(self, tokenizer_hash: str | None) -> None:
        if self._init_tokenizer is None:
            return
        want, where = self._init_tokenizer
        tokenizer_lib.check_same_tokenizer(
            tokenizer_hash, f"the run's data.tokenizer={self.cfg.data.tokenizer!r}", want, f"the tokenizer of {where}",
            "set data.tokenizer to the tokenizer.json the parameters were trained with")

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


def train(cfg: ExperimentConfig, run_dir: str | Path | None = None, *, resume: bool = False,
          echo: Callable[[str], None] = print, trainer_cls: type[Trainer] = Trainer, **kwargs: Any) -> TrainResult:
    """Convenience wrapper: build a `trainer_cls` (a Trainer) for `cfg` and run it (kwargs go to it);
    run_dir None reserves a new runs/<name>-<time>, removed again if the run fails before using it.
    In a multi-process run process 0 reserves it and every process trains in that one."""
    reserved = run_dir is None
    if reserved:
        run_dir = Path(parallel.lead_value("the run directory", lambda: str(run_dir_lib.default_run_dir(cfg))))
    else:
        run_dir = Path(run_dir)
    try:
        return trainer_cls(cfg, run_dir, resume=resume, echo=echo, **kwargs).run()
    except BaseException:
        if reserved and parallel.is_lead() and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # the directory default_run_dir reserved, unused
        raise
