"""Run telemetry sinks: console (tqdm progress bar + log lines), JSONL, TensorBoard (tensorboardX)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

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


def check_finite(step: int, metrics: dict[str, Any], names: tuple[str, ...]) -> None:
    """NaN/Inf guard: raise FloatingPointError naming the step and the first bad metric."""
    for name in names:
        if name not in metrics:
            continue
        values = np.asarray(metrics[name], dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise FloatingPointError(
                f"non-finite {name}={values.tolist()} at step {step}: training diverged (try a lower "
                f"optim.lr, a longer optim.warmup_steps or a smaller sparsity.l1_coef)")


class MetricsWriter:
    """Writes one JSON object per logged step to `<run>/metrics.jsonl` and scalars to TensorBoard."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, total_steps: int, initial_step: int,
                 progress_bar: bool):
        self.run_dir = run_dir
        self.jsonl_path = run_dir / "metrics.jsonl"
        self._jsonl = open(self.jsonl_path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr, leave=True)

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=True)

    def write(self, record: dict[str, Any]) -> None:
        """`record` holds "step", scalars and per-layer lists (suffix `_per_layer`)."""
        record = to_python(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
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
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def device_peak_memory_bytes() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPU), else None."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    peak = stats.get("peak_bytes_in_use")
    return int(peak) if peak is not None else None
