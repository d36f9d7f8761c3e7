"""Hugging Face Llama interop against fixtures written by the real transformers
(experiments/make_hf_fixture.py: Llama MHA relu/silu, a Llama-3-shaped one with grouped-query
attention, llama3 RoPE scaling and an untied head, a Mistral one), export round trips (sharded
too), layout errors; live transformers where installed."""
import dataclasses
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import load_file, save_file

from twell_jax.inference import experiment_config_for
from twell_jax.inference.decode_engine import decode
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


# A Llama-3-shaped model of ours: grouped-query attention, an untied head, llama3 RoPE scaling.
LLAMA3 = {"n_kv_heads": 2, "tie_embeddings": False,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}}


@pytest.mark.parametrize("kind,extra", [("twell", {}), ("swiglu", {}), ("swiglu", LLAMA3)])
def test_export_then_import_round_trips_exactly(tmp_path, kind, extra):
    from twell_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32,
                      ffn_kind=kind, compute_dtype="float32", rope_theta=5e4, norm_eps=1e-6, **extra)
    model = init_model(cfg, 3)
    loaded = LoadedModel(model=model, config=experiment_config_for(cfg), tokenizer=None, step=None, eos_id=7)
    out = export_hf(loaded, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    back = import_hf(out)
    jax.tree.map(np.testing.assert_array_equal, split_model(model)[1], split_model(back.model)[1])
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "rope_theta",
                  "rope_scaling", "tie_embeddings", "norm_eps", "ffn_kind"):
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
    # tokenizer_config.json: the class and the context for AutoTokenizer; no end-of-text token here.
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 16, "clean_up_tokenization_spaces": False}
    vocab["<|endoftext|>"] = 299
    del vocab["t299"]
    with_eos = dataclasses.replace(loaded, tokenizer=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    out = export_hf(with_eos, tmp_path / "with_eos")
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    try:  # where transformers is installed: AutoTokenizer takes the export as it is (lm-eval's `hf` does)
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        auto = transformers.AutoTokenizer.from_pretrained(str(out))
        assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == 299 and auto.model_max_length == 16
    relu_cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=16, ffn_kind="relu")
    with pytest.raises(ValueError, match="no Llama layout"):
        export_hf(init_model(relu_cfg, 0), tmp_path / "relu", cfg=relu_cfg)
    assert not (tmp_path / "relu").exists()


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 must be an int >= 1 dividing num_attention_heads=4"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    ({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"), ({"head_dim": 32}, "head_dim=32"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type 'linear'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}}, "missing: original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 32}},
     "rope_parameters.high_freq_factor=1.0 must exceed low_freq_factor=4.0"),
    ({"model_type": "qwen2"}, "model_type 'qwen2'"), ({"architectures": ["Qwen2ForCausalLM"]}, "architectures"),
    ({"sliding_window": 16}, "sliding_window=16 is shorter than the context 64 (max_position_embeddings)")])
def test_unsupported_llama_configs_are_clear_errors(change, match):
    hf = json.loads((FIXTURES / "llama_relu" / "config.json").read_text())
    with pytest.raises(ValueError, match=re.escape(match)):
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

    # The Llama-3-shaped one written in shards (its index read by transformers), over 30 positions
    # (its RoPE scaling's original context is 16).
    for name, kind, extra, shard in (("twell", "twell", {}, {}), ("swiglu", "swiglu", {}, {}),
                                     ("llama3", "swiglu", LLAMA3, {"max_shard_bytes": 40_000})):
        cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32,
                          ffn_kind=kind, compute_dtype="float32", ffn_backend="reference", init_std=0.1, **extra)
        loaded = LoadedModel(model=init_model(cfg, 5), config=experiment_config_for(cfg), tokenizer=None, step=None)
        out = export_hf(loaded, tmp_path / name, **shard)
        assert (out / "model.safetensors.index.json").is_file() == bool(shard)
        hf_model = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
        tokens = np.random.default_rng(0).integers(0, 300, size=(2, 30 if extra else 10))
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


def test_the_llama3_shaped_fixture_gives_the_logits_transformers_computed():
    """Grouped-query attention (2 KV heads for 4), llama3 RoPE scaling and an untied lm_head, as
    transformers computed them, by the forward and by prefill + KV-cached decode steps. The fixture
    needs each feature: without the scaling, or with the embedding as the head, the logits differ."""
    from twell_jax.inference.load import model_with_params
    from twell_jax.model import init_cache

    path = FIXTURES / "llama3_gqa"
    loaded = import_hf(path)
    m = loaded.config.model
    assert (m.n_heads, m.n_kv_heads, m.tie_embeddings, m.ffn_kind, m.rope_theta, m.max_seq_len) == (
        4, 2, False, "swiglu", 5e5, 128)
    assert m.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}
    tokens, want = np.load(path / "token_ids.npy"), np.load(path / "logits.npy")
    np.testing.assert_allclose(_logits(loaded, tokens), want, rtol=1e-5, atol=1e-5)
    cache = init_cache(m, tokens.shape[0], tokens.shape[1])
    start = jnp.zeros((tokens.shape[0],), jnp.int32)
    prompt, cache, _ = decode(loaded.model, jnp.asarray(tokens[:, :30]), cache, jnp.int32(0), start,
                              config=loaded.config.decode, all_logits=True)
    steps = []
    for t in range(30, tokens.shape[1]):
        logits, cache, _ = decode(loaded.model, jnp.asarray(tokens[:, t:t + 1]), cache, jnp.int32(t), start,
                                  config=loaded.config.decode)
        steps.append(logits)
    assert cache.k_LxBxTxNxK.shape == (2, 2, tokens.shape[1], 2, 16)  # the 2 KV heads cached, not 4
    np.testing.assert_allclose(np.concatenate([prompt, np.stack(steps, 1)], axis=1), want, rtol=1e-5, atol=1e-5)
    params = split_model(loaded.model)[1]
    tied = {k: v for k, v in params.items() if k != "lm_head"}
    for change, weights in (({"rope_scaling": None}, params), ({"tie_embeddings": True}, tied)):
        other = model_with_params(dataclasses.replace(m, **change), weights, "float32")
        assert np.max(np.abs(np.asarray(other(jnp.asarray(tokens))[0]) - want)) > 1e-3, change


def test_the_mistral_fixture_imports_within_its_sliding_window():
    """MistralForCausalLM (Llama's weights): its sliding_window (32) is shorter than its
    max_position_embeddings (64), which our full causal attention cannot honour: refused by
    default, imported with a context of at most the window, where the window changes nothing."""
    path = FIXTURES / "mistral_gqa"
    with pytest.raises(ValueError, match=r"mistral_gqa/config\.json: sliding_window=32 is shorter than the context 64 "
                                         r"\(max_position_embeddings\).*max_seq_len <= 32"):
        import_hf(path)
    loaded = import_hf(path, max_seq_len=32)
    m = loaded.config.model
    assert (m.max_seq_len, m.n_kv_heads, m.tie_embeddings, m.rope_scaling) == (32, 2, False, None)
    np.testing.assert_allclose(_logits(loaded, np.load(path / "token_ids.npy")), np.load(path / "logits.npy"),
                               rtol=1e-5, atol=1e-5)


def test_an_export_above_the_shard_size_is_sharded_with_an_index_and_imports_the_same(tmp_path):
    from twell_jax.inference.hf import shard_names

    src = FIXTURES / "llama3_gqa"
    loaded = import_hf(src)
    out = export_hf(loaded, tmp_path / "sharded", max_shard_bytes=100_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert not (out / "model.safetensors").exists() and len(shards) >= 3
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = {name: value for shard in shards for name, value in load_file(str(out / shard)).items()}
    assert sorted(tensors) == sorted(index["weight_map"]) and "lm_head.weight" in tensors
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    for shard in shards:  # each shard within the size, unless one tensor alone exceeds it
        part = load_file(str(out / shard))
        assert sum(v.nbytes for v in part.values()) <= 100_000 or len(part) == 1
    back = import_hf(out)
    jax.tree.map(np.testing.assert_array_equal, split_model(loaded.model)[1], split_model(back.model)[1])
    np.testing.assert_allclose(_logits(back, np.load(src / "token_ids.npy")), np.load(src / "logits.npy"),
                               rtol=1e-5, atol=1e-5)
    assert list(shard_names(tensors, 10 ** 9)) == ["model.safetensors"]  # below the size: one file
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes must be an int >= 1"):
            export_hf(loaded, tmp_path / "bad", max_shard_bytes=bad)
    assert not (tmp_path / "bad").exists()


def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path):
    path = shutil.copytree(FIXTURES / "llama_silu", tmp_path / "escape")
    names = list(load_file(str(path / "model.safetensors")))
    index = {"weight_map": {name: "../x.safetensors" for name in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard '../x.safetensors' is not a file name in the checkpoint directory"):
        import_hf(path)


def test_a_silu_checkpoint_imports_into_a_relu_gated_kind_only_when_asked(caplog):
    """Sparsifying a SwiGLU model starts here: ffn_kind twell / relu_gated keeps every weight and
    replaces the gate's SiLU by a ReLU (a warning says the function changed); by default it stays swiglu."""
    path = FIXTURES / "llama_silu"
    default = import_hf(path)
    assert default.config.model.ffn_kind == "swiglu" and not caplog.records
    with caplog.at_level("WARNING"):
        sparse = import_hf(path, ffn_kind="twell", ffn_backend="dense")
    assert sparse.config.model.ffn_kind == "twell" and sparse.config.model.kind.l1
    assert any("hidden_act silu imported as ffn_kind twell" in r.getMessage() for r in caplog.records)
    jax.tree.map(np.testing.assert_array_equal, split_model(default.model)[1], split_model(sparse.model)[1])
    with pytest.raises(ValueError, match="ffn_kind='relu' does not match hidden_act='silu'"):
        import_hf(path, ffn_kind="relu")


def test_the_cli_describes_a_grouped_checkpoint_and_names_an_unsupported_field_with_exit_2(tmp_path, capsys):
    from twell_jax.cli import main

    assert main(["hf", "import", str(FIXTURES / "llama3_gqa")]) == 0
    out = capsys.readouterr().out
    assert "4 heads (2 KV heads)" in out and "llama3 scaling x8" in out and "untied lm_head" in out, out
    path = shutil.copytree(FIXTURES / "llama_silu", tmp_path / "qwen")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "architectures": ["Qwen2ForCausalLM"]}))
    assert main(["hf", "import", str(path)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1 and "architectures ['Qwen2ForCausalLM'] is not supported" in errors[0], err
