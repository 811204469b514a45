"""The field's two data formats, as Search-R1 and FlashRAG use them.

* corpus JSONL: one passage per line, ``{"id", "title", "contents"}``. As in Search-R1's wiki-18,
  ``contents`` carries the title on its first line (``"Title"\\ntext``) so that Search-R1's client, which
  renders ``Doc i(Title: <first line>) <rest>``, works unchanged. :attr:`Passage.text` is the body.
* QA JSONL: ``{"id", "question", "golden_answers": [...], "metadata": {...}}`` (FlashRAG).

Readers stream line by line and name the file and line number of any malformed record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO


class DataFormatError(ValueError):
    """A record in a corpus or QA file is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class Passage:
    """One retrievable unit of a corpus.

    ``contents`` is ``title + "\\n" + text`` (the wiki-18 convention); ``title`` is kept beside it.
    """

    id: str
    title: str
    contents: str

    @property
    def text(self) -> str:
        """The body of the passage, without the title line: the first line when it is the title, bare or in
        quotes (wiki-18's ``"Title"``; a title that itself ends in a quote too)."""
        head, sep, rest = self.contents.partition("\n")
        quoted = head[1:-1] if len(head) > 1 and head[0] == head[-1] == '"' else None
        return rest if sep and self.title in (head, head.strip('"'), quoted) else self.contents

    @classmethod
    def make(cls, id: str, title: str, text: str) -> Passage:
        """Build a passage with the title on the first line of ``contents``."""
        return cls(id=str(id), title=title, contents=f"{title}\n{text}" if title else text)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "contents": self.contents}


@dataclass
class QAExample:
    """One question with its gold answers. ``metadata`` may carry ``supporting_ids`` (corpus ids of the
    supporting paragraphs), ``hops`` and the source dataset's own fields."""

    id: str
    question: str
    golden_answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# a JSON escape in the surrogate range (\ud800-\udfff): only a line with one can decode to a lone surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_B = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def iter_json_objects(
    lines: Iterable[str] | Iterable[bytes], path: str | Path
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` for each non-blank line of a JSONL stream (1-based numbers).

    ``lines`` is any iterable of text lines or of UTF-8 byte lines (an open file), a byte-order mark before
    the first line skipped; ``path`` only names the source in errors. Raises :class:`DataFormatError`
    naming the file and line of a line that is not UTF-8, not a JSON object, or has a string with an escaped
    lone surrogate (``"\\ud800"``, which no UTF-8 file can hold).
    """
    for lineno, line in enumerate(lines, start=1):
        try:
            if isinstance(line, bytes):
                escapes = _SURROGATE_ESCAPE_B.search(line)  # (faster on the bytes than on the decoded line)
                line = line.decode("utf-8")
            else:
                escapes = _SURROGATE_ESCAPE.search(line)
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark (files saved on Windows)
            if not line.strip():
                continue
            obj = json.loads(line)
        except UnicodeDecodeError as e:
            raise DataFormatError(
                f"{path}:{lineno}: not valid UTF-8 (byte {line[e.start]:#04x} at byte {e.start} of the line: "
                f"{e.reason})"
            ) from None
        except json.JSONDecodeError as e:  # (e.msg may end in "at", before the position str(e) adds)
            where = f"{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"
            raise DataFormatError(f"{path}:{lineno}: not valid JSON ({e.msg}{where})") from None
        if not isinstance(obj, dict):
            raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        if escapes and _has_lone_surrogate(obj):
            raise DataFormatError(
                f"{path}:{lineno}: lone surrogate escape in a string (\\ud800-\\udfff without its pair): "
                "not text, cannot be written as UTF-8"
            )
        yield lineno, obj


def iter_json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Stream ``(line number, object)`` from a JSONL file read as UTF-8 (see :func:`iter_json_objects`)."""
    with open(path, "rb") as f:
        yield from iter_json_objects(f, path)


def iter_json_array(path: Path, block: int = 1 << 20) -> Iterator[tuple[int, dict]]:
    """Stream ``(line number, object)`` for the elements of a file holding one JSON array of objects (the raw
    HotpotQA and 2WikiMultihopQA releases, ``[{...}, {...}]``), reading ``block`` characters at a time, so
    the file is never loaded whole. The line is where the element starts (1 for every element of a
    one-line file). Raises :class:`DataFormatError` naming the file and line of an element that is not a
    JSON object, not valid JSON or not UTF-8."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf, pos, line, eof, done = "", 0, 1, False, 0  # done: characters dropped before buf

        def more() -> bool:  # read the next block, dropping what was consumed; False at the end of the file
            nonlocal buf, pos, eof, done
            try:
                got = f.read(block)
            except UnicodeDecodeError as e:
                raise DataFormatError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None
            buf, pos, eof, done = buf[pos:] + got, 0, not got, done + pos
            return bool(got)

        def skip_space() -> str:  # the next non-blank character ("" at the end of the file)
            nonlocal pos, line
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf) or not more():
                    return buf[pos : pos + 1]

        if skip_space() != "[":
            raise DataFormatError(f"{path}:{line}: not valid JSON (expected a JSON array)")
        pos += 1
        n = 0
        while True:
            c = skip_space()
            if c == "]":
                return
            if n:
                if c != ",":
                    raise DataFormatError(f"{path}:{line}: not valid JSON (expected ',' or ']' after element {n})")
                pos += 1
                skip_space()
            last = None
            while True:
                try:
                    obj, end = dec.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    # cut by the block's end, read on; a real error stays where it was with more text
                    where = (e.msg, done + e.pos)
                    if eof or (where == last and not e.msg.startswith("Unterminated string")) or not more():
                        raise DataFormatError(f"{path}:{line}: not valid JSON ({e.msg})") from None
                    last = where
            n += 1
            if not isinstance(obj, dict):
                raise DataFormatError(f"{path}:{line}: element {n} of the JSON array is {type(obj).__name__}, "
                                      "expected an object")
            if _SURROGATE_ESCAPE.search(buf, pos, end) and _has_lone_surrogate(obj):
                raise DataFormatError(f"{path}:{line}: lone surrogate escape in a string (\\ud800-\\udfff without "
                                      "its pair): not text, cannot be written as UTF-8")
            yield line, obj
            line += buf.count("\n", pos, end)
            pos = end


def iter_records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Stream ``(where, record)`` from a QA or corpus file, ``where`` naming the record in errors: JSONL
    (``path:line``); one JSON array, streamed element by element as the large HotpotQA / 2Wiki releases need
    (``path:line: element i``, the line the element starts on); a JSON object holding a ``data`` list
    (``path: record i``);
    parquet (``path: row i``). Raises :class:`DataFormatError` naming the file and line of what is not
    UTF-8 JSON objects."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for rec in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", rec
        return
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b" \t\r\n\xef\xbb\xbf")
    if head.startswith(b"["):
        for n, (line, obj) in enumerate(iter_json_array(path), start=1):
            yield f"{path}:{line}: element {n}", obj
    elif head.startswith(b"{") and path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_bytes())
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        except UnicodeDecodeError as e:
            raise DataFormatError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise DataFormatError(f"{path}: expected a JSON list of records (or an object with a 'data' list)")
        for i, rec in enumerate(data["data"], start=1):
            if not isinstance(rec, dict):
                raise DataFormatError(f"{path}: record {i}: expected a JSON object")
            yield f"{path}: record {i}", rec
    else:
        for line, obj in iter_json_lines(path):
            yield f"{path}:{line}", obj


def nonblank_text(value: Any) -> str | None:
    """``value`` as text when it is a non-blank string or a number (its text); ``None`` for anything else
    (``null``, a bool, a list or object, blank text): a QA field read from JSON must not become ``"None"``."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        return None
    return str(value)


def answer_texts(values: list[Any]) -> list[str]:
    """The golden answers of a QA record's answer list as text (:func:`nonblank_text`): ``null`` and blank ones
    left out (as an answer, ``"None"`` or ``""`` would reward answering that), numbers as their text. Raises
    ``ValueError`` (``"holds <value>, not an answer string"``) for the first object, list or bool: no prediction
    matches its Python text. Used by the QA reader, :func:`corpora.qa.read_qa`."""
    out = []
    for a in values:
        text = nonblank_text(a)
        if text is not None:
            out.append(text)
        elif not (a is None or isinstance(a, str)):
            raise ValueError(f"holds {a!r:.60}, not an answer string")
    return out


def passage_field(obj: dict[str, Any], key: str, where: str) -> str:
    """The text of field ``key`` of a corpus record (at ``where``, ``path:line``): a string or a number (its
    text); ``id`` must also not be blank. Raises :class:`DataFormatError` naming the file, line and field for
    anything else (``null``, a bool, a list or object), which ``str()`` would turn into a passage id or text
    like ``"None"``."""
    if key not in obj:
        raise DataFormatError(f"{where}: missing field {key!r} (has {sorted(obj)})")
    v = obj[key]
    if key == "id":
        if (text := nonblank_text(v)) is None:
            raise DataFormatError(f"{where}: field 'id' must be a non-empty string or a number, got {v!r:.60}")
        return text
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise DataFormatError(f"{where}: field {key!r} must be a string, got {v!r:.60}")
    return str(v)


# a Search-R1 / verl export row ({data_source, prompt, reward_model, ...}) met where a corpus or a FlashRAG QA
# file was expected
SEARCH_R1_QA = ("a Search-R1-format QA record (prompt, reward_model): QA files go to sleuth eval --qa or "
                "--benchmarks (e.g. --benchmarks nq --data-dir DIR), or data.train / data.test")


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Stream passages from a corpus JSONL file without loading it whole.

    Accepts ``{"id", "contents"}`` with an optional ``title`` (Search-R1 / FlashRAG / pyserini) and
    ``{"id", "title", "text"}`` (DPR-style). A ``contents`` whose first line is not its ``title`` gets the
    title line put before it (what Search-R1's client renders as the title). Raises :class:`DataFormatError`
    naming the line of a bad record, and :class:`FileNotFoundError` if the file is missing.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file not found: {path}")
    for lineno, obj in iter_json_lines(path):
        if "contents" not in obj and "text" not in obj and {"contexts", "context", "paragraphs"} & obj.keys():
            raise DataFormatError(
                f"{path}:{lineno}: a QA record with context paragraphs, not a passage: pool the file into a "
                f"corpus first with: sleuth corpus --from {path} --out CORPUS.jsonl"
            )
        if "contents" not in obj and "text" not in obj and {"prompt", "reward_model"} <= obj.keys():
            raise DataFormatError(f"{path}:{lineno}: {SEARCH_R1_QA}, not a passage: a corpus JSONL has "
                                  "{id, title, contents} per line")
        if "contents" not in obj and "text" not in obj and {"question", "golden_answers"} <= obj.keys():
            raise DataFormatError(
                f"{path}:{lineno}: a QA record (a question and its answers), not a passage: a corpus JSONL has "
                "{id, title, contents} per line; give QA files to sleuth eval --qa or data.train / data.test"
            )
        where = f"{path}:{lineno}"
        pid = passage_field(obj, "id", where)
        if "contents" in obj:
            contents = passage_field(obj, "contents", where)
            title = str(obj.get("title") or contents.partition("\n")[0].strip('"'))
            p = Passage(id=pid, title=title, contents=contents)
            # contents without the title line get it (Search-R1's client takes the first line as the title)
            yield p if p.text != contents or contents == title else Passage.make(pid, title, contents)
        elif "text" in obj:
            title = obj.get("title")  # (null: no title, not the title 'None')
            yield Passage.make(pid, "" if title is None else str(title), passage_field(obj, "text", where))
        else:
            raise DataFormatError(f"{path}:{lineno}: missing field 'contents' (or 'text')")


def read_corpus(path: str | Path) -> list[Passage]:
    """Read a whole corpus JSONL file into memory (small corpora; use :func:`iter_corpus` to stream)."""
    return list(iter_corpus(path))




def write_jsonl(path: str | Path, records: Iterable[Any]) -> int:
    """Write records (dicts or objects with ``to_json``) as JSONL, atomically (temp file then rename).

    Returns the number of lines written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            obj = r.to_json() if hasattr(r, "to_json") else r
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def json_records(path: str | Path, on_torn: Callable[[str], None] | None = None) -> Iterator[tuple[str, Any]]:
    """``(line, record)`` for each non-blank line of a JSONL file written by this project (UTF-8), split at
    ``\n`` only (a record may hold raw U+2028 or U+0085, which ``str.splitlines`` would also split at). A last
    line with no newline after it that is not JSON or not UTF-8 (a writer killed mid-append, perhaps inside a
    multi-byte character, or one still writing) is skipped after ``on_torn(line)`` (undecodable bytes
    replaced by U+FFFD); any other line that is not JSON raises ``json.JSONDecodeError``, not UTF-8
    ``UnicodeDecodeError``, a missing file ``FileNotFoundError``."""
    lines = Path(path).read_bytes().split(b"\n")
    for n, raw in enumerate(lines):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if n < len(lines) - 1:
                raise
            if on_torn is not None:
                on_torn(raw.decode("utf-8", "replace"))
            continue
        yield line, rec


def drop_torn_tail(f: BinaryIO, block: int = 1 << 16) -> int:
    """Truncate the binary file ``f`` (opened readable and writable, e.g. ``"a+b"``) after its last newline:
    a JSONL line cut short by a writer killed mid-write, so that records appended next start on a fresh line.
    Reads backwards in ``block``-byte steps, so a long file is not read whole. Returns the number of bytes
    dropped (0 when the file is empty or ends with a newline)."""
    end = f.seek(0, 2)
    pos = end
    while pos > 0:
        start = max(0, pos - block)
        f.seek(start)
        chunk = f.read(pos - start)
        if start + len(chunk) == end and chunk.endswith(b"\n"):
            return 0
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            f.truncate(start + nl + 1)
            return end - (start + nl + 1)
        pos = start
    f.truncate(0)
    return end
