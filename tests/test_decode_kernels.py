"""The decode kernels' one-token step (`decode_engine.kernel_step`, decode.kernels)
against the full forward and the XLA decode path: dense, sparse and SwiGLU models, batch 1 and
left-padded rows, both sides of the device-side dense switch, the stacked weights read in place;
the fused decode FFN kernel (hidden + down + residual in one launch, interpret mode) against the
plain-jnp reference and the unfused kernels; and the rows' compaction kernel (`compact_active_rows`: the
per-neuron count over the rows and the partition in one launch) against its references and in the step."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.config import DecodeConfig, ModelConfig
from twell_jax.inference import decode_engine, decode_plan
from twell_jax.inference.decode_engine import decode
from twell_jax.model import init_cache, init_model
from twell_jax.pallas_kernels.twell_decode import (DecodeBlockSizes, compact_active, compact_active_reference,
                                                   compact_active_rows, compact_active_rows_reference,
                                                   sparse_decode_ffn, sparse_decode_ffn_fused,
                                                   sparse_decode_ffn_reference)
from oracles import rel_err

BASE = ModelConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=2, d_ff=64, max_seq_len=16,
                   compute_dtype="float32", ffn_kind="twell", ffn_backend="pallas", ffn_interpret=True,
                   ffn_op_config={"tile": 16, "slots": 16, "ell_width": 64})
# The kernels' step, on the stored layout (the default, transposed, has its own tests below); XLA:
# the model's own decode, what every step is compared with.
KERNELS = DecodeConfig(kernels="pallas", transposed=False)
XLA = DecodeConfig(kernels="xla")
KINDS = {"sparse": {}, "dense_twin": {"ffn_kind": "relu_gated", "ffn_backend": "dense"},
         "swiglu": {"ffn_kind": "swiglu", "ffn_backend": "dense"},
         "relu": {"ffn_kind": "relu", "ffn_backend": "pallas"}}


def _run(cfg, tokens, start, prompt, config=KERNELS):
    """Prefill `prompt` tokens by the XLA path, then decode the rest one token per step by the
    decode section `config`; the step logits [B, steps, V] and the per-step aux."""
    model = init_model(cfg, seed=4)
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    _, cache, _ = decode(model, tokens[:, :prompt], cache, jnp.int32(0), start, config=config)
    out, auxes = [], []
    for t in range(prompt, tokens.shape[1]):
        logits, cache, aux = decode(model, tokens[:, t:t + 1], cache, jnp.int32(t), start, config=config)
        out.append(logits)
        auxes.append(aux)
    return jnp.stack(out, 1), auxes, model


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch,padded", [(1, False), (3, True)])
@pytest.mark.fast_params("3-True-sparse", "1-False-dense_twin", "3-True-swiglu")
def test_kernel_steps_equal_the_xla_steps_and_the_forward(kind, batch, padded):
    cfg = dataclasses.replace(BASE, **KINDS[kind])
    tokens = jax.random.randint(jax.random.key(batch), (batch, 10), 0, cfg.vocab_size)
    start = jnp.asarray([0, 2, 4][:batch] if padded else [0] * batch, jnp.int32)
    got, auxes, model = _run(cfg, tokens, start, prompt=6)
    assert decode_engine.uses_kernels(model, KERNELS)
    want, want_aux, _ = _run(cfg, tokens, start, prompt=6, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5, err_msg=kind)
        assert a["l0"].shape == (cfg.n_layers,)
    # Rows without padding: the full forward's logits at those positions.
    full, _ = model(tokens)
    for row in range(batch):
        if int(start[row]) == 0:
            np.testing.assert_allclose(got[row], full[row, 6:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sparse_ffn", ["fused", "tiles", "packed", "packed_down"])
@pytest.mark.parametrize("kind", ["sparse", "relu"])
@pytest.mark.parametrize("batch,padded", [(1, False), (3, True)])
@pytest.mark.fast_params("3-True-sparse-fused", "3-True-relu-tiles")
def test_the_fused_sparse_ffn_step_equals_the_xla_steps(kind, batch, padded, sparse_ffn, monkeypatch):
    """decode.sparse_ffn="fused", "tiles", "packed" and "packed_down": the sparse layers' up and
    down products (packed: the up product in the gate's launch; packed_down: the down product too)
    and the residual give the XLA path's logits and the same active counts; the split kernels do
    not run."""
    cfg = dataclasses.replace(BASE, **KINDS[kind])
    config = dataclasses.replace(KERNELS, sparse_ffn=sparse_ffn)
    monkeypatch.setattr("twell_jax.pallas_kernels.twell_decode.sparse_decode_ffn",
                        lambda *a, **k: pytest.fail("the split kernels ran"))
    tokens = jax.random.randint(jax.random.key(10 + batch), (batch, 10), 0, cfg.vocab_size)
    start = jnp.asarray([0, 2, 4][:batch] if padded else [0] * batch, jnp.int32)
    got, auxes, model = _run(cfg, tokens, start, prompt=6, config=config)
    assert decode_engine.uses_kernels(model, config) and any(decode_plan.layer_sparse(model, config, batch,
                                                                                      jnp.float32))
    want, want_aux, _ = _run(cfg, tokens, start, prompt=6, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5)
    with pytest.raises(ValueError, match="decode.sparse_ffn"):
        DecodeConfig(sparse_ffn="one")


@pytest.mark.parametrize("sparse_ffn", ["split", "fused", "tiles", "packed", "packed_down"])
@pytest.mark.parametrize("limit", [0, 10_000])
@pytest.mark.fast_params("0-fused", "10000-split")
def test_both_sides_of_the_dense_switch(monkeypatch, limit, sparse_ffn):
    """Several rows: a union limit of 0 sends every sparse layer to the dense products, a large one
    keeps the sparse kernels; both give the XLA path's logits (the fused kernel with no active
    neuron passes the residual through)."""
    monkeypatch.setattr(decode_plan.planner, "decode_union_limit", lambda *a, **k: limit)
    cfg, config = BASE, dataclasses.replace(KERNELS, sparse_ffn=sparse_ffn)
    tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, cfg.vocab_size)
    start = jnp.zeros((2,), jnp.int32)
    got, _, model = _run(cfg, tokens, start, prompt=5, config=config)
    assert all(decode_plan.layer_sparse(model, config, 2, jnp.float32))
    want, _, _ = _run(cfg, tokens, start, prompt=5, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_bf16_greedy_tokens_match_the_xla_path():
    cfg = dataclasses.replace(BASE, compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(9), (2, 10), 0, cfg.vocab_size)
    start = jnp.zeros((2,), jnp.int32)
    got, _, _ = _run(cfg, tokens, start, prompt=4)
    want, _, _ = _run(cfg, tokens, start, prompt=4, config=XLA)
    assert float(jnp.max(jnp.abs(got - want))) <= 0.05 * float(jnp.max(jnp.abs(want)))


def test_the_choice_of_path(monkeypatch):
    """decode.kernels picks a registered step as model.ffn_backend picks the op's backend: "xla"
    (the model's own decode) anywhere, "pallas" on a GPU or in the interpreter, "auto" the kernels
    where they run without the interpreter, else "xla"."""
    from twell_jax.ops import backends

    model = init_model(BASE, seed=0)
    assert decode_engine.step_names() == ("xla", "pallas")
    assert decode_engine.choose_step(model, XLA).name == "xla" and not decode_engine.uses_kernels(model, XLA)
    assert decode_engine.choose_step(model, KERNELS).name == "pallas"  # model.ffn_interpret
    cpu = init_model(dataclasses.replace(BASE, ffn_interpret=False), seed=0)
    with pytest.raises(ValueError, match="decode.kernels='pallas' needs a GPU"):
        decode_engine.uses_kernels(cpu, KERNELS)
    auto = DecodeConfig(kernels="auto")
    assert decode_engine.uses_kernels(cpu, auto) == (jax.default_backend() == "gpu")
    monkeypatch.setattr(backends, "gpu_available", lambda: True)
    assert decode_engine.choose_step(cpu, auto).name == "pallas" and decode_engine.uses_kernels(cpu, KERNELS)
    monkeypatch.setattr(backends, "gpu_available", lambda: False)
    assert decode_engine.choose_step(model, auto).name == "xla"  # "auto" never picks the interpreter
    with pytest.raises(ValueError, match="decode.kernels"):
        DecodeConfig(kernels="cuda")


def test_qkv_in_three_launches_when_d_model_is_not_a_multiple_of_block_n(monkeypatch):
    from twell_jax.pallas_kernels import decode_matvec

    monkeypatch.setitem(decode_matvec.ROLE_BLOCK_SIZES, "qkv", decode_matvec.MatvecBlockSizes(block_n=64, block_k=16))
    cfg = dataclasses.replace(BASE, **KINDS["dense_twin"])
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, cfg.vocab_size)
    start = jnp.zeros((2,), jnp.int32)
    got, _, _ = _run(cfg, tokens, start, prompt=5)
    want, _, _ = _run(cfg, tokens, start, prompt=5, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_head_dim_that_is_not_a_power_of_two_attends_through_xla():
    cfg = dataclasses.replace(BASE, d_model=36, n_heads=3, **KINDS["dense_twin"])  # head dim 12
    tokens = jax.random.randint(jax.random.key(5), (2, 8), 0, cfg.vocab_size)
    start = jnp.asarray([0, 3], jnp.int32)
    got, _, _ = _run(cfg, tokens, start, prompt=5)
    want, _, _ = _run(cfg, tokens, start, prompt=5, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sparse", "dense_twin"])
@pytest.mark.fast_params("dense_twin")
def test_transposed_weight_copies_give_the_same_steps(kind, monkeypatch):
    """decode.transposed: the step reads q/k/v, out and the dense W_down from `prepare_decode`'s
    output-major copies (layout "nk"; q/k/v as one weight): the XLA path's logits, padded rows
    included; without the option, or off the kernel path, there are no copies."""
    cfg, config = dataclasses.replace(BASE, **KINDS[kind]), dataclasses.replace(KERNELS, transposed=True)
    model = init_model(cfg, seed=4)
    prepared = decode_engine.prepare_decode(model, config)
    attn = model.blocks.attn
    np.testing.assert_array_equal(prepared.w_qkv, jnp.concatenate(
        [jnp.swapaxes(w[...], 1, 2) for w in (attn.w_q, attn.w_k, attn.w_v)], axis=1))
    np.testing.assert_array_equal(prepared.w_down, jnp.swapaxes(model.blocks.ffn.w_down[...], 1, 2))
    tokens = jax.random.randint(jax.random.key(5), (3, 9), 0, cfg.vocab_size)
    start = jnp.asarray([0, 1, 3], jnp.int32)
    cache = init_cache(cfg, 3, 9)
    _, cache, _ = decode(model, tokens[:, :5], cache, jnp.int32(0), start, config=config)
    from twell_jax.pallas_kernels import decode_matvec

    layouts = []
    original = decode_matvec.decode_matvec
    monkeypatch.setattr(decode_matvec, "decode_matvec",
                        lambda *a, **k: layouts.append(k.get("layout", "nk")) or original(*a, **k))
    for c_, p in ((KERNELS, None), (config, prepared)):  # every product reads an output-major weight with the copies
        layouts.clear()
        jax.make_jaxpr(lambda c: decode(model, tokens[:, 5:6], c, jnp.int32(5), start, config=c_, prepared=p))(cache)
        assert ("kn" in layouts) == (p is None), layouts
    with pytest.raises(ValueError, match="pass the copies of prepare_decode"):  # never silently the stored ones
        decode(model, tokens[:, 5:6], cache, jnp.int32(5), start, config=config)
    step = jax.jit(lambda c, t, i, p: decode(model, t, c, i, start, config=config, prepared=p)[:2])
    got = []
    for t in range(5, 9):
        logits, cache = step(cache, tokens[:, t:t + 1], jnp.int32(t), prepared)
        got.append(logits)
    want, _, _ = _run(cfg, tokens, start, prompt=5, config=XLA)
    np.testing.assert_allclose(jnp.stack(got, 1), want, rtol=1e-4, atol=1e-5)
    assert decode_engine.prepare_decode(model, KERNELS) is None
    assert decode_engine.prepare_decode(model, dataclasses.replace(config, kernels="xla")) is None
    with pytest.raises(ValueError, match="prepare_decode"):
        decode(model, tokens[:, 5:6], cache, jnp.int32(5), start, config=config, prepared={"w_qkv": prepared.w_qkv})
    with pytest.raises(ValueError, match="decode.transposed must be true or false"):
        DecodeConfig(transposed="yes")


# ---------------------------------------------------------------------------------------------
# the fused decode FFN kernel (sparse_decode_ffn_fused), interpret mode
# ---------------------------------------------------------------------------------------------

# rel. error (Frobenius) vs the exact rounding of the reference's h . W (+ residual), as
# tests/test_pallas_decode.py's TOL_REF: fp32 summation order only; bf16 adds a flip of y's one
# rounding (~1 ulp) where the oracle's float64 sum falls on the other side of a rounding boundary.
TOL_FUSED = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3}
# D = 37: 3 column blocks (the last 5 wide) and 3 K steps (the last 5 wide); H = 151: 10 chunks,
# the last 7 long, when every neuron is active.
FUSED_SMALL = DecodeBlockSizes(block_n=16, block_k=16, block_h=16, block_d=16, max_block_m=16)
FUSED_WIDE = DecodeBlockSizes(block_n=16, block_k=32, block_h=32, block_d=32, max_block_m=16)


def fused_inputs(dtype, m, pattern="sparse", d=37, h=151, layers=0, seed=0):
    """x [M, D], g fp32 [M, H], w_up and w_down ([L, H, D] stacks when layers > 0), residual; the
    gate fires by `pattern`: "sparse" (a random set of 20 neurons, each on a random subset of the
    tokens), "none", "all" (every neuron on every token) or "one_hot" (neuron H // 2 only)."""
    rng = np.random.default_rng(seed)
    magnitude = np.abs(rng.normal(size=(m, h))) + 0.05
    if pattern == "sparse":
        on = np.zeros((m, h), bool)
        hot = rng.choice(h, size=20, replace=False)
        on[:, hot] = rng.random((m, 20)) < 0.6
        on[0, hot] = True  # every one of the 20 fires somewhere: n = 20 exactly
    elif pattern in ("none", "all", "one_hot"):
        on = np.full((m, h), pattern == "all")
        on[:, h // 2] = pattern != "none"
    else:
        raise ValueError(pattern)
    g = np.where(on, magnitude, -magnitude).astype(np.float32)
    shape = (layers, h, d) if layers else (h, d)
    w_up, w_down = (rng.normal(size=shape) / np.sqrt(d) for _ in range(2))
    x, residual = rng.normal(size=(m, d)), rng.normal(size=(m, d))
    return (jnp.asarray(x, dtype), jnp.asarray(g), jnp.asarray(w_up, dtype), jnp.asarray(w_down, dtype),
            jnp.asarray(residual, dtype))


def fused_oracle(x, g, order, n, w_up, w_down, capacity, residual):
    """The reference's h (rounded where the kernels round it) . W[order_C] + residual in float64,
    rounded once to x's dtype: what the fused kernel equals up to the fp32 summation order. (The
    reference's own y is rounded before any residual could be added: two roundings.)"""
    h_MxC, _ = sparse_decode_ffn_reference(x, g, order, n, w_up, w_down, capacity=capacity)
    y = np.asarray(h_MxC, np.float64) @ np.asarray(jnp.take(w_down, order[:capacity], axis=0), np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return jnp.asarray(y.astype(np.float32)).astype(x.dtype)


def check_fused(x, g, w_up, w_down, residual, capacity, block_sizes=FUSED_SMALL, n_expected=None):
    """The fused kernel, with and without the residual, against the oracle and the unfused kernels
    at the same capacity; returns (y without, y with the residual)."""
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    if n_expected is not None:
        assert int(n[0]) == n_expected
    tol = TOL_FUSED[x.dtype.type]
    _, y_unfused = sparse_decode_ffn(x, g, order, n, w_up, w_down, capacity=capacity,
                                     block_sizes=block_sizes, interpret=True)
    out = []
    for r in (None, residual):
        y = sparse_decode_ffn_fused(x, g, order, n, w_up, w_down, capacity=capacity, residual_MxD=r,
                                    block_sizes=block_sizes, interpret=True)
        assert y.shape == x.shape and y.dtype == x.dtype
        want = fused_oracle(x, g, order, n, w_up, w_down, capacity, r)
        assert rel_err(y, want) <= tol, ("residual" if r is not None else "no residual", rel_err(y, want))
        unfused = y_unfused if r is None else (y_unfused.astype(jnp.float32) + r).astype(x.dtype)
        assert rel_err(y, unfused) <= tol
        if block_sizes.block_h == block_sizes.block_n and (r is None or x.dtype == jnp.float32):
            # Interpret mode, the same dot shapes in both (u in block_n / block_h neuron chunks)
            # and the same order: the same bits, which pins h's rounding point (a tolerance does
            # not see a second bf16 rounding of h). bf16 with a residual rounds y twice unfused.
            np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(unfused, np.float32))
        out.append(y)
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("m", [1, 3, 17])  # 17 > max_block_m: a second token block with one row
@pytest.mark.fast_params("17-True-bfloat16", "17-False-float32", "3-True-float32", "1-False-bfloat16")
def test_fused_matches_the_reference_and_the_unfused_kernels(dtype, gated, m):
    x, g, w_up, w_down, residual = fused_inputs(dtype, m, seed=100 * m + 10 * gated + (dtype == jnp.bfloat16))
    # capacity 48 >= n = 20: two live chunks of 16 (the second partial), a third never read.
    check_fused(x, g, w_up if gated else None, w_down, residual, capacity=48, n_expected=20)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("pattern,dtype,capacity,n_expected", [
    ("none", jnp.bfloat16, 32, 0),
    ("one_hot", jnp.float32, 32, 1),
    ("all", jnp.bfloat16, 256, 151),  # every neuron: 10 chunks, the last 7 long
    ("all", jnp.float32, 32, 151),  # n > capacity: only order[:32] is read
])
def test_fused_adversarial_active_sets(gated, pattern, dtype, capacity, n_expected):
    x, g, w_up, w_down, residual = fused_inputs(dtype, 3, pattern, seed=capacity + gated)
    y, y_res = check_fused(x, g, w_up if gated else None, w_down, residual, capacity,
                           n_expected=n_expected)
    if pattern == "none":  # nothing active: exactly 0, exactly the residual
        assert not np.any(np.asarray(y, np.float32))
        np.testing.assert_array_equal(np.asarray(y_res, np.float32), np.asarray(residual, np.float32))


@pytest.mark.parametrize("gated", [True, False])
def test_fused_reads_the_stacked_layer_in_place(gated):
    x, g, w_up, w_down, residual = fused_inputs(jnp.float32, 17, layers=3, seed=7 + gated)
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    up = (lambda w: w) if gated else (lambda w: None)  # noqa: E731
    run = lambda layer, u, w: sparse_decode_ffn_fused(  # noqa: E731
        x, g, order, n, up(u), w, capacity=64, layer=layer, residual_MxD=residual,
        block_sizes=FUSED_WIDE, interpret=True)
    y = run(jnp.asarray([2], jnp.int32), w_up, w_down)
    want = fused_oracle(x, g, order, n, up(w_up[2]), w_down[2], 64, residual)
    assert rel_err(y, want) <= TOL_FUSED[jnp.float32]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(run(None, w_up[2], w_down[2])))
    assert rel_err(run(jnp.asarray([1], jnp.int32), w_up, w_down), want) > 1e-2  # another layer differs


def test_fused_rejects_bad_arguments():
    x, g, w_up, w_down, residual = fused_inputs(jnp.float32, 3, "none")
    order, n = compact_active_reference(jnp.any(g > 0, axis=0))
    call = lambda **kw: sparse_decode_ffn_fused(x, g, order, n, w_up, w_down, capacity=32,  # noqa: E731
                                                interpret=True, **{"block_sizes": FUSED_SMALL, **kw})
    with pytest.raises(ValueError, match="residual_MxD"):
        call(residual_MxD=residual[:2])
    with pytest.raises(ValueError, match="residual_MxD"):
        call(residual_MxD=residual[:, :-1])
    with pytest.raises(ValueError, match="residual_MxD"):
        call(residual_MxD=residual.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="capacity"):
        call(residual_MxD=residual, block_sizes=DecodeBlockSizes(block_h=64))  # chunk 64
    with pytest.raises(ValueError, match="layer"):
        call(layer=jnp.asarray([0], jnp.int32))  # 2-D weights with a layer


def test_fused_kernel_lowers_to_triton_for_cuda(capsys):
    # As tests/test_pallas_decode.py's lowering test: the Pallas -> Triton IR lowering runs without
    # a GPU, with the default block sizes at the model's shapes, stacked weights and a residual.
    from jax import export

    def forward(x, w_up, w_down, residual, layer):
        g = jnp.einsum("md,hd->mh", x, w_up[0], preferred_element_type=jnp.float32)
        order, n = compact_active_reference(jnp.sum(g > 0, axis=0, dtype=jnp.int32))
        return (sparse_decode_ffn_fused(x, g, order, n, w_up, w_down, capacity=5632, layer=layer,
                                        residual_MxD=residual, debug=True),
                sparse_decode_ffn_fused(x, g, order, n, None, w_down, capacity=5632, debug=True,
                                        layer=layer))

    x = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 5632, 2048), jnp.bfloat16)
    exported = export.export(jax.jit(forward), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            x, w, w, x, jax.ShapeDtypeStruct((1,), jnp.int32))
    assert exported.mlir_module().count("twell_decode_fused") >= 2
    printed = capsys.readouterr().out
    # Gated: the active-list loop with the D loop inside; non-gated: the list loop only. No scf.for
    # in MLIR's generic quoted form (an op that failed verification: mixed bound types did).
    assert printed.count("scf.for") >= 3 and '"scf.for"' not in printed


# ---------------------------------------------------------------------------------------------
# the rows' compaction kernel (compact_active_rows), interpret mode
# ---------------------------------------------------------------------------------------------

ROWS_PATTERNS = ("sparse", "none", "all", "one_hot_last_row", "zeros")


def rows_inputs(b, h, pattern, seed=0):
    """g fp32 [B, H], finite: "sparse" (~8% of the entries > 0, the rest < 0), "none" (all < 0),
    "all" (all > 0), "one_hot_last_row" (one neuron, in the last row only), "zeros" (0.0 and -0.0
    everywhere but a tiny positive at (0, H - 1) and a positive in the last row at neuron 0)."""
    rng = np.random.default_rng(seed)
    magnitude = np.abs(rng.normal(size=(b, h))) + 0.05
    if pattern == "sparse":
        on = rng.random((b, h)) < 0.08
    elif pattern in ("none", "all", "one_hot_last_row"):
        on = np.full((b, h), pattern == "all")
        if pattern == "one_hot_last_row":
            on[b - 1, (7 * h) // 11] = True
    elif pattern == "zeros":
        g = np.where(rng.random((b, h)) < 0.5, np.float32(0.0), np.float32(-0.0))
        g[0, h - 1], g[b - 1, 0] = 1e-30, 2.0
        return g.astype(np.float32)
    else:
        raise ValueError(pattern)
    return np.where(on, magnitude, -magnitude).astype(np.float32)


# (B, H): H = 1, 37, 64 and 151 load several rows at once (151: 2 rows per load, the last block of
# B = 3 half masked); H = 600 one row per load (L = 1024, 2 warps); B = 64 the largest decode batch.
ROWS_SHAPES = [(b, h) for b in (1, 3, 8) for h in (1, 37, 64, 151)] + [(3, 600), (64, 151)]


@pytest.mark.parametrize("b,h", ROWS_SHAPES)
def test_compact_active_rows_equals_its_references(b, h):
    length = 1 << max(0, (h - 1).bit_length())
    identity = np.minimum(np.arange(length), h - 1)
    for i, pattern in enumerate(ROWS_PATTERNS):
        g_np = rows_inputs(b, h, pattern, seed=1000 * b + h + i)
        g = jnp.asarray(g_np)
        order, n, pairs = compact_active_rows(g, interpret=True)
        assert order.shape == (length,) and n.shape == pairs.shape == (1,), pattern
        assert order.dtype == n.dtype == pairs.dtype == jnp.int32
        for want in (compact_active_rows_reference(g),
                     (*compact_active_reference(jnp.sum(g > 0, axis=0, dtype=jnp.int32)), None)):
            np.testing.assert_array_equal(np.asarray(order), np.asarray(want[0]), err_msg=pattern)
            np.testing.assert_array_equal(np.asarray(n), np.asarray(want[1]), err_msg=pattern)
        active = np.flatnonzero(np.any(g_np > 0, axis=0))
        assert int(pairs[0]) == int(np.sum(g_np > 0)) == int(compact_active_rows_reference(g)[2][0]), pattern
        assert int(n[0]) == active.size, pattern
        np.testing.assert_array_equal(np.asarray(order[:n[0]]), active, err_msg=pattern)  # ascending
        # A permutation of [0, L) with the padding lanes clamped: every neuron exactly once.
        np.testing.assert_array_equal(np.sort(np.asarray(order)), identity, err_msg=pattern)
        if pattern == "none":  # nothing active: the identity partition
            assert int(pairs[0]) == 0
            np.testing.assert_array_equal(np.asarray(order), identity)
        elif pattern == "all":
            assert int(n[0]) == h and int(pairs[0]) == b * h
        elif pattern == "one_hot_last_row":
            assert int(n[0]) == 1 and int(order[0]) == (7 * h) // 11 and int(pairs[0]) == 1
        elif pattern == "zeros":  # 0.0 and -0.0 are not active
            assert int(pairs[0]) == (2 if (b, h) != (1, 1) else 1)


def test_compact_active_rows_rejects_bad_arguments():
    g = jnp.ones((3, 37), jnp.float32)
    for bad in (g[0], g.astype(jnp.int32), g.astype(jnp.bfloat16), g[:0], g[:, :0], g[None]):
        for fn in (lambda a: compact_active_rows(a, interpret=True), compact_active_rows_reference):
            with pytest.raises(ValueError, match="g_BxH"):
                fn(bad)


def _pallas_names_and_row_sums(closed_jaxpr, shape):
    """The names of the pallas_calls in a jaxpr (nested jits, scans and conds included) and the
    number of reduce_sum equations outside the kernels over an operand of `shape`."""
    names, sums = [], 0
    for eqn in _step_eqns(closed_jaxpr):
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["name"])
        elif eqn.primitive.name == "reduce_sum" and tuple(eqn.invars[0].aval.shape) == shape:
            sums += 1
    return names, sums


def _step_eqns(closed_jaxpr):
    """Every equation of a jaxpr, nested jits, scans and conds included, but not the bodies of its
    pallas_calls (a kernel's body is not the step's XLA graph; the pallas_call itself is yielded)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            if eqn.primitive.name == "pallas_call":
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return list(walk(closed_jaxpr.jaxpr))


@pytest.mark.parametrize("batch", [1, 3])
def test_the_sparse_step_compacts_the_rows_in_one_launch(batch):
    """decode.sparse_ffn="fused": a sparse layer's step runs `compact_active_rows`
    (twell_decode_compact_rows): no XLA reduction of the gate's [B, H] signs before the compaction,
    no `compact_active` launch."""
    cfg, config = dataclasses.replace(BASE, n_layers=2), dataclasses.replace(KERNELS, sparse_ffn="fused")
    model = init_model(cfg, seed=4)
    assert decode_engine.uses_kernels(model, config) and all(decode_plan.layer_sparse(model, config, batch,
                                                                                      jnp.float32))
    cache = init_cache(cfg, batch, 8)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    start = jnp.zeros((batch,), jnp.int32)
    traced = jax.make_jaxpr(lambda c: decode(model, tokens, c, jnp.int32(3), start, config=config))(cache)
    names, sums = _pallas_names_and_row_sums(traced, (batch, cfg.d_ff))
    assert "twell_decode_compact_rows" in names and "twell_decode_compact" not in names, names
    assert sums == 0
    # The check sees the old formula: the XLA count then the compaction kernel.
    old = jax.make_jaxpr(lambda g: compact_active(jnp.sum(g > 0, axis=0, dtype=jnp.int32), interpret=True))(
        jnp.zeros((batch, cfg.d_ff), jnp.float32))
    assert _pallas_names_and_row_sums(old, (batch, cfg.d_ff)) == (["twell_decode_compact"], 1)


@pytest.mark.slow
def test_many_rows_count_in_xla_then_compact_with_the_same_steps(monkeypatch):
    """Above decode_engine.COMPACT_ROWS_IN_KERNEL rows (64 in generation at most), the rows' count runs
    as an XLA reduction and `compact_active` compacts it (one program reading [B, H] row after row would
    be slow): the step still equals the XLA path, with the same active counts."""
    monkeypatch.setattr(decode_engine, "COMPACT_ROWS_IN_KERNEL", 2)
    cfg, config = BASE, dataclasses.replace(KERNELS, sparse_ffn="fused")
    tokens = jax.random.randint(jax.random.key(3), (3, 9), 0, cfg.vocab_size)
    start = jnp.asarray([0, 1, 3], jnp.int32)
    got, auxes, model = _run(cfg, tokens, start, prompt=5, config=config)
    traced = jax.make_jaxpr(lambda c: decode(model, tokens[:, :1], c, jnp.int32(5), start, config=config))(
        init_cache(cfg, 3, 9))
    names, sums = _pallas_names_and_row_sums(traced, (3, cfg.d_ff))
    assert "twell_decode_compact" in names and "twell_decode_compact_rows" not in names and sums > 0
    want, want_aux, _ = _run(cfg, tokens, start, prompt=5, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5)


@pytest.mark.parametrize("rows", [17, 40])
@pytest.mark.parametrize("kind", ["dense_twin", "sparse"])
@pytest.mark.fast_params("sparse-17")
def test_more_rows_than_the_gate_holds_give_the_same_steps(kind, rows):
    """17 rows: the dense products in one block of 32 rows (ROLE_BLOCK_SIZES); 40: in one of 64
    (ROLE_BLOCK_SIZES_MANY_ROWS); the sparse layers' gate in blocks of 16 ("fused": no tile lists),
    left-padded rows: the steps equal the XLA path."""
    cfg, config = dataclasses.replace(BASE, **KINDS[kind]), dataclasses.replace(KERNELS, transposed=True)
    tokens = jax.random.randint(jax.random.key(17), (rows, 8), 0, cfg.vocab_size)
    start = jnp.arange(rows, dtype=jnp.int32) % 3
    model = init_model(cfg, seed=4)
    cache = init_cache(cfg, rows, 8)
    _, cache, _ = decode(model, tokens[:, :6], cache, jnp.int32(0), start, config=config)
    want_cache = cache
    prepared = decode_engine.prepare_decode(model, config)
    for t in (6, 7):
        got, cache, aux = decode(model, tokens[:, t:t + 1], cache, jnp.int32(t), start, config=config,
                                 prepared=prepared)
        want, want_cache, want_aux = decode(model, tokens[:, t:t + 1], want_cache, jnp.int32(t), start, config=XLA)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(aux["l0"], want_aux["l0"], rtol=1e-5)
    assert set(decode_plan.layer_ways(model, config, rows, jnp.float32)) == (
        {"dense"} if kind == "dense_twin" else {"fused"})


def test_compact_active_rows_lowers_to_triton_for_cuda(capsys):
    # As test_fused_kernel_lowers_to_triton_for_cuda: the Pallas -> Triton IR lowering without a GPU, at
    # the model's d_ff and a batch of 8 (one row per load at L = 8192).
    import re

    from jax import export

    exported = export.export(jax.jit(lambda g: compact_active_rows(g, debug=True)), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        jax.ShapeDtypeStruct((8, 5632), jnp.float32))
    assert "twell_decode_compact_rows" in exported.mlir_module()
    printed = capsys.readouterr().out
    assert "module @twell_decode_compact_rows" in printed
    # MLIR prints an op that fails verification in the generic quoted form; the reductions and the
    # cumsum's scan print so anyway (as in `compact_active`'s module).
    assert set(re.findall(r'"(\w+\.\w+)"', printed)) <= {"tt.reduce", "tt.scan"}


def test_auto_picks_one_launch_or_split_per_layer_by_the_expected_union():
    """decode.sparse_ffn="auto" (the default): per sparse layer, one launch walking the
    active neurons where the union expected from the layer's activity hint is small (the gate's
    tile lists alone, "tiles", where the gate's program holds every row; else the compacted list,
    "fused"), `hidden` + `down` where it is not (that launch's every program walks all the active
    neurons: planner.decode_sparse_way); up to decode_plan.PACKED_MAX_ROWS rows every sparse layer
    "packed" (the tiles make their own neurons' values), up to decode_plan.PACKED_DOWN_MAX_ROWS rows
    "packed_down" (their down product too, in the same launch); the step runs both and equals the
    XLA path."""
    from twell_jax.ops import planner

    assert planner.decode_sparse_way(1, None, 5632) == "fused"  # no hint
    assert planner.decode_sparse_way(1, 29.0, 5632) == "fused"
    assert planner.decode_sparse_way(1, 100.0, 5632) == "split"  # layer 0 of the 0.5b checkpoints
    assert planner.decode_sparse_way(8, 10.0, 5632) == "split"  # a union of ~80 over 8 rows
    cfg = dataclasses.replace(BASE, ffn_expected_active=(4.0, 60.0, 4.0))
    config = dataclasses.replace(KERNELS, sparse_ffn="auto")
    model = init_model(cfg, seed=4)
    assert decode_plan.PACKED_MAX_ROWS == 4
    assert decode_plan.PACKED_DOWN_MAX_ROWS == 2

    def ways(m, rows, c=config):
        return decode_plan.layer_ways(m, c, rows, jnp.float32)

    for rows in (1, 2, 3, 4):  # (a backend the user forced: no union limit)
        assert ways(model, rows) == ("packed_down" if rows <= 2 else "packed",) * 3
    assert ways(model, 5) == ("tiles", "split", "tiles")
    # More rows than the gate's program holds (16): the compacted list for the small unions.
    few = init_model(dataclasses.replace(cfg, ffn_expected_active=(0.2, 60.0, 0.2)), seed=4)
    assert ways(few, 17) == ("fused", "split", "fused")
    tokens, start = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32)
    traced = jax.make_jaxpr(lambda c: decode(model, tokens, c, jnp.int32(3), start, config=config))(
        init_cache(cfg, 1, 8))
    names, _ = _pallas_names_and_row_sums(traced, (1, cfg.d_ff))
    # The layers unrolled: the gate with the down product in each (in interpret mode its partials
    # summed by a second launch), no separate down kernel, no compaction.
    assert names.count("twell_decode_gate_down") == names.count("twell_decode_down_partials") == 3, names
    assert "twell_decode_down_tiles" not in names and "twell_decode_hidden" not in names, names
    assert not any(n.startswith("twell_decode_compact") for n in names) and "twell_decode_tiles" not in names, names
    tokens2, start2 = jnp.zeros((5, 1), jnp.int32), jnp.zeros((5,), jnp.int32)
    traced2 = jax.make_jaxpr(lambda c: decode(model, tokens2, c, jnp.int32(3), start2, config=config))(
        init_cache(cfg, 5, 8))
    names2, _ = _pallas_names_and_row_sums(traced2, (5, cfg.d_ff))
    # Five rows: the tiles kernel in two layers, `hidden` in one (after its compaction).
    assert names2.count("twell_decode_tiles") == 2 and names2.count("twell_decode_hidden") == 1, names2
    assert ways(model, 1, dataclasses.replace(config, sparse_ffn="fused")) == ("fused",) * 3
    tokens = jax.random.randint(jax.random.key(12), (1, 10), 0, cfg.vocab_size)
    got, auxes, _ = _run(cfg, tokens, start, prompt=6, config=config)
    want, want_aux, _ = _run(cfg, tokens, start, prompt=6, config=XLA)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(auxes, want_aux):
        np.testing.assert_allclose(a["l0"], b["l0"], rtol=1e-5)


@pytest.mark.parametrize("kind", ["sparse", "dense_twin"])
@pytest.mark.slow
def test_the_decode_layers_unrolled_or_in_a_loop_give_the_same_steps(kind):
    """decode.layer_unroll: 0 (the default) runs every layer with a constant index and no
    loop; 1 a loop over the layers; 2 two layers per iteration (3 layers: a remainder). The
    same logits, cache and active counts each way."""
    tokens = jax.random.randint(jax.random.key(7), (3, 9), 0, BASE.vocab_size)
    start = jnp.asarray([0, 1, 3], jnp.int32)
    results = {}
    for unroll in (0, 1, 2):
        cfg, config = dataclasses.replace(BASE, **KINDS[kind]), dataclasses.replace(KERNELS, layer_unroll=unroll)
        model = init_model(cfg, seed=4)
        cache = init_cache(cfg, 3, 9)
        _, cache, _ = decode(model, tokens[:, :5], cache, jnp.int32(0), start, config=config)
        jaxpr = jax.make_jaxpr(lambda c: decode(model, tokens[:, 5:6], c, jnp.int32(5), start, config=config))(cache)
        top = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}  # the kernels' own loops are inside their calls
        assert ("scan" in top) == (unroll != 0), (unroll, top)
        results[unroll] = decode(model, tokens[:, 5:6], cache, jnp.int32(5), start, config=config)
    for unroll in (1, 2):
        for got, want in zip(jax.tree.leaves(results[unroll]), jax.tree.leaves(results[0])):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"decode.layer_unroll={unroll}")
    with pytest.raises(ValueError, match="decode.layer_unroll must be an int >= 0"):
        dataclasses.replace(KERNELS, layer_unroll=-1)


def test_the_prepared_step_converts_no_norm_scale():
    """`prepare_decode` holds the norm scales in fp32 (as the kernels read them): a step given the
    copies of a model whose weights are bf16 (as `inference.load_run` loads them) converts no [L, D]
    or [D] scale outside the kernels (each was an XLA launch of its own every step); the stored
    layout's step (no copies) still converts them itself, and both give the same logits up to their
    products' fp32 sum order."""
    from flax import nnx

    cfg, config = dataclasses.replace(BASE, compute_dtype="bfloat16"), dataclasses.replace(KERNELS, transposed=True)

    def bf16_model(config):
        model = init_model(config, seed=4)
        nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                                       nnx.state(model)))
        return model

    model = bf16_model(cfg)
    assert model.final_norm.scale[...].dtype == jnp.bfloat16
    prepared = decode_engine.prepare_decode(model, config)
    assert {k: (v.dtype, v.shape) for k, v in prepared._asdict().items() if k.endswith("norm")} == {
        "attn_norm": (jnp.float32, (cfg.n_layers, cfg.d_model)), "ffn_norm": (jnp.float32, (cfg.n_layers, cfg.d_model)),
        "final_norm": (jnp.float32, (cfg.d_model,))}
    tokens, start = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32)
    scale_shapes = {(cfg.n_layers, cfg.d_model), (cfg.d_model,)}

    def scale_converts(c_, p):
        traced = jax.make_jaxpr(lambda c: decode(model, tokens, c, jnp.int32(3), start, config=c_, prepared=p))(
            init_cache(cfg, 1, 8))
        return sorted(tuple(e.invars[0].aval.shape) for e in _step_eqns(traced)
                      if e.primitive.name == "convert_element_type" and e.invars[0].aval.dtype == jnp.bfloat16
                      and tuple(e.invars[0].aval.shape) in scale_shapes)

    assert decode_engine.uses_kernels(model, config) and scale_converts(config, prepared) == []
    assert scale_converts(KERNELS, None) == sorted([(cfg.n_layers, cfg.d_model)] * 2 + [(cfg.d_model,)])
    got, _, _ = decode(model, tokens, init_cache(cfg, 1, 8), jnp.int32(0), start, config=config, prepared=prepared)
    want, _, _ = decode(model, tokens, init_cache(cfg, 1, 8), jnp.int32(0), start, config=KERNELS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="prepare_decode"):
        decode(model, tokens, init_cache(cfg, 1, 8), jnp.int32(0), start, config=config,
               prepared={k: v for k, v in prepared._asdict().items() if k != "final_norm"})
