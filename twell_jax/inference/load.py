"""Load a trained run for inference: parameters (no optimizer state), config, tokenizer.

`load_run(run_dir)` reads `<run>/checkpoints/<step>/` (Orbax: the "state" item holds
{params, opt_state, step, since_active}, the "meta" item the config) and restores only the
parameters, so no optimizer or Trainer is built. The tokenizer is `<run>/tokenizer.json` when the
run has one; otherwise it is rebuilt from the config's data section (the BPE cache, or the
tokenizer file the config names), with a warning.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from twell_jax import checkpoint as ckpt_lib
from twell_jax import config as config_lib
from twell_jax.config import DTYPES, DataConfig, ExperimentConfig, ModelConfig, SparsityConfig
from twell_jax.evaluate import with_auto_hints
from twell_jax.model import Transformer, init_model

if TYPE_CHECKING:  # pragma: no cover - typing only
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass
class LoadedModel:
    """A model ready for inference: params cast to the compute dtype inside `model`."""

    model: Transformer  # the NNX module (params in `config.model.compute_dtype`)
    config: ExperimentConfig  # the run's config, compute_dtype set to the load dtype
    tokenizer: "Tokenizer | None"  # None when neither the run nor its data section provides one
    step: int | None  # checkpoint step (None for a model that did not come from a run)
    eos_id: int | None = None  # end-of-text id (the data section's eot_token), None if unknown
    # The compiled programs of `generate(loaded, ...)`, made on first use and reused by later calls.
    _generator: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model


def experiment_config_for(model_cfg: ModelConfig, *, name: str = "model",
                          tokenizer_path: str | None = None) -> ExperimentConfig:
    """An ExperimentConfig around a bare model config (a random or imported model), so that such a
    model travels as a LoadedModel like a trained run. Without `tokenizer_path` the data section
    names a BPE of the model's vocabulary size (which must then be >= 257)."""
    data = DataConfig(tokenizer=tokenizer_path or "bpe", seq_len=model_cfg.max_seq_len,
                      vocab_size=min(model_cfg.vocab_size, DataConfig().vocab_size))
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


def _available_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(c.name) for c in ckpt_dir.iterdir() if c.name.isdigit() and c.is_dir())


def restore_params(run_dir: str | Path, step: int | None = None) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(params as saved, the checkpoint's meta dict, step) of a run, without the optimizer state."""
    run_path = Path(run_dir)
    if not run_path.exists():
        raise FileNotFoundError(f"no run directory at {run_path.absolute()}")
    ckpt_dir = ckpt_lib.checkpoint_dir(run_path)
    steps = _available_steps(ckpt_dir)
    if not steps:
        raise FileNotFoundError(f"{run_path.absolute()} holds no checkpoint (expected {ckpt_dir}/<step>/)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {ckpt_dir}; available steps: {steps}")
    options = ocp.CheckpointManagerOptions(create=False, read_only=True)
    try:
        manager = ocp.CheckpointManager(ckpt_dir, options=options)
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        cfg = config_lib.from_dict(meta["config"])
    except Exception as err:  # Orbax raises many kinds; all mean the same to the user
        raise ValueError(f"checkpoint {ckpt_dir / str(step)} is unreadable or incomplete "
                         f"(meta/config): {type(err).__name__}: {err}") from err
    abstract = nnx.eval_shape(lambda: init_model(cfg.model, 0))
    abstract_params = nnx.to_pure_dict(nnx.split(abstract)[1])
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {"params": jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                                     abstract_params)}
    restore_args = jax.tree.map(lambda leaf: ocp.ArrayRestoreArgs(sharding=sharding), target)
    try:
        # partial_restore: only the params subtree is read; the optimizer state stays on disk.
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=True))).state
    except Exception as err:
        raise ValueError(f"checkpoint {ckpt_dir / str(step)}: cannot restore its parameters for the saved model "
                         f"config: {type(err).__name__}: {err}") from err
    finally:
        manager.close()
    return state["params"], meta, int(step)


def load_tokenizer_for_run(run_dir: str | Path, cfg: ExperimentConfig) -> "Tokenizer | None":
    """`run_dir/tokenizer.json`, else the tokenizer rebuilt from `cfg.data` (warns), else None (warns)."""
    from twell_jax import tokenizer as tokenizer_lib

    path = Path(run_dir) / TOKENIZER_FILE
    if path.is_file():
        return tokenizer_lib.load_tokenizer(str(path))
    warnings.warn(f"{path} not found: rebuilding the tokenizer from the run's data config "
                  f"(tokenizer={cfg.data.tokenizer!r}, source={cfg.data.source!r}); this needs the same "
                  "tokenizer file or BPE cache / corpus as at training time", stacklevel=3)
    try:
        if cfg.data.tokenizer != "bpe":
            return tokenizer_lib.load_tokenizer(cfg.data.tokenizer)
        from twell_jax import data as data_lib

        # The data pipeline's own cache lookup (and, on a miss, the same deterministic BPE training).
        files = data_lib._list_source_files(cfg.data)
        fingerprint = data_lib._source_fingerprint(cfg.data, files)

        def is_val() -> Any:
            num_documents = sum(1 for _ in data_lib.iter_documents(cfg.data, files))
            return data_lib._select_val_documents(num_documents, cfg.data)

        return data_lib._get_tokenizer(cfg.data, files, fingerprint, is_val)[0]
    except (ValueError, OSError, ImportError) as err:
        warnings.warn(f"no tokenizer for {run_dir}: {err}; generation then needs token ids", stacklevel=3)
        return None


def eos_id_of(tokenizer: "Tokenizer | None", cfg: ExperimentConfig) -> int | None:
    """The id of the data config's end-of-text token in `tokenizer` (None when absent)."""
    if tokenizer is None:
        return None
    token_id = tokenizer.token_to_id(cfg.data.eot_token)
    return None if token_id is None else int(token_id)


def load_run(run_dir: str | Path, step: int | None = None, dtype: str = "bfloat16") -> LoadedModel:
    """Load a trained run (a run dir or its checkpoints/ dir) for inference.

    `step`: the checkpoint step (default: the latest). `dtype`: compute dtype, and the dtype the
    parameters are cast to ("bfloat16" or "float32")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    params, meta, step = restore_params(run_dir, step)
    cfg = config_lib.from_dict(meta["config"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=dtype))
    run_path = ckpt_lib.checkpoint_dir(run_dir).parent
    # Per-layer active counts from the run's telemetry: "auto" then picks dense/sparse at trace time.
    cfg = with_auto_hints(cfg, run_path, echo=logger.info)
    tokenizer = load_tokenizer_for_run(run_path, cfg)
    if tokenizer is not None and tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
                         f"{cfg.model.vocab_size}: not this run's tokenizer")
    model = model_with_params(cfg.model, params, dtype)
    return LoadedModel(model=model, config=cfg, tokenizer=tokenizer, step=step, eos_id=eos_id_of(tokenizer, cfg))
