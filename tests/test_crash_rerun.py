"""The CI's guards against a dying worker: a test whose worker crashed once runs again and may
pass, one that crashes again fails, the run finishes (no deadlock) and names both crashes
(tests/_crash_rerun.py); compiled programs are dropped before a worker runs out of memory maps
(tests/conftest.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def test_a_crashed_test_reruns_once_and_a_second_crash_fails(tmp_path):
    (tmp_path / "conftest.py").write_text("from _crash_rerun import pytest_handlecrashitem, pytest_terminal_summary\n")
    (tmp_path / "test_flaky.py").write_text(textwrap.dedent("""
        import os, pathlib
        def test_crashes_once():
            mark = pathlib.Path(__file__).with_name("crashed_once")
            if not mark.exists():
                mark.write_text("x")
                os._exit(3)
        def test_fine():
            pass
    """))
    (tmp_path / "test_always.py").write_text("import os\ndef test_always_crashes():\n    os._exit(3)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TWELL_TESTS_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))  # tests/_crash_rerun.py
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "worksteal", "-rA",
                          "-p", "no:cacheprovider", "-p", "no:benchmark", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "PASSED test_flaky.py::test_crashes_once" in out, out
    assert "PASSED test_flaky.py::test_fine" in out, out
    assert "FAILED test_always.py::test_always_crashes" in out, out
    assert "test_flaky.py::test_crashes_once: its worker died (re-run)" in out, out
    assert "test_always.py::test_always_crashes: its worker died (failed after 2 crashes)" in out, out


def test_dropping_the_compiled_programs_returns_their_memory_maps():
    """The guard of conftest.py: compiled programs hold memory maps until JAX's caches drop them
    (a worker that ran out of maps crashed)."""
    import jax
    import jax.numpy as jnp

    from conftest import _drop_compiled_programs, _maps

    _drop_compiled_programs()
    before = _maps()
    if before == 0:
        pytest.skip("no /proc/self/maps here (not Linux)")
    keep = [jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cumsum(x)) for i in range(60)]
    for fn in keep:
        fn(jnp.arange(8.0)).block_until_ready()
    grown = _maps()
    _drop_compiled_programs()
    assert grown > before + 60 and _maps() < before + (grown - before) / 2, (before, grown, _maps())
