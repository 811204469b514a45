"""Verified weight sync (training.rollout.weight_sync): a push that leaves the rollout side on other weights
than the trainer's fails loudly, naming the parameter (in-process copy) or the probe (an engine), on the
in-process, engine and LoRA paths; an intact push passes even at a tolerance far below bf16 noise. The real
vLLM engine's side is in tests/test_backends_vllm.py."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from tests.conftest import QUESTIONS, run_rl
from tests.test_trainer import SeededLLM, load, make_cfg, varying_judge

#: fp32 on the CPU: the same weights give the same probe log-probs to ~1e-6 (vLLM's CPU engine too)
TIGHT = "train.rollout.sync_probe_tol=1e-4"


def test_check_tensors_names_the_tensor_a_push_skipped(tiny_policy_dir):
    from training.rollout.weight_sync import WeightSyncError, check_tensors

    model, _ = load(tiny_policy_dir)
    copy_ = copy.deepcopy(model)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    skipped = "model.layers.0.mlp.down_proj.weight"
    copy_.load_state_dict({k: v for k, v in new.items() if k != skipped}, strict=False)
    with pytest.raises(WeightSyncError, match=r"1 of \d+ tensors differ.*down_proj"):
        check_tensors(copy_, new)
    copy_.load_state_dict(new)
    assert check_tensors(copy_, new) == len(new)


def _fsdp_like_state(model):
    """A RunState stand-in for the torchrun path of sync_phase: a world of 2 whose rollout copy is separate."""
    from training.model.forward import LogprobModule

    return types.SimpleNamespace(world_size=2, fwd=LogprobModule(model), policy=model,
                                 rollout_model=copy.deepcopy(model), gen_model=None, fleet=None)


def test_the_in_process_copy_under_fsdp_is_checked_after_each_push(tiny_policy_dir, monkeypatch):
    """sync_phase's torchrun path loads the gathered weights into each rank's rollout copy; a load that
    skips one tensor (and says nothing) is caught, naming it."""
    import training.trainer as T
    from training.rollout.weight_sync import WeightSyncError

    model, _ = load(tiny_policy_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # the update moved every weight
    tc = make_cfg().train
    state = _fsdp_like_state(model)
    worker = types.SimpleNamespace(llm=None)
    stats = T.sync_phase(state, worker, tc, True, None, None)
    assert stats["sync/tensors_checked"] == len(model.state_dict())

    real = T.sync_rollout_weights
    skipped = "model.layers.0.self_attn.q_proj.weight"

    def skips_one(llm, rollout_model, full):
        real(llm, rollout_model, full)
        if rollout_model is not None:
            with torch.no_grad():
                rollout_model.get_parameter(skipped).sub_(0.01)  # that tensor kept its old value

    monkeypatch.setattr(T, "sync_rollout_weights", skips_one)
    state = _fsdp_like_state(model)
    with pytest.raises(WeightSyncError, match="q_proj"):
        T.sync_phase(state, worker, tc, True, None, None)
    assert T.sync_phase(state, worker, tc.updated({"rollout.verify_sync": False}), True, None, None) == {}


class OwnWeightsEngine(SeededLLM):
    """A rollout engine that holds its own copy of the weights (as vLLM does), loaded from the policy's
    directory, and takes pushes by name; ``skip`` names a tensor its loader leaves out, and a loader that
    ignores unknown names (``strict=False``) takes a peft state dict's ``base_layer``/``lora_`` names as
    nothing new."""

    skip: str | None = None

    def __init__(self, path, tokenizer):
        from transformers import AutoModelForCausalLM

        super().__init__(AutoModelForCausalLM.from_pretrained(str(path)).eval(), tokenizer)
        self.pushes = 0

    def update_weights(self, items):
        state = {k: v for k, v in items if k != self.skip}
        self.model.load_state_dict(state, strict=False)
        self.pushes += 1

    def probe_logprobs(self, ids):
        return self.inner.probe_logprobs(ids)


def test_an_engine_that_runs_the_pushed_weights_passes_a_tight_probe(tiny_policy_dir, retriever, tmp_path):
    model, tok = load(tiny_policy_dir)
    engines = []

    def factory(m, t):
        engines.append(OwnWeightsEngine(tiny_policy_dir, t))
        return engines[-1]

    out = run_rl(make_cfg("train.steps=2", TIGHT), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge,
                 llm_factory=factory)
    rec = out["last"]
    assert engines[0].pushes == 2 and rec["sync/probe_lp_diff_mean"] < 1e-5
    assert "sync/probe_lp_diff_max" in rec


def test_an_engine_that_skipped_one_tensor_fails_the_run_naming_the_probe(tiny_policy_dir, retriever, tmp_path,
                                                                          monkeypatch):
    model, tok = load(tiny_policy_dir)
    monkeypatch.setattr(OwnWeightsEngine, "skip", "model.layers.0.mlp.up_proj.weight")
    cfg = make_cfg("train.steps=2", "train.optim.lr=1e-2", TIGHT)
    with pytest.raises(RuntimeError, match="weight-sync probe") as e:
        run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge,
               llm_factory=lambda m, t: OwnWeightsEngine(tiny_policy_dir, t))
    assert type(e.value).__name__ == "WeightSyncError"


def test_an_engine_started_from_other_weights_is_refused_before_the_first_step(tiny_policy_dir, retriever, tmp_path):
    model, tok = load(tiny_policy_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)  # the trainer's policy is not what the engine loaded
    with pytest.raises(RuntimeError, match="does not run the trainer's weights"):
        run_rl(make_cfg("train.steps=1"), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge,
               llm_factory=lambda m, t: OwnWeightsEngine(tiny_policy_dir, t))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_lora_adapters_not_merged_into_the_push_are_caught(tiny_policy_dir, retriever, tmp_path):
    """LoRA: the engine must get the adapters merged into the base weights. A push of the peft model's own
    state dict (``...q_proj.base_layer.weight``, ``lora_A``/``lora_B``) through a loader that ignores
    unknown names leaves the engine on the base weights; the merged push of the trainer passes."""
    from training.model.lora import base_model

    lora = ["train.optim.lora=true", "train.optim.lora_rank=4", "train.optim.lora_targets=[q_proj,v_proj]", "train.optim.lr=5e-2",
            "train.steps=2", TIGHT]
    model, tok = load(tiny_policy_dir)
    out = run_rl(make_cfg(*lora), model, tok, retriever, QUESTIONS, tmp_path / "merged", judge=varying_judge,
                 llm_factory=lambda m, t: OwnWeightsEngine(tiny_policy_dir, t))
    assert out["last"]["sync/probe_lp_diff_mean"] < 1e-5

    model, tok = load(tiny_policy_dir)
    policies = []

    def factory(m, t):
        policies.append(m)  # the peft-wrapped policy the rollout side is built on
        return OwnWeightsEngine(tiny_policy_dir, t)

    def unmerged(llm, full):
        llm.update_weights(base_model(policies[0]).state_dict().items())

    with pytest.raises(RuntimeError, match="LoRA adapters not merged"):
        run_rl(make_cfg(*lora), model, tok, retriever, QUESTIONS, tmp_path / "unmerged", judge=varying_judge,
               llm_factory=factory, sync_weights=unmerged)
