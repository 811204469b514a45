"""Benchmark: one GRPO step of Qwen2.5-sized policies on one GPU -- rollout and update, peak memory, tokens/s.

Randomly initialised ``Qwen2ForCausalLM`` policies of the shapes of Qwen2.5-0.5B, 1.5B, 3B and 7B (numbers
below, from each model's public ``config.json``; nothing is downloaded), in bf16 with gradient checkpointing,
with and without LoRA (peft), each measured in two phases:

* **rollout**: one batched generation call of the transformers backend
  (:class:`agent.backends.hf.TransformersLLM`, the one Sleuth's trainer uses by default): ``--rollout-batch``
  prompts of ``--prompt-len`` random tokens, up to ``--new-tokens`` sampled tokens each at temperature 1 with
  the Search-R1 stop strings (several tokens each here, as with Qwen's tokenizer, so the stop-string check
  runs at every step). A random policy almost never samples a stop, so every row generates the full budget.
  With vLLM importable, the same prompts through :class:`agent.backends.vllm.VLLMBackend` too
  (``--vllm auto``).
* **update**: the masked policy-gradient update on a synthetic batch of ``--update-rows`` episodes of up to
  ``--seq-len`` tokens (a prompt, then policy turns and tool spans; loss mask from the roles), through the
  public functions the trainer uses: :func:`training.batch.micro_batches` (token budget
  ``--micro-tokens``), the old log-probs (no grad), then per micro-batch
  :func:`training.model.forward.policy_logprobs` (the fused masked LM-head kernel of
  :mod:`training.model.kernels` on GPU) and :func:`training.model.kernels.policy_loss` (PPO-clip, token-mean)
  and backward, then gradient clipping and one AdamW step over the trainable parameters (all of them, or
  LoRA's adapters).

Reported per phase: wall time after a warm-up, tokens/s (rollout: generated tokens; update: every real token
the policy ran on, and policy tokens apart), peak memory (``max_memory_allocated`` and ``max_memory_reserved``,
weights included) and whether that peak fits one 80 GB GPU (the H100's 79.6 GiB, less about 0.6 GiB of
CUDA context). An out-of-memory phase is recorded as such and the next one runs. Prints a table and writes
JSON (``--out``) after every phase, so a run that is stopped keeps what it measured.

Usage (GPU): ``python bench/gpu_scale.py [--shapes 0.5b 1.5b 3b] [--no-lora] [--out bench/results/gpu_scale.json]``.
``--cpu-smoke`` runs a tiny shape on the CPU (float32, the PyTorch reference kernels) to check the script.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.backends.hf import TransformersLLM
from agent.llm import SamplingParams
from agent.trajectory import Role
from training.batch import Batch, micro_batches
from training.masking import loss_mask_from_roles
from training.model import kernels as K
from training.model.forward import policy_logprobs

VOCAB = 151_936
# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# tie_word_embeddings, from https://huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}/blob/main/config.json
# (vocab_size 151,936 in all four; rope_theta 1e6, rms_norm_eps 1e-6)
_KEYS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "tie", "vocab")
SHAPES = {
    "0.5b": dict(zip(_KEYS, (896, 4864, 24, 14, 2, True, VOCAB), strict=True)),
    "1.5b": dict(zip(_KEYS, (1536, 8960, 28, 12, 2, True, VOCAB), strict=True)),
    "3b": dict(zip(_KEYS, (2048, 11008, 36, 16, 2, True, VOCAB), strict=True)),
    "7b": dict(zip(_KEYS, (3584, 18944, 28, 28, 4, False, VOCAB), strict=True)),
}
SMOKE_SHAPE = dict(zip(_KEYS, (64, 128, 2, 4, 2, True, 512), strict=True))
FITS_GIB = 79.0  # an 80 GB H100 shows 79.6 GiB; its CUDA context takes about 0.6
STOPS = ("</search>", "</answer>")
GIB = 1024**3


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly ``vocab_size`` ids (``<|endoftext|>`` 0, ``<|pad|>`` 1, ``<unk>`` 2,
    printable ASCII characters, then ``w<i>`` words), so every id a random policy samples decodes, and a stop
    string is several tokens (one per character) as with Qwen's tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|pad|>", "<unk>", *map(chr, range(33, 127))]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   unk_token="<unk>")


def make_policy(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A randomly initialised ``Qwen2ForCausalLM`` of ``shape``, in ``dtype`` on ``device``, with gradient
    checkpointing on (non-reentrant, as the trainer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         tie_word_embeddings=shape["tie"], max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 0, 1
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def synthetic_batch(rows: int, seq_len: int, prompt_len: int, policy_span: int, tool_span: int, vocab: int,
                    seed: int = 0) -> Batch:
    """``rows`` right-padded episodes of 75-100% of ``seq_len`` tokens: a prompt of ``prompt_len`` tokens, then
    policy turns of ``policy_span`` tokens each followed by a tool span of ``tool_span`` tokens, random ids.
    Advantages are +-1 per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(128, vocab, (rows, seq_len), generator=g)
    lens = torch.randint(int(0.75 * seq_len), seq_len + 1, (rows,), generator=g)
    pos = torch.arange(seq_len)
    attn = (pos[None] < lens[:, None]).long()
    period = policy_span + tool_span
    in_turn = (pos - prompt_len) % period
    role = torch.where(pos < prompt_len, int(Role.PROMPT),
                       torch.where(in_turn < policy_span, int(Role.POLICY), int(Role.TOOL)))
    roles = torch.where(attn.bool(), role.expand(rows, seq_len), -1)
    ids = torch.where(attn.bool(), ids, 1)
    turns = torch.where(pos < prompt_len, 0, (pos - prompt_len) // period + 1).expand(rows, seq_len).clone()
    adv = torch.randint(0, 2, (rows,), generator=g).float() * 2 - 1
    loss_mask = loss_mask_from_roles(roles[:, 1:])
    return Batch(input_ids=ids, attention_mask=attn, roles=roles, loss_mask=loss_mask, turn_ids=turns,
                 rewards=(adv > 0).float(), groups=torch.arange(rows) // 8,
                 token_advantages=adv[:, None] * loss_mask)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    alloc, reserved = torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB
    return {"peak_alloc_gib": round(alloc, 2), "peak_reserved_gib": round(reserved, 2),
            "fits_80gb": reserved <= FITS_GIB}


def measure_rollout(model, tok, args, device: torch.device) -> dict:
    """One timed generation call of :class:`agent.backends.hf.TransformersLLM` (after a short warm-up
    call)."""
    llm = TransformersLLM(model, tok)
    model.eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(128, len(tok), (args.rollout_batch, args.prompt_len), generator=g).tolist()
    # warm-up at the timed batch size (kernel selection and allocations for these shapes), a few tokens long
    llm.generate(prompts, SamplingParams(max_new_tokens=4, stop=STOPS, seed=0))
    _reset_peak(device)
    _sync(device)
    t0 = time.perf_counter()
    gens = llm.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, stop=STOPS, seed=0))
    _sync(device)
    dt = time.perf_counter() - t0
    n = sum(len(x.token_ids) for x in gens)
    return {"episodes": len(prompts), "prompt_len": args.prompt_len, "gen_tokens": n, "s": round(dt, 3),
            "gen_tokens_per_s": round(n / dt, 1), **_peak(device)}


def measure_rollout_vllm(model, tok, args) -> dict:
    """The same prompts through :class:`agent.backends.vllm.VLLMBackend` on the policy saved to a temporary
    directory (its memory is the engine's preallocated share, ``gpu_memory_utilization``)."""
    from agent.backends.vllm import VLLMBackend

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tok.save_pretrained(d)
        llm = VLLMBackend(d, dtype="bfloat16", gpu_memory_utilization=args.vllm_memory, enforce_eager=False,
                          max_model_len=args.prompt_len + args.new_tokens + 8)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(128, len(tok), (args.rollout_batch, args.prompt_len), generator=g).tolist()
        llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, stop=STOPS, seed=0))
        t0 = time.perf_counter()
        gens = llm.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, stop=STOPS, seed=0))
        dt = time.perf_counter() - t0
        n = sum(len(x.token_ids) for x in gens)
        del llm
    return {"episodes": len(prompts), "gen_tokens": n, "s": round(dt, 3), "gen_tokens_per_s": round(n / dt, 1),
            "gpu_memory_utilization": args.vllm_memory}


def update_step(model, optimizer, batch: Batch, args, autocast) -> dict:
    """One policy-gradient update (see the module docstring); returns token counts and the loss stats."""
    model.train()
    micro = [batch.select(idx) for idx in micro_batches(batch, args.micro_rows, args.micro_tokens)]
    total = float(batch.loss_mask.sum())
    with torch.no_grad(), autocast():
        old = [policy_logprobs(model, mb, with_entropy=False)[0] for mb in micro]
    optimizer.zero_grad(set_to_none=True)
    stats = {}
    for mb, old_lp in zip(micro, old, strict=True):
        with autocast():
            lp, ent = policy_logprobs(model, mb)
        mask = mb.loss_mask.to(lp.device)
        adv = mb.token_advantages.to(lp.device)
        loss, stats = K.policy_loss(lp, old_lp, adv, mask, entropy=ent)
        (loss * (float(mask.sum()) / total)).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return {"micro_batches": len(micro), "pg_loss": round(stats.get("pg_loss", float("nan")), 4)}


def measure_update(model, args, device: torch.device, vocab: int) -> dict:
    """A warm-up update (allocates the optimizer state), then ``--update-repeats`` timed ones."""
    batch = synthetic_batch(args.update_rows, args.seq_len, args.prompt_len, args.policy_span, args.tool_span,
                            vocab)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    try:
        _reset_peak(device)
        update_step(model, optimizer, batch, args, autocast)
        _sync(device)
        times = []
        for _ in range(args.update_repeats):
            t0 = time.perf_counter()
            info = update_step(model, optimizer, batch, args, autocast)
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
    dt = min(times)
    tokens, policy = int(batch.attention_mask.sum()), int(batch.loss_mask.sum())
    return {"rows": len(batch), "tokens": tokens, "policy_tokens": policy,
            "trainable_params": sum(p.numel() for p in params),
            "s": round(dt, 3), "tokens_per_s": round(tokens / dt, 1), "policy_tokens_per_s": round(policy / dt, 1),
            **info, **_peak(device)}


def _phase(fn, *a) -> dict:
    """``fn(*a)``, or ``{"oom": True, ...}`` when the GPU runs out of memory (the memory is freed again), or
    ``{"error": ...}`` (traceback on stderr) when it fails otherwise, so that the next phase still runs."""
    try:
        return fn(*a)
    except torch.cuda.OutOfMemoryError as e:
        gc.collect()
        torch.cuda.empty_cache()
        return {"oom": True, "error": str(e).splitlines()[0][:200]}
    except Exception as e:  # noqa: BLE001 - a benchmark records the failure and goes on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def run_shape(name: str, shape: dict, args, device: torch.device, dtype: torch.dtype, save) -> dict:
    """Every phase of one shape; ``save(res)`` after each."""
    res: dict = {"shape": shape}
    tok = make_tokenizer(shape["vocab"])
    try:
        model = make_policy(shape, dtype, device)
    except torch.cuda.OutOfMemoryError as e:
        return res | {"oom": True, "error": str(e).splitlines()[0][:200]}
    res["params"] = sum(p.numel() for p in model.parameters())
    res["weights_gib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, 2)
    res["rollout"] = _phase(measure_rollout, model, tok, args, device)
    save(res)
    res["update"] = _phase(measure_update, model, args, device, shape["vocab"])
    save(res)
    if args.vllm == "auto" and device.type == "cuda":
        from agent.backends.vllm import vllm_available

        res["rollout_vllm"] = _phase(measure_rollout_vllm, model, tok, args) if vllm_available() else "not importable"
        save(res)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model.zero_grad(set_to_none=True)
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                 task_type="CAUSAL_LM"))
        res["rollout_lora"] = _phase(measure_rollout, model, tok, args, device)
        save(res)
        res["update_lora"] = _phase(measure_update, model, args, device, shape["vocab"])
        save(res)
    del model
    _reset_peak(device)
    return res


def _cell(r, key: str, fmt: str = "{:.0f}") -> str:
    if not isinstance(r, dict):
        return "-"
    if r.get("oom"):
        return "OOM"
    if "error" in r:
        return "error"
    return fmt.format(r[key]) if key in r else "-"


def print_table(out: dict) -> None:
    print(f"\n{out['date']}, {out['gpu']}, torch {out['torch']}, transformers {out['transformers']}, "
          f"kernels {out['kernels']}")
    print("| shape | params | phase | LoRA | tokens/s | s | peak alloc GiB | peak reserved GiB | fits 80 GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, res in out["shapes"].items():
        for phase, label, lora in [("rollout", "rollout (transformers)", "no"),
                                   ("rollout_vllm", "rollout (vLLM)", "no"), ("update", "update", "no"),
                                   ("rollout_lora", "rollout (transformers)", "yes"), ("update_lora", "update", "yes")]:
            r = res.get(phase)
            if r is None or (isinstance(r, str)):
                continue
            tps = _cell(r, "gen_tokens_per_s" if phase.startswith("rollout") else "tokens_per_s")
            fits = "-" if "fits_80gb" not in r else ("yes" if r["fits_80gb"] else "no")
            secs = _cell(r, "s", "{:.2f}")
            print(f"| {name} | {res.get('params', 0) / 1e9:.2f}B | {label} | {lora} | {tps} | {secs} "
                  f"| {_cell(r, 'peak_alloc_gib', '{:.2f}')} | {_cell(r, 'peak_reserved_gib', '{:.2f}')} | {fits} |")
    for k in ("largest_full_fits_80gb", "largest_lora_fits_80gb"):
        if k in out:
            print(f"{k}: {out[k]}")


def largest_fitting(shapes: dict, phase: str) -> str | None:
    """The largest shape whose ``phase`` and rollout both ran within :data:`FITS_GIB`."""
    ok = [n for n, r in shapes.items()
          if all(isinstance(r.get(p), dict) and r[p].get("fits_80gb") for p in (phase, "rollout"))]
    return max(ok, key=lambda n: shapes[n].get("params", 0)) if ok else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "3b"], choices=sorted(SHAPES))
    p.add_argument("--rollout-batch", type=int, default=128, help="episodes generated in one call")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (rollout) / prompt part (update)")
    p.add_argument("--new-tokens", type=int, default=256, help="sampled tokens per episode in the rollout call")
    p.add_argument("--update-rows", type=int, default=32, help="episodes in the update batch")
    p.add_argument("--seq-len", type=int, default=2048, help="longest episode in the update batch (tokens)")
    p.add_argument("--policy-span", type=int, default=160, help="tokens per policy turn in the update batch")
    p.add_argument("--tool-span", type=int, default=240, help="tokens per tool span (retrieved documents)")
    p.add_argument("--micro-tokens", type=int, default=16384, help="padded tokens per micro-batch")
    p.add_argument("--micro-rows", type=int, default=64, help="episodes per micro-batch at most")
    p.add_argument("--update-repeats", type=int, default=1, help="timed updates after the warm-up (best kept)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--no-lora", dest="lora", action="store_false", help="skip the LoRA phases")
    p.add_argument("--vllm", choices=["auto", "off"], default="auto", help="also time vLLM when importable")
    p.add_argument("--vllm-memory", type=float, default=0.5, help="vLLM's gpu_memory_utilization")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_scale.json; none with "
                                               "--cpu-smoke)")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU, to check the script")
    args = p.parse_args(argv)
    for k in ("rollout_batch", "prompt_len", "new_tokens", "update_rows", "seq_len", "policy_span", "tool_span",
              "micro_tokens", "micro_rows", "update_repeats", "lora_rank"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.prompt_len >= args.seq_len:
        p.error("--prompt-len must be shorter than --seq-len")
    if not 0 < args.vllm_memory < 1:
        p.error("--vllm-memory must lie in (0, 1)")
    if args.cpu_smoke:
        args.shapes = ["tiny"]
        args.rollout_batch, args.prompt_len, args.new_tokens = min(args.rollout_batch, 4), 16, 8
        args.update_rows, args.seq_len, args.policy_span, args.tool_span = 4, 96, 12, 20
        args.micro_tokens, args.vllm = 256, "off"
    elif args.out is None:
        args.out = str(Path(__file__).resolve().parent / "results" / "gpu_scale.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("bench/gpu_scale.py needs a CUDA device (or --cpu-smoke)")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    import transformers

    out = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()})",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "kernels": ("cuda" if device.type == "cuda" and K.available() else "reference"),
           "argv": sys.argv[1:] if argv is None else list(argv),
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "shapes": {}}

    def save(res: dict | None = None, name: str | None = None) -> None:
        if name is not None:
            out["shapes"][name] = res
        for k, phase in (("largest_full_fits_80gb", "update"), ("largest_lora_fits_80gb", "update_lora")):
            if device.type == "cuda":
                out[k] = largest_fitting(out["shapes"], phase)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    for name in args.shapes:
        shape = SMOKE_SHAPE if name == "tiny" else SHAPES[name]
        t0 = time.perf_counter()
        res = run_shape(name, shape, args, device, dtype, lambda r, n=name: save(r, n))
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        save(res, name)
        print(f"{name}: {json.dumps(res)}", flush=True)
    print_table(out)
    return out


if __name__ == "__main__":
    main()
