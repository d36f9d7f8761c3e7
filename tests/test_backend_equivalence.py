"""The sparse kernels train the same model as the dense path (issue 23), on the CPU: the same short
`micro` run (same seed, data and L1) with the op's `dense` backend and with `pallas` in the Pallas
interpreter gives the same loss and active-count curves.

Tolerance, stated: float32 compute, so the two backends differ only in summation order (the
kernels accumulate the FFN's products in another order than XLA's dot); over 4 optimizer steps
the losses must agree to 1e-5 relative and every layer's mean active count per token to 0.5%
relative (a neuron whose gate pre-activation sits within rounding of 0 may flip). Measured
(2026-11-24, CPU): losses within 8.4e-8 relative, active counts identical. The GPU version in bf16,
with the noise measured by two dense runs that differ only in the data order, is
`python experiments/backend_equivalence.py` (twell_jax/bench/backend_equivalence.py), whose figures (raw and smoothed differences, the dense-fallback
share) are checked at the end of this file on synthetic metric rows.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from twell_jax.configs import get_config
from twell_jax import compare as compare_lib
from twell_jax import config as config_lib
from twell_jax.training.train import train

STEPS = 4
LOSS_RTOL = 1e-5
ACTIVE_RTOL = 5e-3
# A micro model has ~50% of its 64 neurons active: with the op's defaults every call would take its
# exact dense fallback. Small tiles and room for every overflowing row / neuron in the exact fix-up
# and the backward's dense tails make the TwELL kernels (pack, fused FFN, sparse backward) run, with
# tails, on every step: checked below, so that agreeing is not agreeing on the dense formula.
OP_CONFIG = {"tile": 32, "slots": 16, "overflow_rows": 128, "tail_rows": 1.0, "transpose_tail_rows": 1.0}


def _curves(backend: str, run_dir) -> dict[str, np.ndarray]:
    cfg = config_lib.apply_overrides(get_config("micro"), [
        f"model.ffn_backend={backend}", f"model.ffn_interpret={backend == 'pallas'}",
        "data.source=synthetic", "data.synthetic_sequences=256", f"train.steps={STEPS}", "train.log_every=1",
        "sparsity.l1_coef=1e-2", f"model.ffn_op_config={json.dumps(OP_CONFIG)}"])
    train(cfg, run_dir, echo=lambda _: None)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "ce" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return {"loss": np.array([r["loss"] for r in steps]), "ce": np.array([r["ce"] for r in steps]),
            "active": np.array([r["l0_per_layer"] for r in steps]),
            "val_loss": np.array([r["val_loss"] for r in records if "val_loss" in r]),
            "fallback": np.array([r["dense_fallback_per_layer"] for r in steps]),
            "tail_rows": np.array([r["backward_tail_rows_per_layer"] for r in steps])}


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    root = tmp_path_factory.mktemp("equivalence")
    return {backend: _curves(backend, root / backend) for backend in ("dense", "pallas")}


def test_pallas_trains_the_dense_model(curves):
    dense, pallas = curves["dense"], curves["pallas"]
    np.testing.assert_allclose(pallas["loss"], dense["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(pallas["ce"], dense["ce"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(pallas["val_loss"], dense["val_loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(pallas["active"], dense["active"], rtol=ACTIVE_RTOL)
    # The kernels ran: no call of the pallas run fell back to the dense formula, and its backward
    # had dense tails to handle (the op's dense backend reports neither, so only pallas is checked).
    assert not pallas["fallback"].any() and (pallas["tail_rows"] > 0).all()
    # The run learns and the L1 acts, so agreeing is not agreeing on nothing.
    assert dense["ce"][-1] < dense["ce"][0]
    assert 0 < dense["active"].min() and dense["active"][-1].mean() < dense["active"][0].mean()


# ---------------------------------------------------------------------------------------------
# experiments/backend_equivalence.py's figures, from synthetic metric rows (nothing is trained)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def script():
    from twell_jax.bench import backend_equivalence

    return backend_equivalence


def _write_run(run_dir: Path, loss, active, fallback=None, devices: int = 1) -> None:
    """A metrics.jsonl as the training loop writes it (one record per step, then a validation record)."""
    run_dir.mkdir(parents=True)
    rows = []
    for i, (lo, ac) in enumerate(zip(loss, active)):
        row = {"step": i + 1, "loss": float(lo), "ce": float(lo) - 0.1, "l0_per_layer": [float(ac) - 1, float(ac) + 1],
               "tokens_per_s": 1000.0 * devices, "tokens_per_s_per_device": 1000.0}
        if fallback is not None:
            row["dense_fallback_per_layer"] = fallback[i]
        rows.append(row)
    rows.append({"step": len(loss), "val_loss": float(loss[-1]), "val_l0_per_layer": [1.0, 1.0]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _study(script, root: Path, steps: int = 60, fallback=None, devices: int = 1):
    """The four runs of the plan on `micro` with 4 micro-batches per step: dense, pallas (dense plus
    a constant 0.01 loss offset), and two noise runs whose loss alternates +-0.2 around dense's."""
    cfg = config_lib.apply_overrides(get_config("micro"), [
        f"train.steps={steps}", f"train.global_batch={8 * devices}", "train.micro_batch=2"])
    runs = script.plan(cfg)
    dense = np.linspace(5.0, 3.0, steps)
    active = np.linspace(100.0, 20.0, steps)
    wiggle = 0.2 * (-1.0) ** np.arange(steps)
    curves = {"dense": (dense, active), "pallas": (dense + 0.01, active * 1.02),
              "dense-half-micro-batch": (dense + wiggle, active + 5 * wiggle),
              "dense-data-seed": (dense - wiggle, active - 5 * wiggle)}
    for run in runs:
        loss, act = curves[run.key]
        _write_run(root / run.key, loss, act, fallback if run.key == "pallas" else None, devices)
    return runs


def test_dense_fallback_share_is_per_call_not_per_step(script, tmp_path):
    # 4 micro-batches per step (global 8, micro 2, 1 device): the loop logs each layer's fallback
    # count summed over them. Layer 0 always falls back, layer 1 in 1 of 4 micro-batches: 5 of 8 calls.
    steps = 30
    runs = _study(script, tmp_path, steps, fallback=[[4, 1]] * steps)
    result = script.report(tmp_path, runs)
    assert result["pallas_dense_fallback_share"] == pytest.approx(5 / 8)  # the per-step mean was 2.5 (250%)
    # On 2 devices (global 16, micro 2) a step has 4 micro-batches per device as well; the device
    # count comes from summary.json when there is one, else from the logged throughput.
    two = tmp_path / "two_devices"
    runs = _study(script, two, steps, fallback=[[4, 4]] * steps, devices=2)
    assert script.report(two, runs)["pallas_dense_fallback_share"] == pytest.approx(1.0)
    (two / "pallas" / "summary.json").write_text(json.dumps({"num_devices": 1}))  # 8 micro-batches
    assert script.report(two, runs)["pallas_dense_fallback_share"] == pytest.approx(0.5)
    # A count above the micro-batches per step is refused, not reported as a share above 1.
    bad = tmp_path / "bad"
    runs = _study(script, bad, steps, fallback=[[5, 0]] * steps)
    with pytest.raises(ValueError, match="fall outside 0..4"):
        script.report(bad, runs)


def test_smoothed_differences_average_out_batch_noise(script, tmp_path):
    runs = _study(script, tmp_path)
    result = script.report(tmp_path, runs, window=20)
    pallas, reduction, data = result["pairs"]
    # The noise runs differ by +-0.2 from step to step: raw 0.2, but 0 over 20-step means (even window).
    assert reduction["max_abs_loss_diff"] == pytest.approx(0.2)
    assert reduction["smoothed_max_abs_loss_diff"] == pytest.approx(0.0, abs=1e-12)
    assert data["smoothed_mean_abs_active_diff"] == pytest.approx(0.0, abs=1e-9)
    # pallas is off by a constant: the same before and after smoothing.
    assert pallas["max_abs_loss_diff"] == pytest.approx(0.01)
    assert pallas["smoothed_mean_abs_loss_diff"] == pytest.approx(0.01)
    assert pallas["smoothed_max_abs_loss_diff"] == pytest.approx(0.01)
    assert pallas["smoothed_max_rel_active_diff"] == pytest.approx(0.02)
    assert pallas["smoothing_window"] == 20
    # Raw, pallas is within the noise; smoothed, the constant offset stands out of the averaged noise.
    assert result["pallas_within_noise"]
    assert result["pallas_within_noise_smoothed"] == {"loss": False, "active": False}
    # A window longer than the run: the whole run's mean.
    short = script.compare_pair(script.curves(tmp_path / "pallas"), script.curves(tmp_path / "dense"), window=1000)
    assert short["smoothing_window"] == 60 and short["smoothed_max_abs_loss_diff"] == pytest.approx(0.01)


def test_report_only_recomputes_from_saved_metrics(script, tmp_path, monkeypatch):
    runs = _study(script, tmp_path / "runs", steps=23)
    plan = {"version": compare_lib.PLAN_VERSION, "options": {},
            "runs": [{"key": r.key, "config": config_lib.to_dict(r.cfg)} for r in runs]}
    (tmp_path / "runs" / compare_lib.PLAN_FILE).write_text(json.dumps(plan))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    result = script.main(["--out", str(tmp_path / "runs"), "--report-only"])
    saved = json.loads((tmp_path / "out" / "backend_equivalence.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert (tmp_path / "out" / "backend_equivalence.png").stat().st_size > 0
    assert saved["config"] == "micro" and saved["steps"] == 23 and saved["smoothing_window"] == 20
    assert saved["pallas_dense_fallback_share"] is None  # the synthetic pallas run logged no fallback counts
    assert [p["pair"] for p in saved["pairs"]] == ["pallas vs dense", "dense-half-micro-batch vs dense",
                                                   "dense-data-seed vs dense"]
    # Curves at the first step and every 5th, for a plot.
    assert saved["curves"]["pallas"]["step"] == [1, 5, 10, 15, 20]
    assert saved["curves"]["dense"]["loss"][1] == pytest.approx(np.linspace(5.0, 3.0, 23)[4])
    assert saved["curves"]["dense"]["active"][0] == pytest.approx(100.0)
    assert saved["final_val_loss"]["dense"] == pytest.approx(3.0)
    with pytest.raises(SystemExit):  # no plan there
        script.main(["--out", str(tmp_path / "out"), "--report-only"])


# ---------------------------------------------------------------------------------------------
# --init-run: the four runs start from a trained run's parameters
# ---------------------------------------------------------------------------------------------

FIRST_LOSS_RTOL = 1e-5  # float32; the pallas run differs from the dense formula in summation order only


def _first_step_loss(cfg: config_lib.ExperimentConfig, params) -> float:
    """The training loss the run of `cfg` logs at step 1 if it starts from `params`: the loss of
    its first batch before the update (through the dense backend: the same function as every other)."""
    import jax
    import jax.numpy as jnp

    from twell_jax.data import build_experiment_data
    from twell_jax.training import parallel
    from twell_jax.training.loss import l1_coefficient
    from twell_jax.training.planning import abstract_graphdef
    from twell_jax.training.sparsity import init_counters
    from twell_jax.training.step import accumulate_gradients

    cfg = config_lib.apply_overrides(cfg, ["model.ffn_backend=dense"])
    tokens = jnp.asarray(next(build_experiment_data(cfg).train_iter)["tokens"])
    with jax.set_mesh(parallel.make_mesh(1)):
        _, _, per_micro = accumulate_gradients(
            cfg, abstract_graphdef(cfg.model, cfg.train.seed), params, tokens, init_counters(cfg.model),
            l1_coefficient(cfg.sparsity, jnp.int32(0)), cfg.train.global_batch // cfg.train.micro_batch)
    return float(jnp.mean(per_micro["loss"]))


@pytest.fixture(scope="module")
def init_study(script, tmp_path_factory, data_cache_dir):
    """A micro run trained for 4 steps on text (the stdlib, its BPE), then the study with --init-run
    on it (2 steps a run; the data default to the run's corpus and saved tokenizer)."""
    root = tmp_path_factory.mktemp("init_run")
    cache = f"data.cache_dir={data_cache_dir}"
    trained = root / "trained"
    train(config_lib.apply_overrides(get_config("micro"), ["train.steps=4", "optim.lr=1e-2", cache]), trained,
          echo=lambda _: None)
    argv = ["--config", "micro", "--steps", "2", "--init-run", str(trained), "--out", str(root / "study"),
            "--set", "model.ffn_interpret=true", cache]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OUT", str(root / "out"))
        result = script.main(argv)
    return root, trained, argv, result


@pytest.mark.slow
def test_init_run_starts_every_run_from_the_trained_parameters(init_study):
    from twell_jax.model import init_model, split_model
    from twell_jax.training import checkpoint as ckpt_lib

    root, trained, _, result = init_study
    runs, _ = compare_lib.load_plan(root / "study")
    assert [r.init_run for r in runs] == [str(trained.absolute())] * 4  # the plan records the init run
    assert result["init_run"] == str(trained.absolute())
    assert json.loads((root / "out" / "backend_equivalence.json").read_text())["init_run"] == result["init_run"]
    params, _, step = ckpt_lib.restore_params(trained)
    assert step == 4
    for run in runs:
        # The run's corpus, read with its tokenizer: the token ids its embedding was trained on.
        assert (run.cfg.data.source, run.cfg.data.tokenizer) == ("stdlib", str(trained.absolute() / "tokenizer.json"))
        logged = json.loads((root / "study" / run.key / "metrics.jsonl").read_text().splitlines()[0])
        assert logged["step"] == 1
        fresh = _first_step_loss(run.cfg, split_model(init_model(run.cfg.model, run.cfg.train.seed))[1])
        started = _first_step_loss(run.cfg, params)
        # The first logged loss is the trained parameters' on that batch, not an initialisation's.
        assert logged["loss"] == pytest.approx(started, rel=FIRST_LOSS_RTOL), run.key
        assert abs(started - fresh) > 1000 * FIRST_LOSS_RTOL * abs(fresh), run.key


@pytest.mark.slow
def test_init_run_is_kept_on_resume_and_report_only(script, init_study, monkeypatch, capsys):
    root, trained, argv, result = init_study
    monkeypatch.setenv("OUT", str(root / "again"))
    without = [a for a in argv if a not in ("--init-run", str(trained))]
    # Every run finished: continuing without --init-run keeps the plan's, trains nothing, reports the same.
    assert script.main(without)["init_run"] == result["init_run"]
    assert script.main(["--out", str(root / "study"), "--report-only"])["init_run"] == result["init_run"]
    capsys.readouterr()
    with pytest.raises(SystemExit):  # another init run for the same study
        script.main(without + ["--init-run", str(root / "other_run")])
    assert f"the study in {root / 'study'} started from {trained.absolute()}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--out", str(root / "study"), "--report-only", "--init-run", str(trained)])
    # A run continued (here: one step more) restores its own checkpoint, not the init run's parameters.
    longer = list(without)
    longer[longer.index("--steps") + 1] = "3"
    longer += ["--set", "optim.schedule_steps=3"]
    assert script.main(longer)["steps"] == 3
    printed = capsys.readouterr().out
    assert printed.count("(resuming from its checkpoint)") == 4 and "starts from the parameters" not in printed
    for key in ("dense", "pallas", "dense-half-micro-batch", "dense-data-seed"):
        records = [json.loads(line) for line in (root / "study" / key / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "ce" in r] == [1, 2, 3]


@pytest.mark.slow
def test_init_run_of_another_model_is_refused(script, init_study, tmp_path, monkeypatch):
    _, trained, _, _ = init_study
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    out = tmp_path / "study"
    with pytest.raises(ValueError, match=rf"--init-run {re.escape(str(trained))}: .*model.d_ff: the run has 64, "
                                         "the study 128"):
        script.main(["--config", "micro", "--steps", "2", "--init-run", str(trained), "--out", str(out),
                     "--set", "model.d_ff=128"])
    assert not out.exists()  # refused before the plan was written
    swiglu = config_lib.apply_overrides(get_config("micro"), ["model.ffn_kind=swiglu", "sparsity.l1_coef=0"])
    with pytest.raises(ValueError, match="model.ffn_kind: the run has 'twell', the study 'swiglu'"):
        compare_lib.check_init_run(trained, swiglu)
    relu_gated = config_lib.apply_overrides(get_config("micro"), ["model.ffn_kind=relu_gated", "sparsity.l1_coef=0"])
    compare_lib.check_init_run(trained, relu_gated)  # the same layout and activation: fits
    with pytest.raises(ValueError, match="--init-run .*: no checkpoint there"):
        script.main(["--config", "micro", "--init-run", str(tmp_path / "nothing"), "--out", str(out)])
