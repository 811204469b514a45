"""The one reader of QA files: every format the search-agent benchmarks ship in, as
:class:`corpora.formats.QAExample`.

Formats (detected from the file suffix and the first record's fields, or forced with ``fmt``):

* ``flashrag``: FlashRAG JSONL ``{"id", "question", "golden_answers", "metadata"}`` (the shipped sample,
  ``data.train`` / ``data.test``, ``sleuth eval --qa``);
* ``searchr1``: Search-R1 / verl JSONL or parquet rows: ``prompt[0].content`` (the question, or Search-R1's
  instruction template ending in ``Question: ...``), ``reward_model.ground_truth`` (a string, a list, or
  ``{"target": [...]}``), ``extra_info.{question, answer, index, split}`` (``answer`` may be a list).
  ``extra_info`` wins where both exist (``ground_truth`` may be several answers joined by ", ").
* ``hotpotqa``: the official HotpotQA JSON list ``[{"_id", "question", "answer", "supporting_facts",
  "context", "type", "level"}]``;
* ``2wiki``: the official 2WikiMultihopQA JSON list (HotpotQA's fields plus ``evidences``; ``type`` is one of
  comparison, inference, compositional, bridge_comparison);
* ``musique``: the official MuSiQue JSONL ``{"id", "question", "answer", "answer_aliases", "answerable",
  "paragraphs", "question_decomposition"}`` (unanswerable questions are skipped);
* ``ircot``: IRCoT's processed JSONL ``{"question_id", "question_text", "answers_objects", "contexts"}``.

``metadata["hops"]`` is set where derivable (HotpotQA 2; MuSiQue from the official id prefix ``2hop__`` /
``3hop1__`` or the number of decomposition steps; 2Wiki from its question type) and
``metadata["supporting_titles"]`` where the source has them (FlashRAG's ``metadata.supporting_facts.title``
included). Golden answers that are ``null`` or blank are left out (as an answer, ``"None"`` or ``""`` would
reward answering that). A malformed record raises
:class:`corpora.formats.DataFormatError` naming the file, line (or row) and field.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from corpora.formats import DataFormatError, QAExample, answer_texts, iter_records, nonblank_text

log = logging.getLogger(__name__)
FORMATS = ("auto", "searchr1", "flashrag", "hotpotqa", "2wiki", "musique", "ircot")

# 2WikiMultihopQA question types -> reasoning hops (Ho et al., COLING 2020, Sec. 3: a bridge-comparison
# question composes two bridge hops per compared entity with a comparison).
TWOWIKI_HOPS = {"comparison": 2, "inference": 2, "compositional": 2, "bridge_comparison": 4}


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
    """Names a record in error messages (``path:3: missing field 'x'``); ``loc`` (``line 3``, ``row 3``)
    stands in for a missing question id."""

    def __init__(self, path: Path, where: str):
        self.where = where
        rest = where[len(str(path)):]  # ":3" (JSONL), ":1: element 2" (a JSON array), " row 3" (parquet)
        if "element" in rest:
            self.loc = "record " + rest.rsplit(" ", 1)[1]
        else:
            self.loc = f"line {rest[1:]}" if rest.startswith(":") else rest.strip()

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
    meta = dict(meta)
    facts = meta.get("supporting_facts")  # FlashRAG's HotpotQA / 2Wiki: {"title": [...], "sent_id": [...]}
    if isinstance(facts, dict) and isinstance(facts.get("title"), list) and "supporting_titles" not in meta:
        meta["supporting_titles"] = list(dict.fromkeys(str(t) for t in facts["title"]))
    return QAExample(id=ctx.text(rec, "id"), question=ctx.text(rec, "question"), golden_answers=answers,
                     metadata=meta)


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


def read_qa(
    path: str | Path,
    fmt: str = "auto",
    dataset: str | None = None,
    split: str | None = None,
    hops: int | None = None,
    source_ids: bool = False,
) -> list[QAExample]:
    """Read every question of a QA file in any supported format (see the module docstring).

    ``dataset`` names the source (stored as ``metadata["dataset"]``; ``"musique"`` also derives the hops of
    any record from a MuSiQue id prefix, ``2hop__...``); ``hops`` sets the hop count of questions that still
    have none. The official HotpotQA, 2Wiki and MuSiQue formats derive hops whatever ``dataset`` is; with
    ``dataset="2wikimultihopqa"`` a record whose ``metadata.type`` is a 2Wiki question type (FlashRAG's export)
    gets that type's hops. ``source_ids`` prefixes each id with the record's ``data_source`` (``nq_0``) and
    records the source as its dataset: Search-R1's merged files number every source from 0, so bare ids repeat.
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
    for where, rec in iter_records(path):
        ctx = _Ctx(path, where)
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
        if source_ids and nonblank_text(rec.get("data_source")):
            source = nonblank_text(rec["data_source"])
            ex.id = f"{source}_{ex.id}"
            ex.metadata.setdefault("data_source", source)
            ex.metadata.setdefault("dataset", source)
        if not ex.question.strip():  # e.g. a Search-R1 prompt whose "Question:" line is blank
            raise ctx.fail("empty question")
        if ex.id in seen:
            raise ctx.fail(f"duplicate question id {ex.id!r} (first at {seen[ex.id]})")
        seen[ex.id] = ctx.loc
        if dataset:
            ex.metadata.setdefault("dataset", dataset)
        if ex.metadata.get("hops") is None:
            derived = musique_hops(ex.id) if dataset == "musique" else None
            if dataset == "2wikimultihopqa" and f == "flashrag":
                derived = TWOWIKI_HOPS.get(str(ex.metadata.get("type")))
            if derived is not None or hops is not None:  # (no "hops": None key where nothing is known)
                ex.metadata["hops"] = derived if derived is not None else hops
        out.append(ex)
    if skipped:
        log.warning("%s: skipped %d unanswerable question(s) (MuSiQue 'answerable': false); read %d",
                    path, skipped, len(out))
    return out
