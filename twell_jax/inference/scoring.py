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
  `encode_pairs` and `encode_many` do the same for many at once: the distinct texts (a
  multiple-choice item's choices share its context) in one batch call of the tokenizer.

Batches: requests are sorted by length (longest first, so a batch that does not fit memory fails at
once), cut into batches of `batch_size` rows, right-padded to a power-of-two length (at least
`MIN_LENGTH_BUCKET`, at most the window) and a power-of-two row count: the compiled programs are
bounded by (row buckets) x (length buckets). Right padding changes nothing before it in a causal
model, so every row scores exactly what it would alone. Results come back in request order. The
forward is the model's own (`Transformer.hidden_states`, then `Transformer.logits`): its FFN op
backend ("auto" on a GPU runs the sparse kernels where the run's hints say they win, each layer
planned by its forward alone: `load_run`'s `forward_only`), its attention, its dtype; the LM head and the
log-softmax (fp32) run only on a window of each row's positions that holds its continuation (the
batch's longest continuation rounded up to a power of two: a multiple-choice request's few tokens,
not its context; at a large vocabulary the head is a large share of the forward).

Host work per batch is kept off the device's path: one int32 array per batch (inputs and targets
are its two shifted views, sliced in the program), `IN_FLIGHT` batches dispatched before the host
waits for the oldest, the results' copy to the host started at dispatch, and each batch's sums and
greedy flags taken with array operations (fp64) rather than per request.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Sequence

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
# Batches dispatched and not yet read back: the host prepares batch k + IN_FLIGHT - 1 while the
# device runs batch k. Each holds its program's buffers until read back (peak memory grows with it).
IN_FLIGHT = 2

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


def target_scores(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log p(target) at every position [B, S] (log-softmax in fp32), whether the target is the
    argmax of its logits [B, S]).

    The argmax test is "the target's logit is the maximum and no lower id's logit is": argmax's
    first-maximum rule, the same for every row without NaN, as plain reductions (XLA's argmax on a
    CPU, a two-operand reduction, is several times slower than they are)."""
    logp_BxSxV = jax.nn.log_softmax(logits_BxSxV.astype(jnp.float32), axis=-1)
    target_logp_BxS = jnp.take_along_axis(logp_BxSxV, targets_BxS[..., None], axis=-1)[..., 0]
    max_BxS = jnp.max(logits_BxSxV, axis=-1)
    target_logit_BxS = jnp.take_along_axis(logits_BxSxV, targets_BxS[..., None], axis=-1)[..., 0]
    vocab_V = jnp.arange(logits_BxSxV.shape[-1], dtype=targets_BxS.dtype)
    lower_max_BxS = jnp.any((logits_BxSxV == max_BxS[..., None]) & (vocab_V < targets_BxS[..., None]), axis=-1)
    return target_logp_BxS, (target_logit_BxS == max_BxS) & ~lower_max_BxS


class ScoreProgram:
    """The jitted forward + `target_scores` of one loaded model, kept by the LoadedModel
    (`LoadedModel._score_program`) so that every Scorer over it (one per lm-eval call: a second
    evaluation in the same process, `twell compare --tasks`) reuses the compiled programs instead
    of compiling each (rows, length) bucket again."""

    def __init__(self, model: Any):
        self.graphdef, self.state = nnx.split(model)
        self.traces = 0  # programs traced so far (one per (rows, length, scored positions) bucket)
        self.shapes: list[tuple[int, int]] = []  # (rows, input length) of each program traced

        def score(state: nnx.State, sequence_BxS1: jax.Array, positions_BxC: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
            """`target_scores` at the input positions `positions_BxC` of each row: inputs
            `sequence_BxS1[:, :-1]`, targets `sequence_BxS1[:, 1:]`. The decoder runs on every
            position; the LM head and the log-softmax only on the C asked for (a multiple-choice
            request scores its few continuation tokens, not its whole context)."""
            self.traces += 1
            self.shapes.append((sequence_BxS1.shape[0], sequence_BxS1.shape[1] - 1))
            model = nnx.merge(self.graphdef, state)
            hidden_BxSxD, _ = model.hidden_states(sequence_BxS1[:, :-1])
            hidden_BxCxD = jnp.take_along_axis(hidden_BxSxD, positions_BxC[..., None], axis=1)
            targets_BxC = jnp.take_along_axis(sequence_BxS1[:, 1:], positions_BxC, axis=1)
            return target_scores(model.logits(hidden_BxCxD), targets_BxC)

        self._score = jax.jit(score)

    def __call__(self, sequence_BxS1: jax.Array, positions_BxC: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self._score(self.state, sequence_BxS1, positions_BxC)


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
        if loaded._score_program is None:
            loaded._score_program = ScoreProgram(loaded.model)  # one set of programs per loaded model
        self._program = loaded._score_program

    @property
    def traces(self) -> int:
        """Programs traced (= compiled) so far for this loaded model, by every Scorer over it."""
        return self._program.traces

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
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids (as `encode`), in order; the distinct texts encoded in one batch call."""
        encoded = self._encode_distinct(texts)
        return [list(encoded[text]) for text in texts]

    def _encode_distinct(self, texts: Sequence[str]) -> dict[str, list[int]]:
        """{text: its ids} over the distinct `texts`: one call of the tokenizer's batch encoder (its
        threads), each text once however often it repeats."""
        from twell_jax.data.tokenizer import encode_documents

        distinct = list(dict.fromkeys(texts))
        encoded = dict(zip(distinct, encode_documents(self.tokenizer, distinct)))
        for ids in encoded.values():  # ids are never negative (the tokenizer's are unsigned)
            if ids and max(ids) >= self.vocab_size:
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                raise ValueError(f"the tokenizer gives ids outside the model's vocabulary [0, {self.vocab_size}): "
                                 f"{bad[:5]}; not this run's tokenizer")
        return encoded

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a text pair (see the module docstring)."""
        return self.encode_pairs([(context, continuation)])[0]

    def encode_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        """`encode_pair` of each (context, continuation) text pair, in order; every text they need
        (each stripped context and each whole) encoded in one batch call, each distinct one once."""
        plans = []  # (stripped context or None: the prefix token, the whole text)
        for context, continuation in pairs:
            stripped = context.rstrip()
            # The context's trailing whitespace moves to the continuation, so the whole text is
            # context + continuation; a context of whitespace only (or none) becomes the prefix token.
            plans.append((stripped or None, context + continuation))
        encoded = self._encode_distinct([text for plan in plans for text in plan if text is not None])
        out = []
        for stripped, whole in plans:
            if stripped is None:
                out.append(([self.prefix_id], list(encoded[whole])))
            else:
                context_ids = encoded[stripped]
                out.append((list(context_ids), encoded[whole][len(context_ids):]))
        return out

    # ------------------------------------------------------------------ scoring

    def loglikelihoods(self, pairs: Sequence[TokenPair],
                       progress: ProgressFn | None = None) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) per pair, in the order given."""
        rows = [self._row(i, context, continuation) for i, (context, continuation) in enumerate(pairs)]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        logp_N = np.zeros(len(rows), np.float64)
        greedy_N = np.zeros(len(rows), bool)
        done = 0

        def read_back(indices: list[int], outputs: tuple[jax.Array, jax.Array], scored_BxS: np.ndarray) -> None:
            nonlocal done
            logp_BxS, greedy_BxS = (np.asarray(x)[:len(indices)] for x in outputs)  # padding rows dropped
            logp_N[indices] = np.where(scored_BxS, logp_BxS.astype(np.float64), 0.0).sum(axis=1)
            greedy_N[indices] = np.where(scored_BxS, greedy_BxS, True).all(axis=1)
            done += len(indices)
            if progress is not None:
                progress(done, len(rows))

        in_flight: collections.deque = collections.deque()
        for start in range(0, len(order), self.batch_size):
            indices = order[start:start + self.batch_size]
            in_flight.append((indices, *self._launch([rows[i] for i in indices])))
            if len(in_flight) >= IN_FLIGHT:
                read_back(*in_flight.popleft())
        while in_flight:
            read_back(*in_flight.popleft())
        return list(zip(logp_N.tolist(), greedy_N.tolist()))

    def _row(self, i: int, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], int]:
        """(the request's tokens, cut to the window's max_length + 1, the continuation's length);
        a request that cannot be scored is a ValueError naming it (`i`)."""
        context, continuation = list(context), list(continuation)
        if not continuation:
            raise ValueError(f"request {i}: the continuation is empty (nothing to score)")
        if not context:
            raise ValueError(f"request {i}: the context is empty (give at least the prefix token, "
                             f"{self.loaded.eos_id})")
        if len(continuation) > self.max_length:
            raise ValueError(f"request {i}: the continuation has {len(continuation)} tokens, more than the "
                             f"context window of {self.max_length} (model.max_seq_len) can score at once")
        full = (context + continuation)[-(self.max_length + 1):]
        if min(full) < 0 or max(full) >= self.vocab_size:
            bad = [int(t) for t in full if not 0 <= t < self.vocab_size]
            raise ValueError(f"request {i}: token ids outside [0, {self.vocab_size}): {bad[:5]}")
        return full, len(continuation)

    def _launch(self, batch: list[tuple[list[int], int]]) -> tuple[tuple[jax.Array, jax.Array], np.ndarray]:
        """Dispatch one batch's forward (asynchronous; the results' copy to the host started): rows
        right-padded to the bucket shapes. Returns (the program's outputs at each row's window of
        scored positions, which of them are the row's continuation: [rows of the batch, window] bool)."""
        lengths_B = np.array([len(full) for full, _ in batch])
        length = min(max(next_pow2(int(lengths_B.max()) - 1), MIN_LENGTH_BUCKET), self.max_length)
        n_rows = min(next_pow2(len(batch)), next_pow2(self.batch_size))
        sequence_BxS1 = np.zeros((n_rows, length + 1), np.int32)
        for b, (full, _) in enumerate(batch):
            sequence_BxS1[b, :len(full)] = full
        # Input positions 0..end-1 predict full[1..end]; the continuation is the last n of them.
        # The head runs on a window of C positions per row, C = the batch's longest continuation
        # rounded up to a power of two (at most the bucket length): the window ends where the row's
        # continuation ends (or starts at 0 in a row shorter than C).
        end_B = lengths_B - 1
        start_B = end_B - np.array([n for _, n in batch])
        width = min(next_pow2(int((end_B - start_B).max())), length)
        first_B = np.zeros(n_rows, np.int64)
        first_B[:len(batch)] = np.maximum(end_B - width, 0)
        positions_BxC = (first_B[:, None] + np.arange(width)).astype(np.int32)
        outputs = self._program(sequence_BxS1, positions_BxC)
        for x in outputs:
            x.copy_to_host_async()
        window_BxC = positions_BxC[:len(batch)]
        scored_BxC = (window_BxC >= start_B[:, None]) & (window_BxC < end_B[:, None])
        return outputs, scored_BxC

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
