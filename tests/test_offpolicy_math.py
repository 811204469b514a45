"""Rollout correction's arithmetic (training.algos.offpolicy) on hand-computed cases: the log-ratio and which
tokens are known, the drift metrics (``kl_k3``'s value and sign), the TIS weights and the MIS band with both
of its edges. A plain namespace stands for the batch and the config, so this pins the functions' values
whatever shape ``TrainConfig`` takes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from training.algos.offpolicy import (
    LOG_RATIO_BOUND,
    QUANTILES,
    drift_stats,
    log_ratios,
    quantiles,
    rollout_correction,
    sequence_keep,
)

NAN = float("nan")
LN2 = math.log(2.0)


def train_config(**algorithm):
    """A train config whose ``train.algorithm`` section holds the rollout-correction settings ``algorithm``
    (``tis_cap``, ``mis_band``, ``mis_level``)."""
    return SimpleNamespace(algorithm=SimpleNamespace(**algorithm))


def batch(old, rollout, mask):
    return SimpleNamespace(old_logprobs=torch.tensor(old), rollout_logprobs=torch.tensor(rollout),
                           loss_mask=torch.tensor(mask), is_weights=None)


def test_log_ratios_known_tokens_and_the_bound():
    b = batch([[-1.0, -2.0, -30.0, 0.0], [-1.0, 1.0, 0.0, 0.0]],
              [[-1.5, NAN, -5.0, -3.0], [-26.0, -1.0, 0.0, 0.0]],
              [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    lr, known = log_ratios(b)
    # NaN rollout log-prob: unknown; off the mask: unknown; -30 - (-5) = -25 and -1 - (-26) = 25 bounded to 20
    assert known.tolist() == [[True, False, True, False], [True, True, False, False]]
    assert lr.tolist() == [[0.5, 0.0, -20.0, 0.0], [20.0, 2.0, 0.0, 0.0]]
    assert LOG_RATIO_BOUND == 20.0
    at_bound = batch([[-21.0, 19.0]], [[-1.0, -1.0]], [[1.0, 1.0]])
    assert log_ratios(at_bound)[0].tolist() == [[-20.0, 20.0]]  # exactly at the bound: kept
    assert log_ratios(batch([[0.0]], [[NAN]], [[1.0]])) is None  # no known token
    assert log_ratios(batch([[0.0]], [[-1.0]], [[0.0]])) is None  # none on the mask
    assert log_ratios(SimpleNamespace(rollout_logprobs=None, old_logprobs=torch.zeros(1, 1),
                                      loss_mask=torch.ones(1, 1))) is None
    assert log_ratios(SimpleNamespace(rollout_logprobs=torch.zeros(1, 1), old_logprobs=None,
                                      loss_mask=torch.ones(1, 1))) is None


def test_drift_stats_hand_computed():
    # log rho = [ln 2, 0, -ln 2, (masked: 5)] -> rho = [2, 1, 1/2]
    lr = torch.tensor([[LN2, 0.0], [-LN2, 5.0]])
    known = torch.tensor([[True, True], [True, False]])
    s = drift_stats(lr, known, cap=1.5)
    # k3 = mean(rho - 1 - log rho) = ((1 - ln 2) + 0 + (-1/2 + ln 2)) / 3 = 1/6: KL >= 0
    assert s["offpolicy/kl_k3"] == pytest.approx(1 / 6, rel=1e-6)
    assert s["offpolicy/lp_diff_abs_mean"] == pytest.approx(2 * LN2 / 3, rel=1e-6)
    assert s["offpolicy/lp_diff_abs_max"] == pytest.approx(LN2, rel=1e-6)
    assert s["offpolicy/ratio_max"] == pytest.approx(2.0, rel=1e-6)
    assert s["offpolicy/tis_capped"] == pytest.approx(1 / 3)  # only rho = 2 exceeds 1.5
    # torch.quantile (linear) of [0.5, 1, 2]
    want = {1: 0.51, 5: 0.55, 50: 1.0, 95: 1.9, 99: 1.98}
    for q, v in want.items():
        assert s[f"offpolicy/ratio_p{q:02d}"] == pytest.approx(v, rel=1e-5)
    assert set(s) == {"offpolicy/kl_k3", "offpolicy/lp_diff_abs_mean", "offpolicy/lp_diff_abs_max",
                      "offpolicy/ratio_max", "offpolicy/tis_capped", *(f"offpolicy/ratio_p{q:02d}" for q in want)}
    assert QUANTILES == (0.01, 0.05, 0.5, 0.95, 0.99)
    assert "offpolicy/tis_capped" not in drift_stats(lr, known, cap=None)
    # a ratio exactly at the cap (rho = exp(0) = 1) is not past it
    assert drift_stats(lr, known, cap=1.0)["offpolicy/tis_capped"] == pytest.approx(1 / 3)
    assert drift_stats(lr, known, cap=0.5 - 1e-6)["offpolicy/tis_capped"] == 1.0


def test_kl_k3_is_positive_and_asymmetric():
    """k3 of one token with rho = 2: 2 - 1 - ln 2 = 0.3069; with rho = 1/2: 1/2 - 1 + ln 2 = 0.1931."""
    one = torch.tensor([[True]])
    assert drift_stats(torch.tensor([[LN2]]), one, None)["offpolicy/kl_k3"] == pytest.approx(1 - LN2, rel=1e-6)
    assert drift_stats(torch.tensor([[-LN2]]), one, None)["offpolicy/kl_k3"] == pytest.approx(LN2 - 0.5, rel=1e-6)
    assert drift_stats(torch.tensor([[0.0]]), one, None)["offpolicy/kl_k3"] == 0.0


def test_quantiles_of_a_long_tensor_are_taken_on_an_even_subsample():
    assert quantiles(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]), (0.0, 0.25, 0.5, 1.0)) == [0.0, 1.0, 2.0, 4.0]
    n = (1 << 24) + 1  # over torch.quantile's limit: every 2nd value, 0, 2, ..., 2^24
    got = quantiles(torch.arange(n, dtype=torch.float32), (0.0, 0.5, 1.0))
    assert got == [0.0, float(1 << 23), float(1 << 24)]


def test_sequence_keep_band_edges_both_sides():
    lr = torch.tensor([[0.0, 0.0], [LN2, 0.0], [25.0, 0.0], [0.0, 0.0]])
    known = torch.tensor([[True, True], [True, True], [True, False], [False, False]])
    # sequence ratios: 1, 2, exp(20) (the sum of 25 is bounded first), no known token
    assert sequence_keep(lr, known, (1.0, 1.0), "sequence").tolist() == [True, False, False, True]
    assert sequence_keep(lr, known, (1.0 + 1e-6, 3.0), "sequence").tolist() == [False, True, False, True]
    assert sequence_keep(lr, known, (0.5, 1.0 - 1e-6), "sequence").tolist() == [False, False, False, True]
    assert sequence_keep(lr, known, (0.5, math.exp(20) * 1.001), "sequence").tolist() == [True, True, True, True]
    assert sequence_keep(lr, known, (0.5, math.exp(20) * 0.999), "sequence").tolist() == [True, True, False, True]
    # geometric: exp(mean log rho) over the known tokens: 1, sqrt 2, exp(25) (no bound on the mean)
    assert sequence_keep(lr, known, (1.0, 1.5), "geometric").tolist() == [True, True, False, True]
    assert sequence_keep(lr, known, (1.0, 1.4), "geometric").tolist() == [True, False, False, True]
    assert sequence_keep(lr, known, (1.42, 1e12), "geometric").tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="'sequence' or 'geometric', got 'token'"):
        sequence_keep(lr, known, (0.5, 2.0), "token")


def test_rollout_correction_weights_and_rejection():
    def fresh():  # row 0: log rho [ln 2, -ln 2]; row 1: [ln 2 * 3, 0 (off the mask)]; row 2: nothing known
        return batch([[-1.0 + LN2, -1.0 - LN2], [-1.0 + 3 * LN2, -1.0], [0.0, 0.0]],
                     [[-1.0, -1.0], [-1.0, -1.0], [NAN, NAN]], [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])

    b = fresh()
    stats = rollout_correction(b, train_config(tis_cap=4.0, mis_band=None, mis_level="sequence"))
    torch.testing.assert_close(b.is_weights, torch.tensor([[2.0, 0.5], [4.0, 1.0], [1.0, 1.0]]))  # 8 capped at 4
    assert b.is_weights.dtype == b.loss_mask.dtype and "offpolicy/mis_rejected" not in stats
    assert stats["offpolicy/tis_capped"] == pytest.approx(1 / 3)
    assert b.loss_mask.tolist() == [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]

    b = fresh()
    stats = rollout_correction(b, train_config(tis_cap=None, mis_band=(0.5, 4.0), mis_level="sequence"))
    assert b.is_weights is None
    # sequence ratios 1 (kept), 8 (dropped); row 2 has nothing known: kept, not counted as judged
    assert b.loss_mask.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert stats["offpolicy/mis_rejected"] == 0.5
    b = fresh()
    stats = rollout_correction(b, train_config(tis_cap=None, mis_band=[0.5, 8.5], mis_level="sequence"))
    assert stats["offpolicy/mis_rejected"] == 0.0 and b.loss_mask.sum() == 5

    none = batch([[0.0]], [[NAN]], [[1.0]])
    assert rollout_correction(none, train_config(tis_cap=2.0, mis_band=(0.5, 2.0), mis_level="sequence")) == {}
    assert none.is_weights is None and none.loss_mask.tolist() == [[1.0]]


def test_sequence_keep_negative_sums_and_one_token_rows():
    # a sequence ratio below 1 is not clamped up: -25 is bounded to -20 (ratio e^-20), -ln 4 is 1/4
    lr = torch.tensor([[-25.0, 0.0], [-2 * LN2, 0.0], [LN2, 0.0]])
    known = torch.tensor([[True, False], [True, False], [True, False]])  # one known token each
    assert sequence_keep(lr, known, (0.2, 0.3), "sequence").tolist() == [False, True, False]
    assert sequence_keep(lr, known, (math.exp(-20) * 0.999, math.exp(-20) * 1.001), "sequence").tolist() == [
        True, False, False]
    # geometric with one known token: the mean is the token's own log-ratio (ratio 2, not sqrt 2)
    assert sequence_keep(lr, known, (1.9, 2.1), "geometric").tolist() == [False, False, True]
    for level in ("arithmetic", "Sequence", ""):  # any other level, on either side of the valid names
        with pytest.raises(ValueError, match="'sequence' or 'geometric'"):
            sequence_keep(lr, known, (0.5, 2.0), level)


def test_mis_rejected_share_with_one_judged_row():
    # one row judged (ratio 8, outside the band: dropped), one with nothing known: the share is 1 of 1
    b = batch([[-1.0 + 3 * LN2, -1.0], [0.0, 0.0]], [[-1.0, -1.0], [NAN, NAN]], [[1.0, 1.0], [1.0, 1.0]])
    stats = rollout_correction(b, train_config(tis_cap=None, mis_band=(0.5, 4.0), mis_level="sequence"))
    assert stats["offpolicy/mis_rejected"] == 1.0 and b.loss_mask.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_quantiles_subsample_step_on_an_exact_multiple_of_the_limit():
    x = torch.zeros(1 << 25)  # twice the limit: every 2nd value, which are all the zeros (ones at odd places)
    x[1::2] = 1.0
    assert quantiles(x, (0.0, 0.5, 1.0)) == [0.0, 0.0, 0.0]
