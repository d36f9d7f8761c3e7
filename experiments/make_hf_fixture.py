"""Build the tiny Hugging Face Llama fixtures under tests/fixtures/ with the real `transformers`.

    pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install transformers
    python experiments/make_hf_fixture.py [--out tests/fixtures]

For each MLP variant (hidden_act relu: the ReLU-gated model; silu: SwiGLU) it builds a random
LlamaForCausalLM (2 layers, hidden 64, 4 heads, intermediate 96, vocab 128, tied embeddings,
rope_theta 1e5), saves it with `save_pretrained` (config.json + model.safetensors) and writes the
float32 logits of `transformers` for fixed token ids: `token_ids.npy` [2, 12] and `logits.npy`
[2, 12, 128]. (The tests derive the reference's transposed-down_proj variant from `llama_relu`.)
transformers and torch are NOT dependencies of twell-jax; the tests read the committed files.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

VARIANTS = {"llama_relu": "relu", "llama_silu": "silu"}


def build(out: Path, name: str, act: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act=act, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm scales, so a swapped norm is caught
        for module_name, param in model.named_parameters():
            if "norm" in module_name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    target = out / name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, cfg.vocab_size, size=(2, 12)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(token_ids)).logits.float().numpy()
    np.save(target / "token_ids.npy", token_ids.astype(np.int32))
    np.save(target / "logits.npy", logits.astype(np.float32))
    print(f"{target}: hidden_act={act}, logits {logits.shape}, |logits| max {np.abs(logits).max():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed, (name, act) in enumerate(VARIANTS.items()):
        build(out, name, act, seed)
    total = sum(p.stat().st_size for name in VARIANTS for p in (out / name).iterdir())
    print(json.dumps({"total_bytes": total}))


if __name__ == "__main__":
    main()
