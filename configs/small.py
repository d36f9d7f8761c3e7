"""small: ~30M parameters, a few minutes on one GPU (bf16, stdlib corpus, 8k BPE)."""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="small",
        model=ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, d_ff=1408, max_seq_len=512,
                          ffn_kind="twell", ffn_backend="auto", compute_dtype="bfloat16"),
        optim=OptimConfig(lr=1e-3, warmup_steps=100, weight_decay=0.1),
        sparsity=SparsityConfig(l1_coef=2e-3),
        train=TrainConfig(steps=2000, global_batch=64, micro_batch=64, log_every=10, eval_every=500,
                          eval_batches=8, eval_batch_size=32, checkpoint_every=500),
        data=DataConfig(source="stdlib", vocab_size=8192, seq_len=512),
    )
