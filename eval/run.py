"""Evaluation: a method on QA files or benchmarks with a resumable prediction cache, and the agent on a
list of questions in memory.

Entry point of ``sleuth eval`` (a QA file with ``--qa``, or ``--benchmarks``; any method):
:func:`run_benchmarks`. For each QA file or benchmark it
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
from agent.trajectory import Trajectory, save_trajectories
from corpora.formats import QAExample
from eval.cache import (
    PredictionCache,
    describe_llm,
    describe_retriever,
    fingerprint,
    path_manifest,
    safe_name,
)
from eval.datasets import (
    REGISTRY,
    benchmark_path,
    expand_benchmarks,
    load_benchmark,
    locate_benchmarks,
)
from eval.methods import Method, get_method, make_method
from eval.metrics import aggregate, exact_match, f1_score, judge_score
from eval.prompting import trajectory_record

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
        "retriever": describe_retriever(retriever, index_dir) if get_method(method).retrieves else None,
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
    keep_trajectories: bool = False,
) -> dict[str, Any]:
    """Evaluate ``method`` on ``benchmarks`` and return the run summary (also saved as JSON).

    Args:
        benchmarks: registry names, ``"all"`` (the seven benchmarks), comma-separated lists, or QA file
            paths (any format :func:`corpora.qa.read_qa` reads).
        method: a name of :data:`eval.methods.EVAL_METHODS` (``direct``, ``rag``, ``ircot``, ``agent``,
            ``search_o1``, and what plugins register).
        limit, seed: deterministic sub-sample of each benchmark (``None`` = all questions); ``seed`` is also
            the sampling seed when ``temperature > 0``.
        out_dir: the run directory; predictions go to ``out_dir/<method>-<fingerprint>/``.
        llm: an :class:`agent.llm.LLM` backend; retriever: a :class:`retrieval.base.Retriever` (may be
            ``None`` for ``direct``); agent_cfg: a :class:`agent.config.AgentConfig`.
        data_dir: root of the benchmark files (default ``$SLEUTH_DATA_DIR``, else the folder ``sleuth data get``
            fills: :func:`corpora.catalog.resolve_data_dir`).
        top_k, temperature: passages per search and decoding temperature (0 = greedy).
        method_options: more :class:`eval.methods.MethodContext` settings (``max_steps``, ``max_docs``...).
        run_episodes: the agent loop of a method that runs episodes (default: the built-in one).
        index_dir, model_dir, fingerprint_extra: added to the config fingerprint (index and model manifests,
            anything else that determines the predictions).
        batch_size: questions per method call (and per cache append).
        method_fn: use this ``examples -> records`` callable instead of building ``method`` (tests, custom
            baselines); it is still cached under ``method``.
        judge_llm: an :class:`agent.llm.LLM` backend that judges every computed record
            (:func:`judge_records`; ``None`` = no LLM judge); its description, ``judge_options``
            (``unparseable``: ``"zero"``/``"rule"``, ``fallback_metric``, ``max_new_tokens``; defaults
            :data:`JUDGE_DEFAULTS`) and ``judge_model_dir``'s manifest go into the fingerprint.
        keep_trajectories: with a method that runs episodes (``agent``), append the trajectories of the episodes computed in this
            call to ``<run dir>/<benchmark>.trajectories.jsonl``.

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
    entry = get_method(method)  # fail fast on an unknown method
    options: dict[str, Any] = {"top_k": top_k, "temperature": temperature, **(method_options or {})}
    if temperature > 0:
        options["sampling_seed"] = seed
    judge, judge_man = make_judge(judge_llm, judge_options, judge_model_dir)
    manifest = method_manifest(method, llm, retriever, agent_cfg, options, index_dir, model_dir, fingerprint_extra,
                               judge_man)
    cache = PredictionCache(out_dir, method, manifest)
    unjudged: PredictionCache | None = None
    if judge is not None:  # predictions of the same config without a judge are judged, not recomputed
        base = method_manifest(method, llm, retriever, agent_cfg, options, index_dir, model_dir, fingerprint_extra)
        if (Path(out_dir) / f"{method}-{fingerprint(base)}").is_dir():
            unjudged = PredictionCache(out_dir, method, base)
    kw = {k: v for k, v in options.items() if k != "sampling_seed"}
    if entry.episodes and run_episodes is not None:
        kw["run_episodes"] = run_episodes
    summary_path = cache.dir / SUMMARY
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update({"method": method, "fingerprint": cache.fingerprint, "run_dir": str(cache.dir), "benchmarks": {}})
    datasets = {n: load_benchmark(n, data_dir, limit, seed) for n in names}  # load all first: fail early
    ours: dict[str, Any] = {}  # the benchmarks this call scored
    for name, examples in datasets.items():
        t0 = time.perf_counter()
        fn = method_fn
        if fn is None:
            if entry.episodes and keep_trajectories:  # beside the predictions, those computed in this call
                path = cache.dir / f"{safe_name(name)}.trajectories.jsonl"
                kw["on_trajectories"] = lambda trajs, path=path: save_trajectories(path, trajs, append=True)
            fn = make_method(method, llm, retriever, agent_cfg, seed=seed, **kw)
        reuse = unjudged.load(name) if unjudged is not None else None
        records, computed = evaluate_benchmark(name, examples, fn, cache, batch_size, progress, judge, reuse)
        ours[name] = benchmark_metrics(name, examples, records, computed, data_dir, limit, seed, t0)
        write_summary(summary_path, summary, ours)
    return summary


def write_summary(path: Path, summary: dict[str, Any], ours: dict[str, Any]) -> None:
    """Write ``summary`` with this call's benchmarks ``ours`` to ``path`` (through a temporary file renamed into
    place), keeping the other benchmarks another run of the same config may have written meanwhile."""
    if path.exists():
        summary["benchmarks"] = json.loads(path.read_text()).get("benchmarks", {})
    summary["benchmarks"].update(ours)
    summary["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.replace(path)


def make_judge(judge_llm: Any, judge_options: dict[str, Any] | None,
               judge_model_dir: str | Path | None) -> tuple[Judge | None, dict[str, Any] | None]:
    """The records judge of :func:`run_benchmarks` and its manifest (both ``None`` without ``judge_llm``).
    Raises ``ValueError`` for an unknown or invalid judge option, or options without a judge."""
    if judge_llm is None:
        if judge_options:
            raise ValueError("judge_options given without a judge_llm")
        return None, None
    unknown = set(judge_options or {}) - set(JUDGE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown judge option(s) {sorted(unknown)}; known: {', '.join(JUDGE_DEFAULTS)}")
    jopts = {**JUDGE_DEFAULTS, **(judge_options or {})}
    check_judge_options(**jopts)  # before any prediction is computed

    def judge(recs: list[dict[str, Any]]) -> None:
        judge_records(recs, judge_llm, **jopts)

    return judge, judge_manifest(judge_llm, jopts, judge_model_dir)


def benchmark_metrics(name: str, examples: list[QAExample], records: list[dict[str, Any]], computed: int,
                      data_dir: str | Path | None, limit: int | None, seed: int, t0: float) -> dict[str, Any]:
    """The summary entry of one QA file or benchmark: :func:`eval.metrics.aggregate` of its records plus
    where they came from (``file``, relative to the data directory or the working directory where it lies
    under one, so a summary names no machine's absolute paths), ``limit``, ``seed``, ``split``,
    ``multihop``, ``computed``, ``errors`` (and the ``first_error``'s text), ``elapsed_s`` and
    ``question_ids``."""
    metrics = aggregate(records, recall_k=RECALL_K)
    spec = REGISTRY.get(name)
    metrics.update({
        "limit": limit,
        "seed": seed,
        "file": _shown_path(benchmark_path(name, data_dir) if spec else Path(name), data_dir),
        "split": spec.split if spec else None,
        "multihop": spec.multihop if spec else any(r.get("hops") for r in records),
        "computed": computed,
        "errors": sum(_failed(r) for r in records),
        "first_error": next((r.get("error") or r.get("stop_reason") for r in records if _failed(r)), None),
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "question_ids": [e.id for e in examples],
    })
    return metrics


def _shown_path(path: Path, data_dir: str | Path | None) -> str:
    """``path`` relative to the benchmarks' data directory (``<data>/nq/test.jsonl``), else to the working
    directory, else as given: what a summary records of where its questions came from."""
    from eval.datasets import resolve_data_dir

    path = Path(path).resolve()
    for root, label in ((resolve_data_dir(data_dir), "<data>"), (Path.cwd(), ".")):
        try:
            return f"{label}/{path.relative_to(root.resolve())}"
        except ValueError:
            continue
    return str(path)


def check_targets(targets: list[str], method: str, data_dir: str | Path | None, limit: int | None,
                  seed: int) -> None:
    """Raise the error :func:`run_benchmarks` would, before an index or a model is loaded: an unknown
    benchmark or method (``ValueError`` listing the known ones), a missing file (``FileNotFoundError``; for
    benchmarks, all the missing ones and the ``sleuth data get`` command that fetches them) or a
    malformed question (``DataFormatError`` naming file, line and field; every file is read, which takes
    well under a second for the seven benchmarks)."""
    get_method(method)
    names = expand_benchmarks(targets)
    locate_benchmarks(names, data_dir)  # every missing benchmark is named (with its fetch command) first
    for name in names:
        load_benchmark(name, data_dir, limit, seed)


def evaluate_agent(llm: Any, retriever: Any, examples: list[QAExample], agent_cfg: Any, *, top_k: int = 3,
                   temperature: float = 0.0, seed: int | None = 0,
                   run_episodes: Callable[..., list[Any]] | None = None) -> tuple[dict[str, Any], list[Trajectory]]:
    """Run the agent on ``examples`` in memory (no cache) and score it: what a run evaluates between its
    stages (the quickstart's before/after table, ``train.eval_every``). Greedy at ``temperature`` 0; the
    rule judge (an LLM judge, ``agent.judge=llm``, would cost a generation per answer).

    Returns ``(summary, trajectories)``; ``summary`` has n, em, f1, cover_em, recall (of supporting
    paragraphs among everything retrieved), search_calls, turns, generated_tokens, format_ok, wall_s
    (seconds per question) and errors (episodes that stopped on an error, e.g. a failed search, scored 0;
    the error is in each one's ``metadata["error"]``). ``run_episodes``: the agent to run, with
    :func:`agent.loop.batch.run_episodes`'s signature (default: that loop; an external agent's
    :meth:`agent.external.runner.ExternalRunner.loop_episodes`)."""
    from agent.judges import rule_judge

    if run_episodes is None:
        from agent.loop.batch import run_episodes
    t0 = time.time()
    trajs = run_episodes(examples, llm, retriever, agent_cfg, temperature=temperature, top_k=top_k, seed=seed,
                         judge=rule_judge())
    wall = (time.time() - t0) / max(len(examples), 1)
    records = [trajectory_record(t) | {"wall_s": wall} for t in trajs]
    summary = aggregate(records, by_hops=False)
    summary["format_ok"] = sum(bool(t.verdict.get("format_ok")) for t in trajs) / max(len(trajs), 1)
    summary["errors"] = sum(t.stop_reason == "error" for t in trajs)
    return summary, trajs


def write_eval_outputs(out_dir: Path, name: str, summary: dict[str, Any], trajs: list[Trajectory]) -> None:
    """Write ``<name>.json`` (the summary) and ``<name>.trajectories.jsonl`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=1))
    save_trajectories(out_dir / f"{name}.trajectories.jsonl", trajs)
