"""TwELL pack/unpack against a numpy oracle: layout, ascending order, true counts, overflow."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from twell_jax.ops import format as tf


def oracle_pack(dense: np.ndarray, tile: int, slots: int):
    """Plain-loop TwELL: (values, indices, counts) with the first `slots` non-zeros per tile."""
    m, h = dense.shape
    n_tiles = max(1, -(-h // tile))
    values = np.zeros((m, n_tiles, slots), dense.dtype)
    indices = np.zeros((m, n_tiles, slots), np.int32)
    counts = np.zeros((m, n_tiles), np.int32)
    for i in range(m):
        for t in range(n_tiles):
            cols = [c for c in range(t * tile, min(h, (t + 1) * tile)) if dense[i, c] != 0]
            counts[i, t] = len(cols)
            for s, c in enumerate(cols[:slots]):
                values[i, t, s], indices[i, t, s] = dense[i, c], c
    return values, indices, counts


def random_dense(rng: np.random.Generator, m: int, h: int, zero_fraction: float, dtype) -> np.ndarray:
    dense = rng.standard_normal((m, h)).astype(np.float32) + 0.1  # + 0.1: no accidental zeros
    dense[rng.random((m, h)) < zero_fraction] = 0
    return np.asarray(jnp.asarray(dense, dtype))


@functools.partial(jax.jit, static_argnames=("tile", "slots"))
def pack_and_inspect(dense, *, tile, slots):
    """One compiled program per shape (eager op-by-op dispatch would compile every op)."""
    packed = tf.pack(dense, tile=tile, slots=slots)
    return (packed, tf.unpack(packed), tf.overflow_count(packed), tf.row_overflow_mask(packed),
            tf.row_nnz(packed))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 2, 7, 31]), h=st.sampled_from([1, 5, 13, 37, 300]),
       tile=st.sampled_from([1, 4, 16, 256]), slot_fraction=st.sampled_from([0.0, 0.25, 1.0]),
       zero_fraction=st.sampled_from([0.0, 0.5, 0.9, 1.0]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 2**16))
def test_pack_matches_oracle(m, h, tile, slot_fraction, zero_fraction, dtype, seed):
    slots = max(1, int(slot_fraction * tile))
    dense = random_dense(np.random.default_rng(seed), m, h, zero_fraction, dtype)
    packed, unpacked, n_overflow, row_overflow, nnz = pack_and_inspect(jnp.asarray(dense), tile=tile, slots=slots)
    values, indices, counts = oracle_pack(dense, tile, slots)
    np.testing.assert_array_equal(np.asarray(packed.values, np.float32), values.astype(np.float32))
    np.testing.assert_array_equal(packed.indices, indices)
    np.testing.assert_array_equal(packed.counts, counts)
    assert packed.values.dtype == dtype and packed.indices.dtype == jnp.int32
    assert (packed.n_cols, packed.tile) == (h, tile)
    assert int(n_overflow) == int(np.sum(counts > slots))
    np.testing.assert_array_equal(row_overflow, np.any(counts > slots, axis=1))
    np.testing.assert_array_equal(nnz, np.sum(dense != 0, axis=1))
    # unpack = the stored entries: the dense matrix exactly when nothing overflowed.
    stored = np.zeros_like(dense)
    for i in range(m):
        for t in range(values.shape[1]):
            for s in range(min(counts[i, t], slots)):
                stored[i, indices[i, t, s]] = values[i, t, s]
    np.testing.assert_array_equal(np.asarray(unpacked, np.float32), stored.astype(np.float32))
    if not np.any(counts > slots):
        np.testing.assert_array_equal(np.asarray(unpacked, np.float32), dense.astype(np.float32))


@pytest.mark.parametrize("count", [0, 3, 4, 5, 8, 16])
def test_counts_around_the_slot_limit(count):
    slots, tile = 4, 16
    dense = np.zeros((1, 2 * tile), np.float32)
    dense[0, tile + np.arange(count)] = np.arange(1, count + 1)
    packed = tf.pack(jnp.asarray(dense), tile=tile, slots=slots)
    assert packed.counts.tolist() == [[0, count]]
    kept = min(count, slots)
    np.testing.assert_array_equal(packed.indices[0, 1, :kept], tile + np.arange(kept))
    np.testing.assert_array_equal(packed.values[0, 1, kept:], 0)
    assert int(tf.overflow_count(packed)) == int(count > slots)


def test_nan_counts_as_nonzero_and_pack_is_deterministic():
    dense = np.zeros((3, 9), np.float32)
    dense[1, 4] = np.nan
    dense[2, [0, 8]] = [-1.0, 2.0]
    packed = tf.pack(jnp.asarray(dense), tile=4, slots=2)
    assert packed.counts.tolist() == [[0, 0, 0], [0, 1, 0], [1, 0, 1]]
    again = jax.jit(tf.pack, static_argnames=("tile", "slots"))(jnp.asarray(dense), tile=4, slots=2)
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_twell_is_a_pytree_with_static_metadata():
    packed = tf.pack(jnp.ones((2, 5)), tile=4, slots=2)
    leaves, treedef = jax.tree.flatten(packed)
    assert len(leaves) == 3
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert (rebuilt.n_cols, rebuilt.tile, rebuilt.slots, rebuilt.n_tiles) == (5, 4, 2, 2)
    doubled = jax.jit(lambda p: jax.tree.map(lambda a: a * 2, p))(packed)
    assert doubled.n_cols == 5


def test_reference_words_round_trip():
    dense = random_dense(np.random.default_rng(0), 6, 21, 0.6, jnp.bfloat16)
    packed = tf.pack(jnp.asarray(dense), tile=8, slots=3)
    words = tf.to_reference_words(packed)
    assert words.dtype == jnp.uint32 and words.shape == (6, 3 * 4)
    np.testing.assert_array_equal(words.reshape(6, 3, 4)[..., 0], packed.counts)
    back = tf.from_reference_words(words, n_cols=21, tile=8)
    for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    low = np.asarray(words.reshape(6, 3, 4)[..., 1:]) & 0xFFFF
    np.testing.assert_array_equal(low, packed.indices)


def test_reference_words_reject_bad_input():
    with pytest.raises(ValueError, match="bfloat16"):
        tf.to_reference_words(tf.pack(jnp.ones((1, 4), jnp.float32), tile=4, slots=2))
    with pytest.raises(ValueError, match="n_cols"):
        tf.to_reference_words(tf.pack(jnp.zeros((1, 70000), jnp.bfloat16), tile=256, slots=1))
    with pytest.raises(ValueError, match="words"):
        tf.from_reference_words(jnp.zeros((2, 7), jnp.uint32), n_cols=16, tile=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile=0), "tile"), (dict(slots=0), "slots"), (dict(tile=4, slots=5), "slots"),
])
def test_pack_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tf.pack(jnp.ones((2, 8)), **kwargs)


def test_pack_rejects_bad_dense():
    with pytest.raises(ValueError, match="dense"):
        tf.pack(jnp.ones((8,)))
    with pytest.raises(ValueError, match="dense"):
        tf.pack(jnp.ones((2, 8), jnp.int32))
