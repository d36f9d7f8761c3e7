"""SIGINT / SIGTERM during a training run: acknowledged at once, the run stops after the current
step (or compile) and checkpoints; a second signal aborts (`StopSignals`)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable


class StopSignals:
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

    def __enter__(self) -> "StopSignals":
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
