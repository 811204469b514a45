"""Reward shaping that needs the trajectories or the model: turn tables, IGPO information gain, KL penalty.

* :func:`turn_table`: which turns each trajectory has and which of them searched (``[N, K]`` bool);
* :func:`turn_boundaries`, :func:`answer_ids`: where each turn ends and how the gold answer is written, for
  :func:`gold_answer_probs` (the policy's probability of the gold answer after each turn) and
  :func:`information_gain_rewards`, IGPO's information-gain turn reward (Wang et al., 2025);
* :func:`kl_penalty`: per-token KL to the reference as a reward penalty (InstructGPT / verl's
  ``apply_kl_penalty``; REINFORCE++ folds it into the return);
* :data:`REWARDS`: the registry of training rewards (``train.algorithm.reward``, its settings in
  ``train.algorithm.reward_options``): what each episode is trained on, computed once per step from the
  judge's verdicts before the advantages (:func:`training_rewards`). ``judge`` (the default) keeps the judge's
  reward; ``egrpo`` (E-GRPO's entity reward for near misses), ``ikea`` (IKEA's knowledge-boundary reward) and
  ``ssrl`` (SSRL's format and rule reward) replace it. A plugin adds one with :func:`register_reward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agent.llm import encode
from agent.trajectory import Trajectory
from training.algos.egrpo import EGRPOOptions, egrpo_rewards, entity_match_rate, gold_entities, reasoning_text
from training.algos.knowledge_boundary import IKEAOptions, ikea_rewards
from training.algos.losses import kl_estimate
from training.algos.priming import parse_docs
from training.algos.ssrl import SSRLOptions, ssrl_format_score, ssrl_reward
from training.batch import Batch
from training.registry import Options, Registry, decorator, options_class


def turn_table(trajs: list[Trajectory], max_turns: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid [N, K], is_search [N, K])`` bool, ``K = max_turns`` or the longest trajectory's turn count.

    Turn ``k`` (1-based in the trajectory) is column ``k - 1``; ``valid`` marks the turns that exist.
    """
    K = max_turns or max((max((t.index for t in tr.turns), default=0) for tr in trajs), default=0)
    K = max(K, 1)
    valid = torch.zeros(len(trajs), K, dtype=torch.bool)
    search = torch.zeros(len(trajs), K, dtype=torch.bool)
    for i, tr in enumerate(trajs):
        for t in tr.turns:
            if 1 <= t.index <= K:
                valid[i, t.index - 1] = True
                search[i, t.index - 1] = t.action == "search"
    return valid, search


def turn_boundaries(traj: Trajectory) -> list[int]:
    """Token offsets ``[b_0, b_1, ..., b_K]``: ``b_0`` = end of the prompt, ``b_k`` = end of turn ``k``
    (its policy tokens and the tool observation answering it)."""
    ends: dict[int, int] = {}
    for pos, turn in enumerate(traj.turn_ids):
        ends[turn] = pos + 1
    K = max((t.index for t in traj.turns), default=0)
    out = [traj.prompt_len]
    for k in range(1, K + 1):
        out.append(max(ends.get(k, out[-1]), out[-1]))
    return out


def answer_ids(tokenizer: Any, gold: str) -> tuple[list[int], int, int]:
    """``(ids, start, end)``: the token ids of ``<answer> gold </answer>`` tokenised as one string, as the
    policy writes it, and the span ``[start, end)`` of the gold answer's own tokens in them (so ``" Paris"``,
    not a separate token for the space before ``</answer>``). Where tokens merge across the answer's edges,
    the three parts are tokenised apart instead. An empty ``gold`` gives an empty span."""
    head, upto = encode(tokenizer, "<answer>"), encode(tokenizer, f"<answer> {gold}")
    full = encode(tokenizer, f"<answer> {gold} </answer>")
    if gold and full[: len(upto)] == upto and upto[: len(head)] == head and len(upto) > len(head):
        return full, len(head), len(upto)
    body = encode(tokenizer, f" {gold}") if gold else []
    return head + body + encode(tokenizer, " </answer>"), len(head), len(head) + len(body)


def gold_answer_probs(logprobs: Callable[[Batch], torch.Tensor], tokenizer: Any, trajs: list[Trajectory],
                      batch_rows: int = 32, max_len: int | None = None) -> list[list[float]]:
    """For each trajectory, ``[p_0, ..., p_K]``: the policy's probability of the gold answer given the
    episode up to each turn boundary (:func:`turn_boundaries`), as IGPO's information gain uses it.

    The answer ``<answer> gold </answer>`` is teacher-forced after the prefix (tokenised as the policy would
    write it, :func:`answer_ids`) and ``p`` is the geometric mean of the gold tokens' probabilities
    (length-normalised, so answers of different lengths compare). The first gold answer is used. ``max_len``
    keeps the last ``max_len`` tokens of a long prefix. ``logprobs(batch) -> [n, T-1]`` scores a batch whose
    loss mask marks the gold positions (the policy's forward,
    :func:`training.model.forward.policy_logprobs`: its LM head runs there only), ``batch_rows`` rows at a
    time."""
    rows: list[tuple[int, list[int], int, int]] = []  # (traj index, ids, gold start, gold end)
    for i, tr in enumerate(trajs):
        answer, g0, g1 = answer_ids(tokenizer, tr.golden_answers[0] if tr.golden_answers else "")
        for b in turn_boundaries(tr):
            prefix = tr.token_ids[:b]
            if max_len is not None:
                prefix = prefix[-max(max_len - len(answer), 1):]
            rows.append((i, prefix + answer, len(prefix) + g0, len(prefix) + g1))
    out: list[list[float]] = [[] for _ in trajs]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for c in range(0, len(rows), batch_rows):
        chunk = rows[c : c + batch_rows]
        T = max(len(r[1]) for r in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), T), dtype=torch.long)
        for j, (_, seq, _, _) in enumerate(chunk):
            ids[j, : len(seq)] = torch.tensor(seq)
            attn[j, : len(seq)] = 1
        at_gold = torch.zeros((len(chunk), T - 1))  # positions predicting a gold token: the "loss mask"
        for j, (_, _, s, e) in enumerate(chunk):
            at_gold[j, s - 1 : e - 1] = 1.0
        zeros = torch.zeros(len(chunk), T, dtype=torch.long)
        batch = Batch(ids, attn, zeros, at_gold, zeros, torch.zeros(len(chunk)), torch.zeros(len(chunk), dtype=torch.long))
        lp = logprobs(batch).cpu()
        for j, (i, _, s, e) in enumerate(chunk):
            if e > s:
                out[i].append(math.exp(float(lp[j, s - 1 : e - 1].mean())))
            else:
                out[i].append(0.0)
    return out


def information_gain_rewards(probs: list[list[float]], valid: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` information gain of each turn, ``p_k - p_{k-1}`` (IGPO), 0 at invalid turns."""
    N, K = valid.shape
    ig = torch.zeros(N, K)
    for i, p in enumerate(probs):
        for k in range(1, min(len(p), K + 1)):
            ig[i, k - 1] = p[k] - p[k - 1]
    return ig * valid.float()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """``[N, T]`` per-token KL(pi || pi_ref) estimates at policy tokens (0 elsewhere), to subtract from the
    reward with coefficient ``train.algorithm.kl_coef`` (``kl_mode=reward``)."""
    return kl_estimate(logprobs, ref_logprobs, kind) * mask.float()


# -- the reward registry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewardEntry:
    """A registered training reward: ``fn(trajs, groups [N] int64, opts) -> [N] float32``, the reward each
    episode is trained on, computed from what the judge recorded (``Trajectory.verdict``: ``em``,
    ``format_ok``, ...), the episode itself (turns, search calls, metadata) and, for a group-aware reward, its
    group; ``options``: its settings (``train.algorithm.reward_options``, a frozen
    :class:`training.registry.Options` dataclass)."""

    name: str
    fn: Callable[[list[Trajectory], torch.Tensor, Any], torch.Tensor]
    options: type[Options] = Options


REWARDS: Registry[RewardEntry] = Registry("reward", "train.algorithm.reward")


def register_reward(name: str, *, options: type[Options] = Options, replace: bool = False):
    """Decorator: register ``fn(trajs, groups, opts) -> [N]`` as ``train.algorithm.reward=<name>`` with its
    options class (``train.algorithm.reward_options``). Raises ``TypeError`` for options that are not a frozen
    dataclass of :class:`training.registry.Options`."""
    opts_cls = options_class(options, f"reward {name!r}")
    return decorator(REWARDS, name, lambda fn: RewardEntry(name, fn, opts_cls), replace)


def training_rewards(alg: Any, trajs: list[Trajectory], groups: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32: the rewards of ``trajs`` under ``alg.reward`` (``alg``: the ``train.algorithm`` section)
    with its ``reward_options``. For any reward but ``judge`` each trajectory's ``reward`` is set to it (the
    step's logged ``reward`` is the one trained on) and the judge's is kept as ``verdict["judge_reward"]``."""
    entry = REWARDS.get(alg.reward)
    out = entry.fn(trajs, groups, alg.reward_options).float()
    if entry.name != "judge":
        for t, r in zip(trajs, out.tolist(), strict=True):
            t.verdict.setdefault("judge_reward", t.reward)
            t.reward = r
    return out


def _verdicts(trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correct [N] bool, format_ok [N] bool)`` from the judge's verdicts (``em == 1``, ``format_ok``)."""
    correct = torch.tensor([float(t.verdict.get("em", 0.0)) >= 1.0 for t in trajs], dtype=torch.bool)
    fmt = torch.tensor([bool(t.verdict.get("format_ok", t.answer is not None)) for t in trajs], dtype=torch.bool)
    return correct, fmt


@register_reward("judge")
def judge_reward(trajs: list[Trajectory], groups: torch.Tensor, opts: Options) -> torch.Tensor:
    """The judge's own reward (``agent.reward``, ``agent.format_reward``, ``agent.judge``), unchanged."""
    return torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)


@register_reward("egrpo", options=EGRPOOptions)
def egrpo_reward(trajs: list[Trajectory], groups: torch.Tensor, opts: EGRPOOptions) -> torch.Tensor:
    """E-GRPO (Zhao et al., 2025, arXiv 2510.24694): 1 for a correct answer, ``alpha * gamma^`` for a wrong
    one, 0 for a format error (:func:`training.algos.egrpo.egrpo_rewards`), with ``gamma`` the share of the
    question's gold entities its own turns wrote. Gold entities: ``metadata["entities"]``, else the
    synthetic chain without its answer, else the titles of the supporting passages that any episode of the
    batch retrieved (their titles read off the observations; a question whose supporting passages nobody
    found has none: its wrong answers score 0, as GRPO's)."""
    correct, fmt = _verdicts(trajs)
    titles = retrieved_titles(trajs)
    rates = torch.tensor([entity_match_rate(reasoning_text(t), gold_entities(t.question, t.metadata, titles))
                          for t in trajs], dtype=torch.float32)
    return egrpo_rewards(correct, fmt, rates, groups, opts)


def retrieved_titles(trajs: list[Trajectory]) -> dict[str, str]:
    """Passage id -> title of every passage the episodes' searches returned (the observation's ``Doc i(Title:
    ...)`` lines, in the order of ``Turn.hit_ids``)."""
    out: dict[str, str] = {}
    for t in trajs:
        for turn in t.turns:
            docs = parse_docs(turn.observation)
            if len(docs) == len(turn.hit_ids):
                out.update((pid, title) for pid, (title, _) in zip(turn.hit_ids, docs, strict=True))
    return out


@register_reward("ikea", options=IKEAOptions)
def ikea_reward(trajs: list[Trajectory], groups: torch.Tensor, opts: IKEAOptions) -> torch.Tensor:
    """IKEA's knowledge-boundary reward (Huang et al., 2025, arXiv 2505.07596; the authors'
    ``compute_score_em``): ``format_penalty`` for an invalid format, ``1 + r_kb+ (1 - min(RT, RT_max) /
    RT_max)`` for a correct answer after ``RT`` searches, ``r_kb-`` for a wrong one that searched, 0 for a
    wrong one that did not (:func:`training.algos.knowledge_boundary.ikea_rewards`)."""
    correct, fmt = _verdicts(trajs)
    searches = torch.tensor([t.num_search_calls for t in trajs], dtype=torch.long)
    return ikea_rewards(correct, fmt, searches, opts)


def episode_response(traj: Trajectory) -> str:
    """The episode's response as one text: each turn's generated text, a search turn's observation after it
    inside ``<information>`` tags (as a self-search response writes it)."""
    parts = []
    for turn in sorted(traj.turns, key=lambda x: x.index):
        parts.append(turn.text.strip())
        if turn.action == "search" and turn.observation is not None:
            parts.append(f"<information>{turn.observation.strip()}</information>")
    return "".join(parts)


@register_reward("ssrl", options=SSRLOptions)
def ssrl_reward_fn(trajs: list[Trajectory], groups: torch.Tensor, opts: SSRLOptions) -> torch.Tensor:
    """SSRL's rule reward (Fan et al., 2025, arXiv 2508.10874; the authors' ``NaiveRewardManager``):
    ``em_weight * EM + format_weight * format`` with the format score of
    :func:`training.algos.ssrl.ssrl_format_score` on :func:`episode_response`."""
    return torch.tensor([ssrl_reward(float(t.verdict.get("em", 0.0)), ssrl_format_score(episode_response(t), opts),
                                     opts) for t in trajs], dtype=torch.float32)
