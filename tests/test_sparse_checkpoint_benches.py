"""experiments/train_to_sparse.py and the benchmarks that take its checkpoint (`bench_step.py
--checkpoint`, `bench_inference.py --checkpoint`), end to end at micro shapes on CPU. No timing is
asserted."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from twell_jax.bench import inference as bench_inference

from twell_jax.bench import step as bench_step
from twell_jax.bench import train_to_sparse

from twell_jax.inference.load import load_run, validation_tokens  # noqa: E402


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    """A micro run stopped by the sparsity criterion (per-layer targets of the default profile, a
    tolerance every step meets, 2 steps in a row), with sequences long enough for bench_inference's
    dry-run context of 32. Its config carries the targets, which the benchmarks' dense twins drop."""
    out = tmp_path_factory.mktemp("sparse") / "run"
    summary = out.parent / "summary.json"
    reached = train_to_sparse.main(["--dry-run", "--out", str(out), "--target-active", "30", "--tolerance", "0.99",
                                    "--patience", "2",
                                    "--steps", "6", "--summary", str(summary),
                                    "--set", "data.seq_len=40", "model.max_seq_len=64"])
    return out, reached, json.loads(summary.read_text())


def test_the_stop_criterion_ends_the_run_checkpointed_and_loadable(sparse_run):
    out, reached, saved = sparse_run
    assert reached["reached_target"] and reached["steps"] == 2  # streak of 2 reached at step 2 of 6
    assert saved["steps"] == 2 and [t["step"] for t in saved["trajectory"]] == [1, 2]
    assert len(reached["val_l0_per_layer"]) == len(reached["train_l0_per_layer"]) == 2
    # The default L1 ramp: coefficient at step index 1 of a 300-step ramp to 1e-3.
    assert reached["l1_coef_reached"] == pytest.approx(1e-3 * 1 / 300)
    startup = saved["startup_s"]  # where the start-up went, as the trainer's start-up line says
    assert {"data", "init", "train step compile"} <= set(startup)
    assert saved["first_step_done_s"] >= startup["data"] + startup["init"] + startup["train step compile"]
    loaded = load_run(out, dtype="float32")
    assert loaded.step == 2 and loaded.config.model.ffn_kind == "twell"
    assert len(loaded.config.sparsity.target_active) == 2 and len(reached["l1_coef_per_layer_reached"]) == 2


def test_the_criterion_needs_the_streak_and_restarts_it_on_a_miss():
    stop = train_to_sparse.SparseEnough(target=10.0, patience=2)
    said = [stop({"step": i, "ce": 1.0, "l0_per_layer": l0}) for i, l0 in
            enumerate([[5.0, 5.0], [30.0, 1.0], [9.0, 11.0], [10.0, 10.0]], start=1)]
    assert said[:3] == [None, None, None]  # step 2 breaks the streak (mean 15.5 > 10)
    assert said[3] is not None and "<= 10" in said[3]
    assert [t["l0_mean"] for t in stop.trajectory] == [5.0, 15.5, 10.0, 10.0]


def test_validation_tokens_come_from_the_runs_split_and_cycle_only_when_asked(sparse_run):
    out = sparse_run[0]
    rows = validation_tokens(out, 3)
    assert rows.shape == (3, 41) and rows.dtype == np.int32
    # The micro preset's synthetic split holds 5% of 2**20 sequences = 52,429.
    with pytest.raises(ValueError, match="has 52429 sequences .* fewer than the 60000 asked for"):
        validation_tokens(out, 60_000)
    many = validation_tokens(out, 60_000, cycle=True)
    assert many.shape == (60_000, 41) and np.array_equal(many[:3], rows)
    assert np.array_equal(many[52_429:52_432], rows)  # the split again from its start


@pytest.mark.slow
def test_bench_step_times_the_runs_parameters_on_its_text(sparse_run, tmp_path):
    out = sparse_run[0]
    json_path = tmp_path / "step.json"
    rows = bench_step.main(["--dry-run", "--checkpoint", str(out), "--variants",
                            "ref:none,relu_gated:none,twell@reference:none", "--out", str(json_path)])
    assert [r["variant"] for r in rows] == ["ref:none", "relu_gated:none", "twell@reference:none"]
    assert all("error" not in r for r in rows), rows
    # Same trained weights, same tokens: the dense twin and the sparse op count the same active neurons.
    assert rows[1]["active_per_layer"] == rows[2]["active_per_layer"] and "active_per_layer" not in rows[0]
    assert rows[1]["seq_len"] == 40
    saved = json.loads(json_path.read_text())
    assert saved["source"].startswith("checkpoint") and len(saved["hints"]) == 2


@pytest.mark.slow
def test_bench_inference_feeds_the_runs_text(sparse_run, tmp_path):
    out = sparse_run[0]
    result = bench_inference.main(["--dry-run", "--checkpoint", str(out), "--out", str(tmp_path / "inf.json")])
    phases = {(r["phase"], r["batch"], r["variant"]) for r in result["rows"]}
    assert ("prefill", 2, "dense") in phases and ("decode", 2, "twell-reference") in phases
    assert {("prefill", 2, "plain"), ("decode", 1, "plain"), ("decode", 2, "plain")} <= phases
    assert result["source"].startswith("checkpoint")
    # The plain-JAX rows run the run's weights: on its text the dense twin's states are plain's (f32).
    dense = next(r for r in result["rows"] if r["variant"] == "dense" and r["phase"] == "prefill")
    assert dense["hidden_rel_diff_vs_plain"] < 1e-5 and dense["speed_vs_plain"] > 0


@pytest.mark.parametrize("text,match", [("ref@pallas:none", "the reference model takes @f32"),
                                        ("relu_gated@pallas", "only kinds that run the sparse op"),
                                        ("twell@gpu:none", "unknown backend 'gpu'")])
def test_bad_backend_variants_are_rejected(text, match):
    with pytest.raises(ValueError, match=match):
        bench_step.parse_variants(text)


@pytest.mark.slow
def test_bench_inference_decode_rows_give_the_floor_share_and_the_xla_row(sparse_run, tmp_path):
    out = sparse_run[0]
    result = bench_inference.main(["--dry-run", "--checkpoint", str(out), "--xla-decode-row", "--generate-tokens", "0",
                                   "--xla-option", "xla_gpu_enable_command_buffer=FUSION,WHILE"])
    decode = [r for r in result["rows"] if r["phase"] == "decode"]
    assert {r["variant"] for r in decode} == {f"{v}{suffix}" for v in ("plain", "dense", "dense-xla", "twell-reference",
                                                                             "twell-reference-xla")
                                              for suffix in ("", "+xla")}
    assert not any(r["phase"].startswith("generate") for r in result["rows"])
    for r in decode:  # the option rows: compiled with it, compared with the baselines without it
        assert r.get("xla_options") == ({"xla_gpu_enable_command_buffer": "FUSION,WHILE"} if "+xla" in r["variant"]
                                        else None)
        assert r["speed_vs_plain"] > 0 and r["speed_vs_dense"] > 0
    with pytest.raises(SystemExit, match="--xla-option 'gpu_graphs'"):
        bench_inference.main(["--dry-run", "--checkpoint", str(out), "--xla-option", "gpu_graphs"])
    with pytest.raises(SystemExit, match="--generate-chunks '0,x'"):
        bench_inference.main(["--dry-run", "--checkpoint", str(out), "--generate-chunks", "0,x"])
    one = bench_inference.main(["--dry-run", "--checkpoint", str(out), "--backends", "", "--decode-batches", "1",
                                "--generate-chunks", "4"])
    assert {r["phase"] for r in one["rows"]} == {"prefill", "decode", "generate, chunk 4"}
    for r in decode:
        assert r["floor_bytes"] > 0 and r["floor_share"] > 0
        assert r["prefill_first_call_s"] > 0 and r["steps_first_call_s"] > 0
    assert all(r["first_call_s"] > 0 for r in result["rows"] if r["phase"] == "prefill")
    # the generic path's rows: decode only (their prefill is their variant's)
    assert not any(r["variant"].endswith("-xla") for r in result["rows"] if r["phase"] == "prefill")


@pytest.mark.slow
def test_the_decode_check_compares_the_kernels_with_the_xla_path_and_stops_a_wrong_run(sparse_run, tmp_path):
    """--check-decode: every variant's decode kernels (interpreted here) against the XLA path,
    teacher-forced at each decode batch, before anything is timed; a difference above
    --check-tolerance stops the run naming the variant and batch, and writes nothing."""
    out = sparse_run[0]
    result = bench_inference.main(["--dry-run", "--checkpoint", str(out), "--check-decode", "4", "--generate-tokens", "0",
                                   "--decode-batches", "1,2"])
    checks = result["decode_checks"]
    assert {(c["variant"], c["batch"]) for c in checks} == {(v, b) for v in ("dense", "twell-reference") for b in (1, 2)}
    for check in checks:
        assert check["steps"] == 4 and check["kernels"] and len(check["ffn_ways"]) == 2
        assert 0 < check["max_rel_logit_diff"] < 1e-5 and check["greedy_agree"] == 1.0  # float32: rounding only
    target = tmp_path / "never.json"
    with pytest.raises(SystemExit, match="dense at batch 1 is .* above --check-tolerance 1e-12"):
        bench_inference.main(["--dry-run", "--checkpoint", str(out), "--check-decode", "4", "--generate-tokens", "0",
                              "--check-tolerance", "1e-12",
                              "--out", str(target)])
    assert not target.exists()
    for bad in (["--check-decode", "-1"], ["--check-decode", "40"], ["--check-tolerance", "0", "--check-decode", "2"]):
        with pytest.raises(SystemExit, match="--check-decode"):
            bench_inference.main(["--dry-run", "--checkpoint", str(out), "--generate-tokens", "0", *bad])


def test_the_decode_floor_counts_every_weight_once_and_the_sparse_rows_union():
    from twell_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                      ffn_kind="twell", ffn_backend="dense")
    dense = bench_inference.decode_floor_bytes(cfg, batch=2, context=16, itemsize=2)
    weights = 100 * 8 + 2 * (4 * 8 * 8 + 3 * 32 * 8)
    kv = 2 * 2 * 2 * 16 * 8
    assert dense == 2 * (weights + kv)
    # 3 active per token: the union of 2 rows is at most 6 of the 32 neurons; the gate stays whole.
    sparse = bench_inference.decode_floor_bytes(cfg, batch=2, context=16, itemsize=2, active_per_layer=[3.0, 40.0])
    ffn = (32 * 8 + 2 * 6 * 8) + (32 * 8 + 2 * 32 * 8)
    assert sparse == 2 * (100 * 8 + 2 * 4 * 8 * 8 + ffn + kv)


@pytest.mark.slow
def test_the_matvec_sweep_runs_on_the_cpu(tmp_path, capsys):
    from twell_jax.bench import decode_matvec as module

    rows = module.main(["--dry-run", "--rows", "1", "--out", str(tmp_path / "m.json")])
    # Each role's fastest blocks, printed as decode_matvec.ROLE_BLOCK_SIZES entries.
    printed = capsys.readouterr().out
    assert '"qkv": MatvecBlockSizes(block_n=16, block_k=16, num_warps=4, num_stages=1, split_k=' in printed
    assert set(module.ROLE_SHAPES) == set(module.ROLES) and set(module.ROLE_SHAPES.values()) <= {
        shape[0] for shape in module.SHAPES}
    assert {r["split_k"] for r in rows if "us" in r} == {1, 2}
    assert all("error" not in r for r in rows) and json.loads((tmp_path / "m.json").read_text())["rows"]
    with pytest.raises(SystemExit):  # argparse's error: the unknown shape is named on stderr
        module.main(["--dry-run", "--shapes", "qkv,nope"])
    # --stages and --max-block-m set the sweep's blocks; --role-blocks-only sweeps each shape's roles'
    # own blocks at each --stages value, --block-k setting their K step.
    staged = module.main(["--dry-run", "--rows", "20", "--stages", "2", "--max-block-m", "32"])
    assert {(r["num_stages"], r["max_block_m"]) for r in staged if "us" in r} == {(2, 32)}
    only = module.main(["--dry-run", "--rows", "1", "--stages", "2,3", "--role-blocks-only", "--block-k", "32"])
    # (the dry run sweeps programs_n 0 and 3; q/k/v's parts refuse programs_n)
    want = {(shape, dataclasses.replace(module.role_block_sizes(role), num_stages=st, programs_n=p, block_k=32))
            for role, shape in (("out", "tiny"), ("gate_up", "tiny_gated"), ("qkv", "tiny_parts")) for st in (2, 3)
            for p in (0, 3) if not (p and shape == "tiny_parts")}
    fields = ("block_n", "block_k", "max_block_m", "num_warps", "num_stages", "split_k", "programs_n")
    got = {(r["shape"], module.MatvecBlockSizes(**{f: r[f] for f in fields})) for r in only if "us" in r}
    assert got == want, got ^ want
    with pytest.raises(SystemExit):  # argparse's error names --stages
        module.main(["--dry-run", "--stages", "0"])
    for bad in (["--max-block-m", "24"], ["--block-k", "16"], ["--role-blocks-only", "--block-k", "8"]):
        with pytest.raises(SystemExit):  # not powers of two >= 16; --block-k without --role-blocks-only
            module.main(["--dry-run", *bad])
    # Each layout sweeps its own tiles: kn wide and short (rows of >= 64 B), nk narrow and long.
    kn = module.SWEEPS["kn"]
    assert all(s.block_n * 2 >= 64 for s in kn) and {1, 4, 8} == {s.split_k for s in kn}


def test_matvec_blocks_file_sets_the_roles_and_bad_files_are_refused(tmp_path):
    """bench_inference --matvec-blocks: a sweep's --blocks-out file sets those roles' blocks for the
    process (the others keep theirs); a file that is not one, or names an unknown role, is refused
    with the flag named."""
    from twell_jax.pallas_kernels import decode_matvec

    saved, saved_many = dict(decode_matvec.ROLE_BLOCK_SIZES), dict(decode_matvec.ROLE_BLOCK_SIZES_MANY_ROWS)
    try:
        good = tmp_path / "blocks.json"
        good.write_text(json.dumps({"device": "cpu", "m": 1, "roles": {"qkv_nk": {
            "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1, "split_k": 2}}}))
        assert bench_inference.load_matvec_blocks(str(good))["qkv_nk"]["split_k"] == 2
        assert decode_matvec.role_block_sizes("qkv_nk") == decode_matvec.MatvecBlockSizes(
            block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=2)
        assert decode_matvec.role_block_sizes("head") == saved["head"]
        # A sweep at more than MANY_ROWS rows sets the blocks of steps of that many rows only.
        many = tmp_path / "many.json"
        many.write_text(json.dumps({"device": "cpu", "m": 64, "roles": {"head": {
            "block_n": 16, "block_k": 64, "max_block_m": 64, "num_warps": 4, "num_stages": 2, "split_k": 1}}}))
        bench_inference.load_matvec_blocks(str(many))
        assert decode_matvec.role_block_sizes("head", 64).block_k == 64
        assert decode_matvec.role_block_sizes("head") == saved["head"]
        for text, message in (("not json", "expected a bench_decode_matvec --blocks-out file"),
                              (json.dumps({"m": 1, "roles": {"qkv_nk": {"block_n": 3}}}), "--blocks-out file"),
                              (json.dumps({"m": 1, "roles": {"nope": saved["head"].__dict__}}), "unknown roles"),
                              (json.dumps({"roles": {}}), "--blocks-out file")):
            bad = tmp_path / "bad.json"
            bad.write_text(text)
            with pytest.raises(SystemExit, match=message):
                bench_inference.load_matvec_blocks(str(bad))
    finally:
        decode_matvec.ROLE_BLOCK_SIZES.clear()
        decode_matvec.ROLE_BLOCK_SIZES.update(saved)
        decode_matvec.ROLE_BLOCK_SIZES_MANY_ROWS.clear()
        decode_matvec.ROLE_BLOCK_SIZES_MANY_ROWS.update(saved_many)
