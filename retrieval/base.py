"""The one retriever interface every backend implements (BM25, dense, hybrid, simulated, remote)."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

#: Response header of the retrieval server's row path (reply spliced from a Sleuth passage store: every
#: document has string ``id``/``title``/``contents`` and every score is a float or null); its value names the
#: format, ``search-r1``, ``columns`` or ``columns-stream`` (:data:`REPLY_FORMAT_HEADER`); on the ``columns``
#: formats the client takes its fast path (:func:`retrieval.client._column_hits`) and parses anything else the
#: general way.
ROWS_REPLY_HEADER = "x-sleuth-rows-reply"
#: Request header by which a client asks for ``columns`` (``{"result": [[document, ...]], "scores": [s, ...]}``,
#: :func:`retrieval.reply.rows_to_reply`) or, as Sleuth's client does, ``columns-stream`` (the same in frames,
#: :func:`retrieval.reply.rows_to_frame`); servers that do not know it, or requests the row path cannot serve,
#: get Search-R1's format.
REPLY_FORMAT_HEADER = "x-sleuth-reply-format"


class IndexNotFoundError(FileNotFoundError):
    """An index directory is missing or incomplete; the message says how to build it."""


class Hit(NamedTuple):
    """One retrieved passage, immutable (a retriever's cache hands the same hits to every caller).

    ``contents`` follows the wiki-18 convention (title on the first line); ``score`` is the backend's own
    score (BM25 score, inner product, fused RRF score), higher is better. A named tuple rather than a frozen
    dataclass because every search builds k hits per query: 2,560 of them (batch 256, top-10) take 0.8 ms
    instead of 2.0 ms on this project's 2-vCPU machine, a tenth of an in-process batch over 10k passages.
    """

    id: str
    title: str
    contents: str
    score: float

    @property
    def text(self) -> str:
        """The passage body without its title line."""
        _, sep, rest = self.contents.partition("\n")
        return rest if sep else self.contents

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "contents": self.contents, "score": self.score}


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the top-k hits of each, best first. One whose
    ``search`` may run in several threads at once may set the class attribute ``concurrent_calls = True``
    (optional, read with ``getattr``; see :class:`agent.loop.scheduler.Scheduler`)."""

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Return, for each query, at most ``k`` hits sorted by descending score.

        Raises ``ValueError`` for ``k < 1``.
        """
        ...


def check_queries(queries: list[str], k: int) -> None:
    """The checks every retriever makes of a search's arguments (:meth:`Retriever.search`).

    Raises ``TypeError`` for one string instead of a list of them or for a query that is not a ``str``, and
    ``ValueError`` for ``k`` not an integer >= 1 (a bool is not one).
    """
    if isinstance(queries, str):
        raise TypeError("queries must be a list of strings, got one string")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise TypeError(f"query {i} is {type(q).__name__}, expected str")
