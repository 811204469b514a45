"""External agents as rollouts: an agent written against the OpenAI API, run over the training proxy.

An external agent is an async function ``agent(question: str, base_url: str) -> str`` (named
``module:function``, :func:`load_entry`): it talks to "the model" at ``base_url`` with any OpenAI-compatible
client (LangChain's ``ChatOpenAI``, the ``openai`` package) and returns its answer. :class:`ExternalRunner`
serves the policy backend through a :class:`agent.external.proxy.Proxy` on 127.0.0.1, hands each episode its
own base URL (``.../ep/<episode>/v1``), and turns what the proxy recorded into the same
:class:`~agent.trajectory.Trajectory` records the built-in loop writes (:mod:`agent.external.stitch`), judged
by the same judge (:func:`agent.judges.rule_judge` by default, or the configured one) with the answer the
agent returned, grouped as :func:`agent.loop.batch.run_episodes` groups them. An episode the template split
gives several sequences of one episode (``metadata["episode"]``/``["segment"]``), each with the episode's
reward. An agent that raises, or runs past ``timeout_s``, gives an episode with ``stop_reason == "error"`` and
the reason in ``metadata["error"]`` (what the trainer's fault handling reruns and leaves out), never an
exception.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Self

from agent.external.proxy import Proxy, ProxyServer, ProxySettings
from agent.judges import Judge, configured_judge, rule_judge
from agent.llm import LLM, run_sync
from agent.metrics import rule_verdict
from agent.trajectory import Trajectory
from corpora.formats import QAExample

ExternalAgent = Callable[[str, str], Awaitable[str]]
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def load_entry(spec: str) -> ExternalAgent:
    """The async function named by ``spec`` (``package.module:function``), imported with the working directory
    on ``sys.path`` (as ``uvicorn module:app`` does: ``examples.react_agent:answer`` from a checkout). Raises
    ``ValueError`` for a spec without ``:`` or a function that is not async, ``ImportError`` /
    ``AttributeError`` naming what is missing."""
    import os
    import sys

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"agent.entry must be 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except AttributeError:
        raise AttributeError(f"agent.entry {spec!r}: module {module!r} has no {name!r}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.entry {spec!r} must be an async function (question, base_url) -> answer")
    return fn


def runner_for(llm: LLM, agent_cfg: Any, judge: Judge | None = None,
               temperature: float | None = None) -> ExternalRunner | None:
    """The :class:`ExternalRunner` of ``agent.kind: external`` (``agent_cfg.entry``, ``external_timeout_s``)
    over ``llm``, judged by ``judge`` (default: the agent config's, :func:`agent.judges.configured_judge`);
    ``None`` for the built-in loop. Raises ``ValueError`` when ``agent.entry`` is missing, and what
    :func:`load_entry` raises."""
    if getattr(agent_cfg, "kind", "builtin") != "external":
        return None
    if not agent_cfg.entry:
        raise ValueError("agent.kind=external needs agent.entry=module:function, an async function (question, "
                         "base_url) -> answer (e.g. examples.react_agent:answer)")
    return ExternalRunner(llm, load_entry(agent_cfg.entry), agent_cfg, temperature=temperature,
                          judge=judge or configured_judge(agent_cfg, llm), timeout_s=agent_cfg.external_timeout_s)


def final_answer(text: Any) -> str | None:
    """The answer in an agent's reply: the text inside ``<answer>...</answer>`` when there is one, else the
    whole reply, stripped; ``None`` for an empty or non-string reply."""
    if not isinstance(text, str):
        return None
    m = _ANSWER_RE.search(text)
    text = (m.group(1) if m else text).strip()
    return text or None


class ExternalRunner:
    """Runs an external agent's episodes over a proxy it serves (see the module docstring).

    Args:
        llm: the policy backend (:class:`agent.llm.LLM`); the proxy batches concurrent calls.
        agent: the external agent (:func:`load_entry`). agent_cfg: the agent config (``max_new_tokens``,
            ``max_total_tokens``, ``temperature``, ``top_p``, ``reward``, ``format_reward``).
        temperature: overrides ``agent_cfg.temperature`` (0 = greedy); every call samples with it.
        judge: scores an episode (default: the rule judge of ``agent_cfg``). timeout_s: seconds per episode.
        reruns: runs again of an episode that failed (:meth:`arun_episodes`).

    Use as a context manager, or call :meth:`close`. ``stats``: the proxy's counters (``calls``, ``splits``...).
    """

    def __init__(self, llm: LLM, agent: ExternalAgent, agent_cfg: Any, *, temperature: float | None = None,
                 judge: Judge | None = None, timeout_s: float = 600.0, max_concurrency: int = 256,
                 reruns: int = 1):
        temp = agent_cfg.temperature if temperature is None else temperature
        settings = ProxySettings(max_new_tokens=agent_cfg.max_new_tokens, max_total_tokens=agent_cfg.max_total_tokens,
                                 temperature=temp, top_p=agent_cfg.top_p if temp > 0 else 1.0)
        self.agent, self.timeout_s, self.max_concurrency, self.reruns = agent, timeout_s, max_concurrency, reruns
        self.judge = judge or rule_judge(agent_cfg.reward, agent_cfg.format_reward)
        self.proxy = Proxy(llm, settings, max_batch=getattr(agent_cfg, "max_batch", 256))
        self.server = ProxyServer(self.proxy).start()

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.proxy.stats)

    async def run_episode(self, example: QAExample, group: int = 0, judge: Judge | None = None) -> list[Trajectory]:
        """One episode of ``example``: its sequences (one unless the template split it), judged by ``judge``
        (default: the runner's)."""
        eid = f"{example.id}-{uuid.uuid4().hex[:12]}"
        error = None
        try:
            reply = await asyncio.wait_for(self.agent(example.question, self.server.base_url(eid)), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the episode fails with its reason, the run goes on
            reply, error = None, f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) \
                else f"the agent took longer than {self.timeout_s} s"
        answer = final_answer(reply)
        meta = {k: v for k, v in example.metadata.items() if k in ("hops", "dataset", "supporting_ids")}
        seqs = self.proxy.take(eid).trajectories(example.id, example.question, example.golden_answers, group, answer)
        if not seqs:  # the agent never called the model: nothing to train, an episode all the same
            seqs = [Trajectory(example.id, example.question, list(example.golden_answers), group=group, answer=answer,
                               metadata={"episode": eid, "segment": 0, "segments": 1})]
            error = error or "the agent never called the model"
        whole = Trajectory(example.id, example.question, list(example.golden_answers), answer=answer,
                           turns=[t for s in seqs for t in s.turns])
        judge = judge or self.judge
        if error is None:
            stop = "answer" if answer is not None else "max_turns"
            reward, verdict = await (asyncio.to_thread(judge, whole) if getattr(judge, "blocking", False)
                                     else _now(judge, whole))
        else:
            stop, reward, verdict = "error", 0.0, rule_verdict(None, example.golden_answers) | {"format_ok": False}
        for s in seqs:
            s.metadata.update(meta)
            s.stop_reason, s.reward, s.verdict = stop, reward, dict(verdict)
            if error is not None:
                s.metadata["error"] = error
        return seqs

    async def arun_episodes(self, examples: list[QAExample], n_samples: int = 1, judge: Judge | None = None,
                            merge: bool = False) -> list[Trajectory]:
        """``n_samples`` episodes per example, concurrently (at most ``max_concurrency`` at once); sequences
        come back grouped by example (group id = example index), episodes in order. ``merge``: one record per
        episode (:func:`merged`, for evaluation) instead of its training sequences. An episode that failed is
        run again, at most ``reruns`` times (a fresh sample of its question in its group); the failed runs are
        counted in ``metadata["failed_attempts"]`` (the trainer leaves one that still failed out)."""
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(ex: QAExample, g: int) -> list[Trajectory]:
            attempts = 0
            while True:
                async with gate:
                    seqs = await self.run_episode(ex, g, judge)
                attempts += int(seqs[0].stop_reason == "error")
                if seqs[0].stop_reason != "error" or attempts > self.reruns:
                    break
            for t in seqs:  # what training.rollout.faults.drop_failed counts
                t.metadata["failed_attempts"] = attempts
            return [merged(seqs)] if merge else seqs

        runs = await asyncio.gather(*(one(ex, g) for g, ex in enumerate(examples) for _ in range(n_samples)))
        return [t for seqs in runs for t in seqs]

    def run_episodes(self, examples: list[QAExample], n_samples: int = 1, judge: Judge | None = None,
                     merge: bool = False) -> list[Trajectory]:
        """Synchronous :meth:`arun_episodes` (in a fresh loop on a helper thread when one already runs)."""
        return run_sync(self.arun_episodes(examples, n_samples, judge, merge))

    def loop_episodes(self, examples: list[QAExample], llm: Any = None, retriever: Any = None, cfg: Any = None, *,
                      n_samples: int = 1, temperature: float | None = None, top_k: int | None = None,
                      seed: int | None = None, judge: Judge | None = None, merge: bool = True) -> list[Trajectory]:
        """:func:`agent.loop.batch.run_episodes`'s signature over the external agent (``llm``, ``retriever``,
        ``cfg``, ``top_k`` and ``seed`` are the runner's own and ignored), e.g. for
        ``eval.run.run_benchmarks``'s ``run_episodes``: one record per episode by default. ``temperature``
        applies to this call only."""
        settings = self.proxy.settings
        saved = (settings.temperature, settings.top_p)
        if temperature is not None:
            settings.temperature, settings.top_p = temperature, settings.top_p if temperature > 0 else 1.0
        try:
            return self.run_episodes(examples, n_samples, judge, merge)
        finally:
            settings.temperature, settings.top_p = saved

    def close(self) -> None:
        self.server.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merged(seqs: list[Trajectory]) -> Trajectory:
    """One record of an episode from its training sequences: the first one with every sequence's turns and
    tokens (in order; a split episode's record is then no training sequence) and ``metadata["segments"]``."""
    if len(seqs) == 1:
        return seqs[0]
    first = seqs[0]
    out = Trajectory(first.question_id, first.question, list(first.golden_answers), answer=first.answer,
                     reward=first.reward, verdict=dict(first.verdict), stop_reason=first.stop_reason, group=first.group,
                     metadata=dict(first.metadata))
    for s in seqs:
        out.token_ids += s.token_ids
        out.roles += s.roles
        out.turn_ids += s.turn_ids
        out.turns += s.turns
    return out


async def _now(fn: Judge, traj: Trajectory) -> tuple[float, dict[str, Any]]:
    return fn(traj)
