"""load_run on a real (micro) training run, the README's inference example, `twell generate`, and
the inference benchmark's dry run (its JSON rows)."""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from twell_jax import cli
from twell_jax.inference import cli as inference_cli
from twell_jax.inference import generate, load_run
from twell_jax.model import split_model
from twell_jax.ops import planner

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    """A 4-step micro run under <tmp>/runs/micro (what the README's example loads), its final params."""
    from twell_jax.configs import get_config
    from twell_jax.training.train import train

    root = tmp_path_factory.mktemp("inference")
    result = train(get_config("micro"), root / "runs" / "micro", echo=lambda _: None)
    return root, jax.device_get(result.state["params"])


def test_load_run_restores_the_trained_params_in_the_requested_dtype(micro_run):
    root, trained = micro_run
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run saved its tokenizer: no fallback warning
        loaded = load_run(root / "runs" / "micro", dtype="float32")
    assert loaded.step == 4 and loaded.config.name == "micro" and loaded.config.model.compute_dtype == "float32"
    jax.tree.map(np.testing.assert_array_equal, split_model(loaded.model)[1], trained)
    # The run's telemetry fills the per-layer "auto" hints, and the op plans for inference: forward
    # only, the weights' NaN pass skipped (they were verified finite).
    assert len(loaded.config.model.ffn_expected_active) == loaded.config.model.n_layers
    assert all(c.forward_only and not c.check_finite for c in loaded.model.op_configs)
    # ... and each row length its own hint, from the validation activity by position the run logged.
    profile = loaded.config.model.ffn_active_by_position
    assert len(profile) == loaded.config.model.n_layers
    max_len = loaded.config.model.max_seq_len
    for layer, row in enumerate(profile):
        assert [c.expected_active_per_token for c in loaded.model.op_configs_for(max_len)][layer] == pytest.approx(
            planner.active_for_length(row, max_len, max_len))
    assert loaded.tokenizer.get_vocab_size() <= loaded.config.model.vocab_size and loaded.eos_id == 0
    half = load_run(root / "runs" / "micro" / "checkpoints", step=4)  # the checkpoints dir works too
    for got, want in zip(jax.tree.leaves(split_model(half.model)[1]), jax.tree.leaves(trained)):
        assert got.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype("bfloat16"))


def test_validation_logs_activity_by_position_and_a_run_without_it_keeps_its_hints(micro_run, tmp_path):
    """The trainer's validation record holds each layer's activity by position bucket, whose mean over
    the whole length is the layer's validation l0; a run whose records lack it loads with the hints
    alone (every row length the same hint), and says so."""
    import json

    root, _ = micro_run
    records = [json.loads(line) for line in (root / "runs" / "micro" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_active_by_position" in r][-1]
    from twell_jax.training.checkpoint import load_run_config
    from twell_jax.training.hints import with_auto_hints, with_position_hints

    cfg = load_run_config(root / "runs" / "micro")
    assert len(val["val_active_by_position"][0]) == len(planner.position_buckets(cfg.model.max_seq_len)) - 1
    for row, l0 in zip(val["val_active_by_position"], val["val_l0_per_layer"]):
        assert planner.active_for_length(row, cfg.seq_len, cfg.model.max_seq_len) == pytest.approx(l0, rel=1e-5)
    run = tmp_path / "run"
    shutil.copytree(root / "runs" / "micro", run)
    stripped = [{k: v for k, v in r.items() if k != "val_active_by_position"} for r in records]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stripped))
    lines = []
    hinted = with_auto_hints(cfg, run, echo=lambda _: None)
    assert with_position_hints(hinted, run, echo=lines.append) is hinted
    assert "no validation activity by position" in lines[0]
    loaded = load_run(run)
    assert loaded.config.model.ffn_active_by_position == ()
    assert loaded.model.op_configs_for(4) == loaded.model.op_configs


def test_load_run_prefers_the_runs_tokenizer_json(micro_run, tmp_path):
    root, _ = micro_run
    from tokenizers import Tokenizer, models

    run = tmp_path / "run"
    shutil.copytree(root / "runs" / "micro", run)
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 50)}}
    Tokenizer(models.WordLevel(vocab, unk_token="w1")).save(str(run / "tokenizer.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        loaded = load_run(run)
    assert loaded.tokenizer.get_vocab_size() == 50 and loaded.eos_id == 0


def test_load_run_without_a_saved_tokenizer_rebuilds_it_with_a_warning(micro_run, tmp_path, monkeypatch):
    root, _ = micro_run
    run = tmp_path / "run"
    shutil.copytree(root / "runs" / "micro", run)
    (run / "tokenizer.json").unlink()
    from twell_jax.data import bundle

    def no_data_build(*args, **kwargs):
        raise AssertionError("the tokenizer fallback must not build the token streams")

    monkeypatch.setattr(bundle, "build_data", no_data_build)
    with pytest.warns(UserWarning, match="tokenizer.json"):
        loaded = load_run(run)
    assert loaded.tokenizer.get_vocab_size() <= loaded.config.model.vocab_size and loaded.eos_id == 0


def test_load_run_errors_name_what_is_wrong(micro_run, tmp_path):
    root, _ = micro_run
    with pytest.raises(FileNotFoundError, match="no run directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_run(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 3 .*steps: \[4\]"):
        load_run(root / "runs" / "micro", step=3)
    with pytest.raises(ValueError, match="dtype"):
        load_run(root / "runs" / "micro", dtype="float16")
    broken = tmp_path / "broken"
    shutil.copytree(root / "runs" / "micro", broken)
    for path in (broken / "checkpoints" / "4" / "params").rglob("*"):
        if path.is_file() and path.name not in ("_METADATA", "commit_success.txt"):
            path.write_bytes(b"")
    with pytest.raises(ValueError, match="checkpoint .*4"):
        load_run(broken)


def test_readme_inference_example_runs(micro_run, monkeypatch, capsys):
    root, _ = micro_run
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    examples = [b for b in blocks if "load_run(" in b]
    assert examples, "README.md has no example of load_run"
    example = examples[0]
    monkeypatch.chdir(root)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run saved its tokenizer: no fallback warning, nor any other
        exec(compile(example, "README.md#inference", "exec"), namespace)
    result = namespace["result"]
    assert len(result.texts) == 2 and all(len(t) <= 8 for t in result.tokens)
    assert str(result.texts) in capsys.readouterr().out


def test_twell_generate_streams_and_reports_errors(micro_run, capsys, monkeypatch):
    root, _ = micro_run
    run = root / "runs" / "micro"
    loaded = load_run(run, dtype="float32")
    requested = []

    def load_once(checkpoint, step=None, dtype="bfloat16"):
        requested.append((checkpoint, step, dtype))
        return loaded  # the CLI's programs stay cached on it for the check below

    monkeypatch.setattr(inference_cli, "load_run", load_once)
    rc = cli.main(["generate", "--checkpoint", str(run), "--prompt", "def main(", "--max-new-tokens", "5",
                   "--dtype", "float32", "--temperature", "0.7", "--top-k", "20", "--seed", "1"])
    captured = capsys.readouterr()
    assert rc == 0 and requested == [(run, None, "float32")]
    # It printed the prompt and streamed the continuation that generate() gives for these settings.
    expected = generate(loaded, ["def main("], max_new_tokens=5, temperature=0.7, top_k=20, seed=1)
    assert captured.out == "def main(" + expected.texts[0] + "\n"
    assert expected.finish_reasons[0] in captured.err
    monkeypatch.undo()
    rc = cli.main(["generate", "--checkpoint", str(root / "runs" / "missing"), "--prompt", "x"])
    assert rc == 2 and "no run directory" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_inference_dry_run_measures_every_variant_on_the_same_weights(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "twell_jax.bench.inference", "--dry-run",
                           "--stored-decode-rows", "--loop-decode-rows", "--sparse-ffn-rows", "auto,tiles", "--trace-decode",
                           "3", "--interleave-decode", "1", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    # +stored rows (decode.transposed off): decode and generate only, the same tokens (on a
    # CPU the step is XLA's, so no copies are made: the plumbing is what runs here).
    transposed = [r for r in rows if r["variant"].endswith("+stored")]
    assert {r["variant"] for r in transposed} == {"dense+stored", "twell-reference+stored"}
    assert {r["phase"] for r in transposed} == {"decode", "generate, chunk 1", "generate, chunk 16"}
    # --loop-decode-rows: the dense and sparse variants with their decode layers in a loop
    # (decode.layer_unroll=1), decode and generate only, the same tokens.
    looped = [r for r in rows if r["variant"].endswith("+loop")]
    assert {r["variant"] for r in looped} == {"dense+loop", "twell-reference+loop"}
    assert {r["phase"] for r in looped} == {"decode", "generate, chunk 1", "generate, chunk 16"}
    # --interleave-decode: every decode row timed again in alternation with its batch's others, its
    # ratios to the twin and plain JAX of those rounds (each base exactly 1 against itself).
    decoded = [r for r in rows if r["phase"] == "decode"]
    assert all(r["ms_per_step_interleaved"] > 0 and r["interleaved_vs_dense"] > 0 and r["interleaved_vs_plain"] > 0
               for r in decoded)
    for base in ("dense", "plain"):
        assert all(r[f"interleaved_vs_{base}"] == 1.0 for r in decoded if r["variant"] == base)
    assert "interleaved rounds | vs dense | vs plain |" in proc.stdout
    # --trace-decode: every decode row at the first batch carries its loop's kernel time line, and
    # every generate row its calls' (on a CPU the profile is empty and says why), the other batches none.
    traced = {(r["variant"], r["batch"]) for r in rows if "trace" in r and r["phase"] == "decode"}
    assert traced == {(r["variant"], 1) for r in rows if r["phase"] == "decode"} and len(traced) == 8
    assert all("trace" in r for r in rows if r["phase"].startswith("generate"))
    assert all(r["trace"] and r["trace"][0].startswith("kernel trace") for r in rows if "trace" in r)
    # --sparse-ffn-rows: the sparse variant with each named decode.sparse_ffn but the default
    # ("auto": only "+tiles"), decode and generate only (no prefill row), making the same tokens.
    assert not any(r["variant"].endswith("+auto") for r in rows)
    fused = [r for r in rows if r["variant"].endswith("+tiles")]
    assert {r["variant"] for r in fused} == {"twell-reference+tiles"}
    assert {r["phase"] for r in fused} == {"decode", "generate, chunk 1", "generate, chunk 16"}
    fused_tokens = {tuple(r["tokens"]) for r in fused if "tokens" in r}
    assert {tuple(r["tokens"]) for r in looped if "tokens" in r} == fused_tokens
    rows = [r for r in rows if not r["variant"].endswith(("+stored", "+tiles", "+loop"))]
    generate_rows = [r for r in rows if r["phase"].startswith("generate")]
    rows = [r for r in rows if not r["phase"].startswith("generate")]
    assert {(r["phase"], r["batch"]) for r in rows} == {("prefill", 2), ("decode", 1), ("decode", 2)}
    assert [r["variant"] for r in rows if r["phase"] == "prefill"] == ["plain", "dense", "twell-reference"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speed_vs_plain"] > 0 and r["speed_vs_dense"] > 0
        # plain JAX has no FFN telemetry; the library's rows count per layer.
        assert r["l0_per_layer"] is None if r["variant"] == "plain" else len(r["l0_per_layer"]) == 2
    # Generation end to end (no plain-JAX generator): 1 and 16 steps per device call, the same
    # 8 greedy tokens from the same prompt, and dense and sparse make the same ones (same weights).
    assert {(r["variant"], r["chunk"]) for r in generate_rows} == {
        (v, c) for v in ("dense", "twell-reference") for c in (1, 16)}
    assert len({tuple(r["tokens"]) for r in generate_rows}) == 1
    assert {tuple(r["tokens"]) for r in transposed if "tokens" in r} == {tuple(r["tokens"]) for r in generate_rows}
    assert fused_tokens == {tuple(r["tokens"]) for r in generate_rows}
    for r in generate_rows:
        assert r["decode_steps"] == 7 and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert r["speed_vs_dense"] > 0 and "speed_vs_plain" not in r
    # The same weights: dense and sparse rows see the same activity, and plain's hidden states (f32).
    prefill = {r["variant"]: r for r in rows if r["phase"] == "prefill"}
    np.testing.assert_allclose(prefill["dense"]["l0_per_layer"], prefill["twell-reference"]["l0_per_layer"],
                               rtol=1e-4)
    assert prefill["dense"]["hidden_rel_diff_vs_plain"] < 1e-5
    assert prefill["twell-reference"]["hidden_rel_diff_vs_plain"] < 1e-5
    assert "| prefill | 2 | plain |" in proc.stdout and "| vs plain |" in proc.stdout


def test_bench_inference_refuses_an_unknown_sparse_ffn_row():
    from twell_jax.bench import inference as bench_inference

    with pytest.raises(SystemExit, match="--sparse-ffn-rows 'tiles,bogus'"):
        bench_inference.main(["--dry-run", "--sparse-ffn-rows", "tiles,bogus"])
