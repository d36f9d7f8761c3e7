"""Token-major backward kernel (Pallas, Triton backend): packed gate (TwELL) -> dx and per-entry values.

For every token i and every stored active neuron j of its TwELL pack (slot < min(count, S)):

    gated:      u = x_i . U_j          h = round(a * u)       (a = packed relu(gate) value)
                dt = gy_i . W_j + l1_scale * sign(h)
                dr = dt * a  (grad of the up activation)   dg = dt * u  (grad of the gate pre-activation)
                dx_i += dr U_j + dg G_j
                entry values (t, d_up, d_gate) = (h, dr, dg)
    non-gated:  h = a                  dt = gy_i . W_j + l1_scale * sign(h)
                dx_i += dt G_j         entry values (t, d_act) = (h, dt)

`round` is the activation dtype (the dense formula rounds h to x's dtype before the down
projection and the L1 norm). G is the packed ("act") weight: the gate weight gated, the op's up
weight non-gated (its relu gives the pattern); U the up weight beside the gate (gated only), W the
down weight, all neuron-major [H, D]. The per-entry values are written in a token-major ELL of
width `width` (slot = rank of the entry in the token's row: tiles ascending, slots ascending), with
the neuron ids in `cols`, for the weight-gradient pass (twell_bwd_neuron.py, after a transpose).

One program handles `block_t` tokens: x_i and gy_i stay in registers, dx_i accumulates in fp32
registers, each active neuron costs one gather of the rows it needs (W_j, U_j, G_j gated; W_j,
G_j non-gated), each read once. The ELL rows are assembled in [block_t, width] register tiles and
written with one block store (the pack kernel's trick): no scatter, no atomics.

The caller guarantees that every row has at most `width` stored entries and no overflowing tile
(rows that do not are handled by the dense token tail: pass their counts as 0). All arithmetic is
fp32 ("tensor-core exact"), dx is rounded once to x's dtype.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (check_launch_sizes, compiler_params, is_pow2 as _is_pow2,
                                   next_pow2 as _next_pow2, pad_rows, round_up, validate_packed_operands)




@dataclasses.dataclass(frozen=True)
class TokenBwdBlockSizes:
    """Static launch parameters of the token-major backward kernel."""

    # Like the forward's fused kernel (BENCHMARKS.md): one token per program, 4 warps. Not yet
    # tuned on a GPU (experiments/bench_ffn_train.py --sweep-blocks).
    block_t: int = 1  # token rows per program (power of two)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # pipelining depth of the slot loop (dynamic trip counts: 1 = none)

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_t) or self.block_t > 64:
            raise ValueError(f"TokenBwdBlockSizes.block_t must be a power of two <= 64, got {self.block_t}")
        check_launch_sizes(self)


def _token_bwd_kernel(*refs, gated: bool, slots: int, n_tiles: int, d: int, d_block: int,
                      width: int, h_dtype) -> None:
    """Refs: x, gy [BT, D], counts [BT, NT], values/indices [BT, NT, S], w_act, (w_up), w_down
    [H, D], l1_scale [1]; outputs dx [BT, D], cols [BT, W] int32, then 3 (gated: t, d_up, d_gate)
    or 2 (t, d_act) f32 [BT, W] value tiles."""
    if gated:
        (x_ref, gy_ref, counts_ref, values_ref, indices_ref, w_act_ref, w_up_ref, w_down_ref,
         scale_ref, dx_ref, cols_ref, *entry_refs) = refs
    else:
        (x_ref, gy_ref, counts_ref, values_ref, indices_ref, w_act_ref, w_down_ref,
         scale_ref, dx_ref, cols_ref, *entry_refs) = refs
        w_up_ref = None
    block_t = x_ref.shape[0]
    col_D = lax.broadcasted_iota(jnp.int32, (d_block,), 0)
    col_ok_1xD = (col_D < d)[None, :]
    col_1xD = col_D[None, :]
    full_d = d == d_block

    def load_own(ref):
        return plgpu.load(ref.at[:, pl.ds(0, d_block)], mask=None if full_d else col_ok_1xD,
                          other=None if full_d else 0).astype(jnp.float32)

    x_BTxD = load_own(x_ref)
    gy_BTxD = load_own(gy_ref)
    l1_scale = jnp.sum(scale_ref[...])  # a [1] block: sum -> scalar (value slicing is not lowered)
    slot_BTxW = lax.broadcasted_iota(jnp.int32, (block_t, width), 1)

    def gather(ref, j_BT, live_BT):
        # Masked-off rows move no bytes; `other=0` keeps the products below finite.
        return plgpu.load(ref.at[j_BT[:, None], col_1xD], mask=live_BT[:, None] & col_ok_1xD,
                          other=0).astype(jnp.float32)

    def tile_step(t, carry):
        dx_BTxD, pos_BT, cols_BTxW, entries = carry
        count_BT = jnp.minimum(plgpu.load(counts_ref.at[:, t]), slots)

        def slot_step(k, carry):
            dx_BTxD, pos_BT, cols_BTxW, entries = carry
            live_BT = k < count_BT
            j_BT = plgpu.load(indices_ref.at[:, t, k])
            a_BT = plgpu.load(values_ref.at[:, t, k]).astype(jnp.float32)
            w_rows = gather(w_down_ref, j_BT, live_BT)
            act_rows = gather(w_act_ref, j_BT, live_BT)
            dt_BT = jnp.sum(gy_BTxD * w_rows, axis=1)
            if gated:
                up_rows = gather(w_up_ref, j_BT, live_BT)
                u_BT = jnp.sum(x_BTxD * up_rows, axis=1)
                h_BT = (a_BT * u_BT).astype(h_dtype).astype(jnp.float32)
            else:
                h_BT = a_BT
            dt_BT = jnp.where(live_BT, dt_BT + l1_scale * jnp.sign(h_BT), 0.0)
            if gated:
                d_up_BT, d_gate_BT = dt_BT * a_BT, dt_BT * u_BT
                dx_BTxD = (dx_BTxD + d_up_BT[:, None] * up_rows + d_gate_BT[:, None] * act_rows)
                new_values = (h_BT, d_up_BT, d_gate_BT)
            else:
                dx_BTxD = dx_BTxD + dt_BT[:, None] * act_rows
                new_values = (h_BT, dt_BT)
            hit_BTxW = (slot_BTxW == pos_BT[:, None]) & live_BT[:, None]
            cols_BTxW = jnp.where(hit_BTxW, j_BT[:, None], cols_BTxW)
            entries = tuple(jnp.where(hit_BTxW, v_BT[:, None], e_BTxW)
                            for v_BT, e_BTxW in zip(new_values, entries))
            return dx_BTxD, pos_BT + live_BT.astype(jnp.int32), cols_BTxW, entries

        return lax.fori_loop(0, jnp.max(count_BT), slot_step, (dx_BTxD, pos_BT, cols_BTxW, entries))

    n_values = 3 if gated else 2
    init = (jnp.zeros((block_t, d_block), jnp.float32), jnp.zeros((block_t,), jnp.int32),
            jnp.zeros((block_t, width), jnp.int32),
            tuple(jnp.zeros((block_t, width), jnp.float32) for _ in range(n_values)))
    dx_BTxD, _, cols_BTxW, entries = lax.fori_loop(0, n_tiles, tile_step, init)
    plgpu.store(dx_ref.at[:, pl.ds(0, d_block)], dx_BTxD.astype(dx_ref.dtype),
                mask=None if full_d else jnp.broadcast_to(col_ok_1xD, dx_BTxD.shape))
    cols_ref[...] = cols_BTxW
    for ref, value_BTxW in zip(entry_refs, entries):
        ref[...] = value_BTxW


def validate_token_bwd_args(x_MxD, gy_MxD, values, indices, counts, w_act_HxD, w_up_HxD,
                            w_down_HxD, width: int) -> None:
    """Raise ValueError naming the offending argument."""
    validate_packed_operands(x_MxD, values, indices, counts)
    d = x_MxD.shape[1]
    if gy_MxD.shape != x_MxD.shape or gy_MxD.dtype != x_MxD.dtype:
        raise ValueError(f"gy_MxD must be {x_MxD.dtype}{x_MxD.shape} like x_MxD, got "
                         f"{gy_MxD.dtype}{gy_MxD.shape}")
    h = w_act_HxD.shape[0] if w_act_HxD.ndim == 2 else None
    for name, w in (("w_act_HxD", w_act_HxD), ("w_up_HxD", w_up_HxD), ("w_down_HxD", w_down_HxD)):
        if w is not None and (w.ndim != 2 or w.shape != (h, d) or w.dtype != x_MxD.dtype):
            raise ValueError(f"{name} must be {x_MxD.dtype}[H, D={d}] like w_act_HxD, got "
                             f"{w.dtype}{w.shape}")
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")


def _token_bwd_triton(x_MxD, gy_MxD, values, indices, counts, w_act_HxD, w_up_HxD, w_down_HxD,
                      scale_1, *, width: int, block_sizes: TokenBwdBlockSizes, interpret: bool,
                      debug: bool):
    m, d = x_MxD.shape
    n_tiles, slots = values.shape[1], values.shape[2]
    bt = block_sizes.block_t
    gated = w_up_HxD is not None
    kernel = functools.partial(_token_bwd_kernel, gated=gated, slots=slots, n_tiles=n_tiles, d=d,
                               d_block=_next_pow2(d), width=width, h_dtype=x_MxD.dtype)
    weights = (w_act_HxD, w_up_HxD, w_down_HxD) if gated else (w_act_HxD, w_down_HxD)
    n_values = 3 if gated else 2
    row_spec = pl.BlockSpec((bt, d), lambda i: (i, 0))
    ell_spec = pl.BlockSpec((bt, width), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        grid=(m // bt,),
        in_specs=[row_spec, row_spec,
                  pl.BlockSpec((bt, n_tiles), lambda i: (i, 0)),
                  pl.BlockSpec((bt, n_tiles, slots), lambda i: (i, 0, 0)),
                  pl.BlockSpec((bt, n_tiles, slots), lambda i: (i, 0, 0)),
                  *[pl.BlockSpec(w.shape, lambda i: (0, 0)) for w in weights],
                  pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=[row_spec, ell_spec, *[ell_spec] * n_values],
        out_shape=[jax.ShapeDtypeStruct((m, d), x_MxD.dtype),
                   jax.ShapeDtypeStruct((m, width), jnp.int32),
                   *[jax.ShapeDtypeStruct((m, width), jnp.float32)] * n_values],
        compiler_params=compiler_params(block_sizes),
        interpret=interpret,
        debug=debug,
        name="twell_bwd_token_gated" if gated else "twell_bwd_token",
    )(x_MxD, gy_MxD, counts, values, indices, *weights, scale_1)


@functools.partial(jax.jit, static_argnames=("width", "block_sizes", "interpret", "debug"))
def token_backward(x_MxD: jax.Array, gy_MxD: jax.Array, values: jax.Array, indices: jax.Array,
                   counts: jax.Array, w_act_HxD: jax.Array, w_up_HxD: jax.Array | None,
                   w_down_HxD: jax.Array, l1_scale: jax.Array, *, width: int,
                   block_sizes: TokenBwdBlockSizes = TokenBwdBlockSizes(), interpret: bool = False,
                   debug: bool = False) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """Token-major backward over a TwELL pack (module doc).

    Returns (dx [M, D] in x's dtype, cols [M, W] int32 neuron ids, entry values): (t, d_up, d_gate)
    gated or (t, d_act) when w_up_HxD is None, each f32 [M, W]; W = next_pow2(width) (Triton block
    shapes are powers of two); slots >= the row's stored count hold 0. Any M (padded to block_t).
    """
    validate_token_bwd_args(x_MxD, gy_MxD, values, indices, counts, w_act_HxD, w_up_HxD,
                            w_down_HxD, width)
    m = x_MxD.shape[0]
    # Padded rows have count 0: they read nothing and write zeros.
    x_MxD, gy_MxD, values, indices, counts = pad_rows(round_up(m, block_sizes.block_t), x_MxD, gy_MxD,
                                                      values, indices, counts)
    scale_1 = jnp.reshape(l1_scale.astype(jnp.float32), (1,))
    dx_MxD, cols_MxW, *entries = _token_bwd_triton(
        x_MxD, gy_MxD, values, indices, counts, w_act_HxD, w_up_HxD, w_down_HxD, scale_1,
        width=_next_pow2(width), block_sizes=block_sizes, interpret=interpret, debug=debug)
    return dx_MxD[:m], cols_MxW[:m], tuple(e[:m] for e in entries)


@functools.partial(jax.jit, static_argnames=("width",))
def token_backward_reference(x_MxD: jax.Array, gy_MxD: jax.Array, values: jax.Array,
                             indices: jax.Array, counts: jax.Array, w_act_HxD: jax.Array,
                             w_up_HxD: jax.Array | None, w_down_HxD: jax.Array,
                             l1_scale: jax.Array, *, width: int
                             ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """Plain-jnp version of `token_backward` (same slots read, fp32 arithmetic, same outputs)."""
    m, n_tiles, slots = values.shape
    width = _next_pow2(width)
    hi = lax.Precision.HIGHEST
    live_MxK = (jnp.arange(slots)[None, None, :] < jnp.minimum(counts, slots)[:, :, None]).reshape(m, -1)
    j_MxK = indices.reshape(m, -1)
    a_MxK = jnp.where(live_MxK, values.reshape(m, -1).astype(jnp.float32), 0.0)
    x32, gy32 = x_MxD.astype(jnp.float32), gy_MxD.astype(jnp.float32)
    act_rows = w_act_HxD.astype(jnp.float32)[j_MxK]  # [M, K, D]
    dt_MxK = jnp.einsum("md,mkd->mk", gy32, w_down_HxD.astype(jnp.float32)[j_MxK], precision=hi)
    if w_up_HxD is not None:
        up_rows = w_up_HxD.astype(jnp.float32)[j_MxK]
        u_MxK = jnp.einsum("md,mkd->mk", x32, up_rows, precision=hi)
        h_MxK = (a_MxK * u_MxK).astype(x_MxD.dtype).astype(jnp.float32)
    else:
        h_MxK = a_MxK
    dt_MxK = jnp.where(live_MxK, dt_MxK + l1_scale.astype(jnp.float32) * jnp.sign(h_MxK), 0.0)
    if w_up_HxD is not None:
        d_up_MxK, d_gate_MxK = dt_MxK * a_MxK, dt_MxK * u_MxK
        dx = (jnp.einsum("mk,mkd->md", d_up_MxK, up_rows, precision=hi)
              + jnp.einsum("mk,mkd->md", d_gate_MxK, act_rows, precision=hi))
        values_MxK = (h_MxK, d_up_MxK, d_gate_MxK)
    else:
        dx = jnp.einsum("mk,mkd->md", dt_MxK, act_rows, precision=hi)
        values_MxK = (h_MxK, dt_MxK)
    # Compact the live slots to the ELL row (rank = running count of live slots).
    slot_MxK = jnp.where(live_MxK, jnp.cumsum(live_MxK, axis=1, dtype=jnp.int32) - 1, width)
    rows_MxK = jnp.broadcast_to(jnp.arange(m)[:, None], slot_MxK.shape)

    def compact(v_MxK, dtype):
        return jnp.zeros((m, width), dtype).at[rows_MxK, slot_MxK].set(v_MxK.astype(dtype), mode="drop")

    cols = compact(jnp.where(live_MxK, j_MxK, 0), jnp.int32)
    return dx.astype(x_MxD.dtype), cols, tuple(compact(jnp.where(live_MxK, v, 0.0), jnp.float32)
                                               for v in values_MxK)
