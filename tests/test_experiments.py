"""experiments/ follows its one convention (experiments/README.md): every script is a shim that calls
the `main` of a module of twell_jax/bench/, or one of the README's exceptions, and every script is
listed in the README. Read from the files (`ast`); nothing is run."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
README = EXPERIMENTS / "README.md"
# The full scripts experiments/README.md lists as exceptions, with why.
EXCEPTIONS = {"make_hf_fixture.py"}


def scripts() -> list[Path]:
    return sorted(EXPERIMENTS.glob("*.py"))


def shim_module(path: Path) -> str | None:
    """The twell_jax.bench module whose `main` the shim `path` calls, or None when `path` is not a
    shim (more than the docstring, the sys.path line, one `from twell_jax.bench.X import main` and
    the `__main__` block)."""
    tree = ast.parse(path.read_text())
    body = tree.body[1:] if ast.get_docstring(tree) else tree.body
    imports = [node for node in body if isinstance(node, ast.ImportFrom) and node.module
               and node.module.startswith("twell_jax.bench.") and [a.name for a in node.names] == ["main"]]
    allowed = (ast.Import, ast.ImportFrom, ast.Expr, ast.If)
    if len(imports) != 1 or len(body) > 6 or not all(isinstance(node, allowed) for node in body):
        return None
    return imports[0].module


@pytest.mark.parametrize("path", scripts(), ids=lambda p: p.name)
def test_every_script_is_a_shim_over_a_bench_module_or_a_listed_exception(path):
    if path.name in EXCEPTIONS:
        return
    module = shim_module(path)
    assert module is not None, (f"{path.name} is a full script: move its code to twell_jax/bench/ and leave the "
                                "shim (experiments/README.md), or list it as an exception there and here")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{path.name} calls {module}, which does not exist"
    source = ast.parse(Path(spec.origin).read_text())
    names = {node.name for node in source.body if isinstance(node, ast.FunctionDef)}
    runs_as_main = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in source.body)
    assert "main" in names and runs_as_main, f"{module} needs main() and an `if __name__ == \"__main__\"` block"


def test_every_script_is_in_the_readme():
    text = README.read_text()
    missing = [path.name for path in scripts() if f"`{path.name}`" not in text]
    assert not missing, f"experiments/README.md does not list {missing}"
    assert all(f"`{name}`" in text for name in EXCEPTIONS)
