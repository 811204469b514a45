"""LoRA through peft (checkpoints are plain merged model directories, resume is exact) and gradient
checkpointing (same update as without)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import QUESTIONS
from tests.test_trainer import SeededLLM, load, make_cfg, varying_judge
from training.algos.advantages import to_token_advantages

peft = pytest.importorskip("peft")


def test_lora_trains_adapters_and_resumes_exactly(tiny_policy_dir, retriever, tmp_path):
    from safetensors.torch import load_file

    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    lora = ["train.optim.lora=true", "train.optim.lora_rank=4", "train.optim.lora_targets=[q_proj,v_proj]", "train.optim.lr=1e-2"]
    model, tok = load(tiny_policy_dir)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    run_rl(make_cfg("train.steps=3", *lora), model, tok, retriever, QUESTIONS, tmp_path / "straight",
             judge=varying_judge, llm_factory=SeededLLM)
    final = latest_checkpoint(tmp_path / "straight")
    merged, _ = load_model_and_tokenizer(str(final), device="cpu")  # a plain HF directory
    ms = merged.state_dict()
    assert not torch.equal(ms["model.layers.0.self_attn.q_proj.weight"], init["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(ms["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])  # frozen
    base = load_file(str(final / "base" / "model.safetensors"))
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"], init["model.layers.0.self_attn.q_proj.weight"])

    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=2", *lora), model, tok, retriever, QUESTIONS, tmp_path / "split",
             judge=varying_judge, llm_factory=SeededLLM)
    ckpt = latest_checkpoint(tmp_path / "split")
    model, tok = load_model_and_tokenizer(str(ckpt), device="cpu")
    run_rl(make_cfg("train.steps=3", *lora), model, tok, retriever, QUESTIONS, tmp_path / "split", resume=True,
             judge=varying_judge, llm_factory=SeededLLM)
    resumed, _ = load_model_and_tokenizer(str(latest_checkpoint(tmp_path / "split")), device="cpu")
    for k, v in ms.items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_update(tiny_policy_dir, retriever):
    from agent.backends.hf import TransformersLLM
    from agent.loop.batch import run_episodes
    from training.batch import collate
    from training.model.actor import update_policy

    cfg = make_cfg()
    model, tok = load(tiny_policy_dir)
    torch.manual_seed(0)
    trajs = run_episodes(QUESTIONS[:2], TransformersLLM(model, tok), retriever, cfg.agent, n_samples=2)
    out = []
    for ckpt in (False, True):
        m, _ = load(tiny_policy_dir)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        b = collate(trajs, tok.pad_token_id)
        b.token_advantages = to_token_advantages(torch.tensor([1.0, -1.0, 0.5, -0.5]), b.loss_mask)
        update_policy(m, None, torch.optim.SGD(m.parameters(), lr=0.1), b, cfg.train)
        out.append(m.state_dict())
    for k in out[0]:
        torch.testing.assert_close(out[0][k], out[1][k], rtol=1e-5, atol=1e-7)


def test_lora_checkpoint_is_committed_only_with_its_base_weights(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """A LoRA checkpoint's frozen base weights (base/model.safetensors, which resume loads under the adapters)
    were written after the checkpoint was renamed into place and made `latest`: a kill during that write left
    a latest checkpoint without them, whose resume stacks the adapters on the merged weights. Killed there,
    the run must resume from the previous complete checkpoint."""
    import safetensors.torch

    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    real, calls = safetensors.torch.save_file, []

    def killed_at_second_base(tensors, filename, *a, **kw):
        calls.append(filename)
        if "base" in str(filename) and len(calls) == 2:
            raise KeyboardInterrupt  # the process dies while writing step 2's base weights
        return real(tensors, filename, *a, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", killed_at_second_base)
    lora = ["train.optim.lora=true", "train.optim.lora_rank=4", "train.optim.lora_targets=[q_proj,v_proj]"]
    model, tok = load(tiny_policy_dir)
    with pytest.raises(KeyboardInterrupt):
        run_rl(make_cfg("train.steps=2", *lora), model, tok, retriever, QUESTIONS, tmp_path,
                 judge=varying_judge, llm_factory=SeededLLM)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000001" and (ckpt / "base" / "model.safetensors").exists()


class OwnWeightsLLM(SeededLLM):
    """A rollout backend that holds its own plain copy of the weights, as vLLM does: ``update_weights`` loads
    a full state dict under the Hugging Face names, strictly (a tied LM head may come along)."""

    def __init__(self, model, tok):
        import copy

        own = copy.deepcopy(model)
        own = own.merge_and_unload() if hasattr(own, "merge_and_unload") else own
        super().__init__(own, tok)
        self.updates = 0

    def update_weights(self, named):
        state = dict(named)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (unexpected, missing)
        self.updates += 1


def test_a_rollout_backend_with_its_own_weights_gets_the_merged_lora_policy(tiny_policy_dir, retriever, tmp_path):
    """With LoRA, the update pushed to a backend holding its own weights (vLLM) was the peft model's state
    dict: ``base_layer``/``lora_A`` names that the engine cannot load, so it kept rolling out the initial
    weights (vLLM warned) or stopped. It now gets the merged weights under the base model's names, equal to
    the merged checkpoint."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    made = []

    def factory(model, tok):
        made.append(OwnWeightsLLM(model, tok))
        return made[-1]

    lora = ["train.optim.lora=true", "train.optim.lora_rank=4", "train.optim.lora_targets=[q_proj,v_proj]", "train.optim.lr=1e-2"]
    model, tok = load(tiny_policy_dir)
    init = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].clone()
    run_rl(make_cfg("train.steps=2", *lora), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge,
             llm_factory=factory)
    merged, _ = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
    own = made[0].model.state_dict()
    assert made[0].updates == 2
    assert not torch.equal(own["model.layers.0.self_attn.q_proj.weight"], init)
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(own[k], v, rtol=0, atol=1e-6)
