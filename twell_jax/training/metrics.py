"""Run telemetry sinks: console (tqdm progress bar + log lines), JSONL, TensorBoard (tensorboardX)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np


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


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Drop the records of `path` with a step after `last_step` (what a resumed run will write
    again); atomic. Returns how many were dropped."""
    from twell_jax.training.checkpoint import atomic_write_text

    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= last_step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


class MetricsSink:
    """The one place a run's telemetry goes: `<run>/metrics.jsonl` (one JSON object per record),
    TensorBoard scalars (tensorboardX) and the console (tqdm bar + message lines).

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
                 progress_bar: bool, echo: Callable[[str], None] = print, files: bool = True):
        self.run_dir = run_dir
        self.jsonl_path = run_dir / "metrics.jsonl"
        self.echo = echo
        self.total_steps = total_steps
        self._files = files
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not files:
            return
        dropped = truncate_jsonl(self.jsonl_path, start_step)
        if dropped:
            echo(f"[twell] metrics.jsonl: dropped {dropped} record(s) after step {start_step} (re-run now)")
        self._jsonl = open(self.jsonl_path, "a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard hides the events at steps >= it from older event files.
            self._tb = SummaryWriter(str(run_dir / "tensorboard"),
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
            for key, value in record.items():
                if key == "step":
                    continue
                prefix = "val/" if key.startswith("val_") else "train/"
                if isinstance(value, (int, float)) and value is not None and math.isfinite(value):
                    self._tb.add_scalar(prefix + key, value, step)
                elif isinstance(value, list) and key.endswith("_per_layer"):
                    for layer, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            self._tb.add_scalar(f"{prefix}{key[:-len('_per_layer')]}/layer_{layer}", v, step)
            self._tb.flush()

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


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """The plain console line of a training record (where no progress bar is drawn)."""
    parts = [f"[twell] step {record['step']}/{total_steps}"]
    for key, label in (("loss", "loss"), ("ce", "ce"), ("lr", "lr")):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{label} {record[key]:.4g}")
    if record.get("l0_per_layer"):
        parts.append(f"l0 {sum(record['l0_per_layer']) / len(record['l0_per_layer']):.1f}")
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
