"""Which way each layer's FFN runs in the decode kernels' one-token step (decode.sparse_ffn).

`layer_ways(model, config, batch, dtype)` names, per layer, "dense" (the fused dense products) or
one of the sparse FFN's decode ways (config.DECODE_SPARSE_FFN); `decode_engine` runs them. The row
bounds below are where "auto" changes way; the measurements behind them are on BENCHMARKS.md,
Decode (experiments/bench_decode_ffn_step.py, experiments/bench_inference.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from twell_jax import ops
from twell_jax.config import DecodeConfig
from twell_jax.ops import planner

if TYPE_CHECKING:  # pragma: no cover - typing only
    from twell_jax.model import Transformer

# Rows of a decode step up to which decode.sparse_ffn "auto" runs its sparse layers "packed"
# ("packed_down" up to PACKED_DOWN_MAX_ROWS): each column tile makes its own active neurons' values,
# so no program walks them all (as "tiles" and "fused" do) and the down kernel's steps are cheap.
# Every sparse layer at one row; at more, those whose expected union is within "packed"'s own limit
# (`union_limit`), with the device switch to the dense products above it. The gate's values
# epilogue runs its rows one after another (an unrolled loop), so its cost grows with the rows: at
# twice this many rows the packed layers' kernels saved less than their switch's short launches left
# in launch gaps, or took longer than the twin's, on trained checkpoints, so larger steps keep the
# other ways' plans.
PACKED_MAX_ROWS = 4

# Rows of a decode step up to which "auto" runs those layers "packed_down" (the gate's launch also
# adds each tile's neurons' W_down rows into a partial of its own, summed after a grid barrier with
# the residual: one launch a layer) rather than "packed" (a second launch walks every listed
# neuron's W_down row). Each row's partial is stored and summed, so its cost grows faster with the
# rows than "packed"'s: at PACKED_MAX_ROWS rows it was the slower at the unions trained checkpoints
# show there, so 3 and 4 rows keep "packed".
PACKED_DOWN_MAX_ROWS = 2


def union_limit(model: "Transformer", batch: int, way: str, itemsize: int) -> int:
    """The union of a step's rows' active neurons above which a sparse layer of this `way` runs
    the dense products (the device switch of a step of several rows): `planner.decode_union_limit`
    with the switch priced, "packed" and "packed_down" by "packed"'s own cost model."""
    return planner.decode_union_limit(batch, model.d_model, model.d_ff, gated=model.gated, itemsize=itemsize,
                                      device_switch=True,
                                      way="packed" if way in ("packed", "packed_down") else None)


def layer_ways(model: "Transformer", config: DecodeConfig, batch: int, dtype: Any) -> tuple[str, ...]:
    """Per layer, how a one-token decode step of `batch` rows runs its FFN: "dense" (the fused
    dense products) or the sparse kernels of decode.sparse_ffn, "auto" resolved per layer:
    "packed_down" at up to PACKED_DOWN_MAX_ROWS rows, "packed" at up to PACKED_MAX_ROWS, else by
    `planner.decode_sparse_way` from the layer's activity hint (one launch walking every active
    neuron: "tiles" where the gate's program holds every row, else "fused"; or "split"). "tiles",
    "packed" and "packed_down" need every row in one program of the gate and run "fused" for more
    rows. At more than one row (backend "auto") a sparse layer runs "dense" where its way's union
    limit (`union_limit`) is 0 or below the union expected from its hint."""
    if not model.through_op:  # the dense formula (SwiGLU): no sparse op, no sparse decode
        return ("dense",) * model.n_layers
    # Imported here, as the op imports its kernels: importing the library does not load Triton.
    from twell_jax.pallas_kernels.decode_matvec import gate_role, role_block_sizes

    tiles_fit = batch <= role_block_sizes(gate_role(batch), batch).block_m(batch)  # every row in one gate program

    def way(op_config: Any) -> str:
        if config.sparse_ffn == "auto":
            if batch <= PACKED_MAX_ROWS:  # each tile makes its own neurons' values (up to
                # PACKED_DOWN_MAX_ROWS rows also their down product, in the same launch)
                return "packed_down" if batch <= PACKED_DOWN_MAX_ROWS else "packed"
            expected = None if op_config is None else op_config.expected_active_per_token
            chosen = planner.decode_sparse_way(batch, expected, model.d_ff)
            # One launch walking every active neuron: from the gate's tile lists where they hold the
            # rows (no compaction launch: one launch fewer a layer).
            return "tiles" if chosen == "fused" and tiles_fit else chosen
        if config.sparse_ffn in ("tiles", "packed", "packed_down") and not tiles_fit:
            return "fused"
        return config.sparse_ffn

    itemsize = jnp.dtype(dtype).itemsize
    ways = tuple(way(op_config) for op_config in model.op_configs)

    # Several rows: the step's device-side switch costs the sparse side its own launches, and above
    # its union limit the dense side reads the gate's weights a second time. "auto" plans a
    # layer's dense products statically (the twin's: never slower) where the cost model of its
    # way finds no union that pays for the switch, or where the union expected from the layer's
    # hint is above that limit (the switch would fall back on most steps).
    def sparse(op_config: Any, chosen: str) -> bool:
        if not ops.decode_forward_is_sparse(model.gated, model.backend, op_config, batch, model.d_model, model.d_ff,
                                            itemsize, model.interpret):
            return False
        if batch == 1 or model.backend != "auto":
            return True
        limit = union_limit(model, batch, chosen, itemsize)
        expected = None if op_config is None else op_config.expected_active_per_token
        return limit > 0 and (expected is None or planner.expected_union(batch, expected, model.d_ff) <= limit)

    return tuple(chosen if sparse(op_config, chosen) else "dense" for op_config, chosen in zip(model.op_configs, ways))


def layer_sparse(model: "Transformer", config: DecodeConfig, batch: int, dtype: Any) -> tuple[bool, ...]:
    """Per layer, whether a one-token decode step of `batch` rows runs the sparse FFN's decode
    kernels (its op plan is a sparse forward) or the fused dense products."""
    return tuple(way != "dense" for way in layer_ways(model, config, batch, dtype))
