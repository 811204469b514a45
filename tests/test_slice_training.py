"""One real training step on the tiny model, the SFT warm start, and resuming an interrupted run."""

from __future__ import annotations

import itertools

import pytest
import torch

from agent.loop.batch import run_episodes
from sleuth.config import load_config
from tests.conftest import PASSAGES, QUESTIONS, run_rl
from training.algos.estimators import advantage_inputs, compute_advantages
from training.batch import collate
from training.model.actor import update_policy


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_one_grpo_step_changes_the_weights(tiny_llm, retriever, agent_cfg):
    cfg = load_config(None, ["train.optim.micro_batch=3"])
    trajs = run_episodes(QUESTIONS[:2], tiny_llm, retriever, agent_cfg, n_samples=3, seed=0)
    for i, t in enumerate(trajs):  # rewards with in-group variance, so GRPO advantages are non-zero
        t.reward = float(i % 2)
    batch = collate(trajs, tiny_llm.tokenizer.pad_token_id)
    # the trainer's advantage phase: the registered estimator (GRPO) on the batch and its trajectories
    batch.token_advantages = compute_advantages(cfg.train, advantage_inputs(batch, trajs))["advantages"]
    assert batch.token_advantages.abs().sum() > 0
    before = _params(tiny_llm.model)
    opt = torch.optim.AdamW(tiny_llm.model.parameters(), lr=1e-3)
    tiny_llm.model.train()
    stats = update_policy(tiny_llm.model, None, opt, batch, cfg.train)
    changed = [k for k, v in _params(tiny_llm.model).items() if not torch.equal(v, before[k])]
    assert changed and stats["grad_norm"] > 0
    assert abs(stats["ratio_mean"] - 1.0) < 1e-4  # on-policy: old log-probs are the current policy's


def test_sft_on_oracle_trajectories_lowers_the_loss(tiny_llm, retriever, agent_cfg):
    from training.sft import oracle_trajectories, sft_train

    titles = {p.id: p.title for p in PASSAGES}
    trajs = oracle_trajectories(QUESTIONS, tiny_llm.tokenizer, retriever, agent_cfg, titles, top_k=1)
    assert all(t.answer == q.golden_answers[0] for t, q in zip(trajs, QUESTIONS))
    assert trajs[1].num_search_calls == 2  # the two-hop question searches its second supporting title
    assert set(trajs[1].retrieved_ids) == {"p2", "p3"}
    cfg = load_config(None, ["sft.epochs=30", "sft.batch_size=4", "sft.lr=5e-3"]).sft
    hist = sft_train(tiny_llm.model, tiny_llm.tokenizer, trajs, cfg)
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"]


def test_oracle_with_the_full_search_r1_instruction(tiny_llm, retriever, agent_cfg):
    """The full instruction names ``<search> query </search>``: the oracle must not count that as a search
    already made (it skipped searching the question, and the two-hop question got one search)."""
    from training.rollout.oracle import ChainOracleLLM
    from training.sft import oracle_trajectories

    cfg = agent_cfg.model_copy(update={"short_prompt": False, "chat_template": "off", "max_total_tokens": 1024})
    titles = {p.id: p.title for p in PASSAGES}
    trajs = oracle_trajectories(QUESTIONS, tiny_llm.tokenizer, retriever, cfg, titles, top_k=1)
    assert [t.num_search_calls for t in trajs] == [1, 2, 1, 1]
    assert all(t.turns[0].query == q.question for t, q in zip(trajs, QUESTIONS, strict=True))
    q = QUESTIONS[0].__class__("c0", "Who?", ["C"], {"chain": ["A", "B", "C"], "hops": 2})
    (t,) = run_episodes([q], ChainOracleLLM(tiny_llm.tokenizer, [q]), retriever, cfg, top_k=1, temperature=0.0)
    assert [turn.query for turn in t.turns[:2]] == ["A", "B"] and t.answer == "C"


def test_oracle_finds_the_question_under_a_chat_template_that_trims(tiny_llm, retriever, agent_cfg):
    """Chat templates such as Llama 3's trim the user message, so the question line has no newline of its
    own (the end-of-turn marker follows it): the oracle must still recognise the question (it answered
    'unknown' to everything, and SFT taught that)."""
    import copy

    from training.sft import oracle_trajectories

    tok = copy.deepcopy(tiny_llm.tokenizer)
    tok.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|eot|>"
                         "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}")
    cfg = agent_cfg.model_copy(update={"chat_template": "on", "max_total_tokens": 1024})
    titles = {p.id: p.title for p in PASSAGES}
    trajs = oracle_trajectories(QUESTIONS, tok, retriever, cfg, titles, top_k=1)
    assert [t.answer for t in trajs] == [q.golden_answers[0] for q in QUESTIONS]
    assert [t.num_search_calls for t in trajs] == [1, 2, 1, 1]


def test_oracle_refuses_the_function_call_protocol(tiny_llm, retriever, agent_cfg):
    """The oracle writes Search-R1 tags and finds the question after 'Question:'; under
    agent.protocol=function_call (no 'Question:' in the prompt) it answered 'unknown' to every question
    without searching, and SFT taught that. It is refused with the fix named."""
    import copy

    import pytest

    from training.sft import oracle_trajectories

    tok = copy.deepcopy(tiny_llm.tokenizer)
    tok.chat_template = ("{% for m in messages %}<|start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|eot|>"
                         "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}")
    cfg = agent_cfg.model_copy(update={"protocol": "function_call", "max_total_tokens": 1024})
    titles = {p.id: p.title for p in PASSAGES}
    with pytest.raises(ValueError, match="agent.protocol=search_r1"):
        oracle_trajectories(QUESTIONS, tok, retriever, cfg, titles, top_k=1)


def test_oracle_search_fits_the_turn_budget(tiny_llm, retriever, agent_cfg):
    """A question longer than agent.max_new_tokens was cut with its </search>: an invalid turn, after which
    the hint's own '<search>' counted as a search and the oracle answered without ever searching (SFT taught
    unclosed searches). The query is shortened to fit instead; a cut turn reports finish_reason 'length'."""
    from agent.llm import SamplingParams, encode
    from training.rollout.oracle import OracleLLM
    from training.sft import oracle_trajectories

    cfg = agent_cfg.model_copy(update={"max_new_tokens": 8})
    titles = {p.id: p.title for p in PASSAGES}
    trajs = oracle_trajectories(QUESTIONS, tiny_llm.tokenizer, retriever, cfg, titles, top_k=1)
    for t in trajs:
        actions = [turn.action for turn in t.turns]
        assert actions[0] == "search" and "invalid" not in actions
    assert [t.answer for t in trajs] == [q.golden_answers[0] for q in QUESTIONS]
    tok = tiny_llm.tokenizer
    oracle = OracleLLM(tok, QUESTIONS)
    prompt = encode(tok, f"Question: {QUESTIONS[0].question}\n")
    (gen,) = oracle.generate([prompt], SamplingParams(max_new_tokens=2))
    assert len(gen.token_ids) == 2 and gen.finish_reason == "length"


def test_sft_learning_rate_reaches_ten_percent_at_the_last_step(tiny_llm, retriever, agent_cfg, monkeypatch):
    """sft_train's schedule as documented: linear warm-up over 10 steps, then a linear decay that reaches
    10% of sft.lr at the last step (it reached the 10% floor at 90% of the steps and stayed there)."""
    from training.sft import oracle_trajectories, sft_train

    titles = {p.id: p.title for p in PASSAGES}
    trajs = oracle_trajectories(QUESTIONS[:2], tiny_llm.tokenizer, retriever, agent_cfg, titles, top_k=1)
    cfg = load_config(None, ["sft.epochs=10", "sft.batch_size=1", "sft.lr=0.001"]).sft
    lrs = []
    real = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: lrs.append(self.param_groups[0]["lr"])
                        or real(self, *a, **k))
    sft_train(tiny_llm.model, tiny_llm.tokenizer, trajs, cfg)
    assert len(lrs) == 20
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in itertools.pairwise(lrs[9:]))  # decreasing to the last step


def test_sft_non_finite_gradient_raises_before_any_weight_moves(tiny_llm, retriever, agent_cfg):
    """A finite loss whose gradient is not (an overflow in backward) is a FloatingPointError, and no weight
    moves: clipping an inf norm would otherwise step with NaN gradients."""
    import pytest

    from training.sft import oracle_trajectories, sft_train

    titles = {p.id: p.title for p in PASSAGES}
    trajs = oracle_trajectories(QUESTIONS[:2], tiny_llm.tokenizer, retriever, agent_cfg, titles, top_k=1)
    cfg = load_config(None, ["sft.epochs=1", "sft.batch_size=2"]).sft
    before = _params(tiny_llm.model)
    param = next(p for p in tiny_llm.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("inf"))
    try:
        with pytest.raises(FloatingPointError, match="gradient norm"):
            sft_train(tiny_llm.model, tiny_llm.tokenizer, trajs, cfg)
    finally:
        hook.remove()
    assert all(torch.equal(v, before[k]) for k, v in _params(tiny_llm.model).items())


def test_interrupted_run_resumes_from_last_checkpoint(tiny_policy_dir, retriever, tmp_path):
    from agent.backends.hf import TransformersLLM
    from training.infra.checkpoint import latest_checkpoint

    over = ["train.steps=2", "train.checkpoints.save_every=1", "train.rollout.questions_per_step=2", "train.rollout.group_size=2",
            "agent.max_new_tokens=12", "agent.max_turns=2", "agent.max_total_tokens=256"]
    cfg = load_config(None, over)
    llm = TransformersLLM.from_pretrained(str(tiny_policy_dir))
    run_rl(cfg, llm.model, llm.tokenizer, retriever, QUESTIONS, tmp_path)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000002"
    # "interrupt" after step 2 of 3: a new process resumes from the checkpoint and runs only step 3
    cfg3 = load_config(None, [o for o in over if not o.startswith("train.steps")] + ["train.steps=3"])
    llm2 = TransformersLLM.from_pretrained(str(ckpt))
    out = run_rl(cfg3, llm2.model, llm2.tokenizer, retriever, QUESTIONS, tmp_path, resume=True)
    assert out["start_step"] == 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and latest_checkpoint(tmp_path).name == "step_000003"


def test_oracle_sees_supporting_titles_that_contain_a_closing_parenthesis():
    """A title with ') ' inside ('Queen (band) discography') was read up to its first ') ', so the oracle
    thought the supporting paragraph unseen and searched it again instead of answering."""
    from agent.protocols.base import format_docs
    from corpora.formats import QAExample
    from retrieval.base import Hit
    from training.rollout.oracle import OracleLLM

    title = "Queen (band) discography"
    ex = QAExample("q1", "Who sang Bohemian Rhapsody?", ["Queen"], {"supporting_ids": ["d1"]})
    oracle = OracleLLM(None, [ex], {"d1": title})
    docs = format_docs([Hit("d1", title, "Queen released the single in 1975.", 1.0)])
    context = (f"Question: {ex.question}\n<search> {ex.question} </search>\n"
               f"<information>{docs}</information>\n")
    assert oracle._action(context) == "<answer> Queen </answer>"
    other = format_docs([Hit("d2", "Queen (band)", "A rock band) formed in London.", 1.0)])
    context = (f"Question: {ex.question}\n<search> {ex.question} </search>\n"
               f"<information>{other}</information>\n")
    assert oracle._action(context) == f"<search> {title} </search>"


def test_oracle_still_searches_after_an_invalid_turn():
    """The invalid-action hint names ``<search>`` itself, so after an invalid turn (a search cut by the
    turn budget) the oracle counted the cut search and the hint as two searches made and answered without
    any document; only searches that got documents count now."""
    from agent.protocols.base import format_docs
    from agent.protocols.search_r1 import INVALID_HINT
    from corpora.formats import QAExample
    from retrieval.base import Hit
    from training.rollout.oracle import OracleLLM

    ex = QAExample("q1", "Who sang Bohemian Rhapsody?", ["Queen"], {"supporting_ids": ["d1", "d2"]})
    oracle = OracleLLM(None, [ex], {"d1": "Bohemian Rhapsody", "d2": "Queen (band)"})
    hint = INVALID_HINT.format(reason="unclosed <search> tag")
    context = f"Question: {ex.question}\n<search> Who sang\n\n<information>{hint}</information>\n\n"
    assert oracle._action(context) == f"<search> {ex.question} </search>"
    docs = format_docs([Hit("d1", "Bohemian Rhapsody", "A 1975 single.", 1.0)])
    context += f"<search> {ex.question} </search>\n\n<information>{docs}</information>\n\n"
    assert oracle._action(context) == "<search> Queen (band) </search>"  # the second hop is still made


def test_sft_batch_without_policy_tokens_moves_no_weight(tiny_llm, retriever, agent_cfg, monkeypatch):
    """A batch whose trajectories have no policy token (an episode cut at its prompt) has a zero loss, but
    AdamW still stepped on it: its momentum from earlier batches moved the weights with no data behind the
    step. Such a batch is skipped now (the schedule still advances)."""
    from agent.trajectory import Role, Trajectory
    from training.sft import oracle_trajectories, sft_train

    titles = {p.id: p.title for p in PASSAGES}
    (good,) = oracle_trajectories(QUESTIONS[:1], tiny_llm.tokenizer, retriever, agent_cfg, titles, top_k=1)
    empty = Trajectory(question_id="cut", question="cut")
    empty.append(good.token_ids[:5], Role.PROMPT, 0)
    cfg = load_config(None, ["sft.epochs=3", "sft.batch_size=1"]).sft
    steps, lrs = [], []
    real_step = torch.optim.AdamW.step

    def counted(self, *a, **k):
        steps.append(1)
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    real_sched = torch.optim.lr_scheduler.LambdaLR.step
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step",
                        lambda self, *a, **k: lrs.append(1) or real_sched(self, *a, **k))
    hist = sft_train(tiny_llm.model, tiny_llm.tokenizer, [good, empty], cfg)
    assert len(steps) == 3 and len(lrs) >= 6  # one optimizer step per epoch; the schedule counts both batches
    assert all(h["tokens"] == sum(r == Role.POLICY for r in good.roles) for h in hist)
