"""Hybrid ELL + tail: build, round trips, transpose, and the products, against numpy."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from twell_jax.ops import format as tf
from twell_jax.ops import hybrid as hy


def random_sparse(rng: np.random.Generator, r: int, n: int, zero_fraction: float) -> np.ndarray:
    dense = rng.standard_normal((r, n)).astype(np.float32) + 0.1
    dense[rng.random((r, n)) < zero_fraction] = 0
    if r > 2:
        dense[0] = 0  # an empty row
        dense[1] = rng.standard_normal(n) + 0.1  # a fully dense row
    return dense


def expected_lost(nnz: np.ndarray, width: int, capacity: int) -> int:
    return max(0, int(np.sum(nnz > width)) - capacity)


@functools.partial(jax.jit, static_argnames=("ell_width", "tail_capacity", "t_width", "t_capacity"))
def build_and_use(dense, b, a, c, *, ell_width, tail_capacity, t_width, t_capacity):
    """Everything a round trip checks, as one compiled program per shape."""
    h = hy.from_dense(dense, ell_width=ell_width, tail_capacity=tail_capacity)
    ht = hy.transpose(h, ell_width=t_width, tail_capacity=t_capacity)
    return dict(h=h, dense=hy.to_dense(h), ht=ht, dense_t=hy.to_dense(ht),
                back=hy.to_dense(hy.transpose(ht, ell_width=ell_width, tail_capacity=tail_capacity)),
                spmm=hy.spmm(h, b), spmm_t=hy.spmm(ht, c), sddmm=hy.to_dense(hy.sddmm(a, b, h)),
                abs_sum=hy.sum_values(h, jnp.abs))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(r=st.sampled_from([1, 3, 17, 40]), n=st.sampled_from([1, 7, 30]),
       ell_width=st.sampled_from([1, 3, 8]), tail_capacity=st.sampled_from([0, 2, 40]),
       t_width=st.sampled_from([1, 4, 64]), t_capacity=st.sampled_from([0, 3, 30]),
       zero_fraction=st.sampled_from([0.0, 0.5, 0.9, 1.0]), seed=st.integers(0, 2**16))
# Both tails in use and nothing lost, so every exact check below runs at least once.
@example(r=17, n=30, ell_width=3, tail_capacity=40, t_width=4, t_capacity=30, zero_fraction=0.5, seed=1)
def test_round_trips_transpose_and_products(r, n, ell_width, tail_capacity, t_width, t_capacity,
                                            zero_fraction, seed):
    rng = np.random.default_rng(seed)
    dense = random_sparse(rng, r, n, zero_fraction)
    b = rng.standard_normal((n, 5)).astype(np.float32)
    a = rng.standard_normal((r, 5)).astype(np.float32)
    c = rng.standard_normal((r, 3)).astype(np.float32)
    out = build_and_use(jnp.asarray(dense), jnp.asarray(b), jnp.asarray(a), jnp.asarray(c),
                        ell_width=ell_width, tail_capacity=tail_capacity, t_width=t_width,
                        t_capacity=t_capacity)
    h, ht = out["h"], out["ht"]
    nnz_rows, nnz_cols = np.sum(dense != 0, axis=1), np.sum(dense != 0, axis=0)
    lost = expected_lost(nnz_rows, ell_width, tail_capacity)
    np.testing.assert_array_equal(h.row_nnz, nnz_rows)
    assert int(h.tail_overflow) == lost
    in_ell = nnz_rows <= ell_width
    np.testing.assert_array_equal(h.ell_count, np.where(in_ell, nnz_rows, 0))
    # ELL rows hold ascending columns and their exact values; unused slots are 0.
    for i in np.flatnonzero(in_ell):
        cols = np.flatnonzero(dense[i])
        np.testing.assert_array_equal(h.ell_cols[i, : len(cols)], cols)
        np.testing.assert_array_equal(h.ell_values[i, : len(cols)], dense[i, cols])
        np.testing.assert_array_equal(h.ell_values[i, len(cols):], 0)
    # Tail rows: the first `tail_capacity` rows needing one, in ascending row order.
    tail_rows = np.flatnonzero(~in_ell)[:tail_capacity]
    np.testing.assert_array_equal(h.tail_rows[: len(tail_rows)], tail_rows)
    np.testing.assert_array_equal(h.tail_rows[len(tail_rows):], -1)
    if (r, n, seed) == (17, 30, 1):  # the explicit example must exercise both tails
        assert np.sum(~in_ell) > 0 and np.sum(nnz_cols > t_width) > 0
    if lost:
        return
    np.testing.assert_array_equal(out["dense"], dense)
    np.testing.assert_allclose(out["spmm"], dense.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["sddmm"], (a.astype(np.float64) @ b.T) * (dense != 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["abs_sum"], np.abs(dense).sum(), rtol=1e-6)
    lost_t = expected_lost(nnz_cols, t_width, t_capacity)
    assert int(ht.tail_overflow) == lost_t
    np.testing.assert_array_equal(ht.row_nnz, nnz_cols)
    if lost_t:
        return
    np.testing.assert_array_equal(out["dense_t"], dense.T)
    np.testing.assert_array_equal(out["back"], dense)
    np.testing.assert_allclose(out["spmm_t"], dense.T.astype(np.float64) @ c, rtol=1e-5, atol=1e-5)
    for j in np.flatnonzero(nnz_cols <= t_width):  # transposed ELL rows are ascending too
        np.testing.assert_array_equal(ht.ell_cols[j, : nnz_cols[j]], np.flatnonzero(dense[:, j]))


def test_explicit_pattern_keeps_on_pattern_zeros_through_transpose():
    dense = np.array([[0.0, 2.0, 0.0, 3.0], [1.0, 0.0, 0.0, 0.0], [4.0, 5.0, 6.0, 0.0]], np.float32)
    pattern = dense != 0
    pattern[0, 0] = pattern[2, 3] = True  # explicit zeros on the pattern (one ELL row, one tail row)
    h = hy.from_dense(jnp.asarray(dense), ell_width=2, tail_capacity=1, pattern_RxN=jnp.asarray(pattern))
    assert h.row_nnz.tolist() == [3, 1, 4] and int(h.tail_overflow) == 1  # two rows, one slot
    h = hy.from_dense(jnp.asarray(dense), ell_width=3, tail_capacity=1, pattern_RxN=jnp.asarray(pattern))
    assert int(h.tail_overflow) == 0 and h.tail_rows.tolist() == [2]
    np.testing.assert_array_equal(hy.pattern_to_dense(h), pattern)
    ht = hy.transpose(h, ell_width=1, tail_capacity=4)
    np.testing.assert_array_equal(hy.pattern_to_dense(ht), pattern.T)
    np.testing.assert_array_equal(ht.row_nnz, pattern.sum(0))
    np.testing.assert_array_equal(hy.to_dense(ht), dense.T)
    # An elementwise product that produces zeros keeps the pattern (docs/format.md, below the hybrid's table).
    zeroed = hy.map_values(lambda v: v * 0, h)
    np.testing.assert_array_equal(hy.pattern_to_dense(hy.transpose(zeroed, ell_width=1, tail_capacity=4)),
                                  pattern.T)


def test_from_twell_matches_from_dense_and_recomputes_overflow_rows():
    rng = np.random.default_rng(3)
    dense = random_sparse(rng, 12, 20, 0.6)
    packed = tf.pack(jnp.asarray(dense), tile=4, slots=2)
    assert int(tf.overflow_count(packed)) > 0
    exact = hy.from_twell(packed, ell_width=6, tail_capacity=12, recompute_rows=lambda rows: jnp.asarray(dense)[rows])
    assert int(exact.tail_overflow) == 0
    np.testing.assert_array_equal(hy.to_dense(exact), dense)
    needs_tail = (np.sum(dense != 0, 1) > 6) | np.asarray(tf.row_overflow_mask(packed))
    np.testing.assert_array_equal(exact.tail_rows[: needs_tail.sum()], np.flatnonzero(needs_tail))
    # Without a recompute, rows with tile overflow cannot be exact: they are counted as lost.
    stored_only = hy.from_twell(packed, ell_width=6, tail_capacity=12)
    assert int(stored_only.tail_overflow) == int(np.sum(tf.row_overflow_mask(packed)))
    # Without tile overflow the pack alone is enough.
    wide = tf.pack(jnp.asarray(dense), tile=4, slots=4)
    from_pack = hy.from_twell(wide, ell_width=3, tail_capacity=12)
    reference = hy.from_dense(jnp.asarray(dense), ell_width=3, tail_capacity=12)
    for a, b in zip(jax.tree.leaves(from_pack), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(a, b)


def test_spmm_does_not_leak_nan_through_empty_slots():
    dense = np.zeros((3, 4), np.float32)
    dense[1, 2] = 2.0
    b = np.ones((4, 2), np.float32)
    b[0] = np.nan  # column 0 is the index of every unused slot
    h = hy.from_dense(jnp.asarray(dense), ell_width=2, tail_capacity=0)
    np.testing.assert_array_equal(hy.spmm(h, jnp.asarray(b)), [[0, 0], [2, 2], [0, 0]])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="ell_width"):
        hy.from_dense(jnp.ones((2, 3)), ell_width=0, tail_capacity=1)
    with pytest.raises(ValueError, match="tail_capacity"):
        hy.from_dense(jnp.ones((2, 3)), ell_width=1, tail_capacity=-1)
    with pytest.raises(ValueError, match="pattern_RxN"):
        hy.from_dense(jnp.ones((2, 3)), ell_width=1, tail_capacity=1, pattern_RxN=jnp.ones((3, 2), bool))
    h = hy.from_dense(jnp.ones((2, 3)), ell_width=1, tail_capacity=2)
    with pytest.raises(ValueError, match="b_NxD"):
        hy.spmm(h, jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="b_NxK"):
        hy.sddmm(jnp.ones((2, 5)), jnp.ones((3, 4)), h)
