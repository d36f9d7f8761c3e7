"""Data-parallel plumbing: process start-up, the device mesh, batch and parameter shardings.

One choke point for everything that knows about devices. The mesh has two axes, `DATA_AXIS` x
`FSDP_AXIS` (replicas x the devices of one FSDP group): the batch is split over both, the parameters
and optimizer state over `FSDP_AXIS` only and replicated along `DATA_AXIS`. The layout
(`train.sharding`) is only the mesh's shape: "replicate" is N x 1, "fsdp" 1 x N, "hybrid" (FSDP
within a host, data parallel across hosts) processes x devices per process; "auto" picks one from
the memory the state needs (`resolve_layout`). The trainer builds the mesh with `make_mesh`, enters
it with `jax.set_mesh(mesh)`, places parameters with `param_shardings` and feeds each step with
`host_to_global`; `jax.jit` + `NamedSharding` (GSPMD) then inserts the gradient all-reduce (and,
under FSDP, the per-layer all-gathers and reduce-scatters). The sparse op (`twell_jax/ops/`) wraps
its Pallas calls in `jax.shard_map` over `BATCH_AXES`, because Pallas kernels cannot be partitioned
by GSPMD. docs/parallel.md explains why.

Multi-host: every process calls `initialize_distributed()` first, reads only its own slice of the
data (`data_shard_index()` of `data_shard_count()`), and `host_to_global` stitches the per-process
slices into one global array with `jax.make_array_from_process_local_data`. Decisions that must be
the same on every process (the run directory, the plan trial's verdict, that every process runs the
same config and data) go through `lead_value`, `gather`, `check_same` and `all_or_none`: small
JSON values in the key-value store of JAX's coordination service, every wait bounded
(`TWELL_AGREE_TIMEOUT_S`) and ended early by a failure another process published.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from twell_jax.config import SHARDINGS  # train.sharding's choices, which resolve_layout resolves

logger = logging.getLogger(__name__)

# The mesh's axes. DATA_AXIS: replicas (pure data parallelism: the state is replicated along it;
# across hosts under "hybrid"). FSDP_AXIS: the devices of one FSDP group, which split the parameters
# and optimizer state (within a host under "hybrid"). The batch is split over both, in this order.
DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)
# "auto" replicates when the f32 parameters, AdamW state and gradients take at most this share of a
# device's memory; the rest is the working margin for activations and XLA's buffers.
AUTO_REPLICATE_SHARE = 0.5


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def distributed_request() -> str | None:
    """Which launcher (if any) asks for a multi-process run: "jax_env", "slurm", "openmpi" or None.

    - "jax_env": JAX_COORDINATOR_ADDRESS is set (JAX_NUM_PROCESSES / JAX_PROCESS_ID may complete it;
      if they are missing, JAX's own cluster auto-detection fills them in).
    - "slurm": SLURM_JOB_ID, SLURM_NTASKS > 1, SLURM_PROCID set (an srun with several tasks). A
      one-task allocation (e.g. an interactive `salloc` shell) is NOT a request.
    - "openmpi": OMPI_MCA_orte_hnp_uri (or PMIX_SERVER_URI* with OMPI_COMM_WORLD_SIZE) set and
      OMPI_COMM_WORLD_SIZE > 1 (an `mpirun -n N`, N > 1).
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "jax_env"
    slurm_tasks = _env_int("SLURM_NTASKS")
    if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ and (slurm_tasks or 0) > 1:
        return "slurm"
    ompi_size = _env_int("OMPI_COMM_WORLD_SIZE")
    if "OMPI_MCA_orte_hnp_uri" in os.environ and (ompi_size or 0) > 1:
        return "openmpi"
    return None


# The share of each GPU's memory JAX's allocator may take. JAX's own default is 0.75 (it preallocates
# that much); the measured presets need more: the `2b` dense twin at remat none peaked between the
# two shares of an 80 GB H100 (BENCHMARKS.md, "The paper's sizes"), so it fits with 0.95 and not
# with 0.75. One process drives all of a host's GPUs here, so nothing else shares them.
DEVICE_MEMORY_FRACTION = 0.95
MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def claim_device_memory(fraction: float = DEVICE_MEMORY_FRACTION) -> str | None:
    """Let JAX's GPU allocator use `fraction` of each GPU's memory, unless the user chose an
    allocator setting (XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_PREALLOCATE or
    XLA_PYTHON_CLIENT_ALLOCATOR set: theirs stands). JAX reads the variable when it starts its
    backend, so this must run before anything touches a device; once the backend is up it changes
    nothing and says so. Returns the fraction in force as text, or None where it could not be set."""
    from jax._src import xla_bridge  # noqa: PLC0415 (the only way to ask whether the backend started)

    chosen = [name for name in (MEMORY_FRACTION_VARIABLE, "XLA_PYTHON_CLIENT_PREALLOCATE",
                                "XLA_PYTHON_CLIENT_ALLOCATOR") if os.environ.get(name)]
    if chosen:
        return ", ".join(f"{name}={os.environ[name]}" for name in chosen) + " (set by the user)"
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)()
    if started:
        logger.info("claim_device_memory: JAX's backend already started; %s=%s would take no effect",
                    MEMORY_FRACTION_VARIABLE, fraction)
        return None
    os.environ[MEMORY_FRACTION_VARIABLE] = str(fraction)
    return f"{MEMORY_FRACTION_VARIABLE}={fraction}"


# XLA options every twell command sets unless XLA_FLAGS names them: the data-parallel gradient
# all-reduce pipelined into the layer loop's backward (each layer's reduction overlaps the next
# layer's backward instead of all of them after the loop) and combined into few large transfers.
# Measured on two H100s (BENCHMARKS.md, "Weak scaling on two H100s"); numerically the same
# reduction (the bench's equivalence check). GPU options: other backends ignore them.
DEFAULT_XLA_FLAGS = (("xla_gpu_enable_pipelined_all_reduce", "true"),
                     ("xla_gpu_all_reduce_combine_threshold_bytes", str(4 << 30)))


def default_xla_flags(flags: tuple[tuple[str, str], ...] = DEFAULT_XLA_FLAGS) -> str | None:
    """Add `flags` to XLA_FLAGS, each unless XLA_FLAGS already names it (the user's value stands).
    XLA reads XLA_FLAGS when JAX starts its backend, so this must run before anything touches a
    device; once the backend is up it changes nothing and says so. Returns the options added as
    text ("" when the user's XLA_FLAGS names them all), or None where they could not be set."""
    from jax._src import xla_bridge  # noqa: PLC0415 (the only way to ask whether the backend started)

    current = os.environ.get("XLA_FLAGS", "")
    named = {item.lstrip("-").split("=", 1)[0] for item in current.split()}
    missing = [f"--{key}={value}" for key, value in flags if key not in named]
    if not missing:
        return ""
    if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
        logger.info("default_xla_flags: JAX's backend already started; %s would take no effect",
                    " ".join(missing))
        return None
    os.environ["XLA_FLAGS"] = " ".join([*current.split(), *missing])
    return " ".join(missing)


def prepare_process() -> str | None:
    """What every twell command and benchmark does before anything touches a device: the memory
    share (`claim_device_memory`) and the XLA options (`default_xla_flags`, whose result it returns)."""
    claim_device_memory()
    return default_xla_flags()


def _distributed_is_initialized() -> bool:
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    # Older JAX without the public query: the runtime client exists once initialised.
    from jax._src import distributed as _distributed  # noqa: PLC0415

    return _distributed.global_state.client is not None


# How long `initialize_distributed` waits for every process to join, and how long a process waits
# for the others at an agreement point (`lead_value`, `gather`, `all_or_none`), in seconds.
INIT_TIMEOUT_VARIABLE, DEFAULT_INIT_TIMEOUT_S = "TWELL_INIT_TIMEOUT_S", 120.0
AGREE_TIMEOUT_VARIABLE, DEFAULT_AGREE_TIMEOUT_S = "TWELL_AGREE_TIMEOUT_S", 300.0
# How long a process may go on after another one published its failure before `watch_peer_failures`
# ends it (one that stops at an agreement point does so within seconds, its clean-up included).
PEER_GRACE_VARIABLE, DEFAULT_PEER_GRACE_S = "TWELL_PEER_FAILURE_GRACE_S", 15.0
_PEER_POLL_S = 1.0
# How long a process that `watch_peer_failures` ends waits at JAX's shutdown barrier for the others.
_PEER_SHUTDOWN_WAIT_S = 30.0
# JAX's own initialization timeout is set this much longer than ours: when it expires first, its
# coordination client aborts the process with a C++ check failure instead of an error.
_JAX_INIT_MARGIN_S = 60


def env_seconds(name: str, default: float) -> float:
    """The environment variable `name` as a positive number of seconds (`default` when unset or
    empty); anything else is a ValueError naming the variable."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"environment variable {name} must be a positive number of seconds, got {value!r}")
    return seconds


def _launch_layout(request: str) -> tuple[str, str, str | None]:
    """(this process's index, the process count, the coordinator address) as the launcher's variables
    say them before JAX is initialised ("?" where not known): for messages only."""
    if request == "jax_env":
        return (os.environ.get("JAX_PROCESS_ID") or "?", os.environ.get("JAX_NUM_PROCESSES") or "?",
                os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if request == "slurm":
        return os.environ.get("SLURM_PROCID", "?"), os.environ.get("SLURM_NTASKS", "?"), None
    return os.environ.get("OMPI_COMM_WORLD_RANK", "?"), os.environ.get("OMPI_COMM_WORLD_SIZE", "?"), None


def _answers(address: str) -> str | None:
    """None when something accepts a TCP connection at host:port, else why not."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
            return None
    except (OSError, ValueError) as err:
        return getattr(err, "strerror", None) or str(err)


def _join_timed_out(request: str, seconds: float) -> str:
    index, count, coordinator = _launch_layout(request)
    head = (f"process {index} of {count} could not join the multi-process run within {seconds:g} s "
            f"({INIT_TIMEOUT_VARIABLE})")
    if coordinator is None:
        return (f"{head}: the coordinator that {request} names did not answer or not every process started; "
                "check that every task of the job runs this command")
    if index != "0" and (why := _answers(coordinator)) is not None:
        return (f"{head}: nothing answers at JAX_COORDINATOR_ADDRESS={coordinator} ({why}); start process 0 "
                "there (it hosts the coordinator) or fix the address")
    return (f"{head}: the coordinator at JAX_COORDINATOR_ADDRESS={coordinator} waits for all {count} processes "
            "(JAX_NUM_PROCESSES); start every process, each with its own JAX_PROCESS_ID")


def initialize_distributed() -> None:
    """Start JAX's multi-process runtime when the environment asks for it; otherwise do nothing.

    Must run before any other JAX call touches the devices. Safe to call twice (the second call is
    a no-op). See `distributed_request` for the variables that count as a request.

    Every process waits here until all have joined, at most `TWELL_INIT_TIMEOUT_S` seconds (default
    120). Past it the process prints one line naming what it waited for
    on stderr and exits with status 2: JAX's own timeout would abort it with a C++ check failure,
    and a thread is the only way out of its blocking connect.
    """
    if _distributed_is_initialized():
        return
    request = distributed_request()
    if request is None:
        return
    seconds = env_seconds(INIT_TIMEOUT_VARIABLE, DEFAULT_INIT_TIMEOUT_S)
    grace = env_seconds(PEER_GRACE_VARIABLE, DEFAULT_PEER_GRACE_S)  # read (and checked) before joining
    kwargs: dict[str, Any] = {"initialization_timeout": int(seconds) + _JAX_INIT_MARGIN_S}
    if request == "jax_env":
        # JAX reads JAX_COORDINATOR_ADDRESS itself but not these two, so pass them through.
        num_processes = _env_int("JAX_NUM_PROCESSES")
        process_id = _env_int("JAX_PROCESS_ID")
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ValueError(
                f"JAX_PROCESS_ID={process_id} must be in [0, JAX_NUM_PROCESSES={num_processes})"
            )
        kwargs.update(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=num_processes,
                      process_id=process_id)
    # else SLURM and Open MPI: JAX's cluster detection reads coordinator, count and rank itself.

    def give_up() -> None:
        sys.stderr.write(f"twell: error: {_join_timed_out(request, seconds)}\n")
        sys.stderr.flush()
        os._exit(2)

    watchdog = threading.Timer(seconds, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs)
    finally:
        watchdog.cancel()
    logger.info(
        "jax.distributed initialised via %s: process %d of %d, %d local / %d global devices",
        request, jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )
    if multi_process():
        watch_peer_failures(grace)


def watch_peer_failures(grace_s: float) -> threading.Thread:
    """A daemon thread that ends this process (one line on stderr, exit status 2) once another
    process has published its failure (`publish_failure`: the CLI does it for every error) and this
    one is still running `grace_s` seconds later. A process waiting at an agreement point stops on
    such a failure by itself, within seconds; one blocked inside a collective (a training step's
    all-reduce, an Orbax save) cannot see it, and would wait until JAX's coordination service ends
    it on a missed heartbeat (about 100 s, with "another task died" and no word of why). A thread
    is the only way out of that wait, as for the join's timeout (`initialize_distributed`). Before
    it exits it meets the others at JAX's shutdown barrier (a process that leaves without it makes
    the ones waiting there fail), waiting at most `_PEER_SHUTDOWN_WAIT_S` seconds. The thread stops
    when the interpreter exits, before JAX shuts its client down (a call into a client that is shut
    down, or whose service is gone, aborts the process)."""
    me = jax.process_index()
    stop = threading.Event()

    def end_process(process: int, message: str) -> None:
        sys.stderr.write(f"twell: error: process {process} failed ({message}); process {me} stopped waiting for "
                         f"it after {grace_s:g} s ({PEER_GRACE_VARIABLE})\n")
        sys.stderr.flush()
        leaving = threading.Thread(target=_shutdown_quietly, name="twell-shutdown", daemon=True)
        leaving.start()
        leaving.join(_PEER_SHUTDOWN_WAIT_S)
        os._exit(2)

    def watch() -> None:
        seen = None
        while not stop.wait(_PEER_POLL_S):
            try:
                failure = _failure(_client())
            except Exception:  # noqa: BLE001 (the coordinator is gone: JAX's own error handling ends us)
                return
            if failure is None:
                continue
            seen = time.monotonic() if seen is None else seen
            if time.monotonic() - seen >= grace_s:
                end_process(*failure)

    thread = threading.Thread(target=watch, name="twell-peer-failures", daemon=True)
    thread.start()

    def stop_watching() -> None:  # atexit runs this before JAX's own clean-up (registered earlier)
        stop.set()
        thread.join(2 * _PEER_POLL_S)

    atexit.register(stop_watching)
    return thread


def _shutdown_quietly() -> None:
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 (the others are gone or failed: this process exits all the same)
        pass


# ----------------------------------------------------------------------------- agreement


class ProcessGroupError(ValueError):
    """Another process of a multi-process run failed, or did not arrive in time; names which."""


class PeerFailed(ProcessGroupError):
    """Another process published a failure (`publish_failure`): this error repeats it, and is not
    published again (the others have the original)."""


def multi_process() -> bool:
    """True in a run of several processes (jax.distributed initialised with more than one)."""
    return jax.process_count() > 1


def is_lead() -> bool:
    """True on process 0, the one that writes a run's files and decides for the others."""
    return jax.process_index() == 0


# Every process makes the same agreement calls in the same order, so the n-th call has the same key
# everywhere; the key also names the call, so two processes on different paths time out, naming it,
# instead of reading each other's values.
_SEQUENCE = itertools.count()
_KEYS = "twell"
_POLL_MS = 1000


def _client() -> Any:
    from jax._src import distributed as _distributed  # noqa: PLC0415 (JAX has no public handle on it)

    client = _distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised: call initialize_distributed() first")
    return client


def _key(what: str) -> str:
    return f"{_KEYS}/{next(_SEQUENCE)}-{re.sub(r'[^a-z0-9]+', '-', what.lower()).strip('-')}"


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) or type(err).__name__


def publish_failure(message: str) -> None:
    """Tell the other processes that this one failed, with its one-line `message`: one waiting for
    it at an agreement point stops at once with that message instead of at its timeout. Nothing
    happens in a single-process run, and nothing is raised (a coordinator that is gone has nobody
    left to tell)."""
    if not _distributed_is_initialized() or not multi_process():
        return
    try:
        _client().key_value_set(f"{_KEYS}/failed/{jax.process_index()}", message[:2000])
    except Exception:  # noqa: BLE001 (already published, or the coordinator is gone)
        pass


def _failure(client: Any) -> tuple[int, str] | None:
    """The lowest other process that published a failure, and its message."""
    try:
        entries = client.key_value_dir_get(f"{_KEYS}/failed/")
    except jax.errors.JaxRuntimeError:
        return None
    others = sorted((int(key.rsplit("/", 1)[1]), text) for key, text in entries
                    if int(key.rsplit("/", 1)[1]) != jax.process_index())
    return others[0] if others else None


def _wait(client: Any, key: str, what: str, owner: int) -> str:
    """The value at `key` (set by process `owner`), waiting at most TWELL_AGREE_TIMEOUT_S seconds;
    ProcessGroupError as soon as another process publishes a failure."""
    timeout = env_seconds(AGREE_TIMEOUT_VARIABLE, DEFAULT_AGREE_TIMEOUT_S)
    deadline = time.monotonic() + timeout
    me, count = jax.process_index(), jax.process_count()
    while True:
        try:
            return client.blocking_key_value_get(key, _POLL_MS)
        except jax.errors.JaxRuntimeError as err:
            if "DEADLINE_EXCEEDED" not in str(err):
                raise ProcessGroupError(f"process {me} of {count} lost the coordinator (process 0) while waiting "
                                        f"for {what}: {_one_line(err)[:300]}") from None
        if (failed := _failure(client)) is not None:
            raise PeerFailed(f"process {failed[0]} of {count} failed: {failed[1]}")
        if time.monotonic() >= deadline:
            raise ProcessGroupError(
                f"process {me} of {count} waited {timeout:g} s ({AGREE_TIMEOUT_VARIABLE}) for process {owner} at "
                f"{what}, and it did not come: it is stuck or gone, or runs another command (every process must "
                "run the same one)")


def lead_value(what: str, compute: Callable[[], Any]) -> Any:
    """`compute()` run on process 0 alone, its value (JSON: lists for tuples) on every process.

    `what` names the value in errors. A failure of `compute` is published before it is raised, so
    the other processes stop with it. In a single-process run: `compute()`, unchanged."""
    if not multi_process():
        return compute()
    client, key = _client(), _key(what)
    if not is_lead():
        return json.loads(_wait(client, key, what, owner=0))
    try:
        text = json.dumps(compute())
    except PeerFailed:
        raise
    except BaseException as err:
        publish_failure(_one_line(err))
        raise
    client.key_value_set(key, text)
    return json.loads(text)


def gather(what: str, value: Any) -> list[Any]:
    """Every process's `value` (JSON), in process order, on every process (a barrier too)."""
    if not multi_process():
        return [value]
    client, key = _client(), _key(what)
    text = json.dumps(value)
    client.key_value_set(f"{key}/{jax.process_index()}", text)
    return [json.loads(text if p == jax.process_index() else _wait(client, f"{key}/{p}", what, owner=p))
            for p in range(jax.process_count())]


def barrier(what: str) -> None:
    """Wait until every process got here (`what` names the place in errors)."""
    gather(what, None)


def check_same(what: str, value: Any, hint: str) -> None:
    """Raise the same ValueError on every process unless every process passes an equal `value`,
    naming each process's value and `hint` (what to fix)."""
    values = gather(what, value)
    if any(v != values[0] for v in values):
        shown = ", ".join(f"process {p}: {v}" for p, v in enumerate(values))
        raise ValueError(f"the processes differ in {what} ({shown}); {hint}")


def check_like_lead(what: str, value: Any, differences: Callable[[Any, Any], str], problem: str, hint: str) -> None:
    """Raise the same ValueError on every process unless every process's `value` matches process
    0's: `differences(lead, mine)` (both as JSON gives them back: lists for tuples) says how this
    process's differs, "" where it does not; the error lists each differing process's, after
    `problem` and before `hint` (what to fix). A no-op in a single-process run."""
    if not multi_process():
        return
    mine = json.loads(json.dumps(value))
    lead = lead_value(f"process 0's {what}", lambda: mine)
    differ = [f"process {p}: {text}" for p, text in enumerate(gather(what, differences(lead, mine))) if text]
    if differ:
        raise ValueError(f"{problem} ({'; '.join(differ)}); {hint}")


@contextlib.contextmanager
def all_or_none(what: str) -> Iterator[None]:
    """Every process passes the block, or every process raises: the one that failed its own error
    (published first), the others a ProcessGroupError naming that process and its message, raised
    when they reach the end of the block (or any agreement point inside it). A no-op in a
    single-process run."""
    if not multi_process():
        yield
        return
    try:
        yield
    except PeerFailed:
        raise
    except BaseException as err:
        publish_failure(_one_line(err) if not isinstance(err, KeyboardInterrupt) else "interrupted (Ctrl-C)")
        raise
    barrier(what)


def data_shard_index() -> int:
    """Which slice of the data this process reads (its process index)."""
    return jax.process_index()


def data_shard_count() -> int:
    """How many slices the data is split into (the process count)."""
    return jax.process_count()


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def make_mesh(num_devices: int | None = None, fsdp_size: int = 1) -> Mesh:
    """A 2-D mesh `DATA_AXIS` x `FSDP_AXIS` of shape (num_devices / fsdp_size, fsdp_size), over all
    devices or over the first `num_devices`.

    fsdp_size=1 (the default) is plain data parallelism (every device holds a replica), fsdp_size =
    num_devices one FSDP group of every device; in between, each row of the mesh (an FSDP group) is
    `fsdp_size` consecutive devices of `jax.devices()`. That list holds each process's devices
    consecutively, so a group whose size divides a process's device count stays inside the process
    (its all-gathers never cross the network), and the batch, split over (DATA_AXIS, FSDP_AXIS) in
    that row-major order, keeps each process's rows on its own devices.

    Both axes are `AxisType.Auto` (GSPMD propagation): model code stays free of sharding annotations,
    and `jax.shard_map` over them works the same on JAX 0.10 and 0.11. (`jax.make_mesh` defaults
    to Explicit axes, whose sharding-in-types would make every reshape in the model declare its
    output sharding.)
    """
    devices = jax.devices()
    if num_devices is None:
        num_devices = len(devices)
    if not _is_count(num_devices):
        raise ValueError(f"num_devices must be a positive int or None, got {num_devices!r}")
    if num_devices > len(devices):
        raise ValueError(
            f"num_devices={num_devices} but only {len(devices)} devices are available "
            f"({devices[0].platform})"
        )
    if jax.process_count() > 1 and num_devices != len(devices):
        # A subset could leave a process without any device of the mesh; its data would be lost.
        raise ValueError(
            f"num_devices={num_devices} must equal the global device count {len(devices)} "
            f"in a multi-process run ({jax.process_count()} processes)"
        )
    if not _is_count(fsdp_size) or num_devices % fsdp_size:
        raise ValueError(f"fsdp_size must be a positive int dividing num_devices={num_devices}, got {fsdp_size!r}")
    grid = np.asarray(devices[:num_devices]).reshape(num_devices // fsdp_size, fsdp_size)
    return Mesh(grid, BATCH_AXES, axis_types=(AxisType.Auto,) * len(BATCH_AXES))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the training state lives: a `make_mesh` of `replicas` x `fsdp_size` devices. The
    parameters and optimizer state are split over the `fsdp_size` devices of a row (FSDP_AXIS) and
    replicated over the `replicas` rows (DATA_AXIS); the batch is split over all of them."""

    replicas: int  # size of DATA_AXIS: copies of the state
    fsdp_size: int  # size of FSDP_AXIS: devices one copy is split over
    reason: str  # why: train.sharding as set, or auto's rule with its sizes

    def __post_init__(self) -> None:
        if not (_is_count(self.replicas) and _is_count(self.fsdp_size)):
            raise ValueError(f"Layout needs positive replicas and fsdp_size, got {self.replicas!r} x "
                             f"{self.fsdp_size!r}")

    @property
    def sharding(self) -> str:
        """What the shape is: "replicate" (fsdp_size 1), "fsdp" (one group) or "hybrid"."""
        return "replicate" if self.fsdp_size == 1 else "fsdp" if self.replicas == 1 else "hybrid"

    def describe(self) -> str:
        """The start-up line's text: the layout, the mesh's shape, and why."""
        return f"{self.sharding} (mesh {DATA_AXIS} {self.replicas} x {FSDP_AXIS} {self.fsdp_size}): {self.reason}"


def _host_group(num_devices: int, fsdp_size: int | None, local_devices: int) -> tuple[int, str]:
    """(devices per FSDP group of a hybrid layout, how it was chosen): train.fsdp_size, else the
    devices of one process. A group is part of one process's devices or several whole processes'
    (e.g. the 8 single-GPU processes of one host); anything else is refused, naming the field."""
    if fsdp_size is None:
        return local_devices, f"one process's {local_devices} devices"
    if not _is_count(fsdp_size):
        raise ValueError(f"train.fsdp_size must be a positive int or None (the devices of one process), "
                         f"got {fsdp_size!r}")
    if num_devices % fsdp_size or (local_devices % fsdp_size and fsdp_size % local_devices):
        raise ValueError(f"train.fsdp_size={fsdp_size} must divide the {num_devices} devices and either divide a "
                         f"process's {local_devices} devices or be a multiple of them (an FSDP group is part of one "
                         "process's devices or whole processes')")
    return fsdp_size, f"train.fsdp_size={fsdp_size}"


def resolve_layout(sharding: str, num_devices: int, *, fsdp_size: int | None = None,
                   local_devices: int | None = None, state_bytes: int | None = None,
                   memory_limit: int | None = None, platform: str = "the device") -> Layout:
    """The `Layout` that `train.sharding` asks for over `num_devices` devices.

    "replicate": N x 1. "fsdp": 1 x N (every FSDP all-gather spans all devices, across hosts too).
    "hybrid": FSDP within a group of `fsdp_size` devices (default: the `local_devices` of one
    process, i.e. a host that one process drives) and data parallel across groups.
    "auto": replicate when `state_bytes` (the unsharded f32 parameters, AdamW state and gradients)
    fit in AUTO_REPLICATE_SHARE of `memory_limit` (one device's bytes; None, e.g. a CPU, counts as
    fitting), else hybrid when a group's share fits, else FSDP over all devices. Pure in its
    arguments (with `local_devices` None it reads `jax.local_device_count()`); the trainer agrees on
    its answer across processes (`lead_value`)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"train.sharding must be one of {SHARDINGS}, got {sharding!r}")
    if not _is_count(num_devices):
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if fsdp_size is not None and sharding in ("replicate", "fsdp"):
        raise ValueError(f"train.fsdp_size={fsdp_size!r} sizes the FSDP groups of train.sharding 'hybrid' or 'auto', "
                         f"not {sharding!r}: unset it (None)")
    local = min(num_devices, jax.local_device_count()) if local_devices is None else local_devices
    if sharding == "replicate":
        return Layout(num_devices, 1, "train.sharding=replicate")
    if sharding == "fsdp":
        return Layout(1, num_devices, "train.sharding=fsdp")
    group, chosen = _host_group(num_devices, fsdp_size, local)
    if sharding == "hybrid":
        return Layout(num_devices // group, group, f"train.sharding=hybrid, FSDP groups of {chosen}")
    if num_devices == 1:
        return Layout(1, 1, "auto: one device")
    if state_bytes is None or state_bytes < 0:
        raise ValueError(f"state_bytes must be the bytes of the unsharded training state for train.sharding=auto, "
                         f"got {state_bytes!r}")
    state = f"auto: the f32 parameters, AdamW state and gradients ({_gib(state_bytes)} unsharded)"
    if memory_limit is None:
        return Layout(num_devices, 1, f"{state}; {platform} reports no memory limit: taken to fit, replicated")
    budget = AUTO_REPLICATE_SHARE * memory_limit
    limit = f"{AUTO_REPLICATE_SHARE:g} x {_gib(memory_limit)} of device memory"
    if state_bytes <= budget:
        return Layout(num_devices, 1, f"{state} fit in {limit}: replicated")
    if group > 1 and state_bytes / group <= budget:
        return Layout(num_devices // group, group, f"{state} exceed {limit}: split over FSDP groups of {chosen}, "
                                                   f"{_gib(state_bytes / group)} per device")
    over_groups = (f" ({_gib(state_bytes / group)} per device over groups of {chosen})"
                   if 1 < group < num_devices else "")
    return Layout(1, num_devices, f"{state} exceed {limit}{over_groups}: split over all {num_devices} devices, "
                                  f"{_gib(state_bytes / num_devices)} per device")


def check_batch_layout(global_batch: int, micro_batch: int, num_devices: int) -> int:
    """Gradient-accumulation steps for `global_batch` sequences with `micro_batch` per device.

    Raises ValueError naming the numbers unless global_batch = accum * micro_batch * num_devices
    and global_batch is divisible by the process count (each process loads global/processes rows).
    """
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch),
                        ("num_devices", num_devices)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per_step = micro_batch * num_devices
    if global_batch % per_step:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by micro_batch={micro_batch} x "
            f"num_devices={num_devices} = {per_step}; pick global_batch as a multiple of {per_step}"
        )
    processes = jax.process_count()
    if global_batch % processes:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by the process count {processes}"
        )
    return global_batch // per_step


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over `BATCH_AXES` (every device of the mesh), the rest whole."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, P())


def _leaf_shape(leaf: Any) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else ()


def fsdp_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
    """P(FSDP_AXIS) on the largest dimension divisible by `fsdp_size` (first on ties), else P()."""
    if fsdp_size <= 1:
        return P()
    best_dim = None
    for dim, size in enumerate(shape):
        if size % fsdp_size == 0 and (best_dim is None or size > shape[best_dim]):
            best_dim = dim
    if best_dim is None:
        return P()
    return P(*([None] * best_dim), FSDP_AXIS)


def param_shardings(mesh: Mesh, tree: Any) -> Any:
    """A tree of NamedSharding matching `tree` (params, optimizer state, an nnx.State...).

    Each leaf is split along its largest dimension divisible by the mesh's `FSDP_AXIS` size
    (ZeRO-3 style; GSPMD all-gathers it where it is used) and replicated along `DATA_AXIS`; scalars
    and leaves with no divisible dimension stay replicated. On a mesh whose FSDP_AXIS has size 1
    ("replicate") every leaf is replicated. Leaves may be arrays, jax.ShapeDtypeStruct or anything
    with `.shape` (no shape = scalar).
    """
    size = int(mesh.shape[FSDP_AXIS])
    return jax.tree.map(lambda leaf: NamedSharding(mesh, fsdp_spec(_leaf_shape(leaf), size)), tree)


def host_to_global(
    batch_local: Mapping[str, np.ndarray],
    mesh: Mesh,
    sharding: NamedSharding | None = None,
) -> dict[str, jax.Array]:
    """Stitch each process's rows into global arrays split over `BATCH_AXES` (multi-host correct).

    batch_local[k] holds this process's rows, [B_local, ...]; the global array is
    [B_local * process_count, ...]. B_local must be divisible by the number of this process's
    devices in the mesh, since each of them takes an equal share.
    """
    sharding = batch_sharding(mesh) if sharding is None else sharding
    # Only a leading dim split over the mesh is stitched across processes; otherwise (e.g.
    # `replicated(mesh)`) every process must pass the same full array.
    rows_split = len(sharding.spec) > 0 and sharding.spec[0] is not None
    local_devices = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    if local_devices == 0:
        raise ValueError("the mesh holds none of this process's devices; cannot place its batch")
    out: dict[str, jax.Array] = {}
    for key, local in batch_local.items():
        local = np.asarray(local)
        if local.ndim == 0:
            raise ValueError(f"batch_local[{key!r}] must have a leading batch dimension, got a scalar")
        global_shape = local.shape
        if rows_split:
            if local.shape[0] % local_devices:
                raise ValueError(
                    f"batch_local[{key!r}] has {local.shape[0]} rows, not divisible by this "
                    f"process's {local_devices} devices in the mesh"
                )
            global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
        out[key] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out


def tokens_per_second(tokens_per_step: int, step_seconds: float, num_devices: int) -> dict[str, float]:
    """Throughput telemetry: {"tokens_per_s": total, "tokens_per_s_per_device": total / devices}."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    total = tokens_per_step / step_seconds
    return {"tokens_per_s": total, "tokens_per_s_per_device": total / num_devices}


def scaling_efficiency(throughput_n: float, throughput_1: float, n: int) -> float:
    """throughput on n devices / (n x throughput on 1 device); 1.0 is perfect linear scaling."""
    if throughput_1 <= 0 or n < 1:
        raise ValueError(f"need throughput_1 > 0 and n >= 1, got {throughput_1}, {n}")
    return throughput_n / (n * throughput_1)


def mesh_size(mesh: Mesh) -> int:
    """Number of devices of the mesh: the batch is split over all of them (`BATCH_AXES`)."""
    return int(mesh.devices.size)


__all__ = [
    "DATA_AXIS", "FSDP_AXIS", "BATCH_AXES", "SHARDINGS", "AUTO_REPLICATE_SHARE", "Layout", "resolve_layout",
    "initialize_distributed", "distributed_request", "data_shard_index",
    "ProcessGroupError", "PeerFailed", "multi_process", "is_lead", "publish_failure", "lead_value", "gather", "barrier",
    "check_same", "all_or_none",
    "data_shard_count", "make_mesh", "check_batch_layout", "batch_sharding", "replicated",
    "fsdp_spec", "param_shardings", "host_to_global", "tokens_per_second", "scaling_efficiency",
    "mesh_size",
]
