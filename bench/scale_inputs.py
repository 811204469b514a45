"""The inputs of ``bench/scale_sim.py``: this machine's costs, measured (the tiny policy's ``generate`` by batch
size, BM25's latency, the update and the weight sync of the ``bench/async_rollouts.py`` runs, their
trajectories), and the GPU shapes' costs from ``bench/results/gpu_scale_h200.json`` with the assumptions
named in :data:`ASSUMED`."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
ASYNC_JSON = ROOT / "bench" / "results" / "async_rollouts.json"
GPU_JSON = ROOT / "bench" / "results" / "gpu_scale_h200.json"
SERVE_JSON = ROOT / "bench" / "results" / "serve_load.json"
TAG = "-c"  # the async_rollouts series measured on an idle machine, all three modes in one sitting

#: what the GPU projections assume where no measurement exists (a projection, not a measurement)
ASSUMED = {
    "hbm_bytes_per_s": 4.8e12,  # H200 HBM3e, NVIDIA's figure: a decode iteration reads the weights once
    "prefill_flops_per_s": 0.4 * 989e12,  # 40% of the H200's dense bf16 peak for prompt and observation tokens
    "colocated_sync_bytes_per_s": 100e9,  # the in-process refresh of a colocated engine (device to device)
    "fleet_push_bytes_per_s": 25e9,  # an NCCL broadcast from a trainer node to the engine nodes (200 Gb/s)
    "verify_s": 0.5,  # the probe scored by every engine after a push
    "engine_max_batch": 256,  # vLLM's default max_num_seqs
    "update_scaling": "linear in GPUs (FSDP2, tokens split evenly)",
    "episode_shape": "Search-R1: 512-token prompt, turns as the CPU runs' (counts, generated share of the "
                     "budget) scaled to 500-token turns, 500-token observations after each search",
}


@dataclass
class Profile:
    """The costs of one setting (seconds; see the module docstring)."""

    name: str
    kind: str  # "continuous" or "static"
    iter_fixed_s: float
    iter_per_seq_s: float
    call_fixed_s: float
    prefill_per_token_s: float
    max_batch: int
    tool_s: float
    update_fixed_s: float
    update_per_token_s: float
    sync_s: float  # colocated: the copy into the rollout side
    push_s: float  # fleet: the engines' pause while the weights arrive
    shared_device: bool = True



def run_of(mode: str, seed: int = 0) -> dict | None:
    runs = json.loads(ASYNC_JSON.read_text())["runs"] if ASYNC_JSON.exists() else {}
    return next((r for k, r in runs.items() if r["mode"] == mode and r.get("tag") == TAG and r["seed"] == seed), None)


def measured_steps() -> dict[str, float]:
    """The measured median step time (seconds) of each mode of the series :data:`TAG`."""
    return {m: r["median_step_s"] for m in ("sync", "async", "fleet") if (r := run_of(m)) is not None}


def trajectories(mode: str = "sync") -> list[tuple[int, list[tuple[int, int]]]]:
    """``[(prompt tokens, [(generated, observation tokens) per turn])]`` of the run's logged trajectories."""
    from agent.trajectory import load_trajectories

    path = ROOT / "runs" / "async_rollouts" / f"{mode}_s0" / "trajectories.jsonl"
    out = []
    for t in load_trajectories(path):
        turns = [(max(1, turn.n_policy_tokens), turn.n_tool_tokens) for turn in t.turns]
        if turns:
            out.append((t.prompt_len, turns))
    return out


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; ``(a, b)`` with both clamped at 0."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - b * mx), max(0.0, b)


def measure_decode(prompt_len: int, sizes=(1, 2, 4, 8, 16, 32, 64), repeats: int = 3) -> dict:
    """The tiny policy's ``generate`` (one thread) at each batch size, 1 and 8 new tokens: the call's fixed
    cost, prefill per token, and a decode iteration's cost ``fixed + per_seq x batch``."""
    import learning as L
    import torch

    from agent.backends.hf import TransformersLLM
    from agent.llm import SamplingParams

    torch.set_num_threads(1)
    llm = TransformersLLM.from_pretrained(str(L.WORK / "sft"), device="cpu")
    prompt = list(range(5, 5 + prompt_len))
    rows, iters = {}, {}
    for b in sizes:
        t, longest = {}, 8
        for n in (1, 8):
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                gens = llm.generate([prompt] * b, SamplingParams(max_new_tokens=n, temperature=1.0))
                runs.append(time.perf_counter() - t0)
                if n == 8:
                    longest = max(len(g.token_ids) for g in gens)  # a sequence may end early (EOS)
            t[n] = statistics.median(runs)
        rows[b], iters[b] = t, max(longest, 2)
    per_iter = {b: max(0.0, (t[8] - t[1]) / (iters[b] - 1)) for b, t in rows.items()}
    it_fixed, it_seq = fit_line(list(per_iter), list(per_iter.values()))
    first = {b: t[1] - per_iter[b] for b, t in rows.items()}  # the call's overhead + prefill of b prompts
    call_fixed, pre_tok = fit_line([b * prompt_len for b in first], list(first.values()))
    return {"calls_s": {str(b): t for b, t in rows.items()}, "iter_fixed_s": it_fixed, "iter_per_seq_s": it_seq,
            "call_fixed_s": call_fixed, "prefill_per_token_s": pre_tok}


def measure_tool() -> float:
    """BM25's mean seconds per search (top 1) over the learning task's questions."""
    import learning as L

    retriever, train, _ = L.prepare()
    qs = [q.question for q in train[:100]]
    t0 = time.perf_counter()
    for q in qs:
        retriever.search([q], 1)
    return (time.perf_counter() - t0) / len(qs)


def timing(run: dict, *keys: str) -> float:
    return sum(run["median"].get(f"timing/{k}_s", 0.0) for k in keys)


def cpu_profile(measure: bool, stored: dict | None) -> tuple[Profile, list, dict]:
    """This machine's :class:`Profile` (static engine, one core each for engine and trainer), its episodes and
    the inputs as measured; from ``stored`` unless ``measure``."""
    if not measure and stored:
        return Profile(**stored["profile"]), stored["episodes"], stored["inputs"]
    import learning as L

    eps = trajectories("sync")
    sync, asyn, fleet = run_of("sync"), run_of("async"), run_of("fleet")
    if sync is None:
        raise SystemExit(f"run bench/async_rollouts.py --modes sync async fleet --seeds 0 --tag={TAG} first")
    old = (stored or {}).get("inputs", {})  # the machine's own costs are measured once (--remeasure: again)
    dec = old.get("decode") or measure_decode(int(statistics.median(p for p, _ in eps)))
    tokens = statistics.median([sum(g + o for g, o in turns) + p for p, turns in eps])
    q, gs = L.TRAIN["rollout.questions_per_step"], L.TRAIN["rollout.group_size"]
    trainer_s = timing(sync, "score", "advantages", "update")
    inputs = {"decode": dec, "tool_s": old.get("tool_s") or measure_tool(), "questions": q, "group_size": gs,
              "tokens_per_episode": tokens, "trainer_s_per_step": trainer_s,
              "trainer_s_by_mode": {m: timing(r, "score", "advantages", "update") if r else None
                                    for m, r in (("sync", sync), ("async", asyn), ("fleet", fleet))},
              "load_avg_by_mode": {m: [r["load_before"], r["load_after"]] if r else None
                                   for m, r in (("sync", sync), ("async", asyn), ("fleet", fleet))},
              "sync_s": {"sync": timing(sync, "sync"), "async": timing(asyn, "sync") if asyn else None,
                         "fleet": timing(fleet, "sync") if fleet else None},
              "source": f"bench/results/async_rollouts.json series {TAG}, seed 0; runs/async_rollouts/sync_s0"}
    prof = Profile("cpu", "static", dec["iter_fixed_s"], dec["iter_per_seq_s"], dec["call_fixed_s"],
                   dec["prefill_per_token_s"], 64, inputs["tool_s"], 0.0, trainer_s / (tokens * q * gs),
                   inputs["sync_s"]["async"] or 0.0, inputs["sync_s"]["fleet"] or 0.0, shared_device=False)
    return prof, [[p, t] for p, t in eps], inputs


def search_r1_episodes(cpu_eps: list, budget: int = 500, obs: int = 500, prompt: int = 512,
                       cpu_budget: int = 8) -> list:
    """The CPU runs' episodes reshaped to Search-R1's (see :data:`ASSUMED`)."""
    out = []
    for _, turns in cpu_eps:
        out.append([prompt, [(max(1, round(g / cpu_budget * budget)), obs if o else 0) for g, o in turns]])
    return out


def gpu_profiles() -> dict[str, Profile]:
    """A continuous-batching engine per shape of ``gpu_scale_h200.json`` (see :data:`ASSUMED`)."""
    shapes = json.loads(GPU_JSON.read_text())["shapes"]
    serve = json.loads(SERVE_JSON.read_text())["servers"]["serve-retrieval"]["100"]
    out = {}
    for name, s in shapes.items():
        wbytes = s["weights_gib"] * 2**30
        it = s["rollout"]["episodes"] / s["rollout"]["gen_tokens_per_s"]  # one iteration at 128 sequences
        fixed = wbytes / ASSUMED["hbm_bytes_per_s"]
        per_seq = max(0.0, (it - fixed) / s["rollout"]["episodes"])
        out[name] = Profile(
            name, "continuous", fixed, per_seq, 0.0, 2 * s["params"] / ASSUMED["prefill_flops_per_s"],
            ASSUMED["engine_max_batch"], serve["p50_ms"] / 1000, 0.0, 1.0 / s["update"]["tokens_per_s"],
            wbytes / ASSUMED["colocated_sync_bytes_per_s"],
            wbytes / ASSUMED["fleet_push_bytes_per_s"] + ASSUMED["verify_s"], shared_device=True)
    return out
