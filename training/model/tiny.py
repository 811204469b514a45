"""The default policy: a reproducible tiny Qwen2-architecture model with a BPE tokenizer trained locally.

No pretrained LLM can be downloaded on the machines Sleuth is developed on, so the quickstart builds one:
a byte-level BPE tokenizer trained on the corpus and questions with the ``tokenizers`` library (the
protocol tags are single special tokens) and a small ``Qwen2ForCausalLM`` initialised from a seed. Any
Hugging Face causal-LM path (e.g. ``Qwen/Qwen2.5-3B-Instruct`` on a GPU) replaces it by config
(``policy.model``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from agent.protocols.search_r1 import SPECIAL_TAGS

TAGS = list(SPECIAL_TAGS)  # the protocol tags, each a single special token
EOS, PAD = "<|endoftext|>", "<|pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Any:
    """Train a byte-level BPE tokenizer; returns a ``transformers.PreTrainedTokenizerFast``.

    The protocol tags and ``<|endoftext|>`` / ``<|pad|>`` are special tokens, so each tag is one token id
    (which lets the span-mask kernel find tool spans by marker id).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD, *TAGS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=TAGS)
    fast.padding_side = "left"
    return fast


def build_tiny_policy(tokenizer: Any, cfg: Any, seed: int = 0) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` sized by ``cfg`` (a :class:`sleuth.config.TinyPolicyConfig`)
    with tied embeddings. Deterministic given ``seed``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def tokenizer_corpus(passages: Iterable[Any], questions: Iterable[Any], max_passages: int) -> Iterable[str]:
    """Texts to train the tokenizer on: passage contents, questions and their answers."""
    for p in itertools.islice(passages, max_passages):
        yield p.contents
    for q in questions:
        yield q.question
        yield from q.golden_answers


def create_tiny_policy(out_dir: str | Path, passages: Iterable[Any], questions: list[Any], cfg: Any, seed: int = 0,
                       extra_texts: Iterable[str] = ()) -> Path:
    """Train the tokenizer (on the corpus, the questions and ``extra_texts``, e.g. an external agent's
    conversations, so that their frames take few tokens), build the tiny model and save both
    (``save_pretrained``) to ``out_dir``."""
    out_dir = Path(out_dir)
    texts = itertools.chain(tokenizer_corpus(passages, questions, cfg.tokenizer_texts), extra_texts)
    tok = train_tokenizer(texts, cfg.vocab_size)
    model = build_tiny_policy(tok, cfg, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
