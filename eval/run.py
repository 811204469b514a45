"""Run a method on benchmarks with a resumable prediction cache, and summarise the metrics.

Entry point for ``sleuth eval --benchmarks ... --method ...``: :func:`run_benchmarks`. For each benchmark it
loads the (sub-sampled) questions, computes only the predictions missing from the cache (in batches, each
appended to the cache as soon as it is done), shows a progress bar with the live EM, and writes
``RUN_DIR/<method>-<fingerprint>/summary.json`` with the metrics of :func:`eval.metrics.aggregate`.

With a judge LLM (``judge_llm``), every computed batch is also scored by LLM-as-judge
(:func:`judge_records`, through :func:`agent.judges.judge_answers`) before it is cached, and the judge
model and its options are part of the fingerprint: judged and unjudged records, or records of two judges,
never share a cache; judging a config that already has unjudged predictions reuses them (judged, not recomputed).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from agent.judges import check_judge_options, judge_answers
from corpora.formats import QAExample
from eval.cache import PredictionCache, describe_llm, describe_retriever, fingerprint, path_manifest
from eval.datasets import REGISTRY, benchmark_path, expand_benchmarks, load_benchmark
from eval.methods import Method, get_method, make_method
from eval.metrics import aggregate, exact_match, f1_score, judge_score

SUMMARY = "summary.json"
RECALL_K = (1, 3, 5, 10)
JUDGE_DEFAULTS: dict[str, Any] = {"unparseable": "zero", "fallback_metric": "em", "max_new_tokens": 16}
Judge = Callable[[list[dict[str, Any]]], None]
CACHE_STAMP = ("method", "fingerprint", "benchmark")  # fields PredictionCache.append adds to every record
log = logging.getLogger(__name__)


def judge_records(records: list[dict[str, Any]], judge_llm: Any, unparseable: str = "zero",
                  fallback_metric: str = "em", max_new_tokens: int = 16) -> list[dict[str, Any]]:
    """Score prediction records by LLM-as-judge in one batched call of ``judge_llm``
    (:func:`agent.judges.judge_answers`): adds ``llm_correct``, ``llm_verdict`` and ``llm_raw`` to each
    record, in place, and returns ``records``. A record needs ``question`` (else ``KeyError`` naming it),
    ``golden_answers`` and ``prediction``."""
    for r in records:
        if not r.get("question"):
            raise KeyError(f"prediction record {r.get('id')!r} has no 'question' for the LLM judge")
    verdicts = judge_answers(judge_llm, [r["question"] for r in records], [list(r["golden_answers"]) for r in records],
                             [r.get("prediction") for r in records], unparseable, fallback_metric, max_new_tokens)
    for r, v in zip(records, verdicts, strict=True):
        r.update(v)
    return records


def judge_manifest(judge_llm: Any, options: dict[str, Any], judge_model_dir: str | Path | None = None) -> dict[str, Any]:
    """What an LLM judge's verdicts depend on, for the fingerprint: the judge model
    (:func:`eval.cache.describe_llm`, plus ``judge_model_dir``'s file manifest when given) and its options."""
    man: dict[str, Any] = {"model": describe_llm(judge_llm), "options": dict(options)}
    if judge_model_dir is not None:
        man["model"]["files"] = (path_manifest(judge_model_dir) if Path(judge_model_dir).exists()
                                 else {"name": str(judge_model_dir)})
    return man


def method_manifest(
    method: str,
    llm: Any,
    retriever: Any,
    agent_cfg: Any,
    options: dict[str, Any],
    index_dir: str | Path | None = None,
    model_dir: str | Path | None = None,
    extra: dict[str, Any] | None = None,
    judge: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a method's predictions depend on, hashed into the cache fingerprint: method name and
    options (``top_k``, ``temperature``, and the sampling seed when sampling), the agent config, the model
    (:func:`eval.cache.describe_llm`, plus ``model_dir``'s file manifest when given), the retriever and its
    index manifest (which records the corpus sha256), ``extra``, and the LLM judge (:func:`judge_manifest`;
    the key is absent without a judge, so unjudged runs keep their fingerprint). Not included: ``limit``
    and the sub-sampling seed (they choose questions, not answers), so a larger ``--limit`` reuses the
    cache."""
    cfg = agent_cfg.model_dump() if hasattr(agent_cfg, "model_dump") else agent_cfg
    man: dict[str, Any] = {
        "method": method,
        "options": options,
        "agent": cfg,
        "model": describe_llm(llm),
        "retriever": describe_retriever(retriever, index_dir) if method != "direct" else None,
    }
    if model_dir is not None:  # a local checkpoint is hashed; a hub id is recorded by name
        man["model"]["files"] = path_manifest(model_dir) if Path(model_dir).exists() else {"name": str(model_dir)}
    if extra:
        man["extra"] = extra
    if judge is not None:
        man["judge"] = judge
    return man


def _live_postfix(done: list[dict[str, Any]]) -> dict[str, str]:
    n = len(done) or 1
    out = {
        "EM": f"{sum(exact_match(r['prediction'], r['golden_answers']) for r in done) / n:.3f}",
        "F1": f"{sum(f1_score(r['prediction'], r['golden_answers']) for r in done) / n:.3f}",
        "calls": f"{sum(r.get('search_calls', 0) for r in done) / n:.2f}",
    }
    judged = [j for r in done if (j := judge_score(r)) is not None]
    if judged:
        out["judge"] = f"{sum(judged) / len(judged):.3f}"
    return out


def _same_question(record: dict[str, Any], example: QAExample) -> bool:
    """Whether a cached record answers ``example``: same question text (when recorded) and golden answers."""
    if record.get("question") is not None and record["question"] != example.question:
        return False
    return list(record.get("golden_answers") or []) == list(example.golden_answers)


def _failed(record: dict[str, Any]) -> bool:
    """Whether a prediction record is of an episode that ended on an error (``error`` set, e.g. by
    :func:`eval.methods.trajectory_fields`) rather than with an answer or out of budget."""
    return bool(record.get("error")) or record.get("stop_reason") == "error"


def _set_question_fields(record: dict[str, Any], example: QAExample, benchmark: str) -> dict[str, Any]:
    """Give ``record`` (in place) its example's ``supporting_ids``, ``hops`` and ``dataset``, and its
    ``question`` if it has none; returns ``record``."""
    record.setdefault("question", example.question)
    record["supporting_ids"] = example.metadata.get("supporting_ids")
    record["hops"] = example.metadata.get("hops")
    record["dataset"] = example.metadata.get("dataset", benchmark)
    return record


def evaluate_benchmark(
    benchmark: str,
    examples: Sequence[QAExample],
    method_fn: Method,
    cache: PredictionCache,
    batch_size: int = 32,
    progress: bool = True,
    judge: Judge | None = None,
    reuse: Mapping[str, dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Predictions for ``examples`` in order, computing only those missing from ``cache``.

    ``method_fn`` maps a batch of examples to records (see :mod:`eval.methods`); each batch is appended to
    the cache before the next starts. Records get the example's ``question``, ``supporting_ids``, ``hops``
    and ``dataset``; then ``judge`` (if given, e.g. :func:`judge_records` bound to a judge LLM) scores the
    batch in place, so the cached records carry the verdicts. ``reuse`` (question id -> record, e.g. the
    unjudged predictions of the same config) supplies predictions without calling the method; they are judged
    and cached like computed ones. A cached or reused record whose question or golden answers differ from
    its example's (the same id in other data: another data dir, an edited file) is recomputed, never scored,
    and so is one of an episode that ended on an error (:func:`_failed`: a dead retrieval server is no answer);
    a cached record that is reused gets the example's current ``supporting_ids``, ``hops`` and ``dataset``
    (they describe the question, and a QA file may gain or correct them after its predictions were cached).
    Returns ``(records, n_computed)`` (questions the method computed).
    Raises ``RuntimeError`` if the method returns records that do not match its batch.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cached = cache.load(benchmark)
    stale = [e.id for e in examples if e.id in cached and not _same_question(cached[e.id], e)]
    if stale:  # same benchmark name or path, other data (another --data-dir, an edited file): recompute
        log.warning("%s: %d cached prediction(s) are of other questions under the same id (e.g. %r); "
                    "recomputing them", benchmark, len(stale), stale[0])
        for qid in stale:
            del cached[qid]
    failed = [e.id for e in examples if e.id in cached and _failed(cached[e.id])]
    if failed:  # an episode that ended on an error (a dead retrieval server) is no answer: run it again
        log.warning("%s: %d cached prediction(s) ended on an error (e.g. %r: %s); recomputing them", benchmark,
                    len(failed), failed[0], cached[failed[0]].get("error"))
        for qid in failed:
            del cached[qid]
    if reuse:
        reuse = {e.id: reuse[e.id] for e in examples
                 if e.id in reuse and _same_question(reuse[e.id], e) and not _failed(reuse[e.id])}
    missing = [e for e in examples if e.id not in cached]
    done = [cached[e.id] for e in examples if e.id in cached]
    bar = tqdm(total=len(examples), initial=len(done), desc=f"{cache.method} {benchmark}", disable=not progress,
               unit="q", dynamic_ncols=True)
    if done:
        bar.set_postfix(_live_postfix(done))
    try:
        n_computed = 0
        for start in range(0, len(missing), batch_size):
            batch = missing[start : start + batch_size]
            todo = [e for e in batch if not reuse or e.id not in reuse]
            computed = method_fn(todo) if todo else []
            if [str(r.get("id")) for r in computed] != [e.id for e in todo]:
                raise RuntimeError(f"method {cache.method!r} returned records that do not match its batch of {len(todo)}")
            got = {e.id: r for e, r in zip(todo, computed, strict=True)}
            n_computed += len(todo)
            recs = [got[e.id] if e.id in got else {k: v for k, v in reuse[e.id].items() if k not in CACHE_STAMP}
                    for e in batch]
            for r, e in zip(recs, batch, strict=True):
                _set_question_fields(r, e, benchmark)
            if judge is not None:
                judge(recs)
            cache.append(benchmark, recs)
            for r, e in zip(recs, batch, strict=True):
                cached[e.id] = r
            done.extend(recs)
            bar.update(len(batch))
            bar.set_postfix(_live_postfix(done))
    finally:
        bar.close()
    return [_set_question_fields(cached[e.id], e, benchmark) for e in examples], n_computed


def run_benchmarks(
    benchmarks: list[str] | str,
    method: str,
    limit: int | None,
    seed: int,
    out_dir: str | Path,
    llm: Any,
    retriever: Any,
    agent_cfg: Any,
    data_dir: str | Path | None = None,
    *,
    top_k: int = 3,
    temperature: float = 0.0,
    method_options: dict[str, Any] | None = None,
    run_episodes: Callable[..., list[Any]] | None = None,
    index_dir: str | Path | None = None,
    model_dir: str | Path | None = None,
    fingerprint_extra: dict[str, Any] | None = None,
    batch_size: int = 32,
    progress: bool = True,
    method_fn: Method | None = None,
    judge_llm: Any = None,
    judge_options: dict[str, Any] | None = None,
    judge_model_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate ``method`` on ``benchmarks`` and return the run summary (also saved as JSON).

    Args:
        benchmarks: registry names, ``"all"`` (the seven benchmarks), comma-separated lists, or QA file
            paths (any format :func:`eval.datasets.read_qa_file` reads).
        method: a name of :data:`eval.methods.METHODS` (``direct``, ``rag``, ``ircot``, ``agent``,
            ``search_o1``).
        limit, seed: deterministic sub-sample of each benchmark (``None`` = all questions); ``seed`` is also
            the sampling seed when ``temperature > 0``.
        out_dir: the run directory; predictions go to ``out_dir/<method>-<fingerprint>/``.
        llm: an :class:`agent.llm.LLM` backend; retriever: a :class:`retrieval.base.Retriever` (may be
            ``None`` for ``direct``); agent_cfg: a :class:`agent.config.AgentConfig`.
        data_dir: root of the benchmark files (default ``$SLEUTH_DATA_DIR`` or ``../shared/data``).
        top_k, temperature: passages per search and decoding temperature (0 = greedy).
        method_options: more method keywords (``max_steps``, ``max_docs`` for IRCoT).
        run_episodes: the agent loop to use for ``agent`` (default :func:`agent.loop.run_episodes`).
        index_dir, model_dir, fingerprint_extra: added to the config fingerprint (index and model manifests,
            anything else that determines the predictions).
        batch_size: questions per method call (and per cache append).
        method_fn: use this ``examples -> records`` callable instead of building ``method`` (tests, custom
            baselines); it is still cached under ``method``.
        judge_llm: an :class:`agent.llm.LLM` backend that judges every computed record
            (:func:`judge_records`; ``None`` = no LLM judge); its description, ``judge_options``
            (``unparseable``: ``"zero"``/``"rule"``, ``fallback_metric``, ``max_new_tokens``; defaults
            :data:`JUDGE_DEFAULTS`) and ``judge_model_dir``'s manifest go into the fingerprint.

    Returns ``{"method", "fingerprint", "run_dir", "benchmarks": {name: metrics}}`` where metrics are those of
    :func:`eval.metrics.aggregate` plus ``limit``, ``seed``, ``file``, ``split``, ``multihop``,
    ``computed`` (questions computed in this call; the rest came from the cache), ``errors`` (questions whose
    episode ended on an error, scored 0 and recomputed by the next run); with a judge, ``judge_acc``
    and ``judge_unparseable`` are set.

    Raises :class:`eval.datasets.UnknownBenchmarkError` (lists known names) before any work, ``ValueError``
    for an unknown method or judge option, and :class:`eval.cache.CacheMismatchError` if the run dir holds predictions of
    another config under this fingerprint.
    """
    names = expand_benchmarks(benchmarks)
    get_method(method)  # fail fast on an unknown method
    options: dict[str, Any] = {"top_k": top_k, "temperature": temperature, **(method_options or {})}
    if temperature > 0:
        options["sampling_seed"] = seed
    judge: Judge | None = None
    judge_man = None
    if judge_llm is not None:
        unknown = set(judge_options or {}) - set(JUDGE_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown judge option(s) {sorted(unknown)}; known: {', '.join(JUDGE_DEFAULTS)}")
        jopts = {**JUDGE_DEFAULTS, **(judge_options or {})}
        check_judge_options(**jopts)  # before any prediction is computed
        judge_man = judge_manifest(judge_llm, jopts, judge_model_dir)

        def judge(recs: list[dict[str, Any]]) -> None:
            judge_records(recs, judge_llm, **jopts)
    elif judge_options:
        raise ValueError("judge_options given without a judge_llm")
    manifest = method_manifest(method, llm, retriever, agent_cfg, options, index_dir, model_dir, fingerprint_extra,
                               judge_man)
    cache = PredictionCache(out_dir, method, manifest)
    unjudged: PredictionCache | None = None
    if judge is not None:  # predictions of the same config without a judge are judged, not recomputed
        base = method_manifest(method, llm, retriever, agent_cfg, options, index_dir, model_dir, fingerprint_extra)
        if (Path(out_dir) / f"{method}-{fingerprint(base)}").is_dir():
            unjudged = PredictionCache(out_dir, method, base)
    if method_fn is None:
        kw = dict(options)
        kw.pop("sampling_seed", None)
        if method == "agent" and run_episodes is not None:
            kw["run_episodes"] = run_episodes
        method_fn = make_method(method, llm, retriever, agent_cfg, seed=seed, **kw)
    summary_path = cache.dir / SUMMARY
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update({"method": method, "fingerprint": cache.fingerprint, "run_dir": str(cache.dir)})
    summary.setdefault("benchmarks", {})
    datasets = {n: load_benchmark(n, data_dir, limit, seed) for n in names}  # load all first: fail early
    ours: dict[str, Any] = {}  # the benchmarks this call scored
    for name, examples in datasets.items():
        t0 = time.perf_counter()
        reuse = unjudged.load(name) if unjudged is not None else None
        records, computed = evaluate_benchmark(name, examples, method_fn, cache, batch_size, progress, judge, reuse)
        metrics = aggregate(records, recall_k=RECALL_K)
        spec = REGISTRY.get(name)
        metrics.update({
            "limit": limit,
            "seed": seed,
            "file": str(benchmark_path(name, data_dir)) if spec else str(Path(name).resolve()),
            "split": spec.split if spec else None,
            "multihop": spec.multihop if spec else any(r.get("hops") for r in records),
            "computed": computed,
            "errors": sum(_failed(r) for r in records),
            "elapsed_s": round(time.perf_counter() - t0, 3),
            "question_ids": [e.id for e in examples],
        })
        ours[name] = metrics
        if summary_path.exists():  # another run of this config may have written other benchmarks meanwhile
            summary["benchmarks"] = json.loads(summary_path.read_text()).get("benchmarks", {})
        summary["benchmarks"].update(ours)
        summary["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        tmp = summary_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(summary_path)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A markdown table of one run's summary: one row per benchmark (LLM-judge accuracy and unparseable
    verdicts as two more columns when the run was judged)."""
    cols = [("em", "EM"), ("f1", "F1"), ("cover_em", "cover-EM"), ("recall", "recall"),
            ("search_calls", "searches"), ("turns", "turns"), ("generated_tokens", "gen. tokens"),
            ("wall_s", "s/question")]
    if any(m.get("judge_acc") is not None for m in summary.get("benchmarks", {}).values()):
        cols[3:3] = [("judge_acc", "LLM-judge"), ("judge_unparseable", "unparseable")]
    head = f"| {summary.get('method', '')} | n | " + " | ".join(c for _, c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for name, m in summary.get("benchmarks", {}).items():
        cells = [_fmt(m.get(k), k) for k, _ in cols]
        lines.append(f"| {name} | {m.get('n', 0)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: Any, key: str) -> str:
    if v is None:
        return "-"
    if key in ("em", "f1", "cover_em", "recall", "judge_acc", "judge_unparseable"):
        return f"{100 * v:.1f}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)
