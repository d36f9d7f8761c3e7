"""A run's tokenizer identity: the hash it recorded (`data.tokenizer.tokenizer_record`), or, for a run
from before hashes were recorded, the hash of its saved tokenizer.json. Compared with
`data.tokenizer.check_same_tokenizer` by `twell compare`, the loaders and `--init-from`."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from twell_jax import run_dir as run_dir_lib
from twell_jax.data import tokenizer as tokenizer_lib

_warned_unknown: set[str] = set()  # run directories warned about: once each


def run_tokenizer_hash(run_dir: str | Path, *, warn: Callable[[str], None]) -> str | None:
    """The hash of the tokenizer a run was trained with: the one it recorded (`tokenizer_record`),
    else, for a run recorded before hashes were or by another version of `tokenizers`, computed
    from its tokenizer.json. None for a run without a tokenizer, and for one whose tokenizer is
    unknown (neither recorded nor saved: `warn` is told, once per run directory)."""
    record = run_dir_lib.read_corpus_fingerprint(run_dir)
    if "tokenizer" in record and (record["tokenizer"] is None or record.get("tokenizers") == tokenizer_lib.library_version()):
        return record["tokenizer"]
    saved = run_dir_lib.saved_tokenizer(run_dir)
    if saved is not None:
        return tokenizer_lib.tokenizer_file_hash(saved)
    if "tokenizer" in record:  # recorded by another version of the library, and the file is gone
        return record["tokenizer"]
    cfg = run_dir_lib.saved_config(run_dir)
    if cfg is not None and cfg.data.is_synthetic:  # a run on token ids, from before hashes were recorded
        return None
    key = str(Path(run_dir).absolute())
    if key not in _warned_unknown:
        _warned_unknown.add(key)
        warn(f"[twell] warning: {run_dir} records no tokenizer hash and has no {run_dir_lib.TOKENIZER_FILE}: its "
             "tokenizer cannot be checked against others")
    return None
