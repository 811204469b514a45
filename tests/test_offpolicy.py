"""Rollout correction (training.algos.offpolicy): the backend's sampled log-probs reach the batch, their drift
from the trainer's is logged, and truncated / masked importance sampling bound the update when the rollout
model is not the trainer's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from agent.trajectory import Role, Trajectory
from tests.conftest import QUESTIONS, run_rl
from tests.test_trainer import load, make_cfg, varying_judge
from training.algos.advantages import to_token_advantages


def _traj(roles, logprobs=None, ids=None):
    t = Trajectory("q", "q")
    for i, r in enumerate(roles):
        t.append([ids[i] if ids else 5 + i], Role(r), 1, None if logprobs is None else [logprobs[i]])
    return t


def test_collate_keeps_the_reported_logprobs_aligned_with_the_loss_mask():
    from training.batch import collate

    a = _traj([0, 0, 1, 1, 2, 1], logprobs=[0.0, 0.0, -0.5, -1.5, 0.0, -2.5])
    b = _traj([0, 1, 1])  # a backend that reports none: its row is NaN
    batch = collate([a, b], pad_id=0)
    assert batch.rollout_logprobs.shape == batch.loss_mask.shape == (2, 5)
    pol = batch.loss_mask[0].bool()
    assert batch.rollout_logprobs[0][pol].tolist() == [-0.5, -1.5, -2.5]
    assert torch.isnan(batch.rollout_logprobs[1]).all()
    sub = batch.select(torch.tensor([0]))
    assert sub.rollout_logprobs.shape == sub.loss_mask.shape
    assert collate([b], pad_id=0).rollout_logprobs is None


def _batch_with_drift(log_rho_rows, mask_rows=None):
    """A Batch whose old log-probs exceed the rollout's by ``log_rho`` on its policy tokens."""
    from training.batch import collate

    T = max(len(r) for r in log_rho_rows) + 1
    trajs = [_traj([0] + [1] * len(r) + [2] * (T - 1 - len(r)), logprobs=[0.0] * T) for r in log_rho_rows]
    batch = collate(trajs, pad_id=0)
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    for i, r in enumerate(log_rho_rows):
        batch.rollout_logprobs[i, : len(r)] = -1.0
        batch.old_logprobs[i, : len(r)] = -1.0 + torch.tensor(r)
    return batch


def test_tis_weights_are_the_ratio_capped_and_mis_drops_rows_outside_the_band():
    from training.algos.offpolicy import rollout_correction
    from training.config import TrainConfig

    rows = [[0.0, 0.0, 0.0], [2.0, -1.0, 0.1], [0.3, 0.3]]
    batch = _batch_with_drift(rows)
    stats = rollout_correction(batch, TrainConfig(algorithm={"tis_cap": 2.0}))
    w = batch.is_weights
    assert w[0, :3].tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(w[1, :3], torch.tensor([2.0, torch.e ** -1, torch.e ** 0.1]))  # e^2 capped at 2
    assert stats["offpolicy/lp_diff_abs_max"] == pytest.approx(2.0)
    assert stats["offpolicy/lp_diff_abs_mean"] == pytest.approx((2 + 1 + 0.1 + 0.6) / 8)
    assert stats["offpolicy/tis_capped"] == pytest.approx(1 / 8)
    assert stats["offpolicy/ratio_max"] == pytest.approx(torch.e ** 2, rel=1e-5)
    assert stats["offpolicy/ratio_p50"] == pytest.approx((1 + torch.e ** 0.1) / 2)  # of 8 ratios
    assert stats["offpolicy/kl_k3"] > 0
    assert "offpolicy/mis_rejected" not in stats and batch.loss_mask.sum() == 8

    batch = _batch_with_drift(rows)
    stats = rollout_correction(batch, TrainConfig(algorithm={"tis_cap": None, "mis_band": (0.5, 2.0)}))
    assert batch.is_weights is None
    # row sums of log rho: 0, 1.1 (e^1.1 = 3.0 > 2: dropped), 0.6 (1.82: kept)
    assert batch.loss_mask.sum(-1).tolist() == [3.0, 0.0, 2.0]
    assert stats["offpolicy/mis_rejected"] == pytest.approx(1 / 3)
    batch = _batch_with_drift(rows)
    rollout_correction(batch, TrainConfig(algorithm={"tis_cap": None, "mis_band": (0.5, 1.3), "mis_level": "geometric"}))
    # geometric means: 1, e^(1.1/3) = 1.44 (dropped), e^0.3 = 1.35 (dropped)
    assert batch.loss_mask.sum(-1).tolist() == [3.0, 0.0, 0.0]


def test_no_reported_logprobs_means_no_correction_and_no_metrics():
    from training.algos.offpolicy import rollout_correction
    from training.batch import collate
    from training.config import TrainConfig

    batch = collate([_traj([0, 1, 1])], pad_id=0)
    batch.old_logprobs = torch.zeros_like(batch.loss_mask)
    assert rollout_correction(batch, TrainConfig()) == {} and batch.is_weights is None


def test_mis_band_must_hold_one():
    from pydantic import ValidationError

    from training.config import TrainConfig

    with pytest.raises(ValidationError, match="mis_band"):
        TrainConfig(algorithm={"mis_band": (1.2, 2.0)})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_weights_folded_into_the_advantages_equal_the_weighted_loss(agg, clip_c):
    """The CUDA kernel gets the IS weights folded into the advantages (ppo_clip is positively homogeneous
    in A, dual-clip included): loss and gradient must equal the reference's weighted policy term."""
    from training.algos.losses import LossConfig, policy_loss

    g = torch.Generator().manual_seed(3)
    B, T = 4, 7
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = lp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    w = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2.5).clamp(max=2.0)
    cfg = LossConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, clip_ratio_c=clip_c)
    a, sa = policy_loss(lp, old, adv, mask, cfg, is_weights=w)
    b, sb = policy_loss(lp, old, adv * w, mask, cfg)
    torch.testing.assert_close(a, b)
    ga, = torch.autograd.grad(a, lp)
    gb, = torch.autograd.grad(b, lp)
    torch.testing.assert_close(ga, gb)
    assert sa["pg_loss"] == pytest.approx(sb["pg_loss"])
    plain, _ = policy_loss(lp, old, adv, mask, cfg)
    assert not torch.allclose(a, plain)  # the weights did change the loss


class PerturbedRollouts:
    """A transformers backend on a copy of the trainer's policy with Gaussian noise (std ``noise``) added to
    its LM head: the deliberately mismatched rollout engine (never synced: it has no ``update_weights``).
    The tiny policy's own next-token distributions are nearly uniform, so the noisy copy samples tokens the
    trainer's policy rates up to tens of times likelier than the copy did."""

    def __init__(self, model, tokenizer, noise=0.2):
        from agent.backends.hf import TransformersLLM

        noisy = copy.deepcopy(model)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            w = noisy.get_output_embeddings().weight
            w.add_(torch.randn(w.shape, generator=g) * noise)
        self.inner = TransformersLLM(noisy, tokenizer)
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)


def _spy_weights(monkeypatch):
    """Record the IS weights and the loss of every micro-batch the update computes."""
    import training.model.actor as ACT

    seen = []
    real = ACT.policy_loss

    def spy(*a, **kw):
        loss, stats = real(*a, **kw)
        seen.append((kw.get("is_weights"), float(loss.detach())))
        return loss, stats

    monkeypatch.setattr(ACT, "policy_loss", spy)
    return seen


def test_a_perturbed_rollout_model_is_measured_and_the_correction_bounds_the_update(tiny_policy_dir, retriever,
                                                                                    tmp_path, monkeypatch):
    """The rollout engine samples from a noisy copy of the policy: the drift shows in metrics.jsonl and
    TensorBoard, TIS caps every token's weight at C (ratios far above it), the loss stays finite, and the
    update's gradient is bounded where the uncapped weights would blow it up."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = _spy_weights(monkeypatch)
    model, tok = load(tiny_policy_dir)
    cfg = make_cfg("train.steps=1", "train.rollout.group_size=3", "train.algorithm.tis_cap=2.0")
    out = run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path, judge=varying_judge, llm_factory=PerturbedRollouts)
    rec = out["last"]
    assert rec["offpolicy/ratio_max"] > 10 and rec["offpolicy/tis_capped"] > 0.02
    assert rec["offpolicy/lp_diff_abs_mean"] > 0.3
    assert seen and all(w is not None and float(w.max()) <= 2.0 and float(w.min()) > 0 for w, _ in seen)
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in seen)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["offpolicy/ratio_p99"] == pytest.approx(rec["offpolicy/ratio_p99"])
    tags = EventAccumulator(str(tmp_path / "tb")).Reload().Tags()["scalars"]
    assert {"offpolicy/lp_diff_abs_mean", "offpolicy/ratio_p50", "offpolicy/tis_capped"} <= set(tags)


def test_the_cap_bounds_the_gradient_when_one_reported_logprob_is_far_off(tiny_policy_dir, retriever):
    """On-policy rollouts but for one token whose reported log-prob is 15 nats too low (an engine's rounding
    of a rare token): the uncapped importance weight e^15 multiplies that token's gradient and swamps the
    update; TIS caps it at C, and the gradient stays that of the on-policy batch's order."""
    from agent.backends.hf import TransformersLLM
    from agent.loop.batch import run_episodes
    from training.algos.offpolicy import rollout_correction
    from training.batch import collate
    from training.model.actor import score_logprobs, update_policy

    cfg = make_cfg()
    model, tok = load(tiny_policy_dir)
    torch.manual_seed(0)
    trajs = run_episodes(QUESTIONS, TransformersLLM(model, tok), retriever, cfg.agent, n_samples=2)
    norms, stats = {}, {}
    for name, cap in (("on-policy", None), ("tis", 2.0), ("uncapped", 1e30)):
        m, _ = load(tiny_policy_dir)
        b = collate(trajs, tok.pad_token_id)
        b.token_advantages = to_token_advantages(torch.linspace(-1, 1, len(b)), b.loss_mask)
        row, col = (b.loss_mask > 0).nonzero()[len(b) // 2].tolist()
        b.rollout_logprobs[row, col] -= 15.0
        tc = cfg.train.updated({"algorithm.tis_cap": cap, "optim.grad_clip": 1e30})
        score_logprobs(m, None, b, tc)
        stats[name] = rollout_correction(b, tc)
        if cap is not None:
            assert float(b.is_weights.max()) == pytest.approx(min(cap, float(stats[name]["offpolicy/ratio_max"])))
        norms[name] = update_policy(m, None, torch.optim.SGD(m.parameters(), lr=0.0), b, tc)["grad_norm"]
    assert stats["tis"]["offpolicy/ratio_max"] > 1e6 and stats["tis"]["offpolicy/ratio_p50"] == pytest.approx(1, abs=1e-3)
    assert stats["tis"]["offpolicy/tis_capped"] > 0
    assert norms["tis"] < 3 * norms["on-policy"]
    assert norms["uncapped"] > 1e3 * norms["tis"]


def test_each_turn_is_corrected_against_its_own_version_and_turns_past_the_bound_are_dropped():
    """Partial rollouts: turn 1 generated by weights 3, turn 2 by weights 4 (pushed mid-episode), the trainer at
    5. Each token's staleness is its own turn's; TIS weighs each token by its own turn's behaviour log-prob;
    asynchronously with max_staleness=1 the turn of version 3 is left out of the update."""
    from agent.trajectory import Turn
    from training.algos.offpolicy import rollout_correction, turn_staleness
    from training.batch import collate
    from training.config import TrainConfig

    t = Trajectory("q", "q")
    t.append([5], Role.PROMPT, 0, [0.0])
    t.append([6, 7], Role.POLICY, 1, [-1.0, -1.0])  # turn 1 (version 3)
    t.append([8], Role.TOOL, 1, [0.0])
    t.append([9, 10], Role.POLICY, 2, [-2.0, -2.0])  # turn 2 (version 4)
    t.turns = [Turn(1, "a", "search", weight_version=3), Turn(2, "b", "answer", weight_version=4)]
    other = _traj([0, 1, 1])  # a backend that reports no version
    batch = collate([t, other], pad_id=0)
    batch.old_logprobs = torch.full_like(batch.loss_mask, -1.5)
    st = turn_staleness(batch, [t, other], version=5)
    pol = batch.loss_mask[0].bool()
    assert st[0][pol].tolist() == [2.0, 2.0, 1.0, 1.0] and torch.isnan(st[1]).all()
    assert turn_staleness(batch, [other, other], version=5) is None

    tc = TrainConfig(algorithm={"tis_cap": 2.0})
    stats = rollout_correction(batch, tc, st)
    # rho = exp(-1.5 - (-1)) on turn 1, exp(-1.5 - (-2)) on turn 2: each turn its own behaviour log-probs
    got = batch.is_weights[0][pol].tolist()
    assert got == pytest.approx([0.6065307, 0.6065307, 1.6487213, 1.6487213], rel=1e-6)
    assert stats["offpolicy/turn_staleness_mean"] == 1.5 and stats["offpolicy/turn_staleness_max"] == 2.0
    assert stats["offpolicy/lp_diff_abs_mean_stale2"] == pytest.approx(0.5)
    assert "offpolicy/stale_tokens_dropped" not in stats  # synchronous: nothing dropped
    assert batch.loss_mask[0].sum() == 4

    asynchronous = TrainConfig(rollout={"asynchronous": True, "max_staleness": 1})
    stats = rollout_correction(batch, asynchronous, st)
    assert stats["offpolicy/stale_tokens_dropped"] == 2.0
    assert batch.loss_mask[0][pol].tolist() == [0.0, 0.0, 1.0, 1.0] and batch.loss_mask[1].sum() == 2
    asynchronous2 = TrainConfig(rollout={"asynchronous": True, "max_staleness": 2})
    assert rollout_correction(batch, asynchronous2, st)["offpolicy/stale_tokens_dropped"] == 0.0
