"""The advantage-estimator registry and the built-in estimators' registrations.

Each estimator is registered in :data:`ADV_ESTIMATORS` under the name ``train.algorithm`` takes (verl's
``register_adv_est`` pattern; :mod:`training.registry`); its math lives in :mod:`training.algos.advantages`
and :mod:`training.algos.turn_credit`. Two ways in:

* :func:`register_outcome_adv_est`: an outcome-level estimator ``fn(rewards [N], groups [N],
  search_calls [N], tc) -> [N]``. The wrapper subtracts the KL penalty (``train.kl_mode=reward``), runs it on
  the whole batch under torchrun (every rank's rows gathered), broadcasts the result to the policy tokens
  and adds the per-turn search cost. GRPO, Dr. GRPO, RLOO, REINFORCE++ and Stratified GRPO are such.
* :func:`register_adv_est`: a token-level estimator ``fn(inp: AdvantageInputs, tc) -> {"advantages":
  [N, T-1], "returns"?: [N, T-1]}`` (PPO with GAE, IGPO's turn-level information gain, GiGPO,
  evidence-gain IGPO), declaring what it needs (a critic, group structure, per-turn gold-answer
  probabilities) so the trainer provides it.

``tc`` is the :class:`training.config.TrainConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from training.algos.advantages import (
    batch_masked_whiten,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    igpo_turn_advantages,
    last_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    search_cost_to_go,
    stratified_grpo_advantages,
    to_token_advantages,
    turns_to_tokens,
)
from training.algos.rewards import information_gain_rewards, turn_table
from training.algos.turn_credit import anchor_states, evidence_gain, gigpo_advantages
from training.infra.distributed import gather_objects, world
from training.registry import Registry


@dataclass
class AdvantageInputs:
    """What the trainer hands an estimator for one batch (this rank's rows under torchrun).

    * ``rewards`` ``[N]`` float32: the judge's outcome rewards; ``groups`` ``[N]`` int64;
    * ``mask`` ``[N, T-1]`` float32: the loss mask; ``token_turns`` ``[N, T-1]`` int64: the turn of each
      target token (``Batch.turn_ids[:, 1:]``);
    * ``turn_valid``, ``is_search`` ``[N, K]`` bool: which turns exist, and which searched
      (:func:`training.algos.rewards.turn_table`); ``search_calls`` ``[N]`` int64;
    * ``trajs``: the trajectories themselves (anything else an estimator wants to read);
    * ``values`` ``[N, T-1]``: the critic's values (estimators registered with ``critic=True``);
    * ``gold_probs``: per-turn gold-answer probabilities (``gold_probs=True``,
      :func:`training.model.forward.gold_answer_probs`);
    * ``kl_tokens`` ``[N, T-1]``: the per-token KL to the reference when it is a reward penalty
      (``train.kl_mode=reward``), else ``None``; :meth:`kl_seq` is its per-trajectory sum.
    """

    rewards: torch.Tensor
    groups: torch.Tensor
    mask: torch.Tensor
    token_turns: torch.Tensor
    turn_valid: torch.Tensor
    is_search: torch.Tensor
    search_calls: torch.Tensor
    trajs: list[Any]
    values: torch.Tensor | None = None
    gold_probs: list[list[float]] | None = None
    kl_tokens: torch.Tensor | None = None

    def kl_seq(self) -> torch.Tensor:
        """``[N]``: each trajectory's summed per-token KL penalty (zeros without one)."""
        if self.kl_tokens is None:
            return torch.zeros_like(self.rewards)
        return (self.kl_tokens * self.mask).sum(-1)


def advantage_inputs(batch: Any, trajs: list[Any], **extra: Any) -> AdvantageInputs:
    """:class:`AdvantageInputs` of a :class:`training.batch.Batch` and its trajectories, plus ``extra``
    (``values``, ``gold_probs``, ``kl_tokens``)."""
    valid, is_search = turn_table(trajs)
    return AdvantageInputs(
        rewards=batch.rewards.float(), groups=batch.groups, mask=batch.loss_mask,
        token_turns=batch.turn_ids[:, 1:], turn_valid=valid, is_search=is_search,
        search_calls=torch.tensor([t.num_search_calls for t in trajs], dtype=torch.long), trajs=trajs, **extra)


@dataclass(frozen=True)
class AdvEstimator:
    """A registered estimator: ``fn(inp, tc) -> {"advantages", "returns"?}`` and what it needs: a value
    model (``critic``: ``train.critic`` must be set), group structure (``groups``: ``train.group_size >= 2``),
    per-turn gold-answer probabilities (``gold_probs``)."""

    name: str
    fn: Callable[[AdvantageInputs, Any], dict[str, torch.Tensor]]
    critic: bool = False
    groups: bool = False
    gold_probs: bool = False


ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator", "train.algorithm")


def register_adv_est(name: str, *, critic: bool = False, groups: bool = False, gold_probs: bool = False,
                     replace: bool = False):
    """Decorator: register ``fn(inp: AdvantageInputs, tc) -> {"advantages": [N, T-1], "returns"?: [N, T-1]}``
    as ``train.algorithm=<name>`` (advantages zero off the loss mask; ``returns`` are the critic's targets)."""

    def wrap(fn):
        ADV_ESTIMATORS.add(name, AdvEstimator(name, fn, critic, groups, gold_probs), replace=replace)
        return fn

    return wrap


def register_outcome_adv_est(name: str, *, groups: bool = True, replace: bool = False):
    """Decorator: register an outcome-level ``fn(rewards [N], groups [N], search_calls [N], tc) -> [N]`` as
    ``train.algorithm=<name>``. The trainer calls it on ``rewards - kl_coef * KL`` (with
    ``train.kl_mode=reward``) of the whole batch (gathered over ranks under torchrun, so batch statistics are
    those of one process; an episode split into several training sequences once, :func:`episode_rows`),
    broadcasts the result to every policy token of the trajectory and adds the per-turn search cost-to-go
    (``train.search_cost``). ``groups``: the estimator compares trajectories of a
    group, so ``train.group_size`` must be >= 2."""

    def wrap(fn):
        def estimate(inp: AdvantageInputs, tc: Any) -> dict[str, torch.Tensor]:
            rewards = inp.rewards - tc.kl_coef * inp.kl_seq()
            split = episode_rows(inp.trajs)
            if split is None:
                adv = gathered_outcome(fn, rewards, inp.groups, inp.search_calls, tc)
            else:  # an episode split into several training sequences counts once in its group's statistics
                inverse, first = split
                per_ep = torch.zeros(len(first)).index_add_(0, inverse, rewards - inp.rewards) + inp.rewards[first]
                calls = torch.zeros(len(first), dtype=torch.long).index_add_(0, inverse, inp.search_calls)
                adv = gathered_outcome(fn, per_ep, inp.groups[first], calls, tc)[inverse]
            tok = to_token_advantages(adv, inp.mask)
            if tc.search_cost > 0:
                cost = search_cost_to_go(inp.is_search, inp.turn_valid, tc.search_cost)
                tok = tok + turns_to_tokens(cost, inp.token_turns, inp.mask)
            return {"advantages": tok}

        ADV_ESTIMATORS.add(name, AdvEstimator(name, estimate, groups=groups), replace=replace)
        return fn

    return wrap


def episode_rows(trajs: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a batch where some episodes were split into several training sequences (an external agent whose
    chat template rewrote history: ``metadata["episode"]`` and ``["segments"] > 1``,
    :mod:`agent.external.stitch`): ``(inverse [N], first [E])``, each row's episode among the ``E`` distinct
    episodes and each episode's first row; ``None`` when every row is a whole episode. Episodes are told apart
    by (group, episode id)."""
    keys: list[tuple] = []
    for i, t in enumerate(trajs):
        meta = getattr(t, "metadata", None) or {}
        ep = meta.get("episode") if (meta.get("segments") or 1) > 1 else None
        keys.append(("episode", t.group, ep) if ep is not None else ("row", i))
    if len(set(keys)) == len(keys):
        return None
    index: dict[tuple, int] = {}
    inverse, first = [], []
    for i, k in enumerate(keys):
        if k not in index:
            index[k] = len(index)
            first.append(i)
        inverse.append(index[k])
    return torch.tensor(inverse), torch.tensor(first)


def gathered_outcome(fn: Callable[..., torch.Tensor], rewards: torch.Tensor, groups: torch.Tensor,
                     search_calls: torch.Tensor, tc: Any) -> torch.Tensor:
    """``fn`` over the whole batch: under torchrun every rank's ``[N_r]`` rewards, groups and search calls are
    gathered (each rank's group ids moved past the previous ranks'), so batch statistics (REINFORCE++'s
    normalisation, Stratified GRPO's global term) are those of one process on the whole batch; returns this
    rank's ``[N_r]`` rows. One process: ``fn`` itself. A collective under torchrun."""
    rank, W = world()
    if W == 1:
        return fn(rewards, groups, search_calls, tc)
    R: list[float] = []
    G: list[int] = []
    S: list[int] = []
    for i, (r, g, s) in enumerate(gather_objects((rewards.tolist(), groups.tolist(), search_calls.tolist()))):
        if i == rank:
            start = len(R)
        base = max(G, default=-1) + 1  # this rank's groups after the previous ranks'
        R.extend(r)
        G.extend(base + x for x in g)
        S.extend(s)
    adv = fn(torch.tensor(R, dtype=torch.float32), torch.tensor(G), torch.tensor(S), tc)
    return adv[start : start + len(rewards)]


def compute_advantages(tc: Any, inp: AdvantageInputs) -> dict[str, torch.Tensor]:
    """Per-token advantages ``[N, T-1]`` (aligned with the loss mask) of the registered estimator
    ``tc.algorithm``: ``{"advantages"}``, plus ``{"returns"}`` for a critic's targets. Raises ``ValueError``
    for an unknown estimator or when an input it declared (values, gold probabilities) is missing. A
    collective under torchrun for estimators with batch statistics: every rank must call it."""
    entry = ADV_ESTIMATORS.get(tc.algorithm)
    if entry.critic and inp.values is None:
        raise ValueError(f"{entry.name} needs critic values")
    if entry.gold_probs and inp.gold_probs is None:
        raise ValueError(f"{entry.name} needs the per-turn gold-answer probabilities")
    return entry.fn(inp, tc)


# -- registrations ------------------------------------------------------------------------------------
@register_outcome_adv_est("grpo")
def _grpo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor, tc: Any) -> torch.Tensor:
    return grpo_advantages(rewards, groups)


@register_outcome_adv_est("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor, tc: Any) -> torch.Tensor:
    return dr_grpo_advantages(rewards, groups)


@register_outcome_adv_est("rloo")
def _rloo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor, tc: Any) -> torch.Tensor:
    return rloo_advantages(rewards, groups)


@register_outcome_adv_est("reinforce_pp", groups=False)
def _reinforce_pp(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor, tc: Any) -> torch.Tensor:
    return reinforce_pp_advantages(rewards, groups)


@register_outcome_adv_est("stratified_grpo")
def _stratified_grpo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
                     tc: Any) -> torch.Tensor:
    """Strata: the number of search calls of each trajectory; ``train.stratified_alpha`` blends SAN in."""
    return stratified_grpo_advantages(rewards, groups, search_calls, tc.stratified_alpha)


@register_adv_est("ppo", critic=True)
def _ppo(inp: AdvantageInputs, tc: Any) -> dict[str, torch.Tensor]:
    """GAE over policy tokens on the outcome reward at the last policy token (minus the search cost, and the
    per-token KL penalty with ``train.kl_mode=reward``), whitened over the whole batch."""
    costs = inp.rewards - tc.search_cost * inp.is_search.float().sum(-1)
    token_r = last_token_rewards(costs, inp.mask)
    if inp.kl_tokens is not None:
        token_r = token_r - tc.kl_coef * inp.kl_tokens * inp.mask
    adv, ret = gae_advantages(token_r, inp.values, inp.mask, tc.gamma, tc.lam, whiten=False)
    return {"advantages": batch_masked_whiten(adv, inp.mask), "returns": ret}


@register_adv_est("igpo", groups=True, gold_probs=True)
def _igpo(inp: AdvantageInputs, tc: Any) -> dict[str, torch.Tensor]:
    """IGPO: each search turn earns ``ig_coef`` times its information gain, the last turn the outcome reward
    (minus the KL penalty); every search turn pays the search cost; :func:`igpo_turn_advantages` then
    folds onto the turns' tokens."""
    valid, is_search = inp.turn_valid, inp.is_search
    turn_r = tc.ig_coef * information_gain_rewards(inp.gold_probs, valid) - tc.search_cost * is_search.float()
    last = valid.long().cumsum(-1).argmax(-1)  # column of each trajectory's last valid turn
    rows = torch.arange(len(inp.rewards))
    turn_r[rows, last] = (inp.rewards - tc.kl_coef * inp.kl_seq()) - tc.search_cost * is_search[rows, last].float()
    turn_adv = igpo_turn_advantages(turn_r, valid, inp.groups, tc.gamma)
    return {"advantages": turns_to_tokens(turn_adv, inp.token_turns, inp.mask)}


# -- turn-level credit ---------------------------------------------------------------------------------
def outcome_turn_rewards(inp: AdvantageInputs, tc: Any) -> torch.Tensor:
    """``[N, K]`` turn rewards of an outcome episode: the outcome (minus the KL penalty with
    ``train.kl_mode=reward``) on each trajectory's last valid turn and ``-train.search_cost`` on every search
    turn; their sum over turns is the episode's return."""
    valid = inp.turn_valid
    turn_r = -tc.search_cost * inp.is_search.float() * valid.float()
    last = valid.long().cumsum(-1).argmax(-1)  # column of each trajectory's last valid turn
    rows = torch.arange(len(inp.rewards))
    turn_r[rows, last] += inp.rewards.float() - tc.kl_coef * inp.kl_seq()
    return turn_r


@register_adv_est("gigpo", groups=True)
def _gigpo(inp: AdvantageInputs, tc: Any) -> dict[str, torch.Tensor]:
    """GiGPO over the observation-history anchor states, ``train.gigpo_omega``, ``train.gamma`` and
    ``train.gigpo_std_norm``."""
    turn_r = outcome_turn_rewards(inp, tc)
    states = anchor_states(inp.trajs, inp.turn_valid.shape[1])
    adv = gigpo_advantages(turn_r.sum(-1), inp.groups, turn_r, inp.turn_valid, states, tc.gamma, tc.gigpo_omega,
                           tc.gigpo_std_norm)
    return {"advantages": turns_to_tokens(adv, inp.token_turns, inp.mask)}


@register_adv_est("evidence_igpo", groups=True)
def _evidence_igpo(inp: AdvantageInputs, tc: Any) -> dict[str, torch.Tensor]:
    """IGPO's turn rewards and advantages (:func:`training.algos.advantages.igpo_turn_advantages`:
    z-normalised over the group's turns, accumulated with ``train.gamma``) with the evidence gain
    (:func:`training.algos.turn_credit.evidence_gain`, weight ``train.ig_coef``) in place of the probability
    gain: the outcome (minus the KL penalty) on the last turn, ``-train.search_cost`` on every search turn."""
    gain = evidence_gain(inp.trajs, inp.turn_valid.shape[1]) * inp.turn_valid.float()
    turn_r = tc.ig_coef * gain + outcome_turn_rewards(inp, tc)
    adv = igpo_turn_advantages(turn_r, inp.turn_valid, inp.groups, tc.gamma)
    return {"advantages": turns_to_tokens(adv, inp.token_turns, inp.mask)}
