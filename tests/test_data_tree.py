"""Tests for the text-tree sources (twell_jax/data/tree.py): include patterns, duplicates dropped by
content hash, deterministic order, the split by document, the cache hit, tokenizing in a process
pool (equal to in-process), and the "installed" source's listing."""
from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np
import pytest

from twell_jax.config import DataConfig, ExperimentConfig, apply_overrides
from twell_jax.data import build_data, iter_documents, tree
from twell_jax.data.sources import list_source_files

WORDS = "alpha beta gamma delta sparse dense kernel tile gate relu".split()


def _text(i: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, size=int(rng.integers(30, 90)))) + f"\n# document {i}\n"


def _write(root, relative: str, text: str | bytes) -> None:
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(text, bytes) else "w") as handle:
        handle.write(text)


@pytest.fixture(scope="module")
def tree_root(tmp_path_factory):
    """24 unique documents in .py/.md/.rst/.txt files (3 of them twice), plus files the patterns or the
    walk must skip."""
    root = tmp_path_factory.mktemp("tree") / "src"
    suffixes = (".py", ".md", ".rst", ".txt")
    for i in range(24):
        _write(root, f"pkg{i % 3}/mod_{i:02d}{suffixes[i % 4]}", _text(i))
    for i in (1, 5, 9):  # exact copies under other names: dropped
        _write(root, f"vendored/copy_of_{i}.py", _text(i))
    _write(root, "pkg0/data.json", '{"not": "matched"}')
    _write(root, "pkg0/__pycache__/cached.py", _text(100))
    _write(root, ".git/hooks/hook.py", _text(101))
    _write(root, "pkg1/blob.txt", b"binary\x00data\n")  # a NUL byte: not text, skipped
    _write(root, "pkg2/empty.md", "")
    return root


def _cfg(source, cache_dir, **overrides) -> DataConfig:
    fields = dict(source=str(source), cache_dir=str(cache_dir), include=("*.py", "*.md", "*.rst", "*.txt"),
                  vocab_size=300, seq_len=15, val_fraction=0.2, progress=False, tokenize_workers=1)
    fields.update(overrides)
    return DataConfig(**fields)


def test_patterns_dedup_and_order(tree_root, tmp_path):
    cfg = _cfg(tree_root, tmp_path)
    paths = [f.path for f in list_source_files(cfg)]
    relative = [os.path.relpath(p, tree_root) for p in paths]
    assert relative == sorted(relative)
    assert not any("__pycache__" in r or ".git" in r or r.endswith(".json") for r in relative)
    assert len(relative) == 24 + 3 + 2  # the copies, the NUL file and the empty file are listed...
    documents = list(iter_documents(cfg))
    # ...but only the 24 unique text documents are read, each once, in path order.
    by_path = {os.path.relpath(p, tree_root): p for p in paths}
    expected = [_text(int(r.split("_")[-1].split(".")[0]))
                for r in sorted(by_path) if r.startswith("pkg") and "mod_" in r]
    assert documents == expected
    assert list(iter_documents(cfg)) == documents  # deterministic

    only_md = _cfg(tree_root, tmp_path, include=("*.md",))
    assert [os.path.splitext(f.path)[1] for f in list_source_files(only_md)] == [".md"] * 7
    by_dir = _cfg(tree_root, tmp_path, include=("pkg1/*.py", "vendored/*"))
    assert {os.path.relpath(f.path, tree_root).split("/")[0] for f in list_source_files(by_dir)} == {"pkg1", "vendored"}


def test_pattern_errors(tree_root, tmp_path):
    with pytest.raises(ValueError, match=r"data.source=.*no file below .* matches data.include=\['\*.tex'\]"):
        list_source_files(_cfg(tree_root, tmp_path, include=("*.tex",)))
    with pytest.raises(ValueError, match="data.include=.*must be a directory"):
        list_source_files(_cfg(tree_root / "pkg0" / "mod_00.py", tmp_path))
    with pytest.raises(ValueError, match="data.include"):
        DataConfig(include=("*.py", " "))
    cfg = apply_overrides(ExperimentConfig(), ["data.include=*.py,*.md", "data.tokenize_workers=3"])
    assert cfg.data.include == ("*.py", "*.md") and cfg.data.tokenize_workers == 3


def test_split_by_document_and_cache_hit(tree_root, tmp_path):
    cfg = _cfg(tree_root, tmp_path)
    bundle = build_data(cfg, global_batch=2)
    assert bundle.built_tokens
    train_ids, val_ids = set(bundle.train_document_ids.tolist()), set(bundle.val_document_ids.tolist())
    assert not train_ids & val_ids and train_ids | val_ids == set(range(24)) and len(val_ids) == round(0.2 * 24)
    # Every held-out document's tokens sit in the validation stream, in order, and nowhere else.
    documents = list(iter_documents(cfg))
    encode = lambda text: bundle.tokenizer.encode(text, add_special_tokens=False).ids + [bundle.eot_id]
    val_stream = np.concatenate([encode(documents[i]) for i in sorted(val_ids)])
    train_stream = np.concatenate([encode(documents[i]) for i in sorted(train_ids)])
    assert bundle.num_val_tokens == len(val_stream) and bundle.num_train_tokens == len(train_stream)
    np.testing.assert_array_equal(bundle.val_sequences[:].reshape(-1), val_stream[:bundle.val_sequences[:].size])

    again = build_data(cfg, global_batch=2)
    assert not again.built_tokens and not again.built_tokenizer and again.cache_path == bundle.cache_path
    assert again.source_fingerprint == bundle.source_fingerprint


def test_patterns_do_not_share_the_cache_of_the_same_files_without_them(tmp_path):
    """A directory of .txt files read with data.include drops duplicate documents, without it keeps
    them: the same file listing, two corpora, two caches (one was served for both)."""
    root = tmp_path / "txt"
    for i in range(10):
        _write(root, f"doc_{i:02d}.txt", _text(i))
    _write(root, "doc_99.txt", _text(3))  # a duplicate
    plain = build_data(_cfg(root, tmp_path / "cache", include=()), global_batch=2)
    patterned = build_data(_cfg(root, tmp_path / "cache", include=("*.txt",)), global_batch=2)
    assert plain.num_train_documents + plain.num_val_documents == 11
    assert patterned.num_train_documents + patterned.num_val_documents == 10
    assert patterned.cache_path != plain.cache_path


def test_pool_equals_in_process(tree_root, tmp_path):
    """Two spawned workers on chunks of 3 documents give the in-process cache token for token."""
    one = build_data(_cfg(tree_root, tmp_path / "one", encode_chunk_documents=3), global_batch=2)
    two = build_data(_cfg(tree_root, tmp_path / "two", encode_chunk_documents=3, tokenize_workers=2), global_batch=2)
    assert two.built_tokens and os.path.basename(one.cache_path) == os.path.basename(two.cache_path)
    for split in ("train", "val"):
        for suffix in (".npy", "_doc_ids.npy", "_doc_lengths.npy"):
            np.testing.assert_array_equal(np.load(os.path.join(one.cache_path, split + suffix)),
                                          np.load(os.path.join(two.cache_path, split + suffix)))


def test_installed_listing():
    cfg = DataConfig(source="installed", progress=False)
    assert tree.dedups_documents(cfg)
    paths = tree.list_tree_files(cfg)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
    real = [os.path.realpath(p) for p in paths]
    assert len(set(real)) == len(real) and paths == sorted(paths)
    assert os.path.join(stdlib, "os.py") in real
    assert any(p.startswith(purelib + os.sep) and p.endswith(".py") for p in real)  # installed packages too
    assert not any("__pycache__" in p for p in paths)
    assert {os.path.splitext(p)[1] for p in paths} <= {s[1:] for s in tree.INSTALLED_INCLUDE}
    narrowed = tree.list_tree_files(dataclasses.replace(cfg, include=("*.rst",)))
    assert narrowed and all(p.endswith(".rst") for p in narrowed)


def test_worker_count():
    from twell_jax.data.encode_pool import POOL_MIN_CHUNKS, resolve_workers

    assert resolve_workers(0, POOL_MIN_CHUNKS - 1) == 1  # small corpus: in this process
    assert resolve_workers(0, POOL_MIN_CHUNKS) == min(os.cpu_count(), POOL_MIN_CHUNKS)
    assert resolve_workers(3, 2) == 2 and resolve_workers(3, 100) == 3 and resolve_workers(1, 100) == 1
