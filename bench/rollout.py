"""Rollout benchmark: the LangGraph agent loop against a hand-written batched loop, and serving latency.

Throughput: episodes/s and generated (policy) tokens/s of :func:`agent.loop.batch.run_episodes` and of
:func:`handwritten_rollout` (a plain lock-step loop: one batched ``generate`` per turn for all live
episodes, one batched search, the same prompt, parser and observation code) on the same backend, model and
questions, with greedy decoding so both produce token-identical episodes (checked) from identical batches.
Runs alternate between the two loops; the median of ``--repeats`` runs is reported.

Serving: p50/p99 latency of ``POST /ask`` at 1, 8 and 32 concurrent clients against the app of
``sleuth serve`` on 127.0.0.1 (uvicorn in a thread of this process), same backend and model.

Model: the policy given by ``--model``, else a fresh tiny Qwen2-architecture policy (random weights,
``policy.tiny`` sizes of ``configs/quickstart.yaml``, tokenizer trained on the shipped sample), which
writes until its per-turn budget, so every turn generates ``max_new_tokens`` tokens.

    .venv/bin/python bench/rollout.py [--questions 32] [--repeats 5] [--model DIR] [--markdown]

Prints a table and writes ``bench/results/rollout.json`` (``--out`` elsewhere); ``--markdown`` also updates the "Rollout" section
of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# torch's OpenMP threads: set before torch is imported. On the shared 2-core machine, 2 threads spun against
# other jobs and ran generation 3-30x slower and erratically; 1 thread is stable (override: OMP_NUM_THREADS=N).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.llm import SamplingParams, decode, encode
from agent.loop.batch import run_episodes
from agent.protocols import search_r1
from agent.protocols.base import format_docs
from agent.protocols.build import prompt_ids
from agent.trajectory import Role, Trajectory


def handwritten_rollout(examples, llm, retriever, cfg, top_k: int) -> list[Trajectory]:
    """A hand-written lock-step batched loop (Search-R1 tags), token-identical to the LangGraph loop."""
    tok = llm.tokenizer
    head, tail = encode(tok, "\n\n<information>"), encode(tok, "</information>\n\n")
    trajs = []
    for i, ex in enumerate(examples):
        t = Trajectory(question_id=ex.id, question=ex.question, golden_answers=list(ex.golden_answers), group=i)
        t.append(prompt_ids(tok, ex.question, cfg), Role.PROMPT, 0)
        trajs.append(t)
    live = list(range(len(trajs)))
    for turn in range(1, cfg.max_turns + 1):
        budgets = {i: min(cfg.max_new_tokens, cfg.max_total_tokens - len(trajs[i])) for i in live}
        live = [i for i in live if budgets[i] > 0]
        if not live:
            break
        params = SamplingParams(max_new_tokens=max(budgets[i] for i in live), temperature=0.0,
                                top_p=cfg.top_p, stop=search_r1.STOP_STRINGS)
        gens = llm.generate([trajs[i].token_ids for i in live], params)
        searches, errors, nxt = [], [], []
        for i, g in zip(live, gens, strict=True):
            ids = g.token_ids[: budgets[i]]
            text = g.text if len(ids) == len(g.token_ids) else decode(tok, ids)
            trajs[i].append(ids, Role.POLICY, turn)
            a = search_r1.parse_action(text, max_query_chars=cfg.max_query_chars)
            if a.kind == "answer":
                trajs[i].answer = a.content
            elif turn < cfg.max_turns:
                (searches if a.kind == "search" else errors).append((i, a))
        hits = retriever.search([a.content for _, a in searches], top_k) if searches else []
        bodies = [(i, format_docs(h, cfg.max_doc_chars)) for (i, _), h in zip(searches, hits, strict=True)]
        bodies += [(i, search_r1.INVALID_HINT.format(reason=a.error)) for i, a in errors]
        for i, body in sorted(bodies):
            room = min(cfg.max_obs_tokens, cfg.max_total_tokens - len(trajs[i])) - len(head) - len(tail)
            if room <= 0:
                continue
            trajs[i].append(head + encode(tok, body)[:room] + tail, Role.TOOL, turn)
            nxt.append(i)
        live = nxt
    return trajs


def in_worker_thread(fn):
    """Call ``fn()`` in a worker thread, as the scheduler calls the backend (``asyncio.to_thread``).

    Both loops thus call the backend from a worker thread (with 2 OpenMP threads on the shared machine,
    the calling thread changed kernel speed many-fold); ``--main-thread`` also times the hand-written loop
    from the main thread, for the record."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def measure(fn, n_examples: int) -> dict:
    t0 = time.perf_counter()
    trajs = fn()
    wall = time.perf_counter() - t0
    gen = sum(t.num_policy_tokens for t in trajs)
    return {"wall_s": wall, "episodes_per_s": n_examples / wall, "gen_tokens_per_s": gen / wall,
            "generated_tokens": gen, "trajs": trajs}


def loop_overhead(examples, tokenizer, retriever, cfg, top_k: int, repeats: int = 5) -> dict:
    """Seconds per run of each loop with an instant backend (every turn searches a fixed query): the
    loop's own cost (graph, scheduler, parsing, search, tokenising observations), median of ``repeats``."""
    from agent.llm import Generation

    reply = "<search> capital city </search>"
    ids = encode(tokenizer, reply)

    class Instant:
        def __init__(self):
            self.tokenizer = tokenizer

        def generate(self, prompts, params):
            return [Generation(list(ids), reply) for _ in prompts]

    llm = Instant()
    handwritten_rollout(examples, llm, retriever, cfg, top_k)  # warm-up: the first search compiles MaxScore
    run_episodes(examples, llm, retriever, cfg, temperature=0.0, top_k=top_k)
    hw, lg = [], []
    for _ in range(repeats):  # paired runs, back to back
        hw.append(measure(lambda: handwritten_rollout(examples, llm, retriever, cfg, top_k), 1)["wall_s"])
        lg.append(measure(lambda: run_episodes(examples, llm, retriever, cfg, temperature=0.0, top_k=top_k), 1)["wall_s"])
    per = [1000 * (a - b) / (len(examples) * cfg.max_turns) for a, b in zip(lg, hw, strict=True)]
    return {"handwritten_s": statistics.median(hw), "langgraph_s": statistics.median(lg), "episodes": len(examples),
            "ms_per_episode_turn": statistics.median(per), "ms_per_episode_turn_runs": per}


def scaled_examples(n: int) -> list:
    """``n`` episodes' questions: the shipped sample's test then train questions, repeated under new ids."""
    from corpora import read_qa, sample_paths
    from corpora.formats import QAExample

    qs = read_qa(sample_paths()["test"]) + read_qa(sample_paths()["train"])
    return [QAExample(f"{q.id}#{i // len(qs)}", q.question, q.golden_answers, q.metadata)
            for i, q in ((i, qs[i % len(qs)]) for i in range(n))]


def overhead_line(o: dict, turns: int) -> str:
    """The markdown sentence of one :func:`loop_overhead` result."""
    runs = ", ".join(f"{x:.2f}" for x in o.get("ms_per_episode_turn_runs", []))
    per = o.get("ms_per_episode_turn",
                1000 * (o["langgraph_s"] - o["handwritten_s"]) / (o.get("episodes", 1) * turns))
    return (f"{o.get('episodes', '?')} concurrent episodes x {turns} turns: LangGraph {1000 * o['langgraph_s']:.0f} ms vs "
            f"hand-written {1000 * o['handwritten_s']:.0f} ms per run (medians), **{per:.2f} ms** of graph + "
            f"scheduler per episode-turn (median of paired runs{': ' + runs if runs else ''})")


def serving_latency(llm, retriever, cfg, questions: list[str], concurrency: list[int], per_client: int, top_k: int) -> dict:
    import httpx2

    from agent.serve.app import create_app
    from agent.serve.service import ServeLimits
    from tests.test_agent_fakes import ServerThread

    out = {}
    app = create_app(llm, retriever, cfg, top_k=top_k, limits=ServeLimits(request_timeout_s=600))
    with ServerThread(app) as srv:
        for c in concurrency:
            lat: list[float] = []

            async def client(j: int, http: httpx2.AsyncClient, lat: list[float] = lat) -> None:
                for r in range(per_client):
                    q = questions[(j * per_client + r) % len(questions)]
                    t0 = time.perf_counter()
                    resp = await http.post("/ask", json={"question": q})
                    resp.raise_for_status()
                    lat.append(time.perf_counter() - t0)

            async def run_all(c: int = c) -> float:
                async with httpx2.AsyncClient(base_url=srv.url, timeout=600,
                                             limits=httpx2.Limits(max_connections=c)) as http:
                    t0 = time.perf_counter()
                    await asyncio.gather(*(client(j, http) for j in range(c)))
                    return time.perf_counter() - t0

            wall = asyncio.run(run_all())
            lat.sort()
            p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
            out[str(c)] = {"requests": len(lat), "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * p99,
                           "requests_per_s": len(lat) / wall}
    return out


def load_policy(model: str | None, tmp: Path):
    from agent.backends.hf import TransformersLLM
    from corpora import read_corpus, read_qa, sample_paths
    from sleuth.config import load_config
    from training.model.tiny import create_tiny_policy

    if model:
        return TransformersLLM.from_pretrained(model, device="cpu"), model
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["policy.tiny.tokenizer_texts=3000"])
    path = tmp / "tiny"
    if not (path / "config.json").exists():
        sp = sample_paths()
        create_tiny_policy(path, read_corpus(sp["corpus"]), read_qa(sp["train"]), cfg.policy.tiny, seed=0)
    return TransformersLLM.from_pretrained(str(path), device="cpu"), f"tiny random Qwen2 {cfg.policy.tiny.model_dump()}"


def update_markdown(res: dict) -> None:
    path = ROOT / "bench/RESULTS.md"
    if "argv" in res:
        args = " ".join(res["argv"])
    else:  # a result from before the command line was recorded: what it holds of it
        args = (f"--questions {res['questions']} --repeats {res['repeats']}"
                + " --main-thread" * bool(res.get("handwritten_main_thread")) + " --markdown")
    lines = [
        "## Rollout", "",
        (f"{res['date']}, {res['machine']}. `python bench/rollout.py {args}`; raw numbers in "
         f"`{res.get('json', 'bench/results/rollout.json')}`."), "",
        (f"Model: {res['model']}; backend: transformers on CPU (torch threads: {res['threads']}); greedy; "
         f"{res['questions']} HotpotQA sample questions, max_turns={res['agent']['max_turns']}, "
         f"max_new_tokens={res['agent']['max_new_tokens']}; episodes token-identical between the loops: "
         f"{res['identical']}."), "",
        "| loop | episodes/s (median) | generated tokens/s (median) | generated tokens/s (all runs pooled) | backend calls per run |",
        "|---|---|---|---|---|",
    ]
    for name in ("handwritten", "langgraph"):
        r = res["throughput"][name]
        lines.append(f"| {name} | {r['episodes_per_s']:.2f} | {r['gen_tokens_per_s']:.0f} | "
                     f"{r['pooled_gen_tokens_per_s']:.0f} | {r['backend_calls']} |")
    lines += ["", (f"LangGraph / hand-written generated tokens/s, median of the {res['repeats']} paired runs "
                   f"(each pair back to back, order alternating): **{res['ratio']:.3f}** (target >= 0.95); "
                   f"pooled over all runs: {res['pooled_ratio']:.3f}; per-run ratios "
                   f"{', '.join(f'{x:.3f}' for x in res['ratios'])}. The per-loop medians above come from "
                   "different runs, so their quotient mixes in the machine's load drift."), "",
              ("The loops' own cost, with an instant backend (every turn searches the sample's BM25 index): "
               + overhead_line({"episodes": res["questions"], **res["overhead"]}, res["agent"]["max_turns"])
               + (f"; at {overhead_line(res['overhead_scale'], res['agent']['max_turns'])} (target <= 0.5 ms)"
                  if res.get("overhead_scale") else "") + "."), "",
              "Serving (`POST /ask`, same model, uvicorn on 127.0.0.1 in the same process):", "",
              "| clients | requests | p50 ms | p99 ms | requests/s |", "|---|---|---|---|---|"]
    for c, r in res["serving"].items():
        lines.append(f"| {c} | {r['requests']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['requests_per_s']:.2f} |")
    lines += ["", ("Notes: the machine is shared (2 cores, other jobs running), so absolute numbers are noisy; the "
                   "two loops alternate run by run and see the same load, and their ratio is the number to read. "
                   "Both loops call the backend from a worker thread (the scheduler uses `asyncio.to_thread`); torch "
                   "runs 1 OpenMP thread: with 2 threads on the shared cores generation was 3-30x slower and "
                   "erratic (spinning OpenMP threads against other jobs)")]
    mt = res.get("handwritten_main_thread")
    if mt:
        lines[-1] += (f"; called from the main thread, the same hand-written loop ran at {mt['gen_tokens_per_s']:.0f} "
                      "generated tokens/s")
    lines[-1] += "."
    lines.append("")
    section = "\n".join(lines)
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find("## Rollout")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("\n" + text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def parse_args() -> argparse.Namespace:
    from sleuth.commands.common import positive_int

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--per-client", type=positive_int, default=4, help="sequential requests per serving client")
    ap.add_argument("--tmp", default=str(ROOT / "runs/bench_rollout"))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/rollout.json",
                    help="the JSON results file (default: %(default)s)")
    ap.add_argument("--main-thread", action="store_true", help="also time the hand-written loop from the main thread")
    ap.add_argument("--overhead-episodes", type=positive_int, default=2560,
                    help="concurrent episodes of the loop-overhead measurement at scale (Search-R1's step: 512 x 5)")
    ap.add_argument("--overhead-repeats", type=positive_int, default=3, help="paired runs of that measurement")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the loop-overhead measurements (instant backend), printed and in --out")
    return ap.parse_args()


def paired_runs(examples, llm, retriever, acfg, top_k: int, repeats: int, main_thread: bool) -> dict:
    """The hand-written loop and the LangGraph one on the same episodes, ``repeats`` paired runs in
    alternating order (after a warm-up): ``{"throughput": {loop: medians, pooled tokens/s, backend calls},
    "ratios": [LangGraph / hand-written tokens/s per pair], "identical": bool, "main_thread": dict | None}``
    (``main_thread``: the hand-written loop once more with the backend called from the main thread)."""
    calls = {"n": 0}
    inner = llm.generate

    def counted(prompts, params):
        calls["n"] += 1
        return inner(prompts, params)

    llm.generate = counted
    run_episodes(examples[:4], llm, retriever, acfg, temperature=0.0, top_k=top_k)  # warm-up
    runs = {"handwritten": [], "langgraph": []}
    ncalls = {}
    identical = True
    for r in range(repeats):
        order = ["handwritten", "langgraph"] if r % 2 == 0 else ["langgraph", "handwritten"]
        res = {}
        for name in order:
            calls["n"] = 0
            if name == "langgraph":
                res[name] = measure(lambda: run_episodes(examples, llm, retriever, acfg, temperature=0.0, top_k=top_k), len(examples))
            else:
                res[name] = measure(lambda: in_worker_thread(lambda: handwritten_rollout(examples, llm, retriever, acfg, top_k)),
                                    len(examples))
            ncalls[name] = calls["n"]
            runs[name].append(res[name])
        identical &= all(a.token_ids == b.token_ids for a, b in zip(res["handwritten"]["trajs"], res["langgraph"]["trajs"], strict=True))
        print(f"run {r + 1}: hand-written {res['handwritten']['gen_tokens_per_s']:.0f} tok/s, "
              f"LangGraph {res['langgraph']['gen_tokens_per_s']:.0f} tok/s", flush=True)
    main = None
    if main_thread:
        m = measure(lambda: handwritten_rollout(examples, llm, retriever, acfg, top_k), len(examples))
        main = {k: m[k] for k in ("wall_s", "episodes_per_s", "gen_tokens_per_s")}
        print(f"hand-written, backend called from the main thread: {m['gen_tokens_per_s']:.0f} tok/s", flush=True)
    ratios = [lg["gen_tokens_per_s"] / hw["gen_tokens_per_s"] for lg, hw in zip(runs["langgraph"], runs["handwritten"], strict=True)]
    throughput = {}
    for name, rs in runs.items():
        throughput[name] = {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "episodes_per_s", "gen_tokens_per_s")}
        throughput[name]["generated_tokens"] = rs[0]["generated_tokens"]
        throughput[name]["pooled_gen_tokens_per_s"] = sum(x["generated_tokens"] for x in rs) / sum(x["wall_s"] for x in rs)
        throughput[name]["backend_calls"] = ncalls[name]
    llm.generate = inner
    return {"throughput": throughput, "ratios": ratios, "identical": identical, "main_thread": main}


def print_tables(out: dict, max_turns: int) -> None:
    """The throughput, loop-overhead and serving tables of one run's results."""
    print(f"\n{'loop':<12} {'episodes/s':>10} {'gen tok/s':>10} {'pooled':>8} {'calls':>6}")
    for name, r in out["throughput"].items():
        print(f"{name:<12} {r['episodes_per_s']:>10.2f} {r['gen_tokens_per_s']:>10.0f} "
              f"{r['pooled_gen_tokens_per_s']:>8.0f} {r['backend_calls']:>6}")
    print(f"LangGraph / hand-written tokens/s: {out['ratio']:.3f} (median of paired runs "
          f"{', '.join(f'{x:.3f}' for x in out['ratios'])}; pooled {out['pooled_ratio']:.3f}); identical episodes: "
          f"{out['identical']}")
    for o in (out["overhead"], out["overhead_scale"]):
        print("loop overhead (instant backend), " + overhead_line(o, max_turns))
    print(f"\n{'clients':>7} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7}")
    for c, r in out["serving"].items():
        print(f"{c:>7} {r['requests']:>8} {r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} {r['requests_per_s']:>7.2f}")


def main() -> int:
    args = parse_args()
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from corpora import read_qa, sample_paths
    from retrieval.base import IndexNotFoundError
    from retrieval.index import build_index, load_retriever
    from sleuth.config import load_config

    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ROOT / "configs/quickstart.yaml")
    acfg = cfg.agent.model_copy(update={"temperature": 0.0})
    try:
        retriever = load_retriever(tmp / "index", "bm25")
    except IndexNotFoundError:
        build_index(sample_paths()["corpus"], tmp / "index", build_dense=False, show_progress=False)
        retriever = load_retriever(tmp / "index", "bm25")
    llm, model_desc = load_policy(args.model, tmp)
    examples = read_qa(sample_paths()["test"])[: args.questions]
    top_k = cfg.retrieval.top_k
    if args.overhead_only:
        return overhead_only(args, examples, llm.tokenizer, retriever, acfg, top_k)

    paired = paired_runs(examples, llm, retriever, acfg, top_k, args.repeats, args.main_thread)
    throughput, ratios = paired["throughput"], paired["ratios"]
    overhead = loop_overhead(examples, llm.tokenizer, retriever, acfg, top_k)
    overhead_scale = loop_overhead(scaled_examples(args.overhead_episodes), llm.tokenizer, retriever, acfg, top_k,
                                   repeats=args.overhead_repeats)
    questions = [e.question for e in read_qa(sample_paths()["test"])]
    serving = serving_latency(llm, retriever, acfg, questions, args.concurrency, args.per_client, top_k)

    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
        "json": str(args.out.resolve().relative_to(ROOT)) if args.out.resolve().is_relative_to(ROOT) else str(args.out),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), Python {platform.python_version()}",
        "threads": torch.get_num_threads(), "model": model_desc, "questions": len(examples), "repeats": args.repeats,
        "agent": {k: getattr(acfg, k) for k in ("max_turns", "max_new_tokens", "max_total_tokens", "max_obs_tokens")},
        "identical": paired["identical"], "throughput": throughput, "ratio": statistics.median(ratios), "ratios": ratios,
        "pooled_ratio": throughput["langgraph"]["pooled_gen_tokens_per_s"] / throughput["handwritten"]["pooled_gen_tokens_per_s"],
        "serving": serving, "handwritten_main_thread": paired["main_thread"], "overhead": overhead,
        "overhead_scale": overhead_scale,
    }
    print_tables(out, acfg.max_turns)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    if args.markdown:
        update_markdown(out)
    return 0


def overhead_only(args, examples, tokenizer, retriever, acfg, top_k: int) -> int:
    """``--overhead-only``: the loop overhead at ``--questions`` and at ``--overhead-episodes`` episodes."""
    import torch

    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
           "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), Python {platform.python_version()}",
           "threads": torch.get_num_threads(), "max_turns": acfg.max_turns,
           "overhead": loop_overhead(examples, tokenizer, retriever, acfg, top_k),
           "overhead_scale": loop_overhead(scaled_examples(args.overhead_episodes), tokenizer, retriever, acfg, top_k,
                                           repeats=args.overhead_repeats)}
    for key in ("overhead", "overhead_scale"):
        print("loop overhead (instant backend), " + overhead_line(res[key], acfg.max_turns))
    out = args.out if "--out" in sys.argv else ROOT / "bench/results/rollout_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
