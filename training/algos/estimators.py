"""The advantage-estimator registry and the built-in estimators' registrations.

Each estimator is one registration in :data:`ADV_ESTIMATORS`, under the name ``train.algorithm.adv_estimator``
takes (verl's ``register_adv_est`` pattern, :mod:`training.registry`), in this file or a plugin module named
in the config's ``plugins``; its math lives in :mod:`training.algos.advantages` and
:mod:`training.algos.turn_credit`. A registration carries everything the estimator needs, so neither the
trainer nor the config schema names it:

* ``fn``: the estimator itself;
* ``options``: its own settings, a frozen dataclass subclassing :class:`training.registry.Options` (ranges
  checked in ``__post_init__``), that the config nests as ``train.algorithm.options`` and validates when it is
  loaded (unknown keys are errors; values converted to the field types);
* ``prepare``: the steps that compute its inputs beyond the batch (:class:`PrepareContext`: the batch, the
  trajectories, the models, the tokenizer, the rollout worker), run by the trainer's score phase, each
  writing onto the :class:`training.batch.Batch`: the KL penalty when it is a reward
  (:func:`kl_reward_penalty`), the critic's values (:func:`critic_values`), IGPO's gold-answer
  probabilities (:func:`gold_probs`), or anything a new estimator needs (``batch.prepared[name]``);
* ``critic`` / ``groups``: it needs a value model (``train.algorithm.critic``) / group structure
  (``train.rollout.group_size >= 2``), checked when the config is validated.

Two ways in:

* :func:`register_outcome_adv_est`: an outcome-level estimator ``fn(rewards [N], groups [N], search_calls [N],
  opts) -> [N]``. The wrapper subtracts the KL penalty (``kl_mode=reward``), runs it on the whole batch under
  torchrun (every rank's rows gathered), broadcasts the result to the policy tokens and adds the per-turn
  search cost. GRPO, Dr. GRPO, RLOO, REINFORCE++ and Stratified GRPO are such.
* :func:`register_adv_est`: a token-level estimator ``fn(inp: AdvantageInputs, opts, alg) -> {"advantages":
  [N, T-1], "returns"?: [N, T-1]}`` (PPO with GAE, IGPO's turn-level information gain, GiGPO, evidence-gain
  IGPO); ``alg`` is the ``train.algorithm`` section (``gamma``, ``lam``, ``kl_coef``, ``search_cost``).

``opts`` is the estimator's options (``train.algorithm.options``), an instance of its ``options`` model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from corpora.formats import QAExample
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
from training.algos.aepo import AEPOOptions, aepo_select, aepo_temperature, replace_rows
from training.algos.arpo import ATTRIBUTIONS, hard_attributed_advantages
from training.algos.options import check_range
from training.algos.rewards import (
    gold_answer_probs,
    information_gain_rewards,
    kl_penalty,
    training_rewards,
    turn_table,
)
from training.algos.turn_credit import anchor_states, evidence_gain, gigpo_advantages
from training.batch import Batch, collate
from training.infra.distributed import gather_objects, world
from training.registry import Options, Registry, options_class


@dataclass
class AdvantageInputs:
    """What an estimator reads for one batch (this rank's rows under torchrun), built from the
    :class:`training.batch.Batch` and its trajectories by :func:`advantage_inputs`.

    * ``rewards`` ``[N]`` float32: the judge's outcome rewards; ``groups`` ``[N]`` int64;
    * ``mask`` ``[N, T-1]`` float32: the loss mask; ``token_turns`` ``[N, T-1]`` int64: the turn of each
      target token (``Batch.turn_ids[:, 1:]``);
    * ``turn_valid``, ``is_search`` ``[N, K]`` bool: which turns exist, and which searched
      (:func:`training.algos.rewards.turn_table`); ``search_calls`` ``[N]`` int64;
    * ``trajs``: the trajectories themselves (anything else an estimator wants to read);
    * ``values`` ``[N, T-1]``: the critic's values (``Batch.old_values``, :func:`critic_values`);
    * ``kl_tokens`` ``[N, T-1]``: the per-token KL to the reference when it is a reward penalty
      (``Batch.kl_tokens``, :func:`kl_reward_penalty`), else ``None``; :meth:`kl_seq` is its per-trajectory
      sum;
    * ``prepared``: what the estimator's own prepare steps put in ``Batch.prepared`` (IGPO: ``gold_probs``).
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
    kl_tokens: torch.Tensor | None = None
    prepared: dict[str, Any] = field(default_factory=dict)

    def kl_seq(self) -> torch.Tensor:
        """``[N]``: each trajectory's summed per-token KL penalty (zeros without one)."""
        if self.kl_tokens is None:
            return torch.zeros_like(self.rewards)
        return (self.kl_tokens * self.mask).sum(-1)


def advantage_inputs(batch: Batch, trajs: list[Any]) -> AdvantageInputs:
    """:class:`AdvantageInputs` of a scored :class:`training.batch.Batch` (its prepare steps run) and its
    trajectories."""
    valid, is_search = turn_table(trajs)
    return AdvantageInputs(
        rewards=batch.rewards.float(), groups=batch.groups, mask=batch.loss_mask,
        token_turns=batch.turn_ids[:, 1:], turn_valid=valid, is_search=is_search,
        search_calls=torch.tensor([t.num_search_calls for t in trajs], dtype=torch.long), trajs=trajs,
        values=batch.old_values, kl_tokens=batch.kl_tokens, prepared=batch.prepared)


# -- preparing an estimator's inputs ------------------------------------------------------------------
@dataclass
class PrepareContext:
    """What an estimator's prepare steps may read, once per training step (built by the trainer's score
    phase, after the old and reference log-probs; everything of this rank under torchrun).

    * ``batch``: the step's :class:`training.batch.Batch`, ``old_logprobs`` (and ``ref_logprobs`` with a
      reference) scored; a step writes what it computes onto it: a typed field (``old_values``,
      ``kl_tokens``; or changes ``rewards``, ``loss_mask``, ``old_logprobs``) or ``batch.prepared[name]``;
    * ``trajs``: the batch's trajectories, row for row (tokens, roles, turns, verdicts, metadata);
    * ``tc``: the :class:`training.config.TrainConfig` (:attr:`options`: the estimator's options);
    * ``tokenizer``; ``max_len``: the episode budget (``agent.max_total_tokens``, tokens);
    * ``policy``: the full policy model the rollouts ran (a Hugging Face causal LM, in eval mode);
      ``ref_model``: the KL reference or ``None``; ``critic``: the value model or ``None``;
    * ``logprobs(batch) -> [N, T-1]`` float32: the policy's log-probs of a batch's loss-mask tokens (at
      ``batch.temperature``), for any batch a step builds (:func:`training.model.forward.policy_logprobs`);
    * ``values(batch) -> [N, T-1]`` float32: the critic's values on the update's micro-batches (``None``
      without a critic);
    * ``worker``: the rollout worker (its LLM, retriever, agent config and judge), for steps that sample more
      episodes or read the corpus (``None`` outside a training run); ``step``: the step (0-based);
    * ``entropy(batch) -> [N, T-1]`` float32: the policy's next-token entropy (nats) at a batch's loss-mask
      positions (at ``batch.temperature``; ``None`` outside a training run);
    * ``score(batch)``: fill a batch's ``old_logprobs`` (and ``ref_logprobs``) as the score phase does, for a
      batch a step rebuilds (``None`` outside a training run).

    A step may report numbers in ``batch.prepared["stats"]`` (a dict): they are logged in the step's record.
    """

    batch: Batch
    trajs: list[Any]
    tc: Any
    tokenizer: Any
    max_len: int
    policy: Any
    logprobs: Callable[[Batch], torch.Tensor]
    ref_model: Any | None = None
    critic: Any | None = None
    values: Callable[[Batch], torch.Tensor] | None = None
    worker: Any | None = None
    step: int = 0
    score: Callable[[Batch], None] | None = None
    entropy: Callable[[Batch], torch.Tensor] | None = None

    @property
    def options(self) -> Options:
        """The estimator's options (``train.algorithm.options``)."""
        return self.tc.algorithm.options


PrepareStep = Callable[[PrepareContext], None]


def kl_reward_penalty(ctx: PrepareContext) -> None:
    """``batch.kl_tokens`` ``[N, T-1]``: the per-token KL to the reference (``train.algorithm.kl_type``) when
    it is a reward penalty (``kl_mode=reward``, with a reference); left ``None`` otherwise. Every built-in
    estimator runs it (the default ``prepare``)."""
    b, alg = ctx.batch, ctx.tc.algorithm
    if b.ref_logprobs is not None and alg.kl_mode == "reward":
        b.kl_tokens = kl_penalty(b.old_logprobs, b.ref_logprobs, b.loss_mask, alg.kl_type)


def critic_values(ctx: PrepareContext) -> None:
    """``batch.old_values`` ``[N, T-1]``: the critic's values of the rollout (PPO's ``V_old``, for GAE and
    the clipped value loss). Raises ``ValueError`` without a critic."""
    if ctx.values is None:
        raise ValueError(f"{ctx.tc.algorithm.adv_estimator} needs a value model: set train.algorithm.critic")
    ctx.batch.old_values = ctx.values(ctx.batch)


def gold_probs(ctx: PrepareContext) -> None:
    """``batch.prepared["gold_probs"]``: per trajectory, the policy's probability of the gold answer after
    each turn (:func:`training.algos.rewards.gold_answer_probs`), IGPO's information gain's input."""
    ctx.batch.prepared["gold_probs"] = gold_answer_probs(ctx.logprobs, ctx.tokenizer, ctx.trajs, max_len=ctx.max_len)


def prepare_inputs(ctx: PrepareContext) -> None:
    """Run the prepare steps of the estimator ``ctx.tc.algorithm.adv_estimator``, in their order."""
    for prepare in ADV_ESTIMATORS.get(ctx.tc.algorithm.adv_estimator).prepare:
        prepare(ctx)


# -- the registry -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdvEstimator:
    """A registered estimator: ``fn(inp, opts, alg) -> {"advantages", "returns"?}``, its ``options`` model,
    its ``prepare`` steps (run in order before it, :class:`PrepareContext`) and what the config must provide:
    a value model (``critic``: ``train.algorithm.critic`` must be set), group structure (``groups``:
    ``train.rollout.group_size >= 2``)."""

    name: str
    fn: Callable[[AdvantageInputs, Any, Any], dict[str, torch.Tensor]]
    critic: bool = False
    groups: bool = False
    options: type[Options] = Options
    prepare: tuple[PrepareStep, ...] = (kl_reward_penalty,)


ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator", "train.algorithm.adv_estimator")


def register_adv_est(name: str, *, critic: bool = False, groups: bool = False, options: type[Options] = Options,
                     prepare: tuple[PrepareStep, ...] = (kl_reward_penalty,), replace: bool = False):
    """Decorator: register ``fn(inp: AdvantageInputs, opts, alg) -> {"advantages": [N, T-1], "returns"?:
    [N, T-1]}`` as ``train.algorithm.adv_estimator=<name>`` (advantages zero off the loss mask; ``returns``
    are the critic's targets), with its options class and prepare steps (see :class:`AdvEstimator`). Raises
    ``TypeError`` for options that are not a frozen dataclass of :class:`training.registry.Options`."""
    opts_cls = options_class(options, f"advantage estimator {name!r}")

    def wrap(fn):
        ADV_ESTIMATORS.add(name, AdvEstimator(name, fn, critic, groups, opts_cls, tuple(prepare)), replace=replace)
        return fn

    return wrap


def register_outcome_adv_est(name: str, *, groups: bool = True, options: type[Options] = Options,
                             prepare: tuple[PrepareStep, ...] = (kl_reward_penalty,), replace: bool = False):
    """Decorator: register an outcome-level ``fn(rewards [N], groups [N], search_calls [N], opts) -> [N]`` as
    ``train.algorithm.adv_estimator=<name>``. The trainer calls it on ``rewards - kl_coef * KL`` (with
    ``kl_mode=reward``) of the whole batch (gathered over ranks under torchrun, so batch statistics are
    those of one process; an episode split into several training sequences once, :func:`episode_rows`),
    broadcasts the result to every policy token of the trajectory and adds the per-turn search cost-to-go
    (``train.algorithm.search_cost``). ``groups``: the estimator compares trajectories of a group, so
    ``train.rollout.group_size`` must be >= 2; ``options`` and ``prepare`` as :func:`register_adv_est`."""
    opts_cls = options_class(options, f"advantage estimator {name!r}")

    def wrap(fn):
        def estimate(inp: AdvantageInputs, opts: Options, alg: Any) -> dict[str, torch.Tensor]:
            rewards = inp.rewards - alg.kl_coef * inp.kl_seq()
            split = episode_rows(inp.trajs)
            if split is None:
                adv = gathered_outcome(fn, rewards, inp.groups, inp.search_calls, opts)
            else:  # an episode split into several training sequences counts once in its group's statistics
                inverse, first = split
                per_ep = torch.zeros(len(first)).index_add_(0, inverse, rewards - inp.rewards) + inp.rewards[first]
                calls = torch.zeros(len(first), dtype=torch.long).index_add_(0, inverse, inp.search_calls)
                adv = gathered_outcome(fn, per_ep, inp.groups[first], calls, opts)[inverse]
            tok = to_token_advantages(adv, inp.mask)
            if alg.search_cost > 0:
                cost = search_cost_to_go(inp.is_search, inp.turn_valid, alg.search_cost)
                tok = tok + turns_to_tokens(cost, inp.token_turns, inp.mask)
            return {"advantages": tok}

        ADV_ESTIMATORS.add(name, AdvEstimator(name, estimate, groups=groups, options=opts_cls, prepare=tuple(prepare)),
                           replace=replace)
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
                     search_calls: torch.Tensor, opts: Options) -> torch.Tensor:
    """``fn`` over the whole batch: under torchrun every rank's ``[N_r]`` rewards, groups and search calls are
    gathered (each rank's group ids moved past the previous ranks'), so batch statistics (REINFORCE++'s
    normalisation, Stratified GRPO's global term) are those of one process on the whole batch; returns this
    rank's ``[N_r]`` rows. One process: ``fn`` itself. A collective under torchrun."""
    rank, W = world()
    if W == 1:
        return fn(rewards, groups, search_calls, opts)
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
    adv = fn(torch.tensor(R, dtype=torch.float32), torch.tensor(G), torch.tensor(S), opts)
    return adv[start : start + len(rewards)]


def compute_advantages(tc: Any, inp: AdvantageInputs) -> dict[str, torch.Tensor]:
    """Per-token advantages ``[N, T-1]`` (aligned with the loss mask) of the registered estimator
    ``tc.algorithm.adv_estimator`` with its options ``tc.algorithm.options``: ``{"advantages"}``, plus
    ``{"returns"}`` for a critic's targets. Raises ``ValueError`` for an unknown estimator or without the
    critic values it declared (its prepare steps did not run). A collective under torchrun for estimators with
    batch statistics: every rank must call it."""
    alg = tc.algorithm
    entry = ADV_ESTIMATORS.get(alg.adv_estimator)
    if entry.critic and inp.values is None:
        raise ValueError(f"{entry.name} needs critic values (its prepare step critic_values)")
    return entry.fn(inp, alg.options, alg)


# -- registrations ------------------------------------------------------------------------------------
@register_outcome_adv_est("grpo")
def _grpo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
          opts: Options) -> torch.Tensor:
    return grpo_advantages(rewards, groups)


@register_outcome_adv_est("dr_grpo")
def _dr_grpo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
             opts: Options) -> torch.Tensor:
    return dr_grpo_advantages(rewards, groups)


@register_outcome_adv_est("rloo")
def _rloo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
          opts: Options) -> torch.Tensor:
    return rloo_advantages(rewards, groups)


@register_outcome_adv_est("reinforce_pp", groups=False)
def _reinforce_pp(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
                  opts: Options) -> torch.Tensor:
    return reinforce_pp_advantages(rewards, groups)


@dataclass(frozen=True)
class StratifiedOptions(Options):
    """Stratified GRPO's setting: ``alpha`` in ``[0, 1]``, the weight of the stratified (SAN) advantage against
    the global one."""

    alpha: float = 0.5

    def __post_init__(self) -> None:
        check_range("stratified_grpo's alpha", self.alpha, 0.0, 1.0)


@register_outcome_adv_est("stratified_grpo", options=StratifiedOptions)
def _stratified_grpo(rewards: torch.Tensor, groups: torch.Tensor, search_calls: torch.Tensor,
                     opts: StratifiedOptions) -> torch.Tensor:
    """Strata: the number of search calls of each trajectory; the option ``alpha`` blends SAN in."""
    return stratified_grpo_advantages(rewards, groups, search_calls, opts.alpha)


@register_adv_est("ppo", critic=True, prepare=(kl_reward_penalty, critic_values))
def _ppo(inp: AdvantageInputs, opts: Options, alg: Any) -> dict[str, torch.Tensor]:
    """GAE (``alg.gamma``, ``alg.lam``) over policy tokens on the outcome reward at the last policy token
    (minus the search cost, and the per-token KL penalty with ``kl_mode=reward``), whitened over the whole
    batch."""
    costs = inp.rewards - alg.search_cost * inp.is_search.float().sum(-1)
    token_r = last_token_rewards(costs, inp.mask)
    if inp.kl_tokens is not None:
        token_r = token_r - alg.kl_coef * inp.kl_tokens * inp.mask
    adv, ret = gae_advantages(token_r, inp.values, inp.mask, alg.gamma, alg.lam, whiten=False)
    return {"advantages": batch_masked_whiten(adv, inp.mask), "returns": ret}


@dataclass(frozen=True)
class IGPOOptions(Options):
    """IGPO's (and evidence-gain IGPO's) setting: ``ig_coef`` >= 0, the weight of the information-gain turn
    reward."""

    ig_coef: float = 1.0

    def __post_init__(self) -> None:
        check_range("IGPO's ig_coef", self.ig_coef, 0.0)


@register_adv_est("igpo", groups=True, options=IGPOOptions, prepare=(kl_reward_penalty, gold_probs))
def _igpo(inp: AdvantageInputs, opts: IGPOOptions, alg: Any) -> dict[str, torch.Tensor]:
    """IGPO: each search turn earns ``ig_coef`` times its information gain (from the prepared
    ``gold_probs``), the last turn the outcome reward (minus the KL penalty); every search turn pays the
    search cost; :func:`igpo_turn_advantages` (``alg.gamma``) then folds onto the turns' tokens."""
    valid, is_search = inp.turn_valid, inp.is_search
    gain = information_gain_rewards(inp.prepared["gold_probs"], valid)
    turn_r = opts.ig_coef * gain - alg.search_cost * is_search.float()
    last = valid.long().cumsum(-1).argmax(-1)  # column of each trajectory's last valid turn
    rows = torch.arange(len(inp.rewards))
    turn_r[rows, last] = (inp.rewards - alg.kl_coef * inp.kl_seq()) - alg.search_cost * is_search[rows, last].float()
    turn_adv = igpo_turn_advantages(turn_r, valid, inp.groups, alg.gamma)
    return {"advantages": turns_to_tokens(turn_adv, inp.token_turns, inp.mask)}


# -- turn-level credit ---------------------------------------------------------------------------------
def outcome_turn_rewards(inp: AdvantageInputs, alg: Any) -> torch.Tensor:
    """``[N, K]`` turn rewards of an outcome episode: the outcome (minus the KL penalty with
    ``kl_mode=reward``) on each trajectory's last valid turn and ``-alg.search_cost`` on every search turn;
    their sum over turns is the episode's return."""
    valid = inp.turn_valid
    turn_r = -alg.search_cost * inp.is_search.float() * valid.float()
    last = valid.long().cumsum(-1).argmax(-1)  # column of each trajectory's last valid turn
    rows = torch.arange(len(inp.rewards))
    turn_r[rows, last] += inp.rewards.float() - alg.kl_coef * inp.kl_seq()
    return turn_r


@dataclass(frozen=True)
class GiGPOOptions(Options):
    """GiGPO's settings: ``omega`` >= 0, the weight of the step-level (anchor-state) advantage; ``std_norm``:
    divide both levels by the group's std (the paper's F_norm = std), or not (F_norm = 1, verl-agent's default
    mode ``mean_norm``)."""

    omega: float = 1.0
    std_norm: bool = True

    def __post_init__(self) -> None:
        check_range("GiGPO's omega", self.omega, 0.0)


@register_adv_est("gigpo", groups=True, options=GiGPOOptions)
def _gigpo(inp: AdvantageInputs, opts: GiGPOOptions, alg: Any) -> dict[str, torch.Tensor]:
    """GiGPO over the observation-history anchor states, with the options ``omega`` and ``std_norm`` and
    ``alg.gamma``."""
    turn_r = outcome_turn_rewards(inp, alg)
    states = anchor_states(inp.trajs, inp.turn_valid.shape[1])
    adv = gigpo_advantages(turn_r.sum(-1), inp.groups, turn_r, inp.turn_valid, states, alg.gamma, opts.omega,
                           opts.std_norm)
    return {"advantages": turns_to_tokens(adv, inp.token_turns, inp.mask)}


@register_adv_est("evidence_igpo", groups=True, options=IGPOOptions)
def _evidence_igpo(inp: AdvantageInputs, opts: IGPOOptions, alg: Any) -> dict[str, torch.Tensor]:
    """IGPO's turn rewards and advantages (:func:`training.algos.advantages.igpo_turn_advantages`:
    z-normalised over the group's turns, accumulated with ``alg.gamma``) with the evidence gain
    (:func:`training.algos.turn_credit.evidence_gain`, weight ``ig_coef``) in place of the probability gain:
    the outcome (minus the KL penalty) on the last turn, ``-alg.search_cost`` on every search turn."""
    gain = evidence_gain(inp.trajs, inp.turn_valid.shape[1]) * inp.turn_valid.float()
    turn_r = opts.ig_coef * gain + outcome_turn_rewards(inp, alg)
    adv = igpo_turn_advantages(turn_r, inp.turn_valid, inp.groups, alg.gamma)
    return {"advantages": turns_to_tokens(adv, inp.token_turns, inp.mask)}


# -- AEPO: REINFORCE samples at an entropy-following temperature ---------------------------------------------
def aepo_resample(ctx: PrepareContext) -> None:
    """AEPO's REINFORCE samples (Wang et al., 2025, arXiv 2510.08141; the authors' ``RayPPOTrainer.fit``, branch
    ``AEPO``, and ``_select_by_advantage``), spliced into the step's batch:

    1. ``H``: the old policy's mean token entropy (nats) over the batch's policy tokens;
       ``T = aepo_temperature(H)``: ``temperature_high`` at or below ``entropy_target``, else ``temperature_low``;
    2. the first ``resample_fraction`` of the step's questions (at least one) are rolled out again,
       ``train.rollout.group_size`` episodes each, at ``T``, rewarded as the batch (``train.algorithm.reward``);
    3. the samples whose GRPO advantage within their own group exceeds ``advantage_threshold`` are kept, at most
       ``reinforce_samples`` (half when ``H`` is above the target; :func:`training.algos.aepo.aepo_select`);
    4. they replace the first rows of the batch (:func:`training.algos.aepo.replace_rows`: the batch keeps its
       size, so their share of the update is AEPO's ``alpha``), each in a group of its own, and the batch is
       scored again; ``batch.prepared["aepo_rows"]`` ``[N]`` bool marks them for the estimator, which gives
       them advantage 1 (REINFORCE with reward 1). Their log-probs are the policy's at the batch's temperature,
       their rollout log-probs set to the same (no importance correction towards the tempered sampler, as the
       reference).

    ``ctx.trajs`` is updated in place (the step's records count the spliced samples). Logs ``aepo/entropy``,
    ``aepo/temperature``, ``aepo/resampled`` and ``aepo/selected``. Raises ``ValueError`` outside a training run
    (no rollout worker)."""
    opts: AEPOOptions = ctx.options
    b, trajs = ctx.batch, ctx.trajs
    if ctx.worker is None or ctx.score is None or ctx.entropy is None:
        raise ValueError("AEPO rolls out questions again: it runs inside a training run (no rollout worker here)")
    mask = b.loss_mask
    H = float((ctx.entropy(b).cpu() * mask).sum() / mask.sum().clamp(min=1.0))
    T = aepo_temperature(H, opts)
    first: dict[int, Any] = {}
    for t in trajs:
        first.setdefault(t.group, t)
    qs = [QAExample(t.question_id, t.question, list(t.golden_answers), dict(t.metadata))
          for t in list(first.values())[: max(1, round(opts.resample_fraction * len(first)))]]
    worker = dataclasses.replace(ctx.worker, agent=ctx.worker.agent.model_copy(update={"temperature": T}))
    extra = [t for t in worker.episodes(qs, ctx.tc.rollout.group_size) if not t.metadata.get("error")]
    stats = {"aepo/entropy": H, "aepo/temperature": T, "aepo/resampled": float(len(extra)), "aepo/selected": 0.0}
    b.prepared["stats"] = {**b.prepared.get("stats", {}), **stats}
    b.prepared["aepo_rows"] = torch.zeros(len(trajs), dtype=torch.bool)
    if not extra:
        return
    groups = torch.tensor([t.group for t in extra])
    sel = aepo_select(grpo_advantages(training_rewards(ctx.tc.algorithm, extra, groups), groups), H, opts)
    chosen = [extra[i] for i in sel.tolist()][: len(trajs)]
    if not chosen:
        return
    base = max(t.group for t in trajs) + 1
    for j, t in enumerate(chosen):
        t.group = base + j
        t.metadata["aepo_temperature"] = T
    new_trajs = chosen + [trajs[i] for i in replace_rows(len(trajs), len(chosen)).tolist()]
    new = collate(new_trajs, ctx.tokenizer.pad_token_id, ctx.max_len)
    new.temperature, new.packed = b.temperature, b.packed
    ctx.score(new)
    k = len(chosen)
    if new.rollout_logprobs is not None:
        new.rollout_logprobs[:k] = new.old_logprobs[:k]
    for f in dataclasses.fields(Batch):
        if f.name != "prepared":
            setattr(b, f.name, getattr(new, f.name))
    b.prepared["aepo_rows"] = torch.arange(len(new_trajs)) < k
    b.prepared["stats"]["aepo/selected"] = float(k)
    ctx.trajs[:] = new_trajs


@register_adv_est("aepo", groups=True, options=AEPOOptions, prepare=(aepo_resample, kl_reward_penalty))
def _aepo(inp: AdvantageInputs, opts: AEPOOptions, alg: Any) -> dict[str, torch.Tensor]:
    """AEPO: GRPO's advantages on the batch's rows (rewards minus the KL penalty with ``kl_mode=reward``), 1 on
    the REINFORCE samples :func:`aepo_resample` spliced in (``prepared["aepo_rows"]``), broadcast to the
    policy tokens, plus the per-turn search cost."""
    adv = grpo_advantages(inp.rewards - alg.kl_coef * inp.kl_seq(), inp.groups)
    rows = inp.prepared.get("aepo_rows")
    if rows is not None and rows.any():
        adv = torch.where(rows, torch.ones_like(adv), adv)
    tok = to_token_advantages(adv, inp.mask)
    if alg.search_cost > 0:
        tok = tok + turns_to_tokens(search_cost_to_go(inp.is_search, inp.turn_valid, alg.search_cost),
                                    inp.token_turns, inp.mask)
    return {"advantages": tok}


# -- ARPO's advantage attribution -----------------------------------------------------------------------
@dataclass(frozen=True)
class ARPOAdvOptions(Options):
    """ARPO's advantage attribution over the shared prefixes of a branched group (Dong et al., 2025, arXiv
    2507.19849, Sec. 3.3): ``soft`` (default, the paper's choice and what the authors' code runs: plain GRPO
    rows, a shared token trained once per row that holds it) or ``hard`` (each shared token gets the mean
    advantage of the rows that share it, :func:`training.algos.arpo.hard_attributed_advantages`)."""

    attribution: str = "soft"

    def __post_init__(self) -> None:
        if self.attribution not in ATTRIBUTIONS:
            raise ValueError(f"ARPO's attribution must be one of {ATTRIBUTIONS}, got {self.attribution!r}")


@register_adv_est("arpo", groups=True, options=ARPOAdvOptions)
def _arpo(inp: AdvantageInputs, opts: ARPOAdvOptions, alg: Any) -> dict[str, torch.Tensor]:
    """GRPO's advantages over each group (branches included; the outcome minus the KL penalty with
    ``kl_mode=reward``), given to the policy tokens as they are (``soft``) or averaged over the rows that share
    each token (``hard``: the shared prefix of a branch and its source is one decision, credited once with
    their mean); plus the per-turn search cost. Use it with ``train.rollout.strategy=arpo``."""
    rewards = inp.rewards - alg.kl_coef * inp.kl_seq()
    adv = gathered_outcome(lambda r, g, s, o: grpo_advantages(r, g), rewards, inp.groups, inp.search_calls, opts)
    if opts.attribution == "soft":
        tok = to_token_advantages(adv, inp.mask)
    else:
        hard = hard_attributed_advantages(adv, [t.token_ids for t in inp.trajs], inp.groups.tolist())  # [N, T_max]
        tok = torch.zeros_like(inp.mask, dtype=torch.float32)
        width = min(max(hard.shape[1] - 1, 0), tok.shape[1])
        tok[:, :width] = hard[:, 1 : width + 1]  # token t+1 at target position t, as the loss mask
        tok = tok * inp.mask.float()
    if alg.search_cost > 0:
        tok = tok + turns_to_tokens(search_cost_to_go(inp.is_search, inp.turn_valid, alg.search_cost),
                                    inp.token_turns, inp.mask)
    return {"advantages": tok}
