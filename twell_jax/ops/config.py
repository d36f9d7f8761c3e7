"""SparseFFNConfig (the static knobs of the sparse backends) and the op's typed interface:
the aux keys and the (x, weights) -> (y, aux) value types shared by every file of the op."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:  # annotations only: the kernels are imported lazily (Triton-backed Pallas)
    from twell_jax.pallas_kernels.twell_decode import DecodeBlockSizes
    from twell_jax.pallas_kernels.twell_ffn import FFNBlockSizes
    from twell_jax.pallas_kernels.twell_pack import PackBlockSizes
    from twell_jax.ops.pallas_config import BackwardConfig

AUX_KEYS = ("l1", "l0", "tile_overflow", "row_overflow", "dense_fallback", "backward_tail_rows",
            "backward_hot_neurons")
COUNT_KEYS = ("neuron_active_count", "token_active_count")  # added when config.neuron_counts
# SparseFFNConfig's hints of the sparse backward's dense tails (shares), in this order, and the keys
# of their telemetry (`backward_tail_shares`) in the same order.
TAIL_HINT_FIELDS = ("expected_token_tail", "expected_hot_neurons", "expected_hot_entries")
TAIL_SHARE_KEYS = ("token_tail_share", "hot_neuron_share", "hot_entry_share")

# The smallest entry count that makes a neuron hot when SparseFFNConfig.transpose_ell_width is a
# fraction of the tokens.
HOT_THRESHOLD_FLOOR = 32

Aux = dict[str, jax.Array]
Weights = tuple[jax.Array, ...]


def _check_capacity_spec(name: str, value: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an int (rows) or a float fraction in [0, 1], got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} as a row count must be >= 0, got {value}")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} as a fraction must be in [0, 1], got {value}")


def _resolve_capacity(spec: int | float, n: int) -> int:
    """Rows of capacity for a spec that is a row count (int) or a fraction of n (float)."""
    return min(n, spec) if isinstance(spec, int) else min(n, math.ceil(spec * n))


# SparseFFNConfig.pack_backend's values.
PACK_BACKENDS = ("auto", "triton", "mosaic")

# SparseFFNConfig's fields typed by the kernels' own dataclasses (checked by _check_kernel_configs).
_KERNEL_CONFIG_FIELDS = ("pack_block_sizes", "ffn_block_sizes", "decode_block_sizes", "backward")


def _check_kernel_configs(config: "SparseFFNConfig") -> None:
    # Imported only here (leaf modules), when such a field is set: they load Triton-backed Pallas.
    from twell_jax.pallas_kernels.twell_decode import DecodeBlockSizes
    from twell_jax.pallas_kernels.twell_ffn import FFNBlockSizes
    from twell_jax.pallas_kernels.twell_pack import PackBlockSizes
    from twell_jax.ops.pallas_config import BackwardConfig

    for name, expected in zip(_KERNEL_CONFIG_FIELDS, (PackBlockSizes, FFNBlockSizes, DecodeBlockSizes,
                                                     BackwardConfig)):
        value = getattr(config, name)
        if value is not None and not isinstance(value, expected):
            raise ValueError(f"SparseFFNConfig.{name} must be None or a {expected.__module__}."
                             f"{expected.__name__}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SparseFFNConfig:
    """Static knobs of the sparse backends (hashable: it is a jit static argument)."""

    # TwELL tile width T: hidden columns per tile (the N extent of the gate GEMM tile).
    tile: int = 256
    # TwELL slots S stored per (token, tile); a tile with more actives overflows (handled exactly).
    slots: int = 32
    # ELL width W of the token-major hybrid: tokens with more actives go to the dense tail.
    ell_width: int = 128
    # Dense tail capacity of the token-major hybrid: int = rows, float = fraction of the tokens.
    tail_rows: int | float = 0.125
    # ELL width of the neuron-major (transposed) hybrids of the backward: tokens per neuron; a
    # neuron with more goes to the dense neuron tail ("hot"). int = tokens, float = a fraction of
    # the call's tokens M, at least HOT_THRESHOLD_FLOOR (`hot_threshold`). 1/64: 256 at M 16384,
    # where a hot neuron's dense columns cost about what its ~256 entries cost in the kernels'
    # row gathers (H100); both scale with M, so the threshold does (an absolute 256 sent nearly
    # every neuron of a uniform k 29 pattern to the dense tail at M 65536, BENCHMARKS.md). The
    # floor keeps small calls (M <= 2048) free of hot neurons that a handful of tokens would make.
    transpose_ell_width: int | float = 1 / 64
    # Tail capacity of the transposed hybrids: int = rows, float = fraction of the neurons H.
    transpose_tail_rows: int | float = 0.25
    # Mesh axes that split the tokens: the sparse backends shard_map over those of them the current
    # mesh has (with size > 1). A name or a tuple of names; None = never. The default names the
    # trainer's two axes (twell_jax/training/parallel.py: replicas "data" x FSDP group "fsdp", the batch
    # split over both), so a plain 1-D "data" mesh is covered too.
    data_axis: str | tuple[str, ...] | None = ("data", "fsdp")
    # Pallas: rows with tile overflow recomputed in a fixed block (None = the backend's default,
    # M // 64 rows, at least 16); a call with more such rows uses a second, larger block
    # (overflow_rows_wide; None = M // 8 rows) and past that the whole call is recomputed densely.
    overflow_rows: int | None = None
    overflow_rows_wide: int | None = None
    # Pallas "auto" without a hint: tokens sampled on the device to estimate the active count
    # (None = the backend's default, 32 tokens).
    auto_sample_rows: int | None = None
    # Pallas "auto": mean actives per token above which the forward runs dense (None = the per-shape
    # crossover of the forward's cost model, planner.crossover_active_per_token). The op
    # reads it only without a hint (expected_active_per_token None), against the sampled count;
    # with a hint its plan comes from planner.choose_training_path and
    # planner.prefer_decode_path. (pallas_forward's auto_* entries compare a hint with it.)
    auto_max_active: float | None = None
    # Pallas "auto": expected mean actives per token (e.g. the L0 telemetry of training). When set,
    # "auto" decides dense vs sparse at trace time for free, instead of sampling on the device.
    expected_active_per_token: float | None = None
    # Pallas "auto" with a hint: the layer's expected dense tails of the sparse backward, as shares
    # (None = none: a uniform pattern). expected_token_tail: of the call's tokens, those with more
    # than ell_width actives (dense first tokens); expected_hot_neurons: of the neurons, those over
    # hot_threshold(M); expected_hot_entries: of the active entries, those the hot neurons hold
    # (the kernels skip them). The trainer fills them from its telemetry (`backward_tail_shares`)
    # so that planner.choose_training_path prices the tails (the backward's cost model).
    expected_token_tail: float | None = None
    expected_hot_neurons: float | None = None
    expected_hot_entries: float | None = None
    # Pallas: block sizes of the pack kernel (None = the kernel's defaults).
    pack_block_sizes: PackBlockSizes | None = None
    # Pallas: the gate GEMM + TwELL pack's GPU backend (the same outputs bit for bit): "triton"
    # (pallas_kernels/twell_pack.py), "mosaic" (Pallas Mosaic GPU, Hopper, 16-bit activations, tile
    # 256: pallas_kernels/twell_pack_mgpu.py) or "auto" (mosaic where it runs and was measured
    # faster, else triton: pallas_forward.resolve_pack_backend).
    pack_backend: str = "auto"
    # Pallas: block sizes of the fused FFN kernel (None = the kernel's defaults).
    ffn_block_sizes: FFNBlockSizes | None = None
    # Pallas decode path (pallas_decode): static length of the list of active neurons of a call; a
    # call with more active neurons runs the exact dense formula (dense_fallback = 1). None = every
    # neuron for the Triton kernels (they skip the unused part at run time), min(H, max(64, 2 M k))
    # for the "xla" implementation (k = expected_active_per_token, 32 when unset).
    decode_capacity: int | None = None
    # Pallas: block sizes of the decode kernels (None = the kernel's defaults).
    decode_block_sizes: DecodeBlockSizes | None = None
    # Add the per-neuron and per-token active counts to aux (COUNT_KEYS), computed from the
    # pattern the op builds anyway, so telemetry needs no second gate GEMM.
    neuron_counts: bool = False
    # The NaN policy (docs/format.md): every sparse call checks x and the weights for NaN/Inf (one
    # pass over them, on the device) and then runs the exact dense formula, so non-finite values
    # propagate as in dense. False skips that pass: the sparse paths then read only the rows of
    # active neurons, and a non-finite value elsewhere does not reach y. For decoding with weights
    # verified finite once (`inference.load_run` does), where the pass costs more than the FFN.
    check_finite: bool = True
    # Pallas "auto" with a hint, a layer it plans dense in both directions: False = the plain dense
    # backend (autodiff keeps the FFN's [M, H] pre-activations: the fastest); True = the dense
    # formula inside the op's custom_vjp, which keeps x only and recomputes them in the backward
    # (2 more GEMMs gated; the [M, H] pre-activations less memory per such layer), like the
    # sparse plans, which keep no [M, H] tensor either.
    auto_dense_recompute: bool = False
    # Pallas "auto" with a hint: no gradient is taken through the call (inference, evaluation:
    # `inference.load_run` sets it), so the plan prices the forward alone (pack + fused FFN against
    # the dense forward, with the training plans' margin: `planner.choose_forward_path`) instead of
    # the training plan's forward + backward, which at a few thousand tokens keeps layers dense
    # that the forward alone would run sparse. A gradient through such a call stays exact (the
    # sparse forward's backward is then the dense formula).
    forward_only: bool = False
    # Pallas backward knobs (None = pallas_config.BackwardConfig's defaults).
    backward: BackwardConfig | None = None

    def __post_init__(self) -> None:
        for name in ("tile", "slots", "ell_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseFFNConfig.{name} must be an int >= 1, got {value!r}")
        width = self.transpose_ell_width
        if (isinstance(width, bool) or not isinstance(width, (int, float))
                or (isinstance(width, int) and width < 1)
                or (isinstance(width, float) and not 0.0 < width <= 1.0)):
            raise ValueError("SparseFFNConfig.transpose_ell_width must be an int >= 1 (tokens) or a float "
                             f"in (0, 1] (a fraction of the tokens), got {width!r}")
        if self.slots > self.tile:
            raise ValueError(f"SparseFFNConfig.slots ({self.slots}) must be <= tile ({self.tile})")
        if self.pack_backend not in PACK_BACKENDS:
            raise ValueError(f"SparseFFNConfig.pack_backend must be one of {', '.join(PACK_BACKENDS)}, "
                             f"got {self.pack_backend!r}")
        _check_capacity_spec("SparseFFNConfig.tail_rows", self.tail_rows)
        _check_capacity_spec("SparseFFNConfig.transpose_tail_rows", self.transpose_tail_rows)
        if any(getattr(self, name) is not None for name in _KERNEL_CONFIG_FIELDS):
            _check_kernel_configs(self)
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"SparseFFNConfig.check_finite must be a bool, got {self.check_finite!r}")
        if not isinstance(self.forward_only, bool):
            raise ValueError(f"SparseFFNConfig.forward_only must be a bool, got {self.forward_only!r}")
        if not isinstance(self.auto_dense_recompute, bool):
            raise ValueError(f"SparseFFNConfig.auto_dense_recompute must be a bool, got {self.auto_dense_recompute!r}")
        if not isinstance(self.neuron_counts, bool):
            raise ValueError(f"SparseFFNConfig.neuron_counts must be a bool, got {self.neuron_counts!r}")
        if isinstance(self.data_axis, list):  # from JSON (model.ffn_op_config): a tuple keeps the config hashable
            object.__setattr__(self, "data_axis", tuple(self.data_axis))
        axes = self.data_axis
        names = (axes,) if isinstance(axes, str) else axes
        if axes is not None and not (isinstance(names, tuple) and names and len(set(names)) == len(names)
                                     and all(isinstance(a, str) for a in names)):
            raise ValueError(f"SparseFFNConfig.data_axis must be a mesh axis name, a tuple of distinct names or None, "
                             f"got {self.data_axis!r}")
        for name in ("overflow_rows", "overflow_rows_wide", "auto_sample_rows", "decode_capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"SparseFFNConfig.{name} must be None or an int >= 1, got {value!r}")
        if self.overflow_rows and self.overflow_rows_wide and self.overflow_rows_wide < self.overflow_rows:
            raise ValueError(f"SparseFFNConfig.overflow_rows_wide ({self.overflow_rows_wide}) must be >= "
                             f"overflow_rows ({self.overflow_rows}): it is the second, larger block")
        if self.auto_max_active is not None and (
                isinstance(self.auto_max_active, bool) or not isinstance(self.auto_max_active, (int, float))
                or not self.auto_max_active >= 0):
            raise ValueError(f"SparseFFNConfig.auto_max_active must be None or >= 0, got {self.auto_max_active!r}")
        for name in TAIL_HINT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0.0 <= value <= 1.0):
                raise ValueError(f"SparseFFNConfig.{name} must be None or a share in [0, 1], got {value!r}")
        expected = self.expected_active_per_token
        if expected is not None and (isinstance(expected, bool) or not isinstance(expected, (int, float))
                                     or not expected >= 0):
            raise ValueError("SparseFFNConfig.expected_active_per_token must be None or a number >= 0, "
                             f"got {expected!r}")

    @property
    def data_axes(self) -> tuple[str, ...]:
        """`data_axis` as a tuple of names (() for None)."""
        axes = self.data_axis
        return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)

    @property
    def keeps_gate_pattern(self) -> bool:
        """Whether the Pallas training forward keeps its TwELL pack for the backward
        (`backward.keep_gate_pattern`; without a BackwardConfig, its default: True)."""
        return True if self.backward is None else self.backward.keep_gate_pattern

    def tail_capacity(self, n_tokens: int) -> int:
        """Tail rows of the token-major hybrid for a call with n_tokens tokens."""
        return _resolve_capacity(self.tail_rows, n_tokens)

    def hot_threshold(self, n_tokens: int) -> int:
        """Entries above which a neuron is hot (the neuron-major ELL width) in a call with
        n_tokens tokens: transpose_ell_width, or that fraction of n_tokens rounded up and at least
        HOT_THRESHOLD_FLOOR."""
        width = self.transpose_ell_width
        return width if isinstance(width, int) else max(HOT_THRESHOLD_FLOOR, math.ceil(width * n_tokens))

    def transpose_tail_capacity(self, n_neurons: int) -> int:
        """Tail rows of the neuron-major hybrids for a layer with n_neurons neurons."""
        return _resolve_capacity(self.transpose_tail_rows, n_neurons)
