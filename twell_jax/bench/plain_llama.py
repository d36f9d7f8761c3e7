"""A plain-JAX Llama: the baseline row of `bench_step.py` (training step) and `bench_inference.py`
(prefill and KV-cached decode).

Tied embedding, pre-norm blocks (RMSNorm -> causal MHA with non-interleaved RoPE -> residual,
RMSNorm -> relu-gated FFN -> residual), final RMSNorm: the architecture of `twell_jax.model` with
`ffn_kind="relu_gated"` and the presets' attention (no grouped KV heads, untied head or RoPE
scaling: `check_plain_architecture` refuses them), written with jnp and `jax.nn.dot_product_attention` only. Nothing of
twell_jax runs inside the model math, so the baseline needs no trust in the library; `ModelConfig`
only supplies the shapes. Dots take the parameters' dtype (bf16 from `reference_init`), norms,
RoPE angles, the FFN gating product and the loss are f32, as in the library's model.

Parameters are a plain dict: {"embed": [V, D], "norm": [D], "layers": [{"wq", "wk", "wv", "wo":
[D, D] (x @ w), "wg", "wu": [D, H], "wd": [H, D], "n1", "n2": [D]}, ...]}. `reference_init` draws
them; `reference_params_from_model` takes them from a twell_jax model (the same weights as its
dense twin). The KV cache is a pair of preallocated [L, B, T, N, K] arrays written in place with
`lax.dynamic_update_slice`, as `twell_jax.model.Transformer.decode` does.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from twell_jax.config import ModelConfig

PlainParams = dict[str, Any]
PlainCache = tuple[jax.Array, jax.Array]  # (k_LxBxTxNxK, v_LxBxTxNxK)
REFERENCE_REMATS = ("none", "full", "dots")  # the remat policies reference_loss implements


# ----------------------------------------------------------------------------- parameters


def check_plain_architecture(cfg: ModelConfig) -> None:
    """The plain model is the presets' architecture: multi-head attention, a tied head, plain RoPE;
    a ValueError naming the model field it does not have (a baseline that silently computed
    another model would time the wrong thing)."""
    for field, value, plain in (("n_kv_heads", cfg.kv_heads, cfg.n_heads), ("tie_embeddings", cfg.tie_embeddings, True),
                                ("rope_scaling", cfg.rope_scaling, None)):
        if value != plain:
            raise ValueError(f"the plain-JAX baseline has model.{field}={plain!r} only (multi-head attention, a tied "
                             f"head, plain RoPE), got {getattr(cfg, field)!r}")


def reference_init(cfg: ModelConfig, key: jax.Array) -> PlainParams:
    """Random bf16 parameters: normal(0, init_std) matrices, unit norm scales."""
    check_plain_architecture(cfg)
    d, h, dt = cfg.d_model, cfg.d_ff, jnp.bfloat16
    keys = iter(jax.random.split(key, 1 + 7 * cfg.n_layers))
    normal = lambda shape: (cfg.init_std * jax.random.normal(next(keys), shape)).astype(dt)  # noqa: E731
    layers = [{"wq": normal((d, d)), "wk": normal((d, d)), "wv": normal((d, d)), "wo": normal((d, d)),
               "wg": normal((d, h)), "wu": normal((d, h)), "wd": normal((h, d)),
               "n1": jnp.ones((d,), dt), "n2": jnp.ones((d,), dt)} for _ in range(cfg.n_layers)]
    return {"embed": normal((cfg.vocab_size, d)), "layers": layers, "norm": jnp.ones((d,), dt)}


def _entry(tree: Any, path: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
    """tree[path[0]][path[1]]..., checked to exist with `shape`."""
    node = tree
    for i, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"reference_params_from_model: params has no entry {'/'.join(map(str, path[:i + 1]))}")
        node = node[key]
    if tuple(node.shape) != shape:
        raise ValueError(f"reference_params_from_model: params {'/'.join(map(str, path))} has shape "
                         f"{tuple(node.shape)}, expected {shape} for this config")
    return jnp.asarray(node)


def reference_params_from_model(cfg: ModelConfig, params: dict[str, Any], dtype: str = "bfloat16") -> PlainParams:
    """The plain parameters holding the weights of a twell_jax model of `cfg` (`params`: the nested
    dict of `model.split_model`), cast to `dtype`. The model keeps its FFN matrices neuron-major
    [H, D]: w_gate and w_up are transposed to the plain [D, H]; w_down [H, D] is the plain layout."""
    if not (cfg.kind.gated and cfg.kind.relu):
        raise ValueError(f"reference_params_from_model: the plain model is relu-gated; ffn_kind "
                         f"{cfg.ffn_kind!r} has no such FFN (use a 'twell' or 'relu_gated' model)")
    check_plain_architecture(cfg)
    d, h, dt = cfg.d_model, cfg.d_ff, jnp.dtype(dtype)

    def get(path: tuple[Any, ...], shape: tuple[int, ...]) -> jax.Array:
        return _entry(params, path, shape).astype(dt)

    n = cfg.n_layers  # the model's blocks are stacked over layers: every entry is [L, ...]
    stacked = {name: get(("blocks",) + path, (n,) + shape) for name, path, shape in (
        ("wq", ("attn", "w_q"), (d, d)), ("wk", ("attn", "w_k"), (d, d)), ("wv", ("attn", "w_v"), (d, d)),
        ("wo", ("attn", "w_out"), (d, d)), ("wg", ("ffn", "w_gate"), (h, d)), ("wu", ("ffn", "w_up"), (h, d)),
        ("wd", ("ffn", "w_down"), (h, d)), ("n1", ("attn_norm", "scale"), (d,)), ("n2", ("ffn_norm", "scale"), (d,)))}
    layers = [{name: (value[layer].T if name in ("wg", "wu") else value[layer]) for name, value in stacked.items()}
              for layer in range(n)]
    return {"embed": get(("embed",), (cfg.vocab_size, d)), "layers": layers,
            "norm": get(("final_norm", "scale"), (d,))}


# ----------------------------------------------------------------------------- pieces


def _norm(cfg: ModelConfig, x_BxSxD: jax.Array, scale_D: jax.Array) -> jax.Array:
    """RMSNorm in f32, returned in the input dtype."""
    x32 = x_BxSxD.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + cfg.norm_eps)
            * scale_D.astype(jnp.float32)).astype(x_BxSxD.dtype)


def _rope(cfg: ModelConfig, x_BxSxNxK: jax.Array, positions_S: jax.Array) -> jax.Array:
    """Rotates the pairs (x[i], x[i + K/2]) of token s by positions_S[s] times each frequency."""
    half = cfg.head_dim // 2
    freq_K2 = 1.0 / cfg.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angle_SxK2 = positions_S.astype(jnp.float32)[:, None] * freq_K2
    cos, sin = jnp.cos(angle_SxK2)[None, :, None], jnp.sin(angle_SxK2)[None, :, None]
    x1, x2 = x_BxSxNxK[..., :half].astype(jnp.float32), x_BxSxNxK[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxSxNxK.dtype)


def _qkv(cfg: ModelConfig, p: dict[str, jax.Array], a_BxSxD: jax.Array,
         positions_S: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, k, v) [B, S, N, K]; q and k rotated at positions_S."""
    b, s, _ = a_BxSxD.shape
    heads = lambda w: (a_BxSxD @ p[w]).reshape(b, s, cfg.n_heads, cfg.head_dim)  # noqa: E731
    return _rope(cfg, heads("wq"), positions_S), _rope(cfg, heads("wk"), positions_S), heads("wv")


def _ffn(p: dict[str, jax.Array], f_BxSxD: jax.Array) -> jax.Array:
    """relu(f Wg) * (f Wu) @ Wd: the gating product in f32, rounded once to the input dtype."""
    hidden = jax.nn.relu((f_BxSxD @ p["wg"]).astype(jnp.float32)) * (f_BxSxD @ p["wu"]).astype(jnp.float32)
    return hidden.astype(f_BxSxD.dtype) @ p["wd"]


def _head(params: PlainParams, x_BxSxD: jax.Array) -> jax.Array:
    """The tied LM head on final-normed states: logits in f32."""
    return (x_BxSxD @ params["embed"].T).astype(jnp.float32)


# ----------------------------------------------------------------------------- full sequences


def reference_body(cfg: ModelConfig, params: PlainParams, tokens_BxS: jax.Array, attention: str | None,
                   remat: str = "none") -> jax.Array:
    """The decoder body (embedding, blocks, final norm; no LM head): hidden states [B, S, D].
    `attention`: the implementation of `jax.nn.dot_product_attention` (None: JAX's choice);
    `remat`: "none", "full" (jax.checkpoint of each block) or "dots" (dots saved)."""
    if remat not in REFERENCE_REMATS:
        raise ValueError(f"remat must be one of {REFERENCE_REMATS}, got {remat!r}")
    positions_S = jnp.arange(tokens_BxS.shape[1])

    def block(x_BxSxD: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        b, s, d = x_BxSxD.shape
        q, k, v = _qkv(cfg, p, _norm(cfg, x_BxSxD, p["n1"]), positions_S)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
        x_BxSxD = x_BxSxD + o.reshape(b, s, d) @ p["wo"]
        return x_BxSxD + _ffn(p, _norm(cfg, x_BxSxD, p["n2"]))

    if remat == "full":
        block = jax.checkpoint(block)
    elif remat == "dots":
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    x_BxSxD = params["embed"][tokens_BxS]
    for p in params["layers"]:
        x_BxSxD = block(x_BxSxD, p)
    return _norm(cfg, x_BxSxD, params["norm"])


def reference_logits(cfg: ModelConfig, params: PlainParams, tokens_BxS: jax.Array,
                     attention: str | None = None) -> jax.Array:
    """The full forward: f32 logits [B, S, V]."""
    return _head(params, reference_body(cfg, params, tokens_BxS, attention))


def reference_loss(cfg: ModelConfig, remat: str, attention: str | None,
                   params: PlainParams, tokens_BxT: jax.Array) -> jax.Array:
    """Mean next-token CE (f32) of predicting tokens_BxT[:, 1:] from tokens_BxT[:, :-1]."""
    logits_BxSxV = _head(params, reference_body(cfg, params, tokens_BxT[:, :-1], attention, remat))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxSxV, tokens_BxT[:, 1:]))


# ----------------------------------------------------------------------------- KV-cached decode


def reference_init_cache(cfg: ModelConfig, batch: int, length: int, dtype: str | jnp.dtype) -> PlainCache:
    """Zeroed (k, v) caches [L, batch, length, N, K] in `dtype`."""
    check_plain_architecture(cfg)
    if batch < 1 or not 1 <= length <= cfg.max_seq_len:
        raise ValueError(f"cache needs batch >= 1 and 1 <= length <= model.max_seq_len={cfg.max_seq_len}, "
                         f"got batch={batch}, length={length}")
    shape = (cfg.n_layers, batch, length, cfg.n_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def reference_decode_step(cfg: ModelConfig, params: PlainParams, cache: PlainCache, tokens_BxS: jax.Array,
                          pos: int | jax.Array, attention: str | None = "xla") -> tuple[jax.Array, PlainCache]:
    """S new tokens per row (S = 1 for a decode step) at positions and cache slots [pos, pos + S).

    Each layer writes its new keys/values into its part of the all-layer caches in place
    (`lax.dynamic_update_slice`), then every query attends to all T slots with a mask keeping the
    slots <= its own (the filled ones). Returns (f32 logits of the last new token [B, V], the
    updated cache). `attention`: the implementation of `jax.nn.dot_product_attention` (a masked
    attention: "xla", as the library's decode uses). The caller keeps pos + S <= T."""
    k_LxBxTxNxK, v_LxBxTxNxK = cache
    length = k_LxBxTxNxK.shape[2]
    if tokens_BxS.ndim != 2 or tokens_BxS.shape[0] != k_LxBxTxNxK.shape[1] or tokens_BxS.shape[1] > length:
        raise ValueError(f"tokens must be [batch, S] with batch = the cache's {k_LxBxTxNxK.shape[1]} rows and "
                         f"S <= its {length} slots, got shape {tokens_BxS.shape}")
    b, s = tokens_BxS.shape
    positions_S = pos + jnp.arange(s)
    visible_SxT = jnp.arange(length)[None, :] <= positions_S[:, None]
    x_BxSxD = params["embed"][tokens_BxS]
    for layer, p in enumerate(params["layers"]):
        q, k, v = _qkv(cfg, p, _norm(cfg, x_BxSxD, p["n1"]), positions_S)
        start = (layer, 0, pos, 0, 0)
        k_LxBxTxNxK = jax.lax.dynamic_update_slice(k_LxBxTxNxK, k[None].astype(k_LxBxTxNxK.dtype), start)
        v_LxBxTxNxK = jax.lax.dynamic_update_slice(v_LxBxTxNxK, v[None].astype(v_LxBxTxNxK.dtype), start)
        o = jax.nn.dot_product_attention(q, k_LxBxTxNxK[layer].astype(q.dtype), v_LxBxTxNxK[layer].astype(q.dtype),
                                         mask=visible_SxT[None, None], implementation=attention)
        x_BxSxD = x_BxSxD + o.reshape(b, s, -1) @ p["wo"]
        x_BxSxD = x_BxSxD + _ffn(p, _norm(cfg, x_BxSxD, p["n2"]))
    logits_BxV = _head(params, _norm(cfg, x_BxSxD[:, -1], params["norm"]))
    return logits_BxV, (k_LxBxTxNxK, v_LxBxTxNxK)


def reference_prefill_cache(cfg: ModelConfig, params: PlainParams, tokens_BxS: jax.Array, length: int,
                            attention: str | None = "xla", chunk: int = 256) -> tuple[jax.Array, PlainCache]:
    """A fresh cache of `length` slots filled with `tokens_BxS` at slots [0, S), `chunk` tokens per
    `reference_decode_step` (one call's masked attention holds [B, N, chunk, length] scores).
    Returns (f32 logits of the last token [B, V], the cache)."""
    b, s = tokens_BxS.shape
    if not 1 <= s <= length:
        raise ValueError(f"prefill needs 1 <= tokens ({s}) <= cache length ({length})")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    cache = reference_init_cache(cfg, b, length, params["embed"].dtype)
    for begin in range(0, s, chunk):
        logits_BxV, cache = reference_decode_step(cfg, params, cache, tokens_BxS[:, begin:begin + chunk], begin,
                                                  attention)
    return logits_BxV, cache
