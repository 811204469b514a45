""":class:`agent.backends.vllm.VLLMBackend`'s own logic over a fake ``vllm`` module (fast, no vLLM needed);
the real engine is exercised in ``tests/test_backends_vllm.py`` (slow, separate venv)."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch


@pytest.fixture
def fake_vllm(tiny_llm, monkeypatch):
    """Installs a fake ``vllm`` whose ``LLM.generate`` echoes each prompt's ids; returns the engine class."""
    tok = tiny_llm.tokenizer

    class Engine:
        on_generate = None  # a hook run inside generate (while the backend holds its lock)

        def __init__(self, **kw):
            self.kw = kw

        def get_tokenizer(self):
            return tok

        def generate(self, reqs, sps, use_tqdm=False):
            if Engine.on_generate is not None:
                Engine.on_generate()
            ns = types.SimpleNamespace
            return [ns(outputs=[ns(token_ids=list(r["prompt_token_ids"]), logprobs=None, finish_reason="length")])
                    for r in reqs]

        def collective_rpc(self, method, kwargs=None):
            return [None]

        def reset_prefix_cache(self):
            return True

    install_fake_vllm(monkeypatch, Engine)
    return Engine


def install_fake_vllm(monkeypatch, engine: type) -> None:
    """Make ``import vllm`` give a module whose ``LLM`` is ``engine`` (SamplingParams and TokensPrompt as
    plain dicts), for :class:`agent.backends.vllm.VLLMBackend` without vLLM installed."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = engine, lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def test_weight_version_tags_the_weights_that_generated(fake_vllm):
    """A weight update that waits on the lock while a batch generates must not tag that batch with the
    new version: the tag is read under the same lock as the generation."""
    from agent.backends.vllm import VLLMBackend
    from agent.llm import SamplingParams, encode

    backend = VLLMBackend("fake")
    updated = threading.Event()

    class HandOffLock:  # after the generation's release, let the waiting update run to completion first
        def __init__(self):
            self.lock, self.exits = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()

        def __exit__(self, *exc):
            self.exits += 1
            first = self.exits == 1
            self.lock.release()
            if first:
                updated.wait(10)
            else:
                updated.set()

    backend._lock = HandOffLock()
    update = threading.Thread(target=backend.update_weights, args=([("w", torch.zeros(2))],))
    fake_vllm.on_generate = update.start
    try:
        (g,) = backend.generate([encode(backend.tokenizer, "hello")], SamplingParams(max_new_tokens=4, stop=()))
    finally:
        fake_vllm.on_generate = None
        update.join(10)
        backend.close()
    assert updated.is_set() and backend.weight_version == 1
    assert g.meta["weight_version"] == 0


def test_logprobs_are_of_the_sampling_distribution_unless_overridden(fake_vllm):
    from agent.backends.vllm import VLLMBackend

    assert VLLMBackend("fake").engine.kw["logprobs_mode"] == "processed_logprobs"
    assert VLLMBackend("fake", logprobs_mode="raw_logprobs").engine.kw["logprobs_mode"] == "raw_logprobs"


def test_a_prefix_cache_that_cannot_be_cleared_after_an_update_is_an_error(fake_vllm):
    """vLLM's reset_prefix_cache returns False while requests remain in the engine; the update went on as if
    the cache were clear, so later rollouts could reuse KV computed with the old weights."""
    from agent.backends.vllm import VLLMBackend

    backend = VLLMBackend("fake")
    try:
        backend.update_weights([("w", torch.zeros(2))])
        assert backend.weight_version == 1
        backend.engine.reset_prefix_cache = lambda: False
        with pytest.raises(RuntimeError, match="prefix cache"):
            backend.update_weights([("w", torch.ones(2))])
        assert backend.weight_version == 2  # the engine holds the new weights either way
    finally:
        backend.close()


def test_an_update_that_leaves_out_weights_of_the_served_model_is_refused(fake_vllm, tiny_policy_dir):
    """vLLM's in-place reload keeps the old tensors of a layer it gets no weights for (with only a warning in
    the worker's log), so a partial state dict, or one under other names (a peft model's ``base_layer``
    names), rolled out with stale weights. An update must now name every weight of the served checkpoint;
    nothing reaches the engine otherwise."""
    from transformers import AutoModelForCausalLM

    from agent.backends.vllm import VLLMBackend

    calls = []
    fake_vllm.collective_rpc = lambda self, method, kwargs=None: calls.append(method)
    state = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).state_dict()
    backend = VLLMBackend(str(tiny_policy_dir))
    try:
        partial = {k: v for k, v in state.items() if "mlp" not in k}
        with pytest.raises(ValueError, match="mlp"):
            backend.update_weights(partial.items())
        renamed = {k.replace("q_proj.", "q_proj.base_layer."): v for k, v in state.items()}
        with pytest.raises(ValueError, match="q_proj.weight"):
            backend.update_weights(renamed.items())
        assert calls == [] and backend.weight_version == 0
        backend.update_weights(state.items())  # the full state dict (tied LM head included) is accepted
        assert calls == ["reload_weights"] and backend.weight_version == 1
    finally:
        backend.close()


def test_close_shuts_the_engine_down_once(fake_vllm):
    """``close()`` left vLLM's engine-core process running until interpreter exit, where its shutdown logged
    to closed streams; it now shuts the engine down (once), and the backend refuses work afterwards."""
    from agent.backends.vllm import VLLMBackend
    from agent.llm import SamplingParams

    shutdowns = []
    backend = VLLMBackend("fake")
    core = types.SimpleNamespace(shutdown=lambda: shutdowns.append(1))
    backend.engine.llm_engine = types.SimpleNamespace(engine_core=core)
    backend.close()
    backend.close()
    assert shutdowns == [1]
    with pytest.raises(RuntimeError, match="closed"):
        backend.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        backend.update_weights([("w", torch.zeros(2))])


def test_each_request_gets_its_own_budget_in_one_engine_call(fake_vllm):
    """Through the scheduler's agent.llm.generate_requests, vLLM got the batch's largest max_new_tokens for
    every prompt (generating tokens that were then cut); it now takes one SamplingParams per prompt, each
    with its own budget, in one engine call."""
    from agent.backends.vllm import VLLMBackend
    from agent.llm import SamplingParams, generate_requests

    seen = []
    real = fake_vllm.generate

    def recording(self, reqs, sps, use_tqdm=False):
        seen.append([sp["max_tokens"] for sp in sps])
        return real(self, reqs, sps, use_tqdm)

    fake_vllm.generate = recording
    backend = VLLMBackend("fake")
    reqs = [([5, 6, 7], SamplingParams(max_new_tokens=n, temperature=1.0)) for n in (9, 24, 3)]
    out = generate_requests(backend, reqs)
    assert seen == [[9, 24, 3]] and len(out) == 3


def test_the_probe_is_scored_from_the_engines_prompt_logprobs(fake_vllm):
    """``probe_logprobs`` asks vLLM for the prompt's log-probs (``prompt_logprobs=0``, one token generated at
    temperature 1) and reads each token's own entry (the first prompt token has none)."""
    import types

    from agent.backends.vllm import VLLMBackend

    asked = []

    def generate(self, reqs, sps, use_tqdm=False):
        asked.append(sps[0])
        ids = reqs[0]["prompt_token_ids"]
        ns = types.SimpleNamespace
        steps = [None] + [{t: ns(logprob=-0.5 * i), t + 1: ns(logprob=-9.0)} for i, t in enumerate(ids[1:], 1)]
        return [ns(prompt_logprobs=steps, outputs=[])]

    fake_vllm.generate = generate
    backend = VLLMBackend("fake")
    try:
        assert backend.probe_logprobs([5, 6, 7, 8]) == [-0.5, -1.0, -1.5]
    finally:
        backend.close()
    assert asked[0]["prompt_logprobs"] == 0 and asked[0]["max_tokens"] == 1 and asked[0]["temperature"] == 1.0
