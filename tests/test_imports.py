"""The package's import graph: no circles, no arrow up from a lower floor, and every module imports
on its own in a fresh interpreter.

The graph is read from each file's `import` statements (`ast`), function-level ones included (a
lazy import that closes a circle is a circle all the same) and `if TYPE_CHECKING:` blocks left out
(never run). An edge goes to the most specific module named (`from twell_jax.data import cache` ->
`twell_jax.data.cache`; `from twell_jax.data import DataSource` -> the package `twell_jax.data`).
"""
from __future__ import annotations

import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import twell_jax

# The floors, bottom first: a module may import its own group (package or top-level module) and
# any group on a LOWER floor; never one on its own floor or above. A new top-level module or
# package gets a floor here. The kernels know nothing of the library; the configs and the run
# directory sit under everything that reads a run; the CLI and the benchmarks are the top.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("pallas_kernels",),
    ("ops",),
    ("twell_jax", "config", "compile_cache"),
    ("configs", "data", "model", "run_dir"),
    ("training",),
    ("inference",),
    ("compare",),
    ("bench", "cli"),
)
FLOOR_OF = {group: floor for floor, groups in enumerate(FLOORS) for group in groups}


def package_modules() -> dict[str, Path]:
    """Every module of twell_jax (name -> source file), the installed-as `twell_jax.pallas_kernels`
    and `twell_jax.configs` included (in a source checkout their folders are on the package's path)."""
    modules: dict[str, Path] = {"twell_jax": Path(twell_jax.__file__)}

    def walk(paths: list[str], prefix: str) -> None:
        for info in pkgutil.iter_modules(paths):
            name = prefix + info.name
            if info.name == "twell_jax" or name in modules:  # the repository root is on twell_jax's path
                continue
            where = Path(info.module_finder.path) / info.name
            if info.ispkg:
                modules[name] = where / "__init__.py"
                walk([str(where)], name + ".")
            else:
                modules[name] = where.with_suffix(".py")

    walk(list(twell_jax.__path__), "twell_jax.")
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` (source `path`) imports, anywhere in the file."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for branch in child.orelse:
                    visit_one(branch)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def group_of(module: str) -> str:
    """The floor group of a module: its first component under twell_jax (a subpackage or a module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"twell_jax.cli", "twell_jax.run_dir", "twell_jax.training.train", "twell_jax.data.cache",
            "twell_jax.pallas_kernels", "twell_jax.configs"} <= set(graph)
    assert "twell_jax.run_dir" in graph["twell_jax.inference.cli"]  # checkpoint_arg
    assert "twell_jax.data.encode_pool" in graph["twell_jax.data.cache"]


def test_find_cycle_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_from_its_floor_or_above():
    graph = import_graph()
    unknown = sorted({group_of(module) for module in graph} - set(FLOOR_OF))
    assert not unknown, f"modules without a floor: {unknown} (add them to FLOORS in {__file__})"
    upward = sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                    if group_of(source) != group_of(target)
                    and FLOOR_OF[group_of(target)] >= FLOOR_OF[group_of(source)])
    assert not upward, "imports from the same floor or above: " + "; ".join(upward)


# A fresh interpreter per module: the third-party libraries are imported once, then each module of
# twell_jax is imported in a forked child that has none of them, so that an order-dependent
# circle (A imports B imports A at import time) fails there as it would for a user.
_IMPORT_EACH = r"""
import importlib, os, sys
import jax, numpy, optax, flax.nnx, orbax.checkpoint  # noqa: F401 (shared by every child)
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except ImportError as err:
            # A module of an optional extra (lm-eval, ...) names the extra to install: not a circle.
            print(f"{name}: {type(err).__name__}: {err}", flush=True)
            os._exit(0 if "pip install" in str(err) else 1)
        except BaseException as err:  # noqa: BLE001
            print(f"{name}: {type(err).__name__}: {err}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(name)
print("FAILED " + " ".join(failed) if failed else "ALL IMPORTED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child per module")
def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = sorted(package_modules())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.stdout.strip().endswith("ALL IMPORTED"), result.stdout + result.stderr[-3000:]
