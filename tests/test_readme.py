"""The README stays true: its op example runs and gives the dense backend's gradients, and every
command it shows names a real entry point with options that exist (wherever it appears)."""

import pathlib
import re
import shlex
import tomllib

import jax
import numpy as np

from twell_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _commands() -> list[list[str]]:
    """Every shell command of the README's bash blocks, as argv lists (`a && b` gives two)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


def test_readme_op_example_runs_and_matches_the_dense_backend():
    examples = [b for b in _python_blocks() if "ops.gated_ffn" in b]
    assert examples, "README.md has no example of the sparse FFN op"
    namespace: dict = {}
    exec(compile(examples[0], "README.md", "exec"), namespace)
    grads = namespace["grads"]
    assert set(grads) == {"w_gate", "w_up", "w_down"}
    # The example's reference-backend gradients equal the dense backend's.
    ops, params, x = namespace["ops"], namespace["params"], namespace["x"]

    def dense_loss(p, x_):
        y, aux = ops.gated_ffn(x_, p["w_gate"], p["w_up"], p["w_down"], backend="dense")
        return (y ** 2).mean() + 2e-5 * aux["l1"]

    dense = jax.grad(dense_loss)(params, x)
    for name in grads:
        np.testing.assert_allclose(grads[name], dense[name], rtol=1e-4, atol=1e-7)


def test_readme_commands_name_real_entry_points_and_options():
    commands = _commands()
    programs = {argv[0] for argv in commands}
    assert {"twell", "python", "pip"} <= programs, programs
    parser = cli._parser()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ci = [" ".join(shlex.split(line, comments=True)) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for argv in commands:
        if argv[0] == "twell":  # the CLI's own parser accepts it (a bad subcommand or option exits)
            parser.parse_args(argv[1:])
        elif argv[:3] == ["python", "-m", "pytest"]:  # the README's test command is what CI runs
            assert any(" ".join(argv[2:]) in line for line in ci), argv
        elif argv[0] == "python":
            script = ROOT / argv[1]
            assert script.is_file(), argv
            source = script.read_text()
            thin = re.search(r"from (twell_jax\.bench\.\w+) import main", source)  # a command over the library
            if thin:
                source += (ROOT / (thin.group(1).replace(".", "/") + ".py")).read_text()
            for option in (a for a in argv[2:] if a.startswith("--")):
                assert f'"{option}"' in source, f"{argv[1]} defines no option {option}"
        elif argv[:3] == ["pip", "install", "-e"]:
            extra = re.fullmatch(r"\.(?:\[(\w+)\])?", argv[3])
            assert extra and (extra.group(1) is None or extra.group(1) in extras), argv
        else:
            raise AssertionError(f"README command with an unknown program: {argv}")
