"""Run telemetry sinks: console (tqdm progress bar + log lines), JSONL, TensorBoard (tensorboardX),
Weights & Biases (optional); and model FLOPs utilisation (MFU)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from twell_jax import run_dir as run_dir_lib


def to_python(value: Any) -> Any:
    """numpy/jax scalars and arrays -> JSON-ready floats/ints/lists."""
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    array = np.asarray(value)
    if array.ndim == 0:
        item = array.item()
        return item
    return array.tolist()


def check_finite(step: int, metrics: dict[str, Any], names: tuple[str, ...], *,
                 hint: str = "training diverged (try a lower optim.lr, a longer optim.warmup_steps or a "
                             "smaller sparsity.l1_coef)") -> None:
    """NaN/Inf guard: raise FloatingPointError naming the step, the first bad metric and `hint`."""
    for name in names:
        if name not in metrics:
            continue
        values = np.asarray(metrics[name], dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise FloatingPointError(f"non-finite {name}={values.tolist()} at step {step}: {hint}")


# ----------------------------------------------------------------------------- model FLOPs utilisation

# Peak dense bf16 tensor-core FLOP/s by device kind (NVIDIA's datasheets; sparsity-doubled figures not
# used), matched as a substring of `device_kind` in this order. A kind not listed has no MFU.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),  # "NVIDIA H100 PCIe"
    ("H100 80GB HBM3", 989.4e12),  # H100 SXM5
    ("H100 SXM", 989.4e12),
    ("H200", 989.4e12),  # "NVIDIA H200" (SXM); the NVL kinds are not listed (below)
    ("A100", 312e12),  # every A100 (SXM4 / PCIe, 40 / 80 GB)
)


def peak_bf16_flops(device_kind: str) -> float | None:
    """The peak dense bf16 FLOP/s of one device of `device_kind` (PEAK_BF16_FLOPS), None when the
    kind is not in the table (a CPU, a GPU we have no figure for, the NVL boards)."""
    if "NVL" in device_kind:
        return None
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_kind), None)


def model_flops_per_token(cfg: Any, seq_len: int) -> float:
    """Model FLOPs of one training token, forward and backward: 6 N + 12 L S D (PaLM, appendix B:
    N parameters (ModelConfig.num_params), L layers, S the sequence length, D d_model; the attention
    term counts the whole S x S score matrix). The dense model's FLOPs whatever the FFN skips, so a
    sparse run's MFU is its speed in its dense twin's units. N counts the matrices that multiply: an
    untied model's input embedding is a gather (its output head is counted)."""
    gathered = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return 6.0 * (cfg.num_params() - gathered) + 12.0 * cfg.n_layers * seq_len * cfg.d_model


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s of one device over its peak (None: no peak)."""
    if peak_flops is None:
        return None
    return tokens_per_s_per_device * flops_per_token / peak_flops


# ----------------------------------------------------------------------------- the sink


def scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """A record's scalars as (tag, value) for TensorBoard and W&B: "val/<key>" for validation
    keys, "train/<key>" for the others, one "<prefix><key>/layer_<i>" per layer of a `_per_layer`
    list; non-finite scalars and non-numbers (lists that are not per layer, strings) are left out."""
    out = []
    for key, value in record.items():
        if key == "step":
            continue
        prefix = "val/" if key.startswith("val_") else "train/"
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append((prefix + key, value))
        elif isinstance(value, list) and key.endswith("_per_layer"):
            out.extend((f"{prefix}{key[:-len('_per_layer')]}/layer_{layer}", v) for layer, v in enumerate(value)
                       if isinstance(v, (int, float)))
    return out


class WandbRun:
    """The W&B side of a run (train.wandb_project): one W&B run per run directory, named after it,
    its id kept in `<run>/wandb/twell_run_id` so that a resumed run logs into the same W&B run (W&B
    keeps the first value of a step logged twice, as an interrupted run's steps after its checkpoint
    are). Its local files go to `<run>/wandb/`; WANDB_MODE=offline writes only those (`wandb sync
    <run>/wandb/offline-run-*` uploads them later)."""

    ID_FILE = "twell_run_id"

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any] | None, *, resume: bool):
        try:
            import wandb
        except ImportError as err:
            raise ValueError(f"train.wandb_project={project!r}: the wandb package is not installed (pip install "
                             f"'twell-jax[wandb]'), or set train.wandb_project=null ({err})") from None
        local = run_dir / run_dir_lib.WANDB_SUBDIR
        local.mkdir(parents=True, exist_ok=True)
        id_file = local / self.ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        # dir: W&B makes its own wandb/ folder there. Console capture off: the run's lines are in
        # metrics.jsonl, and the command's stdout stays the result alone.
        self.run = wandb.init(project=project, name=run_dir.absolute().name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config, settings=wandb.Settings(console="off"))
        if run_id is None:
            id_file.write_text(self.run.id + "\n")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(dict(scalars(record)), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class MetricsSink:
    """The one place a run's telemetry goes: `<run>/metrics.jsonl` (one JSON object per record),
    TensorBoard scalars (tensorboardX), a W&B run (`wandb_project`, off unless given) and the
    console (tqdm bar + message lines).

    The bar (on stderr) is drawn only when `progress_bar` is set and stderr is a terminal; otherwise
    every record written (each `train.log_every` steps) also prints one plain line, so that a log
    file gets whole lines and no carriage returns.

    Opened at `start_step` (0 for a new run, the restored step on resume): records after it, left by
    an interrupted earlier attempt, are removed from metrics.jsonl and purged from TensorBoard, so a
    resumed run's logs hold every step once.

    `files=False` (the processes of a multi-process run other than process 0, which writes the run's
    logs: the losses are the same on every process): nothing is written or drawn and records print
    no line; messages still do.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, total_steps: int, start_step: int,
                 progress_bar: bool, echo: Callable[[str], None] = print, files: bool = True,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None):
        self.run_dir = run_dir
        self.jsonl_path = run_dir_lib.metrics_path(run_dir)
        self.echo = echo
        self.total_steps = total_steps
        self._files = files
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        if not files:
            return
        if wandb_project is not None:  # first: a missing package stops the run before anything is written
            self._wandb = WandbRun(run_dir, wandb_project, config, resume=bool(start_step))
        dropped = run_dir_lib.truncate_metrics(run_dir, start_step)
        if dropped:
            echo(f"[twell] {run_dir_lib.METRICS_FILE}: dropped {dropped} record(s) after step {start_step} "
                 "(re-run now)")
        self._jsonl = open(self.jsonl_path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard hides the events at steps >= it from older event files.
            self._tb = SummaryWriter(str(run_dir / run_dir_lib.TENSORBOARD_SUBDIR),
                                     purge_step=start_step + 1 if start_step else None)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, leave=True)

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=True)

    def write(self, record: dict[str, Any]) -> None:
        """`record` holds "step", scalars and per-layer lists (suffix `_per_layer`)."""
        if not self._files:
            return
        record = to_python(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._bar is None and "loss" in record:
            self.echo(progress_line(record, self.total_steps))
        if self._tb is not None:
            step = int(record["step"])
            for tag, value in scalars(record):
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record)

    def message(self, text: str) -> None:
        """A console line that does not break the progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            self.echo(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None and not self._jsonl.closed:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """The plain console line of a training record (where no progress bar is drawn)."""
    parts = [f"[twell] step {record['step']}/{total_steps}"]
    for key, label in (("loss", "loss"), ("ce", "ce"), ("lr", "lr")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{label} {record[key]:.4g}")
    if record.get("l0_per_layer"):
        parts.append(f"l0 {sum(record['l0_per_layer']) / len(record['l0_per_layer']):.1f}")
    if record.get("l1_coef_per_layer"):  # sparsity.target_active: the adapted coefficients' range
        parts.append(f"L1/layer {min(record['l1_coef_per_layer']):.3g}-{max(record['l1_coef_per_layer']):.3g}")
    if isinstance(record.get("tokens_per_s"), (int, float)):
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    return " ".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def device_memory_limit_bytes() -> int | None:
    """Bytes JAX's allocator may use on the first local device (GPU: the memory fraction's share,
    `parallel.claim_device_memory`), where the backend reports it, else None."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit is not None else None


def device_peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPU), else None."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None
