"""What each Pallas piece of the sparse FFN moves, and how close it runs to what the GPU allows.

Two measured bounds, timed in the benchmark's own process (`measure_bounds`):
  * the row-gather rate: `gather_probe`, a Pallas kernel that does nothing but what the per-token
    kernels do at their core (one program per token, for each of its k random row indices load a
    D-wide bf16 row of a table and add it to a register accumulator, write the sum). The table
    holds `tables` weights of [H, D] (the fused FFN's and the dx launch's U and W: 2; one for the
    entries launch), so it is read from the L2 cache as theirs are: what a design that reads one
    weight row per (token, active neuron) can reach at best;
  * the HBM rate: XLA's `x + 1` over a 1 GiB bf16 array (a read and a write of every byte);
  * for the pack (a GEMM, not a gather): XLA's relu(x W_gate^T) with a bf16 output, same shapes.

`piece_traffic` is the byte model of each piece (`bench_ffn_train`'s piece_ms names) at a mean of k
active neurons per token: the rows it gathers (bound by the gather rate) and the bytes it streams
from or to HBM (bound by the HBM rate). `attainment` turns both into the time at the bounds and
the fraction of it a measured time reaches (1.0 = at the bound).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from twell_jax.pallas_kernels.common import is_pow2, next_pow2


def _gather_kernel(idx_ref, table_ref, out_ref, *, k: int, d: int) -> None:
    d_block = next_pow2(d)
    col = lax.broadcasted_iota(jnp.int32, (d_block,), 0)
    ok = col < d
    zero = jnp.int32(0)  # a traced index: refs reject Python ints

    def step(s, acc):
        j = idx_ref[zero, s]
        row = plgpu.load(table_ref.at[j, pl.ds(0, d_block)], mask=None if d == d_block else ok,
                         other=None if d == d_block else 0)
        return acc + row.astype(jnp.float32)

    acc = lax.fori_loop(0, k, step, jnp.zeros((d_block,), jnp.float32))
    plgpu.store(out_ref.at[zero, pl.ds(0, d_block)], acc.astype(out_ref.dtype),
                mask=None if d == d_block else ok)


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def gather_probe(table_RxD: jax.Array, idx_MxK: jax.Array, *, num_warps: int = 4,
                 interpret: bool = False) -> jax.Array:
    """out[t] = sum_s table[idx[t, s]] (fp32 sum, table's dtype out): one program per token."""
    if table_RxD.ndim != 2 or idx_MxK.ndim != 2 or idx_MxK.dtype != jnp.int32:
        raise ValueError(f"gather_probe wants table [R, D] and int32 idx [M, K], got {table_RxD.shape} "
                         f"and {idx_MxK.dtype}{idx_MxK.shape}")
    if not is_pow2(num_warps):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    m, k = idx_MxK.shape
    d = table_RxD.shape[1]
    return pl.pallas_call(
        functools.partial(_gather_kernel, k=k, d=d),
        grid=(m,),
        in_specs=[pl.BlockSpec((1, k), lambda i: (i, 0)),
                  pl.BlockSpec(table_RxD.shape, lambda i: (0, 0))],
        out_specs=pl.BlockSpec((1, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, d), table_RxD.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gather_probe",
    )(idx_MxK, table_RxD)


def gather_probe_reference(table_RxD: jax.Array, idx_MxK: jax.Array) -> jax.Array:
    return jnp.sum(table_RxD.astype(jnp.float32)[idx_MxK], axis=1).astype(table_RxD.dtype)


def measure_bounds(bench, m: int, d: int, h: int, k: int, *, dtype=jnp.bfloat16, hbm_bytes: int = 1 << 30,
                   interpret: bool = False) -> dict:
    """The bounds of the module doc, timed by `bench(fn, [args])` (ms): {gather_2_bytes_per_ms,
    gather_1_bytes_per_ms (tables of two weights / one), hbm_bytes_per_ms, xla_gate_ms}. The probe's
    output is checked against its reference first."""
    key = jax.random.PRNGKey(11)
    out: dict = {}
    for tables in (2, 1):
        table = jax.random.normal(jax.random.fold_in(key, tables), (tables * h, d), jnp.float32).astype(dtype)
        idx = jax.random.randint(jax.random.fold_in(key, 10 + tables), (m, k), 0, tables * h, jnp.int32)
        probe = functools.partial(gather_probe, interpret=interpret)
        got = probe(table, idx).astype(jnp.float32)
        want = gather_probe_reference(table, idx).astype(jnp.float32)
        if not bool(jnp.allclose(got, want, rtol=2e-2, atol=2e-2 * k)):
            raise AssertionError("gather_probe disagrees with its reference")
        ms = bench(probe, [(table, idx)])
        out[f"gather_{tables}_bytes_per_ms"] = m * k * d * jnp.dtype(dtype).itemsize / ms
        out[f"gather_{tables}_ms"] = ms
    n = hbm_bytes // jnp.dtype(dtype).itemsize
    big = jnp.zeros((n,), dtype)
    ms = bench(jax.jit(lambda a: a + 1), [(big,)])
    out["hbm_bytes_per_ms"] = 2 * hbm_bytes / ms
    del big
    x = jax.random.normal(key, (m, d), jnp.float32).astype(dtype)
    w = jax.random.normal(jax.random.fold_in(key, 3), (h, d), jnp.float32).astype(dtype)
    out["xla_gate_ms"] = bench(jax.jit(lambda a, b: jax.nn.relu(jnp.einsum("md,hd->mh", a, b))), [(x, w)])
    return out


def piece_traffic(m: int, d: int, h: int, k: float, *, token_entries: float | None = None,
                  neuron_entries: float | None = None, itemsize: int = 2, tile: int = 256, slots: int = 32,
                  ranked_width: int = 64) -> dict[str, dict]:
    """Bytes of each piece at k active per token: {piece: {gather, gather_tables, hbm}}. gather =
    rows read through the gather path (bytes), gather_tables = how many [H, D] tables those rows
    come from (the probe whose rate bounds them), hbm = bytes streamed. The backward's kernels
    visit only the entries outside the dense tails: token_entries (those of rows outside the token
    tail) and neuron_entries (those of neurons that are not hot); both default to M k.
    The neuron-major kernel's rows are of x and gy ([M, D] each, 128 MB at M 16384: more than the L2
    cache), bound here by the two-table gather rate: an optimistic bound for it.
    The pattern is read in the form each piece gets it (bench_ffn_train.piece_fns, as the op runs
    them): the pack's int32 ids and counts by the transpose's first pass (the training forward's)
    and by the lists of the backward that recomputes the pattern; the kept form (uint8 offsets and
    int16 counts for tiles up to 256 lanes, else the pack's) by the transpose's second pass and the
    lists of the backward that keeps it."""
    e = m * k  # entries
    e_tok = e if token_entries is None else token_entries
    e_neu = e if neuron_entries is None else neuron_entries
    row = d * itemsize
    n_tiles = -(-h // tile)
    pattern = m * n_tiles * (slots * 4 + 4)  # the pack's int32 indices and counts
    kept = m * n_tiles * (slots * 1 + 2) if tile <= 256 else pattern  # pallas_backward.Kept's
    pack_bytes = pattern + m * n_tiles * slots * itemsize  # and its values
    act = m * d * itemsize  # one [M, D] activation
    lists = e * (4 + 4 + itemsize)  # a CSR entry: token, position, value
    return {
        "pack": dict(gather=0.0, gather_tables=0, hbm=act + h * row + pack_bytes),
        "fused_ffn": dict(gather=2 * e * row, gather_tables=2, hbm=2 * act + pack_bytes),
        "fused_ffn_ranked": dict(gather=2 * e * row, gather_tables=2,
                                 hbm=2 * act + pack_bytes + m * ranked_width * (itemsize + 4)),
        # Each pass reads the pattern (not the values): the first the pack's, the second the kept one.
        "transpose": dict(gather=0.0, gather_tables=0, hbm=pattern + kept + lists),
        # The lists read the pattern; the kernel's two launches: W_down rows per entry (and gy per
        # token), then W_up and W_gate rows.
        "token_major": dict(gather=3 * e_tok * row, gather_tables=2, hbm=kept + 2 * act + 2 * lists),
        "token_major_recompute": dict(gather=4 * e_tok * row, gather_tables=2,
                                      hbm=pattern + 3 * act + 2 * lists),
        # x and gy rows per entry, three dW written.
        "neuron_major": dict(gather=2 * e_neu * row, gather_tables=2, hbm=lists + 3 * h * d * 4),
    }


def attainment(traffic: dict[str, dict], piece_ms: dict[str, float], bounds: dict) -> dict[str, dict]:
    """Per piece with a time: its bytes, the time its traffic needs at the measured rates (gathers
    from weight tables at the probe's rate, other bytes at HBM's) and the fraction of that bound
    the measured time reaches; the pack against XLA's dense relu GEMM."""
    out = {}
    for name, t in traffic.items():
        if name not in piece_ms:
            continue
        if name == "pack":
            bound_ms = bounds["xla_gate_ms"]
        else:
            rate = bounds.get(f"gather_{t['gather_tables']}_bytes_per_ms", bounds["hbm_bytes_per_ms"]) \
                if t["gather_tables"] else bounds["hbm_bytes_per_ms"]
            bound_ms = t["gather"] / rate + t["hbm"] / bounds["hbm_bytes_per_ms"]
        out[name] = dict(gather_gb=t["gather"] / 1e9, hbm_gb=t["hbm"] / 1e9, ms=piece_ms[name],
                         bound_ms=bound_ms, fraction=bound_ms / piece_ms[name])
    return out
