"""Pallas (Triton backend) GPU kernels of twell-jax, each with a pure-jnp reference beside it.

twell_pack: gate GEMM + ReLU + TwELL pack in the epilogue. twell_ffn: fused sparse FFN from the
packed gate. twell_decode: decode-size FFN over the union of a call's active neurons (compaction,
hidden, down). twell_bwd_token: token-major backward (dx and per-entry values). twell_bwd_neuron:
neuron-major weight gradients. common: integer helpers of the launchers. Every kernel also runs on
CPU with interpret=True (tests). The kernels know nothing of twell_jax: the glue is twell_jax/ops/."""
