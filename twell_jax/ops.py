"""The sparse FFN op: public functions, backend dispatch, custom_vjp, shard_map wrapper.

CONTRACT (other modules rely on it; keep it stable):

    gated_ffn(x, w_gate, w_up, w_down, *, backend="auto", config=None, interpret=False) -> (y, aux)
        y = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down
    ffn(x, w_up, w_down, *, backend="auto", config=None, interpret=False) -> (y, aux)
        y = relu(x @ w_up.T) @ w_down

    x: [..., D]; every weight is neuron-major [H, D]; all the same float dtype (f32 or bf16).
    y: same shape and dtype as x.
    aux: dict of scalars
        "l1": f32, mean over tokens of sum over neurons of |h| (differentiable: add lambda*l1 to the loss)
        "l0": f32, mean number of active neurons per token
        "tile_overflow": int32, (row, tile) pairs whose non-zeros exceed the TwELL slots
        "row_overflow": int32, rows whose non-zeros exceed the ELL width (sent to the dense tail)
        "dense_fallback": int32, 1 if the call fell back to the exact dense path (tail capacity
                          exceeded, or a non-finite input or weight: the NaN policy below)
      and, only when config.neuron_counts is True (COUNT_KEYS; for telemetry, no extra GEMM):
        "neuron_active_count": int32 [H], tokens of this call on which each neuron fired
        "token_active_count": int32 [...] (x.shape[:-1]), active neurons of each token
    backend: "dense" | "reference" | "pallas" | "auto"
    config: SparseFFNConfig (None = defaults)
    interpret: run the Pallas kernels in the Pallas interpreter (pallas backends only; for tests)

For the reference backend, "dense_fallback" covers the forward and the backward (the backward's
decision is a function of the same activation counts, so the forward reports it in advance).
Under vmap each aux entry gets the mapped axis; under a data mesh they are global.

Why neuron-major weights: hidden neuron j owns row j of w_gate, w_up and w_down, so every sparse
access (gathering the up / down rows of the active neurons of a token, or the weight-gradient row
of a neuron) is a contiguous D-vector read, never a strided column.

Backends:
    "dense"      `dense_ffn`, the one copy of the dense formula (also every fallback, the Pallas
                 glue's dense branch and the model's dense kinds): compute-dtype GEMMs with f32
                 accumulation, f32 gating product, aux from the x-dtype h; plain JAX autodiff.
    "reference"  the sparse algorithm in pure JAX (TwELL pack of the gate, SDDMM for the up
                 activations on the gate pattern, hybrid ELL+tail SpMM for the down projection);
                 backward: the sparse hybrid backward below. A `jax.custom_vjp`.
    "pallas"     forward by the Pallas kernels (`twell_jax.pallas_backend`, imported lazily),
                 backward by the Pallas backward kernels (`twell_jax.pallas_training`: the
                 forward keeps its TwELL pack for it). Needs a GPU unless interpret=True.
    "auto"       on a GPU with config.expected_active_per_token set: per layer, forward and
                 backward each sparse (Pallas) or dense from a cost model
                 (`pallas_training.choose_training_path`), decided at trace time (at decode sizes, a few tokens per call, the
                 forward spread over the active neurons: `twell_jax.decode_backend`); on a GPU
                 without the hint: dense or sparse decided first, outside the custom_vjp, by a
                 lax.cond on a sampled active count (`pallas_backend.auto_use_sparse`): dense =
                 the "dense" backend exactly, sparse = the Pallas forward + the exact dense
                 backward; elsewhere: "dense".

The reference and dense backwards keep only (x, weights) as residuals and recompute what they
need; the Pallas backward also keeps the forward's TwELL pack unless
`pallas_training.BackwardConfig.keep_gate_pattern` is False.

Exactness (no non-zero is ever dropped): gate rows with an overflowing TwELL tile or more than
`ell_width` actives go, complete, to the dense tail of the hybrid; if the tail capacity (static,
so no host sync) is exceeded in the forward, or the neuron-major transposes of the backward exceed
theirs, a `lax.cond` runs the exact dense computation for that call instead, and
aux["dense_fallback"] says so.

NaN policy: PROPAGATE. A NaN/Inf in x or in any weight row (silent neurons included) makes y and
the gradients non-finite on every backend exactly where the "dense" backend's are, and aux["l0"] is
the same on every backend: every sparse path checks `isfinite` over x and the weights once per call
(on device, no host sync) and on a non-finite value runs the exact dense forward and backward
instead (aux["dense_fallback"] = 1). The check reads every weight once per call, which the decode
path otherwise avoids.

Under a mesh (`jax.set_mesh`) whose `config.data_axis` has size > 1, the sparse backends run inside
`jax.shard_map` over that axis (tokens split, weights replicated, aux reduced to global scalars),
because Pallas calls are not partitioned by XLA. Tokens are zero-padded to a multiple of the axis
size (a zero token activates nothing).

Limits: indices are int32, so H and the token count per call are only bounded by memory. The
reference backend is a correctness oracle, not a fast path: it computes the gate densely.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from twell_jax import format as twell_format
from twell_jax import hybrid

if TYPE_CHECKING:  # annotations only: the kernels are imported lazily (Triton-backed Pallas)
    from pallas_kernels.twell_ffn import FFNBlockSizes
    from pallas_kernels.twell_pack import PackBlockSizes
    from twell_jax.pallas_training import BackwardConfig

BACKENDS = ("dense", "reference", "pallas", "auto")
AUX_KEYS = ("l1", "l0", "tile_overflow", "row_overflow", "dense_fallback")
COUNT_KEYS = ("neuron_active_count", "token_active_count")  # added when config.neuron_counts

Aux = dict[str, jax.Array]
Weights = tuple[jax.Array, ...]

_HIGHEST = jax.lax.Precision.HIGHEST


def _check_capacity_spec(name: str, value: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an int (rows) or a float fraction in [0, 1], got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} as a row count must be >= 0, got {value}")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} as a fraction must be in [0, 1], got {value}")


def _resolve_capacity(spec: int | float, n: int) -> int:
    """Rows of capacity for a spec that is a row count (int) or a fraction of n (float)."""
    return min(n, spec) if isinstance(spec, int) else min(n, math.ceil(spec * n))


@dataclasses.dataclass(frozen=True)
class SparseFFNConfig:
    """Static knobs of the sparse backends (hashable: it is a jit static argument)."""

    # TwELL tile width T: hidden columns per tile (the N extent of the gate GEMM tile).
    tile: int = 256
    # TwELL slots S stored per (token, tile); a tile with more actives overflows (handled exactly).
    slots: int = 32
    # ELL width W of the token-major hybrid: tokens with more actives go to the dense tail.
    ell_width: int = 128
    # Dense tail capacity of the token-major hybrid: int = rows, float = fraction of the tokens.
    tail_rows: int | float = 0.125
    # ELL width of the neuron-major (transposed) hybrids of the backward: tokens per neuron.
    transpose_ell_width: int = 256
    # Tail capacity of the transposed hybrids: int = rows, float = fraction of the neurons H.
    transpose_tail_rows: int | float = 0.25
    # Mesh axis that splits the tokens; the sparse backends shard_map over it. None = never.
    data_axis: str | None = "data"
    # Pallas: rows with tile overflow recomputed in a fixed block (None = the backend's default).
    overflow_rows: int | None = None
    # Pallas "auto" without a hint: tokens sampled on the device to estimate the active count
    # (None = the backend's default, 32 tokens).
    auto_sample_rows: int | None = None
    # Pallas "auto": mean actives per token above which the dense path runs (None = the per-shape
    # crossover of the backend's cost model, pallas_backend.crossover_active_per_token).
    auto_max_active: float | None = None
    # Pallas "auto": expected mean actives per token (e.g. the L0 telemetry of training). When set,
    # "auto" decides dense vs sparse at trace time for free, instead of sampling on the device.
    expected_active_per_token: float | None = None
    # Pallas: block sizes of the pack kernel (None = the kernel's defaults).
    pack_block_sizes: PackBlockSizes | None = None
    # Pallas: block sizes of the fused FFN kernel (None = the kernel's defaults).
    ffn_block_sizes: FFNBlockSizes | None = None
    # Add the per-neuron and per-token active counts to aux (COUNT_KEYS), computed from the
    # pattern the op builds anyway, so telemetry needs no second gate GEMM.
    neuron_counts: bool = False
    # Pallas backward knobs (None = pallas_training.BackwardConfig's defaults).
    backward: BackwardConfig | None = None

    def __post_init__(self) -> None:
        for name in ("tile", "slots", "ell_width", "transpose_ell_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseFFNConfig.{name} must be an int >= 1, got {value!r}")
        if self.slots > self.tile:
            raise ValueError(f"SparseFFNConfig.slots ({self.slots}) must be <= tile ({self.tile})")
        _check_capacity_spec("SparseFFNConfig.tail_rows", self.tail_rows)
        _check_capacity_spec("SparseFFNConfig.transpose_tail_rows", self.transpose_tail_rows)
        for name, module, cls in (("pack_block_sizes", "twell_pack", "PackBlockSizes"),
                                  ("ffn_block_sizes", "twell_ffn", "FFNBlockSizes")):
            value = getattr(self, name)
            if value is not None:  # imported only here: the kernels load Triton-backed Pallas
                expected = getattr(importlib.import_module(f"pallas_kernels.{module}"), cls)
                if not isinstance(value, expected):
                    raise ValueError(f"SparseFFNConfig.{name} must be None or a pallas_kernels.{module}.{cls}, "
                                     f"got {value!r}")
        if self.backward is not None:  # imported only here, like the kernels' block sizes
            expected = importlib.import_module("twell_jax.pallas_training").BackwardConfig
            if not isinstance(self.backward, expected):
                raise ValueError("SparseFFNConfig.backward must be None or a twell_jax.pallas_training."
                                 f"BackwardConfig, got {self.backward!r}")
        if not isinstance(self.neuron_counts, bool):
            raise ValueError(f"SparseFFNConfig.neuron_counts must be a bool, got {self.neuron_counts!r}")
        if self.data_axis is not None and not isinstance(self.data_axis, str):
            raise ValueError(f"SparseFFNConfig.data_axis must be a str or None, got {self.data_axis!r}")
        for name in ("overflow_rows", "auto_sample_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"SparseFFNConfig.{name} must be None or an int >= 1, got {value!r}")
        if self.auto_max_active is not None and (
                isinstance(self.auto_max_active, bool) or not isinstance(self.auto_max_active, (int, float))
                or not self.auto_max_active >= 0):
            raise ValueError(f"SparseFFNConfig.auto_max_active must be None or >= 0, got {self.auto_max_active!r}")
        expected = self.expected_active_per_token
        if expected is not None and (isinstance(expected, bool) or not isinstance(expected, (int, float))
                                     or not expected >= 0):
            raise ValueError("SparseFFNConfig.expected_active_per_token must be None or a number >= 0, "
                             f"got {expected!r}")

    def tail_capacity(self, n_tokens: int) -> int:
        """Tail rows of the token-major hybrid for a call with n_tokens tokens."""
        return _resolve_capacity(self.tail_rows, n_tokens)

    def transpose_tail_capacity(self, n_neurons: int) -> int:
        """Tail rows of the neuron-major hybrids for a layer with n_neurons neurons."""
        return _resolve_capacity(self.transpose_tail_rows, n_neurons)


# ----------------------------------------------------------------------------------------------
# Dense formulas (the "dense" backend, the fallback branches, the dense backward)
# ----------------------------------------------------------------------------------------------

def _matmul_t(x: jax.Array, w_HxD: jax.Array) -> jax.Array:
    """x @ w.T for x [..., D], in the operands' dtype. On a GPU the GEMM accumulates in f32 anyway;
    asking for an f32 output (preferred_element_type) would make the cotangent f32 and so the
    transposed GEMMs of the backward f32 x f32, about 2x slower for bf16 models."""
    return jnp.einsum("...d,hd->...h", x, w_HxD)


DENSE_ACTIVATIONS = ("relu", "silu")


def dense_hidden(gated: bool, x: jax.Array, weights: Weights,
                 activation: str = "relu") -> tuple[jax.Array, jax.Array]:
    """(h [..., H] in x's dtype, active [..., H] bool) of the dense formula: the ONE copy, used by
    the "dense" backend, every fallback and fix-up, the Pallas glue's dense branch and the model's
    dense kinds (swiglu through activation="silu").

    The GEMM outputs stay in x's dtype (bf16 operands forward and backward); the gating product
    is formed in f32 and rounded once. `active` is the pattern: gate > 0 for relu (what every
    sparse backend packs), h != 0 for silu (never exactly sparse)."""
    if activation not in DENSE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {DENSE_ACTIVATIONS}, got {activation!r}")
    g = _matmul_t(x, weights[0])
    act = jax.nn.relu if activation == "relu" else jax.nn.silu
    if gated:
        h = (act(g.astype(jnp.float32)) * _matmul_t(x, weights[1]).astype(jnp.float32)).astype(x.dtype)
    else:
        h = act(g.astype(jnp.float32)).astype(x.dtype)
    return h, (g > 0 if activation == "relu" else h != 0)


def dense_aux(h: jax.Array, active: jax.Array, neuron_counts: bool = False) -> Aux:
    """The op's aux of a dense evaluation: l1 from h (f32 accumulation over the x-dtype h, no f32
    copy of [M, H]), l0 and the optional counts from the `active` pattern."""
    tokens = max(1, h.size // max(1, h.shape[-1]))
    zero = jnp.zeros((), jnp.int32)
    aux = {"l1": jnp.sum(jnp.abs(h), dtype=jnp.float32) / tokens,
           "tile_overflow": zero, "row_overflow": zero, "dense_fallback": zero}
    if neuron_counts:
        per_token = jnp.sum(active, axis=-1, dtype=jnp.int32)
        aux["token_active_count"] = per_token
        aux["neuron_active_count"] = jnp.sum(active.reshape(-1, active.shape[-1]), axis=0, dtype=jnp.int32)
        aux["l0"] = jnp.sum(per_token, dtype=jnp.float32) / tokens
    else:
        aux["l0"] = jnp.sum(active, dtype=jnp.float32) / tokens
    return aux


def dense_ffn(gated: bool, x: jax.Array, weights: Weights, *, neuron_counts: bool = False,
              activation: str = "relu") -> tuple[jax.Array, Aux]:
    """y and aux of the dense formula, differentiated by plain JAX autodiff (the "dense" backend);
    weights = (w_gate, w_up, w_down) gated, (w_up, w_down) non-gated, all neuron-major [H, D]."""
    h, active = dense_hidden(gated, x, weights, activation)
    y = jnp.einsum("...h,hd->...d", h, weights[-1])
    return y, dense_aux(h, active, neuron_counts)


def _dense_backward(gated: bool, x: jax.Array, weights: Weights, gy: jax.Array,
                    gl1: jax.Array) -> tuple[jax.Array, Weights]:
    """Gradients of <gy, y> + gl1 * l1 by autodiff of the dense formula (gy in y's dtype, so every
    backward GEMM has x-dtype operands)."""
    def y_and_l1(x_, weights_):
        y, aux = dense_ffn(gated, x_, weights_)
        return y, aux["l1"]

    _, vjp = jax.vjp(y_and_l1, x, weights)
    return vjp((gy.astype(x.dtype), gl1.astype(jnp.float32)))


# ----------------------------------------------------------------------------------------------
# Reference sparse forward and backward (pure JAX, on the hybrid ELL + tail format)
# ----------------------------------------------------------------------------------------------

def _activation(gated: bool, x_MxD: jax.Array, weights: Weights) -> jax.Array:
    """f32 [M, H]: relu of the gate (gated) or up (non-gated) pre-activation; its non-zeros are
    the pattern."""
    return jax.nn.relu(jnp.einsum("md,hd->mh", x_MxD, weights[0], preferred_element_type=jnp.float32,
                                  precision=_HIGHEST))


def _needs_dense_backward(act_MxH: jax.Array, config: SparseFFNConfig) -> jax.Array:
    """bool scalar: the backward's hybrids would exceed a tail capacity (decided from counts only,
    the same rule `hybrid.from_dense` / `hybrid.transpose_many` apply)."""
    n_tokens, n_neurons = act_MxH.shape
    active = act_MxH != 0
    token_tail = jnp.sum(jnp.sum(active, axis=1) > config.ell_width)
    neuron_tail = jnp.sum(jnp.sum(active, axis=0) > config.transpose_ell_width)
    return ((token_tail > config.tail_capacity(n_tokens))
            | (neuron_tail > config.transpose_tail_capacity(n_neurons)))


def reference_forward(gated: bool, x_MxD: jax.Array, weights: Weights,
                      config: SparseFFNConfig) -> tuple[jax.Array, Aux]:
    """Sparse forward in pure JAX: TwELL pack -> hybrid P -> SDDMM (up) -> SpMM (down)."""
    n_tokens = x_MxD.shape[0]
    act_MxH = _activation(gated, x_MxD, weights)
    packed = twell_format.pack(act_MxH, tile=config.tile, slots=config.slots)
    # Rows with an overflowing tile are recomputed exactly into the tail; here the dense
    # activation already exists, so recomputing is a row gather (a kernel pipeline would redo
    # relu(x[rows] @ W^T) for those rows only).
    pattern = hybrid.from_twell(packed, ell_width=config.ell_width,
                                tail_capacity=config.tail_capacity(n_tokens),
                                recompute_rows=lambda rows: act_MxH[rows])

    def sparse_branch() -> tuple[jax.Array, jax.Array]:
        if gated:
            up = hybrid.sddmm(x_MxD, weights[1], pattern)
            h = hybrid.map_values(lambda p, u: (p * u).astype(x_MxD.dtype), pattern, up)
        else:
            h = hybrid.map_values(lambda p: p.astype(x_MxD.dtype), pattern)
        y = hybrid.spmm(h, weights[-1]).astype(x_MxD.dtype)
        return y, hybrid.sum_values(h, jnp.abs) / n_tokens

    def dense_branch() -> tuple[jax.Array, jax.Array]:
        y, aux = dense_ffn(gated, x_MxD, weights)
        return y, aux["l1"]

    forward_fallback = pattern.tail_overflow > 0
    y, l1 = jax.lax.cond(forward_fallback, dense_branch, sparse_branch)
    fallback = forward_fallback | _needs_dense_backward(act_MxH, config)
    aux = {
        "l1": l1,
        "l0": jnp.sum(pattern.row_nnz, dtype=jnp.float32) / n_tokens,
        "tile_overflow": twell_format.overflow_count(packed),
        "row_overflow": jnp.sum(pattern.row_nnz > config.ell_width, dtype=jnp.int32),
        "dense_fallback": fallback.astype(jnp.int32),
    }
    if config.neuron_counts:
        aux["neuron_active_count"] = jnp.sum(act_MxH > 0, axis=0, dtype=jnp.int32)
        aux["token_active_count"] = pattern.row_nnz.astype(jnp.int32)
    return y, aux


def reference_backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array,
                       gl1: jax.Array, config: SparseFFNConfig) -> tuple[jax.Array, Weights]:
    """Gradients of <gy, y> + gl1 * l1 on the hybrid format (docs/format.md), recomputing the
    pattern from (x, weights). Falls back to the dense backward when a tail would overflow."""
    n_tokens, n_neurons = x_MxD.shape[0], weights[0].shape[0]
    act_MxH = _activation(gated, x_MxD, weights)

    def sparse_branch() -> tuple[jax.Array, Weights]:
        p = hybrid.from_dense(act_MxH, ell_width=config.ell_width,
                              tail_capacity=config.tail_capacity(n_tokens))
        w_down = weights[-1]
        # dt = gY . W_j on the pattern, plus the L1 term: d(gl1 * sum|t| / M)/dt = gl1/M * sign(t).
        dt_raw = hybrid.sddmm(gy_MxD, w_down, p)
        if gated:
            w_gate, w_up, _ = weights
            up = hybrid.sddmm(x_MxD, w_up, p)
            h = hybrid.map_values(lambda a, u: (a * u).astype(x_MxD.dtype), p, up)
        else:
            (w_up, _) = weights
            h = hybrid.map_values(lambda a: a.astype(x_MxD.dtype), p)
        scale = gl1.astype(jnp.float32) / n_tokens
        dt = hybrid.map_values(lambda d, t: d + scale * jnp.sign(t.astype(jnp.float32)), dt_raw, h)
        transposed = dict(ell_width=config.transpose_ell_width,
                          tail_capacity=config.transpose_tail_capacity(n_neurons))
        if gated:
            # relu' = 1 exactly on the pattern, so dg (pre-activation) = dt * u there.
            d_up = hybrid.map_values(lambda d, a: d * a, dt, p)
            d_gate = hybrid.map_values(lambda d, u: d * u, dt, up)
            dx = hybrid.spmm(d_up, w_up) + hybrid.spmm(d_gate, w_gate)
            h_t, d_up_t, d_gate_t = hybrid.transpose_many([h, d_up, d_gate], **transposed)
            grads = (hybrid.spmm(d_gate_t, x_MxD), hybrid.spmm(d_up_t, x_MxD), hybrid.spmm(h_t, gy_MxD))
        else:
            dx = hybrid.spmm(dt, w_up)
            h_t, dt_t = hybrid.transpose_many([h, dt], **transposed)
            grads = (hybrid.spmm(dt_t, x_MxD), hybrid.spmm(h_t, gy_MxD))
        return dx.astype(x_MxD.dtype), tuple(g.astype(w.dtype) for g, w in zip(grads, weights))

    def dense_branch() -> tuple[jax.Array, Weights]:
        return _dense_backward(gated, x_MxD, weights, gy_MxD, gl1)

    return jax.lax.cond(_needs_dense_backward(act_MxH, config), dense_branch, sparse_branch)


# ----------------------------------------------------------------------------------------------
# custom_vjp: any forward, with the sparse (reference) or the dense backward
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call runs (static)."""

    gated: bool
    forward: str  # "reference" | "pallas" | "pallas_auto" (decided in _op_body) | "dense" | "decode"
    backward: str  # "sparse" (reference) | "pallas" (twell_jax.pallas_training) | "dense"
    interpret: bool


def _run_sparse_forward(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
                        weights: Weights) -> tuple[jax.Array, Aux]:
    """The plan's forward, assuming finite inputs (see `_run_forward`)."""
    if plan.forward == "decode":
        from twell_jax import decode_backend  # lazy, like pallas_backend

        fn = decode_backend.decode_gated_ffn_forward if plan.gated else decode_backend.decode_ffn_forward
        y, aux = fn(x_MxD, *weights, config=config, interpret=plan.interpret)
        if config.neuron_counts:  # the decode path has no packed pattern: count from the dense gate
            _, counts = dense_ffn(plan.gated, x_MxD, weights, neuron_counts=True)
            aux = {**aux, **{key: counts[key] for key in COUNT_KEYS}}
        return y, {key: aux[key] for key in _aux_keys(config)}
    if plan.backward == "pallas" or plan.forward == "dense":
        y, aux, _ = _pallas_training_forward(plan, config, x_MxD, weights)
        return y, aux
    if plan.forward == "reference":
        return reference_forward(plan.gated, x_MxD, weights, config)
    from twell_jax import pallas_backend  # lazy: the kernels need Triton-capable jax builds

    fn = pallas_backend.gated_ffn_forward if plan.gated else pallas_backend.ffn_forward
    y, aux = fn(x_MxD, *weights, config, interpret=plan.interpret)
    return y, {key: aux[key] for key in _aux_keys(config)}


def _non_finite(x_MxD: jax.Array, weights: Weights) -> jax.Array:
    """bool scalar: a NaN/Inf anywhere in x or the weights (one reduction per call, on device).
    The sparse paths skip the rows of silent neurons, so they must not run on such inputs: the
    NaN policy is to propagate like the dense formula (docs/format.md)."""
    return ~functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(a)) for a in (x_MxD, *weights)])


def _same_variance(anchor: jax.Array, tree: Any) -> Any:
    """`tree` unchanged in value, typed to vary (inside a caller's shard_map) over every mesh axis
    `anchor` varies over: both branches of the fallback's lax.cond then have equal types although
    one returns constants (the zero counters). `where(p, a, a)` is `a`; XLA folds it away."""
    return jax.tree.map(lambda a: jnp.where(anchor, a, a), tree)


def _with_dense_fallback(non_finite: jax.Array, gated: bool, config: SparseFFNConfig,
                         x_MxD: jax.Array, weights: Weights,
                         sparse: Callable[[], Any]) -> Any:
    """`sparse()` (whose first two outputs are (y, aux)), or the exact dense forward when
    `non_finite`; the dense branch fills any further outputs (the Pallas pack) with zeros."""
    shapes = jax.eval_shape(sparse)

    def dense() -> Any:
        y, aux = dense_ffn(gated, x_MxD, weights, neuron_counts=config.neuron_counts)
        aux = {**aux, "dense_fallback": jnp.ones((), jnp.int32)}
        out = (y, {key: aux[key].astype(shapes[1][key].dtype) for key in shapes[1]})
        rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tuple(shapes[2:]))
        return _same_variance(non_finite, out + rest)

    return jax.lax.cond(non_finite, dense, lambda: _same_variance(non_finite, sparse()))


def _run_forward(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
                 weights: Weights) -> tuple[jax.Array, Aux]:
    """The plan's forward; the exact dense forward when an input or weight is not finite."""
    return _with_dense_fallback(_non_finite(x_MxD, weights), plan.gated, config, x_MxD, weights,
                                lambda: _run_sparse_forward(plan, config, x_MxD, weights))


def _aux_keys(config: SparseFFNConfig) -> tuple[str, ...]:
    return AUX_KEYS + COUNT_KEYS if config.neuron_counts else AUX_KEYS


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sparse_op(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
               weights: Weights) -> tuple[jax.Array, Aux]:
    return _run_forward(plan, config, x_MxD, weights)


def _pallas_training_forward(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
                             weights: Weights) -> tuple[jax.Array, Aux, Any]:
    """Forward of a plan with the Pallas backward: (y, aux, the TwELL pack kept for it or None)."""
    from twell_jax import pallas_training  # lazy, like pallas_backend

    y, aux, pack = pallas_training.forward(plan.gated, plan.forward, x_MxD, weights, config,
                                           plan.interpret)
    return y, {key: aux[key] for key in _aux_keys(config)}, pack


def _sparse_op_fwd(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights
                   ) -> tuple[tuple[jax.Array, Aux], tuple[Any, ...]]:
    # Residuals: (x, weights, non_finite[, the Pallas pack]); the flag, computed once here, also
    # sends the backward to the dense formula.
    non_finite = _non_finite(x_MxD, weights)
    if plan.backward == "pallas":
        y, aux, pack = _with_dense_fallback(
            non_finite, plan.gated, config, x_MxD, weights,
            lambda: _pallas_training_forward(plan, config, x_MxD, weights))
        return (y, aux), (x_MxD, weights, non_finite, pack)
    y, aux = _with_dense_fallback(non_finite, plan.gated, config, x_MxD, weights,
                                  lambda: _run_sparse_forward(plan, config, x_MxD, weights))
    return (y, aux), (x_MxD, weights, non_finite)


def _sparse_op_bwd(plan: _Plan, config: SparseFFNConfig, residuals: tuple[Any, ...],
                   cotangents: tuple[jax.Array, Aux]) -> tuple[jax.Array, Weights]:
    x_MxD, weights, non_finite = residuals[:3]
    gy_MxD, g_aux = cotangents
    gl1 = jnp.asarray(g_aux["l1"], jnp.float32)  # l0 and the counters are not differentiable
    dense_backward = functools.partial(_dense_backward, plan.gated, x_MxD, weights, gy_MxD, gl1)
    if plan.backward == "dense":
        return dense_backward()

    def sparse_backward() -> tuple[jax.Array, Weights]:
        if plan.backward == "pallas":
            from twell_jax import pallas_training

            return pallas_training.backward(plan.gated, x_MxD, weights, gy_MxD, gl1, config,
                                            plan.interpret, residuals[3], dense_backward)
        return reference_backward(plan.gated, x_MxD, weights, gy_MxD, gl1, config)

    return jax.lax.cond(non_finite, dense_backward, sparse_backward)


_sparse_op.defvjp(_sparse_op_fwd, _sparse_op_bwd)


def _op_body(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
             weights: Weights) -> tuple[jax.Array, Aux]:
    """One call on local tokens. "pallas_auto" decides dense vs sparse OUTSIDE the custom_vjp:
    its dense branch is the plain dense formula under autodiff (exactly the "dense" backend, which
    keeps its activations for the backward), its sparse branch the Pallas forward with the dense
    backward recomputing from (x, weights). A model that is not sparse yet (initialisation) thus
    trains at the dense speed instead of paying the backward's recompute."""
    if plan.forward != "pallas_auto":
        return _sparse_op(plan, config, x_MxD, weights)
    from twell_jax import pallas_backend

    sparse_plan = dataclasses.replace(plan, forward="pallas")

    def sparse() -> tuple[jax.Array, Aux]:
        return _sparse_op(sparse_plan, config, x_MxD, weights)

    def dense() -> tuple[jax.Array, Aux]:
        y, aux = dense_ffn(plan.gated, x_MxD, weights, neuron_counts=config.neuron_counts)
        return y, {**aux, "dense_fallback": jnp.ones((), jnp.int32)}  # "auto" chose the dense path

    use_sparse = pallas_backend.auto_use_sparse(plan.gated, x_MxD, weights[0], config)
    if isinstance(use_sparse, bool):  # decided at trace time: only that path is compiled
        return sparse() if use_sparse else dense()
    return jax.lax.cond(use_sparse, sparse, dense)


# ----------------------------------------------------------------------------------------------
# Dispatch: validation, backend choice, shard_map
# ----------------------------------------------------------------------------------------------

def _data_axis_size(config: SparseFFNConfig) -> int:
    if config.data_axis is None:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or config.data_axis not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types))[config.data_axis] == AxisType.Manual:
        return 1  # the caller is already inside a shard_map over the data axis: x is local
    return int(mesh.shape[config.data_axis])


def _sharded_call(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights,
                  n_shards: int) -> tuple[jax.Array, Aux]:
    """The op inside shard_map over config.data_axis: tokens split, weights replicated."""
    axis = config.data_axis
    n_tokens = x_MxD.shape[0]
    pad = (-n_tokens) % n_shards
    x_pad = jnp.pad(x_MxD, ((0, pad), (0, 0)))

    def local(x_loc: jax.Array, weights_loc: Weights) -> tuple[jax.Array, Aux]:
        # The weights are replicated (spec P()): shard_map's transpose sums the per-shard weight
        # gradients over the axis, so the custom_vjp returns local gradients only.
        y, aux = _op_body(plan, config, x_loc, weights_loc)
        m_loc = x_loc.shape[0]
        # Padded tokens are zero: they add nothing to l1/l0 sums, so divide by the true count.
        global_aux = {
            "l1": jax.lax.psum(aux["l1"] * m_loc, axis) / n_tokens,
            "l0": jax.lax.psum(aux["l0"] * m_loc, axis) / n_tokens,
            "tile_overflow": jax.lax.psum(aux["tile_overflow"], axis),
            "row_overflow": jax.lax.psum(aux["row_overflow"], axis),
            # psum + clip rather than pmax: pmax has no JVP rule, even for integers.
            "dense_fallback": jnp.minimum(jax.lax.psum(aux["dense_fallback"], axis), 1),
        }
        if config.neuron_counts:
            # A zero (padding) token activates nothing, so the neuron counts need no correction.
            global_aux["neuron_active_count"] = jax.lax.psum(aux["neuron_active_count"], axis)
            global_aux["token_active_count"] = aux["token_active_count"]
        return y, global_aux

    aux_specs = {key: PartitionSpec() for key in AUX_KEYS}
    if config.neuron_counts:
        aux_specs.update(neuron_active_count=PartitionSpec(), token_active_count=PartitionSpec(axis))
    # check_vma=False: a pallas_call inside shard_map needs per-output variance annotations whose
    # spelling differs between JAX 0.10 and 0.11; the specs here are simple enough to state.
    sharded = jax.shard_map(local, in_specs=(PartitionSpec(axis), PartitionSpec()),
                            out_specs=(PartitionSpec(axis), aux_specs), axis_names={axis},
                            check_vma=False)
    mesh = jax.sharding.get_abstract_mesh()
    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Explicit
    if explicit:
        # Explicit axes carry shardings in the types: shard_map wants inputs already laid out.
        x_pad = jax.sharding.reshard(x_pad, PartitionSpec(axis))
        weights = jax.sharding.reshard(weights, PartitionSpec())
    y_pad, aux = sharded(x_pad, weights)
    if explicit:
        y_pad = jax.sharding.reshard(y_pad, PartitionSpec())  # so the unpadding slice is legal
        if config.neuron_counts:
            aux["token_active_count"] = jax.sharding.reshard(aux["token_active_count"], PartitionSpec())
    if config.neuron_counts:
        aux["token_active_count"] = aux["token_active_count"][:n_tokens]
    return y_pad[:n_tokens], aux


@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def _sparse_call(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights,
                 n_shards: int) -> tuple[jax.Array, Aux]:
    if n_shards > 1:
        return _sharded_call(plan, config, x_MxD, weights, n_shards)
    return _op_body(plan, config, x_MxD, weights)


def _validate(x: jax.Array, weights: dict[str, jax.Array], backend: str, config: Any,
              interpret: Any) -> SparseFFNConfig:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if config is None:
        config = SparseFFNConfig()
    elif not isinstance(config, SparseFFNConfig):
        raise ValueError(f"config must be a SparseFFNConfig or None, got {type(config).__name__}")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("x must have shape [..., D], got a scalar")
    d_model = x.shape[-1]
    first_name, n_neurons = None, None
    for name, w in weights.items():
        if w.ndim != 2:
            raise ValueError(f"{name} must be a 2-D neuron-major [H, D] matrix, got shape {w.shape}")
        if w.shape[1] != d_model:
            raise ValueError(f"{name} must be [H, D={d_model}] (D = x.shape[-1]), got shape {w.shape}")
        if w.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
        if w.shape[0] < 1:
            raise ValueError(f"{name} must have at least one neuron (H >= 1), got shape {w.shape}")
        if n_neurons is None:
            first_name, n_neurons = name, w.shape[0]
        elif w.shape[0] != n_neurons:
            raise ValueError(f"{name} has H={w.shape[0]} neurons but {first_name} has H={n_neurons}")
    return config


def _pallas_module(required: bool):
    """twell_jax.pallas_backend, or None when it cannot be imported and is not required."""
    try:
        from twell_jax import pallas_backend
    except ImportError as err:
        if required:
            raise RuntimeError(f"backend='pallas' needs twell_jax.pallas_backend, which failed to import: {err}") from err
        return None
    return pallas_backend


def _plan(gated: bool, backend: str, interpret: bool, config: SparseFFNConfig,
          shape: tuple[int, int, int, int]) -> _Plan | None:
    """The plan of a sparse backend, or None when the call runs the plain dense backend.
    shape = (tokens per shard, D, H, itemsize), for the training "auto" choice."""
    if backend == "dense":
        return None
    if backend == "reference":
        return _Plan(gated, "reference", "sparse", interpret)
    if backend == "pallas":
        module = _pallas_module(required=True)
        if not interpret and not module.available():
            raise RuntimeError(
                "backend='pallas' needs a GPU (pallas_backend.available() is False); pass "
                "interpret=True to run the kernels in the Pallas interpreter, or use "
                "backend='reference' or 'dense'")
        return _Plan(gated, "pallas", "pallas", interpret)
    module = _pallas_module(required=False)  # "auto"
    if module is None or not module.available():
        return None
    if config.expected_active_per_token is None:
        # No hint: the forward samples on the device and branches; the backward stays dense.
        return _Plan(gated, "pallas_auto", "dense", interpret)
    from twell_jax import pallas_training

    m, d_model, n_neurons, itemsize = shape
    from twell_jax import decode_backend

    if decode_backend.prefer_decode_path(m, d_model, n_neurons, config.expected_active_per_token, gated,
                                         itemsize=itemsize):
        # Decode sizes (a few tokens per call): the work spread over the active neurons.
        return _Plan(gated, "decode", "dense", interpret)
    fwd_sparse, bwd_sparse = pallas_training.choose_training_path(
        m, d_model, n_neurons, config.expected_active_per_token, gated, itemsize=itemsize,
        ell_width=config.ell_width,
        keep_pattern=pallas_training.backward_settings(config).keep_gate_pattern)
    return _Plan(gated, "pallas" if fwd_sparse else "dense", "pallas" if bwd_sparse else "dense",
                 interpret)


def _dispatch(gated: bool, x: Any, weights: dict[str, Any], backend: str, config: Any,
              interpret: Any) -> tuple[jax.Array, Aux]:
    x = jnp.asarray(x)
    weights = {name: jnp.asarray(w) for name, w in weights.items()}
    config = _validate(x, weights, backend, config, interpret)
    w = tuple(weights.values())
    n_tokens = math.prod(x.shape[:-1])
    n_shards = _data_axis_size(config)
    plan = _plan(gated, backend, interpret, config,
                 (-(-n_tokens // n_shards), x.shape[-1], w[0].shape[0], x.dtype.itemsize))
    if plan is None or n_tokens == 0:
        return dense_ffn(gated, x, w, neuron_counts=config.neuron_counts)
    x_MxD = x.reshape(n_tokens, x.shape[-1])
    y_MxD, aux = _sparse_call(plan, config, x_MxD, w, n_shards)
    if config.neuron_counts:
        aux["token_active_count"] = aux["token_active_count"].reshape(x.shape[:-1])
    return y_MxD.reshape(x.shape), aux


def gated_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
              backend: str = "auto", config: SparseFFNConfig | None = None,
              interpret: bool = False) -> tuple[jax.Array, Aux]:
    """y = (relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down and the aux scalars (module docstring)."""
    return _dispatch(True, x, dict(w_gate=w_gate, w_up=w_up, w_down=w_down), backend, config, interpret)


def ffn(x: jax.Array, w_up: jax.Array, w_down: jax.Array, *, backend: str = "auto",
        config: SparseFFNConfig | None = None, interpret: bool = False) -> tuple[jax.Array, Aux]:
    """y = relu(x @ w_up.T) @ w_down and the aux scalars (module docstring)."""
    return _dispatch(False, x, dict(w_up=w_up, w_down=w_down), backend, config, interpret)
