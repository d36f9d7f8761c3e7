"""The Pallas implementations of the op for the registry (`backends`): "pallas" (forward by
pallas_forward, backward by pallas_backward) and "decode" (pallas_decode, planned by "auto" only).
The kernels' glue is imported when an implementation first runs: the kernels need a jax build with
Triton-backed Pallas."""
from __future__ import annotations

import functools
from typing import Any

import jax

from twell_jax.ops import planner
from twell_jax.ops.config import Aux, SparseFFNConfig, Weights
from twell_jax.ops.implementation import Implementation


def _unavailable(interpret: bool) -> str | None:
    try:
        from twell_jax.ops import pallas_forward
    except ImportError as err:  # a jax build without Triton-backed Pallas: say so, even with interpret
        return f"needs twell_jax.ops.pallas_forward, which failed to import: {err}"
    if interpret or pallas_forward.available():
        return None
    return ("needs a GPU (pallas_forward.available() is False); pass interpret=True to run the "
            "kernels in the Pallas interpreter, or use backend='reference' or 'dense'")


def _pallas_forward(gated: bool, x_MxD: jax.Array, weights: Weights, config: SparseFFNConfig,
                    interpret: bool, keep: bool, non_finite: jax.Array | None = None
                    ) -> tuple[jax.Array, Aux, Any]:
    """keep (the Pallas backward follows): the training forward, which keeps the pattern and
    reports the backward's tails; else pack + fused FFN alone (a dense backward follows).
    non_finite: the op's NaN/Inf flag, folded into the forward's own overflow branch (its dense
    arm runs on it), so the op needs no cond around the kernels."""
    if keep:
        from twell_jax.ops import pallas_backward

        return pallas_backward.forward(gated, x_MxD, weights, config, interpret, non_finite=non_finite)
    from twell_jax.ops import pallas_forward

    fn = pallas_forward.gated_ffn_forward if gated else pallas_forward.ffn_forward
    y, aux = fn(x_MxD, *weights, config, interpret=interpret, non_finite=non_finite)
    return y, aux, None


def _pallas_backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array, gl1: jax.Array,
                     config: SparseFFNConfig, interpret: bool, residual: Any,
                     non_finite: jax.Array | None) -> tuple[jax.Array, Weights]:
    """The Pallas backward. Its dense branch (a tail over its capacity, a non-finite input; never
    run when the kernels can) runs in row blocks, so its temporaries do not set the program's
    memory (pallas_backward.blocked_dense_backward). The NaN/Inf flag joins the backward's own
    branch (one predicate, not two). On such inputs the pieces before that branch read a zero
    pack (what the forward's dense fallback kept) or one rebuilt from the non-finite x (a dense
    forward keeps none): index work only, harmless, and the branch then runs the dense formula."""
    from twell_jax.ops import pallas_backward

    rows = (config.backward or pallas_backward.BackwardConfig()).dense_block_rows
    dense_bwd = functools.partial(pallas_backward.blocked_dense_backward, gated, x_MxD, weights, gy_MxD,
                                  gl1, rows)
    return pallas_backward.backward(gated, x_MxD, weights, gy_MxD, gl1, config, interpret, residual,
                                    dense_bwd, non_finite=non_finite)


def _pallas_cost(shape: tuple[int, int, int, int], config: SparseFFNConfig, gated: bool) -> tuple[float, float]:
    m, d, h, itemsize = shape
    k = config.expected_active_per_token
    return planner.sparse_times_ms(m, d, h, 0.0 if k is None else k, gated, itemsize=itemsize,
                                   keep_pattern=config.keeps_gate_pattern, config=config)


def _decode_forward(gated: bool, x_MxD: jax.Array, weights: Weights, config: SparseFFNConfig,
                    interpret: bool, keep: bool) -> tuple[jax.Array, Aux, None]:
    from twell_jax.ops import pallas_decode

    fn = pallas_decode.decode_gated_ffn_forward if gated else pallas_decode.decode_ffn_forward
    y, aux = fn(x_MxD, *weights, config=config, interpret=interpret)
    return y, aux, None


def _decode_cost(shape: tuple[int, int, int, int], config: SparseFFNConfig, gated: bool) -> tuple[float, float]:
    m, d, h, itemsize = shape
    k = config.expected_active_per_token
    fwd_us = planner.decode_time_us(m, d, h, 0.0 if k is None else k, gated=gated, itemsize=itemsize)
    return fwd_us / 1e3, planner.dense_times_ms(m, d, h, gated)[1]


PALLAS = Implementation("pallas", _pallas_forward, _pallas_backward, _unavailable, cost=_pallas_cost,
                        reports_tails=True, folds_non_finite=True)
DECODE = Implementation("decode", _decode_forward, None, _unavailable, cost=_decode_cost, selectable=False)
