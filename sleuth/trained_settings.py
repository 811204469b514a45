"""The settings a model was trained with, kept beside its weights and used again wherever it runs.

A policy learns under one agent: the prompt and protocol, the turn and token budgets, how many passages a
search returns and how much of each it reads. Run under other settings (``max_doc_chars`` 400 where it was
trained on 100) it answers worse, and nothing says why. So ``sleuth train`` (and the quickstart) write
:func:`settings_of` the run's config into the run directory, whence every checkpoint gets a copy
(:func:`training.run_state.save_run`), and the SFT stage into its model folder; ``sleuth ask``, ``eval`` and
``serve --model DIR`` start from them (:func:`with_trained_settings`): a setting the command's config or
overrides set explicitly is used as given, with a warning when it differs from the trained one.

Saved (:data:`SAVED`): the agent section but where the model runs and how answers are scored by other models
(``backend``, ``simulator``, ``judge``, ``llm_judge``, ``max_batch``), ``retrieval.top_k`` and
``retrieval.method`` (a local index's method only: a simulated, MCP or web search of training is no search to
evaluate with), and ``eval.temperature``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sleuth.config import Config
from training.infra.checkpoint import SETTINGS_FILE, read_settings, write_settings

#: agent fields not saved: where the model runs and what scores it, not how the policy acts
AGENT_NOT_SAVED = frozenset({"backend", "simulator", "judge", "llm_judge", "max_batch"})
#: retrieval methods a saved ``retrieval.method`` may set (those that search a local index)
INDEX_METHODS = ("bm25", "dense", "hybrid", "lucene")
#: ``section -> fields`` of the other sections saved
SAVED = {"retrieval": ("top_k", "method"), "eval": ("temperature",)}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def settings_of(cfg: Config) -> dict[str, Any]:
    """The settings of ``cfg`` a model trained under it keeps (see the module docstring), as JSON-able
    config sections."""
    agent = cfg.agent.model_dump(mode="json", exclude=set(AGENT_NOT_SAVED))
    out: dict[str, Any] = {"agent": agent}
    for section, fields in SAVED.items():
        out[section] = {f: getattr(getattr(cfg, section), f) for f in fields}
    if out["retrieval"]["method"] not in INDEX_METHODS:
        del out["retrieval"]["method"]
    return out


def save_trained_settings(cfg: Config, directory: str | Path) -> Path:
    """Write :func:`settings_of` ``cfg`` beside a model (or into a run directory, whose checkpoints copy it)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    return write_settings(directory, settings_of(cfg))


def _merge_section(current: Any, saved: Any, name: str, skip: frozenset[str] | set[str]) -> tuple[Any, list, list]:
    """``(section, applied, differing)``: ``current`` with the ``saved`` values of the fields its config did not
    set (``model_fields_set``), the ``(key, value)`` pairs that changed it, and the ``(key, given, trained)``
    triples of fields set explicitly to another value than the trained one."""
    if not isinstance(saved, dict):
        return current, [], []
    fields = type(current).model_fields
    explicit = current.model_fields_set
    known = {k: v for k, v in saved.items() if k in fields and k not in skip}
    if name == "retrieval" and known.get("method") not in (None, *INDEX_METHODS):
        known.pop("method")
    keep = {k: getattr(current, k) for k in explicit}
    applied = {k: v for k, v in known.items() if k not in explicit}
    new = type(current).model_validate({**applied, **keep})
    changed = [(f"{name}.{k}", getattr(new, k)) for k in applied if getattr(new, k) != getattr(current, k)]
    differ = [(f"{name}.{k}", keep[k], v) for k, v in known.items() if k in explicit and _differs(keep[k], v)]
    return new, changed, differ


def _differs(given: Any, trained: Any) -> bool:
    return given != trained and not (isinstance(given, (int, float)) and isinstance(trained, (int, float))
                                     and float(given) == float(trained))


def with_trained_settings(cfg: Config, model_dir: str | Path | None,
                          log: Callable[[str], None] = _stderr) -> Config:
    """``cfg`` with the settings saved beside the model in ``model_dir`` (:data:`SETTINGS_FILE`) in place of
    the ones its config file and overrides did not set; ``cfg`` itself when the model has none (a hub id, a
    model trained before they were saved). Says through ``log`` which settings came from the model, and
    warns for each setting given explicitly with another value than the trained one (that value is used).
    Raises ``ValueError`` naming the file when it does not parse or holds values no config takes."""
    if model_dir is None or not Path(model_dir).is_dir():
        return cfg
    saved = read_settings(model_dir)
    if saved is None:
        return cfg
    path = Path(model_dir) / SETTINGS_FILE
    update, applied, differ = {}, [], []
    try:
        for name in ("agent", *SAVED):
            skip = AGENT_NOT_SAVED if name == "agent" else set(type(getattr(cfg, name)).model_fields) - set(SAVED[name])
            update[name], a, d = _merge_section(getattr(cfg, name), saved.get(name), name, skip)
            applied += a
            differ += d
    except ValidationError as e:
        raise ValueError(f"{path} holds settings this version does not take ({e.error_count()} errors, the first: "
                         f"{'.'.join(map(str, e.errors()[0]['loc']))}: {e.errors()[0]['msg']}); delete it to use "
                         "the config's settings") from None
    if applied:
        log(f"using the settings {model_dir} was trained with ({SETTINGS_FILE}): "
            + ", ".join(f"{k}={v}" for k, v in applied))
    for key, given, trained in differ:
        log(f"warning: {key}={given} as given, but {model_dir} was trained with {key}={trained}; its answers may "
            f"differ from training's (leave {key} out to use the trained value)")
    return cfg.model_copy(update=update)


def latest_trained_model(cfg: Config) -> Path | None:
    """The newest trained model under ``out_dir``: an RL run's ``checkpoints/latest``, else the SFT model;
    ``None`` when there is none."""
    out = Path(cfg.out_dir)
    pointers = sorted((p for p in out.glob("*/checkpoints/latest") if p.is_file()), key=lambda p: p.stat().st_mtime)
    if pointers:
        return pointers[-1]
    return out / "sft" if (out / "sft" / "config.json").exists() else None


def untrained_note(cfg: Config, model: str | None) -> str | None:
    """The note a command prints when it runs the untrained tiny policy (no ``--model``, no ``policy.model``),
    pointing at a trained model under ``out_dir`` when there is one; ``None`` when a model is given."""
    if model or cfg.policy.model:
        return None
    note = (f"note: no --model given (nor policy.model): this is the untrained tiny policy of "
            f"{Path(cfg.out_dir) / 'tiny'}, which has learned nothing yet")
    trained = latest_trained_model(cfg)
    if trained is not None:
        return note + f"; for the trained one pass --model {trained}"
    return note + "; train one with `sleuth quickstart` or `sleuth train`, then pass --model <its checkpoint>"
