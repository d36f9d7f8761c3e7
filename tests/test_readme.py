"""The README's code stays true: its Python example runs and its commands name real entry points."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_matches_the_dense_backend():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
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


def test_readme_starts_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    first_block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert "twell compare" in first_block[0]
    assert "pytest" in first_block[1] and "tests" in first_block[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "pytest -q tests" in ci
