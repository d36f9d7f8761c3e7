"""lm-eval over our model (twell_jax/inference/harness.py): a local multiple-choice task, a rolling
log-likelihood task and a generation task through `TwellLM`, equal to lm-eval's own `hf` backend
running the same model exported to Hugging Face (transformers, CPU); `twell eval --tasks` and
`twell compare --tasks`, and their errors. Offline: the tasks read local json files."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lm_eval")

from twell_jax.cli import main  # noqa: E402
from twell_jax.inference import harness  # noqa: E402

ITEMS = [("def main(", ["argv):", "banana", "self)"], 0), ("import", ["os", "the cat sat", "sys"], 2),
         ("for i in", ["range(10):", "apples", "x:"], 0), ("return", ["None", "True", "maybe later"], 1),
         ("class Foo", ["(object):", ":", "bar baz"], 1), ("while", ["True:", "green", "x < 3:"], 0)]
DOCS = ["import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(os.path.basename(name))\n"
        "    return 0\n\n\nif __name__ == '__main__':\n    sys.exit(main(sys.argv))\n", "x = 1\n"]


def write_tasks(where, cache_dir):
    """Three local tasks (lm-eval's json dataset loader, no download) in `where`: multiple choice,
    rolling log-likelihood (a document longer than the tiny models' context) and generation."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "mc.jsonl", "w") as f:
        for question, choices, answer in ITEMS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(where / "docs.jsonl", "w") as f:
        for text in DOCS:
            f.write(json.dumps({"text": text}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    data = lambda name: f"dataset_kwargs:\n  data_files:\n    test: {where / name}\n  cache_dir: {cache_dir}\n"
    (where / "tiny_mc.yaml").write_text(f"task: tiny_mc\n{common}{data('mc.jsonl')}" + textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
          - metric: acc_norm
        """))
    (where / "tiny_ppl.yaml").write_text(f"task: tiny_ppl\n{common}{data('docs.jsonl')}" + textwrap.dedent("""\
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
        """))
    (where / "tiny_gen.yaml").write_text(f"task: tiny_gen\n{common}{data('mc.jsonl')}" + textwrap.dedent("""\
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: "{{choices[answer]}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
        """))
    return where


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    base = tmp_path_factory.mktemp("tasks")
    return write_tasks(base / "tasks", base / "hf_datasets")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A small random model (init_std 0.1, context 32) with a BPE tokenizer: tests/test_scoring.py's."""
    from test_scoring import tiny_loaded

    return tiny_loaded(tmp_path_factory.mktemp("tok"))


def _resps(results, task):
    return {s["doc_id"]: s["resps"] for s in results["samples"][task]}


def test_local_tasks_equal_lm_evals_hf_backend_on_the_exported_model(tiny_model, tasks, tmp_path):
    """Per request: log-likelihoods within 1e-4 relative (measured ~1e-7) of lm-eval's `hf` backend
    (transformers, fp32, CPU) on the exported model, greedy flags, accuracies and generations equal."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from lm_eval.models.huggingface import HFLM

    from twell_jax.inference.hf import export_hf

    selection = harness.select_tasks(f"{tasks}")
    assert set(selection.names) == {"tiny_mc", "tiny_ppl", "tiny_gen"} and not selection.needs_registry
    ours = harness.run_tasks(harness.TwellLM(tiny_model, batch_size=4, progress=False), selection, log_samples=True)
    out = export_hf(tiny_model, tmp_path / "hf")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"),
                                                     eos_token="<|endoftext|>")
    hf = HFLM(pretrained=str(out), tokenizer=tokenizer, batch_size=4, device="cpu", dtype="float32")
    theirs = harness.run_tasks(hf, selection, log_samples=True)
    mine, other = _resps(ours, "tiny_mc"), _resps(theirs, "tiny_mc")
    assert len(mine) == len(ITEMS)
    for doc_id, responses in mine.items():
        for (logp, greedy), (logp_hf, greedy_hf) in zip([r[0] for r in responses], [r[0] for r in other[doc_id]]):
            assert logp == pytest.approx(logp_hf, rel=1e-4) and greedy == greedy_hf
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]
    mine, other = _resps(ours, "tiny_ppl"), _resps(theirs, "tiny_ppl")
    assert len(tiny_model.tokenizer.encode(DOCS[0]).ids) > 2 * tiny_model.config.model.max_seq_len  # rolled
    for doc_id in mine:
        assert mine[doc_id][0][0] == pytest.approx(other[doc_id][0][0], rel=1e-4)
    assert ours["results"]["tiny_ppl"]["word_perplexity,none"] == pytest.approx(
        theirs["results"]["tiny_ppl"]["word_perplexity,none"], rel=1e-4)
    mine, other = _resps(ours, "tiny_gen"), _resps(theirs, "tiny_gen")
    assert mine == other and any(r[0] for r in mine.values())  # greedy: the same text, not all empty
    summary = harness.summarize(ours)
    assert summary["mean_acc"] == ours["results"]["tiny_mc"]["acc,none"] and set(summary["tasks"]) == {
        "tiny_mc", "tiny_ppl", "tiny_gen"}


def test_generate_until_keeps_request_order_across_settings(tiny_model):
    from lm_eval.api.instance import Instance

    from twell_jax.inference.generate import generate

    lm = harness.TwellLM(tiny_model, batch_size=2, progress=False)
    prompts = ["def main(", "import", "", "for i in"]
    kwargs = [{"until": ["\n"], "max_gen_toks": 5}, {"until": [":"], "max_gen_toks": 3},
              {"until": ["\n"], "max_gen_toks": 5}, {"max_gen_toks": 4, "do_sample": False}]
    requests = [Instance("generate_until", {}, (p, k), i) for i, (p, k) in enumerate(zip(prompts, kwargs))]
    texts = lm.generate_until(requests)
    for prompt, kw, text in zip(prompts, kwargs, texts):
        ids = lm.scorer.encode(prompt) if prompt else [lm.scorer.prefix_id]
        want = generate(tiny_model, [ids], max_new_tokens=kw["max_gen_toks"], stop=kw.get("until", ())).texts[0]
        assert text == want
    with pytest.raises(ValueError, match=r"generation settings \['num_beams'\] are not supported"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"num_beams": 4}), 0)])


@pytest.mark.slow
def test_paper_names_the_seven_lm_eval_tasks():
    selection = harness.select_tasks("paper")
    assert selection.names == harness.PAPER_TASKS and selection.needs_registry and selection.label == "paper"
    with pytest.raises(ValueError, match="--tasks arc_eazy: not an lm-eval task.*did you mean arc_easy"):
        harness.select_tasks("arc_eazy,piqa")


# ----------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A finished `twell compare` (dense twin + one sparse run, 2 steps, context 32)."""
    out = tmp_path_factory.mktemp("study") / "cmp"
    cache = tmp_path_factory.getbasetemp() / "twell_data_cache"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["compare", "--config", "micro", "--out", str(out), "--set", f"data.cache_dir={cache}",
                     "train.steps=2", "model.max_seq_len=32", "data.seq_len=32"]) == 0
    return out


def test_eval_tasks_writes_lm_evals_results_into_the_run(study, tasks, capsys):
    run = study / "twell-l1-0.001"
    assert main(["eval", "--checkpoint", str(run), "--tasks", str(tasks / "tiny_mc.yaml"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    path = run / "lm_eval" / "step-2-tiny_mc.json"
    assert document["results_file"] == str(path.absolute()) and document["step"] == 2
    saved = json.loads(path.read_text())
    assert saved["results"]["tiny_mc"]["acc,none"] == document["mean_acc"] == document["tasks"]["tiny_mc"]["acc"]
    assert saved["config"]["twell_ffn_kind"] == "twell" and document["tasks"]["tiny_mc"]["n"] == len(ITEMS)
    assert main(["eval", "--checkpoint", str(run), "--tasks", str(tasks / "tiny_mc.yaml"), "--limit", "2",
                 "--set", "model.ffn_backend=dense"]) == 0
    out = capsys.readouterr().out
    assert "tiny_mc" in out and "mean acc over 1 task(s)" in out and "step-2-tiny_mc-limit2.json" in out


def test_compare_tasks_adds_the_accuracy_column_dense_against_sparse(study, tasks, capsys):
    argv = ["compare", "--out", str(study), "--resume", "--tasks", str(tasks / "tiny_mc.yaml"), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert [row["key"] for row in report["runs"]] == ["dense", "twell-l1-0.001"]
    for row in report["runs"]:
        saved = json.loads((study / row["key"] / "lm_eval" / "step-2-tiny_mc.json").read_text())
        assert row["mean_acc"] == row["task_acc"]["tiny_mc"] == saved["results"]["tiny_mc"]["acc,none"]
    table = (study / "compare.md").read_text()
    assert "| accuracy | acc vs twin |" in table.splitlines()[0] and " pt |" in table
    assert main(argv) == 0  # again: each run's results file is read back, nothing evaluated
    assert captured.err.count("kept") < capsys.readouterr().err.count("kept")


def test_compare_tasks_loads_the_tasks_once_for_every_run(study, tasks, tmp_path, monkeypatch, capsys):
    """`twell compare --tasks` loads lm-eval's tasks once per invocation and evaluates every run on
    those task objects: each run's results equal its own evaluation on freshly loaded tasks."""
    copy = shutil.copytree(study, tmp_path / "cmp", ignore=shutil.ignore_patterns("lm_eval"))
    spec = f"{tasks / 'tiny_mc.yaml'},{tasks / 'tiny_ppl.yaml'}"
    loads, load_tasks = [], harness.load_tasks

    def counted(selection, **kwargs):
        loads.append(selection.names)
        return load_tasks(selection, **kwargs)

    monkeypatch.setattr(harness, "load_tasks", counted)
    assert main(["compare", "--out", str(copy), "--resume", "--tasks", spec, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert loads == [("tiny_mc", "tiny_ppl")]  # once, for the dense twin and the sparse run
    monkeypatch.setattr(harness, "load_tasks", load_tasks)
    selection = harness.select_tasks(spec)
    for row in report["runs"]:
        saved = json.loads((copy / row["key"] / "lm_eval" / "step-2-tiny_mc+tiny_ppl.json").read_text())
        fresh, _ = harness.evaluate_run(copy / row["key"], selection, step=2, progress=False, echo=lambda line: None)
        assert saved["results"] == fresh["results"] and set(fresh["results"]) == {"tiny_mc", "tiny_ppl"}
        assert row["mean_acc"] == fresh["results"]["tiny_mc"]["acc,none"]


@pytest.mark.parametrize("argv,message", [
    (["--tasks", "no_such_task_anywhere"], "--tasks no_such_task_anywhere: not an lm-eval task"),
    (["--tasks", "missing/quiz.yaml"], "--tasks missing/quiz.yaml: no such task file or directory"),
    (["--tasks", "TASKS", "--split", "val"], "--split picks the data of the validation loss"),
    (["--tasks", "TASKS", "--limit", "0"], "--limit must be >= 1"),
    (["--num-fewshot", "2"], "--num-fewshot applies to --tasks"),
])
def test_eval_tasks_errors_are_one_line(study, tasks, capsys, argv, message):
    argv = [str(tasks / "tiny_mc.yaml") if a == "TASKS" else a for a in argv]
    assert main(["eval", "--checkpoint", str(study / "dense"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_tokenizer_that_does_not_match_the_run_is_refused(study, tasks, tmp_path, capsys):
    from twell_jax.data.tokenizer import train_bpe

    run = shutil.copytree(study / "dense", tmp_path / "run")
    bigger = train_bpe([f"word{i} " * 3 for i in range(400)], vocab_size=600, eot_token="<|endoftext|>",
                       show_progress=False)
    assert bigger.get_vocab_size() > 300
    bigger.save(str(run / "tokenizer.json"))
    assert main(["eval", "--checkpoint", str(run), "--tasks", str(tasks / "tiny_mc.yaml")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("twell eval:")]
    assert len(err) == 1 and "not this run's tokenizer" in err[0], err
    no_eot = train_bpe(["abc def " * 50], vocab_size=280, eot_token="<|eot|>", show_progress=False)
    no_eot.save(str(run / "tokenizer.json"))
    assert main(["eval", "--checkpoint", str(run), "--tasks", str(tasks / "tiny_mc.yaml")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("twell eval:")]
    assert len(err) == 1 and "no end-of-text token '<|endoftext|>'" in err[0], err


@pytest.mark.slow
def test_a_task_that_needs_a_download_without_network_is_one_line(study):
    """HF_HUB_OFFLINE=1 stands in for no network (the same ConnectionError, at once instead of after
    the Hub client's retries); the model is never loaded."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "twell_jax.cli", "eval", "--checkpoint", str(study / "dense"),
                           "--tasks", "arc_easy"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    last = [line for line in done.stderr.splitlines() if line.startswith("twell eval: error")]
    assert len(last) == 1 and "--tasks arc_easy: its dataset could not be downloaded" in last[0], done.stderr[-2000:]


def test_without_lm_eval_tasks_name_the_extra(monkeypatch):
    import twell_jax.inference as inference

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    monkeypatch.delitem(sys.modules, "twell_jax.inference.harness")
    monkeypatch.delattr(inference, "harness")
    with pytest.raises(ValueError, match=r"--tasks: lm-eval tasks need the `eval` extra: pip install "):
        inference.lm_eval_harness()


def test_prompt_templates_are_compiled_once_inside_the_evaluation_and_render_the_same():
    import lm_eval.utils as lm_eval_utils

    env = lm_eval_utils.env
    assert env.from_string("{{question}}") is not env.from_string("{{question}}")  # lm-eval compiles each call
    plain = [lm_eval_utils.apply_template("{{choices}}", {"choices": item[1]}) for item in ITEMS]
    with harness.cached_prompt_templates():
        assert env.from_string("{{question}}") is env.from_string("{{question}}")
        assert [lm_eval_utils.apply_template("{{choices}}", {"choices": item[1]}) for item in ITEMS] == plain
        with harness.cached_prompt_templates():  # nested: the outer block's cache stays in place
            assert env.from_string("{{question}}") is env.from_string("{{question}}")
        assert "from_string" in vars(env)
    assert "from_string" not in vars(env)
    with pytest.raises(KeyError), harness.cached_prompt_templates():
        raise KeyError("restored on the way out too")
    assert "from_string" not in vars(env)
