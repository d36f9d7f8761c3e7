"""Mixed precision of the training gradient: every matmul on model, FFN or vocabulary widths has
compute-dtype (bf16) operands, forward and backward, read from the lowered StableHLO.

An f32 operand there means an f32 x f32 GEMM on the GPU (about 2x slower than bf16): the old
`preferred_element_type=float32` + cast pattern produced exactly that in every backward.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from twell_jax import ops
from twell_jax.config import ModelConfig
from twell_jax.training.loss import cross_entropy, total_loss
from twell_jax.model import apply_model, init_model, split_model

# Every width distinct, so a dot_general's operand shapes say which matmul it is:
# D=40 (5 heads of 8), H=56, V=72, B=3, S=12.
D, H, V, B, S = 40, 56, 72, 3, 12
CFG = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=5, d_ff=H, max_seq_len=16,
                  compute_dtype="bfloat16", ffn_backend="auto")
_DOT = re.compile(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


def _dims(tensor_type: str) -> tuple[list[int], str]:
    body = tensor_type[len("tensor<"):-1]
    *dims, dtype = body.split("x")
    return [int(d) for d in dims], dtype


def wide_dots_with_f32_operands(hlo_text: str) -> tuple[int, list[str]]:
    """(number of dot_generals touching D, H or V, those of them with an f32 operand)."""
    wide, bad = 0, []
    for match in _DOT.finditer(hlo_text):
        operands = [_dims(t) for t in match.groups()[:2]]
        if not any(size in (D, H, V) for dims, _ in operands for size in dims):
            continue  # attention's own score / value products (head dim, sequence)
        wide += 1
        if any(dtype == "f32" for _, dtype in operands):
            bad.append(match.group(0)[-160:])
    return wide, bad


def _training_grad_hlo(cfg: ModelConfig) -> str:
    graphdef, params = split_model(init_model(cfg, seed=0))
    tokens = jax.random.randint(jax.random.key(1), (B, S + 1), 0, V)

    def loss_fn(p):
        logits, aux = apply_model(graphdef, p, tokens[:, :-1], track_neurons=cfg.kind.relu)
        ce, _ = cross_entropy(logits, tokens[:, 1:])
        return total_loss(ce, aux["l1"], jnp.float32(2e-5))

    return jax.jit(jax.grad(loss_fn)).lower(params).as_text()


@pytest.mark.parametrize("kind", ["relu_gated", "twell", "swiglu", "relu"])
@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.fast_params("none-twell", "full-relu_gated", "none-swiglu", "full-relu")
def test_training_gradient_has_no_f32_matmul_operands(kind, remat):
    hlo = _training_grad_hlo(dataclasses.replace(CFG, ffn_kind=kind, remat=remat))
    wide, bad = wide_dots_with_f32_operands(hlo)
    # forward: q, k, v, out, FFN (3 or 2), logits; backward: two per matmul -> at least 3x that.
    assert wide >= 3 * (4 + 2 + 1) * CFG.n_layers // 2, wide
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("gated", [True, False])
def test_op_dense_backward_has_no_f32_matmul_operands(gated):
    """The custom_vjp's dense backward (what "auto" runs on a GPU after the Pallas forward)."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (B * S, D), jnp.bfloat16)
    weights = tuple(jax.random.normal(k, (H, D), jnp.bfloat16) for k in keys[1:(4 if gated else 3)])
    gy = jnp.ones((B * S, D), jnp.bfloat16)
    hlo = jax.jit(lambda x_, w_: ops.dense_backward(gated, x_, w_, gy, jnp.float32(0.5))).lower(
        x, weights).as_text()
    wide, bad = wide_dots_with_f32_operands(hlo)
    assert wide >= (5 if gated else 3), wide
    assert not bad, "\n".join(bad)


def test_the_check_catches_an_f32_operand():
    """The parser flags the old pattern: an f32-output GEMM whose backward runs in f32."""
    x = jnp.ones((S, D), jnp.bfloat16)
    w = jnp.ones((H, D), jnp.bfloat16)

    def old_style(x_, w_):
        return jnp.sum(jnp.einsum("sd,hd->sh", x_, w_, preferred_element_type=jnp.float32) ** 2)

    _, bad = wide_dots_with_f32_operands(jax.jit(jax.grad(old_style, argnums=(0, 1))).lower(x, w).as_text())
    assert bad
