"""Per-layer sparsity targets (`sparsity.target_active`): the adaptation of each layer's L1 factor
(training/loss.py), its config checks, a micro run steered by it (CPU) whose state resumes bit for
bit, and train_to_sparse's profile recipe."""
from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import config as config_lib
from twell_jax.bench import train_to_sparse
from twell_jax.configs import get_config
from twell_jax.training import loss
from twell_jax.training.train import Hooks, Trainer


def test_total_loss_per_layer_coefficients_and_the_scalar_form_unchanged():
    l1 = jnp.array([2.0, 6.0])
    assert float(loss.total_loss(jnp.float32(1.0), l1, jnp.float32(0.5))) == 1.0 + 0.5 * 4.0
    assert float(loss.total_loss(jnp.float32(1.0), l1, jnp.array([1.0, 0.25]))) == pytest.approx(1.0 + (2.0 + 1.5) / 2)


def test_the_adaptation_moves_each_layer_towards_its_target_without_wind_up():
    control = loss.l1_control_init(3)
    targets = jnp.array([10.0, 10.0, 40.0])
    # All layers far above their targets (the schedule still ramping): the shape moves (layer 0 the
    # furthest above: the largest factor), the level stays at the schedule's lambda.
    control = loss.adapt_l1_control(control, jnp.array([200.0, 50.0, 50.0]), targets, 0.1)
    shape = np.asarray(control["shape"])
    assert shape[0] > 0 > shape[2] and float(control["level"]) == 0.0
    assert abs(shape.mean()) < 1e-6
    for _ in range(500):  # no wind-up: the level never rises above 0, the shape stays bounded
        control = loss.adapt_l1_control(control, jnp.array([500.0, 500.0, 500.0]), targets, 0.1)
    assert float(control["level"]) == 0.0 and np.all(np.abs(np.asarray(control["shape"])) <= loss.L1_CONTROL_SHAPE_LIMIT + 1e-6)
    # Below target on average: the common level lowers every layer's penalty, down to its floor.
    low = loss.adapt_l1_control(loss.l1_control_init(3), jnp.array([1.0, 1.0, 4.0]), targets, 0.1)
    assert float(low["level"]) < 0.0
    for _ in range(2000):
        low = loss.adapt_l1_control(low, jnp.array([0.0, 0.0, 0.0]), targets, 0.1)
    assert float(low["level"]) == pytest.approx(loss.L1_CONTROL_LEVEL_FLOOR)
    coefs = loss.layer_l1_coefficients(jnp.float32(2.0), {"shape": jnp.array([0.0, np.log(2.0)]), "level": jnp.float32(0.0)})
    np.testing.assert_allclose(np.asarray(coefs), [2.0, 4.0], rtol=1e-6)


def test_moving_targets_go_from_half_the_neurons_to_the_targets_in_log_space():
    cfg = config_lib.apply_overrides(get_config("micro"), [
        "sparsity.target_active=3,15", "sparsity.target_approach_steps=100", "sparsity.l1_warmup_start=20",
        "sparsity.l1_warmup_end=50"]).sparsity
    at = lambda step: np.asarray(loss.moving_targets(cfg, 64, jnp.int32(step)))  # noqa: E731
    np.testing.assert_allclose(at(0), [32.0, 32.0], rtol=1e-6)  # d_ff 64: half the neurons
    np.testing.assert_allclose(at(20), [32.0, 32.0], rtol=1e-6)  # counted from l1_warmup_start
    np.testing.assert_allclose(at(120), [3.0, 15.0], rtol=1e-5)
    np.testing.assert_allclose(at(10_000), [3.0, 15.0], rtol=1e-5)
    halfway = np.log1p(at(70))
    np.testing.assert_allclose(halfway, (np.log1p(32.0) + np.log1p([3.0, 15.0])) / 2, rtol=1e-5)
    steps = np.stack([at(s) for s in range(0, 140, 7)])
    assert np.all(np.diff(steps, axis=0) <= 1e-5)  # never rising
    # A target above half the neurons starts where it is; N = 0 holds the targets from the start.
    high = dataclasses.replace(cfg, target_active=(40.0, 3.0))
    np.testing.assert_allclose(np.asarray(loss.moving_targets(high, 64, jnp.int32(0))), [40.0, 32.0], rtol=1e-6)
    still = dataclasses.replace(cfg, target_approach_steps=0)
    np.testing.assert_allclose(np.asarray(loss.moving_targets(still, 64, jnp.int32(0))), [3.0, 15.0])


def test_moving_targets_lower_the_penalty_while_the_layers_fall_below_them(tmp_path, data_cache_dir):
    # micro, 40 steps, L1 0.05 (which takes both layers to about one active neuron per token): against
    # targets moving over 200 steps (still 21-26 at step 40) the layers are far below, so the level
    # lowers the coefficients further than against the final targets (3 and 15): none higher, their
    # product (the common level) over 4x lower (measured: 0.0019 and 0.0015 against 0.0129 and 0.0016,
    # layer 1's near the shape's limit in both).
    coefs = {}
    for steps in (0, 200):
        records = []
        Trainer(_cfg(data_cache_dir, "train.steps=40", f"sparsity.target_approach_steps={steps}"),
                tmp_path / f"run{steps}", hooks=Hooks(on_step=records.append, save_final=False)).run()
        coefs[steps] = np.asarray(records[-1]["l1_coef_per_layer"])
    assert np.all(coefs[200] <= coefs[0] * 1.001) and np.prod(coefs[200]) < 0.25 * np.prod(coefs[0]), coefs


def test_one_target_is_every_layers():
    cfg = config_lib.apply_overrides(get_config("micro"), ["sparsity.target_active=7"])
    assert cfg.sparsity.target_active == (7, 7)  # micro: 2 layers
    assert config_lib.from_dict(json.loads(json.dumps(config_lib.to_dict(cfg)))) == cfg  # as config.json holds it


@pytest.mark.parametrize("sets, words", [
    (["sparsity.target_active=5,5,5"], "has 3 numbers; the model has model.n_layers=2"),
    (["sparsity.target_active=5,0"], "numbers > 0"),
    (["sparsity.target_active=5,65"], "65 active neurons per token in a layer of model.d_ff=64"),
    (["sparsity.target_active=5,5", "sparsity.l1_coef=0"], "needs an L1-regularised model"),
    (["sparsity.target_active=5,5", "sparsity.target_rate=0"], "sparsity.target_rate must be > 0"),
    (["sparsity.target_approach_steps=10"], "target_approach_steps moves the per-layer targets: it needs "
                                            "sparsity.target_active"),
    (["sparsity.target_active=5,5", "sparsity.target_approach_steps=-1"], "target_approach_steps must be >= 0"),
])
def test_bad_targets_are_refused_naming_the_field(sets, words):
    with pytest.raises(ValueError, match=words):
        config_lib.apply_overrides(get_config("micro"), sets)


def _cfg(data_cache_dir, *sets):
    return config_lib.apply_overrides(get_config("micro"), [
        f"data.cache_dir={data_cache_dir}", "model.ffn_backend=dense", "sparsity.l1_coef=0.05",
        "sparsity.target_active=3,15", "sparsity.target_rate=0.1", "train.log_every=1", *sets])


def test_a_run_is_steered_to_its_layer_targets(tmp_path, data_cache_dir):
    # micro on its stdlib corpus, 150 steps: at this L1 alone layer 1 ends the less active (measured:
    # 5.1 and 1.4 active neurons per token over the last 20 steps); with targets 3 and 15 the
    # adaptation takes the penalty off layer 1, which ends the more active (measured: 4.3 and 11.3).
    records = []
    Trainer(_cfg(data_cache_dir, "train.steps=150"), tmp_path / "run",
            hooks=Hooks(on_step=records.append, save_final=False)).run()
    coefs = np.array([r["l1_coef_per_layer"] for r in records])
    assert coefs.shape == (150, 2) and coefs[-1, 1] < 0.05 / 100 and coefs[-1, 1] < coefs[-1, 0] / 100
    active = np.array([r["l0_per_layer"] for r in records[-20:]]).mean(axis=0)
    assert active[1] > 2 * active[0] and active[1] > 7.0, active


def test_the_adaptation_state_is_checkpointed_and_resumes_bit_for_bit(tmp_path, data_cache_dir):
    cfg = _cfg(data_cache_dir, "train.steps=4", "train.checkpoint_every=2")
    full = Trainer(cfg, tmp_path / "full").run()
    Trainer(cfg, tmp_path / "split").run(stop_after_step=2)
    resumed = Trainer(cfg, tmp_path / "split", resume=True).run()
    assert [r["loss"] for r in full.history] == [r["loss"] for r in resumed.history]
    logged = [{r["step"]: r["l1_coef_per_layer"] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
               if "l1_coef_per_layer" in r} for path in (tmp_path / "full", tmp_path / "split")]
    assert sorted(logged[0]) == [1, 2, 3, 4] and logged[0] == logged[1]
    assert set(full.state["l1_control"]) == {"shape", "level"}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), full.state, resumed.state)


def test_layer_targets_follow_the_profile_over_depth():
    small = train_to_sparse.SMALL_STUDY_PROFILE
    same = train_to_sparse.layer_targets(small, 8, 39.0)
    np.testing.assert_allclose(same, np.asarray(small) * 39.0 / np.mean(small))
    deeper = train_to_sparse.layer_targets(small, 24, 29.0)
    assert len(deeper) == 24 and np.mean(deeper) == pytest.approx(29.0)
    assert deeper[-1] == max(deeper) and deeper[-1] > 1.5 * 29.0  # rising with depth, the last the most active
    assert train_to_sparse.layer_targets((1.0,), 3, 5.0) == (5.0, 5.0, 5.0)
    assert train_to_sparse.parse_profile("none") is None
    assert train_to_sparse.parse_profile("1,2.5") == (1.0, 2.5)
    for bad in ("1,0", "steep", "1,inf"):
        with pytest.raises(ValueError):
            train_to_sparse.parse_profile(bad)


def test_the_profile_criterion_needs_every_layer_within_tolerance():
    stop = train_to_sparse.ProfileReached((10.0, 20.0), tolerance=0.1, patience=2)
    said = [stop({"step": i, "ce": 1.0, "l0_per_layer": l0}) for i, l0 in
            enumerate([[10.5, 19.0], [12.0, 20.0], [9.5, 21.0], [10.0, 20.0]], start=1)]
    assert said[:3] == [None, None, None]  # step 2: layer 0 20% over its target breaks the streak
    assert said[3] is not None and "within 10%" in said[3]
    assert [round(t["worst_layer_error"], 3) for t in stop.trajectory] == [0.05, 0.2, 0.05, 0.0]


def test_the_recipe_passes_its_targets_to_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    reached = train_to_sparse.main(["--dry-run", "--out", str(out), "--steps", "3", "--profile", "1,3",
                                    "--target-active", "8", "--summary", str(tmp_path / "s.json"),
                                    "--plot", str(tmp_path / "plot" / "profile.png"),
                                    "--set", "sparsity.target_approach_steps=7"])  # --set is applied last
    assert (tmp_path / "plot" / "profile.png").read_bytes()[:4] == b"\x89PNG"
    assert reached["target_active_per_layer"] == pytest.approx([4.0, 12.0])
    written = json.loads((out / "config.json").read_text())["sparsity"]
    assert written["target_active"] == pytest.approx([4.0, 12.0]) and written["target_approach_steps"] == 7
    printed = capsys.readouterr().out
    assert "per-layer targets (1,3 profile, mean 8): 4.0 12.0" in printed and "| target |" in printed
    assert "above 8: the run ended inside the L1 ramp (step 3 of --l1-ramp-steps 300)" in printed
    for bad in (["--profile", "steep"], ["--target-active", "60"],  # micro: d_ff 64, the last layer's target 82
                ["--profile", "none", "--tolerance", "0.1"], ["--profile", "none", "--approach-steps", "5"],
                ["--approach-steps", "-1"], ["--set", "model.no_such_field=1"]):
        with pytest.raises(SystemExit):
            train_to_sparse.main(["--dry-run", "--out", str(tmp_path / "bad"), *bad])
        assert not (tmp_path / "bad").exists()
    err = capsys.readouterr().err
    assert "--target-active 60 with --profile small: sparsity.target_active asks for" in err
    assert "--tolerance applies to per-layer targets" in err
    assert "--approach-steps moves per-layer targets; --profile none has none" in err
    assert "--approach-steps must be >= 0" in err
    assert "--set: unknown config field 'model.no_such_field'" in err
    shutil.rmtree(out)


def test_the_dense_baselines_of_a_targeted_config_train_without_l1_or_targets():
    from twell_jax.bench import step as bench_step
    from twell_jax.bench.data_parallel import bench_config
    from twell_jax.compare import study_runs
    base = config_lib.apply_overrides(get_config("micro"), ["sparsity.target_active=3,4"])
    twin, sparse = study_runs(base, l1_values=[1e-3])
    assert (twin.cfg.sparsity.l1_coef, twin.cfg.sparsity.target_active) == (0.0, ())
    assert sparse.cfg.sparsity.target_active == (3.0, 4.0)
    for cfg in (bench_step.variant_config(base, "relu_gated", None, "none"), bench_config(base, "relu_gated", 1, 2, 1)):
        assert (cfg.sparsity.l1_coef, cfg.sparsity.target_active) == (0.0, ())
    assert bench_step.variant_config(base, "twell", "dense", "none").sparsity.target_active == (3.0, 4.0)


def test_the_outcome_says_why_a_run_missed_and_how_validation_differs():
    """`explain_outcome` on summaries like the script's: a mean above the goal (after or inside the L1
    ramp), a mean at the goal with a layer outside its tolerance (dead neurons named), and the
    validation tokens' activity against the training batch's."""
    base = dict(reached_target=False, steps=2400, target_active_per_layer=[10.0, 30.0],
                train_l0_per_layer=[10.0, 30.0], val_l0_per_layer=[10.5, 30.5], dead_share_per_layer=[0.0, 0.0])
    explain = lambda **kw: train_to_sparse.explain_outcome({**base, **kw}, 20.0, 0.15, 300)  # noqa: E731
    assert explain(reached_target=True) == []  # validation within 10% of training: nothing to add
    [line] = explain(train_l0_per_layer=[14.0, 36.0], val_l0_per_layer=[14.0, 36.0])
    assert "average 25.0 active/token, above 20: the L1 schedule reached --l1" in line
    [line] = explain(train_l0_per_layer=[14.0, 36.0], val_l0_per_layer=[14.0, 36.0], steps=100)
    assert "inside the L1 ramp (step 100 of --l1-ramp-steps 300)" in line
    lines = explain(train_l0_per_layer=[7.0, 33.0], val_l0_per_layer=[9.0, 41.0], dead_share_per_layer=[0.4, 0.1])
    assert "average 20.0 active/token, within 15% of 20, but layer(s) 0 below their targets" in lines[0]
    assert "layer(s) 0 (40% dead): a lower penalty does not revive" in lines[1]
    assert "validation tokens the layers average 25.0 active/token, 1.25x the last training batch's" in lines[2]
    assert len(explain(train_l0_per_layer=[7.0, 33.0], dead_share_per_layer=[0.0, 0.0])) == 1  # none dead
    assert explain(train_l0_per_layer=[]) == []
