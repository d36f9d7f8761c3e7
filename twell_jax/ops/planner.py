"""The `auto` planner: the op's cost models (forward, backward, decode), keyed by device kind, and
the plan they give a call (`auto_plan`). No kernel is imported here.

Only `use_sparse_forward` and `sampled_active_per_token` touch arrays (the forward's device-side
choice without a hint).

A plan (`Plan`) names the registry's implementations (`twell_jax.ops.backends`) that run the
call's forward and backward. "auto" (on a GPU, `backends.gpu_available()`):
  * with a hint (`SparseFFNConfig.expected_active_per_token`): decided at trace time. At decode
    sizes (a few tokens per call) the decode path when `prefer_decode_path`; else the cheapest of
    the four whole plans (forward and backward each dense or sparse) by `choose_training_path`,
    the backward's dense tails priced from the config's tail hints (`tails.TailPolicy.expected`);
    with `forward_only` (no gradient taken: inference) the forward alone against the dense
    forward with the same margin (`choose_forward_path`), the backward the dense formula.
    A plan dense both ways is the plain "dense" backend (None here), or, with
    `auto_dense_recompute`, the dense formula inside the op's custom_vjp.
  * without a hint: the Pallas forward behind a device-side `lax.cond` on a sampled active count
    (`use_sparse_forward`), dense backward.
Elsewhere "auto" is the "dense" backend.

Cost models (`COST_MODELS`, keyed by `device_kind`, e.g. "H100"): each part records the date, GPU
and command that fitted it (`Fit`). Unknown devices get `FALLBACK_KIND`'s models: the fits are
relative costs of sparse against dense on a Hopper GPU, and a plan with a sparse piece must beat
dense by a margin (SAFETY, DECODE_MARGIN), so a wrong device costs speed, never exactness. Refit a
device's training models: run `experiments/bench_ffn_train.py --quick` on it and
`experiments/fit_costs.py` on the result, which prints the entry (the decode models have their own
commands, in their `Fit`s).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from twell_jax.ops.config import SparseFFNConfig
from twell_jax.ops.tails import TailPolicy


@dataclasses.dataclass(frozen=True)
class Fit:
    """Where a cost model's constants come from."""

    date: str
    gpu: str
    command: str
    note: str = ""


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """The training/prefill forward (ms; k = mean active neurons per token):
        dense  = dense_launch_ms + n_gemms * 2 M D H / dense_flops_per_ms
        sparse = sparse_fixed_ms + 2 M D H / pack_flops_per_ms                              (pack)
                 + M (ffn_token_ms n_rows / 2 + k n_rows D itemsize / ffn_bytes_per_ms)     (FFN)
    n_gemms = 3 (gated) or 2; n_rows = rows gathered per active neuron: 2 (U and W) or 1 (W).
    sparse_fixed_ms covers the launches, the overflow bookkeeping and the tail of small grids."""

    dense_flops_per_ms: float
    dense_launch_ms: float
    pack_flops_per_ms: float
    sparse_fixed_ms: float
    ffn_token_ms: float
    ffn_bytes_per_ms: float
    fit: Fit


@dataclasses.dataclass(frozen=True)
class BackwardCosts:
    """The training backward (ms; G = backward GEMMs of the dense formula, 6 gated, 4 not):
        dense  = dense_launch_ms (forward's) + G * 2 M D H / dense_bwd_flops_per_ms
        sparse = bwd_fixed_ms                                      transpose, lists, launches, glue
                 + M k (1 - hot_entries) (n_tok_rows + 2) D b / bwd_bytes_per_ms   row gathers
                 + token tail: min(1, T) token_tail_fixed_ms D H / (tail_fit_d tail_fit_h)
                               + T G 2 D H / token_tail_flops_per_ms
                 + hot tail:   min(1, N) hot_tail_fixed_ms M D / (tail_fit_m tail_fit_d)
                               + N G 2 M D / hot_tail_flops_per_ms
                 + (pack time, when the pattern is recomputed)
    T = token-tail rows, N = hot neurons (`TailPolicy.expected`; a tail over its capacity makes the
    backward the dense formula: inf). n_tok_rows = rows gathered per entry by the token-major
    kernel: 3 (W, U, G) gated, 2 (W, G); the neuron-major kernel gathers 2 (x, gy)."""

    bwd_fixed_ms: float
    bwd_bytes_per_ms: float
    dense_bwd_flops_per_ms: float
    token_tail_fixed_ms: float
    token_tail_flops_per_ms: float
    hot_tail_fixed_ms: float
    hot_tail_flops_per_ms: float
    # The shape the tails' fixed costs were measured at (they scale with D H and with M D).
    tail_fit_m: int
    tail_fit_d: int
    tail_fit_h: int
    fit: Fit


@dataclasses.dataclass(frozen=True)
class DecodeCosts:
    """Decode sizes (us):
        one XLA GEMM = gemm_launch_us + D H itemsize / hbm_bytes_per_us + 2 M D H / gemm_flops_per_us
        dense        = n_gemms one-GEMMs (3 gated, 2 not)
        decode       = one gate GEMM + decode_fixed_us (compaction + 2 Pallas launches + fusions)
                       + union n_rows D itemsize / decode_row_bytes_per_us  (each active row once)
                       + n_rows 2 max(M, 16) union D / decode_flops_per_us  (gather-GEMMs)
                       [+ decode_switch_us inside the model's decode step at M > 1: the device-side
                        switch to the dense products, whose launches run (disabled) on the sparse
                        side too, and the union's reductions]
    union = H (1 - (1 - k/H)^M): the expected union of M tokens with k independent actives each
    (trained models share active neurons across tokens, so this over-estimates: conservative)."""

    gemm_launch_us: float
    hbm_bytes_per_us: float
    gemm_flops_per_us: float
    decode_fixed_us: float
    decode_row_bytes_per_us: float
    decode_flops_per_us: float
    decode_switch_us: float
    dense_fit: Fit
    fit: Fit
    switch_fit: Fit
    # The model's decode step (decode.sparse_ffn "auto"): the largest union of active neurons
    # at which the fused up/down kernel (every program walks all of them) beats `hidden` + `down`
    # (which spread them over programs), and the fit it comes from.
    decode_fused_max_union: float
    fused_fit: Fit
    # "packed" (the gate's launch packs each tile's active neurons with their hidden values, then one
    # launch adds their W_down rows and the residual):
    #   packed = one gate GEMM + packed_fixed_us + packed_row_us M
    #            + max(union - packed_free_union, 0) 2 D itemsize / packed_neuron_bytes_per_us
    #            [+ packed_switch_us at M > 1: the device switch's dense launches, disabled]
    # (a union up to packed_free_union costs no more than one neuron a tile: one step of values).
    packed_fixed_us: float
    packed_row_us: float
    packed_free_union: float
    packed_neuron_bytes_per_us: float
    packed_switch_us: float
    packed_fit: Fit


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    """The three cost models of one device kind."""

    forward: ForwardCosts
    backward: BackwardCosts
    decode: DecodeCosts


# A plan with a sparse piece is chosen only when its modelled time is at most SAFETY x the dense
# plan's: with model errors up to 1/SAFETY - 1 - 2% (8.9%) the step stays >= 0.98x dense, and
# otherwise the chosen plan IS the dense program (1.00x by construction).
SAFETY = 0.9
# The decode path is chosen when its predicted time is at most this fraction of dense (a margin
# for the fit's error, so that "auto" stays >= 0.98x dense).
DECODE_MARGIN = 0.95

H100 = DeviceCosts(
    forward=ForwardCosts(
        dense_flops_per_ms=6.96e11, dense_launch_ms=0.02, pack_flops_per_ms=6.67e11, sparse_fixed_ms=0.11,
        ffn_token_ms=1.1e-5, ffn_bytes_per_ms=7.0e9,
        fit=Fit("2026-11-28", "NVIDIA H100 80GB HBM3",
                "python experiments/bench_ffn_train.py --quick --shape trained --trace --repeats 10",
                "the inference forward at M 16384 (D 2048, H 5632, bf16), the pack being the Mosaic GPU "
                "kernel (compaction epilogue, clusters of 2): dense_flops_per_ms from XLA's forward "
                "(1.64-1.66 ms over the seven patterns), pack_flops_per_ms from the pack piece (0.547-0.608 "
                "ms), ffn_bytes_per_ms from the slope of the `pallas` forward over uniform k 16-110 "
                "(0.0192 ms per active neuron a token). sparse_fixed_ms and ffn_token_ms, and the scaling "
                "in M, are the 2026-11-22 fit's (H200, `python experiments/bench_ffn.py`, M 2048 .. "
                "65536): with them the model's sparse forward is 0.06 ms above the measured one at M "
                "16384 (its crossover, k 41, below the measured one, about 44: on the dense side). The "
                "Triton pack (fp32, tiles other than 256) is about 0.15 ms slower at M 16384")),
    backward=BackwardCosts(
        bwd_fixed_ms=0.737, bwd_bytes_per_ms=5.93e9, dense_bwd_flops_per_ms=8.31e11,
        token_tail_fixed_ms=0.30, token_tail_flops_per_ms=2.61e11,
        hot_tail_fixed_ms=0.30, hot_tail_flops_per_ms=1.90e11,
        tail_fit_m=16384, tail_fit_d=2048, tail_fit_h=5632,
        fit=Fit("2026-11-27", "NVIDIA H100 80GB HBM3",
                "python experiments/bench_ffn_train.py --quick --shape trained --trace --sweep-blocks ffn "
                "--repeats 10",
                "the two-launch token-major backward with u kept, the neuron-major kernel's longest lists "
                "first: least squares of the fixed part, the "
                "gather rate and the hot tail's rate over uniform k 16, 29, 39, 56 and the trained-like "
                "pattern at k 29 and 39, the forward's model subtracted, the hot tail's fixed part kept; "
                "dense_bwd_flops_per_ms from `auto`'s dense plan in the same run (the rows: "
                "experiments/results/bench_ffn_train_h100_2026-11-27c.json, in git history); the token "
                "tail's constants are the 2026-11-23 fit (commit 1968cc4, seven trained layers of a 0.5b): "
                "no row of this run has a token tail within its capacity. M 16384, D 2048, H 5632, bf16")),
    decode=DecodeCosts(
        gemm_launch_us=5.0, hbm_bytes_per_us=3.35e6, gemm_flops_per_us=6.0e8,
        decode_fixed_us=12.0, decode_row_bytes_per_us=2.6e5, decode_flops_per_us=2.0e8,
        decode_switch_us=12.0,
        dense_fit=Fit("2026-11-22", "NVIDIA H100 80GB HBM3", "issue 13's table (XLA dense FFN, 1..1024 tokens)",
                      "D 2048, H 5632, bf16; within 3% at 1..256 tokens, 6% high at 1024"),
        fit=Fit("2026-11-22", "NVIDIA H100 80GB HBM3", "python experiments/bench_ffn_decode.py",
                "33.7 / 31.2 / 82.9 us at 1 / 8 / 64 tokens, unions 28 / 205 / 1588"),
        switch_fit=Fit("2026-11-24", "NVIDIA H100 80GB HBM3",
                       "python experiments/bench_inference.py --checkpoint RUN --backends auto --decode-batches 8,1 "
                       "--trace-decode 30 --other-sparse-ffn-rows",
                       "0.5b, batch 8, kernel time line per sparse layer: gate 10.3 + compaction 4.9 + hidden 7.9 + "
                       "down 3.9 + the disabled dense products 6.9 + ~6 of extra fusions = ~40 us against 34.4 for "
                       "the twin's fused dense products; the op-level model gives ~28 at these unions: the "
                       "~12 us it misses is this term"),
        decode_fused_max_union=48.0,
        fused_fit=Fit("2026-11-24", "NVIDIA H100 80GB HBM3",
                      "python experiments/bench_decode_ffn_step.py --rows 1 --active 8,16,32,64,96,160,256,512 "
                      "--no-pieces --repeats 9",
                      "a sparse layer's decode FFN per layer of a scan, 1 row: fused 30.1 / 31.0 / 38.0 / 44.9 / 58.8 / "
                      "79.9 / 136.0 us at 8 / 32 / 64 / 96 / 160 / 256 / 512 active (~0.22 us per neuron from 32 on), "
                      "split 34.4 / 34.9 / 36.2 / 36.6 / 38.7 / 41.7 / 48.6 (~0.03): equal at n ~ 50; the twin "
                      "39.9-40.7"),
        packed_fixed_us=6.7, packed_row_us=0.7, packed_free_union=32.0, packed_neuron_bytes_per_us=1.0e5,
        packed_switch_us=3.5,
        packed_fit=Fit("2026-11-25", "NVIDIA H100 80GB HBM3",
                       "python experiments/bench_decode_ffn_step.py --rows 2,4,8 --active 8,32,128 --placement spread "
                       "--no-pieces --repeats 7; the model's step at 1 row (bench_inference --trace-decode)",
                       "D 2048, H 5632, bf16, active neurons spread over the tiles: packed 24.0 / 23.7 / 31.6 us at "
                       "2 rows and unions 8 / 32 / 128, 25.8 / 26.1 / 33.8 at 4, 28.0 / 27.9 / 35.3 at 8 (a scan "
                       "step: ~3.5 us above the model's unrolled step, whose 1-row packed FFN took 19.3: gate and "
                       "values 14.5 + down 4.8): ~0.7 us a row, ~0.08 us a neuron above 32; packed_switch_us: the "
                       "switch's disabled gate/up and W_down launches timed alone at 1 row, 4.0 us in a chain whose "
                       "own XLA add per call is ~1 us (as bench_decode_matvec.py times a call); 4.5 us at 8 rows "
                       "in the model's kernel time line")),
)

_H200_FIT = Fit("2026-11-28", "NVIDIA H200",
                "python experiments/bench_ffn_train.py --quick --shape trained --trace --repeats 10",
                "`python experiments/fit_costs.py RESULT --gpu 'NVIDIA H200' --date 2026-11-28` on that run "
                "(experiments/results/bench_ffn_train_h200_2026-11-28.json): the Mosaic GPU pack, the "
                "backward without XLA's glue; forward and backward lines through uniform k 16, 29, 39 "
                "(each row's mean active count; within 0.4% of each); the tails' constants, ffn_token_ms "
                "and the decode models are the H100's. M 16384, D 2048, H 5632, bf16")
H200 = dataclasses.replace(
    H100,
    forward=dataclasses.replace(H100.forward, dense_flops_per_ms=7.04e11, pack_flops_per_ms=6.43e11,
                                sparse_fixed_ms=0.0085, ffn_bytes_per_ms=6.68e9, fit=_H200_FIT),
    backward=dataclasses.replace(H100.backward, bwd_fixed_ms=0.763, bwd_bytes_per_ms=8.55e9,
                                 dense_bwd_flops_per_ms=7.73e11, fit=_H200_FIT))

COST_MODELS: dict[str, DeviceCosts] = {"H100": H100, "H200": H200}
# The models of a device kind with no entry (module doc).
FALLBACK_KIND = "H100"


def device_kind(kind: str | None = None) -> str:
    """The COST_MODELS key of a device: its `device_kind` (jax.devices()[0].device_kind when None,
    e.g. "NVIDIA H100 80GB HBM3") matched on the keys; FALLBACK_KIND when none matches."""
    if kind is None:
        kind = jax.devices()[0].device_kind
    return next((key for key in COST_MODELS if key.lower() in kind.lower()), FALLBACK_KIND)


def costs(kind: str | None = None) -> DeviceCosts:
    """The cost models of a device kind (`device_kind`; the default device when None)."""
    return COST_MODELS[device_kind(kind)]


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def crossover_active_per_token(m: int, d: int, h: int, *, gated: bool = True, itemsize: int = 2,
                               kind: str | None = None) -> float:
    """Mean active neurons per token below which pack + fused FFN beats the dense XLA FFN (the
    forward model). May be negative: dense always wins."""
    c = costs(kind).forward
    flops = 2.0 * m * d * h
    dense_ms = c.dense_launch_ms + (3 if gated else 2) * flops / c.dense_flops_per_ms
    n_rows = 2 if gated else 1
    fixed_sparse_ms = c.sparse_fixed_ms + flops / c.pack_flops_per_ms + m * c.ffn_token_ms * n_rows / 2
    ms_per_active = m * n_rows * d * itemsize / c.ffn_bytes_per_ms
    return (dense_ms - fixed_sparse_ms) / ms_per_active


def forward_threshold(config: SparseFFNConfig, m: int, d: int, h: int, gated: bool, itemsize: int,
                      kind: str | None = None) -> float:
    """The active count per token up to which the forward-only "auto" runs sparse: the config's
    auto_max_active, else the forward model's crossover."""
    if config.auto_max_active is not None:
        return float(config.auto_max_active)
    return crossover_active_per_token(m, d, h, gated=gated, itemsize=itemsize, kind=kind)


def sampled_active_per_token(x_MxD: jax.Array, w_act_HxD: jax.Array, n_sample: int) -> jax.Array:
    """f32 scalar: mean active gate neurons per token over a strided sample of n_sample tokens."""
    m = x_MxD.shape[0]
    stride = max(1, m // max(1, n_sample))
    sample_RxD = x_MxD[::stride][:n_sample]
    pre_RxH = jnp.einsum("rd,hd->rh", sample_RxD, w_act_HxD, preferred_element_type=jnp.float32)
    return jnp.sum(pre_RxH > 0, dtype=jnp.float32) / sample_RxD.shape[0]


def use_sparse_forward(gated: bool, x_MxD: jax.Array, w_act_HxD: jax.Array,
                       config: SparseFFNConfig | None) -> bool | jax.Array:
    """The forward-only "auto" choice for this call: True/False when it is known at trace time (a
    hint in the config, or a shape on which dense always wins), else a traced bool from the gate
    pre-activations of a strided sample of config.auto_sample_rows tokens (None: 32; the caller
    branches with lax.cond)."""
    config = config or SparseFFNConfig()
    m, d = x_MxD.shape
    if m == 0:  # nothing to pack (the op handles empty batches before it gets here)
        return False
    threshold = forward_threshold(config, m, d, w_act_HxD.shape[0], gated, jnp.dtype(x_MxD.dtype).itemsize)
    if config.expected_active_per_token is not None:
        # Static choice from the measured active count: no sample, no branch, no host round trip.
        return float(config.expected_active_per_token) <= threshold
    if threshold < 0:  # the shape alone says dense wins at any sparsity
        return False
    return sampled_active_per_token(x_MxD, w_act_HxD, config.auto_sample_rows or 32) <= threshold


# ----------------------------------------------------------------------------------------------
# Training (forward + backward)
# ----------------------------------------------------------------------------------------------

def dense_times_ms(m: int, d: int, h: int, gated: bool, kind: str | None = None,
                   device: DeviceCosts | None = None) -> tuple[float, float]:
    """Modelled (forward, backward) ms of the dense FFN with bf16 operands (`device`: these models
    instead of `kind`'s)."""
    c = device or costs(kind)
    flops = 2.0 * m * d * h
    fwd = c.forward.dense_launch_ms + (3 if gated else 2) * flops / c.forward.dense_flops_per_ms
    bwd = c.forward.dense_launch_ms + (6 if gated else 4) * flops / c.backward.dense_bwd_flops_per_ms
    return fwd, bwd


def tail_times_ms(m: int, d: int, h: int, rows: float, neurons: float, gated: bool,
                  kind: str | None = None, device: DeviceCosts | None = None) -> tuple[float, float]:
    """Modelled ms of the backward's dense token tail (`rows` rows) and hot-neuron tail (`neurons`);
    `device`: these models instead of `kind`'s (a fit being evaluated)."""
    c = (device or costs(kind)).backward
    gemms = 6 if gated else 4
    token = (min(1.0, rows) * c.token_tail_fixed_ms * (d * h) / (c.tail_fit_d * c.tail_fit_h)
             + rows * gemms * 2.0 * d * h / c.token_tail_flops_per_ms)
    hot = (min(1.0, neurons) * c.hot_tail_fixed_ms * (m * d) / (c.tail_fit_m * c.tail_fit_d)
           + neurons * gemms * 2.0 * m * d / c.hot_tail_flops_per_ms)
    return token, hot


def ffn_gather_bytes(m: int, d: int, k: float, gated: bool, itemsize: int = 2) -> float:
    """The fused FFN's row reads in the forward model: per (token, active neuron) its W_up and
    W_down rows (gated; W_down alone non-gated)."""
    return m * k * (2 if gated else 1) * d * itemsize


def backward_gather_bytes(m: int, d: int, k: float, gated: bool, itemsize: int = 2,
                          hot_entries: float = 0.0) -> float:
    """The backward kernels' row reads in the backward model: per entry outside the hot tail, the
    token-major kernel's W rows (3 gated: W_down, W_up, W_gate; 2 not) and the neuron-major
    kernel's x and gy rows."""
    return m * k * (1.0 - hot_entries) * ((3 if gated else 2) + 2) * d * itemsize


def sparse_times_ms(m: int, d: int, h: int, k: float, gated: bool, *, itemsize: int = 2,
                    keep_pattern: bool = True, config: SparseFFNConfig | None = None,
                    kind: str | None = None, device: DeviceCosts | None = None,
                    tails: tuple[float, float, float] | None = None) -> tuple[float, float]:
    """Modelled (forward, backward) ms of the sparse FFN (pack + fused FFN; Pallas backward), with
    the dense tails of `config`'s tail hints (none without a config). A tail over its capacity
    makes the backward the dense formula: inf here (never planned). `device`: these models instead
    of `kind`'s; `tails`: (token-tail rows, hot neurons, the hot neurons' share of the entries) as
    measured, instead of the config's expectation (both for evaluating a fit, `bench/fit_costs.py`)."""
    c = device or costs(kind)
    f, b = c.forward, c.backward
    pack_ms = 2.0 * m * d * h / f.pack_flops_per_ms
    fwd = (f.sparse_fixed_ms + pack_ms + m * f.ffn_token_ms * (2 if gated else 1) / 2
           + ffn_gather_bytes(m, d, k, gated, itemsize) / f.ffn_bytes_per_ms)
    if tails is not None:
        (rows, neurons, hot_entries), over = tails, False
    elif config is not None:
        rows, neurons, hot_entries, over = TailPolicy(config).expected(m, h)
    else:
        rows, neurons, hot_entries, over = 0.0, 0.0, 0.0, False
    if over:
        return fwd, math.inf
    token_tail, hot_tail = tail_times_ms(m, d, h, rows, neurons, gated, device=c)
    bwd = (b.bwd_fixed_ms
           + backward_gather_bytes(m, d, k, gated, itemsize, hot_entries) / b.bwd_bytes_per_ms
           + token_tail + hot_tail + (0.0 if keep_pattern else pack_ms))
    return fwd, bwd


def choose_training_path(m: int, d: int, h: int, expected_active: float, gated: bool, *,
                         itemsize: int = 2, keep_pattern: bool = True,
                         config: SparseFFNConfig | None = None, kind: str | None = None) -> tuple[bool, bool]:
    """(forward sparse?, backward sparse?) for one layer from its expected active count per token
    and the tail hints of `config` (the backward's dense tails; none without a config).

    The four plans are compared whole, because the pieces are not independent: a dense backward
    after a sparse forward runs inside the op's custom_vjp and recomputes the pre-activations (2
    GEMMs gated, 1 not) that plain autodiff of the dense plan keeps; a sparse backward after a
    dense forward recomputes the pattern (the pack). A plan with a sparse piece wins only if its
    modelled time is <= SAFETY x the dense plan's; otherwise the dense plan runs."""
    if isinstance(expected_active, bool) or not expected_active >= 0:
        raise ValueError(f"expected_active must be a number >= 0, got {expected_active!r}")
    dense_fwd, dense_bwd = dense_times_ms(m, d, h, gated, kind=kind)
    recompute = (2.0 if gated else 1.0) / (3.0 if gated else 2.0) * dense_fwd
    sparse_fwd, sparse_bwd_kept = sparse_times_ms(m, d, h, expected_active, gated, itemsize=itemsize,
                                                  keep_pattern=keep_pattern, config=config, kind=kind)
    _, sparse_bwd_repacked = sparse_times_ms(m, d, h, expected_active, gated, itemsize=itemsize,
                                             keep_pattern=False, config=config, kind=kind)
    plans = {
        (True, True): sparse_fwd + sparse_bwd_kept,
        (True, False): sparse_fwd + dense_bwd + recompute,
        (False, True): dense_fwd + sparse_bwd_repacked,
    }
    best = min(plans, key=plans.get)
    return best if plans[best] <= SAFETY * (dense_fwd + dense_bwd) else (False, False)


def choose_forward_path(m: int, d: int, h: int, expected_active: float, gated: bool, *, itemsize: int = 2,
                        kind: str | None = None) -> bool:
    """Whether a call that takes no gradient (`SparseFFNConfig.forward_only`: inference) runs the
    sparse forward: its modelled time (pack + fused FFN) at most SAFETY x the dense forward's, the
    margin `choose_training_path` asks of a training plan. A hint is a model's activity on its
    training batches; on other text it can be higher (a `0.5b` at the paper's sparsity: 1.2x on its
    validation tokens), so the bare crossover (`crossover_active_per_token`, which the sampled
    forward-only choice compares a measured count with) would put layers at the edge on the
    losing side."""
    if isinstance(expected_active, bool) or not expected_active >= 0:
        raise ValueError(f"expected_active must be a number >= 0, got {expected_active!r}")
    dense_fwd, _ = dense_times_ms(m, d, h, gated, kind=kind)
    sparse_fwd, _ = sparse_times_ms(m, d, h, expected_active, gated, itemsize=itemsize, kind=kind)
    return sparse_fwd <= SAFETY * dense_fwd


# ----------------------------------------------------------------------------------------------
# Activity by position: the hint of a program of short rows
# ----------------------------------------------------------------------------------------------

def position_buckets(seq_len: int) -> list[int]:
    """Bucket edges [0, 1, 2, 4, 8, ..., seq_len]: the first tokens alone, then doubling widths."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    edges, edge = [0], 1
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    return edges + [seq_len]


def active_by_position(position_active_LxS, max_seq_len: int) -> tuple[tuple[float, ...], ...]:
    """Per layer, the mean active count in each bucket of `position_buckets(max_seq_len)` from a
    per-position mean [L, S] (S <= max_seq_len); buckets past the measured S repeat the last
    measured bucket's mean (the activity of late positions changes slowly)."""
    counts = np.asarray(position_active_LxS, np.float64)
    if counts.ndim != 2 or not 1 <= counts.shape[1] <= max_seq_len:
        raise ValueError(f"position_active_LxS must be [L, S] with 1 <= S <= {max_seq_len}, got {counts.shape}")
    edges = position_buckets(max_seq_len)
    measured = counts.shape[1]
    rows = []
    for layer in counts:
        values, last = [], None
        for lo, hi in zip(edges[:-1], edges[1:]):
            if lo < measured:
                last = float(layer[lo:min(hi, measured)].mean())
            values.append(last)
        rows.append(tuple(values))
    return tuple(rows)


def active_for_length(profile: tuple[float, ...], seq_len: int, max_seq_len: int) -> float:
    """Mean active count per token of rows of `seq_len` tokens (positions 0..seq_len-1) from a
    layer's bucket profile (`active_by_position`; each bucket's mean taken for all its positions)."""
    edges = position_buckets(max_seq_len)
    if len(profile) != len(edges) - 1:
        raise ValueError(f"profile must have {len(edges) - 1} buckets for max_seq_len {max_seq_len}, "
                         f"got {len(profile)}")
    if not 1 <= seq_len <= max_seq_len:
        raise ValueError(f"seq_len must be in [1, {max_seq_len}], got {seq_len}")
    total = sum(v * max(0, min(hi, seq_len) - lo) for v, lo, hi in zip(profile, edges[:-1], edges[1:]))
    return total / seq_len


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------

def expected_union(m: int, k: float, h: int) -> float:
    """Expected number of distinct active neurons over m tokens with k of h active each."""
    if h < 1 or m < 0 or not 0 <= k:
        raise ValueError(f"need h >= 1, m >= 0, k >= 0; got h={h}, m={m}, k={k}")
    return h * (1.0 - (1.0 - min(k, h) / h) ** m)


def _gemm_us(c: DecodeCosts, m: int, d: int, h: int, itemsize: int) -> float:
    return c.gemm_launch_us + d * h * itemsize / c.hbm_bytes_per_us + 2.0 * m * d * h / c.gemm_flops_per_us


def dense_time_us(m: int, d: int, h: int, *, gated: bool = True, itemsize: int = 2,
                  kind: str | None = None) -> float:
    """Predicted time of the dense XLA FFN at decode sizes."""
    return (3 if gated else 2) * _gemm_us(costs(kind).decode, m, d, h, itemsize)


def decode_time_us(m: int, d: int, h: int, expected_active: float, *, gated: bool = True,
                   itemsize: int = 2, kind: str | None = None) -> float:
    """Predicted time of the decode path ("triton") at expected_active neurons per token."""
    return _decode_time_at_union(m, d, h, expected_union(m, expected_active, h), gated, itemsize, kind)


def _decode_time_at_union(m: int, d: int, h: int, union: float, gated: bool, itemsize: int,
                          kind: str | None, device_switch: bool = False) -> float:
    c = costs(kind).decode
    n_rows = 2 if gated else 1
    return (_gemm_us(c, m, d, h, itemsize) + c.decode_fixed_us + (c.decode_switch_us if device_switch else 0.0)
            + union * n_rows * d * itemsize / c.decode_row_bytes_per_us
            + n_rows * 2.0 * max(m, 16) * union * d / c.decode_flops_per_us)


def packed_time_us(m: int, d: int, h: int, union: float, *, gated: bool = True, itemsize: int = 2,
                   kind: str | None = None, device_switch: bool = False) -> float:
    """Predicted time of one layer's "packed" decode FFN (`DecodeCosts`) at `union` active neurons
    over the step's m rows (a neuron's W_up and W_down rows; W_down's only when not gated);
    device_switch: with the switch's disabled dense launches (m > 1)."""
    c = costs(kind).decode
    neuron_bytes = (2 if gated else 1) * d * itemsize
    return (_gemm_us(c, m, d, h, itemsize) + c.packed_fixed_us + c.packed_row_us * m
            + max(union - c.packed_free_union, 0.0) * neuron_bytes / c.packed_neuron_bytes_per_us
            + (c.packed_switch_us if device_switch else 0.0))


def decode_union_limit(m: int, d: int, h: int, *, gated: bool = True, itemsize: int = 2,
                       kind: str | None = None, device_switch: bool = False, way: str | None = None) -> int:
    """The largest union of active neurons (over a call's m tokens) at which the decode path is
    predicted to beat the dense FFN by DECODE_MARGIN (the same model as `prefer_decode_path`, whose
    time grows linearly in the union), in [0, h]: the device-side switch of the model's decode
    step (`inference.decode_engine.kernel_step`) runs the dense products above it. device_switch: price
    that switch (`decode_switch_us`), as the model's step at m > 1 pays it; 0 = the sparse side
    never pays, so the model plans the layer dense (`inference.decode_plan.layer_sparse`).
    way "packed": the same for decode.sparse_ffn "packed" (`packed_time_us`, its own switch
    cost `packed_switch_us`); other ways (None, "fused", "split", "tiles"): the decode model above."""
    if way not in (None, "fused", "split", "tiles", "packed"):
        raise ValueError(f"way must be None or one of 'fused', 'split', 'tiles', 'packed', got {way!r}")
    if way == "packed":  # flat up to packed_free_union, then linear in the union
        free = costs(kind).decode.packed_free_union
        time = functools.partial(packed_time_us, m, d, h, gated=gated, itemsize=itemsize, kind=kind,
                                 device_switch=device_switch)
        budget = DECODE_MARGIN * dense_time_us(m, d, h, gated=gated, itemsize=itemsize, kind=kind) - time(free)
        if budget < 0:
            return 0
        return int(min(h, free + budget / (time(free + 1.0) - time(free))))
    fixed = _decode_time_at_union(m, d, h, 0.0, gated, itemsize, kind, device_switch)
    per_row = _decode_time_at_union(m, d, h, 1.0, gated, itemsize, kind, device_switch) - fixed
    budget = DECODE_MARGIN * dense_time_us(m, d, h, gated=gated, itemsize=itemsize, kind=kind) - fixed
    return int(min(h, max(0.0, budget / per_row)))


def decode_sparse_way(m: int, expected_active: float | None, h: int, *, kind: str | None = None) -> str:
    """The sparse FFN kernels of one layer in the model's decode step (decode.sparse_ffn
    "auto"): "fused" (one launch; every program walks all the active neurons) where the expected
    union of the step's m rows (`expected_union` of the layer's activity hint) is at most the
    device's `decode_fused_max_union`, else "split" (`hidden` spreads them over programs, then
    `down`). No hint: "fused"."""
    if expected_active is None:
        return "fused"
    union = expected_union(m, expected_active, h)
    return "fused" if union <= costs(kind).decode.decode_fused_max_union else "split"


def prefer_decode_path(m: int, d: int, h: int, expected_active: float | None, gated: bool, *,
                       itemsize: int = 2, check_finite: bool = False, kind: str | None = None) -> bool:
    """True when the decode path is predicted to beat the dense FFN by DECODE_MARGIN.

    expected_active None (no telemetry hint): False; the caller keeps its own choice.
    check_finite (the op's NaN/Inf pass before a sparse call): False. The pass reads x and every
    weight, which is all the bytes dense reads at decode sizes, plus a lax.cond: on the H100 the
    checked decode path was slower than dense at 1 and 8 tokens (BENCHMARKS.md), so
    with the check the dense formula is the faster exact choice. (Generation turns the check off:
    `inference.load_run` verifies the weights once.)"""
    if expected_active is None or m < 1 or check_finite:
        return False
    return (decode_time_us(m, d, h, expected_active, gated=gated, itemsize=itemsize, kind=kind)
            <= DECODE_MARGIN * dense_time_us(m, d, h, gated=gated, itemsize=itemsize, kind=kind))


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs (static): the registry names of its forward and backward implementations
    (`backends.get`). sampled: "auto" without a hint, the forward chosen on the device
    between this plan and the dense formula (`dispatch`)."""

    gated: bool
    forward: str
    backward: str
    interpret: bool
    sampled: bool = False


# "auto" decided at trace time (from the hint) that the whole call runs the dense backend, as the
# device-side switch reports it (aux dense_fallback = 1).
AUTO_DENSE = "auto_dense"


def auto_plan(gated: bool, interpret: bool, config: SparseFFNConfig,
              shape: tuple[int, int, int, int], gpu: bool) -> Plan | str | None:
    """The plan of backend "auto" (module doc) for `shape` = (tokens per shard, D, H, itemsize);
    None = the plain dense backend, AUTO_DENSE = likewise, chosen from the hint. `gpu`: the sparse
    kernels can run (`backends.gpu_available()`)."""
    if not gpu:
        return None
    if config.expected_active_per_token is None:
        # No hint: the forward samples on the device and branches; the backward stays dense.
        return Plan(gated, "pallas", "dense", interpret, sampled=True)
    m, d_model, n_neurons, itemsize = shape
    hint = config.expected_active_per_token
    if prefer_decode_path(m, d_model, n_neurons, hint, gated, itemsize=itemsize,
                          check_finite=config.check_finite):
        # Decode sizes (a few tokens per call): the work spread over the active neurons.
        return Plan(gated, "decode", "dense", interpret)
    if config.forward_only:
        # No backward to price: the forward model alone (the dense plan is the "dense" backend).
        forward_sparse = (hint <= config.auto_max_active if config.auto_max_active is not None
                          else choose_forward_path(m, d_model, n_neurons, hint, gated, itemsize=itemsize))
        return Plan(gated, "pallas", "dense", interpret) if forward_sparse else AUTO_DENSE
    fwd_sparse, bwd_sparse = choose_training_path(m, d_model, n_neurons, hint, gated, itemsize=itemsize,
                                                  keep_pattern=config.keeps_gate_pattern, config=config)
    if not (fwd_sparse or bwd_sparse):
        # The dense plan IS the "dense" backend (plain autodiff keeps its activations), unless the
        # config asks for the dense formula inside the custom_vjp, which recomputes them.
        return Plan(gated, "dense", "dense", interpret) if config.auto_dense_recompute else AUTO_DENSE
    return Plan(gated, "pallas" if fwd_sparse else "dense", "pallas" if bwd_sparse else "dense", interpret)


# Fields of SparseFFNConfig that only the planner reads: given the plan, they do not change the
# traced computation (`plan_key` drops them).
PLANNER_ONLY_FIELDS = ("expected_active_per_token", "expected_token_tail", "expected_hot_neurons",
                       "expected_hot_entries", "auto_dense_recompute", "forward_only")


def traced_config(config: SparseFFNConfig) -> SparseFFNConfig:
    """`config` without its planner-only fields (PLANNER_ONLY_FIELDS, reset to their defaults)."""
    return dataclasses.replace(config, **{name: SparseFFNConfig.__dataclass_fields__[name].default
                                          for name in PLANNER_ONLY_FIELDS})


def key_of(plan: Plan | str | None, config: SparseFFNConfig, shape: tuple[int, int, int, int]) -> Hashable:
    """The hashable key of a planned call (`ops.plan_key`)."""
    return (plan if plan is not None else "dense", shape, traced_config(config))
