"""Sources: list a corpus's files, read its documents in a fixed order, split them train/validation.

Document i of `iter_documents` is "document i" everywhere else (split, document ids, caches).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np

from twell_jax.config import DataConfig
from twell_jax.data import tree

# Version of the listing fingerprint below (part of every cache key: bump to invalidate them all).
LISTING_FORMAT_VERSION = 1
_TEXT_SUFFIXES = (".txt",)
_JSONL_SUFFIXES = (".jsonl",)
_PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = _TEXT_SUFFIXES + _JSONL_SUFFIXES + _PARQUET_SUFFIXES
# Directories of the interpreter's lib dir that are not the standard library itself.
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file of a corpus."""

    kind: str  # "python" (stdlib .py), "text" (any file of a data.include pattern), "txt", "jsonl" or "parquet"
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


def list_source_files(cfg: DataConfig) -> list[SourceFile]:
    """The source's files in a fixed (sorted) order; clear errors for missing or unknown paths."""
    if cfg.is_synthetic:
        raise ValueError("data.source='synthetic' has no files (build it with synthetic_data)")
    if tree.dedups_documents(cfg):  # data.include patterns, or the "installed" source
        return [SourceFile(_kind_of(p) or "text", p) for p in tree.list_tree_files(cfg)]
    if cfg.source == "stdlib":
        root = stdlib_root()
        files = []
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIPPED_DIRS)
            files.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
        if not files:
            raise ValueError(f"data.source='stdlib': found no .py files under {root}")
        return [SourceFile("python", p) for p in sorted(files)]
    path = os.path.expanduser(cfg.source)
    if not os.path.exists(path):
        raise ValueError(f"data.source={cfg.source!r}: no such file or directory")
    if os.path.isfile(path):
        kind = _kind_of(path)
        if kind is None:
            raise ValueError(
                f"data.source={cfg.source!r}: unknown file type {os.path.splitext(path)[1]!r}; expected "
                f"'stdlib', 'synthetic', a directory, or a file ending in one of {SUPPORTED_SUFFIXES}"
            )
        return [SourceFile(kind, path)]
    files = []
    for directory, subdirs, names in os.walk(path):
        subdirs.sort()
        for name in names:
            kind = _kind_of(name)
            if kind is not None:
                files.append(SourceFile(kind, os.path.join(directory, name)))
    if not files:
        raise ValueError(
            f"data.source={cfg.source!r}: the directory holds no file ending in one of {SUPPORTED_SUFFIXES}"
        )
    return sorted(files, key=lambda f: f.path)


def _read_text(path: str) -> str:
    # errors="replace": a stray non-UTF-8 byte (the stdlib's own tests contain some on purpose)
    # must not abort a build; it becomes U+FFFD.
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _iter_file_documents(source_file: SourceFile, cfg: DataConfig) -> Iterator[str]:
    if source_file.kind in ("python", "text"):
        yield _read_text(source_file.path)
    elif source_file.kind == "txt":
        text = _read_text(source_file.path)
        separator = cfg.txt_separator_text
        if separator is None:
            yield text
        else:
            yield from text.split(separator)
    elif source_file.kind == "jsonl":
        yield from _iter_jsonl(source_file.path, cfg.text_field)
    elif source_file.kind == "parquet":
        yield from _iter_parquet(source_file.path, cfg.text_field)
    else:  # pragma: no cover - _kind_of only produces the kinds above
        raise AssertionError(source_file.kind)


def _iter_jsonl(path: str, text_field: str) -> Iterator[str]:
    # Binary lines, decoded one by one, so that invalid UTF-8 is reported with its file and line.
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not valid UTF-8 ({error.reason} at byte {error.start} of the line); "
                                 "JSONL files must be UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error})") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{where}: JSONL line has no {text_field!r} field (found {keys}); set "
                    "data.text_field to the key holding the document text"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
            yield text


def _iter_parquet(path: str, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet_file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:  # not Parquet (no magic bytes), truncated, unreadable
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
    columns = parquet_file.schema_arrow.names
    if text_field not in columns:
        raise ValueError(
            f"{path}: Parquet file has no {text_field!r} column (columns: {columns}); set "
            "data.text_field to the column holding the document text"
        )
    column_type = parquet_file.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ValueError(f"{path}: column {text_field!r} holds {column_type}, expected strings (the document "
                         "text); set data.text_field to the column holding the text")
    try:
        for record_batch in parquet_file.iter_batches(columns=[text_field], batch_size=1024):
            for text in record_batch.column(0).to_pylist():
                if text is not None:  # null rows are empty documents
                    yield text
    except (pa.ArrowException, OSError) as error:  # a damaged row group
        raise ValueError(f"{path}: Parquet file cannot be read ({error})") from None


def iter_documents(cfg: DataConfig, files: list[SourceFile] | None = None) -> Iterator[str]:
    """The source's non-empty documents in a fixed order, at most `cfg.max_documents` of them."""
    files = list_source_files(cfg) if files is None else files
    produced = 0
    seen: set[bytes] | None = set() if tree.dedups_documents(cfg) else None
    for source_file in files:
        for text in _iter_file_documents(source_file, cfg):
            if not text:
                continue
            if seen is not None:  # exact duplicates and binary files (a NUL byte) are dropped
                digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
                if digest in seen or "\x00" in text:
                    continue
                seen.add(digest)
            yield text
            produced += 1
            if cfg.max_documents is not None and produced >= cfg.max_documents:
                return


class DocumentHasher:
    """SHA-256 of a document sequence (content only: moving or touching the files keeps it)."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def update(self, text: str) -> None:
        data = text.encode("utf-8", errors="surrogatepass")
        # The length prefix keeps ["ab", "c"] and ["a", "bc"] apart.
        self._digest.update(len(data).to_bytes(8, "little"))
        self._digest.update(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def listing_fingerprint(cfg: DataConfig, files: list[SourceFile]) -> dict[str, Any]:
    """What identifies the document sequence cheaply (for cache keys): the file listing (path, size,
    mtime) and the settings that select and split documents."""
    listing = []
    for source_file in files:
        stat = os.stat(source_file.path)
        listing.append([os.path.abspath(source_file.path), stat.st_size, stat.st_mtime_ns])
    fingerprint = {
        "version": LISTING_FORMAT_VERSION,
        "source": cfg.source,
        "listing": listing,
        "max_documents": cfg.max_documents,
        "text_field": cfg.text_field,
        # Decoded, so "\\n\\n" from a command line and "\n\n" from Python share a cache.
        "txt_separator": cfg.txt_separator_text,
        "val_fraction": cfg.val_fraction,
        "split_seed": cfg.split_seed,
    }
    if cfg.include:  # the same files listed by patterns give other documents (duplicates dropped): another cache
        fingerprint["dedups_documents"] = True
    return fingerprint


def select_validation(num_items: int, cfg: DataConfig, what: str = "document") -> np.ndarray:
    """Boolean mask over items (documents, or synthetic sequences): True = held out. Exactly
    round(val_fraction * n) items, at least 1 when val_fraction > 0, chosen with split_seed."""
    if num_items == 0:
        raise ValueError(f"data.source={cfg.source!r}: the corpus has no non-empty documents")
    is_val = np.zeros(num_items, dtype=bool)
    if cfg.val_fraction == 0:
        return is_val
    num_val = max(1, round(cfg.val_fraction * num_items))
    if num_val >= num_items:
        hint = ("split the .txt file into documents with data.txt_separator (e.g. '\\n\\n' for "
                "paragraphs, '\\n' for lines), add documents, or set data.val_fraction=0 (for data "
                "builds only: training evaluates on the validation split)")
        raise ValueError(
            f"data.val_fraction={cfg.val_fraction}: the corpus has only {num_items} {what}(s), too few "
            f"to hold out {num_val} and keep one for training; {hint}"
        )
    rng = np.random.default_rng(cfg.split_seed)
    is_val[rng.choice(num_items, size=num_val, replace=False)] = True
    return is_val
