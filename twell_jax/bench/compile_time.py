"""Start-up cost of each preset: the init program and the training step's compile, against depth.

    python experiments/bench_compile.py --configs 0.5b,1b,1.5b,2b --variants relu_gated,twell@pallas
    python experiments/bench_compile.py --dry-run      # micro shapes at 2 and 24 layers, on CPU
    python experiments/bench_compile.py --configs 1b --variants twell@pallas --set model.layer_unroll=0 \
        --profile-compile                              # where an unrolled sparse step's compile goes

Per preset and variant (`kind[@backend]`, as bench_step's without the remat, which is the
preset's or --set's): seconds to compile `jit(init_model)` and to run it, seconds to lower and to
compile the training step (jax.grad of CE + L1 and the AdamW update, bench_step.build_step), the
size of the lowered step's StableHLO text, what the compiled step holds (`hlo_counts`:
instructions, conditionals, while loops, custom calls, Triton calls, sorts), and the first step's
time (compile excluded). Where the layers loop (model.layer_unroll 1: the sparse op's kinds under
"auto"), every number but the init's run time should be about flat in depth; unrolled (the dense
kinds under "auto", or 0) the step's compile grows with depth, as a plain-JAX model's does.
Nothing comes from JAX's persistent compilation cache (it is turned off here: a hit would time a
load). `--profile-compile` traces each step's compile with jax.profiler and keeps its host events summed
by name (`host_events`: the compiler's passes and stages, autotuning, kernel codegen).
Printed last: one table; `--out` gets the rows as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from twell_jax.bench.kernel_trace import read_profile_dir
from twell_jax.bench.step import DRY_RUN_SETS, build_step, variant_config
from twell_jax.configs import get_config
from twell_jax import config as config_lib
from twell_jax.model import init_model, split_model


# What the compiled step is made of (`hlo_counts`): instructions and the kinds that cost compile time.
HLO_COUNTS = {"conditionals": " conditional(", "while_loops": " while(", "custom_calls": "custom-call(",
              "triton_calls": "__gpu$xla.gpu.triton", "sorts": " sort("}


def hlo_counts(text: str) -> dict[str, int]:
    """Instruction counts of a compiled module's text (`Compiled.as_text()`): every instruction
    (an indented `%name = ...` line of any computation) and those of HLO_COUNTS."""
    counts = {"instructions": sum(1 for line in text.splitlines() if line.startswith("  ") and " = " in line)}
    counts.update({name: text.count(mark) for name, mark in HLO_COUNTS.items()})
    return counts


def host_events(trace: dict | None, top: int = 12) -> list[tuple[str, float, int]]:
    """The host-side events of a profiler trace (`kernel_trace.read_profile_dir`) summed by name,
    trailing numbers dropped (one name per compiler pass or stage): [(name, seconds, count)],
    largest first. Nested events each count in full, and the compiler's parallel work sums over its
    threads, so the seconds say where the work goes, not a wall-clock split. The Python frames
    around the call (names starting with "$") are left out."""
    totals: dict[str, list[float]] = {}
    for event in (trace or {}).get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event or str(event.get("name", "")).startswith("$"):
            continue  # "$file:line function": the Python frames around the compile call
        name = re.sub(r"[\d._]+$", "", str(event.get("name", "")))[:100]
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += event["dur"] / 1e6
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, round(seconds, 3), int(count)) for name, (seconds, count) in ranked]


def measure(base: config_lib.ExperimentConfig, kind: str, backend: str | None, micro_batch: int,
            profile: bool = False) -> dict[str, Any]:
    """One (preset, variant): init and step compile seconds, lowered size, the compiled step's
    `hlo_counts`, first step seconds; `profile`: the step's compile under jax.profiler, its
    `host_events` in the row ("compile_events")."""
    cfg = variant_config(base, kind, backend, base.model.remat)
    row: dict[str, Any] = {"config": base.name, "n_layers": cfg.model.n_layers, "variant": f"{kind}"
                           + (f"@{backend}" if backend else ""), "remat": cfg.model.remat}
    try:
        init = jax.jit(lambda: split_model(init_model(cfg.model, seed=0))[1])
        t0 = time.perf_counter()
        compiled_init = init.lower().compile()
        row["init_compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        params = jax.block_until_ready(compiled_init())
        row["init_run_s"] = time.perf_counter() - t0
        step, state, _, _ = build_step(cfg, kind, optimizer=True, params=params)
        del params
        tokens = jax.random.randint(jax.random.key(1), (micro_batch, cfg.seq_len + 1), 0, cfg.model.vocab_size)
        t0 = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=0).lower(state, tokens)
        row["step_lower_s"] = time.perf_counter() - t0
        row["step_hlo_chars"] = len(lowered.as_text())
        with tempfile.TemporaryDirectory() as log_dir:
            with jax.profiler.trace(log_dir) if profile else contextlib.nullcontext():
                t0 = time.perf_counter()
                compiled = lowered.compile()
                row["step_compile_s"] = time.perf_counter() - t0
            if profile:
                row["compile_events"] = host_events(read_profile_dir(Path(log_dir)))
        row["step_hlo_counts"] = hlo_counts(compiled.as_text())
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(state, tokens))
        row["first_step_s"] = time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 (an OOM or a refused shape: report it, go on)
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
    finally:
        jax.clear_caches()
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | layers | variant | remat | init compile s | init run s | step lower s | step compile s "
             "| step HLO kchars | first step s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['n_layers']} | {r['variant']} | {r['remat']} | failed: "
                         f"{r['error'][:90]} | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['n_layers']} | {r['variant']} | {r['remat']} | {r['init_compile_s']:.1f} | "
                     f"{r['init_run_s']:.1f} | {r['step_lower_s']:.1f} | {r['step_compile_s']:.1f} | "
                     f"{r['step_hlo_chars'] / 1e3:.0f} | {r['first_step_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="0.5b,1b,1.5b,2b", help="comma-separated presets (configs/)")
    parser.add_argument("--variants", default="relu_gated,twell@pallas",
                        help="comma-separated kind[@backend] (bench_step's variants without the remat)")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE", help="overrides for every preset")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="micro shapes at 2 and 24 layers on CPU")
    parser.add_argument("--profile-compile", action="store_true",
                        help="trace each step's compile (jax.profiler) and print where the compiler's time went")
    args = parser.parse_args(argv)
    if args.out and Path(args.out).is_dir():  # checked before compiling anything, not when writing the rows
        parser.error(f"--out {args.out} is a directory; give the JSON file to write")
    variants = []
    for item in filter(None, (v.strip() for v in args.variants.split(","))):
        kind, _, backend = item.partition("@")
        variants.append((kind, backend or None))
    if args.dry_run:
        bases = [config_lib.apply_overrides(get_config("micro"), DRY_RUN_SETS + [f"model.n_layers={n}"] + args.set)
                 for n in (2, 24)]
    else:
        bases = [config_lib.apply_overrides(get_config(name), args.set) for name in args.configs.split(",")]
    # Every program compiled here, never loaded from JAX's persistent cache (JAX_COMPILATION_CACHE_DIR
    # or a run's: a hit would time, and profile, a load instead of a compile). JAX decides whether
    # the cache is used once per process, at its first compile: reset that decision too, or a
    # process that compiled before (a test session, a notebook) keeps loading from it.
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    print(f"[bench_compile] on {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for base in bases:
        for kind, backend in variants:
            row = measure(base, kind, backend, args.micro_batch or (2 if args.dry_run else base.train.micro_batch),
                          profile=args.profile_compile)
            print(f"[bench_compile] {json.dumps(row)}", flush=True)
            for name, seconds, count in row.get("compile_events", [])[:8]:
                print(f"[bench_compile]   {seconds:9.2f} s {count:6d}x  {name}", flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                              "rows": rows}, indent=2))
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
