"""The public wiki-18 passage file of Search-R1 and FlashRAG, converted into Sleuth's corpus JSONL.

wiki-18 (the December 2018 Wikipedia dump split into 100-word passages by DPR, Karpukhin et al. 2020; shipped
by Search-R1 as ``wiki-18.jsonl.gz`` in the ``PeterJinGo/wiki-18-corpus`` dataset) has 21,015,324 lines of
``{"id": "0", "contents": "\\"Title\\"\\ntext"}``: the title in quotes on the first line of ``contents``.
Despite its name, the published ``wiki-18.jsonl.gz`` is a gzipped tar archive whose one member is the JSONL
(``.../wiki_dpr_100w/wiki_dump.jsonl``, 14,393,573,105 bytes), so ``gzip -d`` alone leaves a tar file.
:func:`convert_wiki18` streams it (plain, gzip, or such an archive) into ``{"id", "title", "contents"}`` lines,
``contents`` unchanged (Search-R1's retrieval server and Sleuth's both show ``contents``), the title unquoted beside it,
ids kept: row ``i`` of the output is row ``i`` of the input, so a dense index built by Search-R1 over the same
file (``e5_Flat.index``, searched by row number) lines up with it.
"""

from __future__ import annotations

import gzip
import json
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from corpora.formats import DataFormatError, Passage, iter_json_objects, passage_field

WIKI18_PASSAGES = 21_015_324  # lines of wiki-18.jsonl


def wiki18_passage(obj: dict, path: str | Path, lineno: int) -> Passage:
    """One wiki-18 record as a :class:`~corpora.formats.Passage`: the title is the first line of ``contents``
    without its quotes (a record with no newline: all of it, as :func:`corpora.formats.iter_corpus` reads an
    untitled ``{id, contents}`` line, so the converted file reads back the same). Raises :class:`DataFormatError` naming the
    file, line and field for a missing or non-text ``id`` or ``contents``."""
    pid = passage_field(obj, "id", f"{path}:{lineno}")
    contents = passage_field(obj, "contents", f"{path}:{lineno}")
    head = contents.partition("\n")[0].strip()
    title = head[1:-1] if len(head) > 1 and head[0] == head[-1] == '"' else head
    return Passage(id=pid, title=title, contents=contents)


@contextmanager
def _open_passages(src: Path) -> Iterator[IO[bytes]]:
    """The JSONL bytes of ``src``: the file, its gzip content, or the first ``.jsonl`` member of a tar archive
    (gzipped or not), streamed."""
    if not tarfile.is_tarfile(src):
        with (gzip.open(src, "rb") if src.suffix == ".gz" else open(src, "rb")) as f:
            yield f
        return
    with tarfile.open(src, "r|*") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(".jsonl"):
                f = tar.extractfile(member)
                assert f is not None  # a regular member has a file object
                yield f
                return
    raise DataFormatError(f"{src}: a tar archive without a .jsonl member")


def convert_wiki18(src: str | Path, out: str | Path, limit: int | None = None,
                   progress: Callable[[int], None] | None = None) -> dict[str, int | bool]:
    """Stream the wiki-18 JSONL ``src`` (``.gz`` read as gzip; a tar archive, gzipped or not, as its ``.jsonl``
    member) into the corpus JSONL ``out``, written to a
    temporary file and renamed when complete, so an interrupted run leaves no partial corpus.

    ``limit`` keeps the first ``limit`` passages (a trial corpus); ``progress(n)`` is called every 1M passages.
    Memory stays constant (one line at a time). Returns ``passages`` (written), ``untitled`` (records whose
    ``contents`` has no title line) and ``ids_are_rows`` (every id is its 0-based row number, as in the
    published file). Raises ``FileNotFoundError``, ``ValueError`` for ``limit < 1`` and
    :class:`DataFormatError` naming the line of a malformed record; ``out`` is then left as it was.
    """
    src, out = Path(src), Path(out)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not src.is_file():
        raise FileNotFoundError(f"wiki-18 file not found: {src}")
    if out.resolve() == src.resolve():
        raise ValueError(f"the output {out} is the input file; write the corpus elsewhere")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    n = untitled = 0
    rows = True
    try:
        with _open_passages(src) as f, open(tmp, "w", encoding="utf-8") as w:
            for lineno, obj in iter_json_objects(f, src):
                if "contents" not in obj and {"question", "golden_answers"} & obj.keys():
                    raise DataFormatError(f"{src}:{lineno}: a QA record, not a wiki-18 passage "
                                          "{id, contents}: convert QA files with --qa-from")
                p = wiki18_passage(obj, src, lineno)
                untitled += "\n" not in p.contents
                rows = rows and p.id == str(n)
                w.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
                n += 1
                if progress is not None and n % 1_000_000 == 0:
                    progress(n)
                if limit is not None and n >= limit:
                    break
        if n == 0:
            raise DataFormatError(f"{src}: no passages (an empty file)")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"passages": n, "untitled": untitled, "ids_are_rows": rows}
