"""`Implementation`: one implementation of the sparse FFN op, as the registry (`backends`) holds it."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from twell_jax.ops.config import Aux, SparseFFNConfig, Weights

# forward(gated, x_MxD, weights, config, interpret, keep) -> (y, aux, residual). keep: the
# implementation's own backward follows, so keep what it wants (residual) and report its tails in
# aux; otherwise residual is None. An implementation with `folds_non_finite` also takes the
# keyword `non_finite` (see there).
Forward = Callable[..., tuple[jax.Array, Aux, Any]]
# backward(gated, x_MxD, weights, gy_MxD, gl1, config, interpret, residual, non_finite) -> (dx,
# weight gradients); non_finite: the op's NaN/Inf flag (None when config.check_finite is off): on
# it the backward must run the exact dense formula.
Backward = Callable[..., tuple[jax.Array, Weights]]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of the sparse FFN op."""

    name: str
    forward: Forward
    # None: the dense formula's backward (`dense.dense_backward`) follows its forward.
    backward: Backward | None
    # Why it cannot run here (None: it can), given the call's `interpret` flag.
    unavailable: Callable[[bool], str | None]
    # Modelled (forward, backward) ms for shape = (M, D, H, itemsize), a config and gated (None:
    # not modelled). Informational (benchmarks, tests): `planner.auto_plan` does not read it; "auto"
    # plans only the built-in "pallas", "decode" and "dense" from planner's own cost models (which
    # the built-ins' cost functions call), so a registered implementation runs only when named.
    cost: Callable[[tuple[int, int, int, int], SparseFFNConfig, bool], tuple[float, float]] | None = None
    # Its forward is the dense formula (the NaN policy's fallback would be the same computation).
    dense_formula: bool = False
    # Its backward has dense tails that its own forward reports in aux (-1 after another forward).
    reports_tails: bool = False
    # Its forward takes `non_finite=` (the op's NaN/Inf flag, a bool scalar) and returns, when it
    # is set, the dense formula's y and aux (aux["dense_fallback"] = 1) from a branch it has
    # anyway; the op then puts no lax.cond of its own around it (each device-side branch makes
    # the host wait for the GPU before it can queue the work after it).
    folds_non_finite: bool = False
    # A value of gated_ffn's `backend=` (the decode path is planned by "auto" only).
    selectable: bool = True


def runs_anywhere(interpret: bool) -> str | None:
    """`Implementation.unavailable` of a plain-JAX implementation."""
    return None
