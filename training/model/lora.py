"""LoRA (Hu et al., 2021) through peft: wrapping the policy, its adapters' state, and the merged weights a
rollout engine that holds its own copy (vLLM) or a plain model directory needs."""

from __future__ import annotations

from typing import Any

import torch


def base_model(model: Any) -> Any:
    """The Hugging Face model under a peft wrapper (LoRA layers stay injected and active); ``model`` itself
    when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def apply_lora(model: Any, tc: Any) -> Any:
    """Wrap ``model`` with LoRA adapters of ``tc.optim.lora_rank``, ``lora_alpha``, ``lora_dropout`` on
    ``lora_targets`` (``tc``: a :class:`training.config.TrainConfig`); only the adapters are trainable. Raises
    ``ImportError`` with the install hint when peft is missing."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("train.optim.lora=true needs peft: pip install 'sleuth[lora]'") from e
    opt = tc.optim
    conf = LoraConfig(r=opt.lora_rank, lora_alpha=opt.lora_alpha, lora_dropout=opt.lora_dropout,
                      target_modules=list(opt.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(model, conf)


def lora_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' tensors (peft's ``get_peft_model_state_dict``), detached copies on the CPU."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}


def merged_lora_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The full weights of a LoRA policy under the base model's Hugging Face names, each adapted weight
    merged (``W + scale * B @ A``, peft's ``get_delta_weight``; the same as ``merge_and_unload``), on the
    CPU: what a rollout backend that holds its own weights (vLLM) loads. The policy itself is unchanged."""
    from peft.tuners.lora import LoraLayer

    base = base_model(peft_model)
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, LoraLayer) and not mod.merged:
                for a in mod.active_adapters:
                    if a in mod.lora_A:
                        d = mod.get_delta_weight(a)
                        deltas[name] = deltas[name] + d if name in deltas else d
        out = {}
        for k, v in base.state_dict().items():
            if ".lora_" in k:  # the adapters' own tensors
                continue
            k = k.replace(".base_layer.", ".")
            owner, _, leaf = k.rpartition(".")
            if leaf == "weight" and owner in deltas:
                v = v + deltas[owner].to(v.dtype)
            out[k] = v.detach().cpu()
    return out


class MergedView:
    """``save_pretrained`` of a LoRA policy as a plain model directory: the base model's config and the
    merged weights of :func:`merged_lora_state` (no copy of the model is made)."""

    def __init__(self, peft_model: Any):
        self.peft_model = peft_model

    def save_pretrained(self, path: Any) -> None:
        base_model(self.peft_model).save_pretrained(path, state_dict=merged_lora_state(self.peft_model))
