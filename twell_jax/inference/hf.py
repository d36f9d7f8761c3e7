"""Hugging Face Llama interop: import a `LlamaForCausalLM` checkpoint, export ours to that layout.

A Llama checkpoint directory holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`), and optionally `tokenizer.json`. Layouts:

Our blocks are stacked over layers (`blocks.<name>` is [L, ...]); `blocks.i` below is layer i's slice.

| HF tensor (torch Linear: [out, in])            | ours                                    |
|------------------------------------------------|-----------------------------------------|
| model.embed_tokens.weight [V, D]               | embed [V, D] (tied output head)         |
| model.layers.i.self_attn.{q,k,v}_proj [N*K, D] | blocks.i.attn.w_{q,k,v} [D, N*K] (= .T) |
| model.layers.i.self_attn.o_proj [D, N*K]       | blocks.i.attn.w_out [N*K, D] (= .T)     |
| model.layers.i.mlp.{gate,up}_proj [H, D]       | blocks.i.ffn.w_{gate,up} [H, D] (as is) |
| model.layers.i.mlp.down_proj [D, H]            | blocks.i.ffn.w_down [H, D] (= .T)       |
| model.layers.i.{input,post_attention}_layernorm | blocks.i.{attn,ffn}_norm.scale          |
| model.norm.weight                              | final_norm.scale                        |

The paper's reference code stores `down_proj` transposed ([H, D]) in checkpoints saved from its
hybrid-kernel runs (docs/training.md, last section): `down_proj_layout="auto"` recognises it by shape
when D != H; when D == H the layout cannot be told from the shape and must be given
("hf" or "transposed"). RoPE: HF Llama's `rotate_half` pairs (x[i], x[i + K/2]), as ours does,
with inv_freq = theta^(-2i/K), the same. `hidden_act` "relu" is our relu-gated FFN (imported as
`twell`, the sparse op, or `relu_gated`), "silu" is `swiglu`. Only tied embeddings, full
multi-head attention (no grouped KV heads), no biases and no RoPE scaling are representable.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from twell_jax.config import ModelConfig
from twell_jax.inference.load import LoadedModel, experiment_config_for, model_with_params
from twell_jax.model import Transformer, layer_slice, split_model, stack_layers

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DOWN_PROJ_LAYOUTS = ("auto", "hf", "transposed")
# transformers' LlamaConfig default for a config.json without rope_theta (LlamaConfig(rope_theta=10000.0)).
HF_DEFAULT_ROPE_THETA = 10000.0
_ACT_TO_KIND = {"relu": ("twell", "relu_gated"), "silu": ("swiglu",)}
_KIND_TO_ACT = {"twell": "relu", "relu_gated": "relu", "swiglu": "silu"}


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from a Llama config (top level, or `rope_parameters` in transformers >= 5)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise ValueError(f"config.json: rope_type {rope_type!r} (RoPE scaling) is not supported; only plain RoPE")
    theta = hf.get("rope_theta", params.get("rope_theta"))
    if theta is None:  # what transformers' LlamaConfig assumes for such a file
        return HF_DEFAULT_ROPE_THETA
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"config.json: rope_theta={theta!r}, expected a positive number")
    return float(theta)


def model_config_from_hf(hf: dict[str, Any], *, ffn_kind: str | None = None, ffn_backend: str = "auto",
                         compute_dtype: str = "float32") -> ModelConfig:
    """Our ModelConfig for a HF Llama `config.json` dict; unsupported features are errors."""
    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"config.json lacks {key!r} (not a Llama config?)")
        return hf[key]

    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r}, expected 'llama'")
    d_model, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    if int(hf.get("num_key_value_heads") or n_heads) != n_heads:
        raise ValueError(f"config.json: num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads="
                         f"{n_heads}; grouped-query attention is not supported (our attention is full MHA)")
    if hf.get("head_dim") not in (None, d_model // n_heads):
        raise ValueError(f"config.json: head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("config.json: attention_bias / mlp_bias are not supported (our model has no biases)")
    if not hf.get("tie_word_embeddings", False):
        raise ValueError("config.json: tie_word_embeddings is false; our model ties the output head to the "
                         "embedding (an untied head is accepted only if it equals the embedding: set the flag)")
    act = need("hidden_act")
    if act not in _ACT_TO_KIND:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (relu -> twell / relu_gated, "
                         "silu -> swiglu)")
    kind = ffn_kind or _ACT_TO_KIND[act][0]
    if kind not in _ACT_TO_KIND[act]:
        raise ValueError(f"ffn_kind={kind!r} does not match hidden_act={act!r} (allowed: {_ACT_TO_KIND[act]})")
    return ModelConfig(vocab_size=int(need("vocab_size")), d_model=d_model, n_layers=int(need("num_hidden_layers")),
                       n_heads=n_heads, d_ff=int(need("intermediate_size")),
                       max_seq_len=int(need("max_position_embeddings")), rope_theta=_rope_theta(hf),
                       norm_eps=float(hf.get("rms_norm_eps", 1e-6)), ffn_kind=kind, ffn_backend=ffn_backend,
                       compute_dtype=compute_dtype)


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
    d, h = cfg.d_model, cfg.d_ff
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
    if "lm_head.weight" in tensors:
        if not bool(jnp.array_equal(get("lm_head.weight", (cfg.vocab_size, d)), embed)):
            raise ValueError("lm_head.weight differs from model.embed_tokens.weight: an untied output head is not "
                             "supported")
    blocks = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        attn = {f"w_{n}": get(f"{p}self_attn.{n}_proj.weight", (d, d)).T for n in ("q", "k", "v")}
        attn["w_out"] = get(f"{p}self_attn.o_proj.weight", (d, d)).T
        ffn = {"w_gate": get(f"{p}mlp.gate_proj.weight", (h, d)), "w_up": get(f"{p}mlp.up_proj.weight", (h, d)),
               "w_down": down(f"{p}mlp.down_proj.weight")}
        blocks.append({"attn": attn, "ffn": ffn,
                       "attn_norm": {"scale": get(f"{p}input_layernorm.weight", (d,))},
                       "ffn_norm": {"scale": get(f"{p}post_attention_layernorm.weight", (d,))}})
    params = {"embed": embed, "blocks": stack_layers(blocks), "final_norm": {"scale": get("model.norm.weight", (d,))}}
    # Rotary tables some exporters store are recomputed here; any other leftover is a real mismatch.
    unused = sorted(n for n in set(tensors) - used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"checkpoint tensors not used by a {cfg.n_layers}-layer Llama: {unused[:5]}")
    return params


def import_hf(path: str | Path, *, dtype: str = "float32", ffn_kind: str | None = None,
              ffn_backend: str = "auto", down_proj_layout: str = "auto",
              tokenizer: str | Path | None = None) -> LoadedModel:
    """Load a HF Llama checkpoint dir as our model (params cast to `dtype`), with a tokenizer.

    `ffn_kind`: for hidden_act relu, "twell" (default, the sparse op with `ffn_backend`) or
    "relu_gated" (dense); "swiglu" for silu. `tokenizer`: a tokenizer.json (or a directory holding
    one) to use, an error when it does not exist; default the checkpoint's own tokenizer.json when
    it has one, else no tokenizer (generation then takes token ids)."""
    from twell_jax.data import tokenizer as tokenizer_lib

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE} (expected a Hugging Face checkpoint directory)")
    if tokenizer is None:
        tokenizer_file = path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else None
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
        model_cfg = model_config_from_hf(hf, ffn_kind=ffn_kind, ffn_backend=ffn_backend, compute_dtype=dtype)
    except (TypeError, KeyError, ValueError) as err:  # a missing, unsupported or mistyped field
        text = str(err).removeprefix(f"{CONFIG_FILE}: ").removeprefix(CONFIG_FILE + " ")
        raise ValueError(f"{path / CONFIG_FILE}: {text}") from None
    params = params_from_hf(read_safetensors(path), model_cfg, down_proj_layout)
    tok = None if tokenizer_file is None else tokenizer_lib.load_tokenizer(str(tokenizer_file))
    if tok is not None and tok.get_vocab_size() > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer {tokenizer_file} has {tok.get_vocab_size()} tokens but the model's "
                         f"vocab_size is {model_cfg.vocab_size}: not this model's tokenizer")
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    cfg = experiment_config_for(model_cfg, name=path.name or "hf",
                                tokenizer_path=None if tokenizer_file is None else str(tokenizer_file))
    return LoadedModel(model=model_with_params(model_cfg, params, dtype), config=cfg, tokenizer=tok,
                       step=None, eos_id=None if eos is None else int(eos))


def hf_config_from_model(cfg: ModelConfig, *, eos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A LlamaForCausalLM `config.json` dict for our model config."""
    if cfg.ffn_kind not in _KIND_TO_ACT:
        raise ValueError(f"ffn_kind={cfg.ffn_kind!r} has no Llama layout (a Llama MLP is gated: export "
                         f"{tuple(_KIND_TO_ACT)})")
    special = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_heads, "head_dim": cfg.head_dim, "hidden_act": _KIND_TO_ACT[cfg.ffn_kind],
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": None, "vocab_size": cfg.vocab_size, "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": cfg.init_std,
            "torch_dtype": dtype, **special}


def hf_generation_config(eos_id: int | None) -> dict[str, Any]:
    """The `generation_config.json` of an export: the special tokens `generate` stops on."""
    return {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}


def hf_tensors_from_params(params: dict[str, Any], cfg: ModelConfig) -> dict[str, jax.Array]:
    """HF Llama tensors (HF layout, down_proj [D, H]) from our params dict (the inverse of params_from_hf)."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"]}
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


def export_hf(model: LoadedModel | Transformer, out_dir: str | Path, *, cfg: ModelConfig | None = None,
              tokenizer: Any = None, dtype: str = "float32") -> Path:
    """Write `out_dir` = config.json + generation_config.json + model.safetensors (+ tokenizer.json)
    in the Llama layout.

    `out_dir` must not exist or be empty; everything is written to a temporary sibling first and
    renamed into place, so a failed export leaves nothing behind."""
    from safetensors.flax import save_file

    if isinstance(model, LoadedModel):
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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(hf_generation_config(eos_id), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(str(tmp / TOKENIZER_FILE))
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


__all__ = ["DOWN_PROJ_LAYOUTS", "export_hf", "hf_config_from_model", "hf_generation_config", "hf_tensors_from_params", "import_hf",
           "model_config_from_hf", "params_from_hf", "read_safetensors"]
