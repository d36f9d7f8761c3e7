"""BackwardConfig: the static knobs of the Pallas backward (`SparseFFNConfig.backward`), in a leaf
module (it imports only the kernels' block-size dataclasses), so that the op's config can check it
without importing the backward."""
from __future__ import annotations

import dataclasses

from twell_jax.pallas_kernels.twell_bwd_neuron import NeuronBwdBlockSizes
from twell_jax.pallas_kernels.twell_bwd_token import ListsBlockSizes, TokenBwdBlockSizes
from twell_jax.pallas_kernels.twell_transpose import TransposeBlockSizes


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Static knobs of the Pallas backward (SparseFFNConfig.backward)."""

    # Keep the forward's TwELL pattern for the backward (`Kept`: uint8 offsets, int16 counts, a
    # and u in rank order [M, W], the transpose's first pass) instead of re-running the gate GEMM +
    # pack in the backward, and computing u again in the token-major kernel. Recomputing saves a
    # few MiB of the block's temporaries and costs about a pack per fwd+bwd (the `pallas` and
    # `pallas_recompute` columns of experiments/bench_ffn_train.py).
    keep_gate_pattern: bool = True
    # Token-tail rows (an overflowing tile or > ell_width actives) per dense block: the tail runs
    # ceil(rows / chunk) blocks of [chunk, H] (a tail of at most small_tail_chunk rows: one small
    # block; tail_block_sizes: 16, 64, 256, 512, 1024). Each block reads the three weights and updates
    # the f32 weight-gradient accumulators whole, so large tails want large blocks: on a trained
    # 0.5b (H100, BENCHMARKS.md) tails of several hundred to about two thousand rows ran faster in
    # 1024-row blocks than in 256- or 512-row ones; tails of 100-240 rows (one 256-row block
    # either way) were unchanged.
    token_tail_chunk: int = 1024
    # Hot neurons per dense block of the neuron tail ([M, chunk] columns by GEMMs with x and gy).
    # 256: each block reads x and gy whole, so larger blocks read them fewer times (a trained 0.5b
    # on the H100, 118-243 hot neurons: faster than with 64; BENCHMARKS.md).
    neuron_tail_chunk: int = 256
    # The smallest dense block of a tail. A tail of n rows (neurons) runs as ONE block of the
    # smallest of small_tail_chunk, x4, x16, ..., chunk / 2 (below the tail's chunk) that holds
    # n, or in blocks of token_tail_chunk / neuron_tail_chunk (tail_block_sizes): the first
    # tokens of 8 sequences or one hot neuron cost a [16, .] block, not a [256, .] one (a
    # 256-neuron block was slow for one hot neuron on the H100). The size is picked on the
    # device from the count.
    small_tail_chunk: int = 16
    # Rows per block of the dense backward that the op runs instead of the kernels (a tail over its
    # capacity, or a non-finite input): `blocked_dense_backward`, [rows, H] temporaries at a time.
    # The one-shot dense backward's [M, H] temporaries (about 1 GB at M 16384, H 5632) were the
    # largest buffers of the sparse program although that branch seldom runs: XLA reserves memory
    # for every branch of a conditional.
    dense_block_rows: int = 2048
    # Block sizes of the token-major kernel (pallas_kernels.twell_bwd_token).
    token_block_sizes: TokenBwdBlockSizes = TokenBwdBlockSizes()
    # Block sizes of the neuron-major kernel (pallas_kernels.twell_bwd_neuron).
    neuron_block_sizes: NeuronBwdBlockSizes = NeuronBwdBlockSizes()
    # Block sizes of the counting-sort transpose (pallas_kernels.twell_transpose).
    transpose_block_sizes: TransposeBlockSizes = TransposeBlockSizes()
    # Block sizes of the kernel that lists each token's entries (pallas_kernels.twell_bwd_token).
    lists_block_sizes: ListsBlockSizes = ListsBlockSizes()

    def __post_init__(self) -> None:
        if not isinstance(self.keep_gate_pattern, bool):
            raise ValueError(f"BackwardConfig.keep_gate_pattern must be a bool, got {self.keep_gate_pattern!r}")
        for name in ("token_tail_chunk", "neuron_tail_chunk", "small_tail_chunk", "dense_block_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BackwardConfig.{name} must be an int >= 1, got {value!r}")
        for name, expected in (("token_block_sizes", TokenBwdBlockSizes), ("neuron_block_sizes", NeuronBwdBlockSizes),
                               ("lists_block_sizes", ListsBlockSizes), ("transpose_block_sizes", TransposeBlockSizes)):
            value = getattr(self, name)
            if not isinstance(value, expected):
                raise ValueError(f"BackwardConfig.{name} must be a {expected.__name__}, got {type(value).__name__}")
