"""The one request guard of Sleuth's HTTP servers (the retrieval server, ``sleuth serve``, the training proxy):
the API key, a bounded body, and a JSON body parsed within a nesting and an integer-digit limit.

Each check raises :class:`GuardError` with the HTTP status to answer and a message naming the limit; each
server writes it in its own error format (Search-R1's ``{"error", "detail"}``, OpenAI's ``{"error": {...}}``).

* **API key**: with a key (not empty), a request must send ``Authorization: Bearer <key>`` (401 otherwise;
  compared in constant time); without one the server is open.
* **Body size**: a declared ``Content-Length`` over ``max_body_bytes`` is refused before anything is read, and
  a streamed body is counted as it arrives and refused as soon as it passes the limit (413), so a client
  cannot make the server buffer more than the limit.
* **JSON**: a body that is not JSON, not UTF-8, nested deeper than ``max_depth`` arrays and objects (or than
  the decoder's recursion limit), or holding an integer of more than ``max_int_digits`` digits (Python would
  spend time quadratic in the digits converting it; past its own 4,300-digit limit it raises a plain
  ``ValueError``) is a 400 that says which; a body that is not an object where one is expected too.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

#: deepest nesting of arrays and objects a request may have (Sleuth's bodies nest a few levels; an agent's
#: tool schemas a few more)
MAX_JSON_DEPTH = 64
#: most digits of one JSON integer (a 64-bit seed has 20)
MAX_INT_DIGITS = 100


class GuardError(ValueError):
    """A request the guard refuses: HTTP ``status`` (400, 401 or 413), ``message`` and OpenAI's error
    ``kind`` (``authentication_error`` for 401, else ``invalid_request_error``)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass(frozen=True)
class RequestGuard:
    """The checks of one server: ``api_key`` (``None`` or empty: open), ``max_body_bytes``, ``max_depth``
    (nesting of JSON arrays and objects) and ``max_int_digits`` (digits of a JSON integer)."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_depth: int = MAX_JSON_DEPTH
    max_int_digits: int = MAX_INT_DIGITS

    @property
    def open(self) -> bool:
        """Whether the server takes requests without a key."""
        return not self.api_key

    def check_auth(self, authorization: str | bytes | None) -> None:
        """Raise a 401 :class:`GuardError` unless the ``Authorization`` header's value is ``Bearer <api_key>``
        (or the server is :attr:`open`)."""
        if self.open:
            return
        got = authorization.encode("latin-1") if isinstance(authorization, str) else (authorization or b"")
        if not secrets.compare_digest(got, b"Bearer " + self.api_key.encode()):
            raise GuardError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")

    def check_length(self, length: int | str | bytes | None) -> None:
        """Raise a 413 :class:`GuardError` when ``length`` (bytes, or a declared ``Content-Length``; a value that
        is no number is left to the body's own count) is over ``max_body_bytes``."""
        if isinstance(length, (str, bytes)):
            length = int(length) if length.isdigit() else None
        if length is not None and length > self.max_body_bytes:
            raise GuardError(413, f"request body of {length} bytes exceeds the size limit; the limit is "
                                  f"{self.max_body_bytes} (max_body_bytes)")

    async def read_body(self, chunks: AsyncIterator[bytes], content_length: str | bytes | None = None) -> bytes:
        """The body from ``chunks`` (after :meth:`check_length` of the declared length), refused with a 413
        :class:`GuardError` as soon as it passes ``max_body_bytes``."""
        self.check_length(content_length)
        parts, n = [], 0
        async for chunk in chunks:
            n += len(chunk)
            if n > self.max_body_bytes:
                raise GuardError(413, f"request body exceeds the size limit (over {self.max_body_bytes} bytes "
                                      f"sent); the limit is {self.max_body_bytes} (max_body_bytes)")
            parts.append(chunk)
        return b"".join(parts)

    def parse_json(self, body: bytes | str) -> Any:
        """``body`` as JSON, or a 400 :class:`GuardError` saying why not (see the module docstring)."""
        try:
            obj = json.loads(body, parse_int=self._int)
        except GuardError:
            raise
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise GuardError(400, f"request body is not valid JSON ({e})") from None
        except RecursionError:  # valid JSON nested deeper than the decoder's recursion limit ([[[...]]])
            raise GuardError(400, self._too_deep()) from None
        if _depth_over(obj, self.max_depth, body):
            raise GuardError(400, self._too_deep())
        return obj

    def parse_object(self, body: bytes | str, what: str = "") -> dict[str, Any]:
        """:meth:`parse_json` of a body that must be a JSON object (``what`` ends the error: ``" with
        'queries'"``)."""
        obj = self.parse_json(body)
        if not isinstance(obj, dict):
            raise GuardError(400, f"request body must be a JSON object{what}")
        return obj

    async def read_json(self, request: Any) -> dict[str, Any]:
        """The JSON object of a Starlette/FastAPI ``request``: :meth:`read_body` of its stream within
        ``max_body_bytes``, then :meth:`parse_object`."""
        body = await self.read_body(request.stream(), request.headers.get("content-length"))
        return self.parse_object(body)

    def _int(self, digits: str) -> int:
        n = len(digits.lstrip("-"))
        if n > self.max_int_digits:
            raise GuardError(400, f"request body is not valid JSON for this server: an integer of {n} digits; the "
                                  f"limit is {self.max_int_digits} digits (max_int_digits)")
        return int(digits)

    def _too_deep(self) -> str:
        return f"request body is JSON nested too deeply (the limit is {self.max_depth} levels)"


async def asgi_body(receive: Any) -> AsyncIterator[bytes]:
    """The body chunks of a plain ASGI request; a 400 :class:`GuardError` when the client disconnects first."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise GuardError(400, "client disconnected before sending the whole body")
        yield msg.get("body", b"")
        if not msg.get("more_body", False):
            return


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) among an ASGI scope's ``headers``, or ``None``."""
    for key, value in headers:
        if key == name:
            return value
    return None


def _depth_over(obj: Any, limit: int, body: bytes | str) -> bool:
    """Whether ``obj`` nests arrays and objects more than ``limit`` deep (``[]`` is one level). A body with no
    more than ``limit`` brackets and braces cannot (the common case: counted in C, no walk)."""
    opening = (b"[", b"{") if isinstance(body, bytes) else ("[", "{")
    if not isinstance(obj, (dict, list)) or body.count(opening[0]) + body.count(opening[1]) <= limit:
        return False
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
