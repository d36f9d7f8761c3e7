"""The token cache: build (every document tokenized by `encode_pool`'s processes, streamed to disk)
and load. It is built in a private temporary directory and renamed into place (`cache_dir`), so
concurrent processes or an interrupted build never leave a half-written cache behind."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import numpy as np

from twell_jax.config import DataConfig
from twell_jax.data.cache_dir import BuildProgress, log, new_tmp_dir, publish
from twell_jax.data.encode_pool import encode_chunks, resolve_workers
from twell_jax.data.sources import DocumentHasher, SourceFile, iter_documents

# Bump when the token cache's layout or the tokenization semantics change: old caches become
# misses. 2: meta.json holds the corpus content hash (`documents_sha256`).
TOKEN_CACHE_VERSION = 2
_META = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    # uint16 halves the cache (and the page cache it occupies) for vocabularies up to 65536.
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _write_npy_from_raw(raw_path: str, npy_path: str, dtype: np.dtype) -> int:
    """Turns a raw file of `dtype` items into an .npy (so np.load can memory-map it); returns its length."""
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


# What the build streams to disk, per split: the tokens and, per document, its id and token count.
_STREAMS = ("", "_doc_ids", "_doc_lengths")


def build_token_cache(
    cfg: DataConfig, files: list[SourceFile], tokenizer: Any, tokenizer_json_path: str,
    eot_id: int, is_val: np.ndarray, final_dir: str, progress: BuildProgress | None = None,
) -> None:
    """Tokenizes every document (no special tokens, then `eot_id`) into train.npy / val.npy,
    document ids and lengths, and meta.json (with the corpus content hash); chunks of
    `encode_chunk_documents` documents are encoded by `data.tokenize_workers` processes. Everything
    is streamed to files chunk by chunk: memory holds a few chunks, whatever the corpus's size
    (and `is_val`, one byte per document). `progress` (when given) counts the documents done."""
    from tqdm.auto import tqdm

    vocab_size = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab_size)
    tmp_dir = new_tmp_dir(final_dir)
    raw = {split + stream: open(os.path.join(tmp_dir, f"{split}{stream}.raw"), "wb")
           for split in ("train", "val") for stream in _STREAMS}
    hasher = DocumentHasher()
    start = time.perf_counter()
    chunk = cfg.encode_chunk_documents
    workers = resolve_workers(cfg.tokenize_workers, -(-len(is_val) // chunk))
    progress_bar = tqdm(total=len(is_val), unit="doc", disable=not cfg.progress,
                        desc=f"tokenizing {cfg.source} ({workers} process{'es' if workers > 1 else ''}) -> {final_dir}")
    if progress is not None:
        progress.start("tokenizing", len(is_val))

    def chunks():
        batch: list[str] = []
        for text in iter_documents(cfg, files):
            hasher.update(text)
            batch.append(text)
            if len(batch) == chunk:
                yield batch
                batch = []
        if batch:
            yield batch

    try:
        first_doc = 0
        for flat, lengths in encode_chunks(chunks(), tokenizer=tokenizer, tokenizer_json_path=tokenizer_json_path,
                                           eot_id=eot_id, dtype=dtype, workers=workers):
            if first_doc + len(lengths) > len(is_val):
                break  # more documents than counted: reported below
            in_val = is_val[first_doc:first_doc + len(lengths)]
            doc_of_token = np.repeat(in_val, lengths)
            doc_ids = np.arange(first_doc, first_doc + len(lengths), dtype=np.int64)
            for split, mask in (("val", in_val), ("train", ~in_val)):
                raw[split].write(flat[doc_of_token if split == "val" else ~doc_of_token].tobytes())
                raw[f"{split}_doc_ids"].write(doc_ids[mask].tobytes())
                raw[f"{split}_doc_lengths"].write(lengths[mask].tobytes())
            first_doc += len(lengths)
            progress_bar.update(len(lengths))
            if progress is not None:
                progress.done = first_doc
    finally:
        progress_bar.close()
        for handle in raw.values():
            handle.close()
    if first_doc != len(is_val):
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ValueError(f"data.source={cfg.source!r}: the corpus changed while it was tokenized (the "
                         f"{len(is_val)} documents counted before differ from those read); run again")
    meta: dict[str, Any] = {"version": TOKEN_CACHE_VERSION, "vocab_size": vocab_size, "eot_id": eot_id,
                            "dtype": dtype.name, "documents_sha256": hasher.hexdigest()}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        for stream in _STREAMS:
            num_items = _write_npy_from_raw(os.path.join(tmp_dir, f"{split}{stream}.raw"),
                                            os.path.join(tmp_dir, f"{split}{stream}.npy"),
                                            dtype if stream == "" else np.dtype(np.int64))
            if stream == "":
                meta[f"num_{split}_tokens"] = num_items
        meta[f"num_{split}_documents"] = int(mask.sum())
    with open(os.path.join(tmp_dir, _META), "w") as handle:
        json.dump(meta, handle, indent=1)
    publish(tmp_dir, final_dir)
    log(cfg, f"tokenized {len(is_val)} documents ({meta['num_train_tokens']} train + "
             f"{meta['num_val_tokens']} val tokens) in {time.perf_counter() - start:.1f}s with {workers} "
             f"process{'es' if workers > 1 else ''}")


@dataclasses.dataclass(frozen=True)
class TokenCache:
    """A built token cache, memory-mapped (a corpus larger than RAM is paged in on demand)."""

    path: str  # the cache directory
    train_tokens: np.ndarray  # flat training stream, token dtype, documents joined by eot
    val_tokens: np.ndarray  # flat validation stream
    train_document_ids: np.ndarray  # int64 indices (in source order) of the training documents
    val_document_ids: np.ndarray  # int64 indices of the held-out documents
    documents_sha256: str  # content hash of the whole document sequence (`DocumentHasher`)


def has_token_cache(path: str) -> bool:
    """True when `path` holds a published token cache (meta.json is written last)."""
    return os.path.isfile(os.path.join(path, _META))


def load_token_cache(path: str) -> TokenCache:
    """Opens a published token cache; a clear error naming the file when it is damaged."""
    meta_path = os.path.join(path, _META)
    try:
        with open(meta_path) as handle:
            meta = json.load(handle)
        if meta.get("version") != TOKEN_CACHE_VERSION:
            raise ValueError(f"version {meta.get('version')!r}, expected {TOKEN_CACHE_VERSION}")
        return TokenCache(
            path=path,
            train_tokens=np.load(os.path.join(path, "train.npy"), mmap_mode="r"),
            val_tokens=np.load(os.path.join(path, "val.npy"), mmap_mode="r"),
            train_document_ids=np.load(os.path.join(path, "train_doc_ids.npy")),
            val_document_ids=np.load(os.path.join(path, "val_doc_ids.npy")),
            documents_sha256=str(meta["documents_sha256"]),
        )
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"token cache {path} is damaged ({type(error).__name__}: {error}); delete that "
                         "directory and the next run rebuilds it") from None
