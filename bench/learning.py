"""Proof that the trainer learns: a tiny model from scratch -> SFT warm start -> RL, on a synthetic task.

Task v1 (:mod:`corpora.synthetic`, difficulty fixed in its ``SPEC``): facts about invented entities, 1-3-hop
questions that need as many searches; no entity is shared between questions, so nothing can be memorised.
Task v2 (``--task v2``, ``SPEC_V2``): 1-4 hops, 4-hop questions in the test split only, the depth of a
currency question readable only from the search results. Policy: a BPE tokenizer and a small Qwen2 trained
from scratch (:data:`TINY`), SFT on a few oracle trajectories (:data:`N_SFT`, 20 per trained hop class,
shared by every run of a task), then RL with each advantage estimator. Reported: test EM (greedy) after SFT
and after RL, EM and searches per hop class, learning curves (test EM every ``eval_every`` steps).

The setup below is fixed before any RL run and not tuned to the results. The sweep resumes where it
stopped: finished runs are read back from the JSON, an interrupted run continues from its last checkpoint.

    .venv/bin/python bench/learning.py                      # task v1's first sweep (the ``RUNS`` table)
    .venv/bin/python bench/learning.py --only grpo_s0       # one run
    .venv/bin/python bench/learning.py --compare --seeds 0  # every estimator of ``ESTIMATORS``, seed 0
    .venv/bin/python bench/learning.py --task v2 --compare  # the same on task v2 (3 seeds)
    .venv/bin/python bench/learning.py --compare --methods aepo egrpo ikea  # named presets against GRPO
    .venv/bin/python bench/learning.py --compare --short --methods aepo  # the same at SHORT_BUDGET
    .venv/bin/python bench/learning.py --compare --mid --methods arpo rexrag ssp  # ... at MID_BUDGET
    .venv/bin/python bench/learning.py --stability gigpo    # the 600-step run of one estimator
    .venv/bin/python bench/learning.py --report             # tables + plots from the JSON only

Writes ``bench/results/learning.json`` (v1) / ``learning_v2.json`` (v2), ``learning.png``, ``learning.md``,
``learning_compare.png`` and ``learning_compare.md``; work files under ``runs/learning/`` (v2:
``runs/learning-v2/``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BASE_WORK = Path(os.environ.get("SLEUTH_LEARNING_WORK", ROOT / "runs" / "learning"))
RESULTS = Path(os.environ.get("SLEUTH_LEARNING_RESULTS", ROOT / "bench" / "results"))
WORK = BASE_WORK  # the current task's (use_task)
JSON_PATH = RESULTS / "learning.json"

# ---- the fixed setup ------------------------------------------------------------------------------------
TINY = {"vocab_size": 600, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 192,
            "max_position_embeddings": 256, "tokenizer_texts": 100000}
N_SFT = 60  # oracle trajectories for the warm start (a third per hop count)
SFT = {"epochs": 80, "lr": 3e-3, "batch_size": 12}  # calibrated on SFT alone: ~28% test EM, leaving headroom
AGENT = {"max_turns": 4, "max_new_tokens": 8, "max_total_tokens": 160, "max_obs_tokens": 40, "max_doc_chars": 60,
             "temperature": 1.0, "short_prompt": True, "chat_template": "off", "reward": "em", "format_reward": 0.1}
RETRIEVAL_TOP_K = 1
STEPS = 80
EVAL_EVERY = 10
# train settings by their dotted key below ``train`` (training.config.TrainConfig.updated)
TRAIN = {"steps": STEPS, "rollout.questions_per_step": 8, "rollout.group_size": 8, "optim.lr": 5e-4,
         "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.28, "optim.micro_batch": 64,
         "optim.micro_batch_tokens": 8192, "checkpoints.save_every": 10, "monitoring.eval_every": EVAL_EVERY}
LONG_STEPS = 300
RUNS = {  # name -> (algorithm, seed, extra train overrides)
    "grpo_s0": ("grpo", 0, {}),
    "grpo_s1": ("grpo", 1, {}),
    "grpo_s2": ("grpo", 2, {}),
    "dr_grpo_s0": ("dr_grpo", 0, {"algorithm.loss_agg_mode": "seq-mean-token-sum"}),
    "rloo_s0": ("rloo", 0, {}),
    "reinforce_pp_s0": ("reinforce_pp", 0, {}),
    "ppo_s0": ("ppo", 0, {"algorithm.critic": "separate", "optim.critic_lr": 1e-3}),
    "stratified_grpo_s0": ("stratified_grpo", 0, {}),
    # the same GRPO for a longer budget (added after the 80-step runs above fell short of +15 EM points)
    "grpo_long_s0": ("grpo", 0, {"steps": LONG_STEPS}),
    "grpo_long_s1": ("grpo", 1, {"steps": LONG_STEPS}),
    "grpo_long_s2": ("grpo", 2, {"steps": LONG_STEPS}),
}
# ---- the comparison of estimators (both tasks, same budget, fixed before its runs) -------------------------
COMPARE = {"steps": 200, "monitoring.eval_every": 20, "checkpoints.save_every": 20,
           "algorithm.ppo_epochs": 2,  # 2 epochs: the losses differ off-policy
           # the health alarms watch every run (warn only)
           "monitoring.alarms.search_flat": 0.25, "monitoring.alarms.collapse_drop": 0.10}
ESTIMATORS = {  # name -> (train.algorithm.adv_estimator, its own train overrides)
    "grpo": ("grpo", {}),
    "dr_grpo": ("dr_grpo", {"algorithm.loss_agg_mode": "seq-mean-token-sum"}),
    "rloo": ("rloo", {}),
    "reinforce_pp": ("reinforce_pp", {}),
    "stratified_grpo": ("stratified_grpo", {}),
    "ppo": ("ppo", {"algorithm.critic": "separate", "optim.critic_lr": 1e-3}),
    "igpo": ("igpo", {}),
    "gigpo": ("gigpo", {}),
    "gspo": ("grpo", {"algorithm.policy_loss": "gspo", "algorithm.loss_agg_mode": "seq-mean-token-mean",
                      "algorithm.clip_ratio_low": 3e-4, "algorithm.clip_ratio_high": 4e-4}),
    "cispo": ("grpo", {"algorithm.policy_loss": "cispo"}),
    "evidence_igpo": ("evidence_igpo", {}),
    # the search-agent methods that change RL, as named presets (an estimator and its overrides), fixed before
    # their runs: AEPO with the reference's defaults (entropy target 0.5 nats, temperatures 1.2 / 0.8; the SFT
    # policy's mean token entropy measured 0.15 nats, so it starts below the target and samples hot) and its
    # REINFORCE budget, 60 of 512 x 5 rows, scaled to this batch's 64 rows and rounded up to 4; E-GRPO and IKEA
    # replace the reward, with their papers' defaults
    "aepo": ("aepo", {"algorithm.options": {"reinforce_samples": 4}}),
    "egrpo": ("grpo", {"algorithm.reward": "egrpo"}),
    "ikea": ("grpo", {"algorithm.reward": "ikea"}),
    # the rollout strategies, fixed before their runs: ARPO with the authors' split of the budget (half global
    # samples, one copy per branching draw, alpha 0.5, beta 0.2) and an entropy window of one turn of this
    # policy (8 tokens); REX-RAG with the authors' probe probability 0.2 and its importance correction; search
    # self-play with the policy proposing from each training answer, its question filters relaxed to what an
    # 8-token turn can write (one word, no minimum of searches)
    "arpo": ("grpo", {"rollout.strategy": "arpo",
                      "rollout.strategy_options": {"global_samples": 4, "entropy_window": 8}}),
    "rexrag": ("grpo", {"rollout.strategy": "rexrag"}),
    "ssp": ("grpo", {"rollout.strategy": "ssp",
                     "rollout.strategy_options": {"min_question_words": 1, "min_searches": 0}}),
    # AdaSearch's stage 1, fixed before its runs (the stage one run of this harness can train; stage 2 is a
    # second run from its checkpoint): half of each group's rollouts in parametric mode, the paper's mixed
    # batch; on task v1 nothing is parametric, so it measures what the search mode keeps at half its rollouts
    "adasearch": ("grpo", {"rollout.strategy": "adasearch",
                           "rollout.strategy_options": {"stage": 1, "parametric_share": 0.5}}),
    # SSRL: trained against the self-search engine (the policy writes its own queries' results; TRAIN_RETRIEVERS),
    # rewarded by the paper's 0.9 EM + 0.1 format (no <think> asked of this policy), evaluated on the real index
    # (sim-to-real): every test EM of its runs is the real retriever's
    "ssrl": ("grpo", {"algorithm.reward": "ssrl", "algorithm.reward_options": {"require_think": False}}),
}
METHODS = ("aepo", "egrpo", "ikea", "arpo", "rexrag", "ssp", "adasearch", "ssrl")
# presets trained against another search engine than the task's BM25 index (their evaluations keep the index)
TRAIN_RETRIEVERS = {"ssrl": "self_search"}
SELF_SEARCH_DOC_TOKENS = 16  # what the policy writes per self-search result (two of its 8-token turns)  # the presets of the search-agent methods (--methods default with --compare)
SEEDS = (0, 1, 2)
STABILITY_STEPS = 600
# the winning estimator again with the rest of the 20-minute budget a run may take (1 torch thread): its
# 600-step run took 6.8 min and was still raising 3-hop EM; 1,500 steps fixed before any of these runs
LONG_BUDGET = {"steps": 1500, "monitoring.eval_every": 50, "checkpoints.save_every": 50}
# a shorter budget for comparisons that must fit a shared CPU (run names <preset>-short-s<seed>, GRPO's too: each
# preset is compared with GRPO at the same budget)
SHORT_BUDGET = {"steps": 15, "monitoring.eval_every": 15, "checkpoints.save_every": 15}
# a middle budget for the comparison of every search-agent method on both tasks within one shared-CPU sitting
# (run names <preset>-mid-s<seed>, GRPO's too)
MID_BUDGET = {"steps": 60, "monitoring.eval_every": 20, "checkpoints.save_every": 20}
BUDGETS = {"long": LONG_BUDGET, "mid": MID_BUDGET, "short": SHORT_BUDGET}
# ---- task v2: its own corpus, tiny tokenizer and SFT (same recipe); turns and tokens for 4 searches ------
AGENT_V2 = {**AGENT, "max_turns": 6, "max_total_tokens": 224}
TASKS = {"v1": {"work": "", "json": "learning.json", "agent": AGENT, "hops": (1, 2, 3), "sft_hops": (1, 2, 3)},
         "v2": {"work": "-v2", "json": "learning_v2.json", "agent": AGENT_V2, "hops": (1, 2, 3, 4),
                "sft_hops": (1, 2, 3)}}
TASK = "v1"
HOTPOT = {"steps": 30, "questions_per_step": 8, "group_size": 4, "eval_limit": 60}


def use_task(name: str) -> None:
    """Point the work directory, JSON and agent settings at task ``name`` (``v1`` or ``v2``)."""
    global TASK, WORK, JSON_PATH
    TASK = name
    WORK = BASE_WORK.with_name(BASE_WORK.name + TASKS[name]["work"])
    JSON_PATH = RESULTS / TASKS[name]["json"]


def run_spec(name: str) -> tuple[str, int, dict]:
    """``(algorithm, seed, train overrides)`` of a run name: a first-sweep name of ``RUNS`` (task v1), a
    comparison run ``<estimator>-s<seed>``, the same at :data:`LONG_BUDGET` ``<estimator>-long-s<seed>`` or a
    stability run ``stability-<estimator>``. Raises ``KeyError``."""
    if name in RUNS and TASK == "v1":
        return RUNS[name]
    est, _, tail = name.rpartition("-")
    if est == "stability" and tail in ESTIMATORS:
        algo, extra = ESTIMATORS[tail]
        return algo, 0, {**COMPARE, **extra, "steps": STABILITY_STEPS}
    budget = {}
    for label, steps in BUDGETS.items():
        if est.endswith(f"-{label}"):
            est, budget = est.removesuffix(f"-{label}"), steps
    if est in ESTIMATORS and tail.startswith("s") and tail[1:].isdigit():
        algo, extra = ESTIMATORS[est]
        return algo, int(tail[1:]), {**COMPARE, **extra, **budget}
    raise KeyError(name)


def compare_names(seeds=SEEDS, presets=None, budget: str = "") -> list[str]:
    """The comparison's run names, seed by seed (every preset of seed 0 first): ``presets`` (names of
    :data:`ESTIMATORS`; default all) and GRPO, the baseline each is compared with; ``budget`` ``""`` (the
    comparison's), ``"mid"`` (:data:`MID_BUDGET`) or ``"short"`` (:data:`SHORT_BUDGET`)."""
    chosen = list(ESTIMATORS) if presets is None else ["grpo", *(p for p in presets if p != "grpo")]
    tail = f"-{budget}" if budget else ""
    return [f"{e}{tail}-s{s}" for s in seeds for e in chosen]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_results() -> dict:
    return json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {"runs": {}}


_OWN_RUNS: set[str] = set()  # the runs this process writes; the others' records are read back from disk


def save_results(res: dict) -> None:
    """Write ``res`` to the task's JSON, merged under a file lock with what other processes of the same task
    wrote meanwhile (each owns the runs it trains), so two runs of one task may go side by side."""
    import fcntl

    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(JSON_PATH.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        disk = load_results()
        merged = {**disk, **{k: v for k, v in res.items() if k != "runs"}}
        merged["runs"] = {**disk.get("runs", {}), **{n: res["runs"][n] for n in _OWN_RUNS if n in res["runs"]}}
        res["runs"].update({n: r for n, r in merged["runs"].items() if n not in _OWN_RUNS})
        tmp = JSON_PATH.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1))
        os.replace(tmp, JSON_PATH)


def base_config(seed: int = 0, algorithm: str = "grpo", extra: dict | None = None, out_dir: Path = WORK):
    """The run config of estimator ``algorithm`` with :data:`TRAIN` and ``extra`` (dotted keys below ``train``)."""
    from sleuth.config import Config

    cfg = Config.model_validate({
        "seed": seed, "out_dir": str(out_dir),
        "data": {k: str(WORK / "data" / f"{k}.jsonl") for k in ("corpus", "train", "test")},
        "retrieval": {"index_dir": str(WORK / "index"), "method": "bm25", "top_k": RETRIEVAL_TOP_K,
                      "build_dense": False},
        "policy": {"tiny": TINY},
        "agent": TASKS[TASK]["agent"],
        "sft": SFT,
        "eval": {"temperature": 0.0},
    })
    cfg.train = cfg.train.updated({**TRAIN, "algorithm.adv_estimator": algorithm, **(extra or {})})
    return cfg


def prepare():
    """Data, index, tiny policy, SFT warm start (each step reused when already on disk)."""

    from corpora import read_corpus, read_qa
    from corpora.synthetic import SPEC, SPEC_V2, write
    from retrieval.index import build_index, load_retriever
    from sleuth.config import SFTConfig, TinyPolicyConfig
    from training.model.tiny import create_tiny_policy
    from training.rollout.oracle import ChainOracleLLM

    paths = write(WORK / "data", SPEC_V2 if TASK == "v2" else SPEC)
    if not (WORK / "index" / "manifest.json").exists():
        build_index(paths["corpus"], WORK / "index", build_dense=False, show_progress=False)
    retriever = load_retriever(WORK / "index", "bm25")
    train, test = read_qa(paths["train"]), read_qa(paths["test"])
    tiny = WORK / "tiny"
    if not (tiny / "config.json").exists():
        create_tiny_policy(tiny, read_corpus(paths["corpus"]), train, TinyPolicyConfig(**TINY), seed=0)
    sft_dir = WORK / "sft"
    if not (sft_dir / "config.json").exists():
        from agent.backends.hf import TransformersLLM
        from agent.loop.batch import run_episodes

        cfg = base_config()
        llm = TransformersLLM.from_pretrained(str(tiny))
        sft_qs = sft_questions(train)
        trajs = run_episodes(sft_qs, ChainOracleLLM(llm.tokenizer, sft_qs), retriever, cfg.agent,
                             top_k=RETRIEVAL_TOP_K, temperature=0.0)
        assert all(t.verdict["em"] == 1.0 for t in trajs), "the oracle must solve its own questions"
        hist = train_sft(llm, trajs, sft_dir, SFTConfig(**SFT))
        log(f"SFT on {len(trajs)} oracle trajectories: final loss {hist[-1]['loss']:.3f}")
    return retriever, train, test


def sft_questions(train) -> list:
    """The warm start's :data:`N_SFT` training questions: the first of each trained hop class, a share each."""
    hops = TASKS[TASK]["sft_hops"]
    by_hops = {h: [q for q in train if q.metadata["hops"] == h] for h in hops}
    return [q for h in hops for q in by_hops[h][: N_SFT // len(hops)]]


def train_sft(llm, trajs, out_dir: Path, sft_cfg) -> list[dict]:
    """SFT of ``llm`` (a :class:`agent.backends.hf.TransformersLLM`, trained in place) on ``trajs`` with seed 0,
    then the checkpoint and its per-epoch history (``sft_history.json``) written to ``out_dir`` atomically
    (a ``.tmp`` sibling renamed). Returns the history."""
    import torch

    from training.sft import sft_train

    torch.manual_seed(0)
    hist = sft_train(llm.model, llm.tokenizer, trajs, sft_cfg, seed=0, max_len=TASKS[TASK]["agent"]["max_total_tokens"])
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    llm.model.save_pretrained(tmp)
    llm.tokenizer.save_pretrained(tmp)
    (tmp / "sft_history.json").write_text(json.dumps(hist))
    os.replace(tmp, out_dir)
    return hist


def evaluate(model, tokenizer, retriever, examples, cfg) -> dict:
    """Greedy test EM, search calls and validity of ``model``, EM and searches per hop class, and each
    question's EM in order (``per_question``, for paired bootstrap intervals)."""
    from agent.backends.hf import TransformersLLM
    from agent.loop.batch import run_episodes

    trajs = run_episodes(examples, TransformersLLM(model, tokenizer), retriever, cfg.agent, temperature=0.0,
                         top_k=cfg.retrieval.top_k)
    n = len(trajs)
    out = {"em": sum(t.verdict.get("em", 0.0) for t in trajs) / n,
           "search_calls": sum(t.num_search_calls for t in trajs) / n,
           "format_ok": sum(float(t.verdict.get("format_ok", False)) for t in trajs) / n,
           "per_question": [t.verdict.get("em", 0.0) for t in trajs]}
    for h in TASKS[TASK]["hops"]:
        ts = [t for t in trajs if t.metadata.get("hops") == h]
        if ts:
            out[f"em_hops{h}"] = sum(t.verdict.get("em", 0.0) for t in ts) / len(ts)
            out[f"search_hops{h}"] = sum(t.num_search_calls for t in ts) / len(ts)
    return out


def run_one(name: str, retriever, train, test, res: dict) -> None:
    import torch

    from agent.backends.hf import load_model_and_tokenizer
    from training.infra.checkpoint import latest_checkpoint
    from training.trainer import rl_train

    algorithm, seed, extra = run_spec(name)
    _OWN_RUNS.add(name)
    cfg = base_config(seed, algorithm, extra)
    run_dir = WORK / name
    ckpt = latest_checkpoint(run_dir)
    model, tok = load_model_and_tokenizer(str(ckpt or WORK / "sft"), device="cpu")
    torch.manual_seed(seed)
    t0 = time.time()
    # wall time of earlier sessions of this run, up to its last checkpoint (saved with its evaluation)
    before = res["runs"].get(name, {}).get("wall_s_before", 0.0) if ckpt else 0.0
    curve: list[dict] = []
    prev = res["runs"].get(name, {}).get("partial_curve", []) if ckpt else []
    curve.extend(c for c in prev if c["step"] <= (json.loads((ckpt / "trainer_state.json").read_text())["step"] if ckpt else 0))

    def ev(m):  # the periodic evaluation: metrics only (per-question EMs would go to metrics.jsonl)
        return {k: v for k, v in evaluate(m, tok, retriever, test, cfg).items() if k != "per_question"}

    def on_step(step, rec):
        if "eval_em" in rec:
            curve.append({"step": step, "em": rec["eval_em"], "train_reward": rec["reward"],
                          "search_calls": rec["eval_search_calls"],
                          **{k[5:]: v for k, v in rec.items() if k.startswith("eval_") and "hops" in k}})
            res["runs"].setdefault(name, {}).update(partial_curve=curve, wall_s_before=before + time.time() - t0)
            save_results(res)
            log(f"{name}: step {step} test EM {100 * rec['eval_em']:.1f} reward {rec['reward']:.3f} "
                f"entropy {rec.get('entropy', float('nan')):.2f}")

    train_retriever = retriever
    if TRAIN_RETRIEVERS.get(name.split("-")[0]) == "self_search":  # SSRL: sim-to-real (training only)
        from retrieval.simulated import SelfSearch

        train_retriever = SelfSearch(seed=seed)
        cfg.agent.simulator.max_doc_tokens = SELF_SEARCH_DOC_TOKENS
    out = rl_train(cfg.train, cfg.agent, model, tok, train_retriever, train, run_dir, seed=cfg.seed,
                   top_k=cfg.retrieval.top_k, resume=ckpt is not None, on_step=on_step, evaluate=ev)
    final = evaluate(model, tok, retriever, test, cfg)
    res["runs"][name] = {"algorithm": algorithm, "seed": seed, "extra": extra, "sft_em": res["sft"]["em"],
                         "rl_em": final["em"], "final": final, "curve": curve, "best_eval_em": out["best_eval_em"],
                         "wall_s": before + time.time() - t0,
                         "steps": cfg.train.steps}
    save_results(res)
    log(f"{name}: test EM {100 * res['sft']['em']:.1f} (SFT) -> {100 * final['em']:.1f} (RL), "
        f"{(time.time() - t0) / 60:.1f} min")


def run_hotpot(res: dict) -> None:
    """One GRPO curve on the shipped HotpotQA sample with the quickstart's tiny policy (SFT'd by it)."""
    from agent.backends.hf import load_model_and_tokenizer
    from corpora import read_qa
    from sleuth.config import load_config
    from sleuth.pipeline import data_paths, ensure_index, open_retriever, run_sft_stage
    from training.infra.checkpoint import latest_checkpoint
    from training.trainer import rl_train

    out_dir = WORK / "hotpot"
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"out_dir={out_dir}", f"train.steps={HOTPOT['steps']}",
        f"train.rollout.questions_per_step={HOTPOT['questions_per_step']}",
        f"train.rollout.group_size={HOTPOT['group_size']}", "train.checkpoints.save_every=10", "train.monitoring.eval_every=10"])
    ensure_index(cfg, log)
    init = run_sft_stage(cfg, log)
    retriever = open_retriever(cfg)
    train = read_qa(data_paths(cfg)["train"])
    test = read_qa(data_paths(cfg)["test"])[: HOTPOT["eval_limit"]]
    run_dir = out_dir / "grpo"
    ckpt = latest_checkpoint(run_dir)
    model, tok = load_model_and_tokenizer(str(ckpt or init), device="cpu")
    sft_model, _ = load_model_and_tokenizer(str(init), device="cpu")
    sft_eval = evaluate(sft_model, tok, retriever, test, cfg)
    # an interrupted run resumes from its checkpoint: keep its curve and wall time up to that step
    done = json.loads((ckpt / "trainer_state.json").read_text())["step"] if ckpt else 0
    part = res.get("hotpot_partial", {}) if ckpt else {}
    wall_at = {k: v for k, v in part.get("wall_s_at", {}).items() if int(k) <= done}
    before = wall_at.get(str(done), 0.0)
    curve = [{"step": 0, "em": sft_eval["em"], "train_reward": None}]
    curve += [c for c in part.get("curve", []) if 0 < c["step"] <= done]
    t0 = time.time()

    def on_step(step, rec):
        curve.append({"step": step, "em": rec.get("eval_em"), "train_reward": rec["reward"], "train_f1": rec["f1"]})
        wall_at[str(step)] = before + time.time() - t0
        res["hotpot_partial"] = {"curve": curve[1:], "wall_s_at": wall_at}
        save_results(res)
        if "eval_em" in rec:
            log(f"hotpot: step {step} test EM {100 * rec['eval_em']:.1f} train F1 {rec['f1']:.3f}")

    rl_train(cfg.train, cfg.agent, model, tok, retriever, train, run_dir, seed=cfg.seed, top_k=cfg.retrieval.top_k,
             resume=ckpt is not None, on_step=on_step, evaluate=lambda m: evaluate(m, tok, retriever, test, cfg))
    final = evaluate(model, tok, retriever, test, cfg)
    res.pop("hotpot_partial", None)
    res["hotpot"] = {"sft_em": sft_eval["em"], "rl_em": final["em"], "final": final, "curve": curve,
                     "n_test": len(test), "wall_s": before + time.time() - t0, **HOTPOT}
    save_results(res)
    log(f"hotpot: test EM {100 * sft_eval['em']:.1f} (SFT) -> {100 * final['em']:.1f} (GRPO)")


def report(res: dict) -> str:
    """Print the table, write the markdown and the PNG; returns the markdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["| run | estimator | seed | test EM after SFT | test EM after RL | delta | best EM | searches | EM 1/2/3-hop | minutes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    done = {k: v for k, v in res["runs"].items() if "rl_em" in v and k in RUNS}
    for name, r in done.items():
        f = r["final"]
        hops = "/".join(f"{100 * f.get(f'em_hops{h}', 0):.0f}" for h in (1, 2, 3))
        lines.append(f"| {name} | {r['algorithm']} | {r['seed']} | {100 * r['sft_em']:.1f} | {100 * r['rl_em']:.1f} | "
                     f"{100 * (r['rl_em'] - r['sft_em']):+.1f} | {100 * (r['best_eval_em'] or 0):.1f} | "
                     f"{f['search_calls']:.2f} | {hops} | {r['wall_s'] / 60:.1f} |")
    summary = ""
    for label, prefix in (("GRPO, 80 steps", "grpo_s"), ("GRPO, 300 steps", "grpo_long_s")):
        rs = [r for n, r in done.items() if n.startswith(prefix)]
        if rs:
            d = sum(r["rl_em"] - r["sft_em"] for r in rs) / len(rs)
            summary += (f"{label}: mean over {len(rs)} seeds {100 * d:+.1f} EM points over SFT (target >= +15), "
                        f"longest run {max(r['wall_s'] for r in rs) / 60:.1f} min.\n")
    if "hotpot" in res:
        h = res["hotpot"]
        summary += (f"HotpotQA sample (GRPO, {h['steps']} steps, {h['n_test']} test questions): test EM "
                    f"{100 * h['sft_em']:.1f} (SFT) -> {100 * h['rl_em']:.1f}.")
    md = "\n".join(lines) + "\n\n" + summary + "\n"
    print(md)
    (RESULTS / "learning.md").write_text(md)
    fig, axes = plt.subplots(1, 2 if "hotpot" in res else 1, figsize=(13 if "hotpot" in res else 7, 4.5), squeeze=False)
    ax = axes[0, 0]
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for name, r in ((k, v) for k, v in res["runs"].items() if k in RUNS):
        pts = [(0, r.get("sft_em", res["sft"]["em"]))] + [(c["step"], c["em"]) for c in r.get("curve", r.get("partial_curve", []))]
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=name,
                ls="-" if name.startswith("grpo") else "--")
    ax.set_xlabel("RL step")
    ax.set_ylabel("test EM (greedy, %)")
    ax.set_title("synthetic multi-hop task: test EM during RL")
    ax.legend(fontsize=7)
    if "hotpot" in res:
        ax = axes[0, 1]
        c = res["hotpot"]["curve"]
        ax.plot([p["step"] for p in c if p.get("train_f1") is not None],
                [p["train_f1"] for p in c if p.get("train_f1") is not None], label="train F1 (sampled)")
        ax.plot([p["step"] for p in c if p.get("em") is not None], [p["em"] for p in c if p.get("em") is not None],
                marker="o", label="test EM (greedy)")
        ax.set_xlabel("GRPO step")
        ax.set_title("HotpotQA sample, tiny policy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "learning.png", dpi=100)
    plt.close(fig)
    return md


def main() -> int:
    from sleuth.commands.common import positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=list(TASKS), default="v1", help="the synthetic task version (default v1)")
    ap.add_argument("--only", nargs="*", metavar="NAME",
                    help=f"run names: v1's first sweep ({', '.join(RUNS)}; 'hotpot' for the HotpotQA curve), "
                         f"<estimator>-s<seed>, <estimator>-<long|mid|short>-s<seed> or "
                         f"stability-<estimator> with an "
                         f"estimator of {', '.join(ESTIMATORS)}")
    ap.add_argument("--compare", action="store_true", help="the comparison runs of every estimator (--seeds), or of "
                    "the presets named by --methods, with GRPO")
    ap.add_argument("--methods", nargs="*", metavar="PRESET", choices=list(ESTIMATORS),
                    help=f"with --compare: only these presets of ESTIMATORS and GRPO (e.g. {' '.join(METHODS)})")
    ap.add_argument("--short", action="store_true", help=f"with --compare: the shorter budget {SHORT_BUDGET}")
    ap.add_argument("--mid", action="store_true", help=f"with --compare: the middle budget {MID_BUDGET}")
    ap.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS), help="the comparison's seeds")
    ap.add_argument("--stability", metavar="ESTIMATOR", choices=list(ESTIMATORS),
                    help=f"the {STABILITY_STEPS}-step run of one estimator")
    ap.add_argument("--report", action="store_true", help="only print the tables and draw the plots")
    ap.add_argument("--sft-only", action="store_true", help="prepare and evaluate the SFT warm start only")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    use_task(args.task)
    names = list(args.only or [])
    if args.compare:
        names += compare_names(args.seeds, args.methods, "short" if args.short else "mid" if args.mid else "")
    if args.stability:
        names.append(f"stability-{args.stability}")
    if not names and not args.report:
        names = [*RUNS, "hotpot"] if args.task == "v1" else compare_names(args.seeds)
    for name in names:
        try:
            if name != "hotpot" or args.task != "v1":
                run_spec(name)
        except KeyError:
            ap.error(f"unknown run name {name!r} for task {args.task}")
    import torch

    torch.set_num_threads(args.threads)
    res = load_results()
    if args.report:
        write_reports()
        return 0
    retriever, train, test = prepare()
    if "sft" not in res or "per_question" not in res.get("sft_detail", res["sft"]):
        from agent.backends.hf import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(str(WORK / "sft"), device="cpu")
        ev = evaluate(model, tok, retriever, test, base_config())
        if "sft" in res:  # a JSON of before per-hop searches: its SFT numbers stay, the details are added
            res["sft_detail"] = ev
        else:
            res["sft"] = ev
            res["setup"] = {"tiny": TINY, "n_sft": N_SFT, "sft": SFT, "agent": TASKS[TASK]["agent"], "train": TRAIN,
                            "top_k": RETRIEVAL_TOP_K, "task": f"corpora.synthetic.{'SPEC_V2' if TASK == 'v2' else 'SPEC'}",
                            "compare": COMPARE, "estimators": ESTIMATORS}
        save_results(res)
    sft = {k: v for k, v in res["sft"].items() if k != "per_question"}
    log(f"SFT warm start ({TASK}): test EM {100 * sft['em']:.1f}, searches {sft['search_calls']:.2f}, "
        f"valid {100 * sft['format_ok']:.0f}%  {sft}")
    if args.sft_only:
        return 0
    for name in names:
        if name == "hotpot":
            if "hotpot" not in res:
                run_hotpot(res)
            continue
        if "rl_em" in res["runs"].get(name, {}):
            log(f"{name}: done (test EM {100 * res['runs'][name]['rl_em']:.1f})")
            continue
        run_one(name, retriever, train, test, res)
    write_reports()
    return 0


def write_reports() -> None:
    """v1's first-sweep table and plot, and the comparison's tables and curves over both tasks' JSON."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("learning_report", ROOT / "bench" / "learning_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    current = TASK
    use_task("v1")
    if JSON_PATH.exists():
        report(load_results())
    by_task = {}
    for t in TASKS:
        use_task(t)
        if JSON_PATH.exists():
            by_task[t] = load_results()
    use_task(current)
    if by_task:
        mod.compare_report(by_task, RESULTS, ESTIMATORS, TASKS)


if __name__ == "__main__":
    sys.exit(main())
