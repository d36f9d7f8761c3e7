"""Synthetic gate sparsity with the shape of a trained layer, and the fit of that shape to one.

The uniform synthetic pattern of the benchmarks (`bench.ffn.make_inputs`) fires every neuron with
the same probability k / H on every token. A trained layer does not: some neurons fire far more
often than others, some never fire (dead), and the first tokens of a sequence are denser than the
rest. Those are what the kernels' costs depend on besides the mean: hot neurons go to the
backward's dense neuron tail and are reused from cache, dense first tokens go to its token tail.

`PatternShape` holds the three, fitted to a layer by `fit_shape` from its exact activity:
  * neuron skew: the spread (standard deviation) of the log firing frequency over the neurons
    that fire, `neuron_sigma`, taken robustly from its 16th and 84th percentiles;
  * `dead_share`: the share of neurons that never fired on the sample;
  * the position profile: mean active count per position bucket ([0], [1], [2, 4), [4, 8), ...,
    up to the sequence length) over the layer's mean, `position_density`.

`shaped_inputs` draws (x, W_gate, W_up, W_down) whose gate pattern has a given mean k and shape:
g = x . W_gate_j = eps + beta_j + gamma_t with eps ~ N(0, 1) (random x and W), a per-neuron
offset beta_j (x[:, 0] = 1, W_gate[:, 0] = beta) that gives neuron j the firing rate
q_j = k w_j / sum(w) with log w_j ~ N(0, sigma^2) at gamma = 0 (dead neurons: never), and a
per-token offset gamma_t (x[:, 1] = gamma, W_gate[:, 1] = 1) solved per position bucket so that
the expected count sum_j Phi(beta_j + gamma) is k times the bucket's density (the densities
rescaled to a mean of 1 over the positions, so k is the mean). Tokens are taken as
consecutive sequences of `seq_len`. Neurons fire independently given (beta, gamma): the token-to-
token correlation of real text (similar tokens, similar neurons) is not modelled, so a trained
layer reuses rows across tokens somewhat more than this pattern does.

`TRAINED_LIKE` is the shape the benchmarks use, fitted to a trained layer (its `source` says
which, by which command).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr, ndtri

from twell_jax.ops.planner import position_buckets  # noqa: F401 (the buckets of the fitted profiles)


@dataclasses.dataclass(frozen=True)
class PatternShape:
    """The shape of a layer's gate pattern beside its mean (module doc)."""

    neuron_sigma: float  # std of log firing frequency over the neurons that fire
    dead_share: float  # share of neurons that never fire
    seq_len: int  # tokens per sequence (positions repeat every seq_len tokens)
    position_density: tuple[float, ...]  # mean active count per bucket / the mean (position_buckets)
    source: str = ""  # where the fit comes from

    def __post_init__(self) -> None:
        if not (isinstance(self.neuron_sigma, (int, float)) and 0 <= self.neuron_sigma <= 5):
            raise ValueError(f"PatternShape.neuron_sigma must be a number in [0, 5], got {self.neuron_sigma!r}")
        if not (isinstance(self.dead_share, (int, float)) and 0 <= self.dead_share < 1):
            raise ValueError(f"PatternShape.dead_share must be in [0, 1), got {self.dead_share!r}")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"PatternShape.seq_len must be an int >= 1, got {self.seq_len!r}")
        n = len(position_buckets(self.seq_len)) - 1
        if len(self.position_density) != n or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in self.position_density):
            raise ValueError(f"PatternShape.position_density must hold {n} positive numbers (one per bucket "
                             f"of position_buckets({self.seq_len})), got {self.position_density!r}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"position_density": list(self.position_density),
                                           "position_buckets": position_buckets(self.seq_len)}

    @classmethod
    def from_json(cls, data: dict) -> "PatternShape":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields - {"position_buckets"}
        if unknown:
            raise ValueError(f"PatternShape: unknown fields {sorted(unknown)}")
        return cls(**{k: (tuple(v) if k == "position_density" else v) for k, v in data.items() if k in fields})


# The median of the fits of layers 0, 1, 3, 5 and 7 of a trained `small` (D 512, H 1408, 8 layers; 36.1
# active neurons per token on its validation tokens, 97.4% zero), 16384 validation tokens each, on one
# H100 on 2026-11-27 (experiments/results/bench_ffn_train_checkpoint_small_h100_2026-11-27.json).
# Per layer: sigma 0.63-1.00, no dead neuron, the top 10% of neurons held 23-41% of the entries, the
# first token 0.8-12x the layer's mean.
TRAINED_LIKE_SOURCE = (
    "median over layers 0, 1, 3, 5, 7 of a `small` trained by the quality study's L1 1e-3 recipe on the "
    "preset's stdlib corpus (`twell train --config small --set sparsity.l1_coef=1e-3 "
    "sparsity.l1_warmup_start=0 sparsity.l1_warmup_end=300 train.steps=6000`; the study itself ran on the "
    "installed corpus), fitted by `python experiments/bench_ffn_train.py --checkpoint RUN --micro-batch 32 "
    "--layers 0,1,3,5,7` (H100, 2026-11-27)")


def bucket_of_position(seq_len: int) -> np.ndarray:
    """int[seq_len]: each position's bucket (position_buckets)."""
    edges = position_buckets(seq_len)
    return np.searchsorted(np.asarray(edges[1:]), np.arange(seq_len), side="right")


def skew_stats(neuron_count_H: np.ndarray) -> dict:
    """How concentrated the entries are on few neurons: the shares of all entries held by the top
    1% and 10% of neurons, and the dead share."""
    counts = np.sort(np.asarray(neuron_count_H, np.float64))[::-1]
    total = counts.sum()
    h = counts.size

    def top(share: float) -> float:
        return float(counts[:max(1, int(round(share * h)))].sum() / total) if total else 0.0

    return dict(top1_entry_share=top(0.01), top10_entry_share=top(0.10),
                dead_share=float(np.mean(counts == 0)) if h else 0.0)


def fit_shape(active_M: np.ndarray, neuron_count_H: np.ndarray, seq_len: int, source: str = "") -> PatternShape:
    """The PatternShape of a layer from its exact activity on M tokens taken as consecutive
    sequences of seq_len (M a multiple of seq_len): active neurons per token [M] and tokens per
    neuron [H]."""
    active_M = np.asarray(active_M, np.float64)
    neuron_count_H = np.asarray(neuron_count_H, np.float64)
    if active_M.ndim != 1 or neuron_count_H.ndim != 1:
        raise ValueError(f"active_M must be [M] and neuron_count_H [H], got {active_M.shape} and "
                         f"{neuron_count_H.shape}")
    if seq_len < 1 or active_M.size == 0 or active_M.size % seq_len:
        raise ValueError(f"fit_shape needs whole sequences: M={active_M.size} tokens, seq_len={seq_len}")
    mean = active_M.mean()
    alive = neuron_count_H[neuron_count_H > 0]
    if mean <= 0 or alive.size < 2:
        raise ValueError("fit_shape: the layer has no active neurons (nothing to fit)")
    lo, hi = np.percentile(np.log(alive), [15.87, 84.13])
    per_position = active_M.reshape(-1, seq_len).mean(axis=0)
    bucket = bucket_of_position(seq_len)
    density = tuple(float(per_position[bucket == b].mean() / mean) for b in range(bucket.max() + 1))
    return PatternShape(neuron_sigma=float((hi - lo) / 2), dead_share=float(np.mean(neuron_count_H == 0)),
                        seq_len=seq_len, position_density=density, source=source)


def _neuron_offsets(key: jax.Array, h: int, k: float, shape: PatternShape) -> jax.Array:
    """beta [H] (f32): neuron j fires with probability Phi(beta_j) = q_j at gamma = 0, q summing to
    k, log q ~ N(., sigma^2) over the live neurons (random order), -inf-like for the dead."""
    k_perm, k_dead = jax.random.split(key)
    n_dead = int(round(shape.dead_share * h))
    # Deterministic normal quantiles in a random order: the fitted spread exactly, at any H.
    z = ndtri((jnp.arange(h - n_dead, dtype=jnp.float32) + 0.5) / (h - n_dead))
    w = jnp.exp(shape.neuron_sigma * jax.random.permutation(k_perm, z))
    q = jnp.minimum(k * w / jnp.sum(w), 0.5)
    beta_live = ndtri(q)
    beta = jnp.concatenate([beta_live, jnp.full((n_dead,), -30.0, jnp.float32)])
    return jax.random.permutation(k_dead, beta)


def _token_offsets(beta_H: jax.Array, k: float, shape: PatternShape) -> np.ndarray:
    """gamma per position bucket: the offset at which sum_j Phi(beta_j + gamma) = k * density,
    by bisection (the sum grows with gamma)."""
    def expected(gamma: float) -> float:
        return float(jnp.sum(ndtr(beta_H + gamma)))

    # Densities relative to their mean over the positions (a fit's are already; the median of
    # several fits nearly), so that the mean over a sequence is k.
    widths = np.diff(position_buckets(shape.seq_len))
    scale = shape.seq_len / float(np.dot(widths, shape.position_density))
    out = []
    for density in shape.position_density:
        target = min(k * density * scale, 0.999 * beta_H.shape[0])
        lo, hi = -10.0, 10.0
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if expected(mid) < target else (lo, mid)
        out.append(0.5 * (lo + hi))
    return np.asarray(out, np.float32)


def shaped_inputs(key: jax.Array, m: int, k: float, shape: PatternShape, d: int, h: int,
                  dtype=jnp.bfloat16, n_sets: int = 3) -> tuple[list[jax.Array], jax.Array, jax.Array, jax.Array]:
    """n_sets different x [m, d] and one weight set (W_gate, W_up, W_down [h, d]) whose gate pattern
    has mean ~k active neurons per token with `shape`'s skew, dead share and position profile
    (module doc). m need not be a multiple of seq_len (the last sequence is cut)."""
    if d < 3:
        raise ValueError(f"shaped_inputs needs d >= 3 (two columns carry the offsets), got {d}")
    if not 0 < k < h:
        raise ValueError(f"shaped_inputs needs 0 < k < h, got k={k}, h={h}")
    kx, kg, ku, kd, kb = jax.random.split(key, 5)
    beta_H = _neuron_offsets(kb, h, k, shape)
    gamma_B = _token_offsets(beta_H, k, shape)
    position = np.arange(m) % shape.seq_len
    gamma_M = jnp.asarray(gamma_B[bucket_of_position(shape.seq_len)[position]])
    # eps = x[:, 2:] . W[:, 2:] ~ N(0, 1): W's entries N(0, 1 / (d - 2)).
    scale = 1.0 / np.sqrt(d - 2)
    xs = []
    for i in range(n_sets):
        x = jax.random.normal(jax.random.fold_in(kx, i), (m, d), jnp.float32)
        xs.append(x.at[:, 0].set(1.0).at[:, 1].set(gamma_M).astype(dtype))
    w_gate = (jax.random.normal(kg, (h, d), jnp.float32) * scale).at[:, 0].set(beta_H).at[:, 1].set(1.0)
    w_up = jax.random.normal(ku, (h, d), jnp.float32) * scale
    w_down = jax.random.normal(kd, (h, d), jnp.float32) * scale
    return xs, w_gate.astype(dtype), w_up.astype(dtype), w_down.astype(dtype)


def exact_activity(x_MxD: jax.Array, w_gate_HxD: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(active neurons per token [M], tokens per neuron [H]) of relu(x W_gate^T) > 0 with fp32
    accumulation (the pack's sign rule), in blocks of rows so [M, H] never sits in memory whole."""
    m = x_MxD.shape[0]
    per_token, per_neuron = [], jnp.zeros((w_gate_HxD.shape[0],), jnp.int32)

    @jax.jit
    def block(x):
        active = jnp.einsum("md,hd->mh", x, w_gate_HxD, preferred_element_type=jnp.float32) > 0
        return jnp.sum(active, axis=1, dtype=jnp.int32), jnp.sum(active, axis=0, dtype=jnp.int32)

    for start in range(0, m, 4096):
        t, n = block(x_MxD[start:start + 4096])
        per_token.append(np.asarray(t))
        per_neuron = per_neuron + n
    return np.concatenate(per_token), np.asarray(per_neuron)


def describe(shape: PatternShape) -> str:
    """One line: the shape's parameters."""
    edges = position_buckets(shape.seq_len)
    first = ", ".join(f"[{a},{b}) {v:.2f}x" for a, b, v in zip(edges, edges[1:], shape.position_density[:4]))
    return (f"neuron sigma {shape.neuron_sigma:.2f}, dead {shape.dead_share:.1%}, seq {shape.seq_len}, "
            f"density by position {first}, ...")


def shape_of_layers(shapes: Sequence[PatternShape]) -> PatternShape:
    """The median shape of several layers' fits (same seq_len): each parameter's median."""
    if not shapes or len({s.seq_len for s in shapes}) != 1:
        raise ValueError("shape_of_layers needs at least one shape, all with the same seq_len")
    med = lambda values: float(np.median(np.asarray(values)))  # noqa: E731
    return PatternShape(neuron_sigma=med([s.neuron_sigma for s in shapes]),
                        dead_share=med([s.dead_share for s in shapes]), seq_len=shapes[0].seq_len,
                        position_density=tuple(med(v) for v in zip(*(s.position_density for s in shapes))),
                        source=f"median of {len(shapes)} layers' fits")


TRAINED_LIKE = PatternShape(
    neuron_sigma=0.839, dead_share=0.0, seq_len=512,
    position_density=(2.529, 2.466, 2.242, 1.795, 1.674, 1.327, 1.137, 1.031, 0.983, 0.907),
    source=TRAINED_LIKE_SOURCE)
