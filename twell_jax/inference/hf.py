"""Hugging Face Llama interop: import a `LlamaForCausalLM` or `MistralForCausalLM` checkpoint,
export ours as a `LlamaForCausalLM`.

A checkpoint directory holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`), and optionally `tokenizer.json` (an export adds its
`tokenizer_config.json`, for transformers' AutoTokenizer). An export writes one
`model.safetensors`, or, above `max_shard_bytes` (default 5 GB, transformers' own), shards
`model-0000i-of-0000n.safetensors` and their index. Layouts (Mistral's are Llama's):

Our blocks are stacked over layers (`blocks.<name>` is [L, ...]); `blocks.i` below is layer i's slice.

| HF tensor (torch Linear: [out, in])            | ours                                    |
|------------------------------------------------|-----------------------------------------|
| model.embed_tokens.weight [V, D]               | embed [V, D] (the tied output head)     |
| lm_head.weight [V, D] (untied checkpoints)     | lm_head [V, D] (as is)                  |
| model.layers.i.self_attn.q_proj [N*K, D]       | blocks.i.attn.w_q [D, N*K] (= .T)       |
| model.layers.i.self_attn.{k,v}_proj [Nkv*K, D] | blocks.i.attn.w_{k,v} [D, Nkv*K] (= .T) |
| model.layers.i.self_attn.o_proj [D, N*K]       | blocks.i.attn.w_out [N*K, D] (= .T)     |
| model.layers.i.mlp.{gate,up}_proj [H, D]       | blocks.i.ffn.w_{gate,up} [H, D] (as is) |
| model.layers.i.mlp.down_proj [D, H]            | blocks.i.ffn.w_down [H, D] (= .T)       |
| model.layers.i.{input,post_attention}_layernorm | blocks.i.{attn,ffn}_norm.scale          |
| model.norm.weight                              | final_norm.scale                        |

The paper's reference code stores `down_proj` transposed ([H, D]) in checkpoints saved from its
hybrid-kernel runs (docs/training.md, last section): `down_proj_layout="auto"` recognises it by shape
when D != H; when D == H the layout cannot be told from the shape and must be given
("hf" or "transposed"). RoPE: HF Llama's `rotate_half` pairs (x[i], x[i + K/2]), as ours does,
with inv_freq = theta^(-2i/K), the same; rope_type "llama3" scaling is model.rope_scaling
(`model.rope_frequencies`). num_key_value_heads < num_attention_heads is grouped-query attention
(model.n_kv_heads: KV head j serves query heads j*G..j*G+G-1, as transformers' repeat_kv);
tie_word_embeddings false is model.tie_embeddings=false with its own `lm_head`. `hidden_act`
"relu" is our relu-gated FFN (imported as `twell`, the sparse op, or `relu_gated`), "silu" is
`swiglu`, or, asked for by ffn_kind, `twell` / `relu_gated`: the SiLU gate replaced by a ReLU one,
a different function, the start of sparsifying a pretrained model by fine-tuning with the L1
penalty (docs/training.md). Not representable, each an error naming its config field: biases,
a head_dim other than hidden_size / num_attention_heads, other RoPE scalings, a Mistral
sliding_window shorter than the context imported (our attention is full causal).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from twell_jax.config import FFN_KIND_TABLE, ModelConfig, RopeScaling, ffn_kinds_with
from twell_jax.inference.load import LoadedModel, experiment_config_for, model_with_params
from twell_jax.model import Transformer, layer_slice, split_model, stack_layers

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # written beside it by an export, for AutoTokenizer
GENERATION_CONFIG_FILE = "generation_config.json"
DOWN_PROJ_LAYOUTS = ("auto", "hf", "transposed")
# transformers' LlamaConfig default for a config.json without rope_theta (LlamaConfig(rope_theta=10000.0)).
HF_DEFAULT_ROPE_THETA = 10000.0
# The architectures imported (config.json "architectures") and their model_type; Mistral's weights are Llama's.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}


def hf_activation(ffn_kind: str) -> str | None:
    """The `hidden_act` of an FFN kind's Llama export (FFN_KIND_TABLE's activation), None for a kind
    with no Llama layout (a Llama MLP is gated)."""
    kind = FFN_KIND_TABLE[ffn_kind]
    return kind.activation if kind.gated else None


def kinds_for_hidden_act(act: str) -> tuple[str, ...]:
    """The FFN kinds a checkpoint of this `hidden_act` imports as, the default first: the gated
    kinds of that activation (the sparse op's first), then, for another activation, the gated ReLU
    kinds, which swap its gate for a ReLU one (sparsifying a pretrained SwiGLU model: the outputs
    change until it is fine-tuned, docs/training.md). Empty for an activation no kind has."""
    def sparse_op_first(names: tuple[str, ...]) -> list[str]:
        return sorted(names, key=lambda name: not FFN_KIND_TABLE[name].sparse_op)

    same = sparse_op_first(ffn_kinds_with(act))
    if not same:
        return ()
    return (*same, *(name for name in sparse_op_first(ffn_kinds_with("relu")) if name not in same))
# transformers' max_shard_size default of save_pretrained ("5GB"): an export above it is sharded.
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9

logger = logging.getLogger(__name__)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, model.rope_scaling) from a Llama/Mistral config: top-level rope_theta and
    rope_scaling (transformers 4), or `rope_parameters` (transformers >= 5). Plain RoPE and
    rope_type "llama3" are supported; anything else is an error naming the field."""
    for field in ("rope_parameters", "rope_scaling"):
        if hf.get(field) is not None and not isinstance(hf[field], dict):
            raise ValueError(f"config.json: {field}={hf[field]!r}, expected an object or null")
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    theta_in_params = params.pop("rope_theta", None)
    theta = hf.get("rope_theta", theta_in_params)
    if theta is None:  # what transformers' LlamaConfig assumes for such a file
        theta = HF_DEFAULT_ROPE_THETA
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"config.json: rope_theta={theta!r}, expected a positive number")
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type in ("default", None):
        if params:
            raise ValueError(f"config.json: {field} has {sorted(params)} with plain RoPE (rope_type default): "
                             "not supported")
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"config.json: {field}.rope_type {rope_type!r} is not supported (plain RoPE or 'llama3')")
    try:
        scaling = RopeScaling.from_dict({"rope_type": rope_type, **params}, where=field)
    except ValueError as err:
        raise ValueError(f"config.json: {err}") from None
    return float(theta), scaling.to_dict()


def model_config_from_hf(hf: dict[str, Any], *, ffn_kind: str | None = None, ffn_backend: str = "auto",
                         compute_dtype: str = "float32", max_seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig for a HF Llama / Mistral `config.json` dict; unsupported features are errors
    naming their field. `max_seq_len`: the context (default max_position_embeddings); a Mistral
    sliding_window shorter than it is refused (our attention sees every earlier token)."""
    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"config.json lacks {key!r} (not a Llama config?)")
        return hf[key]

    architectures = hf.get("architectures") or []
    unknown = [name for name in architectures if name not in ARCHITECTURES] if isinstance(architectures, list) \
        else [architectures]
    if unknown:
        raise ValueError(f"config.json: architectures {architectures!r} is not supported (one of "
                         f"{', '.join(ARCHITECTURES)})")
    model_type = hf.get("model_type", "llama")
    if model_type not in ARCHITECTURES.values():
        raise ValueError(f"config.json: model_type {model_type!r}, expected one of {tuple(ARCHITECTURES.values())}")
    d_model, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"config.json: num_key_value_heads={n_kv_heads!r} must be an int >= 1 dividing "
                         f"num_attention_heads={n_heads}")
    if hf.get("head_dim") not in (None, d_model // n_heads):
        raise ValueError(f"config.json: head_dim={hf['head_dim']} != hidden_size/num_attention_heads "
                         f"({d_model // n_heads}); our head dim is d_model / n_heads")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise ValueError(f"config.json: {field}=true is not supported (our model has no biases)")
    tie = hf.get("tie_word_embeddings", False)  # transformers' default for Llama and Mistral
    if not isinstance(tie, bool):
        raise ValueError(f"config.json: tie_word_embeddings={tie!r}, expected true or false")
    act = need("hidden_act")
    allowed = kinds_for_hidden_act(act) if isinstance(act, str) else ()
    if not allowed:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (relu -> twell / relu_gated, "
                         "silu -> swiglu, or twell / relu_gated to sparsify it)")
    kind = ffn_kind or allowed[0]
    if kind not in allowed:
        raise ValueError(f"ffn_kind={kind!r} does not match hidden_act={act!r} (allowed: {allowed})")
    context = int(need("max_position_embeddings")) if max_seq_len is None else max_seq_len
    window = hf.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"config.json: sliding_window={window!r}, expected an int or null")
    if window is not None and window < context:
        raise ValueError(f"config.json: sliding_window={window!r} is shorter than the context {context} "
                         f"({'max_position_embeddings' if max_seq_len is None else 'max_seq_len'}); our attention "
                         f"sees every earlier token: import with max_seq_len <= {window} (twell train --init-from: "
                         f"--set model.max_seq_len={window})")
    theta, scaling = _rope(hf)
    return ModelConfig(vocab_size=int(need("vocab_size")), d_model=d_model, n_layers=int(need("num_hidden_layers")),
                       n_heads=n_heads, n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
                       d_ff=int(need("intermediate_size")), max_seq_len=context, rope_theta=theta,
                       rope_scaling=scaling, tie_embeddings=tie, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       ffn_kind=kind, ffn_backend=ffn_backend, compute_dtype=compute_dtype)


def _read_json(path: Path) -> Any:
    """json.loads of a checkpoint's JSON file; a damaged or non-UTF-8 file is an error naming it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def _load_safetensors(file: Path) -> dict[str, jax.Array]:
    """One safetensors file; a truncated or damaged file is an error naming it."""
    from safetensors.flax import load_file

    try:
        return load_file(str(file))
    except Exception as err:  # noqa: BLE001 (safetensors raises its own SafetensorError, or OSError)
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from None


def read_safetensors(path: str | Path) -> dict[str, jax.Array]:
    """All tensors of a checkpoint dir (`model.safetensors`, or the shards of its index)."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        index = _read_json(path / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX_FILE} has no weight_map")
        tensors: dict[str, jax.Array] = {}
        for shard in sorted(set(weight_map.values())):
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise ValueError(f"{path / INDEX_FILE}: shard {shard!r} is not a file name in the checkpoint directory")
            if not (path / shard).is_file():
                raise FileNotFoundError(f"shard {shard} listed in {path / INDEX_FILE} is missing")
            tensors.update(_load_safetensors(path / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"tensors listed in {INDEX_FILE} but absent from the shards: {missing[:5]}")
        return tensors
    if (path / WEIGHTS_FILE).is_file():
        return _load_safetensors(path / WEIGHTS_FILE)
    raise FileNotFoundError(f"{path} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def params_from_hf(tensors: dict[str, jax.Array], cfg: ModelConfig,
                   down_proj_layout: str = "auto") -> dict[str, Any]:
    """Our params dict (f32) from HF Llama tensors; errors name any missing, misshapen, non-float
    or non-finite tensor (a restored checkpoint is held to the same rule)."""
    if down_proj_layout not in DOWN_PROJ_LAYOUTS:
        raise ValueError(f"down_proj_layout must be one of {DOWN_PROJ_LAYOUTS}, got {down_proj_layout!r}")
    d, h, kv = cfg.d_model, cfg.d_ff, cfg.kv_dim
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...] | None = None) -> jax.Array:
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        used.add(name)
        raw = jnp.asarray(tensors[name])
        if not jnp.issubdtype(raw.dtype, jnp.floating):
            raise ValueError(f"tensor {name!r} has dtype {raw.dtype}, expected floating point weights")
        value = raw.astype(jnp.float32)
        if shape is not None and value.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {shape}")
        bad = int(jnp.size(value) - jnp.sum(jnp.isfinite(value)))
        if bad:
            raise ValueError(f"tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf): a damaged checkpoint")
        return value

    def down(name: str) -> jax.Array:
        value = get(name)
        layout = down_proj_layout
        if layout == "auto":
            if d == h:
                raise ValueError(f"{name}: hidden_size == intermediate_size ({d}), so the down_proj layout cannot "
                                 "be told from its shape; pass down_proj_layout='hf' ([D, H], transformers) or "
                                 "'transposed' ([H, D], the reference's hybrid-kernel checkpoints)")
            layout = "hf" if value.shape == (d, h) else "transposed" if value.shape == (h, d) else None
            if layout is None:
                raise ValueError(f"tensor {name!r} has shape {value.shape}, expected [{d}, {h}] or [{h}, {d}]")
        expected = (d, h) if layout == "hf" else (h, d)
        if value.shape != expected:
            raise ValueError(f"tensor {name!r} has shape {value.shape}, expected {expected} ({layout} layout)")
        return value.T if layout == "hf" else value

    embed = get("model.embed_tokens.weight", (cfg.vocab_size, d))
    head = {}
    if not cfg.tie_embeddings:
        head["lm_head"] = get("lm_head.weight", (cfg.vocab_size, d))
    elif "lm_head.weight" in tensors:
        if not bool(jnp.array_equal(get("lm_head.weight", (cfg.vocab_size, d)), embed)):
            raise ValueError("lm_head.weight differs from model.embed_tokens.weight, but config.json has "
                             "tie_word_embeddings true: a damaged checkpoint, or set tie_word_embeddings false")
    blocks = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        attn = {"w_q": get(f"{p}self_attn.q_proj.weight", (d, d)).T,
                **{f"w_{n}": get(f"{p}self_attn.{n}_proj.weight", (kv, d)).T for n in ("k", "v")}}
        attn["w_out"] = get(f"{p}self_attn.o_proj.weight", (d, d)).T
        ffn = {"w_gate": get(f"{p}mlp.gate_proj.weight", (h, d)), "w_up": get(f"{p}mlp.up_proj.weight", (h, d)),
               "w_down": down(f"{p}mlp.down_proj.weight")}
        blocks.append({"attn": attn, "ffn": ffn,
                       "attn_norm": {"scale": get(f"{p}input_layernorm.weight", (d,))},
                       "ffn_norm": {"scale": get(f"{p}post_attention_layernorm.weight", (d,))}})
    params = {"embed": embed, "blocks": stack_layers(blocks), "final_norm": {"scale": get("model.norm.weight", (d,))},
              **head}
    # Rotary tables some exporters store are recomputed here; any other leftover is a real mismatch.
    unused = sorted(n for n in set(tensors) - used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint tensors not used by a {cfg.n_layers}-layer Llama: {unused[:5]}")
    return params


def import_hf(path: str | Path, *, dtype: str = "float32", ffn_kind: str | None = None,
              ffn_backend: str = "auto", down_proj_layout: str = "auto",
              tokenizer: str | Path | None = None, max_seq_len: int | None = None) -> LoadedModel:
    """Load a HF Llama / Mistral checkpoint dir as our model (params cast to `dtype`), with a tokenizer.

    `ffn_kind`: for hidden_act relu, "twell" (default, the sparse op with `ffn_backend`) or
    "relu_gated" (dense); for silu "swiglu" (default), or "twell" / "relu_gated" to sparsify it
    (the gate's SiLU becomes a ReLU: not the checkpoint's function until fine-tuned, docs/training.md).
    `tokenizer`: a tokenizer.json (or a directory holding one) to use, an error when it does not
    exist or, for a checkpoint with its own tokenizer.json, when it is not that one (their
    `tokenizer_hash`es differ); default the checkpoint's own tokenizer.json when it has one, else no
    tokenizer (generation then takes token ids). The result's `tokenizer_hash` is the checkpoint's
    own tokenizer's (None without one). `max_seq_len`: the context (default the checkpoint's
    max_position_embeddings; a Mistral sliding_window must be at least this long)."""
    from twell_jax.data import tokenizer as tokenizer_lib

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE} (expected a Hugging Face checkpoint directory)")
    own_file = path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else None
    if tokenizer is None:
        tokenizer_file = own_file
    else:
        tokenizer_file = Path(tokenizer).expanduser()
        tokenizer_file = tokenizer_file / TOKENIZER_FILE if tokenizer_file.is_dir() else tokenizer_file
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer={str(tokenizer)!r}: no such file (expected a {TOKENIZER_FILE} or a "
                                    "directory holding one)")
    hf = _read_json(path / CONFIG_FILE)
    if not isinstance(hf, dict):
        raise ValueError(f"{path / CONFIG_FILE}: expected a JSON object, got {type(hf).__name__}")
    try:
        model_cfg = model_config_from_hf(hf, ffn_kind=ffn_kind, ffn_backend=ffn_backend, compute_dtype=dtype,
                                         max_seq_len=max_seq_len)
    except (TypeError, KeyError, ValueError) as err:  # a missing, unsupported or mistyped field
        text = str(err).removeprefix(f"{CONFIG_FILE}: ").removeprefix(CONFIG_FILE + " ")
        raise ValueError(f"{path / CONFIG_FILE}: {text}") from None
    if hf_activation(model_cfg.ffn_kind) != hf["hidden_act"]:
        logger.warning("%s: hidden_act %s imported as ffn_kind %s: the gate's activation is now a ReLU, so the model "
                       "computes another function than the checkpoint's until it is fine-tuned (sparsification)",
                       path, hf["hidden_act"], model_cfg.ffn_kind)
    params = params_from_hf(read_safetensors(path), model_cfg, down_proj_layout)
    tok = None if tokenizer_file is None else tokenizer_lib.load_tokenizer(str(tokenizer_file))
    if tok is not None and tok.get_vocab_size() > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer {tokenizer_file} has {tok.get_vocab_size()} tokens but the model's "
                         f"vocab_size is {model_cfg.vocab_size}: not this model's tokenizer")
    own_hash = None  # the identity of the tokenizer the weights come with
    if own_file is not None and tokenizer_file == own_file:
        own_hash = tokenizer_lib.tokenizer_hash(tok)
    elif own_file is not None:  # another tokenizer given for a checkpoint that has its own: the same one only
        own_hash = tokenizer_lib.tokenizer_file_hash(own_file)
        tokenizer_lib.check_same_tokenizer(tokenizer_lib.tokenizer_hash(tok), f"tokenizer={str(tokenizer)!r}",
                                           own_hash, f"the checkpoint's own ({own_file})",
                                           "leave the tokenizer out to use the checkpoint's own")
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    cfg = experiment_config_for(model_cfg, name=path.name or "hf",
                                tokenizer_path=None if tokenizer_file is None else str(tokenizer_file))
    return LoadedModel(model=model_with_params(model_cfg, params, dtype), config=cfg, tokenizer=tok,
                       step=None, eos_id=None if eos is None else int(eos), tokenizer_hash=own_hash)


def hf_config_from_model(cfg: ModelConfig, *, eos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A LlamaForCausalLM `config.json` dict for our model config (RoPE in transformers 4's fields,
    rope_theta and rope_scaling, which transformers 5 reads too)."""
    act = hf_activation(cfg.ffn_kind)
    if act is None:
        raise ValueError(f"ffn_kind={cfg.ffn_kind!r} has no Llama layout (a Llama MLP is gated: export "
                         f"{tuple(name for name in FFN_KIND_TABLE if hf_activation(name))})")
    special = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}
    scaling = cfg.rope_scaling_params
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": act,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": None if scaling is None else scaling.to_dict(), "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
            "torch_dtype": dtype, **special}


def hf_generation_config(eos_id: int | None) -> dict[str, Any]:
    """The `generation_config.json` of an export: the special tokens `generate` stops on."""
    return {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}


def hf_tensors_from_params(params: dict[str, Any], cfg: ModelConfig) -> dict[str, jax.Array]:
    """HF Llama tensors (HF layout, down_proj [D, H]) from our params dict (the inverse of params_from_hf)."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"]
    for i in range(cfg.n_layers):
        block, p = layer_slice(params["blocks"], i), f"model.layers.{i}."
        for n in ("q", "k", "v"):
            out[f"{p}self_attn.{n}_proj.weight"] = block["attn"][f"w_{n}"].T
        out[f"{p}self_attn.o_proj.weight"] = block["attn"]["w_out"].T
        out[f"{p}mlp.gate_proj.weight"] = block["ffn"]["w_gate"]
        out[f"{p}mlp.up_proj.weight"] = block["ffn"]["w_up"]
        out[f"{p}mlp.down_proj.weight"] = block["ffn"]["w_down"].T
        out[f"{p}input_layernorm.weight"] = block["attn_norm"]["scale"]
        out[f"{p}post_attention_layernorm.weight"] = block["ffn_norm"]["scale"]
    return out


def check_export_dir(out_dir: str | Path) -> Path:
    """`out_dir` as a Path when an export may write there (it does not exist, or is an empty
    directory); a FileExistsError naming it otherwise. Callers check before loading a model."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory; refusing to overwrite it")
    return out_dir


def shard_names(tensors: dict[str, jax.Array], max_shard_bytes: int) -> dict[str, list[str]]:
    """{file name: its tensors' names} of an export: one `model.safetensors` when every tensor
    fits `max_shard_bytes`, else `model-0000i-of-0000n.safetensors` filled in the tensors' order,
    each up to max_shard_bytes (a larger tensor alone in its shard), as save_pretrained shards."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
    groups: list[list[str]] = [[]]
    size = 0
    for name, value in tensors.items():
        if groups[-1] and size + value.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += value.nbytes
    if len(groups) == 1:
        return {WEIGHTS_FILE: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": names for i, names in enumerate(groups)}


def export_hf(model: LoadedModel | Transformer, out_dir: str | Path, *, cfg: ModelConfig | None = None,
              tokenizer: Any = None, dtype: str = "float32", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `out_dir` = config.json + generation_config.json + the weights (+ tokenizer.json and
    tokenizer_config.json) in the Llama layout: model.safetensors, or, when the weights exceed
    `max_shard_bytes`, shards and their model.safetensors.index.json (`shard_names`; transformers
    and `read_safetensors` read both).

    `tokenizer`: the one to write (default a LoadedModel's own); it must be the one the weights
    were trained with where that is known (`LoadedModel.tokenizer_hash`): the export's
    tokenizer.json imports with that hash.

    `out_dir` must not exist or be empty; everything is written to a temporary sibling first and
    renamed into place, so a failed export leaves nothing behind."""
    from safetensors.flax import save_file

    from twell_jax.data import tokenizer as tokenizer_lib

    if isinstance(model, LoadedModel):
        if tokenizer is not None and model.tokenizer_hash is not None:
            tokenizer_lib.check_same_tokenizer(tokenizer_lib.tokenizer_hash(tokenizer), "tokenizer=",
                                               model.tokenizer_hash, "the one the model's weights were trained with",
                                               "leave tokenizer= out to export the model's own")
        cfg, tokenizer, eos_id, module = model.config.model, tokenizer or model.tokenizer, model.eos_id, model.model
    else:
        if cfg is None:
            raise ValueError("export_hf of a bare Transformer needs cfg= (its ModelConfig)")
        module, eos_id = model, None
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    out_dir = check_export_dir(out_dir)
    if eos_id is None and tokenizer is not None:
        eos_id = tokenizer.token_to_id("<|endoftext|>")
    hf = hf_config_from_model(cfg, eos_id=eos_id, dtype=dtype)  # first: refuses kinds without a Llama layout
    params = split_model(module)[1]
    # A transposed jax array is a new row-major buffer: safetensors takes it as it is.
    tensors = {name: jnp.asarray(value, dtype) for name, value in hf_tensors_from_params(params, cfg).items()}
    shards = shard_names(tensors, max_shard_bytes)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for file, names in shards.items():
            save_file({name: tensors[name] for name in names}, str(tmp / file), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(value.nbytes for value in tensors.values())},
                     "weight_map": {name: file for file, names in shards.items() for name in names}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(hf_generation_config(eos_id), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER_FILE))
            # So that transformers' AutoTokenizer (and lm-eval's `hf` backend through it) knows the
            # class, the end-of-text token (lm-eval's prefix of an empty context) and the context.
            eos = tokenizer.id_to_token(eos_id) if eos_id is not None else None
            (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                 "clean_up_tokenization_spaces": False, **({"eos_token": eos} if eos is not None else {})},
                indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


__all__ = ["ARCHITECTURES", "DEFAULT_MAX_SHARD_BYTES", "DOWN_PROJ_LAYOUTS", "export_hf", "hf_config_from_model",
           "hf_generation_config", "hf_tensors_from_params", "import_hf", "model_config_from_hf", "params_from_hf",
           "read_safetensors", "shard_names"]
