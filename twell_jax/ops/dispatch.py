"""How a call runs: validation, the backend plan, the custom_vjp (any forward with the sparse,
Pallas or dense backward; the NaN policy's dense fallback), the shard_map wrapper, and the public
`gated_ffn` / `ffn` (the contract is in twell_jax/ops/__init__.py)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from twell_jax.ops.config import AUX_KEYS, COUNT_KEYS, TAIL_SHARE_KEYS, Aux, SparseFFNConfig, Weights
from twell_jax.ops.dense import dense_backward, dense_fallback_ffn, dense_ffn
from twell_jax.ops.reference import reference_backward, reference_forward

BACKENDS = ("dense", "reference", "pallas", "auto")
# The checkpoint_name of the residuals the sparse op's custom_vjp keeps for its backward.
RESIDUAL_NAME = "twell_op_residual"


# ----------------------------------------------------------------------------------------------
# custom_vjp: any forward, with the sparse (reference) or the dense backward
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call runs (static)."""

    gated: bool
    forward: str  # "reference" | "pallas" | "pallas_auto" (decided in _op_body) | "dense" | "decode"
    backward: str  # "sparse" (reference) | "pallas" (twell_jax.ops.pallas_backward) | "dense"
    interpret: bool


def _run_sparse_forward(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
                        weights: Weights) -> tuple[jax.Array, Aux]:
    """The plan's forward, assuming finite inputs (see `_run_forward`)."""
    if plan.forward == "decode":
        from twell_jax.ops import pallas_decode  # lazy, like pallas_forward

        fn = pallas_decode.decode_gated_ffn_forward if plan.gated else pallas_decode.decode_ffn_forward
        y, aux = fn(x_MxD, *weights, config=config, interpret=plan.interpret)
        return y, {key: aux[key] for key in _aux_keys(config)}
    if plan.forward == "dense" and plan.backward == "dense":  # "auto", auto_dense_recompute
        y, aux = dense_fallback_ffn(plan.gated, x_MxD, weights, neuron_counts=config.neuron_counts)
        return y, {key: aux[key] for key in _aux_keys(config)}
    if plan.backward == "pallas" or plan.forward == "dense":
        y, aux, _ = _pallas_training_forward(plan, config, x_MxD, weights)
        return y, aux
    if plan.forward == "reference":
        return reference_forward(plan.gated, x_MxD, weights, config)
    from twell_jax.ops import pallas_forward  # lazy: the kernels need Triton-capable jax builds

    fn = pallas_forward.gated_ffn_forward if plan.gated else pallas_forward.ffn_forward
    y, aux = fn(x_MxD, *weights, config, interpret=plan.interpret)
    return y, {key: aux[key] for key in _aux_keys(config)}


def _non_finite(config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights) -> jax.Array:
    """bool scalar: a NaN/Inf anywhere in x or the weights (one reduction per call, on device).
    The sparse paths skip the rows of silent neurons, so they must not run on such inputs: the
    NaN policy is to propagate like the dense formula (docs/format.md). A constant False when
    config.check_finite is off."""
    if not config.check_finite:
        return jnp.zeros((), jnp.bool_)
    return ~functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(a)) for a in (x_MxD, *weights)])


def _same_variance(anchor: jax.Array, tree: Any) -> Any:
    """`tree` unchanged in value, typed to vary (inside a caller's shard_map) over every mesh axis
    `anchor` varies over: both branches of the fallback's lax.cond then have equal types although
    one returns constants (the zero counters). `where(p, a, a)` is `a`; XLA folds it away."""
    return jax.tree.map(lambda a: jnp.where(anchor, a, a), tree)


def _with_dense_fallback(non_finite: jax.Array, plan: _Plan, config: SparseFFNConfig,
                         x_MxD: jax.Array, weights: Weights,
                         sparse: Callable[[], Any]) -> Any:
    """`sparse()` (whose first two outputs are (y, aux)), or the exact dense forward when
    `non_finite`; the dense branch fills any further outputs (the Pallas pack) with zeros. No cond
    when the check is off, or when the plan's forward is the dense formula already (both branches
    would be the same dense forward; `non_finite` still sends the backward to the dense formula)."""
    if not config.check_finite or plan.forward == "dense":
        return sparse()
    gated = plan.gated
    shapes = jax.eval_shape(sparse)

    def dense() -> Any:
        y, aux = dense_fallback_ffn(gated, x_MxD, weights, neuron_counts=config.neuron_counts)
        out = (y, {key: aux[key].astype(shapes[1][key].dtype) for key in shapes[1]})
        rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tuple(shapes[2:]))
        return _same_variance(non_finite, out + rest)

    return jax.lax.cond(non_finite, dense, lambda: _same_variance(non_finite, sparse()))


def _run_forward(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array,
                 weights: Weights) -> tuple[jax.Array, Aux]:
    """The plan's forward; the exact dense forward when an input or weight is not finite."""
    return _with_dense_fallback(_non_finite(config, x_MxD, weights), plan, config, x_MxD, weights,
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
    from twell_jax.ops import pallas_backward  # lazy, like pallas_forward

    y, aux, pack = pallas_backward.forward(plan.gated, plan.forward, x_MxD, weights, config,
                                           plan.interpret)
    return y, {key: aux[key] for key in _aux_keys(config)}, pack


def _sparse_op_fwd(plan: _Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights
                   ) -> tuple[tuple[jax.Array, Aux], tuple[Any, ...]]:
    # Residuals: (x, weights, non_finite[, the Pallas pack]); the flag, computed once here, also
    # sends the backward to the dense formula. Named RESIDUAL_NAME, so that a caller's remat policy
    # can keep them (the model's layer scan does) instead of rerunning this forward.
    non_finite = _non_finite(config, x_MxD, weights)
    if plan.backward == "pallas":
        y, aux, pack = _with_dense_fallback(
            non_finite, plan, config, x_MxD, weights,
            lambda: _pallas_training_forward(plan, config, x_MxD, weights))
        return (y, aux), checkpoint_name((x_MxD, weights, non_finite, pack), RESIDUAL_NAME)
    y, aux = _with_dense_fallback(non_finite, plan, config, x_MxD, weights,
                                  lambda: _run_sparse_forward(plan, config, x_MxD, weights))
    return (y, aux), checkpoint_name((x_MxD, weights, non_finite), RESIDUAL_NAME)


def _sparse_op_bwd(plan: _Plan, config: SparseFFNConfig, residuals: tuple[Any, ...],
                   cotangents: tuple[jax.Array, Aux]) -> tuple[jax.Array, Weights]:
    x_MxD, weights, non_finite = residuals[:3]
    # The backward recomputes what it needs from (x, weights); without the barrier XLA's CSE merges
    # a recomputed GEMM with the forward's identical one and keeps its [M, H] output alive after
    # all (what jax.checkpoint prevents the same way).
    x_MxD, weights = jax.lax.optimization_barrier((x_MxD, weights))
    gy_MxD, g_aux = cotangents
    gl1 = jnp.asarray(g_aux["l1"], jnp.float32)  # l0 and the counters are not differentiable
    if plan.backward == "dense":
        return dense_backward(plan.gated, x_MxD, weights, gy_MxD, gl1)
    if plan.backward == "pallas":
        # The dense branch of a sparse backward (never run when the kernels can): in row blocks,
        # so its temporaries do not set the program's memory (pallas_backward.blocked_dense_backward).
        from twell_jax.ops import pallas_backward

        rows = (config.backward or pallas_backward.BackwardConfig()).dense_block_rows
        dense_bwd = functools.partial(pallas_backward.blocked_dense_backward, plan.gated, x_MxD,
                                      weights, gy_MxD, gl1, rows)
    else:
        dense_bwd = functools.partial(dense_backward, plan.gated, x_MxD, weights, gy_MxD, gl1)

    if plan.backward == "pallas":
        # The NaN/Inf flag joins the Pallas backward's own branch (one predicate, not two). On such
        # inputs the pieces before that branch read a zero pack (what the forward's dense fallback
        # kept) or one rebuilt from the non-finite x (a dense forward keeps none): index work only,
        # harmless, and the branch then runs the dense formula.
        from twell_jax.ops import pallas_backward

        return pallas_backward.backward(plan.gated, x_MxD, weights, gy_MxD, gl1, config,
                                        plan.interpret, residuals[3], dense_bwd,
                                        non_finite=non_finite if config.check_finite else None)

    def sparse_backward() -> tuple[jax.Array, Weights]:
        return reference_backward(plan.gated, x_MxD, weights, gy_MxD, gl1, config)

    if not config.check_finite:  # non_finite is a constant False: no cond in the program
        return sparse_backward()
    return jax.lax.cond(non_finite, dense_bwd, sparse_backward)


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
    from twell_jax.ops import pallas_forward

    sparse_plan = dataclasses.replace(plan, forward="pallas")

    def sparse() -> tuple[jax.Array, Aux]:
        return _sparse_op(sparse_plan, config, x_MxD, weights)

    def dense() -> tuple[jax.Array, Aux]:
        # "auto" chose the dense path
        return dense_fallback_ffn(plan.gated, x_MxD, weights, neuron_counts=config.neuron_counts)

    use_sparse = pallas_forward.auto_use_sparse(plan.gated, x_MxD, weights[0], config)
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


def backward_tail_shares(token_active_count: jax.Array, neuron_active_count: jax.Array,
                         config: SparseFFNConfig | None) -> dict[str, jax.Array]:
    """Estimates of the sparse backward's dense tails, as the tail hints of SparseFFNConfig want
    them, from the counts any backend adds to aux with `neuron_counts` (so also after a dense
    forward, which builds no pattern): f32 scalars under TAIL_SHARE_KEYS
      "token_tail_share"  tokens with more than ell_width actives / tokens (a token whose TwELL
                          tile overflows with fewer actives is not counted: rare, slots >= 32)
      "hot_neuron_share"  neurons over hot_threshold(M) / H, M = the tokens per data shard of the
                          call and a neuron's per-shard count estimated as its count / shards
      "hot_entry_share"   the hot neurons' entries / all entries (0 with none)."""
    config = config or SparseFFNConfig()
    n_tokens = math.prod(token_active_count.shape)
    n_shards = _data_axis_size(config)
    threshold = config.hot_threshold(-(-n_tokens // n_shards))
    counts_H = neuron_active_count.astype(jnp.float32)
    hot_H = counts_H / n_shards > threshold
    entries = jnp.sum(counts_H)
    shares = (jnp.mean((token_active_count > config.ell_width).astype(jnp.float32)),
              jnp.mean(hot_H.astype(jnp.float32)),
              jnp.where(entries > 0, jnp.sum(jnp.where(hot_H, counts_H, 0.0)) / jnp.maximum(entries, 1.0), 0.0))
    return dict(zip(TAIL_SHARE_KEYS, shares))


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
        for key in ("backward_tail_rows", "backward_hot_neurons"):  # -1 (not counted) stays -1
            unknown = jax.lax.psum((aux[key] < 0).astype(jnp.int32), axis) > 0
            global_aux[key] = jnp.where(unknown, -1, jax.lax.psum(jnp.maximum(aux[key], 0), axis))
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


def _validate_config(config: Any) -> SparseFFNConfig:
    if config is None:
        return SparseFFNConfig()
    if not isinstance(config, SparseFFNConfig):
        raise ValueError(f"config must be a SparseFFNConfig or None, got {type(config).__name__}")
    return config


def _validate(x: jax.Array, weights: dict[str, jax.Array], backend: str, config: Any,
              interpret: Any) -> SparseFFNConfig:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    config = _validate_config(config)
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
    """twell_jax.ops.pallas_forward, or None when it cannot be imported and is not required."""
    try:
        from twell_jax.ops import pallas_forward
    except ImportError as err:
        if required:
            raise RuntimeError(f"backend='pallas' needs twell_jax.ops.pallas_forward, which failed to import: {err}") from err
        return None
    return pallas_forward


# "auto" decided at trace time (from the hint) that the whole call runs the dense backend.
_AUTO_DENSE = "auto_dense"


def _plan(gated: bool, backend: str, interpret: bool, config: SparseFFNConfig,
          shape: tuple[int, int, int, int]) -> _Plan | str | None:
    """The plan of a sparse backend, or None when the call runs the plain dense backend
    (_AUTO_DENSE: likewise, chosen by "auto" from its hint).
    shape = (tokens per shard, D, H, itemsize), for the training "auto" choice."""
    if backend == "dense":
        return None
    if backend == "reference":
        return _Plan(gated, "reference", "sparse", interpret)
    if backend == "pallas":
        module = _pallas_module(required=True)
        if not interpret and not module.available():
            raise RuntimeError(
                "backend='pallas' needs a GPU (pallas_forward.available() is False); pass "
                "interpret=True to run the kernels in the Pallas interpreter, or use "
                "backend='reference' or 'dense'")
        return _Plan(gated, "pallas", "pallas", interpret)
    module = _pallas_module(required=False)  # "auto"
    if module is None or not module.available():
        return None
    if config.expected_active_per_token is None:
        # No hint: the forward samples on the device and branches; the backward stays dense.
        return _Plan(gated, "pallas_auto", "dense", interpret)
    from twell_jax.ops import pallas_backward

    m, d_model, n_neurons, itemsize = shape
    from twell_jax.ops import pallas_decode

    if pallas_decode.prefer_decode_path(m, d_model, n_neurons, config.expected_active_per_token, gated,
                                         itemsize=itemsize, check_finite=config.check_finite):
        # Decode sizes (a few tokens per call): the work spread over the active neurons.
        return _Plan(gated, "decode", "dense", interpret)
    fwd_sparse, bwd_sparse = pallas_backward.choose_training_path(
        m, d_model, n_neurons, config.expected_active_per_token, gated, itemsize=itemsize,
        keep_pattern=(config.backward or pallas_backward.BackwardConfig()).keep_gate_pattern, config=config)
    if not (fwd_sparse or bwd_sparse):
        # The dense plan IS the "dense" backend (plain autodiff keeps its activations), unless the
        # config asks for the dense formula inside the custom_vjp, which recomputes them.
        return _Plan(gated, "dense", "dense", interpret) if config.auto_dense_recompute else _AUTO_DENSE
    return _Plan(gated, "pallas" if fwd_sparse else "dense", "pallas" if bwd_sparse else "dense",
                 interpret)


def auto_decision(gated: bool, config: SparseFFNConfig, shape: tuple[int, int, int, int],
                  interpret: bool = False) -> tuple[str, str]:
    """(forward, backward) that backend "auto" compiles for one call of `shape` = (tokens per shard,
    D, H, itemsize) under `config` (its `expected_active_per_token` hint included): `_plan`'s static
    outcome, ("dense", "dense") when the call runs the plain dense backend. The trainer compares
    these per layer to decide whether refreshed hints need a recompile."""
    plan = _plan(gated, "auto", interpret, config, shape)
    return ("dense", "dense") if plan is None or plan is _AUTO_DENSE else (plan.forward, plan.backward)


_HINT_FIELDS = ("expected_active_per_token", "expected_token_tail", "expected_hot_neurons", "expected_hot_entries")


def plan_key(gated: bool, backend: str, config: SparseFFNConfig | None, shape: tuple[int, int, int, int],
             interpret: bool = False) -> tuple[Any, ...]:
    """A hashable key of everything a call's traced computation depends on besides its arrays:
    two configs with equal keys at `shape` = (tokens of the whole call, D, H, itemsize) compile
    the same program. The hints (expected_active_per_token and the tail shares) only choose
    "auto"'s plan (and, for the decode path, its active-list capacity), so the key holds that
    choice instead of their values; the model scans the layers of equal keys together."""
    config = _validate_config(config)
    stripped = dataclasses.replace(config, **{name: None for name in _HINT_FIELDS})
    if backend != "auto":
        return (gated, backend, interpret, stripped)
    tokens, d_model, n_neurons, itemsize = shape
    n_shards = _data_axis_size(config)
    decision = auto_decision(gated, config, (-(-tokens // n_shards), d_model, n_neurons, itemsize), interpret)
    # The decode path sizes its active list from the hint: keep the hint itself in its key.
    decode_hint = config.expected_active_per_token if decision[0] == "decode" else None
    return (gated, backend, interpret, stripped, decision, decode_hint)


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
    if plan is _AUTO_DENSE:  # "auto" chose the dense path (as its device-side switch reports it)
        return dense_fallback_ffn(gated, x, w, neuron_counts=config.neuron_counts)
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
