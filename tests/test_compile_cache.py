"""The CLI's persistent compilation cache (twell_jax/compile_cache.py): where it goes, off, an
unwritable directory (a warning and a run without it), and a second start that compiles nothing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from twell_jax import compile_cache


@pytest.fixture
def jax_cache_setting():
    """Restore the test process's own cache setting (tests/conftest.py) after a test changes it."""
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_the_directory_comes_from_the_option_then_the_environment_then_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve(None) == str(tmp_path / "xdg" / "twell_jax" / "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/jax/own")
    assert compile_cache.resolve(None) == "/jax/own"
    monkeypatch.setenv(compile_cache.ENV, "/twell/own")
    assert compile_cache.resolve(None) == "/twell/own"
    assert compile_cache.resolve("/asked") == "/asked"
    assert compile_cache.resolve("off") is None and compile_cache.resolve(" OFF ") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve(None) is None


def test_configure_turns_the_cache_on_off_or_warns(tmp_path, jax_cache_setting):
    where, warning = compile_cache.configure(str(tmp_path / "new" / "cache"))
    assert warning is None and where == str(tmp_path / "new" / "cache") and Path(where).is_dir()
    assert jax.config.jax_compilation_cache_dir == where
    assert compile_cache.describe() == f", compilation cache {where}"
    assert compile_cache.configure("off") == (None, None)
    assert jax.config.jax_compilation_cache_dir is None and compile_cache.describe() == ", compilation cache off"
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    where, warning = compile_cache.configure(str(blocker / "cache"))
    assert where is None and jax.config.jax_compilation_cache_dir is None
    assert f"{blocker / 'cache'} cannot be written" in warning and "running without the cache" in warning


@pytest.mark.slow
def test_a_second_start_loads_every_program_and_an_unwritable_directory_is_a_warning(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    def train(out: str, cache_option: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "twell_jax.cli", "train", "--config", "micro", "--set", "train.steps=2",
             "--out", str(tmp_path / out), "--compile-cache", cache_option],
            capture_output=True, text=True, env=env, timeout=300)

    first = train("r1", str(cache))
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"compilation cache {cache}" in first.stderr
    entries = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert any(name.startswith("jit_train_step") for name in entries)
    second = train("r2", str(cache))
    assert second.returncode == 0, second.stderr[-2000:]
    # Every program of the second start came from the cache: nothing new was written.
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == entries
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    third = train("r3", str(blocker))
    assert third.returncode == 0, third.stderr[-2000:]
    assert "cannot be written" in third.stderr and "compilation cache off" in third.stderr
