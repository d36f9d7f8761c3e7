"""Cache directories (the tokenizer cache, the token cache): a key from what their content depends
on, a private directory to build in, an atomic publish, and the data pipeline's progress (lines on
stderr, and `BuildProgress` for the processes waiting for a build)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import uuid
from typing import Any

from twell_jax.config import DataConfig


def log(cfg: DataConfig, message: str) -> None:
    """A progress line on stderr (when `data.progress`)."""
    if cfg.progress:
        print(f"[twell_jax.data] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class BuildProgress:
    """Where a data build is (written by the building thread, read by the one reporting it)."""

    phase: str = "listing the corpus"  # what the build does now, in words
    done: int = 0  # documents done in this phase
    total: int | None = None  # documents in this phase, when known

    def start(self, phase: str, total: int | None = None) -> None:
        self.phase, self.done, self.total = phase, 0, total

    def describe(self) -> str:
        if self.total is None:
            return self.phase
        return f"{self.phase}: {self.done} of {self.total} documents"


def cache_key(payload: Any) -> str:
    """A short stable hash of a JSON-ready payload (cache directory names)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def new_tmp_dir(final_dir: str) -> str:
    """A fresh private directory next to `final_dir` (same filesystem, so the rename is atomic)."""
    tmp_dir = f"{final_dir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp_dir)
    return tmp_dir


def publish(tmp_dir: str, final_dir: str) -> None:
    """Renames a finished `tmp_dir` to `final_dir`; if another process won the race, keeps theirs."""
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not os.path.isdir(final_dir):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
