"""Test session set-up: simulate 8 CPU devices so the data-parallel tests can build 1-, 2- and
8-device meshes in the same process, and compile fast (XLA flags below). The flags must be set
before jax is first imported."""
import gc
import os

import pytest

# One XLA compilation cache per xdist worker, shared with its subprocesses (the experiments' dry
# runs): many tests compile the same tiny programs (the interpreted kernels, the micro model). Not
# one for both workers: a worker crashed in XLA:CPU's deserialisation of a cache entry
# (compilation_cache.get_executable_and_time, 2026-11-24), which was taken for a read of an entry
# the other worker was writing; it may as well have been the memory maps running out (below). A
# worker inherits the controller's environment, so it sets its own directory once (its
# subprocesses then inherit that one).
_CACHE = os.path.join(__import__("tempfile").gettempdir(), "twell-jax-tests-xla-cache")
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.environ.get("TWELL_TESTS_CACHE_WORKER") != _WORKER:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = f"{_CACHE}-{_WORKER}"
    os.environ["TWELL_TESTS_CACHE_WORKER"] = _WORKER
else:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# 8 simulated CPU devices; and CPU code generation without LLVM's expensive optimisations and with
# XLA's classic CPU emitters: the tests run tiny shapes, so compiling is most of their time (the
# interpreted Pallas kernels lower to large while-loop programs), and these flags cut it ~2x
# (an interpreted backward: 8.0 -> 3.4 s) without changing what is computed.
# The last flag only where XLA still has it: JAX 0.11's XLA aborts the process at start-up on an
# unknown flag (pytest on the GPU machine, JAX 0.11.2, then exited 1 without a line of output).
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")


def _jaxlib_before(major: int, minor: int) -> bool:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        installed = tuple(int(part) for part in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return installed < (major, minor)


if _jaxlib_before(0, 11):
    _FLAGS += ("--xla_cpu_use_fusion_emitters=false",)
if "jax" not in __import__("sys").modules:
    _present = os.environ.get("XLA_FLAGS", "")
    _missing = [f for f in _FLAGS if f.split("=")[0] not in _present]
    os.environ["XLA_FLAGS"] = " ".join([_present, *_missing]).strip()

# A worker that dies (as one did when its memory maps ran out: the fixtures below) takes no test
# down with it: its test runs once more on the replacement worker and must pass there; a second
# crash fails it. Every crash is listed at the end. `--dist worksteal` because `loadfile`
# deadlocks after a crash (pytest-xdist 3.8, issue #1378): a CI run then waits until it is killed.
from _crash_rerun import pytest_handlecrashitem, pytest_terminal_summary  # noqa: E402,F401


def pytest_report_header(config):
    return f"XLA compilation cache: {os.environ['JAX_COMPILATION_CACHE_DIR']}"


# The files that take longest on the 2-core CI machine (pytest --durations, 2026-11-22; the files
# of the longest tests of either tier added 2026-11-27), run first, so that the slow files are not
# what is left at the end: `-n 2 --dist worksteal` starts each worker on one half of the collection
# in order and lets an idle worker take the other's last tests.
_LONGEST_FIRST = (
    "test_pallas_bwd_op.py", "test_auto_hints.py", "test_parallel.py", "test_train.py",
    "test_run_trust.py", "test_bench_ffn_train_checkpoint.py", "test_compare.py",
    "test_sparse_checkpoint_benches.py", "test_ops.py", "test_bench_step.py",
    "test_inference_generate.py", "test_nan_policy.py", "test_inference_load.py",
    "test_pallas_bwd.py", "test_model.py", "test_pallas_decode.py", "test_pallas_bwd_bench.py",
    "test_decode_kernels.py", "test_decode_tiles.py", "test_backend_equivalence.py", "test_layer_scan.py",
    "test_cli.py", "test_decode_matvec.py", "test_twell_transpose.py", "test_checkpoint.py",
)


# ----------------------------------------------------------------------------- shared fixtures


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory) -> str:
    """One tokenized-corpus cache for the session's runs of the default corpus (each worker its own):
    the first test that builds the data tokenizes it, the others read it."""
    return str(tmp_path_factory.getbasetemp() / "twell_data_cache")


@pytest.fixture
def cli():
    """`cli(argv)`: the `twell` command in this process, as (exit code, stdout, stderr)
    (`oracles.run_cli`, which module-scoped fixtures call directly)."""
    from oracles import run_cli

    return run_cli


# Two tiers (README): the fast one (`-m "not slow"`, the README's test command) keeps every module's
# core checks; the slow one (`-m slow`; .ci/run runs both) holds the benchmark dry runs, the
# end-to-end runs that repeat a fast test's check at more cost, and the parametrizations that repeat
# a kept one at another size, dtype or option. A test or a `pytest.param` is marked
# `@pytest.mark.slow`; a cross product of parametrize decorators names the parametrizations it keeps
# fast with `@pytest.mark.fast_params(id, ...)` (pytest's ids, e.g. "3-True-sparse") and the others are
# marked slow here, at collection, before `-m` selects. An id that names no parametrization of the
# test is an error, so the fast tier cannot lose a check to a typo.
@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector, name, obj):
    items = yield
    if not isinstance(items, list):  # a class, or not a test
        return items
    fast = [m for m in getattr(obj, "pytestmark", ()) if m.name == "fast_params"]
    if not fast:
        return items
    keep = {i for m in fast for i in m.args}
    ids = {item.callspec.id for item in items if hasattr(item, "callspec")}
    if not keep <= ids:
        raise pytest.UsageError(f"{collector.nodeid}::{name}: fast_params names no parametrization "
                                f"{sorted(keep - ids)} (it has {sorted(ids)})")
    for item in items:
        if item.callspec.id not in keep:
            item.add_marker(pytest.mark.slow)
    return items


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order inside a file kept


# Every compiled XLA:CPU program holds memory maps (its code and data sections) while JAX's caches
# keep it alive. One worker runs hundreds of test files' programs: it passed vm.max_map_count
# (65530) three quarters of the way through the suite, and the next compilation crashed the
# process (a segfault while raising the failed compilation's error; reproduced 2026-11-24 by running
# one worker's share of the tests in one process). Each file's programs are dropped after it, and
# after any test that leaves the process holding more than MAX_MAPS maps (one file reached 31,000).
MAX_MAPS = 30_000


def _drop_compiled_programs():
    import jax  # (after the XLA flags above are set)

    jax.clear_caches()
    gc.collect()


def _maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_file():
    yield
    _drop_compiled_programs()


@pytest.fixture(autouse=True)
def _drop_compiled_programs_when_the_maps_run_high():
    yield
    if _maps() > MAX_MAPS:
        _drop_compiled_programs()
