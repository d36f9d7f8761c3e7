"""The paper's models (its section 5): d_model 2048, d_ff 5632, 32 heads, vocab 49152, context 2048.

0.5b / 1b / 1.5b / 2b = 8 / 18 / 28 / 38 layers. 1M-token global batch (512 x 2048), micro-batch 8
per device, AdamW lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 (not on norms), 600 warm-up
steps then cosine to 0 over 30000 steps, clip 1.0, L1 2e-5 (the paper's recommendation; its run
configs used 3e-4 for 0.5B/1B/2B), bf16 compute. The data section points at a local fineweb-edu
copy with the SmolLM2 tokenizer; set data.source / data.tokenizer to your paths.

Rematerialisation (`REMAT`): the fastest policy that fits an 80 GB GPU at micro-batch 8 x 2048.
0.5b without remat was measured to fit on an H100 80GB (issue 9). The others are estimates: per
device 20 bytes per parameter (fp32 params, gradients, their accumulation buffer, two Adam
moments), plus per layer ~1.1 GB of saved activations without remat at 16384 tokens (six [M, D]
and three [M, H] bf16 tensors), ~0.47 GB with "ffn" (the FFN sub-block recomputed), ~0.07 GB
with "full", plus ~8 GB around the LM head (fp32 logits and their gradient):
    0.5b  N = 0.51B: 10 + 9 + 8 = ~28 GB with "none"
    1b    N = 1.03B: 21 + 20 + 8 = ~49 GB with "none"
    1.5b  N = 1.54B: 31 + 31 + 8 = ~70 GB with "none" (too close to 80), ~52 GB with "ffn"
    2b    N = 2.05B: 41 + 18 + 8 = ~67 GB with "ffn" (too close), ~52 GB with "full"
Measure with `experiments/bench_step.py --config 2b --optimizer --variants twell:ffn,twell:full`
and lower the policy where a larger GPU allows it (`--set model.remat=none`).
"""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig

LAYERS = {"0.5b": 8, "1b": 18, "1.5b": 28, "2b": 38}
REMAT = {"0.5b": "none", "1b": "none", "1.5b": "ffn", "2b": "full"}  # module docstring says why


def get_config(name: str) -> ExperimentConfig:
    return ExperimentConfig(
        name=name,
        model=ModelConfig(vocab_size=49152, d_model=2048, n_layers=LAYERS[name], n_heads=32, d_ff=5632,
                          max_seq_len=2048, rope_theta=100_000.0, ffn_kind="twell", ffn_backend="auto",
                          compute_dtype="bfloat16", remat=REMAT[name]),
        optim=OptimConfig(lr=1e-3, warmup_steps=600, schedule="cosine", b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_norm=1.0),
        sparsity=SparsityConfig(l1_coef=2e-5),
        train=TrainConfig(steps=30_000, global_batch=512, micro_batch=8, seed=42, log_every=10,
                          eval_every=1000, eval_batches=16, eval_batch_size=64, checkpoint_every=1000),
        data=DataConfig(source="data/fineweb-edu", tokenizer="data/SmolLM2-360M/tokenizer.json",
                        vocab_size=49152, seq_len=2048, seed=42, val_fraction=0.001),
    )
