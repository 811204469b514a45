"""ARPO (Dong et al., 2025, "Agentic Reinforced Policy Optimization", arXiv 2507.19849): entropy-based adaptive
rollout and advantage attribution.

ARPO's observation: the policy's token entropy rises right after a tool result enters the context. Its rollout
spends one budget of ``M`` trajectories per question (``train.rollout.group_size``) in two ways:

1. *global samples*: ``N <= M`` trajectories sampled from the question, as GRPO does;
2. *step-level branches*: after each tool call, the first ``k`` tokens the policy writes are scored by their
   entropy ``H_t`` (summed over the window, divided by ``log V``: :func:`window_entropy`), compared with the
   entropy of the trajectory's first window ``H_initial``; ``dH_t = H_t - H_initial`` (:func:`entropy_changes`
   reads them off an episode). With probability
   ``P_t = alpha + beta * dH_t`` (clipped to [0, 1], :func:`branch_probability`) the partial trajectory is
   copied ``Z`` times (each copy continues independently from the same prefix), while ``M - N`` slots remain
   (:func:`branch_plan`). A question whose trajectories all ended before the budget was spent gets new global
   samples (:func:`refill_global`).

Branches share their prefix with their parent. ARPO's *advantage attribution*: with ``soft`` attribution the
rows are plain GRPO rows (a shared token appears in each row that holds it, each time with that row's own
advantage; in expectation the same as averaging); with ``hard`` attribution every shared token gets the mean
advantage of the rows that share it, and each row's own tokens keep its advantage
(:func:`hard_attributed_advantages`). The paper found ``soft`` better and uses it by default.

Reference implementation followed: ``vLLMRolloutWithTools.generate_sequences`` and ``_calc_entropy`` in
``ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py`` of the authors'
repository (RUC-NLPIR/ARPO): entropy over the top-``K`` log-probabilities the engine reports for the first 20
tokens after each tool result, divided by ``log V``; a branch is drawn with ``u ~ U(0, 1)`` when
``clip(u - beta * dH, 0, 1) <= alpha`` (that is, with probability ``clip(alpha + beta * dH, 0, 1)``); defaults
of its deep-search script: ``M = 16``, ``N = 8``, ``Z = 1`` (``beam_size = 2``), ``alpha = 0.5``,
``beta = 0.2``. The budget split of AEPO (Dong et al., 2025, "Agentic Entropy-Balanced Policy Optimization",
arXiv 2510.14545), the same authors' follow-up, is :func:`entropy_balanced_global_samples`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agent.trajectory import Role, Trajectory
from training.algos.options import check_range, parse_options

ATTRIBUTIONS = ("soft", "hard")


@dataclass(frozen=True)
class ARPOOptions:
    """ARPO's rollout options. ``group_size``: ``M``, the trajectories per question (the GRPO group);
    ``global_samples``: ``N``; ``branches``: ``Z``, the copies made of one partial trajectory at one tool step;
    ``branch_prob``: ``alpha``; ``entropy_weight``: ``beta``; ``entropy_window``: ``k`` tokens (after a tool
    result) whose entropy is measured; ``attribution``: ``"soft"`` or ``"hard"``. Raises ``ValueError`` for
    ``N`` outside ``[1, M]`` (a branching budget ``M - N`` larger than the group, or negative), ``Z < 1``,
    ``alpha`` outside [0, 1], ``beta < 0``, ``k < 1`` or an unknown attribution."""

    group_size: int = 16
    global_samples: int = 8
    branches: int = 1
    branch_prob: float = 0.5
    entropy_weight: float = 0.2
    entropy_window: int = 20
    attribution: str = "soft"

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"ARPO needs a group of at least one trajectory, got group_size={self.group_size}")
        if not 1 <= self.global_samples <= self.group_size:
            raise ValueError(
                f"ARPO's global samples N={self.global_samples} must lie in [1, M={self.group_size}] (the group's "
                f"rollout budget): the branching budget M - N={self.group_size - self.global_samples} would be "
                f"{'larger than the group' if self.global_samples < 1 else 'negative'}")
        if self.branches < 1:
            raise ValueError(f"ARPO's branches per tool step Z must be >= 1, got {self.branches}")
        check_range("ARPO's branch_prob (alpha)", self.branch_prob, 0.0, 1.0)
        check_range("ARPO's entropy_weight (beta)", self.entropy_weight, 0.0)
        if self.entropy_window < 1:
            raise ValueError(f"ARPO's entropy_window k must be >= 1 token, got {self.entropy_window}")
        if self.attribution not in ATTRIBUTIONS:
            raise ValueError(f"ARPO's attribution must be one of {ATTRIBUTIONS}, got {self.attribution!r}")

    @property
    def branch_budget(self) -> int:
        """``M - N``: the slots left for step-level branches."""
        return self.group_size - self.global_samples


def arpo_options(values: dict[str, Any] | None = None) -> ARPOOptions:
    """:class:`ARPOOptions` from a mapping; ``ValueError`` for an unknown name or a value out of range."""
    return parse_options(ARPOOptions, values, "ARPO")


# -- entropy -------------------------------------------------------------------------------------------
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy in nats of each next-token distribution, ``[..., V]`` logits (any float dtype) ->
    ``[...]`` float32: ``H = -sum_v p_v log p_v`` with ``p = softmax(logits)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def topk_entropy(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """ARPO's entropy estimate from the ``K`` log-probabilities an engine reports per token (vLLM's
    ``logprobs=K``): ``-sum_{k<=K} p_k log p_k`` over the listed tokens only, ``[..., K]`` -> ``[...]`` float32
    (a lower bound of the exact entropy; ``-inf`` entries, tokens the engine left out, add 0)."""
    lp = topk_logprobs.float()
    terms = torch.where(torch.isfinite(lp), lp.exp() * lp, torch.zeros_like(lp))
    return -terms.sum(-1)


def window_entropy(token_entropies: torch.Tensor | Sequence[float], k: int, vocab_size: int) -> float:
    """``H_t``: the summed entropy (nats) of the first ``k`` tokens of a generation window, divided by
    ``log V`` (ARPO's normalisation). ``token_entropies``: ``[T]`` per-token entropies of the window (fewer
    than ``k`` tokens: all of them; none: 0). Raises ``ValueError`` for ``k < 1`` or ``vocab_size < 2``."""
    if k < 1:
        raise ValueError(f"the entropy window must hold at least one token, got k={k}")
    if vocab_size < 2:
        raise ValueError(f"the vocabulary needs at least two tokens, got vocab_size={vocab_size}")
    h = torch.as_tensor(token_entropies, dtype=torch.float32).reshape(-1)[:k]
    return float(h.sum()) / math.log(vocab_size)


def entropy_changes(traj: Trajectory, token_entropies: Sequence[float], k: int, vocab_size: int) -> dict[int, float]:
    """``{turn: dH}`` of an episode: for each turn that follows a tool result, the window entropy of its first
    ``k`` policy tokens minus that of the episode's first turn (``H_initial``; :func:`window_entropy`).
    ``token_entropies``: one entropy (nats) per token of ``traj.token_ids`` (read at policy tokens only).
    The branching decision taken after turn ``k``'s tool result uses ``dH_k`` (the reference rollout measures
    the round just generated), and 0 for the first turn. Raises ``ValueError`` when the lengths differ."""
    if len(token_entropies) != len(traj.token_ids):
        raise ValueError(f"{len(token_entropies)} entropies for {len(traj.token_ids)} tokens")
    by_turn: dict[int, list[float]] = {}
    after_tool: set[int] = set()
    for h, role, turn in zip(token_entropies, traj.roles, traj.turn_ids, strict=True):
        if role == Role.POLICY:
            by_turn.setdefault(turn, []).append(float(h))
        elif role == Role.TOOL:
            after_tool.add(turn + 1)
    if not by_turn:
        return {}
    first = min(by_turn)
    h0 = window_entropy(by_turn[first], k, vocab_size)
    return {t: window_entropy(v, k, vocab_size) - h0 for t, v in sorted(by_turn.items()) if t in after_tool}


def branch_probability(delta_h: torch.Tensor | float, branch_prob: float, entropy_weight: float) -> torch.Tensor:
    """``P_t = clip(alpha + beta * dH_t, 0, 1)``: the probability that a partial trajectory is branched at a
    tool step whose entropy changed by ``dH_t`` (any shape; float32 of the same shape)."""
    d = torch.as_tensor(delta_h, dtype=torch.float32)
    return (branch_prob + entropy_weight * d).clamp(0.0, 1.0)


class Uniform(Protocol):
    """What :func:`branch_plan` draws from: ``random()`` in [0, 1) (a ``random.Random``)."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class BranchSource:
    """A partial trajectory that just received a tool result: its question's index ``group`` and its entropy
    change ``delta_h`` (``H_t - H_initial``)."""

    group: int
    delta_h: float


def branch_plan(sources: Sequence[BranchSource], rollouts: list[int], opts: ARPOOptions,
                rng: Uniform) -> list[int]:
    """The branches made at one tool step: for each source (in order), how many copies of it to start.

    ``rollouts``: the trajectories each question has so far (global samples plus branches), updated in place.
    Each question may grow to ``M`` trajectories; a source gets up to ``Z`` draws while its question has
    slots left, and each draw ``u = rng.random()`` makes a copy when ``u <= P_t``
    (:func:`branch_probability`); a failed draw uses no slot. Raises ``IndexError`` for a source of an
    unknown question."""
    out = [0] * len(sources)
    for i, src in enumerate(sources):
        remaining = opts.group_size - rollouts[src.group]
        if remaining <= 0:
            continue
        p = min(1.0, max(0.0, opts.branch_prob + opts.entropy_weight * float(src.delta_h)))  # as branch_probability
        for _ in range(min(opts.branches, remaining)):
            if rng.random() <= p:
                out[i] += 1
        rollouts[src.group] += out[i]
    return out


def refill_global(active: Sequence[int], rollouts: list[int], group_size: int) -> list[int]:
    """New global samples per question at the end of a round: a question with no unfinished trajectory and
    fewer than ``group_size`` trajectories starts one more from its question (as ARPO's rollout does, one per
    round, until the budget is spent). ``active``: unfinished trajectories per question; ``rollouts`` is
    updated in place."""
    out = []
    for g, (a, n) in enumerate(zip(active, rollouts, strict=True)):
        add = 1 if a == 0 and n < group_size else 0
        rollouts[g] += add
        out.append(add)
    return out


def entropy_balanced_global_samples(group_size: int, root_entropy: float, tool_entropies: Sequence[float],
                                    beta: float) -> int:
    """AEPO's (Agentic Entropy-Balanced PO) entropy pre-monitoring: the global samples
    ``m = k * sigmoid(beta * (H_root - mean(H_tool)))`` of a budget of ``k = group_size``, rounded and kept in
    ``[1, k]`` (a question more uncertain than its tool results gets more global samples, one whose tool
    results raise uncertainty more branches). ``tool_entropies`` empty: ``H_tool = H_root``, i.e. ``k / 2``.
    Raises ``ValueError`` for ``group_size < 1``."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    h_tool = sum(tool_entropies) / len(tool_entropies) if tool_entropies else root_entropy
    x = beta * (root_entropy - h_tool)
    sig = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))  # no overflow
    return min(group_size, max(1, math.floor(group_size * sig + 0.5)))


# -- advantage attribution ---------------------------------------------------------------------------------
def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix_lengths(token_ids: Sequence[Sequence[int]], groups: Sequence[int]) -> torch.Tensor:
    """``[N, N]`` int64: the length (tokens) of the common prefix of rows ``i`` and ``j`` of the same group (a
    branch shares its parent's tokens up to the branching point), 0 across groups; the diagonal is each row's
    length."""
    n = len(token_ids)
    out = torch.zeros(n, n, dtype=torch.long)
    for i in range(n):
        out[i, i] = len(token_ids[i])
        for j in range(i + 1, n):
            if int(groups[i]) == int(groups[j]):
                out[i, j] = out[j, i] = _lcp(token_ids[i], token_ids[j])
    return out


def hard_attributed_advantages(advantages: torch.Tensor, token_ids: Sequence[Sequence[int]],
                               groups: Sequence[int]) -> torch.Tensor:
    """ARPO's hard advantage attribution, ``[N, T]`` float32 over each row's token positions (``T`` = the
    longest row; 0 past a row's end): token ``t`` of row ``i`` gets the mean advantage of the rows of its group
    whose common prefix with row ``i`` covers ``t`` (row ``i`` included), so a token shared by ``d`` rows gets
    ``(1/d) sum A_j`` and a row's own tokens keep ``A_i``. ``advantages``: ``[N]`` (e.g. GRPO's over the whole
    group, branches included). The caller masks prompt and tool tokens and shifts to the loss's target
    positions (``[:, 1:]``)."""
    adv = advantages.float()
    n = len(token_ids)
    T = max((len(t) for t in token_ids), default=0)
    lcp = shared_prefix_lengths(token_ids, groups)
    out = torch.zeros(n, T)
    pos = torch.arange(T)
    for i in range(n):
        covers = pos.unsqueeze(0) < lcp[i].unsqueeze(1)  # [N, T]: row j shares token t with row i
        count = covers.float().sum(0)
        total = (covers.float() * adv.unsqueeze(1)).sum(0)
        out[i] = torch.where(count > 0, total / count.clamp(min=1.0), torch.zeros(T))
    return out
