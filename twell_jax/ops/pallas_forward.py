"""The Pallas forward of the sparse FFN op (twell_jax/ops/): glue to the Triton pack and FFN kernels.

The backward is in pallas_backward.py (it reuses this forward's pack), the decode-size forward in
pallas_decode.py. Each forward here is

    pack (pallas_kernels.twell_pack)      relu(x W_gate^T) -> TwELL, fp32 accumulation, on device
    fused FFN (pallas_kernels.twell_ffn)  TwELL + x + W_up + W_down -> y and per-row l1
    overflow fix-up (XLA)                 rows with a tile count > S are recomputed exactly

Exactness: the fused kernel reads only the S stored slots of each tile. A row with an overflowing
tile is recomputed by the dense formula: up to `overflow_rows` such rows are gathered into a fixed
[overflow_rows, D] block (static shape, no host sync), up to `overflow_rows_wide` into a second,
larger block (short sequences, e.g. an evaluation's rows of ~100 tokens, hold many dense first
tokens: a few per row is several per cent of the call's rows); if more rows overflow the whole call
is recomputed densely (`dense_fallback` = 1). A `lax.switch` on the on-device row count picks among
"nothing to fix" / "fix the gathered rows" (either block) / "dense", so the common case pays nothing
and a call pays for the rows it fixes, not for the dense formula on all of them.

"auto" (see docs/kernels.md): the pack alone costs about a dense gate GEMM, so once it has run the
dense path can no longer win; the choice must come first. Two ways:
  * static (preferred): the config carries `expected_active_per_token` (from training telemetry
    or `calibrate_active_per_token`); at trace time it is compared with the crossover k* of a
    per-shape cost model (`planner.crossover_active_per_token`) or with `auto_max_active` when
    set (`planner.use_sparse_forward`). Only the chosen path is compiled; the dense one is the same XLA
    ops as the op's "dense" backend, so picking it costs exactly what backend="dense" costs.
  * fallback, no hint: the gate pre-activations of a strided sample of `auto_sample_rows` tokens
    are computed on the device and `lax.cond` picks the branch (costs the sample GEMM and a
    device-side branch, BENCHMARKS.md).
The choice only affects speed; both branches are exact.

Config: a `twell_jax.ops.SparseFFNConfig` (validated there, once) or None for its defaults;
the glue reads tile, slots, overflow_rows (None: min(M, max(16, M // 64))), overflow_rows_wide
(None: min(M, max(overflow_rows, M // 8))), the kernels' block
sizes (None: their defaults) and neuron_counts; the auto_* entries also what
`planner.use_sparse_forward` reads (auto_sample_rows, auto_max_active, expected_active_per_token).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from twell_jax.pallas_kernels.twell_ffn import FFNBlockSizes, sparse_ffn
from twell_jax.pallas_kernels.twell_pack import PackBlockSizes, pack_gate
from twell_jax.pallas_kernels.twell_transpose import neuron_histogram
from twell_jax.ops import planner
from twell_jax.ops.config import SparseFFNConfig
from twell_jax.ops.dense import dense_fallback_ffn, dense_hidden, exact_precision

Aux = dict[str, jax.Array]


def available() -> bool:
    """True when a CUDA GPU backs JAX (the Triton kernels can be compiled)."""
    return jax.default_backend() == "gpu"


def is_hopper() -> bool:
    """Whether JAX's first device is a CUDA GPU of compute capability 9.x (H100, H200)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def mosaic_pack_refusal(dtype: Any, tile: int, slots: int, interpret: bool) -> str | None:
    """Why the Mosaic GPU pack cannot run this call (None: it can)."""
    from twell_jax.pallas_kernels import twell_pack_mgpu  # noqa: PLC0415 (only where a pack runs)

    if interpret:
        return "it has no interpreter on this JAX (interpret=True runs the Triton kernel)"
    if not twell_pack_mgpu.available():
        return f"this JAX ({jax.__version__}) lacks Mosaic GPU names it uses"
    if not is_hopper():
        return "it needs a Hopper GPU (compute capability 9.x)"
    if jnp.dtype(dtype).itemsize != 2:
        return f"it takes 16-bit activations, not {jnp.dtype(dtype).name}"
    if tile != 256 or not 8 <= slots <= 128:
        return f"it wants tile 256 and 8 <= slots <= 128, not tile {tile}, slots {slots}"
    return None


def resolve_pack_backend(config: SparseFFNConfig, dtype: Any, interpret: bool) -> str:
    """The pack kernel a call runs: SparseFFNConfig.pack_backend, "auto" resolved (Mosaic GPU where
    it can run, i.e. on Hopper: measured faster than the Triton kernel there, BENCHMARKS.md, "The
    pack on Mosaic GPU"; Triton elsewhere); "mosaic" where it cannot run is a ValueError saying why."""
    if config.pack_backend == "triton":
        return "triton"
    refusal = mosaic_pack_refusal(dtype, config.tile, config.slots, interpret)
    if config.pack_backend == "mosaic" and refusal is not None:
        raise ValueError(f"SparseFFNConfig.pack_backend='mosaic' cannot run here: {refusal}; use 'auto' "
                         f"or 'triton'")
    return "triton" if refusal is not None else "mosaic"


def run_pack(x_MxD: jax.Array, w_act_HxD: jax.Array, s: dict[str, Any], interpret: bool
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gate GEMM + TwELL pack of a call with settings `s` (values, indices, counts), on the
    backend resolve_pack_backend chose: the op's one call site of the pack kernels."""
    if resolve_pack_backend(s["config"], x_MxD.dtype, interpret) == "mosaic":
        from twell_jax.pallas_kernels.twell_pack_mgpu import pack_gate_mgpu  # noqa: PLC0415

        return pack_gate_mgpu(x_MxD, w_act_HxD, tile=s["tile"], slots=s["slots"])
    return pack_gate(x_MxD, w_act_HxD, tile=s["tile"], slots=s["slots"], block_sizes=s["pack_block_sizes"],
                     interpret=interpret)


def require_runnable(interpret: bool) -> None:
    if not interpret and not available():
        raise RuntimeError(
            "the pallas backend needs a CUDA GPU (jax.default_backend() == 'gpu'), but the default "
            f"backend is '{jax.default_backend()}'. Pass interpret=True to run the kernels in the "
            "Pallas interpreter (slow, for tests), or use backend='dense' / 'reference'.")


def settings(config: SparseFFNConfig | None, m: int) -> dict[str, Any]:
    """The kernel settings of a (validated) op config for a call with m tokens; None = defaults."""
    if config is None:
        config = SparseFFNConfig()
    elif not isinstance(config, SparseFFNConfig):
        raise ValueError(f"config must be a twell_jax.ops.SparseFFNConfig or None, got {type(config).__name__}")
    overflow_rows = config.overflow_rows or min(m, max(16, m // 64))
    return dict(
        tile=config.tile,
        slots=config.slots,
        overflow_rows=overflow_rows,
        # Never below the first block (a wider block than asked for only moves the dense fallback).
        overflow_rows_wide=max(overflow_rows, config.overflow_rows_wide or min(m, m // 8)),
        pack_block_sizes=config.pack_block_sizes or PackBlockSizes(),
        ffn_block_sizes=config.ffn_block_sizes or FFNBlockSizes(),
        neuron_counts=config.neuron_counts,
        config=config,
    )


def validate_operands(x_MxD: jax.Array, weights: dict[str, jax.Array]) -> None:
    if x_MxD.ndim != 2:
        raise ValueError(f"x_MxD must be 2-D [M, D], got shape {x_MxD.shape}")
    if x_MxD.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x_MxD must be float32 or bfloat16, got {x_MxD.dtype}")
    h = None
    for name, w in weights.items():
        if w.ndim != 2 or w.shape[1] != x_MxD.shape[1] or w.dtype != x_MxD.dtype:
            raise ValueError(f"{name} must be {x_MxD.dtype}[H, D={x_MxD.shape[1]}] (neuron-major), "
                             f"got {w.dtype}{w.shape}")
        if h is not None and w.shape[0] != h:
            raise ValueError(f"{name} must have H={h} rows like the other weights, got {w.shape[0]}")
        h = w.shape[0]


def weight_tuple(w_act_HxD: jax.Array, w_up_HxD: jax.Array | None, w_down_HxD: jax.Array) -> tuple[jax.Array, ...]:
    """The op's weight tuple: (w_gate, w_up, w_down) gated, (w_up, w_down) non-gated."""
    return (w_act_HxD, w_down_HxD) if w_up_HxD is None else (w_act_HxD, w_up_HxD, w_down_HxD)


def _dense_rows(x_RxD: jax.Array, w_act_HxD: jax.Array, w_up_HxD: jax.Array | None,
                w_down_HxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The op's dense formula (dense_hidden) on some rows: (y [R, D], l1 per row [R], active
    [R, H]); f32 GEMMs at full precision beside the kernels' rows (`exact_precision`)."""
    weights = weight_tuple(w_act_HxD, w_up_HxD, w_down_HxD)
    precision = exact_precision(x_RxD.dtype)
    h_RxH, active_RxH = dense_hidden(w_up_HxD is not None, x_RxD, weights, precision=precision)
    y_RxD = jnp.einsum("rh,hd->rd", h_RxH, w_down_HxD, precision=precision)
    return y_RxD, jnp.sum(jnp.abs(h_RxH), axis=1, dtype=jnp.float32), active_RxH


def sparse_forward(x_MxD: jax.Array, w_act_HxD: jax.Array, w_up_HxD: jax.Array | None,
                    w_down_HxD: jax.Array, s: dict[str, Any], interpret: bool,
                    pack: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                    ranked_width: int = 0, non_finite: jax.Array | None = None) -> tuple:
    """Pack + fused FFN + exact fix-up of overflowing rows: (y, aux). w_up None = non-gated.
    `pack`: the (values, indices, counts) of pack_gate(x, w_act) when the caller already has it
    (the training forward keeps it for the Pallas backward, twell_jax/ops/pallas_backward.py).
    ranked_width > 0: (y, aux, ranked), ranked = the fused FFN's entries in rank order up to that
    width (`sparse_ffn`'s ranked output: (a, u) gated, (a,) non-gated), as the kernel computed
    them (rows the fix-up recomputes keep the kernel's values: the backward's token tail).
    non_finite (the op's NaN/Inf flag, a bool scalar): when set, the overflow branch takes its
    dense arm (the dense formula on every row: y, l1, l0 and the counts as the dense formula gives
    them, dense_fallback 1), so NaN/Inf propagate as the dense formula's do without a second
    branch; the kernels' outputs are then discarded."""
    m, h = x_MxD.shape[0], w_act_HxD.shape[0]
    values, indices, counts = pack if pack is not None else run_pack(x_MxD, w_act_HxD, s, interpret)
    y_MxD, l1_M, *ranked = sparse_ffn(x_MxD, values, indices, counts, w_up_HxD, w_down_HxD,
                                      block_sizes=s["ffn_block_sizes"], ranked_width=ranked_width,
                                      interpret=interpret)
    tile_overflow_MxNT = counts > s["slots"]
    row_overflow_M = jnp.any(tile_overflow_MxNT, axis=1)
    n_row_overflow = jnp.sum(row_overflow_M, dtype=jnp.int32)
    capacity = s["overflow_rows"]
    want_counts = s["neuron_counts"]
    if want_counts:
        # Neurons fired in rows without overflow: their stored slots are exactly the actives. The
        # transpose's histogram pass (no atomics); an XLA scatter-add here took several ms per
        # layer on trained patterns (thousands of updates to each hot neuron).
        neuron_H = neuron_histogram(indices, jnp.where(row_overflow_M[:, None], 0, counts), h,
                                    interpret=interpret)
    else:
        neuron_H = jnp.zeros((h,), jnp.int32)

    def keep(operands):
        return operands

    def fix_rows(operands, capacity):
        y, l1, neurons, l0 = operands
        # Fixed-capacity gather of the overflowing rows; fill slots point past the end and are
        # dropped by the scatter.
        rows_R = jnp.nonzero(row_overflow_M, size=capacity, fill_value=m)[0]
        y_RxD, l1_R, active_RxH = _dense_rows(x_MxD[jnp.minimum(rows_R, m - 1)], w_act_HxD, w_up_HxD,
                                              w_down_HxD)
        if want_counts:  # the overflowing rows' neurons, fill rows masked out
            neurons = neurons + jnp.sum(active_RxH & (rows_R < m)[:, None], axis=0, dtype=jnp.int32)
        return (y.at[rows_R].set(y_RxD, mode="drop"), l1.at[rows_R].set(l1_R, mode="drop"), neurons,
                l0)

    def all_dense(operands):
        y, l1, active_MxH = _dense_rows(x_MxD, w_act_HxD, w_up_HxD, w_down_HxD)
        return (y, l1, jnp.sum(active_MxH, axis=0, dtype=jnp.int32),
                jnp.sum(active_MxH, dtype=jnp.float32))

    # The blocks, smallest first: "fix the gathered rows" in a block of each capacity (the wide one
    # only where it is larger).
    capacities = [capacity] + ([s["overflow_rows_wide"]] if s["overflow_rows_wide"] > capacity else [])
    fixes = [lambda operands, c=c: fix_rows(operands, c) for c in capacities]
    dense_branch = 1 + len(fixes)
    branch = jnp.where(n_row_overflow == 0, 0, dense_branch)
    for i, c in reversed(list(enumerate(capacities))):  # the smallest block that holds the rows
        branch = jnp.where((n_row_overflow > 0) & (n_row_overflow <= c), 1 + i, branch)
    if non_finite is not None:
        branch = jnp.where(non_finite, dense_branch, branch)
    # The pack's counts are the true counts, overflow included (l0 exact); the dense arm's active
    # count is the same on finite inputs and the dense formula's on others.
    l0_sum = jnp.sum(counts, dtype=jnp.float32)
    y_MxD, l1_M, neuron_H, l0_sum = lax.switch(branch, (keep, *fixes, all_dense),
                                               (y_MxD, l1_M, neuron_H, l0_sum))
    tokens = max(m, 1)
    aux = {
        "l1": jnp.sum(l1_M) / tokens,
        "l0": l0_sum / tokens,
        "tile_overflow": jnp.sum(tile_overflow_MxNT, dtype=jnp.int32),
        "row_overflow": n_row_overflow,
        "dense_fallback": (branch == dense_branch).astype(jnp.int32),
        # This forward's op runs the dense backward (the training forward, pallas_backward.forward,
        # replaces these with the sparse backward's tails).
        "backward_tail_rows": jnp.zeros((), jnp.int32),
        "backward_hot_neurons": jnp.zeros((), jnp.int32),
    }
    if want_counts:
        aux["neuron_active_count"] = neuron_H
        aux["token_active_count"] = jnp.sum(counts, axis=1, dtype=jnp.int32)
    if non_finite is not None:  # the dense formula's counters (dense.dense_aux): no overflow
        for key in ("tile_overflow", "row_overflow"):
            aux[key] = jnp.where(non_finite, 0, aux[key])
    return (y_MxD, aux, *ranked)


def calibrate_active_per_token(x: jax.Array, w_gate_HxD: jax.Array, *,
                               max_tokens: int = 4096) -> float:
    """Mean active gate neurons per token of x (any [..., D]) under relu(x w_gate^T) > 0, measured
    eagerly on up to `max_tokens` evenly strided tokens. Run it once on representative inputs (a
    calibration batch, or after training) and put the result in the config's
    `expected_active_per_token`: "auto" then decides dense vs sparse at trace time, for free."""
    if x.ndim < 1 or w_gate_HxD.ndim != 2 or w_gate_HxD.shape[1] != x.shape[-1]:
        raise ValueError(f"x must be [..., D] and w_gate_HxD [H, D] with the same D, got "
                         f"{x.shape} and {w_gate_HxD.shape}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    x_MxD = jnp.reshape(x, (-1, x.shape[-1]))
    if x_MxD.shape[0] == 0:
        raise ValueError("x has no tokens to calibrate on")
    n = min(max_tokens, x_MxD.shape[0])
    return float(planner.sampled_active_per_token(x_MxD, w_gate_HxD, n))


def _auto_forward(x_MxD: jax.Array, w_act_HxD: jax.Array, w_up_HxD: jax.Array | None,
                  w_down_HxD: jax.Array, s: dict[str, Any], interpret: bool) -> tuple[jax.Array, Aux]:
    """"auto": the sparse forward, or the op's own dense formula (so choosing it costs exactly what
    backend="dense" costs; dense_fallback = 1), decided by `planner.use_sparse_forward`."""
    use_sparse = planner.use_sparse_forward(w_up_HxD is not None, x_MxD, w_act_HxD, s["config"])

    def sparse():
        return sparse_forward(x_MxD, w_act_HxD, w_up_HxD, w_down_HxD, s, interpret)

    def dense():
        return dense_fallback_ffn(w_up_HxD is not None, x_MxD, weight_tuple(w_act_HxD, w_up_HxD, w_down_HxD),
                                      neuron_counts=s["neuron_counts"])

    if isinstance(use_sparse, bool):
        return sparse() if use_sparse else dense()
    return lax.cond(use_sparse, sparse, dense)


def _entry(forward: Callable[..., tuple[jax.Array, Aux]], x_MxD: jax.Array, w_act_HxD: jax.Array,
           w_up_HxD: jax.Array | None, w_down_HxD: jax.Array, config: SparseFFNConfig | None,
           interpret: bool, **flag: Any) -> tuple[jax.Array, Aux]:
    """Checks, then `forward` (w_up None = non-gated); an empty batch takes the dense formula (the
    kernels need a row)."""
    require_runnable(interpret)
    validate_operands(x_MxD, dict(w_up_HxD=w_act_HxD, w_down_HxD=w_down_HxD) if w_up_HxD is None  # non-gated
              else dict(w_gate_HxD=w_act_HxD, w_up_HxD=w_up_HxD, w_down_HxD=w_down_HxD))
    s = settings(config, x_MxD.shape[0])
    if x_MxD.shape[0] == 0:
        return dense_fallback_ffn(w_up_HxD is not None, x_MxD, weight_tuple(w_act_HxD, w_up_HxD, w_down_HxD),
                                      neuron_counts=s["neuron_counts"])
    return forward(x_MxD, w_act_HxD, w_up_HxD, w_down_HxD, s, interpret, **flag)


def gated_ffn_forward(x_MxD: jax.Array, w_gate_HxD: jax.Array, w_up_HxD: jax.Array,
                      w_down_HxD: jax.Array, config: SparseFFNConfig | None = None, *,
                      interpret: bool = False, non_finite: jax.Array | None = None) -> tuple[jax.Array, Aux]:
    """y = (relu(x W_gate^T) * (x W_up^T)) W_down through the Pallas kernels; returns (y, aux).
    non_finite (a bool scalar): when set, the dense formula's result (`sparse_forward`)."""
    return _entry(sparse_forward, x_MxD, w_gate_HxD, w_up_HxD, w_down_HxD, config, interpret,
                  non_finite=non_finite)


def ffn_forward(x_MxD: jax.Array, w_up_HxD: jax.Array, w_down_HxD: jax.Array,
                config: SparseFFNConfig | None = None, *, interpret: bool = False,
                non_finite: jax.Array | None = None) -> tuple[jax.Array, Aux]:
    """y = relu(x W_up^T) W_down through the Pallas kernels; returns (y, aux). non_finite: as
    gated_ffn_forward's."""
    return _entry(sparse_forward, x_MxD, w_up_HxD, None, w_down_HxD, config, interpret,
                  non_finite=non_finite)


def auto_gated_ffn_forward(x_MxD: jax.Array, w_gate_HxD: jax.Array, w_up_HxD: jax.Array,
                           w_down_HxD: jax.Array, config: SparseFFNConfig | None = None, *,
                           interpret: bool = False) -> tuple[jax.Array, Aux]:
    """Like gated_ffn_forward, but runs the dense XLA FFN when "auto" predicts it is faster."""
    return _entry(_auto_forward, x_MxD, w_gate_HxD, w_up_HxD, w_down_HxD, config, interpret)


def auto_ffn_forward(x_MxD: jax.Array, w_up_HxD: jax.Array, w_down_HxD: jax.Array,
                     config: SparseFFNConfig | None = None, *, interpret: bool = False) -> tuple[jax.Array, Aux]:
    """Like ffn_forward, but runs the dense XLA FFN when "auto" predicts it is faster."""
    return _entry(_auto_forward, x_MxD, w_up_HxD, None, w_down_HxD, config, interpret)
