"""The ``train`` section: its nested layout, the earlier flat keys (read with a warning naming the new key, in a
YAML file and on the command line alike, giving the same config), the estimator's and the policy loss's own
options validated against their registered models, one validator for every registered choice, and the loss
settings built from the section."""

from __future__ import annotations

import warnings

import pytest
import yaml

from sleuth.config import ConfigError, load_config
from training.algos import estimators as E
from training.algos.losses import CISPOOptions, LossConfig
from training.config import FLAT_KEYS, DeprecatedConfigKey, TrainConfig, upgrade_train_keys
from training.registry import Options

OLD_YAML = """
train:
  algorithm: ppo
  critic: separate
  critic_lr: 1.0e-5
  vf_clip: 0.5
  steps: 7
  questions_per_step: 4
  group_size: 3
  lr: 1.0e-6
  warmup_steps: 5
  clip_low: 0.1
  clip_high: 0.3
  kl_coef: 0.001
  kl_mode: reward
  entropy_coef: 0.001
  loss_agg: seq-mean-token-mean
  max_grad_norm: 0.5
  async_rollouts: false
  rollout_retry_waits: [1.0]
  save_every: 3
  keep_checkpoints: 4
  eval_every: 2
  alarm_min_entropy: 0.05
  alarm_action: stop
"""
NEW_YAML = """
train:
  steps: 7
  algorithm:
    adv_estimator: ppo
    critic: separate
    cliprange_value: 0.5
    clip_ratio_low: 0.1
    clip_ratio_high: 0.3
    kl_coef: 0.001
    kl_mode: reward
    entropy_coeff: 0.001
    loss_agg_mode: seq-mean-token-mean
  rollout: {questions_per_step: 4, group_size: 3, asynchronous: false, retry_waits: [1.0]}
  optim: {lr: 1.0e-6, critic_lr: 1.0e-5, lr_warmup_steps: 5, grad_clip: 0.5}
  monitoring: {eval_every: 2, alarms: {min_entropy: 0.05, action: stop}}
  checkpoints: {save_every: 3, keep: 4}
"""


def _load(tmp_path, text, overrides=()):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_config(path, list(overrides))
    return cfg, [str(w.message) for w in seen if issubclass(w.category, DeprecatedConfigKey)]


def test_a_flat_yaml_gives_the_nested_config_with_a_warning_per_key_naming_the_new_one(tmp_path):
    old, warned = _load(tmp_path, OLD_YAML)
    new, none = _load(tmp_path, NEW_YAML)
    assert old.model_dump() == new.model_dump() and none == []
    (msg,) = warned  # one warning for the file, naming every old key's new one and where they were read
    assert msg.startswith(f"{tmp_path / 'c.yaml'}: deprecated flat train keys, read for one more release: ")
    assert msg.count(" -> ") == len(yaml.safe_load(OLD_YAML)["train"]) - 1  # every key but steps, which stays
    for pair in ("train.lr -> train.optim.lr", "train.algorithm -> train.algorithm.adv_estimator",
                 "train.alarm_action -> train.monitoring.alarms.action", "train.vf_clip -> train.algorithm.cliprange_value"):
        assert pair in msg
    t = new.train
    assert (t.algorithm.adv_estimator, t.algorithm.critic, t.optim.critic_lr, t.rollout.group_size,
            t.checkpoints.keep, t.monitoring.alarms.action) == ("ppo", "separate", 1e-5, 3, 4, "stop")


def test_flat_overrides_on_the_command_line_land_in_their_sections_without_replacing_them(tmp_path):
    """``train.algorithm=grpo`` (the earlier spelling, a name) over a file's ``algorithm:`` section sets the
    estimator and keeps the section's other keys."""
    cfg, warned = _load(tmp_path, NEW_YAML, ["train.algorithm=ppo", "train.lr=2e-6", "train.clip_high=0.4",
                                             "train.options.cispo_clip_low=0.5", "train.policy_loss=cispo"])
    a = cfg.train.algorithm
    assert (a.adv_estimator, a.critic, a.cliprange_value, a.clip_ratio_high, cfg.train.optim.lr) == (
        "ppo", "separate", 0.5, 0.4, 2e-6)
    assert isinstance(a.loss_options, CISPOOptions) and a.loss_options.clip_low == 0.5
    (msg,) = warned
    assert msg.startswith("override: deprecated flat train keys") and \
        "train.options.cispo_clip_low -> train.algorithm.loss_options.clip_low" in msg
    new, none = _load(tmp_path, NEW_YAML, ["train.algorithm.adv_estimator=ppo", "train.optim.lr=2e-6",
                                           "train.algorithm.clip_ratio_high=0.4", "train.algorithm.policy_loss=cispo",
                                           "train.algorithm.loss_options.clip_low=0.5"])
    assert new.model_dump() == cfg.model_dump() and none == []


def test_a_key_of_a_section_given_directly_below_train_is_pointed_to_its_place():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.adv_estimator'; did you mean "
                                          r"'train.algorithm.adv_estimator'\?"):
        load_config(None, ["train.adv_estimator=grpo"])
    with pytest.raises(ConfigError, match=r"'train.grad_clip'; did you mean 'train.optim.grad_clip'( or [^?]*)?\?"):
        load_config(None, ["train.grad_clip=0.5"])


def test_one_setting_in_both_spellings_is_an_error_naming_both():
    with pytest.raises(ConfigError, match="train.lr and train.optim.lr are the same setting"):
        load_config(None, ["train.lr=1e-3", "train.optim.lr=1e-4"])
    with pytest.raises(ValueError, match="train.lr and train.optim.lr"):
        upgrade_train_keys({"lr": 1e-3, "optim": {"lr": 1e-4}})
    # a flat key in the file and the new one on the command line: the override wins, as for any key
    assert load_config(None, ["train.optim.lr=1e-4"]).train.optim.lr == 1e-4


def test_every_flat_key_has_a_place_in_the_schema():
    for old, new in FLAT_KEYS.items():
        *path, last = new.split(".")
        model = TrainConfig
        for part in path:
            if part == "options":  # the estimator's own model: checked below
                break
            model = model.model_fields[part].annotation
        else:
            assert last in model.model_fields, f"train.{old} -> train.{new}"
    with pytest.warns(DeprecatedConfigKey, match="train.stratified_alpha -> train.algorithm.options.alpha"):
        cfg = TrainConfig(algorithm="stratified_grpo", stratified_alpha=0.3)  # flat keys in Python too
    assert cfg.algorithm.options.alpha == 0.3
    with pytest.warns(DeprecatedConfigKey):
        gigpo = TrainConfig(algorithm="gigpo", gigpo_omega=0.5, gigpo_std_norm=False)
    assert gigpo.algorithm.options.std_norm is False and gigpo.algorithm.options.omega == 0.5


def test_a_config_saved_by_the_earlier_release_loads_to_the_same_config(tmp_path):
    """Every run saved its whole config (config.yaml): the flat train section with every key, the settings of
    every estimator among them. It loads to the same config as today's keys; the settings of estimators
    other than the run's are dropped (that release ignored them), saying so."""
    new = load_config(None, ["train.algorithm.adv_estimator=ppo", "train.algorithm.critic=separate",
                             "train.optim.lr=3e-4", "train.monitoring.alarms.window=7"])
    dumped = new.model_dump()
    flat = {"steps": dumped["train"]["steps"], "dist_timeout_s": dumped["train"]["dist_timeout_s"], "options": {}}
    for old, path in FLAT_KEYS.items():
        if path.startswith("algorithm.options."):
            continue
        value = dumped["train"]
        for part in path.split("."):
            value = value[part]
        flat[old] = value
    flat.update(stratified_alpha=0.5, ig_coef=1.0, gigpo_omega=1.0, gigpo_std_norm=True)  # the old defaults
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**dumped, "train": flat}, sort_keys=False))
    with pytest.warns(DeprecatedConfigKey) as seen:
        old = load_config(tmp_path / "config.yaml")
    assert old.model_dump() == dumped
    msg = str(seen[0].message)
    assert "train.ig_coef (ignored: ppo has no such option)" in msg and "train.lr -> train.optim.lr" in msg
    # the same keys with the estimator that has the option: it is kept
    flat.update(algorithm="igpo", ig_coef=0.25, critic="none")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**dumped, "train": flat}, sort_keys=False))
    with pytest.warns(DeprecatedConfigKey, match=r"train.ig_coef -> train.algorithm.options.ig_coef"):
        assert load_config(tmp_path / "config.yaml").train.algorithm.options.ig_coef == 0.25


def test_estimator_options_are_its_own_model_validated_with_the_config():
    cfg = load_config(None, ["train.algorithm.adv_estimator=igpo", "train.algorithm.options.ig_coef=0.3"])
    assert isinstance(cfg.train.algorithm.options, E.IGPOOptions) and cfg.train.algorithm.options.ig_coef == 0.3
    assert type(load_config(None, ["train.algorithm.adv_estimator=igpo"]).train.algorithm.options) is E.IGPOOptions
    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'ig_cof' of advantage estimator 'igpo'.*"
                                          r"it takes ig_coef; did you mean train.algorithm.options.ig_coef\?"):
        load_config(None, ["train.algorithm.adv_estimator=igpo", "train.algorithm.options.ig_cof=0.3"])
    with pytest.raises(ConfigError, match=r"train.algorithm.options: Value error, IGPO's ig_coef must lie in "
                                          r"\[0.0, inf\), got -1.0"):
        load_config(None, ["train.algorithm.adv_estimator=igpo", "train.algorithm.options.ig_coef=-1"])
    with pytest.raises(ConfigError, match="train.algorithm.options.ig_coef expects a number, got the bool True"):
        load_config(None, ["train.algorithm.adv_estimator=igpo", "train.algorithm.options.ig_coef=yes"])
    with pytest.raises(ConfigError, match="train.algorithm.options.ig_coef: Input should be a valid number"):
        load_config(None, ["train.algorithm.adv_estimator=igpo", "train.algorithm.options.ig_coef=lots"])
    with pytest.raises(ConfigError, match="'grpo'.*it takes no options"):
        load_config(None, ["train.algorithm.options.alpha=0.3"])
    with pytest.raises(ConfigError, match="'ppo_clip'.*it takes no options"):
        load_config(None, ["train.algorithm.loss_options.clip_low=0.3"])
    # a name assigned later gets its own model's defaults; options another estimator does not take are refused
    tc = TrainConfig()
    tc.algorithm.adv_estimator = "gigpo"
    assert type(tc.algorithm.options) is E.GiGPOOptions and tc.algorithm.options.omega == 1.0
    with pytest.raises(ValueError, match="'grpo'"):
        TrainConfig(algorithm={"adv_estimator": "gigpo", "options": {"omega": 0.5}}).updated(
            {"algorithm.adv_estimator": "grpo", "algorithm.options": {"omega": 0.5}})
    assert type(TrainConfig(algorithm={"adv_estimator": "gigpo"}).updated(
        {"algorithm.adv_estimator": "grpo"}).algorithm.options) is Options


def test_a_saved_config_loads_back_with_its_options(tmp_path):
    from sleuth.config import dump_config

    cfg = load_config(None, ["train.algorithm.adv_estimator=gigpo", "train.algorithm.options.omega=0.25",
                             "train.algorithm.policy_loss=cispo", "train.algorithm.loss_options.clip_low=0.1"])
    dump_config(cfg, tmp_path / "config.yaml")
    back = load_config(tmp_path / "config.yaml")
    assert back.model_dump() == cfg.model_dump() and back.train.algorithm.options.omega == 0.25
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["algorithm"]["options"] == {
        "omega": 0.25, "std_norm": True}


def test_registered_choices_share_one_validator():
    for key, bad, kind in (("adv_estimator", "gpro", "advantage estimator"), ("policy_loss", "ppo", "policy loss"),
                           ("loss_agg_mode", "tokenmean", "loss aggregation"), ("kl_type", "k4", "KL estimator")):
        with pytest.raises(ConfigError, match=f"unknown {kind} '{bad}' \\(train.algorithm.{key}\\); registered: "):
            load_config(None, [f"train.algorithm.{key}={bad}"])


def test_checks_of_the_train_section_alone_fail_when_the_config_is_loaded():
    with pytest.raises(ConfigError, match="needs a value model"):
        load_config(None, ["train.algorithm.adv_estimator=ppo"])
    with pytest.raises(ConfigError, match="group-relative: train.rollout.group_size must be >= 2"):
        load_config(None, ["train.rollout.group_size=1"])
    assert load_config(None, ["train.rollout.group_size=1", "train.algorithm.adv_estimator=reinforce_pp"])
    with pytest.raises(ConfigError, match="asynchronous runs the agent loop without dynamic sampling"):
        load_config(None, ["train.rollout.asynchronous=true", "train.rollout.dynamic_sampling=true"])
    assert load_config(None, ["train.rollout.asynchronous=true"]).train.rollout.asynchronous
    with pytest.raises(ConfigError, match="mis_band must be"):
        load_config(None, ["train.algorithm.mis_band=[1.1,2.0]"])


def test_the_loss_settings_come_from_the_algorithm_section_once():
    alg = load_config(None, ["train.algorithm.policy_loss=cispo", "train.algorithm.loss_options.clip_low=0.2",
                             "train.algorithm.clip_ratio_low=0.1", "train.algorithm.clip_ratio_high=0.3",
                             "train.algorithm.clip_ratio_c=3", "train.algorithm.loss_agg_mode=seq-mean-token-mean",
                             "train.algorithm.kl_coef=0.01", "train.algorithm.kl_type=k1",
                             "train.algorithm.entropy_coeff=0.02"]).train.algorithm
    cfg = LossConfig.of(alg, loss_scale=512.0)
    assert cfg == LossConfig(loss="cispo", clip_low=0.1, clip_high=0.3, clip_ratio_c=3.0,
                             loss_agg="seq-mean-token-mean", loss_scale=512.0, kl_coef=0.01, kl_type="k1",
                             entropy_coef=0.02)
    assert cfg.options == CISPOOptions(clip_low=0.2)
    assert LossConfig.of(alg.model_copy(update={"loss_scale_factor": 64.0}), 512.0).loss_scale == 64.0
    assert type(LossConfig(loss="cispo").resolved().options) is CISPOOptions
    with pytest.raises(TypeError, match="takes CISPOOptions, got Options"):
        LossConfig(loss="cispo", options=Options()).resolved()


def test_a_registration_takes_only_frozen_options_dataclasses():
    from dataclasses import dataclass

    from training.algos.losses import register_policy_loss

    @dataclass(frozen=True)
    class NotOptions:  # a frozen dataclass, but no Options (e.g. a method's options class not wired yet)
        x: float = 1.0

    class Plain:
        x = 1.0

    for bad in (NotOptions, Plain, dict):
        with pytest.raises(TypeError, match="advantage estimator 'bad_options': options must be a frozen dataclass"):
            E.register_adv_est("bad_options", options=bad)
        with pytest.raises(TypeError, match="policy loss 'bad_options': options must be a frozen dataclass"):
            register_policy_loss("bad_options", options=bad)
    assert "bad_options" not in E.ADV_ESTIMATORS
