"""Benchmark: a whole ``sleuth train`` of a few steps at a real policy shape -- step time by phase, peak memory,
generated tokens/s.

The run is ``configs/search_r1_qwen2.5_3b.yaml`` (GRPO, group 5, KL to a reference model in the loss, micro
batches of 64 episodes / 16,384 tokens, gradient checkpointing, bf16) with the policy scaled to Qwen2.5-0.5B's
shape and these settings changed (all on the command line, nothing else): the policy is bench/gpu_policy.py's
random one (no download; it searches about one turn in four), saved to a folder first; 64 questions x 5
episodes per step; the shipped HotpotQA sample with BM25 over its corpus, searched through a retrieval server
(``sleuth serve-retrieval``, its own process, started here); the transformers backend (the device image has no
vLLM) with all 320 episodes in one generation batch and at most 64 tokens per turn (a random policy rarely
stops: the recipe's 500 would spend the budget on noise); 3 steps, no held-out evaluation. The checkpoint of
the last step is written as in any run.

Phases are timed by wrapping :mod:`training.trainer`'s phase functions (rollout, collate, score, advantages,
rollout correction, update, sync, checkpoint, log) in this process, then running ``sleuth train`` through its
CLI entry point (``sleuth.cli.main``), so the timed run is the command users run. On a GPU each phase is
synchronised and its peak ``max_memory_allocated`` recorded. The JSON is rewritten after every step, so a run
that is stopped keeps the steps it finished.

Usage: ``python bench/gpu_train.py [--steps 3 --questions 64] [--out bench/results/gpu_train.json]``;
``--device cpu --tiny`` runs bench/gpu_scale.py's tiny shape on the CPU (2 questions x 2 episodes of at most 2
turns of 8 tokens, Search-R1's short prompt, observations of 64 tokens, tags far more likely) to check the
script.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_policy
import gpu_scale
import gpu_tables

CONFIG = ROOT / "configs" / "search_r1_qwen2.5_3b.yaml"
#: training.trainer's phase functions and the names they are reported under, in the order a step runs them
PHASES = {"rollout_phase": "rollout", "collate": "collate", "score": "score", "advantage_phase": "advantages",
          "rollout_correction": "rollout_correction", "update_phase": "update", "sync_phase": "sync",
          "checkpoint_phase": "checkpoint", "log_phase": "log"}
GIB = 1024**3


class PhaseClock:
    """Wall time (and on a GPU the peak allocated memory) of each phase of each step; ``save()`` is called
    after every step's last phase."""

    def __init__(self, cuda: bool, save):
        self.cuda, self.save, self.steps = cuda, save, []
        self.first_call: float | None = None

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            if name == "rollout":
                self.first_call = self.first_call or time.perf_counter()
                self.steps.append({"phases": {}, "peak_alloc_gib": {}})
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if self.cuda:
                torch.cuda.synchronize()
            step = self.steps[-1]
            step["phases"][name] = round(step["phases"].get(name, 0.0) + time.perf_counter() - t0, 3)
            if self.cuda:
                step["peak_alloc_gib"][name] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            if name == "rollout":
                step.update(rollout_counts(out[0]))
                step["gen_tokens_per_s"] = round(step["gen_tokens"] / max(step["phases"]["rollout"], 1e-9), 1)
            if name == "log":  # the step's last phase (its record is logged after its checkpoint)
                step["step_s"] = round(sum(step["phases"].values()), 3)
                self.save()
            return out

        return timed

    def install(self) -> None:
        import training.trainer as T

        for attr, name in PHASES.items():
            setattr(T, attr, self.wrap(name, getattr(T, attr)))


def rollout_counts(trajs) -> dict:
    """Episodes, generated (policy) tokens, tool tokens, all tokens and searches of one step's rollout."""
    from agent.trajectory import Role

    return {"episodes": len(trajs), "gen_tokens": sum(t.num_policy_tokens for t in trajs),
            "tool_tokens": sum(sum(1 for r in t.roles if r == Role.TOOL) for t in trajs),
            "tokens": sum(len(t) for t in trajs), "searches": sum(t.num_search_calls for t in trajs)}


def save_policy(args, out_dir: Path, device: torch.device) -> dict:
    """The searching random policy and its tokenizer, written as a model folder ``sleuth train`` loads."""
    shape = gpu_scale.SMOKE_SHAPE if args.tiny else gpu_scale.SHAPES["0.5b"]
    tok = gpu_policy.make_tokenizer(shape["vocab"])
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rates = gpu_policy.TINY_TAG_RATES if args.tiny else gpu_policy.TAG_RATES
    model = gpu_policy.make_policy(shape, tok, dtype, device, seed=args.seed, rates=rates)
    measured = gpu_policy.tag_rates(model, 128)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": shape, "params": params, "dtype": str(dtype).removeprefix("torch."), "tag_rates": measured}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: Path, port: int, log: Path) -> subprocess.Popen:
    """``sleuth serve-retrieval`` over ``index`` on 127.0.0.1:``port`` in its own process; returns once its
    ``/health`` answers (``RuntimeError`` with its log's end if it exits or takes over 120 s)."""
    from retrieval.client import RemoteRetriever

    cmd = [sys.executable, "-m", "sleuth.cli", "serve-retrieval", "--index", str(index), "--port", str(port)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # and wheels carried there
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the retrieval server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            RemoteRetriever(f"http://127.0.0.1:{port}", timeout=2, retries=0).health()
            return proc
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the retrieval server did not answer /health in 120 s: {log.read_text()[-2000:]}")


def overrides(args, work: Path, port: int) -> list[str]:
    """The command line's changes to configs/search_r1_qwen2.5_3b.yaml (see the module docstring)."""
    tiny = args.tiny
    return [f"out_dir={work / 'run'}", "data.corpus=", "data.train=", "data.test=",
            "retrieval.method=bm25", f"retrieval.index_dir={work / 'index'}", f"retrieval.url=http://127.0.0.1:{port}",
            "retrieval.build_dense=false", f"policy.model={work / 'policy'}",
            f"policy.dtype={'float32' if tiny else 'bfloat16'}", "agent.backend.kind=transformers",
            f"agent.max_new_tokens={args.new_tokens}", f"agent.max_batch={args.questions * args.group}",
            f"train.steps={args.steps}", f"train.rollout.questions_per_step={args.questions}",
            f"train.rollout.group_size={args.group}", "train.monitoring.eval_every=0",
            *(["agent.short_prompt=true", "agent.max_turns=2", "agent.max_obs_tokens=64", "agent.max_total_tokens=512"]
              if tiny else [])]


def dir_gib(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / GIB, 3)


def run(args, save) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
           "torch": torch.__version__, "config": str(CONFIG.relative_to(ROOT)), "steps": []}
    with tempfile.TemporaryDirectory(dir=args.work) as d:
        work = Path(d)
        t0 = time.perf_counter()
        out["policy"] = save_policy(args, work / "policy", device)
        from corpora import sample_paths
        from retrieval.index import build_index

        build_index(sample_paths()["corpus"], work / "index", build_dense=False, show_progress=False)
        port = free_port()
        server = start_server(work / "index", port, work / "server.log")
        t1 = time.perf_counter()
        from retrieval.client import RemoteRetriever

        # the first search compiles the BM25 top-k (numba, cached per install): not a step's cost
        RemoteRetriever(f"http://127.0.0.1:{port}", timeout=300).search(["warm up the index"], 3)
        out["server_warmup_s"] = round(time.perf_counter() - t1, 2)
        out["setup_s"] = round(time.perf_counter() - t0, 2)
        try:
            clock = PhaseClock(cuda, lambda: save(out))
            out["steps"] = clock.steps
            clock.install()
            argv = ["train", "--config", str(CONFIG), *overrides(args, work, port)]
            out["argv"] = ["sleuth", *argv[:2], str(CONFIG.relative_to(ROOT)),
                           *[a.replace(str(work), "<work>") for a in argv[3:]]]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t1 = time.perf_counter()
            from sleuth.cli import main as sleuth_main

            rc = sleuth_main(argv)
            out["train_s"] = round(time.perf_counter() - t1, 2)
            out["startup_s"] = round((clock.first_call or t1) - t1, 2)
            out["exit_code"] = rc
            if rc != 0:
                raise RuntimeError(f"sleuth train exited with {rc}")
        finally:
            server.terminate()
            server.wait(30)
        run_dir = work / "run" / "grpo"
        out["records"] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
        out["checkpoint_gib"] = dir_gib(ckpts[-1]) if ckpts else None
    if cuda:
        out["peak_alloc_gib"] = max((max(s["peak_alloc_gib"].values()) for s in out["steps"]), default=None)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from sleuth.commands.common import positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the tiny shape and batch (for --device cpu)")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--questions", type=positive_int, default=None, help="questions per step (64; tiny 2)")
    p.add_argument("--group", type=positive_int, default=None, help="episodes per question (5; tiny 2)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens per turn at most (64; tiny 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the run's temporary files (default: the system's)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_train.json on a GPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device; use --device cpu --tiny to check the script")
    for k, full, tiny in (("questions", 64, 2), ("group", 5, 2), ("new_tokens", 64, 8)):
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    if args.out is None and args.device == "cuda":
        args.out = str(ROOT / "bench" / "results" / "gpu_train.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def save(out: dict) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")

    out = run(args, save)
    save(out)
    print(gpu_tables.train_table(out))
    return out


if __name__ == "__main__":
    main()
