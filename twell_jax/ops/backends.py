"""The registry of the op's implementations (the anchor: tokamax's `implementation=`).

Each implementation is one `Implementation` object: its forward, its backward, where it runs and
its cost for a shape and hints. The planner (`planner.Plan`) names them; `dispatch` looks them up
here and calls them, with no switch on their names. The built-in ones live beside their code:

    "dense"      dense.DENSE          the dense formula; as a backend it runs outside the custom_vjp
                                      (plain autodiff), as a plan's piece inside it
    "reference"  reference.REFERENCE  the sparse algorithm in pure JAX (the kernels' oracle)
    "pallas"     pallas.PALLAS        the Pallas kernels, forward and backward (GPU or interpret)
    "decode"     pallas.DECODE        the decode-size forward (only "auto" plans it)

Adding a backend: write its file with one `Implementation` and `register` it (one line below for
a built-in one); `gated_ffn(..., backend=name)` then runs it through the op's custom_vjp, NaN
policy and shard_map (tests/test_backends.py registers a toy one).
"""
from __future__ import annotations

from twell_jax.ops.implementation import Implementation

_REGISTRY: dict[str, Implementation] = {}


def register(implementation: Implementation) -> Implementation:
    """Add an implementation (its name must be new); returns it."""
    if not isinstance(implementation, Implementation):
        raise ValueError(f"register needs an Implementation, got {type(implementation).__name__}")
    if implementation.name == "auto":
        raise ValueError("an implementation cannot be named 'auto': backend='auto' is the planner")
    if implementation.name in _REGISTRY:
        raise ValueError(f"an implementation named {implementation.name!r} is already registered")
    _REGISTRY[implementation.name] = implementation
    return implementation


def unregister(name: str) -> None:
    """Remove a registered implementation (tests)."""
    _REGISTRY.pop(name)


def get(name: str) -> Implementation:
    return _REGISTRY[name]


def backend_names() -> tuple[str, ...]:
    """The values gated_ffn's `backend=` takes: the selectable implementations, then "auto"."""
    return (*(name for name, impl in _REGISTRY.items() if impl.selectable), "auto")


def gpu_available() -> bool:
    """The Pallas kernels can run without the interpreter (`pallas_forward.available`); False when
    they cannot even be imported (a jax build without Triton-backed Pallas)."""
    try:
        from twell_jax.ops import pallas_forward
    except ImportError:
        return False
    return pallas_forward.available()


def _register_builtins() -> None:
    from twell_jax.ops.dense import DENSE
    from twell_jax.ops.pallas import DECODE, PALLAS
    from twell_jax.ops.reference import REFERENCE

    for implementation in (DENSE, REFERENCE, PALLAS, DECODE):  # one line per built-in backend
        register(implementation)


_register_builtins()
