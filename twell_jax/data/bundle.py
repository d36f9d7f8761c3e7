"""The one interface the trainer uses: `DataSource` (a Protocol) and its implementation
`DataBundle`, built from a corpus (`build_data`), from random tokens (`synthetic_data`), or from
an experiment config (`build_experiment_data`, the trainer's default data builder); and the
tokenizer alone (`build_tokenizer`, for inference)."""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from twell_jax.config import DataConfig, ExperimentConfig
from twell_jax.data import cache as cache_lib
from twell_jax.data import cache_dir
from twell_jax.data import tokenizer as tokenizer_lib
from twell_jax.data.batching import Batch, BatchIterator, SequenceTable, TrainBatchSource, grain_iterator, val_batches
from twell_jax.data.packing import pack
from twell_jax.data.sources import iter_documents, list_source_files, listing_fingerprint, select_validation
from twell_jax.data.synthetic import SyntheticSequences

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer


class DataSource(Protocol):
    """What the trainer and the evaluator need from the data."""

    vocab_size: int  # ids are in [0, vocab_size): the model's embedding must be at least this big
    eot_id: int  # end-of-text id appended to every document
    train_iter: BatchIterator  # infinite training batches; get_state/set_state go into checkpoints
    tokenizer_json_path: str | None  # the tokenizer.json in use; None for the synthetic source
    source_fingerprint: str  # content hash of the corpus (or of the synthetic settings)

    def make_train_iter(self) -> BatchIterator: ...

    def val_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[Batch]: ...


@dataclasses.dataclass
class DataBundle:
    """Vocabulary facts, the training iterator and the validation batches of one data build."""

    config: DataConfig
    vocab_size: int  # the tokenizer's vocabulary size (model embedding size)
    eot_id: int  # end-of-text id appended to every document
    global_batch: int  # sequences per training batch over all processes
    process_index: int
    process_count: int
    train_sequences: SequenceTable  # [num_train_sequences, seq_len + 1] (memory-mapped or synthetic)
    val_sequences: SequenceTable  # [num_val_sequences, seq_len + 1]
    # SHA-256 of the document sequence (texts in source order, before the split): the same corpus
    # gives the same value wherever it lives; for source="synthetic", of its settings.
    source_fingerprint: str
    tokenizer: "Tokenizer | None" = None  # None for the synthetic source
    tokenizer_json_path: str | None = None  # the tokenizer.json in use (trained BPE: inside cache_dir)
    cache_path: str | None = None  # directory holding the token caches of this build
    train_document_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    val_document_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    num_train_tokens: int = 0  # tokens in the training split (with end-of-text ids, before packing)
    num_val_tokens: int = 0
    built_tokenizer: bool = False  # True when this call trained the BPE (False: cache hit or user file)
    built_tokens: bool = False  # True when this call tokenized the corpus (False: cache hit)
    train_iter: BatchIterator = dataclasses.field(init=False)  # Grain iterator at step 0

    def __post_init__(self) -> None:
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

    def train_batch_source(self) -> TrainBatchSource:
        """Random access to this process's training batches by step (what the iterator walks)."""
        return TrainBatchSource(self.train_sequences, seed=self.config.seed, global_batch=self.global_batch,
                                process_index=self.process_index, process_count=self.process_count)

    def make_train_iter(self) -> BatchIterator:
        """A fresh training iterator at step 0 (restore a checkpoint into it with set_state)."""
        return grain_iterator(self.train_batch_source(), num_threads=self.config.num_threads,
                              prefetch=self.config.prefetch)

    def val_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[Batch]:
        """Validation batches in a fixed order: `batch_size` is global (like `global_batch`); each
        process gets its slice, `{"tokens": int32[batch_size // process_count, seq_len + 1]}`."""
        if self.config.val_fraction == 0:
            raise ValueError("val_batches: there is no validation split (data.val_fraction=0)")
        describe = (f"the validation split (data.val_fraction={self.config.val_fraction}: sequences of seq_len + 1 = "
                    f"{self.seq_len + 1} tokens, {self.num_val_tokens} tokens")
        if self.tokenizer is not None:
            describe += f" in {self.num_val_documents} documents"
        describe += "; `twell eval --split all` evaluates a whole corpus)"
        return val_batches(self.val_sequences, batch_size=batch_size, max_batches=max_batches,
                           process_index=self.process_index, process_count=self.process_count,
                           describe=describe)


def _check_layout(global_batch: int, process_index: int, process_count: int) -> None:
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch} (train.global_batch): expected a positive integer")
    if process_count < 1:
        raise ValueError(f"process_count={process_count}: expected a positive integer")
    if global_batch % process_count:
        raise ValueError(f"global_batch={global_batch} (train.global_batch) is not divisible by "
                         f"process_count={process_count}: every process must get the same number of sequences")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index}: expected 0 <= process_index < {process_count}")


def build_tokenizer(cfg: DataConfig) -> "Tokenizer | None":
    """The tokenizer `build_data(cfg)` would use (the user's file, or the cached / newly trained BPE),
    without tokenizing the corpus; None for the synthetic source."""
    if cfg.is_synthetic:
        return None
    files = list_source_files(cfg)
    # Only a BPE not yet cached needs the split (it trains on the training documents alone).
    tok, _, _ = tokenizer_lib.get_tokenizer(
        cfg, files, listing_fingerprint(cfg, files),
        lambda: select_validation(sum(1 for _ in iter_documents(cfg, files)), cfg))
    return tok


# How a multi-process run builds the caches once: coordinate(cfg, build) calls build(progress) as
# it sees fit and returns a process's bundle (the trainer's: training/shared_data.build_once).
Coordinate = Callable[[DataConfig, Callable[["cache_dir.BuildProgress | None"], "DataBundle"]], "DataBundle"]


def build_data(cfg: DataConfig, *, global_batch: int, process_index: int = 0, process_count: int = 1,
               coordinate: Coordinate | None = None) -> DataBundle:
    """Builds (or loads from cache) the tokenizer and token streams and returns the batch pipeline;
    `source="synthetic"` gives `synthetic_data(cfg, ...)`.

    `coordinate` (with process_count > 1, in a multi-process run where every process calls this):
    how the processes share the build, e.g. process 0 builds the caches while the others wait, then
    open them (twell_jax/training/shared_data.py); None: each process builds (or finds) them itself."""
    _check_layout(global_batch, process_index, process_count)
    if cfg.is_synthetic:
        return synthetic_data(cfg, global_batch=global_batch, process_index=process_index,
                              process_count=process_count)

    def build(progress: cache_dir.BuildProgress | None) -> DataBundle:
        return _build_from_corpus(cfg, global_batch, process_index, process_count,
                                  progress or cache_dir.BuildProgress())

    if process_count > 1 and coordinate is not None:
        return coordinate(cfg, build)
    return build(None)


def _build_from_corpus(cfg: DataConfig, global_batch: int, process_index: int, process_count: int,
                       progress: cache_dir.BuildProgress) -> DataBundle:
    start = time.perf_counter()
    files = list_source_files(cfg)
    listing = listing_fingerprint(cfg, files)
    is_val_cache: list[np.ndarray] = []

    def is_val_fn() -> np.ndarray:
        # Counting documents reads the corpus once more; only done when something must be built.
        if not is_val_cache:
            progress.start("counting the corpus's documents")
            is_val_cache.append(select_validation(sum(1 for _ in iter_documents(cfg, files)), cfg))
        return is_val_cache[0]

    def split_for_bpe() -> np.ndarray:  # get_tokenizer asks for the split only when it trains a BPE next
        split = is_val_fn()
        progress.start("training the BPE tokenizer")
        return split

    progress.start("looking for the tokenizer")
    tok, tokenizer_path, built_tokenizer = tokenizer_lib.get_tokenizer(cfg, files, listing, split_for_bpe)
    progress.start("looking for the token cache")
    eot_id = tokenizer_lib.eot_token_id(tok, cfg.eot_token, where=repr(cfg.tokenizer))
    tokens_key = cache_dir.cache_key({"source": listing, "tokenizer": tokenizer_lib.file_sha256(tokenizer_path),
                                      "eot_token": cfg.eot_token, "version": cache_lib.TOKEN_CACHE_VERSION})
    cache_path = os.path.join(os.path.expanduser(cfg.cache_dir), "tokens", tokens_key)
    built_tokens = not cache_lib.has_token_cache(cache_path)
    if built_tokens:
        cache_lib.build_token_cache(cfg, files, tok, tokenizer_path, eot_id, is_val_fn(), cache_path, progress)
    else:
        cache_dir.log(cfg, f"tokens: cached at {cache_path}")
    progress.start("opening the token cache")
    tokens = cache_lib.load_token_cache(cache_path)
    train_sequences = pack(tokens.train_tokens, cfg.seq_len)
    if len(train_sequences) < global_batch:
        raise ValueError(
            f"corpus too small: the training split has {len(train_sequences)} sequences of seq_len + 1 "
            f"= {cfg.seq_len + 1} tokens ({len(tokens.train_tokens)} tokens in "
            f"{len(tokens.train_document_ids)} documents), but one batch needs global_batch={global_batch} "
            "sequences (train.global_batch); use more documents (data.source / data.max_documents), a "
            "smaller data.seq_len or a smaller train.global_batch"
        )
    bundle = DataBundle(
        config=cfg, vocab_size=tok.get_vocab_size(), eot_id=eot_id, global_batch=global_batch,
        process_index=process_index, process_count=process_count, train_sequences=train_sequences,
        val_sequences=pack(tokens.val_tokens, cfg.seq_len), source_fingerprint=tokens.documents_sha256,
        tokenizer=tok, tokenizer_json_path=tokenizer_path, cache_path=cache_path,
        train_document_ids=tokens.train_document_ids, val_document_ids=tokens.val_document_ids,
        num_train_tokens=len(tokens.train_tokens), num_val_tokens=len(tokens.val_tokens),
        built_tokenizer=built_tokenizer, built_tokens=built_tokens,
    )
    cache_dir.log(cfg, f"data ready in {time.perf_counter() - start:.2f}s: vocab {bundle.vocab_size}, "
                       f"{bundle.num_train_sequences} train / {bundle.num_val_sequences} val sequences of "
                       f"{cfg.seq_len + 1} tokens ({bundle.num_train_documents} / {bundle.num_val_documents} "
                       "documents)")
    return bundle


def synthetic_data(cfg: DataConfig, *, global_batch: int, process_index: int = 0, process_count: int = 1) -> DataBundle:
    """Random token ids in [0, cfg.vocab_size), deterministic from `cfg.split_seed`, shuffled and
    sharded exactly like a corpus (`cfg.seed`, processes): `cfg.synthetic_sequences` sequences of
    seq_len + 1 tokens, `round(val_fraction * n)` of them (at least one) held out. No tokenizer
    (`tokenizer_json_path` is None), no cache, nothing read from disk; `source` is ignored."""
    _check_layout(global_batch, process_index, process_count)
    total = cfg.synthetic_sequences
    num_val = 0 if cfg.val_fraction == 0 else max(1, round(cfg.val_fraction * total))
    num_train = total - num_val
    if num_train < global_batch:
        raise ValueError(f"data.synthetic_sequences={total}: {num_train} training sequences after the "
                         f"validation split, fewer than one batch of global_batch={global_batch} "
                         "(train.global_batch); raise data.synthetic_sequences")
    width = cfg.seq_len + 1

    def table(split: int, count: int) -> SyntheticSequences:
        return SyntheticSequences(seed=cfg.split_seed, split=split, num_sequences=count, width=width,
                                  vocab_size=cfg.vocab_size)

    fingerprint = cache_dir.cache_key({"source": "synthetic", "split_seed": cfg.split_seed, "vocab_size": cfg.vocab_size,
                                       "seq_len": cfg.seq_len, "sequences": total, "val": num_val})
    return DataBundle(
        config=cfg, vocab_size=cfg.vocab_size, eot_id=0, global_batch=global_batch, process_index=process_index,
        process_count=process_count, train_sequences=table(0, num_train), val_sequences=table(1, num_val),
        source_fingerprint=f"synthetic-{fingerprint}",
        num_train_tokens=num_train * width, num_val_tokens=num_val * width,
    )


def build_experiment_data(cfg: ExperimentConfig, coordinate: Coordinate | None = None) -> DataBundle:
    """The trainer's data: `cfg.data` for this process's slice of `train.global_batch`, checked up
    front against the evaluation the run will do (a run must not train and then fail to evaluate).
    coordinate: `build_data`'s (the trainer passes training/shared_data.build_once)."""
    import jax

    bundle = build_data(cfg.data, global_batch=cfg.train.global_batch, process_index=jax.process_index(),
                        process_count=jax.process_count(), coordinate=coordinate)
    eval_batch = cfg.train.eval_batch_size
    if bundle.num_val_sequences < eval_batch:
        hint = (" (a single .txt file is one document: split it with data.txt_separator, e.g. '\\n\\n')"
                if cfg.data.txt_separator is None and cfg.data.source.lower().endswith(".txt") else "")
        if cfg.data.val_fraction == 0:
            problem, fix = "data.val_fraction=0 leaves no validation split", f"set data.val_fraction > 0{hint}"
        else:
            problem = (f"the validation split has {bundle.num_val_sequences} sequences of seq_len + 1 = "
                       f"{cfg.data.seq_len + 1} tokens, fewer than one evaluation batch")
            fix = f"raise data.val_fraction{hint} or lower train.eval_batch_size"
        raise ValueError(f"{problem}, but training evaluates batches of train.eval_batch_size={eval_batch} "
                         f"sequences at the end (and every train.eval_every steps): {fix}")
    return bundle
