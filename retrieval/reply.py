"""Stored passages spliced into one JSON buffer: the retrieval server's reply body on its row path
(Search-R1's ``{"result": ...}``, :func:`rows_to_reply`) and the documents an in-process search parses into
hits (:func:`rows_json`), without parsing or re-serialising any passage on the way.

Both take ``[Q, k]`` row ids; a numba kernel (``cache=True``: compiled once per install, then loaded) copies
each stored passage from the store's memory map into one buffer.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from orjson import dumps as _dumps


def _u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=np.uint8)


_HEAD, _TAIL = _u8(b'{"result":['), _u8(b"]}")
_LIST_HEAD, _LIST_TAIL = _u8(b"["), _u8(b"]")
_NONE = _u8(b" ")
_COMMA, _OPEN, _CLOSE = ord(","), ord("["), ord("]")
#: how each scored hit of Search-R1's format is framed: (before the document, between document and score,
#: after the score), as in ``{"document": {...}, "score": s}``
_FRAME = (_u8(b'{"document":'), _u8(b',"score":'), _u8(b"}"))
#: reply formats :func:`rows_to_reply` writes (``"columns"`` only for Sleuth's own client; see its docstring)
REPLY_FORMATS = ("search-r1", "columns")


@intrinsic
def _memcpy(typingctx, dst, at, src, a, n):  # pragma: no cover (compiled by numba)
    """``dst[at:at+n] = src[a:a+n]`` for 1-D C-contiguous byte arrays as one libc-style ``memcpy`` (numba's
    slice assignment copies byte by byte: 7x slower on a reply of 1.7 MB)."""
    sig = types.void(dst, types.intp, src, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        d, d_at, s_, s_at, k = args
        u8p = ir.IntType(8).as_pointer()
        d_data = context.make_array(signature.args[0])(context, builder, d).data
        s_data = context.make_array(signature.args[2])(context, builder, s_).data
        dp = builder.gep(builder.bitcast(d_data, u8p), [d_at])
        sp = builder.gep(builder.bitcast(s_data, u8p), [s_at])
        cgutils.raw_memcpy(builder, dp, sp, k, 1)

    return sig, codegen


@nb.njit(cache=True, nogil=True)
def _copy(out, at, src, a, b):  # pragma: no cover (numba)
    _memcpy(out, at, src, a, b - a)
    return at + b - a


@nb.njit(cache=True, nogil=True)
def _splice(src, starts, ends, counts, sc, sc_starts, sc_ends, with_scores, pre, mid, post, head, tail):  # pragma: no cover
    """The bytes ``<head>[d, ...],[d, ...],...<tail>`` with ``d`` = ``src[starts[j]:ends[j]]`` (or
    ``<pre><doc><mid><sc[sc_starts[j]:sc_ends[j]]><post>``), ``counts[q]`` documents per query."""
    Q, n = counts.shape[0], starts.shape[0]
    size = head.size + tail.size + 2 * Q + max(Q - 1, 0)
    for q in range(Q):
        size += max(counts[q] - 1, 0)
    for j in range(n):
        size += ends[j] - starts[j]
        if with_scores:
            size += pre.size + mid.size + sc_ends[j] - sc_starts[j] + post.size
    out = np.empty(size, np.uint8)
    at = _copy(out, 0, head, 0, head.size)
    j = 0
    for q in range(Q):
        if q:
            out[at] = _COMMA
            at += 1
        out[at] = _OPEN
        at += 1
        for i in range(counts[q]):
            if i:
                out[at] = _COMMA
                at += 1
            if with_scores:
                at = _copy(out, at, pre, 0, pre.size)
            at = _copy(out, at, src, starts[j], ends[j])
            if with_scores:
                at = _copy(out, at, mid, 0, mid.size)
                at = _copy(out, at, sc, sc_starts[j], sc_ends[j])
                at = _copy(out, at, post, 0, post.size)
            j += 1
        out[at] = _CLOSE
        at += 1
    _copy(out, at, tail, 0, tail.size)
    return out


def _splice_rows(rows: np.ndarray, store, head: np.ndarray, tail: np.ndarray, scores: np.ndarray | None = None):
    """:func:`_splice` over the stored documents of ``[Q, k]`` ``rows`` (row -1 skipped), between ``head`` and
    ``tail``; with ``scores`` (``[Q, k]``) each document is framed with its score as in Search-R1's format."""
    keep = rows >= 0
    src, starts, ends = store.spans(rows[keep])
    counts = keep.sum(axis=1).astype(np.int64)
    sc, sc_starts, sc_ends = _NONE, starts, starts  # the kernel's score arguments when it writes no scores
    if scores is not None and starts.size:
        sc = _u8(_dumps(scores[keep].astype(np.float64).tolist())[1:-1])
        commas = np.flatnonzero(sc == _COMMA)
        sc_starts = np.concatenate(([0], commas + 1))
        sc_ends = np.concatenate((commas, [sc.size]))
    return memoryview(_splice(src, starts, ends, counts, sc, sc_starts, sc_ends, scores is not None, *_FRAME, head, tail))


def rows_to_reply(
    rows: np.ndarray, scores: np.ndarray, store, return_scores: bool, fmt: str = "search-r1"
) -> memoryview:
    """The ``/retrieve`` reply body for ``[Q, k]`` rows/scores (row -1 = no hit), spliced from the stored
    passage JSON (``store.spans(rows)``: byte ranges of the store's memory map) without parsing it; the same
    JSON as :func:`hits_to_result` serialised (documents carry the stored ``id``, ``title``, ``contents``).
    Scores are formatted by one serialiser call (non-finite scores become ``null``); a numba kernel copies
    every piece once into the reply buffer (about 0.4 ms for 2,560 passages, 1.7 MB), returned as a
    ``memoryview`` (bytes-like; the HTTP response sends it without another copy).

    ``rows`` int64 and ``scores`` float32, both ``[Q, k]``; ``store`` a :class:`retrieval.docstore.DocStore`.
    ``fmt`` ``"search-r1"`` (default) is Search-R1's ``retrieval_server.py`` reply (``{"result": [[{"document",
    "score"}, ...]]}``, or bare documents when ``return_scores`` is false). ``"columns"``, which Sleuth's client
    asks for, keeps documents and scores apart: ``{"result": [[document, ...], ...], "scores": [s, ...]}``, the
    scores flat in the order of the documents; a client parses it into hits about 15% faster than
    ``[document, score]`` pairs (no wrapper object per hit: 2,560 hits in ~6.9 against ~8.3 ms on this
    project's 2-vCPU machine in a slow spell). Without scores both formats are the bare documents.
    Raises ``IndexError`` for a row outside the store and ``ValueError`` for another ``fmt``."""
    if fmt not in REPLY_FORMATS:
        raise ValueError(f"reply format must be one of {REPLY_FORMATS}, got {fmt!r}")
    if not return_scores:
        return _splice_rows(rows, store, _HEAD, _TAIL)
    if fmt == "search-r1":
        return _splice_rows(rows, store, _HEAD, _TAIL, scores)
    return _columns(rows, scores, store, b"}")


def _columns(rows: np.ndarray, scores: np.ndarray, store, end: bytes) -> memoryview:
    """The ``columns`` object of ``[Q, k]`` ``rows``/``scores`` followed by ``end`` (its closing brace, and the
    newline of a frame)."""
    flat = _dumps(scores[rows >= 0].astype(np.float64).tolist())  # b"[s0,s1,...]"
    return _splice_rows(rows, store, _HEAD, _u8(b'],"scores":' + flat + end))


def rows_json(rows: np.ndarray, store) -> memoryview:
    """The stored documents of ``[Q, k]`` int64 ``rows`` (row -1 = no hit, skipped) as one JSON array of
    arrays, ``[[{"id", "title", "contents"}, ...], ...]`` (``Q`` inner arrays), spliced from the store's memory
    map like :func:`rows_to_reply`; ``store`` a :class:`retrieval.docstore.DocStore`. One ``orjson.loads`` of it
    builds a search's documents in about 25% less time than a parse per passage (2,560 passages, batch 256 at
    top-10: 9.6 against 12.8 ms on this project's 2-vCPU machine in a slow spell;
    :meth:`retrieval.docstore.DocStore.hits`). Raises ``IndexError`` for a row outside the store."""
    return _splice_rows(rows, store, _LIST_HEAD, _LIST_TAIL)


def rows_to_frame(rows: np.ndarray, scores: np.ndarray, store) -> tuple[bytes, memoryview]:
    """One frame of a ``columns-stream`` reply: ``(b"<n>\\n", body)``, ``body`` the ``columns`` reply of
    ``[q, k]`` ``rows``/``scores`` (:func:`rows_to_reply`) and a newline, ``n`` its length in bytes. A
    ``columns-stream`` body is such frames, one per slice of queries in order, so a client can parse one while
    the next is still on its way (``retrieval.client``). Raises as :func:`rows_to_reply`."""
    body = _columns(rows, scores, store, b"}\n")
    return b"%d\n" % body.nbytes, body
