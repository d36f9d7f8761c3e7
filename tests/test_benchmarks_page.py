"""BENCHMARKS.md and README's headline table are renders of experiments/results/ (twell_jax/bench/report.py):
the committed files must equal the render, and the results folder holds exactly what the page cites."""
from __future__ import annotations

import json

import pytest

from twell_jax.bench import report


def _cited(manifest) -> set[str]:
    files = {plot["file"] for plot in manifest["plots"]}
    for area in manifest["areas"]:
        for row in area["rows"]:
            files.add(row["source"]["file"])
            files.update(row[ref]["file"] for ref in ("dense", "plain", "paper") if row.get(ref) and "file" in row[ref])
    return files


def test_committed_page_and_readme_headline_are_the_render():
    manifest = report.load_manifest()
    assert report.PAGE.read_text() == report.render_markdown(manifest), (
        "BENCHMARKS.md differs from the render of experiments/results/page.json: run python -m twell_jax.bench.report")
    readme = report.README.read_text()
    assert readme == report.readme_with_headline(readme, manifest)
    assert report.main(["--check"]) == 0


def test_results_folder_holds_what_the_page_cites():
    manifest = report.load_manifest()
    present = {p.name for p in report.RESULTS.iterdir()} - {"page.json"}
    assert present == _cited(manifest)
    for name in manifest["plots"]:
        assert (report.FIGURES / f"{name['name']}.png").is_file()


def test_paths_and_ratios(tmp_path):
    data = {"rows": [{"v": "a", "k": 29.0, "ms": 2.0}, {"v": "b", "k": 29.0, "ms": 4.0}]}
    assert report.lookup(data, "rows[v=b,k=29].ms") == 4.0
    assert report.lookup(data, "rows[1].v") == "b"
    # A value may hold ", ": pairs split only at a comma that starts the next key=.
    phased = {"rows": [{"phase": "generate, chunk 1", "b": 1, "t": 3.0}, {"phase": "generate, chunk 16", "b": 1, "t": 5.0}]}
    assert report.lookup(phased, "rows[phase=generate, chunk 16,b=1].t") == 5.0
    with pytest.raises(KeyError, match="matches 2 elements"):
        report.lookup(data, "rows[k=29].ms", "row 0")
    with pytest.raises(KeyError, match="no key 'x'"):
        report.lookup(data, "rows[0].x", "row 0")
    # A bad index or selection names the row and the path, like a missing key.
    for path, message in (("rows[5].ms", "out of range"), ("rows[0][1]", "not a list"),
                          ("rows[0].v[k=1]", "not a list"), ("rows[b]", "key=value")):
        with pytest.raises(KeyError, match=message) as err:
            report.lookup(data, path, "row 0")
        assert "row 0" in str(err.value) and path in str(err.value)
    (tmp_path / "r.json").write_text(json.dumps(data))
    source = dict(file="r.json", gpu="G", date="D", command="C")
    manifest = {"intro": [], "areas": [{"title": "T", "rows": [
        dict(label="b {rows[1].k:.0f}", kind="time", unit="ms", source=source, figure="rows[v=b].ms",
             dense=dict(path="rows[v=a].ms")),
        dict(label="rate", kind="rate", unit="/s", source=source, figure="rows[v=b].ms", dense=dict(path="rows[v=a].ms"))]}]}
    (_, rows), = report.rows_of(manifest, tmp_path)
    assert rows[0]["what"] == "b 29" and rows[0]["vs_dense"] == "0.500x" and rows[1]["vs_dense"] == "2.000x"
    manifest["areas"][0]["rows"][0]["kind"] = "speed"
    with pytest.raises(ValueError, match="kind must be one of"):
        report.rows_of(manifest, tmp_path)
    manifest["areas"][0]["rows"][0].update(kind="time", source=dict(source, file="missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        report.rows_of(manifest, tmp_path)


def test_a_plot_drawn_by_its_script_is_copied(tmp_path):
    png = b"\x89PNG\r\n\x1a\n not really an image"
    (tmp_path / "curves.png").write_bytes(png)
    manifest = {"plots": [{"name": "curves", "title": "T", "file": "curves.png"}]}
    assert report.render_plots(manifest, tmp_path, tmp_path / "figures") == {tmp_path / "figures" / "curves.png": png}
    manifest["plots"][0]["file"] = "missing.png"
    with pytest.raises(FileNotFoundError, match="missing.png"):
        report.render_plots(manifest, tmp_path, tmp_path / "figures")


def test_side_by_side_area_puts_the_papers_change_beside_ours(tmp_path):
    (tmp_path / "paper.json").write_text(json.dumps({"sizes": [{"size": "1b", "step": 21.9, "memory": -25.5}]}))
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"v": "sparse", "ms": 400.0, "gib": 30.0},
                                                           {"v": "twin", "ms": 500.0, "gib": 40.0}]}))
    source = dict(file="r.json", gpu="G", date="D", command="C")
    rows = [dict(label="step", kind="time", unit="ms", source=source, figure="rows[v=sparse].ms",
                 dense=dict(path="rows[v=twin].ms"), paper=dict(file="paper.json", path="sizes[size=1b].step")),
            dict(label="memory", kind="cost", unit="GiB", source=source, figure="rows[v=sparse].gib",
                 dense=dict(path="rows[v=twin].gib"), paper=dict(file="paper.json", path="sizes[size=1b].memory")),
            dict(label="memory, no paper figure", kind="cost", unit="GiB", source=source, figure="rows[v=sparse].gib",
                 dense=dict(path="rows[v=twin].gib"))]
    manifest = {"intro": [], "areas": [{"title": "T", "side_by_side": True, "rows": rows}]}
    (_, rendered), = report.rows_of(manifest, tmp_path)
    # A time's speed-up reads as throughput (500/400 = +25%), a cost as its change (30/40 = -25%).
    assert [(r["paper"], r["ours"]) for r in rendered] == [("+21.9%", "+25.0%"), ("-25.5%", "-25.0%"),
                                                            ("no counterpart", "-25.0%")]
    page = report.render_markdown(manifest, tmp_path)
    assert "| what | paper | ours | figure | dense | GPU | date | command | result file |" in page
    assert "| step | +21.9% | +25.0% | 400.000 ms | 500.000 | G | D | `C` | `r.json` |" in page
    # Without a dense reference there is no change to show.
    del rows[0]["dense"]
    with pytest.raises(ValueError, match="needs a dense reference"):
        report.rows_of(manifest, tmp_path)
