"""twell-jax: activation-sparse transformer FFNs in JAX (TwELL, fused sparse FFN, hybrid training)."""

__version__ = "0.1.0"
