"""A Hugging Face Hub on 127.0.0.1 for the download tests: the hub's URL layout and headers, a few small files.

``HEAD``/``GET {base}/datasets/{owner}/{name}/resolve/{revision}/{path}`` answers as the hub does:

* a regular (git) file: 200, ``ETag: "<git blob id>"``, ``Content-Length``, ``X-Repo-Commit``;
* an LFS file: 302 to ``{storage}/lfs/<sha256>`` with ``X-Linked-Etag: "<sha256>"``, ``X-Linked-Size`` and
  ``X-Repo-Commit`` (what ``huggingface_hub.get_hf_file_metadata`` reads): a second server on another port
  serves the bytes, as the hub's storage host does (huggingface_hub follows a redirect to its own origin);
* an unknown file: 404 with ``X-Error-Code: EntryNotFound``; an unknown repository: 401 with
  ``X-Error-Code: RepoNotFound``; a revision not in ``revisions``: 404 with ``X-Error-Code: RevisionNotFound``.

Bytes are served with ``Range: bytes=N-`` support (206, ``Content-Range``). Per file, ``served`` replaces the
bytes sent (a corrupted transfer under the right hash) and ``faults`` are consumed one per GET of its bytes:
``("cut", n)`` sends the full ``Content-Length`` but only ``n`` bytes and closes the connection;
``("status", code)`` answers ``code``. ``requests`` records ``(method, path, Range header)`` of each request.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubFile:
    content: bytes
    lfs: bool = True
    served: bytes | None = None
    faults: list[tuple[str, int]] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def git_blob(self) -> str:
        return hashlib.sha1(f"blob {len(self.content)}\0".encode() + self.content).hexdigest()


@dataclass
class FakeHub:
    """``repos``: repo id -> {path in the repo: :class:`HubFile`}; ``revisions``: the revisions answered
    (``None``: any), each resolved to ``commit``."""

    repos: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    revisions: set[str] | None = None
    commit: str = COMMIT
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""
    storage_url: str = ""

    def add(self, repo: str, path: str, content: bytes, lfs: bool = True) -> HubFile:
        f = HubFile(content, lfs)
        self.repos.setdefault(repo, {})[path] = f
        return f

    def byte_requests(self) -> list[tuple[str, str, str | None]]:
        """The GET requests that transferred file bytes."""
        return [r for r in self.requests if r[0] == "GET"]


_RESOLVE = re.compile(r"^/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            path = unquote(self.path)
            if path.startswith("/lfs/"):
                f = next((f for files in hub.repos.values() for f in files.values()
                          if f.lfs and f.sha256 == path[5:]), None)
                return self._bytes(f, body) if f else self._error(404, "EntryNotFound")
            m = _RESOLVE.match(path)
            if m is None or m.group(1) not in hub.repos:
                return self._error(401, "RepoNotFound")
            repo, revision, name = m.groups()
            if hub.revisions is not None and revision not in hub.revisions:
                return self._error(404, "RevisionNotFound")
            f = hub.repos[repo].get(name)
            if f is None:
                return self._error(404, "EntryNotFound", commit=True)
            if f.lfs:
                self.send_response(302)
                self.send_header("Location", f"{hub.storage_url}/lfs/{f.sha256}")
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(len(f.content)))
                self.send_header("ETag", f'"{hashlib.sha1(f.sha256.encode()).hexdigest()}"')  # the pointer's
                self.send_header("X-Repo-Commit", hub.commit)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            return self._bytes(f, body, git=True)

        def _error(self, code: int, error: str, commit: bool = False) -> None:
            self.send_response(code)
            self.send_header("X-Error-Code", error)
            if commit:
                self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _bytes(self, f: HubFile, body: bool, git: bool = False) -> None:
            data = f.served if f.served is not None else f.content
            fault = f.faults.pop(0) if body and f.faults else None
            if fault and fault[0] == "status":
                return self._error(fault[1], "")
            start = 0
            m = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
            if m and body:
                start = int(m.group(1))
            part = data[start:]
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            if git:
                self.send_header("ETag", f'"{f.git_blob}"')
                self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if not body:
                return None
            if fault and fault[0] == "cut":
                self.wfile.write(part[:fault[1]])
                self.wfile.flush()
                self.close_connection = True
                return None
            self.wfile.write(part)
            return None

    return Handler


def serve(hub: FakeHub) -> list[ThreadingHTTPServer]:
    """Start ``hub`` and its storage host on 127.0.0.1 (free ports; ``hub.url`` and ``hub.storage_url`` are
    set); stop them with ``server.shutdown()``."""
    servers = []
    for attr in ("url", "storage_url"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        server.daemon_threads = True
        setattr(hub, attr, f"http://127.0.0.1:{server.server_address[1]}")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    return servers
