"""Sparse vs dense training at scale (issue 6): one config (default the paper's `0.5b`, 1M-token
global batch) trained with the dense `relu_gated` FFN (no L1) and with the sparse `twell` FFN (the
config's L1, 2e-5), on a list of GPU counts. Reports tokens/s in total and per GPU, scaling
efficiency against the same FFN's 1- and 2-GPU runs, step time, peak memory per GPU, compile time,
and the CE and mean-active-neuron curves.

Two kinds of run, each in a FRESH SUBPROCESS (its own compile caches and memory peak; an OOM or a
crash is recorded and the next run goes on):
- curve runs, on `--curve-devices` GPUs (default: the largest count): the real training loop
  stopped by `train.time_limit_s`; `--minutes` is the TOTAL loop time of all curve runs, split
  evenly over the FFN kinds (start-up, compilation and the final evaluation come on top);
- timing runs, on the other counts: `--timing-steps` steps (the first 2 are not timed).
The global batch stays the config's on every count (same tokens per step; accumulation steps =
global / (micro-batch x GPUs)), so the efficiency tput(N) / (N x tput(1)) is strong scaling.

`--max-wall-s` makes an invocation fit a hard wall-clock limit: before each curve run the loop
limits are lowered (equally for every FFN kind) so that the runs left, each costing the start-up +
compile + eval time measured on the earlier runs (DEFAULT_RUN_OVERHEAD_S before one is measured),
end in time; a run still going at the limit is killed and its logged steps are kept as partial
curves.

Results of earlier invocations (`--baseline FILE.json`, e.g. the 1- and 2-GPU runs of a 2-GPU
machine) are merged, so an 8-GPU invocation reports its efficiency against them; the device kind
must match (a warning says so otherwise).

    # on a 2-GPU machine, inside a 600 s call (curve loops shortened to fit --max-wall-s):
    python experiments/run_sparse_vs_dense.py --devices 1,2 --timing-steps 3 --minutes 3 --max-wall-s 560
    # later, on 8 GPUs, against the file the first call wrote:
    python experiments/run_sparse_vs_dense.py --devices 8 --minutes 4 --max-wall-s 560 \
        --baseline experiments/results/sparse_vs_dense_h200x2.json
    # CPU smoke test (2 simulated devices, micro model, random tokens):
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python experiments/run_sparse_vs_dense.py \\
        --config micro --devices 1,2 --micro-batch 4 --timing-steps 3 --minutes 0.05 --data synthetic

Data: `--data stdlib` (default) trains a byte-level BPE of the config's vocabulary on the Python
standard library (built once by this parent process, cached under data.cache_dir; about 8M tokens
with a 49152 BPE, so a long 1M-token-batch run repeats it many times: the curves show early
training, not a fineweb run) with a 2% validation split; `--data synthetic` uses uniform random
tokens (CE cannot fall below ln(vocab); throughput only). Children do not write the final Orbax
checkpoint (several GB for 0.5b, never resumed); their metrics.jsonl / summary.json / config.json
are copied to $OUT/runs/<run>/.

Writes (after every run, so a killed call keeps what finished) $OUT/sparse_vs_dense.json,
$OUT/sparse_vs_dense.md (the table for BENCHMARKS.md) and $OUT/curves.png; OUT defaults to
./scale_out. The table is printed last. Exit status 1 if a run of this invocation failed.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, uninstalled

# The parent imports JAX modules but never touches a device: initialising the GPU backend here
# would hold a CUDA context (and by default 75% of every GPU's memory) while the children run.
from twell_jax.configs import get_config  # noqa: E402
from twell_jax import config as config_lib  # noqa: E402
from twell_jax.training import parallel  # noqa: E402
from twell_jax.config import FFN_KINDS, ExperimentConfig  # noqa: E402

SCRIPT_ID = "experiments/run_sparse_vs_dense.py"
REPORT_STEM = "sparse_vs_dense"
DENSE_KINDS = ("relu_gated", "swiglu")  # dense baselines: trained without L1
TIMED_FROM_STEP = 2  # steps 1-2 (first execution, lazy allocations) are left out of the step time
EVAL_SEQUENCES = 8  # validation sequences per batch (rounded up to a multiple of the GPU count)
CURVE_KEYS = ("step", "ce", "loss", "l1", "l0_mean", "lr", "grad_norm", "step_time_s")
STDLIB_MIN_VAL_FRACTION = 0.02  # the paper config's 0.001 leaves ~2 stdlib files: too few sequences
DEFAULT_RUN_OVERHEAD_S = 120.0  # start-up + compile + final eval of one run, until one is measured
END_RESERVE_S = 15.0  # --max-wall-s: kept for the parent's final writes
PROGRESS_EVERY_S = 20.0  # a child prints its latest step this often (the loop itself is silent)
_PROBE = ("import json, jax; d = jax.devices(); print('PROBE' + json.dumps({'count': len(d), "
          "'kind': d[0].device_kind, 'platform': d[0].platform, 'jax': jax.__version__}))")


def log(text: str) -> None:
    print(f"[svd] {text}", flush=True)


# ----------------------------------------------------------------------------- planning


@dataclasses.dataclass
class PlannedRun:
    """One training run: which FFN, how many GPUs, and whether it is a curve or a timing run."""

    name: str
    ffn_kind: str
    num_devices: int
    role: str  # "curve" (time-limited, the curves) or "timing" (a few steps, throughput only)
    cfg: ExperimentConfig

    @property
    def accum_steps(self) -> int:
        tc = self.cfg.train
        return tc.global_batch // (tc.micro_batch * self.num_devices)

    def record(self) -> dict[str, Any]:
        """What is known of the run before it starts (its result record adds to it)."""
        tc = self.cfg.train
        return {"name": self.name, "ffn_kind": self.ffn_kind,
                "ffn_backend": "dense" if self.ffn_kind in DENSE_KINDS else self.cfg.model.ffn_backend,
                "role": self.role, "num_devices": self.num_devices, "global_batch": tc.global_batch,
                "micro_batch": tc.micro_batch, "accum_steps": self.accum_steps, "seq_len": self.cfg.seq_len,
                "tokens_per_step": tc.global_batch * self.cfg.seq_len, "l1_coef": self.cfg.sparsity.l1_coef,
                "planned_steps": tc.steps, "time_limit_s": tc.time_limit_s, "source": "this run"}

    def describe(self) -> str:
        tc = self.cfg.train
        tokens = tc.global_batch * self.cfg.seq_len
        what = (f"curve run, up to {tc.steps} steps, the loop stops after {tc.time_limit_s:.0f}s "
                f"(train.time_limit_s), every step logged"
                if self.role == "curve" else
                f"timing run, {tc.steps} steps (steps 1-{TIMED_FROM_STEP} not timed)")
        l1 = "no L1 (dense baseline)" if self.ffn_kind in DENSE_KINDS else f"L1 {self.cfg.sparsity.l1_coef:g}"
        return (f"{self.ffn_kind} on {self.num_devices} GPU(s): {what}; global batch {tc.global_batch} = "
                f"{tc.micro_batch}/GPU x {self.accum_steps} accum x {self.num_devices} GPU(s), {tokens:,} "
                f"tokens/step; {l1}")


def run_config(base: ExperimentConfig, ffn_kind: str, num_devices: int, micro_batch: int, role: str,
               timing_steps: int, time_limit_s: float) -> ExperimentConfig:
    """`base` with this run's FFN, device count and loop settings (these win over --set)."""
    model = dataclasses.replace(base.model, ffn_kind=ffn_kind)
    sparsity = base.sparsity
    if ffn_kind in DENSE_KINDS:
        sparsity = dataclasses.replace(sparsity, l1_coef=0.0, reinit_dead=False)
    curve = role == "curve"
    train = dataclasses.replace(
        base.train, num_devices=num_devices, micro_batch=micro_batch,
        steps=base.train.steps if curve else timing_steps, time_limit_s=time_limit_s if curve else 0.0,
        log_every=1, eval_every=0, eval_batches=2 if curve else 1,
        eval_batch_size=num_devices * math.ceil(EVAL_SEQUENCES / num_devices),
        checkpoint_every=0, tensorboard=False, progress_bar=False)
    data = dataclasses.replace(base.data, progress=False)
    return dataclasses.replace(base, name=f"{base.name}-{ffn_kind}-{num_devices}gpu-{role}", model=model,
                               sparsity=sparsity, train=train, data=data)


def base_config(config_name: str, data_mode: str, overrides: list[str]) -> ExperimentConfig:
    """The preset, its data pointed at what `data_mode` needs, then the user's --set overrides."""
    cfg = get_config(config_name)
    if data_mode == "stdlib":
        cfg = config_lib.apply_overrides(cfg, [
            "data.source=stdlib", "data.tokenizer=bpe", f"data.vocab_size={cfg.model.vocab_size}",
            f"data.val_fraction={max(cfg.data.val_fraction, STDLIB_MIN_VAL_FRACTION)}"])
    else:  # the library's synthetic source: random ids over the model's vocabulary
        cfg = config_lib.apply_overrides(cfg, ["data.source=synthetic", f"data.vocab_size={cfg.model.vocab_size}"])
    return config_lib.apply_overrides(cfg, overrides)


def parse_counts(text: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--devices={text!r}: expected a comma-separated list of device counts, e.g. 1,2")
    if not counts or min(counts) < 1:
        parser.error(f"--devices={text!r}: expected positive device counts")
    if len(set(counts)) != len(counts):
        parser.error(f"--devices={text!r}: a device count appears twice")
    return sorted(counts)


# ----------------------------------------------------------------------------- child (one run)


class ChildProgress:
    """Trainer hooks of a child run: prints its latest step every PROGRESS_EVERY_S and counts the
    layer-steps in which the sparse op took its exact dense path (from every step's record)."""

    def __init__(self, start: float):
        self.start, self.last_print = start, start
        self.fallback_layer_steps: int | None = None

    def on_step(self, record: dict[str, Any]) -> None:
        if "dense_fallback_per_layer" in record:
            self.fallback_layer_steps = (self.fallback_layer_steps or 0) + int(sum(record["dense_fallback_per_layer"]))
        now = time.perf_counter()
        if now - self.last_print >= PROGRESS_EVERY_S:
            self.last_print = now
            print(f"[svd-child] step {record['step']}: ce {record['ce']:.4f}, mean active neurons/token "
                  f"{np.mean(record['l0_per_layer']):.1f}, {record['step_time_s']:.2f} s/step "
                  f"({now - self.start:.0f}s since start)", flush=True)


def _peak_bytes(device: Any) -> int | None:
    stats = device.memory_stats()
    if not stats or stats.get("peak_bytes_in_use") is None:
        return None  # CPU: no allocator statistics
    return int(stats["peak_bytes_in_use"])


def _child_train(spec: dict[str, Any]) -> dict[str, Any]:
    import jax

    cfg = config_lib.from_dict(spec["config"])
    n = int(cfg.train.num_devices)
    run_dir = Path(spec["run_dir"])

    from twell_jax.training import train as train_lib

    start = time.perf_counter()
    progress = ChildProgress(start)
    # save_final=False: the run dir is thrown away; writing params + Adam state (6 GB for 0.5b)
    # would cost seconds of the device call's budget and disk on a machine that never resumes.
    hooks = train_lib.Hooks(on_step=progress.on_step, save_final=False)
    # The config's own data (data.source=synthetic for --data synthetic).
    trainer = train_lib.Trainer(cfg, run_dir, echo=lambda line: print(line, flush=True), hooks=hooks)
    result = trainer.run()
    train_call_s = time.perf_counter() - start
    peaks = [_peak_bytes(d) for d in jax.devices()[:n]]
    known = [p for p in peaks if p is not None]

    history = result.history
    times = np.array([r["step_time_s"] for r in history], np.float64)
    timed = times[TIMED_FROM_STEP:]
    tokens_per_step = cfg.train.global_batch * cfg.seq_len
    timing: dict[str, Any] = {"median_step_s": None, "mean_step_s": None, "min_step_s": None,
                              "max_step_s": None, "tokens_per_s": None, "tokens_per_s_per_device": None}
    if len(timed):
        median = float(np.median(timed))
        timing = {"median_step_s": median, "mean_step_s": float(np.mean(timed)),
                  "min_step_s": float(np.min(timed)), "max_step_s": float(np.max(timed)),
                  **parallel.tokens_per_second(tokens_per_step, median, n)}
    summary = result.summary
    keep_dir = Path(spec["keep_dir"])
    keep_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "summary.json", "config.json"):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, keep_dir / name)
    return {
        "device_kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
        "steps_done": int(summary["steps"]), "timed_steps": int(len(timed)), **timing,
        "step_times_s": times.tolist(),
        "peak_memory_bytes": max(known) if known else None, "peak_memory_bytes_per_device": peaks,
        "compile_s": summary.get("compile_time_s"), "loop_s": float(times.sum()), "train_call_s": train_call_s,
        "stopped_by_time_limit": bool(summary.get("stopped_by_time_limit")),
        "final_train_ce": summary.get("final_train_ce"), "val_loss": summary.get("val_loss"),
        "val_perplexity": summary.get("val_perplexity"), "val_l0_mean": summary.get("val_l0_mean"),
        "val_l0_per_layer": summary.get("val_l0_per_layer"), "val_sparsity": summary.get("val_sparsity"),
        "dead_share_mean": summary.get("dead_share_mean"),
        "dense_fallback_layer_steps": progress.fallback_layer_steps,
        "curves": {key: [r.get(key) for r in history] for key in CURVE_KEYS},
        "kept_files": str(keep_dir),
    }


def child_main(spec_path: str) -> int:
    """`--child SPEC.json`: train one run, write its result JSON where the spec says, exit."""
    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    try:
        record, status = _child_train(spec), 0
    except BaseException as err:  # noqa: BLE001 (OOM, divergence, Ctrl-C: the parent records it)
        traceback.print_exc()
        text = f"{type(err).__name__}: {err}"
        record, status = {"error": text if len(text) <= 2000 else text[:1000] + " ... " + text[-1000:]}, 1
    record["child_wall_s"] = time.perf_counter() - start
    Path(spec["result_path"]).write_text(json.dumps(record, default=str))
    return status


# ----------------------------------------------------------------------------- parent


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def probe_devices(env: dict[str, str]) -> dict[str, Any]:
    """Count the devices in a throwaway process, so that this one never opens a GPU."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"the device probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len("PROBE"):])


def fitted_time_limit(planned: PlannedRun, runs_left: list[PlannedRun], remaining_s: float,
                      done: list[dict[str, Any]]) -> float:
    """`planned`'s curve loop limit, shrunk so that it and the runs after it end within `remaining_s`.

    Each run left costs its fixed part (start-up, compile, final eval: the largest measured so far
    plus 10%, or DEFAULT_RUN_OVERHEAD_S before any run finished); the rest is shared by the curve runs.
    """
    overheads = [r["wall_s"] - r["loop_s"] for r in done if "loop_s" in r and "wall_s" in r]
    overhead = 1.1 * max(overheads) if overheads else DEFAULT_RUN_OVERHEAD_S
    curves_left = max(1, sum(p.role == "curve" for p in runs_left))
    share = (remaining_s - END_RESERVE_S - overhead * len(runs_left)) / curves_left
    return max(1.0, min(planned.cfg.train.time_limit_s, share))  # time_limit_s=0 would mean "no limit"


def run_child(planned: PlannedRun, work_dir: Path, out_dir: Path, data_mode: str, env: dict[str, str],
              timeout_s: float | None) -> dict[str, Any]:
    """Train `planned` in a fresh `python THIS_SCRIPT --child` process; its record (or its error)."""
    record = planned.record()
    run_dir = work_dir / planned.name
    spec = {"config": config_lib.to_dict(planned.cfg), "data": data_mode, "run_dir": str(run_dir),
            "keep_dir": str(out_dir / "runs" / planned.name),
            "result_path": str(work_dir / f"{planned.name}.result.json")}
    spec_path = work_dir / f"{planned.name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path = Path(spec["result_path"])
    tail: collections.deque[str] = collections.deque(maxlen=30)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            bufsize=1, env=env)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"  | {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        killed = True
    finally:
        if proc.poll() is None:  # timeout or Ctrl-C: end the child we started
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    record["wall_s"] = time.perf_counter() - start
    if result_path.exists():
        record.update(json.loads(result_path.read_text()))
    if killed:
        record["error"] = f"killed after {timeout_s:.0f}s: the --max-wall-s budget ran out"
    elif "error" not in record and proc.returncode != 0:
        how = (f"killed by signal {-proc.returncode} (host out of memory?)" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        record["error"] = f"the child {how} without a result; last output: " + " / ".join(list(tail)[-8:])
    if "error" in record and (run_dir / "metrics.jsonl").exists():
        # Failed or killed (time budget, OOM, divergence): keep the steps it logged, marked partial.
        keep_dir = Path(spec["keep_dir"])
        keep_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(run_dir / "metrics.jsonl", keep_dir / "metrics.jsonl")
        record["partial_curves"] = curves_from_metrics(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir, ignore_errors=True)
    return record


def curves_from_metrics(path: Path) -> dict[str, list[Any]]:
    """CURVE_KEYS per logged training step of a metrics.jsonl (layer mean of l0_per_layer)."""
    curves: dict[str, list[Any]] = {key: [] for key in CURVE_KEYS}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if "ce" not in record:  # validation records
            continue
        record["l0_mean"] = float(np.mean(record["l0_per_layer"])) if "l0_per_layer" in record else None
        for key in CURVE_KEYS:
            curves[key].append(record.get(key))
    return curves


def load_baselines(paths: list[str], context: dict[str, Any], warnings: list[str]) -> list[dict[str, Any]]:
    """Successful runs of earlier invocations (their own baselines too), each tagged with its file."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--baseline {path}: cannot read it as JSON ({err})") from None
        if data.get("script") != SCRIPT_ID:
            raise ValueError(f"--baseline {path}: not a result of {SCRIPT_ID} (no 'script' field naming it)")
        for key in ("device_kind", "config", "seq_len", "global_batch", "micro_batch", "data"):
            if data.get(key) != context[key]:
                warnings.append(f"--baseline {path}: {key} is {data.get(key)!r}, this run's is "
                                f"{context[key]!r}" + ("; efficiency across device kinds is not meaningful"
                                                       if key == "device_kind" else ""))
        for run in data.get("runs", []) + data.get("baseline_runs", []):
            if "error" in run or not run.get("tokens_per_s"):
                continue
            run = dict(run)
            if run.get("source", "this run") == "this run":
                run["source"] = str(path)
            run["device_kind"] = run.get("device_kind", data.get("device_kind"))
            runs.append(run)
    return runs


def add_comparisons(current: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> None:
    """Efficiency against the same FFN's 1- and 2-GPU runs, and the sparse/dense ratios per GPU count.

    References come from this invocation first, then from the baseline files (first file first).
    """
    ok = [r for r in current + baseline if "error" not in r and r.get("tokens_per_s")]

    def find(kind: str, n: int) -> dict[str, Any] | None:
        return next((r for r in ok if r["ffn_kind"] == kind and r["num_devices"] == n), None)

    present = {r["ffn_kind"] for r in ok}
    dense_kind = next((k for k in DENSE_KINDS if k in present), None)  # relu_gated first: the paper's twin
    for run in ok:
        n, tput = run["num_devices"], run["tokens_per_s"]
        one, two = find(run["ffn_kind"], 1), find(run["ffn_kind"], 2)
        run["eff_vs_1"] = parallel.scaling_efficiency(tput, one["tokens_per_s"], n) if one else None
        run["eff_vs_1_ref"] = f"{one['name']} ({one['source']})" if one else None
        run["eff_vs_2"] = tput * 2 / (n * two["tokens_per_s"]) if two and n >= 2 else None
        run["eff_vs_2_ref"] = f"{two['name']} ({two['source']})" if two and n >= 2 else None
        dense = find(dense_kind, n) if dense_kind else None
        run["tokens_per_s_vs_dense"] = tput / dense["tokens_per_s"] if dense else None
        run["peak_memory_vs_dense"] = (run["peak_memory_bytes"] / dense["peak_memory_bytes"]
                                       if dense and run.get("peak_memory_bytes") and dense.get("peak_memory_bytes")
                                       else None)


# ----------------------------------------------------------------------------- report


def ffn_label(run: dict[str, Any]) -> str:
    """"relu_gated (dense)" or "twell (L1 2e-05)"."""
    kind = run["ffn_kind"]
    return f"{kind} ({'dense' if kind in DENSE_KINDS else 'L1 ' + format(run.get('l1_coef', 0), 'g')})"


def _count(value: int) -> str:
    """A parameter count: 514M, 1.23B, 30K."""
    if value >= 1e9:
        return f"{value / 1e9:.2f}B"
    return f"{value / 1e6:.0f}M" if value >= 1e6 else f"{value / 1e3:.0f}K"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


TABLE_HEADER = ("FFN", "GPUs", "role", "micro x accum", "steps", "step s (median)", "tokens/s total",
                "tokens/s per GPU", "eff vs 1 GPU", "eff vs 2 GPUs", "tok/s vs dense", "peak mem/GPU GiB (max)",
                "compile s", "train CE (last)", "val loss", "active neurons/token (val)", "source")


def table_rows(runs: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = []
    for r in sorted(runs, key=lambda r: (r["ffn_kind"] not in DENSE_KINDS, r["ffn_kind"], r["num_devices"])):
        ffn = ffn_label(r)
        source = "this run" if r.get("source") == "this run" else Path(str(r.get("source"))).name
        if "error" in r:
            rows.append((ffn, str(r["num_devices"]), r.get("role", "-"), "-", "-", "FAILED: " + r["error"][:150],
                         *("-",) * 10, source))
            continue
        stopped = " (time limit)" if r.get("stopped_by_time_limit") else ""
        rows.append((
            ffn, str(r["num_devices"]), r.get("role", "-"), f"{r['micro_batch']} x {r['accum_steps']}",
            f"{r['steps_done']}{stopped}", _num(r.get("median_step_s"), ".3f"), _num(r.get("tokens_per_s"), ",.0f"),
            _num(r.get("tokens_per_s_per_device"), ",.0f"), _num(r.get("eff_vs_1"), ".1%"),
            _num(r.get("eff_vs_2"), ".1%"),
            _num(r.get("tokens_per_s_vs_dense"), ".3f") + "x" * bool(r.get("tokens_per_s_vs_dense")),
            _gib(r.get("peak_memory_bytes")), _num(r.get("compile_s"), ".0f"), _num(r.get("final_train_ce"), ".3f"),
            _num(r.get("val_loss"), ".3f"), _num(r.get("val_l0_mean"), ".1f"), source))
    return rows


def markdown_report(report: dict[str, Any], rows: list[tuple[str, ...]]) -> str:
    model = report["model"]
    actual = sorted({round(r["time_limit_s"]) for r in report["runs"]
                     if r.get("role") == "curve" and r.get("time_limit_s")})
    limits = " / ".join(f"{x}s" for x in actual) if actual else f"{report['curve_time_limit_s']:.0f}s"
    lines = [
        f"## Sparse vs dense training, `{report['config']}`, {report['devices_label']} — `{SCRIPT_ID}`",
        "",
        f"- **What**: `{report['config']}` ({_count(report['num_params'])} params, {model['n_layers']} layers, "
        f"d_model {model['d_model']}, d_ff {model['d_ff']}, {model['compute_dtype']}, remat {model['remat']}), "
        f"global batch {report['global_batch']} x {report['seq_len']} = {report['tokens_per_step']:,} tokens/step "
        f"on every GPU count (strong scaling), micro-batch {report['micro_batch']}/GPU; data: {report['data']}. "
        f"Each run in a fresh process; step time = median after step {TIMED_FROM_STEP}; peak memory = max over the "
        f"run's GPUs of `peak_bytes_in_use`. Curve runs: training loop limited to {limits} per FFN on "
        f"{report['curve_devices']} GPU(s); timing runs: {report['timing_steps']} steps.",
        f"- **GPU**: {report['devices_visible']} x {report['device_kind']}, JAX {report['jax_version']}. "
        f"**Date**: {report['date']}.",
        f"- **Command**: `{report['command']}`",
    ]
    if report["baseline_files"]:
        lines.append(f"- **Baselines merged**: {', '.join(report['baseline_files'])}")
    for warning in report["warnings"]:
        lines.append(f"- **Warning**: {warning}")
    lines += ["", "| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "eff vs 1 GPU = tok/s(N) / (N x tok/s(1)); eff vs 2 GPUs = 2 tok/s(N) / (N x tok/s(2)); "
              "tok/s vs dense = this row / the dense row with as many GPUs."]
    return "\n".join(lines) + "\n"


def console_table(rows: list[tuple[str, ...]]) -> str:
    keep = (0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)  # role and source stay in the markdown/JSON
    header = tuple(TABLE_HEADER[i] for i in keep)
    failed = [row[5].startswith("FAILED") for row in rows]
    body = [tuple(row[i] for i in keep) for row in rows]
    widths = [max(len(x[i]) for x, bad in zip([header] + body, [False] + failed) if not bad)
              for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    for row, bad in zip(rows, failed):  # a failed run: its error on one line, not in a column
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[5]}" if bad
                     else fmt.format(*(row[i] for i in keep)))
    return "\n".join(lines)


def plot_curves(runs: list[dict[str, Any]], d_ff: int, path: Path) -> str:
    """CE and mean active neurons/token against the step for the curve runs in `runs` (killed ones dashed)."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: curves.png skipped (the curves are in the JSON)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve_runs = [(r, r.get("curves") or r.get("partial_curves")) for r in runs if r.get("role") == "curve"]
    curve_runs = [(r, c) for r, c in curve_runs if c and c.get("step")]
    if not curve_runs:
        return "no curve run logged a step: curves.png not written"
    fig, (ax_ce, ax_l0) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, curves in curve_runs:
        label = (f"{ffn_label(r)}, {r['num_devices']} GPU(s)" + (" [killed: partial]" if "error" in r else "")
                 + ("" if r.get("source", "this run") == "this run" else f" [{Path(str(r['source'])).name}]"))
        style = "--" if "error" in r else "-"
        ax_ce.plot(curves["step"], curves["ce"], style, label=label)
        ax_l0.plot(curves["step"], curves["l0_mean"], style, label=label)
    ax_ce.set_xlabel("optimizer step")
    ax_ce.set_ylabel("train cross-entropy (nats/token)")
    ax_ce.set_title("CE")
    ax_ce.legend(fontsize=8)
    ax_l0.axhline(d_ff, color="gray", linestyle="--", linewidth=1, label=f"d_ff = {d_ff}")
    ax_l0.set_yscale("log")  # dense ~ thousands, sparse ~ tens of neurons (a 0 is clipped)
    ax_l0.set_xlabel("optimizer step")
    ax_l0.set_ylabel("mean active FFN neurons per token (layer mean)")
    ax_l0.set_title("active neurons")
    ax_l0.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", default="0.5b", help="preset from configs/ (default: 0.5b)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated GPU counts to run, e.g. 1,2 (default: all visible devices)")
    parser.add_argument("--ffn-kinds", default="relu_gated,twell",
                        help="FFN kinds (default relu_gated,twell; dense kinds get sparsity.l1_coef=0)")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="TOTAL training-loop wall time of the curve runs, split evenly over the FFN "
                             "kinds (start-up, compile and final eval come on top; default 8)")
    parser.add_argument("--curve-devices", type=int, default=None,
                        help="GPU count whose runs are the time-limited curve runs (default: max of --devices)")
    parser.add_argument("--timing-steps", type=int, default=4,
                        help="steps of the timing runs on the other GPU counts (>= 3: steps 1-2 are not timed)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per GPU per forward/backward (default: the config's)")
    parser.add_argument("--data", choices=("stdlib", "synthetic"), default="stdlib",
                        help="stdlib: BPE of the config's vocab on the Python stdlib (built once, cached); "
                             "synthetic: uniform random tokens")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config overrides (train.num_devices/micro_batch/steps/time_limit_s/log_every/"
                             "eval_* and model.ffn_kind are set per run by this script)")
    parser.add_argument("--baseline", nargs="+", action="extend", default=[], metavar="FILE.json",
                        help="earlier sparse_vs_dense.json file(s) whose runs are merged (efficiency references)")
    parser.add_argument("--max-wall-s", type=float, default=0.0,
                        help="wall-time budget of this invocation: curve loops are shortened to fit it (using "
                             "the start-up + compile + eval time measured on earlier runs), a run still going "
                             "at the limit is killed (its logged steps kept as partial curves) and later runs "
                             "are skipped (0 = none)")
    parser.add_argument("--out", default=os.environ.get("OUT", "scale_out"),
                        help="output directory (default: $OUT or ./scale_out)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the arguments against the visible devices, print the plan, and exit")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    started = time.perf_counter()
    if parallel.distributed_request() is not None:
        parser.error("this script runs on one host (a parent process starting one child per run); "
                     "unset the multi-process launcher variables")

    # ---- configuration (all checks before any device is touched)
    try:
        base = base_config(args.config, args.data, args.set)
    except ValueError as err:
        parser.error(str(err))
    kinds = [k.strip() for k in args.ffn_kinds.split(",") if k.strip()]
    for kind in kinds:
        if kind not in FFN_KINDS:
            parser.error(f"--ffn-kinds: unknown FFN kind {kind!r}; expected some of {FFN_KINDS}")
    if not kinds or len(set(kinds)) != len(kinds):
        parser.error(f"--ffn-kinds={args.ffn_kinds!r}: expected distinct FFN kinds")
    if args.timing_steps < TIMED_FROM_STEP + 1:
        parser.error(f"--timing-steps={args.timing_steps}: must be >= {TIMED_FROM_STEP + 1} (steps 1-"
                     f"{TIMED_FROM_STEP} are not timed)")
    if not args.minutes > 0:
        parser.error(f"--minutes={args.minutes}: must be > 0")
    if args.max_wall_s < 0:
        parser.error(f"--max-wall-s={args.max_wall_s}: must be >= 0")
    micro = args.micro_batch or base.train.micro_batch
    if micro < 1:
        parser.error(f"--micro-batch={micro}: must be >= 1")
    counts = parse_counts(args.devices, parser) if args.devices else None
    if counts:
        for n in counts:
            if base.train.global_batch % (micro * n):
                parser.error(f"train.global_batch={base.train.global_batch} is not divisible by --micro-batch="
                             f"{micro} x {n} GPU(s) = {micro * n}; pick a micro-batch that divides "
                             f"{base.train.global_batch // n if base.train.global_batch % n == 0 else 'it'}")

    env = child_env()
    try:
        probe = probe_devices(env)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        log(str(err))
        return 1
    visible = int(probe["count"])
    if counts is None:
        counts = [visible]
        if base.train.global_batch % (micro * visible):
            parser.error(f"train.global_batch={base.train.global_batch} is not divisible by --micro-batch={micro} "
                         f"x {visible} GPUs")
    if max(counts) > visible:
        parser.error(f"--devices asks for {max(counts)} device(s) but only {visible} {probe['platform']} "
                     f"device(s) ({probe['kind']}) are visible")
    curve_n = args.curve_devices if args.curve_devices is not None else max(counts)
    if curve_n not in counts:
        parser.error(f"--curve-devices={curve_n} must be one of --devices {counts}")
    time_limit_s = args.minutes * 60.0 / len(kinds)

    plan: list[PlannedRun] = []
    try:
        for role, ns in (("timing", [n for n in counts if n != curve_n]), ("curve", [curve_n])):
            for n in ns:
                for kind in kinds:
                    cfg = run_config(base, kind, n, micro, role, args.timing_steps, time_limit_s)
                    plan.append(PlannedRun(f"{kind}-{n}gpu-{role}", kind, n, role, cfg))
    except ValueError as err:
        parser.error(str(err))

    out_dir = Path(args.out)
    context = {"device_kind": probe["kind"], "config": args.config, "seq_len": base.seq_len,
               "global_batch": base.train.global_batch, "micro_batch": micro, "data": args.data}
    warnings: list[str] = []
    try:
        baseline_runs = load_baselines(args.baseline, context, warnings)
    except ValueError as err:
        parser.error(str(err))
    for warning in warnings:
        log(f"WARNING: {warning}")

    log(f"{visible} x {probe['kind']} ({probe['platform']}), jax {probe['jax']}, python {platform.python_version()}; "
        f"config {args.config}: {_count(base.model.num_params())} params, seq {base.seq_len}, global batch "
        f"{base.train.global_batch}; data {args.data}; output {out_dir.absolute()}")
    log(f"plan: {len(plan)} run(s), each in a fresh process:")
    for i, planned in enumerate(plan, 1):
        log(f"  {i}. {planned.describe()}")
    n_curve = sum(p.role == "curve" for p in plan)
    log(f"budget: curve loops {n_curve} x {time_limit_s:.0f}s = {n_curve * time_limit_s:.0f}s; timing loops "
        f"{args.timing_steps} steps each; plus per run: process start, data load, compile and final eval"
        + (f"; hard wall limit {args.max_wall_s:.0f}s" if args.max_wall_s else ""))
    if baseline_runs:
        log(f"merged {len(baseline_runs)} baseline run(s) from {', '.join(args.baseline)}")
    if args.dry_run:
        log("--dry-run: nothing trained")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)

    report: dict[str, Any] = {
        "script": SCRIPT_ID, "command": " ".join(["python", SCRIPT_ID, *map(shlex.quote, sys.argv[1:] if argv is None
                                                                            else argv)]),
        "date": datetime.date.today().isoformat(), **context, "platform": probe["platform"],
        "devices_visible": visible, "jax_version": probe["jax"], "python": platform.python_version(),
        "num_params": base.model.num_params(), "model": dataclasses.asdict(base.model),
        "tokens_per_step": base.train.global_batch * base.seq_len, "ffn_kinds": kinds, "devices": counts,
        "devices_label": " / ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in sorted(
            set(counts) | {r["num_devices"] for r in baseline_runs})),
        "curve_devices": curve_n, "minutes": args.minutes, "curve_time_limit_s": time_limit_s,
        "timing_steps": args.timing_steps, "overrides": list(args.set), "baseline_files": list(args.baseline),
        "warnings": warnings, "runs": [], "baseline_runs": baseline_runs, "complete": False,
    }

    def write_outputs(final: bool) -> tuple[str, str]:
        add_comparisons(report["runs"], baseline_runs)
        rows = table_rows(report["runs"] + baseline_runs)
        report["table_console"] = console_table(rows)
        report["elapsed_s"] = time.perf_counter() - started
        report["complete"] = final
        (out_dir / f"{REPORT_STEM}.md").write_text(markdown_report(report, rows))
        (out_dir / f"{REPORT_STEM}.json").write_text(json.dumps(report, indent=2, default=str))
        same_count = [r for r in baseline_runs if r["num_devices"] == curve_n]  # e.g. the other FFN's call
        return report["table_console"], plot_curves(report["runs"] + same_count, base.model.d_ff,
                                                    out_dir / "curves.png")

    if args.data == "stdlib":  # build (or find) the tokenizer and token cache once, before the children
        from twell_jax.data import build_data

        log("data: stdlib corpus, BPE tokenizer and token cache (built once, then cached under "
            f"{base.data.cache_dir})")
        t0 = time.perf_counter()
        try:
            bundle = build_data(dataclasses.replace(base.data, progress=True), global_batch=base.train.global_batch)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            log(f"data build failed: {type(err).__name__}: {err} (try --data synthetic)")
            return 1
        need = max(p.cfg.train.eval_batch_size for p in plan)
        if bundle.num_val_sequences < need:
            log(f"the validation split has {bundle.num_val_sequences} sequences, the evaluation needs {need}: "
                "raise data.val_fraction with --set")
            return 1
        report["data_stats"] = {"vocab": bundle.vocab_size, "train_sequences": bundle.num_train_sequences,
                                "val_sequences": bundle.num_val_sequences, "train_tokens": bundle.num_train_tokens,
                                "build_s": time.perf_counter() - t0}
        log(f"data ready in {time.perf_counter() - t0:.0f}s: {bundle.num_train_sequences} train sequences "
            f"(= {bundle.num_train_sequences / base.train.global_batch:.1f} steps per epoch), "
            f"{bundle.num_val_sequences} validation sequences")
        del bundle

    with tempfile.TemporaryDirectory(prefix="sparse_vs_dense_") as tmp:
        for i, planned in enumerate(plan, 1):
            elapsed = time.perf_counter() - started
            remaining = args.max_wall_s - elapsed if args.max_wall_s else None
            if remaining is not None and remaining <= 5:
                record = {**planned.record(),
                          "error": f"skipped: --max-wall-s={args.max_wall_s:g} reached before it started"}
            else:
                planned_limit = planned.cfg.train.time_limit_s
                if remaining is not None and planned.role == "curve":
                    limit = fitted_time_limit(planned, plan[i - 1:], remaining, report["runs"])
                    if limit < planned_limit:
                        log(f"--max-wall-s: {remaining:.0f}s left for {len(plan) - i + 1} run(s), so the curve "
                            f"loops get {limit:.0f}s instead of {planned_limit:.0f}s")
                        for later in plan[i - 1:]:  # the same limit for every FFN kind (equal loop time)
                            if later.role == "curve" and later.cfg.train.time_limit_s > limit:
                                later.cfg = dataclasses.replace(later.cfg, train=dataclasses.replace(
                                    later.cfg.train, time_limit_s=limit))
                log(f"run {i}/{len(plan)} ({elapsed:.0f}s elapsed): {planned.describe()}")
                record = run_child(planned, Path(tmp), out_dir, args.data, env, remaining)
                record["planned_time_limit_s"] = planned_limit
            report["runs"].append(record)
            if "error" in record:
                log(f"run {i}/{len(plan)} {planned.name} FAILED after {record.get('wall_s', 0):.0f}s: "
                    f"{record['error']}")
            else:
                log(f"run {i}/{len(plan)} {planned.name} done in {record['wall_s']:.0f}s (compile "
                    f"{record['compile_s']:.0f}s, loop {record['loop_s']:.0f}s): {record['steps_done']} steps, "
                    f"median {_num(record['median_step_s'], '.3f')} s/step, {_num(record['tokens_per_s'], ',.0f')} "
                    f"tok/s, peak {_gib(record['peak_memory_bytes'])} GiB/GPU, final train CE "
                    f"{_num(record['final_train_ce'], '.3f')}, val active neurons/token "
                    f"{_num(record['val_l0_mean'], '.1f')}")
            write_outputs(final=False)

    table, plot_message = write_outputs(final=True)
    log(plot_message)
    log(f"wrote {out_dir / (REPORT_STEM + '.json')} and {out_dir / (REPORT_STEM + '.md')} "
        f"({time.perf_counter() - started:.0f}s in all)")
    failed = [r["name"] for r in report["runs"] if "error" in r]
    if failed:
        log(f"FAILED runs: {', '.join(failed)}")
    print("\n" + table + "\n(step time: median after step 2; eff = tok/s(N) / (N x tok/s(ref)); peak memory: max "
          "over the run's GPUs)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
