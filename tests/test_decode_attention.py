"""Decode attention over the stacked KV cache (pallas_kernels/decode_attention.py, interpret mode)
against its reference and against the model's XLA attention with the decode mask."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.model import decode_mask
from twell_jax.pallas_kernels.decode_attention import (AttentionBlockSizes, decode_attention,
                                                       decode_attention_reference)

SMALL = AttentionBlockSizes(block_t=16, target_programs=8, num_warps=1, num_stages=1)


def _inputs(dtype, layers=3, batch=3, length=40, heads=2, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(layers, batch, length, heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(layers, batch, length, heads, head_dim)), dtype)
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("index,starts", [(0, (0, 0, 0)), (17, (0, 5, 17)), (39, (0, 3, 30)), (25, (0, 30, 2))])
def test_matches_the_reference(dtype, tol, index, starts):
    q, k, v = _inputs(dtype, seed=index)
    start = jnp.asarray(starts, jnp.int32)
    for layer in (0, 2):
        args = (q, k, v, jnp.asarray([layer], jnp.int32), jnp.asarray([index], jnp.int32), start)
        got = decode_attention(*args, block_sizes=SMALL, interpret=True)
        want = decode_attention_reference(*args)
        assert got.shape == q.shape and got.dtype == q.dtype
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol * max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32))))), (layer, err)


def test_the_reference_is_the_models_masked_attention():
    q, k, v = _inputs(jnp.float32, seed=5)
    start, index, layer = jnp.asarray([0, 4, 9], jnp.int32), 20, 1
    vis = decode_mask(jnp.asarray([index]), start, k.shape[2])  # the model's rule, [B, 1, T]
    want = jax.nn.dot_product_attention(q[:, None], k[layer], v[layer], mask=vis[:, None],
                                        implementation="xla")[:, 0]
    got = decode_attention_reference(q, k, v, jnp.asarray([layer], jnp.int32), jnp.asarray([index], jnp.int32), start)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_splits_and_bad_arguments():
    sizes = AttentionBlockSizes(block_t=64, target_programs=512)
    assert sizes.splits(1, 32, 2048) == 16 and sizes.splits(64, 32, 2048) == 1 and sizes.splits(1, 1, 10) == 1
    q, k, v = _inputs(jnp.float32)
    one = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q[:, :1], k, v, one, one, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="start_B"):
        decode_attention(q, k, v, one, one, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="block_t"):
        AttentionBlockSizes(block_t=48)
