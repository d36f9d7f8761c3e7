"""Tests for twell_jax.data: packing, split, shuffling, sharding, iterator state, caching, sources,
tokenizers, the synthetic source, the trainer-facing checks and error messages. Small corpora written
to tmp dirs, plus a few stdlib files."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twell_jax import data as data_lib
from twell_jax.data import tokenizer as tokenizer_lib
from twell_jax.config import DataConfig
from twell_jax.data import build_data

SEQ_LEN = 15  # windows of 16 tokens; odd so that window boundaries rarely align with anything
NUM_DOCS = 41
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega sparse dense kernel tile gate relu").split()


def _write_corpus(directory, num_docs: int = NUM_DOCS, seed: int = 0) -> list[str]:
    """Writes num_docs .txt files of random words (varied lengths); returns their texts in order."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    texts = []
    for i in range(num_docs):
        words = rng.choice(WORDS, size=int(rng.integers(20, 120)))
        text = " ".join(words) + ("\n" if i % 3 else "")
        with open(os.path.join(directory, f"doc_{i:03d}.txt"), "w") as handle:
            handle.write(text)
        texts.append(text)
    return texts


def _cfg(source, cache_dir, **overrides) -> DataConfig:
    fields = dict(source=str(source), cache_dir=str(cache_dir), vocab_size=300, seq_len=SEQ_LEN,
                  val_fraction=0.1, progress=False)
    fields.update(overrides)
    return DataConfig(**fields)


def _take(iterator, count: int) -> list[np.ndarray]:
    return [next(iterator)["tokens"] for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = _write_corpus(root / "txt")
    return {"dir": root / "txt", "texts": texts, "cache": root / "cache"}


@pytest.fixture(scope="module")
def bundle(corpus):
    return build_data(_cfg(corpus["dir"], corpus["cache"]), global_batch=4)


def _expected_stream(tokenizer, texts: list[str], doc_ids: np.ndarray, eot_id: int) -> np.ndarray:
    pieces = []
    for doc_id in doc_ids:
        pieces.extend(tokenizer.encode(texts[doc_id], add_special_tokens=False).ids)
        pieces.append(eot_id)
    return np.asarray(pieces, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Packing, split, batches.


def test_packing_is_the_concatenated_stream_with_eot_between_documents(corpus, bundle):
    assert bundle.eot_id == 0 and bundle.tokenizer.id_to_token(0) == "<|endoftext|>"
    for doc_ids, sequences, num_tokens in (
        (bundle.train_document_ids, bundle.train_sequences, bundle.num_train_tokens),
        (bundle.val_document_ids, bundle.val_sequences, bundle.num_val_tokens),
    ):
        stream = _expected_stream(bundle.tokenizer, corpus["texts"], doc_ids, bundle.eot_id)
        assert len(stream) == num_tokens
        assert sequences.shape == (len(stream) // (SEQ_LEN + 1), SEQ_LEN + 1)
        # Only the documented remainder (< one window) is lost.
        assert len(stream) - sequences.size < SEQ_LEN + 1
        np.testing.assert_array_equal(sequences.reshape(-1), stream[: sequences.size])
        assert int((stream == bundle.eot_id).sum()) == len(doc_ids)
    assert bundle.num_train_sequences > 8 and bundle.num_val_sequences >= 1


def test_train_and_val_are_disjoint_by_document(bundle):
    train, val = set(bundle.train_document_ids.tolist()), set(bundle.val_document_ids.tolist())
    assert not train & val
    assert train | val == set(range(NUM_DOCS))
    assert len(val) == round(0.1 * NUM_DOCS)


def test_batches_cover_each_training_sequence_once_per_epoch(bundle):
    source = bundle.train_batch_source()
    n = bundle.num_train_sequences
    steps = 2 * n // bundle.global_batch + 1  # runs across the first epoch boundary
    ids = np.concatenate([source.sequence_ids(step) for step in range(steps)])
    np.testing.assert_array_equal(np.sort(ids[:n]), np.arange(n))
    np.testing.assert_array_equal(np.sort(ids[n:2 * n]), np.arange(n))
    assert not np.array_equal(ids[:n], ids[n:2 * n]), "each epoch must be reshuffled"
    batch = next(bundle.make_train_iter())["tokens"]
    assert batch.dtype == np.int32 and batch.shape == (4, SEQ_LEN + 1)
    np.testing.assert_array_equal(batch, bundle.train_sequences[source.sequence_ids(0)])


def test_same_seed_same_batches_and_different_seed_different(corpus, bundle):
    again = build_data(_cfg(corpus["dir"], corpus["cache"]), global_batch=4)
    np.testing.assert_array_equal(_take(bundle.make_train_iter(), 5), _take(again.train_iter, 5))
    other = build_data(_cfg(corpus["dir"], corpus["cache"], seed=1), global_batch=4)
    assert not np.array_equal(_take(bundle.make_train_iter(), 5), _take(other.train_iter, 5))
    # The split does not follow the training seed: same held-out documents.
    np.testing.assert_array_equal(bundle.val_document_ids, other.val_document_ids)


def test_process_slices_are_disjoint_and_make_up_the_global_batch(corpus, bundle):
    cfg = _cfg(corpus["dir"], corpus["cache"])
    whole = _take(bundle.make_train_iter(), 6)
    parts = [
        _take(build_data(cfg, global_batch=4, process_index=p, process_count=2).train_iter, 6)
        for p in range(2)
    ]
    for step in range(6):
        assert parts[0][step].shape == (2, SEQ_LEN + 1)
        np.testing.assert_array_equal(np.concatenate([parts[0][step], parts[1][step]]), whole[step])
    shards = [build_data(cfg, global_batch=4, process_index=p, process_count=2) for p in range(2)]
    ids = [shards[p].train_batch_source().sequence_ids(3) for p in range(2)]
    assert not set(ids[0].tolist()) & set(ids[1].tolist())
    val_whole = list(bundle.val_batches(2))
    val_parts = [list(s.val_batches(2)) for s in shards]
    assert len(val_parts[0]) == len(val_parts[1]) == len(val_whole) >= 1
    for step, batch in enumerate(val_whole):
        np.testing.assert_array_equal(
            np.concatenate([val_parts[0][step]["tokens"], val_parts[1][step]["tokens"]]), batch["tokens"]
        )


def test_iterator_state_round_trip_across_epoch_boundary(corpus, bundle):
    steps_per_epoch = bundle.num_train_sequences // 4
    first = bundle.make_train_iter()
    _take(first, steps_per_epoch - 2)
    state = json.loads(json.dumps(first.get_state()))  # checkpoints store it as JSON
    expected = _take(first, 5)  # crosses into the second epoch
    resumed = bundle.make_train_iter()
    resumed.set_state(state)
    np.testing.assert_array_equal(_take(resumed, 5), expected)
    # The state is the step of the next batch (the format the removed pure-Python iterator
    # shared, so its checkpoints restore into Grain), and batch s is the batch source's step s.
    assert state == {"next_index": steps_per_epoch - 2}
    source = bundle.train_batch_source()
    np.testing.assert_array_equal(expected, [source[steps_per_epoch - 2 + i]["tokens"] for i in range(5)])


def test_val_batches_are_finite_deterministic_and_capped(bundle):
    batches = list(bundle.val_batches(1))
    assert len(batches) == bundle.num_val_sequences
    np.testing.assert_array_equal([b["tokens"][0] for b in batches], bundle.val_sequences)
    assert len(list(bundle.val_batches(1, max_batches=1))) == 1
    with pytest.raises(ValueError, match=r"batch_size=10000: the validation split .* holds only \d+ sequences"):
        bundle.val_batches(10000)


# ---------------------------------------------------------------------------------------------
# Caching.


def test_second_build_reuses_caches(tmp_path):
    source = tmp_path / "txt"
    _write_corpus(source, num_docs=12)
    cfg = _cfg(source, tmp_path / "cache")
    first = build_data(cfg, global_batch=2)
    assert first.built_tokenizer and first.built_tokens
    cached_files = [os.path.join(first.cache_path, f) for f in os.listdir(first.cache_path)]
    cached_files.append(first.tokenizer_json_path)
    mtimes = {f: os.stat(f).st_mtime_ns for f in cached_files}
    second = build_data(cfg, global_batch=2)
    assert not second.built_tokenizer and not second.built_tokens
    assert {f: os.stat(f).st_mtime_ns for f in cached_files} == mtimes
    assert second.cache_path == first.cache_path
    # Packing is a view of the cached stream: another seq_len reuses the same token cache.
    longer = build_data(dataclasses.replace(cfg, seq_len=31), global_batch=2)
    assert not longer.built_tokens and longer.cache_path == first.cache_path
    # Editing the corpus invalidates both caches.
    with open(source / "doc_000.txt", "a") as handle:
        handle.write(" omega omega omega")
    edited = build_data(cfg, global_batch=2)
    assert edited.built_tokenizer and edited.built_tokens and edited.cache_path != first.cache_path


# ---------------------------------------------------------------------------------------------
# Sources and tokenizers.


def test_jsonl_parquet_and_txt_sources_give_the_same_tokens(tmp_path, corpus):
    texts = corpus["texts"][:12]
    jsonl = tmp_path / "docs.jsonl"
    with open(jsonl, "w") as handle:
        for text in texts:
            handle.write(json.dumps({"id": 1, "text": text}) + "\n")
        handle.write("\n")  # blank lines are skipped
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts, "other": list(range(len(texts)))}), parquet)
    single_txt = tmp_path / "docs.txt"
    single_txt.write_text("\n\n".join(t.strip() for t in texts))
    txt_dir = tmp_path / "txt"
    _write_corpus(txt_dir, num_docs=12)  # same seed: the same 12 texts

    tokenizer = os.path.join(corpus["cache"], "user_tokenizer.json")
    shutil.copy(build_data(_cfg(corpus["dir"], corpus["cache"]), global_batch=4).tokenizer_json_path, tokenizer)
    results = {}
    for name, source, extra in (("jsonl", jsonl, {}), ("parquet", parquet, {}), ("dir", txt_dir, {}),
                                ("txt", single_txt, {"txt_separator": "\n\n"})):
        built = build_data(_cfg(source, tmp_path / "cache", tokenizer=tokenizer, **extra), global_batch=2)
        assert len(built.train_document_ids) + len(built.val_document_ids) == 12
        results[name] = built
    np.testing.assert_array_equal(results["jsonl"].train_sequences, results["parquet"].train_sequences)
    np.testing.assert_array_equal(results["jsonl"].train_sequences, results["dir"].train_sequences)
    # The single .txt file lost each text's trailing newline to the separator: same count of docs.
    assert results["txt"].num_train_documents == results["jsonl"].num_train_documents


def test_user_tokenizer_file(tmp_path, corpus, bundle):
    user_dir = tmp_path / "my_model"
    user_dir.mkdir()
    shutil.copy(bundle.tokenizer_json_path, user_dir / "tokenizer.json")
    cfg = _cfg(corpus["dir"], tmp_path / "cache", tokenizer=str(user_dir / "tokenizer.json"),
               vocab_size=1)  # vocab_size is ignored for a tokenizer file
    built = build_data(cfg, global_batch=4)
    assert not built.built_tokenizer and built.vocab_size == bundle.vocab_size
    np.testing.assert_array_equal(built.train_sequences, bundle.train_sequences)
    # A HF model directory holding tokenizer.json works too.
    by_dir = build_data(dataclasses.replace(cfg, tokenizer=str(user_dir)), global_batch=4)
    np.testing.assert_array_equal(by_dir.train_sequences, bundle.train_sequences)


def test_literal_eot_text_inside_a_document_is_not_a_boundary(tmp_path):
    source = tmp_path / "txt"
    _write_corpus(source, num_docs=10)
    with open(source / "doc_004.txt", "a") as handle:
        handle.write(" the string <|endoftext|> appears in this file ")
    built = build_data(_cfg(source, tmp_path / "cache", val_fraction=0.0), global_batch=2)
    stream = np.load(os.path.join(built.cache_path, "train.npy"))
    assert int((stream == built.eot_id).sum()) == 10
    ends = np.cumsum(np.load(os.path.join(built.cache_path, "train_doc_lengths.npy"))) - 1
    np.testing.assert_array_equal(np.flatnonzero(stream == built.eot_id), ends)


def test_stdlib_source_smoke(tmp_path):
    cfg = DataConfig(vocab_size=400, seq_len=32, max_documents=20, cache_dir=str(tmp_path),
                     progress=False)
    built = build_data(cfg, global_batch=4)
    assert built.num_train_documents + built.num_val_documents == 20
    assert built.num_val_documents == 1  # round(0.05 * 20)
    tokens = next(built.train_iter)["tokens"]
    assert tokens.shape == (4, 33) and tokens.dtype == np.int32
    assert 0 <= tokens.min() and tokens.max() < built.vocab_size
    first_doc = next(data_lib.iter_documents(cfg))
    assert built.tokenizer.decode(built.tokenizer.encode(first_doc).ids) == first_doc


# ---------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    "field, value",
    [("seq_len", 0), ("vocab_size", 100), ("val_fraction", 1.0), ("val_fraction", -0.1),
     ("max_documents", 0), ("seed", -1), ("split_seed", -1), ("prefetch", -1), ("num_threads", -1),
     ("txt_separator", ""), ("txt_separator", "\\q"), ("eot_token", ""), ("source", ""), ("tokenizer", ""),
     ("synthetic_sequences", 1), ("bpe_min_frequency", 0), ("encode_chunk_documents", 0), ("cache_dir", ""),
     ("text_field", "")],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^data\.{field}\b"):
        DataConfig(**{field: value})


def test_build_errors(tmp_path, corpus):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"data.source='.*missing': no such file or directory"):
        build_data(_cfg(tmp_path / "missing", cache), global_batch=2)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unknown file type '\.csv'"):
        build_data(_cfg(tmp_path / "data.csv", cache), global_batch=2)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no file ending in"):
        build_data(_cfg(empty, cache), global_batch=2)
    (empty / "a.txt").write_text("")
    with pytest.raises(ValueError, match="the corpus has no non-empty documents"):
        build_data(_cfg(empty, cache), global_batch=2)
    (empty / "a.txt").write_text("just one document")
    with pytest.raises(ValueError, match=r"data.val_fraction=0.1: the corpus has only 1 document.*data.txt_separator"):
        build_data(_cfg(empty, cache), global_batch=2)
    with pytest.raises(ValueError, match=r"corpus too small: the training split has \d+ sequences .* "
                                         r"global_batch=100000 sequences"):
        build_data(_cfg(corpus["dir"], corpus["cache"]), global_batch=100000)
    with pytest.raises(ValueError, match=r"global_batch=5 \(train.global_batch\) is not divisible by process_count=2"):
        build_data(_cfg(corpus["dir"], corpus["cache"]), global_batch=5, process_count=2)
    with pytest.raises(ValueError, match="process_index=2"):
        build_data(_cfg(corpus["dir"], corpus["cache"]), global_batch=4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"data.tokenizer='.*nope.json': no such tokenizer file"):
        build_data(_cfg(corpus["dir"], cache, tokenizer=str(tmp_path / "nope.json")), global_batch=2)
    no_val = build_data(_cfg(corpus["dir"], corpus["cache"], val_fraction=0.0), global_batch=2)
    with pytest.raises(ValueError, match="no validation split"):
        no_val.val_batches(2)


def test_jsonl_and_parquet_errors(tmp_path):
    cache = tmp_path / "cache"
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: JSONL line has no 'text' field \(found \['body'\]\)"):
        build_data(_cfg(bad_jsonl, cache), global_batch=1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        build_data(_cfg(broken, cache), global_batch=1)
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"content": ["a", "b"]}), parquet)
    with pytest.raises(ValueError, match=r"Parquet file has no 'text' column \(columns: \['content'\]\)"):
        build_data(_cfg(parquet, cache), global_batch=1)
    # Bytes that are not UTF-8 (with their line), a file that is not Parquet, a column of numbers, a
    # tokenizer.json that does not load: each named.
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "fake.parquet").write_text("this is not parquet\n")
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    for name, match in (("latin.jsonl", r"latin.jsonl:2: not valid UTF-8"),
                        ("fake.parquet", r"fake.parquet: not a readable Parquet file"),
                        ("ints.parquet", r"ints.parquet: column 'text' holds int64, expected strings")):
        with pytest.raises(ValueError, match=match):
            build_data(_cfg(tmp_path / name, cache), global_batch=1)
    bad_tok = tmp_path / "tokenizer.json"
    bad_tok.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer.json: not a valid tokenizer.json"):
        tokenizer_lib.load_tokenizer(str(bad_tok))


def test_tokenizer_without_eot_token_is_rejected(tmp_path, corpus):
    trained = tokenizer_lib.train_bpe(corpus["texts"], vocab_size=300, eot_token="</s>", show_progress=False)
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    with pytest.raises(ValueError, match=r"data.eot_token='<\|endoftext\|>' is not in the vocabulary"):
        build_data(_cfg(corpus["dir"], tmp_path / "cache", tokenizer=str(path)), global_batch=2)
    # Naming the file's own end-of-text token works.
    built = build_data(_cfg(corpus["dir"], tmp_path / "cache", tokenizer=str(path), eot_token="</s>"),
                       global_batch=2)
    assert built.eot_id == 0


# ---------------------------------------------------------------------------------------------
# The synthetic source.


def _synthetic(global_batch=4, process_index=0, process_count=1, **overrides) -> data_lib.DataBundle:
    fields = dict(source="synthetic", vocab_size=7, seq_len=5, synthetic_sequences=64, val_fraction=0.25,
                  progress=False)
    fields.update(overrides)
    return build_data(DataConfig(**fields), global_batch=global_batch, process_index=process_index,
                      process_count=process_count)


def test_synthetic_source_is_deterministic_at_any_vocab_and_seq_len():
    bundle = _synthetic()
    assert bundle.tokenizer is None and bundle.tokenizer_json_path is None and bundle.cache_path is None
    assert (bundle.num_train_sequences, bundle.num_val_sequences) == (48, 16)
    batches = _take(bundle.train_iter, 30)  # 2.5 epochs of 12 steps
    for batch in batches:
        assert batch.dtype == np.int32 and batch.shape == (4, 6)
        assert batch.min() >= 0 and batch.max() < 7
    counts = np.bincount(np.concatenate(batches).ravel(), minlength=7)
    assert counts.min() > 0.5 * counts.mean(), f"ids far from uniform: {counts}"
    np.testing.assert_array_equal(batches, _take(_synthetic().train_iter, 30))
    # Every epoch visits each training sequence once, like a corpus.
    rows = {tuple(row) for batch in batches[:12] for row in batch}
    assert len(rows) == 48
    # The token values follow split_seed, the order follows seed; fingerprints follow the values.
    assert not np.array_equal(batches, _take(_synthetic(split_seed=1).train_iter, 30))
    reordered = _synthetic(seed=1)
    assert reordered.source_fingerprint == bundle.source_fingerprint
    assert not np.array_equal(batches[:12], _take(reordered.train_iter, 12))
    assert {tuple(row) for batch in _take(reordered.train_iter, 12) for row in batch} == rows
    assert _synthetic(split_seed=1).source_fingerprint != bundle.source_fingerprint
    wide = _synthetic(vocab_size=50_000, seq_len=33)
    tokens = next(wide.train_iter)["tokens"]
    assert tokens.shape == (4, 34) and tokens.max() < 50_000 and len(np.unique(tokens)) > 100


def test_synthetic_tables_index_like_arrays_and_splits_differ():
    bundle = _synthetic()
    table = np.asarray(bundle.train_sequences)
    assert table.shape == (48, 6)
    np.testing.assert_array_equal(bundle.train_sequences[np.array([5, 2, 5])], table[[5, 2, 5]])
    np.testing.assert_array_equal(bundle.train_sequences[3:9], table[3:9])
    val = np.asarray(bundle.val_sequences)
    assert not {tuple(r) for r in val} & {tuple(r) for r in table}, "validation rows must not be training rows"
    with pytest.raises(IndexError):
        bundle.train_sequences[np.array([48])]


def test_synthetic_process_slices_state_and_validation():
    whole = _synthetic(global_batch=4)
    parts = [_synthetic(global_batch=4, process_index=p, process_count=2) for p in range(2)]
    expected = _take(whole.train_iter, 15)
    got = [_take(part.train_iter, 15) for part in parts]
    for step in range(15):
        np.testing.assert_array_equal(np.concatenate([got[0][step], got[1][step]]), expected[step])
    resumed = whole.make_train_iter()
    resumed.set_state(json.loads(json.dumps({"next_index": 10})))
    np.testing.assert_array_equal(_take(resumed, 5), expected[10:])
    val = list(whole.val_batches(4))
    assert len(val) == 4 and all(b["tokens"].shape == (4, 6) for b in val)
    assert len(list(whole.val_batches(4, max_batches=2))) == 2
    with pytest.raises(ValueError, match="data.val_fraction=0"):
        _synthetic(val_fraction=0.0).val_batches(4)
    with pytest.raises(ValueError, match="data.synthetic_sequences=8"):
        _synthetic(synthetic_sequences=8, global_batch=8)


# ---------------------------------------------------------------------------------------------
# Issue 11 item 6: a single .txt corpus from the command line; no validation split.


def _book(tmp_path, paragraphs: int = 60) -> str:
    rng = np.random.default_rng(3)
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS, size=int(rng.integers(10, 40))))
                                for _ in range(paragraphs)))
    return str(path)


def _micro(*overrides: str):
    from twell_jax.configs import get_config
    from twell_jax import config as config_lib

    return config_lib.apply_overrides(get_config("micro"), list(overrides))


def test_txt_separator_escapes_from_the_command_line(tmp_path):
    book = _book(tmp_path)
    cfg = _micro(f"data.source={book}", "data.max_documents=none", r"data.txt_separator=\n\n", f"data.cache_dir={tmp_path / 'cache'}")
    assert cfg.data.txt_separator == r"\n\n" and cfg.data.txt_separator_text == "\n\n"
    built = build_data(cfg.data, global_batch=cfg.train.global_batch)
    assert built.num_train_documents + built.num_val_documents == 60
    # The same separator written in Python shares the caches (keys use the decoded separator).
    again = build_data(dataclasses.replace(cfg.data, txt_separator="\n\n"), global_batch=cfg.train.global_batch)
    assert not again.built_tokens and again.cache_path == built.cache_path
    lines = build_data(dataclasses.replace(cfg.data, txt_separator=r"\n"), global_batch=cfg.train.global_batch)
    assert lines.num_train_documents + lines.num_val_documents == 60  # blank lines are empty documents
    with pytest.raises(ValueError, match=r"data.txt_separator='\\\\x'.*unknown escape"):
        _micro(r"data.txt_separator=\x")


def test_training_without_a_validation_split_is_refused_before_it_starts(tmp_path):
    """Used to train the whole run, then fail at the final evaluation with no summary."""
    from twell_jax.training.train import Trainer

    book = _book(tmp_path)
    run_dir = tmp_path / "run"
    cfg = _micro(f"data.source={book}", "data.max_documents=none", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0")
    with pytest.raises(ValueError, match=r"data.val_fraction=0 leaves no validation split.*"
                                         r"train.eval_batch_size=8.*data.txt_separator"):
        Trainer(cfg, run_dir, echo=lambda _: None)
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    # A validation split smaller than one evaluation batch is refused up front too.
    small = _micro(f"data.source={book}", "data.max_documents=none", r"data.txt_separator=\n\n", f"data.cache_dir={tmp_path / 'cache'}",
                   "data.val_fraction=0.02", "train.eval_batch_size=8")
    with pytest.raises(ValueError, match=r"the validation split has \d sequences .* fewer than one evaluation "
                                         r"batch.*train.eval_batch_size=8"):
        Trainer(small, run_dir, echo=lambda _: None)


def test_saved_configs_with_the_removed_iterator_field_still_load():
    from twell_jax import config as config_lib

    cfg = _micro()
    saved = config_lib.to_dict(cfg)
    saved["data"]["iterator"] = "python"  # as written by checkpoints before Grain became required
    with pytest.warns(FutureWarning, match=r"data.iterator no longer exists.*same batches"):
        assert config_lib.from_dict(saved) == cfg
    with pytest.raises(ValueError, match="unknown config field 'data.iterator'"):
        config_lib.apply_overrides(cfg, ["data.iterator=grain"])


# ---------------------------------------------------------------------------------------------
# What the run directory records: the tokenizer file and the corpus fingerprint.


def test_source_fingerprint_follows_the_content_not_the_location(tmp_path, bundle):
    source = tmp_path / "txt"
    _write_corpus(source, num_docs=12)
    first = build_data(_cfg(source, tmp_path / "cache"), global_batch=2)
    assert os.path.isfile(first.tokenizer_json_path) and len(first.source_fingerprint) == 64
    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    elsewhere = build_data(_cfg(moved, tmp_path / "cache"), global_batch=2)
    assert elsewhere.source_fingerprint == first.source_fingerprint
    with open(moved / "doc_003.txt", "a") as handle:
        handle.write(" kappa")
    assert build_data(_cfg(moved, tmp_path / "cache"), global_batch=2).source_fingerprint != first.source_fingerprint
    assert bundle.source_fingerprint != first.source_fingerprint  # 41 documents, not 12


def test_damaged_token_cache_is_named(tmp_path):
    source = tmp_path / "txt"
    _write_corpus(source, num_docs=12)
    cfg = _cfg(source, tmp_path / "cache")
    built = build_data(cfg, global_batch=2)
    with open(os.path.join(built.cache_path, "meta.json"), "w") as handle:
        handle.write("{not json")
    with pytest.raises(ValueError, match=rf"token cache {built.cache_path} is damaged"):
        build_data(cfg, global_batch=2)


def test_command_line_builds_and_reports(tmp_path, capsys):
    from twell_jax.data.__main__ import main

    main(["--source", "synthetic", "--vocab-size", "11", "--seq-len", "4", "--global-batch", "2"])
    expected = data_lib.synthetic_data(DataConfig(source="synthetic", vocab_size=11, seq_len=4), global_batch=2)
    assert expected.source_fingerprint[:16] in capsys.readouterr().out  # it built and reported this data
    with pytest.raises(SystemExit):
        main(["--source", str(tmp_path / "missing"), "--cache-dir", str(tmp_path)])
    assert "data.source=" in capsys.readouterr().err

