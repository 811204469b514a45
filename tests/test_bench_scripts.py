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

