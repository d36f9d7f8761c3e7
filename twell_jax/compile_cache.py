"""JAX's persistent compilation cache for the `twell` commands: on by default, so a second start of
the same program (the same model, shapes, backend and JAX version) loads its executables from disk
instead of compiling them again.

Where (`resolve`): the `--compile-cache` option (a directory, or "off"), else the environment
(`TWELL_COMPILE_CACHE`, then JAX's own `JAX_COMPILATION_CACHE_DIR`, which the user may have set),
else `$XDG_CACHE_HOME/twell_jax/xla` (`~/.cache/twell_jax/xla`). A directory that cannot be created
or written is a warning and a run without the cache, never an error: the cache only saves time.

JAX writes an entry only for programs that took at least `jax_persistent_cache_min_compile_time_secs`
(JAX's default, 1 s) to compile; the small ones are not worth the disk.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax

OFF = "off"
ENV = "TWELL_COMPILE_CACHE"
_IN_USE: list[str | None] = []  # the directory `configure` set (None: off), once it ran


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twell_jax" / "xla"


def resolve(option: str | None) -> str | None:
    """The directory asked for (None: off): the option, else the environment, else the default."""
    choice = option or os.environ.get(ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(default_dir())
    return None if choice.strip().lower() == OFF else choice


def _writable(directory: Path) -> str | None:
    """None when `directory` exists or can be made and a file can be written in it, else why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".twell-probe-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def configure(option: str | None) -> tuple[str | None, str | None]:
    """Turn the cache on at the resolved directory (or off): (the directory in use or None, a
    warning or None). Call before the first compilation."""
    _IN_USE[:] = [None]
    choice = resolve(option)
    if choice is None:
        jax.config.update("jax_compilation_cache_dir", None)
        return None, None
    directory = Path(choice).expanduser()
    problem = _writable(directory)
    if problem is not None:
        jax.config.update("jax_compilation_cache_dir", None)
        return None, (f"the compilation cache directory {directory} cannot be written ({problem}); running "
                      f"without the cache (--compile-cache DIR picks another, --compile-cache off silences this)")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    _IN_USE[:] = [str(directory)]
    return str(directory), None


def describe() -> str:
    """", compilation cache DIR" (or "off") for a command's start-up line; "" when `configure` did
    not run (the library used from Python: JAX's own settings apply)."""
    if not _IN_USE:
        return ""
    return f", compilation cache {_IN_USE[0] or 'off'}"
