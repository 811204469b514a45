"""The transformers backend: stop strings end a turn exactly, batching does not change greedy outputs.

A freshly initialised tiny model is close to an identity map on its last token (the residual stream is
dominated by the input embedding and the LM head is tied), so greedy decoding repeats the prompt's last
token: that makes stop-string behaviour checkable without a trained model.
"""

from __future__ import annotations

from agent.llm import SamplingParams, decode, encode, truncate_at_stop


def test_single_token_stop_string_ends_the_turn(tiny_llm):
    tok = tiny_llm.tokenizer
    prompt = encode(tok, "Question: capital?\n<answer>")
    free = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    # the model repeats "<answer>"; make "<answer>" a stop string: the turn ends right after it
    g = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=("<answer>",)))[0]
    assert g.finish_reason == "stop" and g.token_ids == free.token_ids[:1] and g.text == "<answer>"


def test_multi_token_stop_string_cuts_at_the_exact_prefix(tiny_llm):
    tok = tiny_llm.tokenizer
    prompt = encode(tok, "Question: capital?\n<answer>")
    free = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))[0]
    stop = decode(tok, free.token_ids[:3])  # three tokens of text
    assert len(encode(tok, stop)) > 1
    g = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=(stop,)))[0]
    assert g.finish_reason == "stop" and g.token_ids == free.token_ids[:3] and g.text.endswith(stop)


def test_a_tokenizer_without_a_pad_token_still_batches(tiny_llm):
    """TransformersLLM(model, tokenizer) with a tokenizer that has no pad token (Llama 3, Mistral as loaded by
    AutoTokenizer) failed every batch in torch.full(..., None); the padding is masked, so any id pads it."""
    from agent.backends.hf import TransformersLLM

    tok = tiny_llm.tokenizer
    prompts = [encode(tok, "Question: What is the capital of France?\n"), encode(tok, "Paris")]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=("</search>", "</answer>"))
    want = tiny_llm.generate(prompts, params)
    tok.pad_token = None
    assert tok.pad_token_id is None
    got = TransformersLLM(tiny_llm.model, tok).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_batched_greedy_equals_one_by_one(tiny_llm):
    tok = tiny_llm.tokenizer
    prompts = [encode(tok, t) for t in ["Question: What is the capital of France?\n", "Paris", "Question: Who?\n<search>"]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop=("</search>", "</answer>"))
    batched = tiny_llm.generate(prompts, params)
    for p, b in zip(prompts, batched, strict=True):
        (one,) = tiny_llm.generate([p], params)
        assert one.token_ids == b.token_ids and one.finish_reason == b.finish_reason


def test_eos_is_kept_in_ids_but_not_in_text(tiny_llm):
    tok = tiny_llm.tokenizer
    ids = encode(tok, "<answer> Paris </answer>") + [tok.eos_token_id, tok.pad_token_id, tok.pad_token_id]
    kept, text, reason = truncate_at_stop(tok, ids, (), {tok.eos_token_id})
    assert kept == ids[:-2] and text == "<answer> Paris </answer>" and reason == "stop"


def test_generation_config_end_tokens_end_the_turn(tiny_llm):
    """The model's generation config may list more end tokens than the tokenizer's EOS (Qwen2.5-Instruct:
    ``<|im_end|>`` and ``<|endoftext|>``): the backend stops at each, and the loop sees the turn end there."""
    from agent.backends.hf import TransformersLLM
    from agent.loop.nodes import make_context
    from sleuth.config import AgentConfig

    tok = tiny_llm.tokenizer
    prompt = encode(tok, "Question: capital?\n<answer>")
    free = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))[0]
    assert free.token_ids[0] != tok.eos_token_id
    cfg = tiny_llm.model.generation_config
    old = cfg.eos_token_id
    cfg.eos_token_id = [tok.eos_token_id, free.token_ids[0]]
    try:
        llm = TransformersLLM(tiny_llm.model, tok)
        g = llm.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))[0]
    finally:
        cfg.eos_token_id = old
    assert g.finish_reason == "stop" and g.token_ids == free.token_ids[:1]
    assert make_context(llm, None, AgentConfig()).eos_ids == {tok.eos_token_id, free.token_ids[0]}


def test_end_of_turn_ids_reads_a_model_directory(tiny_llm, tmp_path):
    import json

    from agent.llm import end_of_turn_ids

    tok = tiny_llm.tokenizer
    assert end_of_turn_ids(tok, tmp_path) == {tok.eos_token_id}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert end_of_turn_ids(tok, tmp_path) == {tok.eos_token_id, 5, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert end_of_turn_ids(tok, str(tmp_path)) == {tok.eos_token_id, 9}
    (tmp_path / "generation_config.json").write_text("{broken")
    assert end_of_turn_ids(tok, tmp_path) == {tok.eos_token_id}


def test_end_of_turn_ids_reads_a_cached_hub_model(tiny_llm, tmp_path, monkeypatch):
    """vLLM and the OpenAI backend give a hub id (``Qwen/Qwen2.5-7B-Instruct``) where the model is in the
    local cache: its generation config's end tokens are read from the cache, as transformers and vLLM do."""
    import json

    from huggingface_hub import constants

    from agent.llm import end_of_turn_ids

    snap = tmp_path / "models--org--chat-model" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "models--org--chat-model" / "refs").mkdir()
    (tmp_path / "models--org--chat-model" / "refs" / "main").write_text("abc123")
    (snap / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    tok = tiny_llm.tokenizer
    assert end_of_turn_ids(tok, "org/chat-model") == {tok.eos_token_id, 5, 7}
    assert end_of_turn_ids(tok, "org/not-cached") == {tok.eos_token_id}
    assert end_of_turn_ids(tok, "not a/valid//repo id") == {tok.eos_token_id}


def test_the_model_generation_config_does_not_change_what_is_sampled(tiny_llm):
    """transformers applies a model's generation_config to whatever a call leaves unset: Qwen2.5-Instruct's
    repetition_penalty 1.05, or another model's no_repeat_ngram_size / min_new_tokens / suppress_tokens, then
    change the distribution the tokens come from, which the trainer's log-probs (logits / T) do not describe.
    Greedy decoding must be the argmax of the model's own logits whatever the generation config says."""
    import torch

    from agent.backends.hf import TransformersLLM

    tok, model = tiny_llm.tokenizer, tiny_llm.model
    prompt = encode(tok, "Question: capital?\n")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop=())
    ids = list(prompt)
    with torch.no_grad():  # plain greedy decoding, by hand
        for _ in range(8):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
    want = ids[len(prompt):]
    cfg, saved = model.generation_config, model.generation_config.to_dict()
    cfg.repetition_penalty, cfg.no_repeat_ngram_size, cfg.min_new_tokens = 50.0, 1, 8
    cfg.suppress_tokens = [want[0]]
    try:
        got = TransformersLLM(model, tok).generate([prompt], params)[0]
    finally:
        for k in ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "suppress_tokens"):
            setattr(cfg, k, saved.get(k))
    assert got.token_ids == want


def test_a_model_that_cannot_be_loaded_says_how_to_allow_downloads(monkeypatch):
    """The CLI sets HF_HUB_OFFLINE=1 unless the user set it, so `policy.model=Qwen/Qwen2.5-3B-Instruct` (the
    README's example) fails on a machine with internet when the model is not cached; the error said only
    'OSError' and 'HF_HUB_OFFLINE=1' and never how to let it download."""
    import pytest

    from agent.backends.hf import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=0"):
        load_model_and_tokenizer("no-such-org/no-such-model-xyz")


def test_plain_sampling_passes_only_knobs_this_transformers_has(tiny_llm, monkeypatch):
    """generate() rejects keyword arguments it does not know, and the knobs switched off differ between
    transformers versions (top_h is new in 5.x): one unknown to this version must be left out, not passed."""
    from agent.backends import hf

    monkeypatch.setattr(hf, "_PLAIN_SAMPLING", {**hf._PLAIN_SAMPLING, "knob_from_a_future_release": 0})
    hf._plain_sampling.cache_clear()
    try:
        assert "knob_from_a_future_release" not in hf._plain_sampling()
        assert hf._plain_sampling()["repetition_penalty"] == 1.0
        prompt = encode(tiny_llm.tokenizer, "Question: capital?\n")
        assert hf.TransformersLLM(tiny_llm.model, tiny_llm.tokenizer).generate(
            [prompt], SamplingParams(max_new_tokens=2, temperature=0.0, stop=()))[0].token_ids
    finally:
        hf._plain_sampling.cache_clear()


def test_loads_on_a_transformers_that_names_the_dtype_torch_dtype(tiny_policy_dir, monkeypatch):
    """pyproject allows transformers 4.51-4.55, whose from_pretrained knows the weights' dtype as ``torch_dtype``
    only and hands ``dtype=`` on to the model's constructor (TypeError): every model load failed there."""
    import torch
    import transformers

    from agent.backends.hf import load_model_and_tokenizer

    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained_451(path, **kw):  # what transformers 4.51 does with the two spellings
        if "dtype" in kw:
            raise TypeError("Qwen2ForCausalLM.__init__() got an unexpected keyword argument 'dtype'")
        return real(path, dtype=kw.pop("torch_dtype"), **kw)

    class Config451:  # PretrainedConfig before 4.56: a torch_dtype attribute, no dtype
        torch_dtype = None

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained_451)
    monkeypatch.setattr(transformers, "PretrainedConfig", Config451)
    model, _ = load_model_and_tokenizer(str(tiny_policy_dir), "bfloat16", "cpu")
    assert next(model.parameters()).dtype == torch.bfloat16


def _forward_logprobs(model, prompt: list[int], gen: list[int], temperature: float = 1.0, top_k: int = 0) -> list[float]:
    """Log-probabilities of ``gen`` after ``prompt`` under softmax(logits / T) restricted to the top k."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0].float() / (temperature or 1.0)
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen)]


def test_logprobs_are_those_of_the_distribution_sampled_from(tiny_llm):
    """Each generation carries one log-probability per kept token: of the plain softmax when greedy, of
    softmax(logits / T) within the top k when sampling (what vLLM's processed log-probs report), batched
    or not; sampling draws the same tokens as transformers' own warpers for the same seed."""
    import pytest
    import torch

    tok = tiny_llm.tokenizer
    prompts = [encode(tok, "Question: What is the capital of France?\n"), encode(tok, "Paris")]
    greedy = tiny_llm.generate(prompts, SamplingParams(max_new_tokens=7, temperature=0.0, stop=()))
    for p, g in zip(prompts, greedy, strict=True):
        assert len(g.logprobs) == len(g.token_ids) == 7
        assert g.logprobs == pytest.approx(_forward_logprobs(tiny_llm.model, p, g.token_ids), abs=1e-4)
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=50, stop=("</answer>",), seed=5)
    sampled = tiny_llm.generate(prompts, params)
    for p, g in zip(prompts, sampled, strict=True):
        assert len(g.logprobs) == len(g.token_ids)
        want = _forward_logprobs(tiny_llm.model, p, g.token_ids, 0.7, 50)
        assert g.logprobs == pytest.approx(want, abs=1e-4)
    # the same draws as transformers' built-in warpers (no change to what the policy samples)
    torch.manual_seed(5)
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = (torch.arange(width)[None] >= torch.tensor([[width - len(p)] for p in prompts])).long()
    ref = tiny_llm.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=0.7, top_k=50,
                                  top_p=1.0, max_new_tokens=9, pad_token_id=tok.pad_token_id, eos_token_id=[-1])
    for row, g in zip(ref[:, width:].tolist(), sampled, strict=True):
        assert row[: len(g.token_ids)] == g.token_ids
