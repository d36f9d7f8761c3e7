"""KV-cached decoding and generation: exact against the full forward, bounded compilations,
sampling, EOS, streaming, errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.config import DecodeConfig, ModelConfig
from twell_jax.inference import (Generator, LoadedModel, SamplingConfig, experiment_config_for, generate,
                                 sample_tokens)
from twell_jax.inference import decode_engine
from twell_jax.inference.decode_engine import decode
from twell_jax.model import init_cache, init_model

VOCAB = 300


def _model_cfg(**overrides) -> ModelConfig:
    # init_std 0.2: logits far from ties, so greedy choices are robust to rounding. The generation
    # mechanics run the op's dense backend (fast to compile); the exactness test runs the sparse one.
    fields = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64,
                  compute_dtype="float32", ffn_kind="twell", ffn_backend="dense", init_std=0.2)
    fields.update(overrides)
    return ModelConfig(**fields)


def _loaded(model_cfg: ModelConfig, seed: int = 0, decode_cfg: DecodeConfig = DecodeConfig()) -> LoadedModel:
    config = dataclasses.replace(experiment_config_for(model_cfg), decode=decode_cfg)
    return LoadedModel(model=init_model(model_cfg, seed), config=config, tokenizer=None, step=None)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """One model for the generation-mechanics tests: its cached Generator compiles each program once
    for the whole module (prompts of <= 8 tokens, 2 or 3 rows: prompt bucket 8, row buckets 2 and 4)."""
    return _loaded(_model_cfg())


def _full_forward_logits(model, seqs: list[np.ndarray], width: int) -> list[np.ndarray]:
    """Each sequence's logits from the full forward, alone: right-padded to `width` tokens in one
    batch, which changes no logit of a real position (causal attention), so one program serves all."""
    padded_BxW = np.zeros((len(seqs), width), np.int32)
    for b, seq in enumerate(seqs):
        padded_BxW[b, :len(seq)] = seq
    logits_BxWxV = np.asarray(jax.jit(lambda tokens: model(tokens)[0])(jnp.asarray(padded_BxW)))
    return [logits_BxWxV[b, :len(seq)] for b, seq in enumerate(seqs)]


@pytest.mark.parametrize("kind,backend", [("twell", "reference"), ("relu", "reference"), ("swiglu", "dense")])
def test_kv_cached_logits_equal_the_full_forward_at_every_position_for_a_ragged_batch(kind, backend):
    cfg = _model_cfg(ffn_kind=kind, ffn_backend=backend)
    model = init_model(cfg, 1)
    rng = np.random.default_rng(0)
    lengths = [5, 1, 8, 3]  # 8 fills the bucket (no padding), 1 is a lone token at the last slot
    bucket, steps = 8, 3
    seqs = [rng.integers(0, VOCAB, size=n + steps) for n in lengths]
    tokens_BxP = np.zeros((len(lengths), bucket), np.int32)
    start_B = np.array([bucket - n for n in lengths], np.int32)
    for b, n in enumerate(lengths):
        tokens_BxP[b, bucket - n:] = seqs[b][:n]
    config = DecodeConfig()  # the default: the decode kernels' step on a GPU, the model's XLA decode here
    prefill = jax.jit(lambda tokens, c: decode(model, tokens, c, jnp.int32(0), jnp.asarray(start_B), config=config,
                                               all_logits=True))
    logits_BxPxV, cache, _ = prefill(jnp.asarray(tokens_BxP), init_cache(cfg, len(lengths), cfg.max_seq_len))
    full = _full_forward_logits(model, seqs, bucket + steps)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits_BxPxV[b, bucket - n:]), full[b][:n], rtol=1e-5, atol=1e-5)
    step_fn = jax.jit(lambda m_tokens, c, i: decode(model, m_tokens, c, i, jnp.asarray(start_B), config=config))
    for t in range(steps):
        fed_B = np.array([seq[n + t] for seq, n in zip(seqs, lengths)], np.int32)
        logits_BxV, cache, _ = step_fn(jnp.asarray(fed_B[:, None]), cache, jnp.int32(bucket + t))
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(logits_BxV[b]), full[b][n + t], rtol=1e-5, atol=1e-5)


def _greedy_by_full_forward(model, prompt: list[int], n: int, width: int = 16) -> list[int]:
    """Greedy continuation by re-running the full forward on the growing sequence, right-padded to
    `width` (causal: the padding changes no real position), so every step reuses one program."""
    ids = list(prompt)
    forward = jax.jit(lambda tokens: model(tokens)[0])
    for _ in range(n):
        logits = forward(jnp.asarray([ids + [0] * (width - len(ids))]))[0, len(ids) - 1]
        ids.append(int(jnp.argmax(logits)))
    return ids[len(prompt):]


def test_greedy_generation_equals_a_full_forward_loop_per_row(loaded):
    prompts = [[3, 14, 15, 9, 2, 6], [5], [35, 8, 9, 7, 9, 3, 2, 38]]
    result = generate(loaded, prompts, max_new_tokens=4, eos=())
    for prompt, out in zip(prompts, result.tokens):
        assert out == _greedy_by_full_forward(loaded.model, prompt, 4)
    assert result.finish_reasons == ["length"] * 3
    assert result.prompt_lengths == [6, 1, 8]
    assert result.texts is None  # no tokenizer


def test_a_mix_of_prompt_lengths_compiles_one_prefill_per_bucket_and_one_decode_step():
    generator = Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32)  # one layer: cheaper programs to count
    rng = np.random.default_rng(1)
    lengths = [1, 5, 8, 9, 17, 30]
    for n in lengths:
        prompts = [list(rng.integers(0, VOCAB, size=n)), list(rng.integers(0, VOCAB, size=max(1, n // 2)))]
        generator.generate(prompts, max_new_tokens=2, eos=())
    # Buckets 8, 16, 32 (30 + 2 fits the 32-slot cache only in a 31-slot bucket: capped).
    buckets = {generator.prompt_bucket(n, 2) for n in lengths}
    assert buckets == {8, 16, 31}
    assert generator.traces == {"prefill": len(buckets), "decode": 1}
    # Another row bucket (3 prompts -> 4 rows) adds one program per shape, nothing per length.
    for n in (3, 20, 4):
        generator.generate([[1] * n, [2], [3, 4]], max_new_tokens=2, eos=())
    assert generator.traces == {"prefill": len(buckets) + 2, "decode": 2}


@pytest.mark.parametrize("chunk", [1, 2, 16])
@pytest.mark.fast_params("16")
def test_chunked_decode_equals_step_at_a_time_and_compiles_before_the_clock(chunk):
    """Any chunk (decode steps per program call) gives the same tokens, greedy and sampled, with
    rows stopping on EOS inside a chunk; compilation is reported on its own, once."""
    generator = Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32, chunk=chunk)
    reference = Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32, chunk=1)
    prompts = [[1, 2, 3], [40, 41], [7]]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.5, seed=2)):
        free = reference.generate(prompts, 9, sampling, eos=())
        eos = free.tokens[1][3]  # row 1 stops at its 4th token: inside the first chunk of 16, after one of 2
        want = reference.generate(prompts, 9, sampling, eos=eos)
        got = generator.generate(prompts, 9, sampling, eos=eos)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
        assert got.decode_steps == want.decode_steps
    first = generator.generate(prompts, 5, SamplingConfig(), eos=())
    # A call may name its own chunk: the reference Generator then compiles that size's program.
    assert reference.generate(prompts, 5, SamplingConfig(), eos=(), chunk=chunk).tokens == first.tokens
    with pytest.raises(ValueError, match="chunk .* must be an int >= 1"):
        reference.generate(prompts, 5, SamplingConfig(), eos=(), chunk=0)
    again = generator.generate(prompts, 5, SamplingConfig(), eos=())
    assert first.compile_s == 0.0 and again.compile_s == 0.0  # compiled by the calls above
    assert generator.traces == {"prefill": 1, "decode": 2}  # one decode program per mode: greedy, sampled
    fresh = Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32, chunk=chunk)
    assert fresh.generate(prompts, 3, SamplingConfig(), eos=()).compile_s > 0


def test_a_chunk_ends_on_the_device_once_every_row_made_an_eos():
    generator = Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32, chunk=8)
    greedy = generator.generate([[7]], 4, SamplingConfig(), eos=()).tokens[0]
    assert greedy[2] != greedy[1]  # (this model's greedy tokens from [7] do not repeat at once)
    prefill = generator._run("prefill", generator._prefill, generator.state, generator.prepared,
                             jnp.asarray([[0] * 7 + [7]]), jnp.asarray([7]), jax.random.key(0), jnp.float32(0),
                             jnp.int32(0), jnp.float32(1))
    (token_B, cache), _ = prefill
    assert int(token_B[0]) == greedy[0]
    settings = (jnp.int32(8), jnp.int32(8))  # the first slot after the prompt bucket, up to 8 steps
    for eos, steps in ((greedy[2], 2), (-1, 8)):  # the 2nd decode step makes greedy[2]; -1 is never made
        args = (generator.state, generator.prepared, cache, token_B, jnp.full((1, 8), -1, jnp.int32), *settings,
                jnp.asarray([False]), jnp.asarray([eos], jnp.int32), jnp.asarray([7]), jax.random.key(0),
                jnp.float32(0), jnp.int32(0), jnp.float32(1))
        (tokens_BxC, n_run, last_B, _, done_B), _ = generator._run("decode greedy", generator._decode_chunk[True], *args)
        assert int(n_run) == steps and list(np.asarray(tokens_BxC[0, :2])) == greedy[1:3]
        assert bool(done_B[0]) == (eos != -1)  # the device's done flags, the next chunk's input
        assert int(last_B[0]) == int(tokens_BxC[0, steps - 1]) and int(tokens_BxC[0, steps:].max(initial=-1)) == -1
    # The chunk's loop has a trip count known when it is traced (the chunk width), and the greedy
    # program has no lax.cond: on a GPU, XLA then runs the steps without copying a loop or branch
    # predicate to the host after each one. The stop is a mask inside the loop (checked above).
    jaxpr = str(jax.make_jaxpr(generator._decode_chunk[True])(*args))
    assert "scan[" in jaxpr and " while[" not in jaxpr and " cond[" not in jaxpr
    with pytest.raises(ValueError, match="chunk .* must be an int >= 1"):
        Generator(_loaded(_model_cfg(n_layers=1)), chunk=0)


def test_eos_stops_each_row_on_its_own(loaded):
    prompts = [[1, 2, 3], [40, 41], [7]]
    free = generate(loaded, prompts, max_new_tokens=8, eos=())
    eos = free.tokens[0][2]
    stopped = generate(loaded, prompts, max_new_tokens=8, eos=eos)
    for row_free, row, reason in zip(free.tokens, stopped.tokens, stopped.finish_reasons):
        if eos in row_free:
            cut = row_free.index(eos) + 1
            assert row == row_free[:cut] and reason == "eos"
        else:
            assert row == row_free and reason == "length"
    assert stopped.finish_reasons[0] == "eos" and len(stopped.tokens[0]) <= 3


@pytest.mark.parametrize("chunk", [2, 16])
def test_stream_gets_every_token_in_order_as_generated(loaded, chunk):
    seen: list[tuple[int, int, str]] = []
    result = generate(Generator(loaded, chunk=chunk), [[4, 5, 6], [9]], max_new_tokens=5, eos=(),
                      stream=lambda row, token, text: seen.append((row, token, text)))
    for row in range(2):
        assert [t for r, t, _ in seen if r == row] == result.tokens[row]
    assert [r for r, _, _ in seen] == [0, 1] * 5  # one step at a time, rows interleaved, across chunks
    assert all(text == "" for _, _, text in seen)  # no tokenizer: nothing printable


def test_sampling_is_seeded_and_top_k_one_or_zero_temperature_is_greedy(loaded):
    prompts = [[1, 2, 3], [4]]
    greedy = generate(loaded, prompts, max_new_tokens=5, eos=()).tokens
    a = generate(loaded, prompts, max_new_tokens=5, temperature=1.5, seed=3, eos=()).tokens
    b = generate(loaded, prompts, max_new_tokens=5, temperature=1.5, seed=3, eos=()).tokens
    c = generate(loaded, prompts, max_new_tokens=5, temperature=1.5, seed=4, eos=()).tokens
    assert a == b and a != c and a != greedy
    assert generate(loaded, prompts, max_new_tokens=5, temperature=1.5, top_k=1, seed=3, eos=()).tokens == greedy
    assert generate(loaded, prompts, max_new_tokens=5, temperature=1.5, top_p=1e-6, seed=3, eos=()).tokens == greedy
    # The settings are traced values: all of the above ran on the module's programs, one per row
    # bucket (2 and 4, other tests) and mode (greedy, sampled), never one per setting.
    assert loaded._generator.traces["decode"] <= 4


def test_sample_tokens_respects_top_k_and_top_p():
    logits_1xV = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    keys = jax.random.split(jax.random.key(0), 2000)
    # One program for every setting (they are traced), as in generation.
    draws = jax.jit(jax.vmap(lambda k, logits, t, kk, p: sample_tokens(logits, k, t, kk, p)[0],
                             in_axes=(0, None, None, None, None)))

    def draw(temperature, top_k, top_p, logits=logits_1xV, n=len(keys)):
        return np.asarray(draws(keys[:n], logits, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)))

    assert set(draw(1.0, 2, 1.0)) == {1, 3}
    assert set(draw(1.0, 0, 0.75)) == {1, 3, 4}  # 0.4 + 0.3 < 0.75: the third most likely joins
    assert set(draw(1.0, 0, 0.7)) == {1, 3}  # 0.4 + 0.3 reaches 0.7
    assert set(draw(0.0, 0, 1.0)) == {1}
    assert set(draw(1.0, 1, 1.0)) == {1}
    # Greedy settings are the argmax itself: of two tied maxima, always the first.
    tied_1xV = jnp.asarray([[0.0, 2.0, 2.0, 1.0]])
    for temperature, top_k in ((0.0, 0), (1.0, 1)):
        assert set(draw(temperature, top_k, 1.0, logits=tied_1xV, n=200)) == {1}
    # The greedy branch is a lax.cond: one program serves every setting, traced or not.
    assert "cond" in str(jax.make_jaxpr(sample_tokens)(tied_1xV, keys[0], jnp.float32(0), jnp.int32(0),
                                                       jnp.float32(1)))
    counts = np.bincount(draw(1.0, 0, 1.0), minlength=5) / len(keys)
    np.testing.assert_allclose(counts, [0.05, 0.4, 0.1, 0.3, 0.15], atol=0.04)


def test_generation_errors_name_the_problem():
    loaded = _loaded(_model_cfg(max_seq_len=16))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(loaded, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="only 9 fit the cache of 16"):
        generate(loaded, [[1] * 10], max_new_tokens=8)
    with pytest.raises(ValueError, match="no tokenizer"):
        generate(loaded, ["hello"], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside"):
        generate(loaded, [[VOCAB]], max_new_tokens=2)
    with pytest.raises(ValueError, match="single string"):
        generate(loaded, "hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(loaded, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="eos"):
        generate(loaded, [[1]], max_new_tokens=2, eos="x")
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingConfig(**bad)


def test_a_long_prompt_is_refused_naming_the_option_or_keeps_its_last_tokens():
    loaded = _loaded(_model_cfg(max_seq_len=16))
    prompt = list(range(1, 13))  # 12 tokens; with 8 new ones only 9 fit the 16-token cache
    with pytest.raises(ValueError, match=r"prompt 0 has 12 tokens.*only 9 fit.*truncate='left'.*--truncate-prompt"):
        generate(loaded, [prompt], max_new_tokens=8)
    kept = generate(loaded, [prompt], max_new_tokens=8, eos=(), truncate="left")
    assert kept.prompt_lengths == [9]
    assert kept.tokens == generate(loaded, [prompt[-9:]], max_new_tokens=8, eos=()).tokens
    with pytest.raises(ValueError, match="truncate must be one of"):
        generate(loaded, [prompt], max_new_tokens=8, truncate="right")


def test_stop_strings_end_a_row_before_them_and_the_stream_never_shows_them(loaded):
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    named = LoadedModel(model=loaded.model, config=loaded.config, tokenizer=tokenizer, step=None)
    prompts = [[1, 2, 3], [40, 41]]
    free = generate(named, prompts, max_new_tokens=8, eos=())
    stop = f"w{free.tokens[0][3]}"  # the 4th generated word of row 0 (decoded words are space-separated)
    seen: dict[int, str] = {0: "", 1: ""}

    def stream(row, token, text):
        seen[row] += text

    stopped = generate(named, prompts, max_new_tokens=8, eos=(), stop=[stop],
                       stream=lambda row, token, text: stream(row, token, text))
    for row in range(2):
        text = free.texts[row]
        cut = text.find(stop)
        if cut >= 0:
            assert stopped.finish_reasons[row] == "stop" and stopped.texts[row] == text[:cut]
        else:
            assert stopped.finish_reasons[row] == "length" and stopped.texts[row] == text
        assert seen[row] == stopped.texts[row]  # streamed text: exactly the result, the stop string held back
    assert stopped.finish_reasons[0] == "stop" and len(stopped.tokens[0]) <= 4
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        generate(loaded, prompts, max_new_tokens=2, stop=["x"])


@pytest.mark.parametrize("kind,backend,transposed", [("twell", "pallas", False), ("relu_gated", "dense", False),
                                                     ("twell", "pallas", True)])
@pytest.mark.slow
def test_greedy_generation_through_the_decode_kernels_equals_the_full_forward(kind, backend, transposed):
    """The one-token steps run `decode_engine.kernel_step` (decode.kernels=pallas, the kernels
    interpreted): the sparse model and its dense twin, padded rows included; with decode.transposed,
    on the Generator's output-major weight copies."""
    cfg = _model_cfg(ffn_kind=kind, ffn_backend=backend, ffn_interpret=True,
                     ffn_op_config={"tile": 16, "slots": 16, "ell_width": 64})
    loaded_ = _loaded(cfg, seed=1, decode_cfg=DecodeConfig(kernels="pallas", transposed=transposed))
    assert decode_engine.uses_kernels(loaded_.model, loaded_.config.decode)
    assert (Generator(loaded_).prepared is not None) == transposed
    prompts = [[3, 14, 15, 9, 2, 6], [5]]
    result = generate(loaded_, prompts, max_new_tokens=4, eos=())
    for prompt, out in zip(prompts, result.tokens):
        assert out == _greedy_by_full_forward(loaded_.model, prompt, 4)
    assert result.decode_steps == 3 and result.decode_s > 0 and result.prefill_s > 0
    assert result.decode_tokens_per_s() == pytest.approx(2 * 3 / result.decode_s)
    # A cache with room for one prompt token: the prompt's bucket is one token, so the prefill
    # itself is a one-token kernel step (with the copies when transposed).
    one = Generator(loaded_, cache_len=8).generate([[5]], 8, SamplingConfig(), eos=())
    assert one.tokens[0] == _greedy_by_full_forward(loaded_.model, [5], 8)


def test_the_decode_step_runs_no_finiteness_scan():
    """Generation never pays for the op's NaN/Inf scan: the one-token step through the decode
    kernels contains no is_finite, whatever the op config's check_finite says."""
    cfg = _model_cfg(ffn_kind="twell", ffn_backend="pallas", ffn_interpret=True,
                     ffn_op_config={"tile": 16, "slots": 16, "ell_width": 64, "check_finite": True})
    config = DecodeConfig(kernels="pallas")
    model = init_model(cfg, 0)
    cache = init_cache(cfg, 2, 8)
    assert config.transposed  # the default layout: the step reads prepare_decode's copies
    prepared = decode_engine.prepare_decode(model, config)
    jaxpr = jax.make_jaxpr(lambda c: decode(model, jnp.zeros((2, 1), jnp.int32), c, jnp.int32(3),
                                            jnp.zeros((2,), jnp.int32), config=config, prepared=prepared))(cache)
    assert "is_finite" not in str(jaxpr)
    assert "twell_decode_matvec" in str(jaxpr) or "pallas_call" in str(jaxpr)


def test_the_next_chunk_is_dispatched_before_the_host_reads_this_ones_tokens():
    """Chunks go one ahead: chunk k + 1 is queued (from chunk k's device outputs) before the host
    waits for and books chunk k's tokens, so the device does not idle while the host works. The
    tokens are those of one chunk at a time (chunk=1 and chunk=2 agree, EOS included); at most one
    chunk more than needed is dispatched."""
    generator = Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32, chunk=2)
    free = generator.generate([[7]], 9, SamplingConfig(), eos=()).tokens[0]
    events: list[tuple] = []
    real_run = generator._run

    def run(name, fn, *args):
        if name.startswith("decode"):
            events.append(("dispatch", int(args[5]) - 8))  # decode step of the chunk's first slot
        return real_run(name, fn, *args)

    generator._run = run
    streamed = generator.generate([[7]], 9, SamplingConfig(), eos=(),
                                  stream=lambda row, token, text: events.append(("token", token))).tokens[0]
    assert streamed == free
    dispatched = [at for kind, at in events if kind == "dispatch"]
    assert dispatched == [0, 2, 4, 6]  # 8 decode steps, 2 a chunk: no chunk past the length limit
    # the first decode token (the second streamed token) reaches the host after chunk 1 was queued
    second_token = [i for i, e in enumerate(events) if e[0] == "token"][1]
    assert events.index(("dispatch", 2)) < second_token
    events.clear()
    eos = free[3]  # made by decode step 2 (chunk 1): chunk 2 is already queued then, chunk 3 never
    stopped = generator.generate([[7]], 9, SamplingConfig(), eos=eos).tokens[0]
    assert stopped == free[:free.index(eos) + 1]
    assert [at for kind, at in events if kind == "dispatch"] == [0, 2, 4]
    assert Generator(_loaded(_model_cfg(n_layers=1)), cache_len=32, chunk=1).generate(
        [[7]], 9, SamplingConfig(), eos=eos).tokens[0] == stopped
