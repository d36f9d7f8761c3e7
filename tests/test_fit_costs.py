"""bench/fit_costs.py: the planner's training models refitted from a bench_ffn_train run."""
from __future__ import annotations

import dataclasses
import json

import pytest

from twell_jax.bench import fit_costs
from twell_jax.ops import planner

M, D, H = 16384, 2048, 5632
FIT = planner.Fit("2026-01-01", "a GPU", "a command")


def _run_from(truth: planner.DeviceCosts, ks=(16, 29, 39)) -> dict:
    """A bench_ffn_train.json whose times are exactly `truth`'s models (plus a trained-like row with
    a hot tail, which the fit must leave out)."""
    flops = 2.0 * M * D * H
    dense_fwd, dense_bwd = planner.dense_times_ms(M, D, H, True, device=truth)
    rows = []
    for k, synthetic, hot in [*((k, "uniform", (0, 0, 0.0)) for k in ks), (29, "trained_like", (0, 227, 0.18))]:
        fwd, bwd = planner.sparse_times_ms(M, D, H, k, True, device=truth, tails=hot)
        rows.append(dict(kind="train", k=float(k), synthetic=synthetic, m=M, d=D, h=H,
                         pattern=dict(token_tail_rows=hot[0], hot_neurons=hot[1], hot_entry_share=hot[2]),
                         ms=dict(xla_bf16=dense_fwd + dense_bwd, pallas=fwd + bwd),
                         infer_ms=dict(xla_bf16=dense_fwd, pallas=fwd),
                         piece_ms=dict(pack=flops / truth.forward.pack_flops_per_ms)))
    return dict(rows=rows)


def test_the_fit_recovers_the_models_that_made_the_times():
    truth = dataclasses.replace(
        planner.H100,
        forward=dataclasses.replace(planner.H100.forward, dense_flops_per_ms=7.5e11, pack_flops_per_ms=6.1e11,
                                    sparse_fixed_ms=0.05, ffn_bytes_per_ms=8.2e9),
        backward=dataclasses.replace(planner.H100.backward, bwd_fixed_ms=0.61, bwd_bytes_per_ms=7.7e9,
                                     dense_bwd_flops_per_ms=8.8e11))
    costs, report = fit_costs.fit_training(_run_from(truth), planner.H100, FIT)
    for part in ("forward", "backward"):
        got, want = getattr(costs, part), getattr(truth, part)
        for field in dataclasses.fields(want):
            if field.name != "fit":
                assert getattr(got, field.name) == pytest.approx(getattr(want, field.name), rel=1e-6), field.name
        assert got.fit == FIT
    assert costs.decode is planner.H100.decode
    assert [r.fitted for r in report] == [True, True, True, False]  # the hot-tail row only predicted
    for r in report:
        assert r.model_total == pytest.approx(r.measured_total, rel=1e-6)
    # The printed entry holds the fitted constants.
    src = fit_costs.entry_source("X", costs)
    assert "bwd_bytes_per_ms=7.7e+09" in src and "sparse_fixed_ms=0.05" in src


def test_bad_runs_are_refused_with_the_reason(tmp_path, capsys):
    one_k = _run_from(planner.H100, ks=(29,))
    with pytest.raises(ValueError, match="two different k"):
        fit_costs.fit_training(one_k, planner.H100, FIT)
    with pytest.raises(ValueError, match="no training rows"):
        fit_costs.fit_training({"rows": []}, planner.H100, FIT)
    mixed = _run_from(planner.H100)
    mixed["rows"][0]["m"] = 8192
    with pytest.raises(ValueError, match="several shapes"):
        fit_costs.fit_training(mixed, planner.H100, FIT)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": [{"kind": "train", "k": 29.0}]}))
    assert fit_costs.main([str(path), "--gpu", "g", "--date", "d"]) == 2
    assert "has no 'ms'" in capsys.readouterr().err
    assert fit_costs.main([str(tmp_path / "missing.json"), "--gpu", "g", "--date", "d"]) == 2
    path.write_text(json.dumps(_run_from(planner.H100)))
    assert fit_costs.main([str(path)]) == 2
    assert "records no device_kind (give --gpu) and no date (give --date)" in capsys.readouterr().err


def test_the_gpu_and_date_come_from_the_run_when_it_has_them(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**_run_from(planner.H100), "device_kind": "NVIDIA H200", "date": "2026-11-28"}))
    assert fit_costs.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "Fit('2026-11-28', 'NVIDIA H200'," in out and "| uniform k 29 | yes |" in out
    assert fit_costs.main([str(path), "--gpu", "NVIDIA H100", "--date", "2026-12-01"]) == 0
    assert "Fit('2026-12-01', 'NVIDIA H100'," in capsys.readouterr().out
