"""The decode step's attention over the stacked KV cache (pallas_kernels/decode_attention.py,
`decode_attention_qkv`: RoPE, the cache writes and the attention in one launch, interpret mode)
against its reference, which is the model's own RoPE and cache update, then the attention
reference, itself checked against the model's XLA attention with the decode mask."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.model import decode_mask, rope, rope_tables
from twell_jax.pallas_kernels.decode_attention import (AttentionBlockSizes, decode_attention_qkv,
                                                       decode_attention_qkv_reference, decode_attention_reference)

SMALL = AttentionBlockSizes(block_t=16, target_programs=8, num_warps=1, num_stages=1)


def _inputs(dtype, layers=3, batch=3, length=40, heads=2, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(layers, batch, length, heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(layers, batch, length, heads, head_dim)), dtype)
    return q, k, v


def test_the_reference_is_the_models_masked_attention():
    q, k, v = _inputs(jnp.float32, seed=5)
    start, index, layer = jnp.asarray([0, 4, 9], jnp.int32), 20, 1
    vis = decode_mask(jnp.asarray([index]), start, k.shape[2])  # the model's rule, [B, 1, T]
    want = jax.nn.dot_product_attention(q[:, None], k[layer], v[layer], mask=vis[:, None],
                                        implementation="xla")[:, 0]
    got = decode_attention_reference(q, k, v, jnp.asarray([layer], jnp.int32), jnp.asarray([index], jnp.int32), start)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_splits_and_bad_block_sizes():
    sizes = AttentionBlockSizes(block_t=64, target_programs=512)
    assert sizes.splits(1, 32, 2048) == 16 and sizes.splits(64, 32, 2048) == 1 and sizes.splits(1, 1, 10) == 1
    with pytest.raises(ValueError, match="block_t"):
        AttentionBlockSizes(block_t=48)


def _qkv_inputs(dtype, index, starts, layers=3, batch=3, length=40, heads=2, head_dim=16, seed=0, theta=10000.0,
                kv_heads=None):
    rng = np.random.default_rng(seed)
    kv_heads = kv_heads or heads
    qkv = jnp.asarray(rng.normal(size=(batch, (heads + 2 * kv_heads) * head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(layers, batch, length, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(layers, batch, length, kv_heads, head_dim)), dtype)
    start = jnp.asarray(starts, jnp.int32)
    positions = jnp.maximum(index - start, 0)[:, None]  # the model's decode positions
    cos, sin = (t[:, 0] for t in rope_tables(positions, head_dim, theta))
    return qkv, cos, sin, k, v, start, positions


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("index,starts", [(0, (0, 0, 0)), (17, (0, 5, 17)), (39, (0, 3, 30)), (25, (0, 30, 2)),
                                          (16, (0, 16, 16))])
def test_the_fused_step_matches_its_reference(dtype, tol, index, starts):
    """The new slot in every split's position (16: the first slot of a block; 39: the last slot;
    0: the only one), rows that see only it, left padding; the caches change at that slot only."""
    qkv, cos, sin, k, v, start, _ = _qkv_inputs(dtype, index, starts, seed=index)
    for layer in (0, 2):
        args = (qkv, cos, sin, k, v, jnp.asarray([layer], jnp.int32), jnp.asarray([index], jnp.int32), start)
        out, k_new, v_new = decode_attention_qkv(*args, block_sizes=SMALL, interpret=True)
        want, k_want, v_want = decode_attention_qkv_reference(*args)
        assert out.shape == (3, 2, 16) and out.dtype == dtype
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
        assert err <= tol * max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32))))), (layer, err)
        np.testing.assert_array_equal(v_new, v_want)
        # RoPE's fp32 products may round differently (a fused multiply-add): the new keys within an ulp.
        np.testing.assert_allclose(k_new.astype(jnp.float32), k_want.astype(jnp.float32), rtol=2e-7 if dtype ==
                                   jnp.float32 else 8e-3, atol=1e-7)
        changed = np.asarray(jnp.any(k_new != k, axis=(-1, -2)) | jnp.any(v_new != v, axis=(-1, -2)))
        assert not np.delete(changed, index, axis=2).any() and not np.delete(changed, layer, axis=0).any()
        assert changed[layer, :, index].all()


def test_the_fused_steps_reference_is_the_models_rope_and_cache_write():
    qkv, cos, sin, k, v, start, positions = _qkv_inputs(jnp.float32, 21, (0, 4, 9), seed=3)
    layer, index = jnp.asarray([1], jnp.int32), jnp.asarray([21], jnp.int32)
    out, k_new, v_new = decode_attention_qkv_reference(qkv, cos, sin, k, v, layer, index, start)
    q_, k_, v_ = (qkv.reshape(3, 1, 3, 2, 16)[:, :, part] for part in range(3))
    q_rot, k_rot = rope(q_, 10000.0, positions), rope(k_, 10000.0, positions)
    k_want = jax.lax.dynamic_update_slice(k, k_rot[None], (1, 0, 21, 0, 0))
    np.testing.assert_array_equal(k_new, k_want)
    np.testing.assert_array_equal(v_new, jax.lax.dynamic_update_slice(v, v_[None], (1, 0, 21, 0, 0)))
    np.testing.assert_array_equal(out, decode_attention_reference(q_rot[:, 0], k_want, v_new, layer, index, start))


def test_the_fused_step_clamps_an_index_past_the_end_and_rejects_bad_arguments():
    qkv, cos, sin, k, v, start, _ = _qkv_inputs(jnp.float32, 39, (0, 0, 0), seed=1)
    layer = jnp.asarray([1], jnp.int32)
    past = decode_attention_qkv(qkv, cos, sin, k, v, layer, jnp.asarray([45], jnp.int32), start, block_sizes=SMALL,
                                interpret=True)
    last = decode_attention_qkv(qkv, cos, sin, k, v, layer, jnp.asarray([39], jnp.int32), start, block_sizes=SMALL,
                                interpret=True)
    for a, b in zip(past, last):  # XLA's cache write clamps its start: the last slot
        np.testing.assert_array_equal(a, b)
    one = jnp.asarray([0], jnp.int32)
    with pytest.raises(ValueError, match="qkv must be"):
        decode_attention_qkv(qkv[:, :-1], cos, sin, k, v, one, one, start)
    with pytest.raises(ValueError, match="cos must be float32"):
        decode_attention_qkv(qkv, cos[:, :4], sin, k, v, one, one, start)
    with pytest.raises(ValueError, match="sin must be float32"):
        decode_attention_qkv(qkv, cos, sin.astype(jnp.bfloat16), k, v, one, one, start)
    with pytest.raises(ValueError, match="start_B"):
        decode_attention_qkv(qkv, cos, sin, k, v, one, one, start[:2])


@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (32, 8)])
def test_the_fused_step_lowers_to_triton_for_cuda(heads, kv_heads):
    # The Pallas -> Triton IR lowering runs without a GPU, at the 0.5b model's shapes (and Llama 3
    # 8B's grouped heads: 32 query heads on 8 KV heads) with the caches aliased to the outputs (in place).
    import functools

    from jax import export

    cache = jax.ShapeDtypeStruct((8, 1, 2048, kv_heads, 128), jnp.bfloat16)
    shapes = (jax.ShapeDtypeStruct((1, (heads + 2 * kv_heads) * 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, 64), jnp.float32), jax.ShapeDtypeStruct((1, 64), jnp.float32), cache, cache,
              jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
              jax.ShapeDtypeStruct((1,), jnp.int32))
    exported = export.export(jax.jit(functools.partial(decode_attention_qkv, heads=heads)), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
    text = exported.mlir_module()
    assert "twell_decode_attention_qkv" in text and "output_operand_aliases" in text


def test_the_grouped_reference_is_the_multi_head_one_with_each_kv_head_repeated():
    """Grouped-query attention: query head n reads KV head n // G (Hugging Face's repeat_kv), so the
    reference equals the multi-head reference over caches whose KV heads are repeated G times, and
    the model's XLA attention, which takes the grouped caches as they are."""
    q, k, v = _inputs(jnp.float32, heads=6, seed=7)
    k, v = k[..., :2, :], v[..., :2, :]  # 2 KV heads for 6 query heads: G = 3
    start, index, layer = jnp.asarray([0, 4, 9], jnp.int32), 20, 2
    args = (jnp.asarray([layer], jnp.int32), jnp.asarray([index], jnp.int32), start)
    got = decode_attention_reference(q, k, v, *args)
    repeated = decode_attention_reference(q, jnp.repeat(k, 3, axis=3), jnp.repeat(v, 3, axis=3), *args)
    np.testing.assert_allclose(got, repeated, rtol=1e-6, atol=1e-6)
    vis = decode_mask(jnp.asarray([index]), start, k.shape[2])
    want = jax.nn.dot_product_attention(q[:, None], k[layer], v[layer], mask=vis[:, None], implementation="xla")[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 1)])
@pytest.mark.fast_params("6-2-float32-2e-06", "4-1-bfloat16-0.02")
def test_the_fused_step_with_grouped_kv_heads_matches_its_reference(heads, kv_heads, dtype, tol):
    """Each KV head's program serves its G query heads: every query head's output, the one new
    key/value slot written per KV head, left padding and the new slot in a split's middle."""
    index, starts = 17, (0, 5, 17)
    qkv, cos, sin, k, v, start, _ = _qkv_inputs(dtype, index, starts, heads=heads, kv_heads=kv_heads, seed=heads)
    args = (qkv, cos, sin, k, v, jnp.asarray([1], jnp.int32), jnp.asarray([index], jnp.int32), start)
    out, k_new, v_new = decode_attention_qkv(*args, heads=heads, block_sizes=SMALL, interpret=True)
    want, k_want, v_want = decode_attention_qkv_reference(*args, heads=heads)
    assert out.shape == (3, heads, 16) and k_new.shape == k.shape
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err <= tol * max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32))))), err
    np.testing.assert_array_equal(v_new, v_want)
    np.testing.assert_allclose(k_new.astype(jnp.float32), k_want.astype(jnp.float32), rtol=2e-7 if dtype ==
                               jnp.float32 else 8e-3, atol=1e-7)
    changed = np.asarray(jnp.any(k_new != k, axis=-1) | jnp.any(v_new != v, axis=-1))  # [L, B, T, N_kv]
    assert changed[1, :, index].all() and changed.sum() == 3 * kv_heads


def test_the_grouped_step_rejects_heads_that_do_not_fit_the_cache():
    qkv, cos, sin, k, v, start, _ = _qkv_inputs(jnp.float32, 5, (0, 0, 0), heads=4, kv_heads=2)
    one = jnp.asarray([0], jnp.int32)
    with pytest.raises(ValueError, match="heads .*multiple of the cache's N_kv=2"):
        decode_attention_qkv(qkv, cos, sin, k, v, one, one, start, heads=3)
    with pytest.raises(ValueError, match=r"qkv must be \[B=3, \(N \+ 2 N_kv\) K=96\]"):
        decode_attention_qkv(qkv, cos, sin, k, v, one, one, start, heads=2)  # N=2: a multi-head qkv is 96 wide
