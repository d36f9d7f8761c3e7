"""The `twell` CLI end to end on the micro preset: eval, generate, hf, the command line's surface,
errors (`twell train` itself: tests/test_run_trust.py; `twell compare`: tests/test_compare.py)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from twell_jax.cli import main


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_cache_dir):
    """One `twell train` of micro (the sparse `twell` model with micro's L1, backend "auto"), 2 steps,
    for the eval, generate and hf tests."""
    run = tmp_path_factory.mktemp("cli") / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--config", "micro", "--out", str(run),
                     "--set", f"data.cache_dir={data_cache_dir}", "train.steps=2"]) == 0
    return run


def test_eval_reproduces_the_runs_validation(trained_run, cli):
    run = trained_run
    code, out, _ = cli(["eval", "--checkpoint", str(run), "--json"])
    assert code == 0
    result = json.loads(out)  # stdout holds the JSON document and nothing else
    summary = json.loads((run / "summary.json").read_text())
    assert result["step"] == 2
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)  # same params, same val batches
    # eval hands the "auto" backend the hints the checkpoint was trained with (trace-time plan).
    assert result["auto_hints_per_layer"] == summary["auto_hints_per_layer"] is not None


@pytest.mark.parametrize("argv,message", [
    (["train", "--config", "micro", "--set", "model.n_layers=x"], "model.n_layers expects an int"),
    (["train", "--config", "nope"], "unknown config 'nope'"),
    (["train", "--config", "micro", "--resume"], "--resume needs --out"),
])
def test_errors_are_reported_cleanly(argv, message, cli):
    code, _, err = cli(argv)
    assert code == 2 and message in err


def test_eval_of_missing_checkpoint(tmp_path, cli):
    code, _, err = cli(["eval", "--checkpoint", str(tmp_path / "none")])
    assert code == 2 and "no checkpoint" in err


# ----------------------------------------------------------------------------- the command line's surface



def test_version_help_with_examples_and_one_line_per_preset(capsys, cli):
    from twell_jax import __version__
    from twell_jax.cli import _parser
    from twell_jax.configs import list_configs

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"twell {__version__}"
    parser = _parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        text = sub.format_help()
        assert sub.description and "examples:" in text and f"twell {name}" in text.split("examples:")[1], name
    code, out, _ = cli(["configs"])
    lines = out.splitlines()
    assert code == 0 and [line.split()[0] for line in lines] == list_configs()
    assert "2 layers, d_model 32" in lines[0]  # read from the preset itself


def test_print_config_and_a_config_file(tmp_path, cli):
    from twell_jax import config as config_lib
    from twell_jax.configs import get_config

    code, out, _ = cli(["train", "--config", "micro", "--set", "train.steps=7", "--print-config"])
    printed = config_lib.from_dict(json.loads(out))
    assert code == 0 and printed.train.steps == 7 and printed.model == get_config("micro").model
    path = tmp_path / "mine.json"
    path.write_text(out)
    code, out, _ = cli(["train", "--config", str(path), "--set", "model.n_layers=3", "--print-config"])
    assert code == 0 and json.loads(out)["model"]["n_layers"] == 3 and json.loads(out)["train"]["steps"] == 7
    assert not (tmp_path / "runs").exists()
    path.write_text('{"model": ')
    code, out, err = cli(["train", "--config", str(path), "--print-config"])
    assert code == 2 and out == "" and f"--config {path}: not valid JSON" in err and len(err.splitlines()) == 1


def test_dry_run_checks_and_writes_nothing(tmp_path, data_cache_dir, cli):
    out_dir = tmp_path / "dry"
    code, out, _ = cli(["train", "--config", "micro", "--out", str(out_dir), "--dry-run", "--json",
                         "--set", f"data.cache_dir={data_cache_dir}"])
    plan = json.loads(out)
    assert code == 0 and plan["parameters"] > 0 and plan["tokens_per_step"] == 8 * 16 and plan["run_dir_state"] == "new"
    assert not out_dir.exists()
    code, _, err = cli(["train", "--config", "micro", "--dry-run", "--set", "train.global_batch=7"])
    assert code == 2 and "global_batch" in err



def test_dry_run_of_a_resume_reads_the_runs_tokenizer(tmp_path, monkeypatch, cli):
    """As the resumed run will: the run's saved tokenizer.json, not a tokenizer built anew from the config."""
    import twell_jax.training.shared_data
    from twell_jax import config as config_lib
    from twell_jax.configs import get_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(config_lib.to_json(get_config("micro")))
    (run / "tokenizer.json").write_text("{}")
    (run / "checkpoints" / "4").mkdir(parents=True)  # a step to resume from (never read: the data stops it)
    seen = []

    def builder(cfg):
        seen.append(cfg.data.tokenizer)
        raise ValueError("data: stopped here")

    monkeypatch.setattr(twell_jax.training.shared_data, "build_experiment_data", builder)
    code, _, err = cli(["train", "--out", str(run), "--resume", "--dry-run"])
    assert code == 2 and "stopped here" in err
    assert seen == [str((run / "tokenizer.json").absolute())]


@pytest.mark.slow
def test_readme_generate_example_runs(trained_run, cli):
    """The README's `twell generate` command, on a micro run (16-token context) in place of runs/micro."""
    import pathlib
    import re
    import shlex

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    lines = re.findall(r"^twell generate --checkpoint .*$", readme, flags=re.M)  # (--hf: the HF test)
    assert len(lines) >= 2, "README.md shows no twell generate command of a run"
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        argv[argv.index("--checkpoint") + 1] = str(trained_run)
        code, out, err = cli(argv)
        assert code == 0, err
        prompt = argv[argv.index("--prompt") + 1]
        if "--json" in argv:
            assert json.loads(out)["prompts"][0]["prompt"] == prompt
        else:
            assert out.startswith(prompt) and "[twell]" not in out  # the text on stdout, the notes on stderr


def test_generate_checks_everything_before_printing_and_truncates_on_request(trained_run, cli):
    run = str(trained_run)
    long_prompt = "def main(argv):\n    return sorted(set(argv)) + list(range(10))\n" * 3
    code, out, err = cli(["generate", "--checkpoint", run, "--prompt", long_prompt, "--max-new-tokens", "4"])
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "--prompt 0 has" in err and "--truncate-prompt left" in err
    code, out, err = cli(["generate", "--checkpoint", run, "--prompt", long_prompt, "--max-new-tokens", "4",
                           "--truncate-prompt", "left", "--json"])
    report = json.loads(out)
    assert code == 0 and report["prompts"][0]["prompt_tokens"] == 16 - 4 + 1 and "truncated to its last" in err
    for argv, message in ((["--prompt", "x\udcff"], "--prompt 0: not valid UTF-8"),
                          (["--prompt", "x", "--num-samples", "2"], "--num-samples 2 with --temperature 0"),
                          (["--prompt", "x", "--top-p", "0"], "--top-p"),
                          (["--prompt", "x", "--decode-chunk", "0"], "--decode-chunk 0"),
                          (["--prompt", "x", "--max-new-tokens", "40"], "--max-new-tokens 40 does not fit")):
        code, out, err = cli(["generate", "--checkpoint", run, *argv])
        assert code == 2 and out == "" and message in err and len(err.splitlines()) == 1, (argv, err)


@pytest.mark.slow
def test_generate_samples_and_stop_strings_as_json(trained_run, cli):
    run = str(trained_run)
    argv = ["generate", "--checkpoint", run, "--prompt", "def", "--prompt", "import", "--max-new-tokens", "6",
            "--temperature", "1.0", "--num-samples", "3", "--json"]
    code, out, _ = cli(argv)
    report = json.loads(out)
    assert code == 0 and [len(p["samples"]) for p in report["prompts"]] == [3, 3]
    free = report["prompts"][0]["samples"][0]
    assert len({tuple(s["tokens"]) for p in report["prompts"] for s in p["samples"]}) > 1  # samples differ
    assert report["decode_chunk"] == 16 and report["compile_s"] > 0 and report["decode_tokens_per_s"] > 0
    code, out, _ = cli(argv + ["--decode-chunk", "1"])  # a device call per token: the same samples
    assert code == 0 and json.loads(out)["prompts"] == report["prompts"]
    assert report["decode_layout"] == "transposed"  # the default of runs made now
    code, out, _ = cli(argv + ["--decode-layout", "stored"])  # (a CPU: XLA's steps, no copies made)
    stored = json.loads(out)
    assert code == 0 and stored["prompts"] == report["prompts"] and stored["decode_layout"] == "stored"
    stop = free["text"][2:4] if len(free["text"]) >= 4 else free["text"]
    code, out, _ = cli(argv + ["--stop", stop])
    first = json.loads(out)["prompts"][0]["samples"][0]  # same seed and rows: the same sample, cut at the stop
    assert code == 0 and first["finish_reason"] == "stop" and first["text"] == free["text"][:free["text"].find(stop)]


def test_eval_accepts_a_step_directory_and_the_whole_of_another_corpus(trained_run, tmp_path, cli):
    import dataclasses

    from twell_jax.data import build_data
    from twell_jax.training import checkpoint as ckpt_lib

    run = trained_run
    code, out, _ = cli(["eval", "--checkpoint", str(run / "checkpoints" / "2"), "--json"])
    assert code == 0 and json.loads(out)["step"] == 2
    code, _, err = cli(["eval", "--checkpoint", str(run / "checkpoints" / "2"), "--step", "1"])
    assert code == 2 and "pick one" in err
    corpus = tmp_path / "other.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n"}) + "\n"
                              for i in range(60)))
    overrides = [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"]
    code, _, err = cli(["eval", "--checkpoint", str(run), "--set", *overrides])
    assert code == 2 and "--split all" in err and "raise data.val_fraction" not in err  # 5% of 60 documents
    code, _, err = cli(["eval", "--checkpoint", str(run), "--set", "data.val_fraction=0.5"])
    assert code == 2 and "--split all" in err
    code, out, _ = cli(["eval", "--checkpoint", str(run), "--split", "all", "--json", "--set", *overrides])
    result = json.loads(out)
    cfg = ckpt_lib.load_run_config(run)
    whole = build_data(dataclasses.replace(cfg.data, source=str(corpus), cache_dir=str(tmp_path / "cache"),
                                           tokenizer=str(run / "tokenizer.json"), val_fraction=0.0), global_batch=1)
    batch = cfg.train.eval_batch_size
    assert code == 0 and result["split"] == "all"
    assert result["tokens"] == (whole.num_train_sequences // batch) * batch * cfg.data.seq_len  # every full batch


@pytest.mark.slow
def test_hf_export_import_eval_and_fine_tuning_from_the_command_line(trained_run, tmp_path, data_cache_dir, cli):
    import numpy as np

    from twell_jax.inference.hf import import_hf
    from twell_jax.training.checkpoint import restore_params

    run = trained_run
    exported = tmp_path / "hf"
    code, out, _ = cli(["hf", "export", "--checkpoint", str(run), "--out", str(exported), "--json"])
    assert code == 0 and json.loads(out)["files"] == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    code, out, _ = cli(["hf", "import", str(exported), "--json"])
    assert code == 0 and json.loads(out)["model"]["n_layers"] == 2
    # An export into a non-empty directory is refused before the checkpoint is loaded.
    from twell_jax.inference import load as load_lib

    def no_load(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before --out was checked")

    original, load_lib.load_run = load_lib.load_run, no_load
    try:
        code, _, err = cli(["hf", "export", "--checkpoint", str(run), "--out", str(exported)])
    finally:
        load_lib.load_run = original
    assert code == 2 and "is not an empty directory" in err, err
    code, out, _ = cli(["eval", "--hf", str(exported), "--json", "--set", f"data.cache_dir={data_cache_dir}",
                         "train.eval_batches=1"])
    assert code == 0 and json.loads(out)["loss"] > 0
    # Fine-tuning starts from the imported weights: one step at a negligible learning rate keeps them.
    tuned = tmp_path / "tuned"
    code, _, err = cli(["train", "--config", "micro", "--init-from", str(exported), "--out", str(tuned), "--set",
                         "train.steps=1", "optim.lr=1e-12", "optim.weight_decay=0", f"data.cache_dir={data_cache_dir}"])
    assert code == 0, err
    params = restore_params(tuned)[0]
    original = import_hf(exported)
    from twell_jax.model import split_model

    expected = split_model(original.model)[1]
    np.testing.assert_allclose(np.asarray(params["embed"]), np.asarray(expected["embed"]), atol=1e-6)
    code, _, err = cli(["train", "--config", "micro", "--init-from", str(exported), "--set", "model.d_model=64",
                         "--print-config"])
    assert code == 2 and "model.d_model" in err


def test_every_error_is_one_line_and_exit_2_with_a_traceback_only_on_debug(trained_run, tmp_path, monkeypatch, cli):
    import errno

    from twell_jax.training import evaluate

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, out, err = cli(["train", "--config", "micro", "--out", str(a_file / "run")])
    errors = [line for line in err.splitlines() if line.startswith("twell train: error: ")]
    assert code == 2 and out == "" and "Traceback" not in err  # a real OSError, named by its file
    assert len(errors) == 1 and f"{a_file / 'run'}: Not a directory" in errors[0]

    def full_disk(*args, **kwargs):  # what Orbax / TensorStore raise: a long message around the OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/4/params")
        except OSError as inner:
            raise RuntimeError("TensorStore write failed:\n" + "    at frame\n" * 500) from inner

    run = str(trained_run)
    def tensorstore_says(*args, **kwargs):  # a library's ValueError whose errno text sits deep in its message
        raise ValueError("Error writing local file \"/runs/x/d/1\":\n" + "  context\n" * 50
                         + "[RESOURCE_EXHAUSTED] No space left on device")

    for error, expected in ((full_disk, "/runs/x/checkpoints/4/params: No space left on device"),
                            (TypeError("expected str, got int"), "TypeError: expected str, got int"),
                            (tensorstore_says, 'ValueError: Error writing local file "/runs/x/d/1": '
                                               '[No space left on device]')):
        def raise_(*args, _error=error, **kwargs):
            if callable(_error):
                _error()
            raise _error

        monkeypatch.setattr(evaluate, "evaluate_checkpoint", raise_)
        code, out, err = cli(["eval", "--checkpoint", run])
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and expected in err, err
        code, _, err = cli(["eval", "--checkpoint", run, "--debug"])
        assert code == 2 and "Traceback" in err and expected in err.splitlines()[-1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def import_interrupted(*args, **kwargs):  # numpy turns a Ctrl-C during its import into an ImportError
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("Encountered an error while initializing the extension.")

    for raiser in (interrupted, import_interrupted):
        monkeypatch.setattr(evaluate, "evaluate_checkpoint", raiser)
        code, out, err = cli(["eval", "--checkpoint", run])
        assert code == 130 and out == "" and len(err.splitlines()) == 1 and "interrupted" in err


def test_without_a_terminal_progress_is_plain_lines_on_each_logged_step(tmp_path):
    from twell_jax.training.metrics import MetricsSink

    lines = []
    sink = MetricsSink(tmp_path, tensorboard=False, total_steps=4, start_step=0, progress_bar=True,
                       echo=lines.append)
    assert sink._bar is None  # pytest's stderr is not a terminal: no bar, no carriage returns
    sink.progress(1, {"loss": 1.0})
    sink.write({"step": 2, "loss": 5.5, "ce": 5.4, "lr": 1e-3, "l0_per_layer": [3.0, 5.0], "tokens_per_s": 100.0})
    sink.write({"step": 2, "val_loss": 5.0})
    sink.write({"step": 4, "loss": 5.0, "l0_per_layer": [3.0], "l1_coef_per_layer": [2e-4, 1.5e-3]})
    sink.close()
    assert lines == ["[twell] step 2/4 loss 5.5 ce 5.4 lr 0.001 l0 4.0 100 tok/s",
                     "[twell] step 4/4 loss 5 l0 3.0 L1/layer 0.0002-0.0015"]


@pytest.mark.slow
def test_the_console_script_exits_130_on_ctrl_c_and_2_on_an_error(tmp_path):
    import subprocess
    import sys

    script = ("import sys\n"
              "from twell_jax.training import evaluate\n"
              "def stop(*a, **k):\n"
              "    raise KeyboardInterrupt\n"
              "if sys.argv[1] == 'ctrl-c':\n"
              "    evaluate.evaluate_checkpoint = stop\n"
              "sys.argv = ['twell', 'eval', '--checkpoint', sys.argv[2]]\n"
              "from twell_jax.cli import run\n"
              "run()\n")
    for case, code, message in (("ctrl-c", 130, "interrupted (Ctrl-C)"), ("error", 2, "no checkpoint")):
        done = subprocess.run([sys.executable, "-c", script, case, str(tmp_path / "none")], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == code and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and message in done.stderr


def test_a_damaged_run_config_or_tokenizer_is_named(trained_run, tmp_path, cli):
    import shutil

    run = shutil.copytree(trained_run, tmp_path / "run")
    (run / "config.json").write_bytes(b"\xff\xfe{")
    code, _, err = cli(["eval", "--checkpoint", str(run)])
    assert code == 2 and f"{run / 'config.json'} is not valid JSON" in err
    shutil.copy(trained_run / "config.json", run / "config.json")
    (run / "tokenizer.json").write_text("{bad")
    code, _, err = cli(["generate", "--checkpoint", str(run), "--prompt", "x"])
    assert code == 2 and f"{run / 'tokenizer.json'}: not a valid tokenizer.json" in err


def test_an_imported_model_keeps_a_set_ffn_kind_of_its_activation():
    """`eval --hf ... --set model.ffn_kind=relu_gated` evaluates the dense kind (it was silently reset
    to the import's default, twell); a kind of another activation is refused naming the field."""
    import types

    from twell_jax import config as config_lib
    from twell_jax.cli import _with_imported_model
    from twell_jax.configs import get_config

    base = config_lib.apply_overrides(get_config("micro"), ["data.source=synthetic"])
    imported = types.SimpleNamespace(config=base, tokenizer=None)  # a relu checkpoint: twell by default
    dense = ["model.ffn_kind=relu_gated", "sparsity.l1_coef=0"]
    cfg = _with_imported_model(config_lib.apply_overrides(base, dense), imported, dense, "--hf")
    assert cfg.model.ffn_kind == "relu_gated"
    assert _with_imported_model(base, imported, [], "--hf").model.ffn_kind == "twell"
    silu = ["model.ffn_kind=swiglu", "sparsity.l1_coef=0"]
    with pytest.raises(ValueError, match="model.ffn_kind=swiglu"):
        _with_imported_model(config_lib.apply_overrides(base, silu), imported, silu, "--hf")
