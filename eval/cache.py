"""Prediction cache and configuration fingerprints: evaluation runs that resume and never mix configs.

A run directory holds one folder per (method, config fingerprint)::

    RUN_DIR/<method>-<fingerprint>/fingerprint.json          what was hashed (method options, agent config,
                                                             model, index and corpus manifests)
    RUN_DIR/<method>-<fingerprint>/predictions/<bench>.jsonl append-only, one prediction record per question
    RUN_DIR/<method>-<fingerprint>/summary.json              metrics per benchmark (written by eval.run)

Predictions are keyed by (method, fingerprint, benchmark, question id). A run computes only the questions
whose records are missing, appends each finished batch (flushed and fsynced), so a crash loses at most the
batch in flight, and extending ``--limit`` reuses every question already answered. A different config has a
different fingerprint and hence a different folder; a record whose ``fingerprint`` field disagrees with its
folder is refused (:class:`CacheMismatchError`), never silently mixed in.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from corpora.formats import drop_torn_tail

log = logging.getLogger(__name__)

FINGERPRINT_LEN = 12
FULL_HASH_LIMIT = 64 << 20  # files up to 64 MiB are hashed whole; larger ones by size + head + tail
_VOLATILE_KEYS = {"created", "build_seconds"}  # manifest fields that change on a rebuild of the same thing


class CacheMismatchError(ValueError):
    """A cache file holds predictions of another configuration (or is corrupt)."""


def fingerprint(obj: Any) -> str:
    """Hex sha256 (first 12 characters) of ``obj`` as canonical JSON (sorted keys; non-JSON values by
    ``str``)."""
    blob = json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:FINGERPRINT_LEN]


def file_digest(path: str | Path) -> str:
    """sha256 of a file; files over 64 MiB are summarised by their size and first and last 4 MiB (model
    weights are large; a change of weights changes those bytes in practice)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            while b := f.read(1 << 23):
                h.update(b)
        else:
            h.update(str(size).encode())
            h.update(f.read(4 << 20))
            f.seek(size - (4 << 20))
            h.update(f.read(4 << 20))
    return h.hexdigest()


def path_manifest(path: str | Path, max_files: int = 2000) -> dict[str, Any]:
    """What identifies a file or directory: ``{"path", "sha256"}`` for a file; for a directory a sorted
    list of ``(relative path, size, sha256)`` of its files (at most ``max_files``; an index directory's own
    ``manifest.json`` is used instead when it has one). Raises ``FileNotFoundError``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"cannot fingerprint {path}: it does not exist")
    if path.is_file():
        return {"path": str(path.resolve()), "sha256": file_digest(path)}
    man = path / "manifest.json"
    if man.exists():
        data = json.loads(man.read_text())
        return {"path": str(path.resolve()), "manifest": {k: v for k, v in data.items() if k not in _VOLATILE_KEYS}}
    files = sorted(p for p in path.rglob("*") if p.is_file())[:max_files]
    return {
        "path": str(path.resolve()),
        "files": [[str(p.relative_to(path)), p.stat().st_size, file_digest(p)] for p in files],
    }


def describe_llm(llm: Any) -> dict[str, Any]:
    """Identity of an LLM backend: its class, its ``fingerprint`` attribute if it has one, the model's
    ``name_or_path`` (an API backend's served model name, its ``model`` string), an API backend's
    ``base_url``, and for a torch model a checksum of its current parameters (the trainer updates
    weights in place, so the path alone does not identify them)."""
    out: dict[str, Any] = {"class": f"{type(llm).__module__}.{type(llm).__qualname__}"}
    fp = getattr(llm, "fingerprint", None)
    if fp is not None:
        out["fingerprint"] = fp() if callable(fp) else fp
    model = getattr(llm, "model", None)
    name = (getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(llm, "model_name", None)
            or (model if isinstance(model, str) else None))
    if name:
        out["name_or_path"] = str(name)
    if getattr(llm, "base_url", None):
        out["base_url"] = str(llm.base_url)
    if model is not None and hasattr(model, "parameters"):
        out["weights"] = _param_checksum(model)
    tok = getattr(llm, "tokenizer", None)
    if tok is not None:
        out["tokenizer"] = {"class": type(tok).__name__, "vocab_size": getattr(tok, "vocab_size", None),
                            "name_or_path": getattr(tok, "name_or_path", None)}
    return out


def _param_checksum(model: Any) -> str:
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.detach().double()
            h.update(f"{name}:{tuple(p.shape)}:{t.sum().item():.10e}:{t.abs().sum().item():.10e}".encode())
    return h.hexdigest()[:16]


SERVER_KEYS = ("index", "method", "num_passages", "bm25_backend")  # what a server's /health says it searches


def describe_retriever(retriever: Any, index_dir: str | Path | None = None) -> dict[str, Any]:
    """Identity of a retriever: its class and its index manifest (``index_dir`` if given, else found through
    a ``index_dir`` attribute or a doc store's ``path``; the manifest carries the corpus sha256). A retrieval
    server's client (an ``endpoint`` attribute, :class:`retrieval.client.RemoteRetriever`) is identified by
    its URL and what the server's ``/health`` reports of its index (:data:`SERVER_KEYS`; nothing from a
    server without ``/health``, like Search-R1's), not by a local ``index_dir``, which it does not search."""
    if retriever is None:
        return {"class": None}
    out: dict[str, Any] = {"class": f"{type(retriever).__module__}.{type(retriever).__qualname__}"}
    endpoint = getattr(retriever, "endpoint", None)
    if endpoint is not None:
        out["url"] = str(endpoint)
        try:
            health = retriever.health()
        except ValueError:  # no /health route (HTTP 404)
            health = {}
        out["server"] = {k: health[k] for k in SERVER_KEYS if isinstance(health, dict) and k in health}
        return out
    if index_dir is None:
        index_dir = getattr(retriever, "index_dir", None)
        store = getattr(retriever, "store", None) or getattr(getattr(retriever, "bm25", None), "store", None)
        if index_dir is None and store is not None and getattr(store, "path", None):
            index_dir = Path(store.path).parent
    if index_dir is not None and Path(index_dir).exists():
        out["index"] = path_manifest(index_dir)
    fp = getattr(retriever, "fingerprint", None)
    if fp is not None:
        out["fingerprint"] = fp() if callable(fp) else fp
    return out


def safe_name(benchmark: str) -> str:
    """A file-system-safe cache name for a benchmark (a QA file path becomes ``<stem>-<hash of path>``)."""
    if re.fullmatch(r"[A-Za-z0-9_.-]+", benchmark) and not benchmark.endswith((".jsonl", ".json", ".parquet")):
        return benchmark
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(benchmark).stem)[:40]
    return f"{stem}-{fingerprint(str(Path(benchmark).resolve()))[:8]}"


class PredictionCache:
    """The predictions of one (method, fingerprint) in a run directory.

    ``manifest`` is what the fingerprint was computed from; it is saved as ``fingerprint.json`` and must
    match an existing one (else :class:`CacheMismatchError`).
    """

    def __init__(self, run_dir: str | Path, method: str, manifest: dict[str, Any]):
        self.method = method
        self.manifest = manifest
        self.fingerprint = fingerprint(manifest)
        self.dir = Path(run_dir) / f"{method}-{self.fingerprint}"
        (self.dir / "predictions").mkdir(parents=True, exist_ok=True)
        fp_file = self.dir / "fingerprint.json"
        if fp_file.exists():
            saved = json.loads(fp_file.read_text())
            if saved.get("fingerprint") != self.fingerprint:
                raise CacheMismatchError(
                    f"{fp_file} records fingerprint {saved.get('fingerprint')!r}, not {self.fingerprint!r}; "
                    "refusing to mix predictions of different configs (use another --out)"
                )
        else:
            # a temp name of this process and thread: two runs starting this config at once each rename their own
            tmp = fp_file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"method": method, "fingerprint": self.fingerprint, "manifest": manifest},
                                      indent=1, default=str))
            tmp.replace(fp_file)

    def path(self, benchmark: str) -> Path:
        return self.dir / "predictions" / f"{safe_name(benchmark)}.jsonl"

    def load(self, benchmark: str) -> dict[str, dict[str, Any]]:
        """Cached records of ``benchmark`` by question id (a later record of an id wins).

        A torn last line (a crash mid-write, possibly inside a UTF-8 character) is ignored with a warning; any
        other unreadable line (not UTF-8, not JSON, not a record with an id), or a record of another
        fingerprint or method, raises :class:`CacheMismatchError` naming the line.
        """
        path = self.path(benchmark)
        if not path.exists():
            return {}
        out: dict[str, dict[str, Any]] = {}
        lines = path.read_bytes().split(b"\n")  # per line: a torn last line may end inside a UTF-8 character
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                if lineno == len(lines) or all(not x.strip() for x in lines[lineno:]):
                    log.warning("%s:%d: ignoring a torn last line (interrupted write)", path, lineno)
                    continue
                raise CacheMismatchError(f"{path}:{lineno}: not valid JSON (or not UTF-8); the cache file is corrupt") from None
            if not isinstance(rec, dict):
                raise CacheMismatchError(f"{path}:{lineno}: a JSON {type(rec).__name__}, not a record; the cache "
                                         "file is corrupt")
            if rec.get("fingerprint") != self.fingerprint or rec.get("method") != self.method:
                raise CacheMismatchError(
                    f"{path}:{lineno}: record of method {rec.get('method')!r} / fingerprint "
                    f"{rec.get('fingerprint')!r} in the cache of {self.method!r} / {self.fingerprint!r}; "
                    "refusing to mix predictions of different configs"
                )
            if rec.get("id") is None:
                raise CacheMismatchError(f"{path}:{lineno}: a record without an id; the cache file is corrupt")
            out[str(rec["id"])] = rec
        return out

    def append(self, benchmark: str, records: Iterable[dict[str, Any]]) -> int:
        """Append records (stamped with method, fingerprint and benchmark) and fsync; returns how many.

        Holds an exclusive lock on the file while it writes, so another process appending to it (a second
        run of this config) finishes its batch first, and its unfinished last line is not cut as torn."""
        path = self.path(benchmark)
        lines = []
        for r in records:
            rec = {**r, "method": self.method, "fingerprint": self.fingerprint, "benchmark": benchmark}
            lines.append(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
        if not lines:
            return 0
        with open(path, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file is closed (or the process dies)
            if dropped := drop_torn_tail(f):  # a crash mid-write: new records start on a fresh line
                log.warning("%s: dropping a torn last line of %d bytes (interrupted write)", path, dropped)
            f.write("".join(lines).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        return len(lines)
