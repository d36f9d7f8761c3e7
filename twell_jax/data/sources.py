"""Sources: list a corpus's files, read its documents in a fixed order, split them train/validation.

Document i of `iter_documents` is "document i" everywhere else (split, document ids, caches). Every
file is read as a stream (`.gz` / `.zst` ones through their decompressor), one document at a time:
memory holds the current document and a block of the file, never a whole file of many documents.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

from twell_jax.config import DataConfig
from twell_jax.data import tree

# Version of the listing fingerprint below (part of every cache key: bump to invalidate them all).
LISTING_FORMAT_VERSION = 1
_KIND_OF_SUFFIX = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
# Compressed files, read as a stream through their decompressor (Parquet compresses inside the file).
_COMPRESSION_OF_SUFFIX = {".gz": "gzip", ".zst": "zstd"}
_COMPRESSIBLE_KINDS = ("txt", "jsonl")
SUPPORTED_SUFFIXES = (*_KIND_OF_SUFFIX, *(kind_suffix + suffix for kind_suffix, kind in _KIND_OF_SUFFIX.items()
                                         if kind in _COMPRESSIBLE_KINDS for suffix in _COMPRESSION_OF_SUFFIX))
# Characters of a .txt file decoded per read when it is split into documents; compressed bytes
# per read of a .zst file (its decompressed size, roughly 3-10x for text, is what one read holds).
_TEXT_BLOCK_CHARS = 1 << 20
_ZSTD_READ_BYTES = 1 << 16
ZSTD_EXTRA = "zstd"  # the pyproject extra that installs `zstandard`
# Directories of the interpreter's lib dir that are not the standard library itself.
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file of a corpus."""

    kind: str  # "python" (stdlib .py), "text" (any file of a data.include pattern), "txt", "jsonl" or "parquet"
    path: str
    compression: str | None = None  # "gzip" (.gz) or "zstd" (.zst) for a compressed .txt / .jsonl


def _source_file(path: str) -> SourceFile | None:
    """The file's kind (and compression) from its name, None for a name of no supported kind."""
    stem, suffix = os.path.splitext(path.lower())
    compression = _COMPRESSION_OF_SUFFIX.get(suffix)
    if compression is not None:
        stem, suffix = os.path.splitext(stem)
    kind = _KIND_OF_SUFFIX.get(suffix)
    if kind is None or (compression is not None and kind not in _COMPRESSIBLE_KINDS):
        return None
    return SourceFile(kind, path, compression)


def stdlib_root() -> str:
    """The directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def list_source_files(cfg: DataConfig) -> list[SourceFile]:
    """The source's files in a fixed (sorted) order; clear errors for missing or unknown paths."""
    if cfg.is_synthetic:
        raise ValueError("data.source='synthetic' has no files (build it with synthetic_data)")
    if tree.dedups_documents(cfg):  # data.include patterns, or the "installed" source
        return [_source_file(p) or SourceFile("text", p) for p in tree.list_tree_files(cfg)]
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
        source_file = _source_file(path)
        if source_file is None:
            raise ValueError(
                f"data.source={cfg.source!r}: unknown file type {os.path.splitext(path)[1]!r}; expected "
                f"'stdlib', 'synthetic', a directory, or a file ending in one of {SUPPORTED_SUFFIXES}"
            )
        return [source_file]
    files = []
    for directory, subdirs, names in os.walk(path):
        subdirs.sort()
        for name in names:
            source_file = _source_file(os.path.join(directory, name))
            if source_file is not None:
                files.append(source_file)
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


class _ZstdReader(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame, read `_ZSTD_READ_BYTES` compressed bytes at
    a time. `zstandard`'s own stream_reader ends quietly where a truncated file ends: this one raises
    EOFError when the file stops inside a frame (decompressobj's `eof` says where frames end), and
    OSError for data that is not zstd or is damaged."""

    def __init__(self, path: str):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path}: reading .zst files needs the zstandard package (pip install "
                             f"'twell-jax[{ZSTD_EXTRA}]')") from None
        super().__init__()
        self._file = open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor()
        self._zstd_error = zstandard.ZstdError
        self._frame: Any = None  # the decompressobj of the frame being read; None between frames
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _refill(self) -> bool:
        """Decompresses the next read of the file into `_pending`; False at the end of the file."""
        compressed = self._file.read(_ZSTD_READ_BYTES)
        if not compressed:
            if self._frame is not None:
                raise EOFError("it ends inside a zstd frame")
            return False
        out = []
        while compressed:
            if self._frame is None:
                self._frame = self._decompressor.decompressobj()
            try:
                out.append(self._frame.decompress(compressed))
            except self._zstd_error as error:  # not zstd data, or a damaged frame
                raise OSError(str(error)) from None
            if self._frame.eof:  # a frame ended: what follows it starts the next one
                compressed, self._frame = self._frame.unused_data, None
            else:
                compressed = b""
        self._pending = memoryview(b"".join(out))
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            if not self._refill():
                return 0
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_binary(source_file: SourceFile) -> IO[bytes]:
    """The file's (decompressed) bytes as a buffered stream."""
    if source_file.compression == "gzip":
        return gzip.open(source_file.path, "rb")
    if source_file.compression == "zstd":
        return io.BufferedReader(_ZstdReader(source_file.path), buffer_size=_ZSTD_READ_BYTES)
    return open(source_file.path, "rb")


def _split_stream(blocks: Iterable[str], separator: str) -> Iterator[str]:
    """`"".join(blocks).split(separator)`, piece by piece: memory holds one piece and one block.

    Only text after the last separator found is searched again (with the next block), and of a
    block holding none only the last len(separator) - 1 characters, where a separator may begin
    that the next block completes: the pieces are exactly those of `str.split` (a test checks it)."""
    piece: list[str] = []  # the current piece, searched through
    tail = ""  # text after the last separator found, not searched through with what follows
    keep = len(separator) - 1
    for block in blocks:
        text = tail + block
        parts = text.split(separator)
        if len(parts) == 1:
            cut = max(0, len(text) - keep)
            piece.append(text[:cut])
            tail = text[cut:]
            continue
        piece.append(parts[0])
        yield "".join(piece)
        piece = []
        yield from parts[1:-1]
        tail = parts[-1]
    piece.append(tail)
    yield "".join(piece)


def _iter_txt(source_file: SourceFile, separator: str | None) -> Iterator[str]:
    """A .txt file's documents: the whole text, or its pieces between `separator`s."""
    if separator is None and source_file.compression is None:
        yield _read_text(source_file.path)  # the whole file is one document
        return
    # The same decoding as _read_text (UTF-8, U+FFFD for bad bytes, universal newlines), block by block.
    with io.TextIOWrapper(_open_binary(source_file), encoding="utf-8", errors="replace") as handle:
        if separator is None:
            yield handle.read()
        else:
            yield from _split_stream(iter(lambda: handle.read(_TEXT_BLOCK_CHARS), ""), separator)


def _iter_file_documents(source_file: SourceFile, cfg: DataConfig) -> Iterator[str]:
    if source_file.compression is not None:
        yield from _iter_decompressed(source_file, cfg)
    elif source_file.kind in ("python", "text"):
        yield _read_text(source_file.path)
    elif source_file.kind == "txt":
        yield from _iter_txt(source_file, cfg.txt_separator_text)
    elif source_file.kind == "jsonl":
        yield from _iter_jsonl(source_file, cfg.text_field)
    elif source_file.kind == "parquet":
        yield from _iter_parquet(source_file.path, cfg.text_field)
    else:  # pragma: no cover - _source_file only produces the kinds above
        raise AssertionError(source_file.kind)


def _iter_decompressed(source_file: SourceFile, cfg: DataConfig) -> Iterator[str]:
    """A compressed .txt / .jsonl file's documents; damage to the compressed data (a bad header, a
    failed checksum, a truncated file) is a ValueError naming the file."""
    path, compression = source_file.path, source_file.compression
    if os.path.getsize(path) == 0:  # even an empty text compresses to a header: this file was cut off
        raise ValueError(f"{path}: empty file, not {compression} data (truncated?)")
    try:
        if source_file.kind == "txt":
            yield from _iter_txt(source_file, cfg.txt_separator_text)
        else:
            yield from _iter_jsonl(source_file, cfg.text_field)
    except (EOFError, OSError, zlib.error) as error:  # _ZstdReader raises these too
        raise ValueError(f"{path}: damaged or truncated {compression} file ({error})") from None


def _iter_jsonl(source_file: SourceFile, text_field: str) -> Iterator[str]:
    path = source_file.path
    # Binary lines, decoded one by one, so that invalid UTF-8 is reported with its file and line.
    with _open_binary(source_file) as handle:
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
