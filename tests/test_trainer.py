"""The RL trainer on the tiny policy: every estimator takes a step that moves the weights, micro-batching by
token budget equals one full-batch step, resume is exact, NaN losses are skipped then stop the run, dynamic
sampling refills, and a long trajectory is truncated with its mask intact."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from agent.trajectory import Role, Trajectory
from tests.conftest import QUESTIONS, run_rl
from training.algos.advantages import to_token_advantages


def varying_judge(traj):
    """A deterministic reward that differs between samples (the random policy never answers correctly)."""
    r = float(sum(traj.token_ids) % 7) / 6.0
    return r, {"em": r, "f1": r, "format_ok": traj.answer is not None}


class SeededLLM:
    """A transformers backend whose samples do not depend on how the scheduler batched the requests:
    each prompt is sampled alone with a seed from (prompt, how often this prompt was seen under the current
    weights, a checksum of the weights). The agent's scheduler batches by timing (worker threads), so the
    plain backend's samples are not bit-reproducible across runs; this one is, which lets the resume tests
    compare parameters exactly."""

    def __init__(self, model, tokenizer):
        from agent.backends.hf import TransformersLLM

        self.inner = TransformersLLM(model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self._key, self._seen = None, {}

    def generate(self, prompts, params):
        from dataclasses import replace

        key = round(float(sum(p.detach().double().sum() for p in self.model.parameters())), 6)
        if key != self._key:
            self._key, self._seen = key, {}
        outs = []
        for p in prompts:
            h = hash(tuple(p))
            n = self._seen.get(h, 0)
            self._seen[h] = n + 1
            seed = (h + 7919 * n + int(key * 1e4)) % (2**31)
            outs.extend(self.inner.generate([p], replace(params, seed=seed)))
        return outs


def make_cfg(*overrides):
    from sleuth.config import load_config

    return load_config(None, ["train.steps=2", "train.rollout.questions_per_step=2", "train.rollout.group_size=2",
                              "agent.max_turns=2", "agent.max_new_tokens=8", "agent.max_total_tokens=200",
                              "agent.max_obs_tokens=60", "train.checkpoints.save_every=1", "train.optim.lr=1e-3", *overrides])


def load(tiny_policy_dir):
    from agent.backends.hf import load_model_and_tokenizer

    torch.set_num_threads(1)
    return load_model_and_tokenizer(str(tiny_policy_dir), device="cpu")


@pytest.mark.parametrize("algo,extra", [
    ("grpo", []), ("dr_grpo", ["train.algorithm.loss_agg_mode=seq-mean-token-sum"]), ("rloo", []),
    ("reinforce_pp", ["train.algorithm.kl_coef=0.1", "train.algorithm.kl_mode=reward"]), ("stratified_grpo", []),
    ("ppo", ["train.algorithm.critic=separate"]), ("ppo", ["train.algorithm.critic=shared"]), ("igpo", ["train.algorithm.search_cost=0.05"]),
    ("ppo", ["train.algorithm.critic=separate", "train.optim.packing=true", "train.optim.micro_batch_tokens=150"]),
    ("grpo", ["train.algorithm.kl_coef=0.1", "train.algorithm.entropy_coeff=0.01", "train.optim.micro_batch_tokens=150"]),
    ("grpo", ["train.algorithm.clip_ratio_c=3"]), ("gigpo", ["train.algorithm.search_cost=0.05"]), ("evidence_igpo", []),
    ("grpo", ["train.algorithm.policy_loss=gspo", "train.algorithm.loss_agg_mode=seq-mean-token-mean", "train.algorithm.ppo_epochs=2"]),
    ("rloo", ["train.algorithm.policy_loss=cispo", "train.algorithm.ppo_epochs=2"]),
])
def test_every_estimator_moves_the_weights(algo, extra, tiny_policy_dir, retriever, tmp_path):
    from tests.conftest import run_rl

    model, tok = load(tiny_policy_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = make_cfg(f"train.algorithm.adv_estimator={algo}", "train.steps=1", "train.rollout.group_size=3", *extra)
    out = run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    rec = out["last"]
    assert "skipped" not in rec and rec["adv_abs_mean"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    for key in ("format_ok", "degeneracy", "search_calls", "response_tokens", "entropy", "clip_frac"):
        assert key in rec
    if algo == "ppo":
        assert rec["vf_loss"] > 0
    assert ("clip_frac_lower" in rec) == ("train.algorithm.clip_ratio_c=3" in extra)  # dual-clip reaches the loss
    if "train.algorithm.kl_coef=0.1" in extra and "train.algorithm.kl_mode=reward" not in extra:
        assert "kl" in rec


def test_token_budget_micro_batches_equal_one_full_batch(tiny_policy_dir, retriever):
    """Gradient accumulation over length-sorted micro-batches (padding trimmed) == one full-batch step."""
    from agent.backends.hf import TransformersLLM
    from agent.loop.batch import run_episodes
    from training.batch import collate, micro_batches
    from training.model.actor import update_policy

    cfg = make_cfg()
    model, tok = load(tiny_policy_dir)
    torch.manual_seed(0)
    trajs = run_episodes(QUESTIONS, TransformersLLM(model, tok), retriever, cfg.agent, n_samples=2)
    batch = collate(trajs, tok.pad_token_id)
    batch.token_advantages = to_token_advantages(torch.linspace(-1, 1, len(batch)), batch.loss_mask)
    parts = micro_batches(batch, 8, 2 * int(batch.lengths.float().mean()))
    assert len(parts) > 1 and sorted(torch.cat(parts).tolist()) == list(range(len(batch)))
    results = []
    for tokens in (None, 2 * int(batch.lengths.float().mean())):
        m, _ = load(tiny_policy_dir)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        tc = cfg.train.updated({"optim.micro_batch": 64 if tokens is None else 8, "optim.micro_batch_tokens": tokens,
                                "optim.grad_clip": 1e9})
        b = collate(trajs, tok.pad_token_id)
        b.token_advantages = batch.token_advantages.clone()
        update_policy(m, None, opt, b, tc)
        results.append(m.state_dict())
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("extra", [(), ("train.algorithm.adv_estimator=ppo", "train.algorithm.critic=separate", "train.optim.critic_lr=1e-2"),
                                   ("train.algorithm.adv_estimator=ppo", "train.algorithm.critic=shared", "train.optim.critic_lr=1e-2")])
def test_resume_is_exact(extra, tiny_policy_dir, retriever, tmp_path):
    """3 steps straight == 2 steps + resume from the checkpoint + 1 step (same weights, same data); with PPO
    the critic and its optimizer state are restored too (the critic's weights after step 3 are equal)."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint, read_extra

    cfg3 = make_cfg("train.steps=3", "train.optim.lr_warmup_steps=2", *extra)
    model, tok = load(tiny_policy_dir)
    run_rl(cfg3, model, tok, retriever, QUESTIONS, tmp_path / "straight", judge=varying_judge,
             llm_factory=SeededLLM)
    straight = model.state_dict()

    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=2", "train.optim.lr_warmup_steps=2", *extra), model, tok, retriever, QUESTIONS,
             tmp_path / "split", judge=varying_judge, llm_factory=SeededLLM)
    ckpt = latest_checkpoint(tmp_path / "split")
    assert ckpt.name == "step_000002"
    if extra:  # the critic's optimizer state is saved keyed by parameter name (any world size resumes it)
        saved = read_extra(ckpt)["critic_optimizer"]
        assert saved["state"] and all(isinstance(k, str) for k in saved["state"])
        assert set(saved["state"]) == set(read_extra(ckpt)["critic"])
    model, tok = load_model_and_tokenizer(str(ckpt), device="cpu")
    out = run_rl(cfg3, model, tok, retriever, QUESTIONS, tmp_path / "split", resume=True, judge=varying_judge,
                   llm_factory=SeededLLM)
    assert out["start_step"] == 2
    for k, v in straight.items():  # equal up to float summation order (group members may swap places)
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-6)
    if extra:
        a, b = (read_extra(latest_checkpoint(tmp_path / run))["critic"] for run in ("straight", "split"))
        assert set(a) == set(b) and a
        for k, v in a.items():
            torch.testing.assert_close(b[k], v, rtol=0, atol=1e-6, msg=f"critic {k}")
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_resume_rewrites_the_sample_trajectories_of_redone_steps(tiny_policy_dir, retriever, tmp_path):
    """A run that dies after logging a step it had not checkpointed redoes that step on resume: its metrics
    record and its sample trajectories are written once, not twice."""
    import shutil

    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    cfg = make_cfg("train.steps=2")
    model, tok = load(tiny_policy_dir)
    run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge, llm_factory=SeededLLM)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000002")  # as if killed after logging step 2, before saving it
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000001"
    model, tok = load_model_and_tokenizer(str(ckpt), device="cpu")
    run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, resume=True, judge=varying_judge, llm_factory=SeededLLM)
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert [json.loads(ln)["metadata"]["step"] for ln in lines] == [1, 1, 2, 2]  # group_size 2 per step
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def _step_of(rec):
    return rec.get("metadata", {}).get("step", 0)


def test_drop_steps_after_keeps_unicode_line_separators_inside_records(tmp_path):
    """save_trajectories writes ensure_ascii=False, so a document with U+2028 / U+0085 (common in Wikipedia
    text) is a raw character inside one JSONL record; the resume trim must not split the record there."""
    from training.infra.monitors import drop_steps_after

    path = tmp_path / "trajectories.jsonl"
    recs = [{"metadata": {"step": s}, "text": f"a\u2028b\x85c\u2029 {s}"} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    drop_steps_after(path, 2, _step_of)
    assert [json.loads(ln) for ln in path.read_text(encoding="utf-8").split("\n") if ln] == recs[:2]


def test_drop_steps_after_drops_a_torn_last_line(tmp_path):
    """A run killed while appending a record leaves a last line without its newline: resuming drops it
    (with a warning) instead of failing; a broken line that is not the last one still raises."""
    from training.infra.monitors import drop_steps_after

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew', encoding="utf-8")
    with pytest.warns(UserWarning, match="torn last line"):
        drop_steps_after(path, 2, lambda r: r["step"])
    assert path.read_text(encoding="utf-8") == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n', encoding="utf-8")
    with pytest.raises(json.JSONDecodeError):
        drop_steps_after(path, 2, lambda r: r["step"])


def test_drop_steps_after_keeps_the_file_when_interrupted_while_rewriting(tmp_path, monkeypatch):
    """The rewrite goes to a temporary file renamed into place: a kill during it leaves the old records."""
    import pathlib

    from training.infra.monitors import drop_steps_after

    path = tmp_path / "metrics.jsonl"
    before = '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    path.write_text(before, encoding="utf-8")
    real = pathlib.Path.write_text

    def killed_midway(self, data, *a, **kw):
        real(self, data[: len(data) // 2], *a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        drop_steps_after(path, 2, lambda r: r["step"])
    monkeypatch.undo()
    assert path.read_text(encoding="utf-8") == before


def test_gold_answer_probs_run_the_lm_head_on_the_gold_tokens_only(tiny_policy_dir, retriever, agent_cfg):
    """IGPO's p_k: the geometric-mean probability of the teacher-forced gold answer's tokens (of
    ``<answer> gold </answer>`` tokenised as one string) after each turn boundary, as the full logits give it; the LM head runs on the gold positions only (a [rows, T, V] float32 logits
    tensor is tens of GB for a real vocabulary and context)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from agent.llm import encode
    from agent.loop.batch import run_episodes
    from training.algos.rewards import gold_answer_probs, turn_boundaries
    from training.model.forward import policy_logprobs

    model, tok = load(tiny_policy_dir)
    trajs = run_episodes(QUESTIONS[:2], SeededLLM(model, tok), retriever, agent_cfg, n_samples=2)
    V = model.get_output_embeddings().weight.shape[0]

    class HeadRows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm) and \
                    out.shape[-1] == V:
                HeadRows.rows += out.shape[:-1].numel()
            return out

    with HeadRows():
        probs = gold_answer_probs(lambda b: policy_logprobs(model, b, with_entropy=False)[0], tok, trajs)
    n_gold = 0
    for tr, ps in zip(trajs, probs, strict=True):
        # the answer as the policy writes it, tokenised as one string; p over the gold's own tokens (not the
        # space before </answer>, a token of its own here that the policy never writes alone)
        answer = encode(tok, f"<answer> {tr.golden_answers[0]} </answer>")
        s0, e0 = len(encode(tok, "<answer>")), len(encode(tok, f"<answer> {tr.golden_answers[0]}"))
        assert tok.decode(answer[s0:e0]) == f" {tr.golden_answers[0]}"
        bounds = turn_boundaries(tr)
        assert len(ps) == len(bounds)
        for b, p in zip(bounds, ps, strict=True):
            ids = torch.tensor([tr.token_ids[:b] + answer])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            s, e = b + s0, b + e0
            want = logp[s - 1 : e - 1].gather(-1, ids[0, s:e, None]).mean().exp()
            assert p == pytest.approx(float(want), rel=1e-4)
            n_gold += e0 - s0
    assert HeadRows.rows == n_gold


def test_log_probs_are_scored_at_the_rollout_temperature(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """rl_train scores old, new (and reference) log-probs at agent.temperature, the temperature the rollout
    sampled at; greedy rollouts (temperature 0) are refused before anything runs."""
    import training.model.forward as FWD
    from tests.conftest import run_rl

    seen = []
    real = FWD.tempered
    monkeypatch.setattr(FWD, "tempered", lambda h, t: seen.append(t) or real(h, t))
    model, tok = load(tiny_policy_dir)
    with pytest.raises(ValueError, match="agent.temperature must be > 0"):
        run_rl(make_cfg("train.steps=1", "agent.temperature=0"), model, tok, retriever, QUESTIONS, tmp_path / "greedy",
                 judge=varying_judge, llm_factory=SeededLLM)
    assert seen == []
    run_rl(make_cfg("train.steps=1", "agent.temperature=0.5"), model, tok, retriever, QUESTIONS, tmp_path / "t05",
             judge=varying_judge, llm_factory=SeededLLM)
    assert seen and set(seen) == {0.5}


def test_a_retriever_with_a_curriculum_follows_the_training_step(tiny_policy_dir, retriever, tmp_path):
    """A retriever with ``set_step`` (ZeroSearch's simulated search: its noise curriculum) is told each
    step before that step's rollout, with the run's total steps."""
    from tests.conftest import run_rl

    class Curriculum:
        def __init__(self, inner):
            self.inner, self.steps = inner, []

        def set_step(self, step, total_steps=None):
            self.steps.append((step, total_steps))

        def search(self, queries, k):
            return self.inner.search(queries, k)

    cur = Curriculum(retriever)
    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=2"), model, tok, cur, QUESTIONS, tmp_path, judge=varying_judge,
             llm_factory=SeededLLM)
    assert cur.steps == [(0, 2), (1, 2)]


def test_nonfinite_loss_is_skipped_then_stops(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    import training.model.actor as ACT
    from tests.conftest import run_rl

    real = ACT.policy_loss

    def nan_loss(*a, **kw):
        loss, stats = real(*a, **kw)
        return loss * float("nan"), stats

    monkeypatch.setattr(ACT, "policy_loss", nan_loss)
    model, tok = load(tiny_policy_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = make_cfg("train.steps=5", "train.monitoring.max_nonfinite_steps=2")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # the stop names the cause and the checkpoint to resume from (step 1's: a skipped step still saves)
        with pytest.raises(RuntimeError, match=r"max_nonfinite_steps=2; the last: non-finite policy loss.*"
                                               r"checkpoint is \S+step_000001: resume"):
            run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    assert sum("step skipped" in str(x.message) for x in w) == 2
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v)  # no parameter moved on a NaN step


def test_a_nonfinite_later_ppo_epoch_still_pushes_the_epochs_that_stepped(tiny_policy_dir, retriever, tmp_path,
                                                                           monkeypatch):
    """With ``train.algorithm.ppo_epochs=2`` a NaN loss in the second epoch raises after the first epoch's optimizer step:
    the step is counted as skipped, but the policy did move, so a rollout side that holds its own weights
    (vLLM; the rollout copy under torchrun, which checkpoints save) must get them. Before, the push sat in the
    skipped branch: the next rollout sampled from stale weights and a checkpoint saved them beside the moved
    optimizer state."""
    import training.model.actor as ACT
    from tests.conftest import run_rl

    real, stepped = ACT.policy_loss, {"n": 0}
    real_step = torch.optim.AdamW.step

    def nan_after_a_step(*a, **kw):
        loss, stats = real(*a, **kw)
        return (loss * float("nan") if stepped["n"] else loss), stats

    def counting_step(self, *a, **kw):
        stepped["n"] += 1
        return real_step(self, *a, **kw)

    monkeypatch.setattr(ACT, "policy_loss", nan_after_a_step)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    pushed = []
    model, tok = load(tiny_policy_dir)
    with pytest.warns(UserWarning, match="step skipped"):
        run_rl(make_cfg("train.steps=1", "train.algorithm.ppo_epochs=2"), model, tok, retriever, QUESTIONS, tmp_path,
                 judge=varying_judge, sync_weights=lambda llm, state: pushed.append(state))
    assert stepped["n"] == 1 and pushed, "the first epoch stepped; its weights were not pushed"
    for k, v in model.state_dict().items():
        assert torch.equal(pushed[-1][k], v), k


def test_dynamic_sampling_drops_flat_groups_and_refills(tiny_policy_dir, retriever):
    from agent.backends.hf import TransformersLLM
    from training.rollout.worker import DataStream, RolloutWorker, rollout

    def judge(traj):  # only the Berlin question ever gets varying rewards
        r = float(len(traj.token_ids) % 2) if "Germany" in traj.question else 0.0
        return r, {"em": r}

    cfg = make_cfg("train.rollout.dynamic_sampling=true", "train.rollout.dynamic_sampling_max_tries=3", "train.rollout.group_size=4")
    model, tok = load(tiny_policy_dir)
    torch.manual_seed(0)
    data = DataStream(QUESTIONS, 0)
    worker = RolloutWorker(TransformersLLM(model, tok), retriever, cfg.agent, cfg.retrieval.top_k, judge)
    trajs, stats = rollout(worker, data.next(2), cfg.train, data)
    groups = {t.group for t in trajs}
    assert stats["ds_dropped_groups"] >= 1 and stats["ds_rounds"] >= 1
    assert groups == set(range(len(groups))) and len(trajs) == 4 * len(groups)
    for g in groups:
        rs = [t.reward for t in trajs if t.group == g]
        assert max(rs) > min(rs) or stats["ds_kept_groups"] == 0


def test_collate_truncates_with_mask_intact():
    from training.batch import collate

    t = Trajectory("q", "q")
    t.append([5, 6, 7], Role.PROMPT, 0)
    t.append([8, 9], Role.POLICY, 1)
    t.append([10, 11, 12], Role.TOOL, 1)
    t.append([13, 14, 15, 16], Role.POLICY, 2)
    b = collate([t], pad_id=0, max_len=10)
    assert b.input_ids.shape == (1, 10)
    assert b.input_ids[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert b.roles[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 1, 1]
    # loss mask over targets 1..9: policy exactly at targets 8, 9, 13, 14
    assert b.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert b.turn_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]


def test_micro_batches_rejects_bad_caps():
    from training.batch import collate, micro_batches

    t = Trajectory("q", "q")
    t.append([1, 2], Role.POLICY, 1)
    with pytest.raises(ValueError):
        micro_batches(collate([t], 0), 0)


def test_weights_are_pushed_to_a_rollout_engine_after_each_update(tiny_policy_dir, retriever, tmp_path):
    """The vLLM protocol: a backend with ``update_weights(state_dict_iter)`` receives the full new weights
    after every optimizer step (and a custom ``sync_weights`` callable replaces that call)."""
    from tests.conftest import run_rl

    pushed = []

    class Engine(SeededLLM):
        def update_weights(self, items):
            pushed.append({k: v.clone() for k, v in items})

    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=2"), model, tok, retriever, QUESTIONS, tmp_path / "a", judge=varying_judge,
             llm_factory=Engine)
    assert len(pushed) == 2
    for k, v in model.state_dict().items():
        assert torch.equal(pushed[-1][k], v)
    calls = []
    run_rl(make_cfg("train.steps=1"), model, tok, retriever, QUESTIONS, tmp_path / "b", judge=varying_judge,
             sync_weights=lambda llm, state: calls.append(len(state)))
    assert calls and calls[0] == len(model.state_dict())


def _synthetic_batch(tok, rows_roles, seed=0):
    """A Batch of right-padded rows with the given role lists (0 prompt, 1 policy, 2 tool)."""
    from training.batch import collate

    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, roles in enumerate(rows_roles):
        t = Trajectory("q", "q", group=i // 2)
        ids = torch.randint(5, tok.vocab_size, (len(roles),), generator=g).tolist()
        for tid, role in zip(ids, roles, strict=True):
            t.append([tid], Role(role), 0 if role == 0 else 1)
        trajs.append(t)
    return collate(trajs, tok.pad_token_id)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_equal_full_batch_with_a_row_without_policy_tokens(agg, tiny_policy_dir):
    """Gradient accumulation over one-row micro-batches equals the full-batch step for every aggregation, also
    when a row has no policy token (a trajectory truncated inside its prompt): seq-mean-token-mean averages
    over the rows that have policy tokens, so a micro-batch's weight must count those rows, not all rows."""
    from training.model.actor import update_policy

    model, tok = load(tiny_policy_dir)
    rows = [[0, 0, 1, 1, 1, 2, 2, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    results = []
    for mb in (64, 1):
        m, _ = load(tiny_policy_dir)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        tc = make_cfg(f"train.algorithm.loss_agg_mode={agg}").train.updated(
            {"optim.micro_batch": mb, "optim.micro_batch_tokens": None, "optim.grad_clip": 1e9})
        b = _synthetic_batch(tok, rows)
        assert b.loss_mask[1].sum() == 0
        b.token_advantages = to_token_advantages(torch.tensor([1.0, -2.0, -0.5, 0.7]), b.loss_mask)
        update_policy(m, None, opt, b, tc)
        results.append(m.state_dict())
    moved = 0
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-4, atol=1e-6)
        moved += int(not torch.equal(results[0][k], model.state_dict()[k]))
    assert moved


def test_old_logprobs_are_computed_under_the_update_autocast(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """rl_train's old (and reference) log-probs must run under the same autocast as update_policy's new ones:
    on GPU with train.optim.bf16 fp32 old log-probs against bf16 new ones make the first-epoch ratio != 1 (spurious
    clipping). The autocast is faked on CPU: every policy/reference forward must happen inside it."""
    import contextlib

    import training.model.actor as ACT
    from training.model.forward import LogprobModule

    active, seen = [0], []

    @contextlib.contextmanager
    def fake_autocast(device, enabled):
        active[0] += 1
        try:
            yield
        finally:
            active[0] -= 1

    real_forward = LogprobModule.forward

    def forward(self, *a, **kw):
        seen.append(active[0] > 0)
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(ACT, "autocast", fake_autocast)
    monkeypatch.setattr(LogprobModule, "forward", forward)
    model, tok = load(tiny_policy_dir)
    cfg = make_cfg("train.steps=1", "train.algorithm.kl_coef=0.1", "train.algorithm.kl_mode=reward")
    run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    assert seen and all(seen), seen


@pytest.mark.parametrize("shared", [False, True])
def test_nonfinite_value_loss_raises_before_any_weight_moves(shared, tiny_policy_dir, monkeypatch):
    """A NaN value loss (PPO's critic) must raise FloatingPointError like a NaN policy loss, with neither the
    policy nor the critic moved; before, the critic stepped on NaN gradients and silently became NaN."""
    import training.model.critic as C
    from training.model.actor import update_policy
    from training.model.critic import ValueModel

    model, tok = load(tiny_policy_dir)
    critic = ValueModel(model, shared=shared)
    b = _synthetic_batch(tok, [[0, 0, 1, 1, 1, 2, 2, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
    b.token_advantages = torch.randn(b.loss_mask.shape) * b.loss_mask
    b.old_values = torch.zeros_like(b.loss_mask)
    b.returns = torch.ones_like(b.loss_mask) * b.loss_mask
    real = C.value_loss

    def nan_value_loss(*a, **kw):
        loss, stats = real(*a, **kw)
        return loss * float("nan"), stats

    monkeypatch.setattr(C, "value_loss", nan_value_loss)
    tc = make_cfg("train.algorithm.adv_estimator=ppo", "train.algorithm.critic=separate").train
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_c = {k: v.clone() for k, v in critic.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    copt = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    with pytest.raises(FloatingPointError, match="value"):
        update_policy(model, None, opt, b, tc, critic=critic, critic_optimizer=copt)
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    for k, v in critic.state_dict().items():
        assert torch.equal(before_c[k], v), k


def test_ppo_with_a_shared_critic_is_refused_under_torchrun(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """A shared critic's head rides on the sharded policy's backbone: refused under torchrun with a message
    that names the layout that works, before anything is written."""
    import training.trainer as T

    monkeypatch.setattr(T, "init_from_env", lambda timeout_s=None: (0, 2))
    model, tok = load(tiny_policy_dir)
    with pytest.raises(ValueError, match="train.algorithm.critic=shared .*torchrun.*train.algorithm.critic=separate"):
        run_rl(make_cfg("train.algorithm.adv_estimator=ppo", "train.algorithm.critic=shared"), model, tok, retriever, QUESTIONS,
                   tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("handed_over_training", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_ppo_critic_estimates_in_eval_mode_and_trains_in_train_mode(shared, handed_over_training, tiny_policy_dir,
                                                                      retriever, tmp_path, monkeypatch):
    """As verl's critic (``compute_values`` in eval mode, ``update_critic`` in train mode): PPO's value
    estimates (GAE's baseline, the value clip's old values) come from the critic's backbone in eval mode, its
    value loss from it in train mode. Before, nothing set the separate critic's mode: its backbone kept the
    mode the policy had when it was copied (eval after ``from_pretrained``), so dropout (GPT-2's
    ``resid_pdrop``, ``train.optim.lora_dropout``) was off in its update, or on in its estimates for a policy
    handed over in train mode."""
    import training.run_state as RS
    from training.model.critic import ValueModel

    model, tok = load(tiny_policy_dir)
    model.train(handed_over_training)  # the mode the policy is handed over in must not matter
    modes: dict[bool, set[bool]] = {True: set(), False: set()}  # grad enabled -> the backbone's modes seen

    class Recording(ValueModel):
        def forward(self, batch):
            modes[torch.is_grad_enabled()] |= {m.training for m in self._body().modules()}
            return super().forward(batch)

    monkeypatch.setattr(RS, "ValueModel", Recording)
    run_rl(make_cfg("train.steps=1", "train.algorithm.adv_estimator=ppo", f"train.algorithm.critic={'shared' if shared else 'separate'}"),
               model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    assert modes == {False: {False}, True: {True}}, modes


def test_a_critic_optimizer_state_of_the_one_process_format_still_resumes(tiny_policy_dir):
    """Checkpoints written before PPO ran under torchrun hold ``optimizer.state_dict()`` (keyed by position):
    one process restores it; under torchrun the moments restart with a warning."""
    from training.model.critic import ValueModel
    from training.run_state import load_critic_optimizer as _load_critic_optimizer

    model, _ = load(tiny_policy_dir)
    critic = ValueModel(model)
    opt = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    critic.head.bias.grad = torch.ones_like(critic.head.bias)
    opt.step()
    old = opt.state_dict()
    fresh = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    _load_critic_optimizer(critic, fresh, old, 0, 1)
    assert torch.equal(fresh.state[critic.head.bias]["exp_avg"], opt.state[critic.head.bias]["exp_avg"])
    other = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="zero moments"):
        _load_critic_optimizer(critic, other, old, 1, 2)
    assert not other.state


def test_resume_loads_a_sharded_reference_model(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """The KL reference saved in run_dir/reference must be what a resumed run compares with, also when
    save_pretrained wrote it in shards (a large model): before, only model.safetensors was read and a sharded
    reference was silently replaced by the resumed (already trained) weights, so the KL started from 0."""
    import shutil

    import training.trainer as TR
    from agent.backends.hf import load_model_and_tokenizer
    from training.infra.checkpoint import latest_checkpoint

    cfg = make_cfg("train.steps=1", "train.algorithm.kl_coef=0.1")
    model, tok = load(tiny_policy_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    ref_dir = tmp_path / "reference"
    shutil.rmtree(ref_dir)
    m0, _ = load(tiny_policy_dir)
    m0.save_pretrained(ref_dir, max_shard_size="20KB")
    assert not (ref_dir / "model.safetensors").exists() and len(list(ref_dir.glob("*.safetensors"))) > 1

    seen = []
    real = TR.update_policy

    def spy(module, ref_model, *a, **kw):
        seen.append({k: v.clone() for k, v in ref_model.state_dict().items()})
        return real(module, ref_model, *a, **kw)

    monkeypatch.setattr(TR, "update_policy", spy)
    model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
    assert any(not torch.equal(initial[k], v) for k, v in model.state_dict().items())
    run_rl(make_cfg("train.steps=2", "train.algorithm.kl_coef=0.1"), model, tok, retriever, QUESTIONS, tmp_path,
                resume=True, judge=varying_judge)
    assert seen
    for k, v in initial.items():
        torch.testing.assert_close(seen[0][k], v, rtol=0, atol=0)


def test_resume_rewrites_best_lost_by_a_kill_inside_save_best(tiny_policy_dir, retriever, tmp_path, monkeypatch):
    """A kill between save_best's two renames (old best moved aside, new one not yet in place) left no
    checkpoints/best, and since the checkpoint already recorded the best metric, no later step rewrote it:
    the resumed run must rebuild best from the checkpoint that set that metric."""
    import training.run_state as RS
    from agent.backends.hf import load_model_and_tokenizer
    from training.infra.checkpoint import latest_checkpoint

    def killed(run_dir, ckpt, metric):
        raise KeyboardInterrupt  # the process dies inside save_best, before best is in place

    model, tok = load(tiny_policy_dir)
    with monkeypatch.context() as m:
        m.setattr(RS, "save_best", killed)
        with pytest.raises(KeyboardInterrupt):
            run_rl(make_cfg("train.steps=2", "train.monitoring.eval_every=1"), model, tok, retriever, QUESTIONS, tmp_path,
                       judge=varying_judge, evaluate=lambda m: {"em": 0.5})
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000001" and not (tmp_path / "checkpoints" / "best").exists()
    model, tok = load_model_and_tokenizer(str(ckpt), device="cpu")
    out = run_rl(make_cfg("train.steps=2", "train.monitoring.eval_every=1"), model, tok, retriever, QUESTIONS, tmp_path,
                     resume=True, judge=varying_judge, evaluate=lambda m: {"em": 0.25})
    assert out["start_step"] == 1 and out["best_eval_em"] == 0.5
    best = json.loads((tmp_path / "checkpoints" / "best" / "best.json").read_text())
    assert best == {"from": "step_000001", "metric": 0.5}


def test_a_nan_eval_metric_is_never_the_best(tiny_policy_dir, retriever, tmp_path):
    """An evaluate that returns NaN (no questions scored) at the first eval made best NaN, and since nothing
    compares greater than NaN, no later step could become best."""

    ems = iter([float("nan"), 0.25, 0.5])
    model, tok = load(tiny_policy_dir)
    out = run_rl(make_cfg("train.steps=3", "train.monitoring.eval_every=1"), model, tok, retriever, QUESTIONS, tmp_path,
                     judge=varying_judge, evaluate=lambda m: {"em": next(ems)})
    assert out["best_eval_em"] == 0.5
    assert json.loads((tmp_path / "checkpoints" / "best" / "best.json").read_text())["from"] == "step_000003"


def test_data_stream_shuffles_once_per_epoch(monkeypatch):
    """DataStream.next rebuilt and reshuffled the whole epoch order for every question it handed out: on
    Search-R1's 170k training questions that took ~10 s per 64 questions, every step. Each epoch's order is
    now shuffled once; the stream (and so a checkpointed position) is unchanged."""
    import random

    from training.rollout.worker import DataStream

    examples = list(range(7))

    def expected(seed, position):
        epoch, i = divmod(position, len(examples))
        order = list(range(len(examples)))
        random.Random(seed * 100003 + epoch).shuffle(order)
        return examples[order[i]]

    calls = []
    real = random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: (calls.append(1), real(self, x))[1])
    data = DataStream(examples, seed=3)
    got = data.next(10) + data.next(11)
    assert got == [expected(3, p) for p in range(21)]
    assert len(calls) - 21 == 3  # expected() shuffles 21 times; the stream once per epoch (0, 1, 2)
    data.position = 4  # a resume sets the position: the stream goes on from there
    assert data.next(5) == [expected(3, p) for p in range(4, 9)]


def test_logged_lr_is_the_one_the_step_used(tiny_policy_dir):
    """update_policy reported the learning rate read after scheduler.step(), i.e. the next step's: with a
    warm-up, step 1 (lr x 1/4) was logged as lr x 2/4. It now reports the rate its optimizer steps used."""
    from training.model.actor import update_policy

    model, tok = load(tiny_policy_dir)
    batch = _synthetic_batch(tok, [[0, 0, 1, 1, 1], [0, 1, 1, 2, 1]])
    batch.token_advantages = to_token_advantages(torch.tensor([1.0, -1.0]), batch.loss_mask)
    cfg = make_cfg("train.optim.lr=1e-3").train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
    stats = update_policy(model, None, opt, batch, cfg, scheduler=sched)
    assert stats["lr"] == pytest.approx(0.25e-3)
    assert update_policy(model, None, opt, batch, cfg, scheduler=sched)["lr"] == pytest.approx(0.5e-3)


def test_resume_takes_the_learning_rate_of_the_config(tiny_policy_dir, retriever, tmp_path):
    """`sleuth train --resume train.optim.lr=1e-5` (the README's example): the restored optimizer and scheduler
    state carried the old run's lr, so the new train.optim.lr was silently ignored; the config's lr now applies
    (warm-up position kept), with a warning that it changed."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=1"), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
    with pytest.warns(UserWarning, match="train.optim.lr"):
        run_rl(make_cfg("train.steps=2", "train.optim.lr=1e-5"), model, tok, retriever, QUESTIONS, tmp_path,
                 resume=True, judge=varying_judge)
    lrs = [json.loads(ln)["lr"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([1e-3, 1e-5])


def test_resume_restores_the_rng_after_building_the_rollout_backend(tiny_policy_dir, retriever, tmp_path,
                                                                     monkeypatch):
    """vLLM's engine seeds the global Python/NumPy/torch RNGs when it starts. The checkpoint's RNG states were
    restored before ``llm_factory`` ran, so a resumed run continued from the backend's seed instead of the
    saved streams; they are now restored after it. Each step draws once from Python's ``random`` here, and the
    draw of step 3 must be the same straight and resumed."""
    import random

    import training.run_state as RS
    from agent.backends.hf import load_model_and_tokenizer
    from training.infra.checkpoint import latest_checkpoint

    draws: list[float] = []

    class DrawingStream(RS.DataStream):
        def next(self, n):
            draws.append(random.random())
            return super().next(n)

    def seeding_factory(model, tok):  # what vLLM's engine start does to the global RNGs
        random.seed(1234)
        torch.manual_seed(1234)
        return SeededLLM(model, tok)

    monkeypatch.setattr(RS, "DataStream", DrawingStream)
    cfg3 = make_cfg("train.steps=3")
    model, tok = load(tiny_policy_dir)
    run_rl(cfg3, model, tok, retriever, QUESTIONS, tmp_path / "straight", judge=varying_judge,
               llm_factory=seeding_factory)
    straight, draws[:] = list(draws), []
    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=2"), model, tok, retriever, QUESTIONS, tmp_path / "split",
               judge=varying_judge, llm_factory=seeding_factory)
    draws.clear()
    model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path / "split")), device="cpu")
    run_rl(cfg3, model, tok, retriever, QUESTIONS, tmp_path / "split", resume=True, judge=varying_judge,
               llm_factory=seeding_factory)
    assert len(straight) == 3 and draws == [straight[2]]


def test_a_second_training_on_the_same_run_directory_is_refused(tiny_policy_dir, retriever, tmp_path):
    """Two trainings writing one run directory interleave metrics and overwrite each other's checkpoints
    (say, a scheduler requeues a job whose first copy still runs). While a run holds the directory, another
    ``rl_train`` on it raises before writing anything; once the holder ends, the directory is free again."""
    from tests.conftest import run_rl
    from training.infra.checkpoint import run_dir_lock

    model, tok = load(tiny_policy_dir)
    with run_dir_lock(tmp_path):  # another process's run, as far as flock is concerned (its own descriptor)
        with pytest.raises(RuntimeError, match="another training"):
            run_rl(make_cfg("train.steps=1"), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
        assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    out = run_rl(make_cfg("train.steps=1"), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    assert out["last"] and (tmp_path / "metrics.jsonl").exists()
    with run_dir_lock(tmp_path):  # released when rl_train returned
        pass


def test_a_fresh_start_replaces_the_reference_of_an_earlier_unfinished_run(tiny_policy_dir, retriever, tmp_path):
    """A run killed before its first checkpoint (an OOM at step 1, say) leaves run_dir/reference; a new run in
    the same directory from another initial model (the user changed policy.model or enabled SFT) kept that
    stale reference on disk, and once resumed, compared its KL with the earlier run's model. A fresh start now
    saves its own initial policy as the reference."""
    from tests.conftest import run_rl
    from training.infra.checkpoint import load_pretrained_weights

    other, _ = load(tiny_policy_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    other.save_pretrained(tmp_path / "reference")  # what the unfinished run with another model left
    model, tok = load(tiny_policy_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    run_rl(make_cfg("train.steps=1", "train.algorithm.kl_coef=0.1"), model, tok, retriever, QUESTIONS, tmp_path,
             judge=varying_judge)
    ref, _ = load(tiny_policy_dir)
    load_pretrained_weights(ref, tmp_path / "reference")
    for k, v in initial.items():
        torch.testing.assert_close(ref.state_dict()[k], v, rtol=0, atol=0)


def test_the_leftovers_of_a_checkpoint_write_killed_midway_are_removed(tiny_policy_dir, retriever, tmp_path):
    """A run killed while writing a checkpoint leaves checkpoints/.tmp_step_<n>_<pid> (a full model and optimizer
    state: gigabytes), and save_best's killed copy .tmp_best_<pid> / .old_best; no later run removed them,
    since each process only clears its own pid's. The run holding the directory now removes them at its start,
    and the complete checkpoints stay."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=1"), model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge)
    root = tmp_path / "checkpoints"
    left = [root / ".tmp_step_000002_999999", root / ".tmp_best_999999", root / ".old_best"]
    for d in left:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
    run_rl(make_cfg("train.steps=2"), model, tok, retriever, QUESTIONS, tmp_path, resume=True, judge=varying_judge)
    assert not any(d.exists() for d in left)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]


@pytest.mark.parametrize("first,then", [(True, False), (False, True)])
def test_resuming_with_lora_switched_is_refused_naming_it(first, then, tiny_policy_dir, retriever, tmp_path):
    """``--resume train.optim.lora=...`` the other way than the checkpoint's run failed deep in torch ('Missing optimizer
    state for parameter ...lora_A...'), naming neither train.optim.lora nor what to do; it is now a ValueError that
    does, raised before anything is written."""
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import run_rl
    from training.infra.checkpoint import latest_checkpoint

    lora = ["train.optim.lora_targets=[q_proj,v_proj]"]
    model, tok = load(tiny_policy_dir)
    run_rl(make_cfg("train.steps=1", f"train.optim.lora={first}", *lora), model, tok, retriever, QUESTIONS, tmp_path,
             judge=varying_judge)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
    with pytest.raises(ValueError, match=f"train.optim.lora={str(first).lower()}"):
        run_rl(make_cfg("train.steps=2", f"train.optim.lora={then}", *lora), model, tok, retriever, QUESTIONS, tmp_path,
                 resume=True, judge=varying_judge)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_a_resumed_run_replaces_the_redone_steps_in_tensorboard_too(tmp_path):
    """On resume ``metrics.jsonl`` was cut back to the checkpoint's step, but TensorBoard kept the events of
    the steps after it, so every redone step was plotted twice (old and new value). The logger now passes
    ``purge_step`` to the ``SummaryWriter``: TensorBoard hides the old events from the resumed step on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.infra.monitors import MetricsLogger

    first = MetricsLogger(tmp_path)
    for step in (1, 2, 3):
        first.log(step, {"reward": float(step)})
    first.tb.close()
    resumed = MetricsLogger(tmp_path, truncate_after=1)  # resumed from step 1's checkpoint
    resumed.log(2, {"reward": 20.0})
    resumed.tb.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 1.0), (2, 20.0)]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_packing_without_packed_sequence_masks_is_refused_before_the_first_rollout(retriever, tmp_path,
                                                                                     monkeypatch):
    """``train.optim.packing`` on a transformers without packed-sequence detection (4.51-4.52) is an error
    (training.model.forward.check_packed_masks); it came at the first packed micro-batch, after a whole
    rollout. It now comes when ``rl_train`` starts, before any model is touched or rollout made."""
    import sys

    from tests.conftest import run_rl

    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # the import fails, as on 4.52
    with pytest.raises(ValueError, match="train.optim.packing needs a transformers"):
        run_rl(make_cfg("train.optim.packing=true"), None, None, retriever, QUESTIONS, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_every_step_record_times_every_phase(tiny_policy_dir, retriever, tmp_path):
    """``timing/<phase>_s`` for each phase of each step (eval on the steps that evaluate), in the records
    logged and in the ones handed to ``on_step``; ``step_s`` spans the rollout through the sync."""
    from training.infra.monitors import PHASES

    model, tok = load(tiny_policy_dir)
    seen = []
    run_rl(make_cfg("train.steps=3", "train.monitoring.eval_every=2"), model, tok, retriever, QUESTIONS, tmp_path,
           judge=varying_judge, on_step=lambda s, r: seen.append(r), evaluate=lambda m: {"em": 0.5})
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["timing/update_s"] for r in recs] == [
        r["timing/update_s"] for r in seen]
    for r in recs:
        evaluated = r["step"] in (2, 3)  # every 2 steps and at the last
        assert {k for k in r if k.startswith("timing/")} == {f"timing/{p}_s" for p in PHASES if p != "eval" or evaluated}
        assert all(r[f"timing/{p}_s"] >= 0 for p in PHASES if p != "eval" or evaluated)
        trained = sum(r[f"timing/{p}_s"] for p in ("rollout", "score", "advantages", "update", "sync"))
        assert trained <= r["step_s"] + 0.01 and r["timing/checkpoint_s"] > 0  # save_every=1: a checkpoint each step
    assert "rollout_s" not in recs[0]  # now timing/rollout_s


def test_a_checkpoint_written_before_its_record_was_logged_gets_the_record_back(tiny_policy_dir, retriever, tmp_path):
    """The checkpoint of a step is written before its record reaches metrics.jsonl; a run killed in between
    resumes at that step with nothing to redo, so the record the checkpoint kept is logged then."""
    from agent.backends.hf import load_model_and_tokenizer
    from training.infra.checkpoint import latest_checkpoint

    cfg = make_cfg("train.steps=2")
    model, tok = load(tiny_policy_dir)
    run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge, llm_factory=SeededLLM)
    path = tmp_path / "metrics.jsonl"
    first, second = path.read_text().splitlines()
    path.write_text(first + "\n")  # killed after step 2's checkpoint, before its record
    model, tok = load_model_and_tokenizer(str(latest_checkpoint(tmp_path)), device="cpu")
    out = run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, resume=True, judge=varying_judge,
                 llm_factory=SeededLLM)
    assert out["start_step"] == 2
    lines = path.read_text().splitlines()
    assert lines[0] == first and len(lines) == 2
    # the record as it was when the checkpoint was written (the phases after it were not timed yet)
    after = ("timing/log_s", "timing/checkpoint_s")
    assert json.loads(lines[1]) == {k: v for k, v in json.loads(second).items() if k not in after}
    run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, resume=True, judge=varying_judge, llm_factory=SeededLLM)
    assert path.read_text().splitlines() == lines  # logged once
