"""TwELL in a decode step (interpret mode): the sparse gate's tile lists
(`decode_matvec(..., tile_lists=True)`: each column tile's active neurons packed in the product's
epilogue) against `tile_lists_reference`, with their hidden values (tile_values=True: the up
product of the listed neurons in the same launch) against `tile_values_reference`; the fused
up/down kernel that reads the lists (`sparse_decode_ffn_tiles`: the norm on load, the residual, the
dense switch's limit) and the down kernel that reads the values (`sparse_decode_down_tiles`)
against the compacted-list kernel and the plain-jnp oracle; then the model's step with
decode.sparse_ffn="tiles" and "packed" against the XLA path, with its launches counted."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.inference import decode_plan
from twell_jax.inference.decode_engine import decode
from twell_jax.model import init_cache, init_model
from twell_jax.pallas_kernels import decode_matvec as matvec_lib
from twell_jax.pallas_kernels.decode_matvec import (MatvecBlockSizes, decode_matvec, decode_matvec_reference,
                                                    tile_lists_reference, tile_values_reference)
from twell_jax.pallas_kernels.twell_decode import (compact_active_reference, sparse_decode_down_tiles,
                                                   sparse_decode_ffn_fused, sparse_decode_ffn_tiles)
from test_decode_kernels import (BASE, FUSED_SMALL, FUSED_WIDE, KERNELS, TOL_FUSED, XLA, _pallas_names_and_row_sums,
                                 _run, _step_eqns, fused_inputs, fused_oracle)
from oracles import rel_err

GATE = MatvecBlockSizes(block_n=16, block_k=16)  # tiles of 16 columns; K steps of 16
PATTERNS = ("sparse", "none", "all", "one_hot_last_row", "first_row_dense")
# The down kernels' cases in the fast tier (tests/conftest.py): every pattern, gated or not, in both
# dtypes at 3 rows, and 17 rows (a second token block) once; the slow tier adds 1 and 17 rows of each.
FAST_DOWN_CASES = (*(f"3-{p}-{g}-{d}" for p in ("sparse", "none", "one_hot", "all") for g in (True, False)
                     for d in ("float32", "bfloat16")), "17-sparse-False-float32")


def gate_inputs(m, n, k, pattern, seed=0):
    """x [M, K], w [N, K] fp32 whose product g = x . w^T fires by `pattern`: g[r, j] ~ bias_j +
    a_j * sign_r (column 0 of x is 1, column 1 the row's sign, the rest small noise). "sparse":
    ~10% of the neurons on every row, ~10% on the rows of sign +1 only; "none"; "all";
    "one_hot_last_row": neuron 7n // 11 on the last row only; "first_row_dense": every neuron on
    row 0 (a dense first token), none elsewhere."""
    rng = np.random.default_rng(seed)
    sign = np.where(np.arange(m) % 2 == 0, -1.0, 1.0)
    if pattern in ("one_hot_last_row", "first_row_dense"):
        sign = -np.ones(m)
        sign[m - 1 if pattern == "one_hot_last_row" else 0] = 1.0
    x = np.concatenate([np.ones((m, 1)), sign[:, None], 0.01 * rng.normal(size=(m, k - 2))], axis=1)
    bias, slope = np.full(n, -10.0), np.zeros(n)
    if pattern == "sparse":
        draw = rng.random(n)
        bias[draw < 0.1] = 10.0
        bias[(draw >= 0.1) & (draw < 0.2)], slope[(draw >= 0.1) & (draw < 0.2)] = 0.0, 5.0
    elif pattern == "all":
        bias[:] = 10.0
    elif pattern == "one_hot_last_row":
        bias[(7 * n) // 11], slope[(7 * n) // 11] = 0.0, 5.0
    elif pattern == "first_row_dense":
        bias[:], slope[:] = 0.0, 5.0
    elif pattern != "none":
        raise ValueError(pattern)
    w = np.concatenate([bias[:, None], slope[:, None], 0.01 * rng.normal(size=(n, k - 2))], axis=1)
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


@pytest.mark.parametrize("m,n", [(1, 37), (3, 64), (8, 151), (16, 40)])
def test_gate_tile_lists_equal_their_reference(m, n):
    for i, pattern in enumerate(PATTERNS):
        x, w = gate_inputs(m, n, 40, pattern, seed=100 * m + n + i)
        out, ids, count, pairs = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True,
                                               interpret=True)
        n_tiles = -(-n // 16)
        assert ids.shape == (16 * n_tiles,) and count.shape == pairs.shape == (n_tiles,), pattern
        assert ids.dtype == count.dtype == pairs.dtype == jnp.int32
        # The product itself is the plain kernel's (the lists are an epilogue).
        np.testing.assert_array_equal(np.asarray(out), np.asarray(
            decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, interpret=True)))
        for got, want in zip((ids, count, pairs), tile_lists_reference(out, 16)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=pattern)
        on = np.asarray(out) > 0
        union = np.flatnonzero(np.any(on, axis=0))
        listed = np.concatenate([np.asarray(ids[t * 16: t * 16 + int(count[t])]) for t in range(n_tiles)])
        np.testing.assert_array_equal(listed, union, err_msg=pattern)  # every active neuron, ascending
        assert int(np.sum(pairs)) == int(np.sum(on)), pattern
        # Each tile's slots are a permutation of its neurons (padding columns clamped to N - 1).
        for t in range(n_tiles):
            want_slots = np.minimum(np.arange(t * 16, t * 16 + 16), n - 1)
            np.testing.assert_array_equal(np.sort(np.asarray(ids[t * 16: t * 16 + 16])), want_slots)
        expected_union = {"none": 0, "all": n, "one_hot_last_row": 1, "first_row_dense": n}.get(pattern)
        if expected_union is not None:
            assert union.size == expected_union, pattern
        if pattern == "first_row_dense":
            assert int(np.sum(pairs)) == n  # row 0 only


@pytest.mark.parametrize("m,n,programs", [(1, 151, 13), (3, 64, 5), (16, 40, 3)])
def test_gate_tile_lists_of_balanced_programs(m, n, programs):
    """MatvecBlockSizes.programs_n: `programs` tiles of ceil(n / programs) <= 16 columns each in 16
    slots (the lanes past the width off): the same product, lists equal to the reference of that
    width, every active neuron listed once, ascending."""
    balanced = dataclasses.replace(GATE, programs_n=programs)
    width = -(-n // programs)
    n_tiles = -(-n // width)
    for i, pattern in enumerate(PATTERNS):
        x, w = gate_inputs(m, n, 40, pattern, seed=7 * m + n + i)
        out, ids, count, pairs = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=balanced, tile_lists=True,
                                               interpret=True)
        assert ids.shape == (16 * n_tiles,) and count.shape == pairs.shape == (n_tiles,), pattern
        np.testing.assert_array_equal(np.asarray(out), np.asarray(
            decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, interpret=True)))
        for got, want in zip((ids, count, pairs), tile_lists_reference(out, 16, width)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=pattern)
        on = np.asarray(out) > 0
        listed = np.concatenate([np.asarray(ids[t * 16: t * 16 + int(count[t])]) for t in range(n_tiles)])
        np.testing.assert_array_equal(listed, np.flatnonzero(np.any(on, axis=0)), err_msg=pattern)
        assert int(np.sum(pairs)) == int(np.sum(on)), pattern
        if m == 3:  # the values of tiles narrower than their slots: each at its id's slot
            up = jax.random.normal(jax.random.key(i), (n, 40))
            *_, values = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=balanced, tile_lists=True,
                                       tile_values=True, up=up, interpret=True)
            live = _live_slots(ids, count)
            want = tile_values_reference(out, ids, count, x, up)
            assert rel_err(values[:, live], want[:, live]) <= TOL_VALUES[jnp.float32], pattern


def test_gate_tile_lists_with_the_norm_and_a_stacked_layer():
    """The sparse layer's gate as the model calls it: RMSNorm prologue, stacked weights read in place."""
    x, w = gate_inputs(3, 37, 40, "sparse", seed=5)
    stack = jnp.stack([w * 0.5, w, -w])
    scale = jnp.abs(jax.random.normal(jax.random.key(1), (3, 40))) + 0.5
    layer = jnp.asarray([1], jnp.int32)
    out, ids, count, pairs = decode_matvec(x, stack, layer=layer, norm_scale=scale, out_dtype=jnp.float32,
                                           block_sizes=GATE, tile_lists=True, interpret=True)
    want = decode_matvec_reference(x, stack, layer=layer, norm_scale=scale, out_dtype=jnp.float32)
    assert rel_err(out, want) <= 1e-6
    for got, ref in zip((ids, count, pairs), tile_lists_reference(out, 16)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert int(jnp.sum(count)) > 0


def test_gate_tile_lists_reject_what_they_cannot_pack():
    x, w = gate_inputs(3, 37, 40, "sparse")
    call = lambda xx=x, **kw: decode_matvec(xx, w, out_dtype=jnp.float32, tile_lists=True, interpret=True,  # noqa: E731
                                            **{"block_sizes": GATE, **kw})
    with pytest.raises(ValueError, match="every row in one program"):
        call(jnp.tile(x, (6, 1)))  # 18 rows > max_block_m 16
    with pytest.raises(ValueError, match="activation"):
        call(activation="relu")
    with pytest.raises(ValueError, match="residual"):
        call(residual=jnp.zeros((3, 37), jnp.float32))
    with pytest.raises(ValueError, match="split_k"):
        call(block_sizes=MatvecBlockSizes(block_n=16, block_k=16, split_k=2))


TOL_VALUES = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}  # the up product's fp32 sum order, then one rounding


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m,n", [(1, 37), (3, 64), (16, 40)])
@pytest.mark.fast_params(*(f"3-64-{g}-{d}" for g in (True, False) for d in ("float32", "bfloat16")),
                         "16-40-True-float32", "1-37-False-bfloat16")
def test_gate_tile_values_equal_their_reference(dtype, gated, m, n):
    """tile_values=True: the same product and lists as tile_lists alone, and each listed neuron's
    hidden value at its id's slot (round(relu(g) * u), u = x . up[id]; round(relu(g)) without up);
    every pattern, a dense first row (all 16 slots of a tile: four steps of 4) and one hot neuron
    included; tiles of 64 slots below."""
    for i, pattern in enumerate(PATTERNS):
        x, w = (a.astype(dtype) for a in gate_inputs(m, n, 40, pattern, seed=31 * m + n + i))
        up = jax.random.normal(jax.random.key(m + i), (n, 40), dtype) if gated else None
        out, ids, count, pairs, values = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True,
                                                       tile_values=True, up=up, interpret=True)
        assert values.shape == (m, ids.shape[0]) and values.dtype == dtype, pattern
        plain = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True, interpret=True)
        for got, want in zip((out, ids, count, pairs), plain):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=pattern)
        live = _live_slots(ids, count)  # the slots after a tile's count are not written
        want = tile_values_reference(out, ids, count, x, up)
        assert rel_err(values[:, live], want[:, live]) <= TOL_VALUES[dtype], pattern
        if pattern in ("sparse", "all", "first_row_dense"):  # the values are not all zero: the check can fail
            assert np.any(np.asarray(values, np.float32)[:, live] != 0), pattern


def _live_slots(ids, count):
    tile = ids.shape[0] // count.shape[0]
    return np.flatnonzero((np.arange(ids.shape[0]) % tile) < np.repeat(np.asarray(count), tile))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_gate_tile_values_of_wide_tiles(pattern):
    """Tiles of 64 slots (the model's gate): a tile's 0 to 64 active neurons in steps of 4, the
    last one partial (151 neurons: tiles of 64, 64 and 23 columns)."""
    wide = MatvecBlockSizes(block_n=64, block_k=16)
    x, w = gate_inputs(3, 151, 40, pattern, seed=8)
    up = jax.random.normal(jax.random.key(9), (151, 40))
    out, ids, count, _, values = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=wide, tile_lists=True,
                                               tile_values=True, up=up, interpret=True)
    live = _live_slots(ids, count)
    want = tile_values_reference(out, ids, count, x, up)
    assert rel_err(values[:, live], want[:, live]) <= TOL_VALUES[jnp.float32]
    if pattern in ("all", "first_row_dense"):
        assert list(np.asarray(count)) == [64, 64, 23]


@pytest.mark.parametrize("elements", [64, 128])
def test_gate_tile_values_in_narrower_steps(elements, monkeypatch):
    """A wider model takes fewer active neurons a step (values_chunk: 1 and 2 here at K = 44 -> 64):
    the same values, over tiles with many active neurons (a dense first row: 16 a tile). Shapes of
    this test only (the chunk is read when the kernel is traced: no cached trace may answer)."""
    assert matvec_lib.values_chunk(2048) == 4 and matvec_lib.values_chunk(2560) == 2  # the defaults
    monkeypatch.setattr(matvec_lib, "VALUES_STEP_ELEMENTS", elements)
    assert matvec_lib.values_chunk(44) == elements // 64
    n = 29 + elements // 64
    for pattern in ("first_row_dense", "sparse"):
        x, w = gate_inputs(3, n, 44, pattern, seed=elements)
        up = jax.random.normal(jax.random.key(elements), (n, 44))
        out, ids, count, _, values = decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True,
                                                   tile_values=True, up=up, interpret=True)
        live = _live_slots(ids, count)
        want = tile_values_reference(out, ids, count, x, up)
        assert rel_err(values[:, live], want[:, live]) <= TOL_VALUES[jnp.float32], pattern


def test_gate_tile_values_with_the_norm_and_a_stacked_layer():
    """As the model's packed way calls it: the RMSNorm prologue feeds the up product too, and the
    up rows are read in place at the layer of a stack."""
    x, w = gate_inputs(3, 37, 40, "sparse", seed=6)
    x = x * 5.0
    stack = jnp.stack([w * 0.5, w, -w])
    up = jax.random.normal(jax.random.key(3), (3, 37, 40))
    scale = jnp.abs(jax.random.normal(jax.random.key(1), (3, 40))) + 0.5
    layer = jnp.asarray([1], jnp.int32)
    out, ids, count, _, values = decode_matvec(x, stack, layer=layer, norm_scale=scale, eps=1e-5,
                                               out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True,
                                               tile_values=True, up=up, interpret=True)
    xn = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-5) * scale[1]
    want = tile_values_reference(out, ids, count, xn, up[1])
    live = _live_slots(ids, count)
    assert live.size > 0 and rel_err(values[:, live], want[:, live]) <= TOL_VALUES[jnp.float32]
    assert rel_err(tile_values_reference(out, ids, count, x, up[1]), want) > 1e-2  # the norm is not a no-op
    assert rel_err(tile_values_reference(out, ids, count, xn, up[0]), want) > 1e-2  # nor the layer


def test_gate_tile_values_reject_bad_arguments():
    x, w = gate_inputs(3, 37, 40, "sparse")
    call = lambda **kw: decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, interpret=True, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="tile_values needs tile_lists"):
        call(tile_values=True)
    with pytest.raises(ValueError, match="up must be"):
        call(tile_lists=True, tile_values=True, up=w[:, :39])
    with pytest.raises(ValueError, match="up must be"):
        call(tile_lists=True, up=w)  # up without tile_values would be ignored
    with pytest.raises(ValueError, match="layout 'nk'"):
        decode_matvec(x, w.T, layout="kn", tile_lists=True, tile_values=True, up=w.T, block_sizes=GATE,
                      interpret=True)


def _down_oracle(x, out, ids, count, up, down, residual):
    """The down product of the gate's lists in float64: residual + sum over the listed neurons of
    their reference hidden values (rounded as the kernel stores them) . W_down[id], rounded once."""
    values = np.asarray(tile_values_reference(out, ids, count, x, up), np.float64)  # 0 past each count
    y = values @ np.asarray(jnp.take(down, ids, axis=0), np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return jnp.asarray(y.astype(np.float32)).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m,n,block_n", [(1, 37, 16), (3, 64, 16), (2, 151, 64)])
@pytest.mark.fast_params(*(f"3-64-16-{g}-{d}" for g in (True, False) for d in ("float32", "bfloat16")),
                         "2-151-64-True-bfloat16", "1-37-16-False-float32")
def test_gate_down_product_equals_its_oracle(dtype, gated, m, n, block_n):
    """down=W_down: the gate's launch also makes y = residual + values . W_down[ids] (each tile's
    fp32 partial, the tiles' partials summed; in interpret mode by a second launch), the lists and
    values unchanged; every pattern (a dense first row: 16 or 64 active neurons a tile, several
    steps of the values' epilogue adding into one partial), with and without the residual; nothing
    active: exactly the residual."""
    sizes = MatvecBlockSizes(block_n=block_n, block_k=16)
    for i, pattern in enumerate(PATTERNS):
        x, w = (a.astype(dtype) for a in gate_inputs(m, n, 40, pattern, seed=7 * m + n + i))
        up = jax.random.normal(jax.random.key(m + i), (n, 40), dtype) if gated else None
        down = jax.random.normal(jax.random.key(50 + i), (n, 40), dtype)
        residual = jax.random.normal(jax.random.key(90 + i), (m, 40), dtype)
        call = lambda **kw: decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=sizes, tile_lists=True,  # noqa: E731
                                          tile_values=True, up=up, interpret=True, **kw)
        outs = call(down=down, down_residual=residual)
        assert len(outs) == 6 and outs[5].shape == (m, 40) and outs[5].dtype == dtype, pattern
        for got, want in zip(outs[:4], call()[:4]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=pattern)
        out, ids, count = outs[:3]
        want = _down_oracle(x, out, ids, count, up, down, residual)
        assert rel_err(outs[5], want) <= TOL_FUSED[dtype], pattern
        alone = call(down=down)[5]
        assert rel_err(alone, _down_oracle(x, out, ids, count, up, down, None)) <= TOL_FUSED[dtype], pattern
        if int(jnp.sum(count)) == 0:  # "none" (and a row of "sparse" that drew no neuron)
            np.testing.assert_array_equal(np.asarray(outs[5], np.float32), np.asarray(residual, np.float32))
            np.testing.assert_array_equal(np.asarray(alone, np.float32), 0.0)
        else:  # the product is not a no-op
            assert rel_err(want, residual) > 1e-2, pattern
        assert pattern in ("none", "sparse") or int(jnp.sum(count)) > 0, pattern


def test_gate_down_product_with_the_norm_a_stacked_layer_and_counters():
    """As the model's "packed_down" calls it: the norm prologue, the up and W_down rows read in
    place at the layer of a stack, the barrier's counters (int32 [L]), which interpret mode (a
    second launch, no barrier) returns as given, and down_limit (several rows' device switch)."""
    x, w = gate_inputs(3, 37, 40, "sparse", seed=6)
    x = x * 5.0
    stack = jnp.stack([w * 0.5, w, -w])
    up = jax.random.normal(jax.random.key(3), (3, 37, 40))
    down = jax.random.normal(jax.random.key(4), (3, 37, 40))
    scale = jnp.abs(jax.random.normal(jax.random.key(1), (3, 40))) + 0.5
    sync = jnp.asarray([5, 6, 7], jnp.int32)
    outs = decode_matvec(x, stack, layer=jnp.asarray([1], jnp.int32), norm_scale=scale, eps=1e-5,
                         out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True, tile_values=True, up=up,
                         down=down, down_residual=x, sync=sync, interpret=True)
    assert len(outs) == 7
    np.testing.assert_array_equal(np.asarray(outs[6]), np.asarray(sync))
    xn = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + 1e-5) * scale[1]
    out, ids, count = outs[:3]
    want = _down_oracle(xn, out, ids, count, up[1], down[1], x)
    assert int(jnp.sum(count)) > 0 and rel_err(outs[5], want) <= 1e-5
    assert rel_err(_down_oracle(xn, out, ids, count, up[1], down[0], x), want) > 1e-2  # the layer's W_down
    # down_limit: the sparse side of the device switch (a union above it reads no partial: y = x)
    union = int(jnp.sum(count))
    for limit, expect in ((union, outs[5]), (union - 1, x)):
        limited = decode_matvec(x, stack, layer=jnp.asarray([1], jnp.int32), norm_scale=scale, eps=1e-5,
                                out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True, tile_values=True, up=up,
                                down=down, down_residual=x, down_limit=limit, sync=sync, interpret=True)
        np.testing.assert_array_equal(np.asarray(limited[5]), np.asarray(expect), err_msg=str(limit))


def test_gate_down_product_rejects_bad_arguments():
    x, w = gate_inputs(3, 37, 40, "sparse")
    call = lambda **kw: decode_matvec(x, w, out_dtype=jnp.float32, block_sizes=GATE, tile_lists=True,  # noqa: E731
                                      interpret=True, **kw)
    with pytest.raises(ValueError, match="down must be"):
        call(down=w)  # without tile_values
    with pytest.raises(ValueError, match="down must be"):
        call(tile_values=True, down=w[:, :39])
    with pytest.raises(ValueError, match="pass down=W_down"):
        call(tile_values=True, down_residual=x)
    with pytest.raises(ValueError, match="pass down=W_down"):
        call(tile_values=True, sync=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="pass down=W_down"):
        call(tile_values=True, down_limit=3)
    with pytest.raises(ValueError, match="down_limit must be"):
        call(tile_values=True, down=w, down_limit=-1)
    with pytest.raises(ValueError, match="down_residual must be"):
        call(tile_values=True, down=w, down_residual=x[:2])
    with pytest.raises(ValueError, match="sync must be int32"):
        call(tile_values=True, down=w, sync=jnp.zeros((1,), jnp.float32))
    with pytest.raises(ValueError, match=r"sync must be int32 \(3,\)"):  # one counter per layer of a stack
        decode_matvec(x, jnp.stack([w] * 3), layer=jnp.asarray([0], jnp.int32), out_dtype=jnp.float32,
                      block_sizes=GATE, tile_lists=True, tile_values=True, down=jnp.stack([w] * 3),
                      sync=jnp.zeros((1,), jnp.int32), interpret=True)


class _FakeDevice:
    def __init__(self, platform, core_count=None):
        self.platform = platform
        if core_count is not None:
            self.core_count = core_count


def test_the_grid_barrier_runs_only_where_every_program_is_resident(monkeypatch):
    """`_grid_is_resident`: a GPU with at least as many SMs as the launch has programs; never the
    CPU, nor a device that does not say how many SMs it has."""
    assert not matvec_lib._grid_is_resident(88)  # this machine: the CPU
    for device, programs, want in [(_FakeDevice("gpu", 132), 88, True), (_FakeDevice("gpu", 132), 132, True),
                                   (_FakeDevice("gpu", 132), 133, False), (_FakeDevice("gpu"), 8, False),
                                   (_FakeDevice("cpu", 132), 8, False)]:
        monkeypatch.setattr(jax, "devices", lambda *a, device=device: [device])
        assert matvec_lib._grid_is_resident(programs) == want, (vars(device), programs)


def _values_of(x, g, up, tile):
    ids, count = tile_lists_reference(g, tile)[:2]
    return tile_values_reference(g, ids, count, x, up), ids, count


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m,pattern", [(1, "sparse"), (3, "sparse"), (17, "sparse"), (3, "none"), (3, "one_hot"),
                                       (3, "all")])
@pytest.mark.fast_params(*FAST_DOWN_CASES)
def test_down_tiles_kernel_equals_the_oracle(dtype, gated, m, pattern):
    """The packed values' down kernel: residual + values . W_down[ids] over the tile lists equals
    the fused kernels' oracle (the same neurons' h, then W_down) and the tiles kernel that makes h
    itself, for tiles of 16 and 64 slots and both block sizes; nothing active: the residual."""
    x, g, w_up, w_down, residual = fused_inputs(dtype, m, pattern, seed=m + 10 * gated + 3)
    up = w_up if gated else None
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    oracle = fused_oracle(x, g, order, n, up, w_down, 160, residual)
    for sizes in (FUSED_SMALL, FUSED_WIDE):
        for tile in (16, 64):
            values, ids, count = _values_of(x, g, up, tile)
            y = sparse_decode_down_tiles(values, ids, count, w_down, residual_MxD=residual, block_sizes=sizes,
                                         interpret=True)
            assert y.shape == x.shape and y.dtype == x.dtype
            assert rel_err(y, oracle) <= TOL_FUSED[dtype], (sizes, tile)
            tiles = sparse_decode_ffn_tiles(x, g, ids, count, up, w_down, residual_MxD=residual, block_sizes=sizes,
                                            interpret=True)
            assert rel_err(y, tiles) <= TOL_FUSED[dtype], (sizes, tile)
    if pattern == "none":
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(residual, np.float32))
    else:  # the products are not a no-op
        assert rel_err(oracle, residual) > 1e-2
    no_residual = sparse_decode_down_tiles(values, ids, count, w_down, block_sizes=FUSED_SMALL, interpret=True)
    assert rel_err(no_residual, fused_oracle(x, g, order, n, up, w_down, 160, None)) <= TOL_FUSED[dtype]


def test_down_tiles_kernel_at_a_stacked_layer_and_its_limit():
    x, g, w_up, w_down, residual = fused_inputs(jnp.float32, 3, "sparse", layers=3, seed=12)  # a union of 20
    values, ids, count = _values_of(x, g, w_up[2], 16)
    layer = jnp.asarray([2], jnp.int32)
    run = lambda limit, li=layer: sparse_decode_down_tiles(values, ids, count, w_down, layer=li,  # noqa: E731
                                                           residual_MxD=residual, limit=limit,
                                                           block_sizes=FUSED_SMALL, interpret=True)
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    assert rel_err(run(None), fused_oracle(x, g, order, n, w_up[2], w_down[2], 160, residual)) <= 1e-6
    assert rel_err(run(None, jnp.asarray([0], jnp.int32)), run(None)) > 1e-2  # another layer's rows
    np.testing.assert_array_equal(np.asarray(run(19)), np.asarray(residual))  # 20 > 19: nothing read
    np.testing.assert_array_equal(np.asarray(run(20)), np.asarray(run(None)))


def test_down_tiles_kernel_rejects_bad_arguments():
    x, g, w_up, w_down, residual = fused_inputs(jnp.float32, 3, "sparse")
    values, ids, count = _values_of(x, g, w_up, 16)
    call = lambda **kw: sparse_decode_down_tiles(**{"values": values, "ids": ids, "count": count,  # noqa: E731
                                                    "w_down_HxD": w_down, "interpret": True, **kw})
    with pytest.raises(ValueError, match="values must be"):
        call(values=values[:, :-1])
    with pytest.raises(ValueError, match="w_down_HxD must be"):
        call(w_down_HxD=w_down.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"w_down_HxD must be .*\[L, H, D\] with layer"):
        call(layer=jnp.asarray([0], jnp.int32))
    with pytest.raises(ValueError, match="layer must be"):
        call(w_down_HxD=jnp.stack([w_down] * 2), layer=jnp.asarray(0, jnp.int32))
    with pytest.raises(ValueError, match="count"):
        call(count=count.astype(jnp.float32))
    with pytest.raises(ValueError, match="ids"):
        call(ids=ids[:32], count=count[:2], values=values[:, :32])
    with pytest.raises(ValueError, match="limit"):
        call(limit=-1)
    with pytest.raises(ValueError, match="residual_MxD"):
        call(residual_MxD=residual[:2])


def _lists(g, tile, width=None):
    return tile_lists_reference(g, tile, width)[:2]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m,pattern", [(1, "sparse"), (3, "sparse"), (17, "sparse"), (3, "none"), (3, "one_hot"),
                                       (3, "all")])
@pytest.mark.fast_params(*FAST_DOWN_CASES)
def test_tiles_kernel_equals_the_compacted_list_kernel(dtype, gated, m, pattern):
    """The same neurons in the same (ascending) order: the same sums as `sparse_decode_ffn_fused`,
    bit for bit in interpret mode, for tiles of 16 and of 64 slots (151 neurons: 10 and 3 tiles),
    and tiles narrower than their slots (MatvecBlockSizes.programs_n: 12 of 16, 47 of 64)."""
    x, g, w_up, w_down, residual = fused_inputs(dtype, m, pattern, seed=m + 10 * gated)
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    up = w_up if gated else None
    for sizes in (FUSED_SMALL, FUSED_WIDE):
        want = sparse_decode_ffn_fused(x, g, order, n, up, w_down, capacity=160, residual_MxD=residual,
                                       block_sizes=sizes, interpret=True)
        oracle = fused_oracle(x, g, order, n, up, w_down, 160, residual)
        for tile, width in ((16, 16), (64, 64), (16, 12), (64, 47)):
            ids, count = _lists(g, tile, width)
            y = sparse_decode_ffn_tiles(x, g, ids, count, up, w_down, residual_MxD=residual, block_sizes=sizes,
                                        interpret=True)
            assert y.shape == x.shape and y.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
            assert rel_err(y, oracle) <= TOL_FUSED[dtype]
    if pattern == "none":  # nothing active: exactly the residual
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(residual, np.float32))


@pytest.mark.parametrize("gated", [True, False])
def test_tiles_kernel_limit_is_the_sparse_side_of_the_switch(gated):
    x, g, w_up, w_down, residual = fused_inputs(jnp.float32, 3, "sparse", seed=11)  # a union of 20
    ids, count = _lists(g, 16)
    up = w_up if gated else None
    run = lambda limit: sparse_decode_ffn_tiles(x, g, ids, count, up, w_down, residual_MxD=residual,  # noqa: E731
                                                limit=limit, block_sizes=FUSED_SMALL, interpret=True)
    np.testing.assert_array_equal(np.asarray(run(19)), np.asarray(residual))  # 20 > 19: nothing read
    np.testing.assert_array_equal(np.asarray(run(20)), np.asarray(run(None)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiles_kernel_normalises_x_on_load_at_a_stacked_layer(dtype):
    """x un-normalised + the layer's norm scale: what the kernel computes from RMSNorm(x) itself."""
    x, g, w_up, w_down, residual = fused_inputs(dtype, 3, "sparse", layers=3, seed=21)
    x = (x.astype(jnp.float32) * 7.0).astype(dtype)
    scale = jnp.abs(jax.random.normal(jax.random.key(2), (3, x.shape[1]))) + 0.5
    layer = jnp.asarray([2], jnp.int32)
    ids, count = _lists(g, 16)
    y = sparse_decode_ffn_tiles(x, g, ids, count, w_up, w_down, layer=layer, norm_scale=scale, eps=1e-5,
                                residual_MxD=residual, block_sizes=FUSED_WIDE, interpret=True)
    x32 = x.astype(jnp.float32)
    xn = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=1, keepdims=True) + 1e-5) * scale[2]).astype(dtype)
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    want = fused_oracle(xn, g, order, n, w_up[2], w_down[2], 160, residual)
    assert rel_err(y, want) <= TOL_FUSED[dtype]
    # Normalising is not a no-op here (x is 7x its normalised size): the un-normalised x differs.
    assert rel_err(fused_oracle(x, g, order, n, w_up[2], w_down[2], 160, residual), want) > 1e-2


def test_tiles_kernel_rejects_bad_arguments():
    x, g, w_up, w_down, residual = fused_inputs(jnp.float32, 3, "sparse")
    ids, count = _lists(g, 16)
    call = lambda **kw: sparse_decode_ffn_tiles(**{"x_MxD": x, "g_MxH": g, "ids": ids, "count": count,  # noqa: E731
                                                   "w_up_HxD": w_up, "w_down_HxD": w_down, "interpret": True,
                                                   "block_sizes": FUSED_SMALL, **kw})
    with pytest.raises(ValueError, match="count"):
        call(count=count.astype(jnp.float32))
    with pytest.raises(ValueError, match="ids"):
        call(ids=ids[:-1])
    with pytest.raises(ValueError, match="ids"):
        call(ids=ids[:32], count=count[:2])  # 2 tiles of 16 cannot cover 151 neurons
    with pytest.raises(ValueError, match="norm_scale needs w_up_HxD"):
        call(w_up_HxD=None, norm_scale=jnp.ones((37,), jnp.float32))
    with pytest.raises(ValueError, match="norm_scale"):
        call(norm_scale=jnp.ones((36,), jnp.float32))
    with pytest.raises(ValueError, match=r"norm_scale must be float32 \(3, 37\)"):  # a stack's scales: [L, D]
        call(w_up_HxD=jnp.stack([w_up] * 3), w_down_HxD=jnp.stack([w_down] * 3), layer=jnp.asarray([1], jnp.int32),
             norm_scale=jnp.ones((37,), jnp.float32))
    with pytest.raises(ValueError, match="limit"):
        call(limit=-1)
    with pytest.raises(ValueError, match="residual_MxD"):
        call(residual_MxD=residual[:2])


def test_tiles_kernels_lower_to_triton_for_cuda(capsys):
    # As the other decode kernels' lowering tests: the Pallas -> Triton IR lowering runs without a
    # GPU, at the model's shapes (the gate role's blocks, stacked weights, the norm and a residual).
    from jax import export

    def forward(x, w_gate, w_up, w_down, scale, layer):
        g, ids, count, _ = decode_matvec(x, w_gate, layer=layer, norm_scale=scale, out_dtype=jnp.float32,
                                         block_sizes=matvec_lib.role_block_sizes("gate"), tile_lists=True,
                                         debug=True)
        y = sparse_decode_ffn_tiles(x, g, ids, count, w_up, w_down, layer=layer, norm_scale=scale,
                                    residual_MxD=x, limit=300, debug=True)
        _, ids, count, _, values = decode_matvec(y, w_gate, layer=layer, norm_scale=scale, out_dtype=jnp.float32,
                                                 block_sizes=matvec_lib.role_block_sizes("gate"), tile_lists=True,
                                                 tile_values=True, up=w_up, debug=True)
        return sparse_decode_down_tiles(values, ids, count, w_down, layer=layer, residual_MxD=y, limit=300,
                                        debug=True)

    x = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 5632, 2048), jnp.bfloat16)
    exported = export.export(jax.jit(forward), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            x, w, w, w, jax.ShapeDtypeStruct((2, 2048), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32))
    module = exported.mlir_module()
    for name in ("twell_decode_gate_lists", "twell_decode_tiles", "twell_decode_gate_values", "twell_decode_down_tiles"):
        assert name in module, name
    printed = capsys.readouterr().out
    assert '"scf.for"' not in printed  # no op that failed verification (mixed loop-bound types did)


@pytest.mark.parametrize("resident", [True, False])
def test_gate_down_lowers_to_triton_for_cuda_with_and_without_the_barrier(resident, monkeypatch, capsys):
    """At the model's shapes (88 tiles of the gate at one row): where every program is resident, one
    launch whose Triton IR holds the grid barrier (a CTA barrier, the acquire-release arrival and
    its spin loop) and no second launch; else the partials' sum as a launch of its own."""
    from jax import export

    monkeypatch.setattr(matvec_lib, "_grid_is_resident", lambda programs: resident and programs == 88)
    decode_matvec.clear_cache()  # the residency is read at trace time: no trace of the other case may answer

    def forward(x, w, up, down, scale, layer, sync):
        return decode_matvec(x, w, layer=layer, norm_scale=scale, out_dtype=jnp.float32,
                             block_sizes=matvec_lib.role_block_sizes(matvec_lib.gate_role(1)), tile_lists=True,
                             tile_values=True, up=up, down=down, down_residual=x, sync=sync, debug=True)

    w = jax.ShapeDtypeStruct((2, 5632, 2048), jnp.bfloat16)
    exported = export.export(jax.jit(forward), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16), w, w, w, jax.ShapeDtypeStruct((2, 2048), jnp.float32),
            jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
    decode_matvec.clear_cache()
    module, printed = exported.mlir_module(), capsys.readouterr().out
    assert "twell_decode_gate_down" in module
    assert ("twell_decode_down_partials" in module) == (not resident)
    barrier = ("gpu.barrier", "tt.atomic_rmw add, acq_rel, gpu", "scf.while")
    assert all(op in printed for op in barrier) == resident, [op in printed for op in barrier]


# ---------------------------------------------------------------------------------------------
# the model's step
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("way", ["tiles", "packed"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.fast_params("3-tiles", "1-packed")
def test_the_tiles_step_has_no_compaction(batch, way, monkeypatch):
    """A sparse layer's FFN is two launches ("tiles": the gate with its lists, the tiles kernel,
    after the norm; "packed": the gate with its lists and values, the norm in its prologue, then
    the down kernel): no compaction kernel, no XLA reduction of the gate's signs (the fused path's
    step has its compaction: the check can fail). With tiles of 16 (4 per layer) the step equals
    the XLA path."""
    for role in ("gate", "gate_few_rows"):  # the gate's role at 3 rows and at 1 (matvec_lib.gate_role)
        monkeypatch.setitem(matvec_lib.ROLE_BLOCK_SIZES, role, GATE)
    cfg, config = dataclasses.replace(BASE, n_layers=2), dataclasses.replace(KERNELS, sparse_ffn=way)
    model = init_model(cfg, seed=4)
    assert all(decode_plan.layer_sparse(model, config, batch, jnp.float32))
    tokens, start = jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch,), jnp.int32)
    step = lambda c_: jax.make_jaxpr(lambda c: decode(model, tokens, c, jnp.int32(3), start, config=c_))(  # noqa: E731
        init_cache(cfg, batch, 8))
    traced = step(config)
    names, sums = _pallas_names_and_row_sums(traced, (batch, cfg.d_ff))
    # The FFN norm: one XLA reduction a layer for "tiles", none for "packed" (the gate's prologue).
    norms = _pallas_names_and_row_sums(traced, (batch, cfg.d_model))[1]
    assert norms == (cfg.n_layers if way == "tiles" else 0), norms
    # The layers unrolled (decode.layer_unroll 0): a launch of each a layer.
    kernels = ("twell_decode_gate_lists", "twell_decode_tiles") if way == "tiles" else (
        "twell_decode_gate_values", "twell_decode_down_tiles")
    assert names.count(kernels[0]) == names.count(kernels[1]) == cfg.n_layers, names
    assert not any(name.startswith("twell_decode_compact") for name in names) and sums == 0, names
    fused = step(dataclasses.replace(config, sparse_ffn="fused"))
    assert "twell_decode_compact_rows" in _pallas_names_and_row_sums(fused, (batch, cfg.d_ff))[0]

    tokens = jax.random.randint(jax.random.key(30 + batch), (batch, 10), 0, cfg.vocab_size)
    start = jnp.asarray([0, 2, 5][:batch], jnp.int32)
    got, auxes, _ = _run(cfg, tokens, start, prompt=6, config=config)
    want, want_aux, _ = _run(cfg, tokens, start, prompt=6, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5)


def test_the_packed_down_step_is_one_gate_launch_a_layer(monkeypatch):
    """decode.sparse_ffn="packed_down" at one row: a sparse layer's FFN is the gate's launch
    alone (the norm in its prologue, the lists, the values, the down product and the residual). On
    a GPU that holds every program (patched; the step traced, not run) there is no other launch,
    and each layer's launch updates the step's arrival counters (zeros, int32 [L]) in place and
    hands them to the next; in interpret mode a second launch sums the partials. Equal to the XLA
    path; 3 rows run it too (a forced way; "auto" runs "packed" there)."""
    from twell_jax.ops import backends

    for role in ("gate", "gate_few_rows"):
        monkeypatch.setitem(matvec_lib.ROLE_BLOCK_SIZES, role, GATE)
    cfg, config = dataclasses.replace(BASE, n_layers=2), dataclasses.replace(KERNELS, sparse_ffn="packed_down")
    model = init_model(cfg, seed=4)
    assert decode_plan.layer_ways(model, config, 1, jnp.float32) == ("packed_down",) * 2
    assert decode_plan.layer_ways(model, config, 3, jnp.float32) == ("packed_down",) * 2
    tokens, start = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32)

    def launches(m, primitives=("pallas_call",)):
        traced = jax.make_jaxpr(lambda c: decode(m, tokens, c, jnp.int32(3), start, config=config))(
            init_cache(cfg, 1, 8))
        return [eqn for eqn in _step_eqns(traced) if eqn.primitive.name in primitives]

    names = [eqn.params["name"] for eqn in launches(model)]
    assert names.count("twell_decode_gate_down") == names.count("twell_decode_down_partials") == 2, names
    assert not {"twell_decode_gate_values", "twell_decode_down_tiles"} & set(names), names
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    monkeypatch.setattr(matvec_lib, "_grid_is_resident", lambda programs: True)
    decode_matvec.clear_cache()  # read at trace time (and cleared again below: no later trace may reuse it)
    on_gpu = init_model(dataclasses.replace(cfg, ffn_interpret=False), seed=4)
    gates = [eqn for eqn in launches(on_gpu) if eqn.params["name"] == "twell_decode_gate_down"]
    assert len(gates) == 2 and "twell_decode_down_partials" not in [eqn.params["name"] for eqn in launches(on_gpu)]
    for gate in gates:  # the counters (the last operand) updated in place: the last output
        assert dict(gate.params["input_output_aliases"]) == {len(gate.invars) - 1: len(gate.outvars) - 1}
        assert gate.invars[-1].aval.shape == (cfg.n_layers,) and gate.invars[-1].aval.dtype == jnp.int32
    calls = [eqn for eqn in launches(on_gpu, ("jit", "pjit"))  # the nested jits ("pjit": older JAX's name)
             if eqn.params["name"] == "decode_matvec" and len(eqn.outvars) == 7]  # with down= and sync=
    assert len(calls) == 2 and any(v is calls[0].outvars[-1] for v in calls[1].invars)  # one's counters, the next's
    monkeypatch.undo()
    decode_matvec.clear_cache()
    for role in ("gate", "gate_few_rows"):
        monkeypatch.setitem(matvec_lib.ROLE_BLOCK_SIZES, role, GATE)
    # (3 padded rows with the device switch: test_decode_kernels' step tests, both sides of the switch)
    tokens = jax.random.randint(jax.random.key(32), (1, 10), 0, cfg.vocab_size)
    got, auxes, _ = _run(cfg, tokens, jnp.zeros((1,), jnp.int32), prompt=6, config=config)
    want, want_aux, _ = _run(cfg, tokens, jnp.zeros((1,), jnp.int32), prompt=6, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_the_sparse_gate_role_follows_the_rows(batch, monkeypatch):
    """The sparse gate runs as role "gate_few_rows" (its deeper K pipeline) up to GATE_FEW_ROWS rows
    and as "gate" above: the step asks for exactly that role's blocks (recorded at trace time)."""
    asked = []
    real = matvec_lib.role_block_sizes

    def record(role, rows=1):
        assert rows == batch  # the step's rows pick the table (ROLE_BLOCK_SIZES_MANY_ROWS above MANY_ROWS)
        asked.append(role)
        return real(role, rows)

    monkeypatch.setattr(matvec_lib, "role_block_sizes", record)
    cfg, config = dataclasses.replace(BASE, n_layers=2), dataclasses.replace(KERNELS, sparse_ffn="packed")
    model = init_model(cfg, seed=4)
    tokens, start = jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch,), jnp.int32)
    jax.make_jaxpr(lambda c: decode(model, tokens, c, jnp.int32(3), start, config=config))(init_cache(cfg, batch, 8))
    want = "gate_few_rows" if batch <= matvec_lib.GATE_FEW_ROWS else "gate"
    assert matvec_lib.gate_role(batch) == want
    assert asked.count(want) == cfg.n_layers + 1, asked  # each layer's product, and the ways' row fit
    assert ({"gate", "gate_few_rows"} - {want}).isdisjoint(asked), asked
    # The two roles share the tiles and rows (the lists' layout, `decode_plan.layer_ways`' row fit).
    few, many = real("gate_few_rows"), real("gate")
    assert (few.block_n, few.block_k, few.max_block_m, few.split_k) == (many.block_n, many.block_k,
                                                                        many.max_block_m, many.split_k)


def test_more_rows_than_the_gate_block_run_the_fused_path():
    """17 rows do not fit one program of the gate's lists (max_block_m 16): the step compacts and
    runs the fused kernel instead."""
    cfg, config = dataclasses.replace(BASE, n_layers=2), dataclasses.replace(KERNELS, sparse_ffn="tiles")
    model = init_model(cfg, seed=4)
    assert all(decode_plan.layer_sparse(model, config, 17, jnp.float32))
    tokens, start = jnp.zeros((17, 1), jnp.int32), jnp.zeros((17,), jnp.int32)
    traced = jax.make_jaxpr(lambda c: decode(model, tokens, c, jnp.int32(3), start, config=config))(
        init_cache(cfg, 17, 8))
    names, _ = _pallas_names_and_row_sums(traced, (17, cfg.d_ff))
    assert "twell_decode_fused" in names and "twell_decode_gate_lists" not in names, names


def _bench_decode_ffn_step():
    from twell_jax.bench import decode_ffn_step

    return decode_ffn_step


def test_bench_decode_ffn_step_refuses_bad_arguments_and_places_the_active_neurons():
    """experiments/bench_decode_ffn_step.py: bad arguments refused before anything runs; its gate
    block sizes parsed; its active neurons placed first or one a column tile."""
    bench = _bench_decode_ffn_step()
    with pytest.raises(SystemExit, match="--rows must be in"):
        bench.main(["--rows", "17"])
    assert [gate_blocks.num_stages for gate_blocks in bench.parse_gate_blocks("64x256w4s3,64x256w4s4p132")] == [3, 4]
    with pytest.raises(SystemExit, match="expected BNxBKwWsS"):
        bench.main(["--dry-run", "--gate-blocks", "64x256"])
    with pytest.raises(SystemExit, match="programs_n"):  # the kernel's own check, named with the item
        bench.main(["--dry-run", "--gate-blocks", "16x16w4s3p2"])
    on = np.flatnonzero(np.asarray(bench.active_neurons(5632, 88, "spread")))
    assert on.size == 88 and np.bincount(on // 64).max() == 1  # one a tile of 64
    assert np.asarray(bench.active_neurons(5632, 88, "first")).nonzero()[0].max() == 87


@pytest.mark.slow
def test_bench_decode_ffn_step_dry_run(tmp_path):
    """experiments/bench_decode_ffn_step.py's plumbing at tiny shapes (interpret mode): every variant
    and piece timed at each (rows, active), the sparse ways with a ratio to the twin's (its
    arguments: the test above)."""
    import json

    bench = _bench_decode_ffn_step()
    out = tmp_path / "step.json"
    rows = bench.main(["--dry-run", "--out", str(out)])
    variants = {"plain", "dense", "fused", "split", "tiles", "tiles_xla_norm", "packed", "packed_down",
                "piece: XLA norm",
                "piece: gate", "piece: gate +norm", "piece: gate +lists", "piece: gate +norm +lists",
                "piece: gate +norm +values", "piece: compaction", "piece: fused kernel", "piece: tiles kernel",
                "piece: tiles kernel +norm", "piece: down tiles kernel"}
    assert {(r["rows"], r["variant"]) for r in rows} == {(b, v) for b in (1, 3) for v in variants}
    assert all(r["us_per_layer"] > 0 and r["union"] == 4 for r in rows)  # 4 neurons fire on every row
    ways = {"dense", "fused", "split", "tiles", "tiles_xla_norm", "packed", "packed_down"}  # vs the twin, plain JAX
    assert {r["variant"] for r in rows if "vs_dense" in r} == {r["variant"] for r in rows if "vs_plain" in r} == ways
    assert json.loads(out.read_text())["rows"] == rows
    # --placement spread: the same ways, the active neurons one a column tile
    spread = bench.main(["--dry-run", "--no-pieces", "--placement", "spread"])
    assert {r["variant"] for r in spread} == {"plain"} | ways and {r["placement"] for r in spread} == {"spread"}
    # --gate-blocks: the packed way and its gate alone per block sizes of the sparse gate
    swept = bench.main(["--dry-run", "--no-pieces", "--gate-blocks", "16x16w4s3,16x32w4s2p8"])
    labels = {r["variant"] for r in swept} - {"plain"} - ways
    assert labels == {f"{kind} {b}" for kind in ("packed gate", "piece: gate +norm +values")
                      for b in ("16x16w4s3", "16x32w4s2p8")}, labels
    assert all("vs_dense" in r for r in swept if r["variant"].startswith("packed gate"))
