"""Behaviour priming (Jin, Paladugu and Xiong, 2025, "Beneficial Reasoning Behaviors in Agentic Search and
Effective Post-training to Obtain Them", arXiv 2510.06534): an SFT warm start on trajectories that show four
search behaviours, before RL.

The paper finds four behaviours in successful search trajectories and primes a policy with them:

* **information verification**: checking a found answer against the sources before committing to it;
* **authority evaluation**: when results disagree or mix sources, relying on the one that is authoritative
  for the fact (here: the passage *about* the entity that was searched);
* **adaptive search**: changing the query when a search did not bring what was needed (narrowing or
  broadening);
* **error recovery**: noticing a wrong step (an invalid action, a search off the question's track) and
  correcting it.

Its SFT data are trajectories of a strong model that an LLM judge labels with these behaviours; the primed
set keeps those that show all four, against two baselines of the same size: trajectories drawn at random, and
trajectories with a correct answer only (the behaviours, not the correctness, carry the gain). Sleuth has no
strong model on the synthetic task, so the trajectories come from a scripted oracle that acts out a chosen
subset of the behaviours through the real agent loop (:func:`primed_action`, one action per turn, read off the
observations so far) and a rule-based labeller stands in for the judge (:func:`exhibited_behaviours`). The
selectors (:func:`select_primed`, :func:`select_random`, :func:`select_correct`) build the three SFT sets. The
authors published no code at the time of writing; the oracle, the rules and the think templates are
Sleuth's.

Observations are read in Sleuth's document format, one ``Doc i(Title: <title>) <text>`` line per document.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from agent.metrics import normalize_answer
from agent.trajectory import Turn

BEHAVIOURS = ("verification", "authority", "adaptive_search", "error_recovery")
_DOC_RE = re.compile(r"^Doc \d+\(Title: (.*?)\) (.*)$")
T = TypeVar("T")


def parse_docs(observation: str | None) -> list[tuple[str, str]]:
    """``[(title, text)]`` of a search observation's ``Doc i(Title: t) text`` lines (a title holding ``") "`` is
    cut there); ``[]`` for none or another kind of observation."""
    out = []
    for line in (observation or "").splitlines():
        m = _DOC_RE.match(line.strip())
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def _mentions(text: str, entity: str) -> bool:
    e = normalize_answer(entity)
    return bool(e) and f" {e} " in f" {normalize_answer(text)} "


def check_behaviours(behaviours: Sequence[str]) -> frozenset[str]:
    """``behaviours`` as a frozenset; ``ValueError`` naming an unknown one and the four known."""
    bad = sorted(set(behaviours) - set(BEHAVIOURS))
    if bad:
        raise ValueError(f"unknown behaviour(s) {bad}; behaviour priming knows {', '.join(BEHAVIOURS)}")
    return frozenset(behaviours)


# -- the scripted oracle ----------------------------------------------------------------------------------
def _think(text: str, on: bool) -> str:
    return f"<think> {text} </think> " if on else ""


def primed_action(question: str, chain: Sequence[str], turns: Sequence[Turn], behaviours: Sequence[str],
                  distractor: str | None = None, think: bool = False, broad_query: str | None = None) -> str:
    """The oracle's next action (``<search> q </search>`` or ``<answer> a </answer>``) for a question whose entity
    chain is ``chain = [e_0, ..., e_h]`` (``e_0`` named in the question, ``e_h`` the answer; hop ``k`` reads
    ``e_{k+1}`` in ``e_k``'s passage), given the episode's ``turns`` so far and the ``behaviours`` to act out:

    * ``error_recovery`` (with a ``distractor``, an entity off the question's track): the first search is the
      distractor; the next one returns to the chain;
    * ``adaptive_search``: the first on-track search is broad (``broad_query``, by default the whole
      question); when it does not bring ``e_1``, the next narrows it to ``e_0``;
    * ``verification``: once the answer is in the context, one more search for ``"e_{h-1} e_h"`` before
      answering;
    * ``authority`` needs no action of its own (the oracle always follows the passage about the searched
      entity); with ``think`` the choice is spelled out.

    Otherwise it searches the first chain entity whose successor it has not yet read (once: a search that did
    not bring the successor is not repeated), and answers ``e_h`` once it has read it or has no search left
    to try. ``think`` prefixes an action with a short ``<think>`` naming the behaviour it shows. Raises ``ValueError`` for a chain of fewer than two entities or an
    unknown behaviour."""
    want = check_behaviours(behaviours)
    if len(chain) < 2:
        raise ValueError(f"a chain needs the question's entity and the answer, got {list(chain)}")
    searches = [t for t in turns if t.action == "search"]
    queries = [t.query or "" for t in searches]
    seen = " \n ".join(t.observation or "" for t in searches)
    h = len(chain) - 1
    if "error_recovery" in want and distractor and not turns:
        return f"<search> {distractor} </search>"
    on_track = [q for q in queries if q != distractor]  # the broad query counts as on track
    off = f"That search was off track; back to {chain[0]}."
    if "adaptive_search" in want and not on_track:
        return _think(off, think and bool(queries)) + f"<search> {broad_query or question} </search>"
    missing = [k for k in range(h) if not _mentions(seen, chain[k + 1])]
    if missing and not any(normalize_answer(q) == normalize_answer(chain[missing[0]]) for q in queries):
        k = missing[0]
        if queries and queries[-1] == distractor:
            why = off
        elif k == 0 and on_track:
            why = f"The search missed {chain[1]}; I narrow it to {chain[0]}."
        else:
            why = _authority_note(searches, think)
        return _think(why, think and bool(why)) + f"<search> {chain[k]} </search>"
    if "verification" in want and not missing and not any(_mentions(q, chain[h]) for q in queries):
        return _think(f"Let me check that {chain[h]} is right before answering.", think) + \
            f"<search> {chain[h - 1]} {chain[h]} </search>"
    note = _authority_note(searches, think)
    return _think(note, think and bool(note)) + f"<answer> {chain[h]} </answer>"


def _authority_note(searches: Sequence[Turn], think: bool) -> str:
    """With ``think``, the sentence naming the document trusted for the last search's entity when the last
    observation did not list it first; else ``""``."""
    if not think or not searches:
        return ""
    entity = searches[-1].query or ""
    for m, (title, _) in enumerate(parse_docs(searches[-1].observation)):
        if m > 0 and normalize_answer(title) == normalize_answer(entity):
            return f"Doc {m + 1} is the page about {entity}; I trust it over Doc 1."
    return ""


def pick_distractor(candidates: Sequence[str], chain: Sequence[str], rng: random.Random) -> str:
    """An entity off the question's track for ``error_recovery``: a candidate (e.g. a corpus title) that is not
    in ``chain``. Raises ``ValueError`` when every candidate is in the chain."""
    pool = [c for c in candidates if normalize_answer(c) not in {normalize_answer(e) for e in chain}]
    if not pool:
        raise ValueError("no distractor: every candidate is on the question's chain")
    return rng.choice(pool)


def sample_behaviours(rng: random.Random, p: float = 0.5) -> frozenset[str]:
    """A random subset of the four behaviours, each kept with probability ``p`` (to build the pool that the
    selectors choose from)."""
    return frozenset(b for b in BEHAVIOURS if rng.random() < p)


# -- the labeller -----------------------------------------------------------------------------------------
def _on_track(query: str, question: str, targets: Sequence[str]) -> bool:
    if any(_mentions(query, t) for t in targets):
        return True
    q_words = {w for w in normalize_answer(question).split() if len(w) >= 4}
    return bool(q_words & set(normalize_answer(query).split()))


def _new_target(obs: str | None, before: str, targets: Sequence[str]) -> bool:
    return any(_mentions(obs or "", t) and not _mentions(before, t) for t in targets)


def exhibited_behaviours(question: str, turns: Sequence[Turn], targets: Sequence[str],
                         answer: str | None = None) -> frozenset[str]:
    """The behaviours an episode shows, by rules over its turns. ``targets``: the entities whose discovery is
    progress (a chain's ``e_1 .. e_h``; or the supporting titles and the gold answer); ``answer``: the
    episode's final answer.

    * ``verification``: a search made after the final answer was already in the context, whose result
      mentions it again;
    * ``authority``: a result listing several documents whose first is not about the searched entity but a
      later one is, followed by an action naming something that only the later document said;
    * ``adaptive_search``: an on-track search (naming a target or sharing a word of 4+ letters with the
      question) that revealed no new target, followed by a different on-track search;
    * ``error_recovery``: an invalid action followed by a valid one, or an off-track search followed by an
      on-track one."""
    ts = sorted(turns, key=lambda t: t.index)
    found: set[str] = set()
    context = question
    for j, t in enumerate(ts):
        nxt = ts[j + 1] if j + 1 < len(ts) else None
        nxt_text = ((nxt.query or nxt.answer or nxt.text) if nxt else "") or ""
        if t.action == "invalid" and nxt is not None and nxt.action in ("search", "answer"):
            found.add("error_recovery")
        if t.action != "search":
            continue
        q = t.query or ""
        on = _on_track(q, question, targets)
        if nxt is not None and nxt.action == "search" and _on_track(nxt.query or "", question, targets):
            if not on:
                found.add("error_recovery")
            elif not _new_target(t.observation, context, targets) and normalize_answer(nxt.query or "") != normalize_answer(q):
                found.add("adaptive_search")
        if answer and _mentions(context, answer) and _mentions(t.observation or "", answer):
            found.add("verification")
        docs = parse_docs(t.observation)
        if len({normalize_answer(d[0]) for d in docs}) >= 2 and normalize_answer(docs[0][0]) != normalize_answer(q):
            for title, text in docs[1:]:
                if normalize_answer(title) == normalize_answer(q) and _only_in(nxt_text, text, docs[0][1], targets):
                    found.add("authority")
        context += "\n" + (t.observation or "")
    return frozenset(found)


def _only_in(action_text: str, trusted: str, first: str, targets: Sequence[str]) -> bool:
    """Whether the next action names a target that the trusted document mentions and the first does not."""
    return any(_mentions(action_text, e) and _mentions(trusted, e) and not _mentions(first, e) for e in targets)


# -- the selectors ----------------------------------------------------------------------------------------
def select_primed(items: Sequence[T], labels: Sequence[frozenset[str]], n: int, rng: random.Random,
                  correct: Sequence[bool] | None = None, outcome: str = "correct",
                  required: Sequence[str] = BEHAVIOURS) -> list[T]:
    """The behaviour-primed SFT set: ``n`` items drawn without replacement from those whose labels hold every
    ``required`` behaviour, restricted by ``outcome``: ``"correct"`` (the paper's primed set), ``"incorrect"``
    (its ablation: the behaviours with a wrong answer) or ``"any"`` (``correct`` may then be ``None``). Raises
    ``ValueError`` for an unknown behaviour or outcome, lists of different lengths, or fewer than ``n``
    qualifying items (the sets compared must be the same size)."""
    need = check_behaviours(required)
    if outcome not in ("correct", "incorrect", "any"):
        raise ValueError(f"outcome must be 'correct', 'incorrect' or 'any', got {outcome!r}")
    if len(labels) != len(items) or (correct is not None and len(correct) != len(items)):
        raise ValueError("items, labels and correct must be parallel lists")
    if outcome != "any" and correct is None:
        raise ValueError(f"outcome={outcome!r} needs the items' correctness")
    keep = [i for i, lab in enumerate(labels) if need <= lab and
            (outcome == "any" or bool(correct[i]) == (outcome == "correct"))]
    return _draw(items, keep, n, rng, f"{outcome} items showing {sorted(need)}")


def select_random(items: Sequence[T], n: int, rng: random.Random) -> list[T]:
    """The random baseline: ``n`` items drawn uniformly without replacement. ``ValueError`` if too few."""
    return _draw(items, list(range(len(items))), n, rng, "items")


def select_correct(items: Sequence[T], correct: Sequence[bool], n: int, rng: random.Random) -> list[T]:
    """The correct-outcome baseline: ``n`` items with a correct answer, drawn uniformly without replacement,
    whatever their behaviours. ``ValueError`` if too few or for lists of different lengths."""
    if len(correct) != len(items):
        raise ValueError("items and correct must be parallel lists")
    return _draw(items, [i for i, c in enumerate(correct) if c], n, rng, "correct items")


def _draw(items: Sequence[T], pool: list[int], n: int, rng: random.Random, what: str) -> list[T]:
    if n < 0 or n > len(pool):
        raise ValueError(f"asked for {n} {what}, only {len(pool)} of {len(items)} qualify")
    return [items[i] for i in sorted(rng.sample(pool, n))]


def behaviour_counts(labels: Sequence[frozenset[str]]) -> dict[str, Any]:
    """How often each behaviour occurs in ``labels`` and how many show all four (to report the SFT sets)."""
    out: dict[str, Any] = {b: sum(b in lab for lab in labels) for b in BEHAVIOURS}
    out["all"] = sum(set(BEHAVIOURS) <= lab for lab in labels)
    out["n"] = len(labels)
    return out
