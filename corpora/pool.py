"""Streaming corpus preparation: pool the context paragraphs of multi-hop QA files into one passage corpus,
deduplicated by (title, text), optionally chunked into passages of at most ``chunk_words`` words.

Readable inputs (auto-detected per line, streamed, never loaded whole):

* IRCoT-processed files (HotpotQA, 2WikiMultihopQA, MuSiQue): ``contexts[] = {title, paragraph_text,
  is_supporting}``, e.g. IRCoT's HotpotQA dev file ``dev_400_with_contexts.ircot.jsonl``;
* raw HotpotQA / 2WikiMultihopQA: ``context = [[title, [sentence, ...]], ...]`` (+ ``supporting_facts``), as
  JSONL or as their releases' one JSON array (``hotpot_dev_distractor_v1.json``, 2Wiki's ``dev.json``);
* raw MuSiQue: ``paragraphs[] = {title, paragraph_text, is_supporting}``;
* a corpus JSONL (``{id, contents}`` or ``{id, title, text}``), to deduplicate or chunk it.

Search-R1-format files (``*.searchr1.jsonl`` / ``.parquet``: 2WikiMultihopQA, MuSiQue, NQ, ...) and the
benchmarks ``sleuth data get`` fetches carry questions and answers only, no paragraphs; there is nothing to
pool in them and :func:`pool_corpus` says so.

Malformed input raises :class:`~corpora.formats.DataFormatError` naming the file and line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from corpora.formats import DataFormatError, Passage, QAExample, iter_records, passage_field, write_jsonl


def _norm(text: str) -> str:
    return " ".join(text.split())


def chunk_words(text: str, size: int | None, overlap: int = 0) -> list[str]:
    """Split ``text`` into windows of at most ``size`` words, consecutive windows sharing ``overlap`` words.

    ``size=None`` (or a text no longer than ``size``) returns ``[text]``. Raises ``ValueError`` unless
    ``0 <= overlap < size``.
    """
    if not size:
        return [text]
    if size < 1 or not 0 <= overlap < size:
        raise ValueError(
            f"chunking needs size >= 1 and 0 <= overlap < size, got size={size}, overlap={overlap}"
        )
    words = text.split()
    if len(words) <= size:
        return [" ".join(words)]
    step = size - overlap
    return [" ".join(words[a : a + size]) for a in range(0, max(len(words) - overlap, 1), step)]


def _paragraphs(obj: dict, where: str, n: int) -> tuple[list[tuple[str, str, bool]], dict | None] | None:
    """(title, text, is_supporting) paragraphs and the QA fields of the ``n``-th record (at ``where``, for
    errors); None if it is a passage."""

    def bad(msg: str) -> DataFormatError:
        return DataFormatError(f"{where}: {msg}")

    if "contexts" in obj or "paragraphs" in obj:  # IRCoT-processed / raw MuSiQue
        ctxs = obj.get("contexts", obj.get("paragraphs"))
        if not isinstance(ctxs, list):
            raise bad("field 'contexts'/'paragraphs' must be a list")
        paras = []
        for j, c in enumerate(ctxs):
            if not isinstance(c, dict) or "paragraph_text" not in c:
                raise bad(f"context {j} has no 'paragraph_text'")
            if not isinstance(c["paragraph_text"], str):
                raise bad(f"context {j}: 'paragraph_text' is {type(c['paragraph_text']).__name__}, expected a string")
            title = c.get("title")
            paras.append(("" if title is None else str(title), c["paragraph_text"], bool(c.get("is_supporting"))))
    elif "context" in obj:  # raw HotpotQA / 2WikiMultihopQA
        ctx = obj["context"]
        if isinstance(ctx, dict):  # HF datasets layout: {"title": [...], "sentences": [[...], ...]}
            ctx = list(zip(ctx.get("title", []), ctx.get("sentences", [])))
        sup = (
            {t for t, *_ in obj.get("supporting_facts") or []}
            if isinstance(obj.get("supporting_facts"), list)
            else set()
        )
        if isinstance(obj.get("supporting_facts"), dict):
            sup = set(obj["supporting_facts"].get("title", []))
        paras = []
        for j, item in enumerate(ctx):
            if not (isinstance(item, list | tuple) and len(item) == 2):
                raise bad(f"context {j} is not [title, sentences]")
            title, sents = item
            text = " ".join(sents) if isinstance(sents, list) else str(sents)
            paras.append((str(title), text, title in sup))
    elif "id" in obj and ("contents" in obj or "text" in obj):
        return None
    elif "prompt" in obj and "reward_model" in obj:
        raise bad(
            "this is a Search-R1-format QA record (question and answers only, no paragraphs): nothing to pool. "
            "Pool a file with paragraphs (IRCoT 'contexts', HotpotQA/2Wiki 'context', MuSiQue 'paragraphs')"
        )
    else:
        raise bad(f"no paragraphs found (expected 'contexts', 'context' or 'paragraphs'; has {sorted(obj)})")
    qa = None
    q = obj.get("question_text", obj.get("question"))
    if q is not None:
        answers: list[str] = []
        if "answers_objects" in obj:
            answers = [s for a in obj["answers_objects"] for s in a.get("spans", []) if s]
        elif obj.get("answer") is not None:  # (null in a test split: no answer)
            a = obj["answer"]
            answers = [str(x) for x in a if x is not None] if isinstance(a, list) else [str(a)]
        answers += [a for a in obj.get("answer_aliases", []) if isinstance(a, str)]
        answers = [a for a in answers if a.strip()]  # a blank answer is none (read_qa leaves it out)
        qa = {
            "id": str(obj.get("question_id", obj.get("_id", obj.get("id", n)))),
            "question": str(q),
            "answers": answers,
            "answerable": obj.get("answerable"),
        }
    return paras, qa


def _digest(title: str, text: str) -> bytes:
    """The dedup key of a paragraph: a 16-byte digest of its title and whitespace-normalised text."""
    return hashlib.blake2b(f"{title}\x00{_norm(text)}".encode(), digest_size=16).digest()


def _chunk_ids(base: str, n_chunks: int) -> list[str]:
    return [base] if n_chunks == 1 else [f"{base}-{j}" for j in range(n_chunks)]


@dataclass
class _Pool:
    """One pooling run of :func:`pool_corpus`: the digests and ids written so far, the counts and the
    questions kept (``keep_questions``: a QA file is wanted)."""

    chunk_size: int | None
    overlap: int
    id_prefix: str
    dataset: str | None
    keep_questions: bool
    seen: dict[bytes, list[str]] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)  # every id written
    next_n: int = 0  # generated ids count up from here
    stats: dict[str, int] = field(default_factory=lambda: {
        "records": 0, "paragraphs": 0, "passages": 0, "duplicates": 0, "questions": 0,
        "duplicate_questions": 0, "unanswerable": 0})
    questions: list[QAExample] = field(default_factory=list)
    question_ids: set[str] = field(default_factory=set)

    def fresh_ids(self, n_chunks: int) -> list[str]:
        n = max(self.next_n, len(self.seen))
        ids = _chunk_ids(f"{self.id_prefix}{n}", n_chunks)
        while not self.taken.isdisjoint(ids):
            n += 1
            ids = _chunk_ids(f"{self.id_prefix}{n}", n_chunks)
        self.next_n = n + 1
        return ids

    def add(self, title: str, text: str, src: tuple[str, str] | None) -> list[Passage]:
        """The passages of one paragraph (none for a duplicate); ``src`` = (id, where) of a corpus line."""
        key = _digest(title, text)
        if key in self.seen:
            self.stats["duplicates"] += 1
            return []
        chunks = chunk_words(_norm(text), self.chunk_size, self.overlap)
        if src is None:
            ids = self.fresh_ids(len(chunks))
        else:
            pid, where = src
            ids = _chunk_ids(pid, len(chunks))
            if not self.taken.isdisjoint(ids):
                dup = next(i for i in ids if i in self.taken)
                raise DataFormatError(
                    f"{where}: passage id {dup!r} is already taken by an earlier passage of the pool "
                    "(ids must be unique; kept corpus ids are never renamed): pool the corpus files first, "
                    "or choose an --id-prefix (id_prefix) that none of their ids start with"
                )
        self.seen[key] = ids
        self.taken.update(ids)
        return [Passage.make(i, title, c) for i, c in zip(ids, chunks)]

    def corpus_line(self, obj: dict, where: str) -> list[Passage]:
        """The passages of a corpus-JSONL line (its id kept)."""
        pid = passage_field(obj, "id", where)
        contents = passage_field(obj, "contents" if "contents" in obj else "text", where)
        title = str(obj.get("title") or "")
        if not title and "\n" in contents and "contents" in obj:  # wiki-18: '"Title"\ntext', no title field
            title = contents.partition("\n")[0].strip('"')
        # the body without the title line, only when the first line is the title (Passage.text)
        text = Passage(pid, title, contents).text if "contents" in obj else contents
        self.stats["paragraphs"] += 1
        return self.add(title, text, (pid, where))

    def qa_record(self, paras: list[tuple[str, str, bool]], qa: dict | None,
                  source: str) -> Iterator[Passage]:
        """The passages of a QA record's paragraphs; then its question is kept (with the ids of its
        supporting paragraphs) unless it has no answer, is unanswerable or came in an earlier source."""
        supporting: list[str] = []
        for title, text, is_sup in paras:
            self.stats["paragraphs"] += 1
            yield from self.add(title, text, None)
            if is_sup:
                supporting += self.seen[_digest(title, text)]
        if not self.keep_questions or qa is None or not qa["answers"]:
            return
        if qa.get("answerable") is False:  # MuSiQue-full: the paragraphs do not support the gold
            self.stats["unanswerable"] += 1
            return
        if qa["id"] in self.question_ids:  # the same question in two sources: the first copy is kept
            self.stats["duplicate_questions"] += 1
            return
        self.question_ids.add(qa["id"])
        meta = {"supporting_ids": supporting, "source": source}
        if self.dataset:
            meta["dataset"] = self.dataset
        self.questions.append(QAExample(qa["id"], qa["question"], qa["answers"], meta))

    def passages(self, sources: list[str | Path]) -> Iterator[Passage]:
        """Every passage of ``sources`` in order, counted as written."""
        for src in sources:
            src = Path(src)
            if not src.exists():
                raise FileNotFoundError(f"source file not found: {src}")
            if src.suffix == ".parquet":
                raise DataFormatError(f"{src}: parquet input is a Search-R1-format QA file here (no paragraphs); "
                                      "pool a JSONL with paragraphs")
            for n, (where, obj) in enumerate(iter_records(src), start=1):
                self.stats["records"] += 1
                got = _paragraphs(obj, where, n)
                found = self.corpus_line(obj, where) if got is None else self.qa_record(*got, src.name)
                for p in found:
                    self.stats["passages"] += 1
                    yield p


def pool_corpus(
    sources: list[str | Path],
    out: str | Path,
    qa_out: str | Path | None = None,
    chunk_size: int | None = None,
    overlap: int = 0,
    id_prefix: str = "p",
    dataset: str | None = None,
) -> dict[str, int]:
    """Pool paragraphs of ``sources`` into the corpus JSONL ``out``, deduplicated by (title, text).

    Ids are ``{id_prefix}{n}`` (``{id_prefix}{n}-{j}`` for the j-th chunk when a paragraph is chunked),
    skipping ids already written; corpus-JSONL inputs keep their ids. With ``qa_out``, the questions are
    written as FlashRAG QA JSONL whose ``metadata.supporting_ids`` lists the ids of each question's
    supporting paragraphs (all chunks). Dedup keeps a 16-byte digest and the ids per passage, so memory
    grows with the number of distinct passages only.
    Returns counts: ``records``, ``paragraphs``, ``passages`` (written), ``duplicates``, ``questions``,
    ``duplicate_questions`` (an id already written by an earlier source: the first copy is kept) and
    ``unanswerable`` (MuSiQue-full's ``"answerable": false`` questions, left out of ``qa_out``).

    Raises :class:`~corpora.formats.DataFormatError` naming the file and line of a malformed record and of a
    corpus-JSONL passage (not a duplicate by content) whose id is already written, by another corpus or as
    a generated id (a kept id is never renamed: list corpora first or pick an ``id_prefix`` they do not use),
    and ``FileNotFoundError`` for a missing source.
    """
    out = Path(out)
    pool = _Pool(chunk_size, overlap, id_prefix, dataset, keep_questions=qa_out is not None)
    try:
        write_jsonl(out, pool.passages(sources))
    except BaseException:
        out.with_suffix(out.suffix + ".tmp").unlink(missing_ok=True)  # write_jsonl's temp file
        raise
    if qa_out is not None:
        pool.stats["questions"] = write_jsonl(qa_out, pool.questions)
    return pool.stats
