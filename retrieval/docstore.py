"""An index's passages on disk: ``passages.jsonl`` (one ``{"id","title","contents"}`` per line, what hits
return) and ``passages.offsets.npy`` (int64 ``[N+1]`` byte offsets of each line), memory-mapped for O(1)
lookup by row (:class:`DocStore`), written from a corpus by :func:`write_docstore`."""

from __future__ import annotations

import json
import mmap
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from orjson import loads as _loads
from tqdm.auto import tqdm

from corpora.formats import iter_corpus
from retrieval.base import Hit, IndexNotFoundError
from retrieval.reply import rows_json

PASSAGES = "passages.jsonl"
OFFSETS = "passages.offsets.npy"


def build_command(index_dir: str | Path, corpus: str | None = None, extra: str = "") -> str:
    """The exact command that builds ``index_dir`` (named in every missing-index error); ``extra`` adds
    flags (``--lucene``)."""
    return f"sleuth index --corpus {corpus or 'FILE'} --out {index_dir}" + (f" {extra}" if extra else "")


class DocStore:
    """Passages of an index, looked up by row. ``get(rows)`` reads each line through one ``mmap``.

    Thread-safe for reads. Raises ``IndexError`` for a row outside ``[0, len)``, and
    :class:`IndexNotFoundError` at construction when ``passages.jsonl`` is not the size its offsets end at
    (cut short or replaced: rows would be read past the end of the file).
    """

    def __init__(self, index_dir: str | Path):
        index_dir = Path(index_dir)
        self.path = index_dir / PASSAGES
        self.offsets = np.load(index_dir / OFFSETS, mmap_mode="r")
        size = self.path.stat().st_size
        if size != int(self.offsets[-1]):
            raise IndexNotFoundError(
                f"{self.path} is {size} bytes but its offsets ({OFFSETS}) end at {int(self.offsets[-1])}: the "
                f"index is incomplete or was changed; rebuild it with: {build_command(index_dir)}"
            )
        self._f = open(self.path, "rb")  # noqa: SIM115 (kept open for the mmap)
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._u8 = np.frombuffer(self._mm, dtype=np.uint8)  # read-only view of the map (see spans)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, row: int) -> dict:
        if not 0 <= row < len(self):
            raise IndexError(f"passage row {row} outside [0, {len(self)})")
        a, b = int(self.offsets[row]), int(self.offsets[row + 1])
        return _loads(self._mm[a:b])

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(buf, starts, ends)``: the whole store as a read-only ``uint8`` array (the memory map, no copy)
        and the ``int64`` byte range of each row's stored JSON object (no newline) in ``rows.ravel()``
        order, for splicing passages into a reply without copying them into ``bytes`` first. Raises
        ``IndexError`` for a row outside the store."""
        rows = np.asarray(rows, dtype=np.int64).ravel()
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"passage rows outside [0, {len(self)})")
        return self._u8, np.asarray(self.offsets[rows], dtype=np.int64), self.offsets[rows + 1].astype(np.int64) - 1

    def iter_contents(self, start: int = 0) -> Iterator[str]:
        """Stream ``contents`` from row ``start`` on."""
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[start]) if len(self) else 0)
            for line in f:
                yield json.loads(line)["contents"]

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> list[list[Hit]]:
        """Hit lists of ``[Q, k]`` int64 rows and float32 scores (row -1 = no hit, left out). The stored
        documents are spliced into one JSON buffer and parsed by one ``orjson.loads``
        (:func:`retrieval.reply.rows_json`): about 25% faster than a parse per passage. Raises
        ``IndexError`` for a row outside the store."""
        rows = np.asarray(rows)
        docs = _loads(rows_json(rows, self))
        sc = iter(np.asarray(scores)[rows >= 0].tolist())
        return [[Hit(d["id"], d["title"], d["contents"], next(sc)) for d in ds] for ds in docs]


def write_docstore(corpus: str | Path, index_dir: str | Path, show_progress: bool = True,
                   before_replace: Callable[[], None] | None = None) -> int:
    """Stream a corpus JSONL (any accepted format) into ``passages.jsonl`` + offsets. Returns N.

    Both files are written to temporary files renamed into place only once the whole corpus was read, so a
    :class:`DocStore` open on the old ones (a running server) keeps reading the old passages, and a corpus
    that fails half-way leaves the old files as they were; ``before_replace()`` runs just before the renames
    (:func:`build_index` retires the old manifest there). Memory while reading: 16 bytes per passage (its
    offset and a 64-bit hash of its id), not the ids themselves (wiki-18's 21M passages: 340 MB; a set of
    the ids took about 2 GB). Raises
    :class:`~corpora.formats.DataFormatError` naming the line of a bad record and ``ValueError`` naming a
    duplicate passage id (found once the corpus was read).
    """
    index_dir = Path(index_dir)
    index_dir.mkdir(parents=True, exist_ok=True)
    offsets, hashes = array("q", [0]), array("q")
    tmp = index_dir / (PASSAGES + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for p in tqdm(iter_corpus(corpus), desc="read corpus", unit="psg", disable=not show_progress):
                hashes.append(hash(p.id))
                line = (json.dumps(p.to_json(), ensure_ascii=False) + "\n").encode("utf-8")
                f.write(line)
                offsets.append(offsets[-1] + len(line))
        _check_unique_ids(corpus, tmp, np.frombuffer(hashes, dtype=np.int64), np.frombuffer(offsets, dtype=np.int64))
        tmp_off = index_dir / (OFFSETS + ".tmp")
        with open(tmp_off, "wb") as f:
            np.save(f, np.frombuffer(offsets, dtype=np.int64))
        if before_replace is not None:
            before_replace()
    except BaseException:
        tmp.unlink(missing_ok=True)  # (as large as the corpus read so far)
        (index_dir / (OFFSETS + ".tmp")).unlink(missing_ok=True)
        raise
    tmp_off.replace(index_dir / OFFSETS)  # renamed, not overwritten: an open DocStore keeps its memory maps
    tmp.replace(index_dir / PASSAGES)
    return len(offsets) - 1


def _check_unique_ids(corpus: Path, passages: Path, hashes: np.ndarray, offsets: np.ndarray) -> None:
    """Raise ``ValueError`` naming the first duplicate passage id: passages whose id hashes are equal (found by
    sorting ``hashes``, ``[N]`` int64) are read back from ``passages`` (at ``offsets``, ``[N + 1]`` bytes)
    and compared, so a 64-bit hash collision of two different ids is no error."""
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    if not len(same):
        return
    with open(passages, "rb") as f:
        def id_at(row: int) -> str:
            f.seek(int(offsets[row]))
            return json.loads(f.read(int(offsets[row + 1] - offsets[row])))["id"]

        for i in same:
            a, b = sorted((int(order[i]), int(order[i + 1])))
            if id_at(a) == id_at(b):
                raise ValueError(f"{corpus}: duplicate passage id {id_at(b)!r} (passages {a + 1} and {b + 1}; ids "
                                 "must be unique)")
