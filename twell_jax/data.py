"""Data pipeline: documents -> tokens (cached, memory-mapped) -> packed sequences -> shuffled,
process-sharded batches of `{"tokens": int32[global_batch // process_count, seq_len + 1]}`.

Stages (each a function below, run in this order by `build_data`):
1. List the source's files (`_list_source_files`) and fingerprint them (path, size, mtime).
2. Read documents in a fixed order (`iter_documents`) and split them into train / validation by
      document with `split_seed` (`_select_val_documents`).
3. Train a byte-level BPE on the training documents, or load a user `tokenizer.json`; cached.
4. Tokenize every document, append the end-of-text id, concatenate per split and store each split
      as a flat `.npy` token stream in a cache directory keyed by a hash of everything that affects it.
5. View each stream as non-overlapping windows of `seq_len + 1` tokens (the remainder of each split,
      fewer than `seq_len + 1` tokens, is dropped) and serve shuffled global batches through a Grain
      `MapDataset` (or an equivalent plain-Python iterator where Grain is not installed).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from twell_jax import tokenizer as tokenizer_lib
from twell_jax.config import DataConfig

if TYPE_CHECKING:  # pragma: no cover - typing only
        from tokenizers import Tokenizer

# Bump when the cache layout or the tokenization/packing semantics change: old caches become misses.
_CACHE_FORMAT_VERSION = 1
_TEXT_SUFFIXES = (".txt",)
_JSONL_SUFFIXES = (".jsonl",)
_PARQUET_SUFFIXES = (".parquet",)
_SUPPORTED_SUFFIXES = _TEXT_SUFFIXES + _JSONL_SUFFIXES + _PARQUET_SUFFIXES
# Directories of the interpreter's lib dir that are not the standard library itself.
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# ----------------------------------------------------------------------------------------------
# Sources: listing, fingerprinting and reading documents.


@dataclasses.dataclass(frozen=True)
class _SourceFile:
    kind: str  # "python" (stdlib .py), "txt", "jsonl" or "parquet"
    path: str


def _kind_of(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(_TEXT_SUFFIXES):
        return "txt"
    if lower.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return None


def stdlib_root() -> str:
    """The directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def _list_source_files(cfg: DataConfig) -> list[_SourceFile]:
    """The source's files in a fixed (sorted) order; clear errors for missing or unknown paths."""
    if cfg.source == "stdlib":
        root = stdlib_root()
        files = []
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIPPED_DIRS)
            files.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
        if not files:
            raise ValueError(f"source='stdlib': found no .py files under {root}")
        return [_SourceFile("python", p) for p in sorted(files)]
    path = os.path.expanduser(cfg.source)
    if not os.path.exists(path):
        raise ValueError(f"source={cfg.source!r}: no such file or directory")
    if os.path.isfile(path):
        kind = _kind_of(path)
        if kind is None:
            raise ValueError(
                    f"source={cfg.source!r}: unknown file type {os.path.splitext(path)[1]!r}; expected "
                    f"'stdlib', a directory, or a file ending in one of {_SUPPORTED_SUFFIXES}"
            )
        return [_SourceFile(kind, path)]
    files = []
    for directory, subdirs, names in os.walk(path):
        subdirs.sort()
        for name in names:
            kind = _kind_of(name)
            if kind is not None:
                files.append(_SourceFile(kind, os.path.join(directory, name)))
    if not files:
        raise ValueError(
                f"source={cfg.source!r}: the directory holds no file ending in one of {_SUPPORTED_SUFFIXES}"
        )
    return sorted(files, key=lambda f: f.path)


def _read_text(path: str) -> str:
    # errors="replace": a stray non-UTF-8 byte (the stdlib's own tests contain some on purpose)
    # must not abort a build; it becomes U+FFFD.
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _iter_file_documents(source_file: _SourceFile, cfg: DataConfig) -> Iterator[str]:
    if source_file.kind == "python":
        yield _read_text(source_file.path)
    elif source_file.kind == "txt":
        text = _read_text(source_file.path)
        if cfg.txt_separator is None:
            yield text
        else:
            yield from text.split(cfg.txt_separator)
    elif source_file.kind == "jsonl":
        with open(source_file.path, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{source_file.path}:{line_number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: not valid JSON ({error})") from None
                if not isinstance(record, dict) or cfg.text_field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                            f"{where}: JSONL line has no {cfg.text_field!r} field (found {keys}); set "
                            "DataConfig.text_field to the key holding the document text"
                    )
                text = record[cfg.text_field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{where}: field {cfg.text_field!r} is {type(text).__name__}, expected a string"
                    )
                yield text
    elif source_file.kind == "parquet":
        import pyarrow.parquet as pq

        parquet_file = pq.ParquetFile(source_file.path)
        columns = parquet_file.schema_arrow.names
        if cfg.text_field not in columns:
            raise ValueError(
                    f"{source_file.path}: Parquet file has no {cfg.text_field!r} column "
                    f"(columns: {columns}); set DataConfig.text_field to the column holding the "
                    "document text"
            )
        for record_batch in parquet_file.iter_batches(columns=[cfg.text_field], batch_size=1024):
            for text in record_batch.column(0).to_pylist():
                if text is not None:  # null rows are empty documents
                    yield text
    else:  # pragma: no cover - _kind_of only produces the kinds above
        raise AssertionError(source_file.kind)


def iter_documents(cfg: DataConfig, files: list[_SourceFile] | None = None) -> Iterator[str]:
    """The source's non-empty documents in a fixed order, at most `cfg.max_documents` of them.

    Document i of this sequence is "document i" everywhere else (split, document ids).
    """
    files = _list_source_files(cfg) if files is None else files
    produced = 0
    for source_file in files:
        for text in _iter_file_documents(source_file, cfg):
            if not text:
                continue
            yield text
            produced += 1
            if cfg.max_documents is not None and produced >= cfg.max_documents:
                return


def _fingerprint(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _source_fingerprint(cfg: DataConfig, files: list[_SourceFile]) -> dict[str, Any]:
    """What identifies the document sequence: the file listing (path, size, mtime) and settings."""
    listing = []
    for source_file in files:
        stat = os.stat(source_file.path)
        listing.append([os.path.abspath(source_file.path), stat.st_size, stat.st_mtime_ns])
    return {
            "version": _CACHE_FORMAT_VERSION,
            "source": cfg.source,
            "listing": listing,
            "max_documents": cfg.max_documents,
            "text_field": cfg.text_field,
            "txt_separator": cfg.txt_separator,
            "val_fraction": cfg.val_fraction,
            "split_seed": cfg.split_seed,
    }


def _select_val_documents(num_documents: int, cfg: DataConfig) -> np.ndarray:
    """Boolean mask over documents: True = held out. Exactly round(val_fraction * n), at least 1."""
    if num_documents == 0:
        raise ValueError(f"source={cfg.source!r}: the corpus has no non-empty documents")
    is_val = np.zeros(num_documents, dtype=bool)
    if cfg.val_fraction == 0:
        return is_val
    num_val = max(1, round(cfg.val_fraction * num_documents))
    if num_val >= num_documents:
        raise ValueError(
                f"val_fraction={cfg.val_fraction}: the corpus has only {num_documents} document(s), too few "
                f"to hold out {num_val} and keep one for training; add documents (or set txt_separator to "
                "split .txt files) or set val_fraction=0"
        )
    rng = np.random.default_rng(cfg.split_seed)
    is_val[rng.choice(num_documents, size=num_val, replace=False)] = True
    return is_val


# ----------------------------------------------------------------------------------------------
# Caches: built in a private temporary directory, then renamed into place (atomic, so concurrent
# processes or an interrupted build never leave a half-written cache behind).


def _log(cfg: DataConfig, message: str) -> None:
    if cfg.progress:
        print(f"[twell_jax.data] {message}", file=sys.stderr, flush=True)


def _publish(tmp_dir: str, final_dir: str) -> None:
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not os.path.isdir(final_dir):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)  # another process published the same cache first


def _new_tmp_dir(final_dir: str) -> str:
    tmp_dir = f"{final_dir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp_dir)
    return tmp_dir


def _get_tokenizer(
        cfg: DataConfig, files: list[_SourceFile], source_fp: dict[str, Any],
        is_val_fn: Callable[[], np.ndarray],
) -> tuple["Tokenizer", str, bool]:
    """(tokenizer, path of its tokenizer.json, whether this call trained it)."""
    if cfg.tokenizer != "bpe":
        path = tokenizer_lib.resolve_tokenizer_path(cfg.tokenizer)
        return tokenizer_lib.load_tokenizer(path), path, False
    key = _fingerprint(
            {"source": source_fp, "vocab_size": cfg.vocab_size, "eot_token": cfg.eot_token,
              "min_frequency": cfg.bpe_min_frequency}
    )
    final_dir = os.path.join(os.path.expanduser(cfg.cache_dir), "tokenizers", f"bpe-{key}")
    path = os.path.join(final_dir, "tokenizer.json")
    if os.path.isfile(path):
        _log(cfg, f"BPE tokenizer: cached at {path}")
        return tokenizer_lib.load_tokenizer(path), path, False
    is_val = is_val_fn()
    num_train = int((~is_val).sum())
    _log(cfg, f"training a byte-level BPE (vocab {cfg.vocab_size}) on {num_train} training documents"
              f" of {cfg.source!r}; caching it at {path}")
    start = time.perf_counter()
    train_docs = (d for d, held_out in zip(iter_documents(cfg, files), is_val) if not held_out)
    trained = tokenizer_lib.train_bpe(
            train_docs, vocab_size=cfg.vocab_size, eot_token=cfg.eot_token, num_documents=num_train,
            min_frequency=cfg.bpe_min_frequency, show_progress=cfg.progress,
    )
    tmp_dir = _new_tmp_dir(final_dir)
    trained.save(os.path.join(tmp_dir, "tokenizer.json"))
    _publish(tmp_dir, final_dir)
    _log(cfg, f"BPE trained in {time.perf_counter() - start:.1f}s ({trained.get_vocab_size()} tokens)")
    return tokenizer_lib.load_tokenizer(path), path, True


def _token_dtype(vocab_size: int) -> np.dtype:
    # uint16 halves the cache (and the page cache it occupies) for vocabularies up to 65536.
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _write_npy_from_raw(raw_path: str, npy_path: str, dtype: np.dtype) -> int:
    """Turns a raw token file into an .npy (so np.load can memory-map it); returns its length."""
    num_tokens = os.path.getsize(raw_path) // dtype.itemsize
    if num_tokens == 0:
        np.save(npy_path, np.zeros(0, dtype))
    else:
        raw = np.memmap(raw_path, dtype=dtype, mode="r", shape=(num_tokens,))
        out = np.lib.format.open_memmap(npy_path, mode="w+", dtype=dtype, shape=(num_tokens,))
        block = 1 << 24
        for start in range(0, num_tokens, block):
            out[start:start + block] = raw[start:start + block]
        out.flush()
        del out, raw
    os.remove(raw_path)
    return num_tokens


def _build_token_cache(
        cfg: DataConfig, files: list[_SourceFile], tok: "Tokenizer", eot_id: int, is_val: np.ndarray,
        final_dir: str,
) -> None:
    """Tokenizes every document into train.npy / val.npy (+ document ids and lengths, meta.json)."""
    from tqdm.auto import tqdm

    dtype = _token_dtype(tok.get_vocab_size())
    tmp_dir = _new_tmp_dir(final_dir)
    raw = {split: open(os.path.join(tmp_dir, f"{split}.raw"), "wb") for split in ("train", "val")}
    doc_lengths: dict[str, list[int]] = {"train": [], "val": []}
    start = time.perf_counter()
    progress_bar = tqdm(
            total=len(is_val), unit="doc", disable=not cfg.progress,
            desc=f"tokenizing {cfg.source} -> {final_dir}",
    )

    def flush(batch: list[str], first_doc: int) -> None:
        for offset, ids in enumerate(tokenizer_lib.encode_documents(tok, batch)):
            split = "val" if is_val[first_doc + offset] else "train"
            ids.append(eot_id)
            raw[split].write(np.asarray(ids, dtype=dtype).tobytes())
            doc_lengths[split].append(len(ids))
        progress_bar.update(len(batch))

    try:
        batch: list[str] = []
        first_doc = 0
        for doc_index, text in enumerate(iter_documents(cfg, files)):
            if not batch:
                first_doc = doc_index
            batch.append(text)
            if len(batch) == cfg.encode_chunk_documents:
                flush(batch, first_doc)
                batch = []
        if batch:
            flush(batch, first_doc)
    finally:
        progress_bar.close()
        for handle in raw.values():
            handle.close()
    meta: dict[str, Any] = {"version": _CACHE_FORMAT_VERSION, "vocab_size": tok.get_vocab_size(),
                                                    "eot_id": eot_id, "dtype": dtype.name}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        num_tokens = _write_npy_from_raw(
                os.path.join(tmp_dir, f"{split}.raw"), os.path.join(tmp_dir, f"{split}.npy"), dtype
        )
        np.save(os.path.join(tmp_dir, f"{split}_doc_ids.npy"), np.flatnonzero(mask).astype(np.int64))
        np.save(os.path.join(tmp_dir, f"{split}_doc_lengths.npy"), np.asarray(doc_lengths[split], np.int64))
        meta[f"num_{split}_tokens"] = num_tokens
        meta[f"num_{split}_documents"] = int(mask.sum())
    with open(os.path.join(tmp_dir, "meta.json"), "w") as handle:
        json.dump(meta, handle, indent=1)
    _publish(tmp_dir, final_dir)
    _log(cfg, f"tokenized {len(is_val)} documents ({meta['num_train_tokens']} train + "
              f"{meta['num_val_tokens']} val tokens) in {time.perf_counter() - start:.1f}s")


def _load_tokens(path: str) -> np.ndarray:
    # Memory-mapped: a corpus larger than RAM is paged in on demand; batches gather rows from it.
    return np.load(path, mmap_mode="r")


# ----------------------------------------------------------------------------------------------
# Batches.


class _TrainBatchSource:
    """Random access: step -> this process's slice of global batch `step` (infinite length).

    Global example j (j = 0, 1, ...) is packed sequence perm_e[j mod n] with e = j // n and perm_e
    a permutation of the n training sequences keyed by (seed, e): every epoch visits each sequence
    once, in a new order, and batches run on across epoch boundaries (nothing is dropped). Global
    batch s is examples [s*G, (s+1)*G); process p takes [s*G + p*L, s*G + (p+1)*L), L = G / P.

    Our own permutation (rather than grain's `shuffle`) keeps the batches identical with and
    without Grain, and gives seeds independent epochs (grain reseeds epoch e with seed + e, so seed
    0's second epoch would equal seed 1's first).
    """

    def __init__(self, sequences: np.ndarray, *, seed: int, global_batch: int, process_index: int,
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

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return {"tokens": np.asarray(self._sequences[self.sequence_ids(int(step))], dtype=np.int32)}


class PythonBatchIterator:
    """Plain-Python twin of Grain's MapDataset iterator: same batches, same state format
    (`{"next_index": int}`), so a checkpoint written with one restores into the other."""

    def __init__(self, source: _TrainBatchSource):
        self._source = source
        self._next_index = 0

    def __iter__(self) -> "PythonBatchIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self._source[self._next_index]
        self._next_index += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"next_index": self._next_index}

    def set_state(self, state: dict[str, int]) -> None:
        next_index = state["next_index"]
        if not isinstance(next_index, int) or next_index < 0:
            raise ValueError(f"state['next_index']={next_index!r}: expected a non-negative integer")
        self._next_index = next_index


def _grain_available() -> bool:
    try:
        import grain  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass
class DataBundle:
    """Everything the trainer needs: vocabulary facts, the train iterator, validation batches."""

    config: DataConfig
    vocab_size: int  # the tokenizer's vocabulary size (model embedding size)
    eot_id: int  # end-of-text id appended to every document
    tokenizer: "Tokenizer"
    tokenizer_path: str  # the tokenizer.json in use (trained BPE: inside cache_dir)
    cache_path: str  # directory holding the token caches of this build
    global_batch: int
    process_index: int
    process_count: int
    train_sequences: np.ndarray  # [num_train_sequences, seq_len + 1], memory-mapped, token dtype
    val_sequences: np.ndarray  # [num_val_sequences, seq_len + 1]
    train_document_ids: np.ndarray  # indices (in source order) of the training documents
    val_document_ids: np.ndarray  # indices of the held-out documents
    num_train_tokens: int  # tokens in the training split (with end-of-text ids, before packing)
    num_val_tokens: int
    built_tokenizer: bool  # True when this call trained the BPE (False: cache hit or user file)
    built_tokens: bool  # True when this call tokenized the corpus (False: cache hit)
    train_iter: Any = None  # grain DatasetIterator or PythonBatchIterator; see make_train_iter

    def __post_init__(self) -> None:
        if self.train_iter is None:
            self.train_iter = self.make_train_iter()

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.process_count

    @property
    def num_train_sequences(self) -> int:
        return len(self.train_sequences)

    @property
    def num_val_sequences(self) -> int:
        return len(self.val_sequences)

    @property
    def num_train_documents(self) -> int:
        return len(self.train_document_ids)

    @property
    def num_val_documents(self) -> int:
        return len(self.val_document_ids)

    def train_batch_source(self) -> _TrainBatchSource:
        """Random access to this process's training batches by step (what the iterator walks)."""
        return _TrainBatchSource(
                self.train_sequences, seed=self.config.seed, global_batch=self.global_batch,
                process_index=self.process_index, process_count=self.process_count,
        )

    def make_train_iter(self):
        """A fresh training iterator at step 0 (restore a checkpoint into it with set_state)."""
        source = self.train_batch_source()
        use_grain = self.config.iterator == "grain" or (
                self.config.iterator == "auto" and _grain_available()
        )
        if not use_grain:
            return PythonBatchIterator(source)
        import grain

        read_options = grain.ReadOptions(
                num_threads=self.config.num_threads, prefetch_buffer_size=self.config.prefetch
        )
        return iter(grain.MapDataset.source(source).to_iter_dataset(read_options))

    def val_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Validation batches in a fixed order: `batch_size` is global (like `global_batch`); each
        process gets its slice, `{"tokens": int32[batch_size // process_count, seq_len + 1]}`. Every
        process yields the same number of batches; the last partial batch is dropped."""
        if batch_size < 1 or batch_size % self.process_count:
            raise ValueError(
                    f"batch_size={batch_size}: expected a positive multiple of "
                f"process_count={self.process_count}"
            )
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches={max_batches}: expected None or a positive integer")
        if self.config.val_fraction == 0:
            raise ValueError("val_batches: no validation split (DataConfig.val_fraction=0)")
        num_batches = self.num_val_sequences // batch_size
        if num_batches == 0:
            raise ValueError(
                    f"batch_size={batch_size}: the validation split has only {self.num_val_sequences} "
                    f"sequences of seq_len + 1 = {self.seq_len + 1} tokens ({self.num_val_tokens} tokens in "
                    f"{self.num_val_documents} documents); use a smaller batch_size or a larger val_fraction"
            )
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        return self._iter_val(batch_size, num_batches)

    def _iter_val(self, batch_size: int, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
        local = batch_size // self.process_count
        for step in range(num_batches):
            start = step * batch_size + self.process_index * local
            yield {"tokens": np.asarray(self.val_sequences[start:start + local], dtype=np.int32)}


def _pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens (a view; the remainder is dropped)."""
    window = seq_len + 1
    num_sequences = len(tokens) // window
    return tokens[: num_sequences * window].reshape(num_sequences, window)


def build_data(
        cfg: DataConfig, *, global_batch: int, process_index: int = 0, process_count: int = 1
) -> DataBundle:
    """Builds (or loads from cache) the tokenizer and token streams and returns the batch pipeline."""
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch}: expected a positive integer")
    if process_count < 1:
        raise ValueError(f"process_count={process_count}: expected a positive integer")
    if global_batch % process_count:
        raise ValueError(
                f"global_batch={global_batch} is not divisible by process_count={process_count}: every "
                "process must get the same number of sequences"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index}: expected 0 <= process_index < {process_count}")
    start = time.perf_counter()
    files = _list_source_files(cfg)
    source_fp = _source_fingerprint(cfg, files)
    is_val_cache: list[np.ndarray] = []

    def is_val_fn() -> np.ndarray:
        # Counting documents reads the corpus once more; only done when something must be built.
        if not is_val_cache:
            num_documents = sum(1 for _ in iter_documents(cfg, files))
            is_val_cache.append(_select_val_documents(num_documents, cfg))
        return is_val_cache[0]

    tok, tokenizer_path, built_tokenizer = _get_tokenizer(cfg, files, source_fp, is_val_fn)
    eot_id = tokenizer_lib.eot_token_id(tok, cfg.eot_token, where=repr(cfg.tokenizer))
    tokens_key = _fingerprint(
            {"source": source_fp, "tokenizer": tokenizer_lib.file_sha256(tokenizer_path),
              "eot_token": cfg.eot_token}
    )
    cache_path = os.path.join(os.path.expanduser(cfg.cache_dir), "tokens", tokens_key)
    built_tokens = not os.path.isfile(os.path.join(cache_path, "meta.json"))
    if built_tokens:
        _build_token_cache(cfg, files, tok, eot_id, is_val_fn(), cache_path)
    else:
        _log(cfg, f"tokens: cached at {cache_path}")
    with open(os.path.join(cache_path, "meta.json")) as handle:
        meta = json.load(handle)
    train_sequences = _pack(_load_tokens(os.path.join(cache_path, "train.npy")), cfg.seq_len)
    val_sequences = _pack(_load_tokens(os.path.join(cache_path, "val.npy")), cfg.seq_len)
    if len(train_sequences) < global_batch:
        raise ValueError(
                f"corpus too small: the training split has {len(train_sequences)} sequences of seq_len + 1 "
                f"= {cfg.seq_len + 1} tokens ({meta['num_train_tokens']} tokens in "
                f"{meta['num_train_documents']} documents), but one batch needs global_batch={global_batch} "
                "sequences; use more documents (source / max_documents), a smaller seq_len or a smaller "
                "global_batch"
        )
    bundle = DataBundle(
            config=cfg, vocab_size=tok.get_vocab_size(), eot_id=eot_id, tokenizer=tok,
            tokenizer_path=tokenizer_path, cache_path=cache_path, global_batch=global_batch,
            process_index=process_index, process_count=process_count, train_sequences=train_sequences,
            val_sequences=val_sequences,
            train_document_ids=np.load(os.path.join(cache_path, "train_doc_ids.npy")),
            val_document_ids=np.load(os.path.join(cache_path, "val_doc_ids.npy")),
            num_train_tokens=int(meta["num_train_tokens"]), num_val_tokens=int(meta["num_val_tokens"]),
            built_tokenizer=built_tokenizer, built_tokens=built_tokens,
    )
    _log(cfg, f"data ready in {time.perf_counter() - start:.2f}s: vocab {bundle.vocab_size}, "
              f"{bundle.num_train_sequences} train / {bundle.num_val_sequences} val sequences of "
              f"{cfg.seq_len + 1} tokens ({bundle.num_train_documents} / {bundle.num_val_documents} "
         "documents)")
    return bundle


def main(argv: list[str] | None = None) -> None:
    """`python -m twell_jax.data`: build (and cache) a dataset and print its statistics."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--source", default="stdlib")
    parser.add_argument("--tokenizer", default="bpe")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--cache-dir", default=DataConfig.cache_dir)
    args = parser.parse_args(argv)
    cfg = DataConfig(
            source=args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size, seq_len=args.seq_len,
            max_documents=args.max_documents, cache_dir=args.cache_dir,
    )
    start = time.perf_counter()
    bundle = build_data(cfg, global_batch=args.global_batch)
    built = time.perf_counter() - start
    batch = next(bundle.train_iter)
    print(f"built in {built:.2f}s (trained BPE: {bundle.built_tokenizer}, tokenized: "
                f"{bundle.built_tokens}); first batch {batch['tokens'].shape} {batch['tokens'].dtype}; "
                f"train tokens {bundle.num_train_tokens}, val tokens {bundle.num_val_tokens}")


if __name__ == "__main__":
    main()
