"""Batching: the shuffled, process-sharded training batches (served by Grain) and the fixed-order
validation batches, over a table of packed sequences (`[n, seq_len + 1]`, indexable by an int
array or a slice: a memory-mapped corpus cache or the synthetic source)."""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

Batch = dict[str, np.ndarray]  # {"tokens": int32[local_batch, seq_len + 1]}


class SequenceTable(Protocol):
    """Packed sequences: `len()` rows of seq_len + 1 token ids."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> np.ndarray: ...


class BatchIterator(Protocol):
    """The training iterator: infinite, with a JSON-ready position for checkpoints."""

    def __iter__(self) -> "BatchIterator": ...

    def __next__(self) -> Batch: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


class TrainBatchSource:
    """Random access: step -> this process's slice of global batch `step` (infinite length).

    Global example j (j = 0, 1, ...) is packed sequence perm_e[j mod n] with e = j // n and perm_e
    a permutation of the n training sequences keyed by (seed, e): every epoch visits each sequence
    once, in a new order, and batches run on across epoch boundaries (nothing is dropped). Global
    batch s is examples [s*G, (s+1)*G); process p takes [s*G + p*L, s*G + (p+1)*L), L = G / P.

    Our own permutation rather than Grain's `shuffle`: seeds get independent epochs (Grain reseeds
    epoch e with seed + e, so seed 0's second epoch would equal seed 1's first).
    """

    def __init__(self, sequences: SequenceTable, *, seed: int, global_batch: int, process_index: int,
                 process_count: int):
        self._sequences = sequences
        self._num_sequences = len(sequences)
        self._seed = seed
        self._global_batch = global_batch
        self._local_batch = global_batch // process_count
        self._process_index = process_index
        # Two epochs cover any batch that straddles an epoch boundary; threads share the cache.
        self._permutation = functools.lru_cache(maxsize=2)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(self._num_sequences)

    def __len__(self) -> int:
        return sys.maxsize

    def sequence_ids(self, step: int) -> np.ndarray:
        """Indices (into the packed training sequences) of this process's batch at `step`."""
        start = step * self._global_batch + self._process_index * self._local_batch
        positions = np.arange(start, start + self._local_batch, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self._num_sequences)
        ids = np.empty(self._local_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            ids[in_epoch] = self._permutation(int(epoch))[offsets[in_epoch]]
        return ids

    def __getitem__(self, step: int) -> Batch:
        return {"tokens": np.asarray(self._sequences[self.sequence_ids(int(step))], dtype=np.int32)}


def grain_iterator(source: TrainBatchSource, *, num_threads: int, prefetch: int) -> BatchIterator:
    """A Grain `MapDataset` iterator over `source` at step 0 (state `{"next_index": int}`):
    `num_threads` reader threads gather batches `prefetch` steps ahead."""
    import grain

    read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(grain.MapDataset.source(source).to_iter_dataset(read_options))


def val_batches(sequences: SequenceTable, *, batch_size: int, max_batches: int | None, process_index: int,
                process_count: int, describe: str) -> Iterator[Batch]:
    """Validation batches in a fixed order. `batch_size` is global; each process gets its slice. The
    last partial batch is dropped, so every process yields the same number of batches. `describe`
    says what the split holds (for the error when it is smaller than one batch)."""
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(f"batch_size={batch_size}: expected a positive multiple of process_count={process_count}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches={max_batches}: expected None or a positive integer")
    num_batches = len(sequences) // batch_size
    if num_batches == 0:
        raise ValueError(f"batch_size={batch_size}: {describe} holds only {len(sequences)} sequences; use a smaller "
                         "batch (train.eval_batch_size)")
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return _iter_val(sequences, batch_size // process_count, batch_size, num_batches, process_index)


def _iter_val(sequences: SequenceTable, local: int, batch_size: int, num_batches: int,
              process_index: int) -> Iterator[Batch]:
    for step in range(num_batches):
        start = step * batch_size + process_index * local
        yield {"tokens": np.asarray(sequences[start:start + local], dtype=np.int32)}
