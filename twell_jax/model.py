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
decode steps of generation, `twell_jax.inference`), with per-row RoPE positions and masks.

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
from twell_jax.ops import planner
from twell_jax.ops.backends import gpu_available

logger = logging.getLogger(__name__)

Aux = dict[str, jax.Array]

def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def build_op_config(cfg: ModelConfig, layer: int = 0) -> ops.SparseFFNConfig | None:
    """Layer `layer`'s op config: `cfg.ffn_op_config` plus that layer's `ffn_expected_active` and
    `ffn_expected_tails` hints (unless ffn_op_config sets them for all layers), or None for the op
    defaults."""
    fields = dict(cfg.ffn_op_config)
    if cfg.ffn_expected_active and "expected_active_per_token" not in fields:
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
    with ONE logged warning naming the shape and the reason (XLA attention is ~3x slower there);
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
    """The FFN chosen by `cfg.ffn_kind`; weights neuron-major [H, D].

    - "swiglu": silu(x Wg^T) * (x Wu^T) @ Wd, dense XLA (activations are never exactly zero).
    - "relu_gated": relu(x Wg^T) * (x Wu^T) @ Wd through the op's "dense" backend.
    - "twell": same math through the op with `cfg.ffn_backend` (the sparse model).
    - "relu": relu(x Wu^T) @ Wd through the op's non-gated `ffn`.

    The op config is an argument of the call, not an attribute: the blocks are one stacked module
    whose layers may run different plans (`Transformer`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, d, std = cfg.d_ff, cfg.d_model, cfg.init_std
        self.kind = cfg.ffn_kind
        kind = cfg.kind
        self.gated = kind.gated
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
        if self.kind == "swiglu":
            return ops.dense_ffn(True, x_BxSxD, (self.w_gate[...].astype(dt), w_up, w_down), activation="silu")
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
        # unrolled, but a scan materialises every saved value of every layer (28.4 against 19.4
        # GiB for the 0.5b dense twin's step on an H100 before this policy).
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
        self.n_layers, self.layer_scan, self.layer_unroll = cfg.n_layers, cfg.layer_scan, cfg.layer_unroll
        self.gated, self.backend, self.interpret = cfg.kind.gated, cfg.kind.backend(cfg.ffn_backend), cfg.ffn_interpret
        self.d_model, self.d_ff, self.is_swiglu = cfg.d_model, cfg.d_ff, cfg.ffn_kind == "swiglu"
        self.op_configs = tuple(build_op_config(cfg, layer) for layer in range(cfg.n_layers))
        self.decode_kernels, self.decode_transposed = cfg.decode_kernels, cfg.decode_transposed
        self.decode_sparse_ffn, self.decode_layer_unroll = cfg.decode_sparse_ffn, cfg.decode_layer_unroll
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

    def layer_groups(self, n_tokens: int, dtype: Any) -> list[tuple[int, int, int]]:
        """[(first layer, end layer, plan index)] of the maximal runs of consecutive layers whose
        op configs compile the same program for a call of `n_tokens` tokens in `dtype`; the plan
        index numbers the distinct plans in order of first appearance. The representative config
        of a plan is `self.op_configs[first layer of its first run]`."""
        if self.is_swiglu:  # no sparse op: one plan
            return [(0, self.n_layers, 0)]
        shape = (n_tokens, self.d_model, self.d_ff, jnp.dtype(dtype).itemsize)
        keys = [ops.plan_key(self.gated, self.backend, config, shape, self.interpret) for config in self.op_configs]
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
                    slice_params: bool, remat: str = "none") -> tuple[Any, Aux]:
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
        groups = self.layer_groups(n_tokens, dtype)
        first_of_plan: dict[int, int] = {}
        for first, _, plan in groups:
            first_of_plan.setdefault(plan, first)
        configs = [self.op_configs[first_of_plan[plan]] for plan in range(len(first_of_plan))]

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
        return _logits(hidden_BxSxD, self.head()[...].astype(hidden_BxSxD.dtype)), aux

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

        x_BxSxD, aux = self._run_layers(x_BxSxD, step, tokens_BxS.size, dt, slice_params=True, remat=self.remat)
        return self.final_norm(x_BxSxD), aux

    def decode(self, tokens_BxS: jax.Array, cache: KVCache, cache_index: jax.Array, start_B: jax.Array,
               *, all_logits: bool = False, prepared: dict[str, Any] | None = None) -> tuple[jax.Array, KVCache, Aux]:
        """Forward of S new tokens per row written at cache slots [cache_index, cache_index + S).

        Row b's real tokens start at slot `start_B[b]` (left padding: earlier slots are never
        attended to) and sit at RoPE position slot - start_B[b], so a left-padded row computes
        exactly what it would alone. Returns (fp32 logits [B, S, V] if `all_logits` else those of
        the last new token [B, V], the updated cache, aux stacked over layers). The caller keeps
        cache_index + S <= T (a traced index cannot be checked here; the cache write would clamp).
        `prepared`: `prepare_decode()`'s weight copies, which a one-token step through the decode
        kernels reads instead of the stored stacks (other calls ignore them)."""
        length, rows = cache.k_LxBxTxNxK.shape[2], cache.k_LxBxTxNxK.shape[1]
        if tokens_BxS.ndim != 2 or tokens_BxS.shape[1] > length or tokens_BxS.shape[0] != rows:
            raise ValueError(f"tokens must be [batch, S] with S <= the cache length {length} and batch = the "
                             f"cache's {rows} rows, got shape {tokens_BxS.shape}")
        b, s = tokens_BxS.shape
        if s == 1 and not all_logits and self._decode_with_kernels():
            return self._decode_step_kernels(tokens_BxS[:, 0], cache, cache_index, start_B, prepared)
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

        (x_BxSxD, k_all, v_all), aux = self._run_layers((x_BxSxD, *cache), step, tokens_BxS.size, dt,
                                                        slice_params=False)
        if not all_logits:
            x_BxSxD = x_BxSxD[:, -1:]
        x_BxSxD = self.final_norm(x_BxSxD)
        logits = _logits(x_BxSxD, self.head()[...].astype(dt))
        return (logits if all_logits else logits[:, 0]), KVCache(k_all, v_all), aux


    def _decode_with_kernels(self) -> bool:
        """Whether a one-token decode step runs `_decode_step_kernels` (model.decode_kernels)."""
        if self.decode_kernels == "xla":
            return False
        gpu = gpu_available()
        if self.decode_kernels == "pallas":
            if not (gpu or self.interpret):
                raise ValueError("model.decode_kernels='pallas' needs a GPU (or model.ffn_interpret=true to run "
                                 "the kernels in the Pallas interpreter); use 'auto' or 'xla' here")
            return True
        return gpu

    def prepare_decode(self) -> dict[str, jax.Array] | None:
        """Output-major copies ([L, N, K], compute dtype) of the weights that a one-token decode step
        reads input-major, for `decode(..., prepared=)`, when model.decode_transposed and the
        decode kernels run; else None: "w_qkv" [L, D + 2 N_kv K, D] ([L, 3D, D] without grouped KV
        heads; q, k, v side by side: one weight, so one
        launch without the three-part masking), "w_out" [L, D, D], "w_down" [L, D, H]; and the norm
        scales in fp32, as the kernels read them: "attn_norm" and "ffn_norm" [L, D], "final_norm"
        [D] (converted here once: in the step each convert was an XLA launch of its own every step,
        three a step, which a decode loop does not hoist). Made once per set of weights (a Generator
        makes them at its start): the copies cost those weights' memory a second time."""
        if not (self.decode_transposed and self._decode_with_kernels()):
            return None
        dt = _dtype(self.compute_dtype)
        attn = self.blocks.attn

        def t(w: nnx.Param) -> jax.Array:
            return jnp.swapaxes(w[...].astype(dt), 1, 2)

        return {"w_qkv": jnp.concatenate([t(attn.w_q), t(attn.w_k), t(attn.w_v)], axis=1), "w_out": t(attn.w_out),
                "w_down": t(self.blocks.ffn.w_down), **self._norm_scales_fp32()}

    def _norm_scales_fp32(self) -> dict[str, jax.Array]:
        """The decode kernels' norm scales: {"attn_norm", "ffn_norm": [L, D], "final_norm": [D]}, fp32."""
        return {name: norm.scale[...].astype(jnp.float32) for name, norm in
                (("attn_norm", self.blocks.attn_norm), ("ffn_norm", self.blocks.ffn_norm),
                 ("final_norm", self.final_norm))}

    def decode_layer_sparse(self, batch: int, dtype: Any) -> tuple[bool, ...]:
        """Per layer, whether a one-token decode step of `batch` rows runs the sparse FFN's decode
        kernels (its op plan is a sparse forward) or the fused dense products."""
        return tuple(way != "dense" for way in self.decode_layer_ways(batch, dtype))

    def decode_layer_ways(self, batch: int, dtype: Any) -> tuple[str, ...]:
        """Per layer, how a one-token decode step of `batch` rows runs its FFN: "dense" (the fused
        dense products) or the sparse kernels of model.decode_sparse_ffn, "auto" resolved per layer
        "packed_down" at up to PACKED_DOWN_MAX_ROWS rows, "packed" at up to PACKED_MAX_ROWS, else
        by `planner.decode_sparse_way` from the layer's activity hint (one launch walking every
        active neuron: "tiles" where the gate's program holds every row, else "fused"; or "split");
        "tiles", "packed" and "packed_down" need every row in one program of the gate and run
        "fused" for more rows. At more than one row (backend
        "auto") a sparse layer runs "dense" where its way's union limit (`decode_union_limit`) is 0
        or below the union expected from its hint."""
        if self.is_swiglu:
            return ("dense",) * self.n_layers
        from twell_jax.pallas_kernels.decode_matvec import gate_role, role_block_sizes

        tiles_fit = batch <= role_block_sizes(gate_role(batch), batch).block_m(batch)  # every row in one gate program

        def way(config: Any) -> str:
            if self.decode_sparse_ffn == "auto":
                if batch <= PACKED_MAX_ROWS:  # each tile makes its own neurons' values (up to
                    # PACKED_DOWN_MAX_ROWS rows also their down product, in the same launch)
                    return "packed_down" if batch <= PACKED_DOWN_MAX_ROWS else "packed"
                expected = None if config is None else config.expected_active_per_token
                chosen = planner.decode_sparse_way(batch, expected, self.d_ff)
                # One launch walking every active neuron: from the gate's tile lists where they hold the
                # rows (no compaction launch: one launch fewer a layer; an earlier build's step on the H100
                # measured 0.530 against 0.538 ms, issue 24's stop notes, not a current figure).
                return "tiles" if chosen == "fused" and tiles_fit else chosen
            if self.decode_sparse_ffn in ("tiles", "packed", "packed_down") and not tiles_fit:
                return "fused"
            return self.decode_sparse_ffn

        itemsize = jnp.dtype(dtype).itemsize
        ways = tuple(way(config) for config in self.op_configs)

        # Several rows: the step's device-side switch costs the sparse side its own launches, and above
        # its union limit the dense side reads the gate's weights a second time. "auto" plans a
        # layer's dense products statically (the twin's: never slower) where the cost model of its
        # way finds no union that pays for the switch, or where the union expected from the layer's
        # hint is above that limit (the switch would fall back on most steps).
        def sparse(config: Any, chosen: str) -> bool:
            if not ops.decode_forward_is_sparse(self.gated, self.backend, config, batch, self.d_model, self.d_ff,
                                                itemsize, self.interpret):
                return False
            if batch == 1 or self.backend != "auto":
                return True
            limit = self.decode_union_limit(batch, chosen, itemsize)
            expected = None if config is None else config.expected_active_per_token
            return limit > 0 and (expected is None or planner.expected_union(batch, expected, self.d_ff) <= limit)

        return tuple(chosen if sparse(config, chosen) else "dense" for config, chosen in zip(self.op_configs, ways))

    def decode_union_limit(self, batch: int, way: str, itemsize: int) -> int:
        """The union of a step's rows' active neurons above which a sparse layer of this `way` runs
        the dense products (the device switch of a step of several rows): `planner.decode_union_limit`
        with the switch priced, "packed" by its own cost model."""
        return planner.decode_union_limit(batch, self.d_model, self.d_ff, gated=self.gated, itemsize=itemsize,
                                          device_switch=True,
                                          way="packed" if way in ("packed", "packed_down") else None)

    def _decode_step_kernels(self, tokens_B: jax.Array, cache: KVCache, cache_index: jax.Array,
                             start_B: jax.Array, prepared: dict[str, Any] | None = None
                             ) -> tuple[jax.Array, KVCache, Aux]:
        """`decode` of one token per row by the decode kernels, per layer: the attention norm and
        the q/k/v projections in one `decode_matvec` launch; RoPE, the in-place cache writes and the
        attention in one launch (`decode_attention_qkv`, over the stacked caches in place and only
        the visible slots; RoPE's angles made once per step); the output projection with the
        residual add in its epilogue; then the FFN:
        dense plans as one launch for norm + gate/up + activation and one for the down projection
        + residual; sparse plans (`decode_layer_ways`) by the sparse FFN's decode kernels (the
        gate's product, the union of the rows' active neurons compacted on the device, the up/down
        rows of those only: "split" in two launches, "fused" in one with the residual, per layer by
        model.decode_sparse_ffn; "tiles": the gate's tile lists, no compaction; "packed": the
        gate's lists with their hidden values, then the down launch; "packed_down": all of it in
        the gate's launch, its grid barrier's counters made once a step and handed from layer to
        layer), with, for a batch
        of several rows, a device-side switch to the dense
        products when the union exceeds `ops.planner.decode_union_limit` (the decode cost model's
        break-even; no host round trip). The stacked weights are read in place at the layer (no
        per-layer copy); with `prepared` (`prepare_decode`), q/k/v, the output projection and the
        dense W_down are read from its output-major copies instead. With grouped-query attention
        the q/k/v product's output is [B, (N + 2 N_kv) K] and each KV head's program of the
        attention serves its G query heads. The LM head: the final norm and the output head's
        product (the tied embedding, or `lm_head`) in one launch. Same roundings as the XLA path up
        to the order of fp32 sums and the attention's fp32 probabilities (tests/test_decode_kernels.py)."""
        from twell_jax.pallas_kernels.decode_attention import decode_attention_qkv
        from twell_jax.pallas_kernels.decode_matvec import decode_matvec, gate_role, role_block_sizes
        from twell_jax.pallas_kernels.twell_decode import (DecodeBlockSizes, compact_active, compact_active_rows,
                                                           sparse_decode_down_tiles, sparse_decode_ffn,
                                                           sparse_decode_ffn_fused, sparse_decode_ffn_tiles)

        b = tokens_B.shape[0]
        dt = _dtype(self.compute_dtype)
        interpret, gated, h_dim, d = self.interpret, self.gated, self.d_ff, self.d_model
        attn, ffn = self.blocks.attn, self.blocks.ffn
        n_heads, n_kv_heads, head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        w_qkv = tuple(w[...].astype(dt) for w in (attn.w_q, attn.w_k, attn.w_v))  # [L, D, N(_kv)*K]: no-op casts when
        w_out = attn.w_out[...].astype(dt)  # the weights are loaded in the compute dtype (inference.load_run)
        w_gate = ffn.w_gate[...].astype(dt) if gated else None
        w_up, w_down = ffn.w_up[...].astype(dt), ffn.w_down[...].astype(dt)  # [L, H, D]
        # The layouts the products read: the stored stacks are input-major ("kn"); prepared copies
        # are output-major ("nk"). The sparse FFN always reads the stored W_down (rows per neuron).
        proj_layout, w_qkv_mv, w_out_mv, w_down_mv, nk = "kn", w_qkv, w_out, w_down, ""
        if prepared is None and self.decode_transposed:
            raise ValueError("model.decode_transposed: pass the copies of prepare_decode() to "
                             "decode(..., prepared=model.prepare_decode()); without them the stored weights would "
                             "run (model.decode_transposed=false for that)")
        scales = self._norm_scales_fp32() if prepared is None else prepared
        if prepared is not None:
            if set(prepared) != {"w_qkv", "w_out", "w_down", "attn_norm", "ffn_norm", "final_norm"}:
                raise ValueError(f"prepared must be Transformer.prepare_decode()'s dict, got keys {sorted(prepared)}")
            proj_layout, nk = "nk", "_nk"  # the roles of these products in that layout
            w_qkv_mv = prepared["w_qkv"].astype(dt)  # one [L, D + 2 N_kv K, D] weight: q, k, v in one part
            w_out_mv, w_down_mv = prepared["w_out"].astype(dt), prepared["w_down"].astype(dt)
        n1_LxD, n2_LxD = scales["attn_norm"], scales["ffn_norm"]
        act = "silu" if self.is_swiglu else "relu"
        eps, theta, scaling = self.final_norm.eps, attn.rope_theta, attn.rope_scaling  # one norm_eps for every norm

        def mv(*args: Any, role: str, **kwargs: Any) -> jax.Array:
            # Each role's blocks passed explicitly (read at trace time: a changed table retraces).
            return decode_matvec(*args, eps=eps, interpret=interpret, block_sizes=role_block_sizes(role, b),
                                 **kwargs)

        embed_VxD = self.embed[...].astype(dt)
        x_BxD = jnp.take(embed_VxD, tokens_B, axis=0)
        positions_Bx1 = jnp.maximum(cache_index - start_B, 0)[:, None]
        cos_Bx1xH, sin_Bx1xH = rope_tables(positions_Bx1, head_dim, theta, scaling)  # every layer's: made once a step
        index_1 = jnp.reshape(cache_index, (1,)).astype(jnp.int32)
        start_i32 = start_B.astype(jnp.int32)

        def dense_ffn(x: jax.Array, li: jax.Array, norm: jax.Array | None, residual: jax.Array,
                      enable: jax.Array | None = None, enable_above: int = 0) -> tuple[jax.Array, jax.Array]:
            # enable (the device switch's dense side): both launches run only when sum(enable) >
            # enable_above, else neither reads a weight (nor x for the norm); its W_down in one launch
            # ("down_nk_switch": no split-K epilogue launch in XLA on the steps it is disabled).
            switch = {} if enable is None else {"enable": enable, "enable_above": enable_above}
            if gated:
                h = mv(x, w_up, role="gate_up", layer=li, norm_scale=norm, gate=w_gate, activation=act, **switch)
            else:
                h = mv(x, w_up, role="gate_up", layer=li, norm_scale=norm, activation="relu", **switch)
            down_role = "down" + nk + ("_switch" if nk and enable is not None else "")
            return mv(h, w_down_mv, role=down_role, layer=li, layout=proj_layout, residual=residual, **switch), h

        def layer_step(carry: Any, layer: jax.Array, way: str, op_config: Any) -> tuple[Any, Aux]:
            x, k_all, v_all, sync = carry
            li = layer[None]
            # One launch for q, k, v: the prepared [L, D + 2 N_kv K, D] weight, or the three stored ones as
            # parts of one shape (multi-head attention only)
            if prepared is not None or (n_kv_heads == n_heads and d % role_block_sizes("qkv", b).block_n == 0):
                qkv = mv(x, w_qkv_mv, role="qkv" + nk, layer=li, layout=proj_layout, norm_scale=n1_LxD)
            else:
                qkv = jnp.concatenate([mv(x, w, role="qkv" + nk, layer=li, layout=proj_layout, norm_scale=n1_LxD)
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
            x = mv(o.astype(dt).reshape(b, d), w_out_mv, role="out" + nk, layer=li, layout=proj_layout, residual=x)
            if way == "dense":
                x, h = dense_ffn(x, li, n2_LxD, x)
                return (x, k_all, v_all, sync), {"l0": jnp.sum(h != 0, dtype=jnp.float32) / b}
            block_sizes = (op_config.decode_block_sizes if op_config is not None else None) or DecodeBlockSizes()
            limit = None
            if b > 1:  # the planner's decode cost model: the union above which dense is faster
                limit = self.decode_union_limit(b, way, jnp.dtype(dt).itemsize)
            # The norm in XLA where two kernels read xn: one small fusion, faster than a norm prologue in
            # each (experiments/bench_decode_ffn_step.py: "tiles_xla_norm" against "tiles").
            scale = jax.lax.dynamic_index_in_dim(n2_LxD, layer, keepdims=False)
            if way == "packed_down":  # the gate's launch makes the values and the down product (+ the
                # residual) too, its tiles' partials summed after a grid barrier (counters: sync); above
                # the limit it passes x through and the dense products run (the switch reads the counts)
                outs = mv(x, w_gate if gated else w_up, role=gate_role(b), layer=li, norm_scale=n2_LxD,
                          out_dtype=jnp.float32, tile_lists=True, tile_values=True, up=w_up if gated else None,
                          down=w_down, down_residual=x, down_limit=limit, sync=sync)
                y = outs[5] if limit is None else dense_ffn(x, li, n2_LxD, outs[5], outs[2], limit)[0]
                return (y, k_all, v_all, outs[6]), {"l0": jnp.sum(outs[3]).astype(jnp.float32) / b}
            if way in ("tiles", "packed"):
                # TwELL: the gate's epilogue packs each column tile's active neurons (the rows' union);
                # "packed" also their hidden values (the up product of those neurons only, the norm in
                # the gate's prologue), read by the down kernel; "tiles" the lists only, read by one
                # kernel for the up and down products. Either adds the residual.
                if way == "packed":
                    _, ids, count, pairs_T, values = mv(x, w_gate if gated else w_up, role=gate_role(b), layer=li,
                                                        norm_scale=n2_LxD, out_dtype=jnp.float32, tile_lists=True,
                                                        tile_values=True, up=w_up if gated else None)
                    y = sparse_decode_down_tiles(values, ids, count, w_down, layer=li, residual_MxD=x, limit=limit,
                                                 block_sizes=block_sizes, interpret=interpret)
                else:
                    xn = RMSNorm.normalize(x, scale, eps)
                    g, ids, count, pairs_T = mv(xn, w_gate if gated else w_up, role=gate_role(b), layer=li,
                                                out_dtype=jnp.float32, tile_lists=True)
                    y = sparse_decode_ffn_tiles(xn, g, ids, count, w_up if gated else None, w_down, layer=li,
                                                residual_MxD=x, limit=limit, block_sizes=block_sizes,
                                                interpret=interpret)
                if limit is not None:  # above the limit the sparse kernel passed x through: the dense products
                    y = dense_ffn(x, li, n2_LxD, y, count, limit)[0]  # (the switch read from the counts in-kernel)
                return (y, k_all, v_all, sync), {"l0": jnp.sum(pairs_T).astype(jnp.float32) / b}
            xn = RMSNorm.normalize(x, scale, eps)
            g = mv(xn, w_gate if gated else w_up, role=gate_role(b), layer=li, out_dtype=jnp.float32)  # [B, H]
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

        ways_L = self.decode_layer_ways(b, dt)
        # "packed_down"'s arrival counters for its grid barriers: one per layer, zero at each step
        sync = jnp.zeros((self.n_layers,), jnp.int32) if "packed_down" in ways_L else None
        carry, auxes, first = (x_BxD, cache.k_LxBxTxNxK, cache.v_LxBxTxNxK, sync), [], 0
        while first < self.n_layers:  # one scan per run of layers with the same kind of FFN step
            end = first + 1
            while end < self.n_layers and ways_L[end] == ways_L[first]:
                end += 1
            step = functools.partial(layer_step, way=ways_L[first], op_config=self.op_configs[first])
            unroll = self.decode_layer_unroll or end - first
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
        logits_BxV = mv(x_BxD, self.head()[...].astype(dt), role="head", norm_scale=scales["final_norm"],
                        out_dtype=jnp.float32)
        aux = jax.tree.map(lambda *parts: jnp.concatenate(parts), *auxes)
        return logits_BxV, KVCache(k_all, v_all), aux


# Rows of a decode step up to which model.decode_sparse_ffn "auto" runs its sparse layers "packed"
# ("packed_down" up to PACKED_DOWN_MAX_ROWS) (each column tile makes its own active neurons' values:
# no program walks them all, as "tiles" and "fused" do, and the down kernel's steps are cheap):
# every one at 1 row; at more, those whose expected union is within "packed"'s own limit
# (`Transformer.decode_union_limit`), with the device switch to the dense products above it. The
# gate's values epilogue runs its rows one after another (an unrolled loop), so its cost grows with
# the rows. On the H100 (0.5b; BENCHMARKS.md, Decode): one
# layer's FFN with its active neurons spread (experiments/bench_decode_ffn_step.py, a scan step) took
# 22.5 / 27.8 / 34.8 us at 1 row and 16 / 96 / 192 of them against "split"'s 33.1 / 35.4 / 38.7 and the
# twin's 38; 24.0 / 23.7 / 31.6 at 2 rows, 25.8 / 26.1 / 33.8 at 4 and 28.0 / 27.9 / 35.3 at 8 at unions
# 8 / 32 / 128, against the twin's 39-40. The model's step at 4 rows: 0.735 ms against the twin's
# 0.763 (1.039x), and on another checkpoint 1.036x at 4 rows (at 2 rows `packed` 1.155x and
# `packed_down` 1.146x in alternation on a third); at 8 rows the packed layers' kernels took 18 us
# a step less than the twin's on the first checkpoint, but their switch's short launches left 20 us
# of launch gaps (0.998x), and on a third they took more than the twin's
# (0.970x; as CUDA graphs, no gaps, both at 0.981 ms), so 8 rows keep the other ways' batch plans
# (the twin's products on these checkpoints).
PACKED_MAX_ROWS = 4

# Rows of a decode step up to which model.decode_sparse_ffn "auto" runs those layers "packed_down"
# (the gate's launch also adds each tile's neurons' W_down rows into a partial of its own, summed
# after a grid barrier with the residual: one launch a layer) rather than "packed" (a second launch
# walks every listed neuron's W_down row). On the H100 (0.5b; BENCHMARKS.md, Decode), one layer's
# FFN with its active neurons spread (experiments/bench_decode_ffn_step.py, interleaved): at 1 row
# 20.4 / 20.5 / 21.1 us at 8 / 32 / 96 of them against "packed"'s 21.3 / 21.6 / 26.8; at 2 rows
# 23.3 / 23.3 / 23.6 against 23.4 / 24.0 / 28.4; at 4 rows 27.0 / 27.2 / 27.4 against 26.0 / 26.2 /
# 31.1 (each row's partial stored and summed), and trained checkpoints' unions at 4 rows are 8-40:
# so 3 and 4 rows keep "packed".
PACKED_DOWN_MAX_ROWS = 2

# Rows of a decode step up to which a sparse layer counts its rows' active neurons inside the
# compaction kernel (`compact_active_rows`: one program, so one load of [rows, H] after another);
# above it XLA reduces over the rows first. On an H100 at one row it takes 4.8 us a layer where the
# reduction (2.8 us) and `compact_active` (5.1 us) took 7.9 (BENCHMARKS.md, Decode); the bound keeps a
# 64-row step off a one-program read.
COMPACT_ROWS_IN_KERNEL = 8


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
            f"({cfg.kind.backend(cfg.ffn_backend)})")


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
