"""Sparsifying a pretrained SwiGLU Llama (docs/training.md, "Sparsify a pretrained model"):
`twell train --init-from HF_DIR --set model.ffn_kind=twell` imports the checkpoint with its
architecture (grouped KV heads, untied head, llama3 RoPE scaling), swaps the gate's SiLU for a ReLU
and fine-tunes it with the L1 penalty on the default corpus, logging the L1 and sparsity telemetry;
the run exports back to Hugging Face as a ReLU-gated Llama of the same shape."""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

from twell_jax.cli import main

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def swiglu_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A tiny random Llama-3-shaped SwiGLU checkpoint (GQA 4/2, untied, llama3 scaling) with a
    byte-level BPE tokenizer.json, so that text can be tokenized for it."""
    from twell_jax.config import ModelConfig
    from twell_jax.data.tokenizer import train_bpe
    from twell_jax.inference import experiment_config_for
    from twell_jax.inference.hf import export_hf
    from twell_jax.inference.load import LoadedModel
    from twell_jax.model import init_model

    tokenizer = train_bpe(["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 20,
                          vocab_size=300, eot_token="<|endoftext|>", show_progress=False)
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                      ffn_kind="swiglu", compute_dtype="float32", tie_embeddings=False, rope_scaling=SCALING)
    loaded = LoadedModel(model=init_model(cfg, 0), config=experiment_config_for(cfg), tokenizer=tokenizer, step=None)
    return export_hf(loaded, tmp_path_factory.mktemp("sparsify") / "llama")


def test_the_recipes_config_keeps_the_checkpoints_architecture_and_makes_it_twell(swiglu_checkpoint, capsys):
    code = main(["train", "--config", "micro", "--init-from", str(swiglu_checkpoint), "--set", "model.ffn_kind=twell",
                 "sparsity.l1_coef=2e-3", "--print-config"])
    out = capsys.readouterr().out
    cfg = json.loads(out[out.index("{"):])
    model = cfg["model"]
    assert code == 0 and model["ffn_kind"] == "twell" and cfg["sparsity"]["l1_coef"] == 2e-3
    assert (model["n_heads"], model["n_kv_heads"], model["tie_embeddings"], model["rope_scaling"]) == (
        4, 2, False, SCALING)
    assert cfg["data"]["tokenizer"].endswith("tokenizer.json")  # the checkpoint's own
    # A grouped-head setting the weights do not have is refused, naming the field.
    assert main(["train", "--config", "micro", "--init-from", str(swiglu_checkpoint), "--set",
                 "model.n_kv_heads=4", "--print-config"]) == 2
    assert "model.n_kv_heads" in capsys.readouterr().err


def test_a_mistral_checkpoint_trains_within_its_sliding_window(capsys):
    path = str(FIXTURES / "mistral_gqa")
    data = ["data.source=synthetic", "data.vocab_size=128"]
    assert main(["train", "--config", "micro", "--init-from", path, "--set", *data, "--print-config"]) == 2
    assert "sliding_window=32 is shorter than the context 64" in capsys.readouterr().err
    assert main(["train", "--config", "micro", "--init-from", path, "--set", *data, "model.max_seq_len=32",
                 "--print-config"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["model"]["max_seq_len"] == 32


def test_a_swiglu_checkpoint_fine_tunes_as_twell_with_l1_and_sparsity_telemetry(swiglu_checkpoint, tmp_path, capsys):
    from twell_jax.inference.hf import import_hf
    from twell_jax.model import split_model
    from twell_jax.training.checkpoint import restore_params

    run = tmp_path / "run"
    code = main(["train", "--config", "micro", "--init-from", str(swiglu_checkpoint), "--out", str(run), "--json",
                 "--set", "model.ffn_kind=twell", "sparsity.l1_coef=1e-3", "train.steps=3",
                 f"data.cache_dir={tmp_path / 'cache'}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out[captured.out.index("{"):])
    assert math.isfinite(summary["val_loss"]) and 0 < summary["val_l0_mean"] < 64 and 0 < summary["val_sparsity"] < 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "l1" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["l1"] > 0 and r["l1_coef"] == pytest.approx(1e-3)
        assert len(r["l0_per_layer"]) == 2 and all(0 < v < 64 for v in r["l0_per_layer"])
        assert r["loss"] == pytest.approx(r["ce"] + r["l1_coef"] * r["l1"], rel=1e-5)
    # It started from the checkpoint: three steps at lr <= 3e-3 move no weight far from it.
    params = restore_params(run)[0]
    imported = split_model(import_hf(swiglu_checkpoint).model)[1]
    assert params["blocks"]["attn"]["w_k"].shape == (2, 32, 16) and "lm_head" in params
    for name in ("embed", "lm_head"):
        assert float(np.abs(np.asarray(params[name]) - np.asarray(imported[name])).max()) < 0.02, name
    # The sparsified run exports as a ReLU-gated Llama of the same architecture, in shards above the size given.
    out = tmp_path / "hf"
    assert main(["hf", "export", "--checkpoint", str(run), "--out", str(out), "--max-shard-bytes", "20000"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    hf = json.loads((out / "config.json").read_text())
    assert (hf["hidden_act"], hf["num_key_value_heads"], hf["tie_word_embeddings"]) == ("relu", 2, False)
    assert hf["rope_scaling"] == SCALING
    back = split_model(import_hf(out).model)[1]
    np.testing.assert_array_equal(np.asarray(back["lm_head"]), np.asarray(params["lm_head"]))
