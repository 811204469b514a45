"""One plugin file adds a toy of every pluggable kind (a retriever, an LLM backend, a tool protocol, an
evaluation method, an advantage estimator, a policy loss) through the registries, and each runs through the
command line: no edit to Sleuth, only the config's ``plugins``."""

from __future__ import annotations

import json
import textwrap

import pytest

from corpora.formats import QAExample, write_jsonl

TOY_PLUGIN = '''
import torch

from agent.backends.build import register_backend
from agent.llm import Generation, decode, encode
from agent.protocols.build import register_protocol
from agent.protocols.search_r1 import SearchR1
from eval.methods import register_eval_method
from eval.prompting import prediction_record
from retrieval.base import Hit, check_queries
from retrieval.registry import register_retriever
from training.algos.estimators import register_outcome_adv_est
from training.algos.losses import register_policy_loss

TOY_HIT = Hit("toy0", "Toyland", "Toyland\\nToyland is where the toys live.", 7.0)


class ToyRetriever:
    def search(self, queries, k):
        check_queries(queries, k)
        return [[TOY_HIT] if "toy" in q.lower() else [] for q in queries]


@register_retriever("toy_retriever", description="finds Toyland for any query about toys")
def open_toy(req):
    return ToyRetriever()


class ToyLLM:
    """Searches for toys, then answers with the first line of what it read; says so when the prompt is not
    the toy protocol's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = decode(self.tokenizer, p)
            if "[toy]" not in text:
                reply = "<answer> not the toy protocol </answer>"
            elif "<information>" not in text:
                reply = "<search> toys </search>"
            else:
                reply = "<answer> " + ("Toyland" if "Toyland" in text else "nothing found") + " </answer>"
            ids = encode(self.tokenizer, reply)[: params.max_new_tokens]
            out.append(Generation(ids, decode(self.tokenizer, ids), "stop"))
        return out


@register_backend("toy_backend", description="a scripted toy")
def make_toy(backend_cfg, model_path, dtype, device, seed):
    from transformers import AutoTokenizer

    return ToyLLM(AutoTokenizer.from_pretrained(model_path))


@register_protocol("toy_protocol", tags=True, description="Search-R1 tags behind a [toy] prompt")
class ToyProtocol(SearchR1):
    def prompt_ids(self, question):
        return super().prompt_ids("[toy] " + question)


@register_eval_method("toy_method", description="answers with the title of the first hit")
def toy_method(examples, ctx):
    hits = ctx.retriever.search([ex.question for ex in examples], ctx.top_k)
    return [prediction_record(ex, hs[0].title if hs else None, retrieved_ids=[h.id for h in hs], search_calls=1)
            for ex, hs in zip(examples, hits)]


@register_outcome_adv_est("toy_estimator", groups=False)
def toy_estimator(rewards, groups, search_calls, opts):
    return torch.full_like(rewards, 0.5)


@register_policy_loss("toy_loss")
def toy_loss(logprobs, old_logprobs, advantages, mask, cfg):
    ratio = torch.exp(logprobs - old_logprobs)
    return -advantages * ratio, {"toy_ratio_max": float((ratio * mask).detach().max())}
'''

TOYS = [QAExample("t0", "Where do the toys live?", ["Toyland"]), QAExample("t1", "Which land has toys?", ["Toyland"])]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plugin file, one path for the module's tests (a module is imported once per path and process); the
    registries are as before once they are done, so no other test sees the toys."""
    import sys

    from agent.backends.build import BACKENDS
    from agent.protocols.build import PROTOCOLS
    from eval.methods import EVAL_METHODS
    from retrieval.registry import RETRIEVERS
    from training.algos.estimators import ADV_ESTIMATORS
    from training.algos.losses import POLICY_LOSSES

    registries = (RETRIEVERS, BACKENDS, PROTOCOLS, EVAL_METHODS, ADV_ESTIMATORS, POLICY_LOSSES)
    before = [dict(r._entries) for r in registries]
    modules = set(sys.modules)
    path = tmp_path_factory.mktemp("plugins") / "toy_plugins.py"
    path.write_text(textwrap.dedent(TOY_PLUGIN))
    yield path
    for registry, entries in zip(registries, before):
        registry._entries = entries
    for name in set(sys.modules) - modules:
        if name.startswith("sleuth_plugin_toy_plugins"):
            del sys.modules[name]


def sleuth(capsys, *argv) -> tuple[int, str, str]:
    from sleuth.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_toy_retriever_backend_protocol_and_method_run_through_the_cli(plugin, tmp_path, tiny_policy_dir, capsys):
    qa = tmp_path / "toys.jsonl"
    write_jsonl(qa, TOYS)
    toys = [f"plugins=[{plugin}]", "retrieval.method=toy_retriever", f"out_dir={tmp_path / 'run'}",
            f"policy.model={tiny_policy_dir}"]

    # the retriever: `sleuth search` (a --set override names the plugin, as a config file's plugins would)
    code, out, err = sleuth(capsys, "search", "--set", f"plugins=[{plugin}]", "--method", "toy_retriever", "--json",
                            "-k", "2", "about toys")
    assert code == 0, err
    assert [json.loads(line) for line in out.splitlines()] == [
        {"id": "toy0", "title": "Toyland", "contents": "Toyland\nToyland is where the toys live.", "score": 7.0}]

    # the backend and the protocol (and the retriever): `sleuth ask`
    code, out, err = sleuth(capsys, "ask", "Where do the toys live?", *toys, "agent.backend.kind=toy_backend",
                            "agent.protocol=toy_protocol")
    assert code == 0, err
    assert "answer: 'Toyland'" in out and "1 searches" in out

    # the evaluation method (and the retriever), then the agent on the toy backend and protocol: `sleuth eval`
    for method, backend in (("toy_method", "transformers"), ("agent", "toy_backend")):
        code, out, err = sleuth(capsys, "eval", "--qa", qa, "--method", method, "--out", tmp_path / method, *toys,
                                f"agent.backend.kind={backend}", "agent.protocol=toy_protocol")
        assert code == 0, err
        (summary,) = [json.loads(p.read_text()) for p in (tmp_path / method).glob("*/summary.json")]
        (metrics,) = summary["benchmarks"].values()
        assert summary["method"] == method and metrics["n"] == 2 and metrics["em"] == 1.0
        assert metrics["search_calls"] == 1.0


def test_unknown_choices_name_the_registered_ones_and_the_closest(plugin, capsys):
    code, _, err = sleuth(capsys, "search", "--set", f"plugins=[{plugin}]", "--method", "toy_retreiver", "toys")
    assert code == 2 and "unknown retrieval method 'toy_retreiver'" in err and "did you mean 'toy_retriever'" in err
    assert "registered: bm25, dense, hybrid, lucene, simulated, self_search, mcp, web, toy_retriever" in err
    for key, value, kind, close in (("agent.backend.kind", "vlm", "LLM backend", "vllm"),
                                    ("agent.protocol", "search-r1", "tool protocol", "search_r1"),
                                    ("retrieval.method", "bm52", "retrieval method", "bm25")):
        code, _, err = sleuth(capsys, "ask", "q", f"{key}={value}")
        assert code == 2 and f"unknown {kind} '{value}' ({key})" in err and f"did you mean '{close}'" in err, err
    code, _, err = sleuth(capsys, "eval", "--method", "irkot")
    assert code == 2 and "unknown evaluation method 'irkot'" in err and "did you mean 'ircot'" in err


def test_a_toy_estimator_and_policy_loss_train_through_sleuth_train(plugin, tiny_data, tiny_policy_dir, tmp_path,
                                                                    capsys):
    out = tmp_path / "run"
    code, _, err = sleuth(capsys, "train", f"plugins=[{plugin}]", f"out_dir={out}", f"data.corpus={tiny_data / 'corpus.jsonl'}",
                          f"data.train={tiny_data / 'train.jsonl'}", f"data.test={tiny_data / 'test.jsonl'}",
                          "retrieval.method=toy_retriever", "agent.protocol=toy_protocol",
                          f"policy.model={tiny_policy_dir}", "sft.enabled=false", "train.algorithm.adv_estimator=toy_estimator",
                          "train.algorithm.policy_loss=toy_loss", "train.steps=1", "train.rollout.questions_per_step=2",
                          "train.rollout.group_size=2", "agent.max_new_tokens=8", "agent.max_total_tokens=256")
    assert code == 0, err
    (record,) = [json.loads(x) for x in (out / "toy_estimator" / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["adv_abs_mean"] == pytest.approx(0.5)  # the toy's constant advantage
    assert record["toy_ratio_max"] == pytest.approx(1.0, abs=1e-4)  # the toy loss ran (on-policy: ratio 1)


def test_the_built_in_entries_say_what_each_choice_needs():
    from agent.backends.build import BACKENDS
    from agent.protocols.build import PROTOCOLS
    from eval.methods import EVAL_METHODS
    from retrieval.registry import RETRIEVERS
    from sleuth.config import Config
    from sleuth.pipeline import check_rollout_backend, needs_index

    parts = {n: RETRIEVERS.get(n).index_parts for n in ("bm25", "dense", "hybrid", "lucene", "simulated", "self_search",
                                                        "mcp", "web")}
    assert parts == {"bm25": ("bm25",), "dense": ("dense",), "hybrid": ("bm25", "dense"), "lucene": ("lucene",),
                     "simulated": (), "self_search": (), "mcp": (), "web": ()}
    assert [n for n in parts if not RETRIEVERS.get(n).cached] == [n for n in parts if RETRIEVERS.get(n).generative] \
        == ["simulated", "self_search"]
    assert [(n, BACKENDS.get(n).rollout, BACKENDS.get(n).engine) for n in ("transformers", "vllm", "openai")] == [
        ("transformers", True, False), ("vllm", True, True), ("openai", False, False)]
    assert [n for n in ("search_r1", "function_call") if PROTOCOLS.get(n).tags] == ["search_r1"]
    assert {n: (e.retrieves, e.tags, e.episodes) for n in ("direct", "rag", "ircot", "agent", "search_o1")
            for e in [EVAL_METHODS.get(n)]} == {"direct": (False, False, False), "rag": (True, False, False),
                                                 "ircot": (True, False, False), "agent": (True, False, True),
                                                 "search_o1": (True, True, False)}
    with pytest.raises(ValueError, match="agent.backend.kind=openai cannot roll out for training.*"
                                         "agent.backend.kind=transformers or vllm"):
        check_rollout_backend(Config.model_validate({"agent": {"backend": {"kind": "openai"}}}))
    check_rollout_backend(Config())
    # an index is needed for an index method without a server in its place
    assert needs_index(Config()) and not needs_index(Config.model_validate({"retrieval": {"url": "http://h:1"}}))
    assert not needs_index(Config.model_validate({"retrieval": {"method": "web"}}))
    # the config schema's help says the registered names
    schema = Config.model_json_schema()["$defs"]
    assert "one of bm25, dense, hybrid, lucene, simulated, self_search, mcp, web" in \
        schema["RetrievalConfig"]["properties"]["method"]["description"]
    assert "one of transformers, vllm, openai" in schema["BackendConfig"]["properties"]["kind"]["description"]
