"""The synthetic source: random token ids, computed on demand from a counter hash (no corpus, no
tokenizer, no cache). Row r of split s holds hash(seed, s, r, position) mod vocab_size, so any
row is reproducible alone, from any process, at any seq_len and vocabulary."""
from __future__ import annotations

import numpy as np

# splitmix64 constants (Steele, Lea and Flood 2014): a cheap bijective mixer of 64-bit counters.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wrap-around arithmetic is intended)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


class SyntheticSequences:
    """A read-only [num_sequences, width] int32 table of random ids; rows are computed when indexed
    (an int array, a slice or an int), like the memory-mapped table of a real corpus."""

    def __init__(self, *, seed: int, split: int, num_sequences: int, width: int, vocab_size: int):
        if num_sequences < 0 or width < 1 or vocab_size < 1:
            raise ValueError(f"SyntheticSequences: bad shape ({num_sequences}, {width}) or vocab {vocab_size}")
        self._key = _mix64(np.array([seed * 2 + split], np.uint64))[0]
        self._num_sequences = num_sequences
        self._width = width
        self._vocab_size = vocab_size

    @property
    def shape(self) -> tuple[int, int]:
        return (self._num_sequences, self._width)

    def __len__(self) -> int:
        return self._num_sequences

    def __getitem__(self, index: int | slice | np.ndarray) -> np.ndarray:
        if isinstance(index, slice):
            # Only the rows the slice selects (a table may hold ~1e6 rows; a batch wants a few).
            rows_K = np.arange(*index.indices(self._num_sequences), dtype=np.int64)
        else:
            rows_K = np.asarray(index, dtype=np.int64)
        if rows_K.size and (rows_K.min() < 0 or rows_K.max() >= self._num_sequences):
            raise IndexError(f"row index out of range for {self._num_sequences} synthetic sequences")
        counters_KxW = (rows_K.astype(np.uint64)[..., None] * np.uint64(self._width)
                        + np.arange(self._width, dtype=np.uint64))
        ids_KxW = _mix64(counters_KxW ^ self._key) % np.uint64(self._vocab_size)
        return ids_KxW.astype(np.int32)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        table = self[np.arange(self._num_sequences)]
        return table if dtype is None else table.astype(dtype)
