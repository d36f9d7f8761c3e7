"""Per-kernel GPU time of one compiled program, from a `jax.profiler` trace.

    profile = kernel_times(compiled_fn, args, repeats=5)
    print("\\n".join(format_profile(profile)))

`kernel_times` warms the program up, runs it `repeats` times back to back inside
`jax.profiler.trace` (one block_until_ready at the end, as the benchmarks' timed batches do),
reads the `*.trace.json.gz` that the profiler exports under <dir>/plugins/profile/<run>/ (or,
should a JAX version write none, the run's `*.xplane.pb` in the same shape) and
aggregates its GPU kernel events by kernel name (`parse_trace`): launches, ms and share of the
summed kernel time per call of the program, plus the wall span per call (first kernel start to
last kernel end, over `repeats`) and the busy time (union of the kernel intervals).

Which events are GPU kernels: complete events (`"ph": "X"`) of a process whose `process_name`
metadata contains "/device:GPU" (the profiler names GPU planes /device:GPU:0, /device:GPU:1, ...),
on a thread whose `thread_name` starts with "Stream" (the CUPTI activity lines, e.g.
"Stream #13(Compute)"). The device's other lines ("XLA Modules", "XLA Ops", ...) are derived from
the same kernels and would count them twice, so they are left out. A trace without such events
(a CPU run, or a profiler that named them otherwise) gives an empty profile whose `reason` says
what the trace did hold; host events are never counted in their place.
"""
from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

GPU_PROCESS_MARK = "/device:GPU"  # in the process_name of a GPU device plane
STREAM_THREAD_PREFIX = "Stream"  # thread_name of the kernel activity lines of a GPU plane
_GEMM = re.compile(r"gemm|gemv|cublas|cutlass|xmma|matmul", re.IGNORECASE)
_TWELL = re.compile(r"twell_\w+")
_GENERIC_KERNELS = ("Kernel", "Kernel2", "device_kernel", "kernel")  # wrappers named by their template


@dataclasses.dataclass(frozen=True)
class KernelStat:
    """One kernel name's share of a program's GPU time, per call of the program."""

    name: str  # short name (short_kernel_name)
    calls: float  # launches per program call
    ms: float  # summed kernel time per program call
    share: float  # of the summed time of all kernels, in [0, 1]


OWN_PREFIX = "twell_"  # the project's Pallas / Mosaic GPU kernels are named twell_... (`name=` of each call)


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """The GPU kernels of `repeats` calls of one program (module doc); empty with a `reason` when
    the trace held no GPU kernel events."""

    repeats: int  # program calls in the trace
    kernels: tuple[KernelStat, ...] = ()  # by ms, largest first
    span_ms: float = 0.0  # (last kernel end - first kernel start) / repeats
    kernel_ms: float = 0.0  # summed kernel durations / repeats (overlapping streams count twice)
    busy_ms: float = 0.0  # union of the kernel intervals / repeats (GPU busy on any stream)
    gpu_processes: tuple[str, ...] = ()  # the GPU process names the kernels came from
    reason: str = ""  # why `kernels` is empty ("" when it is not)
    # Every per-call figure above is per unit when a call runs several (a device loop of decode
    # steps: figures per step); 1 = per call.
    units_per_call: int = 1

    def __post_init__(self) -> None:
        for field in ("repeats", "units_per_call"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelProfile.{field} must be an int >= 1, got {value!r}")
        if not self.kernels and not self.reason:
            raise ValueError("KernelProfile without kernels needs a reason")

    def to_json(self) -> dict:
        """A plain dict for the benchmarks' JSON rows (from_json reads it back)."""
        return dataclasses.asdict(self)

    def time_line(self, prefix: str = OWN_PREFIX) -> tuple[float, float, float]:
        """Per call (or unit): (ms of the kernels whose names start with `prefix`, the project's own
        Pallas and Mosaic GPU kernels; ms of the others: XLA's fusions, library GEMMs, copies; ms of
        the span with no kernel running)."""
        own = sum(s.ms for s in self.kernels if s.name.startswith(prefix))
        return own, self.kernel_ms - own, max(self.span_ms - self.busy_ms, 0.0)

    @classmethod
    def from_json(cls, data: dict) -> "KernelProfile":
        """The profile that to_json wrote."""
        return cls(**{**data, "kernels": tuple(KernelStat(**k) for k in data["kernels"]),
                      "gpu_processes": tuple(data["gpu_processes"])})


def short_name(name: str) -> str:
    """A kernel's short name: Pallas kernels by their twell_* name, GEMM library kernels as
    "gemm:<name>", others (XLA fusions: loop_fusion_3, ...) unchanged; C++ names lose `void`, the
    namespaces, template and parameter lists."""
    twell = _TWELL.search(name)
    if twell:
        return twell.group(0)
    short = name.strip()
    if short.startswith("void "):
        short = short[5:]
    stem = short.split("(")[0]
    head, _, targs = stem.partition("<")
    short = head.split("::")[-1].strip()
    if short in _GENERIC_KERNELS and targs:  # cutlass::Kernel2<cutlass_80_..._gemm_...>: the name is inside
        short = targs.split(",")[0].split("<")[0].split("::")[-1].strip(" >")
    short = (short or name.strip() or "?")[:60]
    return f"gemm:{short}" if _GEMM.search(name) else short


def _names(events: Sequence[dict], kind: str) -> dict:
    """{pid: name} (kind "process_name") or {(pid, tid): name} (kind "thread_name") from metadata."""
    out = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == kind:
            key = e.get("pid") if kind == "process_name" else (e.get("pid"), e.get("tid"))
            out[key] = str(e.get("args", {}).get("name", ""))
    return out


def parse_trace(trace_json: dict, repeats: int, units_per_call: int = 1) -> KernelProfile:
    """The KernelProfile of a Chrome-trace dict ({"traceEvents": [...]}) holding `repeats` calls,
    its figures per unit of `units_per_call` per call (KernelProfile.units_per_call)."""
    if not isinstance(trace_json, dict) or not isinstance(trace_json.get("traceEvents"), list):
        raise ValueError("trace_json must be a dict with a 'traceEvents' list (the profiler's trace.json)")
    for name, value in (("repeats", repeats), ("units_per_call", units_per_call)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    events = trace_json["traceEvents"]
    processes = _names(events, "process_name")
    threads = _names(events, "thread_name")
    gpu_pids = {pid for pid, name in processes.items() if GPU_PROCESS_MARK in name}
    if not gpu_pids:
        return KernelProfile(repeats, reason="no GPU events: the trace has no GPU device process "
                                             f"(processes: {sorted(set(processes.values()))})")
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
               and threads.get((e.get("pid"), e.get("tid")), "").startswith(STREAM_THREAD_PREFIX)
               and "dur" in e]
    gpu_names = tuple(sorted(processes[p] for p in gpu_pids))
    if not kernels:
        seen = sorted({name for (pid, _), name in threads.items() if pid in gpu_pids})
        return KernelProfile(repeats, gpu_processes=gpu_names,
                             reason=f"no GPU events: no complete event on a {STREAM_THREAD_PREFIX!r} "
                                    f"thread of {list(gpu_names)} (threads: {seen})")
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    intervals = []
    for e in kernels:
        start, dur = float(e["ts"]), float(e["dur"])  # microseconds
        stat = per_name[short_name(str(e.get("name", "?")))]
        stat[0] += 1
        stat[1] += dur
        intervals.append((start, start + dur))
    intervals.sort()
    busy = sum(end - start for start, end in _union(intervals))
    total = sum(dur for _, dur in per_name.values())
    units = repeats * units_per_call
    per_unit_ms = 1e-3 / units
    stats = tuple(sorted((KernelStat(name, n / units, dur * per_unit_ms, dur / total if total else 0.0)
                          for name, (n, dur) in per_name.items()), key=lambda s: (-s.ms, s.name)))
    span = max(end for _, end in intervals) - intervals[0][0]
    return KernelProfile(repeats, stats, span_ms=span * per_unit_ms, kernel_ms=total * per_unit_ms,
                         busy_ms=busy * per_unit_ms, gpu_processes=gpu_names, units_per_call=units_per_call)


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _uncovered(spans: Sequence[tuple[float, float]], cover: Sequence[tuple[float, float]]) -> float:
    """Total length of the disjoint sorted `spans` not inside the disjoint sorted `cover`."""
    out, j = 0.0, 0
    for start, end in spans:
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        pos, k = start, j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > pos:
                out += cover[k][0] - pos
            pos = max(pos, cover[k][1])
            k += 1
        if pos < end:
            out += end - pos
    return out


_COPY = re.compile(r"^(Memcpy|Memset)", re.IGNORECASE)


def _leading_gap(kernels: Sequence[dict], busy: Sequence[tuple[float, float]]) -> float:
    """The idle time before the first kernel that is not a copy or memset (the window's batch copy
    and the wait for the first traced step's dispatch); 0 when the window starts with computation."""
    first = min((float(e["ts"]) for e in kernels if not _COPY.match(str(e.get("name", "")))), default=None)
    if first is None:
        return 0.0
    return sum(min(b_start, first) - a_end for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if a_end < first)


@dataclasses.dataclass(frozen=True)
class CollectiveOverlap:
    """One GPU's collective kernels (NCCL) against its other kernels over a trace of `steps` steps,
    figures per step: `exposed_ms` is the collectives' time while no other kernel of that GPU ran
    (what they add to the step if the rest of the GPU's work is fixed)."""

    gpu: str  # the device plane's name
    steps: int
    collective_ms: float  # union of the collective kernels' intervals
    exposed_ms: float  # of which no other kernel of the GPU overlapped
    compute_busy_ms: float  # union of the other kernels' intervals
    span_ms: float  # first kernel start to last kernel end, over `steps`
    launches: float  # collective kernel launches
    kernels: tuple[tuple[str, float, float], ...] = ()  # (short name, launches, ms), largest first
    idle_ms: float = 0.0  # of the span, no kernel of the GPU running
    # The GPU's time per step with the window's leading gap left out (the trace starts before the
    # first traced step is dispatched: its batch copy, then idle until the host has dispatched the
    # step, which in a steady run overlaps the step before): (span - that gap) / steps.
    step_ms: float = 0.0
    # The longest idle gaps of the window: (ms from the window's first kernel, length ms, the kernel
    # that ended before it, the kernel that started after it), longest first.
    gaps: tuple[tuple[float, float, str, str], ...] = ()

    def line(self) -> str:
        """One line for a console."""
        return (f"{self.gpu}: collectives {self.collective_ms:.2f} ms/step in {self.launches:.0f} launches, "
                f"{self.exposed_ms:.2f} exposed; other kernels busy {self.compute_busy_ms:.2f}, idle "
                f"{self.idle_ms:.2f} of a {self.span_ms:.2f} ms span; {self.step_ms:.2f} ms a step without "
                f"the window's leading gap")


def gpu_trace(trace_json: dict, index: int = 0) -> dict:
    """The trace with only the events of its `index`-th GPU device process (in process-id order;
    the whole trace when it has no GPU process), e.g. for parse_trace of one GPU of several."""
    events = trace_json["traceEvents"]
    gpus = sorted(pid for pid, name in _names(events, "process_name").items() if GPU_PROCESS_MARK in name)
    if not gpus:
        return trace_json
    return {"traceEvents": [e for e in events if e.get("pid") == gpus[index]]}


def collective_overlap(trace_json: dict, steps: int,
                       pattern: str = r"nccl|all_?reduce|all_?gather|reduce_?scatter",
                       top_gaps: int = 5) -> list[CollectiveOverlap]:
    """Per GPU plane of a trace (parse_trace's kernel events), its collective kernels (names matching
    `pattern`, case-insensitive) against the GPU's other kernels, per step of `steps` traced steps,
    and the `top_gaps` longest stretches with no kernel at all."""
    if not isinstance(trace_json, dict) or not isinstance(trace_json.get("traceEvents"), list):
        raise ValueError("trace_json must be a dict with a 'traceEvents' list (the profiler's trace.json)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    events = trace_json["traceEvents"]
    processes = _names(events, "process_name")
    threads = _names(events, "thread_name")
    collective = re.compile(pattern, re.IGNORECASE)
    out = []
    for pid in sorted(p for p, name in processes.items() if GPU_PROCESS_MARK in name):
        kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid and "dur" in e
                   and threads.get((pid, e.get("tid")), "").startswith(STREAM_THREAD_PREFIX)]
        if not kernels:
            continue
        comm, other = [], []
        per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in kernels:
            start, dur = float(e["ts"]), float(e["dur"])
            name = str(e.get("name", "?"))
            if collective.search(name):
                comm.append((start, start + dur))
                stat = per_name[short_name(name)]
                stat[0] += 1
                stat[1] += dur
            else:
                other.append((start, start + dur))
        comm_u, other_u = _union(comm), _union(other)
        every = [iv for ivs in (comm, other) for iv in ivs]
        per_ms = 1e-3 / steps
        busy = _union(every)
        origin = busy[0][0]
        ordered = sorted(kernels, key=lambda e: float(e["ts"]) + float(e["dur"]))
        ends = [float(e["ts"]) + float(e["dur"]) for e in ordered]
        starts = sorted(kernels, key=lambda e: float(e["ts"]))
        holes = []
        for (_, end), (start, _) in zip(busy, busy[1:]):
            before = ordered[max(0, bisect.bisect_right(ends, end) - 1)]
            after = next(e for e in starts if float(e["ts"]) >= start)
            holes.append(((end - origin) * 1e-3, (start - end) * 1e-3, short_name(str(before.get("name", "?"))),
                          short_name(str(after.get("name", "?")))))
        holes.sort(key=lambda h: -h[1])
        out.append(CollectiveOverlap(
            gpu=processes[pid], steps=steps,
            collective_ms=sum(b - a for a, b in comm_u) * per_ms,
            exposed_ms=_uncovered(comm_u, other_u) * per_ms,
            compute_busy_ms=sum(b - a for a, b in other_u) * per_ms,
            span_ms=(busy[-1][1] - origin) * per_ms,
            idle_ms=(busy[-1][1] - origin - sum(b - a for a, b in busy)) * per_ms,
            step_ms=(busy[-1][1] - origin - _leading_gap(kernels, busy)) * per_ms,
            gaps=tuple(holes[:top_gaps]),
            launches=len(comm) / steps,
            kernels=tuple(sorted(((name, n / steps, dur * per_ms) for name, (n, dur) in per_name.items()),
                                 key=lambda k: -k[2]))))
    return out


def kernel_times(fn: Callable[..., Any], args: Sequence[Any], *, repeats: int = 5,
                 units_per_call: int = 1) -> KernelProfile:
    """Profile `repeats` back-to-back calls fn(*args) (after one warm-up call outside the trace);
    figures per unit when each call runs `units_per_call` (a device loop's steps)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory(prefix="kernel_trace_") as tmp:
        with jax.profiler.trace(tmp):
            out = None
            for _ in range(repeats):
                out = fn(*args)
            jax.block_until_ready(out)  # one stream: the last call's end is the last kernel's
        trace_json = read_profile_dir(Path(tmp))
    if trace_json is None:
        return KernelProfile(repeats, reason="no GPU events: the profiler wrote neither a *.trace.json.gz "
                                             "nor a *.xplane.pb")
    return parse_trace(trace_json, repeats, units_per_call)


def read_profile_dir(log_dir: Path) -> dict | None:
    """The trace dict of the newest run under log_dir/plugins/profile/: its <host>.trace.json.gz
    (what jax.profiler exports), else its <host>.xplane.pb turned into the same shape
    (xplane_to_trace); None when neither exists."""
    runs = sorted((log_dir / "plugins" / "profile").glob("*/"), key=lambda p: p.stat().st_mtime)
    for run in reversed(runs):
        for path in sorted(run.glob("*.trace.json.gz")):
            with gzip.open(path, "rt") as fp:
                return json.load(fp)
        for path in sorted(run.glob("*.xplane.pb")):
            return xplane_to_trace(path)
    return None


def xplane_to_trace(path: Path) -> dict:
    """A profiler .xplane.pb (jax.profiler.ProfileData) as a trace dict that parse_trace reads: one
    process per plane (process_name = the plane's name), one thread per line, its events complete
    events in microseconds."""
    data = jax.profiler.ProfileData.from_file(str(path))
    events: list[dict] = []
    for pid, plane in enumerate(data.planes):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": plane.name}})
        for tid, line in enumerate(plane.lines):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": line.name}})
            events += [{"ph": "X", "pid": pid, "tid": tid, "ts": e.start_ns / 1e3, "dur": e.duration_ns / 1e3,
                        "name": e.name} for e in line.events]
    return {"traceEvents": events}


def format_profile(profile: KernelProfile, top: int = 12) -> list[str]:
    """A short table: the `top` kernels by time (name, launches, ms, share per program call)."""
    if not profile.kernels:
        return [f"kernel trace: {profile.reason}"]
    unit = "call" if profile.units_per_call == 1 else "step"
    over = f"{profile.repeats} calls" + ("" if unit == "call" else f" of {profile.units_per_call} steps")
    lines = [f"kernel trace over {over}: span {profile.span_ms:.3f} ms/{unit}, "
             f"kernels {profile.kernel_ms:.3f} ms, busy {profile.busy_ms:.3f} ms, "
             f"{len(profile.kernels)} kernel names",
             "  of which the project's kernels ({}*) {:.3f} ms, the others {:.3f} ms; no kernel running "
             "{:.3f} ms".format(OWN_PREFIX, *profile.time_line()),
             f"{'kernel':<44} {'calls':>6} {'ms':>8} {'share':>6}"]
    for s in profile.kernels[:top]:
        lines.append(f"{s.name[:44]:<44} {s.calls:>6.1f} {s.ms:>8.3f} {s.share:>6.1%}")
    rest = profile.kernels[top:]
    if rest:
        lines.append(f"{f'({len(rest)} more)':<44} {sum(s.calls for s in rest):>6.1f} "
                     f"{sum(s.ms for s in rest):>8.3f} {sum(s.share for s in rest):>6.1%}")
    return lines
