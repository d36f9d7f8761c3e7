"""The paper's models (its section 5): d_model 2048, d_ff 5632, 32 heads, vocab 49152, context 2048.

0.5b / 1b / 1.5b / 2b = 8 / 18 / 28 / 38 layers. 1M-token global batch (512 x 2048; the paper's
micro-batch is 8 per device, ours is measured: below), AdamW lr 1e-3, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1 (not on norms), 600 warm-up steps then cosine to 0 over 30000 steps, clip 1.0, L1
2e-5 (the paper's recommendation; its run configs used 3e-4 for 0.5B/1B/2B), bf16 compute. The data section points at a local fineweb-edu
copy with the SmolLM2 tokenizer; set data.source / data.tokenizer to your paths.

Execution (`EXECUTION`: remat policy and micro-batch per device) is what was measured fastest on one
H100 80GB (JAX 0.11.2, 2026-11-24; `bench_step --optimizer` on a trained-sparse checkpoint of each
size; BENCHMARKS.md, "Remat and micro-batch per size"), for the sparse model (`NAME`, the `twell`
FFN) and its dense twin (`NAME-twin`, the `relu_gated` FFN, no L1) separately: each runs at its own
fastest configuration that fits, for the sparse model also while it is still dense (the start of a
run). Tokens/s, each at its best (the sparse model against the twin):
    0.5b  both remat none, micro-batch 16: twin 167,398 (+3.6% over micro-batch 8; 28.5 GiB compiled),
          sparse `auto` 205,522 (+8.8%), 1.228x.
    1b    both remat none, micro-batch 16: twin 75,020 (+5.0% over micro-batch 8), sparse `auto`
          96,692 (+9.5%), 1.289x.
    1.5b  sparse remat none, micro-batch 8: 54,819. Once sparse it is 12.9% faster at 16 (61,875,
          64.7 GiB compiled), but a run starts dense (at initialisation every layer's plan is the
          dense one, with the twin's memory) and `twell train` at none/16 ran out of memory at its
          first step. The twin cannot run remat none at 16 either (out of memory) and is fastest
          at remat dots, 16: 48,069 (none at 8: 47,415; ffn at 16: 47,255). Each at its best: 1.140x.
    2b    both remat none, micro-batch 8: twin 35,490 (dots 34,625, ffn 33,873, full 32,106; full at
          16: 33,293), sparse 43,664 (dots 43,127, full 39,865; full at 16: 42,758; dots at 16 out of
          memory), 1.230x (1.236x in a second process). The twin at remat none peaks at 73.2 GiB:
          it needs the 95% memory fraction the twell commands set (`parallel.claim_device_memory`).
The layer loop (`LAYER_UNROLL`, model.layer_unroll): `0.5b` runs all 8 layers in one loop
iteration (layer_unroll 0) for both models. From `1b` on "auto": the dense twin unrolled (its
step compiles in seconds, as plain JAX's does, and runs at about plain JAX's speed, without the
loop's copies of each layer's saved values: docs/model.md, "The loop", and BENCHMARKS.md, "The dense
twin at every size, unrolled"), the sparse model in the loop, whose step unrolled compiles for
minutes at these depths.
"""
from __future__ import annotations

from twell_jax.config import ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig
from twell_jax.config import DataConfig

SIZES = ("0.5b", "1b", "1.5b", "2b")
TWIN_SUFFIX = "-twin"  # `NAME-twin`: the dense twin of `NAME` at its own measured execution
LAYERS = {"0.5b": 8, "1b": 18, "1.5b": 28, "2b": 38}
# (remat, micro-batch per device) of the sparse model and of its dense twin: the module docstring says why.
EXECUTION = {
    "0.5b": {"sparse": ("none", 16), "twin": ("none", 16)},
    "1b": {"sparse": ("none", 16), "twin": ("none", 16)},
    "1.5b": {"sparse": ("none", 8), "twin": ("dots", 16)},
    "2b": {"sparse": ("none", 8), "twin": ("none", 8)},
}
LAYER_UNROLL = {"0.5b": 0, "1b": "auto", "1.5b": "auto", "2b": "auto"}  # module docstring says why


def names() -> list[str]:
    """The presets of this module: each size, then each size's dense twin."""
    return list(SIZES) + [size + TWIN_SUFFIX for size in SIZES]


def get_config(name: str) -> ExperimentConfig:
    twin = name.endswith(TWIN_SUFFIX)
    size = name[:-len(TWIN_SUFFIX)] if twin else name
    if size not in LAYERS:
        raise ValueError(f"unknown paper preset {name!r}; expected one of {', '.join(names())}")
    remat, micro_batch = EXECUTION[size]["twin" if twin else "sparse"]
    return ExperimentConfig(
        name=name,
        model=ModelConfig(vocab_size=49152, d_model=2048, n_layers=LAYERS[size], n_heads=32, d_ff=5632,
                          max_seq_len=2048, rope_theta=100_000.0, ffn_kind="relu_gated" if twin else "twell",
                          ffn_backend="auto", compute_dtype="bfloat16", remat=remat,
                          layer_unroll=LAYER_UNROLL[size]),
        optim=OptimConfig(lr=1e-3, warmup_steps=600, schedule="cosine", b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1, clip_norm=1.0),
        sparsity=SparsityConfig(l1_coef=0.0 if twin else 2e-5),
        train=TrainConfig(steps=30_000, global_batch=512, micro_batch=micro_batch, seed=42, log_every=10,
                          eval_every=1000, eval_batches=16, eval_batch_size=64, checkpoint_every=1000),
        data=DataConfig(source="data/fineweb-edu", tokenizer="data/SmolLM2-360M/tokenizer.json",
                        vocab_size=49152, seq_len=2048, seed=42, val_fraction=0.001),
    )
