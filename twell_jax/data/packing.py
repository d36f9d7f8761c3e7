"""Packing: a flat token stream viewed as non-overlapping windows of seq_len + 1 tokens."""
from __future__ import annotations

import numpy as np


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """[num_sequences, seq_len + 1] windows of a flat stream (a view, so a memory-mapped stream
    stays on disk); the remainder, fewer than seq_len + 1 tokens, is dropped."""
    if seq_len < 1:
        raise ValueError(f"data.seq_len={seq_len}: expected a positive integer")
    window = seq_len + 1
    num_sequences = len(tokens) // window
    return tokens[: num_sequences * window].reshape(num_sequences, window)
