"""Model-level inference benchmark: sparse (`twell`) beside its dense twin (`relu_gated`) and a plain-JAX
Llama, all with the same weights.

    python experiments/bench_inference.py --checkpoint runs/0.5b-...   # a trained-sparse run (GPU)
    python experiments/bench_inference.py --config 0.5b                # random init: NOT sparse (plumbing)
    python experiments/bench_inference.py --dry-run                    # tiny shapes on CPU (the test)

Prefill (the paper's protocol): `--prefill-batch` x `--context` tokens through the decoder body
(embedding, blocks, final norm; the LM head excluded), tokens/s, and energy per token from NVML
power sampling (a thread reading the board power every ~50 ms; trapezoid integration over the
timed window; skipped with a message where NVML is absent). With `--checkpoint`, every token fed
(prefill batch, decode context) is text from the run's validation split, and "auto" gets the run's
per-layer activity hints; a random init gets random ids. Decode: tokens/s of KV-cached decode
steps (`decode_engine.decode`, LM head included) at batch 1, 8 and 64 after a prefilled context of
`--context` - `--decode-steps` tokens, so the last step attends to `--context` slots. Each variant
prints its per-layer mean active FFN neurons per token beside its figures. Generate (twell_jax rows
only, `--generate-tokens`): `Generator.generate` at batch 1, greedy, from a prompt of the same text,
with each of `--generate-chunks` (default 1 and 16) decode steps per device call: what `twell
generate` delivers, host round trips included (compilation excluded), beside the device-loop
decode rows above. `--xla-option KEY=VALUE` adds a second decode row per variant, `VARIANT+xla`,
its loop compiled with those XLA options (for
example command buffers over the while loops, which capture the decode steps as CUDA graphs),
compared with the rows compiled without them. The model's rows decode with the library's decode
section (`DecodeConfig()`: decode.transposed on, the decode kernels read output-major copies of
q/k/v, the output projection and W_down), whatever the checkpoint's config says; `--stored-decode-rows` adds `VARIANT+stored`
decode and generate rows of the dense and sparse variants reading the weights as stored,
`--check-decode STEPS` first checks each variant's decode steps against the XLA path of the same
weights (teacher-forced, every decode batch; the run stops before timing when one is past
`--check-tolerance`), `--interleave-decode ROUNDS` times every decode row's loop again, each
batch's in alternation over ROUNDS rounds (`ms_per_step_interleaved` and its ratios,
`interleaved_vs_dense` / `interleaved_vs_plain`: the comparison to trust between variants, as the
rows timed one after another drift: two identical programs came out 5% apart),
`--loop-decode-rows` adds `VARIANT+loop` rows with the decode kernels' layers in a loop
(decode.layer_unroll=1; the default unrolls them), and
`--sparse-ffn-rows fused,split` adds `VARIANT+fused` and `VARIANT+split` rows of the sparse variants with
that decode.sparse_ffn (config.DECODE_SPARSE_FFN: the gate's tile lists read by one launch, a
compaction then one launch, or a compaction then two), each name other than the config's.

Rows: `plain` is the plain-JAX Llama of twell_jax/bench/plain_llama.py (nothing of twell_jax in its
math) holding the model's weights in the compute dtype: its body for prefill, its KV-cached decode
(the same preallocated cache, in-place writes, chunked prefill and masked attention over the cache
as the model's decode) for decode; it has no FFN telemetry, so no active counts. The dense twin
(`dense`) runs the same parameters with `ffn_kind=relu_gated` (the op's dense backend, plain XLA);
the sparse variants run `ffn_kind=twell` with the op backends of `--backends`. Every row runs in
this process on the same tokens; each figure is also given as a ratio to the dense twin and to
plain, and each prefill row records how far its hidden states are from plain's (the same weights
give the same states up to rounding). A short table is printed last; `--out` gets the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.bench.ffn import bench_interleaved
from twell_jax.bench.kernel_trace import format_profile, kernel_times
from twell_jax.bench.plain_llama import (reference_body, reference_decode_step, reference_params_from_model,
                                         reference_prefill_cache)
from twell_jax.config import DECODE_SPARSE_FFN, DEFAULT_DECODE_CHUNK, DecodeConfig, ModelConfig
from twell_jax.inference import decode_engine, decode_plan
from twell_jax.inference.generate import Generator, SamplingConfig
from twell_jax.inference.load import LoadedModel, experiment_config_for, load_run, model_with_params, validation_tokens
from twell_jax.pallas_kernels import decode_matvec
from twell_jax.model import Transformer, choose_attention, init_cache, init_model, split_model
from twell_jax.run_dir import run_dir_of
from twell_jax.training.hints import run_hints

DECODE_BATCHES = (1, 8, 64)
PREFILL_CHUNK = 256  # tokens per call when filling the decode context
GENERATE_PROMPT = 128  # prompt tokens of the generate rows (at most half of --context)


class PowerSampler:
    """Board power of one GPU sampled by a background thread (NVML); energy by the trapezoid rule."""

    def __init__(self, device_index: int = 0, period_s: float = 0.05):
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []  # (time s, watts)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            watts = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            self.samples.append((time.perf_counter(), watts))
            self._stop.wait(self.period_s)

    def __enter__(self) -> "PowerSampler":
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def energy_j(self, start: float, end: float) -> float:
        """Joules between `start` and `end` (perf_counter times), trapezoid over the samples inside."""
        inside = [(t, w) for t, w in self.samples if start <= t <= end]
        if len(inside) < 2:
            raise RuntimeError(f"only {len(inside)} power samples in the timed window; time longer")
        times, watts = np.array([t for t, _ in inside]), np.array([w for _, w in inside])
        energy = float(np.sum((watts[1:] + watts[:-1]) / 2 * np.diff(times)))
        # Extend the two ends at the nearest sample's power (the window rarely starts on a sample).
        return energy + watts[0] * (times[0] - start) + watts[-1] * (end - times[-1])


def make_power_sampler(enabled: bool) -> PowerSampler | None:
    if not enabled:
        return None
    try:
        return PowerSampler()
    except Exception as err:  # no pynvml, no driver, no GPU
        print(f"[bench] energy skipped: NVML unavailable ({type(err).__name__}: {err})")
        return None


def body(model: Transformer, tokens_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Decoder body: embedding, blocks, final norm (no LM head); (hidden [B, S, D], l0 per layer [L])."""
    hidden_BxSxD, aux = model.hidden_states(tokens_BxS)
    return hidden_BxSxD, aux["l0"]


@dataclasses.dataclass(frozen=True)
class Runner:
    """One row's model as pure functions of its parameters. Every jitted program takes the
    parameters as an argument: closing over them would bake the weights in as constants."""

    params: Any  # the pytree each function below takes first
    # (params, tokens_BxS) -> (hidden_BxSxD, l0_L or None): the decoder body, no LM head.
    body: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array | None]]
    # (params, tokens_BxS, length) -> (last-token logits_BxV, a cache of `length` slots filled at [0, S)).
    prefill: Callable[[Any, jax.Array, int], tuple[jax.Array, Any]]
    # (params, cache, tokens_Bx1, slot) -> (logits_BxV, cache, l0_L or None): one KV-cached decode step.
    step: Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, Any, jax.Array | None]]
    telemetry: bool  # whether body and step return the per-layer active counts (plain JAX has none)


def model_runner(model: Transformer, cfg: ModelConfig, decode_cfg: DecodeConfig) -> Runner:
    """A twell_jax model: `body` above, and `decode_engine.decode` with `decode_cfg` for the prefill
    (in chunks) and steps (with `prepare_decode`'s weight copies where decode.transposed asks for
    them). Its params are (the model's state, those copies or None)."""
    graphdef, state = nnx.split(model)

    def prefill(params: Any, tokens_BxS: jax.Array, length: int) -> tuple[jax.Array, Any]:
        # In chunks: the masked attention of one call materialises [B, N, chunk, length] scores.
        model_, cache = nnx.merge(graphdef, params[0]), init_cache(cfg, tokens_BxS.shape[0], length)
        start_B = jnp.zeros((tokens_BxS.shape[0],), jnp.int32)
        for begin in range(0, tokens_BxS.shape[1], PREFILL_CHUNK):
            logits_BxV, cache, _ = decode_engine.decode(model_, tokens_BxS[:, begin:begin + PREFILL_CHUNK], cache,
                                                        jnp.int32(begin), start_B, config=decode_cfg)
        return logits_BxV, cache

    def step(params: Any, cache: Any, tokens_Bx1: jax.Array, slot: jax.Array) -> tuple[jax.Array, Any, jax.Array]:
        start_B = jnp.zeros((tokens_Bx1.shape[0],), jnp.int32)
        logits_BxV, cache, aux = decode_engine.decode(nnx.merge(graphdef, params[0]), tokens_Bx1, cache, slot,
                                                      start_B, config=decode_cfg, prepared=params[1])
        return logits_BxV, cache, aux["l0"]

    return Runner((state, decode_engine.prepare_decode(model, decode_cfg)),
                  lambda p, t: body(nnx.merge(graphdef, p[0]), t), prefill, step, telemetry=True)


def check_decode(checked: Runner, reference: Runner, text_BxS: jax.Array, prompt: int) -> dict[str, Any]:
    """The decode steps of `checked` (as the decode rows run them) against `reference` (the same
    weights through the XLA path), teacher-forced: both prefill text[:, :prompt], then step through
    the rest of text one token at a time, each fed the text's token (not its own). Returns the
    largest |logit difference| over the steps relative to the largest |reference logit|, and the
    share of (row, step) pairs whose greedy tokens agree."""
    length = text_BxS.shape[1]
    logits = []
    for runner in (checked, reference):
        _, cache = jax.jit(runner.prefill, static_argnums=2)(runner.params, text_BxS[:, :prompt], length)
        step = jax.jit(runner.step)
        out = []
        for slot in range(prompt, length):
            logits_BxV, cache, _ = step(runner.params, cache, text_BxS[:, slot:slot + 1], jnp.int32(slot))
            out.append(np.asarray(logits_BxV, np.float32))
        logits.append(np.stack(out, 1))
    got, want = logits
    return {"steps": length - prompt, "max_rel_logit_diff": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
            "greedy_agree": float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))}


def plain_runner(cfg: ModelConfig, params: dict[str, Any], dtype: str, context: int) -> Runner:
    """The plain-JAX Llama (twell_jax/bench/plain_llama.py) over the model's `params` cast to `dtype`.
    Prefill attention is the implementation the model picks at `context` tokens (cuDNN on an
    NVIDIA GPU where it takes the shape); decode attention is masked XLA, as the model's decode."""
    attention = choose_attention(cfg.attention_impl, dtype=jnp.dtype(dtype), head_dim=cfg.head_dim, seq_len=context)
    return Runner(
        reference_params_from_model(cfg, params, dtype),
        body=lambda p, t: (reference_body(cfg, p, t, attention), None),
        prefill=lambda p, t, length: reference_prefill_cache(cfg, p, t, length, "xla", PREFILL_CHUNK),
        step=lambda p, cache, t, slot: (*reference_decode_step(cfg, p, cache, t, slot, "xla"), None),
        telemetry=False)


def timed(fn: Callable[[], Any], min_seconds: float, min_iters: int) -> tuple[float, int, float, float]:
    """(seconds per call, calls, window start, window end): calls run back to back until both minima."""
    jax.block_until_ready(fn())  # compile + warm-up
    calls, start = 0, time.perf_counter()
    while True:
        out = fn()
        calls += 1
        if calls >= min_iters and time.perf_counter() - start >= min_seconds:
            break
    jax.block_until_ready(out)
    end = time.perf_counter()
    return (end - start) / calls, calls, start, end


def variant_configs(base: ModelConfig, backends: list[str], interpret: bool,
                    hints: tuple[float, ...] | None = None) -> dict[str, ModelConfig]:
    """{"dense": relu_gated twin, "twell-<backend>": sparse model}, to run over the same parameters;
    `hints`: the run's per-layer active counts, which "auto" decides with (as `load_run` does for a
    run trained with "auto")."""
    variants = {"dense": dataclasses.replace(base, ffn_kind="relu_gated", ffn_backend="dense",
                                             ffn_expected_active=())}
    for backend in backends:
        variants[f"twell-{backend}"] = dataclasses.replace(
            base, ffn_kind="twell", ffn_backend=backend, ffn_interpret=interpret and backend == "pallas",
            ffn_expected_active=base.ffn_expected_active or (hints if backend == "auto" and hints else ()))
    return variants


def _l0_list(l0: jax.Array | None) -> list[float] | None:
    return None if l0 is None else np.asarray(l0, np.float64).round(2).tolist()


def bench_prefill(runner: Runner, tokens_BxS: jax.Array, sampler: PowerSampler | None,
                  min_seconds: float) -> tuple[dict[str, Any], jax.Array]:
    """(figures, the hidden states [B, S, D] of one call) of the decoder body on `tokens_BxS`."""
    fn = jax.jit(runner.body)
    began = time.perf_counter()
    hidden_BxSxD, l0 = jax.block_until_ready(fn(runner.params, tokens_BxS))
    first_call_s = time.perf_counter() - began  # the program's compile and one call
    if sampler is not None:
        with sampler:
            per_call, calls, start, end = timed(lambda: fn(runner.params, tokens_BxS), min_seconds, 3)
        energy = sampler.energy_j(start, end) / (calls * tokens_BxS.size)
    else:
        per_call, calls, _, _ = timed(lambda: fn(runner.params, tokens_BxS), min_seconds, 3)
        energy = None
    return ({"tokens_per_s": tokens_BxS.size / per_call, "ms_per_call": 1e3 * per_call, "calls": calls,
             "first_call_s": first_call_s,
             "energy_j_per_token": energy, "l0_per_layer": _l0_list(l0)}, hidden_BxSxD)


def bench_decode(runner: Runner, n_layers: int, tokens: jax.Array, context: int, steps: int,
                 min_seconds: float, compiler_options: dict[str, str] | None = None,
                 trace_top: int = 0) -> tuple[dict[str, Any], Callable[[], Any]]:
    """(figures, one call of the timed loop: to time it again, `interleaved_decode`) of a KV-cached
    decode of `steps` tokens per row after prefilling `tokens` [batch, context - steps];
    `compiler_options`: XLA options of the decode loop's program (e.g. its command buffers);
    `trace_top` > 0: also profile two calls of the timed loop program and keep its `trace_top`
    largest kernels per step (`kernel_trace.format_profile`) under "trace": the time line as the
    loop runs it (its span per step against its busy time shows the gaps between launches)."""
    batch, prefill_len = tokens.shape
    assert prefill_len == context - steps, (tokens.shape, context, steps)

    def run_steps(params: Any, token_B: jax.Array, cache: Any, telemetry: bool) -> tuple[jax.Array, jax.Array]:
        # `steps` greedy decode steps in one program (a fori_loop): host dispatch is not what we time.
        # The timed program returns the tokens only, as generation's (the Generator drops the
        # active counts, so XLA does not compute them); the counts come from one more call of
        # the same loop with them (`telemetry`).
        def one(i: jax.Array, carry: tuple) -> tuple:
            token, cache_, l0 = carry
            logits, cache_, l0_step = runner.step(params, cache_, token[:, None], prefill_len + i)
            if l0_step is not None and telemetry:
                l0 = l0 + l0_step / steps
            return jnp.argmax(logits, -1).astype(jnp.int32), cache_, l0

        token_B, _, l0 = jax.lax.fori_loop(0, steps, one, (token_B, cache, jnp.zeros((n_layers,))))
        return token_B, l0 if telemetry else None

    began = time.perf_counter()
    logits_BxV, cache = jax.block_until_ready(jax.jit(runner.prefill, static_argnums=2)(runner.params, tokens, context))
    prefill_first_s = time.perf_counter() - began
    token_B = jnp.argmax(logits_BxV, -1).astype(jnp.int32)
    step_fn = jax.jit(run_steps, static_argnums=3, compiler_options=compiler_options or None)
    began = time.perf_counter()
    jax.block_until_ready(step_fn(runner.params, token_B, cache, False))
    steps_first_s = time.perf_counter() - began
    call = lambda: step_fn(runner.params, token_B, cache, False)  # noqa: E731
    per_call, calls, _, _ = timed(call, min_seconds, 2)
    l0 = step_fn(runner.params, token_B, cache, True)[1] if runner.telemetry else None
    trace = None
    if trace_top:
        trace = format_profile(kernel_times(lambda: step_fn(runner.params, token_B, cache, False), (), repeats=2,
                                            units_per_call=steps), top=trace_top)
    # First calls: each program's compile and one run (the prefill in chunks; the decode steps' loop).
    return {"tokens_per_s": batch * steps / per_call, "ms_per_step": 1e3 * per_call / steps, "calls": calls,
            "prefill_first_call_s": prefill_first_s, "steps_first_call_s": steps_first_s,
            "l0_per_layer": _l0_list(l0) if runner.telemetry else None, **({"trace": trace} if trace else {})}, call


def interleaved_decode(rows: list[dict[str, Any]], calls: list[Callable[[], Any]], steps: int,
                       rounds: int) -> None:
    """Time the decode rows' loops again, each batch's in alternation (`ffn.bench_interleaved`:
    `rounds` rounds, two calls of every row's loop per round in turn), so that what drifts while
    the variants are timed one after another (clocks, the order of the runs) touches every row alike;
    adds each row's median as ms_per_step_interleaved, and, beside the twin's and plain JAX's rows of
    its batch, interleaved_vs_dense / interleaved_vs_plain."""
    for batch in sorted({r["batch"] for r in rows}):
        picked = [i for i, r in enumerate(rows) if r["batch"] == batch]
        names = [rows[i]["variant"] for i in picked]
        ms = bench_interleaved({name: calls[i] for name, i in zip(names, picked)}, [()], batch=2, repeats=rounds)
        for name, i in zip(names, picked):
            rows[i]["ms_per_step_interleaved"] = ms[name] / steps
        for i in picked:
            for base in ("dense", "plain"):
                if base in ms:
                    rows[i][f"interleaved_vs_{base}"] = ms[base] / steps / rows[i]["ms_per_step_interleaved"]


CHECK_PROMPT = 32  # --check-decode: prompt tokens before the checked steps (at most half the context)


def run_decode_checks(args: argparse.Namespace, configs: dict[str, ModelConfig], decodes: dict[str, DecodeConfig],
                      models: dict[str, Transformer], params: dict[str, Any], text: jax.Array, batches: list[int],
                      cfg: ModelConfig) -> list[dict]:
    """--check-decode: `check_decode` of every model variant (its model and decode configs, `configs`
    and `decodes`) at every batch; SystemExit naming the variant and batch where the difference
    passes --check-tolerance (nothing timed or written)."""
    prompt = min(CHECK_PROMPT, text.shape[1] // 2)
    if prompt + args.check_decode > text.shape[1]:
        raise SystemExit(f"--check-decode {args.check_decode}: {prompt} prompt tokens plus the checked steps must fit "
                         f"--context {text.shape[1]}")
    checks = []
    for name, model in models.items():
        checked_decode = decodes[name]
        if args.dry_run:  # the kernels on a CPU: interpreted
            checked_decode = dataclasses.replace(checked_decode, kernels="pallas")
            model = model_with_params(dataclasses.replace(configs[name], ffn_interpret=True), params, args.dtype)
        reference = model_with_params(configs[name], params, args.dtype)
        checked = model_runner(model, cfg, checked_decode)  # (weight copies made once)
        against = model_runner(reference, cfg, dataclasses.replace(decodes[name], kernels="xla"))
        for batch in batches:
            r = check_decode(checked, against, text[:batch, :prompt + args.check_decode], prompt)
            r.update(variant=name, batch=batch, kernels=decode_engine.uses_kernels(model, checked_decode),
                     ffn_ways=list(decode_plan.layer_ways(model, checked_decode, batch, jnp.dtype(args.dtype))))
            checks.append(r)
            print(f"[bench] check   {name} batch {batch}: max logit difference {r['max_rel_logit_diff']:.3%} of the "
                  f"largest logit, greedy tokens {r['greedy_agree']:.1%} alike over {r['steps']} steps "
                  f"({'decode kernels' if r['kernels'] else 'the XLA path itself'}; FFN ways "
                  f"{','.join(r['ffn_ways'])})", flush=True)
            if not r["max_rel_logit_diff"] <= args.check_tolerance:
                raise SystemExit(f"--check-decode: {name} at batch {batch} is {r['max_rel_logit_diff']:.3g} of the largest "
                                 f"logit from the XLA path, above --check-tolerance {args.check_tolerance:g}")
    return checks


def load_matvec_blocks(path: str) -> dict[str, Any]:
    """Set decode_matvec.ROLE_BLOCK_SIZES from a `bench_decode_matvec.py --blocks-out` file ({"m": rows,
    "roles": {role: {block_n, block_k, max_block_m, num_warps, num_stages, split_k, programs_n}}}) for this
    process, before any decode program compiles; a file swept at more than decode_matvec.MANY_ROWS
    rows sets ROLE_BLOCK_SIZES_MANY_ROWS instead (the blocks of steps of that many rows). Returns what
    was set. A role the file does not name keeps its entry."""
    try:
        data = json.loads(Path(path).read_text())
        rows, roles = int(data["m"]), data["roles"]
        sizes = {role: decode_matvec.MatvecBlockSizes(**fields) for role, fields in roles.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--matvec-blocks {path}: expected a bench_decode_matvec --blocks-out file ({exc})")
    unknown = sorted(set(sizes) - set(decode_matvec.ROLES))
    if unknown:
        raise SystemExit(f"--matvec-blocks {path}: unknown roles {unknown}; expected some of {decode_matvec.ROLES}")
    table = decode_matvec.ROLE_BLOCK_SIZES_MANY_ROWS if rows > decode_matvec.MANY_ROWS else decode_matvec.ROLE_BLOCK_SIZES
    table.update(sizes)
    return {role: dataclasses.asdict(s) for role, s in sizes.items()}


def bench_generate(model: Transformer, cfg: ModelConfig, decode_cfg: DecodeConfig, prompt: list[int],
                   new_tokens: int, chunks: list[int], repeats: int = 2, trace_top: int = 0) -> list[dict[str, Any]]:
    """`Generator.generate` end to end at batch 1 (greedy, no EOS: exactly `new_tokens` tokens), one
    row per decode chunk size: what `twell generate` delivers, host round trips included; the
    best of `repeats` calls after a first one (compilation is reported apart by the Generator, and
    appears here only as compile_s). One Generator: its prefill program and weight copies serve
    every chunk size. `trace_top` > 0: also profile two calls and keep the `trace_top` largest
    kernels per decode step under "trace" (the prefill's kernels are in it, spread over the steps:
    a span per step well above the busy time means the device waited on the host)."""
    config = dataclasses.replace(experiment_config_for(cfg), decode=decode_cfg)
    generator = Generator(LoadedModel(model=model, config=config, tokenizer=None, step=None))
    rows = []
    for chunk in chunks:
        first = generator.generate([prompt], new_tokens, SamplingConfig(), eos=(), chunk=chunk)
        best = min((generator.generate([prompt], new_tokens, SamplingConfig(), eos=(), chunk=chunk)
                    for _ in range(repeats)), key=lambda res: res.decode_s / res.decode_steps)
        if best.tokens != first.tokens or (rows and best.tokens[0] != rows[0]["tokens"]):
            raise AssertionError(f"generation with chunk {chunk} is not deterministic or differs from chunk "
                                 f"{chunks[0]}'s: {best.tokens[0]}")
        rows.append({"tokens_per_s": best.decode_tokens_per_s(), "ms_per_step": 1e3 * best.decode_s / best.decode_steps,
                     "chunk": chunk, "decode_steps": best.decode_steps, "prefill_s": best.prefill_s,
                     "compile_s": first.compile_s, "tokens": best.tokens[0], "l0_per_layer": None})
        if trace_top:
            profile = kernel_times(lambda c=chunk: generator.generate([prompt], new_tokens, SamplingConfig(), eos=(),
                                                                      chunk=c), (), repeats=2,
                                   units_per_call=best.decode_steps)
            rows[-1].update(trace=format_profile(profile, top=trace_top), trace_span_ms_per_step=profile.span_ms,
                            trace_busy_ms_per_step=profile.busy_ms, trace_kernel_ms_per_step=profile.kernel_ms)
    return rows


def parse_xla_options(items: list[str]) -> dict[str, str]:
    """{"KEY": "VALUE"} of `--xla-option KEY=VALUE` items (XLA's debug options, e.g. xla_gpu_...)."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("xla_") or key in options:
            raise SystemExit(f"--xla-option {item!r}: expected KEY=VALUE with an XLA option name (xla_...), "
                             "each key once")
        options[key] = value
    return options


def decode_floor_bytes(cfg: ModelConfig, batch: int, context: int, itemsize: int,
                       active_per_layer: list[float] | None = None) -> float:
    """Bytes one decode step must read at least: every weight once (the tied embedding once, as
    the LM head, or the untied head; the token's embedding row is negligible) and the KV cache of
    `context` slots (its KV heads only: fewer with grouped-query attention), in
    the compute dtype. With `active_per_layer` (mean active FFN neurons per token, the sparse
    rows), a layer's up and down projections count only the union of the batch's active neurons,
    bounded by min(d_ff, batch x active): the gate is always read in full."""
    d, h, layers = cfg.d_model, cfg.d_ff, cfg.n_layers
    ffn_mats = 3 if cfg.kind.gated else 2
    attention = 2 * d * d + 2 * d * cfg.kv_dim
    ffn = [ffn_mats * h * d] * layers
    if active_per_layer is not None:
        gate = d * h if cfg.kind.gated else 0
        ffn = [gate + 2 * min(h, batch * a) * d for a in active_per_layer]
    kv = 2 * layers * batch * context * cfg.kv_dim
    return float(itemsize * (cfg.vocab_size * d + layers * attention + sum(ffn) + kv))


def load_params(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, Any], str]:
    if args.checkpoint:
        loaded = load_run(args.checkpoint, step=args.step, dtype=args.dtype)
        return loaded.config.model, split_model(loaded.model)[1], f"checkpoint {args.checkpoint} step {loaded.step}"
    from twell_jax.configs import get_config

    cfg = get_config(args.config).model
    if args.dry_run:
        cfg = dataclasses.replace(cfg, vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=64)
    cfg = dataclasses.replace(cfg, compute_dtype=args.dtype)
    params = split_model(init_model(cfg, args.seed))[1]
    return cfg, params, f"random init of {args.config}" + (" (dry-run shapes)" if args.dry_run else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="trained run directory (sparse weights)")
    source.add_argument("--config", default="0.5b", help="preset for a random init (not sparse: plumbing only)")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--backends", default="auto,pallas", help="op backends of the sparse rows")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048, help="prefill length and decode context")
    parser.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)))
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps per timed program")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="minimum timed window per figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-energy", action="store_true", help="skip NVML power sampling")
    parser.add_argument("--xla-decode-row", action="store_true",
                        help="add 'dense-xla' and 'twell-BACKEND-xla': the dense twin and each sparse variant with "
                             "decode.kernels=xla (the generic path), decode and generate rows (their prefill "
                             "is their variant's)")
    parser.add_argument("--generate-tokens", type=int, default=256,
                        help="tokens per `twell generate`-style call at batch 1 (host round trips included); "
                             "0 = no generate rows")
    parser.add_argument("--generate-chunks", default=f"1,{DEFAULT_DECODE_CHUNK}",
                        help="the generate rows' decode steps per device call (comma-separated)")
    parser.add_argument("--stored-decode-rows", action="store_true",
                        help="add VARIANT+stored for the dense and sparse variants: decode and generate with "
                             "decode.transposed off (the weights as stored, no output-major copies)")
    parser.add_argument("--loop-decode-rows", action="store_true",
                        help="add VARIANT+loop for the dense and sparse variants: decode and generate with "
                             "decode.layer_unroll=1 (the decode kernels' layers in a loop, not unrolled)")
    parser.add_argument("--sparse-ffn-rows", default="", metavar="NAMES",
                        help="comma-separated decode.sparse_ffn values (" + ", ".join(DECODE_SPARSE_FFN)
                             + "): add VARIANT+NAME for the sparse variants, decode and generate with that "
                             "value (each name other than the config's)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an XLA option for a second decode row of every variant, named VARIANT+xla (the "
                             "decode loop compiled with it; repeatable), e.g. xla_gpu_enable_command_buffer="
                             "FUSION,CUBLAS,CUSTOM_CALL,WHILE,CONDITIONAL to capture the steps as CUDA graphs")
    parser.add_argument("--matvec-blocks", default=None, metavar="FILE",
                        help="decode_matvec block sizes per role for this run, from `bench_decode_matvec.py "
                             "--blocks-out FILE` (to measure a sweep's choice before it becomes ROLE_BLOCK_SIZES; a sweep "
                             "at more than decode_matvec.MANY_ROWS rows sets ROLE_BLOCK_SIZES_MANY_ROWS)")
    parser.add_argument("--trace-decode", type=int, default=0, metavar="TOP",
                        help="profile the timed decode loop of every decode row at the first batch, and two "
                             "calls of every generate row, and print the TOP largest kernels per step (the "
                             "step's time line; JSON: the row's 'trace')")
    parser.add_argument("--interleave-decode", type=int, default=0, metavar="ROUNDS",
                        help="after every row, time every decode row's loop again, each batch's in alternation "
                             "over ROUNDS rounds (what drifts between variants timed one after another then "
                             "touches all alike): the median as each row's ms_per_step_interleaved, with its "
                             "ratios to the twin and plain JAX of those rounds (a table printed last)")
    parser.add_argument("--peak-gbs", type=float, default=3350.0,
                        help="the device's HBM bandwidth for the decode rows' share of the floor (H100 SXM)")
    parser.add_argument("--check-decode", type=int, default=0, metavar="STEPS",
                        help="before timing: each model variant's decode steps at every --decode-batches size "
                             "against the same weights through the XLA path (decode.kernels=xla), "
                             "teacher-forced over STEPS tokens of the text after a prompt of 32 (at most half "
                             "--context); the largest "
                             "logit difference and the greedy agreement are printed and kept under "
                             "'decode_checks'; a difference above --check-tolerance stops the run before "
                             "anything is timed or written (the dry run checks the kernels in interpret mode)")
    parser.add_argument("--check-tolerance", type=float, default=0.02,
                        help="the largest |logit difference| / max |logit| --check-decode accepts")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the plumbing")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.check_decode < 0 or not args.check_tolerance > 0:
        raise SystemExit(f"--check-decode {args.check_decode} must be >= 0 (steps; 0: no check) and "
                         f"--check-tolerance {args.check_tolerance} > 0")
    if args.dry_run:
        args.backends, args.dtype = "reference", "float32"  # the sparse algorithm on a CPU
        args.prefill_batch, args.context, args.decode_steps, args.min_seconds = 2, 32, 4, 0.0
        args.decode_batches, args.generate_tokens = "1,2", min(args.generate_tokens, 8)
    backends = [b for b in args.backends.split(",") if b]
    xla_options = parse_xla_options(args.xla_option)
    items = [c for c in args.generate_chunks.split(",") if c]
    chunks = sorted({int(c) for c in items}) if all(c.isdigit() for c in items) else []
    if not chunks or min(chunks) < 1:
        raise SystemExit(f"--generate-chunks {args.generate_chunks!r}: expected integers >= 1, comma-separated")
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    sparse_ffn_rows = [v for v in args.sparse_ffn_rows.split(",") if v]
    if any(v not in DECODE_SPARSE_FFN for v in sparse_ffn_rows):
        raise SystemExit(f"--sparse-ffn-rows {args.sparse_ffn_rows!r}: expected names among "
                         f"{', '.join(DECODE_SPARSE_FFN)}, comma-separated")
    if args.trace_decode < 0:
        raise SystemExit(f"--trace-decode {args.trace_decode}: expected a number of kernels >= 0")
    matvec_blocks = load_matvec_blocks(args.matvec_blocks) if args.matvec_blocks else None
    cfg, params, source_text = load_params(args)
    if args.context > cfg.max_seq_len or args.decode_steps >= args.context:
        raise SystemExit(f"--context {args.context} must be <= model.max_seq_len={cfg.max_seq_len} and > "
                         f"--decode-steps {args.decode_steps}")
    prompt_len = min(GENERATE_PROMPT, args.context // 2)
    if not 0 <= args.generate_tokens <= args.context - prompt_len:
        raise SystemExit(f"--generate-tokens {args.generate_tokens} must be in [0, {args.context - prompt_len}] "
                         f"(a {prompt_len}-token prompt plus the new tokens fit --context)")
    device = jax.devices()[0]
    print(f"[bench] {source_text} on {device.device_kind} ({jax.default_backend()}), {args.dtype}; "
          f"d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.n_layers} layers; variants plain, dense, "
          + ", ".join(f"twell-{b}" for b in backends))
    hints = None
    rows_needed = max([args.prefill_batch, *batches])
    if args.checkpoint:  # the model's activity on text, not on random ids
        text = validation_tokens(args.checkpoint, rows_needed, cycle=True)
        if text.shape[1] - 1 < args.context:
            raise SystemExit(f"--context {args.context} is longer than the run's sequences ({text.shape[1] - 1})")
        text = jnp.asarray(text[:, :args.context])
        hints = run_hints(run_dir_of(args.checkpoint), args.step, n_layers=cfg.n_layers)
    else:
        text = jax.random.randint(jax.random.key(args.seed), (rows_needed, args.context), 0, cfg.vocab_size)
    configs = variant_configs(cfg, backends, interpret=args.dry_run, hints=hints)
    # The library's decode execution, whatever the run's decode section says (runs saved before a
    # change of default carry the old value): the transposed copies and the default sparse FFN step.
    # A row VARIANT+X runs VARIANT's model with another decode section.
    base_decode = DecodeConfig()
    decodes = {name: base_decode for name in configs}

    def add_rows(suffix: str, picked: list[str], **change: Any) -> None:
        for name in picked:
            configs[name + suffix] = configs[name]
            decodes[name + suffix] = dataclasses.replace(decodes[name], **change)

    if args.stored_decode_rows:  # decode and generate rows only (their prefill is their variant's)
        add_rows("+stored", [n for n in list(configs) if n == "dense" or n.startswith("twell-")], transposed=False)
    if args.loop_decode_rows:
        add_rows("+loop", [n for n in list(configs) if (n == "dense" or n.startswith("twell-")) and "+" not in n],
                 layer_unroll=1)
    for value in sparse_ffn_rows:  # decode and generate rows only, as the stored rows
        add_rows(f"+{value}", [n for n in list(configs) if n.startswith("twell-") and "+" not in n
                               and decodes[n].sparse_ffn != value], sparse_ffn=value)
    if args.xla_decode_row:  # after the kernels' row kinds: those rows vary the kernels' step
        add_rows("-xla", [n for n in list(configs) if n == "dense" or (n.startswith("twell-") and "+" not in n)],
                 kernels="xla")
    # In the load dtype, as model_with_params builds them (the generate rows' Generator reads it too).
    configs = {name: dataclasses.replace(c, compute_dtype=args.dtype) for name, c in configs.items()}
    models = {name: model_with_params(c, params, args.dtype) for name, c in configs.items()}
    checks = (run_decode_checks(args, configs, decodes, models, params, text, batches, cfg) if args.check_decode
              else [])
    # plain first: the baseline every other row is compared with.
    runners = {"plain": plain_runner(cfg, params, args.dtype, args.context),
               **{name: model_runner(model, cfg, decodes[name]) for name, model in models.items()}}
    sampler = make_power_sampler(not args.no_energy and not args.dry_run and jax.default_backend() == "gpu")
    tokens = text[:args.prefill_batch]
    rows: list[dict[str, Any]] = []
    plain_hidden = None
    decode_calls: list[Callable[[], Any]] = []  # each decode row's loop (--interleave-decode)
    decode_row_list: list[dict[str, Any]] = []

    def decode_rows(name: str, runner: Runner) -> None:
        """The decode rows of a variant (and its +xla rows), then its generate rows."""
        for batch, options in itertools.product(batches, [None, xla_options] if xla_options else [None]):
            r, call = bench_decode(runner, cfg.n_layers, text[:batch, :args.context - args.decode_steps],
                                   args.context, args.decode_steps, args.min_seconds, options,
                                   trace_top=args.trace_decode if batch == batches[0] else 0)
            if args.interleave_decode:  # kept (its cache and program) for the interleaved rounds
                decode_calls.append(call)
            sparse = name.startswith("twell") and r["l0_per_layer"] is not None
            floor = decode_floor_bytes(cfg, batch, args.context, jnp.dtype(args.dtype).itemsize,
                                       r["l0_per_layer"] if sparse else None)
            r["floor_bytes"] = floor
            r["floor_share"] = floor / (args.peak_gbs * 1e9) / (r["ms_per_step"] / 1e3)
            label = name if options is None else f"{name}+xla"
            if name in models:  # how each layer's FFN ran in the step (decode_plan.layer_ways)
                r["ffn_ways"] = list(decode_plan.layer_ways(models[name], decodes[name], batch, jnp.dtype(args.dtype)))
            rows.append({"variant": label, "phase": "decode", "batch": batch, **r,
                         **({} if options is None else {"xla_options": options})})
            decode_row_list.append(rows[-1])
            print(f"[bench] decode  {label} batch {batch}: {r['tokens_per_s']:.1f} tokens/s "
                  f"({r['ms_per_step']:.3f} ms/step, {r['floor_share']:.0%} of the bandwidth floor "
                  f"{floor / 1e9:.3f} GB; first calls: cache prefill {r['prefill_first_call_s']:.1f}s, "
                  f"decode loop {r['steps_first_call_s']:.1f}s); active/layer {r['l0_per_layer'] or '-'}"
                  + (f"; FFN ways {','.join(r['ffn_ways'])}" if "ffn_ways" in r else ""))
            if "trace" in r:
                print("\n".join(f"[bench]   {line}" for line in r["trace"]))
        if args.generate_tokens and name in models:  # plain JAX has no generator: ratios vs dense only
            for r in bench_generate(models[name], configs[name], decodes[name], text[0, :prompt_len].tolist(),
                                    args.generate_tokens, chunks, trace_top=args.trace_decode):
                rows.append({"variant": name, "phase": f"generate, chunk {r['chunk']}", "batch": 1, **r})
                print(f"[bench] generate {name} chunk {r['chunk']}: {r['tokens_per_s']:.1f} tokens/s "
                      f"({r['ms_per_step']:.3f} ms/token over {r['decode_steps']} steps; "
                      f"compile {r['compile_s']:.1f}s)")
                if "trace" in r:
                    print("\n".join(f"[bench]   {line}" for line in r["trace"]))

    for name, runner in runners.items():
        if not name.endswith(("+stored", "+loop", "-xla", *(f"+{v}" for v in DECODE_SPARSE_FFN))):  # decode rows only: its prefill is its variant's
            r, hidden_BxSxD = bench_prefill(runner, tokens, sampler, args.min_seconds)
            if plain_hidden is None:
                plain_hidden = hidden_BxSxD.astype(jnp.float32)
            else:  # the same weights on the same tokens: plain's states up to rounding
                r["hidden_rel_diff_vs_plain"] = float(jnp.max(jnp.abs(hidden_BxSxD.astype(jnp.float32) - plain_hidden))
                                                      / jnp.max(jnp.abs(plain_hidden)))
            del hidden_BxSxD
            rows.append({"variant": name, "phase": "prefill", "batch": args.prefill_batch, **r})
            energy = "" if r["energy_j_per_token"] is None else f", {1e3 * r['energy_j_per_token']:.3f} mJ/token"
            diff = f"; hidden states {r['hidden_rel_diff_vs_plain']:.1e} from plain" if name != "plain" else ""
            print(f"[bench] prefill {name}: {r['tokens_per_s']:.0f} tokens/s{energy} (first call "
                  f"{r['first_call_s']:.1f}s); active/layer {r['l0_per_layer'] or '-'}{diff}")
        decode_rows(name, runner)
    if args.interleave_decode:
        interleaved_decode(decode_row_list, decode_calls, args.decode_steps, args.interleave_decode)
    for base in ("dense", "plain"):
        same = {(r["phase"], r["batch"]): r for r in rows if r["variant"] == base}
        for r in rows:
            ref = same.get((r["phase"], r["batch"]))
            if ref is None:  # generate rows: no plain-JAX generator
                continue
            r[f"speed_vs_{base}"] = r["tokens_per_s"] / ref["tokens_per_s"]
            if r.get("energy_j_per_token") is not None and ref.get("energy_j_per_token"):
                r[f"energy_vs_{base}"] = r["energy_j_per_token"] / ref["energy_j_per_token"]
    print("\n| phase | batch | variant | tokens/s | vs dense | vs plain | mJ/token | vs dense | vs plain "
          "| mean active/token | ms/step | floor share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mj = "-" if r.get("energy_j_per_token") is None else f"{1e3 * r['energy_j_per_token']:.3f}"
        ev = " | ".join(f"{r[k]:.3f}x" if k in r else "-" for k in ("energy_vs_dense", "energy_vs_plain"))
        active = "-" if r["l0_per_layer"] is None else f"{np.mean(r['l0_per_layer']):.1f} of {cfg.d_ff}"
        step = "- | -" if r["phase"] == "prefill" else f"{r['ms_per_step']:.3f} | " + (
            f"{r['floor_share']:.0%}" if "floor_share" in r else "-")
        vs = " | ".join(f"{r[k]:.3f}x" if k in r else "-" for k in ("speed_vs_dense", "speed_vs_plain"))
        print(f"| {r['phase']} | {r['batch']} | {r['variant']} | {r['tokens_per_s']:.1f} | {vs} | {mj} | {ev} | "
              f"{active} | {step} |")
    if args.interleave_decode:
        print(f"\n| batch | variant | ms/step, {args.interleave_decode} interleaved rounds | vs dense | vs plain |\n"
              "|---|---|---|---|---|")
        for r in decode_row_list:
            vs = " | ".join(f"{r[k]:.3f}x" if k in r else "-" for k in ("interleaved_vs_dense", "interleaved_vs_plain"))
            print(f"| {r['batch']} | {r['variant']} | {r['ms_per_step_interleaved']:.3f} | {vs} |")
    result = {"source": source_text, "device": device.device_kind, "backend": jax.default_backend(),
              "dtype": args.dtype, "context": args.context, "decode_steps": args.decode_steps,
              "model": dataclasses.asdict(cfg), "decode": dataclasses.asdict(base_decode), "rows": rows,
              "date": time.strftime("%Y-%m-%d"),
              **({"decode_checks": checks} if checks else {}),
              **({"matvec_blocks": matvec_blocks} if matvec_blocks else {})}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"[bench] wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
