"""The composition root's wiring, shared by the subcommands: data paths, the retriever, the policy and judge
backends, and the training stages (SFT warm start, RL). Each command builds the retriever and the models once
and passes them down; the layers below never build their own."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from agent.trajectory import save_trajectories
from corpora import read_corpus, read_qa, sample_paths
from corpora.formats import QAExample
from sleuth.config import Config, dump_config
from sleuth.trained_settings import save_trained_settings


def data_paths(cfg: Config) -> dict[str, Path]:
    """Corpus / train / test paths: the config's, else the shipped sample's."""
    sample = sample_paths()
    return {k: Path(getattr(cfg.data, k) or sample[k]) for k in ("corpus", "train", "test")}


#: seconds per socket operation of the start-up ``/health`` probe of ``retrieval.url`` (two attempts)
HEALTH_PROBE_TIMEOUT_S = 10.0


def open_retriever(cfg: Config, index_dir: str | None = None, method: str | None = None, *,
                   cache_size: int | None = None, **load_options: Any):
    """The retriever of ``method`` (default ``retrieval.method``), opened as its registration says
    (:data:`retrieval.registry.RETRIEVERS`): the one way every command opens one. Raises ``ValueError`` for an
    unknown method (naming the registered ones and the closest) and ``IndexNotFoundError`` saying how to build
    a missing index.

    A method that searches an index directory opens ``index_dir`` (default ``retrieval.index_dir``) with
    ``retrieval.bm25_backend``, the chosen ``retrieval.dense_model`` and ``load_options``
    (:func:`retrieval.index.load_retriever`'s keywords: ``mmap``, ``n_threads``, ...); a dense or hybrid index
    is searched with the model it was built with, and a ``retrieval.dense_model`` the config sets to another
    model is a ``ValueError`` naming both and the rebuild command
    (:meth:`~sleuth.config.RetrievalConfig.chosen_dense_model`). A method whose documents an LLM writes
    (``simulated``: ZeroSearch) gets the ``generate`` callable of ``agent.simulator.model``, else of the policy
    model, so the retrieval layer never imports agent.

    Unless an ``index_dir`` is given here, ``retrieval.url`` (a running retrieval server, e.g. ``sleuth
    serve-retrieval``, which picks the method it serves) stands in for every method but one whose documents
    an LLM of this run writes (the simulated engine's noise follows the run's steps). It is asked for
    ``/health`` first (:data:`HEALTH_PROBE_TIMEOUT_S` a socket operation, two attempts), so a server that is
    down or hangs is a ``RetrievalServerError`` saying so before anything runs (the agent loop would keep it
    as one failed episode per question); a server that answers without a ``/health`` route (Search-R1's own)
    is taken as running.

    The retriever is searched through a query cache of ``cache_size`` ``(query, k)`` keys (default
    ``retrieval.cache_size``; 0: none; :class:`retrieval.cache.CachedRetriever`), shared by every rollout and
    step of the run, unless its entry says its answers are sampled (the simulated engine's noise changes per
    step).
    """
    from retrieval.registry import RETRIEVERS

    method = method or cfg.retrieval.method
    entry = RETRIEVERS.get(method)
    retriever = _open_entry(cfg, entry, index_dir, load_options)
    size = cfg.retrieval.cache_size if cache_size is None else cache_size
    if entry.cached and size:
        from retrieval.cache import CachedRetriever

        retriever = CachedRetriever(retriever, size)
    return retriever


def _open_entry(cfg: Config, entry, index_dir: str | None, load_options: dict[str, Any]):
    """:func:`open_retriever`'s retriever before its cache: the server at ``retrieval.url`` (unless an
    ``index_dir`` is given, or the method's documents are written by an LLM of this run), else what the entry
    opens."""
    from retrieval.registry import OpenRequest

    r = cfg.retrieval
    if r.url and index_dir is None and not entry.generative:
        from retrieval.client import RemoteRetriever

        try:  # a probe of its own: short timeout, one retry (the search client waits 60 s, 4 attempts)
            RemoteRetriever(r.url, timeout=HEALTH_PROBE_TIMEOUT_S, retries=1).health()
        except ValueError:  # it answered (HTTP 4xx, or not JSON): it is up
            pass
        return RemoteRetriever(r.url)
    options = {"bm25_backend": r.bm25_backend, "dense_model": r.chosen_dense_model(), **load_options}
    req = OpenRequest(Path(index_dir or r.index_dir), r, cfg, options, lambda: simulator_generate(cfg),
                      total_steps=max(cfg.train.steps, 1), seed=cfg.seed)
    return entry.open(req)


def simulator_generate(cfg: Config):
    """``generate(prompts) -> texts`` of the simulated search engine's LLM (ZeroSearch): ``agent.simulator.model``
    on the ``agent.backend`` kind, else the policy model (the tiny one when none is set), sampling
    ``agent.simulator.max_doc_tokens`` at ``agent.simulator.temperature``."""
    from agent.backends.build import make_llm
    from agent.llm import SamplingParams, complete

    s = cfg.agent.simulator
    backend = other_model_backend(cfg) if s.model else cfg.agent.backend
    sim_llm = make_llm(backend, str(s.model or cfg.policy.model or tiny_policy_path(cfg)),
                       cfg.policy.dtype, cfg.policy.device, cfg.seed)
    params = SamplingParams(max_new_tokens=s.max_doc_tokens, temperature=s.temperature, stop=())
    return lambda prompts: complete(sim_llm, prompts, params)


def needs_index(cfg: Config) -> bool:
    """Whether the configured retriever searches a local index directory: an index method
    (:attr:`retrieval.registry.RetrieverEntry.needs_index`) and no retrieval server (``retrieval.url``) in its
    place."""
    from retrieval.registry import RETRIEVERS

    return RETRIEVERS.get(cfg.retrieval.method).needs_index and not cfg.retrieval.url


def check_index_corpus(cfg: Config) -> None:
    """Warn when the index at ``retrieval.index_dir`` was built from another corpus than ``data.corpus`` (the
    shipped sample when unset): supporting ids, oracle titles and the tiny tokenizer come from the configured
    corpus, the hits from the index's. The corpus is hashed only when the two paths differ."""
    import warnings

    from retrieval.docstore import build_command
    from retrieval.index import file_fingerprint, read_manifest

    if not needs_index(cfg):
        return
    corpus = data_paths(cfg)["corpus"]
    man = read_manifest(cfg.retrieval.index_dir)
    built = man.get("corpus")
    if not built or Path(built).resolve() == corpus.resolve() or man.get("fingerprint") == file_fingerprint(corpus):
        return
    warnings.warn(f"the index at {cfg.retrieval.index_dir} was built from {built}, not from the configured corpus "
                  f"{corpus} (data.corpus): its passage ids and texts differ from the data's; rebuild it with: "
                  f"{build_command(cfg.retrieval.index_dir, str(corpus))}, or set retrieval.index_dir=...",
                  stacklevel=2)


def ensure_index(cfg: Config, log=print):
    """The configured retriever (:func:`open_retriever`), after building the index of the configured corpus
    when no complete one is there yet (nothing is built when the agent searches a server, ``retrieval.url``,
    or the simulated engine). Opened once: the caller passes it to every stage."""
    from retrieval.base import IndexNotFoundError
    from retrieval.registry import RETRIEVERS

    if not needs_index(cfg):
        return open_retriever(cfg)
    try:
        retriever = open_retriever(cfg)
        check_index_corpus(cfg)
        return retriever
    except IndexNotFoundError:
        pass
    from retrieval.index import build_index

    parts = RETRIEVERS.get(cfg.retrieval.method).index_parts
    log(f"building the index of {data_paths(cfg)['corpus']} in {cfg.retrieval.index_dir}")
    build_index(data_paths(cfg)["corpus"], cfg.retrieval.index_dir, dense_model=cfg.retrieval.dense_model,
                build_dense=cfg.retrieval.build_dense or "dense" in parts,
                build_lucene=cfg.retrieval.build_lucene or "lucene" in parts,
                batch_size=cfg.retrieval.dense_batch_size)
    return open_retriever(cfg)


def tiny_policy_path(cfg: Config, log=print) -> Path:
    """The tiny from-scratch policy of this run (``<out_dir>/tiny``), built on first use (under a temporary
    name, then renamed: an interrupted build is never taken for a finished one). With ``agent.kind:
    external`` its tokenizer also learns the agent's conversations (:func:`external_agent_texts`)."""
    import shutil

    from training.model.tiny import create_tiny_policy

    path = Path(cfg.out_dir) / "tiny"
    if not (path / "config.json").exists():
        paths = data_paths(cfg)
        log(f"training a BPE tokenizer and building the tiny Qwen2 policy in {path}")
        extra: list[str] = []
        if cfg.agent.kind == "external":
            try:
                extra = external_agent_texts(cfg)
            except ValueError as e:  # the agent's oracle episodes failed: a tokenizer of the corpus alone
                log(f"warning: the tiny policy's tokenizer learns the corpus only ({e})")
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        create_tiny_policy(tmp, read_corpus(paths["corpus"]), read_qa(paths["train"]), cfg.policy.tiny, cfg.seed, extra)
        shutil.rmtree(path, ignore_errors=True)  # an unfinished folder (no config.json) of an earlier build
        tmp.rename(path)
    return path


def external_agent_texts(cfg: Config, n: int = 3) -> list[str]:
    """The text of ``n`` oracle episodes of the external agent (its system prompt, its tools' schemas, the chat
    template's frames and tool calls; :func:`training.sft.external_oracle_trajectories` over the training
    questions of :func:`sft_questions`), rendered with a tokenizer trained on the corpus alone. The tiny
    policy's tokenizer learns them too, as a pretrained tokenizer knows its model's chat format: the agent's
    conversations then take about half the tokens (the ReAct example's ~660-1030 become ~320-500), and every
    SFT and RL step costs about a third. Raises what the oracle episodes raise (an agent that never searches)."""
    from agent.llm import decode
    from corpora.formats import iter_corpus
    from training.model.tiny import tokenizer_corpus, train_tokenizer
    from training.sft import external_oracle_trajectories

    paths = data_paths(cfg)
    train = read_qa(paths["train"])
    tok = train_tokenizer(tokenizer_corpus(read_corpus(paths["corpus"]), train, cfg.policy.tiny.tokenizer_texts),
                          cfg.policy.tiny.vocab_size)
    external_agent_env(cfg)
    titles = {p.id: p.title for p in iter_corpus(paths["corpus"])}
    trajs = external_oracle_trajectories(sft_questions(train, n), tok, cfg.agent, titles)
    return [decode(tok, t.token_ids) for t in trajs]


def resolve_model_path(path: str | Path) -> str | Path:
    """``path``, except that a checkpoints folder's ``latest`` pointer (``<run>/grpo/checkpoints/latest``, a file
    holding the name of the last complete ``step_*`` folder) gives that folder. A hub id is returned as given."""
    p = Path(path)
    if p.name == "latest" and p.is_file():
        target = p.parent / p.read_text().strip()
        if target.is_dir():
            return target
    return path


def load_llm(cfg: Config, model_path: str | Path | None = None, *, episodes: bool = True):
    """The policy backend (``agent.backend.kind``: transformers, vllm or openai) for ``model_path``, else
    ``policy.model``, else the tiny policy (a checkpoints ``latest`` pointer loads its step folder:
    :func:`resolve_model_path`). A model that runs agent episodes (``episodes``; not a judge) must hold
    ``agent.max_total_tokens`` (:func:`check_context_length`)."""
    from agent.backends.build import make_llm

    path = resolve_model_path(model_path or cfg.policy.model or tiny_policy_path(cfg))
    if episodes:
        check_context_length(cfg, path)
    return make_llm(cfg.agent.backend, str(path), cfg.policy.dtype, cfg.policy.device, cfg.seed)


def check_context_length(cfg: Config, model_path: str | Path) -> None:
    """Raise ``ValueError`` when ``agent.max_total_tokens`` (an episode's token budget) exceeds the context of
    the model in directory ``model_path``: ``max_position_embeddings`` of its ``config.json`` (of the text
    model for a multimodal one), times a ``rope_scaling`` factor when there is one. Nothing is checked when
    ``model_path`` has no readable ``config.json`` (a hub id, an API model)."""
    path = Path(model_path) / "config.json"
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    conf = conf.get("text_config") or conf
    positions = conf.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool):
        return
    factor = (conf.get("rope_scaling") or {}).get("factor") or 1
    limit = int(positions * factor) if isinstance(factor, (int, float)) and factor >= 1 else positions
    if cfg.agent.max_total_tokens > limit:
        raise ValueError(f"agent.max_total_tokens={cfg.agent.max_total_tokens} is more than the {limit} tokens of "
                         f"context of {model_path} (max_position_embeddings in {path}); lower "
                         "agent.max_total_tokens")


# -- evaluation ---------------------------------------------------------------------------------------
def answer_judge(cfg: Config):
    """The episode judge for ``agent.judge: llm`` with its own model (``agent.llm_judge.model``, on the
    ``agent.backend`` kind), for training and ``sleuth serve``; ``None`` otherwise: the rule judge, or the
    policy backend judging its own answers (:func:`agent.loop.nodes.make_context`)."""
    a = cfg.agent
    if a.judge != "llm" or not a.llm_judge.model:
        return None
    from agent.backends.build import make_llm
    from agent.judges import configured_judge

    judge_llm = make_llm(other_model_backend(cfg), str(a.llm_judge.model), cfg.policy.dtype, cfg.policy.device,
                         cfg.seed)
    return configured_judge(a, judge_llm)


def other_model_backend(cfg: Config):
    """``agent.backend`` for a model other than the policy (a judge, a simulator): the same kind and server,
    without ``agent.backend.model`` (the policy's served name), so the openai backend asks for that model."""
    return cfg.agent.backend.model_copy(update={"model": None})


def other_model_config(cfg: Config) -> Config:
    """``cfg`` with :func:`other_model_backend`: for :func:`load_llm` of a judge (``sleuth eval --judge-model``)."""
    return cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"backend": other_model_backend(cfg)})})


def save_run_config(cfg: Config) -> None:
    """Save the resolved config as ``<out_dir>/config.yaml`` beside the run's results."""
    dump_config(cfg, Path(cfg.out_dir) / "config.yaml")


# -- training stages ----------------------------------------------------------------------------------
def run_sft_stage(cfg: Config, retriever, log=print) -> Path:
    """SFT warm start on the trajectories of ``sft.data`` (:data:`training.sft_data.SFT_DATA`; the scripted
    oracle by default) on the training questions (searching ``retriever``; with ``agent.kind: external``,
    episodes of the agent itself with a scripted oracle behind the training proxy,
    :func:`training.sft.external_oracle_trajectories`); returns the model directory (``<out_dir>/sft``, written
    under a temporary name and renamed), reusing it when it already exists.

    One process: under torchrun run it on rank 0 only (``training.infra.distributed.run_on_rank0``, as
    ``sleuth train`` does); the other ranks then load the directory it returns. The weights are trained
    in-process, so they are loaded with transformers whatever ``agent.backend.kind`` is."""
    import shutil

    from tqdm import tqdm

    from agent.backends.hf import TransformersLLM
    from corpora.formats import iter_corpus
    from training.infra.checkpoint import commit_directory
    from training.sft import external_oracle_trajectories, sft_train
    from training.sft_data import SFTDataRequest, build_sft_data

    out = Path(cfg.out_dir) / "sft"
    if (out / "config.json").exists():
        log(f"SFT: reusing {out}")
        return out
    paths = data_paths(cfg)
    init = resolve_model_path(cfg.policy.model or tiny_policy_path(cfg, log))
    check_context_length(cfg, init)
    llm = TransformersLLM.from_pretrained(str(init), cfg.policy.dtype, cfg.policy.device)
    train = sft_questions(read_qa(paths["train"]), cfg.sft.max_examples)
    titles = {p.id: p.title for p in iter_corpus(paths["corpus"])}
    if cfg.agent.kind == "external":  # the agent itself, over the proxy, in its own chat template
        external_agent_env(cfg)
        trajs = external_oracle_trajectories(train, llm.tokenizer, cfg.agent, titles)
        name, stats = "oracle_trajectories.jsonl", None
    else:
        req = SFTDataRequest(train, llm.tokenizer, retriever, cfg.agent, titles, cfg.retrieval.top_k, cfg.seed)
        trajs = build_sft_data(cfg.sft, req)
        name = "oracle_trajectories.jsonl" if cfg.sft.data == "oracle" else f"sft_{cfg.sft.data}_trajectories.jsonl"
        stats = req.stats
    save_trajectories(Path(cfg.out_dir) / name, trajs)
    n_steps = cfg.sft.epochs * ((len(trajs) + cfg.sft.batch_size - 1) // cfg.sft.batch_size)
    log(f"SFT: {len(trajs)} {cfg.sft.data} trajectories, {cfg.sft.epochs} epochs ({n_steps} steps)"
        + (f"; behaviours {stats}" if stats else ""))
    bar = tqdm(total=n_steps, desc="SFT", unit="step")

    def progress(epoch: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}")

    history = sft_train(llm.model, llm.tokenizer, trajs, cfg.sft, seed=cfg.seed,
                        max_len=cfg.agent.max_total_tokens, progress=progress)
    bar.close()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    llm.model.save_pretrained(tmp)
    llm.tokenizer.save_pretrained(tmp)
    (tmp / "sft_history.json").write_text(json.dumps(history, indent=1))
    save_trained_settings(cfg, tmp)  # the agent settings it learned under, for ask/eval/serve --model
    return commit_directory(tmp, out)  # flushed: later runs reuse it, so no empty files after a power loss


def sft_questions(train: list[QAExample], limit: int | None) -> list[QAExample]:
    """The SFT warm start's questions: the first ``limit`` of ``train`` (all when ``None``). On the synthetic
    task (every question has a ``chain`` and a ``hops`` count: :mod:`corpora.synthetic`) the first ``limit //
    classes`` of each hop class instead, class by class, so that every depth is shown equally often (what
    ``bench/learning.py``'s warm start does: 20 per class of 60)."""
    if not train or not all("chain" in q.metadata and "hops" in q.metadata for q in train):
        return train[:limit]
    hops = sorted({int(q.metadata["hops"]) for q in train})
    per = None if limit is None else max(limit // len(hops), 1)
    return [q for h in hops for q in [q for q in train if int(q.metadata["hops"]) == h][:per]]


def held_out_questions(cfg: Config) -> list[QAExample]:
    """The held-out questions runs are scored on: ``data.test``, sub-sampled to ``eval.limit`` with
    ``seed`` as ``sleuth eval`` draws them under the same config (so the quickstart,
    ``train.monitoring.eval_every`` and ``sleuth eval`` score the same questions)."""
    from eval.datasets import subsample

    return subsample(read_qa(data_paths(cfg)["test"]), cfg.eval.limit, cfg.seed)


def held_out_evaluator(cfg: Config, tokenizer, retriever):
    """The trainer's ``evaluate(model) -> {"em": ..., ...}`` for ``train.monitoring.eval_every`` (``None`` when 0):
    :func:`eval.run.evaluate_agent` on the held-out questions (``data.test``, the seeded ``eval.limit`` sub-sample that
    ``sleuth eval`` and the quickstart score), numeric fields only. The torch random state is restored after
    it, so evaluating does not change the training's sampling stream."""
    if not cfg.train.monitoring.eval_every:
        return None
    import torch

    import eval.run as run_eval
    from agent.backends.hf import TransformersLLM

    test = held_out_questions(cfg)

    def evaluate(model) -> dict[str, float]:
        from agent.external.runner import runner_for

        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        llm = TransformersLLM(model, tokenizer)
        with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
            external = runner_for(llm, cfg.agent)  # agent.kind=external: its episodes over a proxy of llm
            if external is not None:
                stack.callback(external.close)
            summary, _ = run_eval.evaluate_agent(llm, retriever, test, cfg.agent, top_k=cfg.retrieval.top_k,
                                                 temperature=cfg.eval.temperature, seed=cfg.seed,
                                                 run_episodes=external.loop_episodes if external else None)
        return {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    return evaluate


def external_agent_env(cfg: Config, index_dir: str | None = None) -> None:
    """With ``agent.kind: external``, tell the agent (which runs in this process) where the run's index is:
    ``$SLEUTH_INDEX`` (unless already set), read by ``examples/react_agent.py``'s search tool."""
    if cfg.agent.kind == "external":
        os.environ.setdefault("SLEUTH_INDEX", str(index_dir or cfg.retrieval.index_dir))


def policy_vocab_size(cfg: Config) -> int | None:
    """``V`` of the policy a run starts from, read before anything is loaded: ``vocab_size`` of
    ``policy.model``'s ``config.json`` (a local directory), else the tiny policy's ``policy.tiny.vocab_size``;
    ``None`` when it cannot be read (a hub id)."""
    if not cfg.policy.model:
        return cfg.policy.tiny.vocab_size
    try:
        conf = json.loads((Path(resolve_model_path(cfg.policy.model)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = (conf.get("text_config") or conf).get("vocab_size")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_rollout_backend(cfg: Config) -> None:
    """Raise ``ValueError`` when ``agent.backend.kind`` cannot roll out for RL (its entry's ``rollout``,
    :data:`agent.backends.build.BACKENDS`): ``openai`` is a server whose weights the trainer cannot update
    (transformers and vllm can; vllm gets each update in place). With ``train.rollout.engines`` the rollouts
    run on that fleet and the backend is not checked."""
    from agent.backends.build import BACKENDS

    kind = cfg.agent.backend.kind
    if cfg.train.rollout.fleet:  # rollouts on train.rollout.engines; agent.backend is not used for them
        return
    if not BACKENDS.get(kind).rollout:
        able = " or ".join(n for n in BACKENDS.names() if BACKENDS.get(n).rollout)
        raise ValueError(f"agent.backend.kind={kind} cannot roll out for training: the trainer cannot update its "
                         f"weights after each step; train with agent.backend.kind={able}")


def rl_run_dir(cfg: Config) -> Path:
    """The RL run directory, ``<out_dir>/<estimator>`` (``train.algorithm.adv_estimator``: ``runs/quickstart/grpo``,
    ``runs/x/ppo``): one run per estimator, so that changing it under one ``out_dir`` starts a new run rather than
    resuming another estimator's checkpoints."""
    return Path(cfg.out_dir) / cfg.train.algorithm.adv_estimator


def run_rl_stage(cfg: Config, init_path: str | Path, retriever, resume: bool = False, log=print) -> Path:
    """RL with ``train.algorithm.adv_estimator`` from ``init_path`` into :func:`rl_run_dir` (``<out_dir>/<estimator>``), searching
    ``retriever``; returns the final checkpoint directory. Rollouts run on
    ``agent.backend.kind`` (transformers, or vllm updated in place after each step; openai is a ``ValueError``,
    :func:`check_rollout_backend`).

    Under torchrun every rank calls it (after rank 0 has prepared ``init_path``; the run directory must be
    on a file system all ranks see): each loads the same weights, :func:`training.trainer.rl_train` shards
    them, and only rank 0 shows progress and logs. Raises ``ValueError`` if the run directory already has
    checkpoints and ``resume`` is False (so a new run never overwrites an old one), and
    :class:`training.infra.checkpoint.CorruptCheckpointError` (a ``ValueError`` naming the previous
    checkpoint) if its latest checkpoint is damaged; ``resume`` on a run with no checkpoint yet starts at step
    0 and logs so.
    """
    from tqdm import tqdm

    from agent.backends.hf import TransformersLLM
    from training.infra.checkpoint import check_checkpoint, latest_checkpoint
    from training.infra.distributed import world
    from training.trainer import rl_train

    check_rollout_backend(cfg)
    external_agent_env(cfg)
    rank = world()[0]
    if rank != 0:
        log = lambda *a, **k: None  # rank 0 alone reports
    run_dir = rl_run_dir(cfg)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and not resume:
        raise ValueError(f"{run_dir} already has checkpoints (latest {ckpt.name}); pass --resume to continue "
                         "it, or set out_dir=... for a new run")
    if rank == 0:  # the agent settings of this run: every checkpoint gets a copy (training.run_state.save_run)
        save_trained_settings(cfg, run_dir)
    if ckpt is not None:  # a damaged checkpoint (cut short by a crash or a full disk): refused, the previous offered
        check_checkpoint(ckpt)
    start_from = ckpt if ckpt is not None else Path(init_path)
    check_context_length(cfg, start_from)
    llm = TransformersLLM.from_pretrained(str(start_from), cfg.policy.dtype, cfg.policy.device)
    train = read_qa(data_paths(cfg)["train"])
    done = 0
    if ckpt is not None:
        done = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        log(f"{run_dir.name}: resuming {run_dir} from {ckpt.name}")
    elif resume:  # --resume (job scripts always pass it; the quickstart resumes by default): say it is no resume
        log(f"{run_dir.name}: no checkpoint in {run_dir} yet: starting at step 0")
    bar = tqdm(total=cfg.train.steps, initial=done, desc=run_dir.name, unit="step", disable=rank != 0)

    def on_step(step: int, rec: dict[str, Any]) -> None:
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward']:.3f}", em=f"{rec['em']:.2f}", searches=f"{rec['search_calls']:.2f}")

    engines: list = []
    llm_factory = None
    from agent.backends.build import BACKENDS, make_llm

    if BACKENDS.get(cfg.agent.backend.kind).engine and not cfg.train.rollout.fleet:  # an engine on the same weights

        def llm_factory(model, tokenizer):
            engines.append(make_llm(cfg.agent.backend, str(start_from), cfg.policy.dtype, cfg.policy.device,
                                    cfg.seed + rank))  # one sampling stream per rank under torchrun
            return engines[-1]
    try:
        rl_train(cfg.train, cfg.agent, llm.model, llm.tokenizer, retriever, train, run_dir, seed=cfg.seed,
                 top_k=cfg.retrieval.top_k, resume=ckpt is not None, on_step=on_step, llm_factory=llm_factory,
                 evaluate=held_out_evaluator(cfg, llm.tokenizer, retriever), judge=answer_judge(cfg))
    finally:
        bar.close()  # ends the bar's line, so a stop message prints on a line of its own
        for engine in engines:  # its process and memory now, not at interpreter exit
            engine.close()
    final = latest_checkpoint(run_dir)
    return final if final is not None else start_from
