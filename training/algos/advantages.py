"""Advantage estimators' math: from rewards (per trajectory, per turn or per token) to advantages.

Each estimator is a small function of tensors naming its paper; :mod:`training.algos.estimators` registers
them under the names ``train.algorithm`` takes. Outcome level (``[N] -> [N]``): GRPO, Dr. GRPO, RLOO,
REINFORCE++, Stratified GRPO; token level: GAE for PPO; turn level: IGPO's turn advantages; and the helpers
that fold turn values onto tokens and charge searches.

Common inputs: ``rewards`` ``[N]`` float32 (one scalar per trajectory), ``groups`` ``[N]`` int64
(trajectories sampled for the same prompt share a group id); token tensors are ``[N, T-1]``, aligned with
``Batch.loss_mask``.

Conventions shared by all group estimators: a group whose rewards are all equal gets advantage 0, and a
group of one trajectory has no baseline and gets advantage 0 (so a batch of one trajectory never moves the
policy under GRPO/RLOO/Dr. GRPO). Standard deviations are unbiased (``torch.std``, as verl).
"""
from __future__ import annotations

import torch

from training.infra.distributed import all_reduce_sum, world


def segment_stats(values: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element mean, unbiased std and count of the segment (equal ``keys``) it belongs to (all ``[N]``).

    The mean is taken of the values shifted by the segment's minimum (``lo + mean(v - lo)``): for a segment
    of equal values the shifted values are exactly 0, so its mean is exactly the value and ``v - mean`` and
    the std are exactly 0 (a float32 ``sum / n`` of equal values need not round back to the value)."""
    values = values.float()
    uniq, inv = torch.unique(keys, return_inverse=True)
    G = uniq.numel()
    count = torch.zeros(G, dtype=torch.float32).index_add_(0, inv, torch.ones_like(values))
    lo = torch.full((G,), float("inf")).scatter_reduce(0, inv, values, "amin")
    total = torch.zeros(G, dtype=torch.float32).index_add_(0, inv, values - lo[inv])
    mean = lo + total / count
    sq = torch.zeros(G, dtype=torch.float32).index_add_(0, inv, (values - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    return mean[inv], std[inv], count[inv]


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6, norm_std: bool = True
) -> torch.Tensor:
    """GRPO (Shao et al., 2024, DeepSeekMath): ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased standard deviation of the group (as ``torch.std`` in verl). With
    ``norm_std=False`` this is Dr. GRPO's advantage (Liu et al., 2025). A group whose rewards are all equal
    gets advantage 0; a group of one trajectory has no baseline and gets advantage 0.
    """
    rewards = rewards.float()
    mean, std, count = segment_stats(rewards, groups)
    adv = rewards - mean
    if norm_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def dr_grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean_g``.

    No division by the group std (which over-weights easy and hard prompts); the matching loss drops the
    per-sequence length normalisation too: use ``train.algorithm.loss_agg_mode=seq-mean-token-sum-norm`` (the paper's
    constant normaliser) or ``seq-mean-token-sum``.
    """
    return grpo_advantages(rewards, groups, norm_std=False)


def rloo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024, "Back to Basics: Revisiting REINFORCE Style Optimization"; Kool et al.,
    2019): the baseline of sample ``i`` is the mean of the *other* samples of its group,
    ``A_i = r_i - (sum_g - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g)``; 0 for groups of one."""
    rewards = rewards.float()
    mean, _, count = segment_stats(rewards, groups)
    adv = (rewards - mean) * count / (count - 1).clamp(min=1.0)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def reinforce_pp_advantages(rewards: torch.Tensor, groups: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs"): no critic,
    no per-prompt baseline; the return (the reward, minus a per-token KL penalty when ``train.algorithm.kl_mode=reward``)
    is normalised over the *whole batch*: ``A_i = (r_i - mean_batch) / (std_batch + eps)``.

    ``groups`` is ignored (kept for a uniform signature). One trajectory, or all rewards equal, gives 0.
    """
    rewards = rewards.float()
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    mean, std, _ = segment_stats(rewards, torch.zeros_like(rewards, dtype=torch.long))  # exact 0 when all equal
    return (rewards - mean) / (std + eps)


def stratified_grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, strata: torch.Tensor, alpha: float = 0.5, eps: float = 1e-6
) -> torch.Tensor:
    """Stratified GRPO (Zhu et al., 2025, "Stratified GRPO: Handling Structural Heterogeneity in RL of LLM
    Search Agents"), Stratified Advantage Normalisation blended with the global estimate.

    ``strata`` ``[N]`` int64 is the structural key of each trajectory (its number of search calls). Within
    each prompt group, trajectories are compared only with peers of their stratum:
    ``A_SAN = (r - mean_{g,k}) / (std_{g,k} + eps)``; the global estimate is GRPO's over the whole group,
    ``A_GN``; the advantage is ``alpha * A_SAN + (1 - alpha) * A_GN`` (``alpha = 1``: pure SAN). A stratum
    of one trajectory contributes 0 to the SAN part.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    rewards = rewards.float()
    key = groups.long() * (int(strata.max().item()) + 1 if strata.numel() else 1) + strata.long()
    mean, std, count = segment_stats(rewards, key)
    san = torch.where(count > 1, (rewards - mean) / (std + eps), torch.zeros_like(rewards))
    return alpha * san + (1.0 - alpha) * grpo_advantages(rewards, groups, eps)


def to_token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[N]`` trajectory advantages to ``[N, T]`` tokens, zero outside the loss ``mask``."""
    return advantages.float().unsqueeze(-1) * mask.float()


# -- token level: PPO with GAE ------------------------------------------------------------------------
def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, total=None) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (verl's ``masked_whiten``; unbiased variance); zero
    outside the mask. ``values``, ``mask``: ``[N, T]``. ``total(t)`` turns each local sum (a 0-d tensor) into
    the sum over the whole batch; default: the local sum itself (under torchrun :func:`batch_masked_whiten`
    passes a sum over ranks)."""
    total = total or (lambda t: t)
    mask = mask.float()
    n = total(mask.sum())
    if n < 2:
        return torch.zeros_like(values)
    mean = total((values * mask).sum()) / n
    var = total((((values - mean) ** 2) * mask).sum()) / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` token rewards: each trajectory's scalar reward on its last policy token, 0 elsewhere."""
    mask = mask.float()
    out = torch.zeros_like(mask)
    has = mask.sum(-1) > 0
    T = mask.shape[1]
    last = (T - 1) - torch.argmax(mask.flip(-1), dim=-1)
    rows = torch.arange(mask.shape[0])[has]
    out[rows, last[has]] = rewards.float()[has]
    return out


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over policy tokens only, for PPO (Schulman et
    al., 2017) as in Search-R1's PPO runs.

    ``token_rewards``, ``values``, ``mask``: ``[N, T]`` float. The time axis is the subsequence of policy
    tokens (``mask == 1``): tool and prompt tokens are skipped, so a turn's last token bootstraps from the
    value of the next turn's first token across the retrieved documents (the environment's transition).
    ``delta_t = r_t + gamma V_next - V_t``; ``A_t = delta_t + gamma lam A_next``; the value after the last
    policy token is 0. Returns ``(advantages, returns)`` ``[N, T]`` with ``returns = A + V`` (the critic's
    target, before whitening); advantages are whitened over the mask when ``whiten``. Both zero off-mask.
    """
    mask = mask.float()
    N, T = mask.shape
    adv = torch.zeros(N, T, dtype=torch.float32)
    next_v = torch.zeros(N)
    next_a = torch.zeros(N)
    r, v = token_rewards.float(), values.float().detach()
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = a * m
        next_v = torch.where(m > 0, v[:, t], next_v)
        next_a = torch.where(m > 0, a, next_a)
    returns = (adv + v) * mask
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


# -- turn level: IGPO information gain and search cost ---------------------------------------------------
def igpo_turn_advantages(
    turn_rewards: torch.Tensor, turn_valid: torch.Tensor, groups: torch.Tensor, gamma: float = 1.0, eps: float = 1e-6
) -> torch.Tensor:
    """IGPO (Wang et al., 2025, "Information Gain-based Policy Optimization"): turn-level advantages.

    ``turn_rewards`` ``[N, K]`` float: the reward of each turn (the information gain of a search turn, the
    outcome reward on the last turn, plus any search-cost term); ``turn_valid`` ``[N, K]`` bool (the turn
    exists). Turn rewards are z-normalised over *all valid turns of the same group* (IGPO's group-wise
    normalisation), then accumulated with discount ``gamma``: ``A_k = sum_{j >= k} gamma^(j-k) R~_j``.
    Returns ``[N, K]`` float32, 0 at invalid turns.
    """
    N, K = turn_rewards.shape
    valid = turn_valid.bool()
    flat_r = turn_rewards.float()[valid]
    flat_g = groups.long().unsqueeze(-1).expand(N, K)[valid]
    mean, std, count = segment_stats(flat_r, flat_g)
    norm = torch.zeros(N, K)
    norm[valid] = torch.where(count > 1, (flat_r - mean) / (std + eps), torch.zeros_like(flat_r))
    adv = torch.zeros(N, K)
    acc = torch.zeros(N)
    for k in range(K - 1, -1, -1):
        acc = torch.where(valid[:, k], norm[:, k] + gamma * acc, acc)
        adv[:, k] = acc * valid[:, k].float()
    return adv


def turns_to_tokens(turn_values: torch.Tensor, token_turns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fold ``[N, K]`` per-turn values onto tokens: token ``t`` of turn ``k >= 1`` gets ``turn_values[:, k-1]``.

    ``token_turns``: ``[N, T]`` int64 (``Batch.turn_ids`` of the *target* tokens, i.e. ``turn_ids[:, 1:]``);
    ``mask``: ``[N, T]``. Tokens of turn 0 (the prompt) or of a turn beyond ``K`` get 0; the result is
    zero off-mask.
    """
    K = turn_values.shape[1]
    idx = (token_turns.long() - 1).clamp(0, max(K - 1, 0))
    ok = (token_turns >= 1) & (token_turns <= K)
    vals = turn_values.float().gather(1, idx) if K else torch.zeros_like(mask, dtype=torch.float32)
    return torch.where(ok, vals, torch.zeros_like(vals)) * mask.float()


def search_cost_to_go(is_search: torch.Tensor, turn_valid: torch.Tensor, cost: float) -> torch.Tensor:
    """Search-cost term (as SEM / IKEA reward a lean search budget): ``[N, K]`` cost-to-go
    ``-cost * #{search turns j >= k}`` (undiscounted), 0 at invalid turns. Added to the outcome advantage of
    every token of turn ``k`` so that each search call is charged to the turns that led to it."""
    s = (is_search.bool() & turn_valid.bool()).float()
    togo = torch.flip(torch.cumsum(torch.flip(s, [1]), 1), [1])
    return -cost * togo * turn_valid.float()


def batch_masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """:func:`masked_whiten` (``[N, T]`` float) over the whole batch: under torchrun the mean and variance are
    those of every rank's masked entries (each sum reduced over ranks), so PPO's advantages are whitened as
    one process whitens the whole batch. A collective under torchrun; the plain function on one process."""
    if world()[1] == 1:
        return masked_whiten(values, mask, eps)
    return masked_whiten(values, mask, eps, total=lambda t: t.new_tensor(all_reduce_sum(float(t))))
