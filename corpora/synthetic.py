"""A synthetic multi-hop knowledge task: facts about invented entities, and 1-3-hop questions.

Made for proving that a trainer learns (``bench/learning.py``): no pretrained model is needed and nothing
can be memorised, because every question has its own chain of fresh entities, whose facts are only in the
corpus. A chain is ``person -born in-> town -lies in-> country -uses-> currency``; a ``h``-hop question
asks for the ``h``-th link and needs ``h`` searches (search the person, read the town, search the town,
read the country, ...). Each entity has one passage titled by its name:

    Kalomi            Kalomi was born in Rutevo.
    Rutevo            Rutevo lies in Sofade.
    Sofade            Sofade uses the pimaru.

Questions: ``Where was Kalomi born?`` (1 hop, ``Rutevo``), ``In which country was Kalomi born?`` (2 hops),
``Which currency is used where Kalomi was born?`` (3 hops). QA metadata: ``hops``, ``chain`` (the entity
names, the answer last), ``supporting_ids`` and ``dataset="synthetic"``.

The difficulty is fixed here (:data:`SPEC`), before any training run, and not tuned to results.

**Task v2** (:data:`SPEC_V2`, :func:`generate_v2`): 1-4 hops, with 4-hop questions in the test split only, so
it asks whether a policy searches deeper than it was trained to. A birthplace question is 1 hop; a currency
question's place of birth lies in ``h - 2`` nested places before the country that names the currency:

    Kalomi            Kalomi was born in Rutevo.
    Rutevo            Rutevo lies in Sofade.          (one "lies in" link per hop beyond 2)
    Sofade            Sofade uses the Pimaru.

so ``Which currency is used where Kalomi was born?`` has 2, 3 or 4 hops and the question does not say
which: the agent has to read each result and search on while it says "lies in". Every hop needs the entity
that only the previous result names, and the classes are mixed in both splits. Currencies are capitalised
like every other name (v1's lowercase currency is a token a tiny from-scratch policy never learns to copy
from its 20 warm-start examples, which caps v1's 3-hop score whatever the search behaviour).

Command line: ``python -m corpora.synthetic OUT_DIR [--v2]`` writes ``corpus.jsonl``, ``train.jsonl``,
``test.jsonl``.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from corpora.formats import Passage, QAExample, write_jsonl

SYLLABLES = (
    "ka", "lo", "mi", "ru", "te", "vo", "zi", "na", "pe", "so", "du", "fa", "gi", "ho", "ju", "be", "ri", "xo",
    "la", "mu", "ne", "po", "si", "ta", "ve", "wo", "yu", "ze", "bi", "co", "de", "fu", "ga", "hi", "jo", "ki",
)
RELATIONS = ("{a} was born in {b}.", "{a} lies in {b}.", "{a} uses the {b}.")
QUESTIONS = ("Where was {p} born?", "In which country was {p} born?", "Which currency is used where {p} was born?")


@dataclass(frozen=True)
class SyntheticSpec:
    """The task's fixed difficulty: split sizes, hop mix, name length in syllables."""

    n_train: int = 240
    n_test: int = 90
    hop_weights: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)
    syllables_per_name: int = 2
    seed: int = 1234


SPEC = SyntheticSpec()


def _names(rng: random.Random, k: int, n_syl: int) -> list[str]:
    pool = [""]
    for _ in range(n_syl):
        pool = [p + s for p in pool for s in SYLLABLES]
    if k > len(pool):
        raise ValueError(f"need {k} distinct names, only {len(pool)} of {n_syl} syllables exist")
    return [n.capitalize() for n in rng.sample(pool, k)]


def _add_chain(passages: list[Passage], qas: list[QAExample], qid: str, chain: list[str], relations: list[str],
               question: str, dataset: str) -> None:
    """Append one question's passages (``relations[j]`` links ``chain[j]`` to ``chain[j + 1]``, passage id
    ``<qid>_<j>``, titled by ``chain[j]``) and its :class:`QAExample` (id ``qid``, the answer ``chain[-1]``)."""
    ids = [f"{qid}_{j}" for j in range(len(relations))]
    for j, (pid, rel) in enumerate(zip(ids, relations, strict=True)):
        passages.append(Passage.make(pid, chain[j], rel.format(a=chain[j], b=chain[j + 1])))
    qas.append(QAExample(qid, question.format(p=chain[0]), [chain[-1]],
                         {"hops": len(relations), "chain": chain, "supporting_ids": ids, "dataset": dataset}))


def generate(spec: SyntheticSpec = SPEC) -> tuple[list[Passage], list[QAExample], list[QAExample]]:
    """Build ``(passages, train, test)`` deterministically from ``spec``. Entities are never shared
    between questions (so neither between train and test). Raises ``ValueError`` if the name space is
    too small for the requested sizes."""
    rng = random.Random(spec.seed)
    n = spec.n_train + spec.n_test
    hops = rng.choices((1, 2, 3), weights=spec.hop_weights, k=n)
    names = iter(_names(rng, sum(h + 1 for h in hops), spec.syllables_per_name))
    passages: list[Passage] = []
    qas: list[QAExample] = []
    for i, h in enumerate(hops):
        chain = [next(names) for _ in range(h + 1)]
        if h == 3:  # v1's currency is lowercase, in its passage and as the answer
            chain[3] = chain[3].lower()
        _add_chain(passages, qas, f"syn{i}", chain, RELATIONS[:h], QUESTIONS[h - 1], "synthetic")
    rng.shuffle(passages)
    return passages, qas[: spec.n_train], qas[spec.n_train :]


@dataclass(frozen=True)
class SyntheticSpecV2:
    """Task v2's fixed difficulty: split sizes, the hop classes of each split (equal shares, mixed), name
    length in syllables."""

    n_train: int = 240
    n_test: int = 120
    train_hops: tuple[int, ...] = (1, 2, 3)
    test_hops: tuple[int, ...] = (1, 2, 3, 4)
    syllables_per_name: int = 2
    seed: int = 4321


SPEC_V2 = SyntheticSpecV2()
QUESTIONS_V2 = ("Where was {p} born?", "Which currency is used where {p} was born?")


def _v2_relations(h: int) -> list[str]:
    """The relation templates of an ``h``-hop v2 chain: born, then ``h - 2`` "lies in", then "uses"."""
    return [RELATIONS[0]] if h == 1 else [RELATIONS[0], *[RELATIONS[1]] * (h - 2), RELATIONS[2]]


def generate_v2(spec: SyntheticSpecV2 = SPEC_V2) -> tuple[list[Passage], list[QAExample], list[QAExample]]:
    """Build task v2's ``(passages, train, test)`` deterministically from ``spec`` (see the module docstring):
    each split holds its hop classes in equal shares (as near as its size allows), shuffled together; no
    entity is shared between questions. Metadata as v1's, with ``dataset="synthetic-v2"``. Raises
    ``ValueError`` for a hop class below 1 or a name space too small for the sizes."""
    if min(spec.train_hops + spec.test_hops) < 1:
        raise ValueError(f"hop classes must be >= 1, got {spec.train_hops} / {spec.test_hops}")
    rng = random.Random(spec.seed)
    splits = []
    for n, classes in ((spec.n_train, spec.train_hops), (spec.n_test, spec.test_hops)):
        hops = [classes[i % len(classes)] for i in range(n)]
        rng.shuffle(hops)
        splits.append(hops)
    all_hops = splits[0] + splits[1]
    names = iter(_names(rng, sum(h + 1 for h in all_hops), spec.syllables_per_name))
    passages: list[Passage] = []
    qas: list[QAExample] = []
    for i, h in enumerate(all_hops):
        chain = [next(names) for _ in range(h + 1)]
        _add_chain(passages, qas, f"syn2_{i}", chain, _v2_relations(h), QUESTIONS_V2[h > 1], "synthetic-v2")
    rng.shuffle(passages)
    return passages, qas[: spec.n_train], qas[spec.n_train :]


def write(out_dir: str | Path, spec: SyntheticSpec | SyntheticSpecV2 = SPEC) -> dict[str, Path]:
    """Write ``corpus.jsonl``, ``train.jsonl`` and ``test.jsonl`` of task v1 (a :class:`SyntheticSpec`) or
    v2 (a :class:`SyntheticSpecV2`) under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    passages, train, test = generate_v2(spec) if isinstance(spec, SyntheticSpecV2) else generate(spec)
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.jsonl", "test": out / "test.jsonl"}
    write_jsonl(paths["corpus"], passages)
    write_jsonl(paths["train"], train)
    write_jsonl(paths["test"], test)
    return paths


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--v2"):
        sys.exit("usage: python -m corpora.synthetic OUT_DIR [--v2]")
    print(write(sys.argv[1], SPEC_V2 if len(sys.argv) == 3 else SPEC))
