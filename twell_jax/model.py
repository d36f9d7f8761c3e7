"""Llama-style decoder LM in Flax NNX with a configurable (sparse) FFN.

Token embedding (the output head tied to it, or its own `lm_head` with model.tie_embeddings=false),
pre-norm blocks (RMSNorm -> causal multi-head or grouped-query attention with RoPE, optionally
Llama-3 scaled -> residual, RMSNorm -> FFN -> residual), final RMSNorm (docs/model.md). FFN weights use the sparse op's neuron-major [H, D]
layout for all three matrices (w_down included), so the model hands them to `twell_jax.ops`
untouched.

Mixed precision: parameters are fp32 master weights; the forward casts them to `compute_dtype`
(bf16 by default), and every matmul of the forward AND of the backward has compute-dtype operands
(the GEMMs accumulate in fp32 on the GPU). No matmul asks for an f32 output
(preferred_element_type), because its cotangent would then be f32 and the transposed backward
GEMMs f32 x f32; where f32 matters (norm statistics, RoPE angles, softmax inside attention, the
FFN gating product, the loss) the values are upcast after the GEMM. The logits come out of a bf16
GEMM and are returned in fp32 for the cross-entropy; `Transformer.decode` uses the same head.

`Transformer.__call__` returns `(logits_BxSxV, aux)`; `aux` stacks the per-layer FFN telemetry on a
leading layer axis: the op's scalars ("l1", "l0", overflow counters) as [L], and, when
`track_neurons=True`, "neuron_active_count" [L, H] (tokens on which each neuron fired) and
"position_active" [L, S] (mean active neurons per token position over the batch) and the sparse
backward's expected dense tails [L] ("token_tail_share", "hot_neuron_share", "hot_entry_share":
`ops.backward_tail_shares`), all taken from the op's own counts (`SparseFFNConfig.neuron_counts`),
so tracking costs no extra GEMM.

`Transformer.decode` runs S new tokens per row against a preallocated `KVCache` (prefill and
decode steps of generation), with per-row RoPE positions and masks, in XLA. Generation calls it
through `twell_jax.inference.decode_engine`, which runs one-token steps through the Pallas decode
kernels where they can run; this module imports no kernel.

The blocks are one `Block` whose parameters are stacked over layers ([L, ...]), initialised by one
vmapped program and run by `lax.scan` (forward, backward and decode), so compile time does not grow
with depth; layers with different sparse-op plans share scan bodies by plan (docs/model.md).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from twell_jax import ops
from twell_jax.config import ATTENTION_IMPLS, REMAT_POLICIES, ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

Aux = dict[str, jax.Array]

def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _powers_of_two_to(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n: the row lengths `Transformer.op_configs_for` keeps configs for."""
    return [1 << i for i in range((n - 1).bit_length())] + [n]


def build_op_config(cfg: ModelConfig, layer: int = 0, seq_len: int | None = None) -> ops.SparseFFNConfig | None:
    """Layer `layer`'s op config: `cfg.ffn_op_config` plus that layer's `ffn_expected_active` and
    `ffn_expected_tails` hints (unless ffn_op_config sets them for all layers), or None for the op
    defaults. `seq_len`: a forward over rows of that many tokens, whose activity hint is, where the
    config has `ffn_active_by_position`, the layer's mean over positions [0, seq_len)."""
    fields = dict(cfg.ffn_op_config)
    if "expected_active_per_token" not in fields:
        if cfg.ffn_active_by_position and seq_len is not None:
            fields["expected_active_per_token"] = ops.planner.active_for_length(
                cfg.ffn_active_by_position[layer], seq_len, cfg.max_seq_len)
        elif cfg.ffn_expected_active:
            fields["expected_active_per_token"] = float(cfg.ffn_expected_active[layer])
    if cfg.ffn_expected_tails and not any(name in fields for name in ops.TAIL_HINT_FIELDS):
        fields.update(zip(ops.TAIL_HINT_FIELDS, (float(v) for v in cfg.ffn_expected_tails[layer])))
    return ops.SparseFFNConfig(**fields) if fields else None


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in fp32 and returned in the input dtype."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        return self.normalize(x_BxSxD, self.scale[...], self.eps)

    @staticmethod
    def normalize(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
        """The norm of `x` over its last axis with `scale` (the module's formula, for a scale
        taken from a stack)."""
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
        return (x32 * inv_rms * scale).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """RoPE's angular frequencies [K/2] fp32, theta^(-2i/K) for pair i, with Llama 3.1's scaling
    when `scaling` is given (model.rope_scaling): a pair whose wavelength 2 pi / f is longer than
    original / low_freq_factor turns `factor` times slower, one shorter than original /
    high_freq_factor keeps its frequency, and in between the frequency is a blend of the two,
    f * ((1 - w) / factor + w) with the weight w = (original / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor), which is 0 and 1 at the band's two ends (so clipping w to
    [0, 1] gives the three cases in one formula)."""
    half = head_dim // 2
    inv_freq_K2 = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    if scaling is None:
        return inv_freq_K2
    wavelength_K2 = 2 * jnp.pi / inv_freq_K2
    weight_K2 = (scaling.original_max_position_embeddings / wavelength_K2 - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    weight_K2 = jnp.clip(weight_K2, 0.0, 1.0)
    return (1.0 - weight_K2) * inv_freq_K2 / scaling.factor + weight_K2 * inv_freq_K2


def rope_tables(positions_BxS: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, S, K/2] fp32 of RoPE's angles at `positions_BxS` (`rope`; the decode step
    makes them once for every layer's attention kernel); `scaling`: `rope_frequencies`'."""
    angle_BxSxK2 = positions_BxS.astype(jnp.float32)[..., None] * rope_frequencies(head_dim, theta, scaling)
    return jnp.cos(angle_BxSxK2), jnp.sin(angle_BxSxK2)


def rope(x_BxSxNxK: jax.Array, theta: float, positions_BxS: jax.Array | None = None,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding, non-interleaved: rotates the pairs (x[i], x[i + K/2]).

    Token s of row b sits at position `positions_BxS[b, s]` (default: s, the same for every row);
    `scaling`: the frequencies' Llama-3 scaling (`rope_frequencies`)."""
    seq_len, head_dim = x_BxSxNxK.shape[1], x_BxSxNxK.shape[-1]
    half = head_dim // 2
    if positions_BxS is None:
        positions_BxS = jnp.arange(seq_len)[None, :]
    cos, sin = (t[:, :, None, :] for t in rope_tables(positions_BxS, head_dim, theta, scaling))
    x32 = x_BxSxNxK.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BxSxNxK.dtype)


def _device_facts() -> tuple[str, str, tuple[int, int] | None]:
    """(platform, device kind, CUDA compute capability or None) of the default device."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    try:
        major_minor = tuple(int(v) for v in str(capability).split(".")[:2]) if capability else None
    except ValueError:
        major_minor = None
    return device.platform, str(getattr(device, "device_kind", "")), major_minor


def cudnn_attention_refusal(*, platform: str, device_kind: str, capability: tuple[int, int] | None,
                            dtype: Any, head_dim: int, seq_len: int) -> str | None:
    """Why cuDNN flash attention cannot run this causal self-attention, or None when it can.

    The rules of JAX's own check (jax/_src/cudnn/fused_attention_stablehlo.py, check_layout and
    check_is_flash_attention): NVIDIA GPU, fp16/bf16 inputs, head dim a multiple of 8 and <= 128
    (<= 256 from Hopper, compute capability 9.0, on); plus an even sequence length: JAX refuses
    odd lengths in training with a bias, and cuDNN refused 2047 without one on an H100 (JAX 0.11.2)
    while 2048 ran."""
    if platform != "gpu" or "nvidia" not in device_kind.lower():
        return f"the device is {platform} ({device_kind or 'unknown kind'}), not an NVIDIA GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention takes bfloat16/float16, the compute dtype is {jnp.dtype(dtype).name}"
    max_head = 256 if capability is not None and capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > max_head:
        return f"head dim {head_dim} must be a multiple of 8 and <= {max_head} on this GPU"
    if seq_len % 2:
        return f"sequence length {seq_len} is odd (cuDNN refused 2047 and ran 2048)"
    return None


_probe_results: dict[tuple[int, int, str], str | None] = {}
_warned: set[tuple[Any, ...]] = set()


def _probe_cudnn(seq_len: int, head_dim: int, dtype: Any) -> str | None:
    """Compile cuDNN attention forward + backward at this (seq, head dim, dtype) once per process:
    None when it compiles, else the error text (the rules above cannot know every cuDNN limit)."""
    key = (seq_len, head_dim, jnp.dtype(dtype).name)
    if key not in _probe_results:
        def loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return jnp.sum(out.astype(jnp.float32))

        spec = jax.ShapeDtypeStruct((1, seq_len, 1, head_dim), jnp.dtype(dtype))
        try:
            jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
            _probe_results[key] = None
        except Exception as err:  # noqa: BLE001 (any refusal means: do not use cuDNN here)
            _probe_results[key] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return _probe_results[key]


def choose_attention(requested: str, *, dtype: Any, head_dim: int, seq_len: int,
                     device: tuple[str, str, tuple[int, int] | None] | None = None,
                     probe: Callable[[int, int, Any], str | None] = _probe_cudnn) -> str:
    """The `jax.nn.dot_product_attention` implementation for model.attention_impl=`requested`.

    "xla" -> "xla". "cudnn" -> "cudnn", or a ValueError naming the shape when cuDNN cannot take it.
    "auto" -> "cudnn" on an NVIDIA GPU when it can take the shape; on a GPU when it cannot, "xla"
    with ONE logged warning naming the shape and the reason (XLA attention is several times slower there);
    elsewhere "xla" silently. `device` = (platform, device kind, compute capability), default the
    default device; `probe(seq_len, head_dim, dtype)` compiles cuDNN once to catch its own refusals.
    """
    if requested not in ATTENTION_IMPLS:  # first: a bad value is reported before any device probing
        raise ValueError(f"model.attention_impl must be one of {ATTENTION_IMPLS}, got {requested!r}")
    if requested == "xla":
        return "xla"
    platform, kind, capability = _device_facts() if device is None else device
    shape = f"[batch, seq {seq_len}, heads, head dim {head_dim}] {jnp.dtype(dtype).name}"
    reason = cudnn_attention_refusal(platform=platform, device_kind=kind, capability=capability,
                                     dtype=dtype, head_dim=head_dim, seq_len=seq_len)
    if reason is None:
        reason = probe(seq_len, head_dim, dtype)
    if reason is None:
        return "cudnn"
    if requested == "cudnn":
        raise ValueError(f"model.attention_impl='cudnn' cannot run attention of shape {shape}: {reason}. "
                         "Use attention_impl='auto' (falls back to XLA) or 'xla'.")
    if platform == "gpu" and (shape, reason) not in _warned:
        _warned.add((shape, reason))
        logger.warning("attention_impl='auto': cuDNN flash attention cannot run attention of shape %s (%s); "
                       "falling back to XLA attention, which is several times slower", shape, reason)
    return "xla"


class Attention(nnx.Module):
    """Causal self-attention through `jax.nn.dot_product_attention`, with the implementation picked
    per shape at trace time by `choose_attention`: multi-head, or grouped-query with
    model.n_kv_heads < n_heads (keys and values of G = n_heads / n_kv_heads consecutive query heads
    shared, as Hugging Face's Llama groups them; `dot_product_attention` takes K/V of fewer heads
    as they are, no repeat)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, std = cfg.d_model, cfg.init_std
        # Head-major projections (x @ w): w_q [D, N*K], w_k and w_v [D, N_kv*K]; w_out is [N*K, D].
        self.w_q = _normal(rngs, (d, d), std)
        self.w_k = _normal(rngs, (d, cfg.kv_dim), std)
        self.w_v = _normal(rngs, (d, cfg.kv_dim), std)
        self.w_out = _normal(rngs, (d, d), std)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling_params
        self.attention_impl = cfg.attention_impl

    def _qkv(self, x_BxSxD: jax.Array,
             positions_BxS: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q [B, S, N, K], k, v [B, S, N_kv, K]) in the input dtype; q and k rotated at
        `positions_BxS` (default: 0..S-1 in every row)."""
        b, s, _ = x_BxSxD.shape
        dt = x_BxSxD.dtype

        def project(w: nnx.Param, heads: int) -> jax.Array:
            return (x_BxSxD @ w[...].astype(dt)).reshape(b, s, heads, self.head_dim)

        def rotate(x: jax.Array) -> jax.Array:
            return rope(x, self.rope_theta, positions_BxS, self.rope_scaling)

        return (rotate(project(self.w_q, self.n_heads)), rotate(project(self.w_k, self.n_kv_heads)),
                project(self.w_v, self.n_kv_heads))

    def __call__(self, x_BxSxD: jax.Array) -> jax.Array:
        b, s, _ = x_BxSxD.shape
        dt = x_BxSxD.dtype
        q_BxSxNxK, k_BxSxNxK, v_BxSxNxK = self._qkv(x_BxSxD)
        implementation = choose_attention(self.attention_impl, dtype=dt, head_dim=self.head_dim, seq_len=s)
        out_BxSxNxK = jax.nn.dot_product_attention(
            q_BxSxNxK, k_BxSxNxK, v_BxSxNxK, is_causal=True, implementation=implementation)
        return out_BxSxNxK.reshape(b, s, -1) @ self.w_out[...].astype(dt)

    def decode(self, x_BxSxD: jax.Array, positions_BxS: jax.Array, k_LxBxTxNxK: jax.Array,
               v_LxBxTxNxK: jax.Array, layer: int, cache_index: jax.Array,
               visible_BxSxT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """KV-cached attention: the S new tokens' keys/values are written at slots
        [cache_index, cache_index + S) of this `layer`'s part of the [L, B, T, N_kv, K] caches, then each
        query attends to the slots `visible_BxSxT` allows. Same projections and RoPE as `__call__`, at
        the given positions. Returns (output [B, S, D], updated k caches, updated v caches).

        Only the new slots are written, in place in the all-layer arrays (taking the layer's
        [B, T, N, K] out and setting it back would move the whole cache twice per step)."""
        b, s, _ = x_BxSxD.shape
        dt = x_BxSxD.dtype
        q_BxSxNxK, k_BxSxNxK, v_BxSxNxK = self._qkv(x_BxSxD, positions_BxS)
        start = (layer, 0, cache_index, 0, 0)
        k_LxBxTxNxK = jax.lax.dynamic_update_slice(k_LxBxTxNxK, k_BxSxNxK[None].astype(k_LxBxTxNxK.dtype), start)
        v_LxBxTxNxK = jax.lax.dynamic_update_slice(v_LxBxTxNxK, v_BxSxNxK[None].astype(v_LxBxTxNxK.dtype), start)
        # XLA attention: an explicit mask over the cache (cuDNN's fused kernels want causal-only).
        out_BxSxNxK = jax.nn.dot_product_attention(
            q_BxSxNxK, k_LxBxTxNxK[layer].astype(dt), v_LxBxTxNxK[layer].astype(dt), mask=visible_BxSxT[:, None],
            implementation="xla")
        return out_BxSxNxK.reshape(b, s, -1) @ self.w_out[...].astype(dt), k_LxBxTxNxK, v_LxBxTxNxK


class FeedForward(nnx.Module):
    """The FFN chosen by `cfg.ffn_kind` (config.FFN_KIND_TABLE); weights neuron-major [H, D].

    - "swiglu": silu(x Wg^T) * (x Wu^T) @ Wd, the dense formula in XLA (activations are never
      exactly zero, so it never enters the op: `FFNKind.through_op` is false).
    - "relu_gated": relu(x Wg^T) * (x Wu^T) @ Wd through the op's "dense" backend.
    - "twell": same math through the op with `cfg.ffn_backend` (the sparse model).
    - "relu": relu(x Wu^T) @ Wd through the op's non-gated `ffn`.

    The op config is an argument of the call, not an attribute: the blocks are one stacked module
    whose layers may run different plans (`Transformer`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d, std = cfg.d_ff, cfg.d_model, cfg.init_std
        self.kind = cfg.ffn_kind
        kind = cfg.kind
        self.gated, self.through_op, self.activation = kind.gated, kind.through_op, kind.activation
        if kind.gated:
            self.w_gate = _normal(rngs, (h, d), std)
        self.w_up = _normal(rngs, (h, d), std)
        self.w_down = _normal(rngs, (h, d), std)
        self.backend = kind.backend(cfg.ffn_backend)
        self.interpret = cfg.ffn_interpret

    def __call__(self, x_BxSxD: jax.Array, op_config: ops.SparseFFNConfig | None,
                 neuron_counts: bool = False) -> tuple[jax.Array, Aux]:
        """(y, aux); with neuron_counts the op adds "neuron_active_count" [H] and
        "token_active_count" [B, S] to aux (relu kinds only)."""
        dt = x_BxSxD.dtype
        w_up, w_down = self.w_up[...].astype(dt), self.w_down[...].astype(dt)
        if not self.through_op:
            weights = (self.w_gate[...].astype(dt), w_up, w_down) if self.gated else (w_up, w_down)
            return ops.dense_ffn(self.gated, x_BxSxD, weights, activation=self.activation)
        config = op_config
        if neuron_counts:
            config = dataclasses.replace(config or ops.SparseFFNConfig(), neuron_counts=True)
        if not self.gated:
            return ops.ffn(x_BxSxD, w_up, w_down, backend=self.backend, config=config,
                           interpret=self.interpret)
        return ops.gated_ffn(x_BxSxD, self.w_gate[...].astype(dt), w_up, w_down,
                             backend=self.backend, config=config, interpret=self.interpret)


# What the backward keeps of a layer (besides its inputs) where it recomputes the rest: the GEMM
# outputs without batch dimensions and the sparse op's own residuals (ops.RESIDUAL_NAME, so that its
# custom_vjp forward is not run twice).
SAVE_DOTS_AND_OP_RESIDUALS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(ops.RESIDUAL_NAME))


def _apply_norm(norm: RMSNorm, x: jax.Array) -> jax.Array:
    return norm(x)


class Block(nnx.Module):
    """Pre-norm transformer block (one layer; `Transformer` holds them stacked over layers)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg, rngs)
        self.track_neurons = cfg.is_relu_family
        self.remat_ffn = cfg.remat == "ffn"

    def __call__(self, x_BxSxD: jax.Array, track_neurons: bool,
                 op_config: ops.SparseFFNConfig | None = None) -> tuple[jax.Array, Aux]:
        # The norm is recomputed from its bf16 input in the backward: the layer scan would otherwise
        # keep its f32 intermediates (three [B, S, D] f32 tensors) for every layer.
        x_BxSxD = x_BxSxD + self.attn(nnx.remat(_apply_norm)(self.attn_norm, x_BxSxD))
        counts = track_neurons and self.track_neurons

        def ffn_sublayer(norm: RMSNorm, ffn: FeedForward, x: jax.Array) -> tuple[jax.Array, Aux]:
            return ffn(norm(x), op_config, neuron_counts=counts)

        # remat "ffn": the whole sub-block recomputed. Otherwise its GEMM outputs and the sparse
        # op's residuals are kept and the elementwise work (the norm, the f32 gating product of
        # the dense formula) recomputed: what XLA's fusion did by itself when the layers were
        # unrolled, but a scan materialises every saved value of every layer (docs/model.md, "What
        # the backward keeps").
        ffn_sublayer = nnx.remat(ffn_sublayer, policy=None if self.remat_ffn else SAVE_DOTS_AND_OP_RESIDUALS)
        y_BxSxD, aux = ffn_sublayer(self.ffn_norm, self.ffn, x_BxSxD)
        aux = dict(aux)
        if counts:
            # Telemetry only (no gradient), from the op's own counts of the pattern it computed.
            aux.update(ops.backward_tail_shares(aux["token_active_count"], aux["neuron_active_count"],
                                                op_config))
            aux["position_active"] = jnp.mean(aux.pop("token_active_count").astype(jnp.float32), axis=0)
        return x_BxSxD + y_BxSxD, aux

    def decode(self, x_BxSxD: jax.Array, positions_BxS: jax.Array, k_LxBxTxNxK: jax.Array,
               v_LxBxTxNxK: jax.Array, layer: jax.Array, cache_index: jax.Array,
               visible_BxSxT: jax.Array, op_config: ops.SparseFFNConfig | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, Aux]:
        """The block (number `layer`, traced) with KV-cached attention (`Attention.decode`) and the
        same FFN call."""
        attn_BxSxD, k_LxBxTxNxK, v_LxBxTxNxK = self.attn.decode(
            self.attn_norm(x_BxSxD), positions_BxS, k_LxBxTxNxK, v_LxBxTxNxK, layer, cache_index, visible_BxSxT)
        x_BxSxD = x_BxSxD + attn_BxSxD
        y_BxSxD, aux = self.ffn(self.ffn_norm(x_BxSxD), op_config)
        return x_BxSxD + y_BxSxD, k_LxBxTxNxK, v_LxBxTxNxK, aux


class KVCache(NamedTuple):
    """Preallocated attention caches of every layer, [L, B, T, N_kv, K] (the KV heads only, fewer
    than the query heads with grouped-query attention); a pytree. Slot t of row b holds the key/value
    of the token written there (`Transformer.decode`); which slots are real is the caller's mask."""

    k_LxBxTxNxK: jax.Array
    v_LxBxTxNxK: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype: str | jnp.dtype | None = None) -> KVCache:
    """Zeroed caches of `length` slots for `batch` rows, in `dtype` (default: the compute dtype)."""
    if batch < 1 or not 1 <= length <= cfg.max_seq_len:
        raise ValueError(f"cache needs batch >= 1 and 1 <= length <= model.max_seq_len={cfg.max_seq_len}, "
                         f"got batch={batch}, length={length}")
    shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def decode_mask(slot_S: jax.Array, start_B: jax.Array, length: int) -> jax.Array:
    """[B, S, T] which cache slots the queries written at `slot_S` see: causal over the slots, and
    no padding slot (before start_B[b]) as a key; a padding query sees itself only, so that its
    softmax is never empty (its output is never used). `decode_attention_qkv` applies the same rule."""
    slot_T = jnp.arange(length)
    return (slot_T[None, None, :] <= slot_S[None, :, None]) & (
        (slot_T[None, None, :] >= start_B[:, None, None]) | (slot_T[None, None, :] == slot_S[None, :, None]))


def _logits(x_BxSxD: jax.Array, head_VxD: jax.Array) -> jax.Array:
    """The output head (the tied embedding, or `lm_head`, both [V, D]): a compute-dtype GEMM (bf16
    operands forward and backward, no f32 output), upcast to fp32 for the loss and for sampling.
    Forward and decode share it, so decoded logits are rounded as the forward's are."""
    return jnp.einsum("bsd,vd->bsv", x_BxSxD, head_VxD).astype(jnp.float32)


def _stacked_blocks(cfg: ModelConfig, key: jax.Array) -> Block:
    """One `Block` module whose every parameter has a leading layer axis [L, ...]: the per-layer
    initialisation is one vmapped program (its compile time does not grow with depth), each layer
    from its own key."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(params=0))))

    def one_layer(layer_key: jax.Array) -> nnx.State:
        return nnx.split(Block(cfg, nnx.Rngs(params=layer_key)))[1]

    return nnx.merge(graphdef, jax.vmap(one_layer)(jax.random.split(key, cfg.n_layers)))


_REMAT_BODY = {"full": jax.checkpoint_policies.nothing_saveable, "dots": SAVE_DOTS_AND_OP_RESIDUALS}


class Transformer(nnx.Module):
    """Decoder-only LM. `__call__(tokens_BxS) -> (logits_BxSxV fp32, aux stacked over layers)`.

    The blocks are ONE `Block` module whose parameters are stacked over layers ([L, ...]), run by
    `lax.scan`, so every program (init, train step, eval, prefill, decode) compiles in time about
    flat in depth. Each layer has its own op config (`build_op_config`: the per-layer hints of
    "auto"); layers whose configs compile the same program (`ops.plan_key`) share a scan body,
    arranged by `model.layer_scan` ("groups" or "switch", `_run_layers`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        # Plain static attributes (not the config object, whose dict field is unhashable).
        self.max_seq_len, self.compute_dtype, self.remat = cfg.max_seq_len, cfg.compute_dtype, cfg.remat
        self.n_layers, self.layer_scan, self.layer_unroll = cfg.n_layers, cfg.layer_scan, cfg.layers_per_iteration
        self.gated, self.backend, self.interpret = cfg.kind.gated, cfg.kind.backend(cfg.ffn_backend), cfg.ffn_interpret
        self.through_op, self.activation = cfg.kind.through_op, cfg.kind.activation
        self.d_model, self.d_ff = cfg.d_model, cfg.d_ff
        self.op_configs = tuple(build_op_config(cfg, layer) for layer in range(cfg.n_layers))
        # Rows of S tokens: each layer's config with its hint for that length (`op_configs_for`),
        # where the config has a profile by position; else `op_configs` for every length.
        self.configs_by_length = () if not cfg.ffn_active_by_position else tuple(
            (s, tuple(build_op_config(cfg, layer, s) for layer in range(cfg.n_layers)))
            for s in _powers_of_two_to(cfg.max_seq_len))
        self.tie_embeddings = cfg.tie_embeddings
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std)
        self.blocks = _stacked_blocks(cfg, rngs.params())
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:  # drawn last: a tied model's initialisation is what it always was
            self.lm_head = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std)

    def head(self) -> nnx.Param:
        """The output head's [V, D] weight: the embedding when tied, else `lm_head`."""
        return self.embed if self.tie_embeddings else self.lm_head

    def layer(self, index: int) -> Block:
        """Layer `index` as a `Block` of its own (its parameter slices; for benchmarks and tests)."""
        if not 0 <= index < self.n_layers:
            raise ValueError(f"layer must be in [0, {self.n_layers}), got {index}")
        graphdef, state = nnx.split(self.blocks)
        return nnx.merge(graphdef, jax.tree.map(lambda v: v[index], state))

    def op_configs_for(self, seq_len: int | None) -> tuple[ops.SparseFFNConfig | None, ...]:
        """Each layer's op config for a forward over rows of `seq_len` tokens (None: a length not
        known, or decode steps): with a profile by position, the hints of the longest kept length
        (a power of two, or max_seq_len) not above the rows' (shorter rows are denser: the hint
        errs on the dense side, by at most a factor 2 in length)."""
        if seq_len is None or not self.configs_by_length:
            return self.op_configs
        return [configs for length, configs in self.configs_by_length if length <= max(seq_len, 1)][-1]

    def layer_groups(self, n_tokens: int, dtype: Any, seq_len: int | None = None) -> list[tuple[int, int, int]]:
        """[(first layer, end layer, plan index)] of the maximal runs of consecutive layers whose
        op configs (`op_configs_for(seq_len)`) compile the same program for a call of `n_tokens`
        tokens in `dtype`; the plan index numbers the distinct plans in order of first appearance.
        The representative config of a plan is that of the first layer of its first run."""
        if not self.through_op:  # the dense formula, no sparse op: one plan
            return [(0, self.n_layers, 0)]
        shape = (n_tokens, self.d_model, self.d_ff, jnp.dtype(dtype).itemsize)
        keys = [ops.plan_key(self.gated, self.backend, config, shape, self.interpret)
                for config in self.op_configs_for(seq_len)]
        index: dict[Any, int] = {}
        groups: list[tuple[int, int, int]] = []
        for layer, key in enumerate(keys):
            plan = index.setdefault(key, len(index))
            if groups and groups[-1][2] == plan:
                groups[-1] = (groups[-1][0], layer + 1, plan)
            else:
                groups.append((layer, layer + 1, plan))
        return groups

    def _run_layers(self, carry: Any, step: Callable[..., tuple[Any, Aux]], n_tokens: int, dtype: Any, *,
                    slice_params: bool, remat: str = "none", seq_len: int | None = None) -> tuple[Any, Aux]:
        """Run `step(block, carry, layer, op_config) -> (carry, aux)` over the layers by lax.scan;
        returns (carry, aux stacked over layers [L, ...]).

        model.layer_scan="groups": one scan per run of layers with the same plan (one scan when
        all agree). "switch": one scan over all layers, a lax.switch over the distinct plans inside
        (no switch with one plan). `slice_params=True` hands each scan its layers' parameters as the
        scanned input (a slice per run: the gradient flows to the stack); False reads layer l's
        parameters from the whole stack by index inside the body (no copy; for decoding, where no
        gradient is taken). `remat` ("full" | "dots") checkpoints the body."""
        graphdef, state = nnx.split(self.blocks)
        if slice_params:
            # The weight matrices cast to the compute dtype once, outside the loop (norm scales stay
            # f32): a scan reads its layer's slice of each stacked input as a copy, half the bytes
            # so. (Decoding reads its weights in place by index, already in the compute dtype when
            # inference.load_run loaded them.)
            state = jax.tree.map(lambda v: v.astype(dtype) if v.ndim >= 3 else v, state)
        groups = self.layer_groups(n_tokens, dtype, seq_len)
        first_of_plan: dict[int, int] = {}
        for first, _, plan in groups:
            first_of_plan.setdefault(plan, first)
        layer_configs = self.op_configs_for(seq_len)
        configs = [layer_configs[first_of_plan[plan]] for plan in range(len(first_of_plan))]

        def run_plan(plan: int, layer_state: Any, carry: Any, layer: jax.Array) -> tuple[Any, Aux]:
            return step(nnx.merge(graphdef, layer_state), carry, layer, configs[plan])

        def layer_state_of(xs_state: Any, layer: jax.Array) -> Any:
            if slice_params:
                return xs_state
            return jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, layer, keepdims=False), state)

        def scan(body: Callable[..., Any], carry: Any, first: int, end: int, plans: jax.Array | None) -> Any:
            if remat in _REMAT_BODY:
                body = jax.checkpoint(body, policy=_REMAT_BODY[remat])
            layers = jnp.arange(first, end, dtype=jnp.int32)
            xs_state = jax.tree.map(lambda v: v[first:end], state) if slice_params else None
            unroll = end - first if self.layer_unroll == 0 else min(self.layer_unroll, end - first)
            return jax.lax.scan(lambda c, xs: body(c, *xs), carry, (xs_state, layers, plans), unroll=unroll)

        if self.layer_scan == "switch" and len(configs) > 1:
            plans_L = jnp.asarray([plan for first, end, plan in groups for _ in range(first, end)], jnp.int32)
            shapes = [jax.eval_shape(functools.partial(run_plan, plan), jax.tree.map(lambda v: v[0], state),
                                     carry, jnp.int32(0)) for plan in range(len(configs))]
            out_types = jax.tree.map(lambda *leaves: jnp.result_type(*[leaf.dtype for leaf in leaves]), *shapes)

            def branch(plan: int, layer_state: Any, carry: Any, layer: jax.Array) -> tuple[Any, Aux]:
                out = run_plan(plan, layer_state, carry, layer)
                return jax.tree.map(lambda value, dtype: value.astype(dtype), out, out_types)

            def switch_body(carry: Any, xs_state: Any, layer: jax.Array, plan: jax.Array) -> tuple[Any, Aux]:
                branches = [functools.partial(branch, p) for p in range(len(configs))]
                return jax.lax.switch(plan, branches, layer_state_of(xs_state, layer), carry, layer)

            return scan(switch_body, carry, 0, self.n_layers, plans_L)
        auxes = []
        for first, end, plan in groups:
            def group_body(carry: Any, xs_state: Any, layer: jax.Array, _: Any, plan: int = plan) -> tuple[Any, Aux]:
                return run_plan(plan, layer_state_of(xs_state, layer), carry, layer)

            carry, aux = scan(group_body, carry, first, end, None)
            auxes.append(aux)
        if len(auxes) == 1:
            return carry, auxes[0]
        return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts), *auxes)

    def __call__(self, tokens_BxS: jax.Array, *, track_neurons: bool = False) -> tuple[jax.Array, Aux]:
        hidden_BxSxD, aux = self.hidden_states(tokens_BxS, track_neurons=track_neurons)
        return self.logits(hidden_BxSxD), aux

    def logits(self, hidden_BxSxD: jax.Array) -> jax.Array:
        """fp32 logits [B, S, V] of final-normed hidden states (`hidden_states`, or some positions
        of them: a scorer needs the head only where it reads a prediction)."""
        return _logits(hidden_BxSxD, self.head()[...].astype(hidden_BxSxD.dtype))

    def hidden_states(self, tokens_BxS: jax.Array, *, track_neurons: bool = False) -> tuple[jax.Array, Aux]:
        """The decoder body without the LM head: (final-normed hidden states [B, S, D] in the
        compute dtype, aux stacked over layers)."""
        if tokens_BxS.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tokens_BxS.shape}")
        if tokens_BxS.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length {tokens_BxS.shape[1]} exceeds model.max_seq_len={self.max_seq_len}")
        dt = _dtype(self.compute_dtype)
        # Gather the rows from the fp32 table, then cast: the embedding gradient (a scatter-add over
        # tokens) then accumulates in fp32 rather than in the compute dtype.
        x_BxSxD = jnp.take(self.embed[...], tokens_BxS, axis=0).astype(dt)

        def step(block: Block, x: jax.Array, layer: jax.Array, op_config: Any) -> tuple[jax.Array, Aux]:
            return block(x, track_neurons, op_config)

        x_BxSxD, aux = self._run_layers(x_BxSxD, step, tokens_BxS.size, dt, slice_params=True, remat=self.remat,
                                        seq_len=tokens_BxS.shape[1])
        return self.final_norm(x_BxSxD), aux

    def check_decode_shapes(self, tokens_BxS: jax.Array, cache: KVCache) -> None:
        """A ValueError unless `tokens_BxS` is [B, S] for a cache of B rows and at least S slots."""
        length, rows = cache.k_LxBxTxNxK.shape[2], cache.k_LxBxTxNxK.shape[1]
        if tokens_BxS.ndim != 2 or tokens_BxS.shape[1] > length or tokens_BxS.shape[0] != rows:
            raise ValueError(f"tokens must be [batch, S] with S <= the cache length {length} and batch = the "
                             f"cache's {rows} rows, got shape {tokens_BxS.shape}")

    def decode(self, tokens_BxS: jax.Array, cache: KVCache, cache_index: jax.Array, start_B: jax.Array,
               *, all_logits: bool = False) -> tuple[jax.Array, KVCache, Aux]:
        """Forward of S new tokens per row written at cache slots [cache_index, cache_index + S).

        Row b's real tokens start at slot `start_B[b]` (left padding: earlier slots are never
        attended to) and sit at RoPE position slot - start_B[b], so a left-padded row computes
        exactly what it would alone. Returns (fp32 logits [B, S, V] if `all_logits` else those of
        the last new token [B, V], the updated cache, aux stacked over layers). The caller keeps
        cache_index + S <= T (a traced index cannot be checked here; the cache write would clamp).
        The generic XLA path (the layer scan); `inference.decode_engine.decode` runs one-token steps
        through the decode kernels where they can run."""
        self.check_decode_shapes(tokens_BxS, cache)
        s = tokens_BxS.shape[1]
        length = cache.k_LxBxTxNxK.shape[2]
        dt = _dtype(self.compute_dtype)
        embed_VxD = self.embed[...].astype(dt)
        x_BxSxD = jnp.take(embed_VxD, tokens_BxS, axis=0)
        slot_S = cache_index + jnp.arange(s)
        positions_BxS = jnp.maximum(slot_S[None, :] - start_B[:, None], 0)
        visible_BxSxT = decode_mask(slot_S, start_B, length)

        def step(block: Block, carry: Any, layer: jax.Array, op_config: Any) -> tuple[Any, Aux]:
            x, k_all, v_all = carry
            x, k_all, v_all, aux = block.decode(x, positions_BxS, k_all, v_all, layer, cache_index,
                                                visible_BxSxT, op_config)
            return (x, k_all, v_all), aux

        # A prefill of S > 1 tokens plans as rows of S tokens (exact for a prompt from slot 0, the
        # denser side for a chunk further on); one-token steps keep the whole-length hints.
        (x_BxSxD, k_all, v_all), aux = self._run_layers((x_BxSxD, *cache), step, tokens_BxS.size, dt,
                                                        slice_params=False, seq_len=s if s > 1 else None)
        if not all_logits:
            x_BxSxD = x_BxSxD[:, -1:]
        x_BxSxD = self.final_norm(x_BxSxD)
        logits = self.logits(x_BxSxD)
        return (logits if all_logits else logits[:, 0]), KVCache(k_all, v_all), aux


def describe_execution(cfg: ModelConfig, seq_len: int) -> str:
    """One line for the start-up log: compute dtype, remat policy, the attention implementation
    this device will run at `seq_len` (a fallback is named with its reason), FFN kind/backend."""
    dt = _dtype(cfg.compute_dtype)
    try:
        attention = choose_attention(cfg.attention_impl, dtype=dt, head_dim=cfg.head_dim, seq_len=seq_len)
    except ValueError as err:
        attention = f"error: {err}"
    return (f"model execution: compute {cfg.compute_dtype} (fp32 master weights), remat {cfg.remat!r} "
            f"({REMAT_POLICIES[cfg.remat]}), attention {attention} (model.attention_impl="
            f"{cfg.attention_impl!r}, seq {seq_len}, {cfg.heads_text()}, head dim {cfg.head_dim}), FFN {cfg.ffn_kind} "
            f"({cfg.kind.backend(cfg.ffn_backend)}), layers {_layers_text(cfg)}")


def _layers_text(cfg: ModelConfig) -> str:
    """How the layer scan runs, in words (model.layer_unroll resolved)."""
    unroll = cfg.layers_per_iteration
    how = ("unrolled (no loop)" if unroll == 0 or unroll >= cfg.n_layers else
           "in a loop" if unroll == 1 else f"in a loop, {unroll} layers an iteration")
    return f"{how} (model.layer_unroll={cfg.layer_unroll})"


def init_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A freshly initialised model (normal(0, init_std) matrices, unit norm scales)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def split_model(model: Transformer) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """(graphdef, params as a plain nested dict): the dict is what the optimiser and checkpoints see."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def apply_model(graphdef: nnx.GraphDef, params: dict[str, Any], tokens_BxS: jax.Array,
                *, track_neurons: bool = False) -> tuple[jax.Array, Aux]:
    """Pure function form of the forward: rebuild the module from `params` and call it."""
    return nnx.merge(graphdef, params)(tokens_BxS, track_neurons=track_neurons)


def stack_layers(per_layer: list[Any]) -> Any:
    """The stacked [L, ...] blocks tree of `Transformer` from one tree per layer (the layout of HF
    checkpoints and of runs written before the layers were scanned)."""
    if not per_layer:
        raise ValueError("stack_layers needs at least one layer")
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *per_layer)


def layer_slice(blocks: Any, layer: int) -> Any:
    """Layer `layer`'s tree of a stacked blocks tree (`stack_layers`'s inverse, one layer)."""
    return jax.tree.map(lambda leaf: leaf[layer], blocks)


def gate_key(cfg: ModelConfig) -> str:
    """Name of the weight whose rows decide whether a neuron fires (re-initialised when dead)."""
    return cfg.kind.gate_weight


def is_decayed(path: tuple[Any, ...]) -> bool:
    """Weight decay applies to matrices and the embedding, never to norm scales (HF grouping)."""
    return path[-1] != "scale"
