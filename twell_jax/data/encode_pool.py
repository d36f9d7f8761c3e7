"""Tokenizing on every core: chunks of documents encoded by a pool of processes, results in input order.

Each worker loads the tokenizer from its `tokenizer.json` once and encodes whole chunks with its own
single thread (TOKENIZERS_PARALLELISM=false), so P workers keep P cores busy while this process reads,
hashes and writes. Output equals the in-process encoding token for token (tests check it), so the
number of workers is not part of any cache key.
"""
from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Iterable, Iterator

import numpy as np

from twell_jax.data.tokenizer import encode_documents, load_tokenizer

# Chunks in flight per worker: enough to hide the reader, bounded so a large corpus is never all in memory.
_CHUNKS_AHEAD_PER_WORKER = 2
_worker_state: dict[str, object] = {}


# With data.tokenize_workers=0, corpora of fewer chunks are encoded in this process (the Rust
# library's own threads): a spawned worker's start-up (importing the package, loading the
# tokenizer) costs more than it saves there (the stdlib's 4 chunks took longer with 2 workers
# than in this process on the shared 2-core machine).
POOL_MIN_CHUNKS = 16


def resolve_workers(requested: int, num_chunks: int) -> int:
    """Processes for `num_chunks` chunks: `data.tokenize_workers` when set (> 0), else every core
    once the corpus has POOL_MIN_CHUNKS chunks (1 below that); never more than the chunks."""
    if requested == 0:
        requested = (os.cpu_count() or 1) if num_chunks >= POOL_MIN_CHUNKS else 1
    return max(1, min(requested, num_chunks))


def _encode_chunk_with(tokenizer, texts: list[str], eot_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(every document's ids + eot, concatenated; each document's length with its eot)."""
    ids = encode_documents(tokenizer, texts)
    lengths = np.asarray([len(doc) + 1 for doc in ids], np.int64)
    flat = np.empty(int(lengths.sum()), dtype)
    ends = np.cumsum(lengths)
    for doc, end in zip(ids, ends):
        flat[end - len(doc) - 1:end - 1] = doc
        flat[end - 1] = eot_id
    return flat, lengths


def _init_worker(tokenizer_json_path: str, eot_id: int, dtype_name: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    _worker_state.update(tokenizer=load_tokenizer(tokenizer_json_path), eot_id=eot_id, dtype=np.dtype(dtype_name))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode_chunk_with(_worker_state["tokenizer"], texts, _worker_state["eot_id"], _worker_state["dtype"])


def encode_chunks(chunks: Iterable[list[str]], *, tokenizer, tokenizer_json_path: str, eot_id: int,
                  dtype: np.dtype, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For each chunk of texts, in order: (its documents' ids each followed by `eot_id`, flat;
    the documents' lengths). `workers` > 1 encodes in that many spawned processes (spawn, not fork:
    the caller may hold JAX's threads)."""
    if workers <= 1:
        for texts in chunks:
            yield _encode_chunk_with(tokenizer, texts, eot_id, dtype)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_json_path, eot_id, dtype.name)) as pool:
        pending: collections.deque = collections.deque()
        for texts in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= workers * _CHUNKS_AHEAD_PER_WORKER:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
