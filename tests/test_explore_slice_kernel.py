"""The column-slice probe's kernels (twell_jax.bench.explore_slice_kernel) in interpret mode against
their references, on the adversarial list patterns, and its command at tiny shapes."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.bench import explore_slice_kernel as esk

M, D, H, W = 32, 32, 64, 16


def _patterns():
    key = jax.random.PRNGKey(3)
    idx, cnt = esk.uniform_lists(key, M, H, 4.0, W)
    yield "uniform", idx, cnt
    yield "all zero", jnp.zeros((M, W), jnp.int32), jnp.zeros((M,), jnp.int32)
    full = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32) * 3, (M, W))
    yield "full rows", full, jnp.full((M,), W, jnp.int32)
    hot = jnp.zeros((M, W), jnp.int32).at[:, 0].set(H - 1)
    yield "one hot neuron", hot, jnp.ones((M,), jnp.int32)
    dense_first = jnp.where(jnp.arange(M)[:, None] < 4, full, idx)
    yield "dense first tokens", dense_first, jnp.where(jnp.arange(M) < 4, W, cnt)


@pytest.mark.parametrize("name,idx,cnt", list(_patterns()), ids=lambda v: v if isinstance(v, str) else "")
def test_slice_kernels_match_their_references(name, idx, cnt):
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (H, D)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 1), (M, D)).astype(jnp.bfloat16)
    h = jax.random.normal(jax.random.fold_in(key, 2), (M, W), jnp.float32)
    want_y = esk.down_reference(idx, h, cnt, w).astype(jnp.float32)
    for kw in (dict(ds=8, bt=8, kc=4, n_chunks=2), dict(ds=16, bt=16, kc=8, n_chunks=1, prefetch=True)):
        got = esk.slice_down(idx, h, cnt, w, interpret=True, **kw).astype(jnp.float32)
        np.testing.assert_allclose(got, want_y, rtol=1e-2, atol=1e-2, err_msg=f"{name} {kw}")
    got = esk.token_down(idx, h, cnt, w, interpret=True).astype(jnp.float32)
    np.testing.assert_allclose(got, want_y, rtol=1e-2, atol=1e-2, err_msg=name)
    got_u = esk.slice_up(idx, cnt, x, w, ds=8, bt=8, kc=4, n_chunks=2, interpret=True)
    np.testing.assert_allclose(got_u, esk.up_reference(idx, cnt, x, w), rtol=1e-5, atol=1e-4, err_msg=name)


def test_bad_blocks_are_refused():
    idx, cnt = esk.uniform_lists(jax.random.PRNGKey(0), M, H, 4.0, W)
    w = jnp.zeros((H, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="ds must be a power of two"):
        esk.slice_down(idx, jnp.zeros((M, W)), cnt, w, ds=12, interpret=True)
    with pytest.raises(ValueError, match="multiples"):
        esk.slice_down(idx, jnp.zeros((M, W)), cnt, w, ds=8, bt=64, interpret=True)


def test_the_command_at_tiny_shapes(tmp_path):
    result = esk.main(["--interpret", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "explore_slice_kernel.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    whats = {r["what"] for r in saved["rows"]}
    assert whats == {"xla_dense", "per_token", "slice_down", "slice_up"}
    assert all(r["max_err"] < 1e-2 for r in saved["rows"] if "max_err" in r)
    with pytest.raises(SystemExit):
        esk.main(["--interpret", "--k", "40", "--out", str(tmp_path)])
