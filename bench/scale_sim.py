"""A discrete-event simulation of RL training steps: colocated-synchronous, colocated-asynchronous and
fleet-asynchronous with partial rollouts, at 8, 32 and 128 GPUs and 0.5B-7B shapes; validated first against
this machine's measured step times.

The model of a step (one event loop, ``simulate``):

* **Engines** generate the episodes. Each holds at most ``max_batch`` sequences; an episode is a list of turns
  (tokens generated, then a search of ``tool_s`` seconds and its observation's tokens, prefilled when it comes
  back), sampled from trajectories of real runs. Two kinds: ``continuous`` (vLLM: every iteration advances each
  running sequence one token, in ``iter_fixed_s + iter_per_seq_s x batch``, sequences join and leave between
  iterations, and the prefix cache leaves only the new tokens to prefill) and ``static`` (Sleuth's
  transformers scheduler: the ready requests form one ``generate`` call of ``call_fixed_s + prefill +
  tokens x (iter_fixed_s + iter_per_seq_s x batch)`` where ``tokens`` is the call's longest turn and every
  sequence's whole context is prefilled; all of its sequences leave at its end). An episode's turns stay on
  one engine.
* **The trainer** updates on the step's tokens spread over its GPUs (``update_fixed_s + tokens / gpus x
  update_per_token_s``; the score phase is folded in), then syncs the weights (``sync_s``).
* **colocated-sync**: every GPU runs an engine and a trainer rank in turn: rollout, then update, then sync.
* **colocated-async**: the next step's groups are generated while the trainer updates (at most
  ``questions x max_staleness`` groups running or waiting, re-queued when older than the bound). With
  ``shared_device`` the engine stops while its GPU runs the update (GPUs); without, both run at once (the CPU
  validation: one core each).
* **fleet-async**: ``engine_gpus`` run engines continuously, the other GPUs train; during a push the engines
  hold their requests (``push_s``) and the episodes in flight then continue on the new weights (partial
  rollouts); the staleness of a group is the trainer's version minus the version it started with.

Outputs per mode: step time (median over the simulated steps after a warm-up), GPU idle share (the share of
GPU-seconds neither generating nor updating), staleness histogram.

Inputs (named in ``bench/results/scale_sim.json``): for this machine, the decode and update costs measured
here (``--measure``: the tiny policy's ``generate`` by batch size; the update and sync from
``bench/results/async_rollouts.json``'s synchronous runs), the trajectories of those runs (turns, tokens),
BM25's latency. For GPUs, ``bench/results/gpu_scale_h200.json`` (decode tokens/s at 128 episodes, update
tokens/s, per shape), Search-R1's episode shape (4 turns of up to 500 tokens, 500-token observations) over the
trajectories' turn counts, the retrieval server's latency under load (``bench/results/serve_load.json``), and
an NCCL push at an assumed bandwidth (stated in the output): a projection, not a measurement.

    .venv/bin/python bench/async_rollouts.py --modes sync async fleet --seeds 0 --tag=-c   # the measured runs
    .venv/bin/python bench/scale_sim.py --decode-only    # this machine's decode and search costs
    .venv/bin/python bench/scale_sim.py --measure        # inputs from the runs, validate, project
    .venv/bin/python bench/scale_sim.py --measure --no-projections   # the validation only (keeps projections)
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from scale_inputs import Profile

JSON_PATH = ROOT / "bench" / "results" / "scale_sim.json"
#: continuous batching: a sequence back from its search joins the batch within this many iterations (the
#: simulation's time quantum; vLLM admits it at the next one)
JOIN_ITERS = 16


@dataclass
class Seq:
    """One episode in flight: its turns ``[(generated, observation tokens)]``, its group, the turn it is in, the
    tokens left to generate in it and the tokens to prefill first (the prompt, then each observation)."""

    turns: list[tuple[int, int]]
    group: Group
    prefill: int = 0
    turn: int = 0
    left: int = 0
    context: int = 0  # the tokens so far (a call without a prefix cache prefills all of them)

    def __post_init__(self):
        self.left, self.context = self.turns[0][0], self.prefill


@dataclass(eq=False)
class Group:
    qid: int
    version: int
    size: int
    done: int = 0
    tokens: int = 0
    finished_at: float = -1.0


@dataclass
class Engine:
    """One engine's state (see the module docstring)."""

    prof: Profile
    t: float = 0.0
    busy: float = 0.0
    active: list[Seq] = field(default_factory=list)
    ready: list[tuple[float, int, Seq]] = field(default_factory=list)  # (time it is back, order, seq)
    blocked: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each stop, in order
    served: int = 0  # the stops already taken
    n: int = 0

    def load(self) -> int:
        return len(self.active) + len(self.ready)

    def add(self, seq: Seq, at: float) -> None:
        self.n += 1
        heapq.heappush(self.ready, (at, self.n, seq))

    def advance(self, until: float, done) -> None:
        """Run until ``until`` (an iteration or call may end a little after it); ``done(seq, t)`` for each
        episode that ends. A stop (``blocked``: the weight push, or the update on a shared device) begins when
        the running iteration or call ends and lasts its length."""
        p = self.prof
        while self.t < until:
            while self.served < len(self.blocked) and self.blocked[self.served][0] <= self.t:
                a, b = self.blocked[self.served]
                self.served += 1
                self.t += b - a
            if self.t >= until:
                break
            stop = min(until, self.blocked[self.served][0]) if self.served < len(self.blocked) else until
            while self.ready and self.ready[0][0] <= self.t and len(self.active) < p.max_batch:
                _, _, s = heapq.heappop(self.ready)
                self.active.append(s)
            if not self.active:
                self.t = min(self.ready[0][0], stop) if self.ready else stop
                continue
            pre = sum(s.context if p.kind == "static" else s.prefill for s in self.active) * p.prefill_per_token_s
            for s in self.active:
                s.prefill = 0
            b = len(self.active)
            per_iter = p.iter_fixed_s + p.iter_per_seq_s * b
            if p.kind == "static":  # one generate call: every sequence to the longest turn's end
                k = max(s.left for s in self.active)
                dt = p.call_fixed_s + pre + k * per_iter
            else:
                k = min(s.left for s in self.active)
                if self.ready:  # a sequence back from its search joins within JOIN_ITERS iterations
                    k = min(k, max(JOIN_ITERS, int((self.ready[0][0] - self.t) / per_iter) + 1))
                k = min(k, max(1, int((stop - self.t) / per_iter) + 1))
                dt = pre + k * per_iter
            self.t += dt
            self.busy += dt
            still = []
            for s in self.active:
                s.left = 0 if p.kind == "static" else s.left - k
                if s.left > 0:
                    still.append(s)
                    continue
                gen, obs = s.turns[s.turn]
                s.group.tokens += gen + obs
                s.context += gen + obs
                s.turn += 1
                if s.turn < len(s.turns):
                    s.left, s.prefill = s.turns[s.turn][0], obs
                    self.add(s, self.t + p.tool_s)
                else:
                    done(s, self.t)
            self.active = still


Episodes = list  # [[prompt tokens, [(generated, observation tokens) per turn]]]


def sample_episodes(episodes: Episodes, n: int, rng: random.Random) -> Episodes:
    return [rng.choice(episodes) for _ in range(n)]


def tick_s(prof: Profile, episodes: Episodes) -> float:
    """The simulation's time step while the trainer waits for groups: a twentieth of a mean turn (its tokens at
    a batch of 8, the call's overhead, the search)."""
    turns = [tt for _, ep in episodes for tt in ep]
    gen = statistics.mean(g for g, _ in turns)
    turn = prof.call_fixed_s + gen * (prof.iter_fixed_s + 8 * prof.iter_per_seq_s) + prof.tool_s
    return max(1e-4, turn / 20)


def update_s(prof: Profile, tokens: int, gpus: int) -> float:
    return prof.update_fixed_s + tokens / max(gpus, 1) * prof.update_per_token_s


def simulate(mode: str, prof: Profile, episodes: Episodes, questions: int, group_size: int,
             gpus: int, steps: int = 12, engine_gpus: int | None = None, max_staleness: int = 1,
             seed: int = 0, sim_engines: int | None = None) -> dict:
    """Simulate ``steps`` training steps of ``mode`` (colocated-sync, colocated-async, fleet-async); returns
    ``step_s`` (median after the first two steps), ``gpu_idle`` and ``staleness`` (a histogram).
    ``sim_engines``: simulate that many engines with their share of the questions and of the trainer's GPUs
    (least-loaded routing spreads the load evenly; the slowest episode of a step is then drawn from fewer
    episodes, so a synchronous step's tail is underestimated)."""
    rng = random.Random(seed)
    fleet = mode == "fleet-async"
    n_eng = (engine_gpus or max(1, gpus // 2)) if fleet else gpus
    train_gpus = gpus - n_eng if fleet else gpus
    if sim_engines is not None and sim_engines < n_eng:  # a share of the engines, the questions and the GPUs
        share = sim_engines / n_eng
        questions, n_eng = max(1, round(questions * share)), sim_engines
        gpus, train_gpus = gpus * share, train_gpus * share
    engines = [Engine(prof) for _ in range(n_eng)]
    finished: list[Group] = []
    qid = [0]

    def done(s: Seq, t: float) -> None:
        g = s.group
        g.done += 1
        if g.done == g.size:
            g.finished_at = t
            finished.append(g)

    def start_group(version: int, at: float) -> Group:
        g = Group(qid[0], version, group_size)
        qid[0] += 1
        for prompt, turns in sample_episodes(episodes, group_size, rng):
            eng = min(engines, key=Engine.load)
            eng.add(Seq([tuple(x) for x in turns], g, prefill=prompt), at)
        return g

    t, times, stale, update_busy = 0.0, [], [], 0.0
    tick = tick_s(prof, episodes)
    if mode == "colocated-sync":
        for _ in range(steps):
            t0 = t
            finished.clear()
            for _ in range(questions):
                start_group(0, t)
            for e in engines:  # each engine to the end of its episodes; the step waits for the last
                while e.active or e.ready:
                    e.advance(e.t + 3600.0, done)
            t = max([t0] + [g.finished_at for g in finished])
            for e in engines:
                e.t = max(e.t, t)
            u = update_s(prof, sum(g.tokens for g in finished), train_gpus)
            update_busy += u * train_gpus
            t += u + prof.sync_s
            for e in engines:
                e.t = t
            times.append(t - t0)
        return summary(times, engines, update_busy, gpus, t, stale)
    # asynchronous: a producer keeps questions x max_staleness groups in flight
    capacity, inflight = questions * max_staleness, set()
    waiting: list[Group] = []
    for version in range(steps):  # the trainer's weight version during the step
        t0 = t
        while True:
            while len(inflight) + len(waiting) < capacity:
                inflight.add(start_group(version, t))
            for g in finished:
                inflight.discard(g)
                waiting.append(g)
            finished.clear()
            for g in [g for g in waiting if version - g.version > max_staleness]:
                waiting.remove(g)  # re-queued: generated again with the latest weights
            if len(waiting) >= questions:
                break
            t += tick
            for e in engines:
                e.advance(t, done)
        batch = sorted(waiting, key=lambda g: g.version)[:questions]
        t = max([t0] + [g.finished_at for g in batch])  # the trainer starts when the last of them ended
        for g in batch:
            waiting.remove(g)
            stale.append(version - g.version)
        while len(inflight) + len(waiting) < capacity:  # room again: the next groups start on these weights
            inflight.add(start_group(version, t))
        u = update_s(prof, sum(g.tokens for g in batch), train_gpus)
        update_busy += u * train_gpus
        pause = prof.push_s if fleet else prof.sync_s
        # engines stop for the push; colocated on a shared device also for the update itself
        stop_from = t if (prof.shared_device and not fleet) else t + u
        for e in engines:
            e.blocked.append((stop_from, t + u + pause))
            e.advance(t + u + pause, done)
        t += u + pause
        times.append(t - t0)
    return summary(times, engines, update_busy, gpus, t, stale)


def summary(times: list[float], engines: list[Engine], update_busy: float, gpus: int, total: float,
            stale: list[int]) -> dict:
    busy = sum(min(e.busy, total) for e in engines) + update_busy
    hist: dict[str, int] = {}
    for s in stale:
        hist[str(s)] = hist.get(str(s), 0) + 1
    return {"step_s": statistics.median(times[2:] if len(times) > 4 else times),
            "gpu_idle": max(0.0, 1.0 - busy / max(gpus * total, 1e-9)), "staleness": hist}


def calls_per_step(cpu, eps: list, q: int, gs: int, inputs: dict) -> float:
    """The ``generate`` calls of one simulated colocated-sync step: the step's growth when every call costs one
    second more."""
    prof = replace(cpu, sync_s=0.0, max_batch=256)
    a, b = (simulate("colocated-sync", replace(prof, call_fixed_s=cpu.call_fixed_s + d), eps, q, gs, gpus=1,
                     engine_gpus=1, steps=20)["step_s"] for d in (0.0, 1.0))
    return b - a


def fit_loop_overhead(cpu, eps: list, q: int, gs: int, inputs: dict, measured_sync: float | None) -> float | None:
    """The agent loop's own seconds per ``generate`` call (LangGraph's nodes, parsing, tokenising observations,
    the judge: what the decode micro-benchmark does not time), fitted by bisection so that the simulated
    colocated-sync step equals the measured one (seconds; ``None`` without a measured synchronous run). The
    validation's variant (c) adds it to every call of every mode: fitted on the synchronous run, checked on
    the asynchronous ones."""
    own = (inputs.get("trainer_s_by_mode") or {}).get("sync")
    if measured_sync is None or not own:
        return None
    prof = replace(cpu, sync_s=(inputs["sync_s"] or {}).get("sync") or 0.0, max_batch=256,
                   update_per_token_s=own / (inputs["tokens_per_episode"] * q * gs))
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        sim = simulate("colocated-sync", replace(prof, call_fixed_s=cpu.call_fixed_s + mid), eps, q, gs, gpus=1,
                       engine_gpus=1, steps=20)
        lo, hi = (mid, hi) if sim["step_s"] < measured_sync else (lo, mid)
    return (lo + hi) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="take this machine's inputs from its runs (the "
                    "decode and search costs measured once)")
    ap.add_argument("--remeasure", action="store_true", help="measure the decode and search costs again")
    ap.add_argument("--decode-only", action="store_true", help="only measure the decode and search costs")
    ap.add_argument("--no-projections", action="store_true", help="the validation only")
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "3b", "7b"], help="shapes projected")
    ap.add_argument("--series", default=None, help="the bench/async_rollouts.py series (its --tag) whose runs are "
                    "measured (default: scale_inputs.TAG)")
    args = ap.parse_args()
    if args.series is not None:
        import scale_inputs

        scale_inputs.TAG = args.series
    from scale_inputs import (
        cpu_profile,
        gpu_profiles,
        measure_decode,
        measure_tool,
        measured_steps,
        search_r1_episodes,
        trajectories,
    )

    stored = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    if args.remeasure or args.decode_only:
        prompt = int(statistics.median(p for p, _ in trajectories("sync")))  # the runs' prompts (tokens)
        stored.setdefault("cpu", {})["inputs"] = {"decode": measure_decode(prompt), "tool_s": measure_tool()}
        if args.decode_only:
            JSON_PATH.write_text(json.dumps(stored, indent=1))
            print(json.dumps(stored["cpu"]["inputs"], indent=1))
            return 0
    cpu, cpu_eps, cpu_inputs = cpu_profile(measure=args.measure or args.remeasure, stored=stored.get("cpu"))
    from scale_inputs import ASSUMED

    out = {"cpu": {"profile": asdict(cpu), "inputs": cpu_inputs, "episodes": cpu_eps}, "validation": {},
           "projections": {},
           "gpu_inputs": {"profiles": {k: asdict(v) for k, v in gpu_profiles().items()}, "assumed": ASSUMED,
                          "measured": "bench/results/gpu_scale_h200.json (decode tokens/s at 128 episodes, update "
                                      "tokens/s), bench/results/serve_load.json (retrieval p50 at 100 clients)",
                          "questions": 512, "group_size": 5, "simulated_engines": 2}}
    measured = measured_steps()
    q, gs = cpu_inputs["questions"], cpu_inputs["group_size"]
    syncs = cpu_inputs["sync_s"]
    loop_s = fit_loop_overhead(cpu, cpu_eps, q, gs, cpu_inputs, measured.get("sync"))
    out["cpu"]["fitted_loop_s_per_call"] = loop_s
    for mode, key in (("colocated-sync", "sync"), ("colocated-async", "async"), ("fleet-async", "fleet")):
        # the weight sync as measured in each mode; the engine server batches at most 64 prompts (its default),
        # the in-process scheduler 256
        prof = replace(cpu, sync_s=syncs[key] or 0.0, max_batch=64 if key == "fleet" else 256)
        got = measured.get(key)
        # (a) every cost from the synchronous run and the micro-benchmarks; (b) the trainer's own costs (score,
        # update) as measured in this mode's run, whose machine load differed (the rollout still simulated)
        own = (cpu_inputs.get("trainer_s_by_mode") or {}).get(key)
        variants = {"a": prof}
        if own:
            variants["b"] = replace(prof, update_per_token_s=own / (cpu_inputs["tokens_per_episode"] * q * gs))
            if loop_s is not None:  # (c) = (b) plus the agent loop's own time, fitted on sync: per generate
                # call where the loop runs beside its engine (colocated); in the fleet the loop runs in the
                # trainer's process (the engine only generates), so its seconds per step land on the trainer
                if key == "fleet":
                    per_step = loop_s * calls_per_step(cpu, cpu_eps, q, gs, cpu_inputs)
                    variants["c"] = replace(variants["b"], update_fixed_s=variants["b"].update_fixed_s + per_step)
                else:
                    variants["c"] = replace(variants["b"], call_fixed_s=prof.call_fixed_s + loop_s)
        res = {"measured_step_s": got}
        for v, pr in variants.items():
            sim = simulate(mode, pr, cpu_eps, q, gs, gpus=2 if key == "fleet" else 1, engine_gpus=1, steps=20)
            err = None if got is None else sim["step_s"] / got - 1.0
            res[v] = {"predicted_step_s": sim["step_s"], "error": err, "staleness": sim["staleness"]}
            print(f"{mode:16s} ({v}) predicted {sim['step_s']:.3f} s/step, measured "
                  f"{'-' if got is None else f'{got:.3f}'}" + ("" if err is None else f" ({100 * err:+.0f}%)"))
        out["validation"][mode] = res
    eps = search_r1_episodes(cpu_eps)
    profiles = {k: v for k, v in gpu_profiles().items() if k in args.shapes}
    for shape, prof in ({} if args.no_projections else profiles).items():
        for gpus in (8, 32, 128):
            row = {}
            for mode, engine_gpus in (("colocated-sync", None), ("colocated-async", None),
                                      ("fleet-async", gpus // 2), ("fleet-async", gpus * 3 // 4)):
                name = mode if engine_gpus in (None, gpus // 2) else f"{mode} (3/4 engines)"
                row[name] = simulate(mode, prof, eps, questions=512, group_size=5, gpus=gpus, steps=4,
                                     engine_gpus=engine_gpus, sim_engines=2)
            out["projections"][f"{shape}@{gpus}"] = row
            print(f"{shape:5s} {gpus:3d} GPUs: " + ", ".join(
                f"{m} {r['step_s']:.0f} s (idle {100 * r['gpu_idle']:.0f}%)" for m, r in row.items()))
    out["projections"] = {**stored.get("projections", {}), **out["projections"]}  # shapes not rerun are kept
    JSON_PATH.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
