"""The Pallas backward at the op level (twell_jax/ops/pallas_backward.py) in interpret mode on CPU:
the gradients (x, every weight, the L1 term) against jax.grad of the dense formula on adversarial
patterns, the tail and fallback paths, shard_map over 8 simulated devices and bitwise determinism.
(The kernels against their references and the training "auto" choice: test_pallas_bwd.py.)"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from twell_jax.pallas_kernels.twell_pack import pack_gate_reference
from oracles import TOL, rel_err
from test_ops import loss_of, make_inputs, oracle
from twell_jax import ops
from twell_jax.ops import dispatch, pallas_backward, pallas_forward

TILE, SLOTS = 16, 4


# ---------------------------------------------------------------------------------------------
# Op-level backward vs jax.grad of the dense formula
# ---------------------------------------------------------------------------------------------

# Tiny tiles so tile overflow, token tails and hot neurons occur at small shapes; chunks of 2 so
# the tail loops run several chunks, the last one partly filled. CONFIG_LADDER: a tail of 1 row or
# neuron takes a block of 1, longer ones blocks of 2 (the device-side size switch; one case runs it,
# since every block size is one more compiled body in the interpreter).
CONFIG = ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=8, tail_rows=0.5,
                             transpose_ell_width=6, transpose_tail_rows=0.5,
                             backward=pallas_backward.BackwardConfig(token_tail_chunk=2,
                                                                     neuron_tail_chunk=2,
                                                                     small_tail_chunk=2))
CONFIG_LADDER = dataclasses.replace(CONFIG, backward=dataclasses.replace(CONFIG.backward,
                                                                         small_tail_chunk=1))


def _nan_backward(x, weights):
    """A stand-in for the dense backward: NaN gradients show that the fallback ran."""
    return lambda: (jnp.full_like(x, jnp.nan), tuple(jnp.full_like(w, jnp.nan) for w in weights))


@functools.partial(jax.jit, static_argnums=(0, 1))
def pallas_grads(gated, config, x, weights, cot):
    """The Pallas backward called directly, with the NaN stand-in for its dense fallback."""
    w_act = weights[0]
    gy = cot.astype(x.dtype)
    pack = pack_gate_reference(x, w_act, tile=config.tile, slots=config.slots)
    return pallas_backward.backward(gated, x, weights, gy, jnp.float32(0.37), config, True, pack,
                                    _nan_backward(x, weights))


def _counts(x, weights, config):
    """(token-tail rows, hot neurons) of the pattern, the quantities the tails are sized by."""
    g = np.asarray(jnp.einsum("md,hd->mh", x.astype(jnp.float32), weights[0].astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST))
    _, _, counts = pack_gate_reference(x, weights[0], tile=config.tile, slots=config.slots)
    tail = np.asarray(ops.TailPolicy(config).pack_token_tail(counts))
    hot = ((g > 0) & ~tail[:, None]).sum(0) > config.hot_threshold(x.shape[0])
    return int(tail.sum()), int(hot.sum())


# gated, M, D, H, dtype, zero fraction, adversarial, (token-tail rows, hot neurons) expected > 0
# The gated f32 cases of CONFIG share one shape (one compiled backward in the interpreter); no
# dimension is a multiple of a tile or a block.
CASES = [
    (True, 29, 13, 41, jnp.float32, 0.97, "none", (False, False)),
    (True, 29, 13, 41, jnp.float32, 1.0, "none", (False, False)),  # all zero
    (True, 29, 13, 41, jnp.float32, 0.93, "dense_first_tokens", (True, False)),
    (True, 31, 19, 37, jnp.float32, 0.95, "hot_neuron", (False, True)),
    (True, 37, 16, 45, jnp.bfloat16, 0.9, "zero_and_dense_rows", (True, True)),
    (True, 29, 13, 41, jnp.float32, 0.95, "hot_neurons", (True, True)),  # 4 hot: two chunks
    (False, 19, 23, 31, jnp.bfloat16, 0.95, "hot_neuron", (False, True)),
]


@pytest.mark.parametrize("gated,m,d,h,dtype,zero_fraction,adversarial,tails", CASES)
def test_backward_matches_dense_grad(gated, m, d, h, dtype, zero_fraction, adversarial, tails):
    x, weights = make_inputs(gated, m, d, h, dtype, zero_fraction, seed=7,
                             adversarial="hot_neuron" if adversarial == "hot_neurons" else adversarial)
    if adversarial == "hot_neurons":  # four neurons active on every token, in three tiles
        weights = (weights[0].at[jnp.array([12, 20, 33]), 0].set(50.0),) + weights[1:]
    n_tail, n_hot = _counts(x, weights, CONFIG)
    assert (n_tail > 0, n_hot > 0) == tails  # the case exercises the paths it claims to
    assert n_tail <= CONFIG.tail_capacity(m) and n_hot <= CONFIG.transpose_tail_capacity(h)
    cot = jnp.asarray(np.random.default_rng(8).standard_normal((m, d)), jnp.float32)
    config = CONFIG_LADDER if (gated, adversarial) == (True, "hot_neuron") else CONFIG  # 1 hot: small block
    dx, dws = pallas_grads(gated, config, x, weights, cot)
    _, _, _, _, (dx_ref, dws_ref) = oracle(gated, x, weights, cot)
    for name, grad, ref in zip(("x", "w_act", "w_up", "w_down"), (dx, *dws), (dx_ref, *dws_ref)):
        assert grad.dtype == dtype and grad.shape == ref.shape, name
        assert not bool(jnp.any(jnp.isnan(grad))), f"{name}: the dense fallback ran"
        assert rel_err(grad, ref) < TOL[dtype], (name, rel_err(grad, ref))


def test_l1_gradient_alone():
    """gy = 0: the gradients are the L1 term's alone (sign(h) gl1 / M through the pattern)."""
    x, weights = make_inputs(True, 17, 13, 29, jnp.float32, 0.9, seed=9, adversarial="hot_neuron")
    cot = jnp.zeros((17, 13), jnp.float32)
    dx, dws = pallas_grads(True, CONFIG, x, weights, cot)
    _, _, _, _, (dx_ref, dws_ref) = oracle(True, x, weights, cot)
    assert float(jnp.max(jnp.abs(dx_ref))) > 0
    for grad, ref in zip((dx, *dws), (dx_ref, *dws_ref)):
        assert rel_err(grad, ref) < 1e-5
    assert not bool(jnp.any(dws[2]))  # dW_down = h^T gy = 0


@pytest.mark.parametrize("which", ["token", "neuron"])
def test_tail_capacity_exceeded_runs_the_dense_backward(which):
    x, weights = make_inputs(True, 23, 17, 53, jnp.float32, 0.9, seed=7,
                             adversarial="zero_and_dense_rows" if which == "token" else "hot_neuron")
    config = (ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=8, tail_rows=0,
                                  transpose_ell_width=6, transpose_tail_rows=1.0) if which == "token"
              else ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=8, tail_rows=1.0,
                                       transpose_ell_width=6, transpose_tail_rows=0))
    cot = jnp.ones((23, 17), jnp.float32)
    dx, dws = pallas_grads(True, config, x, weights, cot)
    assert all(bool(jnp.all(jnp.isnan(g))) for g in (dx, *dws))


def test_forward_aux_reports_the_backward_tails_and_a_fallback():
    """The tails are known from the forward's pattern: aux reports their sizes (the token-tail
    rows, the hot neurons) and "dense_fallback" says in advance that the backward will take the
    dense path (here the Pallas forward itself stays sparse)."""
    x, weights = make_inputs(True, 37, 16, 45, jnp.bfloat16, 0.9, seed=7,
                             adversarial="zero_and_dense_rows")
    for tail_rows, expected in ((0, 1), (1.0, 0)):
        config = ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=8, tail_rows=tail_rows,
                                     transpose_ell_width=6, transpose_tail_rows=1.0)
        n_tail, n_hot = _counts(x, weights, config)
        assert n_tail > 0 and n_hot > 0  # both tails exist on this pattern
        _, aux = ops.gated_ffn(x, *weights, backend="pallas", config=config, interpret=True)
        assert int(aux["row_overflow"]) > 0 and int(aux["dense_fallback"]) == expected
        assert (int(aux["backward_tail_rows"]), int(aux["backward_hot_neurons"])) == (n_tail, n_hot)
        _, aux_ref = ops.gated_ffn(x, *weights, backend="reference", config=config)
        assert int(aux_ref["backward_tail_rows"]) > 0 and int(aux_ref["backward_hot_neurons"]) > 0


@pytest.mark.parametrize("tile", [TILE, 512])
def test_kept_pattern_is_stored_small_and_restored_exactly(tile):
    """The residual of the training forward (`Kept`): uint8 offsets and int16 counts for tiles up
    to 256 lanes, the pack's int32 ids and counts for wider ones (the values are kept in rank
    order: test_pallas_bwd.py); the pattern it gives back has the same counts and the same indices
    in every live slot."""
    h = 41 if tile == TILE else 1500  # 3 tiles either way
    x, weights = make_inputs(True, 29, 13, h, jnp.float32, 0.9, seed=3, adversarial="dense_first_tokens")
    pack = pack_gate_reference(x, weights[0], tile=tile, slots=SLOTS)
    assert pack[1].shape[1] == 3
    kept = pallas_backward.Kept.store(jnp.zeros((29, 8), x.dtype), pack, jnp.zeros((1, 3 * tile), jnp.int32),
                                      h)
    small = tile <= 256
    assert kept.offsets.dtype == (jnp.uint8 if small else jnp.int32)
    assert kept.counts.dtype == (jnp.int16 if small else jnp.int32)
    indices, counts = kept.pattern(h)
    np.testing.assert_array_equal(counts, pack[2])
    live = np.arange(SLOTS)[None, None, :] < np.minimum(np.asarray(pack[2]), SLOTS)[:, :, None]
    assert live.sum() > 0 and np.asarray(pack[2]).max() > SLOTS  # overflowing tiles included
    np.testing.assert_array_equal(np.where(live, indices, 0), np.where(live, pack[1], 0))


def _triton_glue(text: str) -> dict[str, int]:
    """Counts over a program lowered for CUDA: sorts; converts widening a uint8 array; slices of a
    Triton kernel's output (a copy on the GPU, where the kernels take buffers); Triton calls given
    a uint8 operand (the kept pattern as it is stored)."""
    counts = dict(sort=text.count("stablehlo.sort"),
                  uint8_widened=len(re.findall(r"stablehlo\.convert %\S+ : \(tensor<[^>]*xui8>\) "
                                               r"-> tensor<[^>]*xi(16|32)>", text)),
                  sliced_outputs=0, uint8_operands=0)
    for func in text.split("func.func")[1:]:  # SSA names are per function
        calls = re.findall(r"(%[\w]+)(?::\d+)? = stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(.*", func)
        counts["sliced_outputs"] += sum(
            len(re.findall(rf"stablehlo\.slice {name}(#\d+)?\b", func)) for name in calls)
        for line in re.findall(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(.*", func):
            operand_types = line.rsplit(" : (", 1)[-1].split(") -> ")[0]
            counts["uint8_operands"] += "xui8>" in operand_types
    return counts


def test_backward_reads_the_kept_pattern_with_no_glue_copies(monkeypatch):
    """The op's forward + backward lowered for CUDA on the CPU (the program XLA gets on the GPU):
    the kept uint8 pattern reaches the transpose and list kernels as it is stored (no widened
    copy), the neuron-major launch order is no sort, and no kernel output is sliced (each slice
    would be a copy). The same counts on the recomputed pattern's program, which has no uint8."""
    from jax._src.lib import version as jaxlib_version
    if jaxlib_version > (0, 10, 2) and jax.default_backend() != "gpu":
        pytest.skip("jaxlib > 0.10.2 compiles Triton during lowering (needs a GPU)")
    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    m, d, h = 256, 64, 512
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    weights = tuple(jax.ShapeDtypeStruct((h, d), jnp.bfloat16) for _ in range(3))

    def glue(keep: bool) -> dict[str, int]:
        config = ops.SparseFFNConfig(pack_backend="triton", backward=pallas_backward.BackwardConfig(
            keep_gate_pattern=keep))

        def loss(x_, w_):
            y, aux = ops.gated_ffn(x_, *w_, backend="pallas", config=config)
            return jnp.sum(y.astype(jnp.float32)) + 1e-5 * aux["l1"]

        return _triton_glue(jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, weights).lower(
            lowering_platforms=("cuda",)).as_text())

    # Kept: the rank pass and the lists (in both branches that run the kernels) read uint8.
    assert glue(True) == dict(sort=0, uint8_widened=0, sliced_outputs=0, uint8_operands=3)
    assert glue(False) == dict(sort=0, uint8_widened=0, sliced_outputs=0, uint8_operands=0)


def test_backward_tails_capacities():
    """`backward_tails` (pure jnp, shared by the forward's aux and the backward's branch): the
    token tail and the hot neurons against their capacities, each alone."""
    counts = jnp.array([[1, 0], [5, 0], [2, 2], [0, 0]], jnp.int32)  # row 1 overflows S 4
    hist = jnp.array([[3, 0, 7, 1], [0, 0, 1, 0]], jnp.int32)  # two chunks; H 3 of 4 lanes
    base = dict(tile=4, slots=4, ell_width=3, transpose_ell_width=2)
    for tail_rows, hot_rows, over in ((2, 2, False), (1, 2, True), (2, 1, True)):
        config = ops.SparseFFNConfig(**base, tail_rows=tail_rows, transpose_tail_rows=hot_rows)
        tail, kernel_counts = pallas_backward.kernel_pattern(counts, config)
        np.testing.assert_array_equal(tail, [False, True, True, False])  # overflow; 4 > 3 actives
        np.testing.assert_array_equal(kernel_counts, [[1, 0], [0, 0], [0, 0], [0, 0]])
        hot, got = pallas_backward.backward_tails(tail, hist, 3, config)
        np.testing.assert_array_equal(hot, [True, False, True])  # counts 3, 0, 8 > 2
        assert bool(got) == over, (tail_rows, hot_rows)


@pytest.mark.parametrize("gated,m,block,dtype", [
    (True, 23, 8, jnp.float32),   # two full blocks and a partial one
    (True, 16, 8, jnp.bfloat16),  # full blocks only
    (False, 5, 8, jnp.float32),   # one partial block
])
def test_blocked_dense_backward_matches_dense(gated, m, block, dtype):
    """The dense branch of the Pallas backward, in row blocks: the gradients of the dense formula."""
    x, weights = make_inputs(gated, m, 12, 37, dtype, 0.5, seed=21, adversarial="dense_first_tokens")
    cot = jnp.asarray(np.random.default_rng(22).standard_normal((m, 12)), jnp.float32)
    dx, dws = jax.jit(pallas_backward.blocked_dense_backward, static_argnums=(0, 5))(
        gated, x, weights, cot.astype(dtype), jnp.float32(0.37), block)
    _, _, _, _, (dx_ref, dws_ref) = oracle(gated, x, weights, cot)
    for grad, ref in zip((dx, *dws), (dx_ref, *dws_ref)):
        assert grad.dtype == dtype and grad.shape == ref.shape
        assert rel_err(grad, ref) < TOL[dtype], rel_err(grad, ref)


def test_blocked_dense_backward_memory():
    """Its temporaries are [block, H], not [M, H]: the compiled program (CPU) needs far less
    temporary memory than the one-shot dense backward at M 4096, H 1024."""
    m, d, h = 4096, 64, 1024
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    weights = tuple(jax.ShapeDtypeStruct((h, d), jnp.bfloat16) for _ in range(3))
    gl1 = jax.ShapeDtypeStruct((), jnp.float32)

    def temp(fn):
        return jax.jit(fn).lower(x, weights, x, gl1).compile().memory_analysis().temp_size_in_bytes

    one_shot = temp(lambda *a: ops.dense_backward(True, *a))
    blocked = temp(lambda *a: pallas_backward.blocked_dense_backward(True, *a, 256))
    assert blocked < one_shot / 4, (blocked, one_shot)


def _forbid_dense_backward(monkeypatch) -> None:
    """Make the op's dense backward return NaN, so a test sees if the fallback ran."""
    monkeypatch.setattr(dispatch, "dense_backward",
                        lambda gated, x, weights, gy, gl1: _nan_backward(x, weights)())
    monkeypatch.setattr(pallas_backward, "blocked_dense_backward",
                        lambda gated, x, weights, gy, gl1, rows: _nan_backward(x, weights)())


def test_op_gradients_keep_vs_recompute_pattern_and_determinism(monkeypatch):
    """Through ops.gated_ffn (custom_vjp wiring, the training forward with tile overflow, the
    fix-up rows and a token tail): y and the gradients (L1 term included) match the dense oracle;
    recomputing the pattern in the backward gives the same bits as keeping it; two runs give the
    same bits."""
    _forbid_dense_backward(monkeypatch)
    x, weights = make_inputs(True, 21, 16, 47, jnp.float32, 0.92, seed=11,
                             adversarial="dense_first_tokens")
    cot = jnp.asarray(np.random.default_rng(12).standard_normal((21, 16)), jnp.float32)

    def y_and_grads(config):
        def loss(x_, w_):
            y, aux = ops.gated_ffn(x_, *w_, backend="pallas", config=config, interpret=True)
            return loss_of(y, aux["l1"], cot), (y, aux)
        (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, weights)
        assert int(aux["tile_overflow"]) > 0 and int(aux["backward_tail_rows"]) > 0  # the paths it claims
        assert int(aux["dense_fallback"]) == 0
        return (y, grads)

    keep = y_and_grads(CONFIG)
    recompute = y_and_grads(dataclasses.replace(CONFIG, backward=dataclasses.replace(
        CONFIG.backward, keep_gate_pattern=False)))
    again = y_and_grads(CONFIG)
    y_ref, _, _, _, grads_ref = oracle(True, x, weights, cot)
    for a, b, c, r in zip(jax.tree.leaves(keep), jax.tree.leaves(recompute), jax.tree.leaves(again),
                          jax.tree.leaves((y_ref, grads_ref))):
        assert rel_err(a, r) < 1e-5
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_under_shard_map_on_8_devices(monkeypatch):
    """ops.gated_ffn(..., backend="pallas", interpret=True) under an 8-device data mesh: the same
    gradients as the dense oracle (each shard runs the Pallas backward on its tokens)."""
    _forbid_dense_backward(monkeypatch)
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    m, d, h = 40, 16, 37
    x, weights = make_inputs(True, m, d, h, jnp.float32, 0.9, seed=13, adversarial="hot_neuron")
    cot = jnp.asarray(np.random.default_rng(14).standard_normal((m, d)), jnp.float32)
    config = ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=8, tail_rows=1.0,
                                 transpose_ell_width=2, transpose_tail_rows=1.0)

    def loss(x_, w_):
        y, aux = ops.gated_ffn(x_, *w_, backend="pallas", config=config, interpret=True)
        return loss_of(y, aux["l1"], cot)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weights)
    _, _, _, _, ref = oracle(True, x, weights, cot)
    for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        assert rel_err(a, r) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_partial_dense_gemms_are_exact_in_f32(dtype):
    """The sparse paths' dense GEMMs on some rows or neurons (the forward's recomputed rows, the
    token tail, the hot-neuron tail) sit beside kernel results computed in full f32: with f32
    operands every one asks for HIGHEST precision (XLA's default on a GPU is TF32, ~1e-3 relative:
    on an H200 test_backward_matches_dense_grad's dense-first-tokens case, which has a token tail,
    was 6e-4 off on x's gradient before); 16-bit programs unchanged."""
    m, d, h = 8, 16, 24
    x = jax.ShapeDtypeStruct((m, d), dtype)
    ws = tuple(jax.ShapeDtypeStruct((h, d), dtype) for _ in range(3))
    scale = jnp.float32(0.1)
    f32_acc = lambda: (jnp.zeros((m, d), jnp.float32), tuple(jnp.zeros((h, d), jnp.float32) for _ in range(3)))

    programs = {
        "forward rows": lambda x_, w_: pallas_forward._dense_rows(x_, *w_),
        "token tail rows": lambda x_, w_: pallas_backward.dense_rows_backward(True, x_, x_, w_, scale),
        "hot neurons": lambda x_, w_: pallas_backward.hot_neuron_backward(
            True, x_, x_, w_, scale, jnp.zeros((m,), bool), jnp.arange(4, dtype=jnp.int32), 4, 2, 2, f32_acc()),
    }
    for name, fn in programs.items():
        text = jax.jit(fn).trace(x, ws).lower().as_text()
        dots = re.findall(r"stablehlo\.dot_general.*", text)
        assert dots, name
        highest = [("precision = [HIGHEST, HIGHEST]" in line) for line in dots]
        assert all(highest) if dtype == jnp.float32 else not any(highest), (name, dtype, dots)
