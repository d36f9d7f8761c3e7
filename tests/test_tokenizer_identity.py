"""A tokenizer's identity (twell_jax/data/tokenizer.py: tokenizer_hash, what a run records, the
checks): equal tokenizers hash equal across save/load and HF export/import, a changed merge or
special token changes the hash, and a different tokenizer is refused where two things must share
one: the runs of `twell compare`, `twell train --init-from` (and a study's --init-run), lm-eval's
adapter, an HF import or export given another tokenizer. Old runs (no recorded hash) still load."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from twell_jax import run_dir as run_dir_lib
from twell_jax.data import tokenizer as tokenizer_lib
from twell_jax.data.tokenizer import load_tokenizer, tokenizer_file_hash, tokenizer_hash
from twell_jax.training.run_tokenizer import run_tokenizer_hash
from oracles import run_cli

TEXTS = ["def main(argv):\n    return 0\n", "import os\nimport sys\n", "for i in range(10):\n    print(i)\n"] * 20


def _variant(tokenizer, change):
    """A copy of `tokenizer` with `change` applied to its JSON document."""
    from tokenizers import Tokenizer

    document = json.loads(tokenizer.to_str())
    change(document)
    return Tokenizer.from_str(json.dumps(document))


def _drop_last_merge(document):  # the same vocabulary; its last merged token is never produced
    document["model"]["merges"].pop()


def _rename_special_token(document):
    old, new = "<|endoftext|>", "<|eot|>"
    document["added_tokens"][0]["content"] = new
    document["model"]["vocab"][new] = document["model"]["vocab"].pop(old)


def _unflag_special_token(document):
    document["added_tokens"][0]["special"] = False


@pytest.fixture(scope="module")
def bpe():
    return tokenizer_lib.train_bpe(TEXTS, vocab_size=290, eot_token="<|endoftext|>", show_progress=False)


def test_equal_tokenizers_hash_equal_and_a_changed_merge_or_special_token_does_not(bpe, tmp_path):
    bpe.save(str(tmp_path / "pretty.json"))
    bpe.save(str(tmp_path / "compact.json"), pretty=False)
    assert (tmp_path / "pretty.json").read_bytes() != (tmp_path / "compact.json").read_bytes()
    expected = tokenizer_hash(bpe)
    assert re.fullmatch("[0-9a-f]{64}", expected)
    assert tokenizer_file_hash(tmp_path / "pretty.json") == tokenizer_file_hash(tmp_path / "compact.json") == expected
    loaded = load_tokenizer(str(tmp_path / "compact.json"))
    loaded.enable_truncation(8)  # a runtime setting: the same ids for the same text up to the cut
    loaded.encode_special_tokens = True
    assert tokenizer_hash(loaded) == expected
    for change in (_drop_last_merge, _rename_special_token, _unflag_special_token):
        changed = _variant(bpe, change)
        assert changed.get_vocab_size() == bpe.get_vocab_size()
        assert tokenizer_hash(changed) != expected, change.__name__
    # The merge is real: without it some text encodes differently.
    swapped = _variant(bpe, _drop_last_merge)
    assert any(swapped.encode(t).ids != bpe.encode(t).ids for t in set(TEXTS))
    with pytest.raises(ValueError, match=r"^A \(hash [0-9a-f]{16}\) is not B \(hash [0-9a-f]{16}\): do this$"):
        tokenizer_lib.check_same_tokenizer(tokenizer_hash(swapped), "A", expected, "B", "do this")
    tokenizer_lib.check_same_tokenizer(None, "A", expected, "B", "unknown: not compared")


def test_hf_export_then_import_hashes_equal_and_another_tokenizer_is_refused(tmp_path):
    from test_scoring import tiny_loaded

    from twell_jax.inference.hf import export_hf, import_hf

    loaded = tiny_loaded(tmp_path)
    expected = tokenizer_hash(loaded.tokenizer)
    out = export_hf(loaded, tmp_path / "hf")
    imported = import_hf(out)
    assert imported.tokenizer_hash == tokenizer_hash(imported.tokenizer) == expected
    swapped = _variant(loaded.tokenizer, _drop_last_merge)
    swapped.save(str(tmp_path / "swapped.json"))
    with pytest.raises(ValueError, match=rf"tokenizer='.*swapped.json' \(hash {tokenizer_hash(swapped)[:16]}\) is "
                                         rf"not the checkpoint's own \(.*hf/tokenizer.json\) \(hash {expected[:16]}\): "
                                         "leave"):
        import_hf(out, tokenizer=tmp_path / "swapped.json")
    shutil.copy(out / "tokenizer.json", tmp_path / "same.json")
    assert import_hf(out, tokenizer=tmp_path / "same.json").tokenizer_hash == expected
    known = dataclasses.replace(loaded, tokenizer_hash=expected)
    with pytest.raises(ValueError, match=rf"tokenizer= \(hash {tokenizer_hash(swapped)[:16]}\) is not the one the "
                                         rf"model's weights were trained with \(hash {expected[:16]}\): leave "
                                         "tokenizer= out"):
        export_hf(known, tmp_path / "refused", tokenizer=swapped)
    assert not (tmp_path / "refused").exists()


def test_lm_eval_adapter_refuses_a_tokenizer_the_weights_were_not_trained_with(tmp_path):
    pytest.importorskip("lm_eval")
    from test_scoring import tiny_loaded

    from twell_jax.inference import harness

    loaded = tiny_loaded(tmp_path)
    expected = tokenizer_hash(loaded.tokenizer)
    known = dataclasses.replace(loaded, tokenizer_hash=expected)
    harness.TwellLM(known, progress=False)
    swapped = dataclasses.replace(known, tokenizer=_variant(loaded.tokenizer, _drop_last_merge))
    with pytest.raises(ValueError, match=rf"the model's tokenizer \(hash {tokenizer_hash(swapped.tokenizer)[:16]}\) "
                                         rf"is not the one its weights were trained with .*\(hash {expected[:16]}\)"):
        harness.TwellLM(swapped, progress=False)
    harness.TwellLM(dataclasses.replace(swapped, tokenizer_hash=None), progress=False)  # unknown: not compared


# ----------------------------------------------------------------------------- runs


def _error_lines(err):
    return [line for line in err.splitlines() if " error: " in line]


@pytest.fixture(scope="module")
def study(tmp_path_factory, data_cache_dir):
    """A finished `twell compare` (dense twin + one sparse run, 2 steps)."""
    out = tmp_path_factory.mktemp("study") / "cmp"
    cache = Path(data_cache_dir)
    code, _, err = run_cli(["compare", "--config", "micro", "--out", str(out), "--set", f"data.cache_dir={cache}",
                             "train.steps=2"])
    assert code == 0, err
    return out, cache


def test_runs_record_their_tokenizer_hash_and_old_runs_compute_it_or_warn_once(study, tmp_path):
    out, _ = study
    twin = tokenizer_file_hash(out / "dense" / "tokenizer.json")
    for key in ("dense", "twell-l1-0.001"):
        record = run_dir_lib.read_corpus_fingerprint(out / key)
        assert record["tokenizer"] == twin and record["tokenizers"] == tokenizer_lib.library_version()
    assert json.loads((out / "compare.json").read_text())["tokenizer_hash"] == twin
    old = shutil.copytree(out / "dense", tmp_path / "old", ignore=shutil.ignore_patterns("checkpoints"))
    path = old / run_dir_lib.FINGERPRINT_FILE
    warnings = []
    for record in ({"corpus": "c"}, {"corpus": "c", "tokenizer": "0" * 64, "tokenizers": "0.0.1"}):
        path.write_text(json.dumps(record))  # before hashes were recorded; by another version of the library
        assert run_tokenizer_hash(old, warn=warnings.append) == twin  # computed from its tokenizer.json
    (old / "tokenizer.json").unlink()
    assert run_tokenizer_hash(old, warn=warnings.append) == "0" * 64  # the file gone: the record is all there is
    path.write_text(json.dumps({"corpus": "c"}))
    assert [run_tokenizer_hash(old, warn=warnings.append) for _ in range(2)] == [None, None]
    assert len(warnings) == 1 and "records no tokenizer hash and has no tokenizer.json" in warnings[0]


def test_eval_tasks_refuses_a_run_whose_tokenizer_json_is_not_the_recorded_one(study, tmp_path):
    """Same vocabulary size and end-of-text token (what was checked before): the hash tells them apart."""
    pytest.importorskip("lm_eval")
    from test_harness import write_tasks

    out, _ = study
    tasks = write_tasks(tmp_path / "tasks", tmp_path / "hf_datasets")
    run = shutil.copytree(out / "dense", tmp_path / "run")
    recorded = run_dir_lib.read_corpus_fingerprint(run)["tokenizer"]
    swapped = _variant(load_tokenizer(str(run)), _drop_last_merge)
    swapped.save(str(run / "tokenizer.json"))
    code, _, err = run_cli(["eval", "--checkpoint", str(run), "--tasks", str(tasks / "tiny_mc.yaml")])
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1, err
    assert (f"the model's tokenizer (hash {tokenizer_hash(swapped)[:16]}) is not the one its weights were trained "
            f"with (recorded with the run, or the checkpoint's own tokenizer.json) (hash {recorded[:16]})") in errors[0]


def test_compare_refuses_runs_trained_with_another_tokenizer(study, tmp_path):
    out, _ = study
    copy = shutil.copytree(out, tmp_path / "cmp")
    twin = tokenizer_file_hash(out / "dense" / "tokenizer.json")
    sparse = copy / "twell-l1-0.001"
    swapped = _variant(load_tokenizer(str(sparse / "tokenizer.json")), _drop_last_merge)
    swapped.save(str(sparse / "tokenizer.json"))
    fingerprint = sparse / run_dir_lib.FINGERPRINT_FILE
    recorded = json.loads(fingerprint.read_text())
    for record in ({"corpus": recorded["corpus"]},  # an old run: its hash computed from its tokenizer.json
                   {**recorded, "tokenizer": tokenizer_hash(swapped)}):  # a run that recorded another tokenizer
        fingerprint.write_text(json.dumps(record))
        code, text, err = run_cli(["compare", "--out", str(copy), "--resume"])
        errors = _error_lines(err)
        assert code == 2 and text == "" and len(errors) == 1, err
        assert (f"the tokenizer of run twell-l1-0.001 ({sparse}) (hash {tokenizer_hash(swapped)[:16]}) is not the "
                f"dense twin's ({copy / 'dense'}) (hash {twin[:16]})") in errors[0]
        assert f"twell compare --out {copy} --resume" in errors[0]
    # An old run without a record or a tokenizer.json: warned about, not compared.
    fingerprint.write_text(json.dumps({"corpus": recorded["corpus"]}))
    (sparse / "tokenizer.json").unlink()
    code, _, err = run_cli(["compare", "--out", str(copy), "--resume"])
    assert code == 0 and err.count("records no tokenizer hash") == 1, err


def test_init_from_refuses_a_tokenizer_other_than_the_checkpoints(study, tmp_path):
    out, cache = study
    hf = tmp_path / "hf"
    code, _, err = run_cli(["hf", "export", "--checkpoint", str(out / "dense"), "--out", str(hf)])
    assert code == 0, err
    twin = tokenizer_file_hash(out / "dense" / "tokenizer.json")
    assert tokenizer_file_hash(hf) == twin  # the export's tokenizer.json is the run's tokenizer
    swapped = _variant(load_tokenizer(str(hf)), _drop_last_merge)
    swapped.save(str(tmp_path / "swapped.json"))
    shutil.copy(hf / "tokenizer.json", tmp_path / "same.json")
    base = ["train", "--config", "micro", "--init-from", str(hf), "--print-config", "--set", f"data.cache_dir={cache}"]
    code, text, err = run_cli([*base, f"data.tokenizer={tmp_path / 'swapped.json'}"])
    errors = _error_lines(err)
    assert code == 2 and text == "" and len(errors) == 1, err
    assert (f"data.tokenizer={tmp_path / 'swapped.json'} (hash {tokenizer_hash(swapped)[:16]}) is not the tokenizer "
            f"of --init-from's checkpoint ({hf / 'tokenizer.json'}) (hash {twin[:16]}): leave data.tokenizer out") \
        in errors[0]
    code, text, err = run_cli([*base, f"data.tokenizer={tmp_path / 'same.json'}"])  # a copy: the same tokenizer
    assert code == 0 and json.loads(text)["data"]["tokenizer"] == str(hf / "tokenizer.json"), err


def test_a_study_run_from_another_runs_parameters_must_share_its_tokenizer(study, tmp_path):
    """`StudyRun.init_run`: the run's data is checked against the init run's tokenizer before its
    directory is prepared."""
    from twell_jax import compare as compare_lib
    from twell_jax.training import checkpoint as ckpt_lib

    out, cache = study
    twin = tokenizer_file_hash(out / "dense" / "tokenizer.json")
    swapped = _variant(load_tokenizer(str(out / "dense")), _drop_last_merge)
    swapped.save(str(tmp_path / "swapped.json"))
    cfg = ckpt_lib.load_run_config(out / "dense")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tmp_path / "swapped.json"),
                                                            cache_dir=str(cache)))
    run = compare_lib.StudyRun("dense", cfg, init_run=str(out / "dense"))
    with pytest.raises(ValueError, match=rf"the run's data.tokenizer='.*swapped.json' \(hash "
                                         rf"{tokenizer_hash(swapped)[:16]}\) is not the tokenizer of --init-run "
                                         rf".*dense \(hash {twin[:16]}\): set data.tokenizer"):
        compare_lib.run_study([run], tmp_path / "study", echo=lambda line: None)
    assert not (tmp_path / "study" / "dense").exists()  # nothing trained, no run directory left
