"""Test oracles shared by the op and kernel tests: the dense FFN in fp32 at HIGHEST precision and
the relative error every comparison uses."""
import jax
import jax.numpy as jnp
import numpy as np


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (0-safe)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def dense_forward(x, w_act, w_up, w_down):
    """(y, l1, l0) of relu(x W_act^T) [* (x W_up^T)] W_down in fp32; w_up None = non-gated."""
    hi = jax.lax.Precision.HIGHEST
    f = lambda a: a.astype(jnp.float32)
    pre = jnp.einsum("md,hd->mh", f(x), f(w_act), precision=hi)
    h = jax.nn.relu(pre)
    if w_up is not None:
        h = h * jnp.einsum("md,hd->mh", f(x), f(w_up), precision=hi)
    y = jnp.einsum("mh,hd->md", h, f(w_down), precision=hi)
    return y, jnp.abs(h).sum(1).mean(), (pre > 0).sum(1).mean()
