"""The seven QA benchmarks of search-agent papers, and a reader for every format they ship in.

Benchmarks (Search-R1, Jin et al. 2025, Table 2; FlashRAG, Jin et al. 2024): general QA NQ, TriviaQA,
PopQA; multi-hop QA HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle. :data:`REGISTRY` maps each name to a file
and split under a data directory (default ``../shared/data`` relative to the project root, overridden by
the ``SLEUTH_DATA_DIR`` environment variable or an explicit ``data_dir``); ``sample`` is the shipped
HotpotQA test sample (``corpora/sample/test.jsonl``), whose questions carry corpus ids of their supporting
paragraphs.

Formats read (detected from the file suffix and the first record's fields, or forced with ``fmt``):

* ``searchr1``: Search-R1 / verl JSONL or parquet rows: ``prompt[0].content`` (the question, or Search-R1's
  instruction template ending in ``Question: ...``), ``reward_model.ground_truth`` (a string, a list, or
  ``{"target": [...]}``), ``extra_info.{question, answer, index, split}`` (``answer`` may be a list).
  ``extra_info`` wins where both exist (``ground_truth`` may be several answers joined by ", ").
* ``flashrag``: FlashRAG JSONL ``{"id", "question", "golden_answers", "metadata"}``.
* ``hotpotqa``: the official HotpotQA JSON list ``[{"_id", "question", "answer", "supporting_facts",
  "context", "type", "level"}]``.
* ``2wiki``: the official 2WikiMultihopQA JSON list (HotpotQA's fields plus ``evidences``; ``type`` is one of
  comparison, inference, compositional, bridge_comparison).
* ``musique``: the official MuSiQue JSONL ``{"id", "question", "answer", "answer_aliases", "answerable",
  "paragraphs", "question_decomposition"}`` (unanswerable questions are skipped).
* ``ircot``: IRCoT's processed JSONL ``{"question_id", "question_text", "answers_objects", "contexts"}``.

Every loader returns :class:`corpora.formats.QAExample` with ``metadata["dataset"]``, ``metadata["hops"]``
(int where derivable: HotpotQA and Bamboogle 2; MuSiQue from the official id prefix ``2hop__``/``3hop1__``
or the number of decomposition steps; 2Wiki from its question type; only the official MuSiQue JSONL and 2Wiki
JSON carry these: the registered Search-R1 exports of both have neither (their ids are ``<split>_<index>``),
so their hops are ``None`` and EM by hops skips them) and, where the source has them,
``metadata["supporting_titles"]``. A malformed record raises :class:`corpora.formats.DataFormatError` naming
the file, line (or row) and field.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corpora.formats import DataFormatError, QAExample, answer_texts, iter_json_lines, nonblank_text

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = PROJECT_ROOT.parent / "shared" / "data"
SAMPLE_TEST = PROJECT_ROOT / "corpora" / "sample" / "test.jsonl"
FORMATS = ("auto", "searchr1", "flashrag", "hotpotqa", "2wiki", "musique", "ircot")

# 2WikiMultihopQA question types -> reasoning hops (Ho et al., COLING 2020, Sec. 3: a bridge-comparison
# question composes two bridge hops per compared entity with a comparison).
TWOWIKI_HOPS = {"comparison": 2, "inference": 2, "compositional": 2, "bridge_comparison": 4}


class UnknownBenchmarkError(ValueError):
    """A benchmark name is not in the registry; the message lists the known names."""


@dataclass(frozen=True)
class Benchmark:
    """One registry entry: ``path`` is relative to the data dir (absolute for ``sample``); ``hops`` is the
    fixed hop count of every question when the dataset has one (else derived per question or ``None``)."""

    name: str
    path: str
    split: str
    multihop: bool
    hops: int | None = None
    fmt: str = "auto"


REGISTRY: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("nq", "nq/test.searchr1.jsonl", "test", multihop=False),
        Benchmark("triviaqa", "triviaqa/test_subsample.jsonl", "test", multihop=False),
        Benchmark("popqa", "popqa/test_subsample.jsonl", "test", multihop=False),
        Benchmark("hotpotqa", "hotpotqa/dev.searchr1.jsonl", "dev", multihop=True, hops=2),
        Benchmark("2wikimultihopqa", "2wikimultihopqa/dev.searchr1.parquet", "dev", multihop=True),
        Benchmark("musique", "musique/dev.searchr1.jsonl", "dev", multihop=True),
        Benchmark("bamboogle", "bamboogle/test.searchr1.jsonl", "test", multihop=True, hops=2),
        Benchmark("sample", str(SAMPLE_TEST), "test", multihop=True, hops=2, fmt="flashrag"),
    ]
}
ALIASES = {"2wiki": "2wikimultihopqa", "hotpot": "hotpotqa", "tqa": "triviaqa", "natural_questions": "nq"}
ALL = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
MULTIHOP = tuple(n for n in ALL if REGISTRY[n].multihop)


def known_benchmarks() -> list[str]:
    """Registry names, then ``all`` (the seven benchmarks) and aliases."""
    return [*REGISTRY, "all", *ALIASES]


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` if given, else ``$SLEUTH_DATA_DIR``, else ``<project root>/../shared/data``."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get("SLEUTH_DATA_DIR")
    return Path(env) if env else DEFAULT_DATA_DIR


def get_benchmark(name: str) -> Benchmark:
    """Registry entry of ``name`` (case-insensitive, aliases accepted). Raises
    :class:`UnknownBenchmarkError` listing the known names."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in REGISTRY:
        raise UnknownBenchmarkError(f"unknown benchmark {name!r}; known: {', '.join(known_benchmarks())}")
    return REGISTRY[key]


def expand_benchmarks(names: list[str] | str) -> list[str]:
    """Expand ``"all"`` and comma-separated lists into registry names (or QA file paths, kept as given),
    deduplicated in order. Raises :class:`UnknownBenchmarkError` for an unknown name."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for item in names:
        for n in (p.strip() for p in item.split(",")):
            if not n:
                continue
            if _is_file_name(n):
                resolved = [n]
            elif n.lower() == "all":
                resolved = list(ALL)
            else:
                resolved = [get_benchmark(n).name]
            out.extend(r for r in resolved if r not in out)
    return out


def _is_file_name(name: str) -> bool:
    return name.endswith((".jsonl", ".json", ".parquet")) or os.sep in name


def benchmark_path(name: str, data_dir: str | Path | None = None) -> Path:
    """The file a registry name (or alias) reads."""
    b = get_benchmark(name)
    p = Path(b.path)
    return p if p.is_absolute() else resolve_data_dir(data_dir) / p


def locate_benchmark(name: str, data_dir: str | Path | None = None) -> tuple[Path, Benchmark | None]:
    """The existing QA file of a registry name (or alias), or of a path, and its registry entry (``None`` for
    a path); cheap, so callers can check every benchmark before loading anything.

    Raises :class:`UnknownBenchmarkError` (lists the known names) and ``FileNotFoundError`` (says where the
    data dir is and how to change it).
    """
    if _is_file_name(name):
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"QA file not found: {path}")
        return path, None
    b = get_benchmark(name)
    path = benchmark_path(name, data_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"benchmark {b.name!r}: file not found: {path} (data dir {resolve_data_dir(data_dir)}; set "
            "SLEUTH_DATA_DIR or --data-dir to the folder holding the benchmark files)"
        )
    return path, b


def load_benchmark(
    name: str, data_dir: str | Path | None = None, limit: int | None = None, seed: int = 0
) -> list[QAExample]:
    """Load a benchmark by registry name (or a QA file by path), optionally sub-sampled (:func:`subsample`).

    Raises :class:`UnknownBenchmarkError` (lists the known names), ``FileNotFoundError`` (says where the
    data dir is and how to change it) and :class:`DataFormatError` (file, line, field).
    """
    path, b = locate_benchmark(name, data_dir)
    examples = read_qa_file(
        path,
        fmt=b.fmt if b else "auto",
        dataset=b.name if b else path.stem,
        split=b.split if b else None,
        hops=b.hops if b else None,
    )
    return subsample(examples, limit, seed)


def subsample(examples: list[QAExample], limit: int | None, seed: int = 0) -> list[QAExample]:
    """A deterministic random subset of ``limit`` examples, kept in file order.

    The subset is the first ``limit`` of a seeded permutation, so a larger ``limit`` with the same seed
    contains the smaller one (extending a cached run computes only the new questions). ``limit=None`` or
    ``limit >= len(examples)`` returns all. Raises ``ValueError`` for ``limit < 1``.
    """
    if limit is None or limit >= len(examples):
        return list(examples)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return [examples[i] for i in sorted(order[:limit])]


# -- reading ---------------------------------------------------------------------------------------------
def _iter_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(location, record)``; location is ``"line N"``, ``"row N"`` or ``"record N"`` (1-based)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for rec in batch.to_pylist():
                row += 1
                yield f"row {row}", rec
        return
    if suffix == ".json":
        try:
            data = json.loads(path.read_bytes())
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError as e:
            raise DataFormatError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataFormatError(f"{path}: expected a JSON list of questions, got {type(data).__name__}")
        for i, rec in enumerate(data, start=1):
            if not isinstance(rec, dict):
                raise DataFormatError(f"{path}: record {i}: expected a JSON object")
            yield f"record {i}", rec
        return
    for lineno, rec in iter_json_lines(path):
        yield f"line {lineno}", rec


def detect_format(rec: dict[str, Any]) -> str:
    """Guess a record's format from its fields (see the module docstring); ``"flashrag"`` by default."""
    if "prompt" in rec or "reward_model" in rec or "extra_info" in rec:
        return "searchr1"
    if "question_text" in rec or "answers_objects" in rec:
        return "ircot"
    if "paragraphs" in rec or "question_decomposition" in rec or "answer_aliases" in rec:
        return "musique"
    if "_id" in rec:
        # both have type "comparison"; only 2Wiki has evidences and its other types, only HotpotQA has level
        two_wiki = "evidences" in rec or (rec.get("type") in TWOWIKI_HOPS and rec.get("type") != "comparison")
        return "2wiki" if two_wiki and "level" not in rec else "hotpotqa"
    return "flashrag"


class _Ctx:
    """Names a record in error messages: ``path:line N: missing field 'x'``."""

    def __init__(self, path: Path, loc: str):
        self.where = f"{path}: {loc}"
        self.loc = loc

    def fail(self, msg: str) -> DataFormatError:
        return DataFormatError(f"{self.where}: {msg}")

    def get(self, rec: dict[str, Any], dotted: str) -> Any:
        cur: Any = rec
        for part in dotted.split("."):
            if isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            elif isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                have = sorted(cur) if isinstance(cur, dict) else type(cur).__name__
                raise self.fail(f"missing field {dotted!r} (has {have})")
        return cur

    def text(self, rec: dict[str, Any], dotted: str) -> str:
        """A text field: a string (or a number, as its text) that is not blank; ``null`` is no text."""
        v = self.get(rec, dotted)
        text = nonblank_text(v)
        if text is None:
            raise self.fail(f"field {dotted!r} must be a non-empty string, got {v!r:.60}")
        return text


def _answers(value: Any, ctx: _Ctx, field: str) -> list[str]:
    if isinstance(value, dict) and "target" in value:  # Search-R1: {"target": [...]}
        value = value["target"]
    if isinstance(value, str):
        value = [value]
    if hasattr(value, "tolist"):  # numpy arrays from parquet readers
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ctx.fail(f"field {field!r} must be a string or a list of strings, got {type(value).__name__}")
    try:  # null and blank answers are left out; an object, list or bool is no answer text
        out = [text.strip() for text in answer_texts(list(value))]
    except ValueError as e:
        raise ctx.fail(f"field {field!r} {e}") from None
    if not out:
        raise ctx.fail(f"field {field!r} has no non-empty answer")
    return out


_QUESTION_IN_TEMPLATE = re.compile(r"Question:\s*(.+?)\s*$", re.DOTALL)


def _from_searchr1(rec: dict[str, Any], ctx: _Ctx, split: str | None) -> QAExample:
    info = rec.get("extra_info") or {}
    if info.get("question"):
        question = str(info["question"])
    else:
        question = ctx.text(rec, "prompt.0.content")
        m = list(_QUESTION_IN_TEMPLATE.finditer(question))  # Search-R1 instruction template
        if "<search>" in question and m:
            question = m[-1].group(1)
    if info.get("answer") is not None:
        answers = _answers(info["answer"], ctx, "extra_info.answer")
    else:
        if not isinstance(rec.get("reward_model"), dict) or "ground_truth" not in rec["reward_model"]:
            raise ctx.fail("missing field 'reward_model.ground_truth' (or 'extra_info.answer')")
        answers = _answers(rec["reward_model"]["ground_truth"], ctx, "reward_model.ground_truth")
    if rec.get("id") is not None:  # a parquet row may have a null id column
        qid = str(rec["id"])
    elif info.get("index") is not None:
        qid = f"{info.get('split') or split or 'q'}_{info['index']}"
    else:
        qid = ctx.loc.replace(" ", "_")
    meta = {"data_source": rec.get("data_source")} if rec.get("data_source") else {}
    return QAExample(id=qid, question=question.strip(), golden_answers=answers, metadata=meta)


def _from_flashrag(rec: dict[str, Any], ctx: _Ctx) -> QAExample:
    answers = _answers(ctx.get(rec, "golden_answers"), ctx, "golden_answers")
    meta = rec.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ctx.fail("field 'metadata' must be a JSON object")
    return QAExample(
        id=ctx.text(rec, "id"), question=ctx.text(rec, "question"), golden_answers=answers, metadata=dict(meta)
    )


def _supporting_titles(rec: dict[str, Any], ctx: _Ctx) -> list[str]:
    facts = rec.get("supporting_facts") or []
    titles: list[str] = []
    for fact in facts:
        if not isinstance(fact, (list, tuple)) or not fact:
            raise ctx.fail("field 'supporting_facts' must be a list of [title, sentence_id] pairs")
        if str(fact[0]) not in titles:
            titles.append(str(fact[0]))
    return titles


def _from_hotpot_like(rec: dict[str, Any], ctx: _Ctx, two_wiki: bool) -> QAExample:
    titles = _supporting_titles(rec, ctx)
    qtype = rec.get("type")
    meta: dict[str, Any] = {"type": qtype, "supporting_titles": titles}
    if two_wiki:
        meta["hops"] = TWOWIKI_HOPS.get(str(qtype)) or (len(titles) or None)
    else:
        meta["hops"] = 2
        if "level" in rec:
            meta["level"] = rec["level"]
    return QAExample(
        id=ctx.text(rec, "_id"),
        question=ctx.text(rec, "question"),
        golden_answers=_answers(ctx.get(rec, "answer"), ctx, "answer"),
        metadata=meta,
    )


_MUSIQUE_HOPS = re.compile(r"^(\d+)hop")


def musique_hops(qid: str, decomposition: list[Any] | None = None) -> int | None:
    """Hops of a MuSiQue question: from its id prefix (``2hop__...``, ``3hop1__...``, ``4hop3__...``),
    else the number of decomposition steps, else ``None``."""
    m = _MUSIQUE_HOPS.match(qid)
    if m:
        return int(m.group(1))
    return len(decomposition) if decomposition else None


def _from_musique(rec: dict[str, Any], ctx: _Ctx) -> QAExample | None:
    if rec.get("answerable") is False:
        return None
    qid = ctx.text(rec, "id")
    answers = _answers([ctx.get(rec, "answer"), *(rec.get("answer_aliases") or [])], ctx, "answer")
    paragraphs = rec.get("paragraphs") or []
    titles = [str(p.get("title")) for p in paragraphs if isinstance(p, dict) and p.get("is_supporting")]
    return QAExample(
        id=qid,
        question=ctx.text(rec, "question"),
        golden_answers=answers,
        metadata={"hops": musique_hops(qid, rec.get("question_decomposition")), "supporting_titles": titles},
    )


def _from_ircot(rec: dict[str, Any], ctx: _Ctx) -> QAExample:
    objs = ctx.get(rec, "answers_objects")
    if not isinstance(objs, list):
        raise ctx.fail("field 'answers_objects' must be a list")
    spans = [s for o in objs if isinstance(o, dict) for s in (o.get("spans") or [])]
    titles = [str(c.get("title")) for c in rec.get("contexts") or [] if isinstance(c, dict) and c.get("is_supporting")]
    return QAExample(
        id=ctx.text(rec, "question_id"),
        question=ctx.text(rec, "question_text"),
        golden_answers=_answers(spans, ctx, "answers_objects[].spans"),
        metadata={"supporting_titles": titles},
    )


def read_qa_file(
    path: str | Path,
    fmt: str = "auto",
    dataset: str | None = None,
    split: str | None = None,
    hops: int | None = None,
) -> list[QAExample]:
    """Read every question of a QA file in any supported format (see the module docstring).

    ``dataset`` names the source (stored as ``metadata["dataset"]``; ``"musique"`` also derives the hops of
    any record from a MuSiQue id prefix, ``2hop__...``); ``hops`` sets the hop count of questions that still
    have none. The official HotpotQA, 2Wiki and MuSiQue formats derive hops whatever ``dataset`` is.
    Unanswerable MuSiQue questions (``"answerable": false``) are skipped, and their number is logged as a
    warning naming the file. Raises ``FileNotFoundError``, ``ValueError`` for an unknown ``fmt``, and
    :class:`DataFormatError` naming the file, line and field of a malformed record, or a duplicated question id.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown QA format {fmt!r}; known: {', '.join(FORMATS)}")
    if not path.exists():
        raise FileNotFoundError(f"QA file not found: {path}")
    out: list[QAExample] = []
    seen: dict[str, str] = {}
    detected = None if fmt == "auto" else fmt
    skipped = 0
    for loc, rec in _iter_records(path):
        ctx = _Ctx(path, loc)
        f = detected or detect_format(rec)
        detected = f
        if f == "searchr1":
            ex: QAExample | None = _from_searchr1(rec, ctx, split)
        elif f == "flashrag":
            ex = _from_flashrag(rec, ctx)
        elif f in ("hotpotqa", "2wiki"):
            ex = _from_hotpot_like(rec, ctx, two_wiki=f == "2wiki")
        elif f == "musique":
            ex = _from_musique(rec, ctx)
        else:
            ex = _from_ircot(rec, ctx)
        if ex is None:
            skipped += 1
            continue
        if not ex.question.strip():  # e.g. a Search-R1 prompt whose "Question:" line is blank
            raise ctx.fail("empty question")
        if ex.id in seen:
            raise ctx.fail(f"duplicate question id {ex.id!r} (first at {seen[ex.id]})")
        seen[ex.id] = loc
        if dataset:
            ex.metadata.setdefault("dataset", dataset)
        if ex.metadata.get("hops") is None:
            derived = musique_hops(ex.id) if dataset == "musique" else None
            ex.metadata["hops"] = derived if derived is not None else hops
        out.append(ex)
    if skipped:
        log.warning("%s: skipped %d unanswerable question(s) (MuSiQue 'answerable': false); read %d",
                    path, skipped, len(out))
    return out
