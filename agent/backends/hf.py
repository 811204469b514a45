"""The transformers backend: batched sampling across episodes with stop strings.

Loads any Hugging Face causal LM (a local directory or a hub id; offline here) and implements
:class:`agent.llm.LLM`. Prompts arrive as token ids and are left-padded into one batch; a turn ends at the
first stop string (``</search>``, ``</answer>``) or EOS, and the returned ids are exactly the sampled prefix
(no re-tokenisation). Stop strings that are single tokens in the vocabulary (as in the tiny policy) are
passed as extra EOS ids; others are matched by :class:`StopOnNewText` on the *generated* text only
(transformers' own ``stop_strings`` also match text that straddles the prompt, which would end a turn
before the action is written). Each sampled token comes with its log-probability under the distribution it
was drawn from (:class:`SampledLogprobs`), as vLLM's ``processed_logprobs`` reports it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from agent.llm import Generation, SamplingParams, encode, end_of_turn_ids, truncate_at_stop


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype_keyword() -> str:
    """``from_pretrained``'s name for the weights' dtype: ``dtype`` where the installed transformers has it
    (4.56 on), else ``torch_dtype`` (4.51-4.55 hand an unknown ``dtype`` on to the model's constructor, which
    raises ``TypeError``)."""
    from transformers import PretrainedConfig

    return "dtype" if hasattr(PretrainedConfig(), "dtype") else "torch_dtype"


def load_model_and_tokenizer(path: str, dtype: str = "float32", device: str = "auto") -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer with transformers (left padding for batched generation).

    Raises ``FileNotFoundError`` with a hint when ``path`` is neither a local directory nor in the offline
    cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, **{_dtype_keyword(): getattr(torch, dtype)})
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        raise FileNotFoundError(
            f"cannot load model {path!r}: {e.__class__.__name__}. Give a local model directory (e.g. a Sleuth "
            "checkpoint under runs/) or a hub id that is already in the local cache"
            + (" (hub downloads are off: HF_HUB_OFFLINE=1, the sleuth CLI's default; run with HF_HUB_OFFLINE=0 "
               "to download it)." if offline else ".")
        ) from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(resolve_device(device)).eval()
    return model, tok


@torch.no_grad()
def sequence_logprobs(model: Any, ids: list[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for ``i = 1 .. len(ids)-1`` under ``model`` (a Hugging Face causal LM, a peft
    wrapper with its adapters active included) at temperature 1, in its own dtype, in eval mode (restored
    after). Returns ``len(ids) - 1`` floats (natural log)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1).tolist()


class SampledLogprobs:
    """A logits processor placed last in the chain: it keeps the log-softmax of the step's processed scores
    (``[B, V]`` float32, one step at a time) and, at the next step, reads off the log-probability of the token
    that step sampled (the last column of ``input_ids``); :meth:`finish` reads the last step's from the
    returned sequences. ``steps`` is then a list of ``[B]`` float32 tensors, one per generated position."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor, width: int) -> list[list[float]]:
        """Per row, the log-probabilities of the tokens generated after the first ``width`` columns of
        ``sequences`` (``[B, width + n]`` int64), as lists of floats of length ``n``."""
        n = sequences.shape[1] - width
        if self.last is not None and len(self.steps) < n:
            self.steps.append(self.last.gather(1, sequences[:, width + len(self.steps)][:, None]).squeeze(1))
            self.last = None
        if not n:
            return [[] for _ in range(sequences.shape[0])]
        return torch.stack(self.steps[:n], dim=1).cpu().tolist()


def sampling_processors(params: SamplingParams) -> list[Any]:
    """Transformers' own temperature, top-k and top-p warpers for ``params``, in the order ``generate`` applies
    them (none when greedy); passed explicitly so that :class:`SampledLogprobs` can follow them."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if params.temperature <= 0:
        return []
    out: list[Any] = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        out.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return out


class StopOnNewText:
    """A per-row ``StoppingCriteria``: a row is done once one of ``stops`` occurs in the text it generated
    (tokens from position ``start`` on). Only the last ``window`` tokens are decoded at each step, where
    ``window`` bounds the tokens a stop string can span (a token is at least one character)."""

    def __init__(self, tokenizer: Any, stops: list[str], start: int):
        self.tokenizer, self.stops, self.start = tokenizer, stops, start
        self.window = max(len(s) for s in stops) + 1

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        new = input_ids[:, self.start:]
        texts = self.tokenizer.batch_decode(new[:, -self.window:], skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], dtype=torch.bool,
                            device=input_ids.device)


# Every logits processor a model's generation_config may switch on, switched off: transformers applies the
# model's defaults (Qwen2.5-Instruct: repetition_penalty 1.05; others: no_repeat_ngram_size, min_new_tokens,
# suppress_tokens, ...) to whatever a call leaves unset, so the tokens would be drawn from a distribution the
# trainer's log-probs (logits / T, top-p/top-k as given) do not describe. vLLM ignores them too.
_PLAIN_SAMPLING: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "min_length": 0,
    "min_new_tokens": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None,
    "top_h": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": None,
    "watermarking_config": None, "num_beams": 1, "penalty_alpha": None,
}


@functools.cache
def _plain_sampling() -> dict[str, Any]:
    """:data:`_PLAIN_SAMPLING` less the knobs this transformers version does not have (``top_h`` is new in 5.x;
    generate() rejects keyword arguments it does not know)."""
    from transformers import GenerationConfig

    known = GenerationConfig().to_dict()
    return {k: v for k, v in _PLAIN_SAMPLING.items() if k in known}


class TransformersLLM:
    """:class:`agent.llm.LLM` over a transformers model (CPU or GPU).

    ``model`` may be replaced in place by the trainer (same object, new weights): generation always uses the
    current parameters, so on-policy rollouts need no weight sync.
    """

    def __init__(self, model: Any, tokenizer: Any):
        self.model = model
        self.tokenizer = tokenizer
        gen_cfg = getattr(model, "generation_config", None)
        self.eos_ids: set[int] = end_of_turn_ids(tokenizer, getattr(gen_cfg, "eos_token_id", None))

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", device: str = "auto") -> TransformersLLM:
        return cls(*load_model_and_tokenizer(path, dtype, device))

    def _stop_ids(self, stop: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ids, strings = [], []
        for s in stop:
            enc = encode(self.tokenizer, s)
            if len(enc) == 1:
                ids.append(enc[0])
            else:
                strings.append(s)
        return ids, strings

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """:func:`sequence_logprobs` of ``ids`` under this backend's model: what the trainer compares with its
        own after a weight push (:mod:`training.rollout.weight_sync`)."""
        return sequence_logprobs(self.model, ids)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt (see :class:`agent.llm.LLM`); ``logprobs`` are the sampled
        tokens' log-probabilities (natural log) under ``softmax(logits / temperature)`` restricted to
        top-k/top-p, the plain softmax when greedy (:class:`SampledLogprobs`)."""
        if not prompts:
            return []
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id  # masked out; a tokenizer without one (Llama 3) pads with an end id
        if pad is None:
            pad = min(self.eos_ids) if self.eos_ids else 0
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        stop_ids, stop_strings = self._stop_ids(params.stop)
        eos = sorted(self.eos_ids | set(stop_ids))
        kw: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "return_dict_in_generate": False,
            **_plain_sampling(),
        }
        from transformers import LogitsProcessorList

        # the warpers are passed here (the built-in ones off) so that the recorder sees what is sampled from
        recorder = SampledLogprobs()
        kw["logits_processor"] = LogitsProcessorList([*sampling_processors(params), recorder])
        if params.temperature > 0:
            kw.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if stop_strings:
            from transformers import StoppingCriteriaList

            kw.update(stopping_criteria=StoppingCriteriaList([StopOnNewText(self.tokenizer, stop_strings, width)]))
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), **kw)
        new = out[:, width:].tolist()
        lps = recorder.finish(out, width)
        gens = []
        for row, lp in zip(new, lps, strict=True):
            # EOS is kept in the ids (the policy produced it) but not in the text; padding after it is dropped
            ids, text, reason = truncate_at_stop(self.tokenizer, row, params.stop, self.eos_ids)
            gens.append(Generation(token_ids=ids, text=text, finish_reason=reason, logprobs=lp[: len(ids)]))
        return gens
