"""twell_jax/bench/kernel_trace.py: parsing a hand-built trace shaped like the profiler's GPU trace
(GPU device process, stream threads, a derived "XLA Ops" line and host events that must not
count), the short names, the table, a real profile on the CPU (no GPU events, said so), and
bench_ffn_train's bit comparison and argument checks of its --sweep-blocks flag."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
from twell_jax.bench import ffn_train as bench_ffn_train
from twell_jax.bench import kernel_trace
from twell_jax.bench.kernel_trace import KernelProfile, format_profile, parse_trace, short_name

CUTLASS = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)"
HOST, GPU, OTHER_GPU = 7, 1001, 1002
COMPUTE, COPY, DERIVED = 13, 14, 3


def _meta(pid: int, name: str, tid: int | None = None) -> dict:
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid: int, tid: int, ts: float, dur: float, name: str) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_module": "jit_step", "correlation_id": "1"}}


def gpu_trace() -> dict:
    """Two calls of a program: per call a GEMM, the twell kernel, a fusion and a second GEMM on the
    compute stream, and (first call only) a fusion overlapping the twell kernel on another stream."""
    events = [_meta(HOST, "/host:CPU"), _meta(HOST, "python", 1), _meta(GPU, "/device:GPU:0"),
              _meta(GPU, "Stream #13(Compute)", COMPUTE), _meta(GPU, "Stream #14(MemcpyD2D,Compute)", COPY),
              _meta(GPU, "XLA Ops", DERIVED),
              _x(HOST, 1, 0.0, 5000.0, "PjitFunction(step)"),  # host: never counted
              _x(GPU, DERIVED, 100.0, 300.0, "fusion.1"),  # derived from the kernels: never counted
              {"ph": "i", "pid": GPU, "tid": COMPUTE, "ts": 120.0, "name": "marker"}]  # not complete
    for t0 in (100.0, 1000.0):
        events += [_x(GPU, COMPUTE, t0, 50.0, CUTLASS),
                   _x(GPU, COMPUTE, t0 + 50, 200.0, "twell_bwd_token_gated"),
                   _x(GPU, COMPUTE, t0 + 260, 10.0, "loop_multiply_fusion"),
                   _x(GPU, COMPUTE, t0 + 270, 30.0, CUTLASS)]
    events.append(_x(GPU, COPY, 160.0, 40.0, "loop_convert_fusion"))
    return {"displayTimeUnit": "ns", "metadata": {}, "traceEvents": events}


def test_parse_trace_aggregates_gpu_stream_kernels_only():
    p = parse_trace(gpu_trace(), repeats=2)
    assert p.reason == "" and p.gpu_processes == ("/device:GPU:0",)
    by_name = {s.name: s for s in p.kernels}
    gemm = short_name(CUTLASS)
    assert set(by_name) == {"twell_bwd_token_gated", gemm, "loop_multiply_fusion", "loop_convert_fusion"}
    # Per call: launches and ms (the trace is in microseconds).
    assert by_name["twell_bwd_token_gated"].calls == 1.0
    assert by_name["twell_bwd_token_gated"].ms == pytest.approx(0.2)
    assert by_name[gemm].calls == 2.0 and by_name[gemm].ms == pytest.approx(0.08)
    assert by_name["loop_multiply_fusion"].ms == pytest.approx(0.01)
    assert by_name["loop_convert_fusion"].calls == 0.5 and by_name["loop_convert_fusion"].ms == pytest.approx(0.02)
    # Sorted by time; shares of the 620 us summed kernel time.
    assert [s.name for s in p.kernels][:2] == ["twell_bwd_token_gated", gemm]
    assert by_name["twell_bwd_token_gated"].share == pytest.approx(400 / 620)
    assert sum(s.share for s in p.kernels) == pytest.approx(1.0)
    assert p.kernel_ms == pytest.approx(0.31)
    # Span: 100 us to 1300 us over 2 calls; busy: the overlapping kernel is counted once.
    assert p.span_ms == pytest.approx(0.6)
    assert p.busy_ms == pytest.approx(0.29)
    assert KernelProfile.from_json(p.to_json()) == p


def test_figures_per_unit_of_a_call():
    """units_per_call (a device loop's decode steps): every per-call figure divided by it, the
    table labelled per step; shares unchanged."""
    per_call, per_step = parse_trace(gpu_trace(), repeats=2), parse_trace(gpu_trace(), repeats=2, units_per_call=4)
    assert per_step.units_per_call == 4 and per_step.repeats == 2
    for field in ("span_ms", "kernel_ms", "busy_ms"):
        assert getattr(per_step, field) == pytest.approx(getattr(per_call, field) / 4)
    for a, b in zip(per_call.kernels, per_step.kernels):
        assert (b.calls, b.ms, b.share) == pytest.approx((a.calls / 4, a.ms / 4, a.share))
    assert "over 2 calls of 4 steps: span 0.150 ms/step" in format_profile(per_step)[0]
    assert KernelProfile.from_json(per_step.to_json()) == per_step
    with pytest.raises(ValueError, match="units_per_call must be an int >= 1"):
        parse_trace(gpu_trace(), 2, units_per_call=0)


def test_parse_trace_without_gpu_kernels_says_why():
    host_only = {"traceEvents": [_meta(HOST, "/host:CPU"), _meta(HOST, "python", 1),
                                 _x(HOST, 1, 0.0, 10.0, "PjitFunction(step)")]}
    p = parse_trace(host_only, repeats=3)
    assert p.kernels == () and "no GPU device process" in p.reason and "/host:CPU" in p.reason
    # A GPU process whose only line is derived: its events are not kernels, and that is said.
    derived_only = {"traceEvents": [_meta(OTHER_GPU, "/device:GPU:1"), _meta(OTHER_GPU, "XLA Ops", DERIVED),
                                    _x(OTHER_GPU, DERIVED, 0.0, 10.0, "fusion.1")]}
    p = parse_trace(derived_only, repeats=1)
    assert p.kernels == () and p.gpu_processes == ("/device:GPU:1",)
    assert "no GPU events" in p.reason and "XLA Ops" in p.reason
    assert format_profile(p) == [f"kernel trace: {p.reason}"]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="traceEvents"):
        parse_trace({"events": []}, 1)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        parse_trace(gpu_trace(), 0)
    with pytest.raises(ValueError, match="needs a reason"):
        KernelProfile(1)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        kernel_trace.kernel_times(lambda: None, (), repeats=0)


def test_short_names():
    assert short_name("twell_bwd_neuron_gated") == "twell_bwd_neuron_gated"
    assert short_name("loop_add_fusion_3") == "loop_add_fusion_3"
    assert short_name(CUTLASS).startswith("gemm:cutlass_80_tensorop_bf16_s16816gemm")
    assert short_name("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas").startswith("gemm:sm90_xmma")
    assert short_name("void cub::DeviceRadixSortOnesweepKernel<cub::Policy<int>>(int*)") == \
        "DeviceRadixSortOnesweepKernel"
    assert short_name("") == "?"


def test_format_profile_lists_the_top_kernels_and_the_rest():
    p = parse_trace(gpu_trace(), repeats=2)
    lines = format_profile(p, top=2)
    assert "span 0.600 ms/call" in lines[0] and "busy 0.290 ms" in lines[0]
    # the time line: the project's kernel 0.200, the others 0.110 (summed), idle 0.600 - 0.290
    assert p.time_line() == pytest.approx((0.2, 0.11, 0.31))
    assert "the project's kernels (twell_*) 0.200 ms, the others 0.110 ms; no kernel running 0.310 ms" in lines[1]
    assert lines[3].startswith("twell_bwd_token_gated") and "0.200" in lines[3]
    assert lines[5].startswith("(2 more)") and "0.030" in lines[5]
    assert len(format_profile(p)) == 3 + len(p.kernels)


def test_kernel_times_on_the_cpu_reports_no_gpu_events():
    step = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    p = kernel_trace.kernel_times(step, (jnp.ones((32, 32)),), repeats=2)
    assert p.kernels == () and p.repeats == 2
    assert "no GPU events" in p.reason and "/host:CPU" in p.reason


def test_bit_diff_counts_differing_bits():
    a = np.array([1.0, 2.0, -0.0, np.nan], np.float32)
    assert bench_ffn_train.bit_diff(a, a.copy()) == dict(equal=True, n_diff=0, max_abs=0.0)
    b = a.copy()
    b[1] = np.nextafter(np.float32(2.0), np.float32(3.0))  # one ulp
    b[2] = 0.0  # -0.0 and 0.0 compare equal as floats, not as bits
    d = bench_ffn_train.bit_diff(b, a)
    assert not d["equal"] and d["n_diff"] == 2 and d["max_abs"] == pytest.approx(2.0 ** -22)
    bf = jnp.asarray(a[:3], jnp.bfloat16)
    assert bench_ffn_train.bit_diff(bf, bf)["equal"]
    with pytest.raises(ValueError, match="one shape and dtype"):
        bench_ffn_train.bit_diff(a, a.astype(np.float64))


def test_sweep_blocks_is_refused_with_a_checkpoint(capsys):
    with pytest.raises(SystemExit):
        bench_ffn_train.main(["--checkpoint", "x", "--sweep-blocks"])
    assert "--sweep-blocks is for the synthetic mode" in capsys.readouterr().err


def test_an_xplane_reads_as_the_same_trace_shape(tmp_path):
    """The fallback when a JAX version exports no trace.json.gz: the run's xplane.pb, same parser."""
    step = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    jax.block_until_ready(step(jnp.ones((16, 16))))
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(step(jnp.ones((16, 16))))
    xplane, = (tmp_path / "plugins" / "profile").glob("*/*.xplane.pb")
    trace = kernel_trace.xplane_to_trace(xplane)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert "/host:CPU" in names
    assert any(e["ph"] == "X" and e["dur"] >= 0 for e in trace["traceEvents"])
    p = parse_trace(trace, repeats=1)
    assert p.kernels == () and "/host:CPU" in p.reason
    # The exported json is preferred; without it the xplane is read.
    assert "displayTimeUnit" in kernel_trace.read_profile_dir(tmp_path)  # the json export's key
    for path in (tmp_path / "plugins" / "profile").glob("*/*.trace.json.gz"):
        path.unlink()
    assert kernel_trace.read_profile_dir(tmp_path) == trace
    assert kernel_trace.read_profile_dir(tmp_path / "nothing") is None


def test_sweep_blocks_takes_a_list_of_kernels(capsys):
    assert bench_ffn_train.parse_sweep_kernels("token,pack") == ("token", "pack")
    assert bench_ffn_train.parse_sweep_kernels(" neuron ") == ("neuron",)
    with pytest.raises(SystemExit):
        bench_ffn_train.main(["--sweep-blocks", "token,gemm", "--dry-run"])
    assert "--sweep-blocks takes kernels among token, neuron, pack, ffn, got 'token,gemm'" in capsys.readouterr().err


def test_collective_overlap_per_gpu():
    """Two GPUs, two steps: GPU 0's all-reduce runs 40 us beside a GEMM and 60 us after it (60
    exposed of 100); GPU 1's all-reduce is fully overlapped; derived and host lines do not count."""
    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    events = [_meta(HOST, "/host:CPU"), _meta(HOST, "python", 1), _meta(GPU, "/device:GPU:0"),
              _meta(GPU, "Stream #13(Compute)", COMPUTE), _meta(GPU, "Stream #20(Nccl)", COPY),
              _meta(GPU, "XLA Ops", DERIVED), _meta(OTHER_GPU, "/device:GPU:1"),
              _meta(OTHER_GPU, "Stream #13(Compute)", COMPUTE), _meta(OTHER_GPU, "Stream #20(Nccl)", COPY)]
    for step in range(2):
        t0 = 1000.0 * step
        events += [_x(GPU, COMPUTE, t0, 100, CUTLASS), _x(GPU, COPY, t0 + 60, 100, nccl),
                   _x(GPU, DERIVED, t0 + 100, 200, "all-reduce-start"), _x(HOST, 1, t0 + 170, 50, nccl),
                   _x(OTHER_GPU, COMPUTE, t0, 300, "loop_fusion"), _x(OTHER_GPU, COPY, t0 + 100, 50, nccl)]
    first, second = kernel_trace.collective_overlap({"traceEvents": events}, steps=2)
    assert first.gpu == "/device:GPU:0" and second.gpu == "/device:GPU:1"
    assert first.collective_ms == pytest.approx(0.1) and first.exposed_ms == pytest.approx(0.06)
    assert first.compute_busy_ms == pytest.approx(0.1) and first.launches == 1
    assert first.span_ms == pytest.approx(1.16 / 2)  # first start to last end (1160 us), over 2 steps
    assert first.kernels[0][0].startswith("ncclDevKernel_AllReduce") and first.kernels[0][1:] == (1, pytest.approx(0.1))
    assert second.collective_ms == pytest.approx(0.05) and second.exposed_ms == 0
    assert "0.06 exposed" in first.line()
    # GPU 0 per step: kernels over [0, 160] of a 1160 us span: idle 1000 - 160 = 840 us, one gap of
    # 840 us between the steps (after the all-reduce, before the next step's GEMM)
    assert first.idle_ms == pytest.approx(0.84 / 2)
    assert first.gaps[0][:2] == (pytest.approx(0.16), pytest.approx(0.84))
    assert first.gaps[0][2].startswith("ncclDevKernel") and first.gaps[0][3].startswith("gemm:")
    assert second.idle_ms == pytest.approx(0.7 / 2) and len(second.gaps) == 1
    assert first.step_ms == pytest.approx(first.span_ms)  # the window starts with a kernel: no leading gap


def test_the_windows_leading_gap_is_left_out_of_the_step_time():
    """A window that starts with the batch copy, 50 us idle, then 100 us of compute, 10 us idle, 40
    us of compute: a span of 210 us, of which the step's GPU time is 160 (all but the leading gap)."""
    events = [_meta(GPU, "/device:GPU:0"), _meta(GPU, "Stream #13(Compute)", COMPUTE),
              _x(GPU, COMPUTE, 0, 10, "MemcpyH2D"), _x(GPU, COMPUTE, 60, 100, CUTLASS),
              _x(GPU, COMPUTE, 170, 40, "loop_fusion")]
    (gpu,) = kernel_trace.collective_overlap({"traceEvents": events}, steps=1)
    assert gpu.span_ms == pytest.approx(0.21) and gpu.idle_ms == pytest.approx(0.06)
    assert gpu.step_ms == pytest.approx(0.16) and gpu.collective_ms == 0
    with pytest.raises(ValueError, match="steps"):
        kernel_trace.collective_overlap({"traceEvents": events}, steps=0)
    with pytest.raises(ValueError, match="traceEvents"):
        kernel_trace.collective_overlap({}, steps=1)


def test_gpu_trace_keeps_one_gpus_events():
    events = [_meta(HOST, "/host:CPU"), _meta(GPU, "/device:GPU:0"), _meta(OTHER_GPU, "/device:GPU:1"),
              _x(GPU, COMPUTE, 0, 1, "a"), _x(OTHER_GPU, COMPUTE, 0, 1, "b"), _x(HOST, 1, 0, 1, "c")]
    assert [e.get("name") for e in kernel_trace.gpu_trace({"traceEvents": events}, 1)["traceEvents"]] == ["process_name", "b"]
    host_only = {"traceEvents": events[:1]}
    assert kernel_trace.gpu_trace(host_only) is host_only


def test_uncovered_length_of_spans():
    spans = [(0.0, 10.0), (20.0, 30.0)]
    assert kernel_trace._uncovered(spans, []) == 20
    assert kernel_trace._uncovered(spans, [(2.0, 4.0), (5.0, 25.0)]) == pytest.approx(2 + 1 + 5)
    assert kernel_trace._uncovered(spans, [(-5.0, 40.0)]) == 0
    assert kernel_trace._union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == [(0.0, 3.0), (5.0, 6.0)]
