"""EleutherAI's lm-evaluation-harness (lm-eval 0.4.x) over our own model: downstream accuracy.

`TwellLM(loaded)` is an `lm_eval.api.model.LM`: `loglikelihood` and `loglikelihood_rolling` through
`inference.scoring.Scorer` (the model's own forward, batched and length-sorted: the sparse kernels
where the run's "auto" hints choose them on a GPU), `generate_until` through
`inference.generate` (the KV-cached generation of `twell generate`, greedy unless a task asks to
sample). Text is encoded with the run's tokenizer as its documents were (all of a call's requests in
one batch call of the tokenizer); the end-of-text token is the prefix of an empty context and of a
document. Results come back in request order.

`run_tasks(lm, select_tasks("paper"))` runs lm-eval's `simple_evaluate` on lm-eval task names (a
group or tag name too), local task YAML files or directories of them, or `paper`: the seven tasks
of the paper's accuracy column (`PAPER_TASKS`), with each prompt template compiled once
(`cached_prompt_templates`). `summarize` reduces lm-eval's results to accuracy
per task and their mean; `evaluate_run` is what `twell eval --tasks` and `twell compare --tasks`
run: a run's checkpoint through the tasks, lm-eval's results JSON written into the run directory
(`<run>/lm_eval/step-<N>-<tasks>.json`).

This module imports lm-eval at its top (the `eval` extra: `pip install 'twell-jax[eval]'`); the
rest of twell imports it only when tasks are asked for.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

EXTRA_HINT = "lm-eval tasks need the `eval` extra: pip install 'twell-jax[eval]' (lm-eval 0.4.x)"
try:
    import lm_eval
    import lm_eval.utils
    from lm_eval.api.model import LM
except ImportError as _err:  # pragma: no cover - exercised where lm-eval is absent
    raise ImportError(f"{EXTRA_HINT} ({_err})") from _err

from twell_jax import run_dir as run_dir_lib
from twell_jax.inference.scoring import DEFAULT_BATCH_SIZE, Scorer

if TYPE_CHECKING:  # pragma: no cover - typing only
    from twell_jax.inference.load import LoadedModel

logger = logging.getLogger(__name__)

# The paper's accuracy column: mean accuracy over these seven tasks (their lm-eval names).
PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "winogrande", "commonsense_qa")
TASK_ALIASES = {"paper": PAPER_TASKS}
# generate_until: lm-eval's default budget of new tokens, and the task settings we take.
DEFAULT_MAX_GEN_TOKS = 256
GENERATION_KEYS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed"})


# ----------------------------------------------------------------------------- the model


class TwellLM(LM):
    """lm-eval's LM interface over a loaded twell model (`inference.load_run`, `hf.import_hf`).

    `batch_size`: rows per forward (scoring) and prompts per generation call (the context window is
    the model's, model.max_seq_len, for both); `progress`: tqdm bars on stderr."""

    def __init__(self, loaded: "LoadedModel", *, batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True):
        super().__init__()
        check_tokenizer(loaded)
        self.loaded = loaded
        self.scorer = Scorer(loaded, batch_size=batch_size)
        self.batch_size = batch_size
        self.progress = progress
        self._warned_budget = False

    def _bar(self, what: str, total: int, disable: bool) -> Callable[[int, int], None]:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=what, unit="req", disable=disable or not self.progress)

        def update(done: int, of: int) -> None:  # of: the scorer's units (rolling: window pairs)
            bar.total, bar.n = of, done
            bar.refresh()
            if done >= of:
                bar.close()

        return update

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = self.scorer.encode_pairs([request.args for request in requests])  # one batch call
        results = self.scorer.loglikelihoods(pairs, self._bar("loglikelihood", len(pairs), disable_tqdm))
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        docs = self.scorer.encode_many([request.args[0] for request in requests])
        results = self.scorer.rolling_loglikelihoods(docs, self._bar("loglikelihood_rolling", len(docs), disable_tqdm))
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from twell_jax.inference.generate import generate

        settings = [self._generation_settings(request.args[1]) for request in requests]
        prompt_texts = [request.args[0] for request in requests]
        encoded = iter(self.scorer.encode_many([text for text in prompt_texts if text]))
        prompts = [next(encoded) if text else [self.scorer.prefix_id] for text in prompt_texts]
        # Batches of equal settings, longest prompts first (the first batch is the largest).
        order = sorted(range(len(requests)), key=lambda i: (repr(settings[i]), -len(prompts[i])))
        texts: list[str | None] = [None] * len(requests)
        update = self._bar("generate_until", len(requests), disable_tqdm)
        done, start = 0, 0
        while start < len(order):
            key = repr(settings[order[start]])
            batch = [i for i in order[start:start + self.batch_size] if repr(settings[i]) == key]
            until, max_new, sampling = settings[batch[0]]
            result = generate(self.loaded, [prompts[i] for i in batch], max_new_tokens=max_new,
                              temperature=sampling["temperature"], top_k=sampling["top_k"], top_p=sampling["top_p"],
                              seed=sampling["seed"], truncate="left", stop=until)
            for i, text in zip(batch, result.texts):
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            start += len(batch)
            done += len(batch)
            update(done, len(requests))
        return texts  # type: ignore[return-value]

    def _generation_settings(self, kwargs: dict[str, Any] | None) -> tuple[tuple[str, ...], int, dict[str, Any]]:
        """(stop strings, new-token budget, sampling settings) of a task's generation kwargs."""
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - GENERATION_KEYS)
        if unknown:
            raise ValueError(f"generate_until: generation settings {unknown} are not supported (twell's generation "
                             f"takes {sorted(GENERATION_KEYS)})")
        until = kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        window = self.loaded.config.model.max_seq_len
        if max_new > window - 1:  # the cache must hold at least one prompt token
            if not self._warned_budget:
                logger.warning("generate_until: max_gen_toks=%d does not fit the context of %d tokens; generating "
                               "at most %d", max_new, window, window - 1)
                self._warned_budget = True
            max_new = window - 1
        sample = bool(kwargs.get("do_sample", False))
        sampling = {"temperature": float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                    "top_k": int(kwargs.get("top_k", 0) or 0), "top_p": float(kwargs.get("top_p", 1.0) or 1.0),
                    "seed": int(kwargs.get("seed", 0) or 0)}
        return tuple(s for s in until if s), max_new, sampling

    @property
    def tokenizer_name(self) -> str:
        return f"twell:{self.loaded.config.data.tokenizer}"

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' `config` about the model."""
        m = self.loaded.config.model
        return {"twell_step": self.loaded.step, "twell_ffn_kind": m.ffn_kind, "twell_ffn_backend": m.ffn_backend,
                "twell_dtype": m.compute_dtype, "twell_parameters": m.num_params(),
                "twell_max_length": self.scorer.max_length}


def check_tokenizer(loaded: "LoadedModel") -> None:
    """A ValueError unless the model has a tokenizer that fits it: one exists, its ids fit the
    embedding, it has the run's end-of-text token (data.eot_token), and it is the one the weights
    were trained with (`loaded.tokenizer_hash`, where known)."""
    from twell_jax.data import tokenizer as tokenizer_lib

    cfg = loaded.config
    if loaded.tokenizer is None:
        raise ValueError("the model has no tokenizer (a run on synthetic tokens, or a checkpoint without "
                         "tokenizer.json): lm-eval's tasks are text")
    size = loaded.tokenizer.get_vocab_size()
    if size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens but model.vocab_size is {cfg.model.vocab_size}: not the "
                         "tokenizer this model was trained with")
    if loaded.eos_id is None:
        raise ValueError(f"the tokenizer has no end-of-text token {cfg.data.eot_token!r} (data.eot_token): not the "
                         "tokenizer this model was trained with")
    if loaded.tokenizer_hash is not None:
        tokenizer_lib.check_same_tokenizer(
            tokenizer_lib.tokenizer_hash(loaded.tokenizer), "the model's tokenizer", loaded.tokenizer_hash,
            "the one its weights were trained with (recorded with the run, or the checkpoint's own tokenizer.json)",
            "evaluate with the tokenizer.json the model was trained with")


# ----------------------------------------------------------------------------- tasks


@dataclasses.dataclass(frozen=True)
class TaskSelection:
    """What --tasks named: lm-eval task (group, tag) names, and directories of local task YAMLs."""

    names: tuple[str, ...]  # registered names, and the names of the local tasks given by path
    include_paths: tuple[str, ...]  # directories lm-eval indexes besides its own tasks
    needs_registry: bool  # some name is lm-eval's own (its index of ~15k tasks is built: seconds)
    label: str  # a file-name-safe label of the selection (results file names)


def _label(text: str) -> str:
    label = re.sub(r"[^A-Za-z0-9_.+-]+", "_", text.replace(",", "+")).strip("_") or "tasks"
    if len(label) > 60:
        label = label[:48] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return label


def _task_manager(include_paths: Sequence[str], registry: bool) -> Any:
    return _cached_task_manager(tuple(include_paths), registry)


@functools.lru_cache(maxsize=8)
def _cached_task_manager(include_paths: tuple[str, ...], registry: bool) -> Any:
    """lm-eval's task index (seconds to build over its registry): once per process and arguments."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None, include_defaults=registry)


def _entry_path(entry: Any) -> Path | None:
    path = getattr(entry, "yaml_path", None) if not isinstance(entry, dict) else entry.get("yaml_path")
    return Path(path).resolve() if path else None


def _local_task_names(path: Path, manager: Any) -> list[str]:
    """The tasks (and groups) that the YAML file `path`, or the YAMLs under the directory `path`, define."""
    path = path.resolve()
    names = []
    for name, entry in manager.task_index.items():
        where = _entry_path(entry)
        if where is not None and (where == path or (path.is_dir() and path in where.parents)):
            names.append(name)
    return sorted(names)


def select_tasks(text: str, *, flag: str = "--tasks") -> TaskSelection:
    """Parse and check a --tasks value: comma-separated lm-eval task names (groups and tags too),
    `paper` (PAPER_TASKS), or paths of local task YAML files or directories of them. An unknown
    name or a path that defines no task is a ValueError naming it (with the closest names)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{flag} is empty: give lm-eval task names, `paper`, or a task YAML file or directory")
    specs: list[str] = []
    paths: list[Path] = []
    for item in items:
        if item in TASK_ALIASES:
            specs.extend(TASK_ALIASES[item])
        elif item.endswith((".yaml", ".yml")) or "/" in item or Path(item).expanduser().is_dir():
            path = Path(item).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"{flag} {item}: no such task file or directory")
            paths.append(path)
        else:
            specs.append(item)
    registry = bool(specs)
    include = sorted({str((p if p.is_dir() else p.parent).resolve()) for p in paths})
    manager = _task_manager(include, registry)
    known = set(manager.all_tasks)
    unknown = [name for name in specs if name not in known]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
        raise ValueError(f"{flag} {name}: not an lm-eval task, group or tag (lm-eval {_lm_eval_version()} knows "
                         f"{len(known)})" + (f"; did you mean {', '.join(close)}?" if close else "")
                         + " (`paper` = the paper's seven tasks; a path to a task YAML for your own)")
    for path in paths:
        local = _local_task_names(path, manager)
        if not local:
            raise ValueError(f"{flag} {path}: defines no lm-eval task (a YAML with a `task:` key, or a directory "
                             "of them)")
        specs.extend(local)
    label = ",".join(item if item in TASK_ALIASES or item in known else Path(item).expanduser().stem
                     for item in items)
    return TaskSelection(names=tuple(dict.fromkeys(specs)), include_paths=tuple(include), needs_registry=registry,
                         label=_label(label))


def _lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm-eval")
    except PackageNotFoundError:  # pragma: no cover - a source checkout of lm-eval
        return "?"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def load_tasks(selection: TaskSelection, *, flag: str = "--tasks") -> tuple[Any, list[Any]]:
    """(lm-eval's TaskManager, the task and group objects) of `selection`, their data loaded (an
    lm-eval task downloads its dataset from the Hugging Face Hub once, into the datasets cache).
    A dataset that cannot be downloaded (no network) or found is a ValueError naming the task."""
    from lm_eval.api.group import Group

    manager = _task_manager(selection.include_paths, selection.needs_registry)
    objects: list[Any] = []
    for name in selection.names:
        try:
            loaded = manager.load([name])
        except (ConnectionError, TimeoutError) as err:  # datasets' "Couldn't reach ... on the Hub" is one
            raise ValueError(f"{flag} {name}: its dataset could not be downloaded ({_first_line(err)}); no network? "
                             "lm-eval reads a task's data from the Hugging Face Hub: run it once where the Hub is "
                             "reachable (the datasets cache keeps it), or give a local task YAML "
                             "(dataset_path: json)") from None
        except Exception as err:  # noqa: BLE001 (a task lm-eval cannot build: its data, its YAML)
            raise ValueError(f"{flag} {name}: lm-eval could not load this task ({_first_line(err)})") from None
        group = loaded["groups"].get(name)
        objects.extend([group] if isinstance(group, Group) else loaded["tasks"].values())
    return manager, objects


@contextlib.contextmanager
def cached_prompt_templates() -> Iterator[None]:
    """lm-eval renders a task's prompt fields (doc_to_text, doc_to_choice, doc_to_target, ...) with
    Jinja and compiles the template's source anew for every document and field
    (`lm_eval.utils.apply_template`: `env.from_string(template).render(**doc)`), the largest host
    cost per item that lm-eval adds (a profile of `twell eval --tasks` on a CPU). Inside this block
    its environment keeps each compiled template by its source: the same strings, each template
    compiled once. Where lm-eval has no such environment nothing changes."""
    env = getattr(getattr(lm_eval, "utils", None), "env", None)
    compile_template = getattr(env, "from_string", None)
    if compile_template is None or "from_string" in vars(env):  # not lm-eval 0.4's, or already wrapped
        yield
        return
    compiled = functools.lru_cache(maxsize=1024)(compile_template)

    def from_string(source: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(source, str):
            return compile_template(source, *args, **kwargs)
        return compiled(source)

    env.from_string = from_string
    try:
        yield
    finally:
        del env.from_string  # the class's method again


def run_tasks(lm: LM, selection: TaskSelection, *, limit: int | None = None, num_fewshot: int | None = None,
              log_samples: bool = False, loaded_tasks: tuple[Any, list[Any]] | None = None,
              flag: str = "--tasks") -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `lm` on the selected tasks: its results dict (with
    `samples` when `log_samples`). `limit`: at most this many documents per task; `loaded_tasks`:
    `load_tasks(selection)`'s result when the caller loaded them already (their data checked
    before the model was loaded)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    if num_fewshot is not None and (isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int)
                                    or num_fewshot < 0):
        raise ValueError(f"num_fewshot must be an int >= 0, got {num_fewshot!r}")
    manager, objects = loaded_tasks if loaded_tasks is not None else load_tasks(selection, flag=flag)
    with warnings.catch_warnings(), cached_prompt_templates():
        warnings.filterwarnings("ignore", message=".*limit.*")
        results = lm_eval.simple_evaluate(model=lm, tasks=objects, task_manager=manager, limit=limit,
                                          num_fewshot=num_fewshot, log_samples=log_samples,
                                          batch_size=getattr(lm, "batch_size", None))
    if results is None:  # pragma: no cover - lm-eval returns None on ranks other than 0
        raise RuntimeError("lm-eval returned no results")
    return results


def json_ready(results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's results as plain JSON values (its own serialisation rules), without `samples`."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps({k: v for k, v in results.items() if k != "samples"},
                                 default=handle_non_serializable))


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """{"tasks": {task: {"acc", "acc_stderr", "acc_norm", "n"}}, "mean_acc": mean of the tasks'
    accuracy (None when no task reports one)} of lm-eval's results (leaf tasks; groups left out)."""
    groups = set(results.get("groups", {}))
    tasks = {}
    for name, metrics in results.get("results", {}).items():
        if name in groups:
            continue
        row = {key: metrics.get(f"{key},none") for key in ("acc", "acc_stderr", "acc_norm")}
        row = {k: (v if isinstance(v, (int, float)) else None) for k, v in row.items()}
        row["n"] = (results.get("n-samples", {}).get(name) or {}).get("effective")
        tasks[name] = row
    accs = [row["acc"] for row in tasks.values() if row["acc"] is not None]
    return {"tasks": tasks, "mean_acc": sum(accs) / len(accs) if accs else None}


def format_table(results: dict[str, Any]) -> str:
    """lm-eval's own table of the results, and the mean accuracy over the tasks."""
    from lm_eval.utils import make_table

    summary = summarize(results)
    text = make_table(results)
    if "groups" in results and results["groups"]:
        text += "\n" + make_table(results, "groups")
    accs = [name for name, row in summary["tasks"].items() if row["acc"] is not None]
    if summary["mean_acc"] is not None:
        text += f"\nmean acc over {len(accs)} task(s): {summary['mean_acc']:.4f}"
    return text.rstrip()


def results_path(run_dir: str | Path, step: int | None, selection: TaskSelection,
                 limit: int | None = None, num_fewshot: int | None = None) -> Path:
    """Where an evaluation of `run_dir`'s step `step` on `selection` keeps lm-eval's results (one
    file per limit and few-shot setting, so that one does not overwrite another)."""
    suffix = (f"-limit{limit}" if limit is not None else "") + (f"-fewshot{num_fewshot}" if num_fewshot is not None else "")
    return Path(run_dir) / run_dir_lib.LM_EVAL_SUBDIR / f"step-{step}-{selection.label}{suffix}.json"


def evaluate_loaded(loaded: "LoadedModel", selection: TaskSelection, *, batch_size: int = DEFAULT_BATCH_SIZE,
                    limit: int | None = None, num_fewshot: int | None = None, progress: bool = True,
                    loaded_tasks: tuple[Any, list[Any]] | None = None, flag: str = "--tasks") -> dict[str, Any]:
    """lm-eval's results (JSON-ready, no samples) of a loaded model on the selected tasks."""
    lm = TwellLM(loaded, batch_size=batch_size, progress=progress)
    results = run_tasks(lm, selection, limit=limit, num_fewshot=num_fewshot, loaded_tasks=loaded_tasks, flag=flag)
    results = json_ready(results)
    results.setdefault("config", {})["twell_num_fewshot"] = num_fewshot
    return results


def evaluate_run(run_dir: str | Path, selection: TaskSelection, *, step: int | None = None, dtype: str | None = None,
                 overrides: Sequence[str] = (), batch_size: int = DEFAULT_BATCH_SIZE, limit: int | None = None,
                 num_fewshot: int | None = None, reuse: bool = False, progress: bool = True,
                 loaded_tasks: tuple[Any, list[Any]] | None = None, echo: Callable[[str], None] = print,
                 flag: str = "--tasks") -> tuple[dict[str, Any], Path]:
    """Evaluate a run's checkpoint (`step`, default the newest intact one) on the selected tasks and
    write lm-eval's results JSON into the run directory; returns (results, its path). `dtype`:
    compute dtype (default the run's model.compute_dtype); `overrides`: resumable config fields
    (e.g. model.ffn_backend=dense). `reuse`: a results file of the same step, tasks, limit and
    few-shot count is read back instead of evaluating again (what `twell compare --tasks` resumes with)."""
    from twell_jax.inference.load import load_run
    from twell_jax.training import checkpoint as ckpt_lib

    run_dir = run_dir_lib.run_dir_of(run_dir)
    if reuse and step is not None:
        path = results_path(run_dir, step, selection, limit, num_fewshot)
        if path.is_file():
            results = run_dir_lib.read_json_file(path, "lm-eval results")
            if (results.get("config") or {}).get("twell_num_fewshot") == num_fewshot:
                echo(f"[twell] tasks: {path} exists (step {step}, same tasks): kept")
                return results, path
    if dtype is None:
        dtype = ckpt_lib.load_run_config(run_dir).model.compute_dtype
    loaded = load_run(run_dir, step=step, dtype=dtype, overrides=list(overrides))
    check_tokenizer(loaded)
    model_cfg = loaded.config.model
    echo(f"[twell] tasks: {', '.join(selection.names)} on {run_dir} step {loaded.step} ({model_cfg.ffn_kind}, "
         f"backend {model_cfg.ffn_backend}, {dtype}, batch {batch_size})")
    results = evaluate_loaded(loaded, selection, batch_size=batch_size, limit=limit, num_fewshot=num_fewshot,
                              progress=progress, loaded_tasks=loaded_tasks, flag=flag)
    path = results_path(run_dir, loaded.step, selection, limit, num_fewshot)
    path.parent.mkdir(parents=True, exist_ok=True)
    run_dir_lib.atomic_write_text(path, json.dumps(results, indent=2))
    echo(f"[twell] tasks: lm-eval results -> {path}")
    return results, path
