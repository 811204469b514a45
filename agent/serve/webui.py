"""The browser page of ``sleuth serve``: ``GET /`` and its script and style sheet, shipped in the package
(``agent/serve/static``: plain HTML, CSS and JavaScript, no build step and no CDN, so a server with no
internet serves it whole).

The page asks its question over the streaming ``/v1/chat/completions`` (see :mod:`agent.serve.app`) and shows
each turn's reasoning, each search with its passages, the answer, its evidence and any verdict as they
arrive; a stop button (or Escape) aborts the request, which cancels the episode on the server. Everything
retrieved or generated is put on the page as text (``textContent``), never parsed as HTML: corpora come
from the web. The page is sent with a Content-Security-Policy that allows scripts and styles from this
server alone (no inline script, no event-handler attribute) as a second wall.

The page and its files need no API key (they hold no data); the page asks for the key when the server
answers 401 and keeps it in the tab's ``sessionStorage`` only.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException

PAGE_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
              "style.css": "text/css; charset=utf-8"}
"""The page's files in ``agent/serve/static`` and their media types; ``index.html`` is ``GET /``, the others
``GET /static/<name>``."""

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""The page's Content-Security-Policy: its own script, style sheet and API only (``data:`` for the empty
favicon)."""

HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def page_files() -> dict[str, bytes]:
    """The bytes of each of :data:`PAGE_FILES`, read from the installed package. Raises
    ``FileNotFoundError`` when one is missing (a package built without its package data)."""
    root = resources.files("agent.serve") / "static"
    return {name: (root / name).read_bytes() for name in PAGE_FILES}


def add_page_routes(app: FastAPI) -> None:
    """Add ``GET /`` (the page) and ``GET /static/{name}`` (its files; any other name is a 404) to ``app``.
    The files are read once, here: a missing one fails the server's start, not each request."""
    files = page_files()

    def send(name: str) -> Response:
        return Response(files[name], media_type=PAGE_FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def page():
        return send("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name == "index.html" or name not in files:
            raise HTTPException(404, f"no page file {name!r}")
        return send(name)
