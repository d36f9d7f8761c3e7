"""Tokenizers for twell-jax: train a byte-level BPE on a corpus, or load a user `tokenizer.json`.

Both paths return a HF `tokenizers.Tokenizer` whose end-of-text token exists; the data pipeline
appends that token to every document. `tokenizers` is imported lazily so that code reading an
already-tokenized cache does not need it at import time.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer

from twell_jax.config import MIN_BPE_VOCAB_SIZE  # noqa: E402  (256 bytes + end-of-text; re-exported)


def resolve_tokenizer_path(path: str) -> str:
    """Returns the `tokenizer.json` that `path` names (the file itself, or the one in a HF model dir)."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        expanded = os.path.join(expanded, "tokenizer.json")
    if not os.path.isfile(expanded):
        raise ValueError(
            f"tokenizer={path!r}: no such tokenizer file (expected 'bpe' or a path to a tokenizer.json "
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
            f"vocab_size={vocab_size}: a byte-level BPE needs at least {MIN_BPE_VOCAB_SIZE} "
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

    return Tokenizer.from_file(resolve_tokenizer_path(path))


def eot_token_id(tokenizer: "Tokenizer", eot_token: str, *, where: str) -> int:
    """The id of `eot_token` in `tokenizer`; a clear error when the token is missing."""
    token_id = tokenizer.token_to_id(eot_token)
    if token_id is None:
        raise ValueError(
            f"eot_token={eot_token!r} is not in the vocabulary of the tokenizer {where}; set "
            "DataConfig.eot_token to its end-of-text token (e.g. '<|endoftext|>' or '</s>')"
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
