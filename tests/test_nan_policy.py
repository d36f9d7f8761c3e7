"""The sparse op's NaN policy (issue 11 item 10): PROPAGATE, like the dense formula.

A NaN or Inf in any weight row (silent neurons included) or in the input makes `y` and the
gradients non-finite on every backend exactly where the dense backend's are, and `aux["l0"]` is
the same on every backend. A sparse backend that skips the rows of silent neurons would otherwise
return finite numbers for a broken model, so "every backend is exact" would hold for finite inputs
only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import ops

M, D, H = 16, 32, 64
SILENT = 5  # a neuron whose activating row makes it fire for no token
CONFIG = ops.SparseFFNConfig(tile=16, slots=8, ell_width=16, tail_rows=1.0, transpose_ell_width=16,
                             transpose_tail_rows=1.0)
BACKENDS = ("reference", "pallas")


def _inputs(gated: bool, where: str, value: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (M, D))
    x = x.at[:, 0].set(1.0)  # a bias column: column 0 of the activating weight is a threshold
    names = ("w_gate", "w_up", "w_down") if gated else ("w_up", "w_down")
    weights = {n: 0.2 * jax.random.normal(k, (H, D)) for n, k in zip(names, keys[1:])}
    activating = "w_gate" if gated else "w_up"
    weights[activating] = weights[activating].at[SILENT].set(0.0).at[SILENT, 0].set(-100.0)
    if where == "x":
        x = x.at[3, 7].set(value)
    else:  # a row of the silent neuron, outside the threshold column
        weights[where] = weights[where].at[SILENT, 1].set(value)
    return x, weights


def _run(gated: bool, backend: str, x: jax.Array, weights: dict[str, jax.Array]):
    def loss(x_, w):
        if gated:
            y, aux = ops.gated_ffn(x_, w["w_gate"], w["w_up"], w["w_down"], backend=backend, config=CONFIG,
                                   interpret=backend == "pallas")
        else:
            y, aux = ops.ffn(x_, w["w_up"], w["w_down"], backend=backend, config=CONFIG,
                             interpret=backend == "pallas")
        return jnp.sum(y) + 0.1 * aux["l1"], (y, aux)

    (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights)
    return y, aux, grads


CASES = [
    pytest.param(True, "w_up", np.nan, "reference"),
    pytest.param(True, "w_up", np.nan, "pallas"),
    pytest.param(True, "w_down", np.inf, "reference"),
    pytest.param(True, "w_down", np.inf, "pallas"),
    pytest.param(True, "x", np.nan, "reference"),
    pytest.param(True, "x", np.nan, "pallas"),
    pytest.param(False, "w_down", np.nan, "reference"),
    pytest.param(False, "w_down", np.nan, "pallas"),
    pytest.param(False, "x", np.inf, "reference"),
    pytest.param(False, "x", np.inf, "pallas"),
]


@pytest.mark.parametrize("gated,where,value,backend", CASES)
def test_non_finite_values_propagate_like_dense(gated, where, value, backend):
    x, weights = _inputs(gated, where, value)
    y_ref, aux_ref, grads_ref = _run(gated, "dense", x, weights)
    y, aux, grads = _run(gated, backend, x, weights)
    assert not np.all(np.isfinite(y_ref))  # the dense formula propagates: the policy's reference
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(y_ref))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(np.asarray(aux["l0"]), np.asarray(aux_ref["l0"]))
    assert int(aux["dense_fallback"]) == 1  # the sparse backends report taking the dense path


@pytest.mark.parametrize("where,value", [("x", np.nan), ("w_up", np.inf)])
def test_a_dense_forward_then_the_pallas_backward_propagates_like_dense(where, value, monkeypatch):
    """The training "auto" plan dense forward + Pallas backward: the backward rebuilds the pattern
    from the (non-finite) input before its one branch, into which the NaN/Inf flag is folded; the
    branch must still run the dense formula."""
    from twell_jax.ops import pallas_forward, planner

    monkeypatch.setattr(pallas_forward, "available", lambda: True)
    monkeypatch.setattr(planner, "choose_training_path", lambda *a, **k: (False, True))
    config = ops.SparseFFNConfig(**{**CONFIG.__dict__, "expected_active_per_token": 4.0})
    assert ops.auto_decision(True, config, (M, D, H, 4), interpret=True) == ("dense", "pallas")
    x, weights = _inputs(True, where, value)

    def loss(x_, w):
        y, aux = ops.gated_ffn(x_, w["w_gate"], w["w_up"], w["w_down"], backend="auto", config=config,
                               interpret=True)
        return jnp.sum(y) + 0.1 * aux["l1"], y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights)
    y_ref, _, grads_ref = _run(True, "dense", x, weights)
    assert not all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads_ref))  # dense propagates
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(y_ref))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gated", [True, False])
def test_finite_inputs_with_a_silent_neuron_match_dense(gated, backend):
    """The same inputs without the NaN: every backend equals dense (the test's setup is sound)."""
    x, weights = _inputs(gated, "x", 1.0)
    y_ref, aux_ref, grads_ref = _run(gated, "dense", x, weights)
    y, aux, grads = _run(gated, backend, x, weights)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["l0"], aux_ref["l0"])
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_check_finite_off_reads_only_active_rows_and_is_validated():
    """check_finite=False (generation from verified weights): no NaN/Inf pass, so a NaN in a row
    of a neuron that never fires does not reach y, and no dense fallback is reported."""
    import jax.numpy as jnp
    import numpy as np
    import pytest

    from twell_jax import ops

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    w_gate = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
    w_gate = w_gate.at[3].set(-1.0)
    x = jnp.abs(x)  # x > 0 and w_gate[3] < 0: neuron 3 is silent on every token
    w_up = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32).at[3, 0].set(jnp.nan)
    unchecked = ops.SparseFFNConfig(tile=4, slots=4, check_finite=False)
    y, aux = ops.gated_ffn(x, w_gate, w_up, w_down, backend="reference", config=unchecked)
    assert np.all(np.isfinite(np.asarray(y))) and int(aux["dense_fallback"]) == 0
    y_checked, aux_checked = ops.gated_ffn(x, w_gate, w_up, w_down, backend="reference",
                                           config=ops.SparseFFNConfig(tile=4, slots=4))
    assert not np.all(np.isfinite(np.asarray(y_checked))) and int(aux_checked["dense_fallback"]) == 1
    with pytest.raises(ValueError, match="check_finite"):
        ops.SparseFFNConfig(check_finite=1)


def _conds(jaxpr) -> int:
    """The cond / switch equations of a jaxpr and of every jaxpr inside it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "cond"
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _conds(inner)
    return n


@pytest.mark.parametrize("backend,extra", [("pallas", 0), ("reference", 2)])
def test_the_pallas_forward_folds_the_nan_check_into_its_own_branch(backend, extra):
    """check_finite costs the Pallas training step no branch of its own: the flag joins the
    forward's overflow switch and the backward's switch (a device-side branch makes the host wait
    for the GPU). The reference backend keeps the op's cond around its forward, and its backward
    one of its own."""
    x, weights = _inputs(True, "x", 1.0)

    def step(check):
        config = ops.SparseFFNConfig(**{**CONFIG.__dict__, "check_finite": check})

        def loss(x_, w):
            y, aux = ops.gated_ffn(x_, w["w_gate"], w["w_up"], w["w_down"], backend=backend,
                                   config=config, interpret=backend == "pallas")
            return jnp.sum(y) + 0.1 * aux["l1"]
        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, weights).jaxpr

    assert _conds(step(True)) == _conds(step(False)) + extra
