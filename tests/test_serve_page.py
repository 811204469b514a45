"""The browser page of ``sleuth serve`` in real Chromium (Debian's ``chromium`` package, driven by Playwright's
Python API; no browser is downloaded).

``sleuth serve`` runs as a subprocess on 127.0.0.1 (a free port) with ``--api-key``, the tiny policy's
tokenizer and a scripted policy behind an OpenAI-compatible backend (``agent.backend.kind=openai``), over a
BM25 index of the test passages plus one passage that carries ``<script>`` and ``<img onerror>``. The
tests type like a user (keyboard first) and read what the page shows, at 375 px and 1280 px widths."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest

from corpora.formats import Passage, write_jsonl
from tests.conftest import PASSAGES
from tests.test_agent_fakes import ScriptLLM, ServerThread, fake_openai_completions_app

CHROMIUM = os.environ.get("SLEUTH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "page-test-key"
WIDTHS = [375, 1280]
INJECTED = Passage.make(
    "evil", 'Xylophone <script>window.__pwned = "title"</script>',
    'Xylophone facts. <script>window.__pwned = "script"</script> <img src=x onerror="window.__pwned = \'img\'">'
    ' <b onmouseover="window.__pwned = \'b\'">bold</b>')
SCRIPTS = {
    "capital of France": ["<search> capital of France </search>", "<answer> Paris </answer>"],
    "slow question": ["<search> Gustave Eiffel </search>", "<answer> Dijon </answer>"],
    "xylophone": ["<search> Xylophone facts </search>",
                  '<answer> <img src=x onerror="window.__pwned=1"> </answer>'],
}


class HoldingLLM(ScriptLLM):
    """The scripted policy; a "slow question" waits in its second turn until ``release`` is set (10 s at
    most), so that a test can stop the episode while it runs."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release, self.held = threading.Event(), threading.Event()

    def generate(self, prompts, params):
        from agent.llm import decode

        for p in prompts:
            text = decode(self.tokenizer, p)
            if "slow question" in text and self.marker in text:
                self.held.set()
                self.release.wait(10)
        return super().generate(prompts, params)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium, headless. Missing, the test fails saying how to install it (never a silent skip:
    `make test` installs it first)."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(f"no Chromium at {CHROMIUM}: the browser tests need Debian's chromium package "
                    "(`make chromium`, which `make test` runs, or `apt-get install -y chromium`; "
                    "SLEUTH_CHROMIUM names another binary)", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need Playwright's Python package: pip install -e '.[dev]' "
                    "(never `playwright install`: the tests drive the system's Chromium)", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    from transformers import AutoTokenizer

    llm = HoldingLLM(AutoTokenizer.from_pretrained(str(tiny_policy_dir)), SCRIPTS)
    yield llm
    llm.release.set()


@pytest.fixture(scope="module")
def sleuth_serve(policy, tiny_policy_dir, tmp_path_factory):
    """``sleuth serve`` in a subprocess, its policy a scripted OpenAI-compatible server; yields its URL."""
    from retrieval.index import build_index

    d = tmp_path_factory.mktemp("page")
    write_jsonl(d / "corpus.jsonl", [*PASSAGES, INJECTED])
    build_index(d / "corpus.jsonl", d / "index", build_dense=False, show_progress=False)
    with ServerThread(fake_openai_completions_app(policy, {})) as backend, open(d / "serve.log", "w") as log:
        port = _free_port()
        cmd = [sys.executable, "-m", "sleuth.cli", "serve", "--model", str(tiny_policy_dir), "--index",
               str(d / "index"), "--port", str(port), "--api-key", KEY, "--timeout", "30",
               "agent.backend.kind=openai", f"agent.backend.base_url={backend.url}/v1", "agent.max_turns=3",
               "retrieval.top_k=2", f"out_dir={d / 'run'}"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"sleuth serve did not start:\n{(d / 'serve.log').read_text()[-3000:]}")
                try:
                    if httpx2.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                time.sleep(0.2)
            yield url
        finally:
            policy.release.set()
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=WIDTHS, ids=[f"{w}px" for w in WIDTHS])
def page(request, browser, sleuth_serve):
    """A fresh tab (its own sessionStorage) on the page, ``request.param`` px wide; fails the test on any
    error the page's script raises."""
    ctx = browser.new_context(viewport={"width": request.param, "height": 900})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(sleuth_serve + "/")
    pg.width = request.param
    yield pg
    ctx.close()
    assert not errors, errors


def _enter_key(pg, key: str = KEY) -> None:
    """The page found that the server wants a key: the key field shows; type the key into it."""
    box = pg.locator("#api-key")
    box.wait_for(state="visible", timeout=10_000)
    box.fill(key)


def _ask(pg, question: str) -> None:
    """Type the question and press Enter, keyboard only."""
    pg.locator("#question").focus()
    pg.keyboard.type(question)
    pg.keyboard.press("Enter")


def _fits(pg) -> None:
    """Nothing is wider than the window (no sideways scrolling)."""
    assert pg.evaluate("document.documentElement.scrollWidth") <= pg.width


def test_the_page_shows_turns_searches_passages_then_the_answer(page):
    _enter_key(page)
    _ask(page, "What is the capital of France?")
    page.locator("#answer").get_by_text("Paris").wait_for(timeout=20_000)
    steps = page.locator("#steps > li")
    assert [steps.nth(i).get_attribute("data-kind") for i in range(steps.count())] == ["turn", "search", "turn"]
    assert "Turn 1" in steps.nth(0).inner_text() and "<search> capital of France </search>" in steps.nth(0).inner_text()
    search = steps.nth(1)
    assert search.locator(".query").inner_text() == "capital of France"
    passages = search.locator(".passage")
    assert passages.count() == 2  # retrieval.top_k=2
    first = passages.nth(0)
    assert first.locator(".title").inner_text() == "Paris" and first.locator(".id").inner_text() == "p0"
    assert "capital and most populous city of France" in first.locator(".text").inner_text()
    assert first.locator(".score").inner_text().startswith("score ")
    assert "<answer> Paris </answer>" in steps.nth(2).inner_text()
    # the answer comes after the steps, with its evidence
    order = page.evaluate("""() => {
        const s = document.querySelector('#steps'), a = document.querySelector('#answer-box');
        return s.compareDocumentPosition(a) & Node.DOCUMENT_POSITION_FOLLOWING; }""")
    assert order
    assert page.locator("#evidence .passage .id").first.inner_text() == "p0"
    assert "answered" in page.locator("#stop-reason").inner_text()
    assert page.locator("#status").inner_text() == "Answered."
    assert page.locator("#history li").first.inner_text().startswith("What is the capital of France?")
    for sel in ("#question", "#ask", "#answer", "#steps"):
        box = page.locator(sel).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= page.width, sel
    _fits(page)


def test_settings_and_the_judges_verdict_reach_the_server(page):
    _enter_key(page)
    page.locator("#settings summary").click()
    top_k = page.locator("#top-k")
    assert top_k.get_attribute("max") == "20" and top_k.input_value() == "2"  # from /health's limits
    assert page.locator("#max-turns").get_attribute("max") == "3"
    top_k.fill("1")
    page.locator("#golds").fill("Paris")
    _ask(page, "What is the capital of France?")
    page.locator("#verdict").wait_for(timeout=20_000)
    assert page.locator(".step.search .passage").count() == 1
    verdict = dict(zip(page.locator("#verdict dt").all_inner_texts(), page.locator("#verdict dd").all_inner_texts(),
                       strict=True))
    assert verdict["em"] == "1" and verdict["f1"] == "1"
    # one turn only: the episode ends at the turn limit, without an answer
    page.locator("#max-turns").fill("1")
    _ask(page, " again")  # typed after the question still in the box: a new question
    page.locator("#stop-reason").get_by_text("turn limit").wait_for(timeout=20_000)
    assert page.locator("#steps > li").count() == 1 and page.locator("#answer").inner_text() == "(no answer)"
    # the last questions of the session, newest first
    assert page.locator("#history button").all_inner_texts()[:2] == ["What is the capital of France? again",
                                                                      "What is the capital of France?"]
    _fits(page)


def test_stop_cancels_the_episode_on_the_server(page, sleuth_serve, policy):
    policy.release.clear()
    policy.held.clear()
    _enter_key(page)
    _ask(page, "A slow question about the tower?")
    page.locator(".step.search").wait_for(timeout=20_000)  # the first turn and its search are shown
    assert policy.held.wait(10)  # the second turn is being generated (and held)
    assert httpx2.get(sleuth_serve + "/health").json()["inflight"] == 1
    assert page.locator("#stop").is_enabled()
    page.keyboard.press("Escape")
    page.locator("#status").get_by_text("Stopped").wait_for(timeout=5_000)
    deadline = time.time() + 5
    while httpx2.get(sleuth_serve + "/health").json()["inflight"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx2.get(sleuth_serve + "/health").json()["inflight"] == 0  # cancelled while its backend is held
    assert not policy.release.is_set()
    policy.release.set()
    assert page.locator("#answer-box").is_hidden() and page.locator("#stop").is_disabled()
    assert page.evaluate("document.activeElement.id") == "question"
    # the stop button does it too
    policy.release.clear()
    policy.held.clear()
    _ask(page, " again")
    assert policy.held.wait(10)
    page.locator("#stop").click()
    page.locator("#status").get_by_text("Stopped").wait_for(timeout=5_000)
    deadline = time.time() + 5
    while httpx2.get(sleuth_serve + "/health").json()["inflight"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx2.get(sleuth_serve + "/health").json()["inflight"] == 0
    policy.release.set()
    _fits(page)


def test_html_in_passages_and_answers_stays_inert_text(page):
    _enter_key(page)
    _ask(page, "Tell me about the xylophone?")
    page.locator("#answer-box").wait_for(timeout=20_000)
    page.wait_for_timeout(300)  # an image error handler would have run by now
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0 and page.locator("b").count() == 0
    assert page.locator("script").count() == 1  # the page's own app.js
    passage = page.locator(".step.search .passage").first
    assert passage.locator(".id").inner_text() == "evil"
    assert '<script>window.__pwned = "title"</script>' in passage.locator(".title").inner_text()
    assert '<img src=x onerror="window.__pwned = \'img\'">' in passage.locator(".text").inner_text()
    assert page.locator("#answer").inner_text() == '<img src=x onerror="window.__pwned=1">'
    _fits(page)


def test_a_wrong_api_key_shows_an_error_then_the_right_one_works(page):
    page.locator("#api-key").wait_for(state="visible", timeout=10_000)  # the server answered 401 to its probe
    _enter_key(page, "not-the-key")
    _ask(page, "What is the capital of France?")
    error = page.locator("#error")
    error.wait_for(state="visible", timeout=10_000)
    assert "401" in error.inner_text() and "API key" in error.inner_text()
    assert page.evaluate("document.activeElement.id") == "api-key"  # the key field, to correct it
    page.keyboard.type(KEY)  # the wrong key is selected: typing replaces it
    page.locator("#question").focus()
    page.keyboard.press("Enter")
    page.locator("#answer").get_by_text("Paris").wait_for(timeout=20_000)
    assert error.is_hidden()
    # the key lives in this tab's sessionStorage only, and is back after a reload
    assert page.evaluate("sessionStorage.getItem('sleuth.apiKey')") == KEY
    assert page.evaluate("localStorage.length") == 0
    page.reload()
    assert page.locator("#api-key").input_value() == KEY


def test_keyboard_alone_reaches_every_control_in_order(page):
    _enter_key(page)
    page.locator("#api-key").focus()

    def tab(n: int = 1) -> list[str]:
        out = []
        for _ in range(n):
            page.keyboard.press("Tab")
            out.append(page.evaluate("document.activeElement.id || document.activeElement.tagName"))
        return out

    assert tab(3) == ["question", "ask", "SUMMARY"]  # the stop button is skipped while nothing runs
    page.keyboard.press("Enter")  # opens the settings; their fields follow the summary
    assert tab(3) == ["top-k", "max-turns", "golds"]
    for label in ("API key", "Question", "Passages per search (top-k)", "Most turns", "Expected answers (optional)"):
        assert page.get_by_label(label, exact=True).count() == 1, label
    assert page.locator("#status").get_attribute("aria-live") == "polite"
    assert page.locator("#error").get_attribute("role") == "alert"


def test_the_page_and_its_files_need_no_key_and_forbid_inline_script(sleuth_serve):
    r = httpx2.get(sleuth_serve + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert '<script src="static/app.js"' in r.text
    for name, ctype in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx2.get(f"{sleuth_serve}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), name
    for name in ("nope.js", "index.html", "..%2Fserver.py"):
        r = httpx2.get(f"{sleuth_serve}/static/{name}")
        assert r.status_code == 404 and r.json()["error"]["message"], name
    assert httpx2.post(sleuth_serve + "/ask", json={"question": "q"}).status_code == 401  # the API still wants it


def test_the_script_never_writes_html():
    """Every text the page shows goes through textContent; no API that parses HTML appears in its script."""
    js = (Path(__file__).parents[1] / "agent" / "serve" / "static" / "app.js").read_text()
    for api in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "eval(",
                "new Function"):
        assert api not in js, api


def test_chromium_is_installed_by_make():
    """`make test` installs Debian's chromium before the tests when it is missing (the browser tests fail
    without it)."""
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "chromium:" in makefile and "apt-get install -y" in makefile
    test_rule = next(line for line in makefile.splitlines() if line.startswith("test:"))
    assert "chromium" in test_rule
