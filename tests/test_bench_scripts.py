"""The benchmark scripts' own logic (bench/*.py), without running a benchmark: what they time and what their
tables and JSON report."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    # bench/retrieval.py shares its name with the retrieval package: load it under another name
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rb():
    return _load("retrieval")


def test_retrieval_quality_search_time_excludes_the_first_call(rb, monkeypatch):
    calls = []

    class SlowFirst:  # the first search compiles (numba) / warms the encoder
        def search(self, queries, k):
            calls.append(len(queries))
            if len(calls) == 1:
                time.sleep(0.5)
            return [[] for _ in queries]

    monkeypatch.setattr(rb, "build_index", lambda *a, **kw: {"num_passages": 3, "dense": None})
    monkeypatch.setattr(rb, "load_retriever", lambda *a, **kw: SlowFirst())
    out: dict = {}
    rb.quality(argparse.Namespace(no_dense=True), out, None)
    assert calls[-1] == out["quality"]["questions"] == 400
    assert out["quality"]["bm25"]["search_s_all_questions"] < 0.4


def test_retrieval_latency_reports_its_sample_size(rb):
    s = rb._lat([0.01] * 39 + [0.5], 40 * 256)
    assert s["calls"] == 40 and s["p99_ms"] > 300  # of 40 calls, the p99 is (nearly) the slowest one
    row = {"passages": 10_000, "sleuth-maxscore_inproc_b1": rb._lat([0.001] * 200, 200),
           "sleuth-maxscore_inproc_b256": s}
    text = rb.table({"speed": [row]})
    assert "| 10,000 | sleuth-maxscore | inproc |" in text
    assert "200 calls at batch 1 and 40 at batch 256" in text and "fewer than 100" in text
