"""The decode engine: a model's forward of S new tokens per row against its KV cache.

`decode(model, tokens_BxS, cache, cache_index, start_B, config=DecodeConfig)` is what generation and
the benchmarks call. A one-token step (S = 1, the last token's logits) runs through the step
implementation that decode.kernels picks, the way the op picks its backend
(twell_jax/ops/backends.py): each is a `DecodeStep` in a registry,

    "xla"     the model's own `Transformer.decode` (the layer scan): runs anywhere, the fallback
    "pallas"  `kernel_step` below, the Pallas decode kernels: a GPU, or the Pallas interpreter
              (model.ffn_interpret)

and "auto" takes the first registered step that runs here without the interpreter, else "xla"
(`choose_step`). Prefill (S > 1) and all-logits calls run the model's own decode.

`kernel_step`, per layer: the attention norm and the q/k/v projections in one `decode_matvec`
launch; RoPE, the in-place cache writes and the attention in one launch (`decode_attention_qkv`,
over the stacked caches in place and only the visible slots; RoPE's angles made once per step);
the output projection with the residual add in its epilogue; then the FFN, the way
`decode_plan.layer_ways` names for the layer: dense plans as one launch for norm + gate/up +
activation and one for the down projection + residual; sparse plans by the sparse FFN's decode
kernels (the gate's product, the union of the rows' active neurons compacted on the device, the
up/down rows of those only: "split" in two launches, "fused" in one with the residual; "tiles":
the gate's tile lists, no compaction; "packed": the gate's lists with their hidden values, then the
down launch; "packed_down": all of it in the gate's launch, its grid barrier's counters made once a
step and handed from layer to layer), with, for a batch of several rows, a device-side switch to
the dense products when the union exceeds `ops.planner.decode_union_limit` (the decode cost model's
break-even; no host round trip). The stacked weights are read in place at the layer (no per-layer
copy); with `PreparedWeights` (`prepare_decode`, decode.transposed), q/k/v, the output projection
and the dense W_down are read from output-major copies instead. With grouped-query attention the
q/k/v product's output is [B, (N + 2 N_kv) K] and each KV head's program of the attention serves
its G query heads. The LM head: the final norm and the output head's product (the tied embedding,
or `lm_head`) in one launch. Same roundings as the XLA path up to the order of fp32 sums and the
attention's fp32 probabilities (tests/test_decode_kernels.py). docs/model.md tells how the step got
here; BENCHMARKS.md, Decode, has its measurements.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from twell_jax.config import DecodeConfig
from twell_jax.inference.decode_plan import layer_ways, union_limit
from twell_jax.model import Aux, KVCache, RMSNorm, Transformer, decode_mask, rope, rope_tables
from twell_jax.ops import backends

# Rows of a decode step up to which a sparse layer counts its rows' active neurons inside the
# compaction kernel (`compact_active_rows`: one program, so one load of [rows, H] after another);
# above it XLA reduces over the rows first. At a few rows the one launch beats the reduction and
# `compact_active` (BENCHMARKS.md, Decode); the bound keeps a 64-row step off a one-program read.
COMPACT_ROWS_IN_KERNEL = 8


class DecodeResult(NamedTuple):
    """What `decode` returns (unpacks as the model's (logits, cache, aux))."""

    logits: jax.Array  # fp32 [B, V] of the last new token, or [B, S, V] with all_logits
    cache: KVCache  # the caches with the new tokens' keys and values written
    aux: Aux  # the FFN telemetry stacked over layers [L, ...] ("l0": mean active neurons per row)


class NormScales(NamedTuple):
    """The decode kernels' norm scales, fp32 (the kernels read them so)."""

    attn_norm: jax.Array  # [L, D]
    ffn_norm: jax.Array  # [L, D]
    final_norm: jax.Array  # [D]


class PreparedWeights(NamedTuple):
    """`prepare_decode`'s copies, in the compute dtype but for the fp32 norm scales: output-major
    ([L, N, K]) copies of the weights a one-token step reads input-major, and the norm scales
    converted once (in the step each convert was an XLA launch of its own, which a decode loop
    does not hoist)."""

    w_qkv: jax.Array  # [L, D + 2 N_kv K, D]: q, k, v side by side (one weight: one launch)
    w_out: jax.Array  # [L, D, D]
    w_down: jax.Array  # [L, D, H] (the dense products'; the sparse FFN reads W_down's neuron rows)
    attn_norm: jax.Array  # [L, D] fp32
    ffn_norm: jax.Array  # [L, D] fp32
    final_norm: jax.Array  # [D] fp32


class GateTiles(NamedTuple):
    """The sparse gate's `decode_matvec(..., tile_lists=True)` outputs, by name (the kernel returns
    them as a tuple whose length depends on the options)."""

    out: jax.Array  # [M, H] the gate's product
    ids: jax.Array  # [T * bn] int32: each column tile's active neurons (the rows' union), ascending
    count: jax.Array  # [T] int32: active neurons per tile
    pairs: jax.Array  # [T] int32: (row, neuron) pairs with out > 0 per tile
    values: jax.Array | None = None  # [M, T * bn] hidden values beside the ids (tile_values=True)
    y: jax.Array | None = None  # [M, D] the down product + residual (down=W_down)
    sync: jax.Array | None = None  # the grid barrier's arrival counters, for the next layer (sync=)


class _Roles(NamedTuple):
    """`decode_matvec`'s role (its block sizes, decode_matvec.ROLES) of each product whose weight
    layout differs between the stored stacks and `PreparedWeights`."""

    layout: str  # "kn": input-major (stored); "nk": output-major (prepared)
    qkv: str
    out: str
    down: str  # the dense products' W_down
    down_switch: str  # W_down on the device switch's dense side (one launch: no split-K epilogue)


_STORED_ROLES = _Roles(layout="kn", qkv="qkv", out="out", down="down", down_switch="down")
_PREPARED_ROLES = _Roles(layout="nk", qkv="qkv_nk", out="out_nk", down="down_nk", down_switch="down_nk_switch")


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One implementation of the one-token decode step (decode.kernels names it)."""

    name: str
    # (model, config, tokens_B, cache, cache_index, start_B, prepared) -> DecodeResult
    run: Callable[..., DecodeResult]
    available: Callable[[], bool]  # whether it runs here without the Pallas interpreter
    interpretable: bool  # whether it runs in the interpreter where not available (model.ffn_interpret)
    # (model) -> its weight copies for decode.transposed, or None: the step reads the stored weights only
    prepare: Callable[[Transformer], PreparedWeights] | None = None


_REGISTRY: dict[str, DecodeStep] = {}


def register(step: DecodeStep) -> DecodeStep:
    """Add a decode step implementation (its name must be new and not "auto"); returns it."""
    if step.name == "auto" or step.name in _REGISTRY:
        raise ValueError(f"a decode step cannot be named {step.name!r} (taken, or 'auto': the choice)")
    _REGISTRY[step.name] = step
    return step


def step_names() -> tuple[str, ...]:
    """The registered decode steps in registration order: the fallback, "xla", first ("auto" tries
    them from the last back)."""
    return tuple(_REGISTRY)


def choose_step(model: Transformer, config: DecodeConfig) -> DecodeStep:
    """The step decode.kernels asks for on this device: "auto" the last registered one that runs
    here without the interpreter (the kernels on a GPU), else "xla"; a named one, or a ValueError
    where it cannot run."""
    if config.kernels == "auto":
        return next((step for step in reversed(_REGISTRY.values()) if step.available()), _REGISTRY["xla"])
    step = _REGISTRY[config.kernels]
    if not (step.available() or (step.interpretable and model.interpret)):
        raise ValueError(f"decode.kernels={config.kernels!r} needs a GPU (or model.ffn_interpret=true to run the "
                         "kernels in the Pallas interpreter); use 'auto' or 'xla' here")
    return step


def uses_kernels(model: Transformer, config: DecodeConfig) -> bool:
    """Whether a one-token step of `model` runs a kernel step (not the model's XLA decode)."""
    return choose_step(model, config).name != "xla"


def prepare_decode(model: Transformer, config: DecodeConfig) -> PreparedWeights | None:
    """The chosen step's weight copies when decode.transposed asks for them and it reads any, for
    `decode(..., prepared=)`; else None. Made once per set of weights (a Generator makes them at
    its start): the copies cost those weights' memory a second time."""
    step = choose_step(model, config)
    return step.prepare(model) if config.transposed and step.prepare is not None else None


def decode(model: Transformer, tokens_BxS: jax.Array, cache: KVCache, cache_index: jax.Array, start_B: jax.Array,
           *, config: DecodeConfig, all_logits: bool = False, prepared: PreparedWeights | None = None
           ) -> DecodeResult:
    """`Transformer.decode` (the forward of S new tokens per row written at cache slots
    [cache_index, cache_index + S), rows left-padded up to start_B), with a one-token step run by
    the implementation `choose_step` picks; `prepared`: `prepare_decode`'s copies, which that step
    reads instead of the stored stacks (other calls ignore them)."""
    model.check_decode_shapes(tokens_BxS, cache)
    if tokens_BxS.shape[1] == 1 and not all_logits:
        return choose_step(model, config).run(model, config, tokens_BxS[:, 0], cache, cache_index, start_B, prepared)
    return DecodeResult(*model.decode(tokens_BxS, cache, cache_index, start_B, all_logits=all_logits))


def _xla_step(model: Transformer, config: DecodeConfig, tokens_B: jax.Array, cache: KVCache, cache_index: jax.Array,
              start_B: jax.Array, prepared: PreparedWeights | None) -> DecodeResult:
    return DecodeResult(*model.decode(tokens_B[:, None], cache, cache_index, start_B))


def norm_scales_fp32(model: Transformer) -> NormScales:
    """The model's norm scales as the decode kernels read them (fp32)."""
    blocks = model.blocks
    return NormScales(*(norm.scale[...].astype(jnp.float32)
                        for norm in (blocks.attn_norm, blocks.ffn_norm, model.final_norm)))


def transposed_weights(model: Transformer) -> PreparedWeights:
    """`PreparedWeights` of `model`: output-major copies of q/k/v (side by side: one weight, so one
    launch without the three-part masking), the output projection and the dense W_down, in the
    compute dtype, and the fp32 norm scales."""
    dt = jnp.dtype(model.compute_dtype)
    attn = model.blocks.attn

    def t(w: nnx.Param) -> jax.Array:
        return jnp.swapaxes(w[...].astype(dt), 1, 2)

    return PreparedWeights(jnp.concatenate([t(attn.w_q), t(attn.w_k), t(attn.w_v)], axis=1), t(attn.w_out),
                           t(model.blocks.ffn.w_down), *norm_scales_fp32(model))


def kernel_step(model: Transformer, config: DecodeConfig, tokens_B: jax.Array, cache: KVCache,
                cache_index: jax.Array, start_B: jax.Array, prepared: PreparedWeights | None = None
                ) -> DecodeResult:
    """One token per row through the decode kernels (the module docstring)."""
    from twell_jax.pallas_kernels.decode_attention import decode_attention_qkv
    from twell_jax.pallas_kernels.decode_matvec import decode_matvec, gate_role, role_block_sizes
    from twell_jax.pallas_kernels.twell_decode import (DecodeBlockSizes, compact_active, compact_active_rows,
                                                       sparse_decode_down_tiles, sparse_decode_ffn,
                                                       sparse_decode_ffn_fused, sparse_decode_ffn_tiles)

    b = tokens_B.shape[0]
    dt = jnp.dtype(model.compute_dtype)
    interpret, gated, h_dim, d = model.interpret, model.gated, model.d_ff, model.d_model
    attn, ffn = model.blocks.attn, model.blocks.ffn
    n_heads, n_kv_heads, head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w_qkv = tuple(w[...].astype(dt) for w in (attn.w_q, attn.w_k, attn.w_v))  # [L, D, N(_kv)*K]: no-op casts when
    w_out = attn.w_out[...].astype(dt)  # the weights are loaded in the compute dtype (inference.load_run)
    w_gate = ffn.w_gate[...].astype(dt) if gated else None
    w_up, w_down = ffn.w_up[...].astype(dt), ffn.w_down[...].astype(dt)  # [L, H, D]
    # The layouts the products read: the stored stacks are input-major ("kn"); prepared copies
    # are output-major ("nk"). The sparse FFN always reads the stored W_down (rows per neuron).
    roles, w_qkv_mv, w_out_mv, w_down_mv = _STORED_ROLES, w_qkv, w_out, w_down
    if prepared is None and config.transposed:
        raise ValueError("decode.transposed: pass the copies of prepare_decode() to "
                         "decode(..., prepared=prepare_decode(model, config)); without them the stored weights "
                         "would run (decode.transposed=false for that)")
    if prepared is not None and not isinstance(prepared, PreparedWeights):
        raise ValueError(f"prepared must be prepare_decode()'s PreparedWeights, got {type(prepared).__name__}")
    scales = norm_scales_fp32(model) if prepared is None else prepared
    if prepared is not None:
        roles = _PREPARED_ROLES
        w_qkv_mv = prepared.w_qkv.astype(dt)  # one [L, D + 2 N_kv K, D] weight: q, k, v in one part
        w_out_mv, w_down_mv = prepared.w_out.astype(dt), prepared.w_down.astype(dt)
    n1_LxD, n2_LxD = scales.attn_norm, scales.ffn_norm
    act = model.activation
    eps, theta, scaling = model.final_norm.eps, attn.rope_theta, attn.rope_scaling  # one norm_eps for every norm

    def mv(*args: Any, role: str, **kwargs: Any) -> jax.Array:
        # Each role's blocks passed explicitly (read at trace time: a changed table retraces).
        return decode_matvec(*args, eps=eps, interpret=interpret, block_sizes=role_block_sizes(role, b),
                             **kwargs)

    def gate_tiles(x: jax.Array, w: jax.Array, li: jax.Array, **kwargs: Any) -> GateTiles:
        # The sparse gate's product with its tile lists (and, by kwargs, values and down product)
        return GateTiles(*mv(x, w, role=gate_role(b), layer=li, out_dtype=jnp.float32, tile_lists=True, **kwargs))

    embed_VxD = model.embed[...].astype(dt)
    x_BxD = jnp.take(embed_VxD, tokens_B, axis=0)
    positions_Bx1 = jnp.maximum(cache_index - start_B, 0)[:, None]
    cos_Bx1xH, sin_Bx1xH = rope_tables(positions_Bx1, head_dim, theta, scaling)  # every layer's: made once a step
    index_1 = jnp.reshape(cache_index, (1,)).astype(jnp.int32)
    start_i32 = start_B.astype(jnp.int32)

    def dense_ffn(x: jax.Array, li: jax.Array, norm: jax.Array | None, residual: jax.Array,
                  enable: jax.Array | None = None, enable_above: int = 0) -> tuple[jax.Array, jax.Array]:
        # enable (the device switch's dense side): both launches run only when sum(enable) >
        # enable_above, else neither reads a weight (nor x for the norm); its W_down in one launch
        # (no split-K epilogue launch in XLA on the steps it is disabled).
        switch = {} if enable is None else {"enable": enable, "enable_above": enable_above}
        if gated:
            h = mv(x, w_up, role="gate_up", layer=li, norm_scale=norm, gate=w_gate, activation=act, **switch)
        else:
            h = mv(x, w_up, role="gate_up", layer=li, norm_scale=norm, activation="relu", **switch)
        down_role = roles.down if enable is None else roles.down_switch
        return mv(h, w_down_mv, role=down_role, layer=li, layout=roles.layout, residual=residual, **switch), h

    def layer_step(carry: Any, layer: jax.Array, way: str, op_config: Any) -> tuple[Any, Aux]:
        x, k_all, v_all, sync = carry
        li = layer[None]
        # One launch for q, k, v: the prepared [L, D + 2 N_kv K, D] weight, or the three stored ones as
        # parts of one shape (multi-head attention only)
        if prepared is not None or (n_kv_heads == n_heads and d % role_block_sizes("qkv", b).block_n == 0):
            qkv = mv(x, w_qkv_mv, role=roles.qkv, layer=li, layout=roles.layout, norm_scale=n1_LxD)
        else:
            qkv = jnp.concatenate([mv(x, w, role=roles.qkv, layer=li, layout=roles.layout, norm_scale=n1_LxD)
                                   for w in w_qkv_mv], axis=1)
        if head_dim & (head_dim - 1) == 0:  # a power of two: RoPE, the cache writes (in place) and the
            # attention over the caches read in place, in one launch
            o, k_all, v_all = decode_attention_qkv(qkv, cos_Bx1xH[:, 0], sin_Bx1xH[:, 0], k_all, v_all, li,
                                                   index_1, start_i32, heads=n_heads, interpret=interpret)
        else:  # RoPE and the cache writes in XLA, its masked attention over the layer's cache (a copy)
            q, k, v = jnp.split(qkv.reshape(b, 1, n_heads + 2 * n_kv_heads, head_dim),
                                (n_heads, n_heads + n_kv_heads), axis=2)
            q = rope(q, theta, positions_Bx1, scaling)
            k = rope(k, theta, positions_Bx1, scaling)
            start = (layer, 0, cache_index, 0, 0)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
            o = jax.nn.dot_product_attention(
                q, jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False).astype(dt),
                jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False).astype(dt),
                mask=decode_mask(index_1, start_B, k_all.shape[2])[:, None], implementation="xla")[:, 0]
        x = mv(o.astype(dt).reshape(b, d), w_out_mv, role=roles.out, layer=li, layout=roles.layout, residual=x)
        if way == "dense":
            x, h = dense_ffn(x, li, n2_LxD, x)
            return (x, k_all, v_all, sync), {"l0": jnp.sum(h != 0, dtype=jnp.float32) / b}
        block_sizes = (op_config.decode_block_sizes if op_config is not None else None) or DecodeBlockSizes()
        limit = None
        if b > 1:  # the planner's decode cost model: the union above which dense is faster
            limit = union_limit(model, b, way, jnp.dtype(dt).itemsize)
        # The norm in XLA where two kernels read xn: one small fusion, faster than a norm prologue in
        # each (experiments/bench_decode_ffn_step.py: "tiles_xla_norm" against "tiles").
        scale = jax.lax.dynamic_index_in_dim(n2_LxD, layer, keepdims=False)
        w_first = w_gate if gated else w_up  # the product whose sign decides which neurons fire
        if way == "packed_down":  # the gate's launch makes the values and the down product (+ the
            # residual) too, its tiles' partials summed after a grid barrier (counters: sync); above
            # the limit it passes x through and the dense products run (the switch reads the counts)
            tiles = gate_tiles(x, w_first, li, norm_scale=n2_LxD, tile_values=True, up=w_up if gated else None,
                               down=w_down, down_residual=x, down_limit=limit, sync=sync)
            y = tiles.y if limit is None else dense_ffn(x, li, n2_LxD, tiles.y, tiles.count, limit)[0]
            return (y, k_all, v_all, tiles.sync), {"l0": jnp.sum(tiles.pairs).astype(jnp.float32) / b}
        if way in ("tiles", "packed"):
            # TwELL: the gate's epilogue packs each column tile's active neurons (the rows' union);
            # "packed" also their hidden values (the up product of those neurons only, the norm in
            # the gate's prologue), read by the down kernel; "tiles" the lists only, read by one
            # kernel for the up and down products. Either adds the residual.
            if way == "packed":
                tiles = gate_tiles(x, w_first, li, norm_scale=n2_LxD, tile_values=True, up=w_up if gated else None)
                y = sparse_decode_down_tiles(tiles.values, tiles.ids, tiles.count, w_down, layer=li, residual_MxD=x,
                                             limit=limit, block_sizes=block_sizes, interpret=interpret)
            else:
                xn = RMSNorm.normalize(x, scale, eps)
                tiles = gate_tiles(xn, w_first, li)
                y = sparse_decode_ffn_tiles(xn, tiles.out, tiles.ids, tiles.count, w_up if gated else None, w_down,
                                            layer=li, residual_MxD=x, limit=limit, block_sizes=block_sizes,
                                            interpret=interpret)
            if limit is not None:  # above the limit the sparse kernel passed x through: the dense products
                y = dense_ffn(x, li, n2_LxD, y, tiles.count, limit)[0]  # (the switch read from the counts in-kernel)
            return (y, k_all, v_all, sync), {"l0": jnp.sum(tiles.pairs).astype(jnp.float32) / b}
        xn = RMSNorm.normalize(x, scale, eps)
        g = mv(xn, w_first, role=gate_role(b), layer=li, out_dtype=jnp.float32)  # [B, H]
        if b <= COMPACT_ROWS_IN_KERNEL:  # the rows' union counted inside the compaction: one launch
            order, n_active, pairs = compact_active_rows(g, interpret=interpret)
        else:  # many rows: XLA's parallel reduction, then the compaction (one program reads [B, H] slowly)
            count_H = jnp.sum(g > 0, axis=0, dtype=jnp.int32)
            order, n_active = compact_active(count_H, interpret=interpret)
            pairs = jnp.sum(count_H, keepdims=True)
        capacity = -(-h_dim // block_sizes.chunk) * block_sizes.chunk
        if capacity > order.shape[0]:  # tiny d_ff: the list is shorter than one kernel chunk
            order = jnp.pad(order, (0, capacity - order.shape[0]), constant_values=h_dim - 1)
        use_dense = None if limit is None else n_active > limit
        n_sparse = n_active if use_dense is None else jnp.where(use_dense, 0, n_active)
        if way == "fused":  # the residual in the kernel's epilogue (one rounding)
            x = sparse_decode_ffn_fused(xn, g, order, n_sparse, w_up if gated else None, w_down,
                                        capacity=capacity, layer=li, residual_MxD=x, block_sizes=block_sizes,
                                        interpret=interpret)
        else:
            _, y = sparse_decode_ffn(xn, g, order, n_sparse, w_up if gated else None, w_down, capacity=capacity,
                                     layer=li, block_sizes=block_sizes, interpret=interpret)
            x = x + y
        if use_dense is not None:  # no products when sparse (n_active <= limit): x passes through
            x = dense_ffn(xn, li, None, x, n_active.astype(jnp.int32), limit)[0]
        return (x, k_all, v_all, sync), {"l0": pairs[0].astype(jnp.float32) / b}

    ways_L = layer_ways(model, config, b, dt)
    # "packed_down"'s arrival counters for its grid barriers: one per layer, zero at each step
    sync = jnp.zeros((model.n_layers,), jnp.int32) if "packed_down" in ways_L else None
    carry, auxes, first = (x_BxD, cache.k_LxBxTxNxK, cache.v_LxBxTxNxK, sync), [], 0
    while first < model.n_layers:  # one scan per run of layers with the same kind of FFN step
        end = first + 1
        while end < model.n_layers and ways_L[end] == ways_L[first]:
            end += 1
        step = functools.partial(layer_step, way=ways_L[first], op_config=model.op_configs[first])
        unroll = config.layer_unroll or end - first
        if unroll >= end - first:  # no loop: each layer's index a constant (no per-iteration copies)
            for layer in range(first, end):
                carry, aux = step(carry, jnp.int32(layer))
                auxes.append(jax.tree.map(lambda a: a[None], aux))
        else:
            carry, aux = jax.lax.scan(lambda c, layer: step(c, layer), carry,
                                      jnp.arange(first, end, dtype=jnp.int32), unroll=unroll)
            auxes.append(aux)
        first = end
    x_BxD, k_all, v_all, _ = carry
    logits_BxV = mv(x_BxD, model.head()[...].astype(dt), role="head", norm_scale=scales.final_norm,
                    out_dtype=jnp.float32)
    aux = jax.tree.map(lambda *parts: jnp.concatenate(parts), *auxes)
    return DecodeResult(logits_BxV, KVCache(k_all, v_all), aux)


# The fallback first: "auto" tries the others from the last registered back to it.
register(DecodeStep("xla", run=_xla_step, available=lambda: True, interpretable=False))
register(DecodeStep("pallas", run=kernel_step, available=lambda: backends.gpu_available(), interpretable=True,
                    prepare=transposed_weights))
