"""Training glue of the Pallas kernels: the op-level sparse backward and the forward that keeps its residual.

The backward of gated_ffn / ffn (the formulas: docs/kernels.md, "Backward") over the hybrid ELL +
dense-tail format (docs/format.md), in this order:

    pattern      the forward's TwELL pattern of relu(x W_act^T) (kept as a small residual, `Kept`:
                 the values in rank order [M, W], not [M, NT, S]; or recomputed by pack_gate when
                 BackwardConfig.keep_gate_pattern is False)
    token tail   rows with an overflowing tile or more than config.ell_width actives (dense first
                 tokens): their counts are zeroed for the kernels
    transpose    pallas_kernels.twell_transpose.neuron_lists: a counting sort of the pattern into
                 neuron-major CSR lists (start, count per neuron; tokens ascending inside a
                 neuron) and each token entry's CSR position. Known now: the "hot" neurons (more
                 than config.hot_threshold(M) entries)
    one branch   the dense backward (a tail over its capacity), the kernels alone, or the kernels
                 after the dense tails:
    dense tails  token tail (exact dense backward of its rows) and hot-neuron tail (their columns
                 recomputed [M, C] at a time by GEMMs: weight gradients and dx terms), into f32
                 accumulators, so every gradient is rounded once
    lists        pallas_kernels.twell_bwd_token.token_lists: each token's non-hot entries with
                 their CSR positions
    token-major  pallas_kernels.twell_bwd_token.token_backward: dx, and per entry (t, dr, dg)
                 written at its CSR position
    neuron-major pallas_kernels.twell_bwd_neuron: dW_down, dW_up, dW_gate of the non-hot neurons,
                 starting from the tails' f32 contributions

Tails are sized on the device with no host sync: the tail rows (neurons) are listed by a
static-size `nonzero` and processed in blocks whose size and number come from the device-side
count (`_chunked`), so no tail costs nothing and a short one costs one small block (one branch
predicate; only a tail over one block of its chunk runs a loop). Beyond the
config's capacities (tail_capacity(M), transpose_tail_capacity(H)) the exact dense backward runs
for the call. Deterministic: fixed reduction orders, scatters to unique positions, no atomics.

The tail rule (which rows and neurons go to the dense tails, their capacities) is `TailPolicy`
(twell_jax/ops/tails.py); the cost of this backward, for "auto", is in `planner`. Its knobs:
`BackwardConfig` (pallas_config.py).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from twell_jax.pallas_kernels.twell_bwd_neuron import neuron_backward
from twell_jax.pallas_kernels.twell_bwd_token import (rank_values, token_backward,
                                            token_lists)
from twell_jax.pallas_kernels.common import next_pow2
from twell_jax.pallas_kernels.twell_transpose import chunk_histograms, neuron_ids, neuron_lists, pack_tile
from twell_jax.ops import pallas_forward
from twell_jax.ops.config import SparseFFNConfig
from twell_jax.ops.dense import dense_fallback_ffn, exact_precision
from twell_jax.ops.pallas_config import BackwardConfig
from twell_jax.ops.tails import TailPolicy

Weights = tuple[jax.Array, ...]
Pack = tuple[jax.Array, jax.Array, jax.Array]  # (values [M,NT,S], indices [M,NT,S], counts [M,NT])


class Kept(NamedTuple):
    """What the training forward keeps for the backward (keep_gate_pattern): the pattern, stored
    small, the kernels' a (and u, gated) in rank order ([M, W], not the pack's [M, NT, S]) and the
    transpose's first pass. 27 MB at M 16384, H 5632, S 32, W 128, bf16, u included (the pack as
    the forward made it, bf16 values and int32 indices and counts: 71 MB). The backward's kernels
    (the transpose, `token_lists`) read the offsets and counts as they are stored."""

    ranked: jax.Array   # [M, W] the kernels' entries' values in rank order (`sparse_ffn`'s ranked a)
    # [M, NT, S] uint8 neuron id - t * tile and [M, NT] int16 counts for tiles up to 256 lanes
    # (a count is at most the tile's lanes); for wider tiles the pack's int32 ids and counts (the
    # kernels take either: common.validate_pattern)
    offsets: jax.Array
    counts: jax.Array
    hist: jax.Array     # chunk_histograms of the kernels' entries, int32 [C, NT * tile]
    # Gated: [M, W] f32, each entry's u = x . U_j in rank order (`sparse_ffn`'s ranked u), so the
    # token-major backward reads u instead of gathering U_j for it; None non-gated.
    ranked_u: jax.Array | None = None

    @staticmethod
    def store(ranked: jax.Array, pack: Pack, hist: jax.Array, n_neurons: int,
              ranked_u: jax.Array | None = None) -> "Kept":
        _, indices, counts = pack
        tile = pack_tile(n_neurons, indices.shape[1])
        if tile <= 256:
            base = (jnp.arange(indices.shape[1], dtype=jnp.int32) * tile)[None, :, None]
            indices, counts = (indices - base).astype(jnp.uint8), counts.astype(jnp.int16)
        # Dead slots (past a tile's count) are never read; their offsets may wrap. The barrier
        # makes XLA materialise the small arrays here: without one it may fuse the narrowing into
        # the backward's readers and keep the pack's int32 indices (46 MB at M 16384) alive as the
        # residual instead. Seen on the H100 when this forward ran outside the op's NaN cond (larger
        # block temporaries without the barrier than with it); inside that cond, as now, both give
        # the same (BENCHMARKS.md, sixth day).
        return Kept(*jax.lax.optimization_barrier(
            (ranked, indices, counts, hist, ranked_u)))

    def pattern(self, n_neurons: int) -> tuple[jax.Array, jax.Array]:
        """(indices int32 [M, NT, S], counts int32 [M, NT]) as packed (in every live slot): the
        pack's form, for checks (the backward reads the stored form)."""
        return (neuron_ids(self.offsets, pack_tile(n_neurons, self.offsets.shape[1])),
                self.counts.astype(jnp.int32))


Aux = dict[str, jax.Array]



# ----------------------------------------------------------------------------------------------
# Forward with the residual the backward wants
# ----------------------------------------------------------------------------------------------

def ell_width_pow2(config: SparseFFNConfig) -> int:
    """The width W of the backward's per-token arrays (rank order, lists): config.ell_width rounded
    up to a power of two (`rank_values`' W)."""
    return next_pow2(config.ell_width)


def _split(gated: bool, weights: Weights) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(w_act, w_up or None, w_down): w_act is the weight whose relu gives the pattern."""
    return (weights[0], weights[1], weights[2]) if gated else (weights[0], None, weights[1])


def kernel_pattern(counts_MxNT: jax.Array, config: SparseFFNConfig) -> tuple[jax.Array, jax.Array]:
    """(tail_M, the counts the kernels see: zero on the token tail's rows): the token tail of the
    pack by the tail rule (`TailPolicy.pack_token_tail`)."""
    tail_M = TailPolicy(config).pack_token_tail(counts_MxNT)
    return tail_M, jnp.where(tail_M[:, None], 0, counts_MxNT)


def backward_tails(tail_M: jax.Array, hist_CxHp: jax.Array, h: int, config: SparseFFNConfig
                   ) -> tuple[jax.Array, jax.Array]:
    """(hot_H, over_capacity) of the backward by the tail rule (`TailPolicy`), from the token tail
    (tail_M) and the transpose's first pass over the kernels' counts (`chunk_histograms`): a
    neuron's entries exclude the token tail's rows; over_capacity = the backward runs the dense
    formula."""
    m = tail_M.shape[0]
    policy = TailPolicy(config)
    hot_H = policy.hot(jnp.sum(hist_CxHp, axis=0)[:h], m)
    over = policy.over_capacity(jnp.sum(tail_M, dtype=jnp.int32), jnp.sum(hot_H, dtype=jnp.int32), m, h)
    return hot_H, over


def forward(gated: bool, x_MxD: jax.Array, weights: Weights, config: SparseFFNConfig,
            interpret: bool, non_finite: jax.Array | None = None) -> tuple[jax.Array, Aux, Kept | None]:
    """The training forward: pack + fused FFN (pallas_forward) and (y, aux, what the backward keeps
    (the pattern and the transpose's first pass) or None: recomputed there).

    From the pattern, aux reports the backward's dense tails ("backward_tail_rows",
    "backward_hot_neurons") and "dense_fallback" also a backward that will run the dense formula
    because a tail exceeds its capacity. Finding the hot neurons is the transpose's first pass,
    which the backward then skips (when the pattern is kept).

    non_finite (the op's NaN/Inf flag): when set, y and aux are the dense formula's
    (`pallas_forward.sparse_forward`'s dense arm; no tails reported) and the backward, which gets
    the same flag, runs the dense formula: what is kept is then never read for values."""
    pallas_forward.require_runnable(interpret)
    w_act, w_up, w_down = _split(gated, weights)
    m, h = x_MxD.shape[0], w_act.shape[0]
    s = pallas_forward.settings(config, m)
    if m == 0:
        y, aux = dense_fallback_ffn(gated, x_MxD, weights, neuron_counts=s["neuron_counts"])
        return y, {**aux, "backward_tail_rows": jnp.zeros((), jnp.int32),
                   "backward_hot_neurons": jnp.zeros((), jnp.int32)}, None
    bc = config.backward or BackwardConfig()
    pack = pallas_forward.run_pack(x_MxD, w_act, s, interpret)
    # Kept: the fused FFN also writes its entries' values (and u, gated) in rank order, the order
    # of the backward's lists, so no pass of its own ranks them.
    y, aux, *ranked = pallas_forward.sparse_forward(
        x_MxD, w_act, w_up, w_down, s, interpret, pack=pack,
        ranked_width=ell_width_pow2(config) if bc.keep_gate_pattern else 0, non_finite=non_finite)
    tail_M, kernel_counts = kernel_pattern(pack[2], config)
    hist = transpose_histograms(pack[1], kernel_counts, h, config, interpret)
    hot_H, over = backward_tails(tail_M, hist, h, config)
    aux = dict(aux)
    aux["dense_fallback"] = jnp.maximum(aux["dense_fallback"], over.astype(jnp.int32))
    aux["backward_tail_rows"] = jnp.sum(tail_M, dtype=jnp.int32)
    aux["backward_hot_neurons"] = jnp.sum(hot_H, dtype=jnp.int32)
    if non_finite is not None:  # the dense formula's counters (dense.dense_aux)
        for key in ("backward_tail_rows", "backward_hot_neurons"):
            aux[key] = jnp.where(non_finite, 0, aux[key])
    if not bc.keep_gate_pattern:
        return y, aux, None
    ranked_a, ranked_u = ranked[0] if gated else (*ranked[0], None)
    return y, aux, Kept.store(ranked_a, pack, hist, h, ranked_u)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def tail_block_sizes(chunk: int, small_chunk: int) -> tuple[int, ...]:
    """The block sizes a tail may take: small_chunk, x4, x16, ... below `chunk`, then chunk / 2 and
    `chunk` (16 and 256: (16, 64, 128, 256); a tail of 65-128 hot neurons, common in trained
    layers, then runs half the columns of a 256 block)."""
    sizes = []
    size = small_chunk
    while size < chunk:
        sizes.append(size)
        size *= 4
    if chunk // 2 > (sizes[-1] if sizes else 0):
        sizes.append(chunk // 2)
    return (*sizes, chunk)


def _chunked(mask_N: jax.Array, capacity: int, chunk: int, small_chunk: int,
             body: Callable[[jax.Array, Any], Any], carry: Any) -> Any:
    """Run body(ids_C, carry) over the True positions of mask_N (ascending, at most `capacity`):
    in ONE block of the smallest of `tail_block_sizes(chunk, small_chunk)` that holds them all,
    or in blocks of `chunk`; ids past the last are len(mask_N) (callers drop them). ONE switch on
    the device-side count picks nothing (an empty mask), one block of a static size, or the loop
    over blocks of `chunk` (whose trip count is the only other device value the host reads): no
    host sync beyond those predicates, and a tail that fits one block costs one predicate (each
    device-side predicate of a conditional or a loop is a round trip to the host on the GPU, which
    leaves the GPU idle while the host catches up, measurably so in a lone FFN block)."""
    n = mask_N.shape[0]
    count = jnp.minimum(jnp.sum(mask_N, dtype=jnp.int32), capacity)

    def ids(size: int) -> jax.Array:  # the first `size` listed ids, padded with n
        ids_P = jnp.nonzero(mask_N, size=size, fill_value=n)[0].astype(jnp.int32)
        return jnp.where(jnp.arange(size) < count, ids_P, n)  # none past the capacity

    def one_block(size: int, carry: Any) -> Any:
        return body(ids(size), carry)

    def blocks(carry: Any) -> Any:
        ids_P = ids(max(chunk, -(-capacity // chunk) * chunk))

        def step(c, carry):
            return body(lax.dynamic_slice(ids_P, (c * chunk,), (chunk,)), carry)

        return lax.fori_loop(0, (count + chunk - 1) // chunk, step, carry)

    sizes = tail_block_sizes(chunk, small_chunk)
    branches = [lambda carry: carry, *(functools.partial(one_block, size) for size in sizes), blocks]
    which = jnp.where(count == 0, 0, 1 + jnp.sum(jnp.asarray(sizes, jnp.int32) < count, dtype=jnp.int32))
    return lax.switch(which, branches, carry)


def dense_rows_backward(gated: bool, x_RxD: jax.Array, gy_RxD: jax.Array, weights: Weights,
                        l1_scale: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Exact dense backward restricted to some rows (zero rows contribute nothing):
    (dx [R, D] f32, f32 weight-gradient contributions in weight order).

    Operands in x's dtype with fp32 accumulation, as XLA's dense backward computes them (the
    per-row values dt, dR, dG are rounded to x's dtype for the GEMMs that consume them, as it
    rounds them). The GEMMs are skinny ([R, D] x [D, H]) and read the weights whole: fp32 copies
    of the weights per block, as an earlier version of this function made, cost more than the GEMMs
    (a 256-row block on the H100; BENCHMARKS.md)."""
    w_act, w_up, w_down = _split(gated, weights)
    dtype, f32 = x_RxD.dtype, jnp.float32
    precision = exact_precision(dtype)  # f32: no TF32 beside the kernels' exact rows
    gy_RxD = gy_RxD.astype(dtype)

    def mm_t(a, w):  # a @ w.T
        return jnp.einsum("rd,hd->rh", a.astype(dtype), w.astype(dtype), preferred_element_type=f32,
                          precision=precision)

    def mm(a, w):  # a @ w
        return jnp.einsum("rh,hd->rd", a.astype(dtype), w.astype(dtype), preferred_element_type=f32,
                          precision=precision)

    def outer(a, b):  # a.T @ b
        return jnp.einsum("rh,rd->hd", a.astype(dtype), b, preferred_element_type=f32, precision=precision)

    g = mm_t(x_RxD, w_act)
    p = jax.nn.relu(g)
    on = g > 0
    if gated:
        u = mm_t(x_RxD, w_up)
        h = (p * u).astype(dtype).astype(f32)
    else:
        h = p.astype(dtype).astype(f32)
    # d|h|/dh as autodiff of jnp.abs takes it (+1 at 0, -1 for NaN): the same where it matters
    # (h != 0) and the dense formula's NaN propagation where inputs are not finite.
    dt = mm_t(gy_RxD, w_down) + l1_scale * jnp.where(h >= 0, 1.0, -1.0)
    if gated:
        # As autodiff of the dense formula: d_up = dt * relu(g) with no mask (an infinite dt times
        # a silent neuron's 0 is NaN there too: the NaN policy), d_gate through relu's select.
        d_up = dt * p
        d_gate = jnp.where(on, dt * u, 0.0)
        dx = mm(d_up, w_up) + mm(d_gate, w_act)
        return dx, (outer(d_gate, x_RxD), outer(d_up, x_RxD), outer(h, gy_RxD))
    d_act = jnp.where(on, dt, 0.0)
    return mm(d_act, w_act), (outer(d_act, x_RxD), outer(h, gy_RxD))


def blocked_dense_backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array,
                           gl1: jax.Array, block_rows: int) -> tuple[jax.Array, Weights]:
    """The exact dense backward (gradients of <gy, y> + gl1 * l1, as dense.dense_backward) in blocks
    of `block_rows` rows: each block's dx rows are final, its weight-gradient contributions go to
    f32 accumulators rounded once at the end. Memory: [block_rows, H] temporaries instead of
    [M, H] ones. What the Pallas backward runs when it cannot run its kernels (a tail over its
    capacity, a non-finite input): non-finite values propagate as in the dense formula."""
    m, d = x_MxD.shape
    dtype = x_MxD.dtype
    gy_MxD = gy_MxD.astype(dtype)
    l1_scale = gl1.astype(jnp.float32) / max(m, 1)
    n_full, rest = divmod(m, block_rows)

    def block(start, size: int, carry):
        dx, accs = carry
        x_RxD = lax.dynamic_slice_in_dim(x_MxD, start, size)
        gy_RxD = lax.dynamic_slice_in_dim(gy_MxD, start, size)
        dx_RxD, parts = dense_rows_backward(gated, x_RxD, gy_RxD, weights, l1_scale)
        return (lax.dynamic_update_slice_in_dim(dx, dx_RxD.astype(dtype), start, 0),
                tuple(acc + part for acc, part in zip(accs, parts)))

    carry = (jnp.zeros((m, d), dtype), tuple(jnp.zeros(w.shape, jnp.float32) for w in weights))
    if n_full:
        carry = lax.fori_loop(0, n_full, lambda i, c: block(i * block_rows, block_rows, c), carry)
    if rest:
        carry = block(n_full * block_rows, rest, carry)
    dx, accs = carry
    return dx, tuple(acc.astype(w.dtype) for acc, w in zip(accs, weights))


def token_tail_backward(gated: bool, x_MxD: jax.Array, gy_MxD: jax.Array, weights: Weights,
                        l1_scale: jax.Array, tail_M: jax.Array, capacity: int, chunk: int,
                        small_chunk: int, carry: tuple[jax.Array, tuple[jax.Array, ...]]
                        ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The dense token tail: the exact backward of the rows in tail_M (at most `capacity`, `chunk`
    rows per dense block). carry = (dx [M, D], f32 weight-gradient accumulators [H, D] in weight
    order): the tail rows' dx rows are set, their weight-gradient contributions added."""
    m = x_MxD.shape[0]

    def chunk_step(rows_C: jax.Array, carry):
        dx, inits = carry
        used_C = (rows_C < m)[:, None]
        safe_C = jnp.minimum(rows_C, m - 1)
        x_CxD = jnp.where(used_C, x_MxD[safe_C], 0)  # zero rows contribute nothing
        gy_CxD = jnp.where(used_C, gy_MxD[safe_C], 0)
        dx_CxD, contribs = dense_rows_backward(gated, x_CxD, gy_CxD, weights, l1_scale)
        return (dx.at[rows_C].set(dx_CxD.astype(dx.dtype), mode="drop"),
                tuple(a + b for a, b in zip(inits, contribs)))

    return _chunked(tail_M, capacity, chunk, small_chunk, chunk_step, carry)


def hot_neuron_backward(gated: bool, x_MxD: jax.Array, gy_MxD: jax.Array, weights: Weights,
                        l1_scale: jax.Array, tail_M: jax.Array, hot_H: jax.Array, capacity: int,
                        chunk: int, small_chunk: int, carry: tuple[jax.Array, tuple[jax.Array, ...]]
                        ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The dense neuron tail: everything the hot neurons (hot_H, at most `capacity`, `chunk` per
    block) contribute over the rows NOT in the token tail (tail_M: those rows' contributions come
    from `token_tail_backward`). carry = (dx [M, D] f32, f32 weight-gradient accumulators [H, D] in
    weight order): their dx terms and their weight gradients are added.

    Each block recomputes its neurons' columns with dense GEMMs, [M, chunk] at a time (g, u and
    dt = gy . W_j + l1 term), then dW_j = t^T gY, dU_j = dR^T X, dG_j = dG^T X and dx += dR U_C +
    dG G_C: the dense formula restricted to those columns. Hot neurons fire on hundreds to
    thousands of tokens (most of a trained layer's entries), so their columns are dense enough
    for GEMMs, and the token-major kernel skips their entries (no row gathers).
    Operands in x's dtype with fp32 accumulation, like XLA's dense backward: the GEMMs are skinny
    ([M, D] x [D, chunk]) and read x and gy whole, so fp32 copies of them would double the bytes.
    The per-column values (dR, dG, t) are rounded to x's dtype for the GEMMs, as the dense backward
    rounds them. The columns' pattern is g > 0 of this GEMM, not the pack's (the kernels' fp32
    sums in another order): the two can differ only where g rounds to about 0, where the dense
    backward is as ambiguous."""
    h = hot_H.shape[0]
    w_act, w_up, w_down = _split(gated, weights)
    dtype, f32 = x_MxD.dtype, jnp.float32
    precision = exact_precision(dtype)  # f32: no TF32 beside the kernels' exact rows
    keep_M1 = ~tail_M[:, None]

    def chunk_step(hot_C: jax.Array, carry):
        dx_MxD, inits = carry
        c = hot_C.shape[0]
        used_C = hot_C < h  # padding ids (= H) read row H - 1 and contribute nothing
        safe_C = jnp.minimum(hot_C, h - 1)
        # Weights that meet the same operand are stacked, so x and gy are each read once per
        # GEMM kind: x [G_C; U_C]^T, gy W_C^T, then [dG | dU]^T x, t^T gy and [dU | dG] [U_C; G_C].
        x_ws = jnp.concatenate([w_act[safe_C], w_up[safe_C]], axis=0) if gated else w_act[safe_C]
        g_u = jnp.einsum("md,cd->mc", x_MxD, x_ws.astype(dtype), preferred_element_type=f32, precision=precision)
        g_MxC = g_u[:, :c]
        on_MxC = (g_MxC > 0) & keep_M1 & used_C[None, :]
        p_MxC = jnp.where(on_MxC, g_MxC, 0.0)
        if gated:
            u_MxC = g_u[:, c:]
            h_MxC = (p_MxC * u_MxC).astype(dtype).astype(f32)
        else:
            h_MxC = p_MxC.astype(dtype).astype(f32)
        gy_w = jnp.einsum("md,cd->mc", gy_MxD, w_down[safe_C].astype(dtype), preferred_element_type=f32,
                          precision=precision)
        dt_MxC = jnp.where(on_MxC, gy_w + l1_scale * jnp.sign(h_MxC), 0.0)
        if gated:
            d_gate, d_up = (dt_MxC * u_MxC).astype(dtype), (dt_MxC * p_MxC).astype(dtype)
            x_cols = jnp.concatenate([d_gate, d_up], axis=1)  # -> dG_C, dU_C
            # dx += dR U_C + dG G_C as ONE GEMM over the stacked columns: one f32 [M, D] pass.
            dx_cols = jnp.concatenate([d_up, d_gate], axis=1)
            dx_ws = jnp.concatenate([w_up[safe_C], w_act[safe_C]], axis=0)
        else:
            x_cols = dt_MxC.astype(dtype)  # -> dG_C (the act weight)
            dx_cols, dx_ws = x_cols, w_act[safe_C]
        dx_MxD = dx_MxD + jnp.einsum("mc,cd->md", dx_cols, dx_ws.astype(dtype), preferred_element_type=f32,
                                     precision=precision)
        from_x = jnp.einsum("mc,md->cd", x_cols, x_MxD, preferred_element_type=f32, precision=precision)
        d_down = jnp.einsum("mc,md->cd", h_MxC.astype(dtype), gy_MxD, preferred_element_type=f32, precision=precision)
        parts = (from_x[:c], from_x[c:], d_down) if gated else (from_x, d_down)  # weight order
        return dx_MxD, tuple(init.at[hot_C].add(part, mode="drop") for init, part in zip(inits, parts))

    return _chunked(hot_H, capacity, chunk, small_chunk, chunk_step, carry)


# The kernels' calls, as the op runs them (one place: `forward`, `backward` and the benchmark's
# per-piece timings, twell_jax/bench/ffn_train.py, call these).

def transpose_histograms(indices: jax.Array, kernel_counts: jax.Array, n_neurons: int,
                         config: SparseFFNConfig, interpret: bool) -> jax.Array:
    """The transpose's first pass (`chunk_histograms`), int32 [C, NT * tile]: in the training
    forward on the pack's pattern (int32 ids and the kernels' counts), kept for the backward; in
    the backward only when the pattern is recomputed."""
    bc = config.backward or BackwardConfig()
    return chunk_histograms(indices, kernel_counts, n_neurons, block_sizes=bc.transpose_block_sizes,
                            interpret=interpret)


def transpose_lists(indices: jax.Array, kernel_counts: jax.Array, hist: jax.Array, n_neurons: int,
                    config: SparseFFNConfig, interpret: bool
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The transpose's second pass: the neuron-major lists (start_H, count_H, tokens_E, dest_MxW)
    from the pattern as the backward holds it (the kept uint8 offsets and int16 counts, or the
    recomputed pack's int32; the kernels read either as it is) and the first pass's histograms.
    padded: tokens_E and dest as the kernel wrote them (its consumers, `token_major` and
    `neuron_major`, read only the lists; a slice would copy them)."""
    bc = config.backward or BackwardConfig()
    return neuron_lists(indices, kernel_counts, n_neurons, width=config.ell_width, hist=hist,
                        padded=True, block_sizes=bc.transpose_block_sizes, interpret=interpret)


def token_major(gated: bool, x_MxD: jax.Array, gy_MxD: jax.Array, weights: Weights,
                l1_scale: jax.Array, ranked: jax.Array, ranked_u: jax.Array | None,
                indices: jax.Array, kernel_counts: jax.Array, dest_MxW: jax.Array,
                hot_H: jax.Array | None, dx_init: jax.Array | None, config: SparseFFNConfig,
                interpret: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The token-major piece: each token's non-hot entries (`token_lists`, on the pattern as the
    backward holds it, with the pack's tile for uint8 offsets, and `transpose_lists`' padded dest),
    then the kernel (`token_backward`). ranked_u None: the kernel computes u (the pattern
    recomputed). Returns (dx_MxD, values_E: the per-entry values at their CSR positions, padded:
    `neuron_major` takes them so)."""
    bc = config.backward or BackwardConfig()
    w_act, w_up, w_down = _split(gated, weights)
    n_M, cols, a, pos, *u = token_lists(ranked, indices, kernel_counts, dest_MxW, hot_H,
                                        ranked_u_MxW=ranked_u,
                                        tile=pack_tile(w_act.shape[0], indices.shape[1]),
                                        block_sizes=bc.lists_block_sizes, interpret=interpret)
    return token_backward(x_MxD, gy_MxD, n_M, cols, a, pos, w_act, w_up, w_down, l1_scale,
                          dx_init=dx_init, u_MxW=u[0] if u else None, padded=True,
                          block_sizes=bc.token_block_sizes, interpret=interpret)


def neuron_major(x_MxD: jax.Array, gy_MxD: jax.Array, start_H: jax.Array, kernel_count_H: jax.Array,
                 tokens_E: jax.Array, values_E: tuple[jax.Array, ...],
                 inits: tuple[jax.Array, ...] | None, config: SparseFFNConfig, interpret: bool
                 ) -> tuple[jax.Array, ...]:
    """The neuron-major piece (`neuron_backward`, its launch order by `longest_first_order`) on
    the padded lists and values: the weight gradients of the neurons with a count (the hot ones
    zeroed by the caller), from the tails' f32 `inits` when there are tails."""
    bc = config.backward or BackwardConfig()
    return neuron_backward(x_MxD, gy_MxD, start_H, kernel_count_H, tokens_E, values_E, inits,
                           block_sizes=bc.neuron_block_sizes, interpret=interpret)


def backward(gated: bool, x_MxD: jax.Array, weights: Weights, gy_MxD: jax.Array, gl1: jax.Array,
             config: SparseFFNConfig, interpret: bool, kept: Kept | Pack | None,
             dense_backward: Callable[[], tuple[jax.Array, Weights]],
             non_finite: jax.Array | None = None) -> tuple[jax.Array, Weights]:
    """Gradients of <gy, y> + gl1 * l1 (module doc). `kept` = what `forward` kept (`Kept`), a
    pack, or None (recomputed); `dense_backward()` = the op's exact dense backward, run when a
    tail capacity is exceeded or when `non_finite` (the op's NaN/Inf flag: it joins the one
    branch's predicate, so the NaN policy costs no host round trip of its own). Returns (dx in x's
    dtype, weight gradients in weight order and dtype)."""
    pallas_forward.require_runnable(interpret)
    bc = config.backward or BackwardConfig()
    w_act = weights[0]  # the weight whose relu gives the pattern (`_split`)
    m, d = x_MxD.shape
    h = w_act.shape[0]
    if m == 0:
        return dense_backward()
    slots = config.slots
    hist = ranked = values = ranked_u = None
    if isinstance(kept, Kept):
        # The stored pattern as it is (uint8 offsets, int16 counts): the kernels read it so.
        indices, counts, hist, ranked = kept.offsets, kept.counts, kept.hist, kept.ranked
        ranked_u = kept.ranked_u
    else:
        if kept is None:
            kept = pallas_forward.run_pack(x_MxD, w_act, pallas_forward.settings(config, m), interpret)
        values, indices, counts = kept
    gy_MxD = gy_MxD.astype(x_MxD.dtype)
    l1_scale = gl1.astype(jnp.float32) / m
    tail_M, kernel_counts = kernel_pattern(counts, config)
    if ranked is None:
        ranked = rank_values(values, kernel_counts, config.ell_width, block_sizes=bc.lists_block_sizes,
                             interpret=interpret)
    if hist is None:
        hist = transpose_histograms(indices, kernel_counts, h, config, interpret)
    hot_H, over_capacity = backward_tails(tail_M, hist, h, config)
    n_tail = jnp.sum(tail_M, dtype=jnp.int32)
    n_hot = jnp.sum(hot_H, dtype=jnp.int32)

    # The neuron-major lists come from the pattern alone, so the hot neurons are known before the
    # token-major kernel runs, and it writes its values straight to their positions. They are built
    # before the one branch below (also when it picks the dense backward), so the program reads one
    # device-side predicate instead of three (each conditional copies its predicate to the host).
    start_H, count_H, tokens_E, dest_MxW = transpose_lists(indices, kernel_counts, hist, h, config,
                                                           interpret)
    kernel_count_H = jnp.where(hot_H, 0, count_H)

    def kernels(hot: jax.Array | None, dx_init: jax.Array | None,
                inits: tuple[jax.Array, ...] | None) -> tuple[jax.Array, Weights]:
        dx_MxD, values_E = token_major(gated, x_MxD, gy_MxD, weights, l1_scale, ranked, ranked_u,
                                       indices, kernel_counts, dest_MxW, hot, dx_init, config,
                                       interpret)
        grads = neuron_major(x_MxD, gy_MxD, start_H, kernel_count_H, tokens_E, values_E, inits,
                             config, interpret)
        return dx_MxD, grads

    def no_tails() -> tuple[jax.Array, Weights]:
        return kernels(None, None, None)

    def with_tails() -> tuple[jax.Array, Weights]:
        # The tails' dx terms (f32, added before the token kernel's one rounding) and weight
        # gradients (f32 inits of the neuron-major kernel's accumulators).
        carry = (jnp.zeros((m, d), jnp.float32), tuple(jnp.zeros((h, d), jnp.float32) for _ in weights))
        carry = token_tail_backward(gated, x_MxD, gy_MxD, weights, l1_scale, tail_M,
                                    config.tail_capacity(m), bc.token_tail_chunk,
                                    bc.small_tail_chunk, carry)
        dx_init, inits = hot_neuron_backward(gated, x_MxD, gy_MxD, weights, l1_scale, tail_M, hot_H,
                                             config.transpose_tail_capacity(h),
                                             bc.neuron_tail_chunk, bc.small_tail_chunk, carry)
        return kernels(hot_H, dx_init, inits)

    dense = over_capacity if non_finite is None else over_capacity | non_finite
    branch = jnp.where(dense, 0, jnp.where((n_tail > 0) | (n_hot > 0), 2, 1))
    dx, grads = lax.switch(branch, (dense_backward, no_tails, with_tails))
    return dx.astype(x_MxD.dtype), tuple(g.astype(w.dtype) for g, w in zip(grads, weights))
