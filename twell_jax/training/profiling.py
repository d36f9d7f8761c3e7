"""The profiler window of a training run (`train.profile_steps = "START:END"`).

`jax.profiler.start_trace` before optimizer step START is dispatched and `stop_trace` once step
END - 1 has finished: the trace holds exactly those steps' host and device work (not the compile
before them, nor an evaluation or checkpoint after them), written to `<run>/profile/` in the
profiler's own layout (`plugins/profile/<time>/*.xplane.pb`: TensorBoard's profile plugin, XProf or
Perfetto read it). The training loop ends steps START - 1 and END - 1 before dispatching the next
one (`needs_sync`), so no earlier step is still running when the trace starts and the last traced
step is complete when it stops. A resumed run traces what is left of the window; only process 0 of
a multi-process run traces (every process syncs at the same steps).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax

from twell_jax import run_dir as run_dir_lib

class ProfileWindow:
    """Starts and stops the trace of `window` = (START, END) (None: no trace) around a run's steps."""

    def __init__(self, window: tuple[int, int] | None, run_dir: Path, *, start_step: int, enabled: bool):
        self.window = window
        self.directory = run_dir / run_dir_lib.PROFILE_SUBDIR
        self.enabled = enabled
        self.active = False
        # The first step traced: START, or the first step of a run resumed inside the window.
        self.first = None if window is None or start_step + 1 >= window[1] else max(window[0], start_step + 1)

    def needs_sync(self, step_no: int) -> bool:
        """Whether step `step_no` must finish before the next is dispatched: the step before the
        window (nothing of it in the trace) and the window's last step (all of it in the trace)."""
        return self.first is not None and step_no in (self.first - 1, self.window[1] - 1)

    def before_step(self, step_no: int, message: Callable[[str], None]) -> None:
        """Start the trace if step `step_no` (about to be dispatched) is the window's first."""
        if self.enabled and step_no == self.first and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True
            message(f"[twell] profiler: tracing steps {step_no}-{self.window[1] - 1} -> {self.directory}")

    def after_step(self, step_no: int, message: Callable[[str], None]) -> None:
        """Stop the trace once step `step_no`, the window's last, has finished."""
        if self.active and step_no >= self.window[1] - 1:
            self.stop()
            message(f"[twell] profiler: trace of steps {self.first}-{step_no} written to {self.directory}")

    def stop(self) -> None:
        """Stop a running trace (the end of the window, or a run that stops inside it)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
