"""Data pipeline: documents -> tokens (cached, memory-mapped) -> packed sequences -> shuffled,
process-sharded Grain batches of `{"tokens": int32[global_batch // process_count, seq_len + 1]}`.

One job per module, in pipeline order:
- `sources`: list a corpus's files (plain, `.gz`, `.zst`), read documents as a stream in a fixed
  order, split train / validation;
- `tokenizer`: train a byte-level BPE on the training documents (cached) or load a tokenizer.json;
- `cache`: tokenize into flat `.npy` streams in a cache keyed by everything that affects them;
- `cache_dir`: a cache directory's key, private build directory and atomic publish (both caches);
- `packing`: view a stream as windows of seq_len + 1 tokens;
- `synthetic`: random token ids in place of the first four stages (tests, benchmarks);
- `batching`: shuffled, sharded training batches through Grain; fixed-order validation batches;
- `bundle`: `DataSource`, the interface the trainer uses, and the builders of a `DataBundle` (a
  multi-process run builds the caches once: twell_jax/training/shared_data.py, its `build_once`).
`python -m twell_jax.data` builds (warms) a cache and prints its statistics.
"""
from twell_jax.config import DataConfig
from twell_jax.data.batching import Batch, BatchIterator
from twell_jax.data.bundle import DataBundle, DataSource, build_data, build_experiment_data, synthetic_data
from twell_jax.data.sources import iter_documents, stdlib_root

__all__ = ["Batch", "BatchIterator", "DataBundle", "DataConfig", "DataSource", "build_data",
           "build_experiment_data", "iter_documents", "stdlib_root", "synthetic_data"]
