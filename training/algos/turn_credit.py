"""Turn-level credit for multi-turn search episodes: the math of advantage estimators that give each turn its
own value.

An outcome estimator (GRPO and its kin) writes one number on every token of an episode: the search that
found the missing document and the one that wasted a turn are credited alike. The estimators here compare
*turns*, each registered in :data:`training.algos.estimators.ADV_ESTIMATORS`:

* ``gigpo``: GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training";
  reference implementation ``verl-agent``'s ``gigpo/core_gigpo.py``). The episode-level group advantage of
  GRPO plus a step-level advantage computed over *anchor states*: the same environment state reached by
  several rollouts of a group. Here a state is the dialogue's observation history before a turn (the
  retrieved documents and tool messages so far, in order; the policy's own wording of a query does not
  matter when it retrieved the same documents). The actions taken from one anchor state form a step group;
  each action's discounted return is normalised within it.
* ``evidence_igpo``: Sleuth's variant of IGPO (Wang et al., 2025) whose information gain is read from the
  documents instead of the policy: a search turn earns ``train.algorithm.options.ig_coef`` when the gold answer enters the
  episode's context for the first time in its result. IGPO's gain (the policy's probability of the gold
  answer after the turn) is blind where the policy cannot yet *read* the answer from the evidence it
  retrieved (a tiny policy that never learnt to copy a kind of token gives p(gold) ~ 0 with the right
  document in context), so the search chain that found the evidence gets no credit; the rule-based gain
  credits the search that reached the answer-bearing document at whatever depth, and it costs no forward
  pass. It reads the gold answer (as the EM reward does), never the hop count.

Turn ``k`` is column ``k - 1`` of the ``[N, K]`` turn tensors (:func:`training.algos.rewards.turn_table`);
:func:`training.algos.advantages.turns_to_tokens` writes a turn's value on its policy tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from agent.metrics import normalize_answer
from training.algos.advantages import grpo_advantages, segment_stats


# -- GiGPO ---------------------------------------------------------------------------------------------
def anchor_states(trajs: list[Any], K: int) -> list[list[tuple[str, ...] | None]]:
    """``[N][K]`` anchor-state keys: for turn ``k`` of trajectory ``i`` (column ``k - 1``), the tuple of the
    observations (tool texts) of turns ``1 .. k-1``, the state the policy acted from; ``None`` where the turn
    does not exist. Every trajectory's first turn has the key ``()`` (the question alone)."""
    out: list[list[tuple[str, ...] | None]] = []
    for tr in trajs:
        row: list[tuple[str, ...] | None] = [None] * K
        seen: list[str] = []
        for t in sorted(tr.turns, key=lambda t: t.index):
            if 1 <= t.index <= K:
                row[t.index - 1] = tuple(seen)
            seen.append(t.observation or "")
        out.append(row)
    return out


def discounted_turn_returns(turn_rewards: torch.Tensor, turn_valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[N, K]`` return-to-go ``R_k = sum_{j >= k} gamma^(j - k) r_j`` over the valid turns (invalid turns are
    skipped, not discounted over), 0 at invalid turns. ``turn_rewards`` ``[N, K]`` float, ``turn_valid``
    ``[N, K]`` bool."""
    N, K = turn_rewards.shape
    valid = turn_valid.bool()
    out = torch.zeros(N, K)
    acc = torch.zeros(N)
    for k in range(K - 1, -1, -1):
        acc = torch.where(valid[:, k], turn_rewards[:, k].float() + gamma * acc, acc)
        out[:, k] = acc * valid[:, k].float()
    return out


def gigpo_step_advantages(returns: torch.Tensor, turn_valid: torch.Tensor, groups: torch.Tensor,
                          states: list[list[Any]], eps: float = 1e-6, norm_std: bool = True) -> torch.Tensor:
    """GiGPO's step-level relative advantage ``A^S`` (its Eq. 6-7), ``[N, K]`` float32.

    The step group of turn ``k`` of trajectory ``i`` is every valid turn of the same prompt group whose
    anchor state (``states[i][k]``, any hashable) is the same. ``A^S = (R - mean) / (std + eps)`` over the
    step group (unbiased std; ``norm_std=False``: ``R - mean``, the paper's ``F_norm = 1`` variant); a step
    group of one turn gets 0, as does a step group whose returns are all equal. ``returns`` ``[N, K]``:
    the discounted return-to-go of each turn (:func:`discounted_turn_returns`)."""
    N, K = returns.shape
    valid = turn_valid.bool()
    ids: dict[tuple[int, Any], int] = {}
    keys = torch.full((N, K), -1, dtype=torch.long)
    for i in range(N):
        for k in range(K):
            if valid[i, k]:
                keys[i, k] = ids.setdefault((int(groups[i]), states[i][k]), len(ids))
    flat_r, flat_key = returns.float()[valid], keys[valid]
    mean, std, count = segment_stats(flat_r, flat_key)
    adv = flat_r - mean
    if norm_std:
        adv = adv / (std + eps)
    out = torch.zeros(N, K)
    out[valid] = torch.where(count > 1, adv, torch.zeros_like(adv))
    return out


def gigpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, turn_rewards: torch.Tensor, turn_valid: torch.Tensor,
                     states: list[list[Any]], gamma: float = 1.0, omega: float = 1.0,
                     norm_std: bool = True) -> torch.Tensor:
    """GiGPO (Feng et al., 2025): ``A(a_k) = A^E(episode) + omega * A^S(a_k)``, ``[N, K]`` float32 per turn.

    ``rewards`` ``[N]``: each episode's return (the episode-level group advantage ``A^E`` is GRPO's over
    the prompt group, its Eq. 3); ``turn_rewards`` ``[N, K]``: the reward of each turn (the outcome on the
    last turn, any per-turn cost on its turn), whose discounted return-to-go is each turn's step return;
    ``states``: the anchor-state keys (:func:`anchor_states`). What GiGPO changes over GRPO is the second
    term: two rollouts that reached the same documents and then did different things are told apart by
    what followed, at the turn where they diverged, with no critic and no extra rollouts. ``gamma`` is the
    step return's discount (the paper's 0.95 on ALFWorld; 1 here by default, so that a longer correct
    search chain is not worth less than a shorter one); ``omega`` weights the step term (the paper's 1)."""
    ep = grpo_advantages(rewards, groups, norm_std=norm_std)
    ret = discounted_turn_returns(turn_rewards, turn_valid, gamma)
    step = gigpo_step_advantages(ret, turn_valid, groups, states, norm_std=norm_std)
    return (ep.unsqueeze(-1) + omega * step) * turn_valid.float()


# -- evidence-gain IGPO ----------------------------------------------------------------------------------
def _contains(text: str, answers: list[str]) -> bool:
    """Whether a normalised gold answer occurs in the normalised ``text`` as a whole word sequence."""
    padded = f" {normalize_answer(text)} "
    return any(a and f" {a} " in padded for a in (normalize_answer(g) for g in answers))


def evidence_gain(trajs: list[Any], K: int) -> torch.Tensor:
    """``[N, K]`` float32: 1 at the turn whose observation first puts a gold answer (SQuAD-normalised, as a
    whole word sequence) into the episode's context, 0 elsewhere and for an answer the question already
    holds. Trajectory ``i``'s turn ``k`` is column ``k - 1``."""
    out = torch.zeros(len(trajs), K)
    for i, tr in enumerate(trajs):
        if not tr.golden_answers or _contains(tr.question, tr.golden_answers):
            continue
        for t in sorted(tr.turns, key=lambda t: t.index):
            if 1 <= t.index <= K and t.observation and _contains(t.observation, tr.golden_answers):
                out[i, t.index - 1] = 1.0
                break
    return out
