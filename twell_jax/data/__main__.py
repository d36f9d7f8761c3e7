"""`python -m twell_jax.data`: build (and cache) a dataset and print its statistics."""
from __future__ import annotations

import argparse
import time

from twell_jax.config import DataConfig
from twell_jax.data.bundle import build_data


def main(argv: list[str] | None = None) -> None:
    """Build (and cache) a dataset and print its statistics."""
    defaults = DataConfig()
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--source", default=defaults.source)
    parser.add_argument("--tokenizer", default=defaults.tokenizer)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--txt-separator", default=None,
                        help=r"split .txt files into documents at this string; escapes: \n \t \r \\")
    parser.add_argument("--include", default="",
                        help="comma-separated glob patterns for a directory or 'installed' source, e.g. '*.py,*.md'")
    parser.add_argument("--tokenize-workers", type=int, default=defaults.tokenize_workers,
                        help="processes tokenizing in parallel (0 = every core)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    args = parser.parse_args(argv)
    try:
        cfg = DataConfig(source=args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                         seq_len=args.seq_len, max_documents=args.max_documents, val_fraction=args.val_fraction,
                         txt_separator=args.txt_separator, cache_dir=args.cache_dir,
                         include=tuple(p.strip() for p in args.include.split(",") if p.strip()),
                         tokenize_workers=args.tokenize_workers)
        start = time.perf_counter()
        bundle = build_data(cfg, global_batch=args.global_batch)
    except ValueError as error:
        parser.error(str(error))
    built = time.perf_counter() - start
    batch = next(bundle.train_iter)
    print(f"built in {built:.2f}s (trained BPE: {bundle.built_tokenizer}, tokenized: {bundle.built_tokens}); "
          f"first batch {batch['tokens'].shape} {batch['tokens'].dtype}; train tokens {bundle.num_train_tokens}, "
          f"val tokens {bundle.num_val_tokens}; corpus fingerprint {bundle.source_fingerprint[:16]}")


if __name__ == "__main__":
    main()
