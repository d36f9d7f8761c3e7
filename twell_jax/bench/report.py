"""BENCHMARKS.md and its plots, rendered from the result files in experiments/results/.

    python -m twell_jax.bench.report            # writes BENCHMARKS.md, README's headline, docs/figures/*.png
    python -m twell_jax.bench.report --check    # exit 1 when either differs from the render

The page is one table of CURRENT figures per area. What it shows is listed in
experiments/results/page.json (the manifest): per area, rows that each name a result file (a JSON a
benchmark wrote, or a small record transcribing a measured figure with its source) and the paths
of the figure, of the dense figure and of the plain-JAX figure of the same run inside it. Every
number on the page is read from those files here; the ratios are computed here. To update a row,
replace its file by a newer run's and point the row at it; to add one, add a row.

Plots (the manifest's "plots", shown at the end of the page from docs/figures/<name>.png): drawn
here from a result JSON's items ("panels"), or, when "file" names a .png a script drew itself,
that image copied (it is a result file like the others: cited, and kept in experiments/results/).

Paths: dot-separated keys; `[3]` indexes a list; `[key=value,...]` picks the one list element whose
fields equal those values (numbers compared as numbers). Row kinds: "time" (lower is better: the
ratios are reference / figure, a speed-up), "rate" (higher is better: figure / reference), "cost"
(lower is better, memory or energy: figure / reference, below 1 = less), "value" (no ratio).

An area with `"side_by_side": true` is a table of another source's figures beside ours: each row's
"paper" ({"file", "path"}: a change in percent, e.g. the paper's figures transcribed in
paper_anchors.json; without it the cell reads "no counterpart") and "ours", the row's ratio to its
dense reference as a change in percent (a time's speed-up +x% = throughput, a rate's gain, a cost's
change), so that both columns read alike.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
PAGE = ROOT / "BENCHMARKS.md"
README = ROOT / "README.md"
# The README's headline table sits between these lines (rendered like the page).
HEADLINE_START, HEADLINE_END = "<!-- headline table: python -m twell_jax.bench.report -->", "<!-- end of headline table -->"
FIGURES = ROOT / "docs" / "figures"
KINDS = ("time", "rate", "cost", "value")

_STEP = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def lookup(data: Any, path: str, where: str = "") -> Any:
    """The value at `path` inside `data` (module doc); a KeyError naming `where` and the path when
    it is missing or a selection is not unique."""
    node = data
    for key, selector in _STEP.findall(path):
        if key:
            if not isinstance(node, dict) or key not in node:
                raise KeyError(f"{where}: no key {key!r} on the way to {path!r}")
            node = node[key]
        elif not isinstance(node, list):
            raise KeyError(f"{where}: [{selector}] applied to a {type(node).__name__}, not a list, on the way to "
                           f"{path!r}")
        elif re.fullmatch(r"-?\d+", selector):
            if not -len(node) <= int(selector) < len(node):
                raise KeyError(f"{where}: [{selector}] is out of range of a list of {len(node)} on the way to {path!r}")
            node = node[int(selector)]
        else:
            if "=" not in selector or not all(isinstance(item, dict) for item in node):
                raise KeyError(f"{where}: [{selector}] needs key=value pairs over a list of objects, on the way to "
                               f"{path!r}")
            # pairs split at the commas that start the next key=, so a value may hold ", " ("generate, chunk 16")
            wanted = dict(part.split("=", 1) for part in re.split(r",(?=\w+=)", selector))
            hits = [item for item in node if all(str(item.get(k)) == v or item.get(k) == _scalar(v)
                                                  for k, v in wanted.items())]
            if len(hits) != 1:
                raise KeyError(f"{where}: [{selector}] matches {len(hits)} elements on the way to {path!r}")
            node = hits[0]
    return node


def _load(results: Path, name: str, cache: dict[str, Any]) -> Any:
    if name not in cache:
        path = results / name
        if not path.is_file():
            raise FileNotFoundError(f"page.json cites {name}, which is not in {results}")
        cache[name] = json.loads(path.read_text())
    return cache[name]


def _number(value: Any, scale: float, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return float(value) * scale


def _ratio(kind: str, figure: float, reference: float | None) -> str:
    if reference is None or kind == "value":
        return ""
    ratio = reference / figure if kind == "time" else figure / reference
    return f"{ratio:.3f}x"


def _change(kind: str, figure: float, reference: float) -> str:
    """The ratio of `_ratio` as a change in percent: +23.8% for a 1.238x speed-up, -11.5% for 0.885x memory."""
    ratio = reference / figure if kind == "time" else figure / reference
    return f"{(ratio - 1) * 100:+.1f}%"


def _format(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def _label(template: str, data: Any, where: str) -> str:
    """The row's label with {path:format} fields filled from its file."""
    def fill(match: re.Match) -> str:
        path, _, spec = match.group(1).partition(":")
        return format(lookup(data, path, where), spec)
    return re.sub(r"\{([^{}]+)\}", fill, template)


def rows_of(manifest: dict[str, Any], results: Path = RESULTS) -> list[tuple[str, list[dict[str, str]]]]:
    """[(area title, rendered rows)] of the manifest: every figure read from its file."""
    cache: dict[str, Any] = {}
    areas = []
    for area in manifest["areas"]:
        rendered = []
        for i, row in enumerate(area["rows"]):
            where = f"page.json {area['title']!r} row {i}"
            if row.get("kind") not in KINDS:
                raise ValueError(f"{where}: kind must be one of {KINDS}, got {row.get('kind')!r}")
            source = row["source"]
            data = _load(results, source["file"], cache)
            scale = float(row.get("scale", 1.0))
            figure = _number(lookup(data, row["figure"], where), scale, where)
            refs = {}
            for ref in ("dense", "plain"):
                spec = row.get(ref)
                if spec is None:
                    refs[ref] = None
                    continue
                ref_data = _load(results, spec.get("file", source["file"]), cache)
                refs[ref] = _number(lookup(ref_data, spec["path"], where), scale, where)
            digits = int(row.get("digits", 3))
            paper = ours = ""
            if area.get("side_by_side"):
                if refs["dense"] is None or row["kind"] not in ("time", "rate", "cost"):
                    raise ValueError(f"{where}: a side-by-side row needs a dense reference and a time, rate or cost kind")
                ours, paper = _change(row["kind"], figure, refs["dense"]), "no counterpart"
                if "paper" in row:
                    paper_data = _load(results, row["paper"]["file"], cache)
                    paper = f"{_number(lookup(paper_data, row['paper']['path'], where), 1.0, where):+.1f}%"
            rendered.append(dict(
                paper=paper, ours=ours,
                what=_label(row["label"], data, where),
                headline=_label(row.get("headline_label", row["label"]), data, where), gpu=source["gpu"], date=source["date"],
                command=source["command"], figure=f"{_format(figure, digits)} {row['unit']}".strip(),
                dense="" if refs["dense"] is None else _format(refs["dense"], digits),
                vs_dense=_ratio(row["kind"], figure, refs["dense"]),
                plain="" if refs["plain"] is None else _format(refs["plain"], digits),
                vs_plain=_ratio(row["kind"], figure, refs["plain"]),
                file=source["file"]))
        areas.append((area, rendered))
    return areas


def _table(rows: list[dict[str, str]], with_source: bool = True, side_by_side: bool = False) -> list[str]:
    head = ["what", "figure", "dense", "vs dense", "plain JAX", "vs plain JAX", "GPU", "date"]
    keys = ["what", "figure", "dense", "vs_dense", "plain", "vs_plain", "gpu", "date"]
    if side_by_side:
        head = ["what", "paper", "ours", "figure", "dense", "GPU", "date"]
        keys = ["what", "paper", "ours", "figure", "dense", "gpu", "date"]
    if with_source:
        head, keys = head + ["command", "result file"], keys + ["command", "file"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row[k] if k not in ("command", "file") else f"`{row[k]}`" for k in keys]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def render_markdown(manifest: dict[str, Any], results: Path = RESULTS) -> str:
    """BENCHMARKS.md: the manifest's intro, then one table per area."""
    out = ["# Benchmarks: current figures", ""]
    for paragraph in manifest["intro"]:
        out += [paragraph, ""]
    for area, rows in rows_of(manifest, results):
        out += [f"## {area['title']}", ""]
        for paragraph in area.get("notes", []):
            out += [paragraph, ""]
        out += _table(rows, side_by_side=bool(area.get("side_by_side"))) + [""]
    for plot in manifest.get("plots", []):
        out += [f"![{plot['title']}](docs/figures/{plot['name']}.png)", ""]
    return "\n".join(out).rstrip() + "\n"


def headline_markdown(manifest: dict[str, Any], results: Path = RESULTS) -> str:
    """The README's headline table: the rows the manifest marks `headline`."""
    rows = []
    for area, rendered in rows_of(manifest, results):
        rows += [dict(r, what=r["headline"]) for r, spec in zip(rendered, area["rows"]) if spec.get("headline")]
    return "\n".join(_table(rows, with_source=False)) + "\n"


def readme_with_headline(readme: str, manifest: dict[str, Any], results: Path = RESULTS) -> str:
    """`readme` with its headline block (between HEADLINE_START and HEADLINE_END) re-rendered."""
    start, end = readme.find(HEADLINE_START), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md must hold the lines {HEADLINE_START!r} and {HEADLINE_END!r}, in that order")
    return readme[:start] + HEADLINE_START + "\n" + headline_markdown(manifest, results) + readme[end:]


def render_plots(manifest: dict[str, Any], results: Path = RESULTS, out_dir: Path = FIGURES) -> dict[Path, bytes]:
    """The manifest's plots as PNG bytes (matplotlib), by the path they belong at."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cache: dict[str, Any] = {}
    rendered = {}
    for plot in manifest.get("plots", []):
        where = f"page.json plot {plot['name']!r}"
        if plot["file"].endswith(".png"):  # drawn by its script: copied as it is
            image = results / plot["file"]
            if not image.is_file():
                raise FileNotFoundError(f"{where} cites {plot['file']}, which is not in {results}")
            rendered[out_dir / f"{plot['name']}.png"] = image.read_bytes()
            continue
        data = _load(results, plot["file"], cache)
        fig, axes = plt.subplots(1, len(plot["panels"]), figsize=(5.5 * len(plot["panels"]), 4), squeeze=False)
        for ax, panel in zip(axes[0], plot["panels"]):
            items = lookup(data, panel["items"], where)
            for series in panel["series"]:
                xs = [lookup(item, panel["x"], where) for item in items] if "x" in panel else list(range(len(items)))
                ys = [lookup(item, series["path"], where) * float(series.get("scale", 1.0)) for item in items]
                if "over" in series:  # a ratio: reference / value
                    ys = [lookup(item, series["over"], where) / y for item, y in zip(items, ys)]
                if panel.get("bars"):
                    width = 0.8 / len(panel["series"])
                    offset = panel["series"].index(series) * width
                    ax.bar([x + offset for x in range(len(items))], ys, width, label=series["label"])
                    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(items))],
                                  [lookup(item, panel["tick"], where) for item in items], fontsize=8)
                else:
                    ax.plot(xs, ys, "o", label=series["label"])
            if panel.get("hline") is not None:
                ax.axhline(panel["hline"], color="grey", lw=0.8)
            if panel.get("logx"):
                ax.set_xscale("log")
            ax.set_xlabel(panel.get("xlabel", ""))
            ax.set_ylabel(panel["ylabel"])
            ax.legend(fontsize=8)
        fig.suptitle(plot["title"], fontsize=10)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        rendered[out_dir / f"{plot['name']}.png"] = buffer.getvalue()
    return rendered


def load_manifest(results: Path = RESULTS) -> dict[str, Any]:
    return json.loads((results / "page.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare BENCHMARKS.md and README.md's headline table with the render; write nothing")
    parser.add_argument("--no-plots", action="store_true",
                        help="write BENCHMARKS.md and README.md's headline table, not the plots")
    args = parser.parse_args(argv)
    manifest = load_manifest()
    # Everything is read and rendered before anything is written.
    text = render_markdown(manifest)
    readme = readme_with_headline(README.read_text(), manifest)
    if args.check:
        same = PAGE.is_file() and PAGE.read_text() == text and README.read_text() == readme
        print("BENCHMARKS.md and README.md's headline are up to date" if same else
              "BENCHMARKS.md or README.md's headline table differs from the render of "
              "experiments/results/page.json: run python -m twell_jax.bench.report")
        return 0 if same else 1
    plots = {} if args.no_plots else render_plots(manifest)
    PAGE.write_text(text)
    README.write_text(readme)
    for path, png in plots.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
    print(f"wrote {PAGE}, {README}" + "".join(f", {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
