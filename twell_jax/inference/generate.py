"""Text generation with a KV cache: batched ragged prompts, sampling, EOS, streaming.

How the number of compiled programs stays bounded: prompts are left-padded to a power-of-two
length bucket (at least `MIN_PROMPT_BUCKET`) and the batch to a power-of-two row count; every
call with the same row bucket shares ONE decode-step program (fixed cache length, the write slot,
the per-row starts and the sampling settings are traced values), and each (row bucket, length
bucket) pair one prefill program. A length bucket that would leave no room in the cache for
`max_new_tokens` is shortened to fit (`Generator.prompt_bucket`). `Generator.traces` counts the
programs traced so far.

Decode steps run in chunks: one program call runs up to `Generator.chunk` steps in a device-side
loop (each step samples on the device and feeds its token to the next), and hands the chunk's
tokens to the host at once. The loop always runs `chunk` iterations: once every row has produced an
EOS token (or the call's steps are done) the remaining iterations are masked, their results dropped,
so that the GPU never waits on the host inside a chunk (a loop ended by a device value, or a
lax.cond, copies its predicate to the host after every step; greedy decoding has its own program
without the sampling branch for the same reason). Streaming, stop
strings and the per-row bookkeeping then walk the chunk step by step, exactly as if each step had
come alone (tokens a row makes after its stop are computed and dropped). One host round trip per
chunk instead of per token: at decode sizes the per-call dispatch and copy are a large part of a
step. And the next chunk is dispatched before the host reads this one's tokens (its inputs are this
chunk's device outputs, the rows' done flags included), so the device works while the host books a
chunk; a row the host ends by a stop string is known to the device two chunks later, and after the
last chunk needed at most one dispatched chunk is waited for and dropped. `chunk=1` is the
step-at-a-time loop.

Compilation is done before the clock starts (`jax.jit(...).lower(...).compile()`, one executable
per argument shape) and reported on its own (`GenerationResult.compile_s`), so prefill_s and
decode_s are run time on every call, the first included.

Left padding: row b's prompt occupies cache slots [P - len_b, P) and sits at RoPE positions
0..len_b - 1; the model's decode hides the padding slots from every query, so each row computes
exactly what it would alone (tested against the full forward). Every prefill and step runs through
`decode_engine.decode` with the run's decode section (decode.kernels: the decode kernels' step on a
GPU).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.config import DEFAULT_DECODE_CHUNK
from twell_jax.inference import decode_engine
from twell_jax.model import init_cache
from twell_jax.pallas_kernels.common import next_pow2

if TYPE_CHECKING:  # pragma: no cover - typing only
    from twell_jax.inference.load import LoadedModel

# Shortest prompt bucket: tiny prompts share one prefill program.
MIN_PROMPT_BUCKET = 8
# What to do with a prompt that leaves no room in the cache for max_new_tokens: "error" refuses it,
# "left" keeps its last tokens (drops its beginning).
TRUNCATIONS = ("error", "left")

# stream(row, token_id, text): called for every generated token as soon as it is known; `text` is
# the newly printable text of that row ("" while a multi-byte character is incomplete, or when the
# model has no tokenizer). With stop strings, text that may begin a stop string is held back until
# it cannot (it then comes with a later token, at the latest with the row's last one).
StreamFn = Callable[[int, int, str], None]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked from the logits."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples from softmax(logits / temperature)
    top_k: int = 0  # sample among the k most likely tokens (0 = no limit; 1 = greedy; ties at the cut are kept)
    top_p: float = 1.0  # nucleus: the smallest most-likely set with probability >= top_p (1 = all)
    seed: int = 0  # PRNG seed of the sampling (same seed, prompts and settings = same output)

    @property
    def greedy(self) -> bool:
        """Whether these settings pick the argmax (sample_tokens' test, on the host's values)."""
        return self.temperature <= 0 or self.top_k == 1

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no limit), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")


@dataclasses.dataclass
class GenerationResult:
    """What `generate` produced, one entry per prompt (in the order given)."""

    tokens: list[list[int]]  # generated ids (the EOS id included when a row stopped on it)
    texts: list[str] | None  # decoded generated text (EOS excluded); None without a tokenizer
    finish_reasons: list[str]  # "eos", "stop" (a stop string; the text ends before it) or "length"
    prompt_lengths: list[int]  # tokens of each prompt as run (after any truncation)
    # Wall seconds: the prefill up to the first tokens on the host, and the decode steps after it
    # (chunks of steps, each ending with its tokens on the host); neither includes compilation,
    # which is compile_s (0 when every program was compiled by an earlier call). decode_steps
    # counts the steps whose tokens were used; tokens/s = rows x steps / decode_s.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    compile_s: float = 0.0

    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens per second over the decode steps (every row counted), None without any."""
        if not self.decode_steps or self.decode_s <= 0:
            return None
        return len(self.tokens) * self.decode_steps / self.decode_s


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
    """Next token per row [B] (int32): argmax when temperature == 0 or top_k == 1, else a sample
    from the temperature-scaled softmax restricted to the top-k tokens, then to the top-p nucleus
    of those. All settings may be traced, so one program serves every setting; a `lax.cond` runs
    only the argmax for greedy settings (the sort and the sampling are skipped at run time; the same
    test as `SamplingConfig.greedy`, which the Generator's decode loop decides on the host)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    return jax.lax.cond((temperature <= 0) | (top_k == 1),
                        lambda: jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32),
                        lambda: _sample(logits_BxV, key, temperature, top_k, top_p))


def _sample(logits_BxV: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
            top_p: jax.Array) -> jax.Array:
    """The sampling branch of `sample_tokens` (temperature > 0)."""
    vocab = logits_BxV.shape[-1]
    # The floor keeps a vmapped cond (which evaluates both branches) free of 0/0 at temperature 0.
    scaled_BxV = logits_BxV / jnp.maximum(temperature, 1e-6)
    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_top_k_V = jnp.arange(vocab) < k
    sorted_BxV = jnp.where(in_top_k_V[None, :], sorted_BxV, -jnp.inf)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # A token stays in the nucleus while the mass strictly before it is < top_p (the first always does).
    in_nucleus_BxV = (jnp.cumsum(probs_BxV, axis=-1) - probs_BxV) < top_p
    keep_BxV = in_nucleus_BxV & in_top_k_V[None, :]
    n_keep_B = jnp.maximum(jnp.sum(keep_BxV, axis=-1), 1)
    threshold_Bx1 = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)
    masked_BxV = jnp.where(scaled_BxV >= threshold_Bx1, scaled_BxV, -jnp.inf)
    return jax.random.categorical(key, masked_BxV, axis=-1).astype(jnp.int32)


def _checked_chunk(chunk: object) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk (decode steps per program call) must be an int >= 1, got {chunk!r}")
    return chunk


class Generator:
    """Compiled prefill / decode programs of one model, reused across `generate` calls."""

    def __init__(self, loaded: "LoadedModel", *, cache_len: int | None = None, chunk: int = DEFAULT_DECODE_CHUNK):
        model_cfg = loaded.config.model
        self.loaded = loaded
        self.cache_len = model_cfg.max_seq_len if cache_len is None else cache_len
        if not 2 <= self.cache_len <= model_cfg.max_seq_len:
            raise ValueError(f"cache_len must be in [2, model.max_seq_len={model_cfg.max_seq_len}], got {cache_len}")
        self.chunk = _checked_chunk(chunk)  # decode steps per device call, unless a generate call names its own
        self.graphdef, self.state = nnx.split(loaded.model)
        # decode.transposed: the decode kernels' output-major weight copies, made once here.
        decode_cfg = loaded.config.decode
        self.prepared = decode_engine.prepare_decode(loaded.model, decode_cfg)
        self.traces = {"prefill": 0, "decode": 0}  # programs traced (= compiled) so far
        self._executables: dict[tuple, object] = {}
        model_cfg_ = model_cfg
        cache_len_ = self.cache_len

        def prefill(state: nnx.State, prepared: object, tokens_BxP: jax.Array, start_B: jax.Array, key: jax.Array,
                    temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, object]:
            self.traces["prefill"] += 1
            model = nnx.merge(self.graphdef, state)
            cache = init_cache(model_cfg_, tokens_BxP.shape[0], cache_len_)
            # prepared too: a one-token prompt bucket (a cache with room for one prompt token) is a
            # one-token step, which with decode.transposed reads the copies
            logits_BxV, cache, _ = decode_engine.decode(model, tokens_BxP, cache, jnp.int32(0), start_B,
                                                        config=decode_cfg, prepared=prepared)
            return sample_tokens(logits_BxV, jax.random.fold_in(key, 0), temperature, top_k, top_p), cache

        def decode_chunk(greedy: bool, state: nnx.State, prepared: object, cache: object, token_B: jax.Array,
                         tokens_BxC: jax.Array, first_index: jax.Array, n_steps: jax.Array, done_B: jax.Array,
                         eos_E: jax.Array, start_B: jax.Array, key: jax.Array, temperature: jax.Array,
                         top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, object]:
            """Up to n_steps (<= C) decode steps, the first writing cache slot first_index; stops
            after the step in which every row is done (done_B on entry, or an id of eos_E made).
            tokens_BxC: all -1, its width C the chunk (one program per chunk size). Returns it with
            column i holding step i's tokens, the steps run, the last step's tokens [B] (the next
            chunk's input), the cache and the rows' done flags after the chunk (EOS seen).

            The loop runs C iterations, a trip count XLA knows, so the GPU runs it without a host
            round trip per step (a loop ended by a device value, and a lax.cond, each copy their
            predicate to the host every iteration, so the host could launch a step's kernels only
            after the last step ended). An iteration after the stop ("dead") still computes a step
            but changes nothing the caller sees: its token, done flags and column are discarded,
            and the cache slot it writes lies past every live token (each live step writes its own
            slot before it attends, so such a slot is rewritten before it is ever visible; at the
            cache's end the write clamps to the last slot, after the generation's last step).
            `greedy` (static): argmax, no sampling branch (its lax.cond would cost that round trip)."""
            self.traces["decode"] += 1
            model = nnx.merge(self.graphdef, state)

            def step(i: jax.Array, carry: tuple) -> tuple:
                n_run, token_B, cache, done_B, tokens_BxC = carry
                live = (i < n_steps) & ~jnp.all(done_B)  # the while condition of a loop that stopped here
                index = first_index + i
                logits_BxV, cache, _ = decode_engine.decode(model, token_B[:, None], cache, index, start_B,
                                                            config=decode_cfg, prepared=prepared)
                if greedy:
                    new_B = jnp.argmax(logits_BxV.astype(jnp.float32), axis=-1).astype(jnp.int32)
                else:
                    new_B = _sample(logits_BxV.astype(jnp.float32), jax.random.fold_in(key, index), temperature,
                                    top_k, top_p)
                token_B = jnp.where(live, new_B, token_B)
                column_Bx1 = jnp.where(live, token_B, -1)[:, None]
                tokens_BxC = jax.lax.dynamic_update_slice(tokens_BxC, column_Bx1, (jnp.int32(0), i))
                done_B = done_B | (live & jnp.any(token_B[:, None] == eos_E[None, :], axis=1))
                return n_run + live.astype(jnp.int32), token_B, cache, done_B, tokens_BxC

            n_run, token_B, cache, done_B, tokens_BxC = jax.lax.fori_loop(
                0, tokens_BxC.shape[1], step, (jnp.int32(0), token_B, cache, done_B, tokens_BxC))
            return tokens_BxC, n_run, token_B, cache, done_B

        self._prefill = jax.jit(prefill)
        # The cache is updated in place on accelerators (CPU cannot donate buffers and would warn).
        donate = (2,) if jax.default_backend() != "cpu" else ()
        # One program family per mode: {greedy: fn}, named "decode greedy" / "decode sample" in _run.
        self._decode_chunk = {greedy: jax.jit(functools.partial(decode_chunk, greedy), donate_argnums=donate)
                              for greedy in (True, False)}

    def _run(self, name: str, fn, *args) -> tuple[object, float]:
        """fn(*args) through an executable compiled ahead for these argument shapes (once per shape
        per Generator); returns (output, seconds spent compiling now)."""
        key = (name, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in jax.tree.leaves(args[1:])))
        compile_s = 0.0
        if key not in self._executables:
            began = time.perf_counter()
            self._executables[key] = fn.lower(*args).compile()
            compile_s = time.perf_counter() - began
        return self._executables[key](*args), compile_s

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt (strings need the model's tokenizer); errors name the prompt."""
        tokenizer, vocab = self.loaded.tokenizer, self.loaded.config.model.vocab_size
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of strings or of token-id lists, got a single string")
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
                ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            else:
                ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty (it needs at least one token)")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            out.append(ids)
        if not out:
            raise ValueError("prompts is empty")
        return out

    def fit_prompts(self, ids: list[list[int]], max_new_tokens: int, truncate: str = "error") -> list[list[int]]:
        """The prompts as they will run: each must leave room in the cache for max_new_tokens - 1
        decode steps; `truncate="left"` keeps the last tokens of a longer one, "error" refuses it."""
        if truncate not in TRUNCATIONS:
            raise ValueError(f"truncate must be one of {TRUNCATIONS}, got {truncate!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        room = self.cache_len - max_new_tokens + 1  # prompt tokens that fit
        if room < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} does not fit the cache of {self.cache_len} tokens "
                             f"(model.max_seq_len) even with a one-token prompt; use at most {self.cache_len}")
        too_long = [i for i, p in enumerate(ids) if len(p) > room]
        if too_long and truncate == "error":
            i = too_long[0]
            raise ValueError(f"prompt {i} has {len(ids[i])} tokens; with max_new_tokens={max_new_tokens} only "
                             f"{room} fit the cache of {self.cache_len} tokens (model.max_seq_len): shorten the "
                             "prompt or max_new_tokens, or keep the prompt's last tokens with truncate='left' "
                             "(twell generate --truncate-prompt left)")
        return [p[-room:] for p in ids]

    def prompt_bucket(self, longest: int, max_new_tokens: int) -> int:
        """The padded prompt length: a power of two >= longest (>= MIN_PROMPT_BUCKET), shortened to
        leave room in the cache for max_new_tokens - 1 decode steps."""
        if longest + max_new_tokens - 1 > self.cache_len:
            raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} does not fit the "
                             f"cache of {self.cache_len} tokens (model.max_seq_len); shorten the prompt or "
                             "max_new_tokens, or pass truncate='left'")
        return min(max(next_pow2(longest), MIN_PROMPT_BUCKET), self.cache_len - max_new_tokens + 1)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 64,
                 sampling: SamplingConfig = SamplingConfig(), eos: int | Sequence[int] | None = None,
                 stream: StreamFn | None = None, truncate: str = "error",
                 stop: Sequence[str] = (), chunk: int | None = None) -> GenerationResult:
        """See `generate` (module level); `chunk`: decode steps per device call for this call
        (default the Generator's; each size compiles its own decode program)."""
        chunk = self.chunk if chunk is None else _checked_chunk(chunk)
        ids = self.fit_prompts(self.encode(prompts), max_new_tokens, truncate)
        stop = _stop_strings(stop, self.loaded.tokenizer)
        eos_ids = _eos_set(eos, self.loaded.eos_id)
        n_rows, rows = len(ids), next_pow2(len(ids))
        lengths = [len(p) for p in ids]
        bucket = self.prompt_bucket(max(lengths), max_new_tokens)
        tokens_BxP = np.zeros((rows, bucket), np.int32)
        start_B = np.full((rows,), bucket - 1, np.int32)  # padding rows: one token at the last slot
        for b, prompt in enumerate(ids):
            tokens_BxP[b, bucket - len(prompt):] = prompt
            start_B[b] = bucket - len(prompt)
        key = jax.random.key(sampling.seed)
        settings = (jnp.float32(sampling.temperature), jnp.int32(sampling.top_k), jnp.float32(sampling.top_p))
        start = jnp.asarray(start_B)
        # EOS ids padded to a power of two with -1 (never a token): few distinct program shapes.
        eos_E = np.full((next_pow2(max(len(eos_ids), 1)),), -1, np.int32)
        eos_E[:len(eos_ids)] = sorted(eos_ids)
        eos_E = jnp.asarray(eos_E)
        began = time.perf_counter()
        (token_B, cache), compile_s = self._run("prefill", self._prefill, self.state, self.prepared,
                                                jnp.asarray(tokens_BxP), start, key, *settings)
        host_B = np.asarray(token_B)
        decode_began = time.perf_counter()
        prefill_s = decode_began - began - compile_s
        out: list[list[int]] = [[] for _ in range(n_rows)]
        reasons = ["length"] * n_rows
        done = [False] * n_rows
        printer = _RowText(self.loaded.tokenizer, n_rows, stream, stop)

        def take(tokens: np.ndarray, last: bool) -> None:  # one step's token per row
            for b in range(n_rows):
                if done[b]:
                    continue
                token = int(tokens[b])
                out[b].append(token)
                is_eos = token in eos_ids
                if printer.push(b, token, is_eos, last=is_eos or last):
                    done[b], reasons[b] = True, "stop"
                elif is_eos:
                    done[b], reasons[b] = True, "eos"

        take(host_B, last=max_new_tokens == 1)
        steps, decode_compile_s = 0, 0.0
        empty_BxC = jnp.full((rows, chunk), -1, jnp.int32)
        total = max_new_tokens - 1  # decode steps at most (the prefill made the first token)
        name = "decode " + ("greedy" if sampling.greedy else "sample")

        def launch(token_B: jax.Array, cache: object, at: int, done_B: jax.Array) -> tuple:
            """Dispatch the chunk whose first step is decode step `at` (asynchronous: nothing waits)."""
            nonlocal decode_compile_s
            n_steps = min(chunk, total - at)
            out, seconds = self._run(name, self._decode_chunk[sampling.greedy], self.state, self.prepared, cache,
                                     token_B, empty_BxC, jnp.int32(bucket + at), jnp.int32(n_steps), done_B, eos_E,
                                     start, key, *settings)
            decode_compile_s += seconds
            return out, at + n_steps

        def host_done() -> jax.Array:  # padding rows never hold a chunk open
            return jnp.asarray(np.array(done + [True] * (rows - n_rows)))

        # Chunks are dispatched one ahead: chunk k + 1 is queued on the device, from chunk k's device
        # outputs, before the host waits for chunk k's tokens, so the device runs it while the host
        # reads and books chunk k (at decode's short steps, the host's per-chunk work and copy left
        # the GPU idle a sizeable share of each token). A row the host ends (a stop string) in
        # chunk k is only known to chunk k + 2 on; its tokens from k + 1 are ignored here, as those
        # of a chunk's later steps always were. After the last chunk the host needed, one
        # dispatched chunk may be left: it is waited for (its device time counts in decode_s) and
        # dropped.
        pending = launch(token_B, cache, 0, host_done()) if total > 0 and not all(done) else None
        while pending is not None:
            (tokens_BxC, n_run, token_B, cache, device_done_B), end = pending
            ahead = launch(token_B, cache, end, device_done_B | host_done()) if end < total else None
            host_BxC, n_run = np.asarray(tokens_BxC), int(n_run)
            for i in range(n_run):
                if all(done):
                    break
                steps += 1
                take(host_BxC[:, i], last=steps == total)
            if all(done) and ahead is not None:
                jax.block_until_ready(ahead[0])
                ahead = None
            pending = ahead
        texts = None
        if self.loaded.tokenizer is not None:
            texts = [self.loaded.tokenizer.decode([t for t in row if t not in eos_ids]) for row in out]
            texts = [text if cut is None else text[:cut] for text, cut in zip(texts, printer.stop_at)]
        return GenerationResult(tokens=out, texts=texts, finish_reasons=reasons, prompt_lengths=lengths,
                                prefill_s=prefill_s, decode_s=time.perf_counter() - decode_began - decode_compile_s,
                                decode_steps=steps, compile_s=compile_s + decode_compile_s)


def _eos_set(eos: int | Sequence[int] | None, default: int | None) -> frozenset[int]:
    if eos is None:
        return frozenset() if default is None else frozenset([default])
    if isinstance(eos, (int, np.integer)) and not isinstance(eos, bool):
        return frozenset([int(eos)])
    if isinstance(eos, (list, tuple, set, frozenset)) and all(
            isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in eos):
        return frozenset(int(e) for e in eos)
    raise ValueError(f"eos must be None (the model's end-of-text id), a token id or a list of ids (() = never "
                     f"stop early), got {eos!r}")


def _stop_strings(stop: Sequence[str] | None, tokenizer: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    if stop and tokenizer is None:
        raise ValueError("stop strings need the model's tokenizer (this model has none)")
    return tuple(stop)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string (it may still become one)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class _RowText:
    """Each row's decoded text as tokens arrive: newly printable text for the stream callback, and
    where a stop string first appears (`stop_at[row]`, a character offset, None while none has)."""

    def __init__(self, tokenizer: object, n_rows: int, stream: StreamFn | None, stops: tuple[str, ...]):
        self.tokenizer, self.stream, self.stops = tokenizer, stream, stops
        self.ids: list[list[int]] = [[] for _ in range(n_rows)]
        self.emitted = [0] * n_rows
        self.stop_at: list[int | None] = [None] * n_rows

    def push(self, row: int, token: int, is_eos: bool, last: bool) -> bool:
        """Records `token` of `row` (`last`: its final one); True when a stop string is complete."""
        if self.stream is None and not self.stops:
            return False
        text = ""
        if self.tokenizer is not None:
            if not is_eos:
                self.ids[row].append(token)
            decoded = self.tokenizer.decode(self.ids[row])
            hits = [i for i in (decoded.find(s) for s in self.stops) if i >= 0]
            if hits:
                end = self.stop_at[row] = min(hits)
            elif last:
                end = len(decoded)
            elif decoded.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait until it completes
                end = self.emitted[row]
            else:
                end = len(decoded) - _held_back(decoded, self.stops)
            end = max(end, self.emitted[row])
            text, self.emitted[row] = decoded[self.emitted[row]:end], end
        if self.stream is not None:
            self.stream(row, token, text)
        return self.stop_at[row] is not None


def generate(model: "LoadedModel | Generator", prompts: Sequence[str] | Sequence[Sequence[int]],
             max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, eos: int | Sequence[int] | None = None,
             stream: StreamFn | None = None, truncate: str = "error",
             stop: Sequence[str] = ()) -> GenerationResult:
    """Continue each prompt (a string, or a list of token ids) by up to `max_new_tokens` tokens.

    Greedy when temperature == 0, else sampling with top-k / top-p and `seed`. A row stops at
    its first token in `eos` (default: the model's end-of-text id; () never stops early), or once
    its text holds one of the `stop` strings (its text then ends before it). A prompt that leaves no
    room for `max_new_tokens` is an error, or with `truncate="left"` loses its first tokens.
    `stream(row, token_id, text)` is called for each new token as soon as it is known. Pass a
    `Generator` (or the same LoadedModel again: its Generator is cached on it) to reuse compiled
    programs across calls."""
    if isinstance(model, Generator):
        generator = model
    else:
        if model._generator is None:
            model._generator = Generator(model)  # one set of programs per loaded model
        generator = model._generator
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return generator.generate(prompts, max_new_tokens, sampling, eos, stream, truncate, stop)
