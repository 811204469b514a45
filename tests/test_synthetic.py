"""The synthetic multi-hop task: deterministic, no entity shared between questions, h-hop questions need h
searches, and the chain oracle solves every question through the real agent loop."""

from __future__ import annotations

from corpora.synthetic import SPEC, SyntheticSpec, generate, write


def test_deterministic_and_disjoint():
    p1, tr1, te1 = generate()
    _p2, tr2, te2 = generate()
    assert [q.to_json() for q in tr1 + te1] == [q.to_json() for q in tr2 + te2]
    assert len(tr1) == SPEC.n_train and len(te1) == SPEC.n_test
    seen: set[str] = set()
    for q in tr1 + te1:
        ents = {e.lower() for e in q.metadata["chain"]}
        assert not ents & seen, "an entity is shared between questions"
        seen |= ents
        assert len(q.metadata["supporting_ids"]) == q.metadata["hops"] == len(q.metadata["chain"]) - 1
    assert {q.metadata["hops"] for q in te1} == {1, 2, 3}
    by_id = {p.id: p for p in p1}
    for q in tr1[:30]:
        chain = q.metadata["chain"]
        for j, pid in enumerate(q.metadata["supporting_ids"]):
            assert by_id[pid].title == chain[j] and chain[j + 1] in by_id[pid].contents
        assert q.question.count(chain[0]) == 1 and chain[1] not in q.question


def test_chain_oracle_solves_with_exactly_h_searches(tmp_path, tiny_llm):
    from agent.loop.batch import run_episodes
    from corpora import read_qa
    from retrieval.index import build_index, load_retriever
    from sleuth.config import AgentConfig
    from training.rollout.oracle import ChainOracleLLM

    paths = write(tmp_path, SyntheticSpec(n_train=12, n_test=3))
    build_index(paths["corpus"], tmp_path / "idx", build_dense=False, show_progress=False)
    qs = read_qa(paths["train"])
    cfg = AgentConfig(max_turns=4, max_new_tokens=16, max_total_tokens=400, max_obs_tokens=80, max_doc_chars=80,
                      chat_template="off")
    trajs = run_episodes(qs, ChainOracleLLM(tiny_llm.tokenizer, qs), load_retriever(tmp_path / "idx"), cfg,
                         top_k=1, temperature=0.0)
    for q, t in zip(qs, trajs, strict=True):
        assert t.verdict["em"] == 1.0, t.turns
        assert t.num_search_calls == q.metadata["hops"]


def test_v2_four_hops_only_in_test_and_every_hop_needs_the_previous_result():
    from collections import Counter

    from corpora.synthetic import SPEC_V2, generate_v2

    passages, train, test = generate_v2()
    assert [q.to_json() for q in train + test] == [q.to_json() for q in generate_v2()[1] + generate_v2()[2]]
    assert Counter(q.metadata["hops"] for q in train) == {1: 80, 2: 80, 3: 80}
    assert Counter(q.metadata["hops"] for q in test) == {h: SPEC_V2.n_test // 4 for h in (1, 2, 3, 4)}
    assert len({q.metadata["hops"] for q in test[:12]}) > 1  # classes mixed, not in blocks
    by_id = {p.id: p for p in passages}
    mentions: dict[str, list[str]] = {}  # entity -> ids of the passages whose text names it
    for p in passages:
        for w in p.contents.replace(".", " ").split():
            mentions.setdefault(w, []).append(p.id)
    for q in train + test:
        chain, ids, h = q.metadata["chain"], q.metadata["supporting_ids"], q.metadata["hops"]
        assert len(chain) == h + 1 and len(ids) == h and q.golden_answers == [chain[-1]]
        assert q.question.startswith("Where") == (h == 1) and chain[1] not in q.question
        for j in range(1, h + 1):  # entity j is named by passage j-1 (the previous result) and its own only
            assert set(mentions[chain[j]]) <= {ids[j - 1], *(ids[j:j + 1])}
        last = by_id[ids[-1]].contents
        assert ("uses the" in last) == (h > 1) and all("lies in" in by_id[i].contents for i in ids[1:-1])


def test_v2_chain_oracle_solves_four_hops_with_four_searches(tmp_path, tiny_llm):
    from agent.loop.batch import run_episodes
    from corpora import read_qa
    from corpora.synthetic import SyntheticSpecV2
    from retrieval.index import build_index, load_retriever
    from sleuth.config import AgentConfig
    from training.rollout.oracle import ChainOracleLLM

    paths = write(tmp_path, SyntheticSpecV2(n_train=6, n_test=8))
    build_index(paths["corpus"], tmp_path / "idx", build_dense=False, show_progress=False)
    qs = read_qa(paths["test"])
    assert {q.metadata["hops"] for q in qs} == {1, 2, 3, 4}
    cfg = AgentConfig(max_turns=6, max_new_tokens=16, max_total_tokens=500, max_obs_tokens=80, max_doc_chars=80,
                      chat_template="off")
    trajs = run_episodes(qs, ChainOracleLLM(tiny_llm.tokenizer, qs), load_retriever(tmp_path / "idx"), cfg,
                         top_k=1, temperature=0.0)
    for q, t in zip(qs, trajs, strict=True):
        assert t.verdict["em"] == 1.0 and t.num_search_calls == q.metadata["hops"], t.turns
