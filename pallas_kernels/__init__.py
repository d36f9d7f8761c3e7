"""Pallas (Triton backend) GPU kernels of twell-jax, each with a pure-jnp reference beside it.

twell_pack: gate GEMM + ReLU + TwELL pack in the epilogue. twell_ffn: fused sparse FFN from the
packed gate. Both run on CPU with interpret=True (tests)."""
