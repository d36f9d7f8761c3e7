"""The decode matrix-vector kernel (pallas_kernels/decode_matvec.py, interpret mode) against its
jnp reference and against the model's own XLA formulas, every option, stacked or not."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.decode_matvec import MatvecBlockSizes, decode_matvec, decode_matvec_reference
from twell_jax.model import RMSNorm

SMALL = MatvecBlockSizes(block_n=16, block_k=16, max_block_m=16, num_warps=1, num_stages=1)
# rel. error (max abs / max abs of the reference). bf16: the kernel's fp32 sums run in another order,
# so a rounded intermediate can land one bf16 ulp away.
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _inputs(dtype, m, n, k, layers=None, seed=0):
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=lead + (n, k)) / np.sqrt(k), dtype)
    gate = jnp.asarray(rng.normal(size=lead + (n, k)) / np.sqrt(k), dtype)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, size=lead + (k,)), jnp.float32)
    res = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return x, w, gate, scale, res


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (3, 16, 16), (17, 33, 50)])
@pytest.mark.fast_params("1-40-70-nk-float32", "3-16-16-kn-bfloat16", "17-33-50-nk-bfloat16", "17-33-50-kn-float32")
def test_every_option_matches_the_reference(dtype, layout, m, n, k):
    x, w, gate, scale, res = _inputs(dtype, m, n, k, seed=m + n)
    if layout == "kn":
        w, gate = w.T, gate.T
    cases = [dict(), dict(norm_scale=scale), dict(residual=res), dict(activation="relu"),
             dict(norm_scale=scale, gate=gate, activation="relu"), dict(gate=gate, activation="silu"),
             dict(norm_scale=scale, residual=res, out_dtype=jnp.float32)]
    for kwargs in cases:
        got = decode_matvec(x, w, layout=layout, block_sizes=SMALL, interpret=True, **kwargs)
        want = decode_matvec_reference(x, w, layout=layout, **kwargs)
        assert got.shape == (m, n) and got.dtype == want.dtype, kwargs
        assert _rel(got, want) <= TOL[dtype], (kwargs, _rel(got, want))


@pytest.mark.parametrize("m,max_block_m", [(17, 32), (33, 32), (40, 64), (65, 64)])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.fast_params("1-33-32", "2-65-64")
def test_row_blocks_of_32_and_64(m, max_block_m, split_k):
    """The dense products' roles hold up to 32 rows a program (ROLE_BLOCK_SIZES: a step of 17-32
    rows reads each weight once), 64 above 32 rows (ROLE_BLOCK_SIZES_MANY_ROWS): one padded block
    at 17 or 40 rows, a second of one row at 33 or 65."""
    sizes = MatvecBlockSizes(block_n=16, block_k=16, max_block_m=max_block_m, num_warps=1, num_stages=1,
                             split_k=split_k)
    assert sizes.block_m(m) == max_block_m
    x, w, gate, scale, res = _inputs(jnp.float32, m, 40, 48, seed=m + split_k)
    for kwargs in (dict(norm_scale=scale, residual=res), dict(norm_scale=scale, gate=gate, activation="relu")):
        if split_k > 1 and "gate" in kwargs:
            continue  # split-K takes no gate
        got = decode_matvec(x, w, block_sizes=sizes, interpret=True, **kwargs)
        want = decode_matvec_reference(x, w, **kwargs)
        assert got.shape == (m, 40) and _rel(got, want) <= TOL[jnp.float32], (kwargs, _rel(got, want))


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_stacked_weights_are_read_at_the_layer(layout):
    x, w, gate, scale, res = _inputs(jnp.float32, 2, 24, 40, layers=3, seed=7)
    if layout == "kn":
        w, gate = jnp.swapaxes(w, 1, 2), jnp.swapaxes(gate, 1, 2)
    for layer in range(3):
        idx = jnp.asarray([layer], jnp.int32)
        got = decode_matvec(x, w, layer=idx, layout=layout, norm_scale=scale, gate=gate, activation="relu",
                            residual=res, block_sizes=SMALL, interpret=True)
        want = decode_matvec_reference(x, w[layer], layout=layout, norm_scale=scale[layer], gate=gate[layer],
                                       activation="relu", residual=res)
        assert _rel(got, want) <= TOL[jnp.float32], layer
    # traced inside a scan, as the decode loop calls it
    def body(carry, layer):
        return carry, decode_matvec(x, w, layer=layer[None], layout=layout, block_sizes=SMALL, interpret=True)

    _, outs = jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))
    for layer in range(3):
        want = decode_matvec_reference(x, w[layer], layout=layout)
        assert _rel(outs[layer], want) <= TOL[jnp.float32]


def test_the_model_formulas_round_alike():
    """bf16: the fused norm equals the model's RMSNorm followed by a bf16 GEMM, and the gated
    product the dense formula's roundings (same values up to the fp32 summation order)."""
    x, w, gate, scale, res = _inputs(jnp.bfloat16, 4, 64, 96, seed=3)
    norm = RMSNorm(96, 1e-6)
    norm.scale[...] = scale
    xn = norm(x[:, None, :])[:, 0]
    want = (xn @ w.T).astype(jnp.float32)
    got = decode_matvec(x, w, norm_scale=scale, block_sizes=SMALL, interpret=True)
    assert _rel(got, want) <= TOL[jnp.bfloat16]
    g, u = xn @ gate.T, xn @ w.T
    want = (jax.nn.relu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16)
    got = decode_matvec(x, w, norm_scale=scale, gate=gate, activation="relu", block_sizes=SMALL, interpret=True)
    assert _rel(got, want) <= TOL[jnp.bfloat16]


def test_bad_arguments_are_named():
    x, w, gate, scale, res = _inputs(jnp.float32, 2, 24, 40)
    with pytest.raises(ValueError, match="layout"):
        decode_matvec(x, w, layout="mk")
    with pytest.raises(ValueError, match="K=40"):
        decode_matvec(x[:, :30], w)
    with pytest.raises(ValueError, match="w must be"):
        decode_matvec(x, w, layer=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="gate"):
        decode_matvec(x, w, gate=gate[:3])
    with pytest.raises(ValueError, match="norm_scale"):
        decode_matvec(x, w, norm_scale=scale[:5])
    with pytest.raises(ValueError, match="residual"):
        decode_matvec(x, w, residual=res[:, :3])
    with pytest.raises(ValueError, match="activation"):
        decode_matvec(x, w, activation="gelu")
    with pytest.raises(ValueError, match="block_n"):
        MatvecBlockSizes(block_n=24)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_parts_side_by_side_and_the_enable_switch(layout):
    x, w, gate, scale, res = _inputs(jnp.float32, 3, 32, 40, layers=2, seed=11)
    parts = (w, gate, w * 2)
    if layout == "kn":
        parts = tuple(jnp.swapaxes(p, 1, 2) for p in parts)
    layer = jnp.asarray([1], jnp.int32)
    got = decode_matvec(x, parts, layer=layer, layout=layout, norm_scale=scale, block_sizes=SMALL, interpret=True)
    want = jnp.concatenate([decode_matvec_reference(x, p[1], layout=layout, norm_scale=scale[1]) for p in parts], 1)
    assert got.shape == (3, 96) and _rel(got, want) <= TOL[jnp.float32]
    res3 = jnp.concatenate([res, res, res], axis=1)
    for on in (0, 1):
        enable = jnp.asarray([on], jnp.int32)
        got = decode_matvec(x, parts, layer=layer, layout=layout, residual=res3, enable=enable, block_sizes=SMALL,
                            interpret=True)
        want = decode_matvec_reference(x, parts, layer=layer, layout=layout, residual=res3, enable=enable)
        assert _rel(got, want) <= TOL[jnp.float32], on
        if not on:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(res3))
    with pytest.raises(ValueError, match="multiple of block_n"):
        decode_matvec(x[:, :40], tuple(p[:, :20] if layout == "nk" else p[:, :, :20] for p in parts), layer=layer,
                      layout=layout, block_sizes=SMALL)


@pytest.mark.parametrize("m", [1, 3])
def test_the_switch_reads_a_sparse_gates_counts(m):
    """enable = per-tile counts [T], enable_above = a union limit: the products (with the norm and
    a gate) run only when the counts sum above it, else the output is the residual exactly; the
    reference agrees on both sides, and a bad enable or enable_above is named."""
    x, w, gate, scale, res = _inputs(jnp.float32, m, 40, 70, layers=2, seed=21 + m)
    layer = jnp.asarray([1], jnp.int32)
    count = jnp.asarray([3, 0, 5, 1, 2], jnp.int32)  # 11 neurons over five tiles
    for above, on in ((10, True), (11, False), (0, True)):
        kwargs = dict(layer=layer, norm_scale=scale, gate=gate, activation="relu", residual=res, enable=count,
                      enable_above=above)
        got = decode_matvec(x, w, block_sizes=SMALL, interpret=True, **kwargs)
        want = decode_matvec_reference(x, w, **kwargs)
        assert _rel(got, want) <= TOL[jnp.float32], above
        if on:
            assert _rel(got, res) > 0.01
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(res))
    for bad, match in ((dict(enable=count.astype(jnp.float32)), "enable must be int32"),
                       (dict(enable=count.reshape(5, 1)), "enable must be int32"),
                       (dict(enable=count, enable_above=-1), "enable_above"),
                       (dict(enable=count, enable_above=2.5), "enable_above")):
        with pytest.raises(ValueError, match=match):
            decode_matvec(x, w, layer=layer, block_sizes=SMALL, interpret=True, **bad)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.fast_params("2-nk", "3-kn", "8-nk")
def test_split_k_matches_the_unsplit_product(layout, split):
    """The K loop split over programs (fp32 partials summed, the epilogue in XLA): the same values,
    with the norm, residual, activation, parts, a stack and the enable switch."""
    x, w, gate, scale, res = _inputs(jnp.float32, 3, 32, 70, layers=2, seed=split)
    if layout == "kn":
        w, gate = jnp.swapaxes(w, 1, 2), jnp.swapaxes(gate, 1, 2)
    sizes = MatvecBlockSizes(block_n=16, block_k=16, num_warps=1, num_stages=1, split_k=split)
    layer = jnp.asarray([1], jnp.int32)
    cases = [dict(norm_scale=scale, residual=res), dict(activation="relu"),
             dict(w=(w, gate), norm_scale=scale), dict(residual=res, enable=jnp.asarray([0], jnp.int32))]
    for kwargs in cases:
        weights = kwargs.pop("w", w)
        got = decode_matvec(x, weights, layer=layer, layout=layout, block_sizes=sizes, interpret=True, **kwargs)
        want = decode_matvec_reference(x, weights, layer=layer, layout=layout, **kwargs)
        assert got.shape == want.shape and _rel(got, want) <= TOL[jnp.float32], kwargs
    with pytest.raises(ValueError, match="split_k"):
        decode_matvec(x, w, layer=layer, layout=layout, gate=gate, activation="relu", block_sizes=sizes)
    with pytest.raises(ValueError, match="split_k"):
        MatvecBlockSizes(split_k=0)


def test_every_decode_role_has_block_sizes():
    from twell_jax.pallas_kernels.decode_matvec import ROLES, role_block_sizes

    assert all(isinstance(role_block_sizes(role), MatvecBlockSizes) for role in ROLES)
    with pytest.raises(ValueError, match="role"):
        role_block_sizes("lm_head")
    with pytest.raises(ValueError, match="rows"):
        role_block_sizes("head", 0)


def test_steps_of_many_rows_take_their_own_blocks():
    """Above MANY_ROWS rows a role named in ROLE_BLOCK_SIZES_MANY_ROWS takes those blocks (64 rows a
    program for the dense products); the others, and every role up to MANY_ROWS rows, keep
    ROLE_BLOCK_SIZES'. The gates keep 16 rows at any batch (tiles and packed need every row in one
    gate program)."""
    from twell_jax.pallas_kernels import decode_matvec as dm

    many = dm.MANY_ROWS + 1
    for role in dm.ROLES:
        assert dm.role_block_sizes(role, dm.MANY_ROWS) is dm.ROLE_BLOCK_SIZES[role]
        want = dm.ROLE_BLOCK_SIZES_MANY_ROWS.get(role, dm.ROLE_BLOCK_SIZES[role])
        assert dm.role_block_sizes(role, many) is want
    assert set(dm.ROLE_BLOCK_SIZES_MANY_ROWS) <= set(dm.ROLES)
    assert dm.role_block_sizes("gate", 64).block_m(64) == 16


def test_fp32_operands_keep_the_pipeline_within_its_bf16_shared_memory(monkeypatch):
    """The block sizes are tuned for bf16; at fp32 every role's pipeline is cut (stages first, then
    the K step) to at most its bf16 bytes (the output projection's four fp32 stages of [256, 64]
    blocks exceeded the H100's shared memory); bf16 keeps every size as tuned; the result is the
    reference's with the cut sizes (interpret mode)."""
    from twell_jax.pallas_kernels import decode_matvec as dm

    for table in (dm.ROLE_BLOCK_SIZES, dm.ROLE_BLOCK_SIZES_MANY_ROWS):
        for role, sizes in table.items():
            for m in (1, 4, 33, 64):
                for parts in (1, 3):
                    assert sizes.fitted(m, 2, parts) is sizes, role
                    cut = sizes.fitted(m, 4, parts)
                    assert cut.pipeline_bytes(m, 4, parts) <= sizes.pipeline_bytes(m, 2, parts), role
                    assert cut.num_stages >= 2 and cut.block_k >= 16 and cut.block_n == sizes.block_n
    out = dm.ROLE_BLOCK_SIZES["out_nk"]
    assert (out.num_stages, out.block_k) == (4, 256)
    assert (out.fitted(1, 4).num_stages, out.fitted(1, 4).block_k) == (2, 256)
    tiny = MatvecBlockSizes(block_n=16, block_k=32, num_stages=2)  # no stage left to cut: K halves
    assert tiny.fitted(1, 4).block_k == 16
    # The launch gets the fitted sizes (the interpreter ignores the stages, so ask the launch itself).
    import twell_jax.pallas_kernels.decode_matvec as dm_module
    launched = []
    real = dm_module.compiler_params
    monkeypatch.setattr(dm_module, "compiler_params", lambda s: launched.append(s) or real(s))
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 96)) / 10, jnp.float32)
    sizes = MatvecBlockSizes(block_n=16, block_k=64, num_stages=4)
    got = decode_matvec(x, w, block_sizes=sizes, interpret=True)
    assert _rel(got, decode_matvec_reference(x, w)) <= TOL[jnp.float32]
    assert launched and all(s == sizes.fitted(3, 4) != sizes for s in launched)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m,n,programs", [(1, 40, 3), (17, 33, 4), (3, 64, 5)])
@pytest.mark.fast_params("1-40-3-kn", "17-33-4-nk", "3-64-5-kn")
def test_balanced_column_programs_match_the_reference(layout, m, n, programs):
    """MatvecBlockSizes.programs_n: exactly `programs` column programs of ceil(n / programs) <=
    block_n columns (the block's other lanes masked), with and without split_k, every option."""
    x, w, gate, scale, res = _inputs(jnp.float32, m, n, 40, layers=2, seed=m * n)
    if layout == "kn":
        w, gate = jnp.swapaxes(w, 1, 2), jnp.swapaxes(gate, 1, 2)
    layer = jnp.asarray([1], jnp.int32)
    for split in (1, 2):
        sizes = MatvecBlockSizes(block_n=16, block_k=16, num_warps=1, num_stages=1, split_k=split,
                                 programs_n=programs)
        assert sizes.columns(n) == (-(-n // -(-n // programs)), -(-n // programs))
        cases = [dict(norm_scale=scale, residual=res), dict(activation="relu")]
        if split == 1:
            cases.append(dict(norm_scale=scale, gate=gate, activation="relu"))
        for kwargs in cases:
            got = decode_matvec(x, w, layer=layer, layout=layout, block_sizes=sizes, interpret=True, **kwargs)
            want = decode_matvec_reference(x, w, layer=layer, layout=layout, **kwargs)
            assert got.shape == (m, n), kwargs
            assert _rel(got, want) <= TOL[jnp.float32], (split, kwargs, _rel(got, want))


def test_balanced_column_programs_refuse_what_they_cannot_hold():
    x, w, *_ = _inputs(jnp.float32, 1, 40, 16)
    with pytest.raises(ValueError, match="programs_n=2 gives 20 columns a program for N=40, more than block_n=16"):
        decode_matvec(x, w, block_sizes=MatvecBlockSizes(block_n=16, block_k=16, programs_n=2), interpret=True)
    x, w, *_ = _inputs(jnp.float32, 1, 32, 16)
    with pytest.raises(ValueError, match="needs one weight part"):
        decode_matvec(x, (w, w), block_sizes=MatvecBlockSizes(block_n=16, block_k=16, programs_n=5), interpret=True)
    with pytest.raises(ValueError, match="programs_n must be an int >= 0"):
        MatvecBlockSizes(programs_n=-1)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m", [1, 3])
def test_the_norm_prologue_over_several_of_its_steps(layout, m):
    """K = 1100: at 3 rows the sum-of-squares pass runs three steps of NORM_BLOCK_K (the last
    partial); at 1 row (common.NORM_ROWWISE_MAX_ROWS) the row is one masked load of 2048 lanes."""
    from twell_jax.pallas_kernels.common import NORM_ROWWISE_MAX_ROWS
    from twell_jax.pallas_kernels.decode_matvec import NORM_BLOCK_K

    assert -(-1100 // NORM_BLOCK_K) == 3 and (m <= NORM_ROWWISE_MAX_ROWS) == (m == 1)
    x, w, gate, scale, res = _inputs(jnp.float32, m, 24, 1100, seed=11 + m)
    if layout == "kn":
        w, gate = w.T, gate.T
    sizes = MatvecBlockSizes(block_n=16, block_k=128, num_warps=1, num_stages=1)
    for kwargs in (dict(norm_scale=scale), dict(norm_scale=scale, gate=gate, activation="relu")):
        got = decode_matvec(x, w, layout=layout, block_sizes=sizes, interpret=True, **kwargs)
        want = decode_matvec_reference(x, w, layout=layout, **kwargs)
        assert _rel(got, want) <= TOL[jnp.float32], (kwargs, _rel(got, want))
