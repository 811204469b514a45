"""The typed training configuration: the ``sft`` and ``train`` sections of a run's config (pydantic; unknown
keys are errors). The composition root nests them in the whole run configuration (:mod:`sleuth.config`);
training functions take these sections, not the whole config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent.config import Section
from training.algos.estimators import ADV_ESTIMATORS
from training.algos.losses import KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES


def _default_retry_waits() -> list[float]:
    # imported when a config is made: faults imports the agent loop
    from training.rollout.faults import RETRY_WAITS_S

    return list(RETRY_WAITS_S)


class SFTConfig(Section):
    """Warm start on oracle trajectories (search the question, read, answer with the gold answer)."""

    enabled: bool = True
    epochs: int = Field(6, ge=0)
    lr: float = 1e-3
    batch_size: int = Field(16, ge=1)
    max_examples: int | None = None


class TrainConfig(Section):
    """Multi-turn policy-gradient training (GRPO by default); see :mod:`training.algos.advantages` for the
    estimators, :mod:`training.algos.losses` for the losses and :mod:`training.trainer` for the loop.

    ``algorithm``, ``policy_loss``, ``loss_agg`` and ``kl_type`` take the names registered in
    :data:`training.algos.estimators.ADV_ESTIMATORS`, :data:`training.algos.losses.POLICY_LOSSES`,
    :data:`training.algos.losses.LOSS_AGGS` and :data:`training.algos.losses.KL_ESTIMATORS` (a plugin module
    named in the config's ``plugins`` can register more); ``options`` carries a registered part's own
    settings."""

    algorithm: str = Field("grpo", description="advantage estimator (a registered name; ppo needs train.critic)")
    policy_loss: str = Field("ppo_clip", description="policy-gradient term (a registered name)")
    steps: int = Field(10, ge=0)
    questions_per_step: int = Field(8, ge=1)
    group_size: int = Field(4, ge=1)
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up (optimizer steps)")
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.2, ge=0.0, description="DAPO clip-higher when > clip_low")
    clip_ratio_c: float | None = Field(None, gt=1.0, description="dual-clip bound for negative advantages "
                                       "(Ye et al. 2020; verl's clip_ratio_c, 3 there); None = off")
    ppo_epochs: int = Field(1, ge=1)
    micro_batch: int = Field(16, ge=1, description="most trajectories per micro-batch")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="token budget per micro-batch (rows sorted by length, padding trimmed)")
    packing: bool = Field(
        False, description="sequence packing in the policy log-prob forward: real tokens of a micro-batch in one "
                           "row with block-diagonal attention, no padding; micro_batch_tokens then budgets the "
                           "sum of real lengths (same results as padded, see training.batch). Off by default: "
                           "pays off with flash-attention varlen (policy attn_implementation=flash_attention_2); "
                           "with sdpa/eager the packed row's dense L x L mask made the tiny policy 2-2.5x slower "
                           "on CPU")
    kl_coef: float = Field(0.0, ge=0.0)
    kl_type: str = Field("k3", description="KL estimator (registered: k1, k2, k3, abs)")
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL to the reference in the loss or as a reward penalty")
    entropy_coef: float = 0.0
    loss_agg: str = Field("token-mean", description="loss aggregation (registered: token-mean, seq-mean-token-sum, "
                          "seq-mean-token-mean, seq-mean-token-sum-norm)")
    loss_scale_factor: float | None = Field(
        None, gt=0, description="seq-mean-token-sum-norm's constant normaliser (Dr. GRPO's generation budget, "
                                "tokens); None: agent.max_total_tokens")
    max_grad_norm: float = 1.0
    # estimator options
    stratified_alpha: float = Field(0.5, ge=0.0, le=1.0, description="Stratified GRPO: weight of SAN vs global")
    critic: Literal["none", "separate", "shared"] = Field(
        "none", description="value model for PPO: separate (a copy of the policy backbone with a value head; "
                            "also under torchrun) or shared (a head on the policy's own hidden states; one "
                            "process only)")
    critic_lr: float = 1e-3
    vf_coef: float = Field(0.5, ge=0.0, description="value-loss weight (PPO's c1): scales the critic's loss before "
                           "its own gradient clipping (max_grad_norm) and AdamW step at critic_lr, so it mostly "
                           "sets how hard the clipping bites (verl's separate critic does not scale it)")
    vf_clip: float = Field(0.2, ge=0.0, description="clip range of the value update around the rollout's values")
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    ig_coef: float = Field(1.0, ge=0.0, description="IGPO: weight of the information gain turn reward")
    gigpo_omega: float = Field(1.0, ge=0.0, description="GiGPO: weight of the step-level (anchor-state) advantage")
    gigpo_std_norm: bool = Field(True, description="GiGPO: divide both levels by the group's std (the paper's "
                                 "F_norm = std); False: F_norm = 1 (mean_norm, verl-agent's default mode)")
    search_cost: float = Field(0.0, ge=0.0, description="reward cost per search call, folded in by turn")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal, refill")
    dynamic_sampling_max_tries: int = Field(3, ge=1, description="extra rollout rounds to refill a batch")
    rollout_retry_waits: list[float] = Field(
        default_factory=_default_retry_waits,
        description="seconds waited before each rerun of the episodes that failed because the retrieval server "
                    "or rollout backend was down ([]: no rerun, they are left out of the update)")
    # rollout correction (training.algos.offpolicy), verified weight sync (training.rollout.weight_sync),
    # async rollouts
    tis_cap: float | None = Field(
        2.0, gt=0, description="truncated importance sampling (Yao et al. 2025): each token's policy-gradient term "
                               "weighted by min(pi_old / pi_rollout, tis_cap), from the log-probs the rollout "
                               "backend reported; None = off (the drift is still logged)")
    mis_band: tuple[float, float] | None = Field(
        None, description="masked importance sampling: drop from the update the episodes whose sequence ratio "
                          "pi_old / pi_rollout (see mis_level) leaves [low, high], e.g. [0.5, 2.0]; None = off")
    mis_level: Literal["sequence", "geometric"] = Field(
        "sequence", description="MIS ratio of an episode: the product over its tokens, or its geometric mean")
    verify_sync: bool = Field(
        True, description="after each weight push to a rollout engine, check that it runs the trainer's weights "
                          "(tensor comparison for an in-process copy, a probe sequence's log-probs for an engine)")
    sync_probe_tol: float = Field(
        0.05, gt=0, description="largest mean |log-prob difference| (nats) over the probe's tokens between the "
                                "rollout engine and the trainer that still counts as the same weights")
    async_rollouts: bool = Field(
        False, description="generate the next step's rollouts while this step updates "
                           "(training.rollout.producer): one process only; rollouts are off-policy by up to "
                           "max_staleness updates")
    max_staleness: int = Field(
        1, ge=1, description="async: the most updates a rollout's weights may lag the trainer's when it is "
                             "trained on; older groups are generated again with the latest weights")
    # efficiency and scale
    lora: bool = False
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = 16.0
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False
    bf16: bool = Field(True, description="bf16 autocast for the update on GPU (ignored on CPU)")
    dist_timeout_s: float = Field(
        600.0, gt=0, description="torchrun: seconds a collective waits for the other ranks before the run fails")
    # bookkeeping and health
    save_every: int = Field(5, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    max_nonfinite_steps: int = Field(3, ge=1, description="stop after this many NaN/inf losses")
    eval_every: int = Field(0, ge=0, description="evaluate on held-out questions (data.test, eval.limit) every n "
                            "steps, logged as eval_*; the best eval_em is kept in checkpoints/best (0: never)")
    alarm_min_format_ok: float | None = Field(None, ge=0.0, le=1.0, description="alarm when validity falls below")
    alarm_min_entropy: float | None = Field(None, ge=0.0, description="alarm when policy entropy falls below")
    alarm_patience: int = Field(2, ge=1, description="consecutive steps below a threshold before the alarm")
    alarm_search_flat: float | None = Field(
        None, ge=0.0, description="search-depth plateau alarm: mean searches per episode of the hop classes within "
                                  "this of each other over alarm_window steps while their EM spans more than "
                                  "alarm_em_gap (needs metadata.hops; None: off)")
    alarm_em_gap: float = Field(0.2, ge=0.0, le=1.0, description="plateau alarm: EM spread across hop classes")
    alarm_window: int = Field(10, ge=1, description="plateau alarm: steps averaged per hop class")
    alarm_collapse_drop: float | None = Field(
        None, ge=0.0, description="collapse alarm: alarm_collapse_metric falls more than this below its best so far "
                                  "(None: off)")
    alarm_collapse_metric: str = Field("eval_em", description="collapse alarm: the step-record key watched (the "
                                       "held-out eval_em by default; e.g. eval_reward)")
    alarm_action: Literal["warn", "stop"] = Field("warn", description="stop: end the run, keeping the best checkpoint")
    options: dict[str, Any] = Field(default_factory=dict, description="settings of registered estimators and "
                                    "losses beyond the fields above (read by plugins: train.options.my_coef=0.5)")

    @field_validator("rollout_retry_waits")
    @classmethod
    def _waits(cls, v: list[float]) -> list[float]:
        if any(w < 0 for w in v):  # NaN and infinity are refused for every number field (Section)
            raise ValueError(f"train.rollout_retry_waits must be seconds >= 0, got {v}")
        return v

    @field_validator("algorithm")
    @classmethod
    def _registered_estimator(cls, v: str) -> str:
        return ADV_ESTIMATORS.check(v)

    @field_validator("policy_loss")
    @classmethod
    def _registered_loss(cls, v: str) -> str:
        return POLICY_LOSSES.check(v)

    @field_validator("loss_agg")
    @classmethod
    def _registered_agg(cls, v: str) -> str:
        return LOSS_AGGS.check(v)

    @field_validator("kl_type")
    @classmethod
    def _registered_kl(cls, v: str) -> str:
        return KL_ESTIMATORS.check(v)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        est = ADV_ESTIMATORS.get(self.algorithm)
        if est.critic and self.critic == "none":
            raise ValueError(f"train.algorithm={self.algorithm} needs a value model: set train.critic=separate or "
                             "shared")
        if self.mis_band is not None and not 0 < self.mis_band[0] <= 1.0 <= self.mis_band[1]:
            raise ValueError(f"train.mis_band must be [low, high] with 0 < low <= 1 <= high, got {list(self.mis_band)}")
        if est.groups and self.group_size < 2:
            raise ValueError(f"train.algorithm={self.algorithm} is group-relative: train.group_size must be >= 2")
        return self
