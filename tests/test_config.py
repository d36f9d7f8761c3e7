"""Config dataclasses: presets, invariants, dotted overrides, JSON round trip."""
from __future__ import annotations

import dataclasses
import json

import pytest

from twell_jax.configs import get_config, list_configs
from twell_jax import config as config_lib
from twell_jax.config import DataConfig, ExperimentConfig, ModelConfig, OptimConfig, SparsityConfig, TrainConfig


@pytest.mark.parametrize("name", list_configs())
def test_presets_build_and_round_trip(name):
    cfg = get_config(name)
    assert isinstance(cfg, ExperimentConfig)
    assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg


@pytest.mark.parametrize("name,layers,params_b", [("0.5b", 8, 0.51), ("1b", 18, 1.03), ("1.5b", 28, 1.54),
                                                  ("2b", 38, 2.05)])
def test_paper_presets_match_the_paper(name, layers, params_b):
    cfg = get_config(name)
    m = cfg.model
    assert (m.d_model, m.d_ff, m.n_heads, m.vocab_size, m.max_seq_len, m.n_layers) == (2048, 5632, 32, 49152, 2048, layers)
    assert m.num_params() / 1e9 == pytest.approx(params_b, abs=0.01)
    assert cfg.train.global_batch * cfg.data.seq_len == 1_048_576 and cfg.train.global_batch % cfg.train.micro_batch == 0
    o = cfg.optim
    assert (o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.warmup_steps, o.clip_norm, o.schedule) == (
        1e-3, 0.9, 0.95, 1e-8, 0.1, 600, 1.0, "cosine")
    assert cfg.sparsity.l1_coef == 2e-5 and m.compute_dtype == "bfloat16" and m.ffn_kind == "twell"


@pytest.mark.parametrize("size", ["0.5b", "1b", "1.5b", "2b"])
def test_each_paper_size_has_a_dense_twin_at_its_own_measured_execution(size):
    """`NAME-twin` trains the same model and tokens as `NAME` with the dense relu_gated FFN and no
    L1; only the execution (remat, micro-batch: the measured fastest of each, configs/paper.py) and
    the run's name may differ."""
    import configs.paper as paper

    sparse, twin = get_config(size), get_config(f"{size}-twin")
    assert (twin.model.ffn_kind, twin.sparsity.l1_coef) == ("relu_gated", 0.0)
    assert (sparse.model.remat, sparse.train.micro_batch) == paper.EXECUTION[size]["sparse"]
    assert (twin.model.remat, twin.train.micro_batch) == paper.EXECUTION[size]["twin"]
    same = lambda c: dataclasses.replace(  # noqa: E731
        c, name="", model=dataclasses.replace(c.model, ffn_kind="twell", remat="none"),
        sparsity=dataclasses.replace(c.sparsity, l1_coef=0.0), train=dataclasses.replace(c.train, micro_batch=1))
    assert same(sparse) == same(twin)
    with pytest.raises(ValueError, match="unknown paper preset '3b-twin'"):
        paper.get_config("3b-twin")


def test_medium_preset_is_a_compute_optimal_124m_model():
    """`medium` (configs/medium.py): 100M-150M parameters, counted by the config's helper and on the
    model itself (its abstract parameters), trained on 20 tokens per parameter in ~0.5M-token steps;
    and a run of it passes the trainer's own checks (op config, schedule, batch layout)."""
    from twell_jax.cli import _param_count
    from twell_jax.training import parallel
    from twell_jax.training.preflight import checked_run_config

    cfg = get_config("medium")
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.vocab_size, m.max_seq_len) == (768, 12, 12, 2112, 49152, 2048)
    assert m.d_ff / m.d_model == 5632 / 2048 and m.d_ff % 64 == 0  # the paper's ratio
    params = m.num_params()
    assert params == _param_count(m) == 124_472_064  # the count the docstring states
    assert 100e6 <= params <= 150e6
    tokens_per_step = cfg.train.global_batch * cfg.seq_len
    assert tokens_per_step == 524_288
    assert cfg.train.steps * tokens_per_step / params == pytest.approx(20, abs=0.05)  # compute-optimal
    assert (m.ffn_kind, m.ffn_backend, m.compute_dtype) == ("twell", "auto", "bfloat16")
    assert cfg.sparsity.l1_coef == 3e-3 and cfg.data.vocab_size == m.vocab_size
    checked_run_config(cfg, None, resume=False, overwrite=False)
    assert parallel.check_batch_layout(cfg.train.global_batch, cfg.train.micro_batch, 1) == 16


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown config 'nope'"):
        get_config("nope")


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("factory,match", [
    (lambda: ModelConfig(d_model=130, n_heads=4), "divisible by model.n_heads"),
    (lambda: ModelConfig(ffn_kind="gelu"), "model.ffn_kind"),
    (lambda: ModelConfig(ffn_backend="cuda"), "model.ffn_backend"),
    (lambda: ModelConfig(n_layers=0), "model.n_layers must be > 0"),
    (lambda: OptimConfig(b2=1.0), "optim.b2"),
    (lambda: SparsityConfig(l1_coef=-1.0), "sparsity.l1_coef"),
    (lambda: SparsityConfig(reinit_every=0), "sparsity.reinit_every must be > 0"),
    (lambda: SparsityConfig(reinit_dead=True, track_neurons=False), "needs sparsity.track_neurons=True"),
    (lambda: TrainConfig(global_batch=10, micro_batch=4), "train.global_batch=10"),
    (lambda: ExperimentConfig(model=ModelConfig(ffn_kind="relu_gated"), sparsity=SparsityConfig(l1_coef=1e-3)),
     "dense baseline"),
    (lambda: ExperimentConfig(model=ModelConfig(max_seq_len=64)), "data.seq_len=128 exceeds"),
    # Non-finite floats pass `> 0` comparisons: every section rejects them itself.
    (lambda: ModelConfig(rope_theta=float("nan")), "model.rope_theta must be a finite number"),
    (lambda: DataConfig(val_fraction=float("inf")), "data.val_fraction must be a finite number"),
    (lambda: OptimConfig(warmup_steps=-1), "optim.warmup_steps must be >= 0"),
    (lambda: TrainConfig(checkpoint_every=-1), "train.checkpoint_every must be >= 0"),
    (lambda: ModelConfig(n_heads=4, n_kv_heads=3), "model.n_kv_heads must be None .* dividing model.n_heads=4, got 3"),
    (lambda: ModelConfig(n_kv_heads=0), "model.n_kv_heads must be"),
    (lambda: ModelConfig(tie_embeddings="no"), "model.tie_embeddings must be true or false"),
    (lambda: ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "model.rope_scaling.rope_type must be"),
    (lambda: ModelConfig(rope_scaling={**LLAMA3_SCALING, "factor": 0.5}), "model.rope_scaling.factor must be >= 1"),
    (lambda: ModelConfig(rope_scaling={**LLAMA3_SCALING, "low_freq_factor": float("nan")}),
     "model.rope_scaling.low_freq_factor must be a finite number"),
    (lambda: ModelConfig(rope_scaling={**LLAMA3_SCALING, "beta": 1.0}), "unknown: beta"),
    (lambda: ModelConfig(rope_scaling={**LLAMA3_SCALING, "original_max_position_embeddings": 8.5}),
     "original_max_position_embeddings must be an int"),
])
def test_invariants_raise_clear_errors(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_attention_and_head_fields_default_to_todays_model_and_round_trip():
    """n_kv_heads None (multi-head), tie_embeddings true, rope_scaling None: a config saved before
    these fields existed loads as the model it always was; set ones survive JSON and overrides."""
    old = config_lib.to_dict(get_config("micro"))
    for name in ("n_kv_heads", "tie_embeddings", "rope_scaling"):
        old["model"].pop(name)
    model = config_lib.from_dict(old).model
    assert (model.n_kv_heads, model.kv_heads, model.tie_embeddings, model.rope_scaling) == (None, 2, True, None)
    cfg = config_lib.apply_overrides(get_config("micro"), [
        "model.n_heads=4", "model.n_kv_heads=2", "model.tie_embeddings=false",
        "model.rope_scaling=" + json.dumps(LLAMA3_SCALING)])
    assert (cfg.model.kv_heads, cfg.model.kv_dim, cfg.model.rope_scaling_params.factor) == (2, 16, 8.0)
    assert config_lib.from_dict(json.loads(config_lib.to_json(cfg))) == cfg
    assert {"model.n_kv_heads", "model.tie_embeddings", "model.rope_scaling"} <= {
        f"model.{f}" for f in config_lib.ARCHITECTURE_FIELDS}  # the weights fix them (--init-from, init runs)


def test_overrides_are_typed():
    cfg = config_lib.apply_overrides(get_config("micro"), [
        "model.n_layers=3", "optim.lr=1e-2", "model.remat=true", "train.num_devices=none",
        "model.ffn_kind=relu", "name=x", 'model.ffn_op_config={"slots": 8}', "data.max_documents=5"])
    assert cfg.model.n_layers == 3 and cfg.optim.lr == 1e-2 and cfg.model.remat == "full"
    assert cfg.train.num_devices is None and cfg.model.ffn_kind == "relu" and cfg.name == "x"
    assert cfg.model.ffn_op_config == {"slots": 8} and cfg.data.max_documents == 5


@pytest.mark.parametrize("override,match", [
    ("model.n_layers=three", "model.n_layers expects an int"),
    ("model.nope=1", "unknown config field 'model.nope'"),
    ("model.ffn_kind=gelu", "model.ffn_kind must be one of"),
    ("model.remat=maybe", "expects a bool"),
    ("model=1", "is a section"),
    ("model.n_heads", "section.field=value"),
    ("model.n_heads=5", "divisible by model.n_heads"),  # invariants re-checked after the override
])
def test_bad_overrides(override, match):
    with pytest.raises(ValueError, match=match):
        config_lib.apply_overrides(get_config("micro"), [override])


def test_diff_names_fields():
    a = get_config("micro")
    b = dataclasses.replace(a, model=dataclasses.replace(a.model, d_ff=96))
    assert config_lib.diff(a, b) == [("model.d_ff", 64, 96)]


def test_coupled_overrides_are_validated_together():
    cfg = config_lib.apply_overrides(get_config("micro"), ["model.ffn_kind=relu_gated", "sparsity.l1_coef=0"])
    assert cfg.model.ffn_kind == "relu_gated" and cfg.sparsity.l1_coef == 0.0
    with pytest.raises(ValueError, match="dense baseline"):
        config_lib.apply_overrides(get_config("micro"), ["model.ffn_kind=relu_gated"])


def test_a_config_saved_with_the_decode_fields_under_model_loads_them_into_the_decode_section():
    """Runs saved before the decode section hold model.decode_kernels, decode_transposed,
    decode_sparse_ffn and decode_layer_unroll: from_dict moves them to decode.* (the same config
    as one written today), the old override names still work, and both places set is an error."""
    new = config_lib.apply_overrides(get_config("micro"), ["decode.kernels=xla", "decode.transposed=false",
                                                           "decode.sparse_ffn=packed", "decode.layer_unroll=1"])
    old = config_lib.to_dict(new)
    decode = old.pop("decode")
    old["model"].update({f"decode_{name}": value for name, value in decode.items()})
    assert config_lib.from_dict(json.loads(json.dumps(old))) == new
    assert "decode_kernels" in old["model"]  # the caller's dict is left as it was
    assert config_lib.from_dict({k: v for k, v in old.items() if k != "model"}).decode == config_lib.DecodeConfig()
    assert config_lib.apply_overrides(get_config("micro"), ["model.decode_kernels=xla", "model.decode_layer_unroll=1"]
                                      ).decode == config_lib.DecodeConfig(kernels="xla", layer_unroll=1)
    assert {"model.decode_kernels", "decode.kernels"} <= config_lib.RESUMABLE_FIELDS
    both = {**old, "decode": {"kernels": "xla"}}
    with pytest.raises(ValueError, match="model.decode_kernels moved to decode.kernels, and both are set"):
        config_lib.from_dict(both)
    assert not any(f.name.startswith("decode") for f in dataclasses.fields(ModelConfig))
    with pytest.raises(ValueError, match="decode.sparse_ffn must be one of"):
        config_lib.apply_overrides(get_config("micro"), ["decode.sparse_ffn=one"])


def test_a_config_saved_with_train_fsdp_loads_as_the_layout_it_ran_with():
    """Runs saved before train.sharding hold train.fsdp (a bool): from_dict converts it (true ->
    "fsdp", false -> "replicate", the layouts they ran with), `--set train.fsdp=...` still works
    (also on a resume), and a bad value or both fields set is one error naming the field."""
    for fsdp, sharding in ((True, "fsdp"), (False, "replicate")):
        old = config_lib.to_dict(get_config("micro"))
        del old["train"]["sharding"]
        old["train"]["fsdp"] = fsdp
        loaded = config_lib.from_dict(json.loads(json.dumps(old)))
        assert loaded.train.sharding == sharding and "fsdp" in old["train"]  # the caller's dict as it was
        assert loaded == config_lib.apply_overrides(get_config("micro"), [f"train.sharding={sharding}"])
        assert config_lib.apply_overrides(get_config("micro"), [f"train.fsdp={str(fsdp).lower()}"]
                                          ).train.sharding == sharding
    assert {"train.fsdp", "train.sharding", "train.fsdp_size"} <= config_lib.RESUMABLE_FIELDS
    assert get_config("micro").train.sharding == "auto" and get_config("micro").train.fsdp_size is None
    both = config_lib.to_dict(get_config("micro"))
    both["train"]["fsdp"] = True
    with pytest.raises(ValueError, match="train.fsdp was replaced by train.sharding, and both are set"):
        config_lib.from_dict(both)
    with pytest.raises(ValueError, match=r"train.fsdp expects a bool \(true/false\), got 'yes please'"):
        config_lib.apply_overrides(get_config("micro"), ["train.fsdp=yes please"])


@pytest.mark.parametrize("overrides, match", [
    (["train.sharding=zero3"], r"train.sharding must be one of \('auto', 'replicate', 'fsdp', 'hybrid'\), "
                               r"got 'zero3'"),
    (["train.fsdp_size=0"], r"train.fsdp_size must be >= 1 or None"),
    (["train.sharding=replicate", "train.fsdp_size=4"], r"train.fsdp_size=4 sizes the FSDP groups of "
                                                         r"train.sharding 'hybrid' or 'auto', not 'replicate'"),
    (["train.fsdp_size=two"], r"train.fsdp_size"),
])
def test_bad_sharding_settings_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_lib.apply_overrides(get_config("micro"), overrides)
    assert config_lib.apply_overrides(get_config("micro"), ["train.sharding=hybrid", "train.fsdp_size=4"]
                                      ).train.fsdp_size == 4


def test_the_model_asks_the_ffn_kind_table():
    """Each kind's activation and gating come from FFN_KIND_TABLE; the kinds a checkpoint of an
    activation loads as are the table's kinds of that activation and gating."""
    table = config_lib.FFN_KIND_TABLE
    assert {name: (kind.activation, kind.through_op) for name, kind in table.items()} == {
        "swiglu": ("silu", False), "relu_gated": ("relu", True), "twell": ("relu", True), "relu": ("relu", True)}
    assert config_lib.ffn_kinds_with("relu") == ("relu_gated", "twell")
    assert config_lib.ffn_kinds_with("relu", gated=False) == ("relu",)
    assert config_lib.ffn_kinds_with("silu") == ("swiglu",)
