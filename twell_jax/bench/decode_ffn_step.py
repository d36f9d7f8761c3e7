"""A sparse layer's FFN in a one-token decode step, each way the model's step can run it, kernel by
kernel: where the microseconds of `decode.sparse_ffn` "packed_down", "packed", "tiles" and "fused"
go, against the dense twin's two launches. Every figure is microseconds per layer of a lax.scan over --layers
stacked weight copies (more bytes than the L2 cache, as a decode step reads its layers), walked
--reps times in one scan, the scan's time divided by its steps (the program's own launch, shared
by layers x reps steps: a small part of a step at the defaults, the same in every row). The model's
step now unrolls its layers (`decode.layer_unroll`), so a scan step here adds the loop's own
per-iteration cost, the same in every row but `plain`, whose layers are unrolled in one step.

Rows (bf16, D and H of the paper's models; --active neurons fire on every row, so the rows' union
is that many; --placement: the first neurons, or spread over the gate's column tiles):
    plain            plain JAX: the norm, the three products and the residual as jnp ops, each
                     layer's weights its own arrays (no slice of a stack), the layers unrolled in
                     the scan's body: what `vs plain` divides by
    dense            the twin: norm + gate/up + ReLU gating (one launch), W_down^T + residual (one)
    fused            XLA's RMSNorm, the gate's product, `compact_active_rows`, the fused kernel
    split            the same up to the compaction, then `hidden` and `down` (two launches) and
                     the residual add in XLA
    tiles            the gate's product with the norm prologue and its tile lists, the tiles
                     kernel normalising x on load
    tiles_xla_norm   XLA's RMSNorm, the gate's product with its tile lists, the tiles kernel on xn
                     (the model's "tiles")
    packed           the gate's product with the norm prologue, its tile lists and the listed
                     neurons' hidden values (their up product in the same launch), then the down
                     kernel over the packed values with the residual (the model's "packed", what
                     "auto" runs at 3 and 4 rows)
    packed_down      "packed" in one launch: the gate's launch also adds the listed neurons' W_down
                     rows into each tile's partial and sums the tiles' partials with the residual
                     after a grid barrier (the model's "packed_down", what "auto" runs at 1 and 2
                     rows; each scan step hands the barrier's counters to the next)
and the pieces alone: the XLA norm, the gate's product (plain, +norm, +lists, +norm+lists,
+norm+values), the compaction, the fused kernel, the tiles kernel (with and without its norm),
the packed values' down kernel.

    python experiments/bench_decode_ffn_step.py --rows 1,8 --active 16,64,256 --out $OUT/ffn_step.json
    python experiments/bench_decode_ffn_step.py --rows 1 --active 32 --placement spread --no-pieces \
        --gate-blocks 64x256w4s3,32x256w4s3,64x128w4s3p132 --out $OUT/gate_blocks.json   # the gate's blocks
    python experiments/bench_decode_ffn_step.py --dry-run     # tiny shapes on CPU (interpret mode)
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp


from twell_jax.bench.ffn import bench_interleaved
from twell_jax.pallas_kernels.decode_matvec import (MatvecBlockSizes, decode_matvec, gate_role,
                                                    role_block_sizes)
from twell_jax.pallas_kernels.twell_decode import (DecodeBlockSizes, compact_active_rows,
                                                   sparse_decode_down_tiles, sparse_decode_ffn,
                                                   sparse_decode_ffn_fused, sparse_decode_ffn_tiles)

EPS = 1e-6
# Whole FFN steps (the rest: pieces)
WAYS = ("dense", "fused", "split", "tiles", "tiles_xla_norm", "packed", "packed_down")


PLACEMENTS = ("first", "spread")


def active_neurons(h: int, active: int, placement: str) -> jax.Array:
    """The neurons that fire: "first" = [0, active) (a few column tiles full: the worst case of the
    packed values, whose tiles walk their own active neurons a few at a time); "spread" = every
    (h / active)-th neuron (one or two a tile, as a trained model's are scattered)."""
    if placement == "first":
        return jnp.arange(h) < active
    return jnp.zeros((h,), bool).at[(jnp.arange(active) * h) // max(active, 1)].set(active > 0)


def make_layers(key, layers: int, rows: int, d: int, h: int, active: int, dtype, placement: str = "first"):
    """x [rows, D] and stacked weights whose gate fires exactly on `active_neurons` of every row
    (their gate rows point along x, the others against it, with a wide margin); W_down small, so
    the residual stream the scan carries keeps that pattern."""
    k = jax.random.split(key, 5)
    x = jax.random.normal(k[0], (1, d), jnp.float32)
    x = jnp.broadcast_to(x, (rows, d)) + 0.01 * jax.random.normal(k[1], (rows, d))
    direction = x[0] / jnp.linalg.norm(x[0])
    sign = jnp.where(active_neurons(h, active, placement), 1.0, -1.0)[:, None]
    w_gate = 0.02 * jax.random.normal(k[2], (layers, h, d)) + 0.5 * sign * direction[None, None, :]
    w_up = 0.02 * jax.random.normal(k[3], (layers, h, d))
    w_down = 1e-3 * jax.random.normal(k[4], (layers, h, d))
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return (cast(x), cast(w_gate), cast(w_up), cast(w_down), cast(jnp.swapaxes(w_down, 1, 2)),
            jnp.ones((layers, d), jnp.float32))


def plain_scan(layers: int, reps: int):
    """Plain JAX's dense FFN over per-layer weight arrays: jit(x, wg, wu, wd, scale) with tuples of
    layers arrays [H, D] (scale [D]); the layers unrolled inside a scan of `reps` steps."""
    def layer(x, wg, wu, wd, scale):
        x32 = x.astype(jnp.float32)
        xn = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=1, keepdims=True) + EPS) * scale).astype(x.dtype)
        h = jax.nn.relu(jnp.einsum("md,hd->mh", xn, wg)) * jnp.einsum("md,hd->mh", xn, wu)
        return x + jnp.einsum("mh,hd->md", h, wd)

    def run(x, wg, wu, wd, scale):
        def body(c, _):
            for i in range(layers):
                c = layer(c, wg[i], wu[i], wd[i], scale[i])
            return c, None
        return jax.lax.scan(body, x, None, length=reps)[0]

    return jax.jit(run)


def parse_gate_blocks(spec: str) -> list[MatvecBlockSizes]:
    """--gate-blocks "BNxBKwWsS[pP],...": the sparse gate's block sizes to sweep (block_n x block_k,
    num_warps, num_stages, programs_n; split_k 1, as tile lists need)."""
    out = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(?:p(\d+))?", item)
        if not m:
            raise SystemExit(f"--gate-blocks {item!r}: expected BNxBKwWsS[pP], e.g. 64x256w4s3 or 64x256w4s3p132")
        bn, bk, nw, ns, pn = (int(g) if g else 0 for g in m.groups())
        try:
            out.append(MatvecBlockSizes(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, split_k=1, programs_n=pn))
        except ValueError as exc:
            raise SystemExit(f"--gate-blocks {item!r}: {exc}")
    return out


def gate_blocks_label(b: MatvecBlockSizes) -> str:
    return f"{b.block_n}x{b.block_k}w{b.num_warps}s{b.num_stages}" + (f"p{b.programs_n}" if b.programs_n else "")


def variants(interpret: bool, sizes: DecodeBlockSizes, gate_blocks: MatvecBlockSizes | None = None) -> dict:
    """name -> fn(x, w_gate, w_up, w_down, w_down_t, scale, layer) -> the next x [rows, D];
    gate_blocks: the sparse gate's block sizes instead of its role's."""
    def mv(x, w, role, **kw):
        if role == "gate":  # the sparse gate: the swept blocks, or its role at these rows
            blocks = gate_blocks or role_block_sizes(gate_role(x.shape[0]), x.shape[0])
        else:
            blocks = role_block_sizes(role, x.shape[0])
        return decode_matvec(x, w, eps=EPS, block_sizes=blocks, interpret=interpret, **kw)

    def norm(x, scale, layer):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=1, keepdims=True) + EPS) * scale[layer[0]]).astype(x.dtype)

    def dense(x, wg, wu, wd, wdt, scale, layer):
        h = mv(x, wu, "gate_up", layer=layer, norm_scale=scale, gate=wg, activation="relu")
        return mv(h, wdt, "down_nk", layer=layer, residual=x)

    def fused(x, wg, wu, wd, wdt, scale, layer):
        xn = norm(x, scale, layer)
        g = mv(xn, wg, "gate", layer=layer, out_dtype=jnp.float32)
        order, n, _ = compact_active_rows(g, interpret=interpret)
        return sparse_decode_ffn_fused(xn, g, order, n, wu, wd, capacity=order.shape[0], layer=layer,
                                       residual_MxD=x, block_sizes=sizes, interpret=interpret)

    def split(x, wg, wu, wd, wdt, scale, layer):
        xn = norm(x, scale, layer)
        g = mv(xn, wg, "gate", layer=layer, out_dtype=jnp.float32)
        order, n, _ = compact_active_rows(g, interpret=interpret)
        _, y = sparse_decode_ffn(xn, g, order, n, wu, wd, capacity=order.shape[0], layer=layer, block_sizes=sizes,
                                 interpret=interpret)
        return x + y

    def tiles(x, wg, wu, wd, wdt, scale, layer):
        g, ids, count, _ = mv(x, wg, "gate", layer=layer, norm_scale=scale, out_dtype=jnp.float32, tile_lists=True)
        return sparse_decode_ffn_tiles(x, g, ids, count, wu, wd, layer=layer, norm_scale=scale, eps=EPS,
                                       residual_MxD=x, block_sizes=sizes, interpret=interpret)

    def tiles_xla_norm(x, wg, wu, wd, wdt, scale, layer):
        xn = norm(x, scale, layer)
        g, ids, count, _ = mv(xn, wg, "gate", layer=layer, out_dtype=jnp.float32, tile_lists=True)
        return sparse_decode_ffn_tiles(xn, g, ids, count, wu, wd, layer=layer, residual_MxD=x, block_sizes=sizes,
                                       interpret=interpret)

    def packed(x, wg, wu, wd, wdt, scale, layer):
        _, ids, count, _, values = mv(x, wg, "gate", layer=layer, norm_scale=scale, out_dtype=jnp.float32,
                                      tile_lists=True, tile_values=True, up=wu)
        return sparse_decode_down_tiles(values, ids, count, wd, layer=layer, residual_MxD=x, block_sizes=sizes,
                                        interpret=interpret)

    def packed_down(x, wg, wu, wd, wdt, scale, layer, sync):  # -> (y, the counters for the next layer)
        outs = mv(x, wg, "gate", layer=layer, norm_scale=scale, out_dtype=jnp.float32, tile_lists=True,
                  tile_values=True, up=wu, down=wd, down_residual=x, sync=sync)
        return outs[5], outs[6]

    packed_down.counters = True  # threads the barrier's counters through the scan (`scan_of`)

    # The pieces: each returns x unchanged after its own work (a data dependency on its output,
    # so nothing is dead code; the pieces' inputs are made from x where they need g or lists).
    def keep(x, out):
        return x + 0 * jax.tree.leaves(out)[0].reshape(-1)[:1].astype(x.dtype)

    def piece_norm(x, wg, wu, wd, wdt, scale, layer):
        return keep(x, norm(x, scale, layer))

    def gate_piece(with_norm, lists, values=False):
        def fn(x, wg, wu, wd, wdt, scale, layer):
            kw = {"norm_scale": scale} if with_norm else {}
            if values:
                kw.update(tile_values=True, up=wu)
            return keep(x, mv(x, wg, "gate", layer=layer, out_dtype=jnp.float32, tile_lists=lists, **kw))
        return fn

    return {"dense": dense, "fused": fused, "split": split, "tiles": tiles, "tiles_xla_norm": tiles_xla_norm,
            "packed": packed, "packed_down": packed_down, "piece: XLA norm": piece_norm,
            "piece: gate": gate_piece(False, False), "piece: gate +norm": gate_piece(True, False),
            "piece: gate +lists": gate_piece(False, True), "piece: gate +norm +lists": gate_piece(True, True),
            "piece: gate +norm +values": gate_piece(True, True, values=True)}


def kernel_pieces(interpret: bool, sizes: DecodeBlockSizes) -> dict:
    """The FFN kernels alone, on a gate product, lists and values made once outside the timed scan."""
    def compaction(x, g, order, n, ids, count, values, wu, wd, scale, layer):
        return x + 0 * compact_active_rows(g, interpret=interpret)[1][0].astype(x.dtype)

    def fused_kernel(x, g, order, n, ids, count, values, wu, wd, scale, layer):
        return sparse_decode_ffn_fused(x, g, order, n, wu, wd, capacity=order.shape[0], layer=layer, residual_MxD=x,
                                       block_sizes=sizes, interpret=interpret)

    def tiles_kernel(with_norm):
        def fn(x, g, order, n, ids, count, values, wu, wd, scale, layer):
            kw = {"norm_scale": scale, "eps": EPS} if with_norm else {}
            return sparse_decode_ffn_tiles(x, g, ids, count, wu, wd, layer=layer, residual_MxD=x, block_sizes=sizes,
                                           interpret=interpret, **kw)
        return fn

    def down_tiles_kernel(x, g, order, n, ids, count, values, wu, wd, scale, layer):
        return sparse_decode_down_tiles(values, ids, count, wd, layer=layer, residual_MxD=x, block_sizes=sizes,
                                        interpret=interpret)

    return {"piece: compaction": compaction, "piece: fused kernel": fused_kernel,
            "piece: tiles kernel": tiles_kernel(False), "piece: tiles kernel +norm": tiles_kernel(True),
            "piece: down tiles kernel": down_tiles_kernel}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8", help="decode rows (batch), comma-separated (at most 16: the tiles path)")
    parser.add_argument("--active", default="16,64,256", help="active neurons per row (and union), comma-separated")
    parser.add_argument("--no-pieces", action="store_true", help="the whole ways only, not each piece alone")
    parser.add_argument("--placement", default="first", choices=PLACEMENTS,
                        help="which neurons fire: the first --active ('first') or spread over the column tiles")
    parser.add_argument("--layers", type=int, default=8, help="stacked weight copies the scan walks")
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--h", type=int, default=5632)
    parser.add_argument("--reps", type=int, default=16, help="walks over the stacked layers per timed call")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--gate-blocks", default="", metavar="BNxBKwWsS[pP],...",
                        help="also the packed way (and its gate alone) with each of these block sizes for the "
                             "sparse gate (e.g. 64x256w4s3,32x256w4s3p264) in place of its role's "
                             "(decode_matvec.gate_role: 'gate_few_rows' up to GATE_FEW_ROWS rows, else 'gate')")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpret mode): the plumbing")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    args = parser.parse_args(argv)
    gate_sweep = parse_gate_blocks(args.gate_blocks)
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r]
        actives = [int(a) for a in args.active.split(",") if a]
    except ValueError:
        raise SystemExit(f"--rows {args.rows!r} / --active {args.active!r}: expected integers, comma-separated")
    if args.dry_run:
        args.d, args.h, args.layers, args.repeats, args.reps = 64, 96, 2, 1, 1
        rows_list, actives = [1, 3], [4]
    if not rows_list or min(rows_list) < 1 or max(rows_list) > 16 or not actives or min(actives) < 0 \
            or max(actives) > args.h or args.layers < 1 or args.reps < 1:
        raise SystemExit(f"--rows must be in [1, 16], --active in [0, --h={args.h}], --layers >= 1; got "
                         f"{args.rows!r}, {args.active!r}, {args.layers}")
    for blocks in gate_sweep:  # what the kernel would refuse mid-run, refused before anything runs
        try:
            blocks.columns(args.h)
        except ValueError as exc:
            raise SystemExit(f"--gate-blocks {gate_blocks_label(blocks)}: {exc}")
    interpret = args.dry_run
    sizes = DecodeBlockSizes()
    dtype = jnp.float32 if interpret else jnp.bfloat16
    layer_ids = jnp.tile(jnp.arange(args.layers, dtype=jnp.int32), args.reps)
    steps = args.layers * args.reps
    results = []
    print(f"[bench] {jax.devices()[0].device_kind}; D {args.d}, H {args.h}, {args.layers} layers, {dtype.__name__}")
    for rows in rows_list:
        for active in actives:
            x, wg, wu, wd, wdt, scale = make_layers(jax.random.key(rows * 1000 + active), args.layers, rows, args.d,
                                                    args.h, active, dtype, args.placement)

            def scan_of(fn):
                def run(x, wg, wu, wd, wdt, scale):
                    if getattr(fn, "counters", False):  # carry (x, counters): zeros once a call, then shared
                        body = lambda c, li: (fn(c[0], wg, wu, wd, wdt, scale, li[None], c[1]), None)  # noqa: E731
                        return jax.lax.scan(body, (x, jnp.zeros((args.layers,), jnp.int32)), layer_ids)[0][0]
                    return jax.lax.scan(lambda c, li: (fn(c, wg, wu, wd, wdt, scale, li[None]), None), x, layer_ids)[0]
                return jax.jit(run)

            fns = {name: scan_of(fn) for name, fn in variants(interpret, sizes).items()
                   if not (args.no_pieces and name.startswith("piece"))}
            for blocks in gate_sweep:  # the packed way and its gate alone, per gate block sizes
                swept = variants(interpret, sizes, blocks)
                label = gate_blocks_label(blocks)
                fns[f"packed gate {label}"] = scan_of(swept["packed"])
                fns[f"piece: gate +norm +values {label}"] = scan_of(swept["piece: gate +norm +values"])
            # The kernels alone read a gate product, lists and values made once (layer 0's, on x).
            g, ids, count, _, values = decode_matvec(
                x, wg, layer=jnp.zeros((1,), jnp.int32), norm_scale=scale, eps=EPS, out_dtype=jnp.float32,
                block_sizes=role_block_sizes(gate_role(rows), rows), tile_lists=True, tile_values=True,
                up=wu, interpret=interpret)
            order, n, _ = compact_active_rows(g, interpret=interpret)
            union = int(n[0])
            pieces = kernel_pieces(interpret, sizes)

            def scan_piece(fn):
                def run(x, wg, wu, wd, wdt, scale):
                    body = lambda c, li: (fn(c, g, order, n, ids, count, values, wu, wd, scale, li[None]),  # noqa: E731
                                          None)
                    return jax.lax.scan(body, x, layer_ids)[0]
                return jax.jit(run)

            if not args.no_pieces:
                fns.update({name: scan_piece(fn) for name, fn in pieces.items()})
            # Plain JAX reads each layer's weights as its own arrays (split once, outside the timing).
            split_layers = [tuple(a[i] for i in range(args.layers)) for a in (wg, wu, wd, scale)]
            plain = plain_scan(args.layers, args.reps)
            fns = {"plain": lambda *_: plain(x, *split_layers), **fns}
            times = bench_interleaved(fns, [(x, wg, wu, wd, wdt, scale)], repeats=args.repeats)
            us = {name: 1e3 * ms / steps for name, ms in times.items()}
            for name, value in us.items():
                row = {"rows": rows, "active": active, "placement": args.placement, "union": union, "variant": name,
                       "us_per_layer": value}
                if name in WAYS or name.startswith("packed gate"):  # whole ways against the twin's and plain JAX's
                    row.update(vs_dense=us["dense"] / value, vs_plain=us["plain"] / value)
                results.append(row)
                print(f"[bench] rows {rows:2d} active {active:4d} (union {union:4d}) {name:28s} {value:8.2f} us/layer")
    print("\n| rows | active | variant | us/layer | vs dense | vs plain |\n|---|---|---|---|---|---|")
    for r in results:
        ratios = [f"{r[k]:.3f}x" if k in r else "" for k in ("vs_dense", "vs_plain")]
        print(f"| {r['rows']} | {r['active']} | {r['variant']} | {r['us_per_layer']:.2f} | {ratios[0]} | {ratios[1]} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "d": args.d, "h": args.h,
                                              "layers": args.layers, "reps": args.reps, "rows": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
