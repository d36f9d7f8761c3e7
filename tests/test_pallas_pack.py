"""Pack kernel (pallas_kernels/twell_pack.py) vs its jnp reference, in interpret mode on CPU.

Inputs are built so every pre-activation is an exact small integer (x = identity rows, the gate
weight carries the target pre-activations), so the active pattern and the values are exact in
f32 and bf16 and the kernel must match the reference bit for bit.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.twell_pack import PackBlockSizes, pack_gate, pack_gate_reference, program_block

TILE, SLOTS = 32, 8
SMALL_BLOCKS = PackBlockSizes(block_m=16, block_k=16, num_warps=4, num_stages=2)


def adversarial_preacts(rng: np.random.Generator, m: int, h: int) -> np.ndarray:
    """Integer pre-activations [m, h]: all the corner cases of the TwELL tile in one matrix."""
    pre = -rng.integers(1, 50, (m, h)).astype(np.float32)  # everything inactive by default
    sparse = rng.random((m, h)) < 0.04
    pre[sparse] = rng.integers(1, 200, sparse.sum())
    pre[:, 7] = 3.0  # one hot neuron in every row
    pre[0] = 0.0  # exact zeros are inactive (strict > 0)
    pre[1:3] = rng.integers(1, 200, (2, h))  # fully dense first tokens: every tile overflows
    for row, count in zip(range(3, 7), (SLOTS - 1, SLOTS, SLOTS + 1, 2 * SLOTS)):
        pre[row, TILE:2 * TILE] = -1.0
        cols = TILE + rng.choice(TILE, count, replace=False)
        pre[row, cols] = rng.integers(1, 200, count)
    pre[16:32] = -5.0  # a whole program block with nothing active
    return pre


def identity_inputs(pre_MxH: np.ndarray, d: int, dtype):
    """x = [I | 0] (M x D, D >= M) and w with w[:, :M] = pre^T, so x @ w.T == pre exactly."""
    m, h = pre_MxH.shape
    x = np.zeros((m, d), np.float32)
    x[np.arange(m), np.arange(m)] = 1.0
    w = np.zeros((h, d), np.float32)
    w[:, :m] = pre_MxH.T
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype,group_m", [(jnp.float32, 0), (jnp.bfloat16, 0), (jnp.bfloat16, 2)])
def test_pack_matches_reference_on_adversarial_sparsity(dtype, group_m):
    rng = np.random.default_rng(0)
    m, d, h = 37, 45, 150  # none a multiple of the blocks; H leaves a partial last tile
    pre = adversarial_preacts(rng, m, h)
    x, w = identity_inputs(pre, d, dtype)
    # group_m 2 over 3 row blocks: a full launch group and a short last one.
    blocks = PackBlockSizes(**{**SMALL_BLOCKS.__dict__, "group_m": group_m})
    values, indices, counts = pack_gate(x, w, tile=TILE, slots=SLOTS, block_sizes=blocks,
                                        interpret=True)
    ref_values, ref_indices, ref_counts = pack_gate_reference(x, w, tile=TILE, slots=SLOTS)
    n_tiles = -(-h // TILE)
    assert values.shape == indices.shape == (m, n_tiles, SLOTS) and counts.shape == (m, n_tiles)
    assert values.dtype == dtype and indices.dtype == jnp.int32 and counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(ref_indices))
    np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(ref_values, np.float32))
    # The reference itself against the construction: true counts, ascending global columns.
    padded = np.pad(pre, ((0, 0), (0, n_tiles * TILE - h)), constant_values=-1)
    true_counts = (padded.reshape(m, n_tiles, TILE) > 0).sum(-1)
    np.testing.assert_array_equal(np.asarray(counts), true_counts)
    assert np.asarray(counts)[3:7, 1].tolist() == [SLOTS - 1, SLOTS, SLOTS + 1, 2 * SLOTS]
    assert int(np.asarray(counts)[0].sum()) == 0
    row = 5  # S + 1 actives in tile 1: the first S in ascending column order are kept
    expected_cols = np.flatnonzero(pre[row, TILE:2 * TILE] > 0)[:SLOTS] + TILE
    np.testing.assert_array_equal(np.asarray(indices)[row, 1], expected_cols)
    np.testing.assert_array_equal(np.asarray(values, np.float32)[row, 1], pre[row, expected_cols])


def test_pack_all_zero_and_random_normal():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(20, 24)), jnp.float32)
    zero_w = jnp.zeros((40, 24), jnp.float32)
    values, indices, counts = pack_gate(x, zero_w, tile=TILE, slots=SLOTS, block_sizes=SMALL_BLOCKS,
                                        interpret=True)
    assert int(jnp.sum(counts)) == 0 and not bool(jnp.any(values)) and not bool(jnp.any(indices))
    # Fresh random real-valued data: same pattern and values as the reference.
    w = jnp.asarray(rng.normal(size=(40, 24)) - 0.8, jnp.float32)
    out = pack_gate(x, w, tile=TILE, slots=SLOTS, block_sizes=SMALL_BLOCKS, interpret=True)
    ref = pack_gate_reference(x, w, tile=TILE, slots=SLOTS)
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(ref[2]))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
    # K-blocked accumulation order differs from the reference: rounding-level differences.
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_m,n_tiles,group_m", [(1, 1, 0), (7, 3, 0), (7, 3, 1), (7, 3, 2), (7, 3, 7),
                                                 (7, 3, 16), (128, 22, 8)])
def test_launch_order_visits_every_block_once_group_by_group(n_m, n_tiles, group_m):
    p = jnp.arange(n_m * n_tiles)
    rows, tiles = (np.asarray(a) for a in program_block(p, n_m, n_tiles, group_m))
    assert sorted(zip(rows.tolist(), tiles.tolist())) == [(i, j) for i in range(n_m) for j in range(n_tiles)]
    g = n_m if group_m == 0 else min(group_m, n_m)
    # Group by group: the programs of group q cover row blocks [q g, (q + 1) g) x every tile, with
    # the row block varying fastest.
    np.testing.assert_array_equal(rows // g, p // (g * n_tiles))
    first = rows[:min(g, n_m) * n_tiles].reshape(n_tiles, -1)
    np.testing.assert_array_equal(first, np.broadcast_to(np.arange(first.shape[1]), first.shape))


def test_pack_block_sizes_and_arguments_are_validated():
    with pytest.raises(ValueError, match="group_m"):
        PackBlockSizes(group_m=-1)
    with pytest.raises(ValueError, match="block_m"):
        PackBlockSizes(block_m=48)
    with pytest.raises(ValueError, match="num_warps"):
        PackBlockSizes(num_warps=3)
    x = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="slots"):
        pack_gate(x, x, tile=32, slots=12, interpret=True)
    with pytest.raises(ValueError, match="tile"):
        pack_gate(x, x, tile=24, slots=8, interpret=True)
    with pytest.raises(ValueError, match="w_HxD"):
        pack_gate(x, jnp.zeros((4, 9), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        pack_gate(x, x.astype(jnp.bfloat16), interpret=True)
