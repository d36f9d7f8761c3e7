"""Data-parallel plumbing: process start-up, the device mesh, batch and parameter shardings.

One choke point for everything that knows about devices. The trainer builds the mesh with
`make_mesh`, enters it with `jax.set_mesh(mesh)`, places parameters with `param_shardings` and feeds
each step with `host_to_global`; `jax.jit` + `NamedSharding` (GSPMD) then inserts the gradient
all-reduce. The sparse op (`twell_jax/ops/`) wraps its Pallas calls in `jax.shard_map` over
`DATA_AXIS`, because Pallas kernels cannot be partitioned by GSPMD. docs/parallel.md explains why.

Multi-host: every process calls `initialize_distributed()` first, reads only its own slice of the
data (`data_shard_index()` of `data_shard_count()`), and `host_to_global` stitches the per-process
slices into one global array with `jax.make_array_from_process_local_data`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

logger = logging.getLogger(__name__)

DATA_AXIS = "data"

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
# that much); the measured presets need more: the `2b` dense twin at remat none peaked at 73.2 GiB of
# an 80 GB H100 (BENCHMARKS.md, "The paper's sizes"), which fits with 0.95 (75.2 GiB) and not with
# 0.75 (59.7 GiB). One process drives all of a host's GPUs here, so nothing else shares them.
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


def _distributed_is_initialized() -> bool:
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    # Older JAX without the public query: the runtime client exists once initialised.
    from jax._src import distributed as _distributed  # noqa: PLC0415

    return _distributed.global_state.client is not None


def initialize_distributed() -> None:
    """Start JAX's multi-process runtime when the environment asks for it; otherwise do nothing.

    Must run before any other JAX call touches the devices. Safe to call twice (the second call is
    a no-op). See `distributed_request` for the variables that count as a request.
    """
    if _distributed_is_initialized():
        return
    request = distributed_request()
    if request is None:
        return
    if request == "jax_env":
        # JAX reads JAX_COORDINATOR_ADDRESS itself but not these two, so pass them through.
        num_processes = _env_int("JAX_NUM_PROCESSES")
        process_id = _env_int("JAX_PROCESS_ID")
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ValueError(
                f"JAX_PROCESS_ID={process_id} must be in [0, JAX_NUM_PROCESSES={num_processes})"
            )
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=num_processes,
            process_id=process_id,
        )
    else:
        # SLURM and Open MPI: JAX's cluster detection reads coordinator, count and rank itself.
        jax.distributed.initialize()
    logger.info(
        "jax.distributed initialised via %s: process %d of %d, %d local / %d global devices",
        request, jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )


def data_shard_index() -> int:
    """Which slice of the data this process reads (its process index)."""
    return jax.process_index()


def data_shard_count() -> int:
    """How many slices the data is split into (the process count)."""
    return jax.process_count()


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh with axis `DATA_AXIS` over all devices, or over the first `num_devices`.

    The axis is `AxisType.Auto` (GSPMD propagation): model code stays free of sharding annotations,
    and `jax.shard_map` over "data" works the same on JAX 0.10 and 0.11. (`jax.make_mesh` defaults
    to Explicit axes, whose sharding-in-types would make every reshape in the model declare its
    output sharding.)
    """
    devices = jax.devices()
    if num_devices is None:
        num_devices = len(devices)
    if not isinstance(num_devices, (int, np.integer)) or isinstance(num_devices, bool) or num_devices < 1:
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
    # jax.devices() lists each process's devices contiguously, so a 1-D mesh in that order keeps a
    # process's batch rows on its own devices.
    return Mesh(np.asarray(devices[:num_devices]), (DATA_AXIS,), axis_types=(AxisType.Auto,))


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
    """Leading (batch) dimension split over `DATA_AXIS`, the rest whole."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, P())


def _leaf_shape(leaf: Any) -> tuple[int, ...]:
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else ()


def fsdp_spec(shape: tuple[int, ...], mesh_size: int) -> P:
    """P("data") on the largest dimension divisible by `mesh_size` (first on ties), else P()."""
    if mesh_size <= 1:
        return P()
    best_dim = None
    for dim, size in enumerate(shape):
        if size % mesh_size == 0 and (best_dim is None or size > shape[best_dim]):
            best_dim = dim
    if best_dim is None:
        return P()
    return P(*([None] * best_dim), DATA_AXIS)


def param_shardings(mesh: Mesh, tree: Any, fsdp: bool = False) -> Any:
    """A tree of NamedSharding matching `tree` (params, optimizer state, an nnx.State...).

    Default: every leaf replicated (plain data parallelism). With fsdp=True each leaf is split along
    its largest dimension divisible by the mesh size (ZeRO-3 style; GSPMD all-gathers it where it
    is used); scalars and leaves with no divisible dimension stay replicated. Leaves may be arrays,
    jax.ShapeDtypeStruct or anything with `.shape` (no shape = scalar).
    """
    size = mesh.shape[DATA_AXIS]
    if not fsdp:
        return jax.tree.map(lambda _: replicated(mesh), tree)
    return jax.tree.map(lambda leaf: NamedSharding(mesh, fsdp_spec(_leaf_shape(leaf), size)), tree)


def host_to_global(
    batch_local: Mapping[str, np.ndarray],
    mesh: Mesh,
    sharding: NamedSharding | None = None,
) -> dict[str, jax.Array]:
    """Stitch each process's rows into global arrays split over `DATA_AXIS` (multi-host correct).

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
    """Number of devices along `DATA_AXIS`."""
    return int(mesh.shape[DATA_AXIS])


__all__ = [
    "DATA_AXIS", "initialize_distributed", "distributed_request", "data_shard_index",
    "data_shard_count", "make_mesh", "check_batch_layout", "batch_sharding", "replicated",
    "fsdp_spec", "param_shardings", "host_to_global", "tokens_per_second", "scaling_efficiency",
    "mesh_size",
]
