"""The scanned layer stack (twell_jax.model): equal to a layer-by-layer loop with per-layer plans
that differ, both ways of scanning them, compile cost flat in depth, and runs written before the
layers were stacked."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from twell_jax import ops
from twell_jax.config import DecodeConfig, ModelConfig
from twell_jax.inference import decode_engine
from twell_jax.model import (KVCache, Transformer, _logits, apply_model, init_cache, init_model, layer_slice,
                             split_model, stack_layers)

# Micro shapes; 4 layers with hints that "auto" plans two ways (below): dense, sparse, sparse, dense.
CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=4, n_heads=2, d_ff=64, max_seq_len=16,
                  compute_dtype="float32", ffn_kind="twell", ffn_backend="auto", ffn_interpret=True,
                  ffn_op_config={"tile": 16, "slots": 16, "ell_width": 64, "check_finite": False},
                  ffn_expected_active=(40.0, 3.0, 2.0, 50.0))


@pytest.fixture
def two_plans(monkeypatch):
    """"auto" on a (pretended) GPU with the kernels interpreted: a layer whose hint is under 10
    actives/token runs the Pallas forward and backward, the others the dense backend. The real
    cost model sends every micro shape dense; this gives both kinds of layer one model."""
    from twell_jax.ops import pallas_forward, planner

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    monkeypatch.setattr(planner, "choose_training_path",
                        lambda m, d, h, k, gated, **_: (k < 10, k < 10))


def _tokens(batch=2, seq=9, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, CFG.vocab_size)


def _layer_loop(model: Transformer, tokens_BxS: jax.Array) -> tuple[jax.Array, dict]:
    """The oracle: the same blocks called one by one in Python, each with its own op config."""
    x_BxSxD = jnp.take(model.embed[...], tokens_BxS, axis=0)
    auxes = []
    for layer in range(model.n_layers):
        x_BxSxD, aux = model.layer(layer)(x_BxSxD, True, model.op_configs[layer])
        auxes.append(aux)
    logits = _logits(model.final_norm(x_BxSxD), model.embed[...])
    return logits, {key: jnp.stack([a[key] for a in auxes]) for key in auxes[0]}


def test_the_plans_differ_by_layer(two_plans):
    model = init_model(CFG, seed=0)
    groups = model.layer_groups(18, jnp.float32)
    assert groups == [(0, 1, 0), (1, 3, 1), (3, 4, 0)]
    shape = (18, CFG.d_model, CFG.d_ff, 4)
    decisions = [ops.auto_decision(True, config, shape, True) for config in model.op_configs]
    assert decisions == [("dense", "dense"), ("pallas", "pallas"), ("pallas", "pallas"), ("dense", "dense")]


@pytest.mark.parametrize("layer_scan", ["groups", "switch"])
@pytest.mark.fast_params("switch")
def test_forward_loss_and_gradients_equal_the_layer_loop(two_plans, layer_scan):
    cfg = dataclasses.replace(CFG, layer_scan=layer_scan)
    graphdef, params = split_model(init_model(cfg, seed=1))
    tokens = _tokens()

    def loss(params, scanned):
        if scanned:
            logits, aux = apply_model(graphdef, params, tokens, track_neurons=True)
        else:
            logits, aux = _layer_loop(nnx.merge(graphdef, params), tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + 1e-3 * jnp.sum(aux["l1"]), aux

    (scan_loss, scan_aux), scan_grads = jax.value_and_grad(lambda p: loss(p, True), has_aux=True)(params)
    (loop_loss, loop_aux), loop_grads = jax.value_and_grad(lambda p: loss(p, False), has_aux=True)(params)
    np.testing.assert_allclose(scan_loss, loop_loss, rtol=1e-6)
    # Both kinds of layer ran: the sparse layers report tails counted on their pattern, the dense
    # plan's none (-1: no pattern), and their active counts agree with the loop's.
    assert [int(v) for v in scan_aux["dense_fallback"]] == [int(v) for v in loop_aux["dense_fallback"]]
    for key in ("l0", "l1", "neuron_active_count", "position_active", "backward_tail_rows"):
        np.testing.assert_allclose(scan_aux[key], loop_aux[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for (path, g_scan), g_loop in zip(jax.tree_util.tree_leaves_with_path(scan_grads), jax.tree.leaves(loop_grads)):
        np.testing.assert_allclose(g_scan, g_loop, rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(scan_grads["blocks"]["ffn"]["w_gate"][1]).max()) > 0  # a sparse layer's gradient


@pytest.mark.parametrize("layer_scan", ["groups", "switch"])
@pytest.mark.slow
def test_kv_cached_decode_equals_the_forward(two_plans, layer_scan):
    """Prefill + token-by-token decode of left-padded rows give the full forward's logits."""
    cfg = dataclasses.replace(CFG, layer_scan=layer_scan)
    model = init_model(cfg, seed=2)
    tokens = _tokens(batch=2, seq=8, seed=3)
    full, _ = model(tokens)
    cache = init_cache(cfg, 2, 8)
    start = jnp.zeros((2,), jnp.int32)
    config = DecodeConfig()  # the default: the decode kernels on a GPU, the model's XLA decode here
    logits, cache, _ = decode_engine.decode(model, tokens[:, :5], cache, jnp.int32(0), start, config=config,
                                            all_logits=True)
    np.testing.assert_allclose(logits, full[:, :5], rtol=1e-4, atol=1e-5)
    prepared = decode_engine.prepare_decode(model, config)  # the default layout's output-major copies
    for t in range(5, 8):
        step_logits, cache, aux = decode_engine.decode(model, tokens[:, t:t + 1], cache, jnp.int32(t), start,
                                                       config=config, prepared=prepared)
        np.testing.assert_allclose(step_logits, full[:, t], rtol=1e-4, atol=1e-5)
    assert isinstance(cache, KVCache) and aux["l0"].shape == (4,)


def test_a_single_plan_is_one_scan_and_unroll_changes_nothing():
    cfg = dataclasses.replace(CFG, ffn_backend="reference", ffn_interpret=False, ffn_expected_active=())
    model = init_model(cfg, seed=4)
    assert model.layer_groups(18, jnp.float32) == [(0, 4, 0)]
    tokens = _tokens()
    base, _ = model(tokens)
    unrolled = init_model(dataclasses.replace(cfg, layer_unroll=0), seed=4)
    np.testing.assert_allclose(unrolled(tokens)[0], base, rtol=1e-6, atol=1e-6)
    for bad in (-1, "all", 1.5, True):
        with pytest.raises(ValueError, match='model.layer_unroll must be "auto" or an int >= 0'):
            dataclasses.replace(cfg, layer_unroll=bad)
    with pytest.raises(ValueError, match="model.layer_scan"):
        dataclasses.replace(cfg, layer_scan="unrolled")


def test_the_lowered_train_step_does_not_grow_with_depth():
    """Compile cost flat in depth: the lowered training step of a 24-layer model is within a few
    percent of a 2-layer one's (an unrolled model's grows about 12x)."""
    def lowered_size(n_layers: int) -> int:
        cfg = dataclasses.replace(CFG, n_layers=n_layers, ffn_backend="reference", ffn_interpret=False,
                                  ffn_expected_active=(), remat="full")
        graphdef, params = split_model(init_model(cfg, 0))

        def loss(params, tokens):
            logits, aux = apply_model(graphdef, params, tokens, track_neurons=True)
            return jnp.mean(logits) + jnp.sum(aux["l1"])

        return len(jax.jit(jax.grad(loss)).lower(params, _tokens()).as_text())

    small, deep = lowered_size(2), lowered_size(24)
    assert deep < 1.1 * small, (small, deep)


def test_init_is_one_program_and_layers_differ():
    """Each layer is drawn from its own key (no two layers equal), and jit(init) lowers to a
    program whose size does not grow with depth."""
    def init_text(n_layers: int) -> str:
        cfg = dataclasses.replace(CFG, n_layers=n_layers, ffn_expected_active=())
        return jax.jit(lambda: split_model(init_model(cfg, 0))[1]).lower().as_text()

    assert len(init_text(24)) < 1.1 * len(init_text(2))
    w_gate = split_model(init_model(dataclasses.replace(CFG, ffn_expected_active=()), 0))[1]["blocks"]["ffn"]["w_gate"]
    assert w_gate.shape == (4, 64, 32)
    assert all(not np.allclose(w_gate[i], w_gate[j]) for i in range(4) for j in range(i + 1, 4))


def test_stack_layers_round_trips():
    per_layer = [{"a": jnp.full((2,), float(i)), "b": {"c": jnp.full((3, 1), float(i))}} for i in range(3)]
    stacked = stack_layers(per_layer)
    assert stacked["b"]["c"].shape == (3, 3, 1)
    for i in range(3):
        assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), layer_slice(stacked, i),
                                         per_layer[i]))
    with pytest.raises(ValueError, match="at least one layer"):
        stack_layers([])


# ----------------------------------------------------------------------------- runs written before the stack


def _per_layer(tree):
    """A tree in the layout of format-2 checkpoints: every "blocks" entry one dict per layer."""
    def unstack(node):
        if not (isinstance(node, dict) and isinstance(node.get("blocks"), dict)):
            return node
        n_layers = jax.tree.leaves(node["blocks"])[0].shape[0]
        return {**node, "blocks": {i: layer_slice(node["blocks"], i) for i in range(n_layers)}}

    return jax.tree.map(unstack, tree, is_leaf=lambda n: isinstance(n, dict) and isinstance(n.get("blocks"), dict))


@pytest.mark.slow
def test_a_run_written_before_the_layers_were_stacked_restores_and_resumes(tmp_path, monkeypatch):
    """A format-2 run (one dict per layer in its params and in the optimizer's moments) is
    verified as written, converted on restore, and resumes to the same parameters as a run that
    was written stacked."""
    from twell_jax.configs import get_config
    from twell_jax import config as config_lib
    from twell_jax import run_dir as run_dir_lib
    from twell_jax.training import checkpoint as ckpt_lib
    from twell_jax.training.checkpoint import CheckpointStore, restore_params
    from twell_jax.training.train import Trainer

    cfg = config_lib.apply_overrides(get_config("micro"), [
        "data.source=synthetic", "train.steps=2", "optim.schedule_steps=3", "train.checkpoint_every=2",
        "train.eval_every=0"])
    new_run, old_run = tmp_path / "new", tmp_path / "old"
    Trainer(cfg, new_run).run()
    stacked_save = CheckpointStore.save

    def save_as_format_2(self, step, params, train_state, meta):
        current, ckpt_lib.CHECKPOINT_FORMAT = ckpt_lib.CHECKPOINT_FORMAT, ckpt_lib.LAYER_LIST_FORMAT
        try:
            stacked_save(self, step, _per_layer(params), _per_layer(train_state), meta)
        finally:
            ckpt_lib.CHECKPOINT_FORMAT = current

    monkeypatch.setattr(CheckpointStore, "save", save_as_format_2)
    Trainer(cfg, old_run).run()
    monkeypatch.undo()
    store = CheckpointStore(run_dir_lib.checkpoint_dir(old_run), create=False)
    assert store.restore_meta(2)["format"] == 2
    store.close()
    old_params, _, _ = restore_params(old_run)
    new_params, _, _ = restore_params(new_run)
    assert old_params["blocks"]["ffn"]["w_gate"].shape == (2, 64, 32)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), old_params, new_params))
    # Resumed one step further, both runs (the old one through the converted optimizer state) agree.
    more = config_lib.apply_overrides(cfg, ["train.steps=3"])
    for run in (old_run, new_run):
        Trainer(more, run, resume=True).run()
    old3, _, step = restore_params(old_run)
    new3, _, _ = restore_params(new_run)
    assert step == 3
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), old3, new3))
    assert not jnp.array_equal(old3["blocks"]["ffn"]["w_up"], old_params["blocks"]["ffn"]["w_up"])


def test_layer_unroll_auto_unrolls_only_where_no_sparse_op_kernel_runs():
    """"auto" (the default): a dense FFN (a twin's kind, or backend "dense") runs every layer in one
    iteration, the sparse op's kernels keep the loop; an int is kept as given; the CLI spelling
    parses; the start-up line says which; and the twin's lowered step has no loop left."""
    from twell_jax import config as config_lib
    from twell_jax.model import describe_execution
    assert ModelConfig().layer_unroll == "auto"
    resolved = {(kind, backend): dataclasses.replace(CFG, ffn_kind=kind, ffn_backend=backend).layers_per_iteration
                for kind in ("twell", "relu_gated", "swiglu") for backend in ("auto", "pallas", "reference", "dense")}
    assert resolved == {(kind, backend): 1 if kind == "twell" and backend != "dense" else 0
                        for kind, backend in resolved}
    assert dataclasses.replace(CFG, ffn_kind="relu_gated", layer_unroll=2).layers_per_iteration == 2
    assert dataclasses.replace(CFG, layer_unroll=0).layers_per_iteration == 0
    from twell_jax.configs import get_config
    base = get_config("micro")
    assert config_lib.apply_overrides(base, ["model.layer_unroll=auto"]).model.layer_unroll == "auto"
    assert config_lib.apply_overrides(base, ["model.layer_unroll=3"]).model.layer_unroll == 3
    # A saved run may be resumed or evaluated with another loop (the same function, the same weights).
    assert "model.layer_unroll" in config_lib.RESUMABLE_FIELDS
    twin = dataclasses.replace(CFG, ffn_kind="relu_gated", layer_unroll="auto")
    assert "layers unrolled (no loop) (model.layer_unroll=auto)" in describe_execution(twin, seq_len=8)
    assert "layers in a loop (model.layer_unroll=auto)" in describe_execution(
        dataclasses.replace(CFG, ffn_backend="reference", ffn_interpret=False, layer_unroll="auto"), seq_len=8)

    def lowered(cfg: ModelConfig) -> str:
        graphdef, params = split_model(init_model(cfg, 0))

        def loss(params, tokens):
            return jnp.mean(apply_model(graphdef, params, tokens)[0])

        return jax.jit(jax.grad(loss)).lower(params, _tokens()).as_text()

    assert "stablehlo.while" not in lowered(twin)
    assert "stablehlo.while" in lowered(dataclasses.replace(twin, layer_unroll=1))
