"""Sleuth's engine server (agent.serve.engine, in-process on 127.0.0.1): vLLM's completion format with token ids
in and out, prompt log-probs, identity, limits, and the RL weight-update routes (pause during an update, the
new version on every reply after it, an abandoned update refusing service instead of serving mixed weights)."""

from __future__ import annotations

import threading
import time

import httpx2
import pytest
import torch

from agent.backends.engine_protocol import tokenizer_fingerprint
from agent.backends.hf import TransformersLLM, sequence_logprobs
from agent.backends.openai import OpenAICompatibleLLM
from agent.llm import SamplingParams, encode
from agent.serve.engine import EngineLimits, EngineServer
from agent.serve.engine_weights import EngineWeights
from tests.conftest import QUESTIONS
from tests.test_agent_fakes import ServerThread


def make_engine(path, name="tiny", **kw):
    llm = TransformersLLM.from_pretrained(str(path), device="cpu")
    weights = kw.pop("weights_kw", None)
    return EngineServer(llm, name, weights=EngineWeights(llm.model, **weights) if weights else None, **kw)


@pytest.fixture()
def engine(tiny_policy_dir):
    srv = make_engine(tiny_policy_dir)
    with ServerThread(srv.app) as st:
        srv.url = st.url
        yield srv


def prompts_of(tok):
    return [encode(tok, f"Question: {q.question}\n") for q in QUESTIONS]


def test_completions_are_token_exact_greedy_and_carry_the_weight_version(engine, tiny_llm):
    client = OpenAICompatibleLLM(engine.url + "/v1", "tiny", tiny_llm.tokenizer, max_retries=0)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=("</search>", "</answer>"))
    got = client.generate(prompts_of(tiny_llm.tokenizer), params)
    want = tiny_llm.generate(prompts_of(tiny_llm.tokenizer), params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(g.meta == {"exact": True, "weight_version": 0} for g in got)
    for g, w in zip(got, want, strict=True):  # the sampled tokens' log-probs, as the backend reports them
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert engine.scheduler.stats["generate_batches"] < len(got)  # concurrent requests were batched


def test_prompt_logprobs_are_the_models_own(engine, tiny_llm):
    ids = prompts_of(tiny_llm.tokenizer)[1]
    r = httpx2.post(engine.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                          "temperature": 1.0, "prompt_logprobs": 0}).json()
    steps = r["choices"][0]["prompt_logprobs"]
    assert steps[0] is None and len(steps) == len(ids)
    got = [step[str(t)]["logprob"] for step, t in zip(steps[1:], ids[1:], strict=True)]
    assert got == pytest.approx(sequence_logprobs(tiny_llm.model, ids), abs=1e-6)


def test_identity_routes(engine, tiny_llm):
    (m,) = httpx2.get(engine.url + "/v1/models").json()["data"]
    assert (m["id"], m["max_model_len"], m["weight_version"]) == ("tiny", 1024, "0")
    assert m["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny_llm.tokenizer)
    r = httpx2.post(engine.url + "/tokenize", json={"prompt": "capital of France", "add_special_tokens": False})
    assert r.json()["tokens"] == encode(tiny_llm.tokenizer, "capital of France")
    h = httpx2.get(engine.url + "/health").json()
    assert h["status"] == "ok" and h["inflight"] == 0 and h["updating"] is False


def test_stop_string_is_left_out_unless_asked(engine, tiny_llm, monkeypatch):
    from agent.llm import Generation

    ids = encode(tiny_llm.tokenizer, "<search> Paris </search>")
    monkeypatch.setattr(engine.gated.llm, "generate", lambda prompts, params: [
        Generation(ids, "<search> Paris </search>", "stop", [-0.5] * len(ids)) for _ in prompts])
    body = {"prompt": [5, 6], "max_tokens": 8, "stop": ["</search>"], "logprobs": 1}
    plain = httpx2.post(engine.url + "/v1/completions", json=body).json()["choices"][0]
    kept = httpx2.post(engine.url + "/v1/completions", json={**body, "include_stop_str_in_output": True,
                                                             "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert plain["text"] == "<search> Paris " and plain["stop_reason"] == "</search>"
    assert kept["text"] == "<search> Paris </search>"
    assert kept["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]


@pytest.mark.parametrize(("body", "status", "match"), [
    ({"model": "other", "prompt": [1]}, 404, "does not exist"),
    ({"prompt": [1], "n": 2}, 422, "n .* must be 1"),
    ({"prompt": [1], "stream": True}, 422, "stream"),
    ({"prompt": [], "max_tokens": 1}, 422, "prompt must be"),
    ({"prompt": [1, 10_000]}, 422, r"token ids in \[0, "),
    ({"prompt": [1], "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": [1] * 1000, "max_tokens": 25}, 400, "maximum context length is 1024 tokens"),
    ({"prompt": [1], "repetition_penalty": 1.1}, 422, "repetition_penalty"),
    ({"prompt": [1], "stop": ["x"] * 17}, 422, "stop must be"),
    ({"prompt": [1], "prompt_logprobs": 5}, 422, "prompt_logprobs"),
])
def test_bad_requests_get_named_errors(engine, body, status, match):
    import re

    r = httpx2.post(engine.url + "/v1/completions", json=body)
    assert r.status_code == status and re.search(match, r.json()["error"]["message"])


def test_bounds_and_key(tiny_policy_dir):
    srv = make_engine(tiny_policy_dir, limits=EngineLimits(max_body_bytes=2000), api_key="k")
    with ServerThread(srv.app) as st:
        assert httpx2.get(st.url + "/health").status_code == 200  # open: a load balancer's check
        assert httpx2.get(st.url + "/v1/models").status_code == 401
        assert httpx2.post(st.url + "/start_weight_update", json={}).status_code == 401
        auth = {"Authorization": "Bearer k"}
        r = httpx2.post(st.url + "/v1/completions", json={"prompt": [1] * 1000}, headers=auth)
        assert r.status_code == 413
        r = httpx2.post(st.url + "/v1/completions", content=b"{nope", headers=auth)
        assert r.status_code == 400
        assert httpx2.post(st.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2},
                           headers=auth).status_code == 200


def _perturbed(model, delta=0.01):
    return {k: v + delta for k, v in model.state_dict().items()}


def test_a_disk_update_replaces_the_weights_and_bumps_the_version(engine, tiny_llm, tmp_path):
    from safetensors.torch import save_file

    new = _perturbed(tiny_llm.model)
    half = sorted(new)[: len(new) // 2]
    save_file({k: new[k].contiguous() for k in half}, str(tmp_path / "a.safetensors"))
    save_file({k: new[k].contiguous().clone() for k in new if k not in half}, str(tmp_path / "b.safetensors"))
    post = lambda path, body=None: httpx2.post(engine.url + path, json=body or {}, timeout=30)
    assert post("/update_weights", {"update_info": {"path": str(tmp_path / "a.safetensors")}}).status_code == 409
    assert post("/start_weight_update").status_code == 200
    assert post("/start_weight_update").status_code == 409  # one update at a time
    for f in ("a", "b"):
        r = post("/update_weights", {"update_info": {"path": str(tmp_path / f"{f}.safetensors")}})
        assert r.status_code == 200, r.text
    r = post("/finish_weight_update", {"weight_version": "7"}).json()
    assert (r["weight_version"], r["loaded"], r["missing_count"]) == ("7", len(new), 0)
    assert all(torch.equal(engine.weights.own[k], new[k]) for k in new)
    assert httpx2.get(engine.url + "/weight_info").json()["weight_version"] == "7"
    g = OpenAICompatibleLLM(engine.url + "/v1", "tiny", tiny_llm.tokenizer).generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert g[0].meta["weight_version"] == 7


def test_an_update_that_leaves_weights_out_reports_them(engine, tiny_llm, tmp_path):
    from safetensors.torch import save_file

    new = _perturbed(tiny_llm.model)
    skipped = "model.layers.0.mlp.up_proj.weight"
    save_file({k: v.contiguous().clone() for k, v in new.items() if k != skipped}, str(tmp_path / "a.safetensors"))
    httpx2.post(engine.url + "/start_weight_update", json={})
    httpx2.post(engine.url + "/update_weights", json={"update_info": {"path": str(tmp_path / "a.safetensors")}})
    r = httpx2.post(engine.url + "/finish_weight_update", json={}).json()
    assert r["weight_version"] == "1" and r["missing"] == [skipped] and r["missing_count"] == 1


def test_bad_weight_files_are_refused_by_name(tiny_policy_dir, tmp_path):
    from safetensors.torch import save_file

    srv = make_engine(tiny_policy_dir, weights_kw={"weights_dir": str(tmp_path / "shared")})
    (tmp_path / "shared").mkdir()
    save_file({"model.nope.weight": torch.zeros(2)}, str(tmp_path / "shared" / "bad.safetensors"))
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "shared" / "shape.safetensors"))
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "outside.safetensors"))
    with ServerThread(srv.app) as st:
        httpx2.post(st.url + "/start_weight_update", json={})
        up = lambda p: httpx2.post(st.url + "/update_weights", json={"update_info": {"path": p}})
        cases = [(str(tmp_path / "shared" / "bad.safetensors"), 422, "no weight 'model.nope.weight'"),
                 (str(tmp_path / "shared" / "shape.safetensors"), 422, "has shape"),
                 (str(tmp_path / "outside.safetensors"), 403, "not under this engine's weights directory"),
                 (str(tmp_path / "shared" / "absent.safetensors"), 422, "no weight file"),
                 (str(tmp_path / "shared" / "x.bin"), 422, "must name a .safetensors file")]
        for path, status, match in cases:
            r = up(path)
            assert r.status_code == status and match in r.json()["error"]["message"], (path, r.text)
        r = httpx2.post(st.url + "/init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1"}})
        assert r.status_code == 422 and "master_port" in r.text
        r = httpx2.post(st.url + "/update_weights", json={"update_info": {"names": [], "dtype_names": [], "shapes": []}})
        assert r.status_code == 409 and "init_weight_transfer_engine" in r.text  # no transfer group yet
    assert srv.weights.version == "0"


def test_generation_waits_for_an_update_and_then_runs_the_new_weights(engine, tiny_llm, tmp_path):
    from safetensors.torch import save_file

    new = _perturbed(tiny_llm.model, 0.05)
    save_file({k: v.contiguous().clone() for k, v in new.items()}, str(tmp_path / "w.safetensors"))
    client = OpenAICompatibleLLM(engine.url + "/v1", "tiny", tiny_llm.tokenizer, max_retries=0)
    httpx2.post(engine.url + "/start_weight_update", json={})
    out = {}
    t = threading.Thread(target=lambda: out.update(g=client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and httpx2.get(engine.url + "/health").json()["updating"] is True  # held, not served
    httpx2.post(engine.url + "/update_weights", json={"update_info": {"path": str(tmp_path / "w.safetensors")}})
    httpx2.post(engine.url + "/finish_weight_update", json={"weight_version": "3"})
    t.join(timeout=60)
    assert out["g"][0].meta["weight_version"] == 3


def test_an_abandoned_update_refuses_service_instead_of_serving_mixed_weights(tiny_policy_dir, tiny_llm, tmp_path):
    from safetensors.torch import save_file

    srv = make_engine(tiny_policy_dir, weights_kw={"idle_timeout_s": 0.4})
    new = _perturbed(tiny_llm.model)
    save_file({"lm_head.weight": new["lm_head.weight"].contiguous().clone()}, str(tmp_path / "part.safetensors"))
    with ServerThread(srv.app) as st:
        httpx2.post(st.url + "/start_weight_update", json={})
        time.sleep(1.0)  # no call: abandoned before any tensor changed, so it serves on
        assert srv.weights.session is None and not srv.weights.partial
        assert httpx2.post(st.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200
        httpx2.post(st.url + "/start_weight_update", json={})
        httpx2.post(st.url + "/update_weights", json={"update_info": {"path": str(tmp_path / "part.safetensors")}})
        time.sleep(1.0)  # the trainer is gone after one bucket: the weights are mixed
        r = httpx2.post(st.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 503 and "mix of two versions" in r.json()["error"]["message"]
        assert httpx2.get(st.url + "/health").json()["partial"] is True
        save_file({k: v.contiguous().clone() for k, v in new.items()}, str(tmp_path / "all.safetensors"))
        httpx2.post(st.url + "/start_weight_update", json={})
        httpx2.post(st.url + "/update_weights", json={"update_info": {"path": str(tmp_path / "all.safetensors")}})
        httpx2.post(st.url + "/finish_weight_update", json={})
        assert httpx2.post(st.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200


def test_a_bucket_over_the_transfer_group_packed_or_one_tensor_at_a_time(engine, tiny_llm):
    """The engine joins the trainer's gloo group (rank 1 of 2) and receives buckets as vLLM's update_info
    describes them: packed (one broadcast) or unpacked (one per tensor, vLLM's default); a bucket larger
    than the whole model is refused before anything is allocated."""
    from concurrent.futures import ThreadPoolExecutor

    from agent.backends.engine_protocol import (
        broadcast,
        join_group,
        meta_of,
        open_store,
        pack,
        packed_layout,
        update_info,
    )

    store = open_store("127.0.0.1", 0, 2, True, 30)
    post = lambda path, body: httpx2.post(engine.url + path, json=body, timeout=60)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(post, "/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "timeout_s": 30}})
        group = join_group(store, 0, 2, "gloo", 30)
        assert joined.result().json()["rank"] == 1
        new = _perturbed(tiny_llm.model, 0.03)
        names = sorted(new)
        assert post("/start_weight_update", {}).status_code == 200
        huge = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[1 << 20, 1 << 10]], "packed": True}
        r = post("/update_weights", {"update_info": huge})
        assert r.status_code == 422 and "more than the served model's" in r.text
        for packed, part in ((True, names[:5]), (False, names[5:])):
            metas = [meta_of(n, new[n]) for n in part]
            fut = pool.submit(post, "/update_weights", {"update_info": update_info(metas, packed)})
            if packed:
                offsets, total = packed_layout(metas)
                buf = torch.empty(total, dtype=torch.uint8)
                pack([new[n] for n in part], offsets, buf)
                broadcast(group, buf)
            else:
                for n in part:
                    broadcast(group, new[n].contiguous())
            assert fut.result().json()["loaded"] == len(part)
        r = post("/finish_weight_update", {"weight_version": "9"}).json()
    assert r["missing_count"] == 0 and all(torch.equal(engine.weights.own[k], new[k]) for k in new)
