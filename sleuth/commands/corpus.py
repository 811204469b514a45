"""``sleuth corpus``: pool, deduplicate and chunk passages from QA files or corpora into one corpus JSONL; convert
the public wiki-18 passages (``--wiki18``) or a QA file of any supported format (``--qa-from``)."""

from __future__ import annotations

import argparse

from sleuth.commands.common import non_negative_int, positive_int

HELP = ("Pool the context paragraphs of multi-hop QA files into a deduplicated (title+text) corpus JSONL; convert "
        "wiki-18 (--wiki18) or a QA file (--qa-from)")

EPILOG = """inputs (streamed, auto-detected per line):
  IRCoT-processed QA (contexts[].paragraph_text), e.g. IRCoT's dev_400_with_contexts.ircot.jsonl (HotpotQA)
  raw HotpotQA / 2WikiMultihopQA (context = [[title, sentences]]; JSONL, or their releases' one JSON array),
  raw MuSiQue (paragraphs[])
  a corpus JSONL ({id, contents} or {id, title, text}), to deduplicate or --chunk-words it
note: Search-R1 exports and the benchmarks `sleuth data get` fetches hold questions and answers only, no
paragraphs; bring the raw or IRCoT-processed files (which carry paragraphs) to pool them.
example:
  sleuth corpus --from dev_400_with_contexts.ircot.jsonl \\
      --out runs/corpora/hotpotqa.jsonl --qa-out runs/corpora/hotpotqa_qa.jsonl
  sleuth index --corpus runs/corpora/hotpotqa.jsonl --out runs/index_hotpotqa
  sleuth corpus --wiki18 wiki-18.jsonl.gz --out runs/wiki18/corpus.jsonl   # Search-R1's 21M passages, ids kept
  sleuth corpus --qa-from questions.parquet --qa-out runs/qa/questions.jsonl   # a QA file of any format
(`sleuth data get wiki18 nq_hotpotqa_train` downloads and converts Search-R1's corpus and questions)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="sources", nargs="+", metavar="FILE",
                     help="input JSONL files (or JSON array files) to pool")
    src.add_argument("--wiki18", metavar="FILE", help="convert Search-R1's wiki-18 passages (wiki-18.jsonl or .gz) "
                     "to --out as they are: ids, order and contents kept, the title beside them")
    src.add_argument("--qa-from", metavar="FILE", help="convert a QA file of any format sleuth eval reads "
                     "(Search-R1 parquet/JSONL, FlashRAG, HotpotQA, 2Wiki, MuSiQue, IRCoT) to FlashRAG QA JSONL "
                     "at --qa-out (data.train / data.test)")
    p.add_argument("--out", default=None, help="corpus JSONL to write {id, title, contents} (--from, --wiki18)")
    p.add_argument("--qa-out", default=None, help="also write the questions as QA JSONL with supporting_ids "
                   "(--from); the converted questions (--qa-from)")
    p.add_argument("--limit", type=positive_int, default=None, help="--wiki18: only the first N passages")
    p.add_argument("--chunk-words", type=positive_int, default=None,
                   help="split passages longer than this many words (>= 1; default: no chunking)")
    p.add_argument("--overlap", type=non_negative_int, default=0,
                   help="words shared by consecutive chunks (with --chunk-words; less than it; default 0)")
    p.add_argument("--id-prefix", default="p", help="prefix of pooled passage ids (default 'p')")
    p.add_argument("--dataset", default=None, help="dataset name recorded in the QA metadata")


def run(args: argparse.Namespace) -> int:
    if args.qa_from:
        return _convert_qa(args)
    if not args.out:
        raise ValueError("--out is needed: the corpus JSONL to write")
    if args.wiki18:
        return _convert_wiki18(args)
    if args.limit is not None:
        raise ValueError("--limit goes with --wiki18")
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


def _convert_wiki18(args: argparse.Namespace) -> int:
    from corpora.wiki18 import WIKI18_PASSAGES, convert_wiki18

    if args.qa_out or args.chunk_words or args.overlap:
        raise ValueError("--wiki18 converts the passages as they are: --qa-out, --chunk-words and --overlap go "
                         "with --from")
    total = args.limit or WIKI18_PASSAGES
    stats = convert_wiki18(args.wiki18, args.out, limit=args.limit,
                           progress=lambda n: print(f"  {n:,} of ~{total:,} passages", flush=True))
    print(f"{stats['passages']:,} wiki-18 passages -> {args.out} ({stats['untitled']} without a title line; ids "
          + ("are the row numbers, as in Search-R1's e5 index)" if stats["ids_are_rows"] else
             "are not all row numbers: an index built by Search-R1 over another file will not line up)"))
    return 0


def _convert_qa(args: argparse.Namespace) -> int:
    from corpora.formats import write_jsonl
    from corpora.qa import read_qa

    if not args.qa_out or args.out or args.limit:
        raise ValueError("--qa-from writes the questions to --qa-out (and takes no --out or --limit)")
    examples = read_qa(args.qa_from, dataset=args.dataset)
    n = write_jsonl(args.qa_out, examples)
    print(f"{n} questions from {args.qa_from} -> {args.qa_out}")
    return 0
