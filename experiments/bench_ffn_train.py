"""Benchmark of the FFN block's forward + backward (gradients of x and the 3 weights) per backend.

    PYTHONUNBUFFERED=1 python experiments/bench_ffn_train.py [--quick] [--out DIR]
    python experiments/bench_ffn_train.py --dry-run --out /tmp/b   # CPU, interpret, tiny shapes

Backends, all in the same process on the same inputs (bf16, D 2048, H 5632, synthetic sparsity of
experiments/bench_ffn.py at k = 29, 56, 112 active per token, M = 2048 / 16384 / 65536):
    xla_bf16          plain jnp, bf16 dots, no preferred_element_type (the dense baseline)
    dense             ops.gated_ffn(backend="dense")
    reference         backend="reference" (M <= 16384 only: it materialises [M, H] in f32)
    pallas            backend="pallas": Pallas forward + Pallas backward, pack kept
    pallas_recompute  the same with BackwardConfig(keep_gate_pattern=False)
    auto              backend="auto" with expected_active_per_token = the calibrated count
Each is first checked against xla_bf16 (max abs error per gradient, and relative error), then
timed (interleaved medians, bench_ffn.bench_interleaved); the compiled temporary memory of each
(`jax.jit(f).lower(...).compile().memory_analysis()`), and the time of each piece of the Pallas
path (pack, fused FFN, token tail mask, token-major kernel, transpose, neuron-major kernel, a
64-row dense token tail). Prints a short table last; writes bench_ffn_train.json to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ffn  # noqa: E402  (make_inputs, bench_interleaved, bench: one copy of each)
from pallas_kernels.twell_bwd_neuron import neuron_backward  # noqa: E402
from pallas_kernels.twell_bwd_token import token_backward  # noqa: E402
from pallas_kernels.twell_ffn import sparse_ffn  # noqa: E402
from pallas_kernels.twell_pack import pack_gate  # noqa: E402
from twell_jax import ops  # noqa: E402
from twell_jax.ops import pallas_forward, pallas_backward  # noqa: E402

L1_COEF = 3e-4 / 8  # the 0.5b recipe's lambda over its 8 layers (twell.md 4.9)
BACKENDS = ("xla_bf16", "dense", "reference", "pallas", "pallas_recompute", "auto")


def xla_bf16_loss_parts(x, w_gate, w_up, w_down):
    """The dense FFN with bf16 dots throughout (no f32 outputs): (y, l1)."""
    g = jnp.einsum("md,hd->mh", x, w_gate)
    u = jnp.einsum("md,hd->mh", x, w_up)
    h = jax.nn.relu(g) * u
    y = jnp.einsum("mh,hd->md", h, w_down)
    return y, jnp.sum(jnp.abs(h), dtype=jnp.float32) / x.shape[0]


def make_train_step(backend: str, config: ops.SparseFFNConfig, interpret: bool):
    """f(x, wg, wu, wd, gy) -> (dx, dwg, dwu, dwd): the vjp of (y, l1) at cotangent (gy, L1_COEF)."""
    def parts(x, wg, wu, wd):
        if backend == "xla_bf16":
            return xla_bf16_loss_parts(x, wg, wu, wd)
        op_backend = "pallas" if backend == "pallas_recompute" else backend
        y, aux = ops.gated_ffn(x, wg, wu, wd, backend=op_backend, config=config,
                               interpret=interpret and op_backend == "pallas")
        return y, aux["l1"]

    def step(x, wg, wu, wd, gy):
        _, vjp = jax.vjp(parts, x, wg, wu, wd)
        return vjp((gy, jnp.float32(L1_COEF)))

    return jax.jit(step)


def temp_mb(fn, args) -> float:
    analysis = fn.lower(*args).compile().memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def piece_fns(config: ops.SparseFFNConfig, interpret: bool, h: int):
    """The Pallas path's pieces as separately jitted functions of (x, wg, wu, wd, gy)."""
    s = dict(tile=config.tile, slots=config.slots)
    bc = config.backward or pallas_backward.BackwardConfig()
    pack = jax.jit(lambda x, wg: pack_gate(x, wg, **s, interpret=interpret))

    def token_inputs(x, wg):
        values, indices, counts = pack(x, wg)
        tail = pallas_backward.token_tail_mask(counts, config.slots, config.ell_width)
        return values, indices, jnp.where(tail[:, None], 0, counts), tail

    def token(x, wg, wu, wd, gy, prepared):
        values, indices, counts, _ = prepared
        return token_backward(x, gy, values, indices, counts, wg, wu, wd, jnp.float32(1e-5),
                              width=config.ell_width, block_sizes=bc.token_block_sizes,
                              interpret=interpret)

    @jax.jit
    def transpose(cols, counts, entries):
        nnz = jnp.sum(jnp.minimum(counts, config.slots), axis=1)
        valid = jnp.arange(cols.shape[1])[None, :] < nnz[:, None]
        return pallas_backward.neuron_major_lists(cols, valid, entries, h)

    def neuron(x, gy, lists):
        start, count, tokens, values = lists
        count = jnp.where(count > config.transpose_ell_width, 0, count)
        return neuron_backward(x, gy, start, count, tokens, values,
                               block_sizes=bc.neuron_block_sizes, interpret=interpret)

    @jax.jit
    def token_tail64(x, wg, wu, wd, gy):
        return pallas_backward.dense_rows_backward(True, x[:64], gy[:64], (wg, wu, wd),
                                                   jnp.float32(1e-5))

    return pack, jax.jit(token_inputs), jax.jit(token), transpose, jax.jit(neuron), token_tail64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="M = 16384 at k = 29 and 56 only")
    parser.add_argument("--dry-run", "--interpret", dest="dry_run", action="store_true",
                        help="tiny shapes through the Pallas interpreter (CPU check of the script)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    interpret = args.dry_run
    if interpret:  # bench_ffn's globals drive make_inputs and bench
        bench_ffn.D, bench_ffn.H, bench_ffn.INTERPRET = 32, 48, True
        cases = [(48, 3.0)]
        config = ops.SparseFFNConfig(tile=16, slots=8, ell_width=16, transpose_ell_width=32)
    else:
        bench_ffn.sanity()
        cases = [(m, k) for m in (16384, 2048, 65536) for k in (29.0, 56.0, 112.0)]
        if args.quick:
            cases = [(16384, 29.0), (16384, 56.0)]
        config = ops.SparseFFNConfig()
    d, h = bench_ffn.D, bench_ffn.H
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": []}
    table = [f"{'M':>6} {'k':>5} " + " ".join(f"{b:>16}" for b in BACKENDS)]
    mem_table, piece_table = [], []
    pieces = piece_fns(config, interpret, h)

    def log(row):
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "bench_ffn_train.json").write_text(json.dumps(results, indent=1))

    key = jax.random.PRNGKey(0)
    for m, k in cases:
        try:
            xs, wg, wu, wd = bench_ffn.make_inputs(jax.random.fold_in(key, m), m, k)
            gy = (jax.random.normal(jax.random.fold_in(key, 7), (m, d), jnp.float32)
                  / np.sqrt(m)).astype(bench_ffn.DTYPE)
            sets = [(x, wg, wu, wd, gy) for x in xs]
            measured = pallas_forward.calibrate_active_per_token(xs[0], wg)
            configs = dict(pallas_recompute=dataclasses.replace(config, backward=pallas_backward.BackwardConfig(
                keep_gate_pattern=False)), auto=dataclasses.replace(config, expected_active_per_token=measured))
            backends = [b for b in BACKENDS if not (b == "reference" and m > 16384)]
            steps = {b: make_train_step(b, configs.get(b, config), interpret) for b in backends}
            row = dict(kind="train", m=m, k=k, calibrated=measured, errors={}, temp_mb={})
            if not interpret:
                row["auto_plan"] = pallas_backward.choose_training_path(m, d, h, measured, True)
            # Correctness first: each backend's gradients against xla_bf16's.
            base = steps["xla_bf16"](*sets[0])
            for b in backends:
                grads = steps[b](*sets[0])
                row["errors"][b] = {
                    name: dict(max_abs=float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))),
                               rel=bench_ffn.rel_err(g, r))
                    for name, g, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, base)}
                row["temp_mb"][b] = temp_mb(steps[b], sets[0])
            del base, grads
            times = bench_ffn.bench_interleaved(steps, sets)
            row["ms"] = times
            # The pieces of the Pallas path.
            pack, token_inputs, token, transpose, neuron, tail64 = pieces
            x0 = sets[0]
            prepared = token_inputs(x0[0], wg)
            dx, cols, entries = token(*x0, prepared)
            lists = transpose(cols, prepared[2], entries)
            row["piece_ms"] = dict(
                pack=bench_ffn.bench(pack, [(x, wg) for x in xs]),
                fused_ffn=bench_ffn.bench(functools.partial(sparse_ffn, interpret=interpret),
                                          [(x, *pack(x, wg), wu, wd) for x in xs[:1]]),
                tail_mask=bench_ffn.bench(token_inputs, [(x, wg) for x in xs[:1]]),
                token_major=bench_ffn.bench(token, [(*x0, prepared)]),
                transpose=bench_ffn.bench(transpose, [(cols, prepared[2], entries)]),
                neuron_major=bench_ffn.bench(neuron, [(x0[0], gy, lists)]),
                token_tail_64_rows=bench_ffn.bench(tail64, [x0]),
            )
            row["token_tail_rows"] = int(jnp.sum(prepared[3]))
            row["hot_neurons"] = int(jnp.sum(lists[1] > config.transpose_ell_width))
            del prepared, dx, cols, entries, lists
            log(row)
            ms = row["ms"]
            table.append(f"{m:>6} {k:>5.0f} " + " ".join(
                f"{ms[b]:>8.3f} ({ms['xla_bf16'] / ms[b]:>4.2f}x)" if b in ms else f"{'-':>16}"
                for b in BACKENDS))
            mem_table.append(f"{m:>6} {k:>5.0f} " + " ".join(
                f"{row['temp_mb'].get(b, float('nan')):>16.1f}" for b in BACKENDS))
            piece_table.append(f"{m:>6} {k:>5.0f} " + " ".join(
                f"{name}={t:.3f}" for name, t in row["piece_ms"].items())
                + f"  tail_rows={row['token_tail_rows']} hot={row['hot_neurons']}"
                + f"  max|err| pallas dx={row['errors']['pallas']['dx']['max_abs']:.2e}")
        except Exception as e:  # a failing case is reported, the others still run
            log(dict(kind="train", m=m, k=k, error=repr(e)[:500]))
            table.append(f"{m:>6} {k:>5.0f} error: {repr(e)[:200]}")
    lines = (["", f"=== fwd+bwd ms (ratio = xla_bf16 / x), D={d} H={h}, {results['device']} ==="]
             + table + ["", "compiled temporary memory (MiB)"] + mem_table
             + ["", "Pallas pieces (ms)"] + piece_table)
    print("\n".join(lines))
    (out_dir / "table.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
