"""Build the tiny Hugging Face fixtures under tests/fixtures/ with the real `transformers`.

    pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install transformers
    python experiments/make_hf_fixture.py [--out tests/fixtures] [--only NAME ...]

Each is a random model (2 layers, hidden 64, 4 heads, intermediate 96, vocab 128, non-trivial norm
scales) saved with `save_pretrained` (config.json + model.safetensors), with the float32 logits of
`transformers` for fixed token ids: `token_ids.npy` [2, S] and `logits.npy` [2, S, 128].

- llama_relu / llama_silu: LlamaForCausalLM, hidden_act relu (the ReLU-gated model) / silu
  (SwiGLU), multi-head attention, tied embeddings, rope_theta 1e5, S = 12. (The tests derive the
  reference's transposed-down_proj variant from `llama_relu`.)
- llama3_gqa: Llama 3's shape: grouped-query attention (2 KV heads for 4 query heads), untied
  embeddings (lm_head), rope_theta 5e5 with rope_scaling llama3 (factor 8, low/high_freq_factor 1/4,
  original_max_position_embeddings 64, max_position_embeddings 128: at head dim 16 its 8 RoPE
  frequencies fall in all three bands of the scaling), SiLU; S = 40, so that the scaled low
  frequencies turn far enough to matter.
- mistral_gqa: MistralForCausalLM (GQA 4/2, untied, SiLU, rope_theta 1e4) with sliding_window 32
  below max_position_embeddings 64: imported with a context of at most 32 tokens; S = 12.

transformers and torch are NOT dependencies of twell-jax; the tests read the committed files.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=None)
# name -> (architecture, config fields besides COMMON, sequence length of the logits)
VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "llama_relu": ("llama", dict(num_key_value_heads=4, max_position_embeddings=64, rope_theta=100000.0,
                                 hidden_act="relu", tie_word_embeddings=True), 12),
    "llama_silu": ("llama", dict(num_key_value_heads=4, max_position_embeddings=64, rope_theta=100000.0,
                                 hidden_act="silu", tie_word_embeddings=True), 12),
    "llama3_gqa": ("llama", dict(num_key_value_heads=2, max_position_embeddings=128, hidden_act="silu",
                                 tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}), 40),
    "mistral_gqa": ("mistral", dict(num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                                    hidden_act="silu", tie_word_embeddings=False, sliding_window=32), 12),
}


def build(out: Path, name: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    arch, fields, seq_len = VARIANTS[name]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = config_cls(**COMMON, **fields)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm scales, so a swapped norm is caught
        for module_name, param in model.named_parameters():
            if "norm" in module_name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    target = out / name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, cfg.vocab_size, size=(2, seq_len)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(token_ids)).logits.float().numpy()
    np.save(target / "token_ids.npy", token_ids.astype(np.int32))
    np.save(target / "logits.npy", logits.astype(np.float32))
    print(f"{target}: {model_cls.__name__}, logits {logits.shape}, |logits| max {np.abs(logits).max():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="build these fixtures only")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(VARIANTS):  # each fixture's seed is its place in VARIANTS, whatever --only says
        if name in args.only:
            build(out, name, seed)
    total = sum(p.stat().st_size for name in args.only for p in (out / name).iterdir())
    print(json.dumps({"total_bytes": total}))


if __name__ == "__main__":
    main()
