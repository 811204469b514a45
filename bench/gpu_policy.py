"""The GPU check's policy: a randomly initialised Qwen2.5-shaped model that searches (nothing is downloaded).

A random policy samples nearly uniformly from its vocabulary, so on its own it never writes
``<search> ... </search>``: its episodes would be invalid actions only, and the retrieval server would never
be asked. This one is bench/gpu_scale.py's random ``Qwen2ForCausalLM`` (the shapes of Qwen2.5-0.5B ...,
from their ``config.json``) with two changes, so that its rollouts have the shape of Search-R1's -- policy
turns, searches through the retriever, ``<information>`` blocks of tool tokens -- while every other token
stays nearly uniform:

* the tokenizer (:func:`make_tokenizer`) reads text character by character (every text encodes, a passage
  is about one token per character, as bench/gpu_scale.py's) but its vocabulary holds the Search-R1 tags as
  single tokens and then the sample corpus's most frequent words, so a sampled query has words BM25 finds;
* :func:`make_policy` sets the last layer's value-projection bias so that its attention adds one constant
  vector, :data:`DOMINANCE` times the residual stream's norm, at every position (attention weights sum to
  1): every final hidden state then points the same way, whatever the context. It adds to the tags' LM-head
  rows the multiple of that direction that raises each tag's probability to :data:`TAG_RATES` (measured by a
  forward pass, so it holds at every shape). The other tokens' logits get a fixed random offset (of the
  order of 0.5), so the rest of the distribution stays near uniform. A turn then opens and closes a search
  about one time in four.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_scale

#: per-token probability of each protocol tag under the policy (the rest of the mass: near uniform)
TAG_RATES = {"<search>": 1 / 32, "</search>": 1 / 32, "<answer>": 1 / 1000, "</answer>": 1 / 1000}
#: the rates of the tiny CPU check, whose turns are a few tokens long: most turns hold a tag
TINY_TAG_RATES = {"<search>": 0.2, "</search>": 0.2, "<answer>": 0.01, "</answer>": 0.01}
SPECIALS = ("<|endoftext|>", "<|pad|>", "<unk>")
DOMINANCE = 50.0  # the constant direction's norm over the residual stream's (so every final state points alike)


def corpus_words(limit: int) -> list[str]:
    """The ``limit`` most frequent words (letters and digits) of the shipped sample's corpus, most frequent
    first (ties alphabetically)."""
    from corpora import sample_paths

    counts: Counter[str] = Counter()
    with open(sample_paths()["corpus"], encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            counts.update(re.findall(r"[A-Za-z0-9]+", f"{row.get('title', '')} {row.get('contents', row.get('text', ''))}"))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]


def make_tokenizer(vocab_size: int):
    """A character-level tokenizer of exactly ``vocab_size`` ids: ``<|endoftext|>`` 0, ``<|pad|>`` 1, ``<unk>``
    2, the tags of :data:`TAG_RATES` (matched whole, before the split into characters), the printable ASCII
    characters, then corpus words and ``w<i>`` fillers, which only decoding produces. Raises ``ValueError``
    for a vocabulary too small for the specials, tags and characters."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = [*SPECIALS, *TAG_RATES, *map(chr, range(33, 127))]
    if vocab_size < len(base) + 1:
        raise ValueError(f"vocab_size {vocab_size} < {len(base) + 1}")
    seen = set(base)
    words = [w for w in corpus_words(vocab_size) if w not in seen][: vocab_size - len(base)]
    words += [f"w{i}" for i in range(vocab_size - len(base) - len(words))]
    vocab = {w: i for i, w in enumerate(base + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    tok.add_tokens([AddedToken(t, normalized=False) for t in TAG_RATES])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   unk_token="<unk>")


def _residual_norm(model, ids: torch.Tensor) -> float:
    """Mean norm of the residual stream entering the final norm (the part a constant has to dominate)."""
    seen = []
    hook = model.model.norm.register_forward_pre_hook(lambda mod, args: seen.append(args[0].norm(dim=-1).mean()))
    try:
        model.model(input_ids=ids)
    finally:
        hook.remove()
    return float(seen[0])


def make_policy(shape: dict, tok, dtype: torch.dtype, device: torch.device, seed: int = 0,
                rates: dict[str, float] | None = None):
    """bench/gpu_scale.py's random policy of ``shape`` with the last layer's constant direction and the tag
    boosts to ``rates`` (default :data:`TAG_RATES`; see the module docstring), in ``dtype`` on ``device``,
    eval mode, no gradient checkpointing (the trainer turns it on when its config says so)."""
    model = gpu_scale.make_policy(shape, torch.float32, device, seed=seed)
    model.gradient_checkpointing_disable()
    head = model.get_output_embeddings().weight
    V = head.shape[0]
    g = torch.Generator().manual_seed(seed)
    probe = torch.randint(len(SPECIALS), V, (4, 64), generator=g).to(device)
    with torch.no_grad():
        # attention weights sum to 1, so the last layer's v bias reaches every position as W_o expand(b_v)
        attn = model.model.layers[-1].self_attn
        b = torch.randn(attn.v_proj.out_features, generator=g).to(device)
        group = attn.o_proj.in_features // attn.v_proj.out_features  # query heads per key/value head
        hd = attn.o_proj.in_features // (attn.v_proj.out_features // model.config.head_dim * group) \
            if hasattr(model.config, "head_dim") and model.config.head_dim else None
        hd = hd or model.config.hidden_size // model.config.num_attention_heads
        u = attn.o_proj.weight @ b.view(-1, hd).repeat_interleave(group, 0).reshape(-1)
        attn.v_proj.bias += b * (DOMINANCE * _residual_norm(model, probe) / float(u.norm()))
        mean = model.model(input_ids=probe).last_hidden_state.reshape(-1, head.shape[1]).mean(0)
        for tag, rate in (rates or TAG_RATES).items():
            j = tok.convert_tokens_to_ids(tag)
            boost = math.log(rate * (V - 1) / (1 - rate))  # logit over the (near-equal) others for this rate
            head[j] += (boost / float(mean @ mean)) * mean
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 0, 1
    return model.to(dtype).eval()


@torch.no_grad()
def tag_rates(model, n: int = 256, seed: int = 1) -> dict[str, float]:
    """The mean next-token probability of each tag over ``n`` random positions (to check the boosts)."""
    V = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIALS), V, (max(1, n // 64), 64), generator=g).to(next(model.parameters()).device)
    probs = torch.softmax(model(input_ids=ids).logits.float(), -1).reshape(-1, V)
    return {t: float(probs[:, len(SPECIALS) + i].mean()) for i, t in enumerate(TAG_RATES)}
