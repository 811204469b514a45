"""Download one file of a Hugging Face Hub repository: resumable across runs, checked against its content hash,
never left half-written under its final name.

huggingface_hub (2.x) downloads each file into a temporary file of its own process and deletes it when the
download fails, so an interrupted multi-gigabyte download (wiki-18, the e5 index's two parts of ~32 GB) would
start over. :func:`fetch` therefore composes the library's own pieces and keeps the partial file itself:

* ``hf_hub_url`` + ``get_hf_file_metadata``: the HEAD request on
  ``{endpoint}/datasets/{repo}/resolve/{rev}/{file}`` that answers the commit (``X-Repo-Commit``), the content hash (``X-Linked-Etag``: an LFS file's sha256;
  otherwise ``ETag``: the git blob id), the size (``X-Linked-Size`` / ``Content-Length``) and, for LFS files,
  the storage location the hub redirects to;
* ``http_get``: the GET with ``Range: bytes=N-`` from where the kept partial file ends (``N`` bytes), its
  retries within a run, its progress bar (``HF_HUB_DISABLE_PROGRESS_BARS=1`` hides it) and its size check.

The partial file is ``<file>.<hash>.incomplete`` beside the target, so bytes of another version are never
continued. The complete file is checked before it is renamed into place: its sha256 against the LFS hash (and
against a pinned sha256 when the caller knows one), or its git blob id. A file that fails the check is deleted.
``HF_ENDPOINT`` (read at each call) points the downloads at a mirror of the hub; ``HF_HUB_OFFLINE=1`` refuses
them with :class:`HubOfflineError`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

SHA256 = re.compile(r"^[0-9a-f]{64}$")
GIT_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 1 << 20


class HubError(OSError):
    """A hub download failed (file or revision not found, network down, interrupted); the message names the
    file, the repository and revision, and what to do."""


class HubOfflineError(HubError):
    """``HF_HUB_OFFLINE=1`` forbids the download a missing file needs."""


class ChecksumError(HubError):
    """A downloaded file's content differs from the hash the hub (or the caller) gives for it; the file has been
    deleted."""


@dataclass(frozen=True)
class Fetched:
    """One downloaded file: ``commit`` the hub resolved the revision to, ``etag`` its content hash on the hub
    (sha256 for an LFS file, else the git blob id), ``sha256`` of the bytes on disk, ``size`` in bytes,
    ``downloaded`` the bytes this call transferred and ``resumed_from`` the bytes an earlier run had kept."""

    path: str
    commit: str
    etag: str
    sha256: str
    size: int
    downloaded: int
    resumed_from: int


def hub_offline() -> bool:
    """Whether huggingface_hub refuses network calls (``HF_HUB_OFFLINE=1`` when it was imported)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def file_digests(path: Path, progress_label: str | None = None) -> tuple[str, str]:
    """``(sha256, git blob id)`` of a file, read once in 1 MiB blocks; a progress bar labelled
    ``progress_label`` for files over 1 GiB."""
    from tqdm.auto import tqdm

    size = path.stat().st_size
    sha256, blob = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"checking {progress_label}",
                                     disable=progress_label is None or size < 1 << 30) as bar:
        while block := f.read(_CHUNK):
            sha256.update(block)
            blob.update(block)
            bar.update(len(block))
    return sha256.hexdigest(), blob.hexdigest()


def record_path(dest: Path) -> Path:
    """Where :func:`fetch` records what it downloaded to ``dest`` (``<dest>.hub.json``)."""
    return dest.with_name(dest.name + ".hub.json")


def partial_files(dest: Path) -> list[Path]:
    """Partial downloads of ``dest`` kept for a later run to continue."""
    return sorted(dest.parent.glob(f"{glob.escape(dest.name)}.*.incomplete")) if dest.parent.is_dir() else []


def fetch(repo: str, filename: str, revision: str, dest: str | Path, *, sha256: str | None = None,
          repo_type: str = "dataset", label: str | None = None, force: bool = False) -> Fetched:
    """Download ``filename`` of the hub repository ``repo`` at ``revision`` (a commit, tag or branch) to
    ``dest``, or reuse ``dest`` when an earlier call downloaded the same content there (unless ``force``).

    Resumes a partial file an interrupted run kept (an HTTP ``Range`` request). ``sha256`` pins the content
    (checked besides the hub's hash). ``label`` (a dataset name) starts every error message. Raises
    :class:`HubOfflineError`, :class:`ChecksumError` (the file is deleted) and :class:`HubError` (file,
    revision or repository not found, the hub unreachable, a download interrupted: the partial file is kept and
    the message says that running again resumes it).
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    dest = Path(dest)
    where = f"{label + ': ' if label else ''}{filename} of {repo} (revision {revision})"
    if hub_offline():
        raise HubOfflineError(f"{where} is not downloaded and HF_HUB_OFFLINE=1 forbids downloading it: "
                              "unset HF_HUB_OFFLINE, or copy the files from a machine that has them")
    endpoint = os.environ.get("HF_ENDPOINT") or None
    url = hf_hub_url(repo, filename, repo_type=repo_type, revision=revision, endpoint=endpoint)
    meta = _call(lambda: get_hf_file_metadata(url), where, url)
    if not meta.commit_hash or not meta.etag:
        raise HubError(f"{where}: {url} answered without a commit or content hash (X-Repo-Commit, ETag): "
                       "HF_ENDPOINT does not point at a Hugging Face Hub")
    etag = meta.etag.lower()
    known = _read_record(dest)
    if not force and dest.is_file() and known is not None and (known["etag"], known["size"]) == (
            etag, dest.stat().st_size):
        return Fetched(**{**known, "downloaded": 0, "resumed_from": 0})
    partial = dest.with_name(f"{dest.name}.{etag[:16]}.incomplete")
    for stale in partial_files(dest):  # bytes of another version of the file are no start for this one
        if stale != partial:
            stale.unlink()
    resumed = _download(meta, partial, filename, where)
    digest, blob = file_digests(partial, filename)
    expected = [("sha256 (pinned)", sha256.lower(), digest)] if sha256 else []
    expected.append(("sha256", etag, digest) if SHA256.match(etag) else ("git blob id", etag, blob))
    for kind, want, got in expected:
        if want != got:
            partial.unlink()
            raise ChecksumError(f"{where}: the downloaded file's {kind} is {got}, expected {want}; it was "
                                "deleted (run again to download it anew)")
    dest.unlink(missing_ok=True)
    os.replace(partial, dest)
    size = dest.stat().st_size
    done = Fetched(path=filename, commit=meta.commit_hash, etag=etag, sha256=digest, size=size,
                   downloaded=size - resumed, resumed_from=resumed)
    record = {k: v for k, v in asdict(done).items() if k not in ("downloaded", "resumed_from")}
    record_path(dest).write_text(json.dumps(record, indent=1) + "\n")
    return done


def _download(meta, partial: Path, filename: str, where: str) -> int:
    """Continue (or start) ``partial`` from the hub; the bytes it held before."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    partial.parent.mkdir(parents=True, exist_ok=True)
    resumed = partial.stat().st_size if partial.exists() else 0
    if meta.size is not None and resumed > meta.size:  # longer than the file: not a prefix of it
        partial.unlink()
        resumed = 0
    headers = build_hf_headers()
    hub_host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").netloc
    if urlparse(meta.location).netloc != hub_host:
        headers.pop("authorization", None)  # a storage URL signed by the hub: no token to another host
    with open(partial, "ab") as f:
        _call(lambda: http_get(meta.location, f, resume_size=resumed, headers=headers, expected_size=meta.size,
                               displayed_filename=filename), where, meta.location, partial, meta.size)
    return resumed


def _call(fn: Callable, where: str, url: str, partial: Path | None = None, size: int | None = None):
    """``fn()``, its hub and network errors raised as :class:`HubError` saying what happened and what to do."""
    import httpx2
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def kept() -> str:
        if partial is None or not partial.exists():
            return ""
        return (f"; {partial.stat().st_size:,} bytes are kept in {partial} and running the same command again "
                "resumes the download")

    try:
        return fn()
    except RemoteEntryNotFoundError:
        raise HubError(f"{where}: no such file on the hub (HTTP 404 for {url})") from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: the repository has no such revision (HTTP 404 for {url}); pass another with "
                       "--revision (a commit, a tag or 'main')") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where}: repository not found, or private (HTTP error for {url})") from None
    except OfflineModeIsEnabled:
        raise HubOfflineError(f"{where}: HF_HUB_OFFLINE=1 forbids downloading it; unset it") from None
    except (HfHubHTTPError, httpx2.HTTPError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, httpx2.TransportError):  # no answer at all: DNS, refused connection, timeout
            raise HubError(f"{where}: cannot reach {urlparse(url).netloc} ({detail}); check the connection, "
                           f"or HF_ENDPOINT{kept()}") from None
        raise HubError(f"{where}: download failed ({detail}){kept()}") from None
    except OSError as e:  # http_get's size check: the bytes received do not make up the file
        if partial is None:
            raise HubError(f"{where}: {e}") from None
        if size is not None and partial.exists() and partial.stat().st_size < size:  # a prefix: resumable
            raise HubError(f"{where}: the download stopped early{kept()}") from None
        partial.unlink(missing_ok=True)
        raise HubError(f"{where}: {str(e).splitlines()[0]}; the partial file was deleted (run again to "
                       "download it anew)") from None


def _read_record(dest: Path) -> dict | None:
    try:
        rec = json.loads(record_path(dest).read_text())
    except (OSError, ValueError):
        return None
    fields = {"path", "commit", "etag", "sha256", "size"}
    return {k: rec[k] for k in fields} if isinstance(rec, dict) and fields <= rec.keys() else None
