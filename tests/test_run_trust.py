"""Issue 11: a run directory is one run, nothing is lost or mixed up silently, every fault is a clear
message. Each test reproduces one reported fault through the `twell` CLI (micro preset, a small
.txt corpus written into the test's directory) and checks the fixed behaviour."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from twell_jax.configs import get_config, list_configs
from twell_jax import run_dir as run_dir_lib
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax import config as config_lib
from twell_jax.cli import _parser, main
from twell_jax.training.evaluate import evaluate_checkpoint
from twell_jax.training.optimizer import learning_rate_schedule
from twell_jax.data import build_experiment_data
from twell_jax.training.preflight import check_op_config

REPO = Path(__file__).resolve().parents[1]


def _write_corpus(directory: Path, documents: int = 30) -> Path:
    """`documents` .txt files (standard-library sources, one document each)."""
    directory.mkdir(parents=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for index, source in enumerate(sources[:documents]):
        (directory / f"doc{index:03d}.txt").write_text(source.read_text(errors="replace")[:4000])
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One trained micro run (checkpoints at steps 1 and 2) that tests copy before changing."""
    root = tmp_path_factory.mktemp("trust")
    corpus = _write_corpus(root / "corpus")
    sets = [f"data.cache_dir={root / 'cache'}", f"data.source={corpus}", "data.max_documents=null"]
    run = root / "run"
    assert main(["train", "--config", "micro", "--out", str(run), "--set", *sets,
                 "--set", "train.steps=2", "train.checkpoint_every=1", "train.tensorboard=true", "optim.warmup_steps=1"]) == 0
    return {"root": root, "run": run, "sets": sets, "corpus": corpus}


@pytest.fixture()
def run(base, tmp_path):
    """A private copy of the base run."""
    target = tmp_path / "run"
    shutil.copytree(base["run"], target)
    return target


def _steps(run_dir: Path, key: str = "loss") -> list[int]:
    return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


def _corrupt_params(step_dir: Path) -> None:
    """Random bytes over every data file of the checkpoint's parameter item."""
    rng = np.random.default_rng(0)
    files = [p for p in (step_dir / ckpt_lib.PARAMS_ITEM).rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for path in files:
        path.write_bytes(rng.integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


# ----------------------------------------------------------------------------- 1. repeated --set


def test_repeated_set_keeps_every_override():
    args = _parser().parse_args(["train", "--set", "train.steps=60", "--set", "train.progress_bar=false", "a.b=1"])
    assert args.set == ["train.steps=60", "train.progress_bar=false", "a.b=1"]


# ----------------------------------------------------------------------------- 2./3. one run per directory


def test_resume_uses_the_saved_config_and_never_trains_at_lr_0(base, run, capsys):
    saved = json.loads((run / "config.json").read_text())
    assert saved["optim"]["schedule_steps"] == 2  # resolved at the start of the run
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    # Step 3 is past the end of the 2-step cosine to 0: it would train at lr 0. Refused, naming the fix.
    assert main(["train", "--out", str(run), "--resume", "--set", "train.steps=3"]) == 2
    assert "--set optim.schedule_steps=3" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    # No --config, no --set of the model: the saved config is the reference.
    assert main(["train", "--out", str(run), "--resume", "--set", "train.steps=3", "optim.schedule_steps=3"]) == 0
    assert _steps(run) == [1, 2, 3]
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["steps"] == 3 and config["optim"]["schedule_steps"] == 3
    lr = [r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    optim = config_lib.from_dict(config).optim
    # Step 3 (lr of state step 2) is on the stretched 3-step schedule.
    assert lr[-1] == pytest.approx(float(learning_rate_schedule(optim, 3)(2)), abs=1e-9) and lr[-1] > 0


def test_resume_refuses_changes_to_fixed_fields_and_leaves_the_run_alone(run, capsys):
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["train", "--out", str(run), "--resume", "--set", "model.n_layers=3"]) == 2
    assert "model.n_layers" in capsys.readouterr().err
    assert main(["train", "--config", "tiny", "--out", str(run), "--resume"]) == 2
    assert "leave out --config" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_new_run_refuses_a_non_empty_directory_unless_overwrite(base, run, capsys):
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    argv = ["train", "--config", "micro", "--out", str(run), "--set", *base["sets"], "train.steps=1"]
    assert main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    # A failing --overwrite (bad value found at validation) changes nothing either.
    assert main([*argv, "--overwrite", "--set", "train.eval_batch_size=3", "train.num_devices=2"]) == 2
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert main([*argv, "--overwrite"]) == 0
    assert _steps(run) == [1]
    assert ckpt_lib.CheckpointStore(run / "checkpoints", create=False).all_steps() == [1]


# ----------------------------------------------------------------------------- 4. verified checkpoints


def test_corrupt_checkpoint_is_named_and_the_older_one_is_used(run, capsys):
    _corrupt_params(run / "checkpoints" / "2")
    assert main(["eval", "--checkpoint", str(run), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert str(run / "checkpoints" / "2") in err
    assert main(["eval", "--checkpoint", str(run), "--json"]) == 0  # falls back to step 1, with a warning
    captured = capsys.readouterr()
    assert str(run / "checkpoints" / "2") in captured.err and json.loads(captured.out)["step"] == 1
    # --resume falls back too, moves the corrupt one aside and trains step 2 again.
    assert main(["train", "--out", str(run), "--resume"]) == 0
    assert _steps(run) == [1, 2]
    assert list((run / run_dir_lib.QUARANTINE_SUBDIR).iterdir())
    assert main(["eval", "--checkpoint", str(run), "--step", "2"]) == 0


def test_checksum_mismatch_and_broken_metadata_are_named(run, capsys):
    meta_file = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    key = next(iter(meta["checksums"]["params"]))
    meta["checksums"]["params"][key] ^= 1  # what a flipped bit in the arrays would look like
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ckpt_lib.CorruptCheckpointError, match=r"checkpoints/2 is corrupt.*checksum"):
        ckpt_lib.restore_params(run, step=2)
    (run / "checkpoints" / "1" / "meta" / "metadata").write_text("")
    assert main(["eval", "--checkpoint", str(run), "--step", "1"]) == 2
    assert str(run / "checkpoints" / "1" / "meta") in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run)]) == 2  # no intact checkpoint left
    assert "no intact checkpoint" in capsys.readouterr().err
    (run / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        ckpt_lib.load_run_config(run)


def test_restore_params_needs_no_optimizer(run):
    import jax
    from flax import nnx

    from twell_jax.model import init_model

    params, cfg, step = ckpt_lib.restore_params(run)
    assert step == 2 and cfg.name == "micro"
    fresh = nnx.to_pure_dict(nnx.split(init_model(cfg.model, cfg.train.seed))[1])
    assert jax.tree.structure(params) == jax.tree.structure(fresh)  # the parameters and nothing else
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fresh)))


def test_evaluation_that_yields_nan_fails(run, capsys):
    def nan_data(cfg):
        data = build_experiment_data(cfg)
        data.val_sequences = np.full_like(np.asarray(data.val_sequences), 10_000)  # out of vocab: NaN logits
        return data

    with pytest.raises(FloatingPointError, match="non-finite val_loss"):
        evaluate_checkpoint(run, data_builder=nan_data, echo=lambda _: None)


# ----------------------------------------------------------------------------- 5. tokenizer in the run


def test_tokenizer_saved_and_a_changed_corpus_is_reported(base, run, capsys):
    assert (run / run_dir_lib.TOKENIZER_FILE).is_file() and (run / run_dir_lib.FINGERPRINT_FILE).is_file()
    edited = base["root"] / f"edited-{os.getpid()}-{time.time_ns()}"
    shutil.copytree(base["corpus"], edited)
    first = sorted(edited.iterdir())[0]
    first.write_text(first.read_text() + "\nan edit of the corpus after training\n" * 50)
    seen = []

    def builder(cfg):
        seen.append(cfg.data.tokenizer)
        return build_experiment_data(cfg)

    messages: list[str] = []
    evaluate_checkpoint(run, overrides=[f"data.source={edited}"], data_builder=builder, echo=messages.append)
    assert seen == [str((run / run_dir_lib.TOKENIZER_FILE).absolute())]  # never re-trained on the new corpus
    old = json.loads((run / run_dir_lib.FINGERPRINT_FILE).read_text())["corpus"]
    assert any(old in m for m in messages)  # the change is reported, naming the fingerprint trained on


# ----------------------------------------------------------------------------- 7. signals, defaults, --resume


def test_sigterm_checkpoints_and_exits_with_a_resume_hint(base, tmp_path):
    out = tmp_path / "sig"
    command = [sys.executable, "-m", "twell_jax.cli", "train", "--config", "micro", "--out", str(out), "--set",
               *base["sets"], "train.steps=100000", "train.eval_every=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not _logged(out):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no training step logged in time"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "--resume" in err and str(out.absolute()) in err
    steps = ckpt_lib.CheckpointStore(out / "checkpoints", create=False).all_steps()
    assert steps and steps[-1] == _steps(out)[-1]  # the last finished step is checkpointed
    assert not (out / run_dir_lib.LOCK_FILE).exists()  # the run's lock is released on SIGTERM too


def _logged(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() and bool(_steps(run_dir))


def test_every_training_preset_checkpoints_regularly():
    for name in list_configs():
        train = get_config(name).train
        if name == "micro":  # test preset: seconds long
            continue
        assert 0 < train.checkpoint_every <= train.steps // 4, name


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "typo"), "--resume"]) == 2
    assert "no run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(config_lib.to_json(get_config("micro")))
    assert main(["train", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 8. logs across resumes


def test_metrics_hold_each_step_once_after_a_resume(run, capsys):
    # What a kill after step 2 was logged but before its checkpoint leaves: records past the checkpoint.
    shutil.rmtree(run / "checkpoints" / "2")
    assert main(["train", "--out", str(run), "--resume", "--set", "train.steps=3", "optim.schedule_steps=3"]) == 0
    assert _steps(run) == [1, 2, 3]
    assert _steps(run, "val_loss") == [3]  # the earlier run's final validation was at step 2, now dropped
    newest = max((run / "tensorboard").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    events = _events(newest)
    # TensorBoard drops the older files' events from the purge step on (SessionLog START at step 2).
    assert any(e.session_log.status == e.session_log.START and e.step == 2 for e in events)
    assert sorted({e.step for e in events if e.summary.value}) == [2, 3]


def _events(path: Path) -> list:
    """The Event protos of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    data, events, offset = path.read_bytes(), [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[offset + 12:offset + 12 + length])
        events.append(event)
        offset += 12 + length + 4
    return events


def test_final_validation_reaches_tensorboard(run):
    tags = {v.tag for p in (run / "tensorboard").iterdir() for e in _events(p) for v in e.summary.value}
    assert "val/val_loss" in tags and "train/loss" in tags


# ----------------------------------------------------------------------------- 9. validation


@pytest.mark.parametrize("override,field", [
    ("sparsity.l1_coef=nan", "sparsity.l1_coef"), ("optim.lr=inf", "optim.lr"),
    ("train.time_limit_s=nan", "train.time_limit_s"), ("optim.schedule_steps=-1", "optim.schedule_steps"),
])  # (a non-finite model.rope_theta: test_config.py, test_invariants_raise_clear_errors)
def test_non_finite_and_bad_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        config_lib.apply_overrides(get_config("micro"), [override])


def test_unknown_op_config_key_names_the_field(capsys):
    cfg = config_lib.apply_overrides(get_config("micro"), ['model.ffn_op_config={"slotz": 8}'])
    with pytest.raises(ValueError, match=r"model\.ffn_op_config.*slotz.*known keys"):
        check_op_config(cfg)
    assert main(["train", "--config", "micro", "--set", 'model.ffn_op_config={"tile": 0}']) == 2
    assert "model.ffn_op_config" in capsys.readouterr().err
