"""twell-jax: activation-sparse transformer FFNs in JAX (TwELL, fused sparse FFN, hybrid training)."""
from pathlib import Path as _Path

__version__ = "0.1.0"

# The Pallas kernels and the presets live in the repository's top-level folders `pallas_kernels/`
# and `configs/`, and install as `twell_jax.pallas_kernels` and `twell_jax.configs` (pyproject.toml's
# package-dir), so that no top-level package of those common names is installed. In a source
# checkout (imported from the repository, not from a wheel) the repository root joins this
# package's search path, so the same names import the same folders there.
_ROOT = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "pallas_kernels").is_dir() and (_ROOT / "pallas_kernels" / "__init__.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)
