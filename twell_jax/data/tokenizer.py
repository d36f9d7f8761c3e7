"""Tokenizers: train a byte-level BPE on a corpus (cached), or load a user `tokenizer.json`.

Both paths return a HF `tokenizers.Tokenizer` whose end-of-text token exists; the data pipeline
appends that token to every document. `tokenizers` is imported lazily so that code reading an
already-tokenized cache does not need it at import time.

A tokenizer's identity is `tokenizer_hash`, a content hash; a run records its tokenizer's in
`data_fingerprint.json` (`tokenizer_record`), and `training.run_tokenizer.run_tokenizer_hash` reads
it back (old runs: computed from their tokenizer.json). Wherever two things must share a tokenizer (the runs of a
comparison, a checkpoint and the data it is trained or evaluated on, an export and its import)
`check_same_tokenizer` compares the hashes.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twell_jax.config import MIN_BPE_VOCAB_SIZE, DataConfig
from twell_jax.data.cache_dir import cache_key, log, new_tmp_dir, publish
from twell_jax.data.sources import SourceFile, iter_documents

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer


def resolve_tokenizer_path(path: str) -> str:
    """Returns the `tokenizer.json` that `path` names (the file itself, or the one in a HF model dir)."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        expanded = os.path.join(expanded, "tokenizer.json")
    if not os.path.isfile(expanded):
        raise ValueError(
            f"data.tokenizer={path!r}: no such tokenizer file (expected 'bpe' or a path to a tokenizer.json "
            "or to a directory holding one)"
        )
    return expanded


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes (tokenizer files are small, so hashing them is cheap)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def train_bpe(
    documents: Iterable[str],
    *,
    vocab_size: int,
    eot_token: str,
    num_documents: int | None = None,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> "Tokenizer":
    """Trains a byte-level BPE (GPT-2 style pre-tokenization) with `eot_token` as special id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB_SIZE:
        raise ValueError(
            f"data.vocab_size={vocab_size}: a byte-level BPE needs at least {MIN_BPE_VOCAB_SIZE} "
            "(256 bytes + the end-of-text token)"
        )
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: a document's first word is encoded as written (no invented space).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=show_progress,
        # Listed first so it gets id 0 (as in the reference recipe, where bos = eos = 0).
        special_tokens=[eot_token],
        # All 256 byte symbols are in the vocabulary even if the corpus lacks some: no unknown tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_non_empty(documents), trainer=trainer, length=num_documents)
    return tokenizer


def load_tokenizer(path: str) -> "Tokenizer":
    """Loads a `tokenizer.json` (a file or a HF model directory holding one)."""
    from tokenizers import Tokenizer

    resolved = resolve_tokenizer_path(path)
    try:
        return Tokenizer.from_file(resolved)
    except Exception as error:  # noqa: BLE001 (the tokenizers library raises a bare Exception on bad JSON)
        raise ValueError(f"{resolved}: not a valid tokenizer.json ({error})") from None


def eot_token_id(tokenizer: "Tokenizer", eot_token: str, *, where: str) -> int:
    """The id of `eot_token` in `tokenizer`; a clear error when the token is missing."""
    token_id = tokenizer.token_to_id(eot_token)
    if token_id is None:
        raise ValueError(
            f"data.eot_token={eot_token!r} is not in the vocabulary of the tokenizer {where}; set "
            "data.eot_token to its end-of-text token (e.g. '<|endoftext|>' or '</s>')"
        )
    return int(token_id)


def encode_documents(tokenizer: "Tokenizer", documents: list[str]) -> list[list[int]]:
    """Batch-encodes documents without special tokens (the caller appends the end-of-text id).

    The literal text of a special token inside a document (say "<|endoftext|>" in a source file
    that mentions it) is encoded as ordinary text, so the end-of-text id marks only real document
    boundaries.
    """
    previous = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        # encode_batch_fast skips offset tracking, which we never use.
        encodings = tokenizer.encode_batch_fast(documents, add_special_tokens=False)
    finally:
        tokenizer.encode_special_tokens = previous
    return [encoding.ids for encoding in encodings]


def _non_empty(documents: Iterable[str]) -> Iterator[str]:
    for document in documents:
        if document:
            yield document


def get_tokenizer(
    cfg: DataConfig, files: list[SourceFile], listing: dict[str, Any], is_val_fn: Callable[[], np.ndarray],
) -> tuple["Tokenizer", str, bool]:
    """(tokenizer, path of its tokenizer.json, whether this call trained it).

    `cfg.tokenizer == "bpe"`: a BPE trained on the training documents (`is_val_fn()` gives the
    split), cached under `cache_dir/tokenizers/bpe-<key>`; otherwise the user's file.
    """
    if cfg.tokenizer != "bpe":
        path = resolve_tokenizer_path(cfg.tokenizer)
        return load_tokenizer(path), path, False
    key = cache_key({"source": listing, "vocab_size": cfg.vocab_size, "eot_token": cfg.eot_token,
                     "min_frequency": cfg.bpe_min_frequency})
    final_dir = os.path.join(os.path.expanduser(cfg.cache_dir), "tokenizers", f"bpe-{key}")
    path = os.path.join(final_dir, "tokenizer.json")
    if os.path.isfile(path):
        log(cfg, f"BPE tokenizer: cached at {path}")
        return load_tokenizer(path), path, False
    is_val = is_val_fn()
    num_train = int((~is_val).sum())
    log(cfg, f"training a byte-level BPE (vocab {cfg.vocab_size}) on {num_train} training documents"
             f" of {cfg.source!r}; caching it at {path}")
    start = time.perf_counter()
    train_docs = (d for d, held_out in zip(iter_documents(cfg, files), is_val) if not held_out)
    trained = train_bpe(train_docs, vocab_size=cfg.vocab_size, eot_token=cfg.eot_token,
                        num_documents=num_train, min_frequency=cfg.bpe_min_frequency,
                        show_progress=cfg.progress)
    tmp_dir = new_tmp_dir(final_dir)
    trained.save(os.path.join(tmp_dir, "tokenizer.json"))
    publish(tmp_dir, final_dir)
    log(cfg, f"BPE trained in {time.perf_counter() - start:.1f}s ({trained.get_vocab_size()} tokens)")
    return load_tokenizer(path), path, True


# ----------------------------------------------------------------------------- identity

# Top-level fields of a tokenizer's serialization that do not decide which ids a text gets: the
# format's version, and the encoder's runtime settings (enable_truncation, enable_padding).
_NOT_IDENTITY = ("version", "truncation", "padding")


def tokenizer_hash(tokenizer: "Tokenizer") -> str:
    """The tokenizer's content hash: hex SHA-256 of its serialization (model with vocabulary and
    merges, added and special tokens, normalizer, pre-tokenizer, post-processor, decoder) as
    canonical JSON (sorted keys, no whitespace). The same tokenizer hashes equal whichever file it
    was read from (pretty or compact, a run's copy, an export); a changed token, merge or special
    token changes it. The serialization is the installed `tokenizers`' own, so a hash is compared
    with hashes of the same library version (`training.run_tokenizer.run_tokenizer_hash`)."""
    document = json.loads(tokenizer.to_str())
    for key in _NOT_IDENTITY:
        document.pop(key, None)
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_file_hash(path: str | Path) -> str:
    """`tokenizer_hash` of a tokenizer.json (a file or a directory holding one)."""
    return tokenizer_hash(load_tokenizer(str(path)))


def library_version() -> str:
    """The installed `tokenizers` version (a hash is compared with hashes of the same version)."""
    import tokenizers

    return tokenizers.__version__


def tokenizer_record(tokenizer_json_path: str | None) -> dict[str, Any]:
    """What a run records of its tokenizer in data_fingerprint.json: {"tokenizer": its hash,
    "tokenizers": the library version that serialized it}, or {"tokenizer": None} for a run
    without one (the synthetic source)."""
    if tokenizer_json_path is None:
        return {"tokenizer": None}
    return {"tokenizer": tokenizer_file_hash(tokenizer_json_path), "tokenizers": library_version()}


def check_same_tokenizer(have: str | None, have_what: str, want: str | None, want_what: str, fix: str) -> None:
    """A one-line ValueError "`have_what` (hash ...) is not `want_what` (hash ...): `fix`" (16 hex
    digits of each hash) unless the two tokenizers are the same; an unknown one (None) is not compared."""
    if have is not None and want is not None and have != want:
        raise ValueError(f"{have_what} (hash {have[:16]}) is not {want_what} (hash {want[:16]}): {fix}")
