"""The shipped sample: real HotpotQA dev questions and the pooled corpus of their context paragraphs.

``prepare_hotpotqa_sample`` rebuilds it from the IRCoT-processed HotpotQA dev file (see
``corpora/sample/README.md`` for source and license). The split into train and test questions is a seeded
shuffle, fixed at preparation time: the quickstart trains only on ``train.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from corpora.formats import Passage, QAExample, write_jsonl

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"


def sample_paths() -> dict[str, Path]:
    """Paths of the shipped sample: ``corpus``, ``train``, ``test``."""
    return {
        "corpus": SAMPLE_DIR / "corpus.jsonl",
        "train": SAMPLE_DIR / "train.jsonl",
        "test": SAMPLE_DIR / "test.jsonl",
    }


def prepare_hotpotqa_sample(
    src: str | Path, out_dir: str | Path, n_test: int = 100, seed: int = 0
) -> dict[str, int]:
    """Pool the context paragraphs of IRCoT-format HotpotQA questions into a corpus and split the questions.

    Paragraphs are deduplicated by (title, text); each question's ``metadata.supporting_ids`` lists the
    corpus ids of its supporting paragraphs and ``metadata.hops`` is 2 (HotpotQA is two-hop).
    Returns counts of passages, train and test questions.
    """
    src, out_dir = Path(src), Path(out_dir)
    key_to_id: dict[tuple[str, str], str] = {}
    passages: list[Passage] = []
    examples: list[QAExample] = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            supporting: list[str] = []
            for ctx in row["contexts"]:
                key = (ctx["title"], " ".join(ctx["paragraph_text"].split()))
                if key not in key_to_id:
                    key_to_id[key] = f"hp{len(passages)}"
                    passages.append(Passage.make(key_to_id[key], *key))
                if ctx.get("is_supporting"):
                    supporting.append(key_to_id[key])
            answers = [s for a in row["answers_objects"] for s in a["spans"] if s]
            examples.append(
                QAExample(
                    id=row["question_id"],
                    question=row["question_text"],
                    golden_answers=answers,
                    metadata={"dataset": "hotpotqa", "hops": 2, "supporting_ids": supporting},
                )
            )
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    test = [examples[i] for i in sorted(order[:n_test])]
    train = [examples[i] for i in sorted(order[n_test:])]
    write_jsonl(out_dir / "corpus.jsonl", passages)
    write_jsonl(out_dir / "train.jsonl", train)
    write_jsonl(out_dir / "test.jsonl", test)
    return {"passages": len(passages), "train": len(train), "test": len(test)}


if __name__ == "__main__":  # python -m corpora.sample path/to/dev_400_with_contexts.ircot.jsonl
    import sys

    print(prepare_hotpotqa_sample(sys.argv[1], SAMPLE_DIR))
