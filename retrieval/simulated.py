"""Simulated search (ZeroSearch, Sun et al., 2025): an LLM plays the search engine.

Given a query, the simulator writes ``k`` documents; each is *useful* (contains information that helps
answer the query) or *noisy* (plausible but unhelpful), drawn independently with the current noise
probability. The draw is per document, one prompt and one completion per document, so a result list mixes
useful and noisy documents. This differs from ZeroSearch's code, which draws once per search call and asks
for all five documents of that one kind in a single completion, with the training question and its gold
answer in the prompt; a :class:`~retrieval.base.Retriever` sees only the query, so neither is in
:func:`simulator_prompt`. A curriculum raises the noise probability over training steps with ZeroSearch's schedule

    p(i) = p_s + (b^(i/m) - 1) / (b - 1) * (p_e - p_s)

(step ``i`` of ``m``, start ``p_s``, end ``p_e``, base ``b``; ZeroSearch uses ``b = 4``).

This module implements :class:`retrieval.base.Retriever` and knows nothing about the agent: the
composition root passes a plain ``generate(prompts: list[str]) -> list[str]`` (e.g. built from any
:class:`agent.llm.LLM` with :func:`agent.llm.complete`). :func:`simulator_prompt` is shared with the
command that builds the simulator's fine-tuning data (``sleuth simulator-data``), so the fine-tuned
simulator sees exactly the prompts it was trained on.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable

from retrieval.base import Hit, check_queries

USEFUL, NOISY = "useful", "noisy"

PROMPT = (
    "You are a search engine. Given a query, write one {kind} Wikipedia-style document for it.{hint}\n"
    "Query: {query}\n"
    "Write the document as a title line followed by one paragraph of about 60 words.\n"
    "Document:\n"
)
_KIND_TEXT = {
    USEFUL: "useful",
    NOISY: "noisy",
}
_HINT = {
    USEFUL: " The document must contain information that helps answer the query.",
    NOISY: " The document must look relevant but must not contain the information needed to answer the query.",
}


def curriculum_noise(step: int, total_steps: int, start: float, end: float, base: float = 4.0) -> float:
    """ZeroSearch's noise probability at training step ``step`` of ``total_steps``.

    ``p = start + (base**(step/total_steps) - 1) / (base - 1) * (end - start)``, with ``step`` clamped to
    ``[0, total_steps]``; ``base == 1`` is the linear limit. Raises ``ValueError`` for ``total_steps < 1``,
    probabilities outside [0, 1] or a ``base`` that is not a finite number > 0 (NaN included).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not (0.0 <= start <= 1.0 and 0.0 <= end <= 1.0):
        raise ValueError(f"noise probabilities must lie in [0, 1], got start={start}, end={end}")
    if not 0 < base < math.inf:
        raise ValueError(f"base must be a finite number > 0, got {base}")
    frac = min(max(step, 0), total_steps) / total_steps
    ramp = frac if abs(base - 1.0) < 1e-12 else (base**frac - 1.0) / (base - 1.0)
    return start + ramp * (end - start)


def simulator_prompt(query: str, kind: str) -> str:
    """The prompt asking the simulator for one ``kind`` (``"useful"``/``"noisy"``) document for ``query``."""
    if kind not in _KIND_TEXT:
        raise ValueError(f"kind must be 'useful' or 'noisy', got {kind!r}")
    return PROMPT.format(kind=_KIND_TEXT[kind], hint=_HINT[kind], query=" ".join(query.split()))


def document_completion(title: str, text: str) -> str:
    """The simulator's target output for a document (title line, then the paragraph)."""
    return f"{title.strip()}\n{' '.join(text.split())}"


class SimulatedSearch:
    """A :class:`retrieval.base.Retriever` whose documents are written by an LLM.

    Args:
        generate: ``prompts -> completions`` (one string per prompt, same order), e.g.
            ``lambda ps: agent.llm.complete(llm, ps, params)``.
        noise_start, noise_end, noise_base: the curriculum (``p_s``, ``p_e``, ``b``).
        total_steps: ``m``; call :meth:`set_step` as training advances (noise starts at ``p_s``).
        seed: the useful/noisy draws are a deterministic function of ``(seed, step, n, query, rank)``, where
            ``n`` counts the earlier searches of the same query at this step (in this call or earlier ones):
            repeated searches of a query (a GRPO group's rollouts) draw independently, as ZeroSearch's per-call
            draws do, and the same calls with the same seed draw the same labels.
        max_doc_chars: generated documents are cut to this many characters (an integer >= 1, else
            ``ValueError``; so are the curriculum's bad values, see :func:`curriculum_noise`).

    Each :class:`~retrieval.base.Hit` has ``id = "sim:<useful|noisy>:<query hash>:<rank>"`` (the label is in
    the id so evaluation can count useful documents), the first line of the completion as title, and a
    descending pseudo-score; a blank query gets no hits. ``last_labels`` holds the labels of the latest call.
    Raises ``TypeError`` / ``ValueError`` for malformed queries or ``k`` not an integer >= 1
    (:func:`retrieval.base.check_queries`); an exception from ``generate`` propagates, and an empty (or blank)
    completion is a ``RuntimeError`` naming the query (the agent loop fails the episode with either).
    """

    def __init__(self, generate: Callable[[list[str]], list[str]], noise_start: float = 0.0,
                 noise_end: float = 0.5, noise_base: float = 4.0, total_steps: int = 1, seed: int = 0,
                 max_doc_chars: int = 1000):
        curriculum_noise(0, max(total_steps, 1), noise_start, noise_end, noise_base)  # validates
        if isinstance(max_doc_chars, bool) or not isinstance(max_doc_chars, int) or max_doc_chars < 1:
            raise ValueError(f"max_doc_chars must be an integer >= 1, got {max_doc_chars!r}")
        self.generate = generate
        self.noise_start, self.noise_end, self.noise_base = noise_start, noise_end, noise_base
        self.total_steps = max(total_steps, 1)
        self.step = 0
        self.seed = seed
        self.max_doc_chars = max_doc_chars
        self.last_labels: list[list[str]] = []
        self._searched: dict[str, int] = {}  # searches of each query at this step (``n`` of the draws)

    @property
    def noise_probability(self) -> float:
        return curriculum_noise(self.step, self.total_steps, self.noise_start, self.noise_end, self.noise_base)

    def set_step(self, step: int, total_steps: int | None = None) -> None:
        """Advance the curriculum to training step ``step`` (of ``total_steps`` when given) and count repeated
        searches afresh, so the step draws the same whatever was searched before it (a resumed run, SFT)."""
        if total_steps is not None:
            self.total_steps = max(total_steps, 1)
        self._searched = {}
        self.step = step

    def _label(self, query: str, n: int, rank: int, p: float) -> str:
        h = hashlib.sha256(f"{self.seed}|{self.step}|{n}|{rank}|{query}".encode()).digest()
        return NOISY if random.Random(h).random() < p else USEFUL

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        check_queries(queries, k)
        p = self.noise_probability
        # blank queries get no hits (as from every other retriever) and cost no simulator calls
        labels: list[list[str]] = []
        for q in queries:
            if not q.strip():
                labels.append([])
                continue
            n = self._searched.get(q, 0)
            self._searched[q] = n + 1
            labels.append([self._label(q, n, r, p) for r in range(k)])
        prompts = [simulator_prompt(q, lab) for q, labs in zip(queries, labels) for lab in labs]
        outs = self.generate(prompts) if prompts else []
        if len(outs) != len(prompts):
            raise RuntimeError(f"simulator returned {len(outs)} documents for {len(prompts)} prompts")
        self.last_labels = labels
        results, j = [], 0
        for q, labs in zip(queries, labels):
            qh = hashlib.sha1(q.encode()).hexdigest()[:10]
            hits = []
            for r, lab in enumerate(labs):
                doc = (outs[j] or "").strip()[: self.max_doc_chars]
                j += 1
                if not doc:  # not a hit titled with the query and no text: the policy would read its query back
                    raise RuntimeError(f"the simulator wrote an empty document {r + 1} of {len(labs)} ({lab}) for "
                                       f"query {q!r}")
                title, _, body = doc.partition("\n")
                title = title.strip() or q
                hits.append(Hit(id=f"sim:{lab}:{qh}:{r}", title=title, contents=f"{title}\n{body.strip()}",
                                score=float(k - r)))
            results.append(hits)
        return results


class SelfSearch(SimulatedSearch):
    """SSRL's self-search (Fan et al., 2025, "SSRL: Self-Search Reinforcement Learning", arXiv 2508.10874): the
    search engine is played by the policy being trained, which writes the results of its own queries from its
    parametric knowledge; trained this way, the same policy is later run against a real retriever
    (sim-to-real).

    A :class:`SimulatedSearch` without noise (every document is asked to be useful: the policy writes what it
    knows) whose ``generate`` is bound to the policy when training starts (:meth:`bind_policy`; the trainer
    binds its rollout backend, so the engine follows every update), else ``generate`` as given (the policy's
    weights loaded on their own, for evaluation: ``make_generate()``, called on first use). A blank completion (a policy that stops at once) becomes
    the document ``"<query>\\n(no result)"``, not an error: what the policy writes is the result. The
    reference writes the information in the same pass as the reasoning (its ``<information>`` tokens masked
    out of the loss); here the policy writes it in a separate call, as ZeroSearch's simulator does, and the
    agent loop gives it the tool role, so it is out of the loss as well."""

    def __init__(self, make_generate: Callable[[], Callable[[list[str]], list[str]]] | None = None, seed: int = 0,
                 max_doc_chars: int = 1000):
        super().__init__(self._write, 0.0, 0.0, total_steps=1, seed=seed, max_doc_chars=max_doc_chars)
        self._make, self._policy = make_generate, None

    def _write(self, prompts: list[str]) -> list[str]:
        if self._policy is None and self._make is not None:  # built on first use: not when training binds one
            self._policy = self._make()
        if self._policy is None:
            raise RuntimeError("the self-search engine has no policy to write its results (bind_policy)")
        outs = list(self._policy(prompts))
        if len(outs) != len(prompts):
            return outs  # SimulatedSearch.search names the mismatch
        queries = [p.split("Query: ", 1)[-1].split("\n", 1)[0] for p in prompts]
        return [o if (o or "").strip() else f"{q}\n(no result)" for o, q in zip(outs, queries, strict=True)]

    def bind_policy(self, generate: Callable[[list[str]], list[str]]) -> None:
        """Make ``generate(prompts) -> texts`` (the policy being trained) the engine from now on."""
        self._policy = generate
