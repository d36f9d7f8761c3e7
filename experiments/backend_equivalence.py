"""Do the sparse kernels train the same model as the dense path? (issue 23) The same run (default
`0.5b`, same seed, data and L1) with the op's `dense` backend and with `pallas`, plus the noise
to judge the difference by: the dense run again with half the micro-batch (same tokens, another
gradient-accumulation / reduction order) and with another data-order seed.

    PYTHONPATH=. python experiments/backend_equivalence.py --steps 300 --l1 2e-4 --set train.global_batch=64
    # CPU smoke run:
    PYTHONPATH=. python experiments/backend_equivalence.py --config micro --steps 4 --data synthetic \
        --set model.ffn_interpret=true

The runs are a `twell compare` plan (twell_jax/compare.py) in --out: a call cut short (SIGTERM,
`timeout`) keeps its finished runs and the next call with the same --out continues the
interrupted one from its checkpoint. Prints one table, per pair and over the common steps: the
max |loss difference|, the max |CE difference|, the max |difference| of the mean active count
per token (layer mean, and its relative value), and, for the pallas run, the share of layer-steps
in which the op took its exact dense fallback (a high share means the kernels did not run yet:
raise --l1 or the steps). Writes $OUT/backend_equivalence.json (the runs stay in --out, one
checkpoint each).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from twell_jax.configs import get_config
from twell_jax import compare as compare_lib
from twell_jax import config as config_lib

PAIRS = (("pallas", "dense", "sparse kernels vs dense"),
         ("dense-half-micro-batch", "dense", "noise: reduction order"),
         ("dense-data-seed", "dense", "noise: data order"))


def plan(cfg: config_lib.ExperimentConfig) -> list[compare_lib.StudyRun]:
    """The four runs: twell with backend dense / pallas, then the two noise runs of the dense one."""
    def variant(name: str, **sections) -> compare_lib.StudyRun:
        replaced = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
        return compare_lib.StudyRun(name, dataclasses.replace(cfg, name=f"{cfg.name}-{name}", **replaced))

    half = max(1, cfg.train.micro_batch // 2)
    if half == cfg.train.micro_batch:
        raise ValueError(f"train.micro_batch={cfg.train.micro_batch}: cannot be halved for the reduction-order run")
    return [variant("dense", model={"ffn_backend": "dense"}),
            variant("pallas", model={"ffn_backend": "pallas"}),
            variant("dense-half-micro-batch", model={"ffn_backend": "dense"}, train={"micro_batch": half}),
            variant("dense-data-seed", model={"ffn_backend": "dense"}, data={"seed": cfg.data.seed + 1})]


def curves(run_dir: Path) -> dict[int, dict]:
    """step -> its logged training record (metrics.jsonl, as the loop wrote it)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records if "ce" in r}


def compare_pair(a: dict[int, dict], b: dict[int, dict]) -> dict:
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError("the two runs logged no common step")
    loss = np.array([[a[s]["loss"], b[s]["loss"]] for s in steps])
    ce = np.array([[a[s]["ce"], b[s]["ce"]] for s in steps])
    active = np.array([[np.mean(a[s]["l0_per_layer"]), np.mean(b[s]["l0_per_layer"])] for s in steps])
    return {"steps": len(steps), "last_step": steps[-1],
            "max_abs_loss_diff": float(np.max(np.abs(loss[:, 0] - loss[:, 1]))),
            "max_abs_ce_diff": float(np.max(np.abs(ce[:, 0] - ce[:, 1]))),
            "max_abs_active_diff": float(np.max(np.abs(active[:, 0] - active[:, 1]))),
            "max_rel_active_diff": float(np.max(np.abs(active[:, 0] - active[:, 1]) / np.maximum(active[:, 1], 1e-9))),
            "final_active": active[-1].tolist()}


def fallback_share(run: dict[int, dict]) -> float | None:
    flags = [r["dense_fallback_per_layer"] for r in run.values() if "dense_fallback_per_layer" in r]
    return float(np.mean(flags)) if flags else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="0.5b")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--l1", type=float, default=None, help="sparsity.l1_coef (default: the config's)")
    parser.add_argument("--data", default="stdlib",
                        help="data.source (default stdlib: a BPE of the model's vocabulary, built once and cached)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", default="runs/backend_equivalence",
                        help="directory of the runs (not under $OUT: 0.5b checkpoints are GBs)")
    args = parser.parse_args(argv)
    cfg = get_config(args.config)
    base = [f"train.steps={args.steps}", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=100",
            "train.keep_checkpoints=1",
            "train.eval_batches=2", "train.eval_batch_size=8", "train.progress_bar=false", "model.ffn_kind=twell", f"data.source={args.data}"]
    if args.data != "synthetic":
        base += ["data.tokenizer=bpe", f"data.vocab_size={cfg.model.vocab_size}", "data.val_fraction=0.02"]
    if args.l1 is not None:
        base.append(f"sparsity.l1_coef={args.l1}")
    cfg = config_lib.apply_overrides(cfg, base + args.set)
    out_root = Path(os.environ.get("OUT", "."))
    out = Path(args.out)
    runs = plan(cfg)
    compare_lib.run_study(runs, out, resume=(out / compare_lib.PLAN_FILE).is_file())
    logged = {run.key: curves(out / run.key) for run in runs}
    rows = [{"pair": f"{a} vs {b}", "what": what, **compare_pair(logged[a], logged[b])} for a, b, what in PAIRS]
    noise = max(r["max_abs_loss_diff"] for r in rows[1:])
    result = {"config": args.config, "steps": args.steps, "l1_coef": cfg.sparsity.l1_coef, "data": args.data,
              "global_batch": cfg.train.global_batch, "seq_len": cfg.seq_len, "pairs": rows,
              "pallas_dense_fallback_share": fallback_share(logged["pallas"]),
              "pallas_within_noise": rows[0]["max_abs_loss_diff"] <= noise}
    print("| pair | what | steps | max abs loss diff | max abs CE diff | max abs active diff (rel) |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['what']} | {r['steps']} | {r['max_abs_loss_diff']:.3g} | {r['max_abs_ce_diff']:.3g} "
              f"| {r['max_abs_active_diff']:.3g} ({100 * r['max_rel_active_diff']:.2f}%) |")
    share = result["pallas_dense_fallback_share"]
    print(f"pallas: dense fallback in {'-' if share is None else f'{100 * share:.1f}%'} of layer-steps; "
          f"loss difference {'within' if result['pallas_within_noise'] else 'OUTSIDE'} the measured noise "
          f"({noise:.3g})")
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "backend_equivalence.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
