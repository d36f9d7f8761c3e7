"""Fused sparse FFN kernel (pallas_kernels/twell_ffn.py) vs its jnp reference and the dense formula,
in interpret mode on CPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.twell_ffn import FFNBlockSizes, launches, sparse_ffn, sparse_ffn_reference
from twell_jax.pallas_kernels.twell_pack import pack_gate_reference
from oracles import rel_err

TILE, SLOTS = 32, 4
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_case(dtype, m=37, d=45, h=150, seed=0):
    """Random inputs whose gate is sparse (~5%), with one dense row (tiles overflow) and one empty row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, d)).astype(np.float32)
    x[:, 0] = 1.0
    w_gate = rng.normal(size=(h, d)).astype(np.float32) / np.sqrt(d)
    w_gate[:, 0] = -1.7
    x[3, 0] = -40.0  # a fully dense token: every tile overflows
    x[4] = 0.0  # an empty token
    w_up = rng.normal(size=(h, d)).astype(np.float32) / np.sqrt(d)
    w_down = rng.normal(size=(h, d)).astype(np.float32) / np.sqrt(d)
    return [jnp.asarray(a, dtype) for a in (x, w_gate, w_up, w_down)]


def dense_from_stored(x, values, indices, counts, w_up, w_down):
    """Dense oracle on the STORED entries: scatter the packed activation to [M, H], then matmuls."""
    m, h = x.shape[0], w_down.shape[0]
    live = jnp.arange(values.shape[2]) < jnp.minimum(counts, values.shape[2])[..., None]
    a = jnp.zeros((m, h), jnp.float32).at[
        jnp.arange(m)[:, None, None], indices].add(jnp.where(live, values.astype(jnp.float32), 0))
    hi = jax.lax.Precision.HIGHEST
    x32 = x.astype(jnp.float32)
    hid = a if w_up is None else a * jnp.einsum("md,hd->mh", x32, w_up.astype(jnp.float32), precision=hi)
    return jnp.einsum("mh,hd->md", hid, w_down.astype(jnp.float32), precision=hi), jnp.abs(hid).sum(1)


# head_slots: 0 = every slot in the dynamic loop; 1, 2 = prefetched head slots (with S = 4 slots,
# tiles of 0, 1, 2 and > 2 actives all occur); 4 = every stored slot is a head slot.
@pytest.mark.parametrize("dtype,gated,block_t,head_slots", [
    (jnp.float32, True, 1, 1), (jnp.float32, False, 4, 2), (jnp.bfloat16, True, 4, 0),
    (jnp.bfloat16, False, 1, 4), (jnp.float32, True, 2, 1), (jnp.bfloat16, True, 1, 2)])
def test_sparse_ffn_matches_reference_and_dense_oracle(dtype, gated, block_t, head_slots):
    x, w_gate, w_up, w_down = make_case(dtype)
    values, indices, counts = pack_gate_reference(x, w_gate, tile=TILE, slots=SLOTS)
    assert bool(jnp.all(counts[3] > SLOTS))  # the dense token: the reader must stop at S slots
    up = w_up if gated else None
    y, l1 = sparse_ffn(x, values, indices, counts, up, w_down,
                       block_sizes=FFNBlockSizes(block_t=block_t, head_slots=head_slots),
                       interpret=True)
    y_ref, l1_ref = sparse_ffn_reference(x, values, indices, counts, up, w_down)
    y_oracle, l1_oracle = dense_from_stored(x, values, indices, counts, up, w_down)
    assert y.shape == x.shape and y.dtype == dtype and l1.shape == (x.shape[0],)
    assert rel_err(y, y_oracle) < TOL[dtype] and rel_err(y_ref, y_oracle) < TOL[dtype]
    assert rel_err(l1, l1_oracle) < 1e-5 and rel_err(l1_ref, l1_oracle) < 1e-5
    assert not bool(jnp.any(y[4])) and float(l1[4]) == 0.0  # the empty token


def test_sparse_ffn_validates_arguments():
    with pytest.raises(ValueError, match="block_t"):
        FFNBlockSizes(block_t=3)
    with pytest.raises(ValueError, match="head_slots"):
        FFNBlockSizes(head_slots=5)
    with pytest.raises(ValueError, match="split"):
        FFNBlockSizes(split=1)
    x, w_gate, w_up, w_down = make_case(jnp.float32, m=8, d=16, h=40)
    values, indices, counts = pack_gate_reference(x, w_gate, tile=TILE, slots=SLOTS)
    with pytest.raises(ValueError, match="counts"):
        sparse_ffn(x, values, indices, counts[:4], w_up, w_down, interpret=True)
    with pytest.raises(ValueError, match="w_down_HxD"):
        sparse_ffn(x, values, indices, counts, w_up, w_down.astype(jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("dtype,gated,block_t,head_slots", [
    (jnp.float32, True, 1, 0), (jnp.bfloat16, True, 2, 1), (jnp.bfloat16, False, 1, 2)])
def test_sparse_ffn_ranked_outputs_are_the_rows_entries_in_rank_order(dtype, gated, block_t, head_slots):
    """ranked_width: each row's stored (a, u) in rank order, what the training backward keeps; rows
    with more stored entries than the width (the dense token 3: the backward's token tail) keep
    their first `width`; y and l1 are unchanged by it."""
    x, w_gate, w_up, w_down = make_case(dtype)
    values, indices, counts = pack_gate_reference(x, w_gate, tile=TILE, slots=SLOTS)
    up = w_up if gated else None
    width = 16
    n_stored = np.asarray(jnp.sum(jnp.minimum(counts, SLOTS), axis=1))
    assert n_stored[3] > width and n_stored[4] == 0 and n_stored.max() > 0
    sizes = FFNBlockSizes(block_t=block_t, head_slots=head_slots)
    y, l1, ranked = sparse_ffn(x, values, indices, counts, up, w_down, block_sizes=sizes,
                               ranked_width=width, interpret=True)
    y0, l10 = sparse_ffn(x, values, indices, counts, up, w_down, block_sizes=sizes, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l10))
    *_, ranked_ref = sparse_ffn_reference(x, values, indices, counts, up, w_down, ranked_width=width)
    assert len(ranked) == len(ranked_ref) == (2 if gated else 1)
    assert ranked[0].dtype == dtype and (not gated or ranked[1].dtype == jnp.float32)
    assert all(r.shape == (x.shape[0], width) for r in ranked)  # written [M, W]: no slice, no copy
    stored = np.arange(width)[None, :] < np.minimum(n_stored, width)[:, None]
    np.testing.assert_array_equal(np.asarray(ranked[0])[stored], np.asarray(ranked_ref[0])[stored])
    for i in (0, 1, 2, 3):  # rank order = the stored slots, tiles then slots ascending
        live = np.asarray(jnp.arange(SLOTS)[None, :] < jnp.minimum(counts[i], SLOTS)[:, None])
        want = np.asarray(values[i])[live][:width]
        np.testing.assert_array_equal(np.asarray(ranked_ref[0][i, :len(want)]), want)
    if gated:  # u = x . U_j of each entry, fp32
        u = np.asarray(ranked[1])[stored]
        assert rel_err(u, np.asarray(ranked_ref[1])[stored]) < 1e-5
        j = np.asarray(indices)
        i = int(np.nonzero(stored)[0][0])  # independent check of one row: u from its own entries
        live = np.asarray(jnp.arange(SLOTS)[None, :] < jnp.minimum(counts[i], SLOTS)[:, None])
        js = j[i][live][:width]
        want_u = np.asarray(x[i], np.float32) @ np.asarray(w_up, np.float32)[js].T
        np.testing.assert_allclose(np.asarray(ranked[1][i, :len(js)]), want_u, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="ranked_width"):
        sparse_ffn(x, values, indices, counts, up, w_down, ranked_width=12, interpret=True)


@pytest.mark.parametrize("dtype,block_t,head_slots", [(jnp.bfloat16, 1, 0), (jnp.float32, 2, 1),
                                                      (jnp.bfloat16, 4, 4)])
def test_sparse_ffn_split_launches_equal_the_fused_kernel(dtype, block_t, head_slots):
    """split: the up launch (u, h of every stored entry, l1, the ranked (a, u)) then the down launch
    (y from h): the same arithmetic in the same order as the one fused launch, so the same bits;
    the dense token's tiles overflow (the reader stops at S), the empty token gives 0. The default
    (split None) splits exactly when the ranked outputs are asked for."""
    x, w_gate, w_up, w_down = make_case(dtype, seed=5)
    values, indices, counts = pack_gate_reference(x, w_gate, tile=TILE, slots=SLOTS)
    fused = sparse_ffn(x, values, indices, counts, w_up, w_down, ranked_width=16, interpret=True,
                       block_sizes=FFNBlockSizes(block_t=block_t, head_slots=head_slots, split=False))
    split = sparse_ffn(x, values, indices, counts, w_up, w_down, ranked_width=16, interpret=True,
                       block_sizes=FFNBlockSizes(block_t=block_t, head_slots=head_slots, split=True))
    for a, b in zip(fused[:2], split[:2]):  # y, l1
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    n_stored = np.asarray(jnp.sum(jnp.minimum(counts, SLOTS), axis=1))
    stored = np.arange(16)[None, :] < np.minimum(n_stored, 16)[:, None]  # the rest is unspecified
    for a, b in zip(fused[2], split[2]):  # the ranked a, u
        np.testing.assert_array_equal(np.asarray(a)[stored], np.asarray(b)[stored])
    y_oracle, l1_oracle = dense_from_stored(x, values, indices, counts, w_up, w_down)
    assert rel_err(split[0], y_oracle) < TOL[dtype] and rel_err(split[1], l1_oracle) < 1e-5
    assert not bool(jnp.any(split[0][4]))
    y2, l12 = sparse_ffn(x, values, indices, counts, w_up, w_down, interpret=True,
                         block_sizes=FFNBlockSizes(block_t=block_t, split=True))  # no ranked output
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(fused[0]))
    assert launches(FFNBlockSizes(), gated=True, ranked_width=16) == ("up", "down")  # training
    assert launches(FFNBlockSizes(), gated=True, ranked_width=0) == ("fused",)  # inference
    assert launches(FFNBlockSizes(split=True), gated=False, ranked_width=16) == ("fused",)  # one matrix
    assert launches(FFNBlockSizes(split=False), gated=True, ranked_width=16) == ("fused",)
