"""The SFT data builders: which trajectories the warm start is trained on (``sft.data``, its settings in
``sft.data_options``), one registry (:data:`SFT_DATA`) filled by :func:`register_sft_data`.

* ``oracle`` (the default): the scripted oracle of :mod:`training.rollout.oracle` (search the question, read,
  answer with the gold answer), one trajectory per training question;
* ``primed``, ``random``, ``correct``: behaviour priming (Jin, Paladugu and Xiong, 2025, "Beneficial Reasoning
  Behaviors in Agentic Search and Effective Post-training to Obtain Them", arXiv 2510.06534) and its two
  baselines. A pool of ``pool_factor`` trajectories per question is rolled out through the real agent loop by a
  scripted oracle acting out a random subset of the four behaviours (information verification, authority
  evaluation, adaptive search, error recovery; :func:`training.algos.priming.primed_action`), each labelled by
  the behaviours it shows (:func:`training.algos.priming.exhibited_behaviours`); ``primed`` keeps ``n`` that show
  every ``required`` behaviour (with a correct answer, by default), ``random`` ``n`` drawn at random, ``correct``
  ``n`` with a correct answer: sets of the same size, compared by the same RL after them.

A builder is ``fn(req: SFTDataRequest, opts) -> list[Trajectory]``. The agent loop is imported when a builder
runs, not with the config.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from agent.trajectory import Trajectory, Turn
from corpora.formats import QAExample
from corpora.registry import decorator
from training.algos.options import check_range
from training.algos.priming import (
    BEHAVIOURS,
    behaviour_counts,
    check_behaviours,
    exhibited_behaviours,
    pick_distractor,
    primed_action,
    sample_behaviours,
    select_correct,
    select_primed,
    select_random,
)
from training.registry import Options, Registry, options_class
from training.rollout.oracle import OracleLLM, searches_made


@dataclass
class SFTDataRequest:
    """What a builder may use: the training ``examples``, the policy's ``tokenizer``, the run's ``retriever``
    (searched ``top_k`` passages at a time), the agent settings (``agent_cfg``), corpus ``titles_by_id`` and a
    ``seed``. A builder may put numbers to report in ``stats``."""

    examples: list[QAExample]
    tokenizer: Any
    retriever: Any
    agent_cfg: Any
    titles_by_id: dict[str, str]
    top_k: int
    seed: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SFTDataBuilder:
    """A registered builder: ``fn(req, opts) -> trajectories`` and its ``options`` class."""

    name: str
    fn: Any
    options: type[Options] = Options


SFT_DATA: Registry[SFTDataBuilder] = Registry("SFT data builder", "sft.data")


def register_sft_data(name: str, *, options: type[Options] = Options, replace: bool = False):
    """Decorator: register ``fn(req: SFTDataRequest, opts) -> list[Trajectory]`` as ``sft.data=<name>`` with its
    options class (``sft.data_options``)."""
    opts_cls = options_class(options, f"SFT data builder {name!r}")
    return decorator(SFT_DATA, name, lambda fn: SFTDataBuilder(name, fn, opts_cls), replace)


def build_sft_data(sft_cfg: Any, req: SFTDataRequest) -> list[Trajectory]:
    """The trajectories of ``sft_cfg.data`` with its ``data_options``; ``ValueError`` when there are none."""
    trajs = SFT_DATA.get(sft_cfg.data).fn(req, sft_cfg.data_options)
    if not trajs:
        raise ValueError(f"sft.data={sft_cfg.data} built no trajectory from {len(req.examples)} questions")
    return trajs


@register_sft_data("oracle")
def oracle_data(req: SFTDataRequest, opts: Options) -> list[Trajectory]:
    """The scripted oracle's trajectories (:func:`training.sft.oracle_trajectories`)."""
    from training.sft import oracle_trajectories

    return oracle_trajectories(req.examples, req.tokenizer, req.retriever, req.agent_cfg, req.titles_by_id,
                               req.top_k)


# -- behaviour priming ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrimingOptions(Options):
    """Behaviour priming's SFT set: ``n`` trajectories (``0``: as many as there are training questions),
    chosen from a pool of ``pool_factor`` per question in which each behaviour is acted out with probability
    ``behaviour_prob``; ``required``: the behaviours a ``primed`` trajectory must all show (authority evaluation
    needs ``retrieval.top_k >= 2``: with one result per search it cannot show, so drop it there);
    ``outcome``: ``correct`` (the paper's primed set), ``incorrect`` (its ablation) or ``any``. Raises
    ``ValueError`` for an unknown behaviour or outcome, ``n < 0``, ``pool_factor < 1`` or a probability
    outside [0, 1]."""

    n: int = 0
    pool_factor: int = 4
    behaviour_prob: float = 0.5
    required: tuple[str, ...] = BEHAVIOURS
    outcome: str = "correct"

    def __post_init__(self) -> None:
        check_behaviours(self.required)
        if self.outcome not in ("correct", "incorrect", "any"):
            raise ValueError(f"behaviour priming's outcome must be correct, incorrect or any, got {self.outcome!r}")
        if self.n < 0 or self.pool_factor < 1:
            raise ValueError(f"behaviour priming needs n >= 0 and pool_factor >= 1, got {self.n}, {self.pool_factor}")
        check_range("behaviour priming's behaviour_prob", self.behaviour_prob, 0.0, 1.0)


_PAIR = re.compile(r"<search>(.*?)</search>\s*<information>(.*?)</information>", re.DOTALL)


def chain_of(ex: QAExample, titles_by_id: dict[str, str]) -> list[str]:
    """The entity chain ``[e_0, ..., e_h]`` the priming oracle follows: a synthetic question's
    ``metadata["chain"]`` up to its hop count; else the titles of its supporting passages then the gold answer
    (HotpotQA-style data); ``[]`` when neither is known."""
    if "chain" in ex.metadata:
        return list(ex.metadata["chain"])[: int(ex.metadata.get("hops", len(ex.metadata["chain"]) - 1)) + 1]
    titles = [titles_by_id[i] for i in ex.metadata.get("supporting_ids", []) if i in titles_by_id]
    return [*titles, ex.golden_answers[0]] if titles and ex.golden_answers else []


class PrimingOracleLLM(OracleLLM):
    """The scripted oracle acting out behaviours: per question its ``plans`` entry ``(behaviours, distractor,
    broad_query)``; each turn's action is :func:`training.algos.priming.primed_action` on the turns read back
    from the context (the ``<search>`` / ``<information>`` pairs after the question). A question without a
    chain is answered as :class:`OracleLLM` does."""

    def __init__(self, tokenizer: Any, examples: list[QAExample], titles_by_id: dict[str, str],
                 plans: dict[str, tuple[frozenset[str], str | None, str | None]]):
        super().__init__(tokenizer, examples, titles_by_id)
        self.plans = plans

    def _action(self, context: str) -> str:
        ex, m = self._question(context)
        chain = chain_of(ex, self.titles_by_id) if ex is not None else []
        if ex is None or len(chain) < 2:
            return super()._action(context)
        turns = [Turn(index=i + 1, text="", action="search", query=q.strip(), observation=o.strip())
                 for i, (q, o) in enumerate(_PAIR.findall(context[m.end():]))]
        if len(turns) != searches_made(context, m):  # an invalid turn's hint: the pairs are not the turns
            turns = turns[: searches_made(context, m)]
        behaviours, distractor, broad = self.plans.get(ex.id, (frozenset(), None, None))
        return primed_action(ex.question, chain, turns, behaviours, distractor, broad_query=broad)


def priming_pool(req: SFTDataRequest, opts: PrimingOptions) -> tuple[list[Trajectory], list[frozenset[str]], list[bool]]:
    """``pool_factor`` primed-oracle trajectories per question, their behaviour labels and correctness. Each
    round draws every question's behaviours (:func:`sample_behaviours`), an off-track distractor among the
    corpus titles, and a broad query (the question without its first entity)."""
    from agent.loop.batch import run_episodes

    rng = random.Random(req.seed)
    titles = sorted(set(req.titles_by_id.values()))
    pool: list[Trajectory] = []
    for _ in range(opts.pool_factor):
        plans = {}
        for ex in req.examples:
            chain = chain_of(ex, req.titles_by_id)
            distractor = pick_distractor(titles, chain, rng) if chain and len(titles) > len(chain) else None
            broad = " ".join(ex.question.replace(chain[0], " ").split()) if chain else None
            plans[ex.id] = (sample_behaviours(rng, opts.behaviour_prob), distractor, broad)
        oracle = PrimingOracleLLM(req.tokenizer, req.examples, req.titles_by_id, plans)
        pool += run_episodes(req.examples, oracle, req.retriever, req.agent_cfg, top_k=req.top_k, temperature=0.0)
    by_id = {ex.id: ex for ex in req.examples}
    labels = [exhibited_behaviours(t.question, t.turns, chain_of(by_id[t.question_id], req.titles_by_id)[1:],
                                   t.answer) for t in pool]
    correct = [float(t.verdict.get("em", 0.0)) >= 1.0 for t in pool]
    req.stats["pool"] = behaviour_counts(labels)
    return pool, labels, correct


def _chosen(req: SFTDataRequest, opts: PrimingOptions, which: str) -> list[Trajectory]:
    pool, labels, correct = priming_pool(req, opts)
    n = opts.n or len(req.examples)
    rng = random.Random(req.seed + 1)
    if which == "primed":
        idx = select_primed(list(range(len(pool))), labels, n, rng, correct, opts.outcome, opts.required)
    elif which == "random":
        idx = select_random(list(range(len(pool))), n, rng)
    else:
        idx = select_correct(list(range(len(pool))), correct, n, rng)
    req.stats["chosen"] = behaviour_counts([labels[i] for i in idx])
    return [pool[i] for i in idx]


@register_sft_data("primed", options=PrimingOptions)
def primed_data(req: SFTDataRequest, opts: PrimingOptions) -> list[Trajectory]:
    """Behaviour priming's SFT set: ``n`` pool trajectories showing every ``required`` behaviour with the
    ``outcome`` asked (:func:`training.algos.priming.select_primed`); ``ValueError`` when fewer qualify."""
    return _chosen(req, opts, "primed")


@register_sft_data("random", options=PrimingOptions)
def random_data(req: SFTDataRequest, opts: PrimingOptions) -> list[Trajectory]:
    """Behaviour priming's random baseline: ``n`` pool trajectories drawn at random."""
    return _chosen(req, opts, "random")


@register_sft_data("correct", options=PrimingOptions)
def correct_data(req: SFTDataRequest, opts: PrimingOptions) -> list[Trajectory]:
    """Behaviour priming's correct-outcome baseline: ``n`` pool trajectories with a correct answer."""
    return _chosen(req, opts, "correct")
