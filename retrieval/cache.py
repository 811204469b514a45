"""An LRU cache of query results in front of any retriever, shared across a rollout step.

In GRPO every question is rolled out G times and the first search call is often the question itself, so
many queries repeat within a step. Keys are ``(query, k)``, exactly: the top 3 of a cached top-10 is not
served for k=3, because for HNSW, IVF (nprobe) and hybrid fusion the top 3 of a deeper search need not be the
top 3 searched for, and the cache must answer what the retriever would. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from retrieval.base import Hit, Retriever, check_queries


class CachedRetriever:
    """Wrap ``inner`` with an LRU of at most ``maxsize`` ``(query, k)`` keys. Misses of one batch are searched together
    in one ``inner.search`` call. ``hits``/``misses`` count lookups. Answers are stored as tuples and every
    caller gets its own lists, so a caller that changes one does not change the cache."""

    def __init__(self, inner: Retriever, maxsize: int = 100_000):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.inner, self.maxsize = inner, maxsize
        self._lru: OrderedDict[tuple[str, int], tuple[Hit, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __getattr__(self, name):  # expose the wrapped retriever's public attributes (store, search_rows, ...)
        if name.startswith("_") or name == "inner":  # no recursion on a half-built copy (copy, pickle)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.inner, name)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """The top-``k`` hits of each query, cached ones without searching. Raises ``TypeError`` /
        ``ValueError`` for malformed queries or ``k < 1`` (:func:`check_queries`) and ``RuntimeError`` when
        ``inner`` answers a different number of hit lists than it was asked queries."""
        check_queries(queries, k)
        out: list[list[Hit] | None] = [None] * len(queries)
        todo: dict[str, list[int]] = {}
        with self._lock:
            for i, q in enumerate(queries):
                got = self._lru.get((q, k))
                if got is not None:
                    self._lru.move_to_end((q, k))
                    out[i] = list(got)
                    self.hits += 1
                else:
                    todo.setdefault(q, []).append(i)
                    self.misses += 1
        if todo:
            uniq = list(todo)
            res = self.inner.search(uniq, k)
            if len(res) != len(uniq):
                raise RuntimeError(f"{type(self.inner).__name__}.search returned {len(res)} hit lists for "
                                   f"{len(uniq)} queries")
            with self._lock:
                for q, hits in zip(uniq, res):
                    hits = tuple(hits)
                    for i in todo[q]:
                        out[i] = list(hits)
                    self._lru[q, k] = hits
                    self._lru.move_to_end((q, k))
                while len(self._lru) > self.maxsize:
                    self._lru.popitem(last=False)
        return out  # type: ignore[return-value]
