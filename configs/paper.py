"""The paper's models (its section 5): d_model 2048, d_ff 5632, 32 heads, vocab 49152, context 2048.

0.5b / 1b / 1.5b / 2b = 8 / 18 / 28 / 38 layers. 1M-token global batch (512 x 2048), micro-batch 8
per device, AdamW lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 (not on norms), 600 warm-up
steps then cosine to 0 over 30000 steps, clip 1.0, L1 2e-5 (the paper's recommendation; its run
configs used 3e-4 for 0.5B/1B/2B), bf16 compute. The data section points at a local fineweb-edu
copy with the SmolLM2 tokenizer; set data.source / data.tokenizer to your paths.

Rematerialisation (`REMAT`) and the layer loop (`LAYER_UNROLL`, model.layer_unroll), measured on
one H100 80GB (JAX 0.11.2, 2026-11-24, trained-sparse checkpoints of each size, `bench_step
--optimizer` at micro-batch 8; BENCHMARKS.md, "The paper's sizes"):
    0.5b  remat none, all 8 layers in one loop iteration (layer_unroll 0): the dense twin 103.3 ms
          = 1.005x plain JAX (the loop: 0.913x, its per-layer residual slices are copied); sparse
          `auto` 1.197x the twin; twin 17.6 GiB compiled, step compile 5-36 s.
    1b    remat none, the loop (layer_unroll 1): twin 231 ms, 33.5 GiB; `auto` 1.222x, `pallas`
          29.6 GiB; step compile 5-16 s (unrolled, `pallas` would take ~4.5 s a layer: over a minute).
    1.5b  remat none, the loop (layer_unroll 1): twin 352 ms, 49.5 GiB compiled (55.3 GiB peak), at
          0.896x plain JAX in the same process (the loop copies each layer's saved values,
          docs/model.md); `auto` 1.210x the twin (1.084x plain JAX), `pallas` 1.188x and 42.8 GiB
          (-13.6%); step compile 6-22 s. Prefill: `auto` 1.282x the twin at 0.764x its energy.
    2b    remat full, the loop: twin 520 ms, 35.0 GiB; `auto` 1.238x; step compile 6-19 s (all 38
          layers unrolled: 184 s for `pallas`); `twell train --config 2b` did its first step 43 s
          after the command with the data cached, all layers unrolled (its step compiled in 26 s).
Lighter remat policies and larger micro-batches at 1b-2b (what the sparse model's saved memory
could buy) are not measured yet: `experiments/bench_step.py --checkpoint RUN --optimizer
--variants relu_gated:dots,twell@auto:dots,twell@auto:none [--micro-batch 16]`.
"""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig

LAYERS = {"0.5b": 8, "1b": 18, "1.5b": 28, "2b": 38}
REMAT = {"0.5b": "none", "1b": "none", "1.5b": "none", "2b": "full"}  # module docstring says why
LAYER_UNROLL = {"0.5b": 0, "1b": 1, "1.5b": 1, "2b": 1}  # module docstring says why


def get_config(name: str) -> ExperimentConfig:
    return ExperimentConfig(
        name=name,
        model=ModelConfig(vocab_size=49152, d_model=2048, n_layers=LAYERS[name], n_heads=32, d_ff=5632,
                          max_seq_len=2048, rope_theta=100_000.0, ffn_kind="twell", ffn_backend="auto",
                          compute_dtype="bfloat16", remat=REMAT[name], layer_unroll=LAYER_UNROLL[name]),
        optim=OptimConfig(lr=1e-3, warmup_steps=600, schedule="cosine", b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_norm=1.0),
        sparsity=SparsityConfig(l1_coef=2e-5),
        train=TrainConfig(steps=30_000, global_batch=512, micro_batch=8, seed=42, log_every=10,
                          eval_every=1000, eval_batches=16, eval_batch_size=64, checkpoint_every=1000),
        data=DataConfig(source="data/fineweb-edu", tokenizer="data/SmolLM2-360M/tokenizer.json",
                        vocab_size=49152, seq_len=2048, seed=42, val_fraction=0.001),
    )
