"""The trainer's management of training "auto" hints: measured at start, restored on resume,
re-planned every train.auto_refresh_every steps with a recompile only when a decision changes.

On the CPU "auto" always runs dense (ops.pallas_forward.available() is False), so the refresh logic is
driven by a monkeypatched `ops.auto_decision`; the step compiled is the dense one either way, which
is what lets the loss trajectories of a rebuilt and a never-rebuilt run be compared exactly."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_train import FakeData, micro_cfg
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax import ops
from twell_jax.ops import planner
from twell_jax.config import DecodeConfig
from twell_jax.inference import decode_plan
from twell_jax.model import init_model, split_model
from twell_jax.training.hints import manages_auto_hints, run_hints, run_tail_hints
from twell_jax.training.plan_trial import PlanTrial
from twell_jax.training import planning
from twell_jax.training.planning import auto_decisions, measure_activity
from twell_jax.training.train import Hooks, Trainer


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_which_configs_the_trainer_manages():
    cfg = micro_cfg()
    assert manages_auto_hints(cfg.model)  # micro: twell, backend auto, no hint
    assert not manages_auto_hints(micro_cfg("model.ffn_expected_active=[1.0, 2.0]").model)
    assert not manages_auto_hints(micro_cfg("model.ffn_backend=dense").model)
    assert not manages_auto_hints(micro_cfg("model.ffn_kind=relu_gated", "sparsity.l1_coef=0").model)
    hinted_op = dataclasses.replace(cfg.model, ffn_op_config={"expected_active_per_token": 3.0})
    assert not manages_auto_hints(hinted_op)
    with pytest.raises(ValueError, match="train.auto_refresh_every"):
        micro_cfg("train.auto_refresh_every=-1")


def test_auto_decision_is_the_ops_plan(monkeypatch):
    """ops.auto_decision reports what _plan compiles: dense on the CPU; on a (pretended) GPU, the
    training cost model's choice, or the decode path at decode sizes."""
    from twell_jax.ops import pallas_backward, pallas_forward, planner

    shape = (16384, 2048, 5632, 2)
    assert ops.auto_decision(True, ops.SparseFFNConfig(expected_active_per_token=29.0), shape) == ("dense", "dense")
    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    for hint in (0.0, 29.0, 112.0, 2816.0):
        config = ops.SparseFFNConfig(expected_active_per_token=hint)
        fwd, bwd = planner.choose_training_path(
            *shape[:3], hint, True, itemsize=2,
            keep_pattern=(config.backward or pallas_backward.BackwardConfig()).keep_gate_pattern)
        expected = ("pallas" if fwd else "dense", "pallas" if bwd else "dense")
        if planner.prefer_decode_path(*shape[:3], hint, True, itemsize=2,
                                            check_finite=config.check_finite):
            expected = ("decode", "dense")  # so few actives that the decode path wins even here
        assert ops.auto_decision(True, config, shape) == expected, hint
    assert ops.auto_decision(True, ops.SparseFFNConfig(expected_active_per_token=2816.0), shape) == ("dense", "dense")
    decode_shape = (1, 2048, 5632, 2)
    unchecked = ops.SparseFFNConfig(expected_active_per_token=29.0, check_finite=False)
    assert planner.prefer_decode_path(1, 2048, 5632, 29.0, True, itemsize=2)
    assert ops.auto_decision(True, unchecked, decode_shape) == ("decode", "dense")
    # With the NaN/Inf pass (the default), which reads every weight: the dense formula.
    assert ops.auto_decision(True, ops.SparseFFNConfig(expected_active_per_token=29.0), decode_shape) == (
        "dense", "dense")


def test_fresh_run_takes_its_hints_from_the_first_batch(tmp_path):
    cfg = micro_cfg("train.steps=1")
    trainer = Trainer(cfg, tmp_path, data_builder=FakeData)
    result = trainer.run()
    # Independently: the initial params on the first micro-batch of the first training batch.
    graphdef, params = split_model(init_model(cfg.model, cfg.train.seed))
    first = next(FakeData(cfg).train_iter)["tokens"][:cfg.train.micro_batch]
    expected, expected_tails = measure_activity(graphdef, params, jnp.asarray(first), tails=True)
    assert 0 < min(expected) and max(expected) < cfg.model.d_ff  # a real measurement, not a default
    hints = result.last_metrics["auto_hints_per_layer"]
    np.testing.assert_allclose(hints, expected, rtol=1e-6)
    # The tail hints: measured on the same micro-batch. A fresh model fires ~half its neurons on
    # every token, so every neuron is hot; no token exceeds the ELL width (128 > d_ff 64).
    tails = result.last_metrics["auto_tail_hints_per_layer"]
    np.testing.assert_allclose(tails, expected_tails, rtol=1e-6)
    assert len(tails) == cfg.model.n_layers and all(t[0] == 0.0 and t[1] > 0.5 for t in tails)
    assert trainer.step_builds == 1
    assert _records(tmp_path)[0]["auto_hints_per_layer"] == hints
    # The checkpoint's config carries the hints in use; config.json stays the user's (no hints),
    # which is how a resume knows the trainer manages them.
    _, meta, _ = ckpt_lib.restore_params_with_meta(tmp_path, 1)
    assert meta["config"]["model"]["ffn_expected_active"] == hints and meta["auto_hints"] == hints
    assert meta["config"]["model"]["ffn_expected_tails"] == tails
    assert ckpt_lib.load_run_config(tmp_path).model.ffn_expected_active == ()
    # A run with a user hint is left alone: its step compiles with the user's config as it is.
    fixed = Trainer(micro_cfg("train.steps=1", "model.ffn_expected_active=[1.0, 2.0]"), tmp_path / "fixed",
                    data_builder=FakeData, hooks=Hooks(save_final=False))
    assert not fixed.planner.active and fixed.planner.step_cfg is fixed.cfg


def test_refresh_recompiles_only_when_a_decision_changes(tmp_path, monkeypatch):
    flip = {"sparse": False}  # the pretended cost model: every layer dense until the hook flips it

    def fake_decision(gated, config, shape, interpret=False):
        assert config.expected_active_per_token is not None
        return ("pallas", "dense") if flip["sparse"] else ("dense", "dense")

    monkeypatch.setattr(ops, "auto_decision", fake_decision)

    def flip_after_step_2(record):
        if record["step"] == 2:
            flip["sparse"] = True

    # auto_trial_steps=0: no A/B of the sparse plan here (tested below), so builds count plans only.
    changing = Trainer(micro_cfg("train.steps=4", "train.auto_refresh_every=1", "train.auto_trial_steps=0"),
                       tmp_path / "a",
                       data_builder=FakeData,
                       hooks=Hooks(on_step=flip_after_step_2, save_final=False))
    a = changing.run()
    flip["sparse"] = False
    steady = Trainer(micro_cfg("train.steps=4", "train.auto_refresh_every=1", "train.auto_trial_steps=0"),
                     tmp_path / "b",
                     data_builder=FakeData, hooks=Hooks(save_final=False))
    b = steady.run()

    # Unchanged decisions: the l0 moves every step, yet the hints compiled in and the step stay.
    b_records = _records(tmp_path / "b")
    assert b_records[0]["l0_per_layer"] != b_records[1]["l0_per_layer"]
    assert all(r["auto_hints_per_layer"] == b_records[0]["auto_hints_per_layer"] for r in b_records)
    assert steady.step_builds == 1 and b.summary["step_builds"] == 1
    # A changed decision at step 2: one rebuild, with step 2's l0 as the new hints from step 3 on.
    a_records = _records(tmp_path / "a")
    assert changing.step_builds == 2
    assert changing.planner.decisions == (("pallas", "dense"),) * 2
    assert a_records[1]["auto_hints_per_layer"] == a_records[0]["auto_hints_per_layer"]
    assert a_records[2]["auto_hints_per_layer"] == pytest.approx(a_records[1]["l0_per_layer"])
    assert a_records[3]["auto_hints_per_layer"] == a_records[2]["auto_hints_per_layer"]
    # ... and step 2's tail shares as the new tail hints.
    shares = [a_records[1][f"{key}_per_layer"] for key in ops.TAIL_SHARE_KEYS]
    np.testing.assert_allclose(a_records[2]["auto_tail_hints_per_layer"], np.transpose(shares), rtol=1e-6)
    # Same params, same batches: the rebuild leaves the loss trajectory exactly as it was.
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    assert [r["grad_norm"] for r in a.history] == [r["grad_norm"] for r in b.history]


def test_resume_measures_hints_on_the_trained_parameters(tmp_path):
    cfg = micro_cfg("train.steps=2", "train.auto_refresh_every=0")
    first = Trainer(cfg, tmp_path, data_builder=FakeData).run()
    saved = first.last_metrics["auto_hints_per_layer"]  # measured on the initial parameters
    resumed = Trainer(micro_cfg("train.steps=3", "train.auto_refresh_every=0"), tmp_path, resume=True,
                      data_builder=FakeData)
    result = resumed.run()
    # The resumed run measures on the parameters it restored (step 2), on the first micro-batch of
    # the batch it trains next (FakeData's batch 2), as a fresh run does on its initial ones.
    params, _, _ = ckpt_lib.restore_params(tmp_path, step=2)
    tokens = FakeData(cfg).train_iter
    tokens.set_state({"step": 2})
    dense = dataclasses.replace(cfg.model, ffn_backend="dense")
    hints, tails = measure_activity(planning.abstract_graphdef(dense, cfg.train.seed), params,
                                    next(tokens)["tokens"][:cfg.train.micro_batch], tails=True)
    assert result.last_metrics["step"] == 3
    np.testing.assert_allclose(result.last_metrics["auto_hints_per_layer"], hints, rtol=1e-6)
    np.testing.assert_allclose(result.last_metrics["auto_tail_hints_per_layer"], tails, rtol=1e-6)
    assert result.last_metrics["auto_hints_per_layer"] != saved
    saved_tails = first.last_metrics["auto_tail_hints_per_layer"]
    assert run_tail_hints(tmp_path, 2, n_layers=2) == tuple(tuple(t) for t in saved_tails)
    # Evaluation and inference read the hints a checkpoint was compiled with, not later telemetry.
    assert run_hints(tmp_path, 2) == tuple(saved)
    assert run_hints(tmp_path) == tuple(result.last_metrics["auto_hints_per_layer"])
    # A checkpoint without hints (older runs): the last l0 logged in metrics.jsonl (validation or
    # training) and the last tail shares logged, up to the checkpoint's step.
    step_3 = [r for r in _records(tmp_path) if r["step"] == 3][0]
    logged_tails = run_tail_hints(tmp_path, n_layers=2, meta={"step": 3})
    np.testing.assert_allclose(logged_tails, np.transpose([step_3[f"{k}_per_layer"] for k in ops.TAIL_SHARE_KEYS]))
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])  # the final validation
    assert list(run_hints(tmp_path, meta={"step": 3})) == last["val_l0_per_layer"]
    step_1 = [r for r in _records(tmp_path) if r["step"] == 1][0]
    assert run_hints(tmp_path, 1, meta={"step": 1}) == tuple(step_1["l0_per_layer"])
    assert auto_decisions(resumed.cfg, saved, 1) == (("dense", "dense"),) * 2  # CPU: "auto" is dense


def test_refresh_decides_from_the_mean_l0_since_the_last_refresh(tmp_path, monkeypatch):
    """One re-plan per refresh, from the mean of the steps since the previous one (hysteresis: a
    single noisy step does not decide), with one auto_decisions call per refresh."""
    trainer = Trainer(micro_cfg("train.steps=4", "train.auto_refresh_every=2"), tmp_path,
                      data_builder=FakeData, hooks=Hooks(save_final=False))
    planner = trainer.planner
    planner.use_hints([10.0, 10.0], None, (("dense", "dense"),) * 2)
    asked = []

    def fake_decisions(cfg, hints, num_devices, tails=None):
        asked.append((list(hints), tails))
        return tuple(("pallas" if h < 5 else "dense", "dense") for h in hints)

    monkeypatch.setattr(planning, "auto_decisions", fake_decisions)

    def step(l0, token_tail):
        return {"l0_per_layer": l0, "token_tail_share_per_layer": token_tail,
                "hot_neuron_share_per_layer": [0.5, 0.5], "hot_entry_share_per_layer": [0.25, 0.75]}

    for l0, tail in (([2.0, 20.0], [0.0, 0.2]), ([12.0, 20.0], [0.1, 0.4])):  # one sparse-looking step; the
        planner.observe(step(l0, tail))                                        # mean (7, 20) stays dense
    assert not planner.refresh_hints(2, print)
    assert asked == [([7.0, 20.0], ((0.05, 0.5, 0.25), (pytest.approx(0.3), 0.5, 0.75)))]
    for l0 in ([3.0, 20.0], [1.0, 18.0]):  # only the steps since the last refresh count
        planner.observe(step(l0, [0.0, 0.0]))
    assert planner.refresh_hints(4, print) and asked[1][0] == [2.0, 19.0]
    assert planner.auto_hints == (2.0, 19.0) and planner.decisions == (("pallas", "dense"), ("dense", "dense"))
    assert planner.auto_tails == ((0.0, 0.5, 0.25), (0.0, 0.5, 0.75))
    assert planner.step_cfg.model.ffn_expected_tails == planner.auto_tails
    # A step without tail shares (a run that does not track neurons): l0 alone, no tail hints.
    planner.observe({"l0_per_layer": [1.0, 1.0]})
    planner.refresh_hints(5, print)
    assert asked[-1] == ([1.0, 1.0], None)


# ---------------------------------------------------------------------------------------------
# the A/B of a sparse plan against the dense program (training/plan_trial.py)
# ---------------------------------------------------------------------------------------------

def test_plan_trial_arms_warmup_and_verdict():
    trial = PlanTrial(2)
    arms = []
    for seconds in (9.0, 1.0, 1.2, 9.0, 1.1, 1.3):  # the first step of each arm is warm-up
        arms.append(trial.arm())
        trial.add(seconds)
    assert arms == ["auto"] * 3 + ["dense"] * 3 and trial.decided and trial.arm() is None
    assert trial.medians() == {"auto": pytest.approx(1.1), "dense": pytest.approx(1.2)}
    assert trial.verdict() == "auto" and trial.speed_ratio() == pytest.approx(1.2 / 1.1)
    slower = PlanTrial(1)
    for seconds in (0.0, 1.0, 0.0, 0.97):  # auto at 0.97x dense: under the 0.98 floor
        slower.add(seconds)
    assert slower.verdict() == "dense"
    within = PlanTrial(1)
    for seconds in (0.0, 1.0, 0.0, 0.99):  # 0.99x: within the floor, the plan is kept
        within.add(seconds)
    assert within.verdict() == "auto"
    with pytest.raises(RuntimeError):
        within.add(1.0)
    with pytest.raises(RuntimeError):
        PlanTrial(1).medians()
    with pytest.raises(ValueError, match="steps"):
        PlanTrial(0)
    with pytest.raises(ValueError, match="floor"):
        PlanTrial(1, floor=1.5)
    with pytest.raises(ValueError, match="train.auto_trial_steps"):
        micro_cfg("train.auto_trial_steps=-1")


_REAL_ADD = PlanTrial.add  # before any test patches it


def _trial_run(tmp_path, monkeypatch, name, seconds_per_arm, *overrides):
    """A micro run whose plan is (pretended) sparse in every layer, with each trial step's time
    replaced by `seconds_per_arm[arm]` (CPU timings would decide nothing)."""
    monkeypatch.setattr(ops, "auto_decision", lambda gated, config, shape, interpret=False: ("pallas", "dense"))

    def add(trial, seconds):
        _REAL_ADD(trial, seconds_per_arm[trial.arm()])

    monkeypatch.setattr(PlanTrial, "add", add)
    trainer = Trainer(micro_cfg(*overrides), tmp_path / name, data_builder=FakeData,
                      hooks=Hooks(save_final=False), echo=lambda _: None)
    return trainer, trainer.run()


def test_trial_runs_dense_when_the_plan_is_slower(tmp_path, monkeypatch):
    trainer, result = _trial_run(tmp_path, monkeypatch, "slow", {"auto": 2.0, "dense": 1.0},
                                 "train.steps=7", "train.auto_trial_steps=2", "train.auto_refresh_every=0")
    plans = [r["ffn_plan"] for r in _records(tmp_path / "slow")]
    assert plans == ["auto"] * 3 + ["dense"] * 4  # 3 timed-or-warm-up steps per arm, then the verdict
    assert trainer.step_builds == 2 and trainer.planner.plan_in_use == "dense"
    (trial,) = result.summary["auto_plan_trials"]
    assert trial["kept"] == "dense" and trial["step"] == 6 and trial["auto_vs_dense"] == pytest.approx(0.5)
    assert result.summary["ffn_plan_in_use"] == "dense"
    # Both arms are ordinary training steps: the run equals one without the trial (on the CPU both
    # programs are the dense formula: losses bit for bit; the gradient norm is a sum XLA may order
    # differently in the two compiled programs: to f32 rounding).
    plain = Trainer(micro_cfg("train.steps=7", "train.auto_trial_steps=0", "train.auto_refresh_every=0"),
                    tmp_path / "plain", data_builder=FakeData, hooks=Hooks(save_final=False)).run()
    assert [r["loss"] for r in result.history] == [r["loss"] for r in plain.history]
    assert [r["grad_norm"] for r in result.history] == pytest.approx([r["grad_norm"] for r in plain.history],
                                                                     rel=1e-6)


def test_trial_keeps_a_plan_within_the_floor_and_rechecks_a_dense_verdict(tmp_path, monkeypatch):
    _, kept = _trial_run(tmp_path, monkeypatch, "kept", {"auto": 1.0, "dense": 0.99},
                         "train.steps=6", "train.auto_trial_steps=1", "train.auto_refresh_every=0")
    assert [r["ffn_plan"] for r in _records(tmp_path / "kept")] == ["auto"] * 2 + ["dense"] * 2 + ["auto"] * 2
    assert kept.summary["auto_plan_trials"][0]["kept"] == "auto"
    # A dense verdict is checked again at the next re-plan (decisions unchanged: no recompile of
    # the plan; the dense program is compiled once per run).
    trainer, again = _trial_run(tmp_path, monkeypatch, "again", {"auto": 2.0, "dense": 1.0},
                                "train.steps=10", "train.auto_trial_steps=1", "train.auto_refresh_every=5")
    assert [r["ffn_plan"] for r in _records(tmp_path / "again")] == (
        ["auto"] * 2 + ["dense"] * 2 + ["dense"] + ["auto"] * 2 + ["dense"] * 3)
    assert [t["step"] for t in again.summary["auto_plan_trials"]] == [4, 9]
    assert trainer.step_builds == 2


# ---------------------------------------------------------------------------------------------
# the tail hints: telemetry of the sparse backward's dense tails, for any plan
# ---------------------------------------------------------------------------------------------

def test_backward_tail_shares_against_numpy():
    rng = np.random.default_rng(0)
    tokens_BxS = rng.integers(0, 12, size=(3, 40))
    neurons_H = rng.integers(0, 90, size=(50,))
    config = ops.SparseFFNConfig(tile=16, slots=8, ell_width=6, transpose_ell_width=1 / 4)
    out = jax.device_get(ops.backward_tail_shares(jnp.asarray(tokens_BxS), jnp.asarray(neurons_H), config))
    hot = neurons_H > config.hot_threshold(120)  # 32: the floor (120 / 4 = 30)
    assert 0 < hot.sum() < hot.size and 0 < (tokens_BxS > 6).sum() < tokens_BxS.size
    np.testing.assert_allclose(out["token_tail_share"], np.mean(tokens_BxS > 6), rtol=1e-6)
    np.testing.assert_allclose(out["hot_neuron_share"], np.mean(hot), rtol=1e-6)
    np.testing.assert_allclose(out["hot_entry_share"], neurons_H[hot].sum() / neurons_H.sum(), rtol=1e-6)
    # No entries at all: shares of 0, not NaN.
    empty = jax.device_get(ops.backward_tail_shares(jnp.zeros((2, 3), jnp.int32), jnp.zeros((5,), jnp.int32), config))
    assert all(float(v) == 0.0 for v in empty.values())
    # Over a data-parallel mesh each shard's call has M / shards tokens and ~count / shards entries.
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        sharded = jax.device_get(ops.backward_tail_shares(jnp.asarray(tokens_BxS), jnp.asarray(neurons_H), config))
    hot_2 = neurons_H / 2 > config.hot_threshold(60)
    assert hot_2.sum() != hot.sum()
    np.testing.assert_allclose(sharded["hot_neuron_share"], np.mean(hot_2), rtol=1e-6)


def test_the_models_tail_shares_are_the_ops_counts(tmp_path):
    """The model's per-layer shares (track_neurons) are backward_tail_shares of each layer's counts,
    the same for the dense and the reference backend (a backend never changes a count). The op
    config puts the ELL width and the hot threshold inside the fresh model's range (~32 of 64
    neurons per token, each neuron on ~half the tokens), so no share is trivially 0 or 1."""
    from twell_jax.model import apply_model

    cfg = micro_cfg('model.ffn_op_config={"ell_width": 32, "transpose_ell_width": 16}')
    graphdef, params = split_model(init_model(cfg.model, cfg.train.seed))
    tokens = jnp.asarray(next(FakeData(cfg).train_iter)["tokens"][:2, :-1])
    _, aux = apply_model(graphdef, params, tokens, track_neurons=True)
    for key in ops.TAIL_SHARE_KEYS:
        assert aux[key].shape == (cfg.model.n_layers,)
    # Layer by layer from the counts the model reports.
    for layer in range(cfg.model.n_layers):
        counts_H = np.asarray(aux["neuron_active_count"][layer])
        hot = counts_H > 16
        np.testing.assert_allclose(aux["hot_neuron_share"][layer], hot.mean(), rtol=1e-6)
        np.testing.assert_allclose(aux["hot_entry_share"][layer], counts_H[hot].sum() / counts_H.sum(), rtol=1e-6)
        assert 0 < float(aux["hot_neuron_share"][layer]) < 1
        assert 0 < float(aux["token_tail_share"][layer]) < 1
    ref = dataclasses.replace(cfg.model, ffn_backend="reference")
    graphdef_ref = split_model(init_model(ref, cfg.train.seed))[0]
    _, aux_ref = apply_model(graphdef_ref, params, tokens, track_neurons=True)
    for key in ops.TAIL_SHARE_KEYS:
        np.testing.assert_allclose(aux_ref[key], aux[key], rtol=1e-6)


def test_tail_hints_reach_each_layers_op_config_and_are_validated():
    from twell_jax.model import build_op_config

    tails = ((0.1, 0.02, 0.5), (0.0, 0.0, 0.0))
    cfg = micro_cfg()
    model = dataclasses.replace(cfg.model, ffn_expected_active=(3.0, 4.0), ffn_expected_tails=tails)
    op = build_op_config(model, 0)
    assert (op.expected_token_tail, op.expected_hot_neurons, op.expected_hot_entries) == tails[0]
    assert build_op_config(model, 1).expected_active_per_token == 4.0
    # One setting in ffn_op_config wins for every layer, as for the active-count hint.
    fixed = dataclasses.replace(model, ffn_op_config={"expected_token_tail": 0.3})
    assert build_op_config(fixed, 0).expected_token_tail == 0.3 and build_op_config(fixed, 0).expected_hot_neurons is None
    # A JSON config's lists become tuples; wrong lengths and shares are named.
    assert dataclasses.replace(cfg.model, ffn_expected_tails=[[0.1, 0.2, 0.3]] * 2).ffn_expected_tails == ((0.1, 0.2, 0.3),) * 2
    for bad in (((0.1, 0.2, 0.3),), ((0.1, 0.2), (0.1, 0.2)), ((0.1, 0.2, 1.5),) * 2):
        with pytest.raises(ValueError, match="model.ffn_expected_tails"):
            dataclasses.replace(cfg.model, ffn_expected_tails=bad)


@pytest.mark.parametrize("m", [2, 8, 64])
def test_the_decode_union_limit_is_the_decode_paths_break_even(m):
    """Below the limit the decode model's time at that union beats dense by the margin, above it not;
    and a hint whose expected union is under it is one prefer_decode_path takes."""
    d, h = 2048, 5632
    limit = planner.decode_union_limit(m, d, h)
    assert 0 < limit < h
    dense = planner.DECODE_MARGIN * planner.dense_time_us(m, d, h, gated=True)
    assert planner._decode_time_at_union(m, d, h, limit, True, 2, None) <= dense
    assert planner._decode_time_at_union(m, d, h, limit + 1, True, 2, None) > dense
    k = 1.0
    while planner.expected_union(m, k * 1.1, h) <= limit:
        k *= 1.1
    assert planner.prefer_decode_path(m, d, h, k, True)


def test_measured_shares_a_rounding_past_one_are_clipped_and_accepted():
    """The planner's mean tail shares are fp32 sums over steps divided by the step count: shares of
    1.0 can come back a hair above 1, which ModelConfig refused (`twell train --config 2b` failed at
    its first re-plan). Within rounding they are clipped; a real out-of-range value is still refused."""

    from twell_jax.configs import get_config
    from twell_jax.training.hints import normalise_tails, with_hints

    steps = np.float32(3)
    summed = np.array([[1.0, 0.99893469, 0.99997538]] * 2, np.float32) * steps + np.float32(1e-6)
    tails = normalise_tails(summed / steps)
    assert max(max(t) for t in tails) == 1.0 and min(min(t) for t in tails) > 0.99
    assert normalise_tails([[-1e-7, 0.5, 1.00001]]) == ((0.0, 0.5, 1.0),)
    cfg = get_config("micro")
    hinted = with_hints(cfg, [3.0] * cfg.model.n_layers, [(1.0000001, 1.0, 0.5)] * cfg.model.n_layers)
    assert hinted.model.ffn_expected_tails[0] == (1.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="ffn_expected_tails must be empty or"):
        with_hints(cfg, [3.0] * cfg.model.n_layers, [(1.5, 1.0, 0.5)] * cfg.model.n_layers)


def test_several_decode_rows_plan_the_twins_products_where_the_switch_never_pays(monkeypatch):
    """The model's decode step at batch > 1 pays for its device-side dense switch on the sparse side
    (measured on the H100 at batch 8: ~40 us a sparse layer against 34.4 for the dense products);
    where the cost model (with `decode_switch_us`) finds no union at which the sparse side wins,
    "auto" plans the layer's dense products statically; one row keeps the sparse kernels."""
    from flax import nnx

    from twell_jax.config import ModelConfig
    from twell_jax.ops import backends

    d, h = 2048, 5632
    assert planner.decode_union_limit(8, d, h, device_switch=True) == 0 < planner.decode_union_limit(8, d, h)
    switch = planner.costs().decode.decode_switch_us
    assert (planner._decode_time_at_union(8, d, h, 100, True, 2, None, device_switch=True)
            == pytest.approx(planner._decode_time_at_union(8, d, h, 100, True, 2, None) + switch))
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    cfg = ModelConfig(vocab_size=256, d_model=d, n_layers=2, n_heads=32, d_ff=h, max_seq_len=32, ffn_kind="twell",
                      ffn_backend="auto", ffn_expected_active=(29.0, 29.0), compute_dtype="bfloat16",
                      ffn_op_config={"check_finite": False})
    model = nnx.eval_shape(lambda: init_model(cfg, 0))

    def layer_sparse(m, rows):
        return decode_plan.layer_sparse(m, DecodeConfig(), rows, jnp.bfloat16)

    assert layer_sparse(model, 1) == (True, True)
    assert layer_sparse(model, 8) == (False, False)
    forced = nnx.eval_shape(lambda: init_model(dataclasses.replace(cfg, ffn_backend="pallas"), 0))
    assert layer_sparse(forced, 8) == (True, True)  # a backend the user forced stands
    # Where some union pays (64 rows), a layer whose hint makes the expected union larger than the
    # switch's limit plans the dense products too (the switch would fall back on most steps, after
    # reading the gate's weights once more); a sparser one keeps the sparse kernels behind the switch.
    limit = planner.decode_union_limit(64, d, h, device_switch=True)
    mixed = nnx.eval_shape(lambda: init_model(dataclasses.replace(cfg, ffn_expected_active=(5.0, 0.5)), 0))
    assert planner.expected_union(64, 0.5, h) <= limit < planner.expected_union(64, 5.0, h)
    # (the op's own plan, which prices no switch, would run the first layer sparse)
    assert ops.decode_forward_is_sparse(True, "auto", mixed.op_configs[0], 64, d, h, 2)
    assert layer_sparse(mixed, 64) == (False, True)
    assert layer_sparse(mixed, 1) == (True, True)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_the_packed_union_limit_is_packeds_break_even(m):
    """decode_union_limit(way="packed"): below it "packed" (with its switch) beats dense by the
    margin, above it not; it shrinks as the rows grow (the values epilogue runs them one after
    another), and a union up to packed_free_union costs the same as none."""
    d, h = 2048, 5632
    c = planner.costs().decode
    limit = planner.decode_union_limit(m, d, h, device_switch=True, way="packed")
    dense = planner.DECODE_MARGIN * planner.dense_time_us(m, d, h, gated=True)
    assert c.packed_free_union < limit < h
    assert planner.packed_time_us(m, d, h, limit, device_switch=True) <= dense
    assert planner.packed_time_us(m, d, h, limit + 1, device_switch=True) > dense
    assert planner.packed_time_us(m, d, h, 0.0) == planner.packed_time_us(m, d, h, c.packed_free_union)
    assert (planner.packed_time_us(m, d, h, 50.0, device_switch=True)
            == pytest.approx(planner.packed_time_us(m, d, h, 50.0) + c.packed_switch_us))
    if m > 1:
        assert limit < planner.decode_union_limit(m // 2, d, h, device_switch=True, way="packed")
    # The plain (not gated) FFN reads no W_up rows: each neuron above the free union costs half.
    def slope(gated):
        return (planner.packed_time_us(m, d, h, 200.0, gated=gated)
                - planner.packed_time_us(m, d, h, 100.0, gated=gated))
    assert slope(False) == pytest.approx(slope(True) / 2)
    # No budget at all (a tiny FFN, whose fixed costs exceed the dense time): 0, the dense products.
    assert planner.decode_union_limit(m, 64, 128, device_switch=True, way="packed") == 0
    with pytest.raises(ValueError, match="way must be"):
        planner.decode_union_limit(m, d, h, way="packd")


def test_a_few_rows_plan_packed_where_its_expected_union_is_within_its_limit(monkeypatch):
    """"auto" at 2 to decode_plan.PACKED_MAX_ROWS rows runs a sparse layer "packed" where the union
    expected from its hint is within packed's own limit (its cost model, not the older ways',
    which no union pays at these rows), the twin's products where it is not; above
    PACKED_MAX_ROWS the other ways' plans (here: dense, the switch never pays)."""
    from flax import nnx

    from twell_jax.config import ModelConfig
    from twell_jax.ops import backends

    d, h = 2048, 5632
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    cfg = ModelConfig(vocab_size=256, d_model=d, n_layers=3, n_heads=32, d_ff=h, max_seq_len=32, ffn_kind="twell",
                      ffn_backend="auto", ffn_expected_active=(10.0, 60.0, 146.0), compute_dtype="bfloat16",
                      ffn_op_config={"check_finite": False})
    model = nnx.eval_shape(lambda: init_model(cfg, 0))

    def ways(rows):
        return decode_plan.layer_ways(model, DecodeConfig(), rows, jnp.bfloat16)

    limit4 = planner.decode_union_limit(4, d, h, device_switch=True, way="packed")
    assert (decode_plan.union_limit(model, 4, "packed", 2) == decode_plan.union_limit(model, 4, "packed_down", 2)
            == limit4)
    assert planner.expected_union(4, 10.0, h) <= limit4 < planner.expected_union(4, 60.0, h)
    assert ways(1) == ("packed_down",) * 3  # one row: no union limit
    limit2 = planner.decode_union_limit(2, d, h, device_switch=True, way="packed")
    assert decode_plan.union_limit(model, 2, "packed_down", 2) == limit2  # "packed_down" (2 rows) shares the limit
    assert planner.expected_union(2, 60.0, h) <= limit2 < planner.expected_union(2, 146.0, h)
    assert ways(2) == ("packed_down", "packed_down", "dense")
    assert ways(4) == ("packed", "dense", "dense")
    assert decode_plan.PACKED_MAX_ROWS == 4
    assert ways(5) == ("dense",) * 3


def test_activity_by_position_buckets_and_the_mean_of_a_row_length():
    """The bucket profile of a per-position count, and the hint of rows of S tokens it gives: the
    exact mean over positions [0, S) where each bucket is flat; buckets past the measured length
    repeat the last one; refusals name the argument."""
    assert planner.position_buckets(16) == [0, 1, 2, 4, 8, 16] and planner.position_buckets(1) == [0, 1]
    counts_LxS = np.array([[100.0, 40.0, 10.0, 10.0, 5.0, 5.0, 5.0, 5.0],
                           [1.0, 2.0, 3.0, 5.0, 7.0, 7.0, 7.0, 9.0]])
    profile = planner.active_by_position(counts_LxS, 16)  # measured on 8 positions, max_seq_len 16
    assert profile == ((100.0, 40.0, 10.0, 5.0, 5.0), (1.0, 2.0, 4.0, 7.5, 7.5))
    for layer, row in enumerate(profile):
        for s in (1, 2, 4, 8):  # a flat bucket's mean is its positions' mean: exact up to 8
            assert planner.active_for_length(row, s, 16) == pytest.approx(counts_LxS[layer, :s].mean())
    assert planner.active_for_length(profile[0], 16, 16) == pytest.approx((100 + 40 + 20 + 20 + 40) / 16)
    with pytest.raises(ValueError, match="profile must have 5 buckets"):
        planner.active_for_length(profile[0][:4], 4, 16)
    with pytest.raises(ValueError, match="seq_len must be in"):
        planner.active_for_length(profile[0], 17, 16)
    with pytest.raises(ValueError, match="position_active_LxS"):
        planner.active_by_position(np.zeros((2, 32)), 16)


def test_rows_of_each_length_plan_with_their_own_hint():
    """With a profile by position (first tokens far denser), short rows get a hint above the cutoff
    (dense) and long rows one below it (sparse): the layer groups' plans differ by row length; a
    hint in ffn_op_config wins for every length; decode steps (no length) keep the whole-length
    hints; the config checks the profile's shape and values."""
    from twell_jax.model import Transformer, build_op_config
    from flax import nnx

    cfg = micro_cfg()
    n = len(planner.position_buckets(cfg.model.max_seq_len)) - 1
    profile = ((60.0, 30.0) + (1.0,) * (n - 2),) * cfg.model.n_layers
    model_cfg = dataclasses.replace(cfg.model, ffn_backend="auto", ffn_expected_active=(2.0,) * cfg.model.n_layers,
                                    ffn_active_by_position=[list(row) for row in profile],  # JSON lists
                                    ffn_op_config={"auto_max_active": 10.0})
    assert model_cfg.ffn_active_by_position == profile
    assert build_op_config(model_cfg, 0, 2).expected_active_per_token == 45.0
    assert build_op_config(model_cfg, 0).expected_active_per_token == 2.0  # no length: the hints
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    short = model.op_configs_for(3)  # the longest kept length not above 3: 2
    assert short[0].expected_active_per_token == 45.0
    assert model.op_configs_for(None) == model.op_configs
    long_hint = planner.active_for_length(profile[0], cfg.model.max_seq_len, cfg.model.max_seq_len)
    assert model.op_configs_for(cfg.model.max_seq_len)[0].expected_active_per_token == pytest.approx(long_hint)
    assert long_hint < 10.0
    key = lambda s: ops.plan_key(True, "auto", model.op_configs_for(s)[0], (8 * s, 64, 128, 4), False)
    assert key(2) != key(cfg.model.max_seq_len)
    fixed = dataclasses.replace(model_cfg, ffn_op_config={"expected_active_per_token": 7.0})
    assert build_op_config(fixed, 0, 2).expected_active_per_token == 7.0
    for bad in (profile[:1], ((1.0,) * (n - 1),) * cfg.model.n_layers, ((-1.0,) * n,) * cfg.model.n_layers):
        with pytest.raises(ValueError, match="model.ffn_active_by_position"):
            dataclasses.replace(cfg.model, ffn_active_by_position=bad)
