"""The `twell` command: train / eval / compare / generate / hf / configs (`twell COMMAND --help`).

    twell train --config tiny [--set model.n_layers=2 --set train.steps=50] [--out DIR] [--overwrite]
    twell train --out DIR --resume [--step N] [--set train.steps=500 optim.schedule_steps=500]
    twell train --config micro --init-from HF_DIR      (fine-tune a Hugging Face Llama checkpoint)
    twell eval --checkpoint runs/tiny-20250101-120000 [--step N] [--split all] [--json]
    twell eval --checkpoint RUN --tasks paper [--limit N]   (lm-eval downstream tasks: the `eval` extra)
    twell compare --config tiny [--l1 0 1e-5 2e-5] [--set ...] [--out DIR] [--resume] [--dry-run]
    twell generate --checkpoint RUN --prompt "def main(" [--max-new-tokens 64 --temperature 0.8 --top-k 50]
    twell hf export --checkpoint RUN --out DIR        twell hf import HF_DIR
    twell configs            (one line per preset)

Output: results on stdout (`--json`: one JSON document), everything else (progress, logs,
warnings) on stderr. Exit status: 0 done, 2 an error (one line naming the argument, field or file;
`--debug` adds the traceback), 130 / 143 stopped by SIGINT / SIGTERM (a training run checkpoints
first; a second one aborts it at once).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, TextIO

from twell_jax import __version__
from twell_jax import config as config_lib
from twell_jax import run_dir as run_dir_lib
from twell_jax.run_dir import checkpoint_arg

EXIT_ERROR = 2
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal number, as a shell reports it

EXAMPLES = {
    "train": """examples:
  twell train --config tiny                                   # -> runs/tiny-<timestamp>/
  twell train --config micro --set train.steps=50 --out runs/m
  twell train --out runs/m --resume --set train.steps=100     # continue it
  twell train --config ./my_config.json --print-config        # the resolved config, nothing run
  twell train --config tiny --dry-run                         # check config and data, write nothing
  twell train --config micro --init-from path/to/hf_llama --set data.source=corpus.jsonl""",
    "eval": """examples:
  twell eval --checkpoint runs/m                              # newest intact checkpoint, validation split
  twell eval --checkpoint runs/m/checkpoints/8 --json | python -m json.tool
  twell eval --checkpoint runs/m --set data.source=other.jsonl --split all   # all of another corpus
  twell eval --hf path/to/hf_llama --set data.source=corpus.jsonl --split all
  twell eval --checkpoint runs/m --tasks paper                # the paper's seven lm-eval tasks -> runs/m/lm_eval/
  twell eval --checkpoint runs/m --tasks arc_easy,piqa --limit 100 --set model.ffn_backend=dense
  twell eval --checkpoint runs/m --tasks my_tasks/quiz.yaml   # a local task (dataset_path: json)""",
    "compare": """examples:
  twell compare --config tiny --l1 1e-3 3e-3                  # dense relu_gated twin vs sparse twell at 2 L1
  twell compare --out runs/compare-tiny-X --resume            # continue an interrupted study
  twell compare --config micro --set train.steps=20 --json
  twell compare --out runs/compare-tiny-X --resume --tasks paper   # + the accuracy column (lm-eval)""",
    "generate": """examples:
  twell generate --checkpoint runs/m --prompt "def main(" --max-new-tokens 8
  twell generate --checkpoint runs/m --prompt "import" --num-samples 3 --temperature 0.8 --json
  twell generate --checkpoint runs/m --prompt "$(cat long.py)" --truncate-prompt left --stop "\\n\\n"
  twell generate --hf path/to/hf_llama --prompt "def main(" """,
    "hf": """examples:
  twell hf import path/to/hf_llama                            # check and describe a Llama checkpoint
  twell hf export --checkpoint runs/m --out exported/         # config.json, generation_config.json,
                                                              # model.safetensors, tokenizer.json""",
    "configs": """examples:
  twell configs""",
}


# ----------------------------------------------------------------------------- configs and runs


def _load_config(name: str, overrides: list[str]) -> config_lib.ExperimentConfig:
    """A preset by name, or a config.json file (a path ending in .json, e.g. a run's saved config),
    with `overrides` applied."""
    if name.endswith(".json") or os.sep in name:
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--config {name}: no such file (a preset name or a config .json)")
        try:
            values = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"--config {path}: not valid JSON ({err})") from None
        if not isinstance(values, dict):
            raise ValueError(f"--config {path}: expected a JSON object, got {type(values).__name__}")
        try:
            cfg = config_lib.from_dict(values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--config {path}: {err}") from None
    else:
        from twell_jax.configs import get_config

        cfg = get_config(name)
    return config_lib.apply_overrides(cfg, overrides)


def describe_preset(name: str) -> str:
    """One line: the preset's model, data and schedule (read from the preset itself)."""
    from twell_jax.configs import get_config

    cfg = get_config(name)
    m, d, t = cfg.model, cfg.data, cfg.train
    source = "synthetic tokens" if d.is_synthetic else f"{d.source} ({d.tokenizer} tokenizer)"
    return (f"{name:<6} {m.n_layers} layers, d_model {m.d_model}, d_ff {m.d_ff}, {m.heads_text()}, vocab "
            f"{m.vocab_size}, seq {d.seq_len}; {m.ffn_kind} FFN ({m.ffn_backend}), L1 {cfg.sparsity.l1_coef:g}; "
            f"{t.steps} steps x {t.global_batch} sequences; data: {source}")


def check_resumable_overrides(overrides: list[str]) -> None:
    """Only config.RESUMABLE_FIELDS may be set for a run that exists (resume, eval)."""
    fixed = sorted({item.split("=", 1)[0].strip() for item in overrides} - config_lib.RESUMABLE_FIELDS)
    if "data.val_fraction" in fixed:
        raise ValueError("--set data.val_fraction: cannot change for an existing run (its validation split was "
                         "drawn when it was trained); to evaluate on more text use `twell eval --split all` "
                         "(with --set data.source=<corpus> for another corpus), or lower train.eval_batch_size")
    if fixed:
        raise ValueError(f"--set {', '.join(fixed)}: cannot change for an existing run (its saved config.json is "
                         f"the source of truth); fields that may change: "
                         f"{', '.join(sorted(config_lib.RESUMABLE_FIELDS))}")


def resume_config(run_dir: Path, preset: str | None, overrides: list[str]) -> config_lib.ExperimentConfig:
    """The saved config of the run in `run_dir` with `overrides` (resumable fields only) applied."""
    from twell_jax.training import checkpoint as ckpt_lib

    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume: no run directory at {run_dir.absolute()} (check --out)")
    check_resumable_overrides(overrides)
    saved = ckpt_lib.load_run_config(run_dir)
    if preset is not None and preset != saved.name:
        raise ValueError(f"--config {preset!r}: the run in {run_dir} was trained with {saved.name!r}; leave out "
                         "--config when resuming (the run's saved config is used)")
    return config_lib.apply_overrides(saved, overrides)


def _imported(hf_dir: str, *, dtype: str, ffn_kind: str | None = None, ffn_backend: str = "auto",
              max_seq_len: int | None = None) -> Any:
    from twell_jax.inference.hf import import_hf

    return import_hf(hf_dir, dtype=dtype, ffn_kind=ffn_kind, ffn_backend=ffn_backend, max_seq_len=max_seq_len)


def _override_keys(overrides: list[str]) -> set[str]:
    return {item.split("=", 1)[0].strip() for item in overrides}


def _with_imported_model(cfg: config_lib.ExperimentConfig, imported: Any, overrides: list[str],
                         flag: str) -> config_lib.ExperimentConfig:
    """`cfg` with the imported checkpoint's architecture (its weights fix it) and tokenizer."""
    model = imported.config.model
    architecture = config_lib.ARCHITECTURE_FIELDS  # the weights fix these: a --set may not change them
    changed = sorted(f"model.{f}" for f in architecture
                     if f"model.{f}" in _override_keys(overrides) and getattr(cfg.model, f) != getattr(model, f))
    if changed:
        raise ValueError(f"--set {', '.join(changed)}: {flag} fixes these (the checkpoint's weights have its "
                         f"shapes: {', '.join(f'{f}={getattr(model, f)}' for f in architecture)})")
    keep_seq = "model.max_seq_len" in _override_keys(overrides)
    kind = model.ffn_kind
    if "model.ffn_kind" in _override_keys(overrides) and cfg.model.ffn_kind != kind:
        # The weights fix the activation; the FFN kinds of that activation share one layout.
        activation = config_lib.FFN_KIND_TABLE[kind].activation
        allowed = sorted(config_lib.ffn_kinds_with(activation))
        if cfg.model.ffn_kind not in allowed:
            raise ValueError(f"--set model.ffn_kind={cfg.model.ffn_kind}: {flag}'s checkpoint has the activation "
                             f"{activation!r}, so the FFN kind is one of {allowed}")
        kind = cfg.model.ffn_kind
    new_model = dataclasses.replace(cfg.model, **{f: getattr(model, f) for f in architecture},
                                    ffn_kind=kind,
                                    max_seq_len=cfg.model.max_seq_len if keep_seq else model.max_seq_len)
    data = cfg.data
    if imported.tokenizer is not None:
        _check_imported_tokenizer(data, imported, flag)
        data = dataclasses.replace(data, tokenizer=imported.config.data.tokenizer)
    elif not data.is_synthetic:
        raise ValueError(f"{flag}: the checkpoint has no tokenizer.json, so text cannot be tokenized for it; add "
                         "its tokenizer.json to the directory, or use --set data.source=synthetic")
    sparsity = cfg.sparsity
    if not new_model.kind.l1:
        sparsity = sparsity.without_l1()  # a dense kind trains without L1
    return dataclasses.replace(cfg, model=new_model, data=data, sparsity=sparsity)


def _check_imported_tokenizer(data: config_lib.DataConfig, imported: Any, flag: str) -> None:
    """A tokenizer.json the config names (data.tokenizer, not "bpe") must be the imported
    checkpoint's own (equal `tokenizer_hash`es): its weights were trained with that one."""
    from twell_jax.data import tokenizer as tokenizer_lib

    own = imported.config.data.tokenizer
    if data.is_synthetic or data.tokenizer == "bpe":
        return  # no tokenizer named
    if Path(data.tokenizer).expanduser().resolve() == Path(own).resolve():
        return  # the checkpoint's own file
    given = tokenizer_lib.resolve_tokenizer_path(data.tokenizer)
    tokenizer_lib.check_same_tokenizer(
        tokenizer_lib.tokenizer_file_hash(given), f"data.tokenizer={data.tokenizer}",
        imported.tokenizer_hash or tokenizer_lib.tokenizer_hash(imported.tokenizer),
        f"the tokenizer of {flag}'s checkpoint ({own})",
        "leave data.tokenizer out: the checkpoint's own tokenizer is used")


# ----------------------------------------------------------------------------- output


def _emit(out: TextIO, args: argparse.Namespace, result: Any, human: Callable[[], str]) -> None:
    """A command's result on stdout: one JSON document with --json, else the human-readable text."""
    if getattr(args, "json", False):
        out.write(json.dumps(result, indent=2) + "\n")
    else:
        out.write(human() + "\n")
    out.flush()


def _param_count(model_cfg: config_lib.ModelConfig) -> int:
    import jax
    from flax import nnx

    from twell_jax.model import init_model

    state = nnx.state(nnx.eval_shape(lambda: init_model(model_cfg, 0)))
    return int(sum(leaf.size for leaf in jax.tree.leaves(state)))


# ----------------------------------------------------------------------------- commands


def _native_output_to_stderr(result_out: TextIO) -> TextIO:
    """A multi-process run: the collectives' native library (Gloo, on CPUs) prints its own lines to
    file descriptor 1, among the results. Point that descriptor at stderr and return a stream on a
    copy of the original stdout for the results (`result_out` itself where it has no descriptor)."""
    try:
        fd = result_out.fileno()
    except (AttributeError, OSError, ValueError):
        return result_out
    result_out.flush()
    copy = os.dup(fd)
    os.dup2(sys.stderr.fileno(), fd)
    return os.fdopen(copy, "w")


# Arguments each process of a multi-process launch may set for itself: they change neither what is
# computed nor the result (a host's own compilation cache, a traceback on one process).
_PROCESS_LOCAL_ARGUMENTS = frozenset({"debug", "compile_cache"})


def _join_processes(name: str, args: argparse.Namespace, result_out: TextIO) -> TextIO:
    """A multi-process launch of `twell NAME` (docs/parallel.md; nothing happens in one process):
    join the others, point the collectives' native output at stderr, and refuse on every process,
    naming the flags, unless every process was given the same arguments (they read the same
    checkpoint or plan, compile the same programs and stop together). Returns the stream for the
    results (a copy of stdout in a multi-process run)."""
    from twell_jax.training import parallel

    # Multi-host launch (SLURM, Open MPI, JAX_COORDINATOR_ADDRESS): before anything touches devices.
    parallel.initialize_distributed()
    if _process_and_count()[1] == 1:
        return result_out
    result_out = _native_output_to_stderr(result_out)
    parallel.check_like_lead(
        f"arguments of twell {name}", {key: value for key, value in vars(args).items() if key not in _PROCESS_LOCAL_ARGUMENTS},
        lambda lead, mine: "; ".join(f"--{key.replace('_', '-')} {mine.get(key)!r} (process 0: {lead.get(key)!r})"
                                     for key in sorted(set(lead) | set(mine)) if mine.get(key) != lead.get(key)),
        "the processes were started with different arguments", f"start every process with the same `twell {name}` command")
    return result_out


def _process_and_count() -> tuple[int, int]:
    """(this process's index, the process count) once `_join_processes` ran; (0, 1) without a
    multi-process launch, asked without starting JAX's backend (a --dry-run need not claim a GPU)."""
    from twell_jax.training import parallel

    if parallel.distributed_request() is None:
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def _refuse_tasks_in_multi_process(instead: str) -> None:
    """lm-eval tasks (--tasks) in a multi-process launch: one line on every process, saying why and
    `instead` (what to run). The adapter (inference/harness.py) drives the model from one process's
    loop over the tasks' requests: it neither splits them over processes nor gathers their answers."""
    count = _process_and_count()[1]
    if count > 1:
        raise ValueError(f"--tasks: lm-eval tasks run in one process (the adapter drives the model from one "
                         f"process's loop over the requests and does not split them over {count} processes); "
                         f"{instead}")


def _result_on_process_0(name: str) -> bool:
    """True where the command's result is printed: one process, or process 0 of several (the others
    say so on stderr)."""
    index, count = _process_and_count()
    if index == 0:
        return True
    print(f"[twell] {name}: process {index} of {count} done; process 0 prints the result")
    return False


def _train(args: argparse.Namespace, result_out: TextIO) -> None:
    from twell_jax.training import parallel
    from twell_jax.training.train import train

    # Multi-host launch (SLURM, Open MPI, JAX_COORDINATOR_ADDRESS): before anything touches devices.
    parallel.initialize_distributed()
    if parallel.multi_process():
        result_out = _native_output_to_stderr(result_out)
    if args.step is not None and not args.resume:
        raise ValueError("--step picks the checkpoint to continue from; it needs --resume")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: pick one")
    if args.resume and args.init_from:
        raise ValueError("--init-from starts a new run from a Hugging Face checkpoint; --resume continues one: "
                         "pick one")
    from twell_jax import compile_cache

    imported = None
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out DIR (the run directory to continue)")
        out = Path(args.out)
        cfg = resume_config(out, args.config, args.set)
        print(f"[twell] train: resuming {out.absolute()} (config {cfg.name!r})"
              + (f" with overrides {args.set}" if args.set else "") + compile_cache.describe())
    else:
        cfg = _load_config(args.config or "tiny", args.set)
        if args.init_from:
            kind = cfg.model.ffn_kind if "model.ffn_kind" in _override_keys(args.set) else None
            context = cfg.model.max_seq_len if "model.max_seq_len" in _override_keys(args.set) else None
            imported = _imported(args.init_from, dtype="float32", ffn_kind=kind, ffn_backend=cfg.model.ffn_backend,
                                 max_seq_len=context)  # (a Mistral sliding window bounds the context)
            cfg = _with_imported_model(cfg, imported, args.set, "--init-from")
        out = Path(args.out) if args.out else None  # None: train() reserves a new runs/<name>-<time>
        print(f"[twell] train: config {cfg.name!r}" + (f" with overrides {args.set}" if args.set else "")
              + (f", initialised from {args.init_from}" if imported is not None else "")
              + compile_cache.describe())
    if args.print_config:
        result_out.write(config_lib.to_json(cfg) + "\n")
        return
    if args.dry_run:
        _dry_run(args, cfg, out, result_out)
        return
    if imported is None:
        result = train(cfg, out, resume=args.resume, resume_step=args.step, overwrite=args.overwrite)
    else:
        from twell_jax.model import split_model
        from twell_jax.training.train import InitFromParams

        result = train(cfg, out, trainer_cls=InitFromParams, init_params=split_model(imported.model)[1],
                       overwrite=args.overwrite)
    summary = {k: result.summary[k] for k in ("val_loss", "val_perplexity", "val_l0_mean", "val_sparsity",
                                              "tokens_per_s")}
    summary["run_dir"] = str(result.run_dir.absolute())
    _emit(result_out, args, summary, lambda: (
        f"{result.run_dir}: validation loss {summary['val_loss']:.4f}, perplexity {summary['val_perplexity']:.2f}, "
        f"{summary['val_l0_mean']:.1f} active FFN neurons/token ({100 * summary['val_sparsity']:.1f}% zero)"))


def _dry_run(args: argparse.Namespace, cfg: config_lib.ExperimentConfig, target: Path | None, out: TextIO) -> None:
    """Check what a run would do (config, data, batch layout over the devices) and write no run."""
    import jax

    from twell_jax.training.shared_data import build_experiment_data
    from twell_jax.training import parallel
    from twell_jax.training.preflight import (check_fits_memory, check_vocab, checked_run_config, describe_memory,
                                              schedule_warnings, training_layout)

    # The run's own checks (schedule, op config, resumable checkpoint, what --out holds, the memory the
    # model needs): a dry run that passes is a run that starts. Without --out the run gets a new directory.
    cfg = checked_run_config(cfg, target, resume=args.resume, overwrite=args.overwrite)[0]
    tc = cfg.train
    devices = parallel.mesh_size(parallel.make_mesh(tc.num_devices))
    accum = parallel.check_batch_layout(tc.global_batch, tc.micro_batch, devices)
    layout = training_layout(cfg, devices)
    estimate, available, memory_source = check_fits_memory(cfg, devices, layout)
    for warning in schedule_warnings(cfg):
        print(warning)
    # The corpus, tokenizer and splits, checked as training checks them (a resume reads the run's tokenizer).
    data = build_experiment_data(run_dir_lib.with_saved_tokenizer(cfg, target) if args.resume else cfg)
    check_vocab(cfg, data.vocab_size, print)
    state = ("continues the run there" if args.resume else "new (a fresh runs/<name>-<timestamp>)" if target is None
             else "holds a twell run, which --overwrite replaces" if run_dir_lib.holds_a_run(target) else "new")
    plan = {"config": cfg.name, "run_dir": str(target.absolute()) if target else None, "run_dir_state": state,
            "parameters": _param_count(cfg.model), "steps": tc.steps,
            "tokens_per_step": tc.global_batch * cfg.seq_len, "devices": devices,
            "platform": jax.devices()[0].platform, "accumulation_steps": accum, "sharding": layout.describe(),
            "train_sequences": data.num_train_sequences, "val_sequences": data.num_val_sequences,
            "vocab_size": data.vocab_size, "memory_estimate_bytes": estimate, "device_memory_bytes": available,
            "device_memory_source": memory_source}
    device_memory = (f"{available / 2**30:.3g} GiB" if available is not None else "unknown") + f" ({memory_source})"

    def human() -> str:
        lines = [f"  {k}: {v}" for k, v in plan.items() if not k.startswith(("memory_", "device_memory_"))]
        lines.append(f"  memory estimate: {describe_memory(estimate)}; device memory {device_memory}")
        return "dry run (nothing written):\n" + "\n".join(lines)

    _emit(out, args, plan, human)


# What the named corpora of data.source are (DataConfig.source), for messages that name one.
_CORPUS_WORDS = {"stdlib": "the Python standard library's .py files",
                 config_lib.SYNTHETIC_SOURCE: "random token ids",
                 "installed": "the standard library and the installed packages' sources and docs"}


def _eval(args: argparse.Namespace, out: TextIO) -> None:
    from twell_jax.training import parallel
    from twell_jax.training.evaluate import evaluate_checkpoint, evaluate_model

    out = _join_processes("eval", args, out)
    if (args.checkpoint is None) == (args.hf is None):
        raise ValueError("give one of --checkpoint RUN (a trained run) or --hf DIR (a Hugging Face checkpoint)")
    if args.tasks is not None:
        _refuse_tasks_in_multi_process("start `twell eval --tasks` as a single process (no "
                                       "JAX_COORDINATOR_ADDRESS, SLURM or mpirun launch)")
        _eval_tasks(args, out)
        return
    given = [flag for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                                      ("--batch-size", args.batch_size), ("--dtype", args.dtype)) if value is not None]
    if given:
        raise ValueError(f"{given[0]} applies to --tasks (lm-eval tasks); the validation loss takes none")
    args.split = args.split or "val"
    if args.checkpoint is not None:
        from twell_jax.training import checkpoint as ckpt_lib

        check_resumable_overrides(args.set)
        run_dir, step = checkpoint_arg(args.checkpoint, args.step)
        result = evaluate_checkpoint(run_dir, step=step, overrides=args.set, split=args.split)
        corpus = config_lib.apply_overrides(ckpt_lib.load_run_config(run_dir), args.set).data.source
    else:
        if args.step is not None:
            raise ValueError("--step picks a checkpoint of a run; a --hf checkpoint has no steps")
        from twell_jax.model import split_model

        with parallel.all_or_none("importing the Hugging Face checkpoint"):  # every process reads it, or none goes on
            imported = _imported(args.hf, dtype="float32")
            cfg = config_lib.apply_overrides(imported.config, args.set)
            cfg = _with_imported_model(cfg, imported, args.set, "--hf")
        corpus = cfg.data.source
        if "data.source" not in _override_keys(args.set):  # an imported model has no corpus of its own
            print(f"[twell] eval: no --set data.source given: evaluating on the default corpus {corpus!r} "
                  f"({_CORPUS_WORDS.get(corpus, 'the config default')}); --set data.source=PATH for your text")
        limit = "train.eval_batches" in _override_keys(args.set)
        result = evaluate_model(cfg, split_model(imported.model)[1], split=args.split, limit_batches=limit)
    result["corpus"] = corpus
    if not _result_on_process_0("eval"):
        return
    weights = f"step {result['step']}" if result["step"] is not None else "imported weights"
    _emit(out, args, result, lambda: (
        f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  tokens {int(result['tokens'])}  "
        f"active FFN neurons/token {result['l0_mean']:.1f}  sparsity {100 * result['sparsity']:.1f}%  "
        f"{weights}  split {result['split']}  corpus {corpus}"))


def _eval_tasks(args: argparse.Namespace, out: TextIO) -> None:
    """`twell eval --tasks`: lm-eval tasks instead of the validation loss."""
    if args.split is not None:
        raise ValueError("--split picks the data of the validation loss; --tasks evaluates lm-eval tasks: pick one")
    for flag, value, least in (("--limit", args.limit, 1), ("--num-fewshot", args.num_fewshot, 0),
                               ("--batch-size", args.batch_size, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    from twell_jax.inference import lm_eval_harness

    harness = lm_eval_harness()
    selection = harness.select_tasks(args.tasks)
    loaded_tasks = harness.load_tasks(selection)  # the tasks' data (a download) before the model
    options = dict(batch_size=args.batch_size or harness.DEFAULT_BATCH_SIZE, limit=args.limit,
                   num_fewshot=args.num_fewshot, loaded_tasks=loaded_tasks)
    if args.checkpoint is not None:
        check_resumable_overrides(args.set)
        run_dir, step = checkpoint_arg(args.checkpoint, args.step)
        results, path = harness.evaluate_run(run_dir, selection, step=step, dtype=args.dtype, overrides=args.set,
                                             **options)
        step = results["config"].get("twell_step")
    else:
        if args.step is not None:
            raise ValueError("--step picks a checkpoint of a run; a --hf checkpoint has no steps")
        if args.set:
            raise ValueError("--set with --hf --tasks: the imported model runs as imported (its FFN backend: auto)")
        loaded = _imported(args.hf, dtype=args.dtype or "float32")
        results, path, step = harness.evaluate_loaded(loaded, selection, **options), None, None
    summary = harness.summarize(results)
    document = {"tasks": summary["tasks"], "mean_acc": summary["mean_acc"], "step": step,
                "results_file": str(path.absolute()) if path is not None else None, "lm_eval": results}
    _emit(out, args, document, lambda: harness.format_table(results)
          + (f"\nlm-eval results: {path}" if path is not None else ""))


def _compare(args: argparse.Namespace, out: TextIO) -> None:
    from twell_jax.compare import PLAN_FILE, main_from_args, markdown_table

    out = _join_processes("compare", args, out)
    if args.tasks is not None:
        _refuse_tasks_in_multi_process("train the study without --tasks, then add the accuracy column with "
                                       "`twell compare --out DIR --resume --tasks ...` started as a single process")
    if args.print_config:
        if args.resume:  # the base config would be tiny's, not the study's
            raise ValueError(f"--print-config shows a new study's config; the configs of the comparison being "
                             f"resumed are in {Path(args.out or 'DIR') / PLAN_FILE}")
        cfg = _load_config(args.config or "tiny", args.set)
        if _result_on_process_0("compare"):
            out.write(config_lib.to_json(cfg) + "\n")
        return
    report = main_from_args(args, _load_config)
    if not _result_on_process_0("compare"):
        return
    if report.get("dry_run"):
        if args.json:  # the plan (without --json it was printed on stderr)
            _emit(out, args, report, str)
        return
    _emit(out, args, report, lambda: markdown_table(report["runs"]))


def _hf(args: argparse.Namespace, out: TextIO) -> None:
    if args.hf_command == "import":
        imported = _imported(args.path, dtype="float32")
        cfg = imported.config
        result = {"path": str(Path(args.path).absolute()), "parameters": _param_count(cfg.model),
                  "tokenizer": cfg.data.tokenizer if imported.tokenizer is not None else None,
                  "eos_id": imported.eos_id, "model": config_lib.to_dict(cfg.model)}
        m = cfg.model
        _emit(out, args, result, lambda: (
            f"{args.path}: a {m.n_layers}-layer Llama, d_model {m.d_model}, d_ff {m.d_ff}, {m.heads_text()}, vocab "
            f"{m.vocab_size}, context {m.max_seq_len}, rope_theta {m.rope_theta:g}"
            f"{'' if m.rope_scaling is None else ' (llama3 scaling x' + format(m.rope_scaling['factor'], 'g') + ')'}"
            f"{'' if m.tie_embeddings else ', untied lm_head'} -> ffn_kind {m.ffn_kind}; "
            f"{result['parameters']} parameters, all finite; tokenizer: {result['tokenizer'] or 'none'}\n"
            f"use it with: twell eval --hf {args.path} ... | twell generate --hf {args.path} ... | "
            f"twell train --init-from {args.path} ..."))
    else:  # export
        from twell_jax.inference.hf import check_export_dir, export_hf
        from twell_jax.inference.load import load_run

        run_dir, step = checkpoint_arg(args.checkpoint, args.step)
        check_export_dir(args.out)  # before the checkpoint is loaded
        loaded = load_run(run_dir, step=step, dtype="float32")
        shard = {} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}
        written = export_hf(loaded, args.out, dtype=args.dtype, **shard)
        files = sorted(p.name for p in written.iterdir())
        _emit(out, args, {"out": str(written.absolute()), "step": loaded.step, "files": files},
              lambda: f"exported {run_dir} step {loaded.step} to {written}: {', '.join(files)}")


def _configs(args: argparse.Namespace, out: TextIO) -> None:
    from twell_jax.configs import list_configs

    names = list_configs()
    if args.json:
        _emit(out, args, {name: describe_preset(name) for name in names}, str)
    else:
        out.write("".join(describe_preset(name) + "\n" for name in names))


def _generate(args: argparse.Namespace, out: TextIO) -> None:
    from twell_jax.inference.cli import run_generate

    run_generate(args, out)


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], None]] = {
    "train": _train, "eval": _eval, "compare": _compare, "generate": _generate, "hf": _hf, "configs": _configs}


# ----------------------------------------------------------------------------- parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twell", description="Activation-sparse transformer language models in JAX: train, evaluate, "
        "compare with the dense twin, generate, and convert to and from Hugging Face Llama checkpoints.",
        epilog="Results go to stdout (--json: one JSON document), logs and progress to stderr. Exit status: 0 "
               "done, 2 error (one line; --debug for the traceback), 130/143 interrupted by SIGINT/SIGTERM.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"twell {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of an error")
    common.add_argument("--compile-cache", default=None, metavar="DIR|off",
                        help="JAX's persistent compilation cache: a directory, or 'off' (default: $TWELL_COMPILE_CACHE, "
                             "else $JAX_COMPILATION_CACHE_DIR, else ~/.cache/twell_jax/xla); a second start of the "
                             "same program loads it instead of compiling")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=description, epilog=EXAMPLES[name],
                              parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter)

    def add_set(p: argparse.ArgumentParser, help_text: str) -> None:
        # action="extend": `--set a=1 --set b=2` keeps both (a plain nargs="*" keeps only the last).
        p.add_argument("--set", nargs="+", action="extend", default=[], metavar="SECTION.FIELD=VALUE",
                       help=help_text)

    def add_json(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print the result as one JSON document on stdout")

    def add_model_source(p: argparse.ArgumentParser, *, hf_help: str | None) -> None:
        """--checkpoint and --step (a trained run), and --hf (a Hugging Face checkpoint) where given."""
        p.add_argument("--checkpoint", default=None, required=hf_help is None,
                       help="run directory, its checkpoints/ dir, or one step's dir (RUN/checkpoints/8)")
        if hf_help is not None:
            p.add_argument("--hf", default=None, metavar="HF_DIR", help=hf_help)
        p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest intact one)")

    p_train = command("train", "train a model (or continue one with --resume)",
                      "Train a model from a preset or a config .json into a run directory (config, checkpoints, "
                      "metrics, summary), continue a run with --resume, or fine-tune a Hugging Face Llama "
                      "checkpoint with --init-from.")
    p_train.add_argument("--config", default=None, help="preset name (see `twell configs`; default tiny) or a "
                         "config .json (e.g. a run's config.json); not needed with --resume")
    add_set(p_train, "config overrides, e.g. --set model.n_layers=2 train.steps=50 (repeatable)")
    p_train.add_argument("--out", default=None, help="run directory (default runs/<name>-<timestamp>)")
    p_train.add_argument("--resume", action="store_true",
                         help="continue the run in --out from its newest intact checkpoint, with its saved config")
    p_train.add_argument("--step", type=int, default=None, help="with --resume: the checkpoint step to continue from")
    p_train.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p_train.add_argument("--init-from", default=None, metavar="HF_DIR",
                         help="start from a Hugging Face Llama checkpoint's weights (its architecture and "
                              "tokenizer; optimizer, schedule and data from --config / --set)")
    p_train.add_argument("--print-config", action="store_true",
                         help="print the resolved config as JSON and exit (nothing is trained or written)")
    p_train.add_argument("--dry-run", action="store_true",
                         help="check the config, devices and data, print the plan, and write no run")
    add_json(p_train)

    p_eval = command("eval", "validation loss + perplexity of a checkpoint, or lm-eval tasks",
                     "Evaluate a trained run's checkpoint (or a Hugging Face checkpoint with --hf): loss, "
                     "perplexity, per-layer active FFN neurons, on the run's validation split or a whole corpus; "
                     "or, with --tasks, accuracy on lm-evaluation-harness tasks (pip install 'twell-jax[eval]').")
    add_model_source(p_eval, hf_help="evaluate a Hugging Face Llama checkpoint")
    p_eval.add_argument("--tasks", default=None, metavar="NAMES",
                        help="evaluate lm-eval tasks instead of the validation loss: comma-separated task (group, "
                             "tag) names, `paper` (arc_easy, arc_challenge, hellaswag, openbookqa, piqa, winogrande, "
                             "commonsense_qa), or a local task YAML file or directory; lm-eval's results JSON goes "
                             "to RUN/lm_eval/ and a table to stdout")
    p_eval.add_argument("--limit", type=int, default=None, metavar="N",
                        help="with --tasks: at most N documents per task (a quick look, not the task's score)")
    p_eval.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                        help="with --tasks: K examples in each prompt (default: each task's own, else 0)")
    p_eval.add_argument("--batch-size", type=int, default=None, metavar="B",
                        help="with --tasks: sequences per forward and prompts per generation call (default 16)")
    p_eval.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="with --tasks: compute dtype (default: the run's model.compute_dtype; float32 for --hf)")
    p_eval.add_argument("--split", choices=("val", "all"), default=None,
                        help="val (default): the validation split (data.val_fraction of the corpus, drawn at training "
                             "time); all: every full batch of the whole corpus (e.g. another corpus given with "
                             "--set data.source=...; train.eval_batches limits it only when set)")
    add_set(p_eval, "eval-time overrides, e.g. train.eval_batches=32 data.source=other.jsonl (repeatable)")
    add_json(p_eval)

    p_compare = command("compare", "train a dense twin and sparse twell models (several L1), compare",
                        "Train the dense twin (no L1) and sparse twell models at each --l1 on the same tokens in "
                        "the same order, then print the comparison table and write compare.png / .md / .json. "
                        "An interrupted study continues with --resume.")
    p_compare.add_argument("--config", default=None, help="preset name (see `twell configs`) or a config .json "
                           "(default tiny; not with --resume)")
    add_set(p_compare, "config overrides for every run (repeatable)")
    p_compare.add_argument("--out", default=None, help="output directory (default runs/compare-<name>-<timestamp>)")
    p_compare.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    from twell_jax.compare import add_arguments as add_compare_arguments

    add_compare_arguments(p_compare)
    add_json(p_compare)

    p_gen = command("generate", "continue prompts with a trained run (KV cache, streamed)",
                    "Continue prompts with a trained run or a Hugging Face checkpoint: greedy or sampled, a "
                    "single prompt streamed as it is generated.")
    add_model_source(p_gen, hf_help="generate with a Hugging Face Llama checkpoint")
    p_gen.add_argument("--prompt", action="append", required=True,
                       help="prompt text; repeat for a batch (a single prompt and sample is streamed)")
    p_gen.add_argument("--max-new-tokens", type=int, default=64)
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p_gen.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p_gen.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus cut")
    p_gen.add_argument("--seed", type=int, default=0)
    p_gen.add_argument("--num-samples", type=int, default=1,
                       help="continuations per prompt (sampled: needs --temperature > 0)")
    p_gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop a continuation at this text, which is not printed (repeatable; escapes such "
                            "as \\n are decoded)")
    p_gen.add_argument("--truncate-prompt", choices=("error", "left"), default="error",
                       help="a prompt that leaves no room for --max-new-tokens in the context: error (default), "
                            "or left: keep its last tokens")
    p_gen.add_argument("--decode-chunk", type=int, default=config_lib.DEFAULT_DECODE_CHUNK, metavar="N",
                       help=f"decode steps per device call (default {config_lib.DEFAULT_DECODE_CHUNK}): tokens reach "
                            "the host, and the stream, N at a time; 1 = one call per token")
    p_gen.add_argument("--decode-layout", choices=("transposed", "stored"), default=None,
                       help="decode.transposed for this call: transposed = the decode kernels read "
                            "output-major copies of q/k/v, the attention output and W_down (faster; those weights "
                            "held twice), stored = the weights as trained, held once (default: the run's config; "
                            "runs saved before 2026-11-24 stored, later ones transposed)")
    p_gen.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add_json(p_gen)

    p_hf = command("hf", "import / export Hugging Face Llama checkpoints",
                   "Hugging Face LlamaForCausalLM checkpoints: `import` checks one and describes the model it "
                   "becomes (then: eval --hf, generate --hf, train --init-from); `export` writes a run's "
                   "checkpoint in that layout.")
    hf_sub = p_hf.add_subparsers(dest="hf_command", required=True, metavar="{import,export}")
    p_import = hf_sub.add_parser("import", parents=[common], help="check a Llama checkpoint and describe it",
                                 epilog=EXAMPLES["hf"], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Read a Llama checkpoint directory (config.json, model.safetensors "
                                 "or shards, tokenizer.json) with every check an import makes.")
    p_import.add_argument("path", help="the checkpoint directory")
    add_json(p_import)
    p_export = hf_sub.add_parser("export", parents=[common], help="write a run's checkpoint as a Llama checkpoint",
                                 epilog=EXAMPLES["hf"], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Write config.json, generation_config.json, model.safetensors and "
                                 "tokenizer.json that transformers.LlamaForCausalLM loads.")
    add_model_source(p_export, hf_help=None)
    p_export.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p_export.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p_export.add_argument("--max-shard-bytes", type=int, default=None, metavar="N",
                          help="weights above N bytes are written as shards of at most N bytes with a "
                               "model.safetensors.index.json (default 5e9, transformers' 5GB)")
    add_json(p_export)

    p_configs = command("configs", "list the presets, one line each",
                        "List the presets: model shape, FFN, L1, schedule and data of each.")
    add_json(p_configs)
    return parser


# ----------------------------------------------------------------------------- errors


def _root_cause(err: BaseException) -> BaseException:
    """The first exception of `err`'s chain (what it was raised from or while handling)."""
    seen = {id(err)}
    while (err.__cause__ or err.__context__) is not None and id(err.__cause__ or err.__context__) not in seen:
        err = err.__cause__ or err.__context__
        seen.add(id(err))
    return err


def describe_error(err: BaseException) -> str:
    """One line for an error: the file of an OSError (also one wrapped by Orbax or TensorStore), the
    message of our own errors, the type and first line of anything else."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, (ValueError, FileNotFoundError, FileExistsError, FloatingPointError)) and lines \
            and _raised_by_twell(err):
        return " ".join(lines)  # our own errors: the whole message, which names the argument, field or file
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:  # an OSError anywhere in the chain names the file
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.strerror:
            where = cause.filename if cause.filename is not None else ""
            return f"{where}: {cause.strerror}" if where else cause.strerror
        # `raise ... from None` hides the context: so does this walk.
        cause = cause.__cause__ if cause.__cause__ is not None or cause.__suppress_context__ else cause.__context__
    text = lines[0] if lines else ""  # a library's (Orbax, TensorStore, ...): its first line
    if len(text) > 400:
        text = text[:400] + " ..."
    # A system error spelled out deeper in a long message (TensorStore reports errno text so).
    system = next((phrase for phrase in _SYSTEM_ERRORS if phrase in str(err) and phrase not in text), None)
    if system:
        text += f" [{system}]"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


_SYSTEM_ERRORS = ("No space left on device", "Read-only file system", "Permission denied", "Disk quota exceeded")


def _raised_by_twell(err: BaseException) -> bool:
    """Whether `err` was raised by this package's code (its kernels and presets included)."""
    import twell_jax

    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    where = os.path.abspath(tb.tb_frame.f_code.co_filename)
    package = os.path.abspath(twell_jax.__path__[0])
    # In a source checkout the kernels and presets are top-level folders beside the package.
    roots = [package] + [os.path.join(os.path.abspath(entry), folder) for entry in twell_jax.__path__[1:]
                         for folder in ("pallas_kernels", "configs")]
    return any(where.startswith(root + os.sep) for root in roots)


# The commands that compile programs, so use the persistent compilation cache (twell_jax/compile_cache.py).
CACHED_COMMANDS = ("train", "compare", "eval", "generate")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    name = args.command if args.command != "hf" else f"hf {args.hf_command}"
    result_out = sys.stdout
    from twell_jax.training import parallel

    # Before any command touches a device: JAX's allocator may use most of each GPU (the presets' measured
    # configurations need more than JAX's default 75%; the user's own allocator settings stand).
    parallel.prepare_process()
    if args.command in CACHED_COMMANDS:
        from twell_jax import compile_cache

        _, warning = compile_cache.configure(getattr(args, "compile_cache", None))  # shown in the start-up line
        if warning:
            print(f"twell {name}: warning: {warning}", file=sys.stderr)
    try:
        # Everything a command prints while it runs is a log line: stderr. Its result goes to stdout.
        with contextlib.redirect_stdout(sys.stderr):
            COMMANDS[args.command](args, result_out)
    except KeyboardInterrupt:
        print(f"twell {name}: interrupted (Ctrl-C); nothing more was written", file=sys.stderr)
        return EXIT_SIGNAL["SIGINT"]
    except Exception as err:  # noqa: BLE001 (the CLI boundary: every error is one line and exit 2)
        train_module = sys.modules.get("twell_jax.training.train")  # imported by then if err is its
        if train_module is not None and isinstance(err, train_module.TrainingInterrupted):
            print(f"twell {name}: {err}", file=sys.stderr)
            return EXIT_SIGNAL.get(err.signal_name, EXIT_ERROR)
        if isinstance(_root_cause(err), KeyboardInterrupt):  # e.g. an import that Ctrl-C broke
            print(f"twell {name}: interrupted (Ctrl-C); nothing more was written", file=sys.stderr)
            return EXIT_SIGNAL["SIGINT"]
        if args.debug:
            traceback.print_exc(file=sys.stderr)
        print(f"twell {name}: error: {describe_error(err)}"
              + ("" if args.debug else " (--debug shows the traceback)"), file=sys.stderr)
        if not isinstance(err, parallel.PeerFailed):  # a multi-process run: the others stop with this line too
            parallel.publish_failure(describe_error(err))
        return EXIT_ERROR
    return 0


def run() -> None:
    """The `twell` console script: main(), exiting without interpreter teardown after Ctrl-C (the
    teardown of a compile that was interrupted has crashed with a segmentation fault)."""
    try:
        code = main()
    except KeyboardInterrupt:  # before a command started (parsing the arguments)
        print("twell: interrupted (Ctrl-C)", file=sys.stderr)
        code = EXIT_SIGNAL["SIGINT"]
    if code == EXIT_SIGNAL["SIGINT"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
