"""Load a trained run for inference: parameters (no optimizer state), config, tokenizer.

`load_run(run_dir)` restores only the parameters of a verified checkpoint
(`twell_jax.training.checkpoint.restore_params`: the newest intact one, or `step`), so no optimizer or
Trainer is built. The tokenizer is the one saved with the run (`<run>/tokenizer.json`); a run
without one gets the tokenizer its config's data section builds, with a warning.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib
from twell_jax.training import checkpoint as ckpt_lib
from twell_jax.config import DTYPES, DataConfig, ExperimentConfig, ModelConfig, SparsityConfig
from twell_jax.training.hints import with_auto_hints, with_position_hints
from twell_jax.model import Transformer, init_model

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)



@dataclasses.dataclass
class LoadedModel:
    """A model ready for inference: params cast to the compute dtype inside `model`."""

    model: Transformer  # the NNX module (params in `config.model.compute_dtype`)
    config: ExperimentConfig  # the run's config, compute_dtype set to the load dtype
    tokenizer: "Tokenizer | None"  # None when neither the run nor its data section provides one
    step: int | None  # checkpoint step (None for a model that did not come from a run)
    eos_id: int | None = None  # end-of-text id (the data section's eot_token), None if unknown
    # `data.tokenizer.tokenizer_hash` of the tokenizer the weights were trained with (the run's
    # record, an imported checkpoint's own tokenizer.json); None if unknown. A tokenizer used with
    # them (lm-eval's adapter, an export) must hash equal.
    tokenizer_hash: str | None = None
    # The compiled programs of `generate(loaded, ...)`, made on first use and reused by later calls.
    _generator: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # The compiled scoring programs (`scoring.ScoreProgram`), made by the first Scorer and reused.
    _score_program: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)


def experiment_config_for(model_cfg: ModelConfig, *, name: str = "model",
                          tokenizer_path: str | None = None) -> ExperimentConfig:
    """An ExperimentConfig around a bare model config (a random or imported model), so that such a
    model travels as a LoadedModel like a trained run. Its data section names `tokenizer_path`
    (an existing tokenizer.json); without one it is the synthetic source of the model's vocabulary
    (token ids, no tokenizer)."""
    if tokenizer_path is None:
        data = DataConfig(source="synthetic", vocab_size=model_cfg.vocab_size, seq_len=model_cfg.max_seq_len)
    else:
        data = DataConfig(tokenizer=tokenizer_path, seq_len=model_cfg.max_seq_len)
    sparsity = SparsityConfig(l1_coef=SparsityConfig().l1_coef if model_cfg.kind.l1 else 0.0)
    return ExperimentConfig(name=name, model=model_cfg, data=data, sparsity=sparsity)


def model_with_params(cfg: ModelConfig, params: dict[str, Any], dtype: str) -> Transformer:
    """A Transformer of `cfg` (compute dtype `dtype`) holding `params` cast to `dtype`.

    `params` is the plain nested dict of `model.split_model`; a missing or misshapen entry is an
    error naming it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    cfg = dataclasses.replace(cfg, compute_dtype=dtype)
    abstract = nnx.eval_shape(lambda: init_model(cfg, 0))
    graphdef, state = nnx.split(abstract)
    expected = nnx.to_pure_dict(state)
    want = {jax.tree_util.keystr(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
    problems = [f"{k}: missing" for k in want if k not in have]
    problems += [f"{k}: unexpected" for k in have if k not in want]
    problems += [f"{k}: shape {have[k]}, expected {want[k]}" for k in want if k in have and have[k] != want[k]]
    if problems:
        raise ValueError("parameters do not match the model config: " + "; ".join(sorted(problems)[:12]))
    cast = jax.tree.map(lambda leaf: jnp.asarray(leaf).astype(dtype), params)
    nnx.replace_by_pure_dict(state, cast)
    return nnx.merge(graphdef, state)


def load_tokenizer_for_run(run_dir: str | Path, cfg: ExperimentConfig) -> "Tokenizer | None":
    """The tokenizer saved with the run (`run_dir.saved_tokenizer`), else the one the config's
    data section builds (`data.bundle.build_tokenizer`: the same file, or the same cached or
    retrained BPE, as at training time; warns), else None (warns)."""
    from twell_jax.data import tokenizer as tokenizer_lib
    from twell_jax.data.bundle import build_tokenizer

    path = run_dir_lib.saved_tokenizer(run_dir)
    if path is not None:
        return tokenizer_lib.load_tokenizer(str(path))
    if cfg.data.is_synthetic:  # nothing to rebuild: the run never had a tokenizer
        warnings.warn(f"no tokenizer for {run_dir}: its data source is synthetic; generation then needs token ids",
                      stacklevel=3)
        return None
    warnings.warn(f"{Path(run_dir) / run_dir_lib.TOKENIZER_FILE} not found: rebuilding the tokenizer from the run's "
                  f"data config (tokenizer={cfg.data.tokenizer!r}, source={cfg.data.source!r}); this needs the "
                  "same tokenizer file or BPE cache / corpus as at training time", stacklevel=3)
    try:
        tokenizer = build_tokenizer(cfg.data)
    except (ValueError, OSError, ImportError) as err:
        warnings.warn(f"no tokenizer for {run_dir}: {err}; generation then needs token ids", stacklevel=3)
        return None
    return tokenizer


def eos_id_of(tokenizer: "Tokenizer | None", cfg: ExperimentConfig) -> int | None:
    """The id of the data config's end-of-text token in `tokenizer` (None when absent)."""
    if tokenizer is None:
        return None
    token_id = tokenizer.token_to_id(cfg.data.eot_token)
    return None if token_id is None else int(token_id)


# The sparse op's config fields `load_run` sets for inference where the run's config does not name
# them: restore_params verified every parameter finite, so the op's per-call NaN/Inf pass over the
# weights (which costs more than a sparse decode step) is skipped (docs/format.md); and no gradient
# is taken, so "auto" plans each layer's forward alone (`SparseFFNConfig.forward_only`).
INFERENCE_OP_CONFIG = {"check_finite": False, "forward_only": True}


def load_run(run_dir: str | Path, step: int | None = None, dtype: str = "bfloat16",
             overrides: list[str] | None = None) -> LoadedModel:
    """Load a trained run (a run dir or its checkpoints/ dir) for inference.

    `step`: the checkpoint step (default: the latest). `dtype`: compute dtype, and the dtype the
    parameters are cast to ("bfloat16" or "float32"). `overrides`: `--set` items applied to the
    checkpoint's config, config.RESUMABLE_FIELDS only (e.g. model.ffn_backend=dense)."""
    from twell_jax.training.run_tokenizer import run_tokenizer_hash

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    run_path = run_dir_lib.run_dir_of(run_dir)
    if not run_path.exists():
        raise FileNotFoundError(f"no run directory at {run_path.absolute()}")
    params, meta, step = ckpt_lib.restore_params_with_meta(run_path, step, warn=logger.warning)
    cfg = config_lib.from_dict(meta["config"])
    if overrides:
        fixed = sorted({item.split("=", 1)[0].strip() for item in overrides} - config_lib.RESUMABLE_FIELDS)
        if fixed:
            raise ValueError(f"--set {', '.join(fixed)}: cannot change for an existing run (its weights and data "
                             f"fix them); fields that may change: {', '.join(sorted(config_lib.RESUMABLE_FIELDS))}")
        cfg = config_lib.apply_overrides(cfg, overrides)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=dtype))
    # Per-layer active counts from the run's telemetry: "auto" then picks dense/sparse at trace time.
    cfg = with_auto_hints(cfg, run_path, step, meta=meta, echo=logger.info)
    cfg = with_position_hints(cfg, run_path, step, echo=logger.info)
    inference_fields = {k: v for k, v in INFERENCE_OP_CONFIG.items() if k not in cfg.model.ffn_op_config}
    if cfg.model.kind.sparse_op and inference_fields:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, ffn_op_config={**cfg.model.ffn_op_config, **inference_fields}))
    tokenizer = load_tokenizer_for_run(run_path, cfg)
    if tokenizer is not None and tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
                         f"{cfg.model.vocab_size}: not this run's tokenizer")
    model = model_with_params(cfg.model, params, dtype)
    return LoadedModel(model=model, config=cfg, tokenizer=tokenizer, step=step, eos_id=eos_id_of(tokenizer, cfg),
                       tokenizer_hash=run_tokenizer_hash(run_path, warn=logger.warning))


def validation_tokens(run_dir: str | Path, batch_size: int, *, cycle: bool = False) -> np.ndarray:
    """int32[batch_size, seq_len + 1]: the first `batch_size` sequences of a run's validation split,
    built from its saved config and tokenizer (the data cache of the training run makes this cheap).
    What benchmarks of a trained model feed it: its activity on random token ids is not its activity
    on text. `cycle`: a split of fewer sequences is repeated to `batch_size` rows instead of refused."""
    from twell_jax.data import build_data

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    run_path = run_dir_lib.run_dir_of(run_dir)
    cfg = run_dir_lib.with_saved_tokenizer(ckpt_lib.load_run_config(run_path), run_path)
    bundle = build_data(cfg.data, global_batch=1)
    available = bundle.num_val_sequences
    if available < batch_size and not cycle:
        raise ValueError(f"{run_path}: the validation split has {available} sequences of "
                         f"{bundle.seq_len + 1} tokens, fewer than the {batch_size} asked for")
    rows = np.asarray(next(iter(bundle.val_batches(min(batch_size, available), max_batches=1)))["tokens"], np.int32)
    return rows[np.arange(batch_size) % len(rows)]
