"""Make ``docs/serve_page.png``: the page of ``sleuth serve`` answering a HotpotQA question of the shipped
sample, in headless Chromium (Debian's ``chromium``; Playwright's Python package drives it).

The server is the real app (:func:`agent.serve.app.create_app`) over a BM25 index of the sample corpus; the
policy is scripted (the three turns below, in the Search-R1 format a trained model writes), so the picture
shows the page rather than what an untrained tiny model would say. Run from the repository root:

    python docs/serve_page_screenshot.py [--out docs/serve_page.png] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

QUESTION_ID = "5a8e3ea95542995a26add48d"  # the director of "Big Stone Gap" ... what New York city?
TURNS = [
    "The question needs the director of the film first. <search> Big Stone Gap film director </search>",
    ("Big Stone Gap was written and directed by Adriana Trigiani. Where is she based? "
     "<search> Adriana Trigiani based </search>"),
    "Adriana Trigiani is based in Greenwich Village, New York City. <answer> Greenwich Village, New York City </answer>",
]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class ScriptedPolicy:
    """Plays :data:`TURNS` in order: the turn is the number of tool results (``<information>``) in the prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        from agent.llm import Generation, decode, encode

        out = []
        for p in prompts:
            text = TURNS[min(decode(self.tokenizer, p).count("<information>"), len(TURNS) - 1)]
            out.append(Generation(encode(self.tokenizer, text), text, "stop"))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/serve_page.png")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--width", type=int, default=1000)
    args = ap.parse_args()

    import uvicorn
    from PIL import Image
    from playwright.sync_api import sync_playwright
    from transformers import AutoTokenizer

    from agent.serve.app import create_app
    from corpora.formats import read_corpus
    from retrieval.index import build_index, load_retriever
    from sleuth.config import AgentConfig, TinyPolicyConfig
    from training.model.tiny import create_tiny_policy

    sample = Path("corpora/sample")
    example = next(q for q in map(json.loads, (sample / "test.jsonl").open()) if q["id"] == QUESTION_ID)
    tmp = Path(tempfile.mkdtemp())
    build_index(sample / "corpus.jsonl", tmp / "index", build_dense=False, show_progress=False)
    # a byte-level BPE tokenizer of the sample (the policy itself is scripted)
    tiny = create_tiny_policy(tmp / "tiny", list(read_corpus(sample / "corpus.jsonl")), [],
                              TinyPolicyConfig(vocab_size=2000, hidden_size=32, num_layers=1, num_heads=2,
                                               num_kv_heads=1, intermediate_size=64), seed=0)
    app = create_app(ScriptedPolicy(AutoTokenizer.from_pretrained(str(tiny))), load_retriever(tmp / "index", "bm25"),
                     AgentConfig(max_doc_chars=400), top_k=3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/")
            page.locator("#settings summary").click()
            page.locator("#golds").fill(example["golden_answers"][0])
            page.locator("#settings summary").click()
            page.locator("#question").fill(example["question"])
            page.keyboard.press("Enter")
            page.locator("#verdict").wait_for()
            page.locator("#question").blur()
            page.screenshot(path=str(tmp / "page.png"), full_page=True)
            browser.close()
    finally:
        server.should_exit = True
    # a 64-colour palette keeps the text sharp and the file small
    Image.open(tmp / "page.png").convert("RGB").quantize(64).save(args.out, optimize=True)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
