"""Verified weight sync: after the trainer pushes its weights to the rollout side, check that the rollout side
now runs them.

A weight push can fail without an error: vLLM's in-place reload keeps the old values of a tensor it gets no
(or a misnamed) update for, a LoRA policy's adapters may not be merged into what is pushed, an in-process
copy may skip a key; the rollouts then come from a stale or different policy, which looks like an
off-policy drift or plain staleness and is hard to tell from either. So each push is checked:

* an **in-process copy** (the full rollout copy under FSDP2, the shared-memory model of
  :class:`agent.backends.process.ProcessLLM`) is compared tensor by tensor with the weights pushed
  (:func:`check_tensors`): a mismatch names the parameters;
* an **engine** that holds its own weights (vLLM, a rollout process) scores a fixed probe sequence
  (:data:`PROBE_TEXT`) through its ``probe_logprobs(ids)`` and the trainer scores it with its own model
  (:func:`check_engine`): when the mean ``|log-prob difference|`` over the probe's tokens exceeds
  ``train.rollout.sync_probe_tol``, the error names the probe and the difference. The tolerance allows for an engine
  that computes in another precision (vLLM in bf16 against an fp32 trainer differs by ~1e-2 nats per token
  in typical reports; on CPU in fp32 both agree to ~1e-6); a weight that was not loaded shows once the
  training moved it further than that. The difference is logged each step (``sync/probe_lp_diff_mean``).

No RL stack we know of checks this; the failure is reported in verl, TRL and SkyRL issue trackers as silent.
"""

from __future__ import annotations

from typing import Any

import torch

from agent.backends.hf import sequence_logprobs

#: the probe sequence (tokenised with the policy's tokenizer, at most :data:`PROBE_MAX_TOKENS` tokens)
PROBE_TEXT = ("Question: Which city is the capital of France, and who designed its tower?\n"
              "<search> capital of France </search>\n<information> Paris is the capital and most populous "
              "city of France. The Eiffel Tower was designed by Gustave Eiffel. </information>\n"
              "<answer> Paris </answer>")
PROBE_MAX_TOKENS = 64


class WeightSyncError(RuntimeError):
    """The rollout side does not run the weights the trainer pushed (the message names the parameters or the
    probe)."""


def probe_ids(tokenizer: Any) -> list[int]:
    """The probe's token ids (:data:`PROBE_TEXT`, no special tokens, at most :data:`PROBE_MAX_TOKENS`).
    Raises ``ValueError`` when the tokenizer makes fewer than 2 tokens of it (nothing to score)."""
    ids = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))[:PROBE_MAX_TOKENS]
    if len(ids) < 2:
        raise ValueError(f"the weight-sync probe has {len(ids)} token(s) under this tokenizer; need 2")
    return ids


def check_tensors(model: Any, state: dict[str, torch.Tensor], what: str = "the rollout copy") -> int:
    """Compare every tensor of ``state`` (the weights pushed, by name) with ``model``'s tensor of that name,
    exactly. Returns how many were compared. Raises :class:`WeightSyncError` naming the parameters that
    differ or that ``model`` lacks (``what`` names the copy in the message)."""
    own = model.state_dict()
    missing = sorted(k for k in state if k not in own)
    bad = [k for k in state if k in own and not torch.equal(own[k].detach().to(state[k].device), state[k])]
    if missing or bad:
        raise WeightSyncError(f"weight sync to {what} failed: {len(bad)} of {len(state)} tensors differ from the "
                              f"trainer's after the push (e.g. {bad[:3]}); {len(missing)} are missing there "
                              f"(e.g. {missing[:3]})")
    return len(state)


def check_engine(llm: Any, model: Any, ids: list[int], tol: float, want: list[float] | None = None,
                 what: str = "the rollout engine") -> dict[str, float]:
    """Score the probe ``ids`` on the engine (``llm.probe_logprobs(ids)``) and with the trainer's ``model``
    (:func:`agent.backends.hf.sequence_logprobs`; or take the trainer's log-probs ``want``, e.g. computed once
    for several engines or by a sharded model's forward on every rank); returns
    ``{"sync/probe_lp_diff_mean": ..., "sync/probe_lp_diff_max": ...}`` (nats). Raises
    :class:`WeightSyncError` naming the probe (and the engine: ``what``) when the mean difference exceeds
    ``tol`` or the engine returns another number of log-probs."""
    got = [float(x) for x in llm.probe_logprobs(ids)]
    want = sequence_logprobs(model, ids) if want is None else want
    if len(got) != len(want):
        raise WeightSyncError(f"{what} scored {len(got)} tokens of the weight-sync probe, not {len(want)}")
    diff = (torch.tensor(got) - torch.tensor(want)).abs()
    mean, mx = float(diff.mean()), float(diff.max())
    if not mean <= tol:  # NaN fails too
        raise WeightSyncError(
            f"{what} does not run the trainer's weights: its log-probs of the weight-sync probe "
            f"({len(ids)} tokens of {PROBE_TEXT[:40]!r}...) differ from the trainer's by {mean:.4g} nats per token "
            f"on average (at most {mx:.4g}, token {int(diff.argmax()) + 1}), over train.rollout.sync_probe_tol={tol:g}: a "
            "weight the engine did not load, LoRA adapters not merged into the push, or another model. (An "
            "engine in lower precision than the trainer differs a little anyway: raise the tolerance if the "
            "difference logged as sync/probe_lp_diff_mean was this large from the start.)")
    return {"sync/probe_lp_diff_mean": mean, "sync/probe_lp_diff_max": mx}


def verify_engine(llm: Any, model: Any, pushed: dict[str, torch.Tensor] | None, tc: Any,
                  probe: list[int] | None) -> dict[str, float]:
    """Check the rollout backend ``llm`` against the trainer's full ``model`` after a push of ``pushed`` (the
    state dict sent; ``None`` for the check before the first step): its shared in-process copy, when it has one
    (``llm.shared_model``), tensor by tensor; its ``probe_logprobs`` on ``probe`` within
    ``tc.rollout.sync_probe_tol``
    (:func:`check_engine`). A backend on ``model`` itself has nothing to check. Returns the ``sync/...``
    statistics; raises :class:`WeightSyncError`."""
    stats: dict[str, float] = {}
    if getattr(llm, "model", None) is model:
        return stats
    shared = getattr(llm, "shared_model", None)
    if shared is not None and pushed is not None:
        stats["sync/tensors_checked"] = float(check_tensors(shared, pushed, "the rollout process's shared copy"))
    if probe is not None and callable(getattr(llm, "probe_logprobs", None)):
        stats.update(check_engine(llm, model, probe, tc.rollout.sync_probe_tol))
    return stats
