"""Load benchmark of both servers: requests/s, p50/p99 latency and the server's memory at 1, 10 and 100 clients.

Each server runs as its own process, started as a user starts it (``sleuth serve-retrieval --index DIR`` and
``sleuth serve --model DIR --index DIR --config configs/quickstart.yaml``), over a BM25 index of the shipped
sample corpus (3,894 passages) and the tiny random Qwen2 policy of the quickstart's sizes (built on first use;
it writes until its per-turn budget, so every episode runs all its turns). Every client sends its requests
one after another over its own keep-alive connection; all clients start together:

* ``serve-retrieval``: ``POST /retrieve`` of one sample question at ``topk`` 3 (a rollout worker's search);
* ``serve``: ``POST /ask`` of one sample question (a whole greedy episode: generations and searches, batched
  with the other clients' episodes by the server's scheduler).

Memory is the server process's resident set (RSS, Linux ``/proc``): before the load, its peak (sampled every
20 ms) during the load, and after it. A request answered with another status than 200 counts as an error.

    .venv/bin/python bench/serve_load.py [--clients 1 10 100] [--requests 50] [--agent-requests 2] [--markdown]

Prints a table and writes ``bench/results/serve_load.json`` (``--out`` elsewhere); ``--markdown`` also updates the
"Serving under load" section of ``bench/RESULTS.md``. ``--smoke`` runs a few requests at 1 and 2 clients (the
test suite's CPU check); ``--corpus``/``--qa``/``--model`` replace the sample data and the tiny policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # see bench/rollout.py: 1 torch thread on the shared cores
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    """Resident set size of process ``pid`` in kB (Linux ``/proc``; 0 elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakRss:
    """Samples process ``pid``'s RSS every ``every_s`` seconds in a thread while the block runs; ``peak`` kB."""

    def __init__(self, pid: int, every_s: float = 0.02):
        self.pid, self.every_s, self.peak = pid, every_s, rss_kb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, rss_kb(self.pid))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_kb(self.pid))


def start_server(args: list[str], port: int, log: Path) -> subprocess.Popen:
    """``python -m sleuth.cli ARGS --port PORT`` started, its output going to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "sleuth.cli", *args, "--port", str(port)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 300.0) -> None:
    """Return once ``/health`` on ``port`` answers; ``RuntimeError`` with the log's end if the server exits or
    does not come up within ``timeout_s``."""
    import httpx2

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not come up in {timeout_s} s: {log.read_text()[-2000:]}")


async def drive(url: str, path: str, bodies: list[dict], clients: int, per_client: int) -> tuple[list[float], dict, float]:
    """``clients`` concurrent clients, each POSTing ``per_client`` bodies (taken round-robin from ``bodies``)
    to ``url + path`` one after another. Returns (latencies in s of the 200 answers, other statuses counted,
    wall seconds)."""
    import httpx2

    lat: list[float] = []
    errors: dict[str, int] = {}

    async def client(j: int, http) -> None:
        for r in range(per_client):
            body = bodies[(j * per_client + r) % len(bodies)]
            t0 = time.perf_counter()
            try:
                resp = await http.post(path, json=body)
                status = str(resp.status_code)
            except httpx2.HTTPError as e:
                status = type(e).__name__
            if status == "200":
                lat.append(time.perf_counter() - t0)
            else:
                errors[status] = errors.get(status, 0) + 1

    async with httpx2.AsyncClient(base_url=url, timeout=600, limits=httpx2.Limits(max_connections=clients)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(j, http) for j in range(clients)))
        return lat, errors, time.perf_counter() - t0


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` by nearest rank (``nan`` for none)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def measure(proc: subprocess.Popen, url: str, path: str, bodies: list[dict], clients: list[int],
            per_client: int) -> dict[str, dict]:
    """One row per client count: requests, errors, requests/s, p50/p99 ms and RSS (MB) before, at peak and
    after the load."""
    out = {}
    asyncio.run(drive(url, path, bodies, 1, 2))  # warm-up: first-call compilation and caches
    for c in clients:
        before = rss_kb(proc.pid)
        with PeakRss(proc.pid) as peak:
            lat, errors, wall = asyncio.run(drive(url, path, bodies, c, per_client))
        out[str(c)] = {"requests": len(lat) + sum(errors.values()), "errors": errors,
                       "requests_per_s": (len(lat) + sum(errors.values())) / wall,
                       "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
                       "p99_ms": 1000 * percentile(lat, 0.99), "rss_mb_before": before / 1024,
                       "rss_mb_peak": peak.peak / 1024, "rss_mb_after": rss_kb(proc.pid) / 1024}
    return out


def prepare(args) -> tuple[Path, Path, list[str], str]:
    """(index directory, policy directory, questions, policy description), built under ``args.work`` on
    first use."""
    from corpora import read_corpus, read_qa, sample_paths
    from retrieval.base import IndexNotFoundError
    from retrieval.index import build_index, load_retriever

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sp = sample_paths()
    corpus, qa = Path(args.corpus or sp["corpus"]), Path(args.qa or sp["test"])
    index = work / f"index-{corpus.stem}"
    try:
        load_retriever(index, "bm25")
    except IndexNotFoundError:
        build_index(corpus, index, build_dense=False, show_progress=False)
    questions = [ex.question for ex in read_qa(qa)]
    if args.model:
        return index, Path(args.model), questions, str(args.model)
    from sleuth.config import load_config
    from training.model.tiny import create_tiny_policy

    cfg = load_config(ROOT / "configs/quickstart.yaml", ["policy.tiny.tokenizer_texts=3000"])
    model = work / "tiny"
    if not (model / "config.json").exists():
        create_tiny_policy(model, read_corpus(sp["corpus"]), read_qa(sp["train"]), cfg.policy.tiny, seed=0)
    return index, model, questions, f"tiny random Qwen2 {cfg.policy.tiny.model_dump()}"


def table(res: dict) -> str:
    lines = ["| server | route | clients | requests | errors | requests/s | p50 ms | p99 ms | RSS MB before / peak / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, route in (("serve-retrieval", "POST /retrieve"), ("serve", "POST /ask")):
        for c, r in res["servers"][name].items():
            errs = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
            lines.append(f"| {name} | {route} | {c} | {r['requests']} | {errs} | {r['requests_per_s']:.1f} | "
                         f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['rss_mb_before']:.0f} / {r['rss_mb_peak']:.0f} / "
                         f"{r['rss_mb_after']:.0f} |")
    return "\n".join(lines)


def memory_note(res: dict) -> str:
    """One sentence on each server's resident memory from the lightest load to the heaviest."""
    parts = []
    for name in ("serve-retrieval", "serve"):
        rows = res["servers"][name]
        lo, hi = rows[min(rows, key=int)], rows[max(rows, key=int)]
        parts.append(f"`{name}` went from {lo['rss_mb_before']:.0f} MB before the lightest load to a peak of "
                     f"{hi['rss_mb_peak']:.0f} MB at {max(rows, key=int)} clients ({hi['rss_mb_after']:.0f} MB after it)")
    return "Memory: " + "; ".join(parts) + "."


def update_markdown(res: dict, text: str) -> None:
    path = ROOT / "bench/RESULTS.md"
    section = "\n".join([
        "## Serving under load", "",
        (f"{res['date']}, 2-core CPU dev machine ({res['machine']}). `python bench/serve_load.py {' '.join(res['argv'])}`; raw numbers in "
         "`bench/results/serve_load.json`."), "",
        (f"Each server in its own process as `sleuth serve-retrieval` / `sleuth serve` start it, over a BM25 index of "
         f"{res['passages']:,} passages; the agent: {res['model']}, configs/quickstart.yaml's agent (max_turns "
         f"{res['agent']['max_turns']}, max_new_tokens {res['agent']['max_new_tokens']}), greedy. Each client sends "
         f"its requests one after another ({res['per_client']['serve-retrieval']} to /retrieve: one question, "
         f"topk 3; {res['per_client']['serve']} to /ask: a whole episode); all clients start together."), "",
        text, "",
        (f"The load generator (httpx in one Python process) runs on the same cores as the server, and the machine "
         f"was shared with other jobs (load average {res['load_avg'][0]:.1f} at the start, {res['load_avg'][1]:.1f} at "
         "the end, on 2 cores), so absolute numbers are noisy and latency at many clients is mostly queueing. "
         "The retrieval server batches the requests that arrive while a search runs into one index pass; the "
         "agent server batches the clients' episodes into one generation per turn, so an episode's latency grows "
         "with the batch it joins. No request was refused at these loads (every limit at its default)."), "",
        memory_note(res), ""])
    doc = path.read_text()
    start = doc.find("## Serving under load")
    if start >= 0:
        end = doc.find("\n## ", start + 1)
        doc = doc[:start] + section + ("\n" + doc[end + 1:] if end >= 0 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + section
    path.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    from sleuth.commands.common import positive_int

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=positive_int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--requests", type=positive_int, default=50, help="/retrieve requests per client")
    ap.add_argument("--agent-requests", type=positive_int, default=2, help="/ask requests per client")
    ap.add_argument("--corpus", help="corpus JSONL (default: the shipped sample)")
    ap.add_argument("--qa", help="questions JSONL (default: the shipped sample's test split)")
    ap.add_argument("--model", help="policy directory (default: the tiny random policy, built in --work)")
    ap.add_argument("--work", default=str(ROOT / "runs/bench_serve_load"))
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/serve_load.json")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="1 and 2 clients, 3 and 1 requests, 2 short turns")
    args = ap.parse_args(argv)
    if args.smoke:
        args.clients, args.requests, args.agent_requests = [1, 2], 3, 1
    index, model, questions, model_desc = prepare(args)
    agent_over = ["agent.max_turns=2", "agent.max_new_tokens=8"] if args.smoke else []
    work = Path(args.work)
    servers = {
        "serve-retrieval": (["serve-retrieval", "--index", str(index)], "/retrieve",
                            [{"queries": [q], "topk": 3, "return_scores": True} for q in questions], args.requests),
        "serve": (["serve", "--config", str(ROOT / "configs/quickstart.yaml"), "--model", str(model), "--index",
                   str(index), f"out_dir={work}", *agent_over], "/ask", [{"question": q} for q in questions],
                  args.agent_requests),
    }
    res: dict = {"servers": {}, "per_client": {}, "load_avg": [os.getloadavg()[0]]}
    ports = {name: free_port() for name in servers}
    procs = {name: start_server(cmd, ports[name], work / f"{name}.log") for name, (cmd, *_) in servers.items()}
    try:  # both start at once (loading is most of a short run); each is then loaded alone
        for name, (_, path, bodies, per_client) in servers.items():
            wait_healthy(procs[name], ports[name], work / f"{name}.log")
            url = f"http://127.0.0.1:{ports[name]}"
            res["servers"][name] = measure(procs[name], url, path, bodies, args.clients, per_client)
            res["per_client"][name] = per_client
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(60)
    from retrieval.index import read_manifest
    from sleuth.config import load_config

    res["load_avg"].append(os.getloadavg()[0])
    acfg = load_config(ROOT / "configs/quickstart.yaml", agent_over).agent
    res |= {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": argv if argv is not None else sys.argv[1:],
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), Python {platform.python_version()}",
            "passages": read_manifest(index)["num_passages"], "model": model_desc,
            "agent": {"max_turns": acfg.max_turns, "max_new_tokens": acfg.max_new_tokens}}
    text = table(res)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    if args.markdown:
        update_markdown(res, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
