"""Decode attention over a stacked KV cache (Pallas, Triton backend), the model's decode step
(`twell_jax/inference/decode_engine.py`): from the q/k/v product's output, RoPE of the new query and
key, their writes into the caches and one new query per row and head against the cached keys and
values of one layer, in one launch, the caches read and written in place.

The model's caches are [L, B, T, N_kv, K] arrays carried through the decode step's layers (N_kv KV
heads: N_kv = N, the query heads, for multi-head attention; fewer for grouped-query attention, each
serving G = N / N_kv consecutive query heads). XLA's
attention reads layer l's [B, T, N, K] out of them as a copy (at batch 8 and 64 that copy cost
more than the attention itself: BENCHMARKS.md, Decode); this kernel takes the whole caches and the
`layer` and reads the slots it needs where they are, and only the slots a row can see (up to the
newest one), not the whole cache length.

    visible(b, t) = t <= index and (t >= start[b] or t == index)     (the model's decode mask)
    out[b, n]     = softmax_t(q[b, n] . k[l, b, t, n // G] / sqrt(K)) . v[l, b, t, n // G]   over visible t

Grid (B, N_kv, S): program (b, h, s) runs, for each of KV head h's G query heads, an online softmax
(fp32) over its share of the slots, [s * T/S, (s+1) * T/S) clipped to the visible range, in blocks
of `block_t` (each block of keys and values loaded once for the G heads: a grouped cache is read
once, not G times), and writes the G partials (acc [K] unnormalised, max, sum); `combine` merges the
S partials per (b, n) in XLA (a few KB). S spreads a small batch over the SMs (S = 1 at large
batches). A program with no visible slot writes max -1e30, sum 0 and contributes nothing.
Deterministic: fixed orders, no atomics.

Every program applies RoPE to its heads' queries (and the new key) as it loads them from the q/k/v
output [B, (N + 2 N_kv) K] (q heads, then k heads, then v heads), rounded as the model rounds them;
the program whose share of the slots holds the new slot `index` writes the new key and value into
the caches (aliased to the outputs: in place) and starts its online softmaxes from them in
registers, and every program skips slot `index` in its loads, so no program reads what the launch
writes. This replaces RoPE, two cache writes and
their casts, each an XLA launch a layer.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .common import check_launch_sizes, compiler_params, is_pow2

NEG = -1e30  # the running max before any visible slot (finite: no inf - inf)


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
    block_t: int = 64  # cache slots per step (power of two >= 16)
    target_programs: int = 512  # S is chosen so that B * N * S reaches about this many programs
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.block_t, bool) or not isinstance(self.block_t, int) or not is_pow2(self.block_t) \
                or self.block_t < 16:
            raise ValueError(f"AttentionBlockSizes.block_t must be a power of two >= 16, got {self.block_t!r}")
        if not isinstance(self.target_programs, int) or self.target_programs < 1:
            raise ValueError(f"AttentionBlockSizes.target_programs must be an int >= 1, got {self.target_programs!r}")
        check_launch_sizes(self)

    def splits(self, batch: int, heads: int, length: int) -> int:
        """S: enough programs for the SMs, at most one per block of slots."""
        blocks = -(-length // self.block_t)
        return max(1, min(-(-self.target_programs // (batch * heads)), blocks))


def _rotated(ref, row, cols_K, cos_K, sin_K, half: int):
    """RoPE of the [K] vector at `row` of `ref` (fp32): x cos - x[j + K/2] sin for j < K/2,
    x cos + x[j - K/2] sin above (the model's `rope`, non-interleaved), from two loads."""
    x_K = plgpu.load(ref.at[jnp.full(cols_K.shape, row, jnp.int32), cols_K]).astype(jnp.float32)
    partner_K = jnp.where(cols_K < half, cols_K + half, cols_K - half)
    xp_K = plgpu.load(ref.at[jnp.full(cols_K.shape, row, jnp.int32), partner_K]).astype(jnp.float32)
    return x_K * cos_K + jnp.where(cols_K < half, -xp_K, xp_K) * sin_K


def _attention_kernel(layer_ref, index_ref, start_ref, qkv_ref, cos_ref, sin_ref, k_ref, v_ref, acc_ref, stats_ref,
                      k_out_ref, v_out_ref, *, batch: int, length: int, heads: int, kv_heads: int, head_dim: int,
                      splits: int, block_t: int, scale: float) -> None:
    """KV head h's G = heads / kv_heads query heads and the new key get RoPE here, rounded as the
    model rounds them; the program whose share of the slots holds `index` writes the new key and
    value to the caches (aliased: k_out is k) and takes them from registers, every program skips
    that slot in its loads (nothing reads what this launch writes). Each block of keys and values
    is loaded once and used by the G heads (an unrolled loop over them)."""
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = heads // kv_heads
    layer = jnp.max(layer_ref[...]).astype(jnp.int32)
    index = jnp.minimum(jnp.max(index_ref[...]), length - 1).astype(jnp.int32)  # where XLA's write would clamp
    start_b = jnp.max(plgpu.load(start_ref.at[jnp.full((2,), b, jnp.int32)])).astype(jnp.int32)  # a 2-lane gather
    cols_K = lax.broadcasted_iota(jnp.int32, (head_dim,), 0)
    share = -(-length // splits)
    begin = s * share
    half = head_dim // 2
    freq_K = jnp.where(cols_K < half, cols_K, cols_K - half)
    cos_K = plgpu.load(cos_ref.at[jnp.full((head_dim,), b, jnp.int32), freq_K])
    sin_K = plgpu.load(sin_ref.at[jnp.full((head_dim,), b, jnp.int32), freq_K])
    qkv_dtype, cache_dtype = qkv_ref.dtype, k_ref.dtype
    row_0 = b * (heads + 2 * kv_heads)  # row b's q heads, then its k heads, then its v heads
    qs = []
    for g in range(group):
        q_K = _rotated(qkv_ref, row_0 + h * group + g, cols_K, cos_K, sin_K, half)
        qs.append(q_K.astype(qkv_dtype).astype(cache_dtype).astype(jnp.float32))
    k_new_K = _rotated(qkv_ref, row_0 + heads + h, cols_K, cos_K, sin_K, half)
    k_new_K = k_new_K.astype(qkv_dtype).astype(cache_dtype)
    v_new_K = plgpu.load(qkv_ref.at[jnp.full((head_dim,), row_0 + heads + kv_heads + h, jnp.int32),
                                    cols_K]).astype(cache_dtype)
    owner = (index >= begin) & (index < begin + share)
    new_row = ((layer * batch + b) * length + index) * kv_heads + h

    @pl.when(owner)
    def _write():
        plgpu.store(k_out_ref.at[jnp.full((head_dim,), new_row, jnp.int32), cols_K], k_new_K)
        plgpu.store(v_out_ref.at[jnp.full((head_dim,), new_row, jnp.int32), cols_K], v_new_K)

    # The owner starts its online softmaxes from the new slot (always visible), the others from nothing.
    k_new32_K, v_new32_K = k_new_K.astype(jnp.float32), v_new_K.astype(jnp.float32)
    m0 = tuple(jnp.where(owner, jnp.sum(q_K * k_new32_K) * scale, jnp.float32(NEG)) for q_K in qs)
    l0 = tuple(jnp.where(owner, jnp.float32(1.0), jnp.float32(0.0)) for _ in qs)
    acc0 = tuple(jnp.where(owner, v_new32_K, jnp.zeros((head_dim,), jnp.float32)) for _ in qs)
    # Slots before start[b] are never visible except `index` itself, which the last block holds.
    first = jnp.maximum(begin, jnp.minimum(start_b, index))
    first = (first // block_t) * block_t
    end = jnp.minimum(begin + share, index + 1)
    trips = jnp.where(end > first, (end - first + block_t - 1) // block_t, 0).astype(jnp.int32)
    row_base = (layer * batch + b) * length  # row of slot 0 in the flattened [L*B*T*N_kv, K] cache
    step_T = lax.broadcasted_iota(jnp.int32, (block_t,), 0)

    def t_step(i, carry):
        t_T = first + i * block_t + step_T
        # The new slot is visible but comes from registers (m0, l0, acc0), not the cache.
        vis_T = (t_T >= begin) & (t_T < end) & (t_T >= start_b) & (t_T != index)
        rows_T = (row_base + jnp.minimum(t_T, length - 1)) * kv_heads + h
        k_TxK = plgpu.load(k_ref.at[rows_T[:, None], cols_K[None, :]], mask=vis_T[:, None], other=0)
        v_TxK = plgpu.load(v_ref.at[rows_T[:, None], cols_K[None, :]], mask=vis_T[:, None], other=0)
        k_TxK, v_TxK = k_TxK.astype(jnp.float32), v_TxK.astype(jnp.float32)
        out = ([], [], [])
        for q_K, m, l, acc_K in zip(qs, *carry):
            s_T = jnp.where(vis_T, jnp.sum(k_TxK * q_K[None, :], axis=1) * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s_T))
            p_T = jnp.exp(s_T - m_new)
            alpha = jnp.exp(m - m_new)
            for part, value in zip(out, (m_new, l * alpha + jnp.sum(p_T),
                                         acc_K * alpha + jnp.sum(p_T[:, None] * v_TxK, axis=0))):
                part.append(value)
        return tuple(tuple(part) for part in out)

    ms, ls, accs = lax.fori_loop(jnp.int32(0), trips, t_step, (m0, l0, acc0))
    two = lax.broadcasted_iota(jnp.int32, (2,), 0)
    for g in range(group):
        row = (b * heads + h * group + g) * splits + s
        plgpu.store(acc_ref.at[jnp.full((head_dim,), row, jnp.int32), cols_K], accs[g])
        plgpu.store(stats_ref.at[jnp.full((2,), row, jnp.int32), two], jnp.where(two == 0, ms[g], ls[g]))


def _check(q_BxNxK, k_cache, v_cache, layer, index, start_B) -> None:
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [L, B, T, N_kv, K] of one shape, got {k_cache.shape} and "
                         f"{v_cache.shape}")
    _, b, _, n_kv, k = k_cache.shape
    if q_BxNxK.ndim != 3 or q_BxNxK.shape[0] != b or q_BxNxK.shape[2] != k or q_BxNxK.shape[1] % n_kv:
        raise ValueError(f"q must be [B={b}, N, K={k}] like the cache, N a multiple of its N_kv={n_kv} KV heads, "
                         f"got {q_BxNxK.shape}")
    if not is_pow2(k):
        raise ValueError(f"the head dim K must be a power of two (a Triton block extent), got {k}")
    for name, value, shape in (("layer", layer, (1,)), ("index", index, (1,)), ("start_B", start_B, (b,))):
        if value.shape != shape or value.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 {list(shape)}, got {value.dtype}{value.shape}")


def _query_heads(heads: int | None, k_cache) -> int:
    """The query heads N of `heads=` (None: the cache's KV heads, multi-head attention)."""
    n_kv = k_cache.shape[3] if k_cache.ndim == 5 else 1
    n = n_kv if heads is None else heads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % n_kv:
        raise ValueError(f"heads (the query heads) must be a multiple of the cache's N_kv={n_kv} KV heads, "
                         f"got {heads!r}")
    return n


def _check_qkv(qkv_BxP, cos_BxH, sin_BxH, k_cache, v_cache, layer, index, start_B, heads) -> None:
    n = _query_heads(heads, k_cache)
    _check(jax.ShapeDtypeStruct((k_cache.shape[1], n, k_cache.shape[-1]), k_cache.dtype), k_cache, v_cache, layer,
           index, start_B)
    _, b, _, n_kv, k = k_cache.shape
    if qkv_BxP.shape != (b, (n + 2 * n_kv) * k):
        raise ValueError(f"qkv must be [B={b}, (N + 2 N_kv) K={(n + 2 * n_kv) * k}] (N={n} q heads, then N_kv={n_kv} "
                         f"k heads, then N_kv v heads, K={k} each), got {qkv_BxP.shape}")
    for name, table in (("cos", cos_BxH), ("sin", sin_BxH)):
        if table.shape != (b, k // 2) or table.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 [B={b}, K/2={k // 2}] (model.rope_tables), got "
                             f"{table.dtype}{table.shape}")


@functools.partial(jax.jit, static_argnames=("heads", "block_sizes", "interpret", "debug"))
def decode_attention_qkv(qkv_BxP: jax.Array, cos_BxH: jax.Array, sin_BxH: jax.Array, k_cache: jax.Array,
                         v_cache: jax.Array, layer: jax.Array, index: jax.Array, start_B: jax.Array, *,
                         heads: int | None = None, block_sizes: AttentionBlockSizes = AttentionBlockSizes(),
                         interpret: bool = False, debug: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's attention from the q/k/v projection's output in one launch: RoPE of the new
    query and key (`cos`/`sin` [B, K/2] of each row's position, `model.rope_tables`), the new key
    and value written at slot `index` of layer `layer` of the [L, B, T, N_kv, K] caches (in place:
    the caches are aliased to the outputs; an index past the end writes the last slot, as XLA's
    clamped update would), and the attention of the new query over the visible slots (module
    docstring), the new one included. `heads`: the query heads N (None: N_kv, multi-head
    attention; a multiple of N_kv: grouped-query attention, query head n reading KV head n // G).
    `qkv_BxP`: [B, (N + 2 N_kv) K], q, k, v side by side. Returns (out [B, N, K] in qkv's dtype,
    k_cache, v_cache) = `decode_attention_qkv_reference`'s up to fp32 sum order.
    Replaces RoPE, two cache writes and the casts between the projection and the attention
    (each its own XLA launch) by nothing: the attention's programs do them."""
    _check_qkv(qkv_BxP, cos_BxH, sin_BxH, k_cache, v_cache, layer, index, start_B, heads)
    n_layers, b, length, n_kv, k = k_cache.shape
    n = _query_heads(heads, k_cache)
    splits = block_sizes.splits(b, n_kv, length)
    flat = (n_layers * b * length * n_kv, k)
    kernel = functools.partial(_attention_kernel, batch=b, length=length, heads=n, kv_heads=n_kv, head_dim=k,
                               splits=splits, block_t=block_sizes.block_t, scale=1.0 / float(k) ** 0.5)
    operands = (layer, index, start_B, qkv_BxP.reshape(b * (n + 2 * n_kv), k), cos_BxH, sin_BxH,
                k_cache.reshape(flat), v_cache.reshape(flat))
    whole = [pl.BlockSpec(op.shape, lambda i, j, s, nd=op.ndim: (0,) * nd) for op in operands]
    rows = b * n * splits
    cache_spec = pl.BlockSpec(flat, lambda i, j, s: (0, 0))
    acc, stats, k_flat, v_flat = pl.pallas_call(
        kernel,
        grid=(b, n_kv, splits),
        in_specs=whole,
        out_specs=[pl.BlockSpec((rows, k), lambda i, j, s: (0, 0)), pl.BlockSpec((rows, 2), lambda i, j, s: (0, 0)),
                   cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, 2), jnp.float32),
                   jax.ShapeDtypeStruct(flat, k_cache.dtype), jax.ShapeDtypeStruct(flat, v_cache.dtype)],
        input_output_aliases={6: 2, 7: 3},
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_decode_attention_qkv",
    )(*operands)
    out = combine(acc.reshape(b, n, splits, k), stats.reshape(b, n, splits, 2))
    out = out.astype(k_cache.dtype).astype(qkv_BxP.dtype)  # as the model's path: the cache dtype, then its own
    return out, k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)


def decode_attention_qkv_reference(qkv_BxP: jax.Array, cos_BxH: jax.Array, sin_BxH: jax.Array, k_cache: jax.Array,
                                   v_cache: jax.Array, layer: jax.Array, index: jax.Array, start_B: jax.Array, *,
                                   heads: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_attention_qkv` in jnp, step by step as the model's XLA decode runs it: RoPE
    (rounded to qkv's dtype), the cache writes, `decode_attention_reference`."""
    _check_qkv(qkv_BxP, cos_BxH, sin_BxH, k_cache, v_cache, layer, index, start_B, heads)
    _, b, _, n_kv, k = k_cache.shape
    n = _query_heads(heads, k_cache)
    q, k_new, v_new = jnp.split(qkv_BxP.reshape(b, n + 2 * n_kv, k), (n, n + n_kv), axis=1)
    half = k // 2
    cos, sin = cos_BxH[:, None, :], sin_BxH[:, None, :]

    def rotate(x):
        x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    start = (layer[0], 0, index[0], 0, 0)
    k_cache = lax.dynamic_update_slice(k_cache, rotate(k_new)[None, :, None].astype(k_cache.dtype), start)
    v_cache = lax.dynamic_update_slice(v_cache, v_new[None, :, None].astype(v_cache.dtype), start)
    index = jnp.minimum(index, k_cache.shape[2] - 1)
    out = decode_attention_reference(rotate(q).astype(k_cache.dtype), k_cache, v_cache, layer, index, start_B)
    return out.astype(qkv_BxP.dtype), k_cache, v_cache


def combine(acc_BxNxSxK: jax.Array, stats_BxNxSx2: jax.Array) -> jax.Array:
    """Merge the splits' partial softmaxes: sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m)."""
    m, l = stats_BxNxSx2[..., 0], stats_BxNxSx2[..., 1]
    w = jnp.exp(m - jnp.max(m, axis=-1, keepdims=True))
    return jnp.sum(w[..., None] * acc_BxNxSxK, axis=2) / jnp.sum(w * l, axis=-1)[..., None]


def decode_attention_reference(q_BxNxK: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                               index: jax.Array, start_B: jax.Array) -> jax.Array:
    """The same in jnp (fp32 softmax over the visible slots of the layer's caches); query head n
    reads KV head n // G, G = N / N_kv."""
    _check(q_BxNxK, k_cache, v_cache, layer, index, start_B)
    k_BxTxHxK, v_BxTxHxK = k_cache[layer[0]].astype(jnp.float32), v_cache[layer[0]].astype(jnp.float32)
    b, n, k = q_BxNxK.shape
    n_kv = k_cache.shape[3]
    q_BxHxGxK = q_BxNxK.astype(jnp.float32).reshape(b, n_kv, n // n_kv, k)
    t = jnp.arange(k_cache.shape[2])
    vis_BxT = (t[None] <= index[0]) & ((t[None] >= start_B[:, None]) | (t[None] == index[0]))
    s = jnp.einsum("bhgk,bthk->bhgt", q_BxHxGxK, k_BxTxHxK,
                   precision=lax.Precision.HIGHEST) / jnp.sqrt(jnp.float32(k))
    p = jax.nn.softmax(jnp.where(vis_BxT[:, None, None], s, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgt,bthk->bhgk", p, v_BxTxHxK, precision=lax.Precision.HIGHEST)
    return out.reshape(b, n, k).astype(q_BxNxK.dtype)
