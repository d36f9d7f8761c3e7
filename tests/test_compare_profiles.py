"""Per-layer profile comparison of runs (twell_jax.compare.layer_profile / profile_distance and
twell_jax/bench/compare_profiles.py, the command experiments/compare_profiles.py) on hand-written
summaries."""
import json

import pytest

from twell_jax.compare import layer_profile, profile_distance


def _run(tmp_path, name, active, d_ff, dead=None):
    run = tmp_path / name
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "d_ff": d_ff, "n_layers": len(active), "steps": 100, "val_loss": 3.0, "val_l0_per_layer": active,
        "dead_share_per_layer": dead}))
    return run


def test_a_profile_against_itself_and_against_a_scaled_or_reshaped_one(tmp_path):
    a = layer_profile(_run(tmp_path, "a", [100.0, 20.0, 10.0, 30.0], 1000, [0.0, 0.2, 0.4, 0.1]))
    assert a["active_share"] == [0.1, 0.02, 0.01, 0.03]
    same = profile_distance(a, a, points=4)
    assert same["shape_distance"] == 0 and same["level_ratio"] == 1 and same["dead_gap"] == 0
    # Twice the activity everywhere, on a model twice as wide and twice as deep: same shape.
    b = layer_profile(_run(tmp_path, "b", [200.0, 200.0, 40.0, 40.0, 20.0, 20.0, 60.0, 60.0], 1000))
    far = profile_distance(a, b, points=4)
    assert far["level_ratio"] == pytest.approx(2.0) and far["shape_distance"] == pytest.approx(0.0, abs=0.15)
    assert far["dead_gap"] is None  # b reports no dead shares
    # All activity in the first layer against all in the last: disjoint shapes.
    c = layer_profile(_run(tmp_path, "c", [50.0, 0.0, 0.0, 0.0], 1000))
    d = layer_profile(_run(tmp_path, "d", [0.0, 0.0, 0.0, 50.0], 1000))
    assert profile_distance(c, d, points=4)["shape_distance"] == pytest.approx(1.0)


def test_the_script_prints_writes_and_refuses_bad_runs(tmp_path, capsys):
    from twell_jax.bench import compare_profiles as module

    ref = _run(tmp_path, "ref", [30.0, 10.0], 100, [0.1, 0.0])
    other = _run(tmp_path, "other", [60.0, 20.0, 20.0], 200, [0.3, 0.5, 0.2])
    result = module.main([str(ref), str(other), "--points", "2", "--out", str(tmp_path / "p.json")])
    assert json.loads((tmp_path / "p.json").read_text())["runs"][0]["level_ratio"] == result["runs"][0]["level_ratio"]
    assert "| vs reference (level) |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        module.main([str(ref), str(tmp_path)])  # no summary.json there
    with pytest.raises(SystemExit):
        module.main([str(ref), str(other), "--points", "0"])
