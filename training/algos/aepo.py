"""AEPO (Wang et al., 2025, "Arbitrary Entropy Policy Optimization", arXiv 2510.08141): hold the policy's
entropy at a target ``H`` by a REINFORCE term on temperature-adjusted samples, instead of an entropy bonus.

GRPO's entropy collapses; an entropy bonus fights it by adding ``-c * H(pi)`` to the loss, which biases the
optimisation towards entropy for its own sake. AEPO never differentiates the entropy. Each step:

1. the temperature follows the policy's entropy measured on the last update (the mean token entropy, nats):
   ``T = T_high`` when ``H(pi_old) <= H`` else ``T_low`` (:func:`aepo_temperature`): sampling at ``T > 1``
   flattens the distribution, at ``T < 1`` sharpens it;
2. a share of the questions is rolled out again at ``T`` and scored; the samples better than their group's
   mean (GRPO advantage above a small threshold) are kept, up to a budget, half of it when the entropy is
   above the target (:func:`aepo_select`);
3. those samples enter the update as REINFORCE samples with reward 1:
   ``grad J_AEPO = grad J_GRPO + alpha * E_{o ~ pi^T}[grad log pi(o | q) * R(q, o)]``
   (:func:`reinforce_pg`). Their "old" log-probabilities are the policy's at temperature 1, so the term pulls
   ``pi`` towards what the tempered policy found, and with it towards the tempered policy's entropy; it never
   dominates, since it only reinforces correct answers.

Reference implementation followed: ``RayPPOTrainer.fit`` (``alg == "AEPO"``) and ``_select_by_advantage`` in
``verl/trainer/ray_trainer.py`` of the authors' repository (597358816/AEPO, on EasyR1): ``T_high = 1.2``,
``T_low = 0.8``, target ``entropy_base = 0.5`` (the paper's best run: 0.75), advantage threshold 0.05,
``reinforce_sample_num = 60`` samples replacing the first rows of the GRPO batch (so ``alpha`` is the share of
the update they take; :func:`replace_rows` builds that batch), a quarter of the questions re-sampled at ``T``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from training.algos.options import check_range, parse_options
from training.registry import Options


@dataclass(frozen=True)
class AEPOOptions(Options):
    """AEPO's options: ``entropy_target`` ``H`` (mean token entropy, nats; the upper bound ``log V`` is checked
    by :func:`check_entropy_target` once the vocabulary is known), ``temperature_high`` / ``temperature_low``,
    ``advantage_threshold`` (samples with a GRPO advantage above it are kept), ``reinforce_samples`` (the
    per-step budget of REINFORCE samples), ``resample_fraction`` (the share of a step's questions rolled out
    again at ``T``) and ``coef`` (``alpha`` when the term is added to the loss, :func:`reinforce_pg`). Raises
    ``ValueError`` for ``H <= 0``, temperatures not ``0 < T_low <= 1 <= T_high`` with ``T_low < T_high``, a
    negative threshold, budget or coefficient, or a fraction outside (0, 1]."""

    entropy_target: float = 0.5
    temperature_high: float = 1.2
    temperature_low: float = 0.8
    advantage_threshold: float = 0.05
    reinforce_samples: int = 60
    resample_fraction: float = 0.25
    coef: float = 1.0

    def __post_init__(self) -> None:
        check_range("AEPO's entropy_target", self.entropy_target, 0.0, lo_open=True)
        if not (0.0 < self.temperature_low <= 1.0 <= self.temperature_high and self.temperature_low < self.temperature_high):
            raise ValueError("AEPO needs 0 < temperature_low <= 1 <= temperature_high with low < high, got "
                             f"temperature_low={self.temperature_low}, temperature_high={self.temperature_high}")
        check_range("AEPO's advantage_threshold", self.advantage_threshold, 0.0)
        if self.reinforce_samples < 0:
            raise ValueError(f"AEPO's reinforce_samples must be >= 0, got {self.reinforce_samples}")
        check_range("AEPO's resample_fraction", self.resample_fraction, 0.0, 1.0, lo_open=True)
        check_range("AEPO's coef", self.coef, 0.0)

    def check_model(self, vocab_size: int) -> None:
        """The entropy target against the policy's vocabulary: ``0 < H < log V`` (:func:`check_entropy_target`)."""
        check_entropy_target(self.entropy_target, vocab_size)


def aepo_options(values: dict[str, Any] | None = None, vocab_size: int | None = None) -> AEPOOptions:
    """:class:`AEPOOptions` from a mapping; with ``vocab_size`` the entropy target is also checked against
    ``log V`` (:func:`check_entropy_target`). ``ValueError`` for an unknown name or a value out of range."""
    opts = parse_options(AEPOOptions, values, "AEPO")
    if vocab_size is not None:
        check_entropy_target(opts.entropy_target, vocab_size)
    return opts


def check_entropy_target(target: float, vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``0 < target < log V`` (nats): a token distribution over ``V`` tokens has
    entropy in ``[0, log V]``, so a target outside can never be held (``log V`` is the uniform policy)."""
    if vocab_size < 2:
        raise ValueError(f"the vocabulary needs at least two tokens, got vocab_size={vocab_size}")
    check_range(f"AEPO's entropy target (nats, V={vocab_size})", target, 0.0, math.log(vocab_size),
                lo_open=True, hi_open=True)


def aepo_temperature(entropy: float, opts: AEPOOptions) -> float:
    """The temperature of this step's REINFORCE samples: ``T_high`` when the last update's mean token entropy
    (nats) is at or below the target, ``T_low`` above it. Raises ``ValueError`` for a NaN entropy."""
    if math.isnan(entropy):
        raise ValueError("AEPO got a NaN policy entropy")
    return opts.temperature_high if entropy <= opts.entropy_target else opts.temperature_low


def aepo_select(advantages: torch.Tensor, entropy: float, opts: AEPOOptions) -> torch.Tensor:
    """Which temperature-``T`` samples become REINFORCE samples: ``[k]`` int64 row indices, in batch order,
    of the samples whose advantage ``[N]`` (GRPO's, within their own groups) exceeds the threshold, at most
    ``reinforce_samples`` of them, half as many (rounded down) when ``entropy`` is above the target."""
    keep = (advantages.float() > opts.advantage_threshold).nonzero().squeeze(-1)
    budget = min(opts.reinforce_samples, keep.numel())
    if entropy > opts.entropy_target:
        budget //= 2
    return keep[:budget]


def reinforce_pg(logprobs: torch.Tensor, old_logprobs: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """AEPO's REINFORCE term per token, ``[B, T]`` (aggregate it over the policy tokens like the policy loss
    and add ``coef`` times it): ``-R_b * pi(y_t) / sg(pi_old(y_t))``, whose value is ``-R`` on policy and
    whose gradient is ``-R * grad log pi`` there (``pi_old`` is the policy at temperature 1, not the tempered
    sampler: no importance correction towards ``pi^T`` is intended). ``logprobs``, ``old_logprobs``:
    ``[B, T]`` float; ``rewards``: ``[B]`` (1 for the selected samples)."""
    ratio = torch.exp((logprobs - old_logprobs.detach()).clamp(-20.0, 20.0))
    return -rewards.to(logprobs.dtype).unsqueeze(-1) * ratio


def replace_rows(n_rows: int, n_selected: int) -> torch.Tensor:
    """The reference code's way of adding the term: the update batch is the ``n_selected`` REINFORCE samples
    followed by GRPO rows ``n_selected .. n_rows - 1`` (the first GRPO rows give way, so the batch keeps its
    size); returns the ``[n_rows - n_selected]`` int64 indices of the GRPO rows kept. Raises ``ValueError``
    when there are more samples than rows."""
    if not 0 <= n_selected <= n_rows:
        raise ValueError(f"cannot put {n_selected} REINFORCE samples into a batch of {n_rows} rows")
    return torch.arange(n_selected, n_rows)
