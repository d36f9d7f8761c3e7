"""How a call runs: validation, the plan (`planner`), the custom_vjp (any registered forward with
any registered backward, `backends`; the NaN policy's dense fallback), the shard_map wrapper, and
the public `gated_ffn` / `ffn` (the contract is in twell_jax/ops/__init__.py). Nothing here
switches on an implementation's name: a plan names registry entries and their objects run."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from twell_jax.ops import backends, planner
from twell_jax.ops.config import AUX_KEYS, COUNT_KEYS, Aux, SparseFFNConfig, Weights
from twell_jax.ops.dense import dense_backward, dense_fallback_ffn, dense_ffn
from twell_jax.ops.implementation import Implementation
from twell_jax.ops.planner import Plan
from twell_jax.ops.tails import TailPolicy

# The backend names of the built-in implementations (`backends.backend_names()` also lists any
# registered later).
BACKENDS = backends.backend_names()
# The checkpoint_name of the residuals the sparse op's custom_vjp keeps for its backward.
RESIDUAL_NAME = "twell_op_residual"


# ----------------------------------------------------------------------------------------------
# custom_vjp: any registered forward, with any registered backward
# ----------------------------------------------------------------------------------------------

def _implementations(plan: Plan) -> tuple[Implementation, Implementation]:
    return backends.get(plan.forward), backends.get(plan.backward)


def _run_sparse_forward(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights,
                        non_finite: jax.Array | None = None) -> tuple[jax.Array, Aux, Any]:
    """The plan's forward, assuming finite inputs unless it folds the NaN/Inf flag (`non_finite`
    given: see `_with_dense_fallback`): (y, aux, the residual its backward keeps). A forward whose
    backward is another implementation with dense tails reports them as -1 (it builds no pattern
    to count them on)."""
    fwd, bwd = _implementations(plan)
    keep = fwd is bwd
    flag = {} if non_finite is None else dict(non_finite=non_finite)
    y, aux, residual = fwd.forward(plan.gated, x_MxD, weights, config, plan.interpret, keep, **flag)
    if bwd.reports_tails and not keep:
        unknown = jnp.full((), 0 if x_MxD.shape[0] == 0 else -1, jnp.int32)
        aux = {**aux, "backward_tail_rows": unknown, "backward_hot_neurons": unknown}
    return y, {key: aux[key] for key in _aux_keys(config)}, residual


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


def _with_dense_fallback(non_finite: jax.Array, plan: Plan, config: SparseFFNConfig,
                         x_MxD: jax.Array, weights: Weights,
                         sparse: Callable[[jax.Array | None], Any]) -> Any:
    """`sparse(None)` (whose first two outputs are (y, aux)), or the exact dense forward when
    `non_finite`; the dense branch fills any further outputs (the residual the backward keeps,
    e.g. the Pallas pattern) with zeros. No cond when the check is off, when the plan's forward is
    the dense formula already (both branches would be the same dense forward; `non_finite` still
    sends the backward to the dense formula), or when the forward folds the flag into a branch of
    its own (`Implementation.folds_non_finite`: `sparse(non_finite)`)."""
    fwd = backends.get(plan.forward)
    if not config.check_finite or fwd.dense_formula:
        return sparse(None)
    if fwd.folds_non_finite:
        return sparse(non_finite)
    gated = plan.gated
    shapes = jax.eval_shape(lambda: sparse(None))

    def dense() -> Any:
        y, aux = dense_fallback_ffn(gated, x_MxD, weights, neuron_counts=config.neuron_counts)
        out = (y, {key: aux[key].astype(shapes[1][key].dtype) for key in shapes[1]})
        rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tuple(shapes[2:]))
        return _same_variance(non_finite, out + rest)

    return jax.lax.cond(non_finite, dense, lambda: _same_variance(non_finite, sparse(None)))


def _run_forward(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array,
                 weights: Weights) -> tuple[jax.Array, Aux, Any]:
    """The plan's forward; the exact dense forward when an input or weight is not finite. Nothing
    is differentiated here, so no residual leaves the branch (None in its place)."""
    def sparse(flag: jax.Array | None) -> tuple[jax.Array, Aux, None]:
        y, aux, _ = _run_sparse_forward(plan, config, x_MxD, weights, flag)
        return y, aux, None

    return _with_dense_fallback(_non_finite(config, x_MxD, weights), plan, config, x_MxD, weights, sparse)


def _aux_keys(config: SparseFFNConfig) -> tuple[str, ...]:
    return AUX_KEYS + COUNT_KEYS if config.neuron_counts else AUX_KEYS


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sparse_op(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array,
               weights: Weights) -> tuple[jax.Array, Aux]:
    y, aux, _ = _run_forward(plan, config, x_MxD, weights)
    return y, aux


def _sparse_op_fwd(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights
                   ) -> tuple[tuple[jax.Array, Aux], tuple[Any, ...]]:
    # Residuals: (x, weights, non_finite, what the backward keeps); the flag, computed once here,
    # also sends the backward to the dense formula. Named RESIDUAL_NAME, so that a caller's remat
    # policy can keep them (the model's layer scan does) instead of rerunning this forward.
    non_finite = _non_finite(config, x_MxD, weights)
    y, aux, residual = _with_dense_fallback(
        non_finite, plan, config, x_MxD, weights,
        lambda flag: _run_sparse_forward(plan, config, x_MxD, weights, flag))
    return (y, aux), checkpoint_name((x_MxD, weights, non_finite, residual), RESIDUAL_NAME)


def _sparse_op_bwd(plan: Plan, config: SparseFFNConfig, residuals: tuple[Any, ...],
                   cotangents: tuple[jax.Array, Aux]) -> tuple[jax.Array, Weights]:
    x_MxD, weights, non_finite, residual = residuals
    # The backward recomputes what it needs from (x, weights); without the barrier XLA's CSE merges
    # a recomputed GEMM with the forward's identical one and keeps its [M, H] output alive after
    # all (what jax.checkpoint prevents the same way).
    x_MxD, weights = jax.lax.optimization_barrier((x_MxD, weights))
    gy_MxD, g_aux = cotangents
    gl1 = jnp.asarray(g_aux["l1"], jnp.float32)  # l0 and the counters are not differentiable
    backward = backends.get(plan.backward).backward
    if backward is None:  # the dense formula's backward: exact on any input
        return dense_backward(plan.gated, x_MxD, weights, gy_MxD, gl1)
    return backward(plan.gated, x_MxD, weights, gy_MxD, gl1, config, plan.interpret, residual,
                    non_finite if config.check_finite else None)


_sparse_op.defvjp(_sparse_op_fwd, _sparse_op_bwd)


def _op_body(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array,
             weights: Weights) -> tuple[jax.Array, Aux]:
    """One call on local tokens. A sampled plan ("auto" without a hint) decides dense vs sparse
    OUTSIDE the custom_vjp: its dense branch is the plain dense formula under autodiff (exactly the
    "dense" backend, which keeps its activations for the backward), its sparse branch the plan
    (the Pallas forward with the dense backward recomputing from (x, weights)). A model that is
    not sparse yet (initialisation) thus trains at the dense speed instead of paying the
    backward's recompute."""
    if not plan.sampled:
        return _sparse_op(plan, config, x_MxD, weights)
    sparse_plan = dataclasses.replace(plan, sampled=False)

    def sparse() -> tuple[jax.Array, Aux]:
        return _sparse_op(sparse_plan, config, x_MxD, weights)

    def dense() -> tuple[jax.Array, Aux]:
        # "auto" chose the dense path
        return dense_fallback_ffn(plan.gated, x_MxD, weights, neuron_counts=config.neuron_counts)

    use_sparse = planner.use_sparse_forward(plan.gated, x_MxD, weights[0], config)
    if isinstance(use_sparse, bool):  # decided at trace time: only that path is compiled
        return sparse() if use_sparse else dense()
    return jax.lax.cond(use_sparse, sparse, dense)


# ----------------------------------------------------------------------------------------------
# Dispatch: validation, backend choice, shard_map
# ----------------------------------------------------------------------------------------------

def _token_axes(config: SparseFFNConfig) -> tuple[str, ...]:
    """The axes of the current mesh that split this call's tokens: those `config.data_axis` names,
    in the mesh's order (so that P(axes) is the batch's own layout and nothing moves), leaving out
    axes of size 1 and Manual ones (the caller is already inside a shard_map over them: x is local)."""
    names = set(config.data_axes)
    mesh = jax.sharding.get_abstract_mesh()
    if not names or mesh.empty:
        return ()
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return tuple(axis for axis in mesh.axis_names
                 if axis in names and types[axis] != AxisType.Manual and int(mesh.shape[axis]) > 1)


def _data_axis_size(config: SparseFFNConfig) -> int:
    """How many shards the call's tokens are split into (1: no shard_map)."""
    return math.prod(int(jax.sharding.get_abstract_mesh().shape[axis]) for axis in _token_axes(config))


def backward_tail_shares(token_active_count: jax.Array, neuron_active_count: jax.Array,
                         config: SparseFFNConfig | None) -> dict[str, jax.Array]:
    """Estimates of the sparse backward's dense tails, as the tail hints of SparseFFNConfig want
    them, from the counts any backend adds to aux with `neuron_counts` (so also after a dense
    forward, which builds no pattern): `TailPolicy.shares` with the call's data shards."""
    config = config or SparseFFNConfig()
    return TailPolicy(config).shares(token_active_count, neuron_active_count, _data_axis_size(config))


# How each aux value of one token shard combines with the other shards' (`combine_over_shards`):
# "mean" a per-token mean (weighted by the shard's tokens), "sum" a count, "any" a 0/1 flag, and
# "sum_known" a count where -1 means "not counted" (any shard's -1 wins).
SHARD_COMBINE = {"l1": "mean", "l0": "mean", "tile_overflow": "sum", "row_overflow": "sum",
                 "dense_fallback": "any", "backward_tail_rows": "sum_known", "backward_hot_neurons": "sum_known",
                 "neuron_active_count": "sum"}


def combine_over_shards(how: str, value: jax.Array, axis: Any, weight: Any = None) -> jax.Array:
    """`value` of one shard combined over the shards of mesh axis (or axes) `axis`, as `how`
    (SHARD_COMBINE's kinds); inside a shard_map. `weight` (for "mean"): this shard's share of
    all the tokens (default: equal shares)."""
    if how == "mean":
        return jax.lax.pmean(value, axis) if weight is None else jax.lax.psum(value * weight, axis)
    if how == "sum":
        return jax.lax.psum(value, axis)
    if how == "any":  # psum + clip rather than pmax: pmax has no JVP rule, even for integers
        return jnp.minimum(jax.lax.psum(value, axis), 1)
    if how == "sum_known":
        unknown = jax.lax.psum((value < 0).astype(jnp.int32), axis) > 0
        return jnp.where(unknown, -1, jax.lax.psum(jnp.maximum(value, 0), axis))
    raise ValueError(f"how must be one of mean, sum, any, sum_known; got {how!r}")


def _sharded_call(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights,
                  n_shards: int) -> tuple[jax.Array, Aux]:
    """The op inside shard_map over the token axes (`_token_axes`): tokens split, weights whole on
    every device (weights sharded by FSDP are all-gathered as they enter, one layer's at a time)."""
    axis = _token_axes(config)  # psum and PartitionSpec take the tuple of axes as one
    n_tokens = x_MxD.shape[0]
    pad = (-n_tokens) % n_shards
    x_pad = jnp.pad(x_MxD, ((0, pad), (0, 0)))

    def local(x_loc: jax.Array, weights_loc: Weights) -> tuple[jax.Array, Aux]:
        # The weights are replicated (spec P()): shard_map's transpose sums the per-shard weight
        # gradients over the axis, so the custom_vjp returns local gradients only.
        y, aux = _op_body(plan, config, x_loc, weights_loc)
        # Padded tokens are zero: they add nothing to l1/l0 sums, so the means weigh each shard by
        # its tokens over the true count (a zero token activates nothing: no count needs correcting).
        share = x_loc.shape[0] / n_tokens
        global_aux = {key: combine_over_shards(SHARD_COMBINE[key], aux[key], axis, share)
                      for key in AUX_KEYS}
        if config.neuron_counts:
            global_aux["neuron_active_count"] = combine_over_shards("sum", aux["neuron_active_count"], axis)
            global_aux["token_active_count"] = aux["token_active_count"]
        return y, global_aux

    aux_specs = {key: PartitionSpec() for key in AUX_KEYS}
    if config.neuron_counts:
        aux_specs.update(neuron_active_count=PartitionSpec(), token_active_count=PartitionSpec(axis))
    # check_vma=False: a pallas_call inside shard_map needs per-output variance annotations whose
    # spelling differs between JAX 0.10 and 0.11; the specs here are simple enough to state.
    sharded = jax.shard_map(local, in_specs=(PartitionSpec(axis), PartitionSpec()),
                            out_specs=(PartitionSpec(axis), aux_specs), axis_names=set(axis),
                            check_vma=False)
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    explicit = any(types[name] == AxisType.Explicit for name in axis)
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
def _sparse_call(plan: Plan, config: SparseFFNConfig, x_MxD: jax.Array, weights: Weights,
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


def _validate_choice(backend: Any, interpret: Any) -> None:
    names = backends.backend_names()
    if backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")


def _validate(x: jax.Array, weights: dict[str, jax.Array], backend: str, config: Any,
              interpret: Any) -> SparseFFNConfig:
    _validate_choice(backend, interpret)
    config = _validate_config(config)
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


def _plan(gated: bool, backend: str, interpret: bool, config: SparseFFNConfig,
          shape: tuple[int, int, int, int], check_runnable: bool = True) -> Plan | str | None:
    """The plan of a call, or None when it runs the plain dense backend (planner.AUTO_DENSE:
    likewise, chosen by "auto" from its hint). shape = (tokens per shard, D, H, itemsize).
    check_runnable: raise when the chosen backend cannot run here (its `unavailable` reason)."""
    if backend == "auto":
        return planner.auto_plan(gated, interpret, config, shape, backends.gpu_available())
    implementation = backends.get(backend)
    if implementation.backward is None and implementation.dense_formula:
        return None  # the "dense" backend: plain autodiff of the dense formula
    reason = implementation.unavailable(interpret) if check_runnable else None
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} {reason}")
    return Plan(gated, backend, backend if implementation.backward is not None else "dense", interpret)


def auto_decision(gated: bool, config: SparseFFNConfig, shape: tuple[int, int, int, int],
                  interpret: bool = False) -> tuple[str, str]:
    """(forward, backward) that backend "auto" compiles for one call of `shape` = (tokens per shard,
    D, H, itemsize) under `config` (its `expected_active_per_token` hint included): the plan's
    implementation names, ("dense", "dense") when the call runs the plain dense backend. The
    trainer compares these per layer to decide whether refreshed hints need a recompile."""
    plan = _plan(gated, "auto", interpret, config, shape)
    return ("dense", "dense") if plan is None or plan is planner.AUTO_DENSE else (plan.forward, plan.backward)


def decode_forward_is_sparse(gated: bool, backend: str, config: SparseFFNConfig | None, m: int, d_model: int,
                             n_neurons: int, itemsize: int, interpret: bool = False) -> bool:
    """Whether a call of `m` tokens runs a sparse forward (planned "decode" or "pallas"), or the
    dense formula: the model's decode kernels (twell_jax/inference/decode_engine.py) run the
    decode path's sparse kernels for the former and their fused dense products for the latter."""
    _validate_choice(backend, interpret)
    config = _validate_config(config)
    plan = _plan(gated, backend, interpret, config, (m, d_model, n_neurons, itemsize), check_runnable=False)
    return isinstance(plan, Plan) and plan.forward in ("decode", "pallas")


def plan_key(gated: bool, backend: str, config: SparseFFNConfig | None, shape: tuple[int, int, int, int],
             interpret: bool = False) -> Hashable:
    """A hashable key of the computation a call traces besides its arrays: two configs with equal
    keys at `shape` = (tokens of the whole call, D, H, itemsize) compile the same program, so
    layers whose keys are equal can share one (the model scans them together).

    The key is the plan (which implementations run, or the plain dense backend; planned for the
    tokens per data shard, as the call plans) with the per-shard shape and the config less the
    fields only the planner reads (`planner.PLANNER_ONLY_FIELDS`: the hints and
    auto_dense_recompute, whose effect the plan holds); every other field (block sizes,
    capacities, decode_capacity, check_finite, neuron_counts, ...) is part of it. To run a group
    of layers with equal keys as one program, call the op with the ORIGINAL config of any one of
    them: it plans the same."""
    _validate_choice(backend, interpret)
    config = _validate_config(config)
    tokens, d_model, n_neurons, itemsize = shape
    local = (-(-tokens // _data_axis_size(config)), d_model, n_neurons, itemsize)
    # No check that the backend can run here: a key is a pure function of its arguments; the call
    # itself reports a backend that cannot run.
    plan = _plan(gated, backend, interpret, config, local, check_runnable=False)
    return planner.key_of(plan, config, local)


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
    if plan is planner.AUTO_DENSE:  # "auto" chose the dense path (as its device-side switch reports it)
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
