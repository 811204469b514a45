"""The algorithm registries: the parts registered as registrations only (Dr. GRPO's constant normaliser, the
k2 and abs KL kinds) against hand-computed values, the config's allowed values coming from the registries,
and an estimator registered from outside the package training one step through ``sleuth train``."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from training.algos import losses as L
from training.registry import Registry


def test_registry_errors_name_the_key_the_names_and_close_matches():
    reg: Registry[int] = Registry("toy part", "train.toy")
    reg.add("alpha", 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("alpha", 2)
    reg.add("alpha", 3, replace=True)
    assert reg.get("alpha") == 3 and "alpha" in reg and reg.names() == ("alpha",)
    with pytest.raises(ValueError, match=r"unknown toy part 'alpah' \(train.toy\); registered: alpha; did you mean"):
        reg.get("alpah")
    with pytest.raises(ValueError, match="non-empty name"):
        reg.add("", 4)


def test_k2_and_abs_kl_by_hand():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    # log-ratios lp - ref: [0.5, -1.0, 0.0]
    torch.testing.assert_close(L.kl_estimate(lp, ref, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    torch.testing.assert_close(L.kl_estimate(lp, ref, "abs"), torch.tensor([0.5, 1.0, 0.0]))
    assert L.KL_ESTIMATORS.get("k2").kernel_id is None and L.KL_ESTIMATORS.get("k3").kernel_id == 3


def test_seq_mean_token_sum_counts_only_rows_with_tokens_and_the_norm_mode_divides_by_a_constant():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # the last row holds no token
    # row sums 3 and 6 over the two rows that hold tokens (the empty row is not counted, as in verl)
    assert float(L.aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx(4.5)
    # Dr. GRPO: (3 / 10 + 6 / 10) / 2 rows
    assert float(L.aggregate(values, mask, "seq-mean-token-sum-norm", scale=10.0)) == pytest.approx(0.45)
    assert float(L.aggregate(values, mask, "token-mean")) == pytest.approx(3.0)
    assert float(L.aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 6.0) / 2)
    with pytest.raises(ValueError, match="constant normaliser"):
        L.aggregate(values, mask, "seq-mean-token-sum-norm")
    assert L.LOSS_AGGS.get("seq-mean-token-sum-norm").unit == "rows"


def test_the_norm_mode_does_not_depend_on_the_padded_width():
    """The reason for the constant: the same tokens in a wider (more padded) batch weigh the same."""
    v = torch.tensor([[1.0, 2.0]])
    m = torch.tensor([[1.0, 1.0]])
    wide_v, wide_m = torch.cat([v, torch.zeros(1, 5)], 1), torch.cat([m, torch.zeros(1, 5)], 1)
    assert float(L.aggregate(v, m, "seq-mean-token-sum-norm", 4.0)) == float(
        L.aggregate(wide_v, wide_m, "seq-mean-token-sum-norm", 4.0)) == 0.75


def test_config_values_come_from_the_registries():
    from sleuth.config import ConfigError, load_config

    cfg = load_config(None, ["train.algorithm.kl_type=k2", "train.algorithm.loss_agg_mode=seq-mean-token-sum-norm",
                             "train.algorithm.loss_scale_factor=512"])
    assert cfg.train.algorithm.kl_type == "k2" and cfg.train.algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    with pytest.raises(ConfigError, match="unknown advantage estimator 'gpro'.*did you mean .*'grpo'"):
        load_config(None, ["train.algorithm.adv_estimator=gpro"])
    with pytest.raises(ConfigError, match="unknown KL estimator 'k9'"):
        load_config(None, ["train.algorithm.kl_type=k9"])
    with pytest.raises(ConfigError, match="unknown policy loss"):
        load_config(None, ["train.algorithm.policy_loss=nope"])


def test_plugin_errors_name_the_plugin(tmp_path):
    from sleuth.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="cannot import 'no_such_sleuth_plugin'"):
        load_config(None, ["plugins=[no_such_sleuth_plugin]"])
    bad = tmp_path / "bad_plugin.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="bad_plugin.py.*boom"):
        load_config(None, [f"plugins=[{bad}]"])
    with pytest.raises(ConfigError, match="list of module names"):
        load_config(None, ["plugins=3"])


def test_the_reference_loss_runs_the_parts_the_kernel_lacks_and_cuda_refuses_them(monkeypatch):
    from training.model import kernels as K

    g = torch.Generator().manual_seed(0)
    lp, old, adv = -torch.rand(2, 4, generator=g), -torch.rand(2, 4, generator=g), torch.randn(2, 4, generator=g)
    ref, mask = -torch.rand(2, 4, generator=g), torch.ones(2, 4)
    cfg = L.LossConfig(loss_agg="seq-mean-token-sum-norm", loss_scale=8.0, kl_coef=0.1, kl_type="abs")
    got, stats = K.policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref)
    want, _ = L.policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref)
    assert float(got) == float(want) and "kl" in stats
    monkeypatch.setenv(K.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="does not implement train.algorithm.loss_agg_mode=seq-mean-token-sum-norm"):
        K.policy_loss(lp, old, adv, mask, cfg, ref_logprobs=ref)


TOY_PLUGIN = """
from dataclasses import dataclass

import torch

from training.algos.estimators import register_outcome_adv_est
from training.registry import Options

CALLS = []


@dataclass(frozen=True)
class ToyOptions(Options):
    toy_value: float = 0.0


@register_outcome_adv_est("toy_constant", groups=False, options=ToyOptions)
def toy_constant(rewards, groups, search_calls, opts):
    CALLS.append(len(rewards))
    return torch.full_like(rewards, opts.toy_value)
"""


def test_an_estimator_registered_outside_the_package_trains_through_sleuth_train(tiny_data, bm25_index,
                                                                                 tiny_policy_dir, tmp_path):
    """Adding an estimator touches one file: a plugin module registers it, the config names it, and `sleuth
    train` runs a step with it (no edit to the trainer or the config schema)."""
    from sleuth.cli import main

    plugin = tmp_path / "toy_estimator.py"
    plugin.write_text(textwrap.dedent(TOY_PLUGIN))
    out = tmp_path / "run"
    rc = main(["train", f"out_dir={out}", f"data.corpus={tiny_data / 'corpus.jsonl'}",
               f"data.train={tiny_data / 'train.jsonl'}", f"data.test={tiny_data / 'test.jsonl'}",
               f"retrieval.index_dir={bm25_index}", f"policy.model={tiny_policy_dir}", "sft.enabled=false",
               f"plugins=[{plugin}]", "train.algorithm.adv_estimator=toy_constant", "train.algorithm.options.toy_value=0.25",
               "train.steps=1", "train.rollout.questions_per_step=2", "train.rollout.group_size=2", "agent.max_new_tokens=8",
               "agent.max_total_tokens=256"])
    assert rc == 0
    (record,) = [json.loads(x) for x in (out / "toy_constant" / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1
    # every policy token got the toy's constant advantage: its mean |advantage| is that constant
    assert record["adv_abs_mean"] == pytest.approx(0.25)
    assert (out / "toy_constant" / "checkpoints" / "latest").exists()


PREPARING_PLUGIN = '''
from dataclasses import dataclass

from training.algos.estimators import kl_reward_penalty, register_adv_est
from training.algos.options import check_range
from training.registry import Options

SEEN = []


@dataclass(frozen=True)
class SurpriseOptions(Options):
    scale: float = 1.0

    def __post_init__(self):
        check_range("surprise's scale", self.scale, 0.0)


def surprise(ctx):
    """A new input: each row's mean surprisal -log pi over its policy tokens, scored with the context's
    policy on the step's batch."""
    mask = ctx.batch.loss_mask
    lp = ctx.logprobs(ctx.batch).cpu()
    ctx.batch.prepared["surprise"] = -(lp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    SEEN.append({"step": ctx.step, "rows": len(ctx.trajs), "tokenizer": ctx.tokenizer is not None,
                 "worker": ctx.worker is not None, "old": ctx.batch.old_logprobs.clone(), "mask": mask.clone(),
                 "surprise": ctx.batch.prepared["surprise"].clone()})


@register_adv_est("surprise_bonus", options=SurpriseOptions, prepare=(kl_reward_penalty, surprise))
def surprise_bonus(inp, opts, alg):
    return {"advantages": opts.scale * inp.prepared["surprise"][:, None] * inp.mask}
'''


def test_an_estimator_with_an_input_of_its_own_is_one_registration_in_one_file(tiny_policy_dir, retriever,
                                                                               tmp_path):
    """An estimator needing something no other one computes declares it as a prepare step in its own module
    (no field in the batch type, no flag, no branch in the trainer), with its options validated by the config;
    the trainer runs the step on the step's batch with the models, the tokenizer and the rollout worker."""
    import sys

    from sleuth.config import load_config
    from tests.conftest import QUESTIONS, run_rl
    from tests.test_trainer import load, varying_judge

    plugin = tmp_path / "surprise_plugin.py"
    plugin.write_text(PREPARING_PLUGIN)
    cfg = load_config(None, [f"plugins=[{plugin}]", "train.algorithm.adv_estimator=surprise_bonus",
                             "train.algorithm.options.scale=0.5", "train.steps=2", "train.rollout.questions_per_step=2",
                             "train.rollout.group_size=2", "agent.max_turns=2", "agent.max_new_tokens=8",
                             "agent.max_total_tokens=200", "train.checkpoints.save_every=1"])
    assert cfg.train.algorithm.options.scale == 0.5
    with pytest.raises(ValueError, match="surprise's scale must lie in"):
        load_config(None, [f"plugins=[{plugin}]", "train.algorithm.adv_estimator=surprise_bonus",
                           "train.algorithm.options.scale=-1"])
    (module,) = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(plugin.resolve())]
    model, tok = load(tiny_policy_dir)
    out = run_rl(cfg, model, tok, retriever, QUESTIONS, tmp_path / "run", judge=varying_judge)
    seen = module.SEEN
    assert [(s["step"], s["rows"], s["tokenizer"], s["worker"]) for s in seen] == [(0, 4, True, True), (1, 4, True, True)]
    last = seen[-1]
    # the context's policy scores as the old log-probs were scored (same weights, before the update)
    want = -(last["old"] * last["mask"]).sum(-1) / last["mask"].sum(-1).clamp(min=1.0)
    torch.testing.assert_close(last["surprise"], want, rtol=1e-5, atol=1e-6)
    # the advantage of every policy token is 0.5 x its row's surprisal: mean |A| over the tokens
    expect = float((0.5 * last["surprise"].abs()[:, None] * last["mask"]).sum() / last["mask"].sum())
    assert out["last"]["adv_abs_mean"] == pytest.approx(expect, rel=1e-5)
