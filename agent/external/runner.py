"""External agents as rollouts: an agent written against the OpenAI API, run over the training proxy.

An external agent is an async function ``agent(question: str, base_url: str) -> str`` (named
``module:function`` or ``path/to/file.py:function``, :func:`load_entry`): it talks to "the model" at
``base_url`` with any OpenAI-compatible client (LangChain's ``ChatOpenAI``, the ``openai`` package) and returns
its answer. :class:`ExternalRunner` serves the policy backend through a :class:`agent.external.proxy.Proxy` on
127.0.0.1, hands each episode its own base URL (``.../ep/<episode>/v1``), and turns what the proxy recorded
into the same :class:`~agent.trajectory.Trajectory` records the built-in loop writes
(:mod:`agent.external.stitch`), judged by the same judge (:func:`agent.judges.rule_judge` by default, or the
configured one) with the answer the agent returned, grouped as :func:`agent.loop.batch.run_episodes` groups
them. An episode the template split gives several sequences of one episode
(``metadata["episode"]``/``["segment"]``), each with the episode's reward.

Each episode runs on a worker thread with an event loop of its own (:mod:`agent.external.isolation`), so an
agent that blocks (``time.sleep`` in a tool, a synchronous client) stops neither the trainer nor the other
episodes, and ``timeout_s`` (``agent.external_timeout_s``) ends it whether it blocks or awaits forever. An
agent that raises, or runs past ``timeout_s``, gives an episode with ``stop_reason == "error"`` and the reason
in ``metadata["error"]``, naming the agent (what the trainer's fault handling leaves out), never an exception.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

from agent.config import EXTERNAL_TIMEOUT_S
from agent.external.isolation import AgentThreads
from agent.external.proxy import Proxy, ProxyLimits, ProxyServer, ProxySettings
from agent.judges import Judge, configured_judge, rule_judge
from agent.llm import LLM, run_sync
from agent.metrics import rule_verdict
from agent.trajectory import Trajectory
from corpora.formats import QAExample

ExternalAgent = Callable[[str, str], Awaitable[str]]
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ENTRY_FORMS = "'module:function' or 'path/to/file.py:function'"


def load_entry(spec: str) -> ExternalAgent:
    """The async function ``(question, base_url) -> answer`` named by ``spec``: ``package.module:function``,
    imported with the working directory on ``sys.path`` (as ``uvicorn module:app`` does:
    ``examples.react_agent:answer`` from a checkout), or ``path/to/file.py:function``, a file loaded as a
    module (its folder put on ``sys.path`` for its own imports). Raises ``ValueError`` for a spec of
    another form or a function that is not async or does not take ``(question, base_url)``,
    ``FileNotFoundError`` for a missing file, ``ImportError`` / ``AttributeError`` naming what is missing;
    an exception the module raises while it is imported comes back as an ``ImportError`` naming the entry."""
    import os

    source, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not source.strip() or not name.isidentifier():
        raise ValueError(f"agent.entry must be {_ENTRY_FORMS}, got {spec!r}")
    is_file = source.endswith(".py") or "/" in source or os.sep in source
    module = _load_file(spec, source) if is_file else _import_module(spec, source)
    try:
        fn = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"agent.entry {spec!r}: {'file' if is_file else 'module'} {source!r} has no "
                             f"{name!r}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.entry {spec!r} must be an async function (question, base_url) -> answer; "
                         f"{name} is {'a plain function' if callable(fn) else type(fn).__name__}")
    try:
        inspect.signature(fn).bind("question", "http://127.0.0.1/v1")
    except TypeError as e:
        raise ValueError(f"agent.entry {spec!r} must take two arguments (question, base_url): {e}") from None
    except ValueError:  # no signature to read (a builtin): called and judged by what it does
        pass
    return fn


def _import_module(spec: str, module: str) -> Any:
    import os

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise ImportError(f"agent.entry {spec!r}: no module named {e.name!r} (give a module importable from "
                              f"the working directory, or a path/to/file.py)") from None
        raise ImportError(f"agent.entry {spec!r}: importing {module!r} failed: {e} (is a package it needs "
                          "installed?)") from e
    except Exception as e:
        raise ImportError(f"agent.entry {spec!r}: importing {module!r} failed: {type(e).__name__}: {e}") from e


def _load_file(spec: str, source: str) -> Any:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"agent.entry {spec!r}: no such file {source!r}"
                                + (" (a .py file is expected)" if not source.endswith(".py") else ""))
    key = f"sleuth_agent_{path.stem}_{abs(hash(str(path)))}"
    if key in sys.modules:
        return sys.modules[key]
    if str(path.parent) not in sys.path:  # the file's own imports of modules beside it
        sys.path.append(str(path.parent))
    loader_spec = importlib.util.spec_from_file_location(key, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ImportError(f"agent.entry {spec!r}: {source!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[key] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[key]
        raise ImportError(f"agent.entry {spec!r}: loading {source!r} failed: {type(e).__name__}: {e}") from e
    except BaseException:
        del sys.modules[key]
        raise
    return module


def agent_name(agent: Any) -> str:
    """``module:function`` of an agent function, for messages."""
    return f"{getattr(agent, '__module__', '?')}:{getattr(agent, '__qualname__', repr(agent))}"


def runner_for(llm: LLM, agent_cfg: Any, judge: Judge | None = None,
               temperature: float | None = None) -> ExternalRunner | None:
    """The :class:`ExternalRunner` of ``agent.kind: external`` (``agent_cfg.entry``, ``external_timeout_s``)
    over ``llm``, judged by ``judge`` (default: the agent config's, :func:`agent.judges.configured_judge`);
    ``None`` for the built-in loop. Raises ``ValueError`` when ``agent.entry`` is missing, and what
    :func:`load_entry` raises."""
    if getattr(agent_cfg, "kind", "builtin") != "external":
        return None
    if not agent_cfg.entry:
        raise ValueError(f"agent.kind=external needs agent.entry, {_ENTRY_FORMS}: an async function (question, "
                         "base_url) -> answer (e.g. examples.react_agent:answer or path/to/my_agent.py:answer)")
    return ExternalRunner(llm, load_entry(agent_cfg.entry), agent_cfg, temperature=temperature,
                          judge=judge or configured_judge(agent_cfg, llm), timeout_s=agent_cfg.external_timeout_s,
                          name=agent_cfg.entry)


def final_answer(text: Any) -> str | None:
    """The answer in an agent's reply: the text inside ``<answer>...</answer>`` when there is one, else the
    whole reply, stripped; ``None`` for an empty or non-string reply."""
    if not isinstance(text, str):
        return None
    m = _ANSWER_RE.search(text)
    text = (m.group(1) if m else text).strip()
    return text or None


Sampling = tuple[float, float] | None
"""An episode's ``(temperature, top_p)``, replacing the runner's; ``None``: the runner's own."""


class ExternalRunner:
    """Runs an external agent's episodes over a proxy it serves (see the module docstring).

    Args:
        llm: the policy backend (:class:`agent.llm.LLM`); the proxy batches concurrent calls.
        agent: the external agent (:func:`load_entry`). agent_cfg: the agent config (``max_new_tokens``,
            ``max_total_tokens``, ``temperature``, ``top_p``, ``reward``, ``format_reward``).
        temperature: overrides ``agent_cfg.temperature`` (0 = greedy); every call samples with it.
        judge: scores an episode (default: the rule judge of ``agent_cfg``).
        timeout_s: seconds an episode may take, its reruns included (one deadline from its start: a hung agent
            holds up a step for at most this long); also the proxy's limit on one model call.
        reruns: runs again of an episode that failed quickly (raised, never called the model), within what is
            left of its ``timeout_s``; an episode that timed out is not run again.
        name: the agent's name in error messages (default: its ``module:function``).

    Raises ``ValueError`` for a ``timeout_s`` that is not a finite number > 0. Use as a context manager, or call
    :meth:`close`. ``stats``: the proxy's counters (``calls``, ``splits``...) and the runner's: ``agent_errors``
    (episodes whose agent raised), ``timeouts`` and ``blocked`` (timed-out agents that did not stop when
    cancelled: a blocking call holds their thread, which is left behind).
    """

    def __init__(self, llm: LLM, agent: ExternalAgent, agent_cfg: Any, *, temperature: float | None = None,
                 judge: Judge | None = None, timeout_s: float = EXTERNAL_TIMEOUT_S, max_concurrency: int = 256,
                 reruns: int = 1, name: str | None = None):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"agent.external_timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        temp = agent_cfg.temperature if temperature is None else temperature
        settings = ProxySettings(max_new_tokens=agent_cfg.max_new_tokens, max_total_tokens=agent_cfg.max_total_tokens,
                                 temperature=temp, top_p=agent_cfg.top_p if temp > 0 else 1.0)
        self.agent, self.timeout_s, self.max_concurrency, self.reruns = agent, float(timeout_s), max_concurrency, reruns
        self.name = name or agent_name(agent)
        self.judge = judge or rule_judge(agent_cfg.reward, agent_cfg.format_reward)
        self.proxy = Proxy(llm, settings, ProxyLimits(request_timeout_s=self.timeout_s),
                           max_batch=getattr(agent_cfg, "max_batch", 256))
        self.counts = {"agent_errors": 0, "timeouts": 0, "blocked": 0}
        self.threads = AgentThreads()  # each episode on a worker thread of its own (agent.external.isolation)
        self.server = ProxyServer(self.proxy).start()

    @property
    def stats(self) -> dict[str, int]:
        return {**self.proxy.stats, **self.counts}

    async def run_episode(self, example: QAExample, group: int = 0, judge: Judge | None = None, *,
                          timeout_s: float | None = None, sampling: Sampling = None) -> list[Trajectory]:
        """One episode of ``example``: its sequences (one unless the template split it), judged by ``judge``
        (default: the runner's), the agent given ``timeout_s`` (default: the runner's) and its model calls
        sampled with ``sampling`` (default: the runner's). ``metadata["timed_out"]`` marks an episode whose
        agent ran out of time."""
        eid = f"{example.id}-{uuid.uuid4().hex[:12]}"
        limit = self.timeout_s if timeout_s is None else timeout_s
        if sampling is not None:
            self.proxy.sampling[eid] = sampling
        base_url = self.server.base_url(eid)
        try:
            run = await self.threads.run(lambda: self.agent(example.question, base_url), limit)
        except BaseException:  # cancelled (a client gone, sleuth serve's own limit): its record is dropped
            self.proxy.end(eid)
            self.proxy.take(eid)
            raise
        self.proxy.end(eid)  # calls it makes after this (a timed-out agent) get an error, not a record
        reply, error = run.result, self._error(run)
        answer = final_answer(reply)
        meta = {k: v for k, v in example.metadata.items() if k in ("hops", "dataset", "supporting_ids")}
        seqs = self.proxy.take(eid).trajectories(example.id, example.question, example.golden_answers, group, answer)
        if not seqs:  # the agent never called the model: nothing to train, an episode all the same
            seqs = [Trajectory(example.id, example.question, list(example.golden_answers), group=group, answer=answer,
                               metadata={"episode": eid, "segment": 0, "segments": 1})]
            error = error or f"the agent {self.name} returned {reply!r:.80} without calling the model at {base_url}"
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
                s.metadata.update(error=error, agent=self.name)
            if run.timed_out:
                s.metadata["timed_out"] = True
        return seqs

    def _error(self, run: Any) -> str | None:
        """The message of an episode's failure (naming the agent), counted in ``counts``; ``None`` if it
        did not fail."""
        if run.timed_out:
            self.counts["timeouts"] += 1
            self.counts["blocked"] += int(run.blocked)
            why = (": it is blocked in a call that does not return (time.sleep or a synchronous client inside "
                   "async code?); its thread is left behind" if run.blocked else "; it was cancelled")
            return f"the agent {self.name} took longer than {self.timeout_s:g} s (agent.external_timeout_s){why}"
        if run.error is not None:
            self.counts["agent_errors"] += 1
            e = run.error
            return f"the agent {self.name} raised {type(e).__name__}: {e}"
        return None

    async def arun_episodes(self, examples: list[QAExample], n_samples: int = 1, judge: Judge | None = None,
                            merge: bool = False, sampling: Sampling = None) -> list[Trajectory]:
        """``n_samples`` episodes per example, concurrently (at most ``max_concurrency`` at once); sequences
        come back grouped by example (group id = example index), episodes in order. ``merge``: one record per
        episode (:func:`merged`, for evaluation) instead of its training sequences. An episode that failed
        quickly is run again, at most ``reruns`` times (a fresh sample of its question in its group), within
        what is left of its ``timeout_s`` from its first start; one that timed out is not. The failed runs
        are counted in ``metadata["failed_attempts"]`` (the trainer leaves one that still failed out)."""
        gate = asyncio.Semaphore(self.max_concurrency)
        loop = asyncio.get_running_loop()

        async def one(ex: QAExample, g: int) -> list[Trajectory]:
            attempts = 0
            async with gate:  # the slot is held across reruns: they share one deadline
                deadline = loop.time() + self.timeout_s
                while True:
                    seqs = await self.run_episode(ex, g, judge, timeout_s=deadline - loop.time(), sampling=sampling)
                    failed = seqs[0].stop_reason == "error"
                    attempts += int(failed)
                    if (not failed or attempts > self.reruns or seqs[0].metadata.get("timed_out")
                            or deadline - loop.time() <= 0):
                        break
            for t in seqs:  # what training.rollout.faults.drop_failed counts
                t.metadata["failed_attempts"] = attempts
            return [merged(seqs)] if merge else seqs

        runs = await asyncio.gather(*(one(ex, g) for g, ex in enumerate(examples) for _ in range(n_samples)))
        return [t for seqs in runs for t in seqs]

    def run_episodes(self, examples: list[QAExample], n_samples: int = 1, judge: Judge | None = None,
                     merge: bool = False, sampling: Sampling = None) -> list[Trajectory]:
        """Synchronous :meth:`arun_episodes` (in a fresh loop on a helper thread when one already runs)."""
        return run_sync(self.arun_episodes(examples, n_samples, judge, merge, sampling))

    def sampling_at(self, temperature: float | None, top_p: float | None = None) -> Sampling:
        """The :data:`Sampling` of ``temperature`` and ``top_p`` (``None``: the runner's own); 1.0 for
        ``top_p`` at temperature 0 (greedy)."""
        s = self.proxy.settings
        if temperature is None and top_p is None:
            return None
        t = s.temperature if temperature is None else temperature
        p = s.top_p if top_p is None else top_p
        return float(t), float(p if t > 0 else 1.0)

    def loop_episodes(self, examples: list[QAExample], llm: Any = None, retriever: Any = None, cfg: Any = None, *,
                      n_samples: int = 1, temperature: float | None = None, top_k: int | None = None,
                      seed: int | None = None, judge: Judge | None = None, merge: bool = True) -> list[Trajectory]:
        """:func:`agent.loop.batch.run_episodes`'s signature over the external agent (``llm``, ``retriever``,
        ``cfg``, ``top_k`` and ``seed`` are the runner's own and ignored), e.g. for
        ``eval.run.run_benchmarks``'s ``run_episodes``: one record per episode by default. ``temperature``
        applies to this call's episodes only."""
        return self.run_episodes(examples, n_samples, judge, merge, self.sampling_at(temperature))

    def close(self) -> None:
        self.threads.close()
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
