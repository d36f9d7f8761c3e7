"""Tests of twell_jax/training/parallel.py (mesh, layouts, batch layout, shardings, host->global) on 8
simulated CPU devices (tests/conftest.py sets the XLA flag)."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from twell_jax.training import parallel as par

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 (simulated) devices: see tests/conftest.py"
)


# ----------------------------------------------------------------------------- mesh

@pytest.mark.parametrize("num_devices", [None, 1, 2, 8])
def test_make_mesh_sizes(num_devices):
    mesh = par.make_mesh(num_devices)
    expected = jax.device_count() if num_devices is None else num_devices
    assert mesh.axis_names == par.BATCH_AXES == ("data", "fsdp")
    assert dict(mesh.shape) == {"data": expected, "fsdp": 1}  # default: every device a replica
    assert par.mesh_size(mesh) == expected
    assert list(mesh.devices.flat) == jax.devices()[:expected]
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


def test_make_mesh_groups_consecutive_devices_into_fsdp_rows():
    mesh = par.make_mesh(8, fsdp_size=4)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    devices = jax.devices()
    assert [list(row) for row in mesh.devices] == [devices[:4], devices[4:8]]


@pytest.mark.parametrize("bad", [0, -1, 9, 2.0, True])
def test_make_mesh_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="num_devices"):
        par.make_mesh(bad)


@pytest.mark.parametrize("bad", [0, 3, 16, 2.0, None])
def test_make_mesh_rejects_fsdp_sizes_that_do_not_divide(bad):
    with pytest.raises(ValueError, match=r"fsdp_size must be a positive int dividing num_devices=8"):
        par.make_mesh(8, fsdp_size=bad)


@pytest.mark.parametrize("fsdp_size", [1, 4, 8])
def test_mesh_works_with_set_mesh_jit_and_shard_map(fsdp_size):
    """The mesh must serve both GSPMD (jit over NamedSharding) and shard_map over both axes."""
    mesh = par.make_mesh(8, fsdp_size)
    x_np = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    with jax.set_mesh(mesh):
        x = jax.device_put(x_np, par.batch_sharding(mesh))
        via_jit = jax.jit(lambda a: jnp.sum(a * a))(x)
        per_shard = jax.shard_map(
            lambda a: jax.lax.psum(jnp.sum(a * a), par.BATCH_AXES),
            in_specs=P(par.BATCH_AXES), out_specs=P(),
        )
        via_shard_map = jax.jit(per_shard)(x)
    np.testing.assert_allclose(via_jit, np.sum(x_np * x_np))
    np.testing.assert_allclose(via_shard_map, np.sum(x_np * x_np))
    # Row i of the batch lives on device i of jax.devices(), whatever the mesh's shape.
    for shard in x.addressable_shards:
        assert shard.index[0].start == jax.devices().index(shard.device)


# ----------------------------------------------------------------------------- layouts

_GIB = 2**30


@pytest.mark.parametrize("sharding, fsdp_size, shape, name", [
    ("replicate", None, (8, 1), "replicate"),
    ("fsdp", None, (1, 8), "fsdp"),
    ("hybrid", None, (2, 4), "hybrid"),  # one process's 4 devices per group
    ("hybrid", 2, (4, 2), "hybrid"),
    ("hybrid", 8, (1, 8), "fsdp"),  # a group of two whole processes: the shape is plain FSDP
])
def test_resolve_layout_as_asked(sharding, fsdp_size, shape, name):
    layout = par.resolve_layout(sharding, 8, fsdp_size=fsdp_size, local_devices=4)
    assert (layout.replicas, layout.fsdp_size) == shape and layout.sharding == name
    assert f"mesh data {shape[0]} x fsdp {shape[1]}" in layout.describe()
    assert f"train.sharding={sharding}" in layout.reason


@pytest.mark.parametrize("limit_gib, shape, words", [
    (None, (8, 1), "; cpu reports no memory limit: taken to fit, replicated"),
    (80.0, (8, 1), " fit in 0.5 x 80.00 GiB of device memory: replicated"),
    (30.0, (2, 4), " exceed 0.5 x 30.00 GiB of device memory: split over FSDP groups of one process's 4 devices, "
                   "10.00 GiB per device"),
    (12.0, (1, 8), " exceed 0.5 x 12.00 GiB of device memory (10.00 GiB per device over groups of one process's "
                   "4 devices): split over all 8 devices, 5.00 GiB per device"),
])
def test_auto_replicates_what_fits_and_splits_what_does_not(limit_gib, shape, words):
    """40 GiB of f32 state on 2 processes x 4 devices: replicated where half the device holds it,
    FSDP within a process where a quarter fits, FSDP over every device otherwise."""
    layout = par.resolve_layout("auto", 8, local_devices=4, state_bytes=40 * _GIB, platform="cpu",
                                memory_limit=None if limit_gib is None else int(limit_gib * _GIB))
    assert (layout.replicas, layout.fsdp_size) == shape
    assert layout.reason == "auto: the f32 parameters, AdamW state and gradients (40.00 GiB unsharded)" + words


def test_auto_on_one_device_and_with_a_group_size():
    assert (par.resolve_layout("auto", 1, state_bytes=10 * _GIB, memory_limit=_GIB).fsdp_size) == 1
    layout = par.resolve_layout("auto", 8, fsdp_size=2, local_devices=8, state_bytes=10 * _GIB,
                                memory_limit=12 * _GIB)
    assert (layout.replicas, layout.fsdp_size, layout.sharding) == (4, 2, "hybrid")
    assert "groups of train.fsdp_size=2" in layout.reason


@pytest.mark.parametrize("args, kwargs, message", [
    (("zero", 8), {}, r"train.sharding must be one of \('auto', 'replicate', 'fsdp', 'hybrid'\), got 'zero'"),
    (("hybrid", 8), {"fsdp_size": 3, "local_devices": 4}, r"train.fsdp_size=3 must divide the 8 devices"),
    (("hybrid", 16), {"fsdp_size": 8, "local_devices": 3}, r"train.fsdp_size=8 must divide the 16 devices and "
                                                            r"either divide a process's 3 devices"),
    (("replicate", 8), {"fsdp_size": 2}, r"train.fsdp_size=2 sizes the FSDP groups of train.sharding 'hybrid' or "
                                         r"'auto', not 'replicate'"),
    (("auto", 8), {}, r"state_bytes must be the bytes of the unsharded training state"),
])
def test_resolve_layout_refuses_bad_input_naming_the_field(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        par.resolve_layout(*args, **kwargs)


# ----------------------------------------------------------------------------- batch layout

@pytest.mark.parametrize(
    "global_batch, micro_batch, num_devices, accum",
    [(16, 2, 8, 1), (64, 2, 8, 4), (12, 3, 2, 2), (7, 7, 1, 1), (7, 1, 1, 7)],
)
def test_check_batch_layout_accum_steps(global_batch, micro_batch, num_devices, accum):
    assert par.check_batch_layout(global_batch, micro_batch, num_devices) == accum


@pytest.mark.parametrize(
    "global_batch, micro_batch, num_devices",
    [(10, 2, 8), (24, 4, 8), (9, 2, 1), (6, 4, 2)],
)
def test_check_batch_layout_names_the_numbers(global_batch, micro_batch, num_devices):
    with pytest.raises(ValueError) as err:
        par.check_batch_layout(global_batch, micro_batch, num_devices)
    message = str(err.value)
    for number in (global_batch, micro_batch, num_devices, micro_batch * num_devices):
        assert str(number) in message


@pytest.mark.parametrize("args", [(0, 1, 1), (8, 0, 1), (8, 1, 0), (8.0, 1, 1), (8, True, 1)])
def test_check_batch_layout_rejects_non_positive(args):
    with pytest.raises(ValueError, match="must be a positive int"):
        par.check_batch_layout(*args)


def test_check_batch_layout_requires_divisibility_by_process_count(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    with pytest.raises(ValueError, match="process count 3"):
        par.check_batch_layout(8, 1, 8)
    assert par.check_batch_layout(24, 1, 8) == 3


# ----------------------------------------------------------------------------- shardings

def test_batch_and_replicated_shardings():
    mesh = par.make_mesh(8, fsdp_size=4)
    assert par.batch_sharding(mesh) == NamedSharding(mesh, P(("data", "fsdp")))
    assert par.replicated(mesh) == NamedSharding(mesh, P())


def test_param_shardings_replicated_on_a_replicate_mesh():
    mesh = par.make_mesh(8)
    tree = {"w": jnp.zeros((16, 24)), "b": jnp.zeros((5,)), "step": jnp.zeros((), jnp.int32)}
    shardings = par.param_shardings(mesh, tree)
    assert jax.tree.structure(shardings) == jax.tree.structure(tree)
    assert all(s.spec == P() for s in jax.tree.leaves(shardings))


def test_param_shardings_of_a_hybrid_mesh_split_within_a_row_and_copy_across_rows():
    """A 2 x 4 mesh: each leaf split 4 ways over "fsdp", the same 4 pieces on both rows."""
    mesh = par.make_mesh(8, fsdp_size=4)
    w = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    placed = jax.device_put(w, par.param_shardings(mesh, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype)})["w"])
    assert placed.sharding.spec == P(None, "fsdp")
    pieces = {shard.device: (shard.index, np.asarray(shard.data)) for shard in placed.addressable_shards}
    for row in mesh.devices:
        assert [pieces[d][1].shape for d in row] == [(16, 6)] * 4
    for first, second in zip(mesh.devices[0], mesh.devices[1]):
        assert pieces[first][0] == pieces[second][0]
        np.testing.assert_array_equal(pieces[first][1], pieces[second][1])


@pytest.mark.parametrize(
    "shape, mesh_devices, spec",
    [
        ((16, 24), 8, P(None, "fsdp")),   # largest divisible dim wins
        ((24, 16), 8, P("fsdp")),
        ((16, 16), 8, P("fsdp")),          # tie: first dim
        ((16, 6), 8, P("fsdp")),           # only one dim divisible
        ((6, 10), 8, P()),                 # none divisible: replicate
        ((7,), 2, P()),
        ((), 8, P()),                      # scalar (e.g. optimizer count)
        ((3, 5), 1, P()),                  # 1-device mesh: nothing to split
        ((4, 2, 12), 2, P(None, None, "fsdp")),
    ],
)
def test_param_shardings_fsdp_picks_largest_divisible_dim(shape, mesh_devices, spec):
    mesh = par.make_mesh(mesh_devices, fsdp_size=mesh_devices)
    tree = {"leaf": jax.ShapeDtypeStruct(shape, jnp.float32)}
    assert par.param_shardings(mesh, tree)["leaf"].spec == spec


def test_param_shardings_fsdp_places_nnx_optimizer_state():
    """fsdp shardings apply to a real nnx model + optimizer state and keep values intact."""
    optax = pytest.importorskip("optax")
    from flax import nnx

    model = nnx.Linear(16, 24, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    _, state = nnx.split(optimizer)
    mesh = par.make_mesh(8, fsdp_size=8)
    shardings = par.param_shardings(mesh, state)
    placed = jax.device_put(state, shardings)
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(placed)):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
        if after.shape == (16, 24):
            assert after.sharding.spec == P(None, "fsdp")
            assert after.addressable_shards[0].data.shape == (16, 3)
        if after.shape == ():
            assert after.sharding.spec == P()


# ----------------------------------------------------------------------------- host -> global

@pytest.mark.parametrize("num_devices, fsdp_size", [(1, 1), (2, 1), (8, 1), (8, 4), (8, 8)])
def test_host_to_global_places_rows_in_order(num_devices, fsdp_size):
    mesh = par.make_mesh(num_devices, fsdp_size)
    tokens = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    mask = (tokens % 3 == 0)
    batch = par.host_to_global({"tokens": tokens, "mask": mask}, mesh)
    assert set(batch) == {"tokens", "mask"}
    assert batch["tokens"].shape == (8, 5) and batch["tokens"].dtype == jnp.int32
    assert batch["tokens"].sharding == par.batch_sharding(mesh)
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), tokens)
    np.testing.assert_array_equal(np.asarray(batch["mask"]), mask)
    rows_per_device = 8 // num_devices
    for shard in batch["tokens"].addressable_shards:
        start = shard.index[0].start or 0
        assert shard.data.shape == (rows_per_device, 5)
        np.testing.assert_array_equal(np.asarray(shard.data), tokens[start:start + rows_per_device])


def test_host_to_global_with_custom_sharding_replicates():
    mesh = par.make_mesh(2)
    tokens = np.arange(6, dtype=np.int32).reshape(3, 2)
    batch = par.host_to_global({"tokens": tokens}, mesh, sharding=par.replicated(mesh))
    assert batch["tokens"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), tokens)


def test_host_to_global_rejects_uneven_rows_and_scalars():
    mesh = par.make_mesh(8)
    with pytest.raises(ValueError, match="not divisible by this process's 8 devices"):
        par.host_to_global({"tokens": np.zeros((12, 3), np.int32)}, mesh)
    with pytest.raises(ValueError, match="leading batch dimension"):
        par.host_to_global({"tokens": np.zeros((), np.int32)}, mesh)


# ----------------------------------------------------------------------------- telemetry, start-up

def test_tokens_per_second_and_scaling_efficiency():
    stats = par.tokens_per_second(tokens_per_step=4096, step_seconds=0.5, num_devices=2)
    assert stats == {"tokens_per_s": 8192.0, "tokens_per_s_per_device": 4096.0}
    assert par.scaling_efficiency(1800.0, 1000.0, 2) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="step_seconds"):
        par.tokens_per_second(1, 0.0, 1)


_LAUNCH_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                "SLURM_NTASKS", "SLURM_PROCID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
          "JAX_PROCESS_ID": "1"}, "jax_env"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # salloc shell
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, "slurm"),
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
    ],
)
def test_distributed_request_detection(monkeypatch, env, expected):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert par.distributed_request() == expected


def test_initialize_distributed_calls_jax_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    par.initialize_distributed()
    assert calls == []  # single process: no-op

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    par.initialize_distributed()
    par.initialize_distributed()  # second call: already initialised, no second jax call
    [kwargs] = calls
    assert {k: kwargs[k] for k in ("coordinator_address", "num_processes", "process_id")} == \
        {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}


def test_initialize_distributed_rejects_bad_process_id(monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("must not start"))
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=2"):
        par.initialize_distributed()


# ============================================================================= trainer equivalence
# The same global batch must give the same training trajectory on 1, 2 and 8 devices: only the
# mesh (and with a fixed per-device micro-batch, the number of accumulation steps) changes.

from twell_jax import ops as ops_lib  # noqa: E402
from twell_jax.training import train as train_lib  # noqa: E402
from twell_jax.config import (ExperimentConfig, ModelConfig, OptimConfig,  # noqa: E402
                              SparsityConfig, TrainConfig)
from twell_jax.config import DataConfig  # noqa: E402

_SEQ_LEN = 8
_GLOBAL_BATCH = 8
_VOCAB = 300


def _micro_config(ffn_kind: str, backend: str, num_devices: int, steps: int = 4,
                  checkpoint_every: int = 0, sharding: str = "auto", fsdp_size: int | None = None) -> ExperimentConfig:
    sparse = ffn_kind == "twell"
    return ExperimentConfig(
        name=f"dp-{ffn_kind}-{backend}-{num_devices}",
        model=ModelConfig(vocab_size=_VOCAB, d_model=16, n_layers=1, n_heads=2, d_ff=64,
                          max_seq_len=_SEQ_LEN, ffn_kind=ffn_kind, ffn_backend=backend,
                          # small tiles so the TwELL path (not only its dense fallback) runs
                          ffn_op_config={"tile": 32, "slots": 8} if sparse else {},
                          compute_dtype="float32"),
        # No warm-up and a large lr: step 1 must move the parameters, so the later losses check
        # the all-reduced gradient, not only the forward.
        optim=OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
        sparsity=SparsityConfig(l1_coef=1e-3 if sparse else 0.0),
        # micro_batch=1: 8 / 4 / 1 accumulation steps on 1 / 2 / 8 devices.
        train=TrainConfig(steps=steps, global_batch=_GLOBAL_BATCH, micro_batch=1,
                          num_devices=num_devices, log_every=1, eval_batches=1, checkpoint_every=checkpoint_every,
                          eval_batch_size=_GLOBAL_BATCH, tensorboard=False, progress_bar=False,
                          sharding=sharding, fsdp_size=fsdp_size),
        # The library's synthetic source: random ids keyed by (seed, row), no tokenizer or corpus,
        # and every device count sees exactly the same global batches.
        data=DataConfig(source="synthetic", vocab_size=_VOCAB, seq_len=_SEQ_LEN, synthetic_sequences=4096,
                        progress=False),
    )


def _train(cfg: ExperimentConfig, run_dir, **run_kwargs) -> train_lib.TrainResult:
    trainer = train_lib.Trainer(cfg, run_dir, resume=run_kwargs.pop("resume", False), echo=lambda _: None)
    return trainer.run(**run_kwargs)


def _trajectory(result: train_lib.TrainResult) -> dict[str, np.ndarray]:
    return {key: np.array([record[key] for record in result.history], np.float64)
            for key in ("loss", "ce", "l1", "grad_norm")}


def _assert_same_trajectory(got: dict, want: dict, what: str) -> None:
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6,
                                   err_msg=f"{what}: {key} differs")


@pytest.fixture
def pallas_interpret(monkeypatch):
    """Run the op's Pallas kernels in the Pallas interpreter (CPU). The model has no knob for
    `interpret` yet (requested: a ModelConfig field), so wrap the op the model calls."""
    original = ops_lib.gated_ffn

    def gated_ffn_interpreted(*args, **kwargs):
        kwargs["interpret"] = True
        return original(*args, **kwargs)

    monkeypatch.setattr(ops_lib, "gated_ffn", gated_ffn_interpreted)


def _runs_on_1_2_and_8_devices(ffn_kind: str, backend: str, root, counts=(1, 2, 8), **config_kwargs) -> dict:
    """{num_devices: TrainResult} of the same run on 1, 2 and 8 devices (or `counts`)."""
    return {n: _train(_micro_config(ffn_kind, backend, n, **config_kwargs), root / str(n)) for n in counts}


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory) -> dict:
    """The dense FFN trained 4 steps on 1, 2 and 8 devices, checkpointing at step 2: shared by the
    equivalence, resume and telemetry tests (each run compiles a step: build them once)."""
    root = tmp_path_factory.mktemp("dense_runs")
    return {"root": root, **_runs_on_1_2_and_8_devices("relu_gated", "dense", root, checkpoint_every=2)}


@pytest.mark.parametrize(
    "ffn_kind, backend",
    [("relu_gated", "dense"), ("twell", "pallas")],
    ids=["dense-relu_gated", "sparse-twell-pallas-interpret"],
)
def test_same_losses_on_1_2_and_8_devices(tmp_path, request, ffn_kind, backend):
    """Same global batch => same loss, CE, L1 and gradient norm at every step on 1, 2, 8 devices
    (the sparse op runs inside shard_map over "data" on 2 and 8; the interpreted Pallas op on 1
    and 8 only: 2 devices add nothing the dense runs do not check, at the interpreter's cost)."""
    counts = (1, 2, 8)
    if backend == "pallas":
        request.getfixturevalue("pallas_interpret")
        # 2 steps: step 2's loss already depends on step 1's all-reduced update, and the Pallas
        # interpreter's cost grows with every step run (8 micro-batches per step on 1 device).
        counts = (1, 8)
        runs = _runs_on_1_2_and_8_devices(ffn_kind, backend, tmp_path, counts=counts, steps=2)
    else:
        runs = request.getfixturevalue("dense_runs")
    trajectories = {}
    for num_devices in counts:
        result = runs[num_devices]
        assert result.summary["num_devices"] == num_devices
        leaf = jax.tree.leaves(result.state["params"])[0]
        assert len(leaf.sharding.device_set) == num_devices
        trajectories[num_devices] = _trajectory(result)
    one = trajectories[1]
    assert len(one["loss"]) >= 2 and np.all(np.isfinite(one["loss"]))
    assert np.all(one["grad_norm"] > 0)
    # The parameters moved: identical trajectories must not come from a frozen model.
    assert not np.allclose(one["loss"][1:], one["loss"][:-1])
    if ffn_kind == "twell":
        assert np.all(one["l1"] > 0)
    for num_devices in counts[1:]:
        _assert_same_trajectory(trajectories[num_devices], one, f"{num_devices} devices vs 1")


def test_checkpoint_from_8_devices_resumes_on_2(tmp_path, dense_runs):
    """Resume the 8-device run from its step-2 checkpoint on 2 devices: steps 3-4 match an
    uninterrupted 2-device run."""
    import shutil

    steps = 4
    run_dir = tmp_path / "interrupted"
    shutil.copytree(dense_runs["root"] / "8", run_dir)  # the shared run stays as it is
    trainer = train_lib.Trainer(_micro_config("relu_gated", "dense", 2, steps), run_dir, resume=True,
                                resume_step=2, echo=lambda _: None)
    resumed = trainer.run()
    assert int(resumed.state["step"]) == steps
    leaf = jax.tree.leaves(resumed.state["params"])[0]
    assert len(leaf.sharding.device_set) == 2  # restored onto the new mesh, not the saved one
    straight = dense_runs[2]
    got, want = _trajectory(resumed), _trajectory(straight)
    assert len(got["loss"]) == steps  # the resumed history continues the saved one
    _assert_same_trajectory(got, want, "resumed (8 -> 2 devices) vs uninterrupted")
    # Adam divides by sqrt(v): near-zero gradients turn summation-order noise (4 vs 1 micro-batch
    # per device) into ~1e-6 parameter noise; one real update is ~lr = 1e-2, far above atol.
    for a, b in zip(jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(straight.state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_step_telemetry_reports_throughput(dense_runs):
    result = dense_runs[2]
    tokens_per_step = _GLOBAL_BATCH * _SEQ_LEN
    for record in result.history:
        assert record["step_time_s"] > 0
        assert record["tokens_per_s"] == pytest.approx(tokens_per_step / record["step_time_s"])
        assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)


# ============================================================================= two-level mesh
# The hybrid layout (FSDP within a group, data parallel across groups) on 4 devices as a 2 x 2 mesh,
# against plain replication on the same 4 devices and the same global batch.


def _specs(tree) -> list:
    return [leaf.sharding.spec for leaf in jax.tree.leaves(tree) if leaf.ndim]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> dict:
    """The dense micro model trained 4 steps on 4 devices, replicated and hybrid 2 x 2, checkpointing at
    step 2."""
    root = tmp_path_factory.mktemp("layout_runs")
    runs = {"root": root}
    for name, fsdp_size in (("replicate", None), ("hybrid", 2)):
        cfg = _micro_config("relu_gated", "dense", 4, checkpoint_every=2, sharding=name, fsdp_size=fsdp_size)
        runs[name] = _train(cfg, root / name)
    return runs


def test_hybrid_mesh_trains_like_replicate_with_its_state_split_within_rows(layout_runs):
    hybrid, replicate = layout_runs["hybrid"], layout_runs["replicate"]
    got, want = _trajectory(hybrid), _trajectory(replicate)
    assert len(want["loss"]) == 4 and not np.allclose(want["loss"][1:], want["loss"][:-1])
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"hybrid 2x2 vs replicate: {key}")
    # Replicated: every array whole on every device. Hybrid: params and both Adam moments split over
    # "fsdp" (never over "data"), each device holding half of every split dimension.
    assert set(_specs(replicate.state)) == {P()}
    for part in ("params", "opt_state"):
        specs = _specs(hybrid.state[part])
        assert specs and all(spec == P() or "fsdp" in spec for spec in specs)
        assert all("data" not in spec for spec in specs)
        assert sum(spec != P() for spec in specs) >= len(specs) // 2, f"{part}: few leaves split: {specs}"
    embedding = hybrid.state["params"]["embed"]
    assert dict(embedding.sharding.mesh.shape) == {"data": 2, "fsdp": 2}
    assert embedding.sharding.spec == P("fsdp") and embedding.addressable_shards[0].data.shape == (_VOCAB // 2, 16)
    assert len(embedding.sharding.device_set) == 4


def test_a_hybrid_checkpoint_resumes_onto_another_layout(tmp_path, layout_runs):
    """Orbax restores the hybrid run's step-2 checkpoint onto a 1 x 4 FSDP mesh: steps 3-4 match the
    uninterrupted replicated run, and the restored state is split 4 ways."""
    import shutil

    run_dir = tmp_path / "interrupted"
    shutil.copytree(layout_runs["root"] / "hybrid", run_dir)
    cfg = _micro_config("relu_gated", "dense", 4, checkpoint_every=2, sharding="fsdp")
    resumed = train_lib.Trainer(cfg, run_dir, resume=True, resume_step=2, echo=lambda _: None).run()
    embedding = resumed.state["params"]["embed"]
    assert dict(embedding.sharding.mesh.shape) == {"data": 1, "fsdp": 4}
    assert embedding.addressable_shards[0].data.shape == (_VOCAB // 4, 16)
    _assert_same_trajectory(_trajectory(resumed), _trajectory(layout_runs["replicate"]),
                            "resumed (hybrid 2x2 -> fsdp 1x4) vs replicated")


def test_the_sparse_op_splits_tokens_over_both_axes_and_gathers_fsdp_weights(monkeypatch):
    """Under a 2 x 2 mesh the op's shard_map splits the tokens 4 ways (both axes) and takes its
    FSDP-split weights whole: output, aux and gradients equal the call without a mesh."""
    from twell_jax.ops import dispatch

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((13, 9)), jnp.float32)  # 13 tokens: padded to 16
    weights = tuple(jnp.asarray(rng.standard_normal((20, 9)) / 3, jnp.float32) for _ in range(3))
    config = ops_lib.SparseFFNConfig(tile=8, slots=2, ell_width=4, tail_rows=1.0)

    def loss(x_, w_):
        y, aux = ops_lib.gated_ffn(x_, *w_, backend="reference", config=config)
        return jnp.sum(y * y) + aux["l1"], (y, aux)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, aux)), grads = step(x, weights)
    shards = []
    original = dispatch._sharded_call
    monkeypatch.setattr(dispatch, "_sharded_call", lambda *a: shards.append(a[-1]) or original(*a))
    mesh = par.make_mesh(4, fsdp_size=2)
    with jax.set_mesh(mesh):
        split = jax.device_put(weights, par.param_shardings(mesh, weights))
        assert split[0].sharding.spec == P("fsdp")
        (_, (y_m, aux_m)), grads_m = step(x, split)
    assert shards == [4]
    np.testing.assert_allclose(y_m, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux_m["l1"], aux["l1"], rtol=1e-5)
    assert float(aux_m["l0"]) == pytest.approx(float(aux["l0"]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads_m), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~55 s; the op's own check under a 2 x 2 mesh is in the fast tier (above)
def test_the_sparse_op_under_a_hybrid_mesh_matches_replicate(tmp_path, pallas_interpret):
    """The twell FFN's Pallas kernels (interpreted) inside the op's shard_map over both axes, its
    weights all-gathered from their FSDP shards as they enter: the same trajectory as replicated."""
    runs = {name: _train(_micro_config("twell", "pallas", 4, steps=2, sharding=name, fsdp_size=size), tmp_path / name)
            for name, size in (("replicate", None), ("hybrid", 2))}
    got, want = _trajectory(runs["hybrid"]), _trajectory(runs["replicate"])
    assert np.all(want["l1"] > 0)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"sparse, hybrid 2x2 vs replicate: {key}")
    assert any("fsdp" in spec for spec in _specs(runs["hybrid"].state["params"]["blocks"]["ffn"]))


def test_auto_with_a_small_device_memory_picks_fsdp_and_says_why(tmp_path, monkeypatch):
    """A device limit of twice the unsharded state: replicated it would take all of the share auto
    allows (0.5), split over the 4 devices it fits, so auto chooses FSDP and prints why."""
    from twell_jax.training import preflight

    cfg = _micro_config("relu_gated", "dense", 4, steps=1)
    estimate = preflight.memory_estimate(cfg, 4, fsdp_size=1)
    state_bytes = estimate["parameters"] + estimate["optimizer_state"] + estimate["gradients"]
    monkeypatch.setattr(preflight, "device_memory_limit_bytes", lambda: state_bytes + 1024)
    lines = []
    result = train_lib.Trainer(cfg, tmp_path / "auto", echo=lines.append).run()
    [line] = [line for line in lines if line.startswith("[twell] sharding:")]
    assert line.startswith("[twell] sharding: fsdp (mesh data 1 x fsdp 4): auto: the f32 parameters, AdamW state "
                           "and gradients (")
    assert "GiB of device memory (" not in line  # one process: its group is every device, no second tier
    assert " exceed 0.5 x " in line and "split over FSDP groups of one process's 4 devices" in line
    embedding = result.state["params"]["embed"]
    assert embedding.sharding.spec == P("fsdp") and dict(embedding.sharding.mesh.shape) == {"data": 1, "fsdp": 4}


@pytest.mark.parametrize("data_axis, refused", [("data", True), (["fsdp"], True), (None, False),
                                                 (["data", "fsdp"], False), (["fsdp", "data", "x"], False)])
def test_an_op_data_axis_must_cover_both_mesh_axes(data_axis, refused):
    import dataclasses as dc

    from twell_jax.training import preflight

    cfg = _micro_config("twell", "pallas", 4)
    cfg = dc.replace(cfg, model=dc.replace(cfg.model, ffn_op_config={**cfg.model.ffn_op_config, "data_axis": data_axis}))
    if refused:
        with pytest.raises(ValueError, match=r"data_axis=.* must name both mesh axes the trainer splits the batch "
                                             r"over, \['data', 'fsdp'\], or be None"):
            preflight.check_op_config(cfg)
    else:
        preflight.check_op_config(cfg)


def test_the_default_auto_on_a_cpu_replicates_the_trained_state(dense_runs):
    result = dense_runs[8]
    assert set(_specs(result.state)) == {P()}
    assert dict(jax.tree.leaves(result.state["params"])[0].sharding.mesh.shape) == {"data": 8, "fsdp": 1}
    assert result.summary["mesh"] == {"data": 8, "fsdp": 1}  # the layout that ran, in summary.json


# ============================================================================= two processes
_TWO_PROCESS_WORKER = r'''
import json
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
import jax.numpy as jnp
import numpy as np
from twell_jax.training import parallel as par

par.initialize_distributed()          # driven by JAX_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID
par.initialize_distributed()          # second call: no-op
mesh = par.make_mesh()
rows = 8
assert par.check_batch_layout(rows, 2, par.mesh_size(mesh)) == 1
tokens = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)
local = rows // par.data_shard_count()
mine = tokens[par.data_shard_index() * local:(par.data_shard_index() + 1) * local]
batch = par.host_to_global({"tokens": mine}, mesh)
weights = jnp.arange(1, rows + 1)[:, None]  # row-dependent: a misplaced row changes the sum
with jax.set_mesh(mesh):
    total = jax.jit(lambda t: jnp.sum(t * weights), out_shardings=par.replicated(mesh))(batch["tokens"])
print("RESULT " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                              "devices": jax.device_count(), "shape": list(batch["tokens"].shape),
                              "total": int(total), "want": int(np.sum(tokens * np.asarray(weights)))}))
'''


def test_two_processes_stitch_their_rows_into_one_global_batch(tmp_path):
    """Multi-host path on one machine: 2 CPU processes x 2 devices, launched through the JAX_* env
    variables; each passes only its rows, the jitted global computation sees the whole batch."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_TWO_PROCESS_WORKER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for process_id in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                   JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(process_id),
                   PYTHONPATH=os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, output[-3000:]
        line = next(l for l in output.splitlines() if l.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["processes"] == 2 and r["devices"] == 4
        assert r["shape"] == [8, 3]
        assert r["total"] == r["want"]


# ----------------------------------------------------------------------------- device memory



def test_claim_device_memory_sets_the_fraction_before_the_backend_starts(monkeypatch):
    from jax._src import xla_bridge

    for name in (par.MEMORY_FRACTION_VARIABLE, "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert par.claim_device_memory() == f"XLA_PYTHON_CLIENT_MEM_FRACTION={par.DEVICE_MEMORY_FRACTION}"
    assert os.environ[par.MEMORY_FRACTION_VARIABLE] == str(par.DEVICE_MEMORY_FRACTION)
    with pytest.raises(ValueError, match="fraction must be in"):
        monkeypatch.delenv(par.MEMORY_FRACTION_VARIABLE)
        par.claim_device_memory(1.5)


def test_claim_device_memory_keeps_the_users_setting_and_a_started_backend(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.delenv(par.MEMORY_FRACTION_VARIABLE, raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert par.claim_device_memory() == "XLA_PYTHON_CLIENT_PREALLOCATE=false (set by the user)"
    assert par.MEMORY_FRACTION_VARIABLE not in os.environ
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
    monkeypatch.setenv(par.MEMORY_FRACTION_VARIABLE, "0.5")
    assert par.claim_device_memory() == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 (set by the user)"
    assert os.environ[par.MEMORY_FRACTION_VARIABLE] == "0.5"
    monkeypatch.delenv(par.MEMORY_FRACTION_VARIABLE)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)  # too late: nothing set
    assert par.claim_device_memory() is None and par.MEMORY_FRACTION_VARIABLE not in os.environ


def test_default_xla_flags_add_what_the_user_did_not_name(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    added = par.default_xla_flags()
    assert added == " ".join(f"--{k}={v}" for k, v in par.DEFAULT_XLA_FLAGS)
    assert os.environ["XLA_FLAGS"] == added
    assert par.default_xla_flags() == ""  # all named now: nothing added twice
    first_key = par.DEFAULT_XLA_FLAGS[0][0]
    monkeypatch.setenv("XLA_FLAGS", f"--{first_key}=false --xla_dump_to=/tmp/x")
    par.default_xla_flags()
    flags = os.environ["XLA_FLAGS"].split()
    assert f"--{first_key}=false" in flags and f"--{first_key}=true" not in flags  # the user's value stands
    assert "--xla_dump_to=/tmp/x" in flags and len(flags) == 1 + len(par.DEFAULT_XLA_FLAGS)
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert par.default_xla_flags() is None and "XLA_FLAGS" not in os.environ  # too late: says so


def _loop_all_reduces(hlo: str) -> list[str]:
    """The all-reduce instructions of computations run inside a while loop (a body or condition, or
    anything those call), of a compiled program's HLO text."""
    import re

    bodies: dict[str, str] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            bodies[name] = ""
        elif name is not None:
            bodies[name] += line + "\n"
    calls = {n: set(re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", text))
             for n, text in bodies.items()}
    loops = {c for text in bodies.values() for c in re.findall(r"(?:body|condition)=%?([\w.\-]+)", text)}
    seen, todo = set(), list(loops)
    while todo:
        n = todo.pop()
        if n in seen or n not in bodies:
            continue
        seen.add(n)
        todo.extend(calls[n])
    return [line.strip() for n in seen for line in bodies[n].splitlines() if " all-reduce(" in line
            or "all-reduce-start(" in line]


@pytest.mark.parametrize("grad_reduce", ["step", "micro_batch"])
def test_gradients_are_reduced_once_a_step_or_in_each_micro_batch(tmp_path, grad_reduce):
    """train.grad_reduce=step (the default) on 2 replicating devices with 4 micro-batches a step: no
    gradient (f32 weight-shaped) all-reduce runs inside the accumulation loop, only the neuron
    counts' (s32); "micro_batch": the partitioner's reduction sits in the loop. The start-up line says
    which. Both train the sparse model to the same step metrics (tests/test_parallel's tolerances)."""
    cfg = _micro_config("twell", "reference", 2, steps=2)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_reduce=grad_reduce))
    lines: list[str] = []
    trainer = train_lib.Trainer(cfg, tmp_path / grad_reduce, echo=lines.append)
    result = trainer.run()
    assert trainer.accum_steps == 4
    said = next(line for line in lines if line.startswith("[twell] gradients:"))
    assert ("reduced once a step" in said) == (grad_reduce == "step")
    in_loop = _loop_all_reduces(trainer.planner._compiled.as_text())
    # A weight gradient: an f32 matrix among the all-reduce's results (one, or a tuple of combined ones).
    gradients = [line for line in in_loop if re.search(r"f32\[\d+,\d+", line.split(" all-reduce")[0])]
    assert bool(gradients) == (grad_reduce == "micro_batch"), gradients[:3]
    if grad_reduce == "step":
        assert in_loop and all("s32[" in line for line in in_loop)  # the neuron counts, each micro-batch


def test_reducing_once_a_step_reports_what_reducing_per_micro_batch_does(tmp_path):
    """The sparse model (the op's reference backend: its aux as the kernels report it) on 2 devices, 4
    micro-batches a step: every step metric of grad_reduce=step equals grad_reduce=micro_batch's, and
    those that do not depend on the micro-batch layout a 1-device run's (to rounding)."""
    runs = {}
    for name, devices, reduce in (("one", 1, "step"), ("step", 2, "step"), ("micro", 2, "micro_batch")):
        cfg = _micro_config("twell", "reference", devices, steps=3)
        cfg = dataclasses.replace(cfg, sparsity=dataclasses.replace(cfg.sparsity, track_neurons=True),
                                  train=dataclasses.replace(cfg.train, grad_reduce=reduce))
        _train(cfg, tmp_path / name)
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [r for r in records if "loss" in r]
    assert len(runs["one"]) == 3
    keys = [k for k, v in runs["one"][0].items() if isinstance(v, (int, float, list)) and k not in (
        "step", "step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_memory_bytes")]
    assert {"loss", "l0_per_layer", "row_overflow_per_layer", "dead_share_per_layer",
            "position_profile"} <= set(keys)
    # Against the other reduction on the same devices: every metric. Against one device: those that do
    # not count per micro-batch call (2 devices run half the micro-batches, each of twice the rows).
    per_call = {"dense_fallback_per_layer", "backward_tail_rows_per_layer", "backward_hot_neurons_per_layer",
                "hot_neuron_share_per_layer", "hot_entry_share_per_layer"}
    for other, reference, compared in (("step", "micro", keys), ("step", "one", set(keys) - per_call)):
        for want, got in zip(runs[reference], runs[other]):
            for key in compared:
                np.testing.assert_allclose(np.asarray(got[key], np.float64), np.asarray(want[key], np.float64),
                                           rtol=2e-5, atol=1e-6,
                                           err_msg=f"{other} vs {reference}: {key} at step {want['step']}")
