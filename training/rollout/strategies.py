"""The rollout strategy registry: how a step's groups of episodes are sampled (``train.rollout.strategy``).

A strategy is one function ``fn(worker, questions, group_size, opts, rng) -> (trajectories, stats)`` that
produces every group of the step from the rollout worker (:class:`training.rollout.worker.RolloutWorker`:
its LLM, retriever, agent settings and judge): the trajectories carry their group ids (question ``i``'s
group is ``i``; a strategy may add groups of its own after them) and ``stats`` are logged with the step.
``opts`` is its own frozen :class:`training.registry.Options` dataclass, nested in the config as
``train.rollout.strategy_options`` and validated when the config is loaded (unknown keys and values out of
range are errors, and so are settings that do not fit the rest of the rollout section, e.g. more ARPO global
samples than the group holds: the entry's ``check``); ``rng`` is a ``random.Random`` seeded by torch's
generator state without advancing it (:func:`strategy_rng`), so a resumed run draws the same and ``plain``
samples exactly the trajectories it sampled before strategies existed. An entry may bring ``prepare`` steps
(:class:`training.algos.estimators.PrepareContext`) that the score phase runs after the estimator's, to write
what its update needs onto the batch (REX-RAG's behaviour log-probs). The trainer names no strategy.

Built in:

* ``plain``: ``group_size`` independent episodes per question (GRPO's group sampling; the default);
* ``arpo``: ARPO's entropy-adaptive branching under one budget of ``group_size`` rollouts per question
  (:mod:`training.rollout.arpo_rollout`);
* ``rexrag``: REX-RAG's probing of dead ends with a reasoning hint, and its importance correction
  (:mod:`training.rollout.rexrag_rollout`);
* ``ssp``: search self-play, a proposer and a solver role of one policy (:mod:`training.rollout.ssp_rollout`);
* ``adasearch``: AdaSearch's two stages, problem solving in a parametric and a search mode, then the decision
  whether to search (:mod:`training.rollout.adasearch_rollout`; one stage per run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agent.trajectory import Trajectory
from corpora.formats import QAExample
from training.algos.arpo import ARPOOptions
from training.algos.knowledge_boundary import AdaSearchOptions, adasearch_split
from training.algos.options import check_range
from training.algos.rexrag import DEFAULT_HINTS, RexRagOptions
from training.algos.ssp import SSPOptions
from training.registry import Options, Registry, options_class

# The strategies' own modules import the agent loop (LangGraph), which the config, importing this registry,
# does not need: they are imported when a strategy runs.

StrategyFn = Callable[[Any, list[QAExample], int, Any, random.Random], tuple[list[Trajectory], dict[str, float]]]


@dataclass(frozen=True)
class RolloutStrategy:
    """A registered rollout strategy: ``fn`` (see the module docstring), its ``options`` class, ``check(opts,
    rollout_cfg)`` raising ``ValueError`` for options that do not fit the rollout section (``None``: none),
    ``prepare`` steps run on the scored batch after the estimator's, and a one-line ``description``."""

    name: str
    fn: StrategyFn
    options: type[Options] = Options
    check: Callable[[Any, Any], None] | None = None
    prepare: tuple[Callable[[Any], None], ...] = ()
    description: str = ""


ROLLOUT_STRATEGIES: Registry[RolloutStrategy] = Registry("rollout strategy", "train.rollout.strategy")


def register_rollout_strategy(name: str, *, options: type[Options] = Options,
                              check: Callable[[Any, Any], None] | None = None,
                              prepare: tuple[Callable[[Any], None], ...] = (), description: str = "",
                              replace: bool = False):
    """Decorator: register ``fn(worker, questions, group_size, opts, rng) -> (trajectories, stats)`` as
    ``train.rollout.strategy=<name>`` (see :class:`RolloutStrategy`). Raises ``TypeError`` for options that
    are not a frozen dataclass of :class:`training.registry.Options`, ``ValueError`` for a name taken."""
    opts_cls = options_class(options, f"rollout strategy {name!r}")

    def wrap(fn: StrategyFn) -> StrategyFn:
        entry = RolloutStrategy(name, fn, opts_cls, check, tuple(prepare), description)
        ROLLOUT_STRATEGIES.add(name, entry, replace=replace)
        return fn

    return wrap


def strategy_rng() -> random.Random:
    """A ``random.Random`` seeded by a hash of torch's global generator state, which is checkpointed with the
    run (a resumed run's strategy draws the same). The generator is not advanced: a strategy that draws
    nothing (``plain``) leaves the episodes' sampling exactly as it was."""
    state = torch.random.get_rng_state().numpy().tobytes()
    return random.Random(int.from_bytes(hashlib.sha256(state).digest()[:8], "little"))


def sample_groups(worker: Any, questions: list[QAExample], tc: Any) -> tuple[list[Trajectory], dict[str, float]]:
    """The step's groups for ``questions`` by the strategy ``tc.rollout.strategy`` with its options
    ``tc.rollout.strategy_options`` and ``tc.rollout.group_size``: ``(trajectories, stats)``."""
    ro = tc.rollout
    entry = ROLLOUT_STRATEGIES.get(ro.strategy)
    return entry.fn(worker, questions, ro.group_size, ro.strategy_options, strategy_rng())


def prepare_steps(tc: Any) -> tuple[Callable[[Any], None], ...]:
    """The chosen strategy's prepare steps (run by the score phase after the estimator's)."""
    return ROLLOUT_STRATEGIES.get(tc.rollout.strategy).prepare


# -- plain group sampling --------------------------------------------------------------------------------
@register_rollout_strategy("plain", description="group_size independent episodes per question (GRPO's group)")
def plain(worker: Any, questions: list[QAExample], group_size: int, opts: Options,
          rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    """``group_size`` independent episodes per question (:meth:`RolloutWorker.episodes`, failed episodes run
    again)."""
    return worker.episodes(questions, group_size), {}


# -- ARPO --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ARPORolloutOptions(Options):
    """ARPO's rollout (Dong et al., 2025, arXiv 2507.19849; defaults of the authors' deep-search script, with
    ``M = train.rollout.group_size``): ``global_samples`` ``N`` (``None``: ``ceil(M / 2)``, the script's
    8 of 16), ``branches`` ``Z`` (copies per branching draw, 1), ``branch_prob`` ``alpha`` (0.5),
    ``entropy_weight`` ``beta`` (0.2), ``entropy_window`` ``k`` (20 tokens after each tool result). Ranges
    are checked by :class:`training.algos.arpo.ARPOOptions` (``N`` against ``M`` when the rollout section is
    validated)."""

    global_samples: int | None = None
    branches: int = 1
    branch_prob: float = 0.5
    entropy_weight: float = 0.2
    entropy_window: int = 20

    def __post_init__(self) -> None:
        if self.global_samples is not None and self.global_samples < 1:
            raise ValueError(f"ARPO's global samples N must be >= 1, got {self.global_samples}")
        ARPOOptions(group_size=max(self.global_samples or 1, 1), global_samples=self.global_samples or 1,
                    branches=self.branches, branch_prob=self.branch_prob, entropy_weight=self.entropy_weight,
                    entropy_window=self.entropy_window)

    def core(self, group_size: int) -> ARPOOptions:
        """The rollout's :class:`training.algos.arpo.ARPOOptions` for a budget of ``group_size`` rollouts.
        Raises ``ValueError`` for ``N`` outside ``[1, M]``."""
        n = self.global_samples if self.global_samples is not None else (group_size + 1) // 2
        return ARPOOptions(group_size=group_size, global_samples=n, branches=self.branches,
                           branch_prob=self.branch_prob, entropy_weight=self.entropy_weight,
                           entropy_window=self.entropy_window)


def _check_arpo(opts: ARPORolloutOptions, rollout_cfg: Any) -> None:
    try:
        opts.core(rollout_cfg.group_size)
    except ValueError as e:
        raise ValueError(f"train.rollout.strategy_options: {e} (train.rollout.group_size={rollout_cfg.group_size} "
                         "is ARPO's budget M)") from None


@register_rollout_strategy("arpo", options=ARPORolloutOptions, check=_check_arpo,
                           description="ARPO: global samples plus entropy-adaptive branches after tool results")
def arpo(worker: Any, questions: list[QAExample], group_size: int, opts: ARPORolloutOptions,
         rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    from training.rollout.arpo_rollout import arpo_groups

    return arpo_groups(worker, questions, opts.core(group_size), rng)


# -- REX-RAG -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RexRagRolloutOptions(Options):
    """REX-RAG's probing (Jiang et al., 2025, arXiv 2508.08149): ``probe_prob`` ``p`` (the chance that a wrong
    answer is probed; 0.2 as the authors' scripts), ``hints`` (the pool of reasoning hints, drawn uniformly)
    and ``correction`` (the importance correction of the update, on by default; off only to measure what it
    does). Ranges checked by :class:`training.algos.rexrag.RexRagOptions`."""

    probe_prob: float = 0.2
    hints: tuple[str, ...] = DEFAULT_HINTS
    correction: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "hints", tuple(self.hints))
        self.core()

    def core(self) -> RexRagOptions:
        return RexRagOptions(probe_prob=self.probe_prob, hints=self.hints)


def rexrag_correction(ctx: Any) -> None:
    """REX-RAG's prepare step: :func:`training.rollout.rexrag_rollout.rexrag_behaviour_logprobs`."""
    from training.rollout.rexrag_rollout import rexrag_behaviour_logprobs

    rexrag_behaviour_logprobs(ctx)


@register_rollout_strategy("rexrag", options=RexRagRolloutOptions, prepare=(rexrag_correction,),
                           description="REX-RAG: probe wrong answers with a reasoning hint; importance-corrected")
def rexrag(worker: Any, questions: list[QAExample], group_size: int, opts: RexRagRolloutOptions,
           rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    from training.rollout.rexrag_rollout import rexrag_groups

    return rexrag_groups(worker, questions, group_size, opts.core(), rng)


# -- SSP -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SSPRolloutOptions(Options, SSPOptions):
    """Search self-play (Lu et al., 2025, arXiv 2510.18821): the fields of
    :class:`training.algos.ssp.SSPOptions` (the proposer's ``reward_type`` and its ``left`` / ``right``, the
    ``format_penalty`` of a rejected question, the question filters and ``noisy_materials``; the authors'
    ``rl_config.yaml`` defaults, ranges checked there) and ``proposals`` per seed answer (``None``:
    ``train.rollout.group_size``; they form the seed's group). Raises ``ValueError`` as ``SSPOptions`` does,
    and for ``proposals < 1``."""

    proposals: int | None = None

    def __post_init__(self) -> None:
        if self.proposals is not None:
            check_range("SSP's proposals", self.proposals, 1.0)
        SSPOptions.__post_init__(self)

    def core(self) -> SSPOptions:
        """The core's :class:`training.algos.ssp.SSPOptions`: these options without ``proposals``."""
        return SSPOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SSPOptions)})


@register_rollout_strategy("ssp", options=SSPRolloutOptions,
                           description="search self-play: the policy proposes questions from answers and solves them")
def ssp(worker: Any, questions: list[QAExample], group_size: int, opts: SSPRolloutOptions,
        rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    from training.rollout.ssp_rollout import ssp_groups

    return ssp_groups(worker, questions, group_size, opts.proposals or group_size, opts.core(), rng)


# -- AdaSearch -------------------------------------------------------------------------------------------------
def _check_adasearch(opts: AdaSearchOptions, rollout_cfg: Any) -> None:
    if opts.stage == 1:
        try:
            adasearch_split(rollout_cfg.group_size, opts.parametric_share)
        except ValueError as e:
            raise ValueError(f"train.rollout.strategy_options: {e}") from None


@register_rollout_strategy("adasearch", options=AdaSearchOptions, check=_check_adasearch,
                           description="AdaSearch: stage 1 parametric and search modes, stage 2 the search decision")
def adasearch(worker: Any, questions: list[QAExample], group_size: int, opts: AdaSearchOptions,
              rng: random.Random) -> tuple[list[Trajectory], dict[str, float]]:
    from training.rollout.adasearch_rollout import adasearch_groups

    return adasearch_groups(worker, questions, group_size, opts, rng)


__all__ = ["ROLLOUT_STRATEGIES", "RolloutStrategy", "prepare_steps", "register_rollout_strategy",
           "sample_groups"]
