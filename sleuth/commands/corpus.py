"""``sleuth corpus``: pool, deduplicate and chunk passages from QA files or corpora into one corpus JSONL."""

from __future__ import annotations

import argparse

from sleuth.commands._common import non_negative_int, positive_int

HELP = "Pool the context paragraphs of multi-hop QA files into a deduplicated (title+text) corpus JSONL."

EPILOG = """inputs (streamed, auto-detected per line):
  IRCoT-processed QA (contexts[].paragraph_text), e.g. ../shared/data/hotpotqa/dev_400_with_contexts.ircot.jsonl
  raw HotpotQA / 2WikiMultihopQA (context = [[title, sentences]]; JSONL, or their releases' one JSON array),
  raw MuSiQue (paragraphs[])
  a corpus JSONL ({id, contents} or {id, title, text}), to deduplicate or --chunk-words it
note: the 2WikiMultihopQA and MuSiQue files in ../shared/data are Search-R1 exports (questions and
answers only, no paragraphs), so only HotpotQA can be pooled from there; bring the raw 2Wiki/MuSiQue files
(which carry paragraphs) to pool them.
example:
  sleuth corpus --from ../shared/data/hotpotqa/dev_400_with_contexts.ircot.jsonl \\
      --out runs/corpora/hotpotqa.jsonl --qa-out runs/corpora/hotpotqa_qa.jsonl
  sleuth index --corpus runs/corpora/hotpotqa.jsonl --out runs/index_hotpotqa"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument(
        "--from", dest="sources", nargs="+", required=True, metavar="FILE", help="input JSONL files (or JSON array files)"
    )
    p.add_argument("--out", required=True, help="corpus JSONL to write {id, title, contents}")
    p.add_argument("--qa-out", default=None, help="also write the questions as QA JSONL with supporting_ids")
    p.add_argument("--chunk-words", type=positive_int, default=None,
                   help="split passages longer than this many words (>= 1; default: no chunking)")
    p.add_argument("--overlap", type=non_negative_int, default=0,
                   help="words shared by consecutive chunks (with --chunk-words; less than it; default 0)")
    p.add_argument("--id-prefix", default="p", help="prefix of pooled passage ids (default 'p')")
    p.add_argument("--dataset", default=None, help="dataset name recorded in the QA metadata")


def run(args: argparse.Namespace) -> int:
    from corpora.pool import pool_corpus

    if args.overlap and args.chunk_words is None:
        raise ValueError("--overlap needs --chunk-words (without it passages are not chunked)")
    if args.chunk_words is not None and args.overlap >= args.chunk_words:
        raise ValueError(f"--overlap ({args.overlap}) must be less than --chunk-words ({args.chunk_words})")

    stats = pool_corpus(
        args.sources,
        args.out,
        qa_out=args.qa_out,
        chunk_size=args.chunk_words,
        overlap=args.overlap,
        id_prefix=args.id_prefix,
        dataset=args.dataset,
    )
    print(
        f"{stats['passages']} passages from {stats['paragraphs']} paragraphs in {stats['records']} records "
        f"({stats['duplicates']} duplicates dropped) -> {args.out}"
        + (f"; {stats['questions']} questions -> {args.qa_out} ({stats['duplicate_questions']} repeated ids and "
           f"{stats['unanswerable']} unanswerable left out)" if args.qa_out else "")
    )
    return 0
