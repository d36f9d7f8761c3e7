"""The checks a training run makes before it touches anything, and what `twell train --dry-run`
runs too: the config (`model.ffn_op_config`, the learning-rate schedule against train.steps, the
tokenizer against the embedding, warm-ups longer than the run), a resume's checkpoint and config
(`checked_run_config`), a memory estimate and the refusal of a model that cannot fit the device
(`check_fits_memory`), and in a multi-process run that every process has the same config, devices,
data and run directory. The run directory's own checks (a new run's directory, its name, its lock)
are `twell_jax/run_dir.py`'s.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import jax

from twell_jax import config as config_lib
from twell_jax import ops
from twell_jax import run_dir as run_dir_lib
from twell_jax.config import ExperimentConfig
from twell_jax.data import DataSource
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax.training import parallel
from twell_jax.training.metrics import device_memory_limit_bytes


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
    """`model.ffn_op_config` holds valid SparseFFNConfig fields (checked by constructing one), and a
    data_axis that splits the tokens over every axis of the trainer's mesh (or None: no shard_map):
    a Pallas call left on an axis it does not name would be partitioned by GSPMD."""
    try:
        op_config = ops.SparseFFNConfig(**cfg.model.ffn_op_config)
    except TypeError as err:
        known = ", ".join(f.name for f in dataclasses.fields(ops.SparseFFNConfig))
        raise ValueError(f"model.ffn_op_config={cfg.model.ffn_op_config!r}: {err} (known keys: {known})") from None
    except ValueError as err:
        raise ValueError(f"model.ffn_op_config={cfg.model.ffn_op_config!r}: {err}") from None
    axes = op_config.data_axis
    if axes is not None and not set(parallel.BATCH_AXES) <= set(op_config.data_axes):
        raise ValueError(f"model.ffn_op_config data_axis={axes!r} must name both mesh axes the trainer splits the "
                         f"batch over, {list(parallel.BATCH_AXES)}, or be None (the op then sees the whole batch)")


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


def _state_bytes(cfg: ExperimentConfig, shards: int) -> dict[str, int]:
    """One device's share of the f32 parameters, AdamW's state and the gradients, split over `shards`."""
    params = cfg.model.num_params()
    return {"parameters": -(-params * _PARAM_BYTES // shards), "optimizer_state": -(-params * _ADAM_BYTES // shards),
            "gradients": -(-params * _GRAD_BYTES // shards)}


def memory_estimate(cfg: ExperimentConfig, num_devices: int, fsdp_size: int | None = None) -> dict[str, int]:
    """A rough estimate of one device's memory for training `cfg` over `num_devices` devices, in bytes:
    the f32 parameters, AdamW's state and the gradients (split over the `fsdp_size` devices of an
    FSDP group; None = the group of the layout train.sharding resolves to, `training_layout`), and
    the activations one micro-batch keeps for its backward without rematerialisation (per layer:
    the block's [tokens, d_model] tensors, the FFN's hidden activations, the attention
    probabilities; then the f32 logits and their softmax). XLA's own figure is the compiled step's
    memory analysis, which the run logs."""
    m, tc = cfg.model, cfg.train
    shards = training_layout(cfg, num_devices, agree=False).fsdp_size if fsdp_size is None else fsdp_size
    tokens = tc.micro_batch * cfg.seq_len
    act = 2 if m.compute_dtype == "bfloat16" else 4
    per_layer = tokens * (6 * m.d_model + 2 * m.kv_dim + (3 if m.kind.gated else 2) * m.d_ff) * act \
        + tc.micro_batch * m.n_heads * cfg.seq_len ** 2 * act
    estimate = {**_state_bytes(cfg, shards),
                "activations_per_micro_batch": m.n_layers * per_layer + 2 * tokens * m.vocab_size * 4}
    estimate["total"] = sum(estimate.values())
    return estimate


def training_layout(cfg: ExperimentConfig, num_devices: int, *, agree: bool = True) -> parallel.Layout:
    """The layout train.sharding resolves to over `num_devices` devices (`parallel.resolve_layout`):
    "auto" weighs the unsharded f32 parameters, AdamW state and gradients against the memory JAX
    may use on a device (memory_stats' bytes_limit; none on a CPU: taken to fit). With `agree`, a
    multi-process run takes process 0's answer (the devices' limits may differ by a few bytes)."""
    def resolve() -> parallel.Layout:
        return parallel.resolve_layout(
            cfg.train.sharding, num_devices, fsdp_size=cfg.train.fsdp_size,
            state_bytes=sum(_state_bytes(cfg, 1).values()),
            memory_limit=device_memory_limit_bytes() if cfg.train.sharding == "auto" else None,
            platform=jax.local_devices()[0].platform)

    if not agree or not parallel.multi_process():
        return resolve()
    return parallel.Layout(**parallel.lead_value("the sharding layout", lambda: dataclasses.asdict(resolve())))


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


def check_fits_memory(cfg: ExperimentConfig, num_devices: int, layout: parallel.Layout | None = None
                      ) -> tuple[dict[str, int], int | None, str]:
    """(`memory_estimate` under `layout` (None: `training_layout`), the device memory, its source);
    a ValueError naming both when the parameters and optimizer state alone exceed the device memory.
    Only that clear case is refused: XLA's allocation would abort the process later with a C++
    trace, after the run directory was made."""
    layout = training_layout(cfg, num_devices, agree=False) if layout is None else layout
    estimate = memory_estimate(cfg, num_devices, fsdp_size=layout.fsdp_size)
    available, source = device_memory_bytes(num_devices)
    state = estimate["parameters"] + estimate["optimizer_state"]
    if available is not None and state > available:
        m = cfg.model
        raise ValueError(f"the model cannot fit: {m.num_params():.3g} parameters (model.d_model={m.d_model}, "
                         f"n_layers={m.n_layers}, d_ff={m.d_ff}, vocab_size={m.vocab_size}) need "
                         f"{_bytes_text(state)} per device for the f32 parameters and AdamW state alone "
                         f"(~{_bytes_text(estimate['total'])} with gradients and activations), but a device has "
                         f"{_bytes_text(available)} ({source}); shrink the model"
                         + (" or shard it with train.sharding=fsdp" if layout.fsdp_size < num_devices else ""))
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
    parallel.check_like_lead(
        "config", config_lib.to_dict(cfg),
        lambda lead, mine: "; ".join(f"{path} {new!r} (process 0: {old!r})" for path, old, new in config_lib.diff(lead, mine)),
        "the processes were started with different configs",
        "start every process with the same command (--config, --set, --out, --resume)")


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


def check_processes_see_same_checkpoints(directory: str | Path, seen: dict[str, str | None]) -> None:
    """A multi-process run that reads a run's checkpoints (evaluation): every process must see the
    same files (`seen`: `checkpoint.saved_files_digest(directory)`) before Orbax reads them with all
    of them; otherwise every process raises the same ValueError naming what differs where."""

    def differences(lead: dict[str, str | None], mine: dict[str, str | None]) -> str:
        missing = [key for key in lead if key not in mine]
        extra = [key for key in mine if key not in lead]
        changed = [key for key in lead if key in mine and mine[key] != lead[key]]
        return "; ".join(part for part in (
            f"no {', '.join(missing)}" if missing else "", f"{', '.join(extra)} that process 0 lacks" if extra else "",
            f"other contents of {', '.join(changed)}" if changed else "") if part)

    parallel.check_like_lead("checkpoints", seen, differences,
                             f"the processes see different checkpoints at {Path(directory).absolute()}",
                             "every process needs the run on a file system they share, at the same path (or "
                             "identical copies)")


def check_shared_run_dir(run_dir: str | Path, lock: run_dir_lib.RunLock | None) -> None:
    """A multi-process run: every process must see the run directory that process 0 locked (`lock`,
    None on the other processes), else every process raises a ValueError naming the directory. Run
    before anything is written to it but the lock, so a refused run leaves nothing behind. Where
    the file system has no flock (no lock file to look at) nothing is checked."""
    if not parallel.multi_process():
        return
    holder = parallel.lead_value("the run directory's lock", lambda: lock.holder if lock is not None else None)
    with parallel.all_or_none("checking that every process sees the run directory"):
        if parallel.is_lead() or holder is None:
            return
        path = Path(run_dir) / run_dir_lib.LOCK_FILE
        try:
            seen = path.read_text().strip()
        except OSError as err:
            seen = f"nothing ({err.strerror})"
        if seen != holder:
            raise ValueError(f"--out {Path(run_dir).absolute()}: process {jax.process_index()} does not see the run "
                             f"directory process 0 locked ({path.name} holds {holder!r} there, {seen!r} here): every "
                             "process of a multi-process run needs --out on a file system they share, at the same "
                             "path (run from the same directory, or give an absolute --out)")


def checked_run_config(cfg: ExperimentConfig, run_dir: Path | None, *, resume: bool,
                       overwrite: bool) -> tuple[ExperimentConfig, ExperimentConfig | None]:
    """The checks a run makes before it touches anything (what `twell train --dry-run` runs too):
    (the config to train with, its schedule fixed; the saved config of the run resumed, or None).
    A resume needs a checkpoint in `run_dir` and a compatible config; a new run a `run_dir` it may
    use (`run_dir.check_new_run_dir`; None: a new runs/<name>-<time>)."""
    check_op_config(cfg)
    run_dir_lib.check_run_name(cfg.name)
    if not resume:
        cfg = config_lib.with_fixed_schedule(cfg)
        check_schedule_covers_steps(cfg, resume=False)
        if run_dir is not None:
            run_dir_lib.check_new_run_dir(run_dir, overwrite=overwrite)  # raises, naming the directory
        return cfg, None
    if run_dir is None:
        raise ValueError("--resume needs --out DIR (the run directory to continue)")
    ckpt_dir = run_dir / run_dir_lib.CHECKPOINT_SUBDIR
    if not run_dir_lib.has_steps(ckpt_dir):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir.absolute()} (is --out the run "
                                "directory of the run to continue?)")
    saved = ckpt_lib.load_run_config(run_dir)
    if not cfg.optim.schedule_steps:  # keep the run's schedule unless one is asked for
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_steps=saved.schedule_steps))
    ckpt_lib.check_compatible(config_lib.to_dict(saved), cfg)
    check_schedule_covers_steps(cfg, resume=True)
    return cfg, saved
