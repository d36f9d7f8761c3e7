"""Small integer helpers shared by the kernels' block-size dataclasses and launchers."""
from __future__ import annotations


def is_pow2(n: int) -> bool:
    """True for 1, 2, 4, 8, ... (Triton block extents must be powers of two)."""
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
