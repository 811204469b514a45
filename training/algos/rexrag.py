"""REX-RAG (Jiang et al., 2025, "REX-RAG: Reasoning Exploration with Policy Correction in Retrieval-Augmented
Generation", arXiv 2508.08149): escape dead ends by probing, and keep the update unbiased by an importance
correction for the probed tokens.

A *dead end* is a rollout that commits to a wrong answer; sampling the same question again mostly repeats it.
REX-RAG's mixed sampling: a rollout that answered wrongly is, with probability ``p`` (the reference scripts'
20 %), cloned without its final answer, a *hint* drawn uniformly from a fixed pool ("perhaps I missed
something ...") is written after the kept prefix, and the policy continues from there (:func:`dead_ends`,
:func:`probe_plan`). The probe rollout joins its question's group. Its tokens were not all drawn from the
policy: the hint comes from the pool and the prefix is one the policy is known to have failed from. The
behaviour distribution of the batch is the mixture ``mu = (1 - alpha) pi_old + alpha pi_probe``, ``alpha`` the
share of probe rollouts in the batch (:func:`mixture_weights`), and the PPO ratio uses it,
``r_t = pi(y_t) / mu(y_t)`` (:func:`behaviour_logprobs`), with ``pi_probe`` per token:

* hint tokens: the pool's probability of the token after the hint prefix so far (the product over the hint is
  the share of pool hints with those tokens; :func:`hint_logprobs`); the hint tokens are trained (the policy
  learns to write such a reflection), so they are policy tokens of the loss;
* prefix tokens (before the hint): ``pi_old / err^(1/n)`` with ``n`` the prefix's policy tokens and ``err`` the
  batch's error rate, so that the prefix's probability is ``pi_old(prefix) / P(wrong)``: the prefix is drawn
  given that it failed;
* tokens the policy wrote after the hint: ``pi_old``.

An ordinary rollout has ``pi_probe = 0`` (it holds no hint), so its behaviour probability is
``(1 - alpha) pi_old``.

Reference implementation followed (MiliLab/REX-RAG): ``LLMGenerationManager.execute_predictions`` and
``_delete_contents`` in ``search_r1/llm_agent/generation.py`` (the probe trigger: a wrong answer of a
not-yet-cloned rollout, ``random.randint(0, 100) < revision_prob`` with ``revision_prob = 20``; the answer is
cut and a random hint of ``thinking_prompts.revision_prompts`` appended), ``PrefixIndex`` in
``verl/workers/actor/exploration_distribution.py`` (the hint pool's prefix probabilities) and the importance
block of ``DataParallelPPOActor.update_policy`` in ``verl/workers/actor/dp_actor.py`` (``alpha`` =
``cloned_traj_ratio``, ``error_rate = 1 - acc``). Differences: the prefix cut is at the start of the final
answer turn (Sleuth never re-tokenises text, so the final turn's reasoning is dropped with its answer), the
prefix division is spread over the prefix's policy tokens (the reference spreads it over every response token,
tool tokens included, which are masked), and the hint pool is Sleuth's own wording.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent.trajectory import Role, Trajectory
from training.algos.options import check_range, parse_options

#: the probe hints (each starts a reflection the policy continues; drawn uniformly)
DEFAULT_HINTS = (
    "<think> I may have missed something important; let me look again.",
    "<think> My reasoning so far could contain an error; let me reconsider.",
    "<think> Perhaps a key fact was overlooked; I should check once more.",
    "<think> I am not sure this is right; let me verify the evidence.",
    "<think> There might be a gap in what I found; let me search differently.",
    "<think> Let me step back and re-examine the question and the evidence.",
)


@dataclass(frozen=True)
class RexRagOptions:
    """REX-RAG's options: ``probe_prob`` (the chance that a wrong answer is probed) and ``hints`` (the pool).
    Raises ``ValueError`` for a probability outside [0, 1] or an empty pool or hint."""

    probe_prob: float = 0.2
    hints: tuple[str, ...] = DEFAULT_HINTS

    def __post_init__(self) -> None:
        check_range("REX-RAG's probe_prob", self.probe_prob, 0.0, 1.0)
        if not self.hints or any(not h.strip() for h in self.hints):
            raise ValueError("REX-RAG needs a non-empty pool of non-empty hints")


def rexrag_options(values: dict[str, Any] | None = None) -> RexRagOptions:
    """:class:`RexRagOptions` from a mapping (``hints`` as any sequence of strings); ``ValueError`` for an
    unknown name or a value out of range."""
    values = dict(values or {})
    if "hints" in values:
        values["hints"] = tuple(values["hints"])
    return parse_options(RexRagOptions, values, "REX-RAG")


def dead_ends(answered: torch.Tensor, correct: torch.Tensor, probed: torch.Tensor, u: torch.Tensor,
              probe_prob: float) -> torch.Tensor:
    """``[N]`` bool: the rollouts to probe. A rollout is probed when it ended with an answer that is wrong, is
    not itself a probe, and its draw ``u ~ U[0, 1)`` is below ``probe_prob``. All inputs ``[N]``."""
    return answered.bool() & ~correct.bool() & ~probed.bool() & (u.float() < probe_prob)


def probe_cut(traj: Trajectory) -> int:
    """The kept prefix of a probed rollout, in tokens: everything before the first policy token of its final
    turn, which must be its answer (the prompt, every earlier turn and their tool results). Raises
    ``ValueError`` when the rollout did not end with an answer."""
    if not traj.turns:
        raise ValueError(f"trajectory {traj.question_id} has no turns to probe")
    last = max(traj.turns, key=lambda t: t.index)
    if last.action != "answer":
        raise ValueError(f"trajectory {traj.question_id} did not end with an answer (its last turn is "
                         f"{last.action!r}): only a wrong answer is a dead end")
    for pos, (role, turn) in enumerate(zip(traj.roles, traj.turn_ids, strict=True)):
        if turn == last.index and role == Role.POLICY:
            return pos
    raise ValueError(f"trajectory {traj.question_id}: its final turn has no policy tokens")


@dataclass(frozen=True)
class ProbePlan:
    """A probe: clone row ``row``, keep its first ``keep_tokens`` tokens, write hint ``hint_index`` (``hint``)
    as the start of the next turn, and let the policy continue."""

    row: int
    keep_tokens: int
    hint_index: int
    hint: str


def probe_plan(trajs: Sequence[Trajectory], dead: torch.Tensor, opts: RexRagOptions,
               rng: random.Random) -> list[ProbePlan]:
    """The probes of a batch: one :class:`ProbePlan` per dead end (``dead`` ``[N]`` bool, from
    :func:`dead_ends`), in row order, each with a hint drawn uniformly from the pool by ``rng``."""
    out = []
    for i in dead.nonzero().flatten().tolist():
        k = rng.randrange(len(opts.hints))
        out.append(ProbePlan(i, probe_cut(trajs[i]), k, opts.hints[k]))
    return out


def probe_masks(n_tokens: int, keep_tokens: int, hint_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prefix [T], hint [T])`` bool over a probe rollout's ``n_tokens`` token positions: the kept prefix
    ``[0, keep_tokens)`` and the hint ``[keep_tokens, keep_tokens + hint_len)`` (the policy's continuation
    follows). Shift both by one (``[1:]``) to align them with the loss's target positions. Raises
    ``ValueError`` when the hint does not fit."""
    if keep_tokens < 0 or hint_len < 1 or keep_tokens + hint_len > n_tokens:
        raise ValueError(f"a hint of {hint_len} tokens after a prefix of {keep_tokens} does not fit in {n_tokens}")
    pos = torch.arange(n_tokens)
    return pos < keep_tokens, (pos >= keep_tokens) & (pos < keep_tokens + hint_len)


def hint_logprobs(hint_ids: Sequence[int], pool_ids: Sequence[Sequence[int]]) -> list[float]:
    """``log pi_probe`` of each token of a hint (natural logs): the share of pool hints that continue the hint's
    prefix with this token, among those that share the prefix (a prefix tree over the tokenised pool; the sum
    is the log of the share of pool hints equal to this one). Raises ``ValueError`` for a hint not in the
    pool (probability 0)."""
    alive = [list(p) for p in pool_ids]
    out = []
    for t, tok in enumerate(hint_ids):
        nxt = [p for p in alive if len(p) > t and p[t] == tok]
        if not nxt:
            raise ValueError(f"the hint's token {t} ({tok}) continues no hint of the pool: not a pool hint")
        out.append(math.log(len(nxt) / len(alive)))
        alive = nxt
    return out


def mixture_weights(is_probe: torch.Tensor, correct: torch.Tensor) -> tuple[float, float]:
    """``(alpha, err)``: the share of probe rollouts in the batch and the error rate of its ordinary rollouts.
    ``is_probe``, ``correct``: ``[N]`` bool. Raises ``ValueError`` for a batch without ordinary rollouts."""
    probe = is_probe.bool()
    n_orig = int((~probe).sum())
    if n_orig == 0:
        raise ValueError("a batch of probe rollouts only: REX-RAG's mixture needs the ordinary rollouts")
    err = 1.0 - float(correct.bool()[~probe].float().mean())
    return float(probe.float().mean()), err


def behaviour_logprobs(old_logprobs: torch.Tensor, mask: torch.Tensor, is_probe: torch.Tensor,
                       hint_mask: torch.Tensor, hint_logp: torch.Tensor, prefix_mask: torch.Tensor,
                       alpha: float, error_rate: float) -> torch.Tensor:
    """``log mu`` per token, ``[B, T]`` float32, to use as the PPO ratio's denominator in place of
    ``old_logprobs`` at the policy tokens (``mask``; elsewhere ``old_logprobs`` is returned unchanged):
    ``mu = (1 - alpha) pi_old + alpha pi_probe`` with ``pi_probe`` as in the module docstring.

    ``old_logprobs``: ``[B, T]`` (``log pi_old``); ``is_probe``: ``[B]`` bool; ``hint_mask``: ``[B, T]`` the hint
    tokens of probe rows; ``hint_logp``: ``[B, T]`` their pool log-probabilities (:func:`hint_logprobs`; read
    at ``hint_mask`` only); ``prefix_mask``: ``[B, T]`` the kept prefix's tokens of probe rows (only its policy
    tokens, ``prefix_mask & mask``, are divided). Raises ``ValueError`` for ``alpha`` outside [0, 1) or an
    ``error_rate`` outside (0, 1] when a probe row has prefix tokens."""
    check_range("REX-RAG's probe share alpha", alpha, 0.0, 1.0, hi_open=True)
    m = mask.bool()
    probe = is_probe.bool().unsqueeze(-1) & m
    pre = prefix_mask.bool() & probe
    n_pre = pre.float().sum(-1, keepdim=True)
    if bool((n_pre > 0).any()):
        check_range("REX-RAG's error rate", error_rate, 0.0, 1.0, lo_open=True)
    pi_old = torch.exp(old_logprobs.float())
    scale = torch.where(n_pre > 0, torch.tensor(float(error_rate)) ** (-1.0 / n_pre.clamp(min=1.0)),
                        torch.ones_like(n_pre))
    mu = torch.where(pre, pi_old * scale, pi_old)
    mu = torch.where(hint_mask.bool() & probe, torch.exp(hint_logp.float()), mu)
    mu = torch.where(probe, mu, torch.zeros_like(mu))
    mix = torch.log((1.0 - alpha) * pi_old + alpha * mu)
    return torch.where(m, mix, old_logprobs.float())
