"""tiny: the CPU demo behind `twell compare --config tiny` (the README's first command: both runs
in under 3 minutes on 2 CPU cores; the README quotes the measured figures).

4 layers, d_model 128, 4 heads, d_ff 512, seq 128, 2048-token BPE on the Python stdlib; 200 steps
of 8 sequences. fp32 compute (bf16 matmuls are slower than fp32 on CPU). L1 coefficient chosen by
measurement (see docs): large because tiny models have small hidden activations.
"""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny",
        model=ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, d_ff=512, max_seq_len=128,
                          ffn_kind="twell", ffn_backend="auto", compute_dtype="float32"),
        optim=OptimConfig(lr=3e-3, warmup_steps=30, weight_decay=0.1),
        sparsity=SparsityConfig(l1_coef=3e-3),
        train=TrainConfig(steps=200, global_batch=8, micro_batch=8, log_every=10, eval_batches=16,
                          eval_batch_size=16, checkpoint_every=50),
        data=DataConfig(source="stdlib", vocab_size=2048, seq_len=128),
    )
