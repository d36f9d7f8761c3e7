"""Log-likelihood scoring of text under a loaded model: what evaluation harnesses ask of a model.

No lm-eval here (`twell_jax/inference/harness.py` adapts this to it), so the numerics are tested on
their own. Three requests, in tokens:

- `loglikelihoods(pairs)`: for each (context ids, continuation ids), the summed log-probability of
  the continuation given the context, and whether greedy decoding would have produced it (every
  continuation token is its position's argmax). A pair longer than the context window keeps its
  last `max_length + 1` tokens (the context loses its beginning); a continuation longer than the
  window is an error.
- `rolling_pairs(doc)`: a whole document as (context, continuation) pairs whose continuations
  tile it, each token predicted exactly once, every prediction with as much context as the window
  holds (the first from the prefix token alone): the log-likelihood of a document longer than the
  context window is the sum of its pairs' (`loglikelihood_rolling`).
- `encode_pair(context, continuation)`: the pair's token ids as a causal LM's harness builds them:
  whitespace that ends the context moves to the continuation, the two are encoded together and
  split where the context's own encoding ends (a BPE merges across the boundary otherwise
  differently from the text as trained); an empty context becomes the prefix token.

Batches: requests are sorted by length (longest first, so a batch that does not fit memory fails at
once), cut into batches of `batch_size` rows, right-padded to a power-of-two length (at least
`MIN_LENGTH_BUCKET`, at most the window) and a power-of-two row count: the compiled programs are
bounded by (row buckets) x (length buckets). Right padding changes nothing before it in a causal
model, so every row scores exactly what it would alone. Results come back in request order. The
forward is the model's own (`Transformer.__call__`): its FFN op backend ("auto" on a GPU runs the
sparse kernels where the run's hints say they win), its attention, its dtype; log-softmax in fp32.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.pallas_kernels.common import next_pow2

if TYPE_CHECKING:  # pragma: no cover - typing only
    from twell_jax.inference.load import LoadedModel

# Shortest padded length: short requests share one program.
MIN_LENGTH_BUCKET = 16
DEFAULT_BATCH_SIZE = 16

TokenPair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
# progress(done, total): called after each batch's results are on the host.
ProgressFn = Callable[[int, int], None]


def rolling_pairs(tokens: Sequence[int], prefix_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """`tokens` (a whole document) as (context, continuation) pairs for a window of `max_length`
    input tokens: continuations tokens[0:W], tokens[W:2W], ...; each pair's context is what
    precedes its continuation in [prefix_id] + tokens, cut so that context + continuation is at
    most W + 1 tokens (the last prediction of every pair sees W tokens, or all there are)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    seq = [int(prefix_id)] + [int(t) for t in tokens]  # token j of the document is seq[j + 1]
    pairs = []
    for start in range(0, len(tokens), max_length):
        end = min(start + max_length, len(tokens))
        pairs.append((seq[max(0, end - max_length):start + 1], seq[start + 1:end + 1]))
    return pairs


class Scorer:
    """Scores token sequences with a loaded model (see the module docstring).

    `batch_size`: rows per forward (rounded up to a power of two for the programs' shapes);
    `max_length`: the context window in tokens (default, and at most, model.max_seq_len)."""

    def __init__(self, loaded: "LoadedModel", *, batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None):
        model_cfg = loaded.config.model
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        window = model_cfg.max_seq_len if max_length is None else max_length
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= model_cfg.max_seq_len:
            raise ValueError(f"max_length must be an int in [1, model.max_seq_len={model_cfg.max_seq_len}], "
                             f"got {max_length!r}")
        self.loaded = loaded
        self.batch_size = batch_size
        self.max_length = window
        self.vocab_size = model_cfg.vocab_size
        self.graphdef, self.state = nnx.split(loaded.model)
        self.traces = 0  # programs traced so far (one per (rows, length) bucket)

        def score(state: nnx.State, tokens_BxS: jax.Array, targets_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
            """(log p(target) at every position [B, S] in fp32, whether the target is the argmax [B, S])."""
            self.traces += 1
            logits_BxSxV, _ = nnx.merge(self.graphdef, state)(tokens_BxS)
            logp_BxSxV = jax.nn.log_softmax(logits_BxSxV.astype(jnp.float32), axis=-1)
            target_logp_BxS = jnp.take_along_axis(logp_BxSxV, targets_BxS[..., None], axis=-1)[..., 0]
            greedy_BxS = jnp.argmax(logits_BxSxV, axis=-1) == targets_BxS
            return target_logp_BxS, greedy_BxS

        self._score = jax.jit(score)

    # ------------------------------------------------------------------ text

    @property
    def tokenizer(self):
        if self.loaded.tokenizer is None:
            raise ValueError("this model has no tokenizer (a run on synthetic tokens, or a checkpoint without "
                             "tokenizer.json): text cannot be scored")
        return self.loaded.tokenizer

    @property
    def prefix_id(self) -> int:
        """The token a document starts after: the end-of-text id the run's documents are joined by."""
        if self.loaded.eos_id is None:
            eot = self.loaded.config.data.eot_token
            raise ValueError(f"the tokenizer has no end-of-text token {eot!r} (data.eot_token): not this run's "
                             "tokenizer, or the run has none; an empty context and a document's first token need it")
        return int(self.loaded.eos_id)

    def encode(self, text: str) -> list[int]:
        """`text`'s ids as the run's documents were encoded (no special tokens; the literal text of a
        special token encoded as text: `data.tokenizer.encode_documents`)."""
        from twell_jax.data.tokenizer import encode_documents

        ids = encode_documents(self.tokenizer, [text])[0]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"the tokenizer gives ids outside the model's vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}; not this run's tokenizer")
        return ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a text pair (see the module docstring)."""
        if not context:
            cont = self.encode(continuation)
            return [self.prefix_id], cont
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        if not stripped:  # a context of whitespace only: all of it moved to the continuation
            return [self.prefix_id], self.encode(continuation)
        whole = self.encode(stripped + continuation)
        ctx = self.encode(stripped)
        return ctx, whole[len(ctx):]

    # ------------------------------------------------------------------ scoring

    def loglikelihoods(self, pairs: Sequence[TokenPair],
                       progress: ProgressFn | None = None) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) per pair, in the order given."""
        rows = []
        for i, (context, continuation) in enumerate(pairs):
            context, continuation = [int(t) for t in context], [int(t) for t in continuation]
            if not continuation:
                raise ValueError(f"request {i}: the continuation is empty (nothing to score)")
            if not context:
                raise ValueError(f"request {i}: the context is empty (give at least the prefix token, "
                                 f"{self.loaded.eos_id})")
            if len(continuation) > self.max_length:
                raise ValueError(f"request {i}: the continuation has {len(continuation)} tokens, more than the "
                                 f"context window of {self.max_length} (model.max_seq_len) can score at once")
            full = (context + continuation)[-(self.max_length + 1):]
            bad = [t for t in full if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"request {i}: token ids outside [0, {self.vocab_size}): {bad[:5]}")
            rows.append((full, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        done = 0
        pending = None
        # One batch ahead: the next batch is dispatched before the host waits for this one's results.
        for batch in batches + [None]:
            launched = (batch, self._launch([rows[i] for i in batch])) if batch is not None else None
            if pending is not None:
                indices, (logp_BxS, greedy_BxS) = pending
                logp_BxS, greedy_BxS = np.asarray(logp_BxS, np.float64), np.asarray(greedy_BxS)
                for b, i in enumerate(indices):
                    full, n_cont = rows[i]
                    end = len(full) - 1  # input positions 0..end-1 predict full[1..end]
                    scored = slice(end - n_cont, end)
                    results[i] = (float(logp_BxS[b, scored].sum()), bool(greedy_BxS[b, scored].all()))
                done += len(indices)
                if progress is not None:
                    progress(done, len(rows))
            pending = launched
        return results  # type: ignore[return-value]

    def _launch(self, batch: list[tuple[list[int], int]]) -> tuple[jax.Array, jax.Array]:
        """Dispatch one batch's forward (asynchronous): rows right-padded to the bucket shapes."""
        longest = max(len(full) - 1 for full, _ in batch)
        length = min(max(next_pow2(longest), MIN_LENGTH_BUCKET), self.max_length)
        n_rows = min(next_pow2(len(batch)), next_pow2(self.batch_size))
        tokens_BxS = np.zeros((n_rows, length), np.int32)
        targets_BxS = np.zeros((n_rows, length), np.int32)
        for b, (full, _) in enumerate(batch):
            tokens_BxS[b, :len(full) - 1] = full[:-1]
            targets_BxS[b, :len(full) - 1] = full[1:]
        return self._score(self.state, jnp.asarray(tokens_BxS), jnp.asarray(targets_BxS))

    def rolling_loglikelihoods(self, docs: Sequence[Sequence[int]],
                               progress: ProgressFn | None = None) -> list[float]:
        """The log-likelihood of each whole document (token ids, after the prefix token), in order:
        the sum over its `rolling_pairs`, all documents' pairs scored in shared batches."""
        pairs, owner = [], []
        for d, doc in enumerate(docs):
            for pair in rolling_pairs(doc, self.prefix_id, self.max_length):
                pairs.append(pair)
                owner.append(d)
        totals = [0.0] * len(docs)
        for d, (logp, _) in zip(owner, self.loglikelihoods(pairs, progress)):
            totals[d] += logp
        return totals
