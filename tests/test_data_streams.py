"""Reading corpora as streams (twell_jax/data/sources.py): `.jsonl.gz` / `.jsonl.zst` / `.txt.gz` /
`.txt.zst` files and directories of shards give the documents of their plain counterparts, in sorted
file order, one at a time (memory bounded by a document and a block, not by the file); damaged or
truncated compressed files are errors naming the file. Fixtures are written in tmp_path."""
from __future__ import annotations

import gzip
import json
import os
import sys
import tracemalloc

import numpy as np
import pytest
import zstandard

from twell_jax.config import DataConfig
from twell_jax.data import build_data, iter_documents, sources

WORDS = "alpha beta gamma delta sparse dense kernel tile gate relu é ü 漢".split()


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) for _ in range(count)]


def _jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def _zstd(data: bytes, frames: int = 1) -> bytes:
    """`data` as `frames` zstd frames back to back (what concatenated or chunked writers produce)."""
    cuts = np.linspace(0, len(data), frames + 1).astype(int)
    return b"".join(zstandard.ZstdCompressor().compress(data[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))


def _cfg(source, **overrides) -> DataConfig:
    return DataConfig(source=str(source), progress=False, **overrides)


# --------------------------------------------------------------------------------------------- reading


def test_split_stream_is_str_split_for_any_blocks():
    rng = np.random.default_rng(0)
    for separator in ("\n", "\n\n", "ab", "aa", "aba", "漢\n"):
        alphabet = sorted(set(separator)) + ["x", "漢"]
        for _ in range(300):
            text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 40))))
            cuts = sorted(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 8))))
            blocks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert list(sources._split_stream(blocks, separator)) == text.split(separator), (text, blocks)


def test_compressed_files_give_the_documents_of_the_plain_file(tmp_path):
    texts = _texts(200)
    plain = _jsonl_bytes(texts)
    (tmp_path / "c.jsonl").write_bytes(plain)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(plain))
    (tmp_path / "c.jsonl.zst").write_bytes(_zstd(plain, frames=3))
    for name in ("c.jsonl", "c.jsonl.gz", "c.jsonl.zst"):
        assert list(iter_documents(_cfg(tmp_path / name))) == texts, name
    # .txt split into documents; \r\n and undecodable bytes read as from a plain .txt file.
    book = "\n\n".join(texts).replace("alpha", "al\r\npha").encode() + b"\xff\xfe tail"
    (tmp_path / "b.txt").write_bytes(book)
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(book))
    (tmp_path / "b.txt.zst").write_bytes(_zstd(book, frames=2))
    for separator in ("\n\n", None):
        expected = list(iter_documents(_cfg(tmp_path / "b.txt", txt_separator=separator)))
        assert len(expected) == (len(texts) if separator else 1)
        assert "\r" not in expected[0] and "\ufffd" in expected[-1]
        for name in ("b.txt.gz", "b.txt.zst"):
            assert list(iter_documents(_cfg(tmp_path / name, txt_separator=separator))) == expected, name


def test_a_directory_of_shards_is_read_in_sorted_order_and_tokenized_like_one_file(tmp_path):
    texts = _texts(240, seed=1)
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    pieces = [texts[i * 30:(i + 1) * 30] for i in range(8)]
    # Written out of order, with both compressions and one shard in a subdirectory.
    paths = [f"train-{i:05d}-of-00008.jsonl" + (".zst" if i % 2 else ".gz") for i in range(8)]
    paths[7] = "sub/" + paths[7]
    for i in (5, 2, 7, 0, 3, 6, 1, 4):
        data = _jsonl_bytes(pieces[i])
        (shards / paths[i]).write_bytes(_zstd(data) if paths[i].endswith(".zst") else gzip.compress(data))
    (shards / "notes.json.gz").write_bytes(gzip.compress(b"{}"))  # no supported kind: ignored
    (shards / "table.parquet.gz").write_bytes(gzip.compress(b"x"))  # Parquet compresses inside: ignored
    listed = sources.list_source_files(_cfg(shards))
    assert [os.path.relpath(f.path, shards) for f in listed] == sorted(paths)  # "sub/..." < "train-..."
    assert [f.compression for f in listed] == ["zstd"] + ["gzip", "zstd"] * 3 + ["gzip"]
    in_order = [text for i in sorted(range(8), key=paths.__getitem__) for text in pieces[i]]
    assert list(iter_documents(_cfg(shards))) == in_order
    # The same documents as one plain file: the same content hash and the same token stream.
    (tmp_path / "all.jsonl").write_bytes(_jsonl_bytes(in_order))
    tokenizer_dir = tmp_path / "cache"
    one = build_data(_cfg(tmp_path / "all.jsonl", cache_dir=str(tokenizer_dir), vocab_size=300, seq_len=15),
                     global_batch=4)
    sharded = build_data(_cfg(shards, cache_dir=str(tmp_path / "cache2"), tokenizer=one.tokenizer_json_path,
                              seq_len=15), global_batch=4)
    assert sharded.source_fingerprint == one.source_fingerprint
    np.testing.assert_array_equal(np.asarray(sharded.train_sequences[:]), np.asarray(one.train_sequences[:]))


def test_the_listing_fingerprint_covers_compressed_files(tmp_path):
    (tmp_path / "a.jsonl.zst").write_bytes(_zstd(_jsonl_bytes(_texts(5))))
    cfg = _cfg(tmp_path)
    before = sources.listing_fingerprint(cfg, sources.list_source_files(cfg))
    assert [os.path.basename(p) for p, *_ in before["listing"]] == ["a.jsonl.zst"]
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(b"one more document"))
    after = sources.listing_fingerprint(cfg, sources.list_source_files(cfg))
    assert [os.path.basename(p) for p, *_ in after["listing"]] == ["a.jsonl.zst", "b.txt.gz"]


@pytest.mark.parametrize("name", ["big.txt", "big.txt.gz", "big.jsonl.zst"])
def test_reading_holds_a_document_and_a_block_not_the_file(tmp_path, name):
    """A 24 MB corpus of 1 KB documents is read with a few MB of Python memory (the old reader of
    .txt files held the whole text and its split: over 48 MB)."""
    rng = np.random.default_rng(2)
    alphabet = np.frombuffer(b"abcdefghij klmnop", np.uint8)
    documents = [rng.choice(alphabet, size=1000).tobytes().decode() for _ in range(24_000)]
    if name.startswith("big.txt"):
        data = "\n\n".join(documents).encode()
    else:
        data = _jsonl_bytes(documents)
    path = tmp_path / name
    path.write_bytes(gzip.compress(data, 1) if name.endswith(".gz") else _zstd(data, 4) if name.endswith(".zst")
                     else data)
    del data
    cfg = _cfg(path, txt_separator="\n\n")
    tracemalloc.start()
    try:
        count, total = 0, 0
        for text in iter_documents(cfg):
            count += 1
            total += len(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (count, total) == (len(documents), 1000 * len(documents))
    assert peak < 12 * 2**20, f"reading {name} peaked at {peak / 2**20:.1f} MB of Python memory"


# --------------------------------------------------------------------------------------------- errors


def _damaged() -> dict[str, bytes]:
    data = _jsonl_bytes(_texts(300))
    gz, zst = gzip.compress(data), _zstd(data, frames=2)
    flipped = bytearray(gz)
    flipped[len(gz) // 2] ^= 0xFF
    return {"truncated.jsonl.gz": gz[:len(gz) // 2], "cut-before-the-trailer.jsonl.gz": gz[:-4],
            "not-gzip.jsonl.gz": data, "bit-flip.txt.gz": bytes(flipped), "empty.txt.gz": b"",
            "truncated.jsonl.zst": zst[:len(zst) // 2], "cut-in-the-last-frame.txt.zst": zst[:-3],
            "not-zstd.jsonl.zst": data, "empty.jsonl.zst": b""}


@pytest.mark.parametrize("name", sorted(_damaged()))
def test_a_damaged_or_truncated_compressed_file_is_an_error_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(_damaged()[name])
    with pytest.raises(ValueError) as error:
        list(iter_documents(_cfg(path)))
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    assert "empty file" in message if name.startswith("empty") else "damaged or truncated" in message, message


def test_a_missing_zstandard_package_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(_zstd(_jsonl_bytes(["text"])))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` raises ImportError
    with pytest.raises(ValueError, match=rf"^{path}: reading \.zst files needs the zstandard package "
                                         r"\(pip install 'twell-jax\[zstd\]'\)$"):
        list(iter_documents(_cfg(path)))


def test_errors_inside_a_compressed_jsonl_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(_jsonl_bytes(["fine"]) + b"{not json\n"))
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid JSON"):
        list(iter_documents(_cfg(path)))
    with pytest.raises(ValueError, match=r"unknown file type '\.gz'.*'\.jsonl\.gz', '\.jsonl\.zst'"):
        (tmp_path / "table.parquet.gz").write_bytes(b"")
        sources.list_source_files(_cfg(tmp_path / "table.parquet.gz"))
