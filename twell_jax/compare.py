"""Dense-vs-sparse comparison: train the dense `relu_gated` twin and the sparse `twell` model on the
same data and seed, then write one table (console, markdown, JSON) and a PNG of loss curves and
per-layer sparsity."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from twell_jax.config import FFN_KIND_TABLE, ExperimentConfig
from twell_jax.training.train import TrainResult, train


def twin_configs(cfg: ExperimentConfig) -> tuple[ExperimentConfig, ExperimentConfig]:
    """(dense relu_gated baseline without L1, sparse twell model with cfg's L1), otherwise identical."""
    dense = dataclasses.replace(
        cfg, name=f"{cfg.name}-dense",
        model=dataclasses.replace(cfg.model, ffn_kind="relu_gated"),
        sparsity=dataclasses.replace(cfg.sparsity, l1_coef=0.0, reinit_dead=False))
    sparse_kind = cfg.model.ffn_kind if cfg.model.kind.sparse_op else "twell"
    sparse = dataclasses.replace(cfg, name=f"{cfg.name}-twell",
                                 model=dataclasses.replace(cfg.model, ffn_kind=sparse_kind))
    return dense, sparse


def _fmt_bytes(value: float | None) -> str:
    return "n/a (CPU)" if value is None else f"{value / 2**30:.2f} GiB"


def comparison_rows(dense: dict[str, Any], sparse: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, dense, sparse) rows of the comparison table."""
    d_ff = dense["d_ff"]
    rel = 100.0 * (sparse["val_loss"] - dense["val_loss"]) / dense["val_loss"]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    return [
        ("FFN", f"{dense['ffn_kind']} ({FFN_KIND_TABLE[dense['ffn_kind']].backend(dense['ffn_backend'])})",
         f"{sparse['ffn_kind']} ({FFN_KIND_TABLE[sparse['ffn_kind']].backend(sparse['ffn_backend'])})"),
        ("L1 coefficient", f"{dense['l1_coef']:g}", f"{sparse['l1_coef']:g}"),
        ("validation loss (CE)", f"{dense['val_loss']:.4f}", f"{sparse['val_loss']:.4f}"),
        ("relative CE change", "-", f"{rel:+.2f}%"),
        ("validation perplexity", f"{dense['val_perplexity']:.2f}", f"{sparse['val_perplexity']:.2f}"),
        (f"mean active neurons/token (of {d_ff})", f"{dense['val_l0_mean']:.1f}", f"{sparse['val_l0_mean']:.1f}"),
        ("FFN activation sparsity", pct(dense["val_sparsity"]), pct(sparse["val_sparsity"])),
        ("dead neurons", pct(dense["dead_share_mean"]), pct(sparse["dead_share_mean"])),
        ("train tokens/s (median step)", f"{dense['tokens_per_s']:.0f}", f"{sparse['tokens_per_s']:.0f}"),
        ("peak device memory", _fmt_bytes(dense["peak_memory_bytes"]), _fmt_bytes(sparse["peak_memory_bytes"])),
        ("wall time (train + eval)", f"{dense['wall_time_s']:.0f}s", f"{sparse['wall_time_s']:.0f}s"),
    ]


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| metric | dense (relu_gated) | sparse (twell) |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def console_table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows + [("metric", "dense (relu_gated)", "sparse (twell)")]) for i in range(3)]
    header = ("metric", "dense (relu_gated)", "sparse (twell)")
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


def plot(dense: TrainResult, sparse: TrainResult, path: Path) -> None:
    """Loss curves (train CE per step, validation loss at the end) and per-layer sparsity bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_sparsity) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result, label, color in ((dense, "dense relu_gated", "tab:blue"), (sparse, "sparse twell", "tab:red")):
        steps = [r["step"] for r in result.history]
        ax_loss.plot(steps, [r["ce"] for r in result.history], color=color, alpha=0.8, label=f"{label} train CE")
        if result.summary.get("val_loss") is not None:
            ax_loss.scatter([steps[-1]], [result.summary["val_loss"]], color=color, marker="*", s=120,
                            label=f"{label} val loss {result.summary['val_loss']:.3f}")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)
    d_ff = dense.summary["d_ff"]
    layers = np.arange(len(dense.summary["val_l0_per_layer"]))
    for offset, result, label, color in ((-0.2, dense, "dense relu_gated", "tab:blue"),
                                         (0.2, sparse, "sparse twell", "tab:red")):
        zero_pct = 100.0 * (1.0 - np.asarray(result.summary["val_l0_per_layer"]) / d_ff)
        ax_sparsity.bar(layers + offset, zero_pct, width=0.4, color=color, label=label)
    ax_sparsity.axhline(90.0, color="gray", linestyle="--", linewidth=1, label="90%")
    ax_sparsity.set_xlabel("layer")
    ax_sparsity.set_ylabel("FFN activations that are zero (%)")
    ax_sparsity.set_title("per-layer sparsity (validation)")
    ax_sparsity.set_ylim(0, 100)
    ax_sparsity.set_xticks(layers)
    ax_sparsity.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(cfg: ExperimentConfig, out_dir: str | Path, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train both twins under `out_dir/{dense,twell}` and write the comparison files into `out_dir`."""
    import time

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dense_cfg, sparse_cfg = twin_configs(cfg)
    results = {}
    for key, run_cfg in (("dense", dense_cfg), ("twell", sparse_cfg)):
        echo(f"[twell] compare: training the {key} model ({run_cfg.model.ffn_kind}, L1 "
             f"{run_cfg.sparsity.l1_coef:g}) -> {out_dir / key}")
        start = time.perf_counter()
        result = train(run_cfg, out_dir / key, echo=echo)
        result.summary["wall_time_s"] = time.perf_counter() - start
        results[key] = result
    rows = comparison_rows(results["dense"].summary, results["twell"].summary)
    table = console_table(rows)
    echo("\n" + table + "\n")
    png = out_dir / "compare.png"
    plot(results["dense"], results["twell"], png)
    summary = {"dense": results["dense"].summary, "twell": results["twell"].summary,
               "relative_ce_change": (results["twell"].summary["val_loss"] - results["dense"].summary["val_loss"])
               / results["dense"].summary["val_loss"]}
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "compare.md").write_text(markdown_table(rows) + "\n")
    echo(f"[twell] compare: wrote {png}, {out_dir / 'compare.md'}, {out_dir / 'compare.json'}")
    return summary
