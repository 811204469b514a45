"""The transformers backend in a worker process, on weights the trainer updates in place.

Asynchronous training generates the next step's rollouts while the trainer updates the policy. In one
Python process the two compete for the interpreter lock (a tiny policy's generation and update are mostly
Python; on a 2-core CPU, overlapping them in threads took as long as running them one after the other), so
:class:`ProcessLLM` runs :class:`agent.backends.hf.TransformersLLM` in a spawned process of its own, on a copy
of the model whose tensors live in shared memory (``torch.multiprocessing``; on a GPU, CUDA IPC): the worker
reads them, the trainer writes them (:meth:`ProcessLLM.update_weights`, between generate calls), so a push
costs one in-place copy and no serialisation. It implements :class:`agent.llm.LLM` plus ``update_weights`` and
``probe_logprobs``, the interface vLLM's backend offers the trainer (:mod:`agent.backends.vllm`).

Scripts that construct one need the ``if __name__ == "__main__":`` guard (the worker is spawned).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable
from typing import Any

import torch

from agent.llm import BackendUnavailable, Generation, SamplingParams


def _serve(conn: Any, model: Any, tokenizer: Any, threads: int, seed: int) -> None:
    """The worker: answer ``("generate", (prompts, params))`` and ``("probe", ids)`` requests on ``conn``
    with ``("ok", result)`` or ``("error", exception)``, until ``None`` arrives or the pipe closes."""
    from agent.backends.hf import TransformersLLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    llm = TransformersLLM(model, tokenizer)
    conn.send(("ok", "ready"))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, payload = msg
        try:
            out = llm.generate(*payload) if kind == "generate" else llm.probe_logprobs(payload)
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            try:
                conn.send(("error", e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))


class ProcessLLM:
    """:class:`agent.llm.LLM` over a transformers causal LM served by a spawned worker process.

    Args:
        model: a plain Hugging Face causal LM (no peft wrapper: a LoRA policy's merged weights); it is copied,
            the copy (:attr:`shared_model`) moved to shared memory and handed to the worker.
        tokenizer: its tokenizer (pickled to the worker).
        threads: torch threads of the worker (``torch.set_num_threads``).
        seed: the worker's torch seed (its sampling stream).

    Calls from several threads run one at a time. ``weight_version`` counts the updates; each
    :class:`~agent.llm.Generation` carries the version it was generated with in ``meta["weight_version"]``.
    Raises :class:`agent.llm.BackendUnavailable` once the worker is gone (closed or died).
    """

    def __init__(self, model: Any, tokenizer: Any, threads: int = 1, seed: int = 0):
        import torch.multiprocessing as mp

        self.tokenizer = tokenizer
        self.shared_model = copy.deepcopy(model).eval()
        for p in self.shared_model.parameters():
            p.requires_grad_(False)
        self.shared_model.share_memory()
        self.weight_version = 0
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.shared_model, tokenizer, threads, seed),
                                 daemon=True, name="sleuth-rollout")
        self._proc.start()
        child.close()
        with self._lock:
            self._recv()  # the worker is up (or its start failed: raised here)

    def _recv(self) -> Any:
        try:
            status, out = self._conn.recv()
        except (EOFError, OSError) as e:
            raise BackendUnavailable(f"the rollout worker process is gone (exit code {self._proc.exitcode})") from e
        if status == "error":
            raise out
        return out

    def _call(self, kind: str, payload: Any) -> Any:
        with self._lock:
            if self._conn.closed:
                raise BackendUnavailable("this ProcessLLM is closed")
            try:
                self._conn.send((kind, payload))
            except (BrokenPipeError, OSError) as e:
                raise BackendUnavailable(f"the rollout worker process is gone (exit code {self._proc.exitcode})") from e
            return self._recv(), self.weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One continuation per prompt, sampled by the worker (see
        :meth:`agent.backends.hf.TransformersLLM.generate`; its log-probs are the behaviour policy's)."""
        if not prompts:
            return []
        gens, version = self._call("generate", (prompts, params))
        for g in gens:
            g.meta["weight_version"] = version
        return gens

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The worker's ``log p(ids[i] | ids[:i])`` for ``i >= 1`` at temperature 1 (the weight-sync check's probe,
        :mod:`training.rollout.weight_sync`)."""
        return self._call("probe", list(ids))[0]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights (Hugging Face names, e.g. ``model.state_dict().items()``) into the shared copy,
        between two requests of the worker. Raises ``ValueError``, before anything is copied, for a name the
        model does not have or when a weight of the model is left out (it would keep its old value)."""
        own = self.shared_model.state_dict()
        new = dict(named_tensors)
        unknown, missing = sorted(new.keys() - own.keys()), sorted(own.keys() - new.keys())
        if unknown or missing:
            raise ValueError(f"the weight update does not match the rollout model: unknown {unknown[:3]}, "
                             f"missing {missing[:3]} (push the full state dict, a LoRA policy's merged)")
        with self._lock, torch.no_grad():
            for k, v in new.items():
                own[k].copy_(v)
            if any(t.is_cuda for t in own.values()):
                torch.cuda.synchronize()  # the worker must not read a copy still in flight
            self.weight_version += 1

    def close(self) -> None:
        """Stop the worker (idempotent; waits for a running request)."""
        with self._lock:
            if self._conn.closed:
                return
            with contextlib.suppress(Exception):
                self._conn.send(None)
            self._conn.close()
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.terminate()

    def __del__(self) -> None:  # no imports here: at interpreter shutdown they fail
        with contextlib.suppress(Exception):
            self.close()
