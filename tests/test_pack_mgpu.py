"""The Mosaic GPU pack kernel (pallas_kernels/twell_pack_mgpu.py) and the op's pack backend choice.

This machine's JAX (0.10) has no CPU interpreter for Pallas Mosaic GPU kernels (no
`plgpu.InterpretGPUParams`), so on the CPU the kernel is checked as far as it goes without a GPU:
its argument checks, and its lowering to a Mosaic GPU module for CUDA (`lower(lowering_platforms=
("cuda",))`: layouts, shapes and the kernel body are checked there). On a
Hopper GPU (`pytest tests/test_pack_mgpu.py` on the device) the outputs are compared with the
pure-jnp reference and with the Triton kernel, bit for bit, on fresh random inputs and the
adversarial patterns (all zero, fully dense rows, one hot neuron, dense first tokens, odd shapes),
and the op's forward and gradients with either pack backend."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import ops
from twell_jax.ops import pallas_forward
from twell_jax.pallas_kernels import twell_pack_mgpu as mg
from twell_jax.pallas_kernels.twell_pack import pack_gate, pack_gate_reference

HOPPER = pallas_forward.is_hopper()
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (the kernel has no CPU interpreter here)")


def test_block_sizes_and_arguments_are_checked():
    for steps in (0, 5, True):
        with pytest.raises(ValueError, match="max_concurrent_steps must be an int in"):
            mg.MgpuPackBlockSizes(max_concurrent_steps=steps)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        mg.MgpuPackBlockSizes(epilogue="sort")
    for cluster in (0, 4, True):
        with pytest.raises(ValueError, match="cluster must be 1 or 2"):
            mg.MgpuPackBlockSizes(cluster=cluster)
    x = jnp.zeros((64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="16-bit activations"):
        mg.validate_mgpu_pack_args(x.astype(jnp.float32), jnp.zeros((256, 64), jnp.float32), 256, 32)
    with pytest.raises(ValueError, match="tile 256 and 8 <= slots <= 128"):
        mg.validate_mgpu_pack_args(x, jnp.zeros((256, 64), jnp.bfloat16), 128, 32)
    with pytest.raises(ValueError, match="w_HxD must be"):
        mg.validate_mgpu_pack_args(x, jnp.zeros((256, 32), jnp.bfloat16), 256, 32)


@pytest.mark.parametrize("steps,epilogue,cluster", [(4, "compact", 1), (3, "compact", 1), (4, "scan", 1),
                                                    (4, "compact", 2)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_kernel_lowers_for_cuda_on_this_jax(steps, epilogue, cluster, dtype):
    """The kernel lowers to a Mosaic GPU custom call (odd M, D and H: the wrapper pads); the
    compaction epilogue's own IR is built there too (its layout checks included)."""
    assert mg.available()
    x = jax.ShapeDtypeStruct((200, 320), dtype)
    w = jax.ShapeDtypeStruct((300, 320), dtype)
    sizes = mg.MgpuPackBlockSizes(steps, epilogue=epilogue, cluster=cluster)
    fn = jax.jit(lambda a, b: mg.pack_gate_mgpu(a, b, block_sizes=sizes))
    text = fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_the_op_chooses_its_pack_backend():
    config = ops.SparseFFNConfig()
    assert config.pack_backend == "auto"
    # interpret mode (the CPU tests) and f32 always run the Triton kernel under "auto"
    assert pallas_forward.resolve_pack_backend(config, jnp.bfloat16, interpret=True) == "triton"
    assert pallas_forward.resolve_pack_backend(config, jnp.float32, interpret=False) == "triton"
    assert pallas_forward.resolve_pack_backend(ops.SparseFFNConfig(pack_backend="triton"), jnp.bfloat16,
                                               interpret=False) == "triton"
    expected = "mosaic" if HOPPER else "triton"
    assert pallas_forward.resolve_pack_backend(config, jnp.bfloat16, interpret=False) == expected
    with pytest.raises(ValueError, match="pack_backend='mosaic' cannot run here: it has no interpreter"):
        pallas_forward.resolve_pack_backend(ops.SparseFFNConfig(pack_backend="mosaic"), jnp.bfloat16,
                                            interpret=True)
    reason = "it wants tile 256" if HOPPER else "it needs a Hopper GPU"
    with pytest.raises(ValueError, match=f"pack_backend='mosaic' cannot run here: {reason}"):
        pallas_forward.resolve_pack_backend(ops.SparseFFNConfig(pack_backend="mosaic", tile=128),
                                            jnp.bfloat16, interpret=False)
    with pytest.raises(ValueError, match="pack_backend must be one of auto, triton, mosaic"):
        ops.SparseFFNConfig(pack_backend="cuda")


def _patterns(dtype):
    key = jax.random.PRNGKey(7)
    kx, kw = jax.random.split(key)
    m, d, h = 384, 512, 768
    x = jax.random.normal(kx, (m, d), jnp.float32)
    w = jax.random.normal(kw, (h, d), jnp.float32) / np.sqrt(d)
    sparse_w = w.at[:, 0].set(-2.0)  # a bias column: ~2% of the gate positive
    x1 = x.at[:, 0].set(1.0)
    yield "random (half active)", x, w
    yield "sparse", x1, sparse_w
    yield "all zero", x, jnp.zeros_like(w)
    yield "fully dense rows", jnp.abs(x), jnp.abs(w)
    yield "one hot neuron", jnp.abs(x), jnp.zeros_like(w).at[5].set(jnp.abs(w[5]))
    yield "dense first tokens", x1.at[:8, 0].set(-3.0), sparse_w  # the bias column flips: ~all active
    yield "odd shape", x1[:200, :320], sparse_w[:300, :320]
    # active but tiny: f16 rounds most stored values to 0 (a slot is used by activity, not value)
    yield "tiny positives", x1 * 1e-4, sparse_w * 1e-4


@on_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("steps,epilogue,cluster", [(4, "compact", 1), (3, "compact", 1), (4, "scan", 1),
                                                    (3, "scan", 1), (4, "compact", 2)])
def test_mosaic_pack_matches_the_triton_kernel_and_the_reference(dtype, steps, epilogue, cluster):
    sizes = mg.MgpuPackBlockSizes(steps, epilogue=epilogue, cluster=cluster)
    for name, x, w in _patterns(dtype):
        x, w = x.astype(dtype), w.astype(dtype)
        got = mg.pack_gate_mgpu(x, w, block_sizes=sizes)
        triton = pack_gate(x, w)
        ref = pack_gate_reference(x, w)
        for part, a, b in zip(("values", "indices", "counts"), got, triton):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32) if part == "values" else a),
                                          np.asarray(b.astype(jnp.float32) if part == "values" else b),
                                          err_msg=f"{name}: {part} differ from the Triton kernel's")
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]), err_msg=f"{name}: counts")
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]), err_msg=f"{name}: indices")
        # values: the kernel's fp32 accumulation order against the reference's HIGHEST einsum
        np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32),
                                   rtol=2e-2, atol=1e-3, err_msg=f"{name}: values")


@on_hopper
def test_the_op_gives_the_same_bits_with_either_pack():
    key = jax.random.PRNGKey(3)
    kx, kg, ku, kd, ky = jax.random.split(key, 5)
    m, d, h = 512, 256, 1024
    x = jax.random.normal(kx, (m, d), jnp.float32).at[:, 0].set(1.0).astype(jnp.bfloat16)
    wg = (jax.random.normal(kg, (h, d)) / 16).at[:, 0].set(-0.15).astype(jnp.bfloat16)
    wu = (jax.random.normal(ku, (h, d)) / 16).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (h, d)) / 16).astype(jnp.bfloat16)
    gy = jax.random.normal(ky, (m, d)).astype(jnp.bfloat16)

    def run(pack_backend):
        config = ops.SparseFFNConfig(pack_backend=pack_backend)

        def loss(*args):
            y, aux = ops.gated_ffn(*args, backend="pallas", config=config)
            return jnp.sum(y.astype(jnp.float32) * gy) + aux["l1"], y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, wg, wu, wd)
        return y, grads

    y_t, g_t = run("triton")
    y_m, g_m = run("mosaic")
    np.testing.assert_array_equal(np.asarray(y_m, np.float32), np.asarray(y_t, np.float32))
    for a, b in zip(g_m, g_t):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bench_pack_refuses_without_a_hopper_gpu(tmp_path, capsys):
    if HOPPER:
        pytest.skip("this machine has a Hopper GPU")
    from twell_jax.bench import pack as bench_pack

    with pytest.raises(SystemExit) as exit_info:
        bench_pack.main(["--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        bench_pack.main(["--k", "29,x"])
    assert "--k / --op-k must be comma-separated numbers" in capsys.readouterr().err


def test_the_compaction_falls_back_to_scan_where_this_jax_cannot_build_it(monkeypatch):
    """The compaction epilogue's needs are checked before the launch (this JAX has them); a JAX
    without them gets the "scan" epilogue and a warning, not a failed lowering."""
    assert mg.compact_epilogue_available()
    assert not mg.compact_epilogue_available(tile=512)  # 128 columns of a row a thread: no 64-bit mask
    # shapes no other test lowers: a jit cache hit would skip the trace (and the choice)
    x = jax.ShapeDtypeStruct((136, 192), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((260, 192), jnp.bfloat16)
    monkeypatch.setattr(mg, "compact_epilogue_available", lambda tile=256: False)
    built = []
    monkeypatch.setattr(mg, "_compact_epilogue", lambda *a, **k: built.append(a))
    with pytest.warns(RuntimeWarning, match="running the 'scan' epilogue"):
        text = jax.jit(lambda a, b: mg.pack_gate_mgpu(a, b)).trace(x, w).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and not built
