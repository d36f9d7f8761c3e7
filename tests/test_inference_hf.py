"""Hugging Face Llama interop against fixtures written by the real transformers
(experiments/make_hf_fixture.py), export round trips, layout errors; live transformers where installed."""
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import load_file, save_file

from twell_jax.inference import experiment_config_for
from twell_jax.inference.hf import export_hf, import_hf, model_config_from_hf, params_from_hf
from twell_jax.inference.load import LoadedModel
from twell_jax.model import init_model, split_model

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _logits(loaded: LoadedModel, token_ids: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda t: loaded.model(t)[0])(jnp.asarray(token_ids)))


@pytest.mark.parametrize("name,kind,backend", [("llama_relu", None, "reference"), ("llama_relu", "relu_gated", "auto"),
                                               ("llama_silu", None, "auto")])
def test_imported_fixture_gives_the_logits_transformers_computed(name, kind, backend):
    path = FIXTURES / name
    loaded = import_hf(path, ffn_kind=kind, ffn_backend=backend)
    expected_kind = kind or ("twell" if name == "llama_relu" else "swiglu")
    assert loaded.config.model.ffn_kind == expected_kind
    assert loaded.eos_id == 0 and loaded.config.model.rope_theta == 1e5 and loaded.config.model.norm_eps == 1e-5
    np.testing.assert_allclose(_logits(loaded, np.load(path / "token_ids.npy")), np.load(path / "logits.npy"),
                               rtol=1e-5, atol=1e-5)


def _copy_with(src: pathlib.Path, dst: pathlib.Path, transform) -> pathlib.Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(transform(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_reference_checkpoint_with_transposed_down_proj_is_detected_by_shape(tmp_path):
    src = FIXTURES / "llama_relu"
    path = _copy_with(src, tmp_path / "t", lambda ts: {k: (jnp.array(v.T) if "down_proj" in k else v)
                                                       for k, v in ts.items()})
    loaded = import_hf(path, ffn_backend="dense")  # the layout, not the backend, is under test here
    np.testing.assert_allclose(_logits(loaded, np.load(src / "token_ids.npy")), np.load(src / "logits.npy"),
                               rtol=1e-5, atol=1e-5)
    # Told explicitly, the wrong layout is an error naming the tensor.
    with pytest.raises(ValueError, match="down_proj.weight.*hf layout"):
        import_hf(path, down_proj_layout="hf")


def test_square_ffn_needs_an_explicit_down_proj_layout():
    hf = json.loads((FIXTURES / "llama_relu" / "config.json").read_text())
    cfg = model_config_from_hf({**hf, "intermediate_size": hf["hidden_size"]})
    model = init_model(cfg, 0)
    from twell_jax.inference.hf import hf_tensors_from_params

    tensors = hf_tensors_from_params(split_model(model)[1], cfg)
    with pytest.raises(ValueError, match="cannot be told from its shape"):
        params_from_hf(tensors, cfg)
    as_hf = params_from_hf(tensors, cfg, down_proj_layout="hf")
    as_transposed = params_from_hf(tensors, cfg, down_proj_layout="transposed")
    w = split_model(model)[1]["blocks"]["ffn"]["w_down"][0]
    np.testing.assert_array_equal(as_hf["blocks"]["ffn"]["w_down"][0], w)
    np.testing.assert_array_equal(as_transposed["blocks"]["ffn"]["w_down"][0], w.T)


def test_sharded_checkpoint_with_an_index_imports_the_same(tmp_path):
    src = FIXTURES / "llama_silu"
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = import_hf(src), import_hf(dst)
    jax.tree.map(np.testing.assert_array_equal, split_model(a.model)[1], split_model(b.model)[1])
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard model-00002-of-00002"):
        import_hf(dst)


@pytest.mark.parametrize("kind", ["twell", "swiglu"])
def test_export_then_import_round_trips_exactly(tmp_path, kind):
    from twell_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32,
                      ffn_kind=kind, compute_dtype="float32", rope_theta=5e4, norm_eps=1e-6)
    model = init_model(cfg, 3)
    loaded = LoadedModel(model=model, config=experiment_config_for(cfg), tokenizer=None, step=None, eos_id=7)
    out = export_hf(loaded, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    back = import_hf(out)
    jax.tree.map(np.testing.assert_array_equal, split_model(model)[1], split_model(back.model)[1])
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "rope_theta", "norm_eps",
                  "ffn_kind"):
        assert getattr(back.config.model, field) == getattr(cfg, field), field
    assert back.eos_id == 7
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        export_hf(loaded, out)


def test_export_writes_the_tokenizer_and_refuses_the_non_gated_kind(tmp_path):
    from tokenizers import Tokenizer, models

    from twell_jax.config import ModelConfig

    vocab = {f"t{i}": i for i in range(300)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=16,
                      compute_dtype="float32")
    loaded = LoadedModel(model=init_model(cfg, 0), config=experiment_config_for(cfg), tokenizer=tokenizer, step=None)
    out = export_hf(loaded, tmp_path / "with_tok")
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 300
    assert import_hf(out).tokenizer.get_vocab_size() == 300
    relu_cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=16, ffn_kind="relu")
    with pytest.raises(ValueError, match="no Llama layout"):
        export_hf(init_model(relu_cfg, 0), tmp_path / "relu", cfg=relu_cfg)
    assert not (tmp_path / "relu").exists()


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 2}, "grouped-query"), ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "bias"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ({"model_type": "mistral"}, "model_type")])
def test_unsupported_llama_configs_are_clear_errors(change, match):
    hf = json.loads((FIXTURES / "llama_relu" / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        model_config_from_hf({**hf, **change})


def test_the_tokenizer_is_the_checkpoints_own_or_the_named_one_never_a_missing_file(tmp_path):
    from tokenizers import Tokenizer, models

    src = FIXTURES / "llama_relu"
    bare = import_hf(src)  # the fixture has no tokenizer.json: token ids only
    assert bare.tokenizer is None and bare.config.data.is_synthetic
    assert bare.config.data.vocab_size == bare.config.model.vocab_size
    with pytest.raises(FileNotFoundError, match="tokenizer='.*nowhere.json': no such file"):
        import_hf(src, tokenizer=tmp_path / "nowhere.json")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(100)}, unk_token="t0")).save(str(tok_dir / "tokenizer.json"))
    named = import_hf(src, tokenizer=tok_dir)  # a directory holding one works too
    assert named.tokenizer.get_vocab_size() == 100 and named.config.data.tokenizer == str(tok_dir / "tokenizer.json")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(200)}, unk_token="t0")).save(str(tmp_path / "big.json"))
    with pytest.raises(ValueError, match="200 tokens but the model's vocab_size is 128"):
        import_hf(src, tokenizer=tmp_path / "big.json")


def test_missing_or_misshapen_tensors_are_named(tmp_path):
    src = FIXTURES / "llama_relu"
    missing = _copy_with(src, tmp_path / "m", lambda ts: {k: v for k, v in ts.items() if "layers.1.mlp.up" not in k})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        import_hf(missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        import_hf(tmp_path)


def test_our_export_loads_in_transformers_with_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from twell_jax.config import ModelConfig

    for kind in ("twell", "swiglu"):
        cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32,
                          ffn_kind=kind, compute_dtype="float32", ffn_backend="reference", init_std=0.1)
        loaded = LoadedModel(model=init_model(cfg, 5), config=experiment_config_for(cfg), tokenizer=None, step=None)
        out = export_hf(loaded, tmp_path / kind)
        hf_model = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
        tokens = np.random.default_rng(0).integers(0, 300, size=(2, 10))
        with torch.no_grad():
            expected = hf_model(torch.from_numpy(tokens)).logits.numpy()
        np.testing.assert_allclose(_logits(loaded, tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [(np.nan, "non-finite"), (np.inf, "non-finite"), ("int", "dtype int32")])
def test_nan_inf_and_integer_weights_are_refused_naming_the_tensor(tmp_path, bad, match):
    name = "model.layers.1.mlp.gate_proj.weight"

    def spoil(tensors):
        value = np.array(tensors[name])
        if bad == "int":
            value = value.astype(np.int32)
        else:
            value[3, 5] = bad
        return {**tensors, name: jnp.asarray(value)}

    path = _copy_with(FIXTURES / "llama_relu", tmp_path / "bad", spoil)
    with pytest.raises(ValueError, match=f"{name}.*{match}"):
        import_hf(path)


def test_a_config_without_rope_theta_takes_transformers_default(tmp_path):
    path = shutil.copytree(FIXTURES / "llama_relu", tmp_path / "norope")
    hf = json.loads((path / "config.json").read_text())
    hf.pop("rope_theta", None)
    hf.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps(hf))
    assert import_hf(path).config.model.rope_theta == 10000.0  # LlamaConfig(rope_theta=10000.0)


def test_damaged_files_are_errors_naming_the_file(tmp_path):
    src = FIXTURES / "llama_relu"
    path = shutil.copytree(src, tmp_path / "trunc")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        import_hf(path)
    path = shutil.copytree(src, tmp_path / "badjson")
    (path / "config.json").write_text('{"hidden_size": 32,')
    with pytest.raises(ValueError, match=r"badjson/config\.json: not valid JSON"):
        import_hf(path)
    path = shutil.copytree(src, tmp_path / "badtok")
    (path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match=r"badtok/tokenizer\.json: not a valid tokenizer\.json"):
        import_hf(path)
    path = shutil.copytree(src, tmp_path / "badfield")
    (path / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                  "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match=r"badfield/config\.json: hidden_act"):
        import_hf(path)


def test_export_writes_a_generation_config_with_the_end_of_text_id(tmp_path):
    loaded = import_hf(FIXTURES / "llama_relu")
    out = export_hf(loaded, tmp_path / "exp")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 0}
