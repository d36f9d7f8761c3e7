"""Issue 44, the first hour of a new user: a wrong type in a config names its field; a model that
cannot fit the device is refused before anything is written (the dry run says how much memory a run
needs); the dry run checks the tokenizer against the model as the run does, and says when a small
corpus leaves the embedding rows no token uses; Ctrl-C is acknowledged at once, even in a compile,
and a second one aborts; `eval` names its corpus; a warm-up longer than the run is named. Each test
calls the functions, or the CLI with the corpus faked: none trains."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import types

import pytest

from twell_jax import config as config_lib
from twell_jax.configs import get_config
from twell_jax.training import preflight
from twell_jax.training import train as train_lib



@pytest.fixture
def fake_corpus(monkeypatch):
    """The CLI's data builder replaced by a corpus whose tokenizer has `vocab[0]` tokens (no corpus read)."""
    import twell_jax.training.shared_data

    vocab = [300]
    monkeypatch.setattr(twell_jax.training.shared_data, "build_experiment_data", lambda cfg: types.SimpleNamespace(
        vocab_size=vocab[0], num_train_sequences=100, num_val_sequences=10))
    return vocab


# ----------------------------------------------------------------------------- types in a config


@pytest.mark.parametrize("section,name,value,message", [
    ("train", "steps", "10", "train.steps: expected int, got str '10'"),
    ("model", "n_layers", 2.5, "model.n_layers: expected int, got float 2.5"),
    ("train", "steps", True, "train.steps: expected int, got bool True"),  # a bool is no int
    ("train", "fsdp", 1, "train.fsdp: expected bool, got int 1"),
    ("train", "num_devices", "all", "train.num_devices: expected int or None, got str 'all'"),
    ("name", None, 3, "name: expected str, got int 3"),
    ("model", None, [], "model: expected a section"),
    ("model", "ffn_expected_active", [1.0, "a"], "model.ffn_expected_active[1]: expected float, got str 'a'"),
    ("model", "ffn_op_config", [1], "model.ffn_op_config: expected JSON object, got list [1]"),
])
def test_a_wrong_type_in_a_config_file_names_the_field(section, name, value, message):
    values = config_lib.to_dict(get_config("micro"))
    if name is None:
        values[section] = value
    else:
        values[section][name] = value
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_lib.from_dict(values)


def test_numbers_that_mean_the_same_pass():
    """An int where a float belongs, and a whole float where an int belongs (JSON writers spell 100 as 100.0)."""
    values = config_lib.to_dict(get_config("micro"))
    values["optim"]["lr"] = 1
    values["train"]["steps"] = 6.0
    cfg = config_lib.from_dict(values)
    assert cfg.optim.lr == 1 and cfg.train.steps == 6 and isinstance(cfg.train.steps, int)
    assert config_lib.apply_overrides(get_config("micro"), ["optim.lr=2"]).optim.lr == 2.0
    with pytest.raises(ValueError, match=r"model.ffn_expected_active\[1\]: expected float, got str 'x'"):
        config_lib.apply_overrides(get_config("micro"), ['model.ffn_expected_active=[1, "x"]'])


def test_the_cli_names_the_field_of_a_config_file_and_exits_2(tmp_path, cli):
    values = config_lib.to_dict(get_config("micro"))
    values["train"]["steps"] = "10"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(values))
    code, out, err = cli(["train", "--config", str(path), "--print-config"])
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert f"--config {path}: train.steps: expected int, got str '10'" in err


# ----------------------------------------------------------------------------- memory


def test_the_estimate_counts_parameters_optimizer_gradients_and_activations():
    cfg = get_config("micro")
    estimate = preflight.memory_estimate(cfg, 1)
    params = cfg.model.num_params()
    assert (estimate["parameters"], estimate["optimizer_state"], estimate["gradients"]) == (4 * params, 8 * params,
                                                                                         4 * params)
    assert estimate["activations_per_micro_batch"] > 0 and estimate["total"] == sum(
        v for k, v in estimate.items() if k != "total")
    fsdp = config_lib.apply_overrides(cfg, ["train.fsdp=true"])
    assert preflight.memory_estimate(fsdp, 4)["parameters"] == params  # a quarter of the f32 copy on each of 4
    text = preflight.describe_memory(estimate)
    assert "parameters" in text and "AdamW" in text and "activations" in text


def test_a_model_is_refused_only_when_its_parameters_and_optimizer_state_exceed_the_memory(monkeypatch):
    cfg = get_config("micro")
    state = 12 * cfg.model.num_params()
    monkeypatch.setattr(preflight, "device_memory_limit_bytes", lambda: state)  # a GPU's bytes_limit
    estimate, available, source = preflight.check_fits_memory(cfg, 1)  # gradients and activations do not count
    assert available == state and estimate["total"] > state and "device memory" in source
    monkeypatch.setattr(preflight, "device_memory_limit_bytes", lambda: state - 1)
    with pytest.raises(ValueError, match=r"cannot fit: .* but a device has"):
        preflight.check_fits_memory(cfg, 1)


def test_a_model_too_large_for_the_device_is_refused_before_any_directory(tmp_path, monkeypatch, fake_corpus, cli):
    def built(*args, **kwargs):  # (XLA would abort the test process allocating it)
        raise AssertionError("the run got past the memory check")

    monkeypatch.setattr(train_lib.Trainer, "_build", built)
    huge = ["--set", "model.d_model=1000000000"]
    out_dir = tmp_path / "run"
    code, out, err = cli(["train", "--config", "micro", "--out", str(out_dir), *huge])
    assert code == 2 and out == "" and not out_dir.exists()
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "cannot fit" in errors[0] and "8e+18 parameters" in errors[0]
    assert "host memory available" in errors[0]  # the device's memory and where it comes from (a CPU here)
    monkeypatch.chdir(tmp_path)  # without --out: no runs/<name>-<time> is left either
    code, _, err = cli(["train", "--config", "micro", *huge])
    assert code == 2 and not any((tmp_path / "runs").glob("*"))
    code, _, err = cli(["train", "--config", "micro", "--dry-run", *huge])  # the dry run refuses too
    assert code == 2 and "cannot fit" in err
    code, out, err = cli(["train", "--config", "micro", "--dry-run", "--json"])
    plan = json.loads(out)
    assert code == 0 and plan["memory_estimate_bytes"]["total"] > 0 and plan["device_memory_bytes"] > 0
    code, out, _ = cli(["train", "--config", "micro", "--dry-run"])
    assert code == 0 and "memory estimate: ~" in out and "per micro-batch" in out


# ----------------------------------------------------------------------------- the tokenizer's vocabulary


def test_the_dry_run_checks_the_tokenizer_against_the_model(fake_corpus, cli):
    fake_corpus[0] = 548
    code, out, err = cli(["train", "--config", "micro", "--dry-run"])
    assert code == 2 and out == ""
    assert "the tokenizer has 548 tokens but model.vocab_size=300" in err


def test_a_bpe_smaller_than_asked_is_named(fake_corpus, cli):
    """tiny asks for 2048 tokens; a small corpus gives fewer: the embedding keeps 2048 rows (so that a
    config means one model), and the run says so."""
    fake_corpus[0] = 548
    one = ["--set", "train.num_devices=1"]  # (the tests' 8 CPU devices do not divide tiny's batch)
    code, _, err = cli(["train", "--config", "tiny", "--dry-run", *one])
    warning = [line for line in err.splitlines() if "warning" in line]
    assert code == 0 and len(warning) == 1
    assert "learned 548 tokens of the data.vocab_size=2048" in warning[0] and "1500 of which" in warning[0]
    fake_corpus[0] = 2048
    code, _, err = cli(["train", "--config", "tiny", "--dry-run", *one])
    assert code == 0 and "warning" not in err


# ----------------------------------------------------------------------------- Ctrl-C

_CHILD = """
import os, sys
from twell_jax.run_dir import RunLock
from twell_jax.training.signals import StopSignals

lock = RunLock(sys.argv[1])
read_fd, _ = os.pipe()
with StopSignals(on_abort=lock.release):
    print("ready", flush=True)
    os.read(read_fd, 1)  # a native call that does not return, as XLA compiling the step
"""


def test_ctrl_c_in_a_native_call_is_acknowledged_at_once_and_a_second_one_aborts(tmp_path):
    from twell_jax.run_dir import LOCK_FILE

    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert (tmp_path / LOCK_FILE).exists()
        child.send_signal(signal.SIGINT)
        # The main thread is still in its native call: only the watcher can have written this line.
        line = child.stderr.readline()
        assert "SIGINT received: stopping after this step / compile" in line and "Ctrl-C again to abort" in line
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) == 130
    finally:
        child.kill()
        child.wait()
    assert "aborting now" in child.stderr.read()
    assert not (tmp_path / LOCK_FILE).exists()  # no stale lock left for the next run


# ----------------------------------------------------------------------------- eval's corpus


def test_eval_names_its_corpus_and_the_weights_of_an_import(tmp_path, monkeypatch, cli):
    from twell_jax import cli as cli_lib
    from twell_jax.model import init_model
    from twell_jax.training import evaluate

    cfg = get_config("micro")
    imported = types.SimpleNamespace(config=cfg, model=init_model(cfg.model, 0), tokenizer=object())
    monkeypatch.setattr(cli_lib, "_imported", lambda *args, **kwargs: imported)
    seen = []

    def evaluated(cfg, *args, step=None, **kwargs):
        seen.append(cfg)
        return {"loss": 1.0, "perplexity": 2.7, "tokens": 10.0, "l0_mean": 3.0, "sparsity": 0.5, "step": step,
                "split": "val"}

    monkeypatch.setattr(evaluate, "evaluate_model", evaluated)
    code, out, err = cli(["eval", "--hf", "hf_dir"])
    assert code == 0 and "step None" not in out and "imported weights" in out and "corpus stdlib" in out
    assert "no --set data.source given: evaluating on the default corpus 'stdlib'" in err
    code, out, err = cli(["eval", "--hf", "hf_dir", "--json", "--set", "data.source=synthetic"])
    assert code == 0 and json.loads(out)["corpus"] == "synthetic" and "default corpus" not in err
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(config_lib.to_json(cfg))
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda run_dir, step=None, **kwargs: evaluated(cfg, step=4))
    code, out, _ = cli(["eval", "--checkpoint", str(run), "--set", "data.source=other.jsonl"])
    assert code == 0 and "step 4" in out and "corpus other.jsonl" in out


# ----------------------------------------------------------------------------- warm-ups


def test_a_warm_up_longer_than_the_run_is_named(fake_corpus, cli):
    cfg = config_lib.apply_overrides(get_config("micro"), ["train.steps=4", "optim.warmup_steps=10",
                                                           "sparsity.l1_warmup_end=8"])
    lines = preflight.schedule_warnings(cfg)
    assert len(lines) == 2 and "optim.warmup_steps=10 exceeds train.steps=4" in lines[0]
    assert "sparsity.l1_warmup_start=0, l1_warmup_end=8" in lines[1]
    assert preflight.schedule_warnings(get_config("micro")) == []  # micro: 2 warm-up steps of 4
    code, _, err = cli(["train", "--config", "micro", "--dry-run", "--set", "optim.warmup_steps=10"])
    assert code == 0 and sum("optim.warmup_steps=10 exceeds" in line for line in err.splitlines()) == 1
