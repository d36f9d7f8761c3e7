"""pallas_kernels/twell_transpose.py in interpret mode on CPU: the counting-sort kernels against the
stable-sort reference bit for bit on random and adversarial TwELL patterns, the CSR invariants
checked independently in numpy, the kept pattern's form (uint8 offsets, int16 counts) and the
padded outputs, argument errors, the Triton lowering, and the benchmark script's dry run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.pallas_kernels.common import next_pow2
from twell_jax.pallas_kernels.twell_pack import pack_gate_reference
from twell_jax.pallas_kernels.twell_transpose import (TransposeBlockSizes, chunk_histograms, chunk_histograms_shape,
                                            neuron_histogram, neuron_lists,
                                            neuron_lists_reference)

ROOT = Path(__file__).resolve().parents[1]
TILE, SLOTS, WIDTH = 16, 4, 8
SMALL = TransposeBlockSizes(block_rows=4, chunk_rows=8)  # several chunks and blocks at M ~ 40


def make_pattern(seed: int, m: int, h: int, *, kind: str = "random", p: float = 0.1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(indices [M, NT, S], counts [M, NT]) of a TwELL pattern of M rows over H neurons (tile TILE):
    each neuron live with probability p, plus `kind`'s adversarial rows. Counts are true counts
    (may exceed SLOTS: only the first SLOTS are stored); rows with more than WIDTH stored entries
    get counts 0 (the caller's contract)."""
    rng = np.random.default_rng(seed)
    active = rng.random((m, h)) < p
    if kind == "zero":
        active[:] = False
    elif kind == "hot":  # neuron 5 live on every row
        active[:, 5] = True
    elif kind == "full_width":  # rows 0, 3, 6, ...: exactly WIDTH stored entries
        for i in range(0, m, 3):
            active[i] = False
            active[i, rng.choice(h, WIDTH, replace=False)] = True
    elif kind == "overflow":  # rows 1, 5, 9, ...: one tile far over SLOTS (only SLOTS stored)
        active[1::4, TILE:2 * TILE] = True
        active[1::4, :TILE] = False
        active[1::4, 2 * TILE:] = False
    n_tiles = -(-h // TILE)
    padded = np.zeros((m, n_tiles * TILE), bool)
    padded[:, :h] = active
    tiles = padded.reshape(m, n_tiles, TILE)
    counts = tiles.sum(-1).astype(np.int32)
    indices = np.zeros((m, n_tiles, SLOTS), np.int32)
    for i, t in zip(*np.nonzero(counts)):
        cols = np.flatnonzero(tiles[i, t])[:SLOTS] + t * TILE
        indices[i, t, :len(cols)] = cols
    counts[np.minimum(counts, SLOTS).sum(1) > WIDTH] = 0
    return indices, counts


def kept_form(indices: np.ndarray, counts: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The pattern as the training forward keeps it (`pallas_backward.Kept`): each live slot's
    neuron as its uint8 offset inside tile TILE, int16 counts; dead slots hold junk (in Kept they
    hold the pack's zeros minus the tile base, wrapped)."""
    live = np.arange(indices.shape[2])[None, None, :] < np.minimum(counts, indices.shape[2])[:, :, None]
    offsets = indices - (np.arange(indices.shape[1]) * TILE)[None, :, None]
    assert np.all((offsets[live] >= 0) & (offsets[live] < TILE))
    junk = np.random.default_rng(seed).integers(0, 256, indices.shape)
    return np.where(live, offsets, junk).astype(np.uint8), counts.astype(np.int16)


def check_csr(out: tuple, indices: np.ndarray, counts: np.ndarray, h: int) -> None:
    """The CSR invariants, from the pattern alone: counts per neuron, starts = their exclusive
    prefix sum, every live entry (row i, rank r, neuron j) at a distinct position inside neuron j's
    range holding row i, tokens ascending inside each neuron, dest -1 past each row's entries."""
    start, count, tokens, dest = (np.asarray(a) for a in out)
    m, n_tiles, slots = indices.shape
    live = np.arange(slots)[None, None, :] < np.minimum(counts, slots)[:, :, None]
    neuron_of = [indices[i][live[i]] for i in range(m)]  # row i's entries in rank order
    np.testing.assert_array_equal(count, np.bincount(np.concatenate(neuron_of), minlength=h)[:h])
    np.testing.assert_array_equal(start, np.cumsum(count) - count)
    seen = np.zeros(int(count.sum()), bool)
    for i, js in enumerate(neuron_of):
        np.testing.assert_array_equal(dest[i, len(js):], -1)
        for r, j in enumerate(js):
            p = dest[i, r]
            assert start[j] <= p < start[j] + count[j] and tokens[p] == i and not seen[p]
            seen[p] = True
    assert seen.all()
    for j in np.flatnonzero(count):
        assert np.all(np.diff(tokens[start[j]:start[j] + count[j]]) > 0)


def assert_matches_reference(indices, counts, h: int, block_sizes=SMALL, width: int = WIDTH) -> tuple:
    out = neuron_lists(jnp.asarray(indices), jnp.asarray(counts), h, width=width,
                       block_sizes=block_sizes, interpret=True)
    ref = neuron_lists_reference(jnp.asarray(indices), jnp.asarray(counts), h, width=width)
    m = indices.shape[0]
    w = next_pow2(width)
    shapes = ((h,), (h,), (m * w,), (m, w))
    n_total = int(ref[1].sum())
    for a, b, shape in zip(out, ref, shapes):
        assert a.shape == shape and a.dtype == jnp.int32
    for k in (0, 1, 3):
        np.testing.assert_array_equal(out[k], ref[k])
    np.testing.assert_array_equal(out[2][:n_total], ref[2][:n_total])
    check_csr(out, indices, counts, h)
    return out


@pytest.mark.parametrize("kind,m,h", [
    ("random", 37, 40),       # M not a multiple of block/chunk; H 40: the last tile partial; 5 chunks
    ("zero", 13, 48),         # no entry at all
    ("hot", 29, 40),          # one neuron on every row (crosses every chunk)
    ("full_width", 30, 48),   # rows with exactly WIDTH entries
    ("overflow", 21, 40),     # counts > S: only S slots live
])
def test_kernel_matches_reference(kind, m, h):
    indices, counts = make_pattern(1, m, h, kind=kind)
    out = assert_matches_reference(indices, counts, h)
    n_live = np.minimum(counts, SLOTS).sum(1)
    if kind == "zero":
        assert not out[1].any() and np.all(np.asarray(out[3]) == -1)
    if kind == "hot":
        assert int(out[1][5]) == int((n_live > 0).sum()) > 16
    if kind == "full_width":
        assert (n_live == WIDTH).sum() >= 8
    if kind == "overflow":
        assert (counts[1::4, 1] > SLOTS).all() and (n_live[1::4] == SLOTS).all()


@pytest.mark.parametrize("kind,m,h", [
    ("random", 37, 40), ("zero", 13, 48), ("hot", 29, 40), ("full_width", 30, 48),
    ("overflow", 21, 40)])
def test_kept_form_gives_the_same_lists(kind, m, h):
    """The pattern as the training forward keeps it (uint8 offsets inside the tile, int16 counts,
    junk in dead slots), read as it is: the same histograms and lists, bit for bit, as the pack's
    int32 ids and counts (and the reference on either form). With padded=True the kernel's
    outputs come unsliced: longer (tokens_E past M * W, dest past M rows), the lists their prefix."""
    indices, counts = make_pattern(1, m, h, kind=kind)
    offsets, counts16 = kept_form(indices, counts, seed=m)
    want = assert_matches_reference(indices, counts, h)
    kept = (jnp.asarray(offsets), jnp.asarray(counts16))
    hist = chunk_histograms(*kept, h, block_sizes=SMALL, interpret=True)
    np.testing.assert_array_equal(hist, chunk_histograms(jnp.asarray(indices), jnp.asarray(counts), h,
                                                         block_sizes=SMALL, interpret=True))
    got = neuron_lists(*kept, h, width=WIDTH, block_sizes=SMALL, interpret=True)
    ref = neuron_lists_reference(*kept, h, width=WIDTH)
    for a, b, r in zip(want, got, ref):
        assert a.shape == b.shape and b.dtype == jnp.int32
        np.testing.assert_array_equal(a, b)
    for k in (0, 1, 3):
        np.testing.assert_array_equal(want[k], ref[k])
    padded = neuron_lists(*kept, h, width=WIDTH, hist=hist, padded=True, block_sizes=SMALL,
                          interpret=True)
    assert padded[2].shape[0] > m * WIDTH and padded[3].shape[0] > m and padded[3].shape[1] == WIDTH
    for a, b in zip(want, padded):
        np.testing.assert_array_equal(a, b[:a.shape[0]])


def test_precomputed_histograms_give_the_same_lists():
    """neuron_lists(hist=chunk_histograms(...)) skips the first pass and gives the same lists (and
    takes its counts from the given histograms: zeros give empty lists); a histogram of another
    shape is refused."""
    indices, counts = make_pattern(3, 37, 40, kind="hot")
    args = (jnp.asarray(indices), jnp.asarray(counts), 40)
    hist = chunk_histograms(*args, block_sizes=SMALL, interpret=True)
    assert hist.shape == chunk_histograms_shape(37, indices.shape[1], TILE, SMALL) == (5, 48)
    np.testing.assert_array_equal(jnp.sum(hist, axis=0)[:40],
                                  neuron_histogram(*args, block_sizes=SMALL, interpret=True))
    with_hist = neuron_lists(*args, width=WIDTH, hist=hist, block_sizes=SMALL, interpret=True)
    for a, b in zip(with_hist, assert_matches_reference(indices, counts, 40)):
        np.testing.assert_array_equal(a, b)
    assert int(with_hist[1].sum()) > 0
    start, count, _, dest = neuron_lists(*args, width=WIDTH, hist=jnp.zeros_like(hist), block_sizes=SMALL,
                                         interpret=True)
    assert not bool(jnp.any(count)) and not bool(jnp.any(start))  # the first pass did not run
    with pytest.raises(ValueError, match="hist must be int32"):
        neuron_lists(*args, width=WIDTH, hist=hist[:4], block_sizes=SMALL, interpret=True)


@pytest.mark.parametrize("kind,m,h", [("random", 37, 45), ("hot", 21, 40), ("overflow", 40, 48),
                                      ("zero", 9, 33)])
def test_neuron_histogram_counts_every_live_slot(kind, m, h):
    """The histogram pass alone (the forward's per-neuron counts): live slots per neuron, counted
    independently with numpy's bincount; no row-width limit (wide rows are counted too)."""
    indices, counts = make_pattern(11, m, h, kind=kind, p=0.3)
    # A second pattern with rows over WIDTH and tiles over SLOTS kept: slot k of tile t holds
    # neuron t * TILE + k (inside the tile, as a pack's are), live up to a random count.
    n_tiles = indices.shape[1]
    tile_k = np.arange(n_tiles)[:, None] * TILE + np.arange(SLOTS)[None, :]
    wide_indices = np.broadcast_to(np.minimum(tile_k, h - 1), indices.shape).astype(np.int32)
    room = np.minimum(h - np.arange(n_tiles) * TILE, SLOTS + 2)  # the last tile may be partial
    wide = (np.random.default_rng(12).random(counts.shape) * (room + 1)).astype(np.int32)
    for ind, c in ((indices, counts), (wide_indices, wide)):
        got = neuron_histogram(jnp.asarray(ind), jnp.asarray(c), h, block_sizes=SMALL, interpret=True)
        live = np.arange(SLOTS)[None, None, :] < np.minimum(c, SLOTS)[:, :, None]
        np.testing.assert_array_equal(got, np.bincount(ind[live], minlength=h)[:h])
    assert neuron_histogram(jnp.zeros((0, 3, SLOTS), jnp.int32), jnp.zeros((0, 3), jnp.int32), h,
                            interpret=True).shape == (h,)


def test_pack_pattern_default_blocks():
    """A real pack's pattern (an overflowing dense row, an all-zero row) with the default block
    sizes: one chunk smaller than chunk_rows."""
    rng = np.random.default_rng(7)
    m, d, h = 19, 8, 56
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal((h, d)).astype(np.float32)
    w[:, 0], x[:, 0] = 1.0, -4.0  # a bias: ~4 live neurons per row
    x[0] = 0.0  # no live neuron
    x[3, 0] = 1e3  # every neuron live: the row's tiles overflow
    _, indices, counts = pack_gate_reference(jnp.asarray(x), jnp.asarray(w), tile=TILE, slots=SLOTS)
    indices, counts = np.asarray(indices), np.asarray(counts)
    counts = np.where((np.minimum(counts, SLOTS).sum(1) > WIDTH)[:, None], 0, counts)
    assert counts[0].sum() == 0 and counts[3].sum() == 0 and counts.sum() > m  # row 3: token tail
    assert_matches_reference(indices, counts, h, block_sizes=TransposeBlockSizes())


def test_width_rounded_and_empty_rows():
    """width 5 -> W 8 (next power of two); M 0 gives empty lists."""
    indices, counts = make_pattern(3, 10, 40, p=0.05)
    counts[np.minimum(counts, SLOTS).sum(1) > 5] = 0
    out = assert_matches_reference(indices, counts, 40, width=5)
    assert out[3].shape == (10, 8)
    empty = neuron_lists(jnp.zeros((0, 3, SLOTS), jnp.int32), jnp.zeros((0, 3), jnp.int32), 40,
                         width=WIDTH, interpret=True)
    assert [a.shape for a in empty] == [(40,), (40,), (0,), (0, WIDTH)] and not empty[1].any()


@pytest.mark.parametrize("change,match", [
    (dict(indices=jnp.zeros((4, 3, SLOTS), jnp.float32)), "indices"),
    (dict(indices=jnp.zeros((4, 3 * SLOTS), jnp.int32)), "indices"),
    (dict(counts=jnp.zeros((4, 2), jnp.int32)), "counts"),
    (dict(counts=jnp.zeros((4, 3), jnp.int8)), "counts"),  # int32 or int16 (the kept pattern's)
    (dict(indices=jnp.zeros((4, 3, SLOTS), jnp.uint16)), "indices"),  # int32 ids or uint8 offsets
    (dict(width=0), "width"),
    (dict(width=True), "width"),
    (dict(n_neurons=0), "n_neurons"),
    (dict(n_neurons=100), "n_neurons"),  # 100 neurons do not make 3 tiles of a power of two
    (dict(indices=jnp.zeros((4, 3, SLOTS), jnp.uint8), n_neurons=1500), "tile"),  # 512: no uint8
    (dict(block_sizes="32"), "block_sizes"),
])
def test_bad_arguments(change, match):
    args = dict(indices=jnp.zeros((4, 3, SLOTS), jnp.int32), counts=jnp.zeros((4, 3), jnp.int32),
                n_neurons=40, width=WIDTH, block_sizes=SMALL)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        neuron_lists(args["indices"], args["counts"], args["n_neurons"], width=args["width"],
                     block_sizes=args["block_sizes"], interpret=True)
    if "block_sizes" not in change:
        with pytest.raises(ValueError, match=match):
            neuron_lists_reference(args["indices"], args["counts"], args["n_neurons"], width=args["width"])


@pytest.mark.parametrize("fields,match", [
    (dict(block_rows=3), "block_rows"), (dict(block_rows=0), "block_rows"),
    (dict(block_rows=8, chunk_rows=12), "chunk_rows"), (dict(block_rows=8, chunk_rows=4), "chunk_rows"),
    (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages"),
])
def test_bad_block_sizes(fields, match):
    with pytest.raises(ValueError, match=f"TransposeBlockSizes.{match}"):
        TransposeBlockSizes(**fields)


def test_triton_lowering():
    """Both kernels lower to Triton IR at the benchmark's shape (cross-platform lowering on the CPU:
    catches constructs the Triton lowering does not implement; jaxlib <= 0.10.2 stops before the
    Triton compile, later versions compile in the lowering and need a GPU)."""
    from jax._src.lib import version as jaxlib_version
    if jaxlib_version > (0, 10, 2):
        pytest.skip("jaxlib > 0.10.2 compiles Triton during lowering (needs a GPU)")
    m, n_tiles, slots = 16384, 22, 32
    for index_dtype, count_dtype in ((jnp.int32, jnp.int32), (jnp.uint8, jnp.int16)):  # the kept form
        lowered = neuron_lists.trace(jax.ShapeDtypeStruct((m, n_tiles, slots), index_dtype),
                                     jax.ShapeDtypeStruct((m, n_tiles), count_dtype), 5632,
                                     width=128, padded=True).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2
        # The pattern reaches both kernels as it is (no wider copy) and no output is sliced.
        assert "stablehlo.convert %arg0" not in text and "stablehlo.slice" not in text


@pytest.mark.slow
def test_bench_dry_run():
    """experiments/bench_transpose.py (twell_jax/bench/transpose.py) --interpret runs end to end (it checks
    equality first)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "twell_jax.bench.transpose", "--interpret"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kernel" in proc.stdout and "xla_sort" in proc.stdout
