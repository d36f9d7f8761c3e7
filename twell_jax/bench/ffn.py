"""Benchmark of the Pallas (Triton) sparse FFN forward against the dense XLA FFN, on one GPU.

    PYTHONUNBUFFERED=1 python experiments/bench_ffn.py [--quick] [--out DIR]

Synthetic sparsity (docs/kernels.md): x[:, 0] = 1, W_gate[:, 0] = -z with z the normal quantile of
1 - p, p = k / H, other entries N(0, 1) for x and N(0, 1/D) for the weights, so each neuron fires
with probability p (k active neurons per token on average).

Every variant is checked against the dense formula before it is timed. Timings: medians over
batches of back-to-back calls (one sync per batch), after warm-up, rotating over 3 input sets.
Ratios are to the XLA dense FFN timed in the same process. Imports no grain: only the kernels
and twell_jax.ops.pallas_forward.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from twell_jax.pallas_kernels.twell_ffn import FFNBlockSizes, sparse_ffn, sparse_ffn_reference
from twell_jax.pallas_kernels.twell_pack import PackBlockSizes, pack_gate, pack_gate_reference
from twell_jax import ops
from twell_jax.ops import pallas_forward, planner

D, H, TILE, SLOTS = 2048, 5632, 256, 32
M_MAIN = 16384
INTERPRET = False  # --smoke: tiny shapes through the Pallas interpreter, to check the script on CPU
DTYPE = jnp.bfloat16


def make_inputs(key, m: int, k_active: float, n_sets: int = 3):
    """n_sets different x plus one weight set with ~k_active active gate neurons per token."""
    z = statistics.NormalDist().inv_cdf(1.0 - k_active / H)
    kx, kg, ku, kd = jax.random.split(key, 4)
    xs = []
    for i in range(n_sets):
        x = jax.random.normal(jax.random.fold_in(kx, i), (m, D), jnp.float32)
        xs.append(x.at[:, 0].set(1.0).astype(DTYPE))
    scale = 1.0 / np.sqrt(D)
    w_gate = (jax.random.normal(kg, (H, D), jnp.float32) * scale).at[:, 0].set(-z).astype(DTYPE)
    w_up = (jax.random.normal(ku, (H, D), jnp.float32) * scale).astype(DTYPE)
    w_down = (jax.random.normal(kd, (H, D), jnp.float32) * scale).astype(DTYPE)
    return xs, w_gate, w_up, w_down


@jax.jit
def dense_gated(x, w_gate, w_up, w_down):
    """The op's "dense" backend, y only (its aux is dead code under jit)."""
    return ops.gated_ffn(x, w_gate, w_up, w_down, backend="dense")[0]


@jax.jit
def dense_plain(x, w_up, w_down):
    return ops.ffn(x, w_up, w_down, backend="dense")[0]


@jax.jit
def xla_gate(x, w_gate):
    """The XLA gate GEMM + ReLU: what the pack kernel's GEMM competes with."""
    return jax.nn.relu(jnp.einsum("md,hd->mh", x, w_gate))


# --- attribution variants of the pack kernel: the same GEMM loop with parts of the epilogue left out
def _gemm_only_kernel(x_ref, w_ref, o_ref, *, block_k, n_k, mode):
    def step(k, acc):
        return acc + lax.dot_general(x_ref[:, pl.ds(k * block_k, block_k)],
                                     w_ref[:, pl.ds(k * block_k, block_k)],
                                     (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    acc = lax.fori_loop(0, n_k, step, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    if mode == "relu_dense":
        o_ref[...] = jnp.maximum(acc, 0.0).astype(o_ref.dtype)
    else:  # "count": the count reduction only (no slot extraction)
        o_ref[...] = jnp.sum((acc > 0).astype(jnp.int32), axis=1)


@functools.partial(jax.jit, static_argnames=("mode", "bs"))
def gemm_variant(x, w, *, mode: str, bs: PackBlockSizes):
    m, h = x.shape[0], w.shape[0]
    bm, bk = bs.block_m, bs.block_k
    kernel = functools.partial(_gemm_only_kernel, block_k=bk, n_k=D // bk, mode=mode)
    if mode == "relu_dense":
        out_spec = pl.BlockSpec((bm, TILE), lambda i, j: (i, j))
        out_shape = jax.ShapeDtypeStruct((m, h), x.dtype)
    else:
        out_spec = pl.BlockSpec((bm, pl.Squeezed()), lambda i, j: (i, j))
        out_shape = jax.ShapeDtypeStruct((m, h // TILE), jnp.int32)
    return pl.pallas_call(
        kernel, grid=(m // bm, h // TILE),
        in_specs=[pl.BlockSpec((bm, D), lambda i, j: (i, 0)),
                  pl.BlockSpec((TILE, D), lambda i, j: (j, 0))],
        out_specs=out_spec, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name=f"bench_gemm_{mode}")(x, w)


def bench(fn, arg_sets, *, batch: int = 5, repeats: int = 15, warmup: int = 2) -> float:
    """Median ms per call over `repeats` batches of `batch` back-to-back calls."""
    n = len(arg_sets)
    if INTERPRET:
        batch, repeats, warmup = 1, 1, 0
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % n]))
    samples = []
    for r in range(repeats):
        t0 = time.perf_counter()
        out = None
        for b in range(batch):
            out = fn(*arg_sets[(r * batch + b) % n])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) * 1e3 / batch)
    return statistics.median(samples)


def bench_interleaved(fns: dict, arg_sets, *, batch: int = 5, repeats: int = 15) -> dict:
    """Median ms per call of each fn, timed in alternation (one batch of each per round), so slow
    drift of the clocks affects every fn alike."""
    n = len(arg_sets)
    if INTERPRET:
        batch, repeats = 1, 1
    for fn in fns.values():
        for i in range(2):
            jax.block_until_ready(fn(*arg_sets[i % n]))
    samples = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = None
            for b in range(batch):
                out = fn(*arg_sets[(r * batch + b) % n])
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - t0) * 1e3 / batch)
    return {name: statistics.median(v) for name, v in samples.items()}


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def sanity() -> None:
    print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
    x = jnp.ones((16, 64), DTYPE)
    v, i, c = pack_gate(x, x, tile=16, slots=16, block_sizes=PackBlockSizes(16, 16, 1, 1))
    assert int(c.sum()) == 16 * 16, c
    print("sanity: Triton pack kernel compiled and ran")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer variants and cases")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--smoke", action="store_true", help="CPU check of the script (interpret)")
    args = parser.parse_args()
    global D, H, TILE, M_MAIN, INTERPRET
    if args.smoke:
        D, H, TILE, M_MAIN, INTERPRET, args.quick = 64, 96, 32, 256, True, True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not INTERPRET:
        sanity()
    results: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": []}
    table = []

    def log(row):
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "bench_ffn.json").write_text(json.dumps(results, indent=1))

    key = jax.random.PRNGKey(0)
    m = M_MAIN
    xs, wg, wu, wd = make_inputs(key, m, 29.0)
    t_dense = bench(dense_gated, [(x, wg, wu, wd) for x in xs])
    t_gate = bench(xla_gate, [(x, wg) for x in xs])
    row = dict(kind="baseline", m=m, k=29, dense_ms=t_dense, xla_gate_ms=t_gate)
    for n in (16, 32, 64):
        sample = jax.jit(functools.partial(planner.sampled_active_per_token, n_sample=n))
        row[f"sample{n}_ms"] = bench(sample, [(x, wg) for x in xs])
    log(row)

    # 1. pack kernel (default blocks; round 1 swept the block sizes): GEMM + ReLU vs full pack.
    ref_pack = pack_gate_reference(xs[0], wg, tile=TILE, slots=SLOTS)
    pack_bs = PackBlockSizes()
    row = dict(kind="pack", block=list(pack_bs.__dict__.values()))
    row["relu_dense_ms"] = float("nan") if INTERPRET else bench(
        functools.partial(gemm_variant, mode="relu_dense", bs=pack_bs), [(x, wg) for x in xs])
    fn = functools.partial(pack_gate, tile=TILE, slots=SLOTS, block_sizes=pack_bs,
                           interpret=INTERPRET)
    v, i, c = fn(xs[0], wg)
    row["count_mismatch"] = int(jnp.sum(c != ref_pack[2]))
    row["index_mismatch"] = int(jnp.sum(i != ref_pack[1]))
    row["value_err"] = rel_err(v, ref_pack[0])
    row["pack_ms"] = bench(fn, [(x, wg) for x in xs])
    log(row)
    table.append(f"pack {list(pack_bs.__dict__.values())}: {row['pack_ms']:.3f} ms, Pallas GEMM+ReLU "
                 f"{row['relu_dense_ms']:.3f}, XLA relu(x Wg^T) {t_gate:.3f} ms, pack/XLA "
                 f"{row['pack_ms'] / t_gate:.2f}; mismatches {row['count_mismatch']}/"
                 f"{row['index_mismatch']}")

    # 2. fused FFN kernel: warps x head-slot prefetch.
    # (block_t, warps, stages, head_slots). Round 2 probes (BENCHMARKS.md): walking 2-8 tiles per
    # step (more gather chains per program) was SLOWER at k = 29; head-slot prefetch no gain;
    # 1 warp slightly faster at k = 29 only.
    ffn_variants = [FFNBlockSizes(), FFNBlockSizes(1, 4, 1, 1), FFNBlockSizes(1, 1, 1, 0),
                    FFNBlockSizes(1, 1, 1, 1), FFNBlockSizes(1, 2, 1, 0)]
    if args.quick:
        ffn_variants = ffn_variants[:3]
    best_ffn = {}
    ffn_table = {}
    for k in (29.0, 112.0):
        xs_k, wg_k, wu_k, wd_k = make_inputs(key, m, min(k, H / 4))
        packs = [pack_gate(x, wg_k, tile=TILE, slots=SLOTS, block_sizes=pack_bs,
                           interpret=INTERPRET) for x in xs_k]
        y_ref_k, _ = sparse_ffn_reference(xs_k[0][:64], *(a[:64] for a in packs[0]), wu_k, wd_k)
        for fb in ffn_variants:
            name = f"bt{fb.block_t}/w{fb.num_warps}/st{fb.num_stages}/head{fb.head_slots}"
            row = dict(kind="ffn", k=k, block=name)
            try:
                fn = functools.partial(sparse_ffn, block_sizes=fb, interpret=INTERPRET)
                y, _ = fn(xs_k[0], *packs[0], wu_k, wd_k)
                row["err_vs_ref_rows"] = rel_err(y[:64], y_ref_k)
                if not row["err_vs_ref_rows"] < 1e-2:
                    raise AssertionError(f"wrong result: rel err {row['err_vs_ref_rows']}")
                row["ffn_ms"] = bench(fn, [(x, *p, wu_k, wd_k) for x, p in zip(xs_k, packs)])
                if k not in best_ffn or row["ffn_ms"] < best_ffn[k][1]:
                    best_ffn[k] = (fb, row["ffn_ms"])
                ffn_table.setdefault(name, {})[k] = row["ffn_ms"]
            except Exception as e:
                row["error"] = repr(e)[:300]
            log(row)
    if 29.0 not in best_ffn:
        raise SystemExit("no fused FFN variant ran")
    ffn_bs = FFNBlockSizes()  # the shipped default, whatever won the sweep
    table.append("fused FFN variants (ms):   k=29    k=112")
    for name, t in ffn_table.items():
        table.append(f"  {name:<22} {t.get(29.0, float('nan')):>7.3f} {t.get(112.0, float('nan')):>7.3f}")
    table.append(f"  used below: {list(ffn_bs.__dict__.values())}")

    def make_config(expected_active=None):
        return ops.SparseFFNConfig(tile=TILE, slots=SLOTS, pack_block_sizes=pack_bs, ffn_block_sizes=ffn_bs,
                                   expected_active_per_token=expected_active)

    def y_only(fn):
        return jax.jit(lambda *a: fn(*a)[0])

    gated = jax.jit(lambda x, g, u, d: pallas_forward.gated_ffn_forward(
        x, g, u, d, make_config(), interpret=INTERPRET))
    auto_sample = jax.jit(
        lambda x, g, u, d: pallas_forward.auto_gated_ffn_forward(x, g, u, d, make_config(),
                                                               interpret=INTERPRET))
    auto_sample_y = y_only(auto_sample)
    dense_aux = jax.jit(lambda x, g, u, d: ops.gated_ffn(x, g, u, d, backend="dense"))
    dense_aux_y = y_only(dense_aux)  # aux dead: must equal the plain dense FFN

    # 3. end to end. auto_hint = static choice from calibrate_active_per_token on the inputs.
    cols = ("pack", "ffn", "total", "dense", "dense_aux", "dense_aux_y", "auto_hint", "auto_hint_y",
            "auto_smp", "auto_smp_y")
    table.append("end to end (ms; dense = y only, +aux = exact l0/l1 too; auto_hint = static choice, "
                 "auto_smp = device sample + cond; _y = aux unused)")
    table.append(f"{'M':>6} {'k':>5} {'l0':>6} {'k*':>5} " + " ".join(f"{c:>11}" for c in cols)
                 + f" {'d/total':>7} {'d/hint_y':>8} {'d+a/hint':>8} {'d/smp_y':>7} {'d+a/smp':>7}")
    cases = [(16384, 29.0), (16384, 40.0), (16384, 56.0), (16384, 112.0), (16384, 1408.0),
             (2048, 29.0), (4096, 29.0), (8192, 29.0), (2048, 112.0), (65536, 29.0)]
    if args.quick:
        cases = [(M_MAIN, 29.0), (M_MAIN, 280.0)]
    for m_case, k in cases:
      if INTERPRET:
          k = min(k, H / 4)
      try:
        xs_k, wg_k, wu_k, wd_k = make_inputs(jax.random.fold_in(key, m_case), m_case, k)
        sets = [(x, wg_k, wu_k, wd_k) for x in xs_k]
        measured = pallas_forward.calibrate_active_per_token(xs_k[0], wg_k)
        cfg = make_config(measured)
        auto_hint = jax.jit(lambda x, g, u, d, cfg=cfg: pallas_forward.auto_gated_ffn_forward(
            x, g, u, d, cfg, interpret=INTERPRET))
        fns = dict(total=gated, dense=dense_gated, dense_aux=dense_aux, dense_aux_y=dense_aux_y,
                   auto_hint=auto_hint, auto_hint_y=y_only(auto_hint), auto_smp=auto_sample,
                   auto_smp_y=auto_sample_y)
        y_dense = dense_gated(*sets[0])
        y_sp, aux = gated(*sets[0])
        y_hint, aux_hint = auto_hint(*sets[0])
        y_smp, aux_smp = auto_sample(*sets[0])
        k_star = planner.crossover_active_per_token(m_case, D, H)
        row = dict(kind="e2e", m=m_case, k=k, calibrated=measured, k_star=k_star,
                   err_total=rel_err(y_sp, y_dense), err_hint=rel_err(y_hint, y_dense),
                   err_smp=rel_err(y_smp, y_dense), aux={n: float(v) for n, v in aux.items()},
                   hint_dense=int(aux_hint["dense_fallback"]),
                   smp_dense=int(aux_smp["dense_fallback"]))
        packs = [pack_gate(x, wg_k, tile=TILE, slots=SLOTS, block_sizes=pack_bs,
                           interpret=INTERPRET) for x in xs_k]
        row["pack_ms"] = bench(functools.partial(pack_gate, tile=TILE, slots=SLOTS,
                                                 block_sizes=pack_bs, interpret=INTERPRET),
                               [(x, wg_k) for x in xs_k])
        row["ffn_ms"] = bench(functools.partial(sparse_ffn, block_sizes=ffn_bs, interpret=INTERPRET),
                              [(x, *p, wu_k, wd_k) for x, p in zip(xs_k, packs)])
        del packs
        for name, ms in bench_interleaved(fns, sets).items():
            row[f"{name}_ms"] = ms
        log(row)
        t = {c: row[f"{c}_ms"] for c in cols}
        table.append(
            f"{m_case:>6} {k:>5.0f} {row['aux']['l0']:>6.1f} {k_star:>5.0f} "
            + " ".join(f"{t[c]:>11.3f}" for c in cols)
            + f" {t['dense'] / t['total']:>7.2f} {t['dense'] / t['auto_hint_y']:>8.2f}"
            f" {t['dense_aux'] / t['auto_hint']:>8.2f} {t['dense'] / t['auto_smp_y']:>7.2f}"
            f" {t['dense_aux'] / t['auto_smp']:>7.2f}  (hint->{'dense' if row['hint_dense'] else 'sparse'},"
            f" smp->{'dense' if row['smp_dense'] else 'sparse'})")
        del sets, xs_k
      except Exception as e:
        log(dict(kind="e2e", m=m_case, k=k, error=repr(e)[:500]))

    # 4. non-gated at 29 active.
    plain = jax.jit(lambda x, u, d: pallas_forward.ffn_forward(x, u, d, make_config(),
                                                                        interpret=INTERPRET))
    xs_k, _, wu_k, wd_k = make_inputs(key, M_MAIN, 29.0)
    wu_k = wu_k.at[:, 0].set(-statistics.NormalDist().inv_cdf(1 - 29.0 / H))
    sets = [(x, wu_k, wd_k) for x in xs_k]
    y_sp, _ = plain(*sets[0])
    row = dict(kind="nongated", m=16384, k=29, err=rel_err(y_sp, dense_plain(*sets[0])),
               total_ms=bench(plain, sets), dense_ms=bench(dense_plain, sets))
    log(row)
    table.append(f"non-gated M=16384 k=29: total {row['total_ms']:.3f} ms, dense "
                 f"{row['dense_ms']:.3f} ms, ratio {row['dense_ms'] / row['total_ms']:.2f}")

    print("\n".join(["", "=== summary (bf16, D=2048, H=5632, ms; ratios = dense/x) ==="] + table))
    (out_dir / "table.txt").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
