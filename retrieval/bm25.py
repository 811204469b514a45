"""BM25 over a passage corpus with bm25s (Lù, 2024, "BM25S: Orders of magnitude faster lexical search").

Scoring follows Lucene's BM25 (``method="lucene"``, k1=0.9 and b=0.4 as in pyserini/Anserini's defaults, so
ranks agree with pyserini). Tokenisation: lower-case, ``\\w\\w+`` tokens, English stopwords removed,
Snowball stemming through PyStemmer. The stemmer language and stopwords are saved beside the index so that
queries are tokenised exactly as the passages were.

Retrieval runs Sleuth's exact MaxScore top-k (:mod:`retrieval.maxscore`) over bm25s's score matrix by default;
bm25s's own exhaustive retrieval (``numpy`` or ``numba`` backend) stays selectable as the reference.

This module scores and ranks document *rows* (0-based positions in the corpus); :mod:`retrieval.index`
turns rows into :class:`~retrieval.base.Hit` objects.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

PARAMS_FILE = "sleuth_bm25.json"


#: bm25s's term-frequency scoring variants (Kamphuis et al., 2020)
METHODS = ("lucene", "robertson", "atire", "bm25l", "bm25+")


@dataclass(frozen=True)
class BM25Params:
    """BM25 hyper-parameters and tokenisation, saved as ``sleuth_bm25.json``.

    ``stemmer`` is a PyStemmer/Snowball language name (``"english"``) or ``None`` for no stemming;
    ``stopwords`` is ``"en"`` or ``None``; ``method`` is one of bm25s's :data:`METHODS`. Raises
    ``ValueError`` for an unknown ``method`` or ``stemmer`` (before anything is built), ``k1`` not a finite
    number >= 0 or ``b`` outside ``[0, 1]``, the ranges Lucene's BM25 accepts (outside them the length norm
    or the term-frequency saturation turns negative and ranks passages backwards).
    """

    k1: float = 0.9
    b: float = 0.4
    method: str = "lucene"
    stemmer: str | None = "english"
    stopwords: str | None = "en"

    def __post_init__(self):
        if not 0 <= self.k1 < math.inf:
            raise ValueError(f"BM25 k1 must be a finite number >= 0, got {self.k1}")
        if not 0 <= self.b <= 1:
            raise ValueError(f"BM25 b must lie in [0, 1], got {self.b}")
        if self.method not in METHODS:
            raise ValueError(f"unknown BM25 method {self.method!r}; bm25s has {', '.join(METHODS)}")
        if self.stemmer:  # None or "": no stemming
            import Stemmer

            if self.stemmer not in Stemmer.algorithms():
                raise ValueError(f"unknown stemmer {self.stemmer!r}; PyStemmer has {', '.join(Stemmer.algorithms())} "
                                 "(or None for no stemming)")


#: modules hidden from bm25s while it loads (see :func:`import_bm25s`)
JAX_MODULES = ("jax", "jax.lax")
_IMPORT_LOCK = threading.Lock()


def import_bm25s():
    """Import and return the ``bm25s`` module without letting it load JAX.

    bm25s's ``selection`` module imports ``jax.lax`` whenever JAX is installed and runs a ``jax.lax.top_k`` at
    import time, which starts JAX's default backend: on a GPU machine JAX then preallocates 75% of every
    visible GPU's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``) in this process, memory the policy and the
    rollout engine need. Sleuth never uses bm25s's JAX top-k (MaxScore, or bm25s's numpy/numba backends),
    so ``jax`` and ``jax.lax`` are hidden (``None`` in ``sys.modules``, an ``ImportError`` to bm25s, which then
    uses numpy) while bm25s loads, and restored afterwards: JAX stays importable, untouched, for anything
    else in the process, and no JAX environment variable is changed. If bm25s was already imported
    elsewhere it is returned as it is.
    """
    mod = sys.modules.get("bm25s")
    if mod is not None:
        return mod
    with _IMPORT_LOCK:
        saved = {name: sys.modules[name] for name in JAX_MODULES if name in sys.modules}
        sys.modules.update(dict.fromkeys(JAX_MODULES))
        try:
            import bm25s  # imports bm25s.selection (the JAX probe) and bm25s.tokenization
        finally:
            for name in JAX_MODULES:
                if name in saved:
                    sys.modules[name] = saved[name]
                elif sys.modules.get(name, 0) is None:
                    del sys.modules[name]
    return bm25s


BACKENDS = ("maxscore", "numpy", "numba")
#: stems of query words cached since loading (about 360 bytes each) kept before they are dropped again
STEM_CACHE_WORDS = 100_000


def _tokenizer(params: BM25Params):
    bm25s = import_bm25s()
    stemmer = None
    if params.stemmer:
        import Stemmer

        stemmer = Stemmer.Stemmer(params.stemmer)
    return bm25s.tokenization.Tokenizer(lower=True, stopwords=params.stopwords or [], stemmer=stemmer)


class BM25Index:
    """A loaded bm25s index plus its tokenizer.

    ``search_rows(queries, k)`` returns ``(rows, scores)``: int64 and float32 arrays of shape ``[Q, k']``,
    ``k' = min(k, num_docs)``, best first. Rows whose score is 0 (no query term matched) are -1, as Lucene
    returns nothing for them.
    """

    def __init__(self, model, tokenizer, params: BM25Params, n_threads: int = 0, backend: str = "maxscore"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown BM25 backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.model = model
        self.tokenizer = tokenizer
        self.params = params
        self.n_threads = n_threads
        self._backend = backend
        self._tok_lock = threading.Lock()  # the tokenizer caches new words in dicts
        self._stems_loaded = len(getattr(tokenizer, "word_to_stem", ()))
        self._maxs = None
        self._pool = None
        if backend == "maxscore":
            if getattr(model, "nonoccurrence_array", None) is not None:
                raise ValueError(f"the maxscore backend needs a BM25 variant without non-occurrence scores, not "
                                 f"method={params.method!r}; load with backend='numpy'")
            from concurrent.futures import ThreadPoolExecutor

            from retrieval import maxscore

            self._maxs = maxscore.max_impacts(model.scores["data"], model.scores["indptr"])
            self._threads = n_threads or maxscore.default_threads()
            if self._threads > 1:  # the calling thread works too; the pool's threads start on first use
                self._pool = ThreadPoolExecutor(self._threads - 1, thread_name_prefix="bm25")

    @property
    def backend(self) -> str:
        """The retrieval backend in use: ``"maxscore"``, or bm25s's ``"numpy"`` or ``"numba"``."""
        return self._backend

    @property
    def num_docs(self) -> int:
        return int(self.model.scores["num_docs"])

    @classmethod
    def build(
        cls,
        texts: Iterable[str],
        n_docs: int,
        out_dir: str | Path,
        params: BM25Params | None = None,
        show_progress: bool = True,
    ) -> BM25Index:
        """Tokenise a stream of ``n_docs`` passage texts, build the index and save it under ``out_dir``.

        The texts are streamed (never held in memory together); the token ids are (int32, about 4 bytes per
        kept token). The returned index searches with ``maxscore``, or with bm25s's ``numpy`` for BM25L and
        BM25+ (``method`` ``"bm25l"``/``"bm25+"``: non-occurrence scores, which maxscore cannot prune; load such
        an index with ``backend="numpy"`` too).
        """
        bm25s = import_bm25s()
        out_dir = Path(out_dir)
        params = params or BM25Params()
        tok = _tokenizer(params)
        corpus_tokens = tok.tokenize(
            texts, update_vocab=True, return_as="tuple", show_progress=show_progress, length=n_docs
        )
        if len(corpus_tokens.ids) != n_docs:
            raise ValueError(f"BM25 build: expected {n_docs} passages, tokenised {len(corpus_tokens.ids)}")
        model = bm25s.BM25(k1=params.k1, b=params.b, method=params.method)
        model.index(corpus_tokens, show_progress=show_progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save(str(out_dir), show_progress=show_progress)
        tok.save_vocab(str(out_dir))
        tok.save_stopwords(str(out_dir))
        (out_dir / PARAMS_FILE).write_text(json.dumps(asdict(params), indent=1))
        return cls(model, tok, params, backend="numpy" if getattr(model, "nonoccurrence_array", None) is not None
                   else "maxscore")

    @classmethod
    def load(
        cls, index_dir: str | Path, mmap: bool = True, n_threads: int = 0, backend: str = "maxscore"
    ) -> BM25Index:
        """Load an index saved by :meth:`build`. ``mmap`` memory-maps the score matrix.

        ``backend``: ``"maxscore"`` (default; Sleuth's exact top-k with MaxScore pruning, numba-compiled once
        per install, searching ``n_threads`` threads, 0 = all cores), or bm25s's exhaustive retrieval:
        ``"numpy"`` or ``"numba"`` (bm25s's ``n_threads``: 0 = one thread). All three give the same scores
        (up to float32 summation order); equal scores may be ordered differently. Raises
        ``FileNotFoundError`` if a part is missing and ``ValueError`` for an unknown backend.
        """
        bm25s = import_bm25s()
        index_dir = Path(index_dir)
        pfile = index_dir / PARAMS_FILE
        if not pfile.exists():
            raise FileNotFoundError(f"BM25 index incomplete: {pfile} is missing")
        params = BM25Params(**json.loads(pfile.read_text()))
        model = bm25s.BM25.load(str(index_dir), mmap=mmap, show_progress=False,
                                backend="numba" if backend == "numba" else "numpy")
        tok = _tokenizer(params)
        tok.load_vocab(str(index_dir))
        tok.load_stopwords(str(index_dir))
        return cls(model, tok, params, n_threads=n_threads, backend=backend)

    def tokenize(self, queries: list[str]) -> list[list[int]]:
        """Token ids of each query that are terms of the index; unknown words and stopwords are dropped, so
        such a query has none.

        bm25s gives a query with no known term its empty token, which every passage that tokenised to nothing
        also carries; that id is removed here, so such a query matches no passage (as in Lucene). bm25s also
        caches the stem of every word it stems, unknown ones included; past :data:`STEM_CACHE_WORDS` of them
        since loading they are dropped (the newest entries of an insertion-ordered dict), so a long-running
        server does not grow with every distinct query word.
        """
        with self._tok_lock:
            ids = self.tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
            stems = getattr(self.tokenizer, "word_to_stem", None)
            if stems is not None and len(stems) - self._stems_loaded > STEM_CACHE_WORDS:
                for _ in range(len(stems) - self._stems_loaded):
                    stems.popitem()
        known, empty = self.model.unique_token_ids_set, self.tokenizer.word_to_id.get("")
        return [[t for t in q if t != empty and t in known] for q in ids]

    def search_rows(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` rows and BM25 scores for each query; see the class docstring for shapes. A query with no
        known term (only unknown words or stopwords, or blank) gets no hits. Raises ``ValueError`` for
        ``k < 1``."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, self.num_docs)
        if not queries:
            return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
        ids = self.tokenize(queries)
        if self._backend == "maxscore":
            from retrieval import maxscore

            s = self.model.scores
            return maxscore.search(s["data"], s["indices"], s["indptr"], self._maxs, ids, k, self._threads, self._pool)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.zeros((len(queries), k), dtype=np.float32)
        keep = [i for i, q in enumerate(ids) if q]  # bm25s's numba backend rejects a query without ids
        if keep:
            res = self.model.retrieve([ids[i] for i in keep], k=k, show_progress=False, n_threads=self.n_threads)
            rows[keep] = np.asarray(res.documents, dtype=np.int64).reshape(len(keep), k)
            scores[keep] = np.asarray(res.scores, dtype=np.float32).reshape(len(keep), k)
        rows[scores <= 0] = -1
        return rows, scores
