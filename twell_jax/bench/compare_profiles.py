"""Per-layer sparsity profiles of finished runs against a reference run (issue 23: do the short
`train_to_sparse.py` recipes behind the benchmark checkpoints give the profile of a properly trained
model?). Each run's validation active share of d_ff and dead-neuron share per layer, read at
relative depths (runs of different sizes compare), with how far each is from the first run: the
ratio of mean active shares, the shape distance (total variation of the normalised profiles) and
the dead-share gap (`twell_jax.compare.profile_distance`).

    python experiments/compare_profiles.py REFERENCE_RUN RUN [RUN ...] [--points 8] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from twell_jax.compare import PROFILE_POINTS, layer_profile, profile_distance


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="the run to compare against (e.g. a study run trained long enough)")
    parser.add_argument("runs", nargs="+", help="runs to compare with it (e.g. train_to_sparse checkpoints)")
    parser.add_argument("--points", type=int, default=PROFILE_POINTS, help="relative depths compared")
    parser.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = parser.parse_args(argv)
    if args.points < 1:
        parser.error(f"--points must be >= 1, got {args.points}")
    if args.out and Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a directory; give a file")
    try:
        ref = layer_profile(args.reference)
        profiles = [layer_profile(run) for run in args.runs]
        rows = [{**profile, **profile_distance(ref, profile, args.points)} for profile in profiles]
    except ValueError as err:
        parser.error(str(err))
    result = {"reference": ref, "runs": rows}
    print(f"reference {ref['run']}: {ref['n_layers']} layers, d_ff {ref['d_ff']}, {ref['steps']} steps, "
          f"val loss {ref['val_loss']}; active share by depth "
          + " ".join(f"{v:.2%}" for v in rows[0]["active_share_a"]))
    print("\n| run | layers | steps | val loss | active share by depth | vs reference (level) | shape distance | dead-share gap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dead = "-" if r["dead_gap"] is None else f"{r['dead_gap']:+.1%}"
        print(f"| {r['run']} | {r['n_layers']} | {r['steps']} | {r['val_loss']} | "
              + " ".join(f"{v:.2%}" for v in r["active_share_b"])
              + f" | {r['level_ratio']:.2f}x | {r['shape_distance']:.3f} | {dead} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
