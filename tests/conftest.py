"""Shared fixtures: a tiny corpus, a BM25 index over it, and a tiny Qwen2 policy with a local tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The development machines keep a mirror of the real benchmark files beside the checkout: the tests that read
# real data (SLEUTH_DATA_DIR) use it when it is there and nothing else names a data dir; elsewhere they read
# what `sleuth data get` fetched into the user's cache, and skip the checks that need the real files.
_MIRROR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not os.environ.get("SLEUTH_DATA_DIR") and _MIRROR.is_dir():
    os.environ["SLEUTH_DATA_DIR"] = str(_MIRROR)

import pytest

from corpora.formats import Passage, QAExample, write_jsonl

PASSAGES = [
    Passage.make("p0", "Paris", "Paris is the capital and most populous city of France."),
    Passage.make("p1", "Berlin", "Berlin is the capital and largest city of Germany."),
    Passage.make("p2", "Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, designed by Gustave Eiffel."),
    Passage.make("p3", "Gustave Eiffel", "Gustave Eiffel was a French civil engineer born in Dijon."),
    Passage.make("p4", "Dijon", "Dijon is a city in eastern France, famous for its mustard."),
    Passage.make("p5", "Rhine", "The Rhine is a river that flows through Germany and the Netherlands."),
]
QUESTIONS = [
    QAExample("q0", "What is the capital of France?", ["Paris"], {"supporting_ids": ["p0"], "hops": 1}),
    QAExample("q1", "Where was the designer of the Eiffel Tower born?", ["Dijon"], {"supporting_ids": ["p2", "p3"], "hops": 2}),
    QAExample("q2", "What is the capital of Germany?", ["Berlin"], {"supporting_ids": ["p1"], "hops": 1}),
    QAExample("q3", "Which river flows through Germany?", ["the Rhine", "Rhine"], {"supporting_ids": ["p5"], "hops": 1}),
]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_jsonl(d / "corpus.jsonl", PASSAGES)
    write_jsonl(d / "train.jsonl", QUESTIONS)
    write_jsonl(d / "test.jsonl", QUESTIONS[:2])
    return d


@pytest.fixture(scope="session")
def bm25_index(tiny_data, tmp_path_factory):
    from retrieval.index import build_index

    out = tmp_path_factory.mktemp("index")
    build_index(tiny_data / "corpus.jsonl", out, build_dense=False, show_progress=False)
    return out


@pytest.fixture(scope="session")
def retriever(bm25_index):
    from retrieval.index import load_retriever

    return load_retriever(bm25_index, "bm25")


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A 1-layer Qwen2 with a BPE tokenizer trained on the fixture texts (built in about a second)."""
    from sleuth.config import TinyPolicyConfig
    from training.model.tiny import create_tiny_policy

    cfg = TinyPolicyConfig(vocab_size=400, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, max_position_embeddings=1024)
    out = tmp_path_factory.mktemp("tiny")
    return create_tiny_policy(out, PASSAGES, QUESTIONS, cfg, seed=0)


@pytest.fixture()
def tiny_llm(tiny_policy_dir):
    from agent.backends.hf import TransformersLLM

    return TransformersLLM.from_pretrained(str(tiny_policy_dir))


@pytest.fixture()
def tok(tiny_policy_dir):
    """The tiny policy's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_policy_dir))


@pytest.fixture()
def agent_cfg():
    from sleuth.config import AgentConfig

    return AgentConfig(max_turns=3, max_new_tokens=24, max_total_tokens=512, max_obs_tokens=160, max_doc_chars=200)


def run_rl(cfg, model, tokenizer, retriever, questions, run_dir, **kw):
    """:func:`training.trainer.rl_train` with the sections of a whole run config, as the composition root
    (``sleuth.pipeline.run_rl_stage``) passes them. Looked up on the module, so a test may patch it."""
    import training.trainer as T

    return T.rl_train(cfg.train, cfg.agent, model, tokenizer, retriever, questions, run_dir, seed=cfg.seed,
                      top_k=cfg.retrieval.top_k, **kw)
