"""The offline corpus on this machine: how many tokens the "installed" source (the standard library
plus every installed package's sources and docs, `twell_jax/data/tree.py`) holds, and how long its
BPE training and its tokenizing take (issue 23's target: >= 100M tokens tokenized in <= 5 minutes
on 16 cores).

    python experiments/measure_corpus.py --vocab-size 49152        # writes $OUT/measure_corpus.json

Phases are timed apart through the library: listing + reading (`iter_documents`, one pass), the BPE
(`build_tokenizer`), and tokenizing into the cache (`build_data`, `data.tokenize_workers` processes).
The cache goes to --cache-dir (default a fresh temporary directory, so nothing is a cache hit).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from twell_jax.config import DataConfig
from twell_jax.data import build_data, iter_documents
from twell_jax.data.bundle import build_tokenizer
from twell_jax.data.sources import list_source_files


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="installed")
    parser.add_argument("--include", default="", help="comma-separated patterns ('' = the source's default)")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--tokenizer", default="bpe", help="'bpe' or a tokenizer.json")
    parser.add_argument("--workers", type=int, default=0, help="data.tokenize_workers (0 = every core)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # before the listing, the BPE, the tokenizing
        parser.error(f"--out {args.out} is a file; give a directory for measure_corpus.json")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="twell_corpus_")
    include = tuple(p.strip() for p in args.include.split(",") if p.strip())
    cfg = DataConfig(source=args.source, include=include, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                     seq_len=2048, val_fraction=0.001, tokenize_workers=args.workers, cache_dir=cache_dir)
    start = time.perf_counter()
    files = list_source_files(cfg)
    listed_s = time.perf_counter() - start
    start = time.perf_counter()
    num_documents, num_bytes = 0, 0
    for text in iter_documents(cfg, files):
        num_documents += 1
        num_bytes += len(text.encode("utf-8", errors="surrogatepass"))
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    build_tokenizer(cfg)
    bpe_s = time.perf_counter() - start
    start = time.perf_counter()
    bundle = build_data(cfg, global_batch=1)
    tokenize_s = time.perf_counter() - start
    tokens = bundle.num_train_tokens + bundle.num_val_tokens
    result = {"source": args.source, "include": list(include), "files": len(files), "documents": num_documents,
              "megabytes": num_bytes / 1e6, "tokens": tokens, "train_tokens": bundle.num_train_tokens,
              "vocab_size": bundle.vocab_size, "cpu_cores": os.cpu_count(), "list_s": listed_s, "read_s": read_s,
              "bpe_s": bpe_s, "tokenize_s": tokenize_s, "tokens_per_s": tokens / tokenize_s,
              "target_met": tokens >= 100e6 and tokenize_s <= 300}
    print("| files | documents (unique) | MB | tokens | list s | read s | BPE s | tokenize s | target |\n"
          "|---|---|---|---|---|---|---|---|---|\n"
          f"| {len(files)} | {num_documents} | {num_bytes / 1e6:.0f} | {tokens / 1e6:.1f}M | {listed_s:.1f} | "
          f"{read_s:.1f} | {bpe_s:.1f} | {tokenize_s:.1f} | {'met' if result['target_met'] else 'NOT met'} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "measure_corpus.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
