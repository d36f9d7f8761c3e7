"""The Pallas backward's kernels (pallas_kernels/twell_bwd_*.py) in interpret mode on CPU against their
jnp references, the tails' block loop, and the training "auto" choice (twell_jax/ops/
pallas_backward.py). The op-level gradients: test_pallas_bwd_op.py."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.twell_bwd_neuron import (NeuronBwdBlockSizes, longest_first_order,
                                             neuron_backward, neuron_backward_reference)
from twell_jax.pallas_kernels.twell_bwd_token import (ListsBlockSizes, TokenBwdBlockSizes, rank_values,
                                            rank_values_reference, token_backward,
                                            token_backward_reference, token_lists,
                                            token_lists_reference)
from twell_jax.pallas_kernels.twell_pack import pack_gate_reference
from twell_jax.pallas_kernels.twell_transpose import neuron_lists, neuron_lists_reference
from oracles import TOL, rel_err
from test_ops import loss_of, make_inputs, oracle
from twell_jax import ops
from twell_jax.ops import dispatch, pallas_backward, pallas_forward, planner

TILE, SLOTS = 16, 4


# ---------------------------------------------------------------------------------------------
# Kernels vs their references
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,gated,block_t,hot,with_init", [
    (jnp.float32, True, 1, False, False), (jnp.bfloat16, True, 2, True, True),
    (jnp.float32, False, 2, True, False), (jnp.bfloat16, False, 1, False, True)])
def test_token_backward_matches_reference(dtype, gated, block_t, hot, with_init):
    m, d, h = 13, 23, 41  # primes: no dimension is a multiple of a block
    x, weights = make_inputs(gated, m, d, h, dtype, 0.85, seed=3, adversarial="zero_and_dense_rows")
    gy = jnp.asarray(np.random.default_rng(4).standard_normal((m, d)), dtype)
    w_act, w_up, w_down = (weights[0], weights[1], weights[2]) if gated else (weights[0], None, weights[1])
    values, indices, counts = pack_gate_reference(x, w_act, tile=TILE, slots=SLOTS)
    # The caller's contract: rows with an overflowing tile or > width entries get count 0.
    width = 8
    tail = ops.TailPolicy(ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=width)).pack_token_tail(counts)
    assert bool(tail[3]) and not bool(jnp.all(tail))  # the dense row is a tail row
    counts = jnp.where(tail[:, None], 0, counts)
    start, count, tokens, dest = neuron_lists_reference(indices, counts, h, width=width)
    # Hot: the two busiest neurons (left out of the lists); an init: the tails' dx terms.
    hot_H = (count >= jnp.sort(count)[-2]) & (count > 0) if hot else None
    # The values in rank order (what the training forward keeps): every row's stored values.
    ranked = rank_values(values, counts, width, block_sizes=ListsBlockSizes(block_rows=4 * block_t),
                         interpret=True)
    ranked_ref = rank_values_reference(values, counts, width)
    n_stored = np.asarray(jnp.sum(jnp.minimum(counts, SLOTS), axis=1))
    stored_MxW = np.arange(width)[None, :] < n_stored[:, None]
    assert ranked.shape == (m, width) and ranked.dtype == dtype and stored_MxW.sum() > m
    np.testing.assert_array_equal(np.asarray(ranked)[stored_MxW], np.asarray(ranked_ref)[stored_MxW])
    for i in range(m):  # rank order = the stored slots, tiles then slots ascending
        live = np.asarray(jnp.arange(SLOTS)[None, :] < jnp.minimum(counts[i], SLOTS)[:, None])
        np.testing.assert_array_equal(np.asarray(ranked_ref[i, :n_stored[i]]), np.asarray(values[i])[live])
    lists = token_lists(ranked, indices, counts, dest, hot_H,
                        block_sizes=ListsBlockSizes(block_rows=4 * block_t), interpret=True)
    n_M, cols, a, pos = lists
    ref_lists = token_lists_reference(ranked_ref, indices, counts, dest, hot_H)
    np.testing.assert_array_equal(n_M, ref_lists[0])
    listed_MxW = np.arange(8)[None, :] < np.asarray(n_M)[:, None]
    for got, want in zip(lists[1:], ref_lists[1:]):  # slots past n are unspecified
        np.testing.assert_array_equal(np.asarray(got)[listed_MxW], np.asarray(want)[listed_MxW])
    # The lists: each row's stored, not-hot entries in rank order, at their CSR positions.
    n_entries = int(jnp.sum(count))
    owner_E = jnp.repeat(jnp.arange(h), count, total_repeat_length=n_entries)
    for i in range(m):
        live = np.asarray(jnp.arange(SLOTS)[None, :] < jnp.minimum(counts[i], SLOTS)[:, None])
        want = [int(j) for j in np.asarray(indices[i])[live] if not (hot and bool(hot_H[j]))]
        got = [int(j) for j in np.asarray(cols[i, :int(n_M[i])])]
        assert got == want, i
        for p, j in zip(np.asarray(pos[i, :len(got)]), got):
            assert int(owner_E[p]) == j and int(tokens[p]) == i, (i, p, j)
    dx_init = (jnp.asarray(np.random.default_rng(5).standard_normal((m, d)), jnp.float32)
               if with_init else None)
    scale = jnp.float32(0.3)
    out = token_backward(x, gy, *lists, w_act, w_up, w_down, scale, dx_init=dx_init,
                         block_sizes=TokenBwdBlockSizes(block_t=block_t), interpret=True)
    ref = token_backward_reference(x, gy, *lists, w_act, w_up, w_down, scale, dx_init)
    dx, entries = out
    if gated:  # the default splits the gated kernel in two launches; one launch computes the same
        one_dx, one_entries = token_backward(
            x, gy, *lists, w_act, w_up, w_down, scale, dx_init=dx_init,
            block_sizes=TokenBwdBlockSizes(block_t=block_t, split=False), interpret=True)
        np.testing.assert_allclose(np.asarray(one_dx, np.float32), np.asarray(dx, np.float32),
                                   rtol=1e-6, atol=1e-6)
        listed = np.zeros(m * 8, bool)
        for i in range(m):
            listed[np.asarray(pos[i, :int(n_M[i])])] = True
        for e, e_one in zip(entries, one_entries):
            np.testing.assert_array_equal(np.asarray(e)[listed], np.asarray(e_one)[listed])
    assert dx.shape == x.shape and dx.dtype == dtype
    assert len(entries) == (3 if gated else 2)
    assert n_entries > 0 and all(e.shape == (m * 8,) for e in entries)
    assert rel_err(dx, ref[0]) < TOL[dtype]
    listed_E = np.zeros(n_entries, bool)
    for i in range(m):
        listed_E[np.asarray(pos[i, :int(n_M[i])])] = True
    assert listed_E.sum() == int(jnp.sum(n_M)) and (listed_E.all() != bool(hot))
    for e, e_ref in zip(entries, ref[1]):  # positions of left-out entries are unspecified
        assert rel_err(e[:n_entries][listed_E], e_ref[:n_entries][listed_E]) < 1e-5
    assert bool(jnp.any(entries[1][:n_entries][listed_E]))
    if gated:
        # u kept by the forward (in rank order, as sparse_ffn's ranked output), listed by
        # token_lists beside a, read by the kernel instead of computing it, in either launch.
        u_slots = jnp.einsum("md,mtsd->mts", x.astype(jnp.float32), w_up.astype(jnp.float32)[indices],
                             precision=jax.lax.Precision.HIGHEST)
        ranked_u = rank_values_reference(u_slots, counts, width)
        lists_u = token_lists(ranked, indices, counts, dest, hot_H, ranked_u_MxW=ranked_u,
                              block_sizes=ListsBlockSizes(block_rows=4 * block_t), interpret=True)
        ref_lists_u = token_lists_reference(ranked_ref, indices, counts, dest, hot_H, ranked_u)
        assert len(lists_u) == len(ref_lists_u) == 5
        for got, want in zip(lists_u, ref_lists_u):
            got, want = np.asarray(got), np.asarray(want)
            np.testing.assert_array_equal(got if got.ndim == 1 else got[listed_MxW],
                                          want if want.ndim == 1 else want[listed_MxW])
        ref_u = token_backward_reference(x, gy, *lists_u[:4], w_act, w_up, w_down, scale, dx_init,
                                         lists_u[4])
        for split in (True, False):
            dx_u, entries_u = token_backward(
                x, gy, *lists_u[:4], w_act, w_up, w_down, scale, dx_init=dx_init, u_MxW=lists_u[4],
                block_sizes=TokenBwdBlockSizes(block_t=block_t, split=split), interpret=True)
            assert rel_err(dx_u, ref_u[0]) < TOL[dtype] and rel_err(dx_u, ref[0]) < TOL[dtype]
            for e, e_ref in zip(entries_u, ref_u[1]):
                assert rel_err(e[:n_entries][listed_E], e_ref[:n_entries][listed_E]) < 1e-5
        with pytest.raises(ValueError, match="u_MxW"):
            token_backward(x, gy, *lists_u[:4], w_act, None, w_down, scale, u_MxW=lists_u[4],
                           interpret=True)
    if not with_init:
        assert not bool(jnp.any(dx[0]))  # all-zero token 0


@pytest.mark.parametrize("width,adversarial,zero_fraction,seed", [
    (8, "zero_and_dense_rows", 0.85, 3),  # S 4 <= W 8: the lists' own W columns (dead lanes wrap)
    (2, "none", 0.95, 5),                 # S 4 > W 2: a column past W for each dead lane
])
def test_token_lists_read_the_kept_pattern_as_it_is(width, adversarial, zero_fraction, seed):
    """`token_lists` on the training forward's kept pattern (uint8 offsets inside the tile, with
    `tile`; int16 counts; junk in dead slots) and the transpose's padded dest (more rows than M):
    the same lists, bit for bit, as from the pack's int32 ids and counts and the exact dest, and
    as the reference; hot neurons and the kept u included. `rank_values` likewise at both widths.
    The entries of `token_backward(padded=True)`: the same bits, with the kernel's padding."""
    m, d, h = 13, 23, 41
    x, weights = make_inputs(True, m, d, h, jnp.float32, zero_fraction, seed=seed, adversarial=adversarial)
    values, indices, counts = pack_gate_reference(x, weights[0], tile=TILE, slots=SLOTS)
    config = ops.SparseFFNConfig(tile=TILE, slots=SLOTS, ell_width=width)
    counts = jnp.where(ops.TailPolicy(config).pack_token_tail(counts)[:, None], 0, counts)
    live = np.arange(SLOTS)[None, None, :] < np.minimum(np.asarray(counts), SLOTS)[:, :, None]
    junk = np.random.default_rng(6).integers(0, 256, indices.shape)  # dead slots: any byte
    base = (np.arange(indices.shape[1]) * TILE)[None, :, None]
    offsets = jnp.asarray(np.where(live, np.asarray(indices) - base, junk).astype(np.uint8))
    counts16 = counts.astype(jnp.int16)
    _, count, _, dest = neuron_lists_reference(indices, counts, h, width=width)
    dest_padded = neuron_lists(offsets, counts16, h, width=width, padded=True, interpret=True)[3]
    assert dest_padded.shape[0] > m
    hot_H = jnp.zeros((h,), bool).at[jnp.argmax(count)].set(True)  # the busiest neuron
    ranked = rank_values(values, counts, width, block_sizes=ListsBlockSizes(block_rows=4), interpret=True)
    ranked_ref = rank_values_reference(values, counts, width)
    n_stored = np.asarray(jnp.sum(jnp.minimum(counts, SLOTS), axis=1))
    stored_MxW = np.arange(width)[None, :] < n_stored[:, None]
    assert ranked.shape == (m, width) and stored_MxW.sum() >= 8
    np.testing.assert_array_equal(np.asarray(ranked)[stored_MxW], np.asarray(ranked_ref)[stored_MxW])
    u_slots = jnp.einsum("md,mtsd->mts", x, weights[1][indices], precision=jax.lax.Precision.HIGHEST)
    ranked_u = rank_values_reference(u_slots, counts, width)
    blocks = ListsBlockSizes(block_rows=4)
    want = token_lists(ranked, indices, counts, dest, hot_H, ranked_u_MxW=ranked_u, block_sizes=blocks,
                       interpret=True)
    got = token_lists(ranked, offsets, counts16, dest_padded, hot_H, ranked_u_MxW=ranked_u, tile=TILE,
                      block_sizes=blocks, interpret=True)
    ref = token_lists_reference(ranked, indices, counts, dest, hot_H, ranked_u)
    listed_MxW = np.arange(width)[None, :] < np.asarray(want[0])[:, None]
    assert 4 <= listed_MxW.sum() < stored_MxW.sum()  # a hot neuron's entries left out
    for a, b, r in zip(want, got, ref):
        a, b, r = np.asarray(a), np.asarray(b), np.asarray(r)
        assert a.shape == b.shape == r.shape and a.dtype == b.dtype
        if a.ndim == 2:
            a, b, r = a[listed_MxW], b[listed_MxW], r[listed_MxW]
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, r)
    with pytest.raises(ValueError, match="tile"):
        token_lists(ranked, offsets, counts16, dest_padded, interpret=True)
    # The entries as the kernel wrote them (padded) hold the exact ones as their prefix.
    n_entries = int(jnp.sum(count))
    args = (x, x, *want[:4], *weights, jnp.float32(0.3))
    _, exact = token_backward(*args, u_MxW=want[4], interpret=True)
    _, padded = token_backward(*args, u_MxW=want[4], padded=True, interpret=True)
    assert n_entries > 0
    for e, e_padded in zip(exact, padded):
        assert e.shape == (m * width,) and e_padded.shape[0] > m * width
        np.testing.assert_array_equal(np.asarray(e)[:n_entries], np.asarray(e_padded)[:n_entries])


@pytest.mark.parametrize("dtype,n_values,block_n,with_init", [
    (jnp.float32, 3, 1, False), (jnp.float32, 2, 2, True), (jnp.bfloat16, 3, 4, True),
    (jnp.bfloat16, 2, 1, False)])
def test_neuron_backward_matches_reference(dtype, n_values, block_n, with_init):
    rng = np.random.default_rng(5)
    m, d, h, e = 11, 19, 7, 31
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    gy = jnp.asarray(rng.standard_normal((m, d)), dtype)
    count = jnp.asarray([3, 0, 9, 2, 0, 11, 4], jnp.int32)  # empty neurons, e > sum: unused tail
    start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(count)[:-1]]).astype(jnp.int32)
    tokens = jnp.asarray(rng.integers(0, m, e), jnp.int32)
    values = tuple(jnp.asarray(rng.standard_normal(e), jnp.float32) for _ in range(n_values))
    init = (tuple(jnp.asarray(rng.standard_normal((h, d)), jnp.float32) for _ in range(n_values))
            if with_init else None)
    out = neuron_backward(x, gy, start, count, tokens, values, init,
                          block_sizes=NeuronBwdBlockSizes(block_n=block_n), interpret=True)
    ref = neuron_backward_reference(x, gy, start, count, tokens, values, init)
    assert len(out) == n_values
    for a, b in zip(out, ref):
        assert a.shape == (h, d) and a.dtype == dtype
        assert rel_err(a, b) < TOL[dtype]
    # The launch order (longest lists first, the default, or neuron order) changes no bit.
    by_index = neuron_backward(x, gy, start, count, tokens, values, init, interpret=True,
                               block_sizes=NeuronBwdBlockSizes(block_n=block_n, longest_first=False))
    for a, b in zip(out, by_index):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if not with_init:
        assert not bool(jnp.any(out[0][1])) and not bool(jnp.any(out[0][4]))  # neurons without entries
    # Lists passed with their producers' padding (tokens and values of other lengths, junk past the
    # lists: `padded=True` of the transpose and the token-major kernel): the same bits.
    padded = neuron_backward(x, gy, start, count, jnp.concatenate([tokens, tokens[::-1][:9]]),
                             tuple(jnp.concatenate([v, jnp.full((4,), 1e30, jnp.float32)]) for v in values),
                             init, block_sizes=NeuronBwdBlockSizes(block_n=block_n), interpret=True)
    ref_padded = neuron_backward_reference(x, gy, start, count, jnp.concatenate([tokens, tokens[:2]]),
                                           values, init)
    for a, b, r, r_padded in zip(out, padded, ref, ref_padded):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(r_padded, np.float32))


def _order_key(counts: np.ndarray, max_count: int) -> np.ndarray:
    """longest_first_order's key in numpy: 0 for the longest lists (bit length of the count,
    capped at max_count's), larger for shorter ones."""
    top = max_count.bit_length()
    return top - np.minimum([int(c).bit_length() for c in counts], top)


@pytest.mark.parametrize("case", ["random", "zero", "one_hot", "bucket_edges", "over_max", "single"])
def test_longest_first_order(case):
    """The neuron-major kernel's launch order: a permutation of the neurons by decreasing bit
    length of their count, ascending index inside a bit length (numpy's stable lexsort of the same
    key), the same on every call. Counts above max_count (M; none in valid lists) go with the
    longest; no count is negative."""
    rng = np.random.default_rng(17)
    m, h = 1000, 1 if case == "single" else 777
    if case in ("random", "single"):  # skewed, like a trained layer's lists: most buckets used
        counts = np.minimum(rng.lognormal(2.0, 2.0, h).astype(np.int64), m) * (rng.random(h) < 0.8)
    elif case == "zero":
        counts = np.zeros(h, np.int64)
    elif case == "one_hot":
        counts = (rng.random(h) < 0.1).astype(np.int64)
        counts[500] = m
    elif case == "bucket_edges":  # 2^b - 1, 2^b, 2^b + 1: neighbours on both sides of each edge
        edges = np.array([v for b in range(10) for v in (2**b - 1, 2**b, 2**b + 1)])
        counts = rng.permutation(np.resize(edges, h))
    else:  # over_max
        counts = rng.integers(0, m + 1, h)
        counts[rng.choice(h, 20, replace=False)] = rng.integers(m + 1, 2**30, 20)
    counts = counts.astype(np.int32)
    order = np.asarray(longest_first_order(jnp.asarray(counts), m))
    assert order.dtype == np.int32 and order.shape == (h,)
    np.testing.assert_array_equal(np.sort(order), np.arange(h))  # a permutation
    key = _order_key(counts, m)
    np.testing.assert_array_equal(order, np.lexsort((np.arange(h), key)))
    bits = np.array([int(c).bit_length() for c in counts[order]])
    assert np.all(np.diff(np.minimum(bits, m.bit_length())) <= 0)  # longest first, by bit length
    if case == "random":
        assert len(set(key)) >= 8  # the case spans many buckets
    if case == "one_hot":
        assert order[0] == 500
    if case == "zero":
        np.testing.assert_array_equal(order, np.arange(h))
    if case == "over_max":
        assert np.all(key[counts > m] == 0)
    np.testing.assert_array_equal(order, np.asarray(longest_first_order(jnp.asarray(counts), m)))


def test_longest_first_order_has_no_sort():
    """The order is a counting sort: at the paper's H and M its program holds no sort (the
    StableHLO, and XLA's compiled program on the CPU), where argsort's has one; the StableHLO's
    one scatter places the ids."""
    def text(fn, compiled: bool) -> str:
        lowered = jax.jit(fn, static_argnums=1).lower(jax.ShapeDtypeStruct((5632,), jnp.int32), 16384)
        return lowered.compile().as_text() if compiled else lowered.as_text()

    def argsort(c, m):
        return jnp.argsort(-c, stable=True)

    assert " sort(" in text(argsort, True) and "stablehlo.sort" in text(argsort, False)
    assert " sort(" not in text(longest_first_order, True)
    lowered = text(longest_first_order, False)
    assert "stablehlo.sort" not in lowered
    assert lowered.count('"stablehlo.scatter"(') == 1


def test_kernel_arguments_are_validated():
    with pytest.raises(ValueError, match="block_t"):
        TokenBwdBlockSizes(block_t=3)
    with pytest.raises(ValueError, match="split"):
        TokenBwdBlockSizes(split=1)
    with pytest.raises(ValueError, match="block_n"):
        NeuronBwdBlockSizes(block_n=0)
    with pytest.raises(ValueError, match="longest_first"):
        NeuronBwdBlockSizes(longest_first=1)
    with pytest.raises(ValueError, match="block_rows"):
        ListsBlockSizes(block_rows=3)
    with pytest.raises(ValueError, match="token_tail_chunk"):
        pallas_backward.BackwardConfig(token_tail_chunk=0)
    x, weights = make_inputs(True, 4, 8, 16, jnp.float32, 0.5, seed=0)
    values, indices, counts = pack_gate_reference(x, weights[0], tile=TILE, slots=SLOTS)
    n_M, cols = jnp.zeros((4,), jnp.int32), jnp.zeros((4, 8), jnp.int32)
    lists = (n_M, cols, cols.astype(jnp.float32), cols)
    with pytest.raises(ValueError, match="ranked_MxW"):
        token_lists(cols[:, :4].astype(jnp.float32), indices, counts, cols, interpret=True)
    with pytest.raises(ValueError, match="counts"):
        rank_values(values, counts[:2], 8, interpret=True)
    with pytest.raises(ValueError, match="gy_MxD"):
        token_backward(x, x[:2], *lists, *weights, jnp.float32(0), interpret=True)
    with pytest.raises(ValueError, match="w_down_HxD"):
        token_backward(x, x, *lists, weights[0], weights[1], weights[2][:3], jnp.float32(0),
                       interpret=True)
    with pytest.raises(ValueError, match="cols_MxW"):
        token_backward(x, x, n_M, cols[:, :6], *lists[2:], *weights, jnp.float32(0), interpret=True)
    with pytest.raises(ValueError, match="pos_MxW"):
        token_backward(x, x, *lists[:3], cols[:, :4], *weights, jnp.float32(0), interpret=True)
    with pytest.raises(ValueError, match="n_M"):
        token_backward(x, x, n_M[:2], *lists[1:], *weights, jnp.float32(0), interpret=True)
    with pytest.raises(ValueError, match="dx_init"):
        token_backward(x, x, *lists, *weights, jnp.float32(0), dx_init=x[:2], interpret=True)
    start = jnp.zeros((16,), jnp.int32)
    with pytest.raises(ValueError, match="values_E"):
        neuron_backward(x, x, start, start, jnp.zeros((5,), jnp.int32), (jnp.zeros((5,)),),
                        interpret=True)
    with pytest.raises(ValueError, match="backward must be None or a .*BackwardConfig"):
        ops.gated_ffn(x, *weights, backend="pallas", interpret=True,
                      config=ops.SparseFFNConfig(backward="keep"))


@pytest.mark.parametrize("capacity", [5, 40])
def test_chunked_visits_each_listed_id_once(capacity):
    """The tails' loop: the first min(n, capacity) True ids, ascending, each once; nothing for no
    ids; one block of the smallest size in (2, 8, 16) that holds them, else blocks of `chunk` = 16
    (padding ids = N). One compiled program per capacity, run on masks with 0, 1, 3, 7, 9, 10, 17,
    19 and 33 ids (up to 3 blocks of 16)."""
    n = 70
    assert pallas_backward.tail_block_sizes(16, 2) == (2, 8, 16)
    assert pallas_backward.tail_block_sizes(256, 16) == (16, 64, 128, 256)
    assert pallas_backward.tail_block_sizes(1024, 16) == (16, 64, 256, 512, 1024)

    def run(ids_C, carry):  # counts the visits of each id and the blocks of each size
        visits, sizes = carry
        return visits.at[ids_C].add(1, mode="drop"), sizes.at[ids_C.shape[0]].add(1)

    loop = jax.jit(lambda m: pallas_backward._chunked(
        m, capacity, 16, 2, run, (jnp.zeros((n,), jnp.int32), jnp.zeros((17,), jnp.int32))))
    for n_true in (0, 1, 3, 7, 9, 10, 17, 19, 33):
        mask = jnp.zeros((n,), bool).at[jnp.arange(0, 2 * n_true, 2) % n].set(True)
        ids_true = np.flatnonzero(np.asarray(mask))[:capacity]
        visits, sizes = loop(mask)
        expect = np.zeros(n, int)
        expect[ids_true] = 1
        np.testing.assert_array_equal(visits, expect)
        k = len(ids_true)
        want_sizes = np.zeros(17, int)
        if k:
            size = next((s for s in (2, 8) if k <= s), 16)
            want_sizes[size] = -(-k // size)
        np.testing.assert_array_equal(sizes, want_sizes, err_msg=f"{n_true} ids")
    # One conditional decides it all (each device-side predicate is a host round trip on the GPU):
    # nothing, one block of 2, 8 or 16, or the loop, the only branch with a device-sized trip count.
    jaxpr = jax.make_jaxpr(lambda m: pallas_backward._chunked(
        m, capacity, 16, 2, run, (jnp.zeros((n,), jnp.int32), jnp.zeros((17,), jnp.int32))))(mask)
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1 and not any(e.primitive.name == "while" for e in jaxpr.eqns)
    assert ["while" in str(branch) for branch in conds[0].params["branches"]] == [False] * 4 + [True]


# ---------------------------------------------------------------------------------------------
# Training "auto"
# ---------------------------------------------------------------------------------------------

# (M, k, keep_gate_pattern) -> (forward sparse?, backward sparse?) at D 2048, H 5632, gated, bf16,
# worked out by hand from the H100 cost models (planner.COST_MODELS) (modelled ms of the
# best plan; one with a sparse piece must be <= SAFETY 0.9 x the dense plan). At M 2048 the dense
# plan is 0.606 ms (limit 0.545), at M 16384 4.569 ms (limit 4.112), at M 65536 18.155 ms (16.339).
TRAINING_PLANS = [
    (2048, 1, True, (False, False)),    # sparse fwd+bwd 0.967: the fixed costs weigh at 2048 tokens
    (2048, 10, True, (False, False)),   # sparse fwd + dense bwd 0.765
    (16384, 1, True, (True, True)),     # 1.806
    (16384, 10, True, (True, True)),    # 2.459
    (16384, 10, False, (True, True)),   # 3.166 with the re-pack
    (16384, 18, False, (True, True)),   # 3.746 with the re-pack
    (16384, 29, True, (True, True)),    # 3.838 (3.817 measured, 2026-11-27)
    (16384, 29, False, (False, False)),  # with the re-pack 4.544 > 4.112
    (16384, 33, True, (False, False)),  # 4.128 > 4.112
    (16384, 56, True, (False, False)),  # 5.797, and sparse fwd + dense bwd 5.854
    (65536, 29, True, (True, True)),    # 12.811: the fixed costs amortised
    (65536, 2000, True, (False, False)),
]


@pytest.mark.parametrize("m, k, keep_pattern, plan", TRAINING_PLANS)
def test_choose_training_path_table(m, k, keep_pattern, plan):
    assert planner.choose_training_path(m, 2048, 5632, k, True, keep_pattern=keep_pattern) == plan


def test_choose_training_path_is_monotone_and_rejects_bad_hints():
    m, d, h = 16384, 2048, 5632
    choices = [planner.choose_training_path(m, d, h, k, True) for k in (1, 10, 29, 56, 112, 2000)]
    for (f0, b0), (f1, b1) in zip(choices, choices[1:]):
        assert f1 <= f0 and b1 <= b0  # sparser never turns a piece dense
    with pytest.raises(ValueError, match="expected_active"):
        planner.choose_training_path(m, d, h, -1.0, True)


# Patterns measured on the H100 (BENCHMARKS.md, 2026-11-27, bench_ffn_train.py --quick --shape trained:
# M 16384, D 2048, H 5632): (k, token-tail rows, hot neurons, hot entries' share, pallas ms, xla_bf16 ms),
# uniform at k 16-56 and the trained-like pattern (bench/patterns.py) at k 29 and 39. The cost model
# with the tails must plan sparse only where the kernels won by the safety margin.
TRAINED_LAYERS = [
    (16.1, 0, 0, 0.0, 2.964, 4.521),      # 1.53x: sparse
    (29.3, 0, 0, 0.0, 3.817, 4.530),      # 1.19x: sparse
    (38.2, 0, 0, 0.0, 4.423, 4.749),      # 1.07x: within the 0.9 safety margin, dense
    (56.1, 0, 1, 0.0, 6.169, 4.774),      # 0.77x: dense
    (29.0, 0, 227, 0.181, 4.327, 4.719),  # trained-like, 1.09x: within the margin, dense
    (39.0, 0, 481, 0.298, 5.224, 4.766),  # trained-like, 0.91x: dense
]


@pytest.mark.parametrize("k, rows, hot, share, pallas_ms, xla_ms", TRAINED_LAYERS)
def test_choose_training_path_prices_the_measured_tails(k, rows, hot, share, pallas_ms, xla_ms):
    m, d, h = 16384, 2048, 5632
    config = ops.SparseFFNConfig(expected_token_tail=rows / m, expected_hot_neurons=hot / h,
                                 expected_hot_entries=share)
    fwd, bwd = planner.sparse_times_ms(m, d, h, k, True, config=config)
    assert fwd + bwd == pytest.approx(pallas_ms, abs=0.25)  # the fit's residuals
    plan = planner.choose_training_path(m, d, h, k, True, config=config)
    assert plan == ((True, True) if pallas_ms < 0.9 * xla_ms else (False, False))


def test_tail_terms_move_the_plan_and_a_tail_over_capacity_plans_a_dense_backward():
    m, d, h = 16384, 2048, 5632
    k = 16.0  # sparse on a uniform pattern
    assert planner.choose_training_path(m, d, h, k, True) == (True, True)
    _, bare = planner.sparse_times_ms(m, d, h, k, True)
    # Hot neurons holding most entries make the kernels cheaper, their dense tail costs its GEMMs.
    hot = ops.SparseFFNConfig(expected_hot_neurons=0.03, expected_hot_entries=0.8)
    token_ms, hot_ms = planner.tail_times_ms(m, d, h, 0.0, 0.03 * h, True)
    assert token_ms == 0.0 and hot_ms > 0.5
    _, with_hot = planner.sparse_times_ms(m, d, h, k, True, config=hot)
    gathers = bare - planner.costs("H100").backward.bwd_fixed_ms
    assert with_hot == pytest.approx(bare - 0.8 * gathers + hot_ms)
    # A long token tail (dense first tokens) makes the same mean k a dense plan.
    long_tail = ops.SparseFFNConfig(expected_token_tail=0.12)  # <= tail_rows 0.125
    assert planner.choose_training_path(m, d, h, k, True, config=long_tail) == (False, False)
    # Over a capacity the backward would run the dense formula: never a sparse backward.
    over = ops.SparseFFNConfig(expected_token_tail=0.2)  # > tail_rows 0.125
    assert planner.sparse_times_ms(m, d, h, k, True, config=over)[1] == float("inf")
    assert planner.choose_training_path(m, d, h, 1.0, True, config=over)[1] is False
    hot_over = ops.SparseFFNConfig(expected_hot_neurons=0.3)  # > transpose_tail_rows 0.25
    assert planner.choose_training_path(m, d, h, 1.0, True, config=hot_over)[1] is False



def test_the_ops_plan_takes_the_configs_tail_hints(monkeypatch):
    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    shape = (16384, 2048, 5632, 2)
    plain = ops.SparseFFNConfig(expected_active_per_token=16.0)
    assert ops.auto_decision(True, plain, shape) == ("pallas", "pallas")
    assert ops.auto_decision(True, dataclasses.replace(plain, expected_token_tail=0.12), shape) == ("dense", "dense")


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.1"])
def test_tail_hints_must_be_shares(bad):
    for name in ops.TAIL_HINT_FIELDS:
        with pytest.raises(ValueError, match=name):
            ops.SparseFFNConfig(**{name: bad})


@pytest.mark.parametrize("choice", [(True, True), (False, True), (True, False), (False, False)])
def test_auto_with_hint_routes_forward_and_backward(choice, monkeypatch):
    """With a GPU (simulated: available() patched, kernels interpreted), "auto" + a hint runs the
    plan that choose_training_path picks (each of the four), with exact gradients."""
    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    asked = []
    monkeypatch.setattr(planner, "choose_training_path",
                        lambda *a, **k: asked.append(a) or choice)
    plans = []
    original = dispatch._sparse_call
    monkeypatch.setattr(dispatch, "_sparse_call", lambda *a: plans.append(a[0]) or original(*a))
    x, weights = make_inputs(True, 13, 16, 29, jnp.float32, 0.9, seed=15)
    cot = jnp.asarray(np.random.default_rng(16).standard_normal((13, 16)), jnp.float32)
    config = ops.SparseFFNConfig(tile=TILE, slots=SLOTS, expected_active_per_token=2.5)

    def loss(x_, w_):
        y, aux = ops.gated_ffn(x_, *w_, backend="auto", config=config, interpret=True)
        return loss_of(y, aux["l1"], cot)

    # The dense formula (these plans' dense pieces) runs f32 GEMMs at JAX's default precision, TF32
    # on a GPU, as plain JAX does (dense.exact_precision): full precision here, as in the oracle.
    with jax.default_matmul_precision("highest"):
        grads = jax.grad(loss, argnums=(0, 1))(x, weights)
    assert asked == [(13, 16, 29, 2.5, True)]
    names = {True: "pallas", False: "dense"}
    if choice == (False, False):  # the dense plan is the plain "dense" backend: no custom_vjp call
        assert plans == []
    else:
        assert [(p.forward, p.backward) for p in plans] == [(names[choice[0]], names[choice[1]])]
    _, _, _, _, ref = oracle(True, x, weights, cot)
    for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        assert rel_err(a, r) < 1e-5
