"""Hybrid retrieval by reciprocal-rank fusion (Cormack, Clarke & Büttcher, SIGIR 2009).

``score(d) = sum_r 1 / (rrf_k + rank_r(d))`` over the retrievers r that returned d within their top
``depth`` (rank starting at 1; ``rrf_k = 60`` as in the paper). Any two (or more) retrievers can be fused;
those that share a passage store (BM25 and dense over one index directory) are fused on rows before the
passages are read, which avoids reading ``depth`` passages per retriever.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from retrieval.base import Hit, Retriever, check_queries


def rrf_fuse(
    rankings: Sequence[Sequence[Hashable]], k: int, rrf_k: float = 60.0
) -> list[tuple[Hashable, float]]:
    """Fuse ranked lists of keys (best first) into the top ``k`` ``(key, rrf score)`` pairs, best first.

    A key repeated within one ranking counts once, at its first place, and the keys after it move up (a
    document has one rank per ranking). Ties keep the order in which keys were first seen (earlier retriever,
    better rank first).
    """
    terms: dict[Hashable, list[float]] = {}
    for ranking in rankings:
        for rank, key in enumerate(dict.fromkeys(ranking), start=1):
            terms.setdefault(key, []).append(1.0 / (rrf_k + rank))
    # fsum is exactly rounded, so equal sets of ranks give equal scores in any retriever order (a running sum
    # of three or more terms can differ in the last bit and break a true tie against the first-seen rule)
    scores = [(key, math.fsum(ts)) for key, ts in terms.items()]
    return sorted(scores, key=lambda kv: -kv[1])[:k]  # sorted() is stable


class HybridRetriever:
    """RRF of several retrievers; hit scores are the fused RRF scores.

    Each part is searched for ``max(depth, k)`` hits; blank queries get no hits. Raises ``TypeError`` /
    ``ValueError`` for malformed queries or ``k < 1`` (:func:`retrieval.base.check_queries`).
    """

    def __init__(self, *parts: Retriever, rrf_k: float = 60.0, depth: int = 100):
        if len(parts) < 2:
            raise ValueError("HybridRetriever needs at least two retrievers")
        if not rrf_k >= 0:  # also NaN; rrf_k <= -1 divides by zero or turns ranks' weights negative
            raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        self.parts, self.rrf_k, self.depth = parts, rrf_k, depth
        stores = {id(getattr(p, "store", None)) for p in parts}
        self._rows = (
            all(hasattr(p, "search_rows") for p in parts)
            and len(stores) == 1
            and None not in [getattr(p, "store", None) for p in parts]
        )
        self.store = parts[0].store if self._rows else None

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        check_queries(queries, k)
        depth = max(self.depth, k)
        if self._rows:
            keep = [i for i, q in enumerate(queries) if q.strip()]
            out: list[list[Hit]] = [[] for _ in queries]
            if not keep:
                return out
            sub = [queries[i] for i in keep]
            ranked = [p.search_rows(sub, depth)[0] for p in self.parts]
            for j, i in enumerate(keep):
                fused = rrf_fuse([[r for r in rows[j].tolist() if r >= 0] for rows in ranked], k, self.rrf_k)
                rows = np.array([[r for r, _ in fused]], dtype=np.int64)
                sc = np.array([[s for _, s in fused]], dtype=np.float32)
                out[i] = self.store.hits(rows, sc)[0]
            return out
        results = [p.search(queries, depth) for p in self.parts]
        out = []
        for qi in range(len(queries)):
            by_id: dict[str, Hit] = {}
            for res in results:
                for h in res[qi]:
                    by_id.setdefault(h.id, h)
            fused = rrf_fuse([[h.id for h in res[qi]] for res in results], k, self.rrf_k)
            out.append([Hit(by_id[i].id, by_id[i].title, by_id[i].contents, float(s)) for i, s in fused])
        return out
