"""micro: a seconds-long model for tests (2 layers, d_model 32, d_ff 64, seq 16, BPE 300)."""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="micro",
        model=ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16,
                          ffn_kind="twell", ffn_backend="auto", compute_dtype="float32"),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        sparsity=SparsityConfig(l1_coef=1e-3),
        train=TrainConfig(steps=4, global_batch=8, micro_batch=8, log_every=1, eval_batches=2,
                          eval_batch_size=8, num_devices=1, tensorboard=False, progress_bar=False),
        data=DataConfig(source="stdlib", vocab_size=300, seq_len=16, max_documents=40, progress=False),
    )
