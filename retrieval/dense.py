"""Dense retrieval's FAISS inner-product indexes over the encoder's vectors (:mod:`retrieval.encoder`; DPR,
Karpukhin et al. 2020).

:class:`DenseIndex` holds one or more FAISS shards (``flat`` = ``IndexFlatIP``, ``hnsw`` =
``IndexHNSWFlat``, ``ivfpq`` = ``IVF{nlist},PQ{m}``) of equal size, each at most ``shard_size`` vectors, and
merges the shards' top-k. Indexes move to GPU when faiss-gpu is installed and ``use_gpu`` is set.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

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
