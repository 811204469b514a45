"""``sleuth simulator-data``: fine-tuning data for the ZeroSearch simulator, built from the real retriever.

For every training question, the real retriever answers the question (and, for multi-hop questions, the
titles of its supporting paragraphs); each retrieved document becomes one example ``prompt -> document``
labelled *useful* when it leads to the gold answer (it is a supporting paragraph, or it contains a
normalised golden answer as whole words: gold "2" is not in "1925", "no" is not in "north"; a yes/no gold
says nothing about a passage, so only supporting ids decide those) and *noisy* otherwise. The prompt is :func:`retrieval.simulated.simulator_prompt`
with that label, so a simulator fine-tuned on this file is steered by the same useful/noisy switch that
:class:`retrieval.simulated.SimulatedSearch` uses at rollout time (ZeroSearch, section 3.2). The retriever is
the configured index or server; ``retrieval.method: simulated`` (a training config's) is a ``ValueError``, as the
simulator would write its own training data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sleuth.commands.common import add_config_arguments, config_from_args, positive_int

HELP = "build the simulated-search (ZeroSearch) fine-tuning data from the real retriever"


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--out", help="output JSONL (default: <out_dir>/simulator_sft.jsonl)")
    p.add_argument("--qa", help="QA file (default: data.train or the shipped sample's train split)")
    p.add_argument("--index", help="index directory (default: retrieval.index_dir)")
    p.add_argument("-k", type=positive_int, default=5, help="documents per query (default 5)")
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many questions")


def simulator_examples(examples: list[Any], retriever: Any, k: int, titles_by_id: dict[str, str] | None = None) -> list[dict]:
    """One record per (query, retrieved document): ``question_id``, ``query``, ``doc_id``, ``label``
    (``useful``/``noisy``), ``prompt`` and ``completion`` (title line + paragraph)."""
    from agent.metrics import normalize_answer
    from retrieval.simulated import NOISY, USEFUL, document_completion, simulator_prompt

    titles_by_id = titles_by_id or {}
    queries, owners = [], []
    for ex in examples:
        qs = [ex.question] + [titles_by_id[s] for s in ex.metadata.get("supporting_ids", []) or [] if s in titles_by_id]
        for q in dict.fromkeys(qs):
            queries.append(q)
            owners.append(ex)
    out = []
    hits_per_query = retriever.search(queries, k) if queries else []
    for q, ex, hits in zip(queries, owners, hits_per_query, strict=True):
        golds = [f" {g} " for g in (normalize_answer(a) for a in ex.golden_answers) if g and g not in ("yes", "no")]
        support = set(ex.metadata.get("supporting_ids", []) or [])
        for h in hits:
            words = f" {normalize_answer(h.contents)} "  # normalize_answer leaves single spaces between words
            useful = h.id in support or any(g in words for g in golds)
            label = USEFUL if useful else NOISY
            out.append({"question_id": ex.id, "query": q, "doc_id": h.id, "label": label,
                        "prompt": simulator_prompt(q, label), "completion": document_completion(h.title, h.text)})
    return out


def run(args) -> int:
    from corpora import read_qa
    from corpora.formats import iter_corpus
    from retrieval.registry import RETRIEVERS
    from sleuth.pipeline import data_paths, open_retriever

    cfg = config_from_args(args)
    if RETRIEVERS.get(cfg.retrieval.method).generative:  # (a training config's) the simulator would label its own
        raise ValueError("sleuth simulator-data builds the simulator's data from a real retriever, and "
                         f"retrieval.method={cfg.retrieval.method} writes its documents with an LLM: give a real "
                         "one, e.g. retrieval.method=bm25 (with --index or retrieval.index_dir), or retrieval.url=...")
    paths = data_paths(cfg)
    qa_path = args.qa or paths["train"]
    examples = read_qa(qa_path)[: args.limit]
    if not examples:  # not an empty fine-tuning file and exit 0
        raise ValueError(f"no questions in {qa_path}: give a QA file with --qa or data.train")
    retriever = open_retriever(cfg, args.index)
    titles = {p.id: p.title for p in iter_corpus(paths["corpus"])}
    recs = simulator_examples(examples, retriever, args.k, titles)
    out = Path(args.out or Path(cfg.out_dir) / "simulator_sft.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    n_useful = sum(r["label"] == "useful" for r in recs)
    print(f"wrote {len(recs)} simulator examples ({n_useful} useful, {len(recs) - n_useful} noisy) "
          f"from {len(examples)} questions to {out}")
    return 0
