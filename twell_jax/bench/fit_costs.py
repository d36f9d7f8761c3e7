"""Fit the planner's training cost models (`planner.ForwardCosts`, `planner.BackwardCosts`) to one
`bench_ffn_train.py` run on a GPU, and print the fitted constants, each row's modelled time beside
its measured one, and a `DeviceCosts` entry to put in `planner.COST_MODELS`.

    python experiments/bench_ffn_train.py --quick --shape trained --trace --repeats 10 --out DIR
    python experiments/fit_costs.py DIR/bench_ffn_train.json    # --gpu, --date: the run's, where it has them

What is fitted, from the gated rows of the run (M, D, H as measured; bf16):
- dense: `dense_flops_per_ms` from XLA's inference forward (3 GEMMs), `dense_bwd_flops_per_ms`
  from XLA's forward + backward minus that forward (6 GEMMs); the launch term is kept;
- the pack: `pack_flops_per_ms` from the pack piece alone (its median over the rows);
- the sparse forward: a line through the `pallas` inference forward over the uniform rows without
  tails, the pack subtracted, against each row's mean active count per token (what the planner is
  given): its slope gives `ffn_bytes_per_ms`, its intercept `sparse_fixed_ms` (`ffn_token_ms` is
  kept from the base entry: one M per run cannot separate it);
- the sparse backward: a line through the `pallas` forward + backward minus the fitted forward over
  the same rows, in the bytes the row gathers move: slope `bwd_bytes_per_ms`, intercept
  `bwd_fixed_ms` (which so holds the training forward's extra over the inference forward).
The tails' constants are kept from the base entry (a run's rows rarely hold a tail within its
capacity); the rows with a hot tail (the trained-like pattern) are not fitted, only predicted,
so the printed table shows how well the kept tail model serves them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from twell_jax.ops import planner


@dataclasses.dataclass(frozen=True)
class FittedRow:
    """One measured row against the fitted model (ms)."""

    label: str
    measured_fwd: float
    model_fwd: float
    measured_total: float
    model_total: float
    fitted: bool


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; needs two distinct xs."""
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs rows at two different k at least, got k {sorted(set(xs))}")
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def _fit_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [r for r in run.get("rows", []) if r.get("kind") == "train"]
    if not rows:
        raise ValueError("the run has no training rows (a bench_ffn_train.json of --quick or --cases)")
    for r in rows:
        for key in ("ms", "infer_ms", "piece_ms"):
            if key not in r:
                raise ValueError(f"row k {r.get('k')} ({r.get('synthetic')}) has no {key!r}: "
                                 "not a bench_ffn_train.json of this version")
    shapes = {(r["m"], r["d"], r["h"]) for r in rows}
    if len(shapes) != 1:
        raise ValueError(f"the rows hold several shapes {sorted(shapes)}: fit one (M, D, H) at a time")
    return rows


def _untailed(row: dict[str, Any]) -> bool:
    p = row["pattern"]
    return (row.get("synthetic") == "uniform" and p["token_tail_rows"] == 0 and p["hot_neurons"] == 0
            and np.isfinite(row["ms"].get("pallas", np.inf)))


def fit_training(run: dict[str, Any], base: planner.DeviceCosts, fit: planner.Fit
                 ) -> tuple[planner.DeviceCosts, list[FittedRow]]:
    """(`base` with its forward and backward models refitted to `run`, the rows against the fit)."""
    rows = _fit_rows(run)
    m, d, h = rows[0]["m"], rows[0]["d"], rows[0]["h"]
    flops = 2.0 * m * d * h
    itemsize = 2  # gated bf16 layers: what bench_ffn_train measures
    f0, b0 = base.forward, base.backward
    launch = f0.dense_launch_ms
    dense_fwd = [r["infer_ms"]["xla_bf16"] for r in rows]
    dense_bwd = [r["ms"]["xla_bf16"] - r["infer_ms"]["xla_bf16"] for r in rows]
    dense_flops = 3 * flops / (statistics.median(dense_fwd) - launch)
    dense_bwd_flops = 6 * flops / (statistics.median(dense_bwd) - launch)
    pack_flops = flops / statistics.median(r["piece_ms"]["pack"] for r in rows)

    fitted = [r for r in rows if _untailed(r)]
    # k as the planner gets it: the mean active count of the row's pattern (its `hint`), not its label.
    k_of = lambda r: float(r["pattern"].get("active_mean", r["k"]))  # noqa: E731
    pack_ms = flops / pack_flops
    token_ms = m * f0.ffn_token_ms  # the per-token term of the forward model (gated: 2 rows / 2)
    fixed, slope = _line([k_of(r) for r in fitted],
                         [r["infer_ms"]["pallas"] - pack_ms - token_ms for r in fitted])
    forward = dataclasses.replace(f0, dense_flops_per_ms=dense_flops, pack_flops_per_ms=pack_flops,
                                  sparse_fixed_ms=fixed,
                                  ffn_bytes_per_ms=planner.ffn_gather_bytes(m, d, 1.0, True, itemsize) / slope,
                                  fit=fit)
    with_forward = dataclasses.replace(base, forward=forward)

    def model_fwd(k: float) -> float:
        return planner.sparse_times_ms(m, d, h, k, True, device=with_forward)[0]

    bwd_fixed, per_byte = _line([planner.backward_gather_bytes(m, d, k_of(r), True, itemsize) for r in fitted],
                                [r["ms"]["pallas"] - model_fwd(k_of(r)) for r in fitted])
    backward = dataclasses.replace(b0, bwd_fixed_ms=bwd_fixed, bwd_bytes_per_ms=1.0 / per_byte,
                                   dense_bwd_flops_per_ms=dense_bwd_flops, fit=fit)
    costs = dataclasses.replace(with_forward, backward=backward)

    report = []
    for r in rows:
        if not np.isfinite(r["ms"].get("pallas", np.inf)):
            continue
        p = r["pattern"]
        fwd, bwd = planner.sparse_times_ms(m, d, h, k_of(r), True, device=costs,
                                           tails=(p["token_tail_rows"], p["hot_neurons"], p["hot_entry_share"]))
        report.append(FittedRow(f"{r.get('synthetic')} k {r['k']:g}", r["infer_ms"]["pallas"], fwd,
                                r["ms"]["pallas"], fwd + bwd, r in fitted))
    return costs, report


def entry_source(name: str, costs: planner.DeviceCosts) -> str:
    """Python source of the fitted forward and backward models (the decode model is the base's)."""
    f, b = costs.forward, costs.backward
    fit = f.fit
    return (f"{name} = dataclasses.replace(BASE,\n"
            f"    forward=ForwardCosts(\n"
            f"        dense_flops_per_ms={f.dense_flops_per_ms:.3g}, dense_launch_ms={f.dense_launch_ms:g}, "
            f"pack_flops_per_ms={f.pack_flops_per_ms:.3g}, sparse_fixed_ms={f.sparse_fixed_ms:.3g},\n"
            f"        ffn_token_ms={f.ffn_token_ms:.3g}, ffn_bytes_per_ms={f.ffn_bytes_per_ms:.3g},\n"
            f"        fit=Fit({fit.date!r}, {fit.gpu!r}, {fit.command!r})),\n"
            f"    backward=dataclasses.replace(BASE.backward,\n"
            f"        bwd_fixed_ms={b.bwd_fixed_ms:.3g}, bwd_bytes_per_ms={b.bwd_bytes_per_ms:.3g}, "
            f"dense_bwd_flops_per_ms={b.dense_bwd_flops_per_ms:.3g},\n"
            f"        fit=Fit({fit.date!r}, {fit.gpu!r}, {fit.command!r})))\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", help="a bench_ffn_train.json")
    parser.add_argument("--gpu", help="the GPU it ran on (the Fit record), e.g. 'NVIDIA H200'; default: the "
                        "run's device_kind (bench_ffn_train records it)")
    parser.add_argument("--date", help="the run's date (the Fit record); default: the run's own")
    parser.add_argument("--base", default=planner.FALLBACK_KIND, choices=sorted(planner.COST_MODELS),
                        help="the entry whose kept constants (tails, ffn_token_ms, decode) the fit starts from")
    parser.add_argument("--command", default="python experiments/bench_ffn_train.py --quick --shape trained "
                        "--trace --repeats 10", help="the command that made the run (the Fit record)")
    args = parser.parse_args(argv)
    path = Path(args.result)
    try:
        run = json.loads(path.read_text())
        gpu, date = args.gpu or run.get("device_kind"), args.date or run.get("date")
        if not gpu or not date:
            raise ValueError("the run records no " + " and no ".join(
                name for name, value in (("device_kind (give --gpu)", gpu), ("date (give --date)", date)) if not value))
        costs, report = fit_training(run, planner.COST_MODELS[args.base], planner.Fit(date, gpu, args.command))
    except (OSError, json.JSONDecodeError, ValueError, KeyError) as e:
        print(f"fit_costs: {path}: {e}", file=sys.stderr)
        return 2
    print("| row | fitted | inference fwd measured / model ms | fwd+bwd measured / model ms |")
    print("|---|---|---|---|")
    for r in report:
        print(f"| {r.label} | {'yes' if r.fitted else 'no'} | {r.measured_fwd:.3f} / {r.model_fwd:.3f} | "
              f"{r.measured_total:.3f} / {r.model_total:.3f} |")
    print()
    print(entry_source("FITTED", costs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
