"""Test oracles shared by the op and kernel tests: the dense FFN in fp32 at HIGHEST precision, the
relative error every comparison uses and its tolerance against that oracle by dtype, and inputs
with a sparse gate."""
import jax
import jax.numpy as jnp
import numpy as np

# rel_err of an op or kernel's output against dense_forward: fp32 differs in summation order only;
# bf16 rounds the hidden activation once (as the op's dense backend does).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (0-safe)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def dense_forward(x, w_act, w_up, w_down, *, with_pre: bool = False):
    """(y, l1, l0) of relu(x W_act^T) [* (x W_up^T)] W_down in fp32; w_up None = non-gated. l1 and
    l0 are per-token means. with_pre: the gate's pre-activation [M, H] as a fourth output.
    Differentiable (the op tests take jax.grad of it)."""
    hi = jax.lax.Precision.HIGHEST
    f = lambda a: a.astype(jnp.float32)
    pre = jnp.einsum("md,hd->mh", f(x), f(w_act), precision=hi)
    h = jax.nn.relu(pre)
    if w_up is not None:
        h = h * jnp.einsum("md,hd->mh", f(x), f(w_up), precision=hi)
    y = jnp.einsum("mh,hd->md", h, f(w_down), precision=hi)
    out = (y, jnp.abs(h).sum(1).mean(), (pre > 0).sum(1).mean())
    return out + (pre,) if with_pre else out


def sparse_gate_inputs(dtype, m: int, d: int = 45, h: int = 150, *, dense_rows=(), pattern: str = "sparse",
                       seed: int = 0) -> list:
    """[x, w_gate, w_up, w_down] in `dtype` with a sparse gate: x[:, 0] = 1 is a bias column and
    w_gate[:, 0] = -2.3 a threshold, so ~1% of the gate fires. dense_rows: tokens that fire every
    neuron (their tiles overflow). pattern: "sparse"; "all_zero" (nothing fires); "one_hot" (neuron
    H // 2 alone fires, on every token); "dense_token" (token 0 fires every neuron)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, d)).astype(np.float32)
    x[:, 0] = 1.0
    x[list(dense_rows), 0] = -40.0
    ws = [rng.normal(size=(h, d)).astype(np.float32) / np.sqrt(d) for _ in range(3)]
    ws[0][:, 0] = -2.3
    if pattern == "all_zero":
        ws[0][:, 0] = -40.0
    elif pattern == "one_hot":
        ws[0][:, 0] = -40.0
        ws[0][h // 2, 0] = 40.0
    elif pattern == "dense_token":
        x[0, 0] = -40.0
    elif pattern != "sparse":
        raise ValueError(pattern)
    return [jnp.asarray(a, dtype) for a in (x, *ws)]


def run_cli(argv):
    """The `twell` command in this process, its output captured by redirection (the `cli` fixture;
    module-scoped fixtures call it directly): (exit code, stdout, stderr)."""
    import contextlib
    import io

    from twell_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()
