"""experiments/bench_compile.py (twell_jax/bench/compile_time.py) at micro shapes on CPU: the compiled
step's contents (`hlo_counts`) and the compile's host events (`--profile-compile`); no time is
asserted."""
from __future__ import annotations

import json

import pytest

from twell_jax import config as config_lib
from twell_jax.bench import compile_time
from twell_jax.bench.step import DRY_RUN_SETS
from twell_jax.configs import get_config


def test_hlo_counts_reads_a_compiled_modules_text():
    text = ("HloModule m\n\nbody {\n  %p = s32[] parameter(0)\n  %s = f32[4] sort(%x), dimensions={0}\n}\n\n"
            "ENTRY main {\n  %w = (s32[]) while(%t), condition=%c, body=%body\n"
            "  %k = f32[2] custom-call(%a), custom_call_target=\"__gpu$xla.gpu.triton\"\n"
            "  %c = f32[2] conditional(%b, %a, %a), branch_computations={%x, %y}\n}\n")
    assert compile_time.hlo_counts(text) == {"instructions": 5, "conditionals": 1, "while_loops": 1,
                                             "custom_calls": 1, "triton_calls": 1, "sorts": 1}


def test_host_events_sums_by_name_without_python_frames():
    trace = {"traceEvents": [{"ph": "X", "name": "RunHloPass.12", "dur": 2e6}, {"ph": "X", "name": "RunHloPass.3", "dur": 1e6},
                             {"ph": "X", "name": "$stages.py:586 compile", "dur": 9e6},
                             {"ph": "M", "name": "process_name"}, {"ph": "X", "name": "Codegen", "dur": 5e5}]}
    assert compile_time.host_events(trace) == [("RunHloPass", 3.0, 2), ("Codegen", 0.5, 1)]
    assert compile_time.host_events(None) == []


@pytest.mark.slow  # a benchmark dry run (two model sizes, two variants, profiled compiles)
def test_the_twin_unrolls_and_the_sparse_op_loops_and_the_compile_is_profiled(tmp_path):
    out = tmp_path / "rows.json"
    rows = compile_time.main(["--dry-run", "--variants", "relu_gated,twell@reference", "--profile-compile",
                              "--out", str(out)])
    assert [(r["variant"], r["n_layers"]) for r in rows] == [("relu_gated", 2), ("twell@reference", 2),
                                                             ("relu_gated", 24), ("twell@reference", 24)]
    assert not any("error" in r for r in rows)
    size = {(r["variant"], r["n_layers"]): r["step_hlo_counts"]["instructions"] for r in rows}
    # model.layer_unroll "auto": the dense twin unrolled (its step grows with depth), the sparse op's
    # kind in the layer loop (flat in depth; the loop's while ops on top of the twin's).
    assert size["relu_gated", 24] > 5 * size["relu_gated", 2]
    assert size["twell@reference", 24] < 1.5 * size["twell@reference", 2]
    assert rows[1]["step_hlo_counts"]["while_loops"] > rows[0]["step_hlo_counts"]["while_loops"]
    assert all(r["compile_events"] and any("ompile" in name for name, _, _ in r["compile_events"]) for r in rows)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))


@pytest.mark.slow  # a benchmark dry run, twice (cold and warm cache)
def test_a_warm_persistent_cache_is_not_timed():
    # A process that compiled with JAX's persistent cache on (as an earlier test in this worker may
    # have, or a notebook), every compile written to it: a second run of the same steps must compile
    # them again, not load them (the compiler's events are in its profile).
    import jax
    import jax.numpy as jnp
    previous = (jax.config.jax_enable_compilation_cache, jax.config.jax_persistent_cache_min_compile_time_secs)
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.jit(lambda x: x * 3 - 1)(jnp.ones(4)).block_until_ready()
        argv = ["--dry-run", "--variants", "relu_gated", "--micro-batch", "1", "--profile-compile"]
        compile_time.main(argv)
        rows = compile_time.main(argv)
    finally:
        jax.config.update("jax_enable_compilation_cache", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
    assert all(any("ompile" in name for name, _, _ in r["compile_events"]) for r in rows), rows


def test_measure_reports_a_failure_in_its_row():
    base = config_lib.apply_overrides(get_config("micro"), DRY_RUN_SETS)
    row = compile_time.measure(base, "twell", "pallas", 2)  # no GPU here: the kernels cannot compile
    assert "error" in row and row["variant"] == "twell@pallas"
