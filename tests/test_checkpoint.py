"""Checkpoints: resume reproduces an uninterrupted run bit for bit (CPU), interrupted saves leave the
previous checkpoint usable, restoring into a different model config fails clearly."""
from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from twell_jax.configs import get_config
from twell_jax import config as config_lib
from twell_jax.training.checkpoint import CheckpointStore
from twell_jax.training.train import Trainer


def cfg_with(data_cache_dir, *overrides):
    return config_lib.apply_overrides(get_config("micro"), [f"data.cache_dir={data_cache_dir}", *overrides])


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, data_cache_dir):
    """A 4-step run "killed" after its step-2 checkpoint (shared: tests copy it before changing it)."""
    path = tmp_path_factory.mktemp("killed") / "run"
    Trainer(cfg_with(data_cache_dir, "train.steps=4", "train.checkpoint_every=2"), path).run(stop_after_step=2)
    return path


def test_resume_equals_uninterrupted_bitwise(tmp_path, data_cache_dir, killed_run):
    """Real data pipeline (Grain iterator state in the checkpoint), 4 steps vs 2 + resume + 2."""
    cfg = cfg_with(data_cache_dir, "train.steps=4", "train.checkpoint_every=2")
    full = Trainer(cfg, tmp_path / "full").run()
    shutil.copytree(killed_run, tmp_path / "split")
    store = CheckpointStore(tmp_path / "split" / "checkpoints")
    meta = store.restore_meta(2)
    store.close()
    assert meta["step"] == 2 and meta["data_iter"]  # the Grain iterator position is saved with the model
    resumed = Trainer(cfg, tmp_path / "split", resume=True).run()
    losses_full = [r["loss"] for r in full.history]
    losses_resumed = [r["loss"] for r in resumed.history]
    assert len(losses_full) == len(losses_resumed) == 4
    assert losses_full == losses_resumed  # exact float equality, not a tolerance
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 full.state, resumed.state)
    assert full.summary["val_loss"] == resumed.summary["val_loss"]


def test_interrupted_save_leaves_previous_checkpoint_usable(tmp_path, data_cache_dir, killed_run):
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    ckpt = tmp_path / "checkpoints"
    # What a save killed midway leaves behind: Orbax's temporary directory, never renamed.
    leftover = ckpt / "3.orbax-checkpoint-tmp-1234567"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "garbage").write_bytes(b"\x00" * 10)
    store = CheckpointStore(ckpt)
    assert store.latest_step() == 2
    store.close()
    cfg_more = cfg_with(data_cache_dir, "train.steps=3")
    result = Trainer(cfg_more, tmp_path, resume=True).run()
    assert [r["step"] for r in result.history] == [1, 2, 3]


def test_restore_into_different_model_names_the_fields(data_cache_dir, killed_run):
    other = cfg_with(data_cache_dir, "train.steps=2", "model.d_ff=96", "model.n_layers=3")
    before = sorted(p.relative_to(killed_run) for p in killed_run.rglob("*"))
    with pytest.raises(ValueError, match=r"model\.d_ff: checkpoint has 64, config has 96.*model\.n_layers"):
        Trainer(other, killed_run, resume=True).run()
    assert sorted(p.relative_to(killed_run) for p in killed_run.rglob("*")) == before  # a failed command changes nothing


def test_a_run_saved_before_grouped_heads_untied_heads_and_rope_scaling_loads_unchanged(tmp_path, killed_run):
    """model.n_kv_heads, tie_embeddings and rope_scaling default to the model such runs trained
    (multi-head, tied, plain RoPE): a config.json without them loads the same parameters, with no
    `lm_head` among them, and the same logits."""
    import json

    import jax.numpy as jnp

    from twell_jax.inference.load import load_run
    from twell_jax.model import split_model

    old = shutil.copytree(killed_run, tmp_path / "old")
    values = json.loads((old / "config.json").read_text())
    for name in ("n_kv_heads", "tie_embeddings", "rope_scaling"):
        values["model"].pop(name)
    (old / "config.json").write_text(json.dumps(values))
    a, b = load_run(killed_run, dtype="float32"), load_run(old, dtype="float32")
    assert b.config == a.config and "lm_head" not in split_model(b.model)[1]
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    np.testing.assert_array_equal(a.model(tokens)[0], b.model(tokens)[0])


def test_a_run_saved_with_the_decode_fields_under_model_loads_and_resumes(tmp_path, data_cache_dir, killed_run):
    """A config.json from before the decode section (model.decode_kernels, decode_transposed,
    decode_sparse_ffn, decode_layer_unroll) loads them into config.decode, and the run resumes."""
    import json

    from twell_jax.inference.load import load_run

    old = shutil.copytree(killed_run, tmp_path / "old")
    values = json.loads((old / "config.json").read_text())
    values["model"].update({f"decode_{name}": value for name, value in values.pop("decode").items()})
    values["model"]["decode_transposed"] = False  # a run saved before the transposed copies
    (old / "config.json").write_text(json.dumps(values))
    from twell_jax.training.checkpoint import load_run_config

    assert load_run_config(old).decode == config_lib.DecodeConfig(transposed=False)
    assert load_run(old, dtype="float32").step == 2  # (its parameters come with the checkpoint's own config)
    # Resuming it: the old override name sets the same field (decode.* may change on resume).
    trainer = Trainer(cfg_with(data_cache_dir, "train.steps=4", "train.checkpoint_every=2", "model.decode_transposed=false"),
                      old, resume=True)
    try:
        assert trainer.cfg.decode == config_lib.DecodeConfig(transposed=False)
    finally:
        trainer.release()
