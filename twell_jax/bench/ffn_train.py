"""Benchmark of the FFN block's forward + backward (gradients of x and the 3 weights) per backend.

    PYTHONUNBUFFERED=1 python experiments/bench_ffn_train.py [--quick] [--out DIR]
    PYTHONUNBUFFERED=1 python experiments/bench_ffn_train.py --checkpoint RUN [--step N] [--layers 0,3,7]
    python experiments/bench_ffn_train.py --dry-run --out /tmp/b   # CPU, interpret, tiny shapes
    python experiments/bench_ffn_train.py --dry-run --checkpoint RUN --out /tmp/b   # the same, a tiny run
    PYTHONUNBUFFERED=1 python experiments/bench_ffn_train.py --quick --trace --sweep-blocks --repeats 5
    PYTHONUNBUFFERED=1 python experiments/bench_ffn_train.py --quick --shape trained   # + the trained-like pattern

Two sources of (x, weights), measured by the same functions (`measure`):
- synthetic (default): bf16, D 2048, H 5632, the sparsity of experiments/bench_ffn.py at k = 29, 39,
  16, 56, 110 active per token (SYNTHETIC_K), M = 16384 / 2048 / 65536 (3 input sets rotated while
  timing; --quick: M 16384 only); with --shape, also the trained-like pattern (bench/patterns.py:
  skewed neurons, denser first tokens; 'trained' = patterns.TRAINED_LIKE, or a --checkpoint run's
  results, whose median fit it takes) at M 16384 and k 29, 39 (SHAPED_K);
- `--checkpoint RUN`: a trained run (`inference.load_run`, compute dtype --dtype), fed the first
  --micro-batch sequences of its validation split; the model's own forward records what each
  chosen layer's FeedForward receives (the normed activations x [M, D], `capture_ffn_inputs`), and
  each layer is measured on its real x and its three weights. The cotangent gy is a fixed random
  [M, D] (as in the synthetic mode): the sparse backward's work (which rows go to the token tail,
  which neurons are hot, how many entries each kernel visits) is set by the forward's pattern,
  i.e. by x and W_gate, not by gy's values. Each layer's pattern shape is fitted
  (patterns.fit_shape: neuron skew, dead share, position profile) and the layers' median written
  as "shape_fit" (what --shape RESULTS takes).

Backends, all in the same process on the same inputs:
    xla_bf16          plain jnp, bf16 dots, no preferred_element_type (the dense baseline)
    dense             ops.gated_ffn(backend="dense")
    reference         backend="reference" (synthetic mode, M <= 16384 only: it materialises [M, H] f32)
    pallas            backend="pallas": Pallas forward + Pallas backward, pack kept
    pallas_recompute  the same with BackwardConfig(keep_gate_pattern=False)
    auto              backend="auto" with expected_active_per_token = the measured mean active count
                      and the tail hints = the measured token-tail, hot-neuron and hot-entry shares
Each is first checked against xla_bf16 (max abs error per gradient, and relative error), then
timed (interleaved medians, bench_ffn.bench_interleaved); the compiled temporary memory of each
(`memory_analysis()` of the program that is timed), and the time of each piece of the Pallas
path: pack, fused FFN (alone, and with the rank-order a and u the training forward keeps), token
tail mask (the backward's, on the kept int16 counts), token-major lists + kernel (on the kept u, and
computing u as the backward that recomputes the pattern does), transpose (its first pass as the
training forward runs it on the pack's pattern, its second as the backward runs it on the kept
one), neuron-major kernel, one 64-row block of the dense token tail, and the dense tails as the
backward takes them on this pattern (token tail: ceil(rows / chunk) blocks; neuron tail: the hot
neurons' blocks), each tail checked against xla_bf16's gradients on its rows. The pieces call the
kernels through the op's own calls (pallas_backward.transpose_histograms, transpose_lists,
token_major, neuron_major) on what the op gives them: the pattern the training forward keeps
(uint8 offsets inside the tile, int16 counts) read as stored, the transpose's and the token-major
kernel's outputs with their padding, with tails the hot neurons left out and f32 inits (zeros
made outside the timed calls); the neuron-major kernel orders its launch itself
(longest_first_order). The forward's narrowing of the pattern to its kept form is in no piece.
Beside the times: the pattern statistics
(`pattern_stats`: active per token, tail rows, per-neuron entry counts, hot neurons, the tails'
sizes and whether a capacity is exceeded, i.e. the whole call falls back to the dense backward)
and the cost model's prediction at the measured mean k and tails (`model_prediction`:
planner.sparse_times_ms / dense_times_ms and auto's plan, ops.auto_decision). The forward alone
of FORWARD_BACKENDS, timed the same way: as a training step runs it (the vjp's forward, with the
residuals the backward keeps: "fwd_ms") and as inference runs it (y and l1: "infer_ms"). Prints a
short table last; writes bench_ffn_train.json (and table.txt) to --out. Synthetic mode: the GPU's
bounds first (bench/bounds.py: a row-gather probe from one and two weight tables, HBM streaming,
XLA's relu GEMM), and per case each piece's time against the time its bytes need at them
("attainment").

--trace (both modes): the per-kernel GPU time of the xla_bf16, pallas and auto programs that were
timed (one jax.profiler trace of --repeats back-to-back calls each, twell_jax/bench/kernel_trace.py):
each kernel's launches, ms and share per fwd+bwd call, the wall span and busy time; in the JSON
rows ("trace"; the xla_bf16 and pallas forward programs: "trace_fwd", "trace_infer") and the
table (top 12). --sweep-blocks [token,neuron,pack,ffn] (synthetic; default all four): those kernels
timed alone over their launch parameters (TOKEN_SWEEP: split x block_t x num_warps x num_stages;
NEURON_SWEEP: block_n x num_warps; PACK_SWEEP: the Triton pack's launch order group_m x
num_stages, beside XLA's relu(x W_gate^T) (the pieces' "pack" is the one the op runs,
`SparseFFNConfig.pack_backend`: Mosaic GPU on Hopper; its layouts are bench_pack.py's); FFN_SWEEP: block_t x num_warps) at the first case's shape (with --shape: the
first trained-like case's), each variant's outputs compared bit for bit with the default launch's
(`sweep_block_sizes`); a "sweep_blocks" JSON row and a table sorted by time with the default marked.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.bench import ffn as bench_ffn  # make_inputs, bench_interleaved, bench: one copy of each
from twell_jax.bench import bounds as bench_bounds
from twell_jax.bench import patterns
from twell_jax.bench.kernel_trace import KernelProfile, format_profile, kernel_times
from twell_jax.pallas_kernels.twell_bwd_neuron import NeuronBwdBlockSizes
from twell_jax.pallas_kernels.twell_bwd_token import TokenBwdBlockSizes, rank_values
from twell_jax.pallas_kernels.twell_ffn import FFNBlockSizes, sparse_ffn
from twell_jax.pallas_kernels.twell_pack import PackBlockSizes
from twell_jax import ops
from twell_jax.config import FFN_KIND_TABLE
from twell_jax.model import FeedForward, Transformer
from twell_jax.ops import pallas_backward, pallas_forward, planner

L1_COEF = 3e-4 / 8  # the 0.5b recipe's lambda over its 8 layers (docs/training.md, "L1 penalty")
BACKENDS = ("xla_bf16", "dense", "reference", "pallas", "pallas_recompute", "auto")
CHECKPOINT_BACKENDS = ("xla_bf16", "dense", "pallas", "pallas_recompute", "auto")
GRAD_NAMES = ("dx", "dw_gate", "dw_up", "dw_down")
TRACED_BACKENDS = ("xla_bf16", "pallas", "auto")  # --trace: the per-kernel profile of these programs
FORWARD_BACKENDS = ("xla_bf16", "dense", "pallas", "auto")  # also timed forward-only (training and inference)
SWEEP_KERNELS = ("token", "neuron", "pack", "ffn")  # --sweep-blocks: the kernels it may time
# Synthetic uniform sparsity, active neurons per token: the paper's trained models (24-39) and
# around them; the first is the --sweep-blocks shape.
SYNTHETIC_K = (29.0, 39.0, 16.0, 56.0, 110.0)
# With --shape: the trained-like pattern (bench/patterns.py) at the paper's sparsity (its 0.5B and
# its 1B-1.5B models), after the uniform cases.
SHAPED_K = (29.0, 39.0)
# --dry-run: the interpreter compiles every backend's whole fwd+bwd, so the smoke run skips the two
# that only repeat others' code paths (the reference backend, and pallas with the pattern recomputed:
# tests/test_ops.py and tests/test_pallas_bwd_op.py cover both).
DRY_RUN_SKIPPED = ("reference", "pallas_recompute")
# --sweep-blocks: the launch parameters tried (the default first, wherever it lies in the list).
TOKEN_SWEEP = tuple(TokenBwdBlockSizes(block_t=t, num_warps=w, num_stages=s, split=sp)
                    for sp in (True, False) for t in (1, 2) for w in (2, 4) for s in (1, 2))
NEURON_SWEEP = (tuple(NeuronBwdBlockSizes(block_n=n, num_warps=w) for n in (1, 2, 4) for w in (2, 4, 8))
                + (NeuronBwdBlockSizes(longest_first=False),))
# The pack kernel: its launch order (group_m: row blocks per L2 group, 0 = all) and pipeline depth.
PACK_SWEEP = tuple(PackBlockSizes(group_m=g, num_stages=st) for g in (0, 1, 4, 8, 16, 32) for st in (3, 4))
# The fused forward FFN: tokens per program and warps (one warp per token is the CUDA reference's
# layout: x in registers, a warp reduction per active neuron).
FFN_SWEEP = tuple(FFNBlockSizes(block_t=t, num_warps=w) for t in (1, 2, 4) for w in (1, 2, 4, 8)
                  if t * 32 <= w * 32 * 4)
# In the interpreter the warps and stages change nothing and each variant compiles anew: the
# default and one more block_t / block_n, the warps and stages varied alongside.
TOKEN_SWEEP_DRY = (TokenBwdBlockSizes(), TokenBwdBlockSizes(2, 2, 2), TokenBwdBlockSizes(split=False))
NEURON_SWEEP_DRY = (NeuronBwdBlockSizes(1, 4), NeuronBwdBlockSizes(2, 2))
PACK_SWEEP_DRY = (PackBlockSizes(), PackBlockSizes(group_m=0, num_stages=4))  # the row-major order
FFN_SWEEP_DRY = (FFNBlockSizes(), FFNBlockSizes(block_t=2, num_warps=1))
Weights3 = tuple[jax.Array, jax.Array, jax.Array]


def xla_bf16_loss_parts(x, w_gate, w_up, w_down):
    """The dense FFN with bf16 dots throughout (no f32 outputs): (y, l1)."""
    g = jnp.einsum("md,hd->mh", x, w_gate)
    u = jnp.einsum("md,hd->mh", x, w_up)
    h = jax.nn.relu(g) * u
    y = jnp.einsum("mh,hd->md", h, w_down)
    return y, jnp.sum(jnp.abs(h), dtype=jnp.float32) / x.shape[0]


def loss_parts(backend: str, config: ops.SparseFFNConfig, interpret: bool):
    """f(x, wg, wu, wd) -> (y, l1) of one backend (BACKENDS)."""
    def parts(x, wg, wu, wd):
        if backend == "xla_bf16":
            return xla_bf16_loss_parts(x, wg, wu, wd)
        op_backend = "pallas" if backend == "pallas_recompute" else backend
        y, aux = ops.gated_ffn(x, wg, wu, wd, backend=op_backend, config=config,
                               interpret=interpret and op_backend == "pallas")
        return y, aux["l1"]
    return parts


@functools.lru_cache(maxsize=None)
def make_forward(backend: str, config: ops.SparseFFNConfig, interpret: bool, training: bool):
    """f(x, wg, wu, wd) -> the forward alone: training=True, the forward of a training step ((y, l1)
    and the vjp's residuals, everything the backward keeps, as outputs so none of it is dropped);
    training=False, the inference forward (y and l1 only: no residual). Made once per arguments, so
    the layers of a checkpoint share its compilations (as `compiled_step`'s)."""
    parts = loss_parts(backend, config, interpret)
    if training:
        return jax.jit(lambda x, wg, wu, wd: jax.vjp(parts, x, wg, wu, wd))
    return jax.jit(parts)


def make_train_step(backend: str, config: ops.SparseFFNConfig, interpret: bool):
    """f(x, wg, wu, wd, gy) -> (dx, dwg, dwu, dwd, y): the vjp of (y, l1) at cotangent (gy, L1_COEF),
    and y itself. y is returned because a training step needs it (the next layer's input): without
    it XLA drops the forward's last product from the program (the down projection, or the fused
    sparse FFN kernel), and the timed fwd+bwd would miss it (as it did until 2026-11-22)."""
    parts = loss_parts(backend, config, interpret)

    def step(x, wg, wu, wd, gy):
        (y, _), vjp = jax.vjp(parts, x, wg, wu, wd)
        return (*vjp((gy, jnp.float32(L1_COEF))), y)

    return jax.jit(step)


def l1_scale(m: int) -> jax.Array:
    """The L1 term's scale in the backward's kernels, as the op computes it from make_train_step's
    cotangent of l1 (pallas_backward.backward: gl1 in f32 over M)."""
    return jnp.float32(L1_COEF) / m


_COMPILED: dict = {}


def compiled_step(backend: str, config: ops.SparseFFNConfig, interpret: bool, args: tuple):
    """make_train_step's program compiled for args' shapes, once per (backend, config, shapes):
    the layers of a checkpoint share their shapes, so only "auto" (one hint each) compiles again."""
    key = (backend, config, interpret, tuple((a.shape, a.dtype) for a in args))
    if key not in _COMPILED:
        _COMPILED[key] = make_train_step(backend, config, interpret).lower(*args).compile()
    return _COMPILED[key]


def temp_mb(compiled) -> float:
    """Compiled temporary memory (MiB) of a compiled program (nan when XLA does not report it)."""
    analysis = compiled.memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def rel_errors(grads: Sequence[jax.Array], base: Sequence[jax.Array], names: Sequence[str]) -> dict:
    """{name: {max_abs, rel}} of each gradient against the baseline's."""
    return {name: dict(max_abs=float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
                       if g.size else 0.0, rel=bench_ffn.rel_err(g, r))
            for name, g, r in zip(names, grads, base)}


@functools.lru_cache(maxsize=None)
def piece_fns(config: ops.SparseFFNConfig, interpret: bool, h: int) -> dict:
    """The Pallas path's pieces as separately jitted functions (pallas_backward.backward's steps);
    made once per (config, interpret, H), so the layers of a checkpoint share their compilations.

    Each piece calls the kernels through the op's own calls (pallas_backward.transpose_histograms,
    transpose_lists, token_major, neuron_major) on the inputs the op gives them (`backward_inputs`):
    the pattern the training forward keeps (pallas_backward.Kept: uint8 offsets inside the tile,
    int16 counts) read as stored, the transpose's and the token-major kernel's outputs with their
    padding, the neuron-major launch order by the kernel's longest_first_order, and with tails
    the hot neurons left out and f32 inits. `keep` (the op's training forward, for the Kept) is
    set-up, not a piece. token_tail / neuron_tail are the backward's own
    pallas_backward.token_tail_backward / hot_neuron_backward, so they take the tails as the
    backward does on this pattern; `measure` checks both against xla_bf16's gradients on their
    rows."""
    bc = config.backward or pallas_backward.BackwardConfig()
    # the pack the op runs (config.pack_backend: Mosaic GPU on Hopper, else Triton)
    pack = jax.jit(lambda x, wg: pallas_forward.run_pack(x, wg, pallas_forward.settings(config, x.shape[0]),
                                                         interpret))
    keeping = dataclasses.replace(config, backward=dataclasses.replace(bc, keep_gate_pattern=True))

    @jax.jit
    def keep(x, wg, wu, wd):
        """What the op's training forward keeps for the backward (pallas_backward.Kept)."""
        return pallas_backward.forward(True, x, (wg, wu, wd), keeping, interpret)[2]

    def token_inputs(pattern):
        """(values, indices, the kernels' counts (tail rows 0), the token-tail mask) of a pattern
        (values, indices, counts): the pack's (int32 ids and counts), or the kept one (None,
        uint8 offsets, int16 counts: what the backward reads)."""
        values, indices, counts = pattern
        tail, kernel_counts = pallas_backward.kernel_pattern(counts, config)
        return values, indices, kernel_counts, tail

    def transpose(packed_in, prepared):
        """The transpose's two passes as the op runs them: the first (the histograms) in the
        training forward on the pack's pattern (`token_inputs` of the pack), the second (the
        padded lists start, count, tokens, dest) in the backward on the kept pattern
        (`token_inputs` of the Kept)."""
        hist = pallas_backward.transpose_histograms(packed_in[1], packed_in[2], h, config, interpret)
        return pallas_backward.transpose_lists(prepared[1], prepared[2], hist, h, config, interpret)

    def hot_of(lists, m: int):
        return ops.TailPolicy(config).hot(lists[1], m)

    @jax.jit
    def ranked(x, wu, wd, pack_out):
        """The fused FFN as the training forward runs it: y and its entries' (a, u) in rank order
        (what the backward keeps)."""
        return sparse_ffn(x, *pack_out, wu, wd, block_sizes=config.ffn_block_sizes or FFNBlockSizes(),
                          ranked_width=pallas_backward.ell_width_pow2(config), interpret=interpret)

    @jax.jit
    def token(x, wg, wu, wd, gy, prepared, lists, kept, dx_init):
        """As the backward calls it (the per-token lists, then the kernel: token_major): from the
        Kept (prepared: its token inputs), or, kept=None, as the backward that recomputes the
        pattern runs it (prepared: the pack's; `rank_values`, and u computed by the kernel).
        dx_init None: no tails; else the tails' f32 dx (the hot neurons left out)."""
        values, indices, counts, _ = prepared
        if kept is None:
            ranked_a = rank_values(values, counts, config.ell_width, block_sizes=bc.lists_block_sizes,
                                   interpret=interpret)
            ranked_u = None
        else:
            ranked_a, ranked_u = kept.ranked, kept.ranked_u
        m = x.shape[0]
        return pallas_backward.token_major(True, x, gy, (wg, wu, wd), l1_scale(m), ranked_a,
                                           ranked_u, indices, counts, lists[3],
                                           None if dx_init is None else hot_of(lists, m), dx_init,
                                           config, interpret)

    @jax.jit
    def neuron(x, gy, lists, values_E, inits):
        """The neuron-major kernel on the padded lists and values (inits None: no tails; else the
        tails' f32 weight gradients, the hot neurons' counts zeroed)."""
        start, count, tokens, _ = lists
        count = jnp.where(hot_of(lists, x.shape[0]), 0, count)
        return pallas_backward.neuron_major(x, gy, start, count, tokens, values_E, inits, config, interpret)

    @jax.jit
    def token_tail64(x, wg, wu, wd, gy):
        return pallas_backward.dense_rows_backward(True, x[:64], gy[:64], (wg, wu, wd),
                                                   l1_scale(x.shape[0]))

    @jax.jit
    def token_tail(x, wg, wu, wd, gy, tail_M):
        """(dx [M, D] f32: the tail rows' rows, zeros elsewhere; f32 weight-gradient parts)."""
        m, d = x.shape
        zeros = tuple(jnp.zeros((h, d), jnp.float32) for _ in range(3))
        return pallas_backward.token_tail_backward(
            True, x, gy, (wg, wu, wd), l1_scale(m), tail_M, config.tail_capacity(m),
            bc.token_tail_chunk, bc.small_tail_chunk, (jnp.zeros((m, d), jnp.float32), zeros))

    @jax.jit
    def neuron_tail(x, wg, wu, wd, gy, tail_M, count_H):
        """(dx [M, D] f32: the hot neurons' terms, f32 weight gradients (gate, up, down) of the hot
        neurons) over the rows outside the token tail, zeros elsewhere."""
        m, d = x.shape
        zeros = tuple(jnp.zeros((h, d), jnp.float32) for _ in range(3))
        return pallas_backward.hot_neuron_backward(
            True, x, gy, (wg, wu, wd), l1_scale(m), tail_M,
            ops.TailPolicy(config).hot(count_H, m), config.transpose_tail_capacity(h), bc.neuron_tail_chunk,
            bc.small_tail_chunk, (jnp.zeros((m, d), jnp.float32), zeros))

    @jax.jit
    def tail_mask(counts):
        """The token-tail mask and the kernels' counts alone (the piece; `token_inputs` also
        passes the pattern through, which a jitted call copies)."""
        return pallas_backward.kernel_pattern(counts, config)

    return dict(pack=pack, keep=keep, token_inputs=jax.jit(token_inputs), tail_mask=tail_mask,
                transpose=jax.jit(transpose),
                ranked=ranked, token=token, neuron=neuron,
                token_tail64=token_tail64, token_tail=token_tail, neuron_tail=neuron_tail)


class BackwardInputs(NamedTuple):
    """The pieces' inputs on one (x, weights), as the op's backward holds them (`backward_inputs`)."""

    packed: tuple            # the pack (values, int32 ids, int32 counts)
    packed_in: tuple         # token_inputs of the pack: the forward's first transpose pass, the recompute path
    kept: Any                # pallas_backward.Kept: what the training forward keeps
    prepared: tuple          # token_inputs of the Kept: (None, uint8 offsets, int16 kernel counts, tail mask)
    lists: tuple             # the transpose's padded lists (start, count, tokens, dest)
    tails: bool              # whether the backward runs its dense tails on this pattern
    dx_init: jax.Array | None                  # with tails: the tails' f32 dx (zeros here), else None
    inits: tuple[jax.Array, ...] | None        # with tails: their f32 weight gradients (zeros), else None


def backward_inputs(p: dict, x: jax.Array, weights: Weights3, config: ops.SparseFFNConfig) -> BackwardInputs:
    """The inputs of `piece_fns`' pieces on (x, weights): the pack, the Kept (the op's training
    forward), the token inputs of either, the transpose's lists, and with tails (a token tail or
    a hot neuron) f32 zero inits for the token- and neuron-major kernels, made outside the timed
    calls as the op's tails make them (the tails' own time is the token_tail / neuron_tail
    pieces')."""
    wg, wu, wd = weights
    m, d = x.shape
    packed = p["pack"](x, wg)
    packed_in = p["token_inputs"](packed)
    kept = p["keep"](x, wg, wu, wd)
    prepared = p["token_inputs"]((None, kept.offsets, kept.counts))
    lists = p["transpose"](packed_in, prepared)
    tails = bool(jnp.any(prepared[3])) or bool(jnp.any(ops.TailPolicy(config).hot(lists[1], m)))
    dx_init = jnp.zeros((m, d), jnp.float32) if tails else None
    inits = tuple(jnp.zeros(w.shape, jnp.float32) for w in weights) if tails else None
    return BackwardInputs(packed, packed_in, kept, prepared, lists, tails, dx_init, inits)


def listed_positions(lists: tuple, m: int, config: ops.SparseFFNConfig) -> np.ndarray:
    """The CSR positions the token-major kernel writes values to (each non-hot neuron's
    [start, start + count)), ascending: the part of its padded value arrays that has a meaning."""
    start = np.asarray(lists[0], np.int64)
    count = np.where(np.asarray(ops.TailPolicy(config).hot(lists[1], m)), 0, np.asarray(lists[1], np.int64))
    first = np.cumsum(count) - count  # each neuron's first listed position in the output
    return np.repeat(start - first, count) + np.arange(int(count.sum()))


def pattern_stats(counts_MxNT: np.ndarray, neuron_count_H: np.ndarray, config: ops.SparseFFNConfig,
                  seq_len: int | None = None) -> dict:
    """Statistics of a layer's pattern as the Pallas backward sees it.

    counts_MxNT: the pack's active count per (token, tile) (exact, also where a tile overflows its
    slots); neuron_count_H: entries per neuron in the backward's neuron-major lists (tokens of the
    token tail excluded, as in pallas_backward.backward). The tails follow backward's decisions:
    token tail = ops.TailPolicy.pack_token_tail, hot = more than config.hot_threshold(M) entries; each
    runs ceil(n / chunk) dense blocks of chunk rows (neurons), and n above the config's capacity
    sends the whole call to the dense backward (`*_fallback`). `seq_len` adds the mean active
    count of the first token of each sequence (rows 0, seq_len, ...)."""
    counts_MxNT = np.asarray(counts_MxNT)
    neuron_count_H = np.asarray(neuron_count_H)
    if counts_MxNT.ndim != 2 or neuron_count_H.ndim != 1:
        raise ValueError(f"counts_MxNT must be [M, NT] and neuron_count_H [H], got {counts_MxNT.shape} "
                         f"and {neuron_count_H.shape}")
    m, h = counts_MxNT.shape[0], neuron_count_H.shape[0]
    bc = config.backward or pallas_backward.BackwardConfig()
    policy = ops.TailPolicy(config)  # the backward's tail rule, not a copy of it
    active_M = counts_MxNT.sum(axis=1)
    overflow_M = (counts_MxNT > config.slots).any(axis=1)
    wide_M = np.asarray(policy.token_tail(active_M))
    tail = int(np.sum(np.asarray(policy.pack_token_tail(jnp.asarray(counts_MxNT)))))
    hot_H = np.asarray(policy.hot(neuron_count_H, m))
    n_hot = int(hot_H.sum())
    entries = int(neuron_count_H.sum())
    token_cap, hot_cap = config.tail_capacity(m), config.transpose_tail_capacity(h)

    def block_size(n: int, chunk: int) -> int:  # the backward's rule (pallas_backward._chunked)
        return next((size for size in pallas_backward.tail_block_sizes(chunk, bc.small_tail_chunk)
                     if n <= size), chunk)

    def blocks(n: int, cap: int, chunk: int) -> int:
        return -(-min(n, cap) // block_size(min(n, cap), chunk))

    def pct(v: np.ndarray, q: float) -> float:
        return float(np.percentile(v, q)) if v.size else 0.0

    stats = dict(
        tokens=m, neurons=h,
        active_mean=float(active_M.mean()) if m else 0.0, active_p50=pct(active_M, 50),
        active_p99=pct(active_M, 99), active_max=int(active_M.max()) if m else 0,
        token_tail_rows=tail, overflow_rows=int(overflow_M.sum()), wide_rows=int(wide_M.sum()),
        token_tail_capacity=token_cap,
        token_tail_blocks=blocks(tail, token_cap, bc.token_tail_chunk),
        token_tail_dense_rows=(blocks(tail, token_cap, bc.token_tail_chunk)
                               * block_size(min(tail, token_cap), bc.token_tail_chunk)),
        token_fallback=tail > token_cap,
        neuron_entries=entries, neuron_count_max=int(neuron_count_H.max()) if h else 0,
        neuron_count_p99=pct(neuron_count_H, 99), dead_neurons=int(np.sum(neuron_count_H == 0)),
        hot_threshold=config.hot_threshold(m), hot_neurons=n_hot,
        hot_entry_share=float(neuron_count_H[hot_H].sum() / entries) if entries else 0.0,
        neuron_tail_capacity=hot_cap,
        neuron_tail_blocks=blocks(n_hot, hot_cap, bc.neuron_tail_chunk),
        neuron_tail_dense_neurons=(blocks(n_hot, hot_cap, bc.neuron_tail_chunk)
                                   * block_size(min(n_hot, hot_cap), bc.neuron_tail_chunk)),
        neuron_fallback=n_hot > hot_cap,
    )
    if seq_len:
        stats["first_token_active_mean"] = float(active_M[::seq_len].mean()) if m else 0.0
    return stats


def auto_config(config: ops.SparseFFNConfig, stats: dict) -> ops.SparseFFNConfig:
    """`config` with the hints "auto" gets from a pattern's statistics (`pattern_stats`): the mean
    active count and the backward's tail shares (token-tail rows / M, hot neurons / H, the hot
    neurons' share of the entries), as the trainer's telemetry gives them."""
    m, h = stats["tokens"], stats["neurons"]
    return dataclasses.replace(
        config, expected_active_per_token=float(stats["active_mean"]),
        expected_token_tail=stats["token_tail_rows"] / m if m else 0.0,
        expected_hot_neurons=stats["hot_neurons"] / h, expected_hot_entries=float(stats["hot_entry_share"]))


def model_prediction(m: int, d: int, h: int, auto_cfg: ops.SparseFFNConfig, itemsize: int,
                     interpret: bool) -> dict:
    """The planner's cost-model figures (ms; planner.COST_MODELS) for this shape at auto_cfg's hints
    (mean k and tails), and the plan "auto" compiles."""
    k = auto_cfg.expected_active_per_token
    keep = auto_cfg.keeps_gate_pattern
    fwd, bwd = planner.sparse_times_ms(m, d, h, k, True, itemsize=itemsize, keep_pattern=keep,
                                               config=auto_cfg)
    _, bwd_recompute = planner.sparse_times_ms(m, d, h, k, True, itemsize=itemsize,
                                                       keep_pattern=False, config=auto_cfg)
    dense_fwd, dense_bwd = planner.dense_times_ms(m, d, h, True)
    return dict(pallas_fwd_ms=fwd, pallas_bwd_ms=bwd, pallas_ms=fwd + bwd,
                pallas_recompute_ms=fwd + bwd_recompute, dense_ms=dense_fwd + dense_bwd,
                choose_training_path=list(planner.choose_training_path(
                    m, d, h, k, True, itemsize=itemsize, keep_pattern=keep, config=auto_cfg)),
                auto_plan=list(ops.auto_decision(True, auto_cfg, (m, d, h, itemsize), interpret)))


def measure(xs: Sequence[jax.Array], weights: Weights3, gy: jax.Array, config: ops.SparseFFNConfig,
            interpret: bool, backends: Sequence[str], *, seq_len: int | None = None,
            repeats: int = 15, trace: bool = False, log=print) -> dict:
    """Everything the benchmark reports for one (x, weights): pattern statistics, the cost model's
    prediction, each backend's errors vs xla_bf16, compiled temporary memory and time, and the
    Pallas pieces' times. xs: input sets rotated while timing (one for a checkpoint's layer).
    trace: also the per-kernel GPU profile (kernel_trace.kernel_times) of TRACED_BACKENDS' timed
    programs, in row["trace"]."""
    wg, wu, wd = weights
    m, d = xs[0].shape
    h = wg.shape[0]
    sets = [(x, wg, wu, wd, gy) for x in xs]
    x0 = sets[0]
    p = piece_fns(config, interpret, h)
    # The pattern, as the op builds it (pack, what the forward keeps, tail mask, transpose,
    # token-major kernel).
    bi = backward_inputs(p, x0[0], weights, config)
    packed, prepared, lists = bi.packed, bi.prepared, bi.lists
    _, values_E = p["token"](*x0, prepared, lists, bi.kept, bi.dx_init)
    stats = pattern_stats(np.asarray(packed[2]), np.asarray(lists[1]), config, seq_len)
    hint = stats["active_mean"]
    row: dict[str, Any] = dict(m=m, d=d, h=h, hint=hint, pattern=stats, errors={}, temp_mb={})
    # The pattern's shape beside its mean (bench/patterns.py): how skewed over neurons, and (whole
    # sequences of seq_len) the fit of the trained-like synthetic pattern's parameters.
    active_M, neuron_H = patterns.exact_activity(x0[0], wg)
    row["skew"] = patterns.skew_stats(neuron_H)
    if seq_len and m % seq_len == 0 and neuron_H.any():
        row["shape"] = patterns.fit_shape(active_M, neuron_H, seq_len).to_json()
    hinted = auto_config(config, stats)
    row["model"] = model_prediction(m, d, h, hinted, x0[0].dtype.itemsize, interpret)
    log(f"  pattern: k mean {hint:.1f} p99 {stats['active_p99']:.0f} max {stats['active_max']}, "
        f"token tail {stats['token_tail_rows']} rows, hot neurons {stats['hot_neurons']} "
        f"({stats['hot_entry_share']:.1%} of entries); auto plan {row['model']['auto_plan']}")
    configs = dict(
        pallas_recompute=dataclasses.replace(
            config, backward=dataclasses.replace(config.backward or pallas_backward.BackwardConfig(),
                                                 keep_gate_pattern=False)),
        auto=hinted)
    # Compile each backend once: its memory analysis, and the program that is checked and timed.
    steps = {b: compiled_step(b, configs.get(b, config), interpret, x0) for b in backends}
    row["temp_mb"] = {b: temp_mb(step) for b, step in steps.items()}
    log(f"  compiled {len(steps)} backends")
    # Correctness first: each backend's gradients against xla_bf16's.
    base = steps["xla_bf16"](*x0)
    for b in backends:
        row["errors"][b] = rel_errors(steps[b](*x0), base, GRAD_NAMES + ("y",))
    # The tails as the backward takes them, checked on their rows: the tail rows' dx, and the hot
    # neurons' weight gradients (their ELL entries' part plus the token tail's part).
    tail_dx, tail_parts = p["token_tail"](*x0, prepared[3])
    _, hot_parts = p["neuron_tail"](*x0, prepared[3], lists[1])
    tail_rows = np.flatnonzero(np.asarray(prepared[3]))
    hot = np.flatnonzero(np.asarray(ops.TailPolicy(config).hot(lists[1], m)))
    row["piece_errors"] = {}
    if tail_rows.size and not stats["token_fallback"]:
        row["piece_errors"].update(rel_errors([tail_dx[tail_rows]], [base[0][tail_rows]], ["token_tail_dx"]))
    if hot.size and not (stats["neuron_fallback"] or stats["token_fallback"]):
        row["piece_errors"].update(rel_errors([(a + b)[hot] for a, b in zip(hot_parts, tail_parts)],
                                              [g[hot] for g in base[1:4]],
                                              ["hot_dw_gate", "hot_dw_up", "hot_dw_down"]))
    del base
    row["ms"] = bench_ffn.bench_interleaved(steps, sets, repeats=repeats)
    log("  " + ", ".join(f"{b} {t:.3f} ms" for b, t in row["ms"].items()))
    # The forward alone, as a training step runs it (with the residuals the backward keeps) and as
    # inference runs it (y and l1), for the backends of FORWARD_BACKENDS.
    fwd_backends = [b for b in FORWARD_BACKENDS if b in backends]
    for training, key in ((True, "fwd_ms"), (False, "infer_ms")):
        fwds = {b: make_forward(b, configs.get(b, config), interpret, training) for b in fwd_backends}
        row[key] = bench_ffn.bench_interleaved(fwds, [s[:4] for s in sets], repeats=repeats)
        log(f"  {key}: " + ", ".join(f"{b} {t:.3f}" for b, t in row[key].items()))
    if trace:  # the very programs just timed: one compilation each
        row["trace"] = {}
        for b in (b for b in TRACED_BACKENDS if b in steps):
            profile = kernel_times(steps[b], x0, repeats=1 if bench_ffn.INTERPRET else repeats)
            row["trace"][b] = profile.to_json()
            log("\n".join(f"  [{b}] {line}" for line in format_profile(profile)))
        # The forward alone too (training, inference): what runs beside its two kernels.
        for training, key in ((True, "trace_fwd"), (False, "trace_infer")):
            row[key] = {}
            for b in (b for b in ("xla_bf16", "pallas") if b in fwd_backends):
                profile = kernel_times(make_forward(b, configs.get(b, config), interpret, training),
                                       x0[:4], repeats=1 if bench_ffn.INTERPRET else repeats)
                row[key][b] = profile.to_json()
                log("\n".join(f"  [{key} {b}] {line}" for line in format_profile(profile)))
    bench = functools.partial(bench_ffn.bench, repeats=repeats)
    piece_ms = dict(
        pack=bench(p["pack"], [(x, wg) for x in xs]),
        fused_ffn=bench(functools.partial(sparse_ffn, interpret=interpret),
                        [(x, *p["pack"](x, wg), wu, wd) for x in xs[:1]]),
        fused_ffn_ranked=bench(p["ranked"], [(x0[0], wu, wd, packed)]),
        tail_mask=bench(p["tail_mask"], [(bi.kept.counts,)]),
        transpose=bench(p["transpose"], [(bi.packed_in, prepared)]),
        token_major=bench(p["token"], [(*x0, prepared, lists, bi.kept, bi.dx_init)]),
        token_major_recompute=bench(p["token"], [(*x0, bi.packed_in, lists, None, bi.dx_init)]),
        neuron_major=bench(p["neuron"], [(x0[0], gy, lists, values_E, bi.inits)]),
        token_tail_64_rows=bench(p["token_tail64"], [x0]),
        token_tail=bench(p["token_tail"], [(*x0, prepared[3])]),
    )
    if hot.size:
        piece_ms["neuron_tail"] = bench(p["neuron_tail"], [(*x0, prepared[3], lists[1])])
    row["piece_ms"] = piece_ms
    row["token_tail_rows"], row["hot_neurons"] = stats["token_tail_rows"], stats["hot_neurons"]
    return row


def bit_diff(a: jax.Array, b: jax.Array) -> dict:
    """How a differs from b bit for bit: {equal, n_diff (entries whose bits differ), max_abs}."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"bit_diff needs arrays of one shape and dtype, got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    bits = np.dtype(f"u{a.dtype.itemsize}")
    differ = a.view(bits) != b.view(bits)
    n_diff = int(np.sum(differ))
    # Over the differing entries only (a NaN on both sides is equal bits, not a NaN difference).
    max_abs = float(np.max(np.abs(a[differ].astype(np.float64) - b[differ].astype(np.float64)))) if n_diff else 0.0
    return dict(equal=n_diff == 0, n_diff=n_diff, max_abs=max_abs)


def sweep_block_sizes(x: jax.Array, weights: Weights3, gy: jax.Array, config: ops.SparseFFNConfig,
                      interpret: bool, token_sizes: Sequence[TokenBwdBlockSizes],
                      neuron_sizes: Sequence[NeuronBwdBlockSizes],
                      pack_sizes: Sequence[PackBlockSizes], ffn_sizes: Sequence[FFNBlockSizes] = (), *,
                      repeats: int = 15, log=print, kernels: Sequence[str] = SWEEP_KERNELS) -> dict:
    """Time the token-major and the neuron-major kernel alone at each launch in the lists, on the
    backward's own inputs for (x, weights, gy) (`backward_inputs`: the kept pattern, the padded
    lists; the default token kernel's padded entry values), and the pack kernel at each launch in `pack_sizes` (on x and
    W_gate; its outputs must not change with the launch: each slot is an exact min-reduction and
    the GEMM's K loop runs in the same order whatever the program order), and the forward's fused
    FFN at each launch in `ffn_sizes` (inference: y and l1, on the pack of x; x . U_j is a
    reduction over D, so its last bits may change with the warps).

    Each variant runs piece_fns' kernel call with only that launch changed in `config.backward`,
    and its outputs are compared bit for bit with the default launch's (config.backward's, run
    first and then again as the sweep's first variant: the run-to-run check); the token kernel's
    value arrays at the listed positions only (`listed_positions`: their padding's length depends
    on the launch, and positions no entry maps to hold nothing). Whether a launch may
    change bits: the neuron kernel accumulates each output entry elementwise in list order, so no
    launch parameter should; the token kernel's dt = gy . W_j and u = x . U_j are reductions over D
    whose tree Triton lays out by block shape and warps, so its per-entry values and dx may differ
    in the last bits across launches. A differing variant is reported (n_diff, max_abs), not dropped.
    Returns {"token": rows, "neuron": rows, "pack": rows, "ffn": rows, "xla_gate_ms": ms}, each kernel's rows
    sorted by ms, the default marked."""
    wg, wu, wd = weights
    h = wg.shape[0]
    bc = config.backward or pallas_backward.BackwardConfig()

    def pieces(**launch) -> dict:
        return piece_fns(dataclasses.replace(config, backward=dataclasses.replace(bc, **launch)), interpret, h)

    args = (x, wg, wu, wd, gy)
    p = pieces()
    bi = backward_inputs(p, x, weights, config)

    def token_run(sizes: TokenBwdBlockSizes):
        return pieces(token_block_sizes=sizes)["token"], (*args, bi.prepared, bi.lists, bi.kept, bi.dx_init)

    fn, fn_args = token_run(bc.token_block_sizes)
    _, values_E = fn(*fn_args)
    # The token kernel's value arrays are padded past the lists by an amount that depends on its
    # launch, and hold nothing at positions no listed entry maps to: compared at the listed ones.
    listed = listed_positions(bi.lists, x.shape[0], config)

    def token_view(out):
        return out[0], *(np.asarray(v)[listed] for v in out[1])

    def neuron_run(sizes: NeuronBwdBlockSizes):
        return pieces(neuron_block_sizes=sizes)["neuron"], (x, gy, bi.lists, values_E, bi.inits)

    def pack_run(sizes: PackBlockSizes):  # the Triton kernel's launch parameters (the Mosaic pack: bench_pack.py)
        swept = dataclasses.replace(config, pack_block_sizes=sizes, pack_backend="triton")
        return piece_fns(swept, interpret, h)["pack"], (x, wg)

    def ffn_run(sizes: FFNBlockSizes):
        return (functools.partial(sparse_ffn, block_sizes=sizes, interpret=interpret),
                (x, *p["pack"](x, wg), wu, wd))

    runs = dict(token=(token_run, bc.token_block_sizes, token_sizes),
                neuron=(neuron_run, bc.neuron_block_sizes, neuron_sizes),
                pack=(pack_run, config.pack_block_sizes or PackBlockSizes(), pack_sizes),
                ffn=(ffn_run, config.ffn_block_sizes or FFNBlockSizes(), ffn_sizes))
    views = dict(token=token_view)
    out = {name: _sweep_one(name, *runs[name], repeats, log, views.get(name)) for name in kernels}
    if "pack" in kernels:
        # What the pack's GEMM should cost: XLA's relu(x W_gate^T) with a bf16 output, same inputs.
        gate = jax.jit(lambda x_, w_: jax.nn.relu(jnp.einsum("md,hd->mh", x_, w_)))
        out["xla_gate_ms"] = bench_ffn.bench(gate, [(x, wg)], repeats=repeats)
        log(f"  XLA relu(x W_gate^T): {out['xla_gate_ms']:.3f} ms")
    return out


def _sweep_one(kernel: str, run, default, sizes: Sequence, repeats: int, log, view=None) -> list[dict]:
    """sweep_block_sizes for one kernel: run(sizes) -> (fn, args); view(outputs): the part of the
    outputs compared bit for bit (None: all of them)."""
    view = view or (lambda out: out)
    fn, fn_args = run(default)
    base = jax.tree.leaves(view(fn(*fn_args)))
    rows = []
    for sizes_i in [default] + [v for v in sizes if v != default]:
        row: dict[str, Any] = dict(block_sizes=dataclasses.asdict(sizes_i), default=sizes_i == default)
        try:
            fn, fn_args = run(sizes_i)
            diffs = [bit_diff(a, b) for a, b in zip(jax.tree.leaves(view(fn(*fn_args))), base)]
            row.update(equal=all(d["equal"] for d in diffs), n_diff=sum(d["n_diff"] for d in diffs),
                       max_abs=max(d["max_abs"] for d in diffs),
                       ms=bench_ffn.bench(fn, [fn_args], repeats=repeats))
        except Exception as e:  # a launch that does not compile (e.g. out of registers) is reported
            row.update(error=repr(e)[:300])
        log(f"  sweep {kernel} {row['block_sizes']}: " + (f"{row['ms']:.3f} ms, equal={row['equal']}"
                                                           if "ms" in row else row["error"]))
        rows.append(row)
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def sweep_table(kernel: str, rows: Sequence[dict]) -> list[str]:
    """The printed table of one kernel's sweep (fastest first, the default marked with *)."""
    default_ms = next((r["ms"] for r in rows if r["default"] and "ms" in r), float("nan"))
    lines = [f"--sweep-blocks {kernel} kernel (* = default; bits vs the default's output)",
             f"  {'block sizes':<46} {'ms':>8} {'speed-up':>10}  bits"]
    for r in rows:
        label = ("* " if r["default"] else "  ") + " ".join(f"{k}={v}" for k, v in r["block_sizes"].items())
        if "error" in r:
            lines.append(f"{label:<48} error: {r['error'][:120]}")
            continue
        bits = "equal" if r["equal"] else f"DIFFER: {r['n_diff']} entries, max |diff| {r['max_abs']:.3g}"
        lines.append(f"{label:<48} {r['ms']:>8.3f} {default_ms / r['ms']:>9.2f}x  {bits}")
    return lines


def capture_ffn_inputs(model: Transformer, tokens_BxS: jax.Array, layers: Sequence[int]) -> list[jax.Array]:
    """The input x [B*S, D] that each of `layers`' FeedForward receives (the normed activations, in
    the compute dtype) in the model's own forward on tokens_BxS, in the order of `layers`.

    One jitted forward of the model, with FeedForward.__call__ wrapped for its duration (restored
    afterwards, also on error) to add its input to its aux: the layer scan stacks it over layers
    like the telemetry, so no value leaves a trace."""
    n_layers = model.n_layers
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"layers must be a non-empty list of indices in [0, {n_layers}), got {list(layers)}")
    original = FeedForward.__call__

    def recording(self, x_BxSxD, op_config, neuron_counts=False):
        y, aux = original(self, x_BxSxD, op_config, neuron_counts)
        return y, {**aux, "ffn_input": x_BxSxD}

    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        inputs_LxBxSxD = nnx.merge(graphdef, state)(tokens)[1]["ffn_input"]
        return [inputs_LxBxSxD[i].reshape(-1, inputs_LxBxSxD.shape[-1]) for i in layers]

    try:
        FeedForward.__call__ = recording
        return forward(state, tokens_BxS)
    finally:
        FeedForward.__call__ = original


def ffn_weights(model: Transformer, layer: int) -> Weights3:
    """(w_gate, w_up, w_down) of a layer, [H, D] each, in the dtype the model holds them in."""
    ffn = model.layer(layer).ffn
    if not (ffn.gated and FFN_KIND_TABLE[ffn.kind].through_op):
        raise ValueError(f"layer {layer}'s FFN is {ffn.kind!r}: this benchmark needs a ReLU-gated kind "
                         "(twell or relu_gated)")
    return ffn.w_gate[...], ffn.w_up[...], ffn.w_down[...]


def parse_layers(text: str | None, n_layers: int) -> list[int]:
    """'0,3,7' -> [0, 3, 7]; None -> every layer. Out of range or malformed: ValueError."""
    if text is None:
        return list(range(n_layers))
    try:
        layers = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers, got {text!r}") from None
    if not layers or any(not 0 <= i < n_layers for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"--layers must list distinct layers in [0, {n_layers}), got {text!r}")
    return layers


def dry_run_config() -> ops.SparseFFNConfig:
    """Tiny blocks for the interpreter (H must be a multiple of the tile: 16 fits the test presets),
    with tails small enough that tiny patterns exercise both and capacities that never fall back."""
    return ops.SparseFFNConfig(tile=16, slots=16, ell_width=32, transpose_ell_width=16, tail_rows=1.0,
                               transpose_tail_rows=1.0,
                               backward=pallas_backward.BackwardConfig(token_tail_chunk=8, neuron_tail_chunk=8))


def parse_hot_width(text: str) -> int | float:
    """--transpose-ell-width: an int (entries) or a fraction in (0, 1] of the tokens."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--transpose-ell-width wants an int or a fraction, got {text!r}") from None
    try:
        ops.SparseFFNConfig(transpose_ell_width=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--transpose-ell-width: {e}") from None
    return value


def parse_sweep_kernels(text: str) -> tuple[str, ...]:
    """--sweep-blocks: "token,pack" -> ("token", "pack"); unknown names are refused."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in SWEEP_KERNELS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--sweep-blocks takes kernels among {', '.join(SWEEP_KERNELS)}, "
                                         f"got {text!r}")
    return names


def parse_cases(text: str) -> list[tuple[int, float]]:
    """--cases: "M:K,M:K" -> [(M, K), ...] with M an int >= 1 and K a number > 0."""
    cases = []
    for item in text.split(","):
        try:
            m_text, k_text = item.split(":")
            m, k = int(m_text), float(k_text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--cases wants M:K pairs like 2048:29, got {item!r}") from None
        if m < 1 or not k > 0:
            raise argparse.ArgumentTypeError(f"--cases wants M >= 1 and K > 0, got {item!r}")
        cases.append((m, k))
    return cases


def load_shape(text: str) -> patterns.PatternShape:
    """--shape: "trained" (patterns.TRAINED_LIKE) or a JSON file holding a PatternShape, or the
    results of a --checkpoint run (its median fit, "shape_fit")."""
    if text == "trained":
        return patterns.TRAINED_LIKE
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--shape wants 'trained' or a JSON file, got {text!r} (no such file)")
    try:
        data = json.loads(path.read_text())
        return patterns.PatternShape.from_json(data.get("shape_fit", data))
    except (ValueError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"--shape {text}: not a PatternShape or a --checkpoint run's results "
                                         f"({e})") from None


def entry_counts(stats: dict, m: int) -> dict:
    """The entries the backward's sparse kernels visit (bench_bounds.piece_traffic): those of the
    rows outside the token tail (the mean count times those rows: an estimate) and those of the
    neurons that are not hot."""
    rows = max(m - stats["token_tail_rows"], 0)
    return dict(token_entries=stats["active_mean"] * rows,
                neuron_entries=stats["neuron_entries"] * (1.0 - stats["hot_entry_share"]))


def synthetic_inputs(key: jax.Array, m: int, k: float, shape: patterns.PatternShape | None):
    """(xs, w_gate, w_up, w_down) of a synthetic case: uniform (shape None) or trained-like."""
    if shape is None:
        return bench_ffn.make_inputs(key, m, k)
    return patterns.shaped_inputs(key, m, k, shape, bench_ffn.D, bench_ffn.H, bench_ffn.DTYPE)


def run_synthetic(args, out: "Output") -> None:
    interpret = args.dry_run
    shape = args.shape
    if interpret:  # bench_ffn's globals drive make_inputs and bench
        bench_ffn.D, bench_ffn.H = 32, 48
        cases = [(48, 3.0, None)] + ([(48, 3.0, shape)] if shape else [])
        config = ops.SparseFFNConfig(tile=16, slots=8, ell_width=16, transpose_ell_width=32)
    else:
        bench_ffn.sanity()
        cases = [(m, k, None) for m in (16384, 2048, 65536) for k in SYNTHETIC_K]
        if args.quick:
            cases = [(16384, k, None) for k in SYNTHETIC_K]
        if args.cases:
            cases = [(m, k, None) for m, k in args.cases]
        if shape is not None:  # after the uniform cases at the same k (a cut-short run keeps them)
            at = max((i + 1 for i, (_, k, _) in enumerate(cases) if k in SHAPED_K), default=len(cases))
            cases[at:at] = [(16384, k, shape) for k in SHAPED_K]
        config = with_sweep_overrides(ops.SparseFFNConfig(), args)
    if shape is not None:
        out.results["shape"] = shape.to_json()
        out.say(f"[bench_ffn_train] trained-like pattern: {patterns.describe(shape)}")
    d, h = bench_ffn.D, bench_ffn.H
    table = [f"{'M':>6} {'k':>5} " + " ".join(f"{b:>16}" for b in BACKENDS)]
    mem_table, piece_table, trace_table, sweep_lines, fwd_table, bound_table = [], [], [], [], [], []
    key = jax.random.PRNGKey(0)
    # The GPU's bounds for the pieces (bench/bounds.py), at the first case's M and k.
    try:
        bounds = bench_bounds.measure_bounds(functools.partial(bench_ffn.bench, repeats=args.repeats),
                                             cases[0][0], d, h, max(1, round(cases[0][1])),
                                             hbm_bytes=1 << (16 if interpret else 30), interpret=interpret)
        out.results["bounds"] = bounds
        out.say("[bench_ffn_train] bounds: " + ", ".join(f"{k} {v:.4g}" for k, v in bounds.items()))
    except Exception as e:  # reported; the cases still run, without the attainment columns
        bounds = None
        out.results["bounds"] = dict(error=repr(e)[:500])
    if args.sweep_blocks:
        # At the first case (M 16384, k 29 uniform; the dry run: the tiny one), or with --shape at
        # the first trained-like case.
        m, k, sweep_shape = next((c for c in cases if c[2] is not None), cases[0]) if shape else cases[0]
        out.say(f"[bench_ffn_train] --sweep-blocks at M {m} k {k:.0f}"
                + ("" if sweep_shape is None else " (trained-like)"))
        try:
            xs, wg, wu, wd = synthetic_inputs(jax.random.fold_in(key, m), m, k, sweep_shape)
            gy = fixed_cotangent(jax.random.fold_in(key, 7), m, d, bench_ffn.DTYPE)
            sweep = sweep_block_sizes(xs[0], (wg, wu, wd), gy, config, interpret,
                                      TOKEN_SWEEP_DRY if interpret else TOKEN_SWEEP,
                                      NEURON_SWEEP_DRY if interpret else NEURON_SWEEP,
                                      PACK_SWEEP_DRY if interpret else PACK_SWEEP,
                                      FFN_SWEEP_DRY if interpret else FFN_SWEEP,
                                      repeats=args.repeats, log=out.say, kernels=args.sweep_blocks)
            out.log(dict(kind="sweep_blocks", m=m, k=k, d=d, h=h,
                         synthetic="uniform" if sweep_shape is None else "trained_like", **sweep))
            sweep_lines = ["", f"=== launch sweeps, M={m} k={k:.0f}{'' if sweep_shape is None else ' trained-like'} "
                               f"D={d} H={h} ==="]
            for kernel_name in args.sweep_blocks:
                sweep_lines += sweep_table(kernel_name, sweep[kernel_name])
            if "xla_gate_ms" in sweep:
                sweep_lines.append(f"  XLA relu(x W_gate^T), bf16 out, same inputs: {sweep['xla_gate_ms']:.3f} ms")
        except Exception as e:  # reported; the cases still run
            out.log(dict(kind="sweep_blocks", m=m, k=k, error=repr(e)[:500]))
            sweep_lines = ["", f"--sweep-blocks error: {repr(e)[:200]}"]
    for m, k, case_shape in cases:
        synthetic = "uniform" if case_shape is None else "trained_like"
        label = f"{k:>4.0f}{'' if case_shape is None else 't'}"  # t: the trained-like pattern
        out.say(f"[bench_ffn_train] M {m} k {k:.0f} {synthetic}")
        try:
            xs, wg, wu, wd = synthetic_inputs(jax.random.fold_in(key, m), m, k, case_shape)
            gy = fixed_cotangent(jax.random.fold_in(key, 7), m, d, bench_ffn.DTYPE)
            backends = [b for b in BACKENDS if not (b == "reference" and m > 16384)
                        and not (interpret and b in DRY_RUN_SKIPPED)]
            row = dict(kind="train", k=k, synthetic=synthetic,
                       **measure(xs, (wg, wu, wd), gy, config, interpret, backends,
                                 seq_len=None if case_shape is None else case_shape.seq_len,
                                 repeats=args.repeats, trace=args.trace, log=out.say))
            if bounds:
                row["attainment"] = bench_bounds.attainment(
                    bench_bounds.piece_traffic(m, d, h, row["hint"], tile=config.tile, slots=config.slots,
                                               **entry_counts(row["pattern"], m)),
                    row["piece_ms"], bounds)
                bound_table.append(f"{m:>6} {label:>5} " + " ".join(
                    f"{name} {a['ms']:.3f}/{a['bound_ms']:.3f} ({a['fraction']:.0%})"
                    for name, a in row["attainment"].items()))
            out.log(row)
            ms = row["ms"]
            table.append(f"{m:>6} {label:>5} " + " ".join(
                f"{ms[b]:>8.3f} ({ms['xla_bf16'] / ms[b]:>4.2f}x)" if b in ms else f"{'-':>16}"
                for b in BACKENDS))
            fwd_table.append(f"{m:>6} {label:>5} " + " ".join(
                f"{row[key][b]:>7.3f} ({row[key]['xla_bf16'] / row[key][b]:>4.2f}x)"
                for key in ("fwd_ms", "infer_ms") for b in row[key]))
            mem_table.append(f"{m:>6} {label:>5} " + " ".join(
                f"{row['temp_mb'].get(b, float('nan')):>16.1f}" for b in BACKENDS))
            piece_table.append(f"{m:>6} {label:>5} " + " ".join(
                f"{name}={t:.3f}" for name, t in row["piece_ms"].items())
                + f"  tail_rows={row['token_tail_rows']} hot={row['hot_neurons']}"
                + f"  max|err| pallas dx={row['errors']['pallas']['dx']['max_abs']:.2e}"
                + f"  model pallas={row['model']['pallas_ms']:.3f}"
                + f"  top 1%/10% neurons hold {row['skew']['top1_entry_share']:.0%}/"
                  f"{row['skew']['top10_entry_share']:.0%} of entries")
            trace_table += trace_lines(f"M={m} k={label.strip()}", row)
        except Exception as e:  # a failing case is reported, the others still run
            out.log(dict(kind="train", m=m, k=k, synthetic=synthetic, error=repr(e)[:500]))
            table.append(f"{m:>6} {label:>5} error: {repr(e)[:200]}")
    out.finish(["", f"=== fwd+bwd ms (ratio = xla_bf16 / x), D={d} H={h}, {out.results['device']} ==="]
               + table
               + ["", "forward alone, ms (ratio = xla_bf16 / x): training (with the backward's residuals) "
                  "then inference, each " + " ".join(b for b in FORWARD_BACKENDS if b in BACKENDS)]
               + fwd_table + ["", "compiled temporary memory (MiB)"] + mem_table
               + ["", "Pallas pieces (ms)"] + piece_table
               + ["", "pieces against the GPU's bounds: ms / ms at the bound (share of the bound reached); "
                  "bench/bounds.py"] + bound_table + trace_table + sweep_lines)


def trace_lines(label: str, row: dict, top: int = 12) -> list[str]:
    """The --trace tables of one measured row (none without --trace)."""
    lines = []
    for key, what in (("trace", "fwd+bwd"), ("trace_fwd", "training forward"), ("trace_infer", "inference forward")):
        for backend, profile in row.get(key, {}).items():
            lines += ["", f"kernels of {backend}, {label} (per {what} call)"]
            lines += format_profile(KernelProfile.from_json(profile), top)
    return lines


def fixed_cotangent(key: jax.Array, m: int, d: int, dtype: Any) -> jax.Array:
    """The fixed random gy [M, D] (N(0, 1/M)): the backward's work depends on the pattern, not on gy."""
    return (jax.random.normal(key, (m, d), jnp.float32) / np.sqrt(m)).astype(dtype)


def checkpoint_config(run_op_config: dict, dry_run: bool) -> ops.SparseFFNConfig:
    """The op config the layers are measured with: the run's ffn_op_config (what its training step
    used) without a hint (auto gets the measured one) and without what load_run sets for inference
    (`INFERENCE_OP_CONFIG`: the NaN check back at its default, training's plans); tiny blocks in a
    dry run."""
    from twell_jax.inference.load import INFERENCE_OP_CONFIG

    if dry_run:
        return dry_run_config()
    dropped = {"expected_active_per_token", *INFERENCE_OP_CONFIG}
    fields = {k: v for k, v in run_op_config.items() if k not in dropped}
    return ops.SparseFFNConfig(**fields)


def with_sweep_overrides(config: ops.SparseFFNConfig, args) -> ops.SparseFFNConfig:
    """`config` with the sweep flags given (--transpose-ell-width: the hot-neuron threshold;
    --token-tail-chunk / --neuron-tail-chunk: the dense tails' block sizes); the configs'
    own validation rejects bad values."""
    if args.transpose_ell_width is not None:
        config = dataclasses.replace(config, transpose_ell_width=args.transpose_ell_width)
    chunks = {name: value for name, value in (("token_tail_chunk", args.token_tail_chunk),
                                              ("neuron_tail_chunk", args.neuron_tail_chunk))
              if value is not None}
    if chunks:
        bc = config.backward or pallas_backward.BackwardConfig()
        config = dataclasses.replace(config, backward=dataclasses.replace(bc, **chunks))
    return config


def run_checkpoint(args, out: "Output") -> None:
    from twell_jax.inference.load import load_run, validation_tokens

    interpret = args.dry_run
    if not interpret:
        bench_ffn.sanity()
    t0 = time.perf_counter()
    loaded = load_run(args.checkpoint, args.step, dtype=args.dtype)
    cfg = loaded.config
    layers = parse_layers(args.layers, cfg.model.n_layers)
    micro_batch = args.micro_batch or (2 if args.dry_run else 8)
    tokens = jnp.asarray(validation_tokens(args.checkpoint, micro_batch))[:, :-1]
    seq_len = tokens.shape[1]
    config = with_sweep_overrides(checkpoint_config(cfg.model.ffn_op_config, args.dry_run), args)
    out.results.update(source=f"checkpoint {args.checkpoint} step {loaded.step}", layers=layers,
                       micro_batch=micro_batch, seq_len=seq_len, dtype=args.dtype,
                       run_hints=list(cfg.model.ffn_expected_active or []), op_config=repr(config))
    out.say(f"[bench_ffn_train] {out.results['source']}: {cfg.model.n_layers} layers, D {cfg.model.d_model}, "
            f"H {cfg.model.d_ff}, {micro_batch} x {seq_len} validation tokens, {args.dtype}; layers {layers}; "
            f"loaded in {time.perf_counter() - t0:.1f} s")
    xs = capture_ffn_inputs(loaded.model, tokens, layers)
    out.say(f"[bench_ffn_train] captured the FFN inputs ({time.perf_counter() - t0:.1f} s)")
    m, d = xs[0].shape
    gy = fixed_cotangent(jax.random.PRNGKey(7), m, d, xs[0].dtype)
    summary = []
    for layer, x in zip(layers, xs):
        t_layer = time.perf_counter()
        out.say(f"[bench_ffn_train] layer {layer}")
        try:
            row = dict(kind="layer", layer=layer, **measure([x], ffn_weights(loaded.model, layer), gy, config,
                                                           interpret, [b for b in CHECKPOINT_BACKENDS if not (
                                                               interpret and b in DRY_RUN_SKIPPED)],
                                                           seq_len=seq_len,
                                                           repeats=args.repeats, trace=args.trace,
                                                           log=out.say))
        except Exception as e:  # a failing layer is reported, the others still run
            row = dict(kind="layer", layer=layer, error=repr(e)[:500])
        row["seconds"] = time.perf_counter() - t_layer
        summary.append(row)
        fits = [patterns.PatternShape.from_json(r["shape"]) for r in summary if "shape" in r]
        if fits:  # the layers' median shape so far: what `--shape RESULTS` takes
            out.results["shape_fit"] = dataclasses.replace(
                patterns.shape_of_layers(fits),
                source=f"median of the fits of layers {[r['layer'] for r in summary if 'shape' in r]} of "
                       f"{out.results['source']} ({m} validation tokens)").to_json()
        out.log(row)
        out.say(f"[bench_ffn_train] layer {layer} done in {row['seconds']:.1f} s "
                f"(total {time.perf_counter() - t0:.1f} s)")
    shape_lines = [f"  layer {r['layer']}: {patterns.describe(patterns.PatternShape.from_json(r['shape']))}; "
                   f"top 1%/10% neurons hold {r['skew']['top1_entry_share']:.0%}/{r['skew']['top10_entry_share']:.0%}"
                   for r in summary if "shape" in r]
    if "shape_fit" in out.results:
        shape_lines.append(f"  median: {patterns.describe(patterns.PatternShape.from_json(out.results['shape_fit']))}")
    out.finish(["", f"=== per layer, fwd+bwd on the layer's real x (ratio = xla_bf16 / x), M={m} D={d} "
                    f"H={cfg.model.d_ff}, {out.results['device']} ==="] + layer_table(summary)
               + ["", "pattern shape per layer (bench/patterns.py fit; --shape RESULTS takes the median)"]
               + shape_lines
               + [line for r in summary if "error" not in r for line in trace_lines(f"layer {r['layer']}", r)])


def layer_table(rows: Sequence[dict]) -> list[str]:
    """The short per-layer table printed last."""
    lines = [f"{'layer':>5} | {'k mean/max':>10} | {'tail rows':>9} | {'hot':>8} | {'xla ms':>7} | "
             f"{'pallas ms (ratio)':>17} | {'auto ms (ratio, plan)':>28} | {'top 3 pieces ms':<50} | model pallas ms"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layer']:>5} | error: {r['error'][:150]}")
            continue
        ms, st, plan = r["ms"], r["pattern"], r["model"]["auto_plan"]
        # Pieces the backward runs on this pattern (the 64-row block is a unit cost, not one of them).
        top = sorted(((n, t) for n, t in r["piece_ms"].items() if n != "token_tail_64_rows"),
                     key=lambda kv: -kv[1])[:3]
        pallas = f"{ms['pallas']:.3f} ({ms['xla_bf16'] / ms['pallas']:.2f}x)"
        auto = f"{ms['auto']:.3f} ({ms['xla_bf16'] / ms['auto']:.2f}x, {plan[0]}/{plan[1]})"
        pieces = ", ".join(f"{n} {t:.2f}" for n, t in top)
        # ">cap": more than the tail's capacity, so the whole call runs the dense backward.
        tail = f"{st['token_tail_rows']}" + (">cap" if st["token_fallback"] else "")
        hot = f"{st['hot_neurons']}" + (">cap" if st["neuron_fallback"] else "")
        lines.append(f"{r['layer']:>5} | {st['active_mean']:>5.1f}/{st['active_max']:<4} | "
                     f"{tail:>9} | {hot:>8} | {ms['xla_bf16']:>7.3f} | "
                     f"{pallas:>17} | {auto:>28} | {pieces:<50} | {r['model']['pallas_ms']:.3f}")
    return lines


class Output:
    """The JSON results (rewritten after each row) and the final table, under --out."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.results: dict = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                              "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "rows": []}

    def say(self, text: str) -> None:
        print(text, flush=True)

    def log(self, row: dict) -> None:
        self.results["rows"].append(row)
        print(json.dumps(row), flush=True)
        (self.dir / "bench_ffn_train.json").write_text(json.dumps(self.results, indent=1))

    def finish(self, lines: list[str]) -> None:
        print("\n".join(lines), flush=True)
        (self.dir / "bench_ffn_train.json").write_text(json.dumps(self.results, indent=1))
        (self.dir / "table.txt").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="synthetic: M = 16384 only (at k = 29, 39 (the paper's 0.5B), 16, 56, 110)")
    parser.add_argument("--cases", type=parse_cases, default=None, metavar="M:K,...",
                        help="synthetic: these (tokens M, active per token k) instead of the 3 x 3 "
                             "grid, e.g. 2048:29,65536:112 (to split the grid over several runs)")
    parser.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                        help="tiny shapes through the Pallas interpreter (CPU check of the script)")
    parser.add_argument("--checkpoint", default=None,
                        help="a trained run: measure its layers on their real FFN inputs (module doc)")
    parser.add_argument("--step", type=int, default=None, help="with --checkpoint: the step (default: newest)")
    parser.add_argument("--layers", default=None, help="with --checkpoint: e.g. 0,3,7 (default: every layer)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="with --checkpoint: validation sequences fed (default 8; 2 in a dry run)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="with --checkpoint: the compute dtype of x and the weights")
    parser.add_argument("--repeats", type=int, default=15, help="timed batches per median (5 calls each)")
    parser.add_argument("--token-tail-chunk", type=int, default=None,
                        help="BackwardConfig.token_tail_chunk (default: the config's)")
    parser.add_argument("--neuron-tail-chunk", type=int, default=None,
                        help="BackwardConfig.neuron_tail_chunk (default: the config's)")
    parser.add_argument("--transpose-ell-width", type=parse_hot_width, default=None,
                        help="SparseFFNConfig.transpose_ell_width, the entries above "
                             "which a neuron is hot: an int, or a fraction of the tokens such as 0.03 "
                             "(default: the config's)")
    parser.add_argument("--trace", action="store_true",
                        help="also the per-kernel GPU time of the xla_bf16, pallas and auto programs "
                             "(jax.profiler trace of the timed programs; twell_jax/bench/kernel_trace.py)")
    parser.add_argument("--sweep-blocks", nargs="?", const=",".join(SWEEP_KERNELS), default=None,
                        type=parse_sweep_kernels, metavar="KERNEL,...",
                        help="synthetic: also time kernels alone over their launch parameters at the "
                             "first case's shape, outputs compared bit for bit: token, neuron, pack, "
                             "ffn (default: all four)")
    parser.add_argument("--shape", type=load_shape, default=None, metavar="trained|FILE",
                        help="synthetic: also the trained-like pattern (bench/patterns.py) at k "
                             + "/".join(f"{k:.0f}" for k in SHAPED_K) + ": 'trained' = patterns.TRAINED_LIKE, "
                             "or a JSON PatternShape / a --checkpoint run's bench_ffn_train.json (its median fit)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error("--micro-batch must be >= 1")
    if not args.checkpoint and (args.step is not None or args.layers or args.micro_batch):
        parser.error("--step, --layers and --micro-batch need --checkpoint")
    if args.dry_run and not args.checkpoint and any(
            v is not None for v in (args.token_tail_chunk, args.neuron_tail_chunk, args.transpose_ell_width)):
        parser.error("--token-tail-chunk, --neuron-tail-chunk and --transpose-ell-width are for the GPU run "
                     "(the synthetic dry run has its own tiny config)")
    if args.checkpoint and args.quick:
        parser.error("--quick is for the synthetic mode")
    if args.checkpoint and args.cases:
        parser.error("--cases is for the synthetic mode")
    if args.quick and args.cases:
        parser.error("--quick and --cases both choose the cases: give one")
    if args.dry_run and args.cases:
        parser.error("--cases is for the GPU run (the dry run has its own tiny case)")
    if args.checkpoint and args.sweep_blocks:
        parser.error("--sweep-blocks is for the synthetic mode")
    if args.checkpoint and args.shape:
        parser.error("--shape is for the synthetic mode (a --checkpoint run fits the shape of its layers)")
    if args.dry_run:
        bench_ffn.INTERPRET = True  # one timed call per measurement
    out = Output(Path(args.out))
    if args.checkpoint:
        run_checkpoint(args, out)
    else:
        run_synthetic(args, out)


if __name__ == "__main__":
    main()
