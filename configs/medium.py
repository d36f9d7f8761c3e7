"""medium: 124.5M parameters (124,472,064), the quality study's size after `small` (one GPU, hours).

The model: GPT-2-small's width and depth with the paper's ratios: d_model 768, 12 layers, 12 heads
(head dim 64), d_ff 2112 (2.75 x d_model: the paper's 5632 / 2048, and a multiple of 64), vocab
49152 and context 2048 (the paper's), `twell` FFN with backend `auto`, bf16 compute.

Compute-optimal at 20 tokens per parameter: 2.49B tokens, here 4750 steps of 256 x 2048 =
524,288 tokens (2,490,368,000 tokens, 20.0 per parameter). The optimizer is the paper's (AdamW lr
1e-3, betas (0.9, 0.95), weight decay 0.1, clip 1.0, cosine to 0) with a warm-up of 250 steps, 5%
of the run as `small`'s 100 of 2000.

L1 3e-3, ramped from 0 over the first 250 steps: the `small` study's choice (BENCHMARKS.md,
"Quality": 3e-3 ramped over 300 steps kept 0.68% of d_ff active at a validation CE 0.69% above the
dense twin). Not measured at this size: each layer feels lambda / n_layers (docs/training.md), so
3e-3 over 12 layers presses each layer two thirds as hard as over `small`'s 8; a study sweeps
around it (`twell compare --config medium --l1 1e-3 3e-3 4.5e-3`).

Data: the offline `installed` corpus (138.4M tokens at this vocabulary on the GPU image,
BENCHMARKS.md "Data") with a BPE of the model's vocabulary: a compute-optimal run reads its training
split about 19 times. For 2.49B distinct tokens set data.source (and data.tokenizer) to a larger corpus.
Micro-batch 16 per device (16 accumulation steps on one GPU) is a starting point that fits, not a
measured fastest (`experiments/bench_step.py` measures it, as for the paper's sizes).
"""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig

STEPS = 4750  # 2,490,368,000 tokens: 20 per parameter
WARMUP_STEPS = 250  # learning rate and L1 ramps (5% of the run)


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="medium",
        model=ModelConfig(vocab_size=49152, d_model=768, n_layers=12, n_heads=12, d_ff=2112, max_seq_len=2048,
                          ffn_kind="twell", ffn_backend="auto", compute_dtype="bfloat16"),
        optim=OptimConfig(lr=1e-3, warmup_steps=WARMUP_STEPS, schedule="cosine", b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_norm=1.0),
        sparsity=SparsityConfig(l1_coef=3e-3, l1_warmup_start=0, l1_warmup_end=WARMUP_STEPS),
        train=TrainConfig(steps=STEPS, global_batch=256, micro_batch=16, log_every=10, eval_every=500,
                          eval_batches=16, eval_batch_size=32, checkpoint_every=500),
        data=DataConfig(source="installed", vocab_size=49152, seq_len=2048),
    )
