"""LLM-as-judge: an LLM (any :class:`agent.llm.LLM` backend) decides whether an answer is correct, for
answers that rule metrics cannot score (paraphrases, lists, dates written differently).

Prompt: the question, the golden answers and the prediction; the judge must reply ``VERDICT: correct`` or
``VERDICT: incorrect`` (greedy, a few tokens). Parsing takes the first ``VERDICT:`` line; a bare leading
``correct``/``incorrect``/``yes``/``no`` is accepted too; a line naming both verdicts (the instruction echoed
back) is unparseable. **Unparseable verdicts** (anything else, an empty reply, a backend error) follow a
stated policy: ``"zero"`` scores 0 (never rewards what could not be verified), ``"rule"`` falls back to the
rule metric (EM by default). Either way the verdict record says ``llm_verdict: "unparseable"`` (or
``"error"``) with the raw reply, so the rate can be monitored.

The judge produces the same per-episode reward record as :func:`agent.loop.rule_judge` (``em``, ``f1``,
``cover_em``, ``format_ok``) plus ``llm_correct``, ``llm_verdict`` and ``llm_raw``; the reward is
``llm_correct`` (+ the format reward). It is batched: :func:`judge_batch` scores many trajectories in one
backend call, which is how the trainer should use it; :func:`judge_answers` is the same judge on plain
(question, golden answers, prediction) triples, which evaluation runs (:mod:`eval.run`) use on prediction
records of any method.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from agent.judges import rule_verdict
from agent.llm import LLM, SamplingParams, complete
from agent.trajectory import Trajectory

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
    """A per-episode judge for :func:`agent.loop.run_episodes` (``judge=``): one backend call per episode
    (the batch form is :func:`judge_batch`)."""

    def judge(traj: Trajectory) -> tuple[float, dict[str, Any]]:
        return judge_batch(llm, [traj], unparseable, fallback_metric, format_reward, max_new_tokens)[0]

    judge.blocking = True  # type: ignore[attr-defined]  # the loop runs it in a worker thread
    return judge
