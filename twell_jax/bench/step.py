"""Speed and memory of one training step of the model, against a plain-JAX Llama of the same shapes.

    python experiments/bench_step.py --config 0.5b --micro-batch 8 \
        --variants ref:none,relu_gated:none,twell:none,relu_gated:dots --out step.json
    python experiments/bench_step.py --checkpoint runs/0.5b-sparse --optimizer \
        --variants ref:none,relu_gated:none,twell@pallas:none,twell@auto:none
    python experiments/bench_step.py --dry-run          # tiny shapes on CPU (what the test runs)

A variant is `kind[@backend]:remat[:micro_batch]` with kind an FFN kind of the model (model.ffn_kind) or
`ref` (the plain-JAX Llama of twell_jax/bench/plain_llama.py, bf16 parameters and, with --optimizer,
optax.adamw on them; `ref@f32`: the same model on fp32 parameters cast to bf16 in the step, with the
trainer's optimizer: the mixed precision the model trains in), backend an op backend
for the kinds that run the sparse op (default: the config's), remat a policy of model.remat, and
micro_batch the variant's sequences per step (default: --micro-batch), so that one process can time a
sparse model at a larger micro-batch than its twin (what its saved memory buys). Compare such rows by
tokens/s. The summary printed last names, for each kind, the fastest variant that ran (`best` table).
One step = jax.grad of CE (+ the L1 penalty for kinds trained with it), plus the AdamW update of the
trainer with --optimizer. Without
--optimizer the step returns the weights unchanged beside their gradients, so every timed step sees
the same weights (a sparse step's time depends on their values) and the gradient buffer counts in
the compiled memory, as it does in training. All steps run on one device, on one micro-batch of random tokens; with `--checkpoint RUN` (a trained run, e.g. from
experiments/train_to_sparse.py) on the run's shapes and parameters and the first micro-batch of its
validation split, with "auto" given the run's per-layer activity hints and tail hints
(`hints.run_hints`, `hints.run_tail_hints`), and each relu-family row shows its measured active
FFN neurons per token (per layer in the JSON and the progress lines, with the layers' token-tail,
hot-neuron and hot-entry shares on those tokens). Every variant runs in this process: compiled once
(its compile seconds and compiled memory analysis recorded), warmed up, then timed as the median over --repeats runs of
--steps back-to-back steps (one jax.block_until_ready per run). A variant that fails (e.g. out of
memory) is reported and the next one runs.

Reported per variant: ms/step, tokens/s, MFU = tokens/s * (6 N + 12 L S D) / --peak-flops (N = the
parameter count, tied embedding once; 989.4e12 = H100 SXM bf16 dense, training/metrics.py's table), the compiled memory
(arguments + outputs + temporaries - aliased) and the device's peak bytes in use so far (a
process-wide high-water mark: JAX cannot reset it between variants), and the ratio of tokens/s to the
first `ref` row. Shapes come from a preset (`--config`, configs.get_config), overridable with --set.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from twell_jax.configs import get_config
from twell_jax import config as config_lib
from twell_jax.config import FFN_KIND_TABLE, REMAT_POLICIES, ExperimentConfig
from twell_jax.training.loss import cross_entropy, total_loss
# Model FLOPs per token: the trainer's MFU uses the same count.
from twell_jax.training.metrics import PEAK_BF16_FLOPS, device_memory_limit_bytes, device_peak_memory_bytes
from twell_jax.training.metrics import model_flops_per_token as flops_per_token
from twell_jax.inference.load import validation_tokens
from twell_jax.model import apply_model, choose_attention, describe_execution, init_model, split_model
from twell_jax.ops import BACKENDS
from twell_jax.run_dir import run_dir_of
from twell_jax.training.checkpoint import restore_params
from twell_jax.training.hints import Tails, describe_tails, run_hints, run_tail_hints, with_hints
from twell_jax.training.planning import abstract_graphdef, measure_activity
from twell_jax.training.optimizer import build_optimizer
from twell_jax.bench.plain_llama import REFERENCE_REMATS, reference_init, reference_loss

H100_BF16_PEAK_FLOPS = dict(PEAK_BF16_FLOPS)["H100 80GB HBM3"]
# --dry-run: a tiny model of the preset's family, fp32 on CPU, to check the script end to end.
DRY_RUN_SETS = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                "model.d_ff=64", "model.max_seq_len=16", "data.vocab_size=300", "data.seq_len=16",
                "model.compute_dtype=float32"]


# ----------------------------------------------------------------------------- variants

# `ref@f32`: the plain-JAX model on fp32 parameters (cast to bf16 in the step), with the trainer's optimizer.
REF_PRECISIONS = ("f32",)


def parse_variants(text: str) -> list[tuple[str, str | None, str, int | None]]:
    """"kind[@backend]:remat[:micro_batch],..." -> [(kind, backend or None, remat, micro_batch or None)],
    validated (kind: an FFN kind or "ref"; backend: an op backend, only for kinds that run the sparse
    op; micro_batch: a positive integer)."""
    variants = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, _, rest = item.partition(":")
        remat, _, batch = rest.partition(":")
        kind, _, backend = spec.partition("@")
        remat = remat or "none"
        micro_batch = None
        if batch:
            if not batch.isdigit() or int(batch) < 1:
                raise ValueError(f"--variants: the micro-batch of {item!r} must be a positive integer, got {batch!r}")
            micro_batch = int(batch)
        if kind != "ref" and kind not in FFN_KIND_TABLE:
            raise ValueError(f"--variants: unknown kind {kind!r} in {item!r}; expected 'ref' or one of "
                             f"{', '.join(FFN_KIND_TABLE)}")
        if kind == "ref" and backend not in ("", *REF_PRECISIONS):
            raise ValueError(f"--variants: {item!r}: the reference model takes @{' or @'.join(REF_PRECISIONS)} "
                             "(its parameters' precision) or nothing")
        if backend and kind != "ref" and not FFN_KIND_TABLE[kind].sparse_op:
            raise ValueError(f"--variants: {item!r}: only kinds that run the sparse op take @backend")
        if backend and kind != "ref" and backend not in BACKENDS:
            raise ValueError(f"--variants: unknown backend {backend!r} in {item!r}; expected one of "
                             f"{', '.join(BACKENDS)}")
        if kind == "ref" and remat not in REFERENCE_REMATS:
            raise ValueError(f"--variants: the reference model takes remat none, full or dots, got {item!r}")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"--variants: unknown remat policy {remat!r} in {item!r}; expected one of "
                             f"{', '.join(REMAT_POLICIES)}")
        variants.append((kind, backend or None, remat, micro_batch))
    if not variants:
        raise ValueError("--variants is empty")
    return variants


def variant_label(kind: str, backend: str | None, remat: str, micro_batch: int | None = None) -> str:
    return f"{kind}{'@' + backend if backend else ''}:{remat}{f':{micro_batch}' if micro_batch else ''}"


def variant_config(base: ExperimentConfig, kind: str, backend: str | None, remat: str,
                   hints: tuple[float, ...] | None = None, tails: Tails | None = None) -> ExperimentConfig:
    """The preset with this FFN kind, op backend and remat policy (L1 off for kinds trained without
    it); `hints`: per-layer expected active neurons per token for the sparse op's "auto" (a trained
    run's), and `tails` its per-layer tail hints (None: none)."""
    sets = [f"model.remat={remat}"]
    if kind != "ref":
        sets.append(f"model.ffn_kind={kind}")
        if backend:
            sets.append(f"model.ffn_backend={backend}")
        if not FFN_KIND_TABLE[kind].l1:
            base = dataclasses.replace(base, sparsity=base.sparsity.without_l1())
    cfg = config_lib.apply_overrides(base, sets)
    if hints and kind != "ref" and FFN_KIND_TABLE[kind].sparse_op and not cfg.model.ffn_expected_active:
        cfg = with_hints(cfg, hints, tails)
    return cfg


def build_step(cfg: ExperimentConfig, kind: str, optimizer: bool,
               params: dict[str, Any] | None = None, precision: str | None = None
               ) -> tuple[Callable, Any, str, Callable | None]:
    """(step(state, tokens) -> state, initial state, a note on how it runs, tokens -> per-layer
    active FFN neurons per token or None). `params`: trained parameters (default: a random init);
    `precision`: the reference model's ("f32": REF_PRECISIONS; None: bf16)."""
    active = None
    if kind == "ref":
        # The model's own per-shape choice (cuDNN on an NVIDIA GPU where it takes the shape).
        attention = choose_attention(cfg.model.attention_impl, dtype=jnp.bfloat16, head_dim=cfg.model.head_dim,
                                     seq_len=cfg.seq_len)
        attention = None if attention == "xla" else attention
        params = reference_init(cfg.model, jax.random.key(0))
        if precision == "f32":  # fp32 master parameters, each cast to bf16 where the step uses it
            params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
            loss_fn = lambda p, t: reference_loss(  # noqa: E731
                cfg.model, cfg.model.remat, attention, jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), t)
        else:
            loss_fn = lambda p, t: reference_loss(cfg.model, cfg.model.remat, attention, p, t)  # noqa: E731
        note = f"plain JAX, {'fp32 master' if precision == 'f32' else 'bf16'} params, attention {attention or 'xla'}"
    else:
        if params is None:
            graphdef, params = split_model(init_model(cfg.model, seed=0))
        else:  # a copy: the timed step donates its state
            graphdef, params = abstract_graphdef(cfg.model, seed=0), jax.tree.map(jnp.array, params)
        track = cfg.sparsity.track_neurons and cfg.model.is_relu_family
        l1_coef = jnp.float32(cfg.sparsity.l1_coef)

        def loss_fn(p, tokens_BxT):
            logits, aux = apply_model(graphdef, p, tokens_BxT[:, :-1], track_neurons=track)
            ce, _ = cross_entropy(logits, tokens_BxT[:, 1:])
            return total_loss(ce, aux["l1"], l1_coef)

        if cfg.model.is_relu_family:
            active = lambda t, p=params: measure_activity(graphdef, p, t, tails=True)  # noqa: E731
        note = describe_execution(cfg.model, cfg.seq_len)
    if optimizer:
        opt = (optax.adamw(1e-4) if kind == "ref" and precision != "f32"
               else build_optimizer(cfg.optim, cfg.train.steps))
        state = (params, opt.init(params))

        def step(state, tokens_BxT):
            p, o = state
            grads = jax.grad(loss_fn)(p, tokens_BxT)
            updates, o = opt.update(grads, o, p)
            return optax.apply_updates(p, updates), o
    else:
        state = (params, jax.tree.map(jnp.zeros_like, params))  # (weights, last gradients)

        def step(state, tokens_BxT):
            # The gradient only. The parameters come back unchanged (aliased to the donated input)
            # and the gradients go out beside them, so nothing is dead code under jit and every
            # step sees the same weights: a sparse step's time depends on the values (replacing
            # the weights by their gradients made later steps look far sparser than the model).
            params, _ = state
            return params, jax.grad(loss_fn)(params, tokens_BxT)
    return step, state, note, active


def compiled_memory_bytes(compiled: Any) -> int | None:
    """Arguments + outputs + temporaries - aliased bytes of a compiled step, where reported."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (not every backend implements it)
        return None
    if analysis is None:
        return None
    return int(sum(getattr(analysis, f"{name}_size_in_bytes", 0) for name in ("argument", "output", "temp"))
               - getattr(analysis, "alias_size_in_bytes", 0))


trace_top = 16  # kernels listed by --trace


def run_variant(base: ExperimentConfig, kind: str, backend: str | None, remat: str, micro_batch: int,
                tokens: jax.Array, *, steps: int, warmup: int, repeats: int, optimizer: bool, peak_flops: float,
                params: dict[str, Any] | None = None, hints: tuple[float, ...] | None = None,
                tails: Tails | None = None, trace: int = 0, label_batch: int | None = None) -> dict[str, Any]:
    """Compile, warm up and time one variant on `tokens` [micro_batch, seq + 1]; any failure is
    returned as {"error": ...}. `label_batch`: the micro-batch the variant named (in its label).
    `params`: trained parameters for the library's model (the `ref` row always runs its own random
    init: a dense step's time does not depend on the values)."""
    cfg = variant_config(base, kind, backend, remat, hints, tails)
    seq_len = cfg.seq_len
    row: dict[str, Any] = {"variant": variant_label(kind, backend, remat, label_batch), "kind": kind,
                           "backend": backend, "remat": remat, "micro_batch": micro_batch, "seq_len": seq_len}
    try:
        step, state, row["how"], active = build_step(cfg, kind, optimizer, params,
                                                     precision=backend if kind == "ref" else None)
        if active is not None:
            l0, tails = active(tokens)
            row["active_per_layer"] = [round(float(v), 2) for v in l0]
            # The sparse backward's tails on these tokens: (token-tail, hot-neuron, hot-entry share).
            row["tail_shares_per_layer"] = [[round(v, 4) for v in t] for t in tails]
        jitted = jax.jit(step, donate_argnums=0)
        t0 = time.perf_counter()
        compiled = jitted.lower(state, tokens).compile()
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_memory_bytes"] = compiled_memory_bytes(compiled)
        for _ in range(warmup):
            state = compiled(state, tokens)
        jax.block_until_ready(state)
        per_step = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                state = compiled(state, tokens)
            jax.block_until_ready(state)
            per_step.append((time.perf_counter() - t0) / steps)
        ms = statistics.median(per_step) * 1e3
        tokens_per_s = micro_batch * seq_len / (ms / 1e3)
        row.update(ms_per_step=ms, ms_per_step_runs=[t * 1e3 for t in per_step], tokens_per_s=tokens_per_s,
                   mfu=tokens_per_s * flops_per_token(cfg.model, seq_len) / peak_flops,
                   peak_bytes_so_far=device_peak_memory_bytes())
        if trace:  # the per-kernel time line (a copy of the state: the timed program donates its own)
            from twell_jax.bench.kernel_trace import format_profile, kernel_times

            try:
                row["trace"] = format_profile(kernel_times(jax.jit(step), (state, tokens), repeats=trace),
                                              top=trace_top)
            except Exception as err:  # noqa: BLE001 (the timing stands; only the profile failed)
                row["trace"] = [f"kernel trace failed: {type(err).__name__}: {str(err).strip()[:200]}"]
    except Exception as err:  # noqa: BLE001 (an OOM or a refused shape: report it, run the next one)
        row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
    finally:
        state = None
        gc.collect()
        jax.clear_caches()
    return row


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary table (last thing printed)."""
    ref = next((r for r in rows if r["kind"] == "ref" and "error" not in r), None)
    lines = ["| variant | ms/step | tokens/s | MFU | vs ref | compiled GiB | peak GiB (so far) | active/token | compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}" if ref else "n/a"
        active = f"{statistics.fmean(r['active_per_layer']):.1f}" if r.get("active_per_layer") else "-"
        lines.append(f"| {r['variant']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                     f"{ratio} | {_gib(r['compiled_memory_bytes'])} | {_gib(r['peak_bytes_so_far'])} | {active} | "
                     f"{r['compile_s']:.1f} |")
    return "\n".join(lines)


def best_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each kind[@backend]: its row of the most tokens/s among those that ran (any remat and
    micro-batch), in the order the kinds first appear."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "error" in r:
            continue
        key = variant_label(r["kind"], r["backend"], "").rstrip(":")
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    return best


def format_best(rows: list[dict[str, Any]]) -> str:
    """The `best` table (printed after the rows where a kind ran in more than one configuration):
    each kind's fastest configuration, and its tokens/s against the fastest dense twin's
    (`relu_gated`) and against the twin at the same remat and micro-batch where that ran."""
    best = best_rows(rows)
    counts: dict[str, int] = {}
    for r in rows:
        key = variant_label(r["kind"], r["backend"], "").rstrip(":")
        counts[key] = counts.get(key, 0) + 1
    if all(n < 2 for n in counts.values()):
        return ""
    twin = best.get("relu_gated")
    lines = ["| kind | fastest configuration | tokens/s | vs the twin's fastest | vs the twin, same configuration "
             "| compiled GiB |", "|---|---|---|---|---|---|"]
    for key, r in best.items():
        same = next((t for t in rows if t["kind"] == "relu_gated" and "error" not in t and t["remat"] == r["remat"]
                     and t["micro_batch"] == r["micro_batch"]), None)
        vs_best = f"{r['tokens_per_s'] / twin['tokens_per_s']:.3f}" if twin else "n/a"
        vs_same = f"{r['tokens_per_s'] / same['tokens_per_s']:.3f}" if same else "not run"
        lines.append(f"| {key} | remat {r['remat']}, micro-batch {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
                     f"{vs_best} | {vs_same} | {_gib(r['compiled_memory_bytes'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from twell_jax.training import parallel

    parallel.prepare_process()  # the twell commands' memory share and XLA options, before any device use
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="0.5b", help="preset whose model shapes are used (configs/)")
    parser.add_argument("--checkpoint", default=None,
                        help="a trained run instead of a preset: its shapes, parameters and per-layer activity "
                             "hints, and the first micro-batch of its validation split as the tokens")
    parser.add_argument("--step", type=int, default=None, help="with --checkpoint: the step (default: newest)")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config overrides applied to the preset (e.g. model.n_layers=4 data.seq_len=1024)")
    parser.add_argument("--variants", default="ref:none,relu_gated:none,twell:none",
                        help="comma-separated kind[@backend]:remat (kind = an FFN kind or 'ref'; backend = an "
                             "op backend for the sparse kinds, default the config's)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default: the preset's)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    parser.add_argument("--optimizer", action="store_true", help="include the AdamW update in the step")
    parser.add_argument("--peak-flops", type=float, default=H100_BF16_PEAK_FLOPS,
                        help="device peak FLOP/s for MFU (default: H100 SXM bf16 dense, 989.4e12)")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="also profile N steps of each variant and print its top kernels (where the time goes)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, 1 step x 1 run (checks the script on CPU)")
    args = parser.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
    except ValueError as err:  # a usage error: the message names the variant, no traceback
        parser.error(str(err))
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    for name in ("warmup", "trace"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0")
    if args.out and Path(args.out).is_dir():  # checked before the variants run, not when writing their rows
        parser.error(f"--out {args.out} is a directory; give the JSON file to write")
    sets = list(args.set)
    if args.dry_run:
        sets = sets if args.checkpoint else DRY_RUN_SETS + sets  # a run's shapes are its own
        args.steps, args.warmup, args.repeats = 1, 1, 1
    params, hints, tails, source = None, None, None, args.config
    if args.checkpoint:
        params, run_cfg, step = restore_params(args.checkpoint, args.step)
        base = config_lib.apply_overrides(run_cfg, sets)
        hints = run_hints(run_dir_of(args.checkpoint), step, n_layers=base.model.n_layers)
        tails = run_tail_hints(run_dir_of(args.checkpoint), step, n_layers=base.model.n_layers)
        source = f"checkpoint {args.checkpoint} step {step}"
    else:
        base = config_lib.apply_overrides(get_config(args.config), sets)
    micro_batch = args.micro_batch or (2 if args.dry_run else base.train.micro_batch)
    if micro_batch < 1:
        parser.error("--micro-batch must be >= 1")
    # One set of tokens for every variant: a variant of a smaller micro-batch takes its first rows.
    most = max([micro_batch] + [v[3] for v in variants if v[3]])
    if args.checkpoint:
        tokens = jnp.asarray(validation_tokens(args.checkpoint, most))
        if tokens.shape[1] != base.seq_len + 1:
            parser.error(f"--set changed the sequence length: the run's validation split holds "
                         f"{tokens.shape[1] - 1}-token sequences")
    else:
        tokens = jax.random.randint(jax.random.key(1), (most, base.seq_len + 1), 0, base.model.vocab_size)
    device = jax.devices()[0]
    limit = device_memory_limit_bytes()
    print(f"[bench_step] {source} ({base.model.n_layers} layers, d_model {base.model.d_model}, d_ff "
          f"{base.model.d_ff}, vocab {base.model.vocab_size}, seq {base.seq_len}), micro-batch {micro_batch}, "
          f"{'grad + AdamW' if args.optimizer else 'grad only'}, on {device.device_kind}"
          f"{f' ({limit / 2**30:.1f} GiB usable by JAX)' if limit else ''}; "
          f"MFU against {args.peak_flops:.3g} FLOP/s; tokens: "
          f"{'its validation split' if args.checkpoint else 'random ids'}"
          + (f"; 'auto' hints from the run: {', '.join(f'{v:.1f}' for v in hints)}" if hints else "")
          + (f"; tail hints (token-tail / hot-neuron share): {describe_tails(tails)}" if tails else ""), flush=True)
    rows = []
    for kind, backend, remat, batch in variants:
        row = run_variant(base, kind, backend, remat, batch or micro_batch, tokens[:batch or micro_batch],
                          steps=args.steps, warmup=args.warmup, repeats=args.repeats, optimizer=args.optimizer,
                          peak_flops=args.peak_flops, params=params, hints=hints, tails=tails, trace=args.trace,
                          label_batch=batch)
        detail = row.get("error") or (f"{row['ms_per_step']:.2f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
                                      f"compiled in {row['compile_s']:.1f} s")
        if row.get("active_per_layer"):
            detail += (f"; active/token per layer {row['active_per_layer']}; token-tail / hot-neuron "
                       f"share per layer {describe_tails(row['tail_shares_per_layer'])}")
        print(f"[bench_step] {row['variant']}: {detail} ({row.get('how', '')})", flush=True)
        for line in row.get("trace", []):
            print(f"[bench_step]   {line}", flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": args.config, "source": source, "hints": hints,
                                              "tail_hints": tails, "sets": sets, "micro_batch": micro_batch,
                                              "device": device.device_kind, "device_bytes_limit": limit,
                                              "optimizer": args.optimizer,
                                              "peak_flops": args.peak_flops, "rows": rows}, indent=2))
        print(f"[bench_step] wrote {args.out}")
    print(format_table(rows))
    best = format_best(rows)
    if best:
        print(best)
    return rows


if __name__ == "__main__":
    main()
