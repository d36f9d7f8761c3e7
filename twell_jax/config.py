"""Typed experiment configuration: frozen dataclasses, invariants checked at construction.

`ExperimentConfig` groups the model, optimiser, sparsity, training and data sections. Every field has
a comment; `__post_init__` rejects bad values with a ValueError naming the field. Named presets live
in `configs/` (`configs.get_config("tiny")`); the CLI applies dotted overrides on top of a preset with
`apply_overrides(cfg, ["model.n_layers=4", "train.steps=100"])`, parsing each value by the field's
declared type. `to_dict` / `from_dict` round-trip a config through JSON (checkpoints store it);
`from_dict` checks each value against its field's declared type, naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal

from twell_jax.ops import backends as op_backends  # the op registry, asked when a config is checked
from twell_jax.ops import planner as ops_planner  # position buckets of model.ffn_active_by_position

DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
# How a one-token decode step runs (decode.kernels; twell_jax/inference/decode_engine.py).
DECODE_KERNELS: dict[str, str] = {
    "auto": "the Pallas decode kernels where they can run (a GPU), else XLA",
    "pallas": "the Pallas decode kernels (a GPU, or model.ffn_interpret=true for the interpreter)",
    "xla": "the model's generic XLA path (the layer scan's decode, `Transformer.decode`)",
}
# How a sparse layer's FFN runs in the decode kernels' step (decode.sparse_ffn), after the gate's
# product (pallas_kernels/twell_decode.py, decode_matvec.py). The row bounds and limits each way
# names are constants of twell_jax/inference/decode_plan.py and ops/planner.py, stated there only.
DECODE_SPARSE_FFN: dict[str, str] = {
    "auto": "per sparse layer: at up to decode_plan.PACKED_MAX_ROWS rows 'packed_down' (up to "
            "decode_plan.PACKED_DOWN_MAX_ROWS rows) or 'packed' (at more than one row only where the union "
            "expected from the layer's activity hint is within packed's limit, else the dense products); at "
            "more rows one launch walking the active neurons where that expected union is small "
            "(ops.planner.decode_sparse_way): 'tiles' where the gate's program holds every row, else 'fused'; "
            "else 'split'",
    "tiles": "the gate's product packs each column tile's active neurons in its epilogue (TwELL) and one "
             "launch reads those lists for the up and down products, the residual in its epilogue: two launches "
             "a layer after the norm, no compaction (a step of more rows than the gate's max_block_m runs "
             "'fused')",
    "packed": "as 'tiles', and the gate's launch (the norm in its prologue) also computes each listed neuron's "
              "hidden value (the up product of the tile's active neurons only) and packs it beside the id (TwELL "
              "values and indices); one launch reads them for the down product, the residual in its epilogue: two "
              "launches a layer, no norm launch (more rows than the gate's max_block_m: 'fused')",
    "packed_down": "as 'packed', and the gate's launch also makes the down product and the residual: "
                   "each column tile adds its active neurons' W_down rows into an fp32 partial of its own, and after "
                   "a grid barrier each program sums every tile's partials for a block of the output, in one fixed "
                   "order: one launch a layer, deterministic (a second launch sums them where the GPU cannot hold "
                   "every program at once, and in interpret mode); with several rows the device switch of "
                   "'packed' (more rows than the gate's max_block_m: 'fused')",
    "fused": "the active neurons compacted into one list (one launch), then one launch: each output block "
             "recomputes the active neurons' hidden values, the residual added in its epilogue",
    "split": "the compaction, then two launches: the active neurons' hidden values into HBM, then the down "
             "product; the residual added by XLA",
}
# Generation's decode steps per program call (twell_jax/inference/generate.py, `Generator.chunk`;
# `twell generate --decode-chunk`): tokens reach the host, and a stream, this many at a time, and the
# host's per-call cost is paid once per chunk rather than once per token.
DEFAULT_DECODE_CHUNK = 16
# How the layer stack runs layers whose sparse-op plans differ (model.layer_scan); twell_jax/model.py
# implements them and docs/model.md says how they were chosen.
LAYER_SCANS: dict[str, str] = {
    "groups": "consecutive layers with the same plan form one lax.scan each (one scan when all agree)",
    "switch": "one lax.scan over every layer; a lax.switch on the layer's plan inside its body",
}
# DataConfig.source value of the deterministic random-token source.
SYNTHETIC_SOURCE = "synthetic"
# Backslash escapes a string field may use on the command line (`decode_escapes`).
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
# Rematerialisation policies of the model (model.remat) and what each keeps for the backward (the
# rest is recomputed from the block input); twell_jax/model.py implements them.
REMAT_POLICIES: dict[str, str] = {
    "none": "keep every activation (fastest, most memory)",
    "full": "recompute each block from its input (least memory, ~1/3 more FLOPs)",
    "dots": "keep the matmul outputs of each block, recompute the elementwise work",
    "ffn": "recompute the FFN sub-block (its [tokens, d_ff] activations are the largest); the "
           "sparse op's kinds keep only (x, weights) anyway",
}
# A byte-level BPE needs the 256 byte tokens plus the end-of-text token.
MIN_BPE_VOCAB_SIZE = 257


@dataclass(frozen=True)
class FFNKind:
    """What an FFN kind means; every module asks this table instead of comparing kind names."""

    name: str
    gated: bool  # three matrices (w_gate, w_up, w_down); False: two (w_up, w_down)
    relu: bool  # exactly sparse ReLU activations: L0 / dead-neuron telemetry is meaningful
    sparse_op: bool  # runs the sparse op with model.ffn_backend; False: a dense baseline
    l1: bool  # trained with the L1 penalty (dense baselines are trained without it)
    # The hidden activation, as `ops.dense_ffn` and Hugging Face's `hidden_act` name it: "relu" runs
    # through the op (`ops.gated_ffn` / `ops.ffn`, whose kernels are ReLU's), "silu" the dense formula.
    activation: str = "relu"

    @property
    def gate_weight(self) -> str:
        """The weight whose rows decide whether a neuron fires (re-initialised when dead)."""
        return "w_gate" if self.gated else "w_up"

    def backend(self, ffn_backend: str) -> str:
        """The op backend this kind runs with, given model.ffn_backend."""
        return ffn_backend if self.sparse_op else "dense"

    @property
    def through_op(self) -> bool:
        """Whether the FFN runs through the op (ReLU activations, any backend); False: the dense
        formula `ops.dense_ffn` with `activation`, which never enters the op or its plans."""
        return self.activation == "relu"


FFN_KIND_TABLE: dict[str, FFNKind] = {
    # Dense silu-gated baseline (activations never exactly zero).
    "swiglu": FFNKind("swiglu", gated=True, relu=False, sparse_op=False, l1=False, activation="silu"),
    # Dense relu-gated baseline: the paper's dense twin, trained without L1.
    "relu_gated": FFNKind("relu_gated", gated=True, relu=True, sparse_op=False, l1=False),
    # The sparse model: relu-gated through the sparse op, trained with L1.
    "twell": FFNKind("twell", gated=True, relu=True, sparse_op=True, l1=True),
    # Non-gated relu FFN through the sparse op, trained with L1.
    "relu": FFNKind("relu", gated=False, relu=True, sparse_op=True, l1=True),
}
FFN_KINDS = tuple(FFN_KIND_TABLE)


def ffn_kinds_with(activation: str, *, gated: bool = True) -> tuple[str, ...]:
    """The FFN kinds (in table order) whose weights are those of a checkpoint with this activation
    and gating: the kinds such weights load as (Hugging Face import, `--init-from`)."""
    return tuple(name for name, kind in FFN_KIND_TABLE.items()
                 if kind.activation == activation and kind.gated == gated)


# RoPE scalings model.rope_scaling may name (its "rope_type"), and their fields besides it.
ROPE_SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (model.rope_scaling, rope_type "llama3"), hashable: the
    model keeps it as a static attribute. Frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those below
    original_max_position_embeddings / high_freq_factor kept, those between interpolated
    (`model.rope_frequencies`)."""

    factor: float  # how much longer the context is than the original one (8 in Llama 3.1)
    low_freq_factor: float  # wavelengths above original / low_freq_factor are scaled fully (1)
    high_freq_factor: float  # wavelengths below original / high_freq_factor are kept (4)
    original_max_position_embeddings: int  # the context the model was pre-trained at (8192)

    @classmethod
    def from_dict(cls, values: Any, where: str = "model.rope_scaling") -> "RopeScaling":
        """The scaling of a model.rope_scaling dict; a ValueError naming the field otherwise."""
        if not isinstance(values, dict):
            raise ValueError(f"{where} must be a JSON object (or None), got {type(values).__name__}")
        kind = values.get("rope_type")
        if kind not in ROPE_SCALING_FIELDS:
            raise ValueError(f"{where}.rope_type must be one of {tuple(ROPE_SCALING_FIELDS)}, got {kind!r}")
        fields = ROPE_SCALING_FIELDS[kind]
        unknown = sorted(set(values) - set(fields) - {"rope_type"})
        missing = [name for name in fields if name not in values]
        if unknown or missing:
            raise ValueError(f"{where} of rope_type {kind!r} takes exactly {', '.join(fields)}; "
                             + (f"unknown: {', '.join(unknown)}" if unknown else f"missing: {', '.join(missing)}"))
        for name in fields:
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{where}.{name} must be a finite number > 0, got {value!r}")
        original = values["original_max_position_embeddings"]
        if isinstance(original, float) and not original.is_integer():
            raise ValueError(f"{where}.original_max_position_embeddings must be an int, got {original!r}")
        if values["factor"] < 1:
            raise ValueError(f"{where}.factor must be >= 1 (a longer context than the original), got "
                             f"{values['factor']!r}")
        if not values["high_freq_factor"] > values["low_freq_factor"]:
            raise ValueError(f"{where}.high_freq_factor={values['high_freq_factor']!r} must exceed "
                             f"low_freq_factor={values['low_freq_factor']!r} (the band between them is interpolated)")
        return cls(float(values["factor"]), float(values["low_freq_factor"]), float(values["high_freq_factor"]),
                   int(original))

    def to_dict(self) -> dict[str, Any]:
        """The model.rope_scaling dict of this scaling (Hugging Face's names)."""
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


def _check_positive(section: str, **values: int | float) -> None:
    """Each named value is > 0 (the error names `section.name`)."""
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


def _check_non_negative(section: str, **values: int | float) -> None:
    """Each named value is >= 0 (the error names `section.name`)."""
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{section}.{name} must be >= 0, got {value!r}")


def _check_finite(section: str, obj: Any) -> None:
    """Every float field of the config dataclass `obj` is a finite number (nan/inf pass `> 0` checks)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{f.name} must be a finite number, got {value!r}")


def _check_choice(section: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name} must be one of {choices}, got {value!r}")


def decode_escapes(text: str, where: str) -> str:
    """`text` with the backslash escapes \\n \\t \\r \\\\ decoded (so a command line can express a
    newline); any other backslash sequence is an error naming `where`."""
    out, index = [], 0
    while index < len(text):
        char = text[index]
        if char != "\\":
            out.append(char)
            index += 1
            continue
        escape = text[index + 1:index + 2]
        if escape not in _ESCAPES:
            raise ValueError(f"{where}={text!r}: unknown escape '\\{escape}' at position {index}; "
                             "use \\n (newline), \\t (tab), \\r or \\\\ (a backslash)")
        out.append(_ESCAPES[escape])
        index += 2
    return "".join(out)


@dataclass(frozen=True)
class ModelConfig:
    """Llama-style decoder: RMSNorm, RoPE (optionally Llama-3 scaled), causal multi-head or
    grouped-query attention, tied or untied output head, configurable FFN."""

    vocab_size: int = 4096  # token vocabulary; must be >= the tokenizer's (checked against the data)
    d_model: int = 128  # residual stream width D
    n_layers: int = 4  # number of transformer blocks
    n_heads: int = 4  # attention (query) heads; d_model % n_heads == 0
    # Key/value heads: None = n_heads (multi-head attention); fewer = grouped-query attention, each
    # KV head serving n_heads / n_kv_heads consecutive query heads (Llama 3, Mistral); must divide n_heads.
    n_kv_heads: int | None = None
    d_ff: int = 512  # FFN hidden width H
    max_seq_len: int = 128  # longest sequence the model accepts (RoPE tables are computed on the fly)
    rope_theta: float = 100_000.0  # RoPE base frequency (paper: 1e5, non-interleaved halves)
    # RoPE frequency scaling: None = plain RoPE; {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} = Llama 3.1's (RopeScaling; Hugging Face's
    # config.json field of that name).
    rope_scaling: dict[str, Any] | None = None
    # The output head: True = the token embedding's transpose (tied); False = its own [V, D] matrix
    # `lm_head` (Llama 3 8B, Mistral).
    tie_embeddings: bool = True
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init of every matrix and the embedding
    # FFN kind: "swiglu" dense silu-gated baseline; "relu_gated" dense relu-gated baseline (the
    # paper's dense twin, trained without L1); "twell" relu-gated through the sparse op (any
    # backend, trained with L1); "relu" non-gated relu FFN through the sparse op.
    ffn_kind: Literal["swiglu", "relu_gated", "twell", "relu"] = "twell"
    # Backend of the sparse op for "twell"/"relu": "dense" | "reference" | "pallas" | "auto"
    # ("relu_gated" always uses "dense": it is the dense baseline).
    ffn_backend: str = "auto"
    # Field overrides of the op's SparseFFNConfig (e.g. {"slots": 32}); empty = op defaults.
    ffn_op_config: dict[str, Any] = field(default_factory=dict)
    ffn_interpret: bool = False  # run the "pallas" backend's kernels in the Pallas interpreter (CPU tests)
    # Per-layer expected mean active FFN neurons per token, given to the op's "auto" backend as
    # `expected_active_per_token`, so that it picks dense or sparse at trace time instead of
    # sampling on the device (speed only, never results). Empty = sample. `twell eval` fills it
    # from the run's own telemetry; a value in ffn_op_config applies to every layer and wins.
    ffn_expected_active: tuple[float, ...] = ()
    # Per-layer expected dense tails of the sparse backward, (token tail, hot neurons, hot entries)
    # shares in [0, 1], given to the op as its tail hints (SparseFFNConfig.expected_token_tail,
    # expected_hot_neurons, expected_hot_entries) so that training "auto" prices them. Empty = no
    # tails assumed. The trainer fills it from its telemetry (`ops.backward_tail_shares`).
    ffn_expected_tails: tuple[tuple[float, float, float], ...] = ()
    # Per layer, the mean active FFN neurons per token by position bucket (`ops.planner.position_buckets`
    # of max_seq_len: position 0, 1, [2, 4), [4, 8), ...): the first positions fire far more than the
    # rest, so rows of a few hundred tokens are denser than rows of max_seq_len. When set (and no
    # hint in ffn_op_config), a forward over rows of S tokens gives "auto" the mean over positions
    # [0, S) instead of `ffn_expected_active`. `inference.load_run` fills it from the run's
    # validation profile (the trainer logs `val_active_by_position`); empty = by length alone.
    ffn_active_by_position: tuple[tuple[float, ...], ...] = ()
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"  # activations/matmuls (master params f32)
    # Rematerialisation in the backward: "none" (keep every activation: fastest, most memory),
    # "full" (recompute each block from its input), "dots" (keep the matmul outputs, recompute the
    # rest), "ffn" (recompute the FFN sub-block only). A bool from an old config means
    # True -> "full", False -> "none".
    remat: Literal["none", "full", "dots", "ffn"] | bool = "none"
    # Attention: "auto" = cuDNN flash attention on NVIDIA GPUs when it takes the shape (else XLA,
    # with one logged warning naming the shape), XLA elsewhere; "cudnn" = cuDNN or an error; "xla".
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    # The blocks' parameters are stacked over layers ([L, ...]) and run as a lax.scan, so compile
    # time is flat in depth. Layers whose op plans differ (backend "auto" with per-layer hints):
    # "groups" = one scan per run of consecutive layers with the same plan; "switch" = one scan
    # with a lax.switch over the distinct plans (LAYER_SCANS).
    layer_scan: Literal["groups", "switch"] = "groups"
    # Layers per iteration of the layer scan's loop (lax.scan's `unroll`): 1 = a loop over layers
    # (compile time flat in depth); n > 1 = n layers per iteration; 0 = all (no loop: compile time
    # grows with depth again, as for an unrolled model); "auto" (`layers_per_iteration`): 0 where
    # the FFN runs no sparse-op kernel (a dense kind, or backend "dense"), 1 otherwise. The loop
    # copies each layer's saved values in and out of stacked buffers (docs/model.md, "The loop").
    layer_unroll: int | Literal["auto"] = "auto"
    def __post_init__(self) -> None:
        _check_finite("model", self)
        _check_positive("model", vocab_size=self.vocab_size, d_model=self.d_model,
                        n_layers=self.n_layers, n_heads=self.n_heads, d_ff=self.d_ff,
                        max_seq_len=self.max_seq_len, rope_theta=self.rope_theta,
                        norm_eps=self.norm_eps, init_std=self.init_std)
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model head dim d_model/n_heads={self.d_model // self.n_heads} must be even (RoPE)")
        if self.n_kv_heads is not None and (isinstance(self.n_kv_heads, bool) or not isinstance(self.n_kv_heads, int)
                                            or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"model.n_kv_heads must be None (= n_heads) or an int >= 1 dividing model.n_heads="
                             f"{self.n_heads}, got {self.n_kv_heads!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.rope_scaling is not None:
            RopeScaling.from_dict(self.rope_scaling)
        _check_choice("model", "ffn_kind", self.ffn_kind, FFN_KINDS)
        # The live registry: a backend registered after this module was imported is accepted.
        _check_choice("model", "ffn_backend", self.ffn_backend, op_backends.backend_names())
        _check_choice("model", "compute_dtype", self.compute_dtype, DTYPES)
        _check_choice("model", "attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice("model", "layer_scan", self.layer_scan, tuple(LAYER_SCANS))
        if self.layer_unroll != "auto" and (isinstance(self.layer_unroll, bool) or not isinstance(self.layer_unroll, int)
                                            or self.layer_unroll < 0):
            raise ValueError(f"model.layer_unroll must be \"auto\" or an int >= 0 (0 = every layer), got "
                             f"{self.layer_unroll!r}")
        if isinstance(self.remat, bool):  # configs saved before remat became a policy
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        _check_choice("model", "remat", self.remat, tuple(REMAT_POLICIES))
        if not isinstance(self.ffn_op_config, dict):
            raise ValueError(f"model.ffn_op_config must be a dict, got {type(self.ffn_op_config).__name__}")
        hints = self.ffn_expected_active
        if not isinstance(hints, tuple) or (hints and len(hints) != self.n_layers) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in hints):
            raise ValueError(f"model.ffn_expected_active must be empty or {self.n_layers} numbers >= 0 (one per "
                             f"layer), got {hints!r}")
        profile = self.ffn_active_by_position
        if isinstance(profile, (tuple, list)) and all(isinstance(t, (tuple, list)) for t in profile):
            profile = tuple(tuple(t) for t in profile)  # a JSON config's lists
            object.__setattr__(self, "ffn_active_by_position", profile)
        buckets = len(ops_planner.position_buckets(self.max_seq_len)) - 1
        if not isinstance(profile, tuple) or (profile and len(profile) != self.n_layers) or any(
                not isinstance(t, tuple) or len(t) != buckets or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in t)
                for t in profile):
            raise ValueError(f"model.ffn_active_by_position must be empty or {self.n_layers} rows (one per layer) of "
                             f"{buckets} numbers >= 0 (the buckets of positions up to max_seq_len "
                             f"{self.max_seq_len}), got {profile!r}")
        tails = self.ffn_expected_tails
        if isinstance(tails, (tuple, list)) and all(isinstance(t, (tuple, list)) for t in tails):
            tails = tuple(tuple(t) for t in tails)  # a JSON config's lists
            object.__setattr__(self, "ffn_expected_tails", tails)
        if not isinstance(tails, tuple) or (tails and len(tails) != self.n_layers) or any(
                not isinstance(t, tuple) or len(t) != 3 or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in t)
                for t in tails):
            raise ValueError(f"model.ffn_expected_tails must be empty or {self.n_layers} triples (token tail, hot "
                             f"neurons, hot entries) of shares in [0, 1], one per layer, got {tails!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads (multi-head attention) when None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def rope_scaling_params(self) -> RopeScaling | None:
        """model.rope_scaling as a `RopeScaling` (None: plain RoPE)."""
        return None if self.rope_scaling is None else RopeScaling.from_dict(self.rope_scaling)

    def heads_text(self) -> str:
        """The attention heads in words: "8 heads", or "8 heads (2 KV heads)" with grouped-query attention."""
        return f"{self.n_heads} heads" + (f" ({self.kv_heads} KV heads)" if self.kv_heads != self.n_heads else "")

    @property
    def kind(self) -> FFNKind:
        """The properties of `ffn_kind` (FFN_KIND_TABLE)."""
        return FFN_KIND_TABLE[self.ffn_kind]

    @property
    def layers_per_iteration(self) -> int:
        """`layer_unroll` resolved to lax.scan's (0 = every layer in one iteration, no loop): "auto"
        is 0 where the FFN runs no sparse-op kernel (its backend is "dense": a dense kind such as a
        twin, or backend "dense"), whose unrolled step compiles about as fast as a plain-JAX model's
        and leaves out the loop's copies of saved values; 1 (the loop) where the op runs its
        kernels, whose step unrolled compiles for minutes at the largest presets (docs/model.md)."""
        if self.layer_unroll != "auto":
            return self.layer_unroll
        return 0 if self.kind.backend(self.ffn_backend) == "dense" else 1

    @property
    def is_relu_family(self) -> bool:
        """True when FFN activations are exactly sparse (ReLU), so L0/dead-neuron telemetry is meaningful."""
        return self.kind.relu

    def num_params(self) -> int:
        """Parameter count (a tied embedding counted once; an untied head's [V, D] besides it)."""
        ffn_mats = 3 if self.kind.gated else 2
        attention = 2 * self.d_model ** 2 + 2 * self.d_model * self.kv_dim  # q and out; k and v
        per_layer = attention + ffn_mats * self.d_model * self.d_ff + 2 * self.d_model
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.d_model
        return embeddings + self.n_layers * per_layer + self.d_model


# Model fields that trained weights fix: their shapes, and what the same shapes compute (RoPE base,
# norm epsilon). An imported checkpoint sets them (`twell train --init-from`); parameters from
# another run start a run only of the same values (`compare.check_init_run`).
ARCHITECTURE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta",
                       "rope_scaling", "tie_embeddings", "norm_eps")


@dataclass(frozen=True)
class DecodeConfig:
    """How generation runs a one-token decode step (twell_jax/inference/decode_engine.py): which
    program, not what it computes (every choice gives the XLA path's logits up to the order of fp32
    sums). Saved configs that hold these fields as model.decode_* load into this section."""

    # "auto" = the Pallas decode kernels (fused norm + matrix-vector products reading the stacked
    # weights in place, the sparse FFN's decode kernels) where they can run, else XLA; "pallas";
    # "xla" (DECODE_KERNELS).
    kernels: Literal["auto", "pallas", "xla"] = "auto"
    # With the decode kernels: read q/k/v, the attention output projection and W_down from
    # output-major copies ([L, N, K], made once per generator by `decode_engine.prepare_decode`)
    # instead of the stored input-major stacks ([L, K, N]): those weights held twice, for a faster
    # step (git history of BENCHMARKS.md, Decode). false: the weights once. Callers of
    # `decode_engine.decode` pass the copies.
    transposed: bool = True
    # The sparse layers' FFN in the decode kernels' step (DECODE_SPARSE_FFN; BENCHMARKS.md, Decode,
    # has the current ways' measurements, git history the others'). "tiles" and "fused" lose to "split" in a layer with many active
    # neurons (their every program walks them all); "packed" does not (each column tile makes its
    # own neurons' values), and "packed_down" also makes their down product in the same launch.
    sparse_ffn: Literal["auto", "tiles", "packed", "packed_down", "fused", "split"] = "auto"
    # Layers per iteration of the decode kernels' layer loop, as model.layer_unroll for the other
    # programs: 0 = every layer unrolled (no loop: each layer's index a constant, no per-iteration
    # copies; the step compiles in time linear in depth); 1 = a loop over the layers (per run of
    # layers with the same FFN way); n > 1 = n layers per iteration.
    layer_unroll: int = 0

    def __post_init__(self) -> None:
        _check_choice("decode", "kernels", self.kernels, tuple(DECODE_KERNELS))
        _check_choice("decode", "sparse_ffn", self.sparse_ffn, tuple(DECODE_SPARSE_FFN))
        if not isinstance(self.transposed, bool):
            raise ValueError(f"decode.transposed must be true or false, got {self.transposed!r}")
        if isinstance(self.layer_unroll, bool) or not isinstance(self.layer_unroll, int) or self.layer_unroll < 0:
            raise ValueError(f"decode.layer_unroll must be an int >= 0 (0 = every layer), got {self.layer_unroll!r}")


# train.sharding's choices (twell_jax/training/parallel.py:resolve_layout resolves them).
SHARDINGS = ("auto", "replicate", "fsdp", "hybrid")


def _sharding_from_fsdp(value: Any, where: str) -> str:
    """train.sharding for a saved train.fsdp: the layout the run had ("fsdp" or "replicate")."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected bool, got {_describe_value(value)}")
    return "fsdp" if value else "replicate"


# Fields replaced by another whose value follows from theirs: old name -> (new name, the old field's
# type, conversion of (value, old name) that raises a ValueError naming the field). `from_dict`
# converts them in a saved config (`migrate_dict`); `apply_overrides` parses the old name by its old
# type and converts it (`--set train.fsdp=true` is train.sharding=fsdp); the resume checks take it.
CONVERTED_FIELDS: dict[str, tuple[str, type, Callable[[Any, str], Any]]] = {
    "train.fsdp": ("train.sharding", bool, _sharding_from_fsdp),
}


# Fields that moved between sections: old name -> new name. `from_dict` moves them in a saved
# config (a run's config.json from before the move loads as it was), and `apply_overrides` and the
# resume checks take the old names on the command line too.
MOVED_FIELDS = {
    "model.decode_kernels": "decode.kernels",
    "model.decode_transposed": "decode.transposed",
    "model.decode_sparse_ffn": "decode.sparse_ffn",
    "model.decode_layer_unroll": "decode.layer_unroll",
}


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping and a warm-up + cosine (or constant) learning-rate schedule."""

    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 600  # linear warm-up from 0 to `lr` over this many optimizer steps
    schedule: Literal["cosine", "constant"] = "cosine"  # after warm-up: cosine decay to min_lr_ratio*lr, or flat
    min_lr_ratio: float = 0.0  # final lr of the cosine schedule, as a fraction of `lr`
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    eps: float = 1e-8  # Adam epsilon
    weight_decay: float = 0.1  # decoupled weight decay on matrices and embedding (never on norm scales)
    clip_norm: float = 1.0  # global gradient-norm clip; 0 disables clipping
    # Horizon of the schedule in optimizer steps (the cosine reaches min_lr_ratio * lr here and
    # stays there). 0 = train.steps; a new run saves the resolved value in its config.json, so
    # resuming with a larger train.steps keeps the original schedule unless this is set too.
    schedule_steps: int = 0

    def __post_init__(self) -> None:
        _check_finite("optim", self)
        _check_positive("optim", lr=self.lr, eps=self.eps)
        _check_non_negative("optim", schedule_steps=self.schedule_steps, warmup_steps=self.warmup_steps,
                            weight_decay=self.weight_decay, clip_norm=self.clip_norm)
        _check_choice("optim", "schedule", self.schedule, ("cosine", "constant"))
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class SparsityConfig:
    """L1 penalty on the FFN hidden activations h, dead-neuron tracking and optional re-initialisation."""

    l1_coef: float = 2e-5  # lambda in loss = CE + lambda * mean_over_layers(l1); 0 = no penalty
    l1_warmup_start: int = 0  # lambda is 0 up to this optimizer step ...
    l1_warmup_end: int = 0  # ... then ramps linearly to l1_coef at this step (end <= start: no ramp)
    # A neuron is dead when it has not fired for this many tokens; 0 = one optimizer step's tokens
    # (global_batch * seq_len, the reference's default).
    dead_window_tokens: int = 0
    track_neurons: bool = True  # compute per-neuron activity (dead neurons, position profile) each step
    position_buckets: int = 8  # the active-count profile averages positions into this many buckets
    reinit_dead: bool = False  # re-sample dead gate rows (rule in twell_jax/training/sparsity.py:reinit_dead_rows)
    reinit_every: int = 100  # check for dead neurons to re-initialise every this many optimizer steps
    # Active FFN neurons per token each layer should train to, one number per layer or one for all
    # (empty: off). The
    # step then scales each layer's L1 penalty by a factor it adapts every step (training/loss.py,
    # `adapt_l1_control`): the factors' shape moves the layers towards the targets' profile, their
    # common level only ever lowers the penalty, to hold the layers' mean at the targets' mean once
    # the coefficient's schedule has brought it there.
    target_active: tuple[float, ...] = ()
    target_rate: float = 0.05  # how fast the factors adapt: log-factor per step per unit of log error
    # Steps over which the targets themselves move, from half of each layer's neurons (about a ReLU
    # layer's activity at initialisation) to target_active, linearly in log(1 + active), counted from
    # l1_warmup_start; 0: the targets hold from the first step. A slower approach to sparsity
    # (training/loss.py, `moving_targets`); it did not keep more neurons alive (docs/training.md).
    target_approach_steps: int = 0

    def __post_init__(self) -> None:
        _check_finite("sparsity", self)
        targets = self.target_active
        if isinstance(targets, list) or (isinstance(targets, (int, float)) and not isinstance(targets, bool)):
            targets = tuple(targets) if isinstance(targets, list) else (targets,)  # a JSON list; one number
            object.__setattr__(self, "target_active", targets)
        if not isinstance(targets, tuple) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                 or not 0 < v < float("inf") for v in targets):
            raise ValueError(f"sparsity.target_active must be empty or numbers > 0 (one per layer), got {targets!r}")
        _check_positive("sparsity", target_rate=self.target_rate)
        _check_non_negative("sparsity", l1_coef=self.l1_coef, l1_warmup_start=self.l1_warmup_start,
                            l1_warmup_end=self.l1_warmup_end, dead_window_tokens=self.dead_window_tokens,
                            target_approach_steps=self.target_approach_steps)
        if self.target_approach_steps and not targets:
            raise ValueError("sparsity.target_approach_steps moves the per-layer targets: it needs "
                             "sparsity.target_active")
        _check_positive("sparsity", position_buckets=self.position_buckets, reinit_every=self.reinit_every)
        if self.reinit_dead and not self.track_neurons:
            raise ValueError("sparsity.reinit_dead needs sparsity.track_neurons=True (it reads the dead counters)")

    def without_l1(self) -> "SparsityConfig":
        """These settings for a dense kind, trained without L1 (nor per-layer targets)."""
        return dataclasses.replace(self, l1_coef=0.0, target_active=(), target_approach_steps=0)


@dataclass(frozen=True)
class TrainConfig:
    """Loop, batch layout, logging, evaluation and checkpoint cadence."""

    steps: int = 300  # optimizer steps to train for (total, counting resumed steps)
    global_batch: int = 16  # sequences per optimizer step, over all devices and accumulation steps
    micro_batch: int = 16  # sequences per device per forward/backward (accum = global/(micro*devices))
    num_devices: int | None = None  # data-parallel devices (None = all visible devices)
    # Where the parameters and optimizer state live (the batch is always split over every device):
    # "replicate" = a copy on each device; "fsdp" = split over all devices (ZeRO-3 style); "hybrid" =
    # split within a group of train.fsdp_size devices (default: one process's, i.e. a host's) and
    # replicated across groups; "auto" = replicate when it fits the device memory with a margin, else
    # hybrid, else fsdp (twell_jax/training/parallel.py:resolve_layout; the choice is printed at start).
    sharding: Literal["auto", "replicate", "fsdp", "hybrid"] = "auto"
    # Devices per FSDP group for train.sharding "hybrid" and "auto" (None = the devices of one process).
    fsdp_size: int | None = None
    # When the gradients are reduced over the devices, under a layout that replicates the weights
    # ("replicate") with several micro-batches a step: "step" = each device sums its micro-batches'
    # gradients and the devices reduce them once per optimizer step (one all-reduce a step);
    # "micro_batch" = inside every micro-batch's backward, as XLA's partitioning places it (one
    # a micro-batch, overlapped with the backward). FSDP layouts and one micro-batch a step always
    # do the latter. Results agree up to rounding.
    grad_reduce: Literal["step", "micro_batch"] = "step"
    seed: int = 42  # parameter init seed (the data has its own seed in data.seed)
    log_every: int = 10  # log metrics (console, JSONL, TensorBoard) every this many steps
    eval_every: int = 0  # validation every this many steps (0 = only at the end)
    eval_batches: int = 8  # validation batches per evaluation (fewer if the split is smaller)
    eval_batch_size: int = 16  # sequences per validation batch (divisible by the device count)
    checkpoint_every: int = 0  # periodic checkpoint every this many steps (0 = only the final one;
    # SIGINT/SIGTERM and train.time_limit_s also checkpoint)
    keep_checkpoints: int = 2  # how many recent checkpoints Orbax keeps
    tensorboard: bool = True  # also write TensorBoard event files (tensorboardX)
    progress_bar: bool = True  # tqdm bar on stderr when it is a terminal (else, and when false: one line per logged step)
    # Wall-clock budget of the training loop in seconds (compilation excluded); the run stops after
    # the step that crosses it, then checkpoints and evaluates as at the end. 0 = no limit.
    time_limit_s: float = 0.0
    # Sparse op with backend "auto" and no model.ffn_expected_active: the trainer sets the per-layer
    # hints itself (measured on the first batch, then from the logged l0) and re-plans every this
    # many steps, recompiling the step only when some layer's dense/sparse decision changes. 0 = never.
    auto_refresh_every: int = 200
    # Managed "auto" runs: after compiling a plan with a sparse piece, time this many training steps
    # with it and as many with the dense program, and keep the sparse plan only if it runs at least
    # 0.98x as fast (training/plan_trial.py); re-checked at each re-plan while dense is kept. 0 = trust
    # the cost model.
    auto_trial_steps: int = 5
    # Weights & Biases: every metrics record also goes to a W&B run of this project, beside TensorBoard
    # (None = off; pip install 'twell-jax[wandb]'; WANDB_MODE=offline keeps it on disk, WANDB_ENTITY names
    # the team; the W&B run is named after the run directory and resumed with it).
    wandb_project: str | None = None
    # Profiler window "START:END": a jax.profiler trace of the optimizer steps START..END-1 (1-based, as
    # logged) written under <run>/profile/ (TensorBoard's profile plugin or Perfetto read it). "" = none.
    profile_steps: str = ""

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """(START, END) of train.profile_steps (the steps START..END-1 are traced), None when unset."""
        if not self.profile_steps:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)

    def __post_init__(self) -> None:
        _check_finite("train", self)
        _check_positive("train", steps=self.steps, global_batch=self.global_batch,
                        micro_batch=self.micro_batch, log_every=self.log_every,
                        eval_batches=self.eval_batches, eval_batch_size=self.eval_batch_size,
                        keep_checkpoints=self.keep_checkpoints)
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"train.num_devices must be >= 1 or None, got {self.num_devices}")
        _check_choice("train", "sharding", self.sharding, SHARDINGS)
        _check_choice("train", "grad_reduce", self.grad_reduce, ("step", "micro_batch"))
        if self.fsdp_size is not None and self.fsdp_size < 1:
            raise ValueError(f"train.fsdp_size must be >= 1 or None (the devices of one process), got {self.fsdp_size}")
        if self.fsdp_size is not None and self.sharding not in ("hybrid", "auto"):
            raise ValueError(f"train.fsdp_size={self.fsdp_size} sizes the FSDP groups of train.sharding 'hybrid' or "
                             f"'auto', not {self.sharding!r}: unset it (None)")
        if isinstance(self.time_limit_s, bool) or not self.time_limit_s >= 0:
            raise ValueError(f"train.time_limit_s must be >= 0 seconds (0 = no limit), got {self.time_limit_s!r}")
        _check_non_negative("train", eval_every=self.eval_every, checkpoint_every=self.checkpoint_every)
        if isinstance(self.auto_refresh_every, bool) or not isinstance(self.auto_refresh_every, int) \
                or self.auto_refresh_every < 0:
            raise ValueError(f"train.auto_refresh_every must be an int >= 0 (0 = never), got {self.auto_refresh_every!r}")
        if isinstance(self.auto_trial_steps, bool) or not isinstance(self.auto_trial_steps, int) \
                or self.auto_trial_steps < 0:
            raise ValueError(f"train.auto_trial_steps must be an int >= 0 (0 = no trial), got {self.auto_trial_steps!r}")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"train.global_batch={self.global_batch} must be a multiple of "
                             f"train.micro_batch={self.micro_batch}")
        if self.wandb_project is not None and (not isinstance(self.wandb_project, str) or not self.wandb_project
                                               or any(c in self.wandb_project for c in "/\\#?%:")):
            raise ValueError(f"train.wandb_project must be a W&B project name (non-empty, none of / \\ # ? % :) "
                             f"or None (off), got {self.wandb_project!r}")
        window = re.fullmatch(r"(\d+):(\d+)", self.profile_steps) if isinstance(self.profile_steps, str) else None
        if self.profile_steps and (window is None or not 1 <= int(window[1]) < int(window[2])):
            raise ValueError(f"train.profile_steps must be 'START:END' with 1 <= START < END (the optimizer steps "
                             f"START..END-1 are traced; '' = no trace), got {self.profile_steps!r}")
        if window is not None and int(window[1]) > self.steps:
            raise ValueError(f"train.profile_steps={self.profile_steps!r} starts after the last step "
                             f"(train.steps={self.steps})")


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized, packed, split and served."""

    # Fields that older saved configs may hold and that no longer exist: `from_dict` drops them
    # with a FutureWarning saying why, so old checkpoints and config.json files still load.
    REMOVED_FIELDS: ClassVar[dict[str, str]] = {
        "iterator": "Grain is now required and always used; the removed pure-Python iterator gave the "
                    "same batches and the same iterator state, so nothing changes",
    }

    # "stdlib" = the Python standard library's own .py files (present offline on every machine);
    # "synthetic" = deterministic random token ids (no corpus, no tokenizer: tests, benchmarks); or
    # a path to a .txt file, a .jsonl file (one JSON object per line), a .parquet file (.txt and
    # .jsonl also as .gz / .zst, read as a stream), or a directory searched recursively for those
    # kinds of file, read in sorted path order (shards; other files are ignored);
    # "installed" = the standard library plus every installed package's sources and docs
    # (site-packages, dist-packages, share/doc; see twell_jax/data/tree.py).
    source: str = "stdlib"
    # Glob patterns (e.g. "*.py,*.md,*.rst,*.txt") choosing the files of a directory source, every
    # match one document (.jsonl/.parquet by their kind); exact duplicate documents are dropped.
    # For source="installed", () = its default sources-and-docs patterns. () = the default above.
    include: tuple[str, ...] = ()
    # "bpe" = train a byte-level BPE on the training documents (cached); or a path to a
    # tokenizer.json (or to a directory holding one, e.g. a local copy of a HF model).
    # Ignored for source="synthetic".
    tokenizer: str = "bpe"
    # Vocabulary size of the trained BPE (>= 257), or of the synthetic source (>= 2: ids drawn
    # uniformly from [0, vocab_size)); ignored for a tokenizer.json (taken from the file).
    vocab_size: int = 4096
    # Model context length: every example holds seq_len + 1 tokens (inputs [:-1], targets [1:]).
    seq_len: int = 128
    # Seed of the training order; epoch e is shuffled with a permutation keyed by (seed, e).
    seed: int = 0
    # Share of documents held out for validation (whole documents; at least one when > 0). For
    # source="synthetic", the share of the synthetic sequences held out.
    val_fraction: float = 0.05
    # Seed of the train/validation document split, separate from `seed` so that runs with
    # different training seeds are evaluated on the same held-out documents. For
    # source="synthetic", the seed of the token values.
    split_seed: int = 0
    # Use only the first max_documents (non-empty) documents of the source; None = all.
    max_documents: int | None = None
    # Tokenizer and token caches live here, keyed by a hash of (source listing, settings).
    cache_dir: str = "~/.cache/twell_jax"
    # End-of-text token appended to every document; must exist in the tokenizer (id 0 in our BPE).
    eot_token: str = "<|endoftext|>"
    # JSONL key / Parquet column holding the document text.
    text_field: str = "text"
    # None: every .txt file is one document. A string: .txt files are split into documents at it
    # (e.g. "\n\n" for paragraphs, "\n" for one document per line); empty pieces are dropped.
    # Backslash escapes \n \t \r \\ are decoded (`txt_separator_text`), so the command line can
    # say --set 'data.txt_separator=\n\n'.
    txt_separator: str | None = None
    # Minimum pair frequency for a BPE merge (raise it on big corpora to keep merges meaningful).
    bpe_min_frequency: int = 2
    # Documents per `encode_batch` call while tokenizing (bounds memory, keeps Rust threads busy).
    encode_chunk_documents: int = 512
    # Processes tokenizing chunks in parallel (0 = one per CPU core for a corpus of at least 16
    # chunks, else in this process; 1 = in this process; see twell_jax/data/encode_pool.py).
    tokenize_workers: int = 0
    # Reader threads assembling batches ahead of the training loop (0 = on the caller's thread).
    num_threads: int = 2
    # Batches buffered ahead per iterator (memory = prefetch * local batch).
    prefetch: int = 4
    # source="synthetic": number of random sequences of seq_len + 1 tokens (train + validation).
    synthetic_sequences: int = 1 << 20
    # Print what is being built and where it is cached, with progress bars on long work.
    progress: bool = True

    def __post_init__(self) -> None:
        _check_finite("data", self)
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"data.source={self.source!r}: expected 'stdlib', 'synthetic' or a path")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"data.tokenizer={self.tokenizer!r}: expected 'bpe' or a path to a tokenizer.json")
        if self.is_synthetic:
            if self.vocab_size < 2:
                raise ValueError(f"data.vocab_size={self.vocab_size}: the synthetic source needs at least 2 ids")
        elif self.tokenizer == "bpe" and self.vocab_size < MIN_BPE_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size={self.vocab_size}: a byte-level BPE needs at least "
                f"{MIN_BPE_VOCAB_SIZE} (256 bytes + the end-of-text token)"
            )
        _check_positive("data", seq_len=self.seq_len, bpe_min_frequency=self.bpe_min_frequency,
                        encode_chunk_documents=self.encode_chunk_documents)
        _check_non_negative("data", seed=self.seed, split_seed=self.split_seed, num_threads=self.num_threads,
                            prefetch=self.prefetch, tokenize_workers=self.tokenize_workers)
        if not isinstance(self.include, tuple) or not all(isinstance(p, str) and p.strip() for p in self.include):
            raise ValueError(f"data.include={self.include!r}: expected glob patterns such as '*.py,*.md'")
        if isinstance(self.val_fraction, bool) or not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction}: expected 0 <= val_fraction < 1")
        if self.max_documents is not None:
            _check_positive("data", max_documents=self.max_documents)
        if not self.cache_dir:
            raise ValueError(f"data.cache_dir={self.cache_dir!r}: expected a directory path")
        if not self.eot_token:
            raise ValueError(f"data.eot_token={self.eot_token!r}: expected a non-empty token string")
        if not self.text_field:
            raise ValueError(f"data.text_field={self.text_field!r}: expected a non-empty field name")
        if self.txt_separator is not None and not self.txt_separator_text:
            raise ValueError(f"data.txt_separator={self.txt_separator!r}: expected None (one document per "
                             "file) or a non-empty string")
        if self.synthetic_sequences < 2:
            raise ValueError(f"data.synthetic_sequences={self.synthetic_sequences}: expected >= 2")

    @property
    def is_synthetic(self) -> bool:
        """True for the random-token source (no corpus, no tokenizer)."""
        return self.source == SYNTHETIC_SOURCE

    @property
    def txt_separator_text(self) -> str | None:
        """`txt_separator` with its backslash escapes decoded (None: one document per .txt file)."""
        if self.txt_separator is None:
            return None
        return decode_escapes(self.txt_separator, "data.txt_separator")


@dataclass(frozen=True)
class ExperimentConfig:
    """One training run: everything needed to rebuild the model, optimiser and data stream."""

    name: str = "experiment"  # run name (default output dir runs/<name>-<timestamp>)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # how generation runs (not part of the model)

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.data.tokenizer == "bpe" and self.data.vocab_size > self.model.vocab_size:
            raise ValueError(f"data.vocab_size={self.data.vocab_size} exceeds model.vocab_size={self.model.vocab_size}")
        if not self.model.kind.l1 and self.sparsity.l1_coef > 0:
            raise ValueError(
                f"model.ffn_kind={self.model.ffn_kind!r} is a dense baseline trained without L1; set "
                f"sparsity.l1_coef=0, or use ffn_kind='twell' (any backend) for an L1-regularised model")
        if self.sparsity.reinit_dead and not self.model.is_relu_family:
            raise ValueError("sparsity.reinit_dead needs a ReLU FFN (ffn_kind twell/relu_gated/relu)")
        targets = self.sparsity.target_active
        if len(targets) == 1 and self.model.n_layers > 1:  # one number: every layer's target
            targets = targets * self.model.n_layers
            object.__setattr__(self, "sparsity", dataclasses.replace(self.sparsity, target_active=targets))
        if targets and len(targets) != self.model.n_layers:
            raise ValueError(f"sparsity.target_active has {len(targets)} numbers; the model has "
                             f"model.n_layers={self.model.n_layers} layers (one target each)")
        if targets and max(targets) > self.model.d_ff:
            raise ValueError(f"sparsity.target_active asks for {max(targets):g} active neurons per token in a layer "
                             f"of model.d_ff={self.model.d_ff}")
        if targets and not (self.model.kind.l1 and self.sparsity.l1_coef > 0):
            raise ValueError("sparsity.target_active adapts the L1 penalty per layer: it needs an L1-regularised "
                             f"model (ffn_kind 'twell', sparsity.l1_coef > 0), got ffn_kind={self.model.ffn_kind!r}, "
                             f"l1_coef={self.sparsity.l1_coef:g}")

    @property
    def seq_len(self) -> int:
        return int(self.data.seq_len)

    @property
    def schedule_steps(self) -> int:
        """Horizon of the learning-rate schedule: optim.schedule_steps, or train.steps when 0."""
        return self.optim.schedule_steps or self.train.steps


def with_fixed_schedule(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with optim.schedule_steps resolved (0 -> train.steps): what a new run saves, so that a
    later `--set train.steps=...` on resume extends the run without re-planning its schedule."""
    if cfg.optim.schedule_steps:
        return cfg
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_steps=cfg.train.steps))


# Fields that may differ between a run's saved config and the config it continues (or is evaluated)
# with: how long and how it runs, what it logs, where it reads from; never what it computes.
# Everything else is fixed for the life of a run directory.
RESUMABLE_FIELDS = frozenset({
    "name",  # a label (the default run directory name)
    "train.steps", "train.time_limit_s", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.eval_batch_size", "train.checkpoint_every", "train.keep_checkpoints", "train.tensorboard",
    "train.progress_bar", "train.num_devices", "train.micro_batch", "train.sharding", "train.fsdp_size",
    "train.grad_reduce",
    "train.auto_refresh_every",
    "train.auto_trial_steps", "train.wandb_project", "train.profile_steps", "optim.schedule_steps",
    "model.ffn_backend", "model.ffn_op_config", "model.ffn_interpret", "model.ffn_expected_active",
    "model.ffn_expected_tails", "model.ffn_active_by_position", "model.remat", "model.attention_impl", "model.layer_unroll",
    "decode.kernels", "decode.transposed", "decode.sparse_ffn", "decode.layer_unroll",
    *MOVED_FIELDS, *CONVERTED_FIELDS,  # their old names, which apply_overrides moves or converts
    "data.source", "data.cache_dir", "data.progress", "data.num_threads", "data.prefetch", "data.tokenize_workers",
})


# ----------------------------------------------------------------------------- (de)serialisation


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict of a (nested) config dataclass."""
    return dataclasses.asdict(cfg)


def _section_from_dict(cls: type, values: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    removed = getattr(cls, "REMOVED_FIELDS", {})
    for name in sorted(set(values) & set(removed) - known):
        warnings.warn(f"config field {path}{name} no longer exists and was dropped: {removed[name]}",
                      FutureWarning, stacklevel=3)
        values = {k: v for k, v in values.items() if k != name}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config field(s) {', '.join(path + k for k in unknown)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ValueError(f"{path}{name}: expected a section (a JSON object of its fields), got "
                                 f"{_describe_value(value)}")
            kwargs[name] = _section_from_dict(hint, value, f"{path}{name}.")
        else:
            kwargs[name] = _typed_value(value, hint, f"{path}{name}")
    return cls(**kwargs)


def _describe_value(value: Any) -> str:
    """A value as a type error names it: its JSON-ish type and its repr (cut short)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _hint_name(hint: Any) -> str:
    """A field's declared type in the words of a type error ("int", "list of str", "int or None")."""
    origin = _origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("None" if h is type(None) else _hint_name(h) for h in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(hint))
    if origin is tuple:
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"list of {_hint_name(args[0])}" if args else "list"
    if origin is dict or hint is dict:
        return "JSON object"
    return getattr(hint, "__name__", str(hint))


def _typed_value(value: Any, hint: Any, where: str) -> Any:
    """`value` (read from JSON, or parsed from an override) checked against the field's declared type
    `hint`, a ValueError naming the field where it does not match: a string where a number belongs
    would otherwise fail deep inside a comparison, and a fraction in an int field pass every check
    and break the model later. Bools are not ints here; an int passes as a float, and a float that is
    a whole number as an int (JSON writers may spell 100 as 100.0). Lists become tuples where the
    field is a tuple. Literal choices are left to the section's own check, which lists them."""
    origin = _origin(hint)
    if hint is Any or origin is Literal:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _typed_value(value, option, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: expected {_hint_name(hint)}, got {_describe_value(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return value
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            args = typing.get_args(hint)
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(_typed_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
            if args and len(args) == len(value):
                return tuple(_typed_value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
            if not args:
                return tuple(value)
            raise ValueError(f"{where}: expected a list of {len(args)} values, got {_describe_value(value)}")
    elif origin is dict or hint is dict:
        if isinstance(value, dict):
            return value
    else:
        return value  # a type the config does not declare today: the section's own checks decide
    raise ValueError(f"{where}: expected {_hint_name(hint)}, got {_describe_value(value)}")


def migrate_dict(values: dict[str, Any]) -> dict[str, Any]:
    """A saved config dict with every field of MOVED_FIELDS at its new place and every field of
    CONVERTED_FIELDS converted to its replacement (a copy; `values` as it is when nothing changed).
    Both the old and the new field set is an error naming them."""
    renamed = {old: (new, None) for old, new in MOVED_FIELDS.items()} | {
        old: (new, convert) for old, (new, _, convert) in CONVERTED_FIELDS.items()}
    present = [(old.split("."), new.split("."), convert) for old, (new, convert) in renamed.items()
               if isinstance(values.get(old.split(".")[0]), dict) and old.split(".")[1] in values[old.split(".")[0]]]
    if not present:
        return values
    values = {key: dict(value) if isinstance(value, dict) else value for key, value in values.items()}
    for (old_section, old_name), (new_section, new_name), convert in present:
        target = values.setdefault(new_section, {})
        if not isinstance(target, dict):
            break  # not a section: _section_from_dict names the field
        value = values[old_section].pop(old_name)
        value = value if convert is None else convert(value, f"{old_section}.{old_name}")  # names a bad old value
        if new_name in target:
            how = "moved to" if convert is None else "was replaced by"
            raise ValueError(f"config field {old_section}.{old_name} {how} {new_section}.{new_name}, and both "
                             "are set: keep the new one")
        target[new_name] = value
    return values


def from_dict(values: dict[str, Any]) -> ExperimentConfig:
    """Inverse of `to_dict` (unknown fields are an error; moved ones are moved, `migrate_dict`)."""
    return _section_from_dict(ExperimentConfig, migrate_dict(values), "")


def to_json(cfg: ExperimentConfig) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


# ----------------------------------------------------------------------------- overrides


def _origin(hint: Any) -> Any:
    return typing.get_origin(hint)


def _parse_value(text: str, hint: Any, where: str) -> Any:
    """Parse `text` as a value of type `hint` (int, float, bool, str, Literal, Optional, tuple, dict)."""
    origin = _origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if type(None) in options and text.lower() in ("none", "null"):
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _parse_value(text, option, where)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(f"{where}: cannot parse {text!r} as {hint}: {'; '.join(errors)}")
    if origin is Literal:
        choices = typing.get_args(hint)
        for choice in choices:
            if str(choice) == text:
                return choice
        raise ValueError(f"{where} must be one of {choices}, got {text!r}")
    if hint is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{where} expects a bool (true/false), got {text!r}")
    if hint is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"{where} expects an int, got {text!r}") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{where} expects a float, got {text!r}") from None
    if hint is str:
        return text
    if origin in (tuple, list, dict) or hint in (dict, list, tuple):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if origin is tuple and "," in text:  # "a,b,c" shorthand for tuples of str/int
                args = typing.get_args(hint)
                elem = args[0] if args else str
                return tuple(_parse_value(part.strip(), elem, where) for part in text.split(","))
            raise ValueError(f"{where} expects JSON for {hint}, got {text!r}") from None
        if origin is tuple and isinstance(value, list):
            return tuple(value)
        if origin is tuple and isinstance(value, (int, float)) and not isinstance(value, bool):
            return (value,)  # one number for a tuple field (sparsity.target_active=39: every layer's)
        expected = dict if (origin is dict or hint is dict) else list
        if origin is not tuple and not isinstance(value, expected):
            raise ValueError(f"{where} expects {hint}, got {text!r}")
        return value
    raise ValueError(f"{where}: overriding fields of type {hint} is not supported")


def apply_overrides(cfg: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    """Return `cfg` with each "section.field=value" (or "field=value" at top level) applied.

    Values are parsed by the field's declared type; unknown fields and bad values raise ValueError
    naming the field. All overrides are applied together before the invariants are checked, so
    coupled fields can change in one go (e.g. model.ffn_kind=relu_gated sparsity.l1_coef=0).
    """
    values = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.field=value")
        key, text = (part.strip() for part in item.split("=", 1))
        key = MOVED_FIELDS.get(key, key)
        if key in CONVERTED_FIELDS:  # e.g. train.fsdp=true: parsed as the old field, set as the new one
            new_key, old_type, convert = CONVERTED_FIELDS[key]
            section, name = new_key.split(".")
            values[section][name] = convert(_parse_value(text, old_type, key), key)
            continue
        parts = key.split(".")
        cls, target = type(cfg), values
        for depth, name in enumerate(parts):
            names = {f.name for f in dataclasses.fields(cls)}
            if name not in names:
                raise ValueError(f"unknown config field {key!r} ({cls.__name__} has: {', '.join(sorted(names))})")
            hint = typing.get_type_hints(cls)[name]
            last = depth == len(parts) - 1
            if last:
                if dataclasses.is_dataclass(hint):
                    raise ValueError(f"{key!r} is a section; set one of its fields ({key}.<field>=...)")
                target[name] = _parse_value(text, hint, key)
            else:
                if not dataclasses.is_dataclass(hint):
                    raise ValueError(f"{'.'.join(parts[:depth + 1])} in {key!r} is not a section")
                cls, target = hint, target[name]
    return from_dict(values)


def diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Fields whose values differ between two config dataclasses (or nested dicts): (path, a, b)."""
    da = to_dict(a) if dataclasses.is_dataclass(a) else a
    db = to_dict(b) if dataclasses.is_dataclass(b) else b
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(da) | set(db)):
        va, vb = da.get(key, "<missing>"), db.get(key, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict) and key != "ffn_op_config":
            out.extend(diff(va, vb, f"{prefix}{key}."))
        elif _normalise(va) != _normalise(vb):
            out.append((f"{prefix}{key}", va, vb))
    return out


def _normalise(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    return value
