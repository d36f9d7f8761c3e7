"""experiments/bench_step.py end to end at tiny shapes on CPU (no timing is asserted)."""
from __future__ import annotations

import json

import pytest

from twell_jax.bench import step as bench_step


def test_dry_run_times_every_variant_and_writes_json(tmp_path, capsys):
    out = tmp_path / "step.json"
    rows = bench_step.main(["--dry-run", "--config", "0.5b", "--optimizer", "--out", str(out),
                            "--variants", "ref:none,twell:dots,relu:ffn"])
    assert [r["variant"] for r in rows] == ["ref:none", "twell:dots", "relu:ffn"]
    for row in rows:
        assert "error" not in row, row
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0 and 0 < row["mfu"]
        assert row["seq_len"] == 16 and row["micro_batch"] == 2
    assert "remat 'dots'" in rows[1]["how"] and "plain JAX" in rows[0]["how"]
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["micro_batch"] == 2
    lines = capsys.readouterr().out.strip().splitlines()
    table = lines[-5:]  # printed last: header, rule, one row per variant
    assert table[0].startswith("| variant |") and table[2].startswith("| ref:none") and "| 1.000 |" in table[2]


def test_the_reference_on_fp32_master_parameters_trains_like_the_model():
    # ref@f32: the plain-JAX model in the model's mixed precision (fp32 parameters cast to bf16 in the
    # step, the trainer's optimizer): its state holds twice the parameter bytes of the bf16 one's.
    rows = bench_step.main(["--dry-run", "--config", "micro", "--optimizer", "--variants", "ref:none,ref@f32:none"])
    assert [r["variant"] for r in rows] == ["ref:none", "ref@f32:none"] and not any("error" in r for r in rows)
    assert "bf16 params" in rows[0]["how"] and "fp32 master params" in rows[1]["how"]
    assert rows[1]["compiled_memory_bytes"] > rows[0]["compiled_memory_bytes"]


def test_a_failing_variant_is_reported_and_the_rest_run(monkeypatch, capsys):
    real = bench_step.build_step

    def build_step(cfg, kind, optimizer, params=None, **options):
        if kind == "relu_gated":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 99 GiB")
        return real(cfg, kind, optimizer, params, **options)

    monkeypatch.setattr(bench_step, "build_step", build_step)
    rows = bench_step.main(["--dry-run", "--config", "micro", "--variants", "relu_gated:none,twell:none"])
    assert "RESOURCE_EXHAUSTED" in rows[0]["error"] and "error" not in rows[1]
    assert "failed: RuntimeError: RESOURCE_EXHAUSTED" in capsys.readouterr().out


def test_flops_per_token_matches_the_issue_figure():
    from twell_jax.configs import get_config

    cfg = get_config("0.5b").model
    # 0.5b: 6N + 12 L S D = 3.47e9 FLOPs per token (131,700 tokens/s = 46% of 989 TFLOP/s).
    assert bench_step.flops_per_token(cfg, 2048) == pytest.approx(3.47e9, rel=2e-3)
    assert 131_700 * bench_step.flops_per_token(cfg, 2048) / 989e12 == pytest.approx(0.46, abs=0.005)


@pytest.mark.slow
def test_a_variant_runs_at_its_own_micro_batch_and_the_best_table_compares_by_tokens(capsys):
    """What a sparse model's saved memory buys: it may run a larger micro-batch than its twin in the
    same process; rows are then compared by tokens/s, and each kind's fastest configuration is named."""
    rows = bench_step.main(["--dry-run", "--config", "micro", "--micro-batch", "2",
                            "--variants", "relu_gated:none,relu_gated:full:3,twell@dense:none:3"])
    assert [(r["variant"], r["micro_batch"]) for r in rows] == [
        ("relu_gated:none", 2), ("relu_gated:full:3", 3), ("twell@dense:none:3", 3)]
    best = bench_step.best_rows(rows)
    assert set(best) == {"relu_gated", "twell@dense"} and best["twell@dense"] is rows[2]
    assert best["relu_gated"]["tokens_per_s"] == max(r["tokens_per_s"] for r in rows[:2])
    table = capsys.readouterr().out.strip().splitlines()[-4:]
    assert table[0].startswith("| kind | fastest configuration |")
    twin_same = next((r for r in rows[:2] if r["remat"] == "none" and r["micro_batch"] == 3), None)
    assert twin_same is None and "| twell@dense | remat none, micro-batch 3 |" in table[3] and "not run" in table[3]
    ratio = rows[2]["tokens_per_s"] / best["relu_gated"]["tokens_per_s"]
    assert f"| {ratio:.3f} |" in table[3]


def test_the_best_table_skips_a_failed_row_and_is_left_out_for_one_configuration_per_kind():
    ok = {"kind": "relu_gated", "backend": None, "remat": "none", "micro_batch": 8, "tokens_per_s": 10.0,
          "compiled_memory_bytes": 2**30}
    failed = {"kind": "relu_gated", "backend": None, "remat": "dots", "micro_batch": 16, "error": "OOM"}
    sparse = dict(ok, kind="twell", backend="auto", tokens_per_s=12.0)
    assert bench_step.best_rows([ok, failed, sparse]) == {"relu_gated": ok, "twell@auto": sparse}
    assert "| twell@auto | remat none, micro-batch 8 | 12 | 1.200 | 1.200 | 1.00 |" in bench_step.format_best(
        [ok, failed, sparse])
    assert bench_step.format_best([ok, sparse]) == ""


@pytest.mark.parametrize("text,match", [("gelu:none", "unknown kind 'gelu'"), ("twell:often", "unknown remat"),
                                        ("ref:ffn", "reference model takes"), ("", "empty"),
                                        ("ref@f16:none", "the reference model takes @f32"),
                                        ("twell:none:0", "must be a positive integer"),
                                        ("twell:none:x8", "must be a positive integer")])
def test_bad_variants_are_rejected(text, match):
    with pytest.raises(ValueError, match=match):
        bench_step.parse_variants(text)


@pytest.mark.parametrize("option", ["--trace", "--warmup"])
def test_a_negative_count_is_refused_before_any_variant_runs(option, capsys):
    # A negative --trace used to reach the profiler after the timing and turn a timed row into an error.
    with pytest.raises(SystemExit) as exc:
        bench_step.main(["--dry-run", "--config", "micro", option, "-1"])
    assert exc.value.code == 2 and f"{option} must be >= 0" in capsys.readouterr().err


def test_out_is_checked_before_the_variants_and_its_folder_made(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_step.main(["--dry-run", "--config", "micro", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "is a directory" in capsys.readouterr().err
    out = tmp_path / "new" / "step.json"  # a folder that does not exist yet: made when the rows are written
    bench_step.main(["--dry-run", "--config", "micro", "--variants", "ref:none", "--out", str(out)])
    assert json.loads(out.read_text())["rows"][0]["variant"].startswith("ref")


def test_the_grad_only_step_keeps_the_weights():
    """A sparse step's time depends on the weights' values: the timed step must not replace them."""
    import jax
    import jax.numpy as jnp
    from twell_jax.configs import get_config

    cfg = bench_step.variant_config(get_config("micro"), "twell", "reference", "none")
    step, state, _, _ = bench_step.build_step(cfg, "twell", optimizer=False)
    tokens = jax.random.randint(jax.random.key(0), (2, cfg.seq_len + 1), 0, cfg.model.vocab_size)
    before = jax.tree.map(jnp.copy, state[0])
    for _ in range(2):
        state = jax.jit(step)(state, tokens)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), before, state[0])))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(state[1]))


def test_a_bad_variant_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_step.main(["--dry-run", "--config", "micro", "--variants", "relu_gated:none,twell:none:0"])
    assert exc.value.code == 2 and "the micro-batch of 'twell:none:0' must be a positive integer" in capsys.readouterr().err
