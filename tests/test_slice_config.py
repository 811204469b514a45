"""Config schema: YAML + dotted overrides, unknown keys named."""

from pathlib import Path

import pytest

from sleuth.config import ConfigError, load_config, parse_overrides


def test_quickstart_config_loads_and_overrides_apply():
    cfg = load_config("configs/quickstart.yaml", ["train.steps=3", "agent.max_turns=2", "policy.model=some/model"])
    assert cfg.train.steps == 3 and cfg.agent.max_turns == 2 and cfg.policy.model == "some/model"
    assert cfg.agent.reward == "f1"  # from the file


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
        load_config(None, ["train.lrr=1e-4"])
    with pytest.raises(ConfigError, match="unknown config key 'nonsense'"):
        load_config(None, ["nonsense=1"])


def test_invalid_value_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("agent:\n  max_turns: 0\n")
    with pytest.raises(ConfigError, match="agent.max_turns"):
        load_config(p)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["train.steps"])
    assert parse_overrides(["a.b=1e-3", "c=[1, 2]"]) == {"a": {"b": 1e-3}, "c": [1, 2]}


def test_missing_config_file():
    with pytest.raises(FileNotFoundError):
        load_config("does/not/exist.yaml")


def test_malformed_yaml_is_a_config_error_naming_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  lr: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml.*not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="override 'train.optim.lr=\\[1'.*not valid YAML"):
        load_config(None, ["train.optim.lr=[1"])
    with pytest.raises(ConfigError, match="not a file"):
        load_config(tmp_path)


def test_unknown_key_suggests_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.optim\.lrr'; did you mean 'train\.optim\.lr'\?"):
        load_config(None, ["train.optim.lrr=1e-4"])
    # a typo of an earlier flat key: its new place
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'; did you mean 'train\.optim\.lr'\?"):
        load_config(None, ["train.lrr=1e-4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'agent\.max_turn'; did you mean 'agent\.max_turns'"):
        load_config(None, ["agent.max_turn=2"])
    with pytest.raises(ConfigError, match=r"'retreival'; did you mean 'retrieval'"):
        load_config(None, ["retreival.top_k=2"])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["zzzz=1"])
    assert "did you mean" not in str(e.value)


def test_numbers_given_to_text_fields_are_text_and_nan_is_an_error():
    """An override or YAML value that reads as a number (``out_dir=2024``, a model named ``1.5``) is the text
    the user wrote in a text field; NaN and infinity are not values of any numeric field."""
    cfg = load_config(None, ["out_dir=2024", "policy.model=1.5"])
    assert cfg.out_dir == "2024" and cfg.policy.model == "1.5"
    for bad in ("train.optim.lr=nan", "train.optim.lr=inf", "train.algorithm.clip_ratio_high=-inf"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])


def test_a_bool_is_not_a_number():
    """YAML reads ``true``/``yes`` as a bool, which pydantic would take as 1 for an int field; every numeric
    field (int, float, optional or not) refuses it by name, and bool fields still take bools."""
    for bad in ("retrieval.top_k=true", "train.steps=yes", "train.optim.lr=false", "agent.max_turns=on"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[-1]):
            load_config(None, [bad])
    assert load_config(None, ["agent.backend.enforce_eager=false"]).agent.backend.enforce_eager is False


def test_chat_template_on_off_unquoted():
    """YAML reads an unquoted ``on``/``off`` as a bool; ``agent.chat_template=off`` still means "off"."""
    assert load_config(None, ["agent.chat_template=off"]).agent.chat_template == "off"
    assert load_config(None, ["agent.chat_template=on"]).agent.chat_template == "on"
    with pytest.raises(ConfigError, match="chat_template"):
        load_config(None, ["agent.chat_template=maybe"])


def test_dual_clip_bound_must_exceed_one():
    assert load_config(None, ["train.algorithm.clip_ratio_c=3"]).train.algorithm.clip_ratio_c == 3.0
    assert load_config(None, []).train.algorithm.clip_ratio_c is None  # off by default
    with pytest.raises(ConfigError, match="train.algorithm.clip_ratio_c"):
        load_config(None, ["train.algorithm.clip_ratio_c=1"])


def test_negative_eval_temperature_is_an_error():
    # 0 is greedy; a negative temperature was accepted and meant greedy on one backend, an error on another
    assert load_config(None, ["eval.temperature=0"]).eval.temperature == 0.0
    with pytest.raises(ConfigError, match="eval.temperature"):
        load_config(None, ["eval.temperature=-0.5"])


def test_a_quoted_override_is_the_string_as_written():
    """The override error says 'quote it to pass a string', but every quoted value that Python's float()
    reads became a float first: out_dir="007" was '7.0', policy.model="1.50" '1.5', "1e-3" '0.001' (and
    unquoted out_dir=infinity 'inf'). Only an unquoted 1e-4-style number (a string to YAML 1.1) is a float."""
    cfg = load_config(None, ['out_dir="007"', "policy.model='1.50'", 'eval.judge_model="1e-3"'])
    assert (cfg.out_dir, cfg.policy.model, cfg.eval.judge_model) == ("007", "1.50", "1e-3")
    assert load_config(None, ["out_dir=infinity"]).out_dir == "infinity"
    assert load_config(None, ["train.optim.lr=1e-4"]).train.optim.lr == 1e-4  # unquoted, still a number
    assert load_config(None, ["train.optim.lr=5E-3", "train.optim.weight_decay=-1.5e-2"]).train.optim.weight_decay == -1.5e-2
    assert load_config(None, ['train.optim.lr="2e-4"']).train.optim.lr == 2e-4  # a quoted number is still a float field's value


def test_tiny_policy_shapes_are_checked():
    """policy.tiny with a hidden size that num_heads does not divide into an even head size, or num_heads not
    a multiple of num_kv_heads, built and saved a model whose first forward failed with 'The size of tensor
    a (19) must match ...'; the config names the keys now."""
    for bad in (["policy.tiny.num_heads=5"], ["policy.tiny.num_kv_heads=4"],
                ["policy.tiny.hidden_size=90"], ["policy.tiny.num_layers=0"]):
        with pytest.raises(ConfigError, match="policy.tiny"):
            load_config(None, bad)
    for f in ("configs/quickstart.yaml", "configs/synthetic.yaml", "configs/synthetic_ppo.yaml"):
        load_config(Path(__file__).resolve().parents[1] / f)
    assert load_config(None, ["policy.tiny.hidden_size=64", "policy.tiny.num_heads=4"]).policy.tiny.num_heads == 4
