"""Log-likelihood scoring (twell_jax/inference/scoring.py, no lm-eval): batched, length-sorted and
padded scores equal each pair scored alone, whatever the batch size and the batches in flight;
the greedy test equals argmax's, ties included; text pairs encoded in one batch call equal each
encoded alone; rolling windows predict every token once; and the scores equal those of the same
model exported to Hugging Face and run by `transformers` (CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.config import ModelConfig
from twell_jax.inference import experiment_config_for
from twell_jax.inference.load import LoadedModel, eos_id_of
from twell_jax.inference import scoring
from twell_jax.inference.scoring import Scorer, rolling_pairs, target_scores
from twell_jax.model import init_model

WINDOW = 32
TEXTS = ["def main(argv):\n    return 0\n", "import os\nimport sys\n", "for i in range(10):\n    print(i)\n",
         "class Foo:\n    pass\n", "while True:\n    break\n"] * 8


def tiny_loaded(directory) -> LoadedModel:
    """A small random model (init_std 0.1: peaked predictions, context WINDOW) with a BPE trained on
    TEXTS saved in `directory` (tests/test_harness.py uses it too)."""
    from twell_jax.data.tokenizer import train_bpe

    tokenizer = train_bpe(TEXTS, vocab_size=300, eot_token="<|endoftext|>", show_progress=False)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=WINDOW,
                      ffn_kind="twell", compute_dtype="float32", ffn_backend="reference", init_std=0.1)
    config = experiment_config_for(cfg, tokenizer_path=str(path))
    return LoadedModel(model=init_model(cfg, 5), config=config, tokenizer=tokenizer, step=None,
                       eos_id=eos_id_of(tokenizer, config))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("tok"))


def _pairs(rng, n):
    """(context, continuation) id pairs of varied lengths, some longer than the window."""
    pairs = []
    for _ in range(n):
        context = rng.integers(1, 300, size=int(rng.integers(1, 45))).tolist()
        continuation = rng.integers(1, 300, size=int(rng.integers(1, 6))).tolist()
        pairs.append((context, continuation))
    return pairs


def _alone(loaded, context, continuation):
    """The pair scored by one unpadded forward of its last WINDOW + 1 tokens (the oracle)."""
    full = (list(context) + list(continuation))[-(WINDOW + 1):]
    logits = np.asarray(loaded.model(jnp.asarray([full[:-1]]))[0][0], np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    n = len(continuation)
    targets = full[1:][-n:]
    rows = logp[-n:]
    greedy = all(rows[i].argmax() == t for i, t in enumerate(targets))
    return float(sum(rows[i, t] for i, t in enumerate(targets))), greedy


def test_batched_scores_equal_each_pair_scored_alone_in_request_order(loaded):
    pairs = _pairs(np.random.default_rng(0), 11)
    # A greedy continuation: the model's own argmax after a context (is_greedy must be True).
    context = pairs[0][0][-10:]
    logits = np.asarray(loaded.model(jnp.asarray([context]))[0][0, -1])
    pairs.append((context, [int(logits.argmax())]))
    scorer = Scorer(loaded, batch_size=3)  # not a power of two: the last batch is padded to 4 rows
    traced_before = scorer.traces  # the programs are the loaded model's: other tests' Scorers count too
    got = scorer.loglikelihoods(pairs)
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        want_logp, want_greedy = _alone(loaded, context, continuation)
        assert logp == pytest.approx(want_logp, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy
    assert got[-1][1] is True
    # Programs: one per (rows, length) bucket used, not one per batch.
    assert scorer.traces - traced_before <= 2 * 2
    # A second Scorer over the same loaded model (lm-eval's second call, a second evaluation in the
    # process) reuses them: the same requests compile nothing, and score the same.
    again = Scorer(loaded, batch_size=3)
    traced = again.traces
    assert again.loglikelihoods(pairs) == got and again.traces == traced


def test_the_head_runs_on_each_rows_continuation_window_only(loaded, monkeypatch):
    """The LM head and log-softmax run on C positions per row (the batch's longest continuation,
    rounded up to a power of two), the window ending where each row's continuation ends, or
    starting at 0 in a row shorter than C: the scores equal the whole forward's."""
    rng = np.random.default_rng(5)
    pairs = [(rng.integers(1, 300, size=int(rng.integers(14, 25))).tolist(),
              rng.integers(1, 300, size=int(rng.integers(1, 4))).tolist()) for _ in range(6)]
    pairs.append(([int(rng.integers(1, 300))], rng.integers(1, 300, size=3).tolist()))  # shorter than C = 4
    scorer = Scorer(loaded, batch_size=8)
    program, shapes = scorer._program, []

    def recording(sequence_BxS1, positions_BxC):
        shapes.append((sequence_BxS1.shape, positions_BxC.shape))
        return program(sequence_BxS1, positions_BxC)

    monkeypatch.setattr(scorer, "_program", recording)
    got = scorer.loglikelihoods(pairs)
    assert shapes == [((8, WINDOW + 1), (8, 4))]  # one batch: 32 input positions, the head on 4
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        want_logp, want_greedy = _alone(loaded, context, continuation)
        assert logp == pytest.approx(want_logp, rel=1e-5, abs=1e-5) and greedy == want_greedy


@pytest.mark.parametrize("batch_size, in_flight", [(5, 1), (5, 3), (16, 2)])
def test_scores_do_not_depend_on_batching_or_batches_in_flight(loaded, monkeypatch, batch_size, in_flight):
    """Sorted, bucketed, several batches dispatched before the first is read back: each request's
    result equals it scored in a batch of its own, in request order (duplicates included)."""
    pairs = _pairs(np.random.default_rng(2), 23)
    pairs += [pairs[3], pairs[0]]
    want = Scorer(loaded, batch_size=1).loglikelihoods(pairs)
    monkeypatch.setattr(scoring, "IN_FLIGHT", in_flight)
    seen = []
    got = Scorer(loaded, batch_size=batch_size).loglikelihoods(pairs, progress=lambda done, total: seen.append(done))
    assert len(got) == len(pairs)
    for (logp, greedy), (want_logp, want_greedy) in zip(got, want):
        assert logp == pytest.approx(want_logp, rel=1e-6) and greedy is want_greedy
    assert seen == sorted(seen) and seen[-1] == len(pairs) and len(seen) == -(-len(pairs) // batch_size)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_target_scores_equal_log_softmax_and_argmax_ties_included(dtype):
    """Logits of a few integer values: most rows have several maxima; targets at the first maximum
    (greedy), at a later one (not: argmax takes the first) and anywhere."""
    rng = np.random.default_rng(3)
    logits_BxSxV = jnp.asarray(rng.integers(0, 3, size=(3, 37, 11)), dtype)
    first_BxS = jnp.argmax(logits_BxSxV, axis=-1)
    last_BxS = 10 - jnp.argmax(logits_BxSxV[..., ::-1], axis=-1)
    assert bool((first_BxS != last_BxS).any())  # ties where the two differ
    for targets_BxS in (first_BxS, last_BxS, jnp.asarray(rng.integers(0, 11, size=(3, 37)))):
        targets_BxS = targets_BxS.astype(jnp.int32)
        logp_BxS, greedy_BxS = jax.jit(target_scores)(logits_BxSxV, targets_BxS)
        want_BxSxV = jax.nn.log_softmax(logits_BxSxV.astype(jnp.float32), axis=-1)
        want_logp_BxS = jnp.take_along_axis(want_BxSxV, targets_BxS[..., None], axis=-1)[..., 0]
        np.testing.assert_array_equal(np.asarray(logp_BxS), np.asarray(want_logp_BxS))
        np.testing.assert_array_equal(np.asarray(greedy_BxS), np.asarray(first_BxS == targets_BxS))


def test_text_pairs_are_encoded_in_one_batch_call_each_text_once(loaded, monkeypatch):
    from twell_jax.data import tokenizer as tokenizer_lib

    text_pairs = [("for i in  ", "range(10):"), ("", "import os"), ("  \n", "x = 1"), ("def main(", "argv):"),
                  ("def main(", " self)"), ("for i in  ", "range(10):"), ("x", "")]
    scorer = Scorer(loaded)
    enc = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    want = []
    for context, continuation in text_pairs:  # the rule, one text at a time
        if not context.strip():
            want.append(([scorer.prefix_id], enc(context + continuation)))
        else:
            ids = enc(context.rstrip())
            want.append((ids, enc(context + continuation)[len(ids):]))
    calls, encode_documents = [], tokenizer_lib.encode_documents

    def counted(tokenizer, documents):
        calls.append(documents)
        return encode_documents(tokenizer, documents)

    monkeypatch.setattr(tokenizer_lib, "encode_documents", counted)
    assert scorer.encode_pairs(text_pairs) == want
    # 12 texts (5 stripped contexts, 7 wholes), 8 of them distinct: one call, each text once.
    assert len(calls) == 1 and len(calls[0]) == len(set(calls[0])) == 8
    assert scorer.encode_many(["import os", "", "import os"]) == [enc("import os"), [], enc("import os")]
    assert len(calls) == 2 and calls[1] == ["import os", ""]


def test_rolling_pairs_predict_every_token_once_with_the_most_context():
    # lm-eval's documented example: window 4, tokens 0..9 after the prefix P.
    assert rolling_pairs(list(range(10)), prefix_id=99, max_length=4) == [
        ([99], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]), ([5, 6, 7], [8, 9])]
    tokens = list(range(100, 177))
    pairs = rolling_pairs(tokens, prefix_id=0, max_length=WINDOW)
    assert [t for _, cont in pairs for t in cont] == tokens
    seq = [0] + tokens
    for context, continuation in pairs:
        assert len(context) + len(continuation) == min(WINDOW + 1, seq.index(continuation[-1]) + 1)
    assert rolling_pairs([], prefix_id=0, max_length=4) == []


def test_rolling_loglikelihood_sums_its_windows(loaded):
    scorer = Scorer(loaded, batch_size=4)
    short = scorer.encode("import os\n")
    long = scorer.encode(" ".join(TEXTS[:6]))
    assert len(long) > 2 * WINDOW
    total_short, total_long = scorer.rolling_loglikelihoods([short, long])
    assert total_short == pytest.approx(_alone(loaded, [scorer.prefix_id], short)[0], rel=1e-5)
    windows = [_alone(loaded, c, t)[0] for c, t in rolling_pairs(long, scorer.prefix_id, WINDOW)]
    assert total_long == pytest.approx(sum(windows), rel=1e-5)


def test_encode_pair_moves_the_contexts_trailing_space_and_splits_the_joint_encoding(loaded):
    scorer = Scorer(loaded)
    context, continuation = scorer.encode_pair("for i in  ", "range(10):")
    assert context == scorer.encode("for i in")
    assert context + continuation == scorer.encode("for i in  range(10):")
    assert scorer.encode_pair("", "import os") == ([scorer.prefix_id], scorer.encode("import os"))
    assert scorer.prefix_id == loaded.tokenizer.token_to_id("<|endoftext|>")


def test_bad_requests_are_errors_naming_them(loaded):
    scorer = Scorer(loaded)
    with pytest.raises(ValueError, match="request 1: the continuation has 40 tokens"):
        scorer.loglikelihoods([([1], [2]), ([1], [3] * 40)])
    with pytest.raises(ValueError, match=r"request 0: token ids outside \[0, 300\)"):
        scorer.loglikelihoods([([1], [300])])
    with pytest.raises(ValueError, match="request 0: the continuation is empty"):
        scorer.loglikelihoods([([1], [])])
    with pytest.raises(ValueError, match="max_length must be an int in"):
        Scorer(loaded, max_length=WINDOW + 1)
    bare = LoadedModel(model=loaded.model, config=loaded.config, tokenizer=None, step=None)
    with pytest.raises(ValueError, match="no tokenizer"):
        Scorer(bare).encode("x")


def test_scores_equal_transformers_on_the_exported_model(loaded, tmp_path):
    """The exported checkpoint run by transformers' LlamaForCausalLM (fp32, CPU): the summed
    log-likelihoods agree to 1e-4 relative (measured ~1e-7) and the greedy flags exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from twell_jax.inference.hf import export_hf

    hf_model = transformers.LlamaForCausalLM.from_pretrained(export_hf(loaded, tmp_path / "hf")).float().eval()
    pairs = _pairs(np.random.default_rng(1), 8)
    got = Scorer(loaded, batch_size=4).loglikelihoods(pairs)
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        full = (context + continuation)[-(WINDOW + 1):]
        with torch.no_grad():
            logits = hf_model(torch.tensor([full[:-1]])).logits[0].double()
        logp_hf = torch.log_softmax(logits, -1)[-len(continuation):]
        targets = torch.tensor(full[1:][-len(continuation):])
        want = float(logp_hf.gather(-1, targets[:, None]).sum())
        assert logp == pytest.approx(want, rel=1e-4)
        assert greedy == bool((logp_hf.argmax(-1) == targets).all())
