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
        "backward_tail_rows": int32, the token rows the sparse backward handles densely (more
                          actives than config.ell_width, or an overflowing tile)
        "backward_hot_neurons": int32, the neurons the sparse backward handles densely (more
                          entries than config.hot_threshold(M) over the other rows)
                          Both 0 where the backward is dense (no tails), -1 where the forward
                          built no pattern to count them on (the "pallas" backward after a
                          dense forward, a plan of training "auto"); summed over data shards.
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

Backends: the registry of implementations (`backends`; each one `Implementation` object with its
forward, backward, where it runs and its cost; `backends.register` adds one, `backend_names()`
lists the values of `backend=`):
    "dense"      `dense_ffn`, the one copy of the dense formula (also every fallback, the Pallas
                 glue's dense branch and the model's dense kinds): compute-dtype GEMMs with f32
                 accumulation, f32 gating product, aux from the x-dtype h; plain JAX autodiff.
    "reference"  the sparse algorithm in pure JAX (TwELL pack of the gate, SDDMM for the up
                 activations on the gate pattern, hybrid ELL+tail SpMM for the down projection);
                 backward: the sparse hybrid backward below. A `jax.custom_vjp`.
    "pallas"     forward by the Pallas kernels (`twell_jax.ops.pallas_forward`, imported lazily),
                 backward by the Pallas backward kernels (`twell_jax.ops.pallas_backward`: the
                 forward keeps its TwELL pack for it). Needs a GPU unless interpret=True.
    "auto"       the planner (`twell_jax.ops.planner`, its cost models keyed by device kind): on a
                 GPU with config.expected_active_per_token set, per layer, forward and backward
                 each sparse (Pallas) or dense from the training cost model (which also prices the
                 backward's dense tails when the config has the tail hints: `backward_tail_shares`
                 estimates them from telemetry), decided at trace time (at decode sizes, a few
                 tokens per call, the forward spread over the active neurons: the "decode"
                 implementation, `twell_jax.ops.pallas_decode`); on a GPU without the hint: dense
                 or sparse decided first, outside the custom_vjp, by a lax.cond on a sampled active
                 count (`planner.use_sparse_forward`): dense = the "dense" backend exactly, sparse =
                 the Pallas forward + the exact dense backward; elsewhere: "dense".
`auto_decision` names the implementations "auto" plans for a call; `plan_key` gives a hashable key
of the traced computation (equal keys: layers that can share one program).

The backward's dense tails follow ONE rule, `TailPolicy` (twell_jax/ops/tails.py), used by the
reference and Pallas backwards, the telemetry estimate and the cost model.

The reference and dense backwards keep only (x, weights) as residuals and recompute what they
need; the Pallas backward also keeps the forward's TwELL pack unless
`pallas_config.BackwardConfig.keep_gate_pattern` is False (`SparseFFNConfig.backward`).

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
path otherwise avoids: `SparseFFNConfig(check_finite=False)` drops it (and its conds) for weights
verified finite once (`inference.load_run` does); the sparse paths then read only the rows of
active neurons, and a non-finite value elsewhere does not reach y (docs/format.md).

Under a mesh (`jax.set_mesh`) with any of the `config.data_axis` axes (default "data" and "fsdp",
the trainer's) of size > 1, the sparse backends run inside `jax.shard_map` over those axes (tokens
split, weights whole on every device: FSDP-split weights are all-gathered as they enter, aux reduced
to global scalars), because Pallas calls are not partitioned by XLA. Tokens are zero-padded to a
multiple of the shard count (a zero token activates nothing).

Limits: indices are int32, so H and the token count per call are only bounded by memory. The
reference backend is a correctness oracle, not a fast path: it computes the gate densely.

Files (one job each): `config.py` SparseFFNConfig and the aux keys; `implementation.py` and
`backends.py` the Implementation type and the registry; `planner.py` "auto" and the cost models;
`tails.py` the tail rule; `dense.py` the dense formula and its aux (the only copy); `reference.py`
the pure-JAX sparse forward and backward; `dispatch.py` validation, the custom_vjp, shard_map,
`gated_ffn` / `ffn`; `format.py` and `hybrid.py` the formats; `pallas.py` the Pallas
implementations, whose glue `pallas_forward.py`, `pallas_backward.py` (+ `pallas_config.py`, its
knobs), `pallas_decode.py` is imported lazily (the kernels need Triton-capable jax builds).
"""
from __future__ import annotations

from twell_jax.ops.config import (AUX_KEYS, COUNT_KEYS, TAIL_HINT_FIELDS, TAIL_SHARE_KEYS, Aux, SparseFFNConfig,
                                  Weights)
from twell_jax.ops.dense import (DENSE_ACTIVATIONS, dense_aux, dense_backward, dense_fallback_ffn, dense_ffn,
                                 dense_hidden)
from twell_jax.ops.backends import backend_names, register
from twell_jax.ops.dispatch import (BACKENDS, RESIDUAL_NAME, SHARD_COMBINE, auto_decision, backward_tail_shares,
                                    combine_over_shards, decode_forward_is_sparse, ffn, gated_ffn, plan_key)
from twell_jax.ops.implementation import Implementation
from twell_jax.ops.reference import reference_backward, reference_forward
from twell_jax.ops.tails import TailPolicy

__all__ = ["AUX_KEYS", "BACKENDS", "COUNT_KEYS", "DENSE_ACTIVATIONS", "TAIL_HINT_FIELDS", "TAIL_SHARE_KEYS", "Aux",
           "Implementation", "RESIDUAL_NAME", "SHARD_COMBINE", "SparseFFNConfig", "TailPolicy", "Weights", "auto_decision", "backend_names", "decode_forward_is_sparse",
           "backward_tail_shares", "combine_over_shards", "dense_aux", "dense_backward", "dense_fallback_ffn", "dense_ffn", "dense_hidden",
           "ffn", "gated_ffn", "plan_key", "reference_backward", "reference_forward", "register"]
