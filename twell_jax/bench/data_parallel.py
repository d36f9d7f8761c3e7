"""Data-parallel scaling: train a config for a fixed number of steps on 1 GPU, then on 2 (or any
list of device counts), with the same per-device micro-batch (global batch scaled with the device
count; one accumulation step, or --accum of them, as a preset's global batch gives), and report
step time, tokens/s total and per device, and the scaling efficiency  tput(N) / (N x tput(1)).

Tokens are SYNTHETIC (the library's `data.source="synthetic"`: uniform random ids, deterministic,
served through the same Grain pipeline as a corpus): throughput does not depend on the token
values for the dense FFN, and no tokenizer has to be trained on the GPU machine. For the sparse FFN the activation pattern of a
barely-trained model on random tokens is not that of real text: read the sparse rows as the cost
of the data-parallel machinery around the op, not as the sparse kernels' speed on real data.

Timing: the real `twell_jax.training.train.Trainer` loop (jit-compiled before the loop, each step's metrics
fetched when it completes, batches placed with `parallel.host_to_global`). Its per-step wall times are recorded;
the first `--warmup` steps are dropped, and the median of the rest is reported.

    python experiments/bench_data_parallel.py --config small --devices 1,2 --steps 30 --warmup 5
    # CPU smoke test (2 simulated devices, micro model):
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python experiments/bench_data_parallel.py \
        --config micro --devices 1,2 --steps 4 --warmup 1

Then (unless --equivalence-config '') it trains a small preset (default micro, its own FFN backend:
the Pallas kernels on a GPU) with ONE global batch on every device count and checks that the loss
trajectories agree to 1e-4 (relative): the real multi-GPU all-reduce and shard_map path.

Writes $OUT/bench_data_parallel.json (OUT defaults to ./bench_out); exit status 1 if a run failed
or the equivalence check did not hold.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import numpy as np

from twell_jax import run_dir as run_dir_lib
from twell_jax.bench import kernel_trace
from twell_jax.configs import get_config
from twell_jax.training import parallel
from twell_jax.training import train as train_lib
from twell_jax.config import ExperimentConfig, apply_overrides


def synthetic(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` on the library's synthetic source over the model's whole vocabulary: every device
    count and process layout trains on identical global batches."""
    data = dataclasses.replace(cfg.data, source="synthetic", vocab_size=cfg.model.vocab_size, progress=False)
    return dataclasses.replace(cfg, data=data)


def bench_config(base: ExperimentConfig, ffn_kind: str, num_devices: int, micro_batch: int,
                 steps: int, trace_steps: str = "", accum: int = 1) -> ExperimentConfig:
    """`base` on `num_devices` devices, `micro_batch` sequences per device, `accum` accumulation
    steps (micro-batches per optimizer step and device); `trace_steps` ("START:END") the profiler
    window of the run."""
    model = dataclasses.replace(base.model, ffn_kind=ffn_kind)
    sparsity = base.sparsity
    if not model.kind.l1:
        sparsity = sparsity.without_l1()  # dense baselines train without L1
    train = dataclasses.replace(
        base.train, steps=steps, num_devices=num_devices, micro_batch=micro_batch,
        global_batch=micro_batch * num_devices * accum, eval_every=0, eval_batches=1,
        eval_batch_size=num_devices, checkpoint_every=0, log_every=max(1, steps),
        tensorboard=False, progress_bar=False, profile_steps=trace_steps)
    return synthetic(dataclasses.replace(base, name=f"dp-{ffn_kind}-{num_devices}dev", model=model,
                                         sparsity=sparsity, train=train))


def trace_summary(trace: dict | None, steps: int) -> tuple[dict[str, Any], list[str]]:
    """What a run's profiler window shows, per step: the first GPU's kernels (parse_trace) and each
    GPU's collectives, exposed collective time, idle time and longest idle gaps
    (collective_overlap), as a record's fields and console lines."""
    if trace is None:
        return {"collectives": []}, ["no trace was written"]
    profile = kernel_trace.parse_trace(kernel_trace.gpu_trace(trace), steps)
    overlap = kernel_trace.collective_overlap(trace, steps)
    lines = kernel_trace.format_profile(profile, top=10)
    for gpu in overlap:
        lines.append(gpu.line())
        lines += [f"  idle {length:.2f} ms at +{at:.2f} ms, after {before}, before {after}"
                  for at, length, before, after in gpu.gaps[:3]]
    return {"collectives": [dataclasses.asdict(gpu) for gpu in overlap],
            "first_gpu_kernels": profile.to_json()}, lines


def gpu_time_efficiency(record: dict[str, Any], one: dict[str, Any]) -> float | None:
    """Weak-scaling efficiency by the traced steps' GPU time (`CollectiveOverlap.step_ms`): the
    1-device run's step over the slowest GPU's step of `record` (the host's step times hold the
    steps around the trace and the host's noise; this holds the GPUs' own work). None unless both
    runs were traced on a GPU."""
    mine = [gpu["step_ms"] for gpu in record.get("collectives") or [] if gpu.get("step_ms")]
    base = [gpu["step_ms"] for gpu in one.get("collectives") or [] if gpu.get("step_ms")]
    if not mine or not base:
        return None
    return base[0] / max(mine)


def run_one(cfg: ExperimentConfig, warmup: int, workdir: Path) -> dict[str, Any]:
    """Train `cfg` once; timing of the steps after `warmup`; with `train.profile_steps` set, each
    GPU's collective kernels against its other kernels in that window (`collective_overlap`)."""
    # save_final=False: a throw-away run; writing params + Adam state would only cost time and disk.
    result = train_lib.train(cfg, workdir / cfg.name, echo=lambda line: print("   ", line, flush=True),
                             hooks=train_lib.Hooks(save_final=False))
    traced = None
    window = cfg.train.profile_window
    if window is not None:
        trace = kernel_trace.read_profile_dir(workdir / cfg.name / run_dir_lib.PROFILE_SUBDIR)
        traced, lines = trace_summary(trace, window[1] - window[0])
        for line in lines:
            print("    [trace]", line, flush=True)
    times = np.array([record["step_time_s"] for record in result.history], np.float64)
    steady = times[warmup:]
    step_s = float(np.median(steady))
    n = cfg.train.num_devices
    tokens_per_step = cfg.train.global_batch * cfg.seq_len
    tput = parallel.tokens_per_second(tokens_per_step, step_s, n)
    losses = [record["loss"] for record in result.history]
    return {
        "ffn_kind": cfg.model.ffn_kind, "ffn_backend": cfg.model.ffn_backend, "num_devices": n,
        "sharding": cfg.train.sharding, "mesh": result.summary.get("mesh"),  # as set; the layout that ran
        "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
        "seq_len": cfg.seq_len, "tokens_per_step": tokens_per_step,
        "median_step_s": step_s, "mean_step_s": float(np.mean(steady)),
        "min_step_s": float(np.min(steady)), "max_step_s": float(np.max(steady)),
        "timed_steps": int(len(steady)), **tput,
        "compile_s": result.summary.get("compile_time_s"),
        "peak_memory_bytes": result.summary.get("peak_memory_bytes"),
        "first_loss": losses[0], "last_loss": losses[-1], "step_times_s": times.tolist(),
        **({} if traced is None else {"trace_steps": cfg.train.profile_steps, **traced}),
    }


def check_equivalence(config_name: str, device_counts: list[int], steps: int, workdir: Path,
                      overrides: list[str] = ()) -> dict[str, Any]:
    """Same global batch on each device count: the loss trajectories must agree (the real NCCL
    all-reduce and, for the sparse FFN, the op's shard_map around its kernels on this machine).
    `overrides`: the timed runs' --set, applied to this preset too (e.g. train.sharding=fsdp,
    model.ffn_backend=pallas)."""
    base = apply_overrides(get_config(config_name), list(overrides))
    global_batch = base.train.global_batch
    counts = [n for n in device_counts if global_batch % n == 0]
    out: dict[str, Any] = {"config": config_name, "ffn_kind": base.model.ffn_kind,
                           "ffn_backend": base.model.ffn_backend, "global_batch": global_batch,
                           "steps": steps, "losses": {}}
    for n in counts:
        train = dataclasses.replace(base.train, steps=steps, num_devices=n,
                                    micro_batch=global_batch // n, eval_batch_size=global_batch,
                                    eval_batches=1, tensorboard=False, progress_bar=False)
        optim = dataclasses.replace(base.optim, warmup_steps=0)  # step 1 must move the parameters
        cfg = synthetic(dataclasses.replace(base, name=f"equiv-{n}dev", train=train, optim=optim))
        result = train_lib.train(cfg, workdir / cfg.name, echo=lambda _: None)
        out["losses"][str(n)] = [record["loss"] for record in result.history]
    ref = np.array(out["losses"][str(counts[0])])
    out["max_rel_diff"] = max(float(np.max(np.abs(np.array(v) - ref) / np.abs(ref)))
                              for v in out["losses"].values())
    out["equal_within_1e-4"] = out["max_rel_diff"] < 1e-4
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="small", help="preset from configs/ (default: small)")
    parser.add_argument("--devices", default="1,2", help="comma-separated device counts; 1 first")
    parser.add_argument("--ffn-kinds", default="twell,relu_gated",
                        help="FFN kinds to bench (twell = sparse op, relu_gated = dense baseline)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per device per step (default: the config's micro_batch)")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches per optimizer step on each device (the global batch grows with it): "
                             "the gradient reduction's share of a step as a preset's global batch makes it")
    parser.add_argument("--steps", type=int, default=30, help="trained steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--equivalence-config", default="micro",
                        help="preset trained with ONE global batch on every device count to compare "
                             "losses ('' to skip)")
    parser.add_argument("--equivalence-steps", type=int, default=3, help="steps of that check")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides, as `twell train --set` (e.g. train.sharding=fsdp), for the "
                             "timed runs and the equivalence check's preset alike")
    parser.add_argument("--baseline", default=None, metavar="FILE",
                        help="an earlier bench_data_parallel.json of the same config on this machine: "
                             "its 1-device runs are the efficiency's reference (run --devices 2 only, "
                             "e.g. with other XLA_FLAGS or --set)")
    parser.add_argument("--trace-steps", default="", metavar="START:END",
                        help="profile these steps of each run and report, per GPU, the collective (NCCL) "
                             "kernels' time per step, how much of it no other kernel overlapped (exposed), "
                             "the GPU's idle time and its longest idle gaps; the trace's syncs at the "
                             "window's edges touch two steps, so put the window after --warmup")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"),
                        help="output directory (default: $OUT or ./bench_out)")
    args = parser.parse_args(argv)

    added = parallel.prepare_process()  # the twell commands' memory share and XLA options (XLA_FLAGS overrides them)
    parallel.initialize_distributed()
    device_counts = [int(n) for n in args.devices.split(",")]
    kinds = [k.strip() for k in args.ffn_kinds.split(",") if k.strip()]
    if args.accum < 1:
        parser.error(f"--accum must be >= 1, got {args.accum}")
    if args.warmup >= args.steps:
        parser.error(f"--warmup={args.warmup} must be < --steps={args.steps}")
    available = jax.device_count()
    if max(device_counts) > available:
        parser.error(f"--devices asks for {max(device_counts)} but only {available} are visible")
    try:
        base = apply_overrides(get_config(args.config), args.set)
    except ValueError as err:
        parser.error(f"--set: {err}")
    baseline_runs: list[dict[str, Any]] = []
    if args.baseline is not None:
        try:
            earlier = json.loads(Path(args.baseline).read_text())
        except (OSError, ValueError) as err:
            parser.error(f"--baseline {args.baseline}: cannot read it ({err})")
        if earlier.get("config") != args.config:
            parser.error(f"--baseline {args.baseline} is of config {earlier.get('config')!r}, not {args.config!r}")
        baseline_runs = [r for r in earlier.get("runs", []) if r.get("num_devices") == 1 and "error" not in r]
        if not baseline_runs:
            parser.error(f"--baseline {args.baseline} holds no successful 1-device run")
    micro = args.micro_batch or base.train.micro_batch
    try:  # the window checked against --steps by the run's own config check
        dataclasses.replace(base.train, steps=args.steps, profile_steps=args.trace_steps)
    except ValueError as err:
        parser.error(f"--trace-steps: {err}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {available} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}; config {args.config}: {base.model.num_params() / 1e6:.1f}M params, "
          f"seq {base.seq_len}, micro-batch {micro}/device x {args.accum} accumulation step(s); SYNTHETIC random "
          "tokens", flush=True)

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_dp_") as tmp:
        for kind in kinds:
            for n in device_counts:
                cfg = bench_config(base, kind, n, micro, args.steps, args.trace_steps, args.accum)
                print(f"[bench] {kind} on {n} device(s): global batch {cfg.train.global_batch}", flush=True)
                start = time.perf_counter()
                try:
                    record = run_one(cfg, args.warmup, Path(tmp))
                except Exception as err:  # noqa: BLE001 (record it, go on with the other runs)
                    traceback.print_exc()
                    record = {"ffn_kind": kind, "num_devices": n, "error": f"{type(err).__name__}: {err}"}
                record["wall_s"] = time.perf_counter() - start
                runs.append(record)

        equivalence = None
        if args.equivalence_config and len(device_counts) > 1:
            print(f"[bench] equivalence check: {args.equivalence_config}, same global batch on "
                  f"{device_counts} devices", flush=True)
            try:
                equivalence = check_equivalence(args.equivalence_config, device_counts,
                                                args.equivalence_steps, Path(tmp), args.set)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                equivalence = {"error": f"{type(err).__name__}: {err}"}
            print(f"[bench] equivalence: {json.dumps(equivalence)}", flush=True)

    for record in runs:  # efficiency against the same FFN kind's 1-device run (this one's, or --baseline's)
        one = next((r for r in runs + baseline_runs if r["ffn_kind"] == record["ffn_kind"]
                    and r["num_devices"] == 1 and "error" not in r), None)
        if one is not None and "error" not in record:
            record["scaling_efficiency"] = parallel.scaling_efficiency(
                record["tokens_per_s"], one["tokens_per_s"], record["num_devices"])
            gpu_time = gpu_time_efficiency(record, one)
            if gpu_time is not None:
                record["gpu_time_efficiency"] = gpu_time

    header = (f"{'ffn':<11}{'devices':>8}{'global B':>9}{'step ms':>10}{'tok/s total':>14}"
              f"{'tok/s/device':>14}{'efficiency':>12}{'by GPU time':>13}")
    lines = [header, "-" * len(header)]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['ffn_kind']:<11}{r['num_devices']:>8}  FAILED: {r['error'][:120]}")
            continue
        eff = r.get("scaling_efficiency")
        lines.append(f"{r['ffn_kind']:<11}{r['num_devices']:>8}{r['global_batch']:>9}"
                     f"{r['median_step_s'] * 1e3:>10.1f}{r['tokens_per_s']:>14,.0f}"
                     f"{r['tokens_per_s_per_device']:>14,.0f}"
                     f"{(f'{eff:.3f}' if eff is not None else '-'):>12}"
                     f"{(f'{gpu:.3f}' if (gpu := r.get('gpu_time_efficiency')) is not None else '-'):>13}")
    table = "\n".join(lines)
    print("\n" + table + "\n(median step time after warm-up; efficiency = tok/s(N) / (N x tok/s(1)); by GPU time "
          "(--trace-steps): the 1-device run's traced GPU step over the slowest GPU's; synthetic random tokens)",
          flush=True)

    report = {
        "benchmark": "data_parallel_scaling", "config": args.config, "synthetic_tokens": True,
        "devices_visible": available, "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(), "jax_version": jax.__version__,
        "python": platform.python_version(), "steps": args.steps, "warmup": args.warmup,
        "micro_batch_per_device": micro, "accum_steps": args.accum, "model": dataclasses.asdict(base.model),
        "runs": runs,
        "overrides": list(args.set), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "default_xla_flags_added": added,
        "baseline": args.baseline, "baseline_runs": baseline_runs,
        "table": table, "equivalence": equivalence,
    }
    path = out_dir / "bench_data_parallel.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"[bench] wrote {path}", flush=True)
    failed = any("error" in r for r in runs) or (
        equivalence is not None and not equivalence.get("equal_within_1e-4", False))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
