"""The weight-sync checks (training.rollout.weight_sync) on a two-parameter model, value by value: the probe's
tolerance on both sides, a NaN difference failing (``NaN <= tol`` is false, and must stay the failing side),
a short probe reply, the tensor comparison naming what differs or is missing, and what ``verify_engine``
checks on which backend. The end-to-end runs (an engine that skipped a tensor, unmerged LoRA adapters) are
in tests/test_weight_sync.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from training.rollout.weight_sync import (
    PROBE_MAX_TOKENS,
    PROBE_TEXT,
    WeightSyncError,
    check_engine,
    check_tensors,
    probe_ids,
    verify_engine,
)

IDS = [0, 1, 2, 1]


class Bigram(torch.nn.Module):
    """A causal LM whose next-token logits are a learned ``[V, V]`` table of the current token."""

    def __init__(self, V: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=g))
        self.bias = torch.nn.Parameter(torch.zeros(V))

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids] + self.bias)


def true_logprobs(model, ids):
    lp = torch.log_softmax(model.table[torch.tensor(ids[:-1])] + model.bias, -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


class Engine:
    """A rollout engine answering the probe with the trainer's log-probs plus ``offsets`` (or ``reply``)."""

    def __init__(self, model, offsets=None, reply=None, shared=None):
        self.model_ref, self.offsets, self.reply, self.shared_model = model, offsets, reply, shared
        self.probed = 0

    def probe_logprobs(self, ids):
        self.probed += 1
        if self.reply is not None:
            return self.reply
        base = true_logprobs(self.model_ref, ids)
        return [x + o for x, o in zip(base, self.offsets or [0.0] * len(base), strict=True)]


def test_check_engine_tolerance_both_sides_and_its_statistics():
    model = Bigram()
    stats = check_engine(Engine(model), model, IDS, tol=0.0)  # the same weights: difference 0, even at tol 0
    assert stats["sync/probe_lp_diff_mean"] == pytest.approx(0.0, abs=1e-6)
    off = [0.25, -0.5, 0.0]  # mean |diff| 0.25, max 0.5 (token 2)
    stats = check_engine(Engine(model, off), model, IDS, tol=0.25 + 1e-6)
    assert stats["sync/probe_lp_diff_mean"] == pytest.approx(0.25, abs=1e-6)
    assert stats["sync/probe_lp_diff_max"] == pytest.approx(0.5, abs=1e-6)
    assert set(stats) == {"sync/probe_lp_diff_mean", "sync/probe_lp_diff_max"}
    with pytest.raises(WeightSyncError, match=r"\(4 tokens of 'Question: Which city is the capital of F'\.\.\.\) "
                                              r"differ from the trainer's by 0\.25 nats per token on average "
                                              r"\(at most 0\.5, token 2\), "
                                              r"over train\.rollout\.sync_probe_tol=0\.2499"):
        check_engine(Engine(model, off), model, IDS, tol=0.2499)


def test_a_nan_difference_fails_the_probe():
    model = Bigram()
    nan = true_logprobs(model, IDS)
    nan[1] = math.nan
    with pytest.raises(WeightSyncError, match="does not run the trainer's weights.*nan nats"):
        check_engine(Engine(model, reply=nan), model, IDS, tol=1e9)
    with pytest.raises(WeightSyncError):
        check_engine(Engine(model, reply=[math.nan] * 3), model, IDS, tol=math.inf)


def test_a_probe_reply_of_another_length_fails():
    model = Bigram()
    short = true_logprobs(model, IDS)[:-1]
    with pytest.raises(WeightSyncError, match="scored 2 tokens of the weight-sync probe, not 3"):
        check_engine(Engine(model, reply=short), model, IDS, tol=1.0)
    with pytest.raises(WeightSyncError, match="scored 4 tokens"):
        check_engine(Engine(model, reply=short + [0.0, 0.0]), model, IDS, tol=1.0)


def test_check_tensors_names_what_differs_or_is_missing():
    a, b = Bigram(seed=0), Bigram(seed=0)
    state = {k: v.detach().clone() for k, v in a.state_dict().items()}
    assert check_tensors(b, state) == 2
    state["table"][0, 0] += 1e-6
    with pytest.raises(WeightSyncError, match=r"weight sync to the copy failed: 1 of 2 tensors differ .*\['table'\]\); "
                                              r"0 are missing"):
        check_tensors(b, state, "the copy")
    state = {"bias": a.bias.detach().clone(), "lm_head.weight": torch.zeros(1)}
    with pytest.raises(WeightSyncError, match=r"0 of 2 tensors differ.*1 are missing there \(e\.g\. \['lm_head\.weight'\]"):
        check_tensors(b, state)
    assert check_tensors(b, {}) == 0
    # the message names at most three of each
    four = torch.nn.Module()
    for k in "abcd":
        four.register_parameter(k, torch.nn.Parameter(torch.zeros(1)))
    pushed = {**{k: torch.ones(1) for k in "abcd"}, **{f"x{i}": torch.zeros(1) for i in range(4)}}
    with pytest.raises(WeightSyncError) as e:
        check_tensors(four, pushed)
    assert str(e.value) == ("weight sync to the rollout copy failed: 4 of 8 tensors differ from the trainer's after "
                            "the push (e.g. ['a', 'b', 'c']); 4 are missing there (e.g. ['x0', 'x1', 'x2'])")


def test_verify_engine_checks_what_the_backend_has():
    model = Bigram()
    tc = SimpleNamespace(rollout=SimpleNamespace(sync_probe_tol=1e-4))  # train.rollout.sync_probe_tol
    assert verify_engine(SimpleNamespace(model=model), model, {"bias": torch.ones(3)}, tc, IDS) == {}  # same model
    pushed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = Engine(model, shared=Bigram(seed=0))
    stats = verify_engine(engine, model, pushed, tc, IDS)
    assert stats["sync/tensors_checked"] == 2.0 and "sync/probe_lp_diff_mean" in stats and engine.probed == 1
    assert verify_engine(engine, model, None, tc, IDS).keys() == {"sync/probe_lp_diff_mean", "sync/probe_lp_diff_max"}
    assert verify_engine(engine, model, pushed, tc, None) == {"sync/tensors_checked": 2.0} and engine.probed == 2
    stale = Engine(model, shared=Bigram(seed=1))
    with pytest.raises(WeightSyncError, match="the rollout process's shared copy"):
        verify_engine(stale, model, pushed, tc, IDS)
    drifted = Engine(model, offsets=[0.0, 0.0, 0.01])
    with pytest.raises(WeightSyncError, match=r"train\.rollout\.sync_probe_tol=0\.0001"):
        verify_engine(drifted, model, None, tc, IDS)
    no_probe = SimpleNamespace(shared_model=None, probe_logprobs=None)
    assert verify_engine(no_probe, model, pushed, tc, IDS) == {}


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return list(range(len(text.split())))


def test_probe_ids_bound_both_sides():
    ids = probe_ids(WordTokenizer())
    assert ids == list(range(min(len(PROBE_TEXT.split()), PROBE_MAX_TOKENS))) and PROBE_MAX_TOKENS == 64

    class Long:
        def encode(self, text, add_special_tokens=False):
            return list(range(65))

    assert probe_ids(Long()) == list(range(64))

    class Two:
        def encode(self, text, add_special_tokens=False):
            return [7, 8]

    assert probe_ids(Two()) == [7, 8]

    class One:
        def encode(self, text, add_special_tokens=False):
            return [7]

    with pytest.raises(ValueError, match="the weight-sync probe has 1 token"):
        probe_ids(One())
