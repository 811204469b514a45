"""Benchmark: rollout/trainer log-prob drift of a bf16 policy -- the rollout correction's ``offpolicy/`` metrics.

A randomly initialised ``Qwen2ForCausalLM`` of Qwen2.5-0.5B's shape (bench/gpu_scale.py's shapes and
tokenizer; nothing is downloaded) runs multi-turn agent episodes on the shipped HotpotQA sample's questions
through the transformers backend (:class:`agent.backends.hf.TransformersLLM`, the trainer's default; BM25 over the
sample), in bf16. Each sampled token's log-prob as the backend reported it is then compared with the
trainer's scoring of the same batch (:func:`training.model.actor.score_logprobs`, the fused masked kernel on a GPU)
by :func:`training.algos.offpolicy.rollout_correction`, which logs the ``offpolicy/`` metrics each training step:
mean and max ``|log pi_old - log pi_rollout|``, quantiles of the ratio, the k3 KL and the share of tokens
past the TIS cap (``train.algorithm.tis_cap``, 2). Scoring modes:

* ``bf16``: the bf16 weights under bf16 autocast (``train.optim.bf16``), as a bf16 policy trains;
* ``fp32``: the same weights upcast to float32, no autocast (the weights' exact distribution);
* ``fp32_autocast``: float32 weights under bf16 autocast (mixed precision, as verl's FSDP actor);
* ``control``: float32 rollouts scored in float32, which must agree to float noise (on the CPU exactly
  the same arithmetic: ~0).

A random policy's next-token distributions are nearly uniform over the vocabulary; a trained model's are
peaked, so these figures say how the numerics differ, not how a trained model's would.

Usage: ``python bench/gpu_drift.py [--episodes 64 --samples 2 --new-tokens 96] [--out bench/results/gpu_drift.json]``;
``--device cpu --tiny`` runs a tiny shape on the CPU (bf16 and fp32) to check the script.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_scale
import gpu_tables

#: the scoring modes: (weights' dtype, bf16 autocast)
MODES = {"bf16": (torch.bfloat16, True), "fp32": (torch.float32, False), "fp32_autocast": (torch.float32, True)}


def agent_config(args):
    """The rollouts' agent settings: the Search-R1 recipe's prompt and protocol, ``args.turns`` turns of at most
    ``args.new_tokens`` tokens, temperature 1 and no top-p cut (the reported log-probs are then of the full
    softmax the trainer scores)."""
    from agent.config import AgentConfig

    return AgentConfig(max_turns=args.turns, max_new_tokens=args.new_tokens, max_total_tokens=4096,
                       max_obs_tokens=500, temperature=1.0, top_p=1.0, short_prompt=False,
                       max_batch=args.episodes * args.samples)


def sample_retriever(work: Path):
    """BM25 over the shipped sample's corpus (built into ``work``), as the agent searches it in training."""
    from corpora import sample_paths
    from retrieval.index import build_index, load_retriever

    build_index(sample_paths()["corpus"], work / "index", build_dense=False, show_progress=False)
    return load_retriever(work / "index", "bm25")


def roll_out(model, tok, retriever, args, n_questions: int, seed: int):
    """Agent episodes of ``n_questions`` sample questions x ``args.samples``, collated as the trainer collates
    them; returns ``(batch, seconds, generated tokens)``."""
    from agent.backends.hf import TransformersLLM
    from agent.loop.batch import run_episodes
    from corpora import read_qa, sample_paths
    from training.batch import collate

    questions = read_qa(sample_paths()["train"])[:n_questions]
    model.eval()
    _sync(model)
    t0 = time.perf_counter()
    trajs = run_episodes(questions, TransformersLLM(model, tok), retriever, agent_config(args),
                         n_samples=args.samples, seed=seed)
    _sync(model)
    dt = time.perf_counter() - t0
    batch = collate(trajs, tok.pad_token_id, 4096)
    batch.temperature = 1.0
    return batch, dt, sum(t.num_policy_tokens for t in trajs)


def _sync(model) -> None:
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def drift(model, batch, bf16: bool, args) -> dict:
    """The trainer's scoring of ``batch`` by ``model`` (autocast ``bf16``), then the rollout correction's
    metrics against the log-probs the backend reported."""
    from training.algos.offpolicy import rollout_correction
    from training.config import TrainConfig
    from training.model.actor import score_logprobs

    tc = TrainConfig(optim={"bf16": bf16, "micro_batch": args.micro_batch, "micro_batch_tokens": args.micro_tokens})
    batch.old_logprobs = batch.is_weights = None
    t0 = time.perf_counter()
    score_logprobs(model, None, batch, tc)
    _sync(model)
    out = {"score_s": round(time.perf_counter() - t0, 3), "tis_cap": tc.algorithm.tis_cap,
           "tokens": int((batch.loss_mask.bool() & torch.isfinite(batch.rollout_logprobs)).sum())}
    out.update(rollout_correction(batch, tc))
    return out


def upcast(model):
    """A float32 copy of ``model`` (the same weights, exactly representable)."""
    import copy

    return copy.deepcopy(model).float().eval()


def run(args, save=lambda out: None) -> dict:
    """The drift measurement; ``save(out)`` after every scoring mode (a stopped run keeps the rows it has)."""
    device = torch.device(args.device)
    shape = gpu_scale.SMOKE_SHAPE if args.tiny else gpu_scale.SHAPES["0.5b"]
    tok = gpu_scale.make_tokenizer(shape["vocab"])
    out = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()})",
           "torch": torch.__version__, "shape": "tiny" if args.tiny else "0.5b", "config": shape,
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": {}}
    from training.model import kernels as K

    out["kernels"] = "cuda" if device.type == "cuda" and K.available() else "reference"
    with tempfile.TemporaryDirectory() as d:
        retriever = sample_retriever(Path(d))
        model = gpu_scale.make_policy(shape, torch.bfloat16, device, seed=args.seed)
        model.gradient_checkpointing_disable()
        batch, secs, gen = roll_out(model, tok, retriever, args, args.episodes, args.seed)
        out["rollout"] = {"episodes": len(batch), "policy_tokens": gen, "s": round(secs, 3),
                          "gen_tokens_per_s": round(gen / secs, 1), "dtype": "bfloat16"}
        fp32 = upcast(model)
        for mode, (dtype, autocast) in MODES.items():
            m = model if dtype == torch.bfloat16 else fp32
            out["rows"][mode] = {"rollout": "bf16", "weights": str(dtype).removeprefix("torch."),
                                 "autocast_bf16": autocast and device.type == "cuda", **drift(m, batch, autocast, args)}
            print(f"[drift] bf16 rollout vs {mode} scoring: {json.dumps(out['rows'][mode])}", flush=True)
            save(out)
        del model
        control, _, _ = roll_out(fp32, tok, retriever, args, args.control_episodes, args.seed + 1)
        out["rows"]["control"] = {"rollout": "fp32", "weights": "float32", "autocast_bf16": False,
                                  **drift(fp32, control, False, args)}
        print(f"[drift] fp32 rollout vs fp32 scoring: {json.dumps(out['rows']['control'])}", flush=True)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from sleuth.commands.common import positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="bench/gpu_scale.py's tiny shape (for --device cpu)")
    p.add_argument("--episodes", type=positive_int, default=64, help="sample questions rolled out in bf16")
    p.add_argument("--samples", type=positive_int, default=2, help="episodes per question")
    p.add_argument("--control-episodes", type=positive_int, default=8, help="questions of the fp32 control")
    p.add_argument("--turns", type=positive_int, default=2, help="agent turns per episode at most")
    p.add_argument("--new-tokens", type=positive_int, default=96, help="tokens per turn at most")
    p.add_argument("--micro-batch", type=positive_int, default=64, help="episodes per scoring micro-batch")
    p.add_argument("--micro-tokens", type=positive_int, default=16384, help="tokens per scoring micro-batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_drift.json on a GPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device; use --device cpu --tiny to check the script")
    if args.out is None and args.device == "cuda":
        args.out = str(Path(__file__).resolve().parent / "results" / "gpu_drift.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def save(out: dict) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    out = run(args, save)
    save(out)
    print(gpu_tables.drift_table(out))
    return out


if __name__ == "__main__":
    main()
