"""Named experiment presets: `get_config("tiny")`, `list_configs()`.

Each preset module defines `get_config() -> ExperimentConfig`:
- tiny: CPU demo (2 cores, under 3 minutes for `twell compare`): 4 layers, d_model 128, d_ff 512, seq 128, BPE 2048.
- small: tens of millions of parameters, minutes on one GPU.
- medium: 124.5M parameters (d_model 768, 12 layers, vocab 49152, context 2048), the quality study's next
  size: 4750 steps of 0.5M tokens = 2.49B tokens, compute-optimal at 20 tokens per parameter (hours on one GPU).
- 0.5b / 1b / 1.5b / 2b: the paper's models ("Sparser, Faster, Lighter Transformer Language Models", section 5),
  sparse; 0.5b-twin / ... / 2b-twin: their dense twins (relu_gated, no L1). Each at the remat policy and
  micro-batch measured fastest for it on one H100 (configs/paper.py).
- micro: a few-second model for tests.
"""
from __future__ import annotations

import importlib

from twell_jax.config import ExperimentConfig

from .paper import names as _paper_names

_MODULES = {"micro": "micro", "tiny": "tiny", "small": "small", "medium": "medium",
            **{name: "paper" for name in _paper_names()}}


def list_configs() -> list[str]:
    return list(_MODULES)


def get_config(name: str) -> ExperimentConfig:
    """The preset called `name` (ValueError listing the presets otherwise)."""
    if name not in _MODULES:
        raise ValueError(f"unknown config {name!r}; available: {', '.join(_MODULES)}")
    module = importlib.import_module(f".{_MODULES[name]}", __name__)
    if _MODULES[name] == "paper":
        return module.get_config(name)
    return module.get_config()
