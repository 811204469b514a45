"""The typed training configuration: the ``sft`` and ``train`` sections of a run's config (pydantic; unknown
keys are errors). The composition root nests them in the whole run configuration (:mod:`sleuth.config`);
training functions take these sections, not the whole config.

``train`` is grouped as verl groups its trainer config (verl's names where it has one):

* ``algorithm``: the RL objective: the advantage estimator (``adv_estimator``) and its own ``options``, the
  discount (``gamma``, ``lam``), the search cost, the policy loss (clip ratios, PPO epochs, loss aggregation,
  entropy bonus) and its ``loss_options``, the KL to the reference, PPO's value model and value loss, and
  the rollout correction (TIS / MIS);
* ``rollout``: questions per step, group size, DAPO's dynamic sampling, reruns of failed episodes,
  asynchronous rollouts, the weight-sync check, a fleet of rollout engines and the weight push to it;
* ``optim``: learning rates, weight decay, warm-up, gradient clipping, micro-batches and packing, LoRA,
  gradient checkpointing, bf16;
* ``monitoring``: the held-out evaluation, the non-finite-loss limit, the health alarms;
* ``checkpoints``: how often a checkpoint is written and how many are kept;
* ``steps`` and ``dist_timeout_s`` stay at the top.

Everything the ``train`` section alone decides is validated here, when the config is loaded (ranges, the
registered names, the estimator's and the loss's options, the combinations that cannot train); what needs
another section or the running system is checked when training starts (:func:`training.trainer.check_setup`,
:func:`training.trainer.check_world`). The flat keys of the earlier release (``train.lr``,
``train.algorithm: grpo``, ...) are accepted with a :class:`DeprecatedConfigKey` warning naming the new key
(:func:`upgrade_train_keys`, :data:`FLAT_KEYS`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
import warnings
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agent.config import Section
from training.algos.estimators import ADV_ESTIMATORS
from training.algos.losses import KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from training.algos.rewards import REWARDS
from training.registry import Options, Registry
from training.rollout.strategies import ROLLOUT_STRATEGIES
from training.sft_data import SFT_DATA


def choice(registry: Registry[Any]) -> Any:
    """The config field type of a choice among ``registry``'s names: a ``str`` that must be registered when
    the config is validated (:meth:`training.registry.Registry.check`, whose ``ValueError`` names the key, the
    registered names and the closest matches): the one validator of every registered choice. The names are
    looked up at validation time, so what a plugin registered before is valid."""
    return Annotated[str, AfterValidator(registry.check)]


EstimatorName = choice(ADV_ESTIMATORS)
PolicyLossName = choice(POLICY_LOSSES)
LossAggName = choice(LOSS_AGGS)
KLName = choice(KL_ESTIMATORS)
RewardName = choice(REWARDS)
SFTDataName = choice(SFT_DATA)
StrategyName = choice(ROLLOUT_STRATEGIES)


def options_validator(field: str, name_field: str, registry: Registry[Any], key: str) -> Any:
    """The config validator of ``field``, the settings of the entry of ``registry`` named by the section's
    ``name_field``: :func:`registered_options` (errors name ``key``); the base :class:`Options` when the name
    itself failed validation (its error is the one to read)."""

    def validate(cls: Any, v: Any, info: ValidationInfo) -> Any:
        name = info.data.get(name_field)
        if name is None:
            return Options()
        return registered_options(registry, name, v, key)

    return field_validator(field, mode="before")(validate)


def _default_retry_waits() -> list[float]:
    # imported when a config is made: faults imports the agent loop
    from training.rollout.faults import RETRY_WAITS_S

    return list(RETRY_WAITS_S)


class SFTConfig(Section):
    """The warm start before RL: ``epochs`` of supervised training on the trajectories of the SFT data builder
    ``data`` (a registered name, :data:`training.sft_data.SFT_DATA`: ``oracle`` by default, the scripted oracle
    that searches the question, reads and answers with the gold answer; ``primed``, ``random`` or ``correct``
    for behaviour priming and its baselines), its settings in ``data_options``."""

    enabled: bool = True
    epochs: int = Field(6, ge=0)
    lr: float = 1e-3
    batch_size: int = Field(16, ge=1)
    max_examples: int | None = None
    data: SFTDataName = Field("oracle", description="the SFT data builder (a registered name)")
    data_options: SerializeAsAny[Options] = Field(
        default_factory=Options, description="the builder's own settings (its registered options class)")

    _data_options = options_validator("data_options", "data", SFT_DATA, "sft.data_options")

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        if type(self.data_options) is not SFT_DATA.get(self.data).options:
            self.__dict__["data_options"] = registered_options(SFT_DATA, self.data, self.data_options,
                                                               "sft.data_options")
        return self


def registered_options(registry: Registry[Any], name: str, raw: Any, key: str) -> Options:
    """``raw`` (a mapping, or an instance) as the :class:`training.registry.Options` class of ``registry``'s
    entry ``name``: its values converted to the field types and its own range checks run. An instance of
    another entry's class (after a name was changed) keeps the values it set away from their defaults.
    Raises ``ValueError`` naming ``key``: an unknown option with its closest match and the options the entry
    takes, a bool given for a number, or the option whose value is invalid."""
    model = registry.get(name).options
    if type(raw) is model:
        return raw
    if isinstance(raw, Options):
        raw = {f.name: getattr(raw, f.name) for f in dataclasses.fields(raw) if getattr(raw, f.name) != f.default}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{key} must be a mapping of {name}'s options, got {raw!r}")  # noqa: TRY004 - pydantic's
    hints = typing.get_type_hints(model)
    takes = [f.name for f in dataclasses.fields(model)]
    unknown = [k for k in raw if k not in takes]
    if unknown:
        close = {k: difflib.get_close_matches(str(k), takes, n=1) for k in unknown}
        near = "".join(f"; did you mean {key}.{c[0]}?" for c in close.values() if c)
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} of {registry.kind} {name!r} ({key}); "
                         f"it takes {', '.join(takes) if takes else 'no options'}{near}")
    for k, v in raw.items():  # YAML's true/yes/on is no number (pydantic would read it as 1)
        kinds = set(typing.get_args(hints[k])) or {hints[k]}
        if isinstance(v, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError(f"{key}.{k} expects a number, got the bool {v}")
    try:
        return TypeAdapter(model).validate_python(raw)
    except ValidationError as e:
        msgs = [f"{key}.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ValueError("; ".join(m.replace(f"{key}.: ", f"{key}: ") for m in msgs)) from None


class AlgorithmConfig(Section):
    """The RL objective (verl's ``algorithm`` and the actor's loss settings). ``adv_estimator``,
    ``policy_loss``, ``loss_agg_mode`` and ``kl_type`` take the names registered in
    :data:`training.algos.estimators.ADV_ESTIMATORS` and :mod:`training.algos.losses` (a plugin module named
    in the config's ``plugins`` can register more); ``options`` are the estimator's own settings (its
    registered :class:`training.registry.Options` class, e.g. ``ig_coef`` for IGPO) and ``loss_options`` the
    policy loss's (e.g. CISPO's ``clip_low``), both validated against the chosen entry's class."""

    adv_estimator: EstimatorName = Field("grpo", description="advantage estimator (a registered name; ppo needs "
                                         "train.algorithm.critic)")
    options: SerializeAsAny[Options] = Field(
        default_factory=Options, description="the estimator's own settings (its registered options class: unknown "
                                             "keys are errors)")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount over tokens (PPO's GAE) or turns (IGPO, "
                         "GiGPO)")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE's lambda (PPO)")
    search_cost: float = Field(0.0, ge=0.0, description="reward cost per search call, folded in by turn")
    reward: RewardName = Field("judge", description="the reward trained on (a registered name): judge (the "
                               "judge's own), egrpo (E-GRPO's entity reward), ikea (IKEA's knowledge-boundary "
                               "reward), ssrl (SSRL's format and rule reward)")
    reward_options: SerializeAsAny[Options] = Field(
        default_factory=Options, description="the reward's own settings (its registered options class)")
    policy_loss: PolicyLossName = Field("ppo_clip", description="policy-gradient term (a registered name)")
    loss_options: SerializeAsAny[Options] = Field(
        default_factory=Options, description="the policy loss's own settings (its registered options class)")
    clip_ratio_low: float = Field(0.2, ge=0.0, description="PPO clip range below 1 (the ratio's floor is 1 - low)")
    clip_ratio_high: float = Field(0.2, ge=0.0, description="PPO clip range above 1; DAPO clip-higher when > "
                                   "clip_ratio_low")
    clip_ratio_c: float | None = Field(None, gt=1.0, description="dual-clip bound for negative advantages "
                                       "(Ye et al. 2020; verl's clip_ratio_c, 3 there); None = off")
    ppo_epochs: int = Field(1, ge=1, description="updates on each rollout batch")
    loss_agg_mode: LossAggName = Field("token-mean", description="loss aggregation (registered: token-mean, "
                                       "seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm)")
    loss_scale_factor: float | None = Field(
        None, gt=0, description="seq-mean-token-sum-norm's constant normaliser (Dr. GRPO's generation budget, "
                                "tokens); None: agent.max_total_tokens")
    entropy_coeff: float = Field(0.0, description="entropy bonus weight in the loss")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the KL to the reference (0: no reference model)")
    kl_type: KLName = Field("k3", description="KL estimator (registered: k1, k2, k3, abs)")
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL to the reference in the loss or as a "
                                               "reward penalty")
    critic: Literal["none", "separate", "shared"] = Field(
        "none", description="value model for PPO: separate (a copy of the policy backbone with a value head; "
                            "also under torchrun) or shared (a head on the policy's own hidden states; one "
                            "process only)")
    vf_coef: float = Field(0.5, ge=0.0, description="value-loss weight (PPO's c1): scales the critic's loss before "
                           "its own gradient clipping (optim.grad_clip) and AdamW step at optim.critic_lr, so it "
                           "mostly sets how hard the clipping bites (verl's separate critic does not scale it)")
    cliprange_value: float = Field(0.2, ge=0.0, description="clip range of the value update around the rollout's "
                                   "values")
    tis_cap: float | None = Field(
        2.0, gt=0, description="truncated importance sampling (Yao et al. 2025): each token's policy-gradient term "
                               "weighted by min(pi_old / pi_rollout, tis_cap), from the log-probs the rollout "
                               "backend reported; None = off (the drift is still logged)")
    mis_band: tuple[float, float] | None = Field(
        None, description="masked importance sampling: drop from the update the episodes whose sequence ratio "
                          "pi_old / pi_rollout (see mis_level) leaves [low, high], e.g. [0.5, 2.0]; None = off")
    mis_level: Literal["sequence", "geometric"] = Field(
        "sequence", description="MIS ratio of an episode: the product over its tokens, or its geometric mean")

    _estimator_options = options_validator("options", "adv_estimator", ADV_ESTIMATORS, "train.algorithm.options")

    _loss_options = options_validator("loss_options", "policy_loss", POLICY_LOSSES, "train.algorithm.loss_options")

    _reward_options = options_validator("reward_options", "reward", REWARDS, "train.algorithm.reward_options")

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        # options of the chosen entries' own models (the defaults, or after a name was assigned a new value)
        for key, registry, name in (("options", ADV_ESTIMATORS, self.adv_estimator),
                                    ("loss_options", POLICY_LOSSES, self.policy_loss),
                                    ("reward_options", REWARDS, self.reward)):
            value = getattr(self, key)
            if type(value) is not registry.get(name).options:
                self.__dict__[key] = registered_options(registry, name, value, f"train.algorithm.{key}")
        est = ADV_ESTIMATORS.get(self.adv_estimator)
        if est.critic and self.critic == "none":
            raise ValueError(f"train.algorithm.adv_estimator={self.adv_estimator} needs a value model: set "
                             "train.algorithm.critic=separate or shared")
        if self.mis_band is not None and not 0 < self.mis_band[0] <= 1.0 <= self.mis_band[1]:
            raise ValueError("train.algorithm.mis_band must be [low, high] with 0 < low <= 1 <= high, got "
                             f"{list(self.mis_band)}")
        return self


class RolloutConfig(Section):
    """How a step's episodes are sampled (verl's ``rollout``): ``questions_per_step`` questions (verl's
    ``data.train_batch_size``) of ``group_size`` episodes each (verl's ``rollout.n``)."""

    questions_per_step: int = Field(8, ge=1)
    group_size: int = Field(4, ge=1, description="episodes per question")
    strategy: StrategyName = Field("plain", description="how a group's episodes are sampled (a registered rollout "
                                   "strategy: plain, arpo, rexrag, ssp, ...)")
    strategy_options: SerializeAsAny[Options] = Field(
        default_factory=Options, description="the rollout strategy's own settings (its registered options class: "
                                             "unknown keys are errors)")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal, refill")
    dynamic_sampling_max_tries: int = Field(3, ge=1, description="extra rollout rounds to refill a batch")
    retry_waits: list[float] = Field(
        default_factory=_default_retry_waits,
        description="seconds waited before each rerun of the episodes that failed because the retrieval server "
                    "or rollout backend was down ([]: no rerun, they are left out of the update)")
    asynchronous: bool = Field(
        False, description="generate the next step's rollouts while this step updates "
                           "(training.rollout.producer): one process, or under torchrun with engines (a fleet); "
                           "rollouts are off-policy by up to max_staleness updates")
    max_staleness: int = Field(
        1, ge=1, description="asynchronous: the most updates a rollout's weights may lag the trainer's when it is "
                             "trained on; older groups are generated again with the latest weights")
    verify_sync: bool = Field(
        True, description="after each weight push to a rollout engine, check that it runs the trainer's weights "
                          "(tensor comparison for an in-process copy, a probe sequence's log-probs for an engine)")
    sync_probe_tol: float = Field(
        0.05, gt=0, description="largest mean |log-prob difference| (nats) over the probe's tokens between the "
                                "rollout engine and the trainer that still counts as the same weights")

    engines: list[str] | int | None = Field(
        None, description="a fleet of rollout engines apart from the trainer (docs/fleet.md): a list of "
                          "OpenAI-compatible server URLs (vllm serve, sleuth serve-engine), or a count of sleuth "
                          "serve-engine processes the trainer starts on 127.0.0.1 (one node); None: every rank rolls "
                          "out on its own copy (colocated)")
    engine_model: str | None = Field(None, description="fleet: the served model name every engine must report "
                                     "(None: whatever they serve, the same on all)")
    engine_timeout_s: float = Field(600.0, gt=0, description="fleet: seconds per generation request (longer than "
                                    "the longest weight push: engines hold requests while their weights change)")
    engine_threads: int = Field(1, ge=1, description="fleet started by the trainer: CPU threads per engine")
    sync_transport: Literal["gloo", "nccl", "disk"] = Field(
        "gloo", description="fleet weight push: a gloo (CPU) or NCCL (GPU) transfer group, or safetensors buckets "
                            "on a shared disk (sync_shared_dir)")
    sync_bucket_bytes: int = Field(1 << 30, ge=1, description="fleet weight push: most bytes per bucket (the "
                                   "extra memory of trainer rank 0 and of each engine)")
    sync_shared_dir: str | None = Field(None, description="fleet weight push over disk: a directory every engine "
                                        "reads at the same path")
    sync_master_address: str = Field("127.0.0.1", description="fleet weight push over a group: trainer rank 0's "
                                     "address the engines reach")
    sync_timeout_s: float = Field(600.0, gt=0, description="fleet weight push: the group's formation, each "
                                  "broadcast and each engine call (seconds)")

    @field_validator("engines")
    @classmethod
    def _engines(cls, v: list[str] | int | None) -> list[str] | int | None:
        if isinstance(v, bool):
            raise ValueError("train.rollout.engines must be a list of URLs or a count, got a bool")  # noqa: TRY004
        if isinstance(v, int) and not 1 <= v <= 64:
            raise ValueError(f"train.rollout.engines: a count of engines to start must be in [1, 64], got {v}")
        if isinstance(v, list):
            if not v:
                raise ValueError("train.rollout.engines: an empty list; give engine URLs, a count, or leave it unset")
            bad = [u for u in v if not u.strip().startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"train.rollout.engines: URLs must start with http:// or https://, got {bad}")
            roots = [u.strip().rstrip("/").removesuffix("/v1") for u in v]
            if len(set(roots)) < len(roots):
                raise ValueError(f"train.rollout.engines: an engine is listed twice: {v}")
        return v

    _strategy_options = options_validator("strategy_options", "strategy", ROLLOUT_STRATEGIES, "train.rollout.strategy_options")

    @field_validator("retry_waits")
    @classmethod
    def _waits(cls, v: list[float]) -> list[float]:
        if any(w < 0 for w in v):  # NaN and infinity are refused for every number field (Section)
            raise ValueError(f"train.rollout.retry_waits must be seconds >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        entry = ROLLOUT_STRATEGIES.get(self.strategy)
        if type(self.strategy_options) is not entry.options:  # the default, or after the name was assigned
            self.__dict__["strategy_options"] = registered_options(ROLLOUT_STRATEGIES, self.strategy,
                                                                   self.strategy_options, "train.rollout.strategy_options")
        if entry.check is not None:
            entry.check(self.strategy_options, self)
        if self.asynchronous and self.strategy != "plain":
            raise ValueError(f"train.rollout.asynchronous samples plain groups in the background: set "
                             f"train.rollout.strategy=plain or train.rollout.asynchronous=false (got {self.strategy})")
        if self.asynchronous and self.dynamic_sampling:
            raise ValueError("train.rollout.asynchronous runs the agent loop without dynamic sampling: set "
                             "train.rollout.dynamic_sampling=false or train.rollout.asynchronous=false")
        if self.engines is not None and self.sync_transport == "disk" and not self.sync_shared_dir:
            raise ValueError("train.rollout.sync_transport=disk needs train.rollout.sync_shared_dir: a directory "
                             "every engine reads")
        return self

    @property
    def fleet(self) -> bool:
        """Whether rollouts run on a fleet of engines (``engines`` is set)."""
        return self.engines is not None


class OptimConfig(Section):
    """The optimisation (verl's ``actor.optim`` and the actor's batch and memory settings): AdamW on the policy
    (and at ``critic_lr`` on PPO's value model), a linear warm-up, gradient clipping, micro-batches."""

    lr: float = 2e-4
    weight_decay: float = 0.0
    lr_warmup_steps: int = Field(0, ge=0, description="linear LR warm-up (optimizer steps)")
    grad_clip: float = Field(1.0, description="largest global gradient norm (policy and critic alike)")
    critic_lr: float = Field(1e-3, description="the value model's learning rate (PPO)")
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
    lora: bool = False
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = 16.0
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    gradient_checkpointing: bool = False
    bf16: bool = Field(True, description="bf16 autocast for the update on GPU (ignored on CPU)")


class AlarmsConfig(Section):
    """The training-health alarms (:class:`training.infra.monitors.Alarms`, same names)."""

    min_format_ok: float | None = Field(None, ge=0.0, le=1.0, description="alarm when validity falls below")
    min_entropy: float | None = Field(None, ge=0.0, description="alarm when policy entropy falls below")
    patience: int = Field(2, ge=1, description="consecutive steps below a threshold before the alarm")
    search_flat: float | None = Field(
        None, ge=0.0, description="search-depth plateau alarm: mean searches per episode of the hop classes within "
                                  "this of each other over `window` steps while their EM spans more than em_gap "
                                  "(needs metadata.hops; None: off)")
    em_gap: float = Field(0.2, ge=0.0, le=1.0, description="plateau alarm: EM spread across hop classes")
    window: int = Field(10, ge=1, description="plateau alarm: steps averaged per hop class")
    collapse_drop: float | None = Field(
        None, ge=0.0, description="collapse alarm: collapse_metric falls more than this below its best so far "
                                  "(None: off)")
    collapse_metric: str = Field("eval_em", description="collapse alarm: the step-record key watched (the held-out "
                                 "eval_em by default; e.g. eval_reward)")
    action: Literal["warn", "stop"] = Field("warn", description="stop: end the run, keeping the best checkpoint")


class MonitoringConfig(Section):
    """What watches a run: the held-out evaluation, the non-finite-loss limit, the health alarms."""

    eval_every: int = Field(0, ge=0, description="evaluate on held-out questions (data.test, eval.limit) every n "
                            "steps, logged as eval_*; the best eval_em is kept in checkpoints/best (0: never)")
    max_nonfinite_steps: int = Field(3, ge=1, description="stop after this many NaN/inf losses")
    alarms: AlarmsConfig = Field(default_factory=AlarmsConfig)


class CheckpointsConfig(Section):
    """Checkpoints of the run (``checkpoints/step_*``, ``latest``; ``best`` with held-out evaluation)."""

    save_every: int = Field(5, ge=1, description="steps between checkpoints (the last step is always saved)")
    keep: int = Field(2, ge=1, description="step checkpoints kept (older ones are deleted)")


class TrainConfig(Section):
    """Multi-turn policy-gradient training (GRPO by default); see :mod:`training.algos.estimators` for the
    estimators, :mod:`training.algos.losses` for the losses and :mod:`training.trainer` for the loop. The
    sections are described in the module docstring."""

    steps: int = Field(10, ge=0)
    dist_timeout_s: float = Field(
        600.0, gt=0, description="torchrun: seconds a collective waits for the other ranks before the run fails")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    checkpoints: CheckpointsConfig = Field(default_factory=CheckpointsConfig)

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        return upgrade_train_keys(data) if isinstance(data, dict) else data

    def updated(self, changes: dict[str, Any]) -> TrainConfig:
        """A validated copy with ``changes`` applied, keyed by dotted paths below ``train``
        (``{"optim.lr": 1e-3, "algorithm.adv_estimator": "ppo", "algorithm.critic": "separate"}``). Raises
        ``pydantic.ValidationError`` as the constructor does. Another estimator (policy loss) starts from its
        own default options unless ``changes`` gives them."""
        data = self.model_dump()
        for name, opts in (("algorithm.adv_estimator", "algorithm.options"),
                           ("algorithm.policy_loss", "algorithm.loss_options"),
                           ("algorithm.reward", "algorithm.reward_options"),
                           ("rollout.strategy", "rollout.strategy_options")):
            if name in changes and opts not in changes:
                section, key = opts.split(".")
                data[section][key] = {}
        for key, value in changes.items():
            *path, last = key.split(".")
            d = data
            for part in path:
                d = d[part]
            d[last] = value
        return TrainConfig.model_validate(data)

    def check_model(self, vocab_size: int) -> None:
        """The checks of the chosen estimator's, policy loss's and reward's options that need the policy
        (:meth:`training.registry.Options.check_model`; ``vocab_size``: tokens of its output layer), run when
        training starts (``sleuth train`` before SFT, :func:`training.trainer.rl_train` before the first step).
        Raises ``ValueError`` naming the setting."""
        alg = self.algorithm
        for key, opts in (("options", alg.options), ("loss_options", alg.loss_options),
                          ("reward_options", alg.reward_options)):
            try:
                opts.check_model(vocab_size)
            except ValueError as e:
                raise ValueError(f"train.algorithm.{key}: {e}") from None

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        est = ADV_ESTIMATORS.get(self.algorithm.adv_estimator)
        if est.groups and self.rollout.group_size < 2:
            raise ValueError(f"train.algorithm.adv_estimator={self.algorithm.adv_estimator} is group-relative: "
                             "train.rollout.group_size must be >= 2")
        return self


# -- the flat keys of the earlier release -------------------------------------------------------------------
class DeprecatedConfigKey(DeprecationWarning):
    """A config key of the earlier, flat ``train`` section; the message names the key to use instead.
    :func:`sleuth.config.load_config` shows it (Python hides a ``DeprecationWarning`` outside ``__main__``
    unless a filter says otherwise)."""


#: the flat ``train`` keys of the earlier release -> their place now (dotted, below ``train``)
FLAT_KEYS: dict[str, str] = {
    "algorithm": "algorithm.adv_estimator", "policy_loss": "algorithm.policy_loss",
    "clip_low": "algorithm.clip_ratio_low", "clip_high": "algorithm.clip_ratio_high",
    "clip_ratio_c": "algorithm.clip_ratio_c", "ppo_epochs": "algorithm.ppo_epochs",
    "loss_agg": "algorithm.loss_agg_mode", "loss_scale_factor": "algorithm.loss_scale_factor",
    "entropy_coef": "algorithm.entropy_coeff", "kl_coef": "algorithm.kl_coef", "kl_type": "algorithm.kl_type",
    "kl_mode": "algorithm.kl_mode", "gamma": "algorithm.gamma", "lam": "algorithm.lam",
    "search_cost": "algorithm.search_cost", "critic": "algorithm.critic", "vf_coef": "algorithm.vf_coef",
    "vf_clip": "algorithm.cliprange_value", "tis_cap": "algorithm.tis_cap", "mis_band": "algorithm.mis_band",
    "mis_level": "algorithm.mis_level", "stratified_alpha": "algorithm.options.alpha",
    "ig_coef": "algorithm.options.ig_coef", "gigpo_omega": "algorithm.options.omega",
    "gigpo_std_norm": "algorithm.options.std_norm",
    "questions_per_step": "rollout.questions_per_step", "group_size": "rollout.group_size",
    "dynamic_sampling": "rollout.dynamic_sampling", "dynamic_sampling_max_tries": "rollout.dynamic_sampling_max_tries",
    "rollout_retry_waits": "rollout.retry_waits", "async_rollouts": "rollout.asynchronous",
    "max_staleness": "rollout.max_staleness", "verify_sync": "rollout.verify_sync",
    "sync_probe_tol": "rollout.sync_probe_tol",
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "warmup_steps": "optim.lr_warmup_steps",
    "max_grad_norm": "optim.grad_clip", "critic_lr": "optim.critic_lr", "micro_batch": "optim.micro_batch",
    "micro_batch_tokens": "optim.micro_batch_tokens", "packing": "optim.packing", "lora": "optim.lora",
    "lora_rank": "optim.lora_rank", "lora_alpha": "optim.lora_alpha", "lora_dropout": "optim.lora_dropout",
    "lora_targets": "optim.lora_targets", "gradient_checkpointing": "optim.gradient_checkpointing",
    "bf16": "optim.bf16",
    "eval_every": "monitoring.eval_every", "max_nonfinite_steps": "monitoring.max_nonfinite_steps",
    **{f"alarm_{k}": f"monitoring.alarms.{k}" for k in ("min_format_ok", "min_entropy", "patience", "search_flat",
                                                         "em_gap", "window", "collapse_drop", "collapse_metric",
                                                         "action")},
    "save_every": "checkpoints.save_every", "keep_checkpoints": "checkpoints.keep",
}
#: the flat ``train.options`` entries that belong to the policy loss now (the rest are the estimator's)
FLAT_LOSS_OPTIONS = {"cispo_clip_low": "algorithm.loss_options.clip_low"}


def upgrade_train_keys(train: dict[str, Any], source: str | None = None) -> dict[str, Any]:
    """A ``train`` mapping with the earlier release's flat keys (:data:`FLAT_KEYS`; ``algorithm`` and
    ``critic`` given as a name; ``options`` as one flat mapping) moved to their sections, with one
    :class:`DeprecatedConfigKey` warning naming each old key's new one (and ``source``, where they were
    read). The settings of one estimator given to another one (``stratified_alpha`` with ``algorithm: grpo``,
    as every run's saved ``config.yaml`` of that release holds) are dropped, as that release ignored them. A
    mapping without flat keys is returned as it is (not copied). Raises ``ValueError`` when a key is given in
    both spellings."""
    moves: list[tuple[str, str, Any]] = []
    for old, value in train.items():
        if old in ("algorithm", "critic") and isinstance(value, dict):
            continue  # the section itself (algorithm), or a mapping where a name belongs: the schema's error
        if old == "options" and isinstance(value, dict):
            moves.extend((f"options.{k}", FLAT_LOSS_OPTIONS.get(k, f"algorithm.options.{k}"), v) for k, v in value.items())
        elif old in FLAT_KEYS:
            moves.append((old, FLAT_KEYS[old], value))
    if not moves and not isinstance(train.get("options"), dict):
        return train
    out = {k: copy.deepcopy(v) for k, v in train.items()
           if k not in {m[0].split(".")[0] for m in moves} | {"options"}}
    name = train.get("algorithm")
    takes = None  # the named estimator's options (None: unknown here, e.g. a plugin's not imported yet)
    if isinstance(name, str) and name in ADV_ESTIMATORS:
        takes = {f.name for f in dataclasses.fields(ADV_ESTIMATORS.get(name).options)}
    notes = []
    for old, new, value in moves:
        if takes is not None and old in FLAT_KEYS and new.startswith("algorithm.options.") and \
                new.rsplit(".", 1)[1] not in takes:
            notes.append(f"train.{old} (ignored: {name} has no such option)")
            continue
        notes.append(f"train.{old} -> train.{new}")
        *path, last = new.split(".")
        d = out
        for p in path:
            nxt = d.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"train.{old} is the old spelling of train.{new}, but train.{'.'.join(path)} is "  # noqa: TRY004
                                 f"not a section ({nxt!r})")  # (a validator's error must be a ValueError)
            d = nxt
        if last in d:
            raise ValueError(f"train.{old} and train.{new} are the same setting: give it once (train.{new})")
        d[last] = value
    if notes:
        where = f"{source}: " if source else ""
        warnings.warn(f"{where}deprecated flat train keys, read for one more release: {', '.join(notes)}",
                      DeprecatedConfigKey, stacklevel=2)
    return out
