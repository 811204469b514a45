"""The episode judges: what scores an episode's answer into its reward and verdict.

* :func:`rule_judge`: EM / F1 / cover-EM of the answer (:mod:`agent.metrics`), plus a format reward;
* :func:`llm_judge`: an LLM (any :class:`agent.llm.LLM` backend) decides whether the answer is correct, for
  answers that rule metrics cannot score (paraphrases, lists, dates written differently);
* :func:`with_self_judge`: either of them plus ReSeek's self-judge term (ReSeek, 2025: a JUDGE action rating each search result).

A judge is a function ``Trajectory -> (reward, verdict)``; one with ``blocking = True`` (the LLM judge) is
run in a worker thread by the agent loop. The verdict is the per-episode reward record: ``em``, ``f1``,
``cover_em``, ``format_ok``, plus ``llm_correct``, ``llm_verdict`` and ``llm_raw`` from the LLM judge and
``self_judge_acc``/``self_judgements`` when the episode judged itself.

LLM judge prompt: the question, the golden answers and the prediction; the judge must reply ``VERDICT:
correct`` or ``VERDICT: incorrect`` (greedy, a few tokens). Parsing takes the first ``VERDICT:`` line; a bare
leading ``correct``/``incorrect``/``yes``/``no`` is accepted too; a line naming both verdicts (the instruction
echoed back) is unparseable. **Unparseable verdicts** (anything else, an empty reply, a backend error) follow a
stated policy: ``"zero"`` scores 0 (never rewards what could not be verified), ``"rule"`` falls back to the
rule metric (EM by default). Either way the verdict record says ``llm_verdict: "unparseable"`` (or
``"error"``) with the raw reply, so the rate can be monitored. It is batched: :func:`judge_batch` scores many
trajectories in one backend call; :func:`judge_answers` is the same judge on plain (question, golden answers,
prediction) triples, which evaluation runs (:mod:`eval.run`) use on prediction records of any method.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from agent.llm import LLM, SamplingParams, complete
from agent.metrics import normalize_answer, rule_verdict
from agent.protocols.base import docs_content
from agent.trajectory import Trajectory

Judge = Callable[[Trajectory], tuple[float, dict[str, Any]]]

PROMPT = (
    "You are grading an answer to a question against the reference answers.\n"
    "Question: {question}\n"
    "Reference answers: {golds}\n"
    "Predicted answer: {prediction}\n"
    "Is the predicted answer correct (same meaning as a reference answer)? "
    "Reply with exactly one line: VERDICT: correct or VERDICT: incorrect\n"
)
# markdown emphasis or quotes around the label or the word are allowed: **VERDICT**: "correct"
_VERDICT_RE = re.compile(r"verdict[*_\s]*[:=][*_\s]*[*_\"'`]*\s*(correct|incorrect)\b", re.IGNORECASE)
_BARE_RE = re.compile(r"^\W*(correct|incorrect|yes|no)\b", re.IGNORECASE)
_WORD_RE = re.compile(r"\b(correct|incorrect|yes|no)\b", re.IGNORECASE)  # verdict words of a bare verdict


def judge_prompt(question: str, golden_answers: list[str], prediction: str) -> str:
    """The judge prompt for one answer."""
    golds = "; ".join(g.strip() for g in golden_answers) or "(none)"
    return PROMPT.format(question=" ".join(question.split()), golds=golds, prediction=" ".join(prediction.split()))


def parse_verdict(text: str) -> bool | None:
    """``True`` (correct), ``False`` (incorrect) or ``None`` (unparseable): the first ``VERDICT:`` line, else
    a bare leading verdict word (correct/yes, incorrect/no). A line that gives both verdicts (the
    instruction's ``VERDICT: correct or VERDICT: incorrect`` echoed back; "Yes, but incorrect") is
    unparseable."""
    text = text or ""
    m = _VERDICT_RE.search(text)
    if m:
        start, end = text.rfind("\n", 0, m.start()) + 1, text.find("\n", m.end())
        line = text[start:] if end < 0 else text[start:end]
        if len({v.lower() for v in _VERDICT_RE.findall(line)}) > 1:
            return None
        return m.group(1).lower() == "correct"
    m = _BARE_RE.match(text)
    if m:
        said = {w.lower() in ("correct", "yes") for w in _WORD_RE.findall(text.split("\n", 1)[0])}
        return None if len(said) > 1 else m.group(1).lower() in ("correct", "yes")
    return None


def check_judge_options(unparseable: str, fallback_metric: str, max_new_tokens: int) -> None:
    """Validate the judge's options (see :func:`judge_answers`); raises ``ValueError`` naming the bad one."""
    if unparseable not in ("zero", "rule"):
        raise ValueError(f"unparseable policy must be 'zero' or 'rule', got {unparseable!r}")
    if fallback_metric not in ("em", "f1", "cover_em"):
        raise ValueError(f"fallback_metric must be 'em', 'f1' or 'cover_em', got {fallback_metric!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def judge_answers(llm: LLM, questions: list[str], golden_answers: list[list[str]], predictions: list[str | None],
                  unparseable: str = "zero", fallback_metric: str = "em", max_new_tokens: int = 16) -> list[dict[str, Any]]:
    """Judge many answers with one batched, greedy backend call (the record-level judge used by
    :func:`judge_batch` and by evaluation runs).

    Args:
        llm: any :class:`agent.llm.LLM` backend (the judge model).
        questions, golden_answers, predictions: parallel lists, one entry per answer; a ``None`` (or blank)
            prediction is not sent to the judge.
        unparseable: ``"zero"`` or ``"rule"`` (see the module docstring).
        fallback_metric: the rule metric of the ``"rule"`` policy: ``"em"``, ``"f1"`` or ``"cover_em"``.
        max_new_tokens: tokens of each verdict.

    Returns one dict per answer, in order: ``llm_correct`` (float in [0, 1]), ``llm_verdict`` (``"correct"``,
    ``"incorrect"``, ``"unparseable"``, ``"error"`` or ``"no_answer"``) and ``llm_raw`` (the judge's reply,
    the backend error for ``"error"``, ``None`` when not judged). A backend exception marks every judged
    answer ``"error"`` and applies the unparseable policy to it. Raises ``ValueError`` for an unknown policy
    or fallback metric, a non-positive ``max_new_tokens``, or lists of different lengths.
    """
    check_judge_options(unparseable, fallback_metric, max_new_tokens)
    if not len(questions) == len(golden_answers) == len(predictions):
        raise ValueError(f"judge_answers needs parallel lists, got {len(questions)} questions, "
                         f"{len(golden_answers)} golden-answer lists and {len(predictions)} predictions")
    todo = [i for i, p in enumerate(predictions) if p is not None and p.strip()]
    prompts = [judge_prompt(questions[i], list(golden_answers[i]), predictions[i] or "") for i in todo]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=("\n\n",))
    try:
        replies: list[str] = list(complete(llm, prompts, params)) if prompts else []
        status = "ok"
        if len(replies) != len(prompts):
            raise RuntimeError(f"judge backend returned {len(replies)} replies for {len(prompts)} prompts")
    except Exception as e:  # noqa: BLE001 - judged by the stated policy, with the reason
        replies, status = [f"{type(e).__name__}: {e}"] * len(todo), "error"
    out: list[dict[str, Any]] = [{"llm_correct": 0.0, "llm_verdict": "no_answer", "llm_raw": None} for _ in predictions]
    for i, raw in zip(todo, replies, strict=True):
        parsed = parse_verdict(raw) if status == "ok" else None
        if parsed is None:
            score = rule_verdict(predictions[i], list(golden_answers[i]))[fallback_metric] if unparseable == "rule" else 0.0
            out[i] = {"llm_correct": float(score), "llm_verdict": "unparseable" if status == "ok" else "error", "llm_raw": raw}
        else:
            out[i] = {"llm_correct": float(parsed), "llm_verdict": "correct" if parsed else "incorrect", "llm_raw": raw}
    return out


def judge_batch(llm: LLM, trajs: list[Trajectory], unparseable: str = "zero", fallback_metric: str = "em",
                format_reward: float = 0.0, max_new_tokens: int = 16) -> list[tuple[float, dict[str, Any]]]:
    """Score ``trajs`` with one batched judge call (:func:`judge_answers`); returns ``(reward, verdict)`` per
    trajectory: the rule verdict (``em``, ``f1``, ``cover_em``), ``format_ok`` and the judge's
    ``llm_correct``, ``llm_verdict``, ``llm_raw``; reward = ``llm_correct`` (+ ``format_reward`` when the
    format is valid).

    Episodes without an answer are not sent to the judge (reward 0, ``llm_verdict: "no_answer"``).
    ``unparseable`` is ``"zero"`` or ``"rule"`` (see the module docstring). Raises ``ValueError`` for
    another policy; a backend exception marks every judged episode ``llm_verdict: "error"`` and applies
    the unparseable policy to it.
    """
    judged = judge_answers(llm, [t.question for t in trajs], [list(t.golden_answers) for t in trajs],
                           [t.answer for t in trajs], unparseable, fallback_metric, max_new_tokens)
    out = []
    for t, j in zip(trajs, judged, strict=True):
        v: dict[str, Any] = rule_verdict(t.answer, t.golden_answers)
        v["format_ok"] = bool(t.answer is not None and all(x.error is None for x in t.turns))
        v.update(j)
        out.append((v["llm_correct"] + (format_reward if v["format_ok"] else 0.0), v))
    return out


def llm_judge(llm: LLM, unparseable: str = "zero", fallback_metric: str = "em", format_reward: float = 0.0,
              max_new_tokens: int = 16) -> Callable[[Trajectory], tuple[float, dict[str, Any]]]:
    """A per-episode judge for :func:`agent.loop.batch.run_episodes` (``judge=``): one backend call per
    episode (the batch form is :func:`judge_batch`)."""

    def judge(traj: Trajectory) -> tuple[float, dict[str, Any]]:
        return judge_batch(llm, [traj], unparseable, fallback_metric, format_reward, max_new_tokens)[0]

    judge.blocking = True  # type: ignore[attr-defined]  # the loop runs it in a worker thread
    return judge


# -- the rule judge and ReSeek's self-judge ---------------------------------------------------------------
def rule_judge(reward_metric: str = "em", format_reward: float = 0.0, self_judge_reward: float = 0.0) -> Judge:
    """The default judge: EM / F1 / cover-EM of the answer (reward = the chosen metric), plus
    ``format_reward`` when every turn was well formed and the episode ended with an answer, plus
    ``self_judge_reward`` times the fraction of self-judgements that agree with the gold (ReSeek).

    The verdict is the per-episode reward record: ``em``, ``f1``, ``cover_em``, ``format_ok`` and, when
    the episode judged itself, ``self_judge_acc`` and ``self_judgements``."""

    def judge(traj: Trajectory) -> tuple[float, dict[str, Any]]:
        verdict: dict[str, Any] = rule_verdict(traj.answer, traj.golden_answers)
        verdict["format_ok"] = bool(traj.answer is not None and all(t.error is None for t in traj.turns))
        return verdict[reward_metric] + (format_reward if verdict["format_ok"] else 0.0), verdict

    return with_self_judge(judge, self_judge_reward)


def self_judge_agreement(traj: Trajectory) -> tuple[int, int]:
    """ReSeek self-judge bookkeeping: ``(agreeing, total)`` over the turns that rated the previous
    observation. A rating agrees when it says ``useful`` exactly when that observation's documents (titles
    and texts, not the ``Doc i`` labels) contain a normalised golden answer (the information that leads to
    the answer)."""
    golds = [g for g in (normalize_answer(x) for x in traj.golden_answers) if g]
    agree = total = 0
    for prev, turn in zip(traj.turns, traj.turns[1:]):
        if turn.judgement is None or prev.action != "search" or prev.observation is None:
            continue
        docs = normalize_answer(docs_content(prev.observation))
        useful = any(g in docs for g in golds)
        total += 1
        agree += int((turn.judgement == "useful") == useful)
    return agree, total


def with_self_judge(fn: Judge, self_judge_reward: float = 0.0) -> Judge:
    """``fn`` plus ReSeek's self-judge term: ``self_judge_reward`` times the fraction of self-judgements that
    agree with the gold (:func:`self_judge_agreement`) is added to the reward, and the verdict gets
    ``self_judge_acc`` and ``self_judgements``, when the episode judged itself. Keeps ``fn.blocking``."""

    def judge(traj: Trajectory) -> tuple[float, dict[str, Any]]:
        reward, verdict = fn(traj)
        agree, total = self_judge_agreement(traj)
        if total:
            verdict["self_judge_acc"] = agree / total
            verdict["self_judgements"] = total
            reward += self_judge_reward * agree / total
        return reward, verdict

    judge.blocking = getattr(fn, "blocking", False)  # type: ignore[attr-defined]
    return judge


def configured_judge(agent_cfg: Any, judge_llm: LLM | None = None) -> Judge:
    """The judge ``agent_cfg`` (an :class:`agent.config.AgentConfig`) asks for: the rule judge, or with
    ``agent.judge: llm`` the LLM judge (``agent.llm_judge``'s options) asking ``judge_llm`` (the policy
    backend, or the backend of ``agent.llm_judge.model`` that the composition root builds); either with
    ReSeek's self-judge term. Raises ``ValueError`` for ``judge: llm`` without a ``judge_llm``."""
    self_judge_reward = getattr(agent_cfg, "self_judge_reward", 0.0)
    if getattr(agent_cfg, "judge", "rule") != "llm":
        return rule_judge(agent_cfg.reward, agent_cfg.format_reward, self_judge_reward)
    if judge_llm is None:
        raise ValueError("agent.judge=llm needs a judge model backend")
    jc = agent_cfg.llm_judge
    return with_self_judge(llm_judge(judge_llm, jc.unparseable, agent_cfg.reward, agent_cfg.format_reward,
                                     jc.max_new_tokens), self_judge_reward)
