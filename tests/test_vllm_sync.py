"""The trainer's push into ``vllm serve`` engines, against a fake vLLM server (no vLLM needed): the routes
called and their order, vLLM's payloads, the tensors that arrive over the gloo group, resume after a failed
push, and the refusal before the first step of an engine without the weight-transfer routes or backend.
The same push into real ``vllm serve`` processes is ``tests/test_fleet_vllm.py`` (the vLLM suite)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agent.backends.engine_protocol import (
    DTYPES,
    TensorMeta,
    broadcast,
    join_group,
    open_store,
    packed_layout,
    unpack,
)
from agent.backends.fleet import Fleet, FleetError
from tests.test_agent_fakes import ServerThread
from training.rollout import vllm_sync
from training.rollout.fleet_sync import FleetSync, FullState, SyncSettings, buckets

GLOO_FLAGS = """VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{"backend": "gloo"}'"""


class FakeVLLM:
    """A ``vllm serve`` as the trainer sees it: ``/v1/models`` (owned by vllm), ``/tokenize``, the dev-mode
    ``/server_info`` (``backend``: the weight-transfer backend, ``None``: started without one, ``"no-routes"``:
    without ``VLLM_SERVER_DEV_MODE``) and the RL routes, receiving over the gloo group as Sleuth's vLLM
    plugin does. ``calls``: each request as ``"METHOD /path?query"``; ``fail``: a path answered HTTP 500;
    ``refuse_bucket``: the n-th ``update_weights`` (from 1) is received, then refused (HTTP 500, as vLLM
    answers a weight its model does not have)."""

    def __init__(self, tok, backend: str | None = "gloo", fail: str = "", report_version: bool = True,
                 refuse_bucket: int = 0):
        self.calls: list[str] = []
        self.init_info: dict = {}
        self.update_infos: list[dict] = []
        self.received: dict[str, torch.Tensor] = {}
        self.version, self.group = "0", None
        self.app = app = FastAPI()
        lock = threading.Lock()

        @app.middleware("http")
        async def record(request: Request, call_next):
            q = f"?{request.url.query}" if request.url.query else ""
            with lock:
                self.calls.append(f"{request.method} {request.url.path}{q}")
            if request.url.path == fail:
                return JSONResponse({"error": "refused"}, status_code=500)
            return await call_next(request)

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "vllm"}]}

        @app.post("/tokenize")
        def tokenize(body: dict):
            return {"tokens": list(tok.encode(body["prompt"], add_special_tokens=body["add_special_tokens"]))}

        if backend == "no-routes":
            return

        @app.get("/server_info")
        def server_info(config_format: str = "text"):
            assert config_format == "json"
            wt = None if backend is None else {"backend": backend}
            return {"vllm_config": {"weight_transfer_config": wt}, "vllm_env": {}, "system_env": {}}

        @app.get("/get_world_size")
        def world_size():
            return {"world_size": 1}

        @app.post("/init_weight_transfer_engine")
        def init(body: dict):
            self.init_info = info = body["init_info"]
            store = open_store(info["master_address"], info["master_port"], info["world_size"], False, 30)
            self.group = join_group(store, info["rank_offset"], info["world_size"], "gloo", 30)
            return {"message": "Weight transfer initialized"}

        @app.post("/update_weights")
        def update(body: dict):
            info = body["update_info"]
            self.update_infos.append(info)
            metas = [TensorMeta(n, d, tuple(s)) for n, d, s in zip(info["names"], info["dtype_names"],
                                                                    info["shapes"], strict=True)]
            if self.init_info["packed"]:
                offsets, total = packed_layout(metas)
                buf = torch.empty(total, dtype=torch.uint8)
                broadcast(self.group, buf)
                self.received |= {n: t.clone() for n, t in unpack(buf, metas, offsets)}
            else:
                for m in metas:
                    t = torch.empty(m.shape, dtype=DTYPES[m.dtype])
                    broadcast(self.group, t)
                    self.received[m.name] = t
            if len(self.update_infos) == refuse_bucket:
                return JSONResponse({"error": {"message": "no weight named so"}}, status_code=500)
            return {"message": "Weights updated"}

        @app.post("/finish_weight_update")
        def finish(body: dict):
            if report_version:
                self.version = body["weight_version"]
            return {"message": "Weight update finished"}

        @app.get("/weight_info")
        def weight_info():
            return {"weight_version": self.version}

        for path in ("/pause", "/resume", "/start_weight_update"):
            app.post(path)(lambda: {"status": "ok"})

        @app.post("/reset_prefix_cache")
        def reset(reset_running_requests: bool = False):
            return {"success": reset_running_requests}  # frozen requests hold blocks: only this way succeeds


def _sync(url, tok, **settings):
    fleet = Fleet([url], tok, "tiny", max_retries=1, backoff_s=0.05, retry_waits=(0.1,))
    return FleetSync(fleet, SyncSettings(**{"bucket_bytes": 32 * 1024, "timeout_s": 30, **settings}), rank=0)


@pytest.mark.parametrize("packed", [False, True])
def test_a_push_speaks_vllms_routes_and_payloads_and_delivers_every_weight(tiny_llm, packed):
    tok, model = tiny_llm.tokenizer, tiny_llm.model
    fake = FakeVLLM(tok)
    with ServerThread(fake.app) as s:
        sync = _sync(s.url, tok, packed=packed)
        sync.check_engines()
        pushed = sync.push(FullState(model), 5, [s.url])
        sync.close()
    state = model.state_dict()
    n = len(list(buckets(state.items(), 32 * 1024)))
    assert n > 1 and pushed == [s.url]
    assert fake.calls == ["GET /v1/models", "POST /tokenize", "GET /server_info?config_format=json",
                          "POST /pause?mode=keep", "POST /start_weight_update", "GET /get_world_size",
                              "POST /init_weight_transfer_engine", *["POST /update_weights"] * n,
                              "POST /finish_weight_update", "POST /reset_prefix_cache?reset_running_requests=true",
                              "GET /weight_info", "POST /resume"]
    port = fake.init_info.pop("master_port")
    assert isinstance(port, int) and 0 < port < 65536
    assert fake.init_info == {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2, "packed": packed,
                              "backend": "gloo", "timeout_s": 30}
    assert all(set(i) == {"names", "dtype_names", "shapes"} for i in fake.update_infos)  # vLLM's fields only
    assert [n for i in fake.update_infos for n in i["names"]] == list(state)
    assert all(torch.equal(fake.received[k], v) for k, v in state.items())
    assert fake.version == "5" and sync.last["sync/engines_pushed"] == 1


def test_an_engine_that_fails_is_named_and_resumed_all_the_same(tiny_llm):
    tok = tiny_llm.tokenizer
    refusing, stale = FakeVLLM(tok, fail="/start_weight_update"), FakeVLLM(tok, report_version=False)
    with ServerThread(refusing.app) as s1, ServerThread(stale.app) as s2:
        fleet = Fleet([s1.url, s2.url], tok, "tiny", max_retries=1, backoff_s=0.05, retry_waits=(0.1,))
        sync = FleetSync(fleet, SyncSettings(bucket_bytes=32 * 1024, timeout_s=30), rank=0)
        assert sync.push(FullState(tiny_llm.model), 7, [s1.url, s2.url]) == []
        sync.close()
    assert refusing.calls[2:] == ["POST /pause?mode=keep", "POST /start_weight_update", "POST /resume"]
    assert stale.calls[-1] == "POST /resume"
    state = fleet.describe()
    assert "could not start the update: POST /start_weight_update answered HTTP 500" in state[s1.url]["reason"]
    assert state[s2.url]["reason"] == "reports weight version '0' after the push of version 7"
    assert fleet.in_rotation() == []


def test_engines_without_the_routes_or_the_backend_are_refused_naming_each_and_the_flag(tiny_llm):
    tok = tiny_llm.tokenizer
    fakes = [FakeVLLM(tok, backend=b) for b in ("no-routes", None, "nccl", "gloo")]
    with ServerThread(fakes[0].app) as a, ServerThread(fakes[1].app) as b, ServerThread(fakes[2].app) as c, \
            ServerThread(fakes[3].app) as good:
        fleet = Fleet([a.url, b.url, c.url, good.url], tok, "tiny")
        sync = FleetSync(fleet, SyncSettings(), rank=0)
        with pytest.raises(FleetError) as e:
            sync.check_engines()
        FleetSync(Fleet([good.url], tok, "tiny"), SyncSettings(), rank=0).check_engines()  # no error
        sync.close()
    msg = str(e.value)
    assert msg.startswith("3 of 4 vllm serve engines cannot take weight pushes: ")
    assert f"{a.url} (vllm serve) has no weight-transfer routes (GET /server_info: HTTP 404): start it with " \
           f"{GLOO_FLAGS}" in msg
    assert f"{b.url} (vllm serve) was started without --weight-transfer-config: start it with {GLOO_FLAGS}" in msg
    assert f"{c.url} (vllm serve) takes weights over 'nccl', the trainer pushes over 'gloo'" in msg
    assert good.url not in msg and msg.count(GLOO_FLAGS) == 3
    assert all(f.calls.count("POST /init_weight_transfer_engine") == 0 for f in fakes)  # nothing started


def test_a_mixed_fleet_and_the_disk_transport_are_refused_for_vllm_engines(tiny_llm):
    from agent.serve.engine import EngineServer

    tok = tiny_llm.tokenizer
    fake = FakeVLLM(tok)
    ours = EngineServer(tiny_llm, "tiny")
    with ServerThread(fake.app) as v, ServerThread(ours.app) as s:
        fleet = Fleet([v.url, s.url], tok, "tiny")
        assert [e.owned_by for e in fleet.engines.values()] == ["vllm", "sleuth"]
        with pytest.raises(FleetError, match=f"the rollout engines mix vllm serve \\({v.url}\\) with other "
                                             f"servers \\({s.url}\\)"):
            FleetSync(fleet, SyncSettings(), rank=0).check_engines()
        FleetSync(Fleet([s.url], tok, "tiny"), SyncSettings(), rank=0).check_engines()  # ours alone: nothing
        with pytest.raises(FleetError, match="the disk weight-sync transport cannot push into vllm serve"):
            FleetSync(Fleet([v.url], tok, "tiny"), SyncSettings(transport="disk", shared_dir="d"),
                      rank=0).check_engines()


def test_init_info_has_the_fields_of_each_vllm_backend():
    assert vllm_sync.init_info("10.0.0.1", 2900, 3, 5, "nccl", False, 60.0) == {
        "master_address": "10.0.0.1", "master_port": 2900, "rank_offset": 3, "world_size": 5, "packed": False}
    assert vllm_sync.init_info("10.0.0.1", 2900, 1, 2, "gloo", True, 60.0) == {
        "master_address": "10.0.0.1", "master_port": 2900, "rank_offset": 1, "world_size": 2, "packed": True,
        "backend": "gloo", "timeout_s": 60.0}


def test_the_gloo_backend_is_declared_as_a_vllm_plugin_and_found_from_a_checkout(tmp_path, monkeypatch):
    """vLLM loads ``vllm.general_plugins`` entry points in each of its processes: pyproject declares Sleuth's,
    and ``plugin_path`` makes a checkout not installed with it declare it all the same."""
    import importlib.metadata
    import tomllib

    from agent.backends import vllm_plugin

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "sleuth_gloo_weight_transfer": "agent.backends.vllm_plugin:register"}
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])  # an install without it
    assert vllm_plugin.plugin_path(str(tmp_path)) == str(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert [(e.group, e.name, e.value) for e in dist.entry_points] == [
        ("vllm.general_plugins", "sleuth_gloo_weight_transfer", "agent.backends.vllm_plugin:register")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: dist.entry_points)  # installed with it
    assert vllm_plugin.plugin_path(str(tmp_path / "unused")) == ""
    assert not (tmp_path / "unused").exists()


def test_an_engine_that_refuses_a_bucket_is_out_and_the_push_to_the_other_goes_on(tiny_llm):
    """vLLM ends an update whose bucket failed (the next one is refused): no second round to it; the other
    engine gets every bucket over a group formed again without it."""
    tok, model = tiny_llm.tokenizer, tiny_llm.model
    bad, good = FakeVLLM(tok, refuse_bucket=2), FakeVLLM(tok)
    with ServerThread(bad.app) as s1, ServerThread(good.app) as s2:
        fleet = Fleet([s1.url, s2.url], tok, "tiny", max_retries=1, backoff_s=0.05, retry_waits=(0.1,))
        sync = FleetSync(fleet, SyncSettings(bucket_bytes=32 * 1024, timeout_s=30), rank=0)
        assert sync.push(FullState(model), 3, [s1.url, s2.url]) == [s2.url]
        sync.close()
    state = model.state_dict()
    assert bad.calls.count("POST /update_weights") == 2 and bad.calls[-1] == "POST /resume"
    assert "weight push bucket 1 failed: POST /update_weights answered HTTP 500" in fleet.describe()[s1.url]["reason"]
    assert good.calls.count("POST /init_weight_transfer_engine") == 2  # the group formed again without s1
    assert [n for i in good.update_infos for n in i["names"]] == list(state)
    assert all(torch.equal(good.received[k], v) for k, v in state.items()) and good.version == "3"
