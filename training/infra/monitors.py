"""Training-health monitors: the collapse signs of Search-R1-style runs, logged per step, with alarms.

Researchers report that these runs collapse: the test score peaks early, the ``<think>`` channel
degenerates into repeated or broken tags before the reward shows it, and GRPO settles on one or two
searches whatever the question. :func:`health_stats` measures, per rollout batch: format validity,
a degeneracy score of the policy's text (:func:`degeneracy_score`), search calls per episode split by
dataset and by hop count, and response length (entropy, clip fraction and KL come from the loss).
:class:`Alarms` fires when validity or entropy falls through a threshold, when searches per episode stay
flat across hop classes while their EM differs (a search-depth plateau), and when a held-out metric falls
more than a margin below its best (a collapse); :func:`plot_dashboard` draws a
run's ``metrics.jsonl`` as one PNG (``sleuth dashboard RUN_DIR``). :class:`MetricsLogger` writes that file
(and TensorBoard) one record per step; :func:`marked_timer` times the phases of a step into it
(``timing/<phase>_s``, as verl's ``marked_timer``).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.trajectory import Trajectory
from corpora.formats import json_records

_TAG = re.compile(r"</?([a-z_]+)>")
# the Search-R1 tags, ReSeek's self-judge tag (agent.self_judge) and the function-call protocol's tool call
KNOWN_TAGS = ("think", "search", "answer", "information", "judge", "tool_call")
# a known tag cut before its ">" (``</answer``), or its name cut after 4 or more letters (``<sear``, ``<judg``)
_CUT = "|".join(t[:k] for t in KNOWN_TAGS for k in range(len(t) - 1, 3, -1))
_BROKEN = re.compile(rf"</?(?:{'|'.join(KNOWN_TAGS)})(?![a-z_>])|</?(?:{_CUT})\b")


def repeated_ngram_fraction(words: list[str], n: int = 3) -> float:
    """Fraction of the word ``n``-grams of a text that repeat an earlier one (0: none, -> 1: a loop)."""
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def malformed_tags(text: str) -> int:
    """Number of tag faults in one turn's text: unknown tags, closing tags without an opening one, opened
    tags never closed, and truncated tag names (``<sear``, ``</answer`` without ``>``)."""
    faults = len(_BROKEN.findall(text))
    stack: list[str] = []
    for m in _TAG.finditer(text):
        closing, name = m.group(0).startswith("</"), m.group(1)
        if name not in KNOWN_TAGS:
            faults += 1
        elif closing:
            if stack and stack[-1] == name:
                stack.pop()
            else:
                faults += 1
        else:
            stack.append(name)
    return faults + len(stack)


def degeneracy_score(traj: Trajectory, n: int = 3) -> float:
    """Degeneracy of the policy's own text in ``[0, 1]``: the mean of the repeated-``n``-gram fraction of
    all policy turns together and ``min(1, tag faults per turn)``. A clean trajectory scores ~0."""
    texts = [t.text for t in traj.turns]
    words = " ".join(texts).split()
    rep = repeated_ngram_fraction(words, n)
    faults = sum(malformed_tags(t) for t in texts)
    return 0.5 * rep + 0.5 * min(1.0, faults / max(len(texts), 1))


def health_stats(trajs: list[Trajectory]) -> dict[str, float]:
    """Per-step health metrics of a rollout batch (flat dict of floats, for JSONL and TensorBoard).

    Keys: ``format_ok`` (rate of episodes whose every turn parsed and that answered), ``degeneracy``,
    ``response_tokens``, ``search_calls``, ``search_calls/dataset=<name>`` and ``search_calls/hops=<h>``
    (from ``trajectory.metadata["dataset"]`` / ``["hops"]``), ``em/hops=<h>``, ``stop/<reason>`` rates.
    """
    n = max(len(trajs), 1)
    out: dict[str, float] = {
        "format_ok": sum(float(t.verdict.get("format_ok", False)) for t in trajs) / n,
        "degeneracy": sum(degeneracy_score(t) for t in trajs) / n,
        "response_tokens": sum(t.num_policy_tokens for t in trajs) / n,
        "search_calls": sum(t.num_search_calls for t in trajs) / n,
    }
    for key in ("dataset", "hops"):
        buckets: dict[str, list[Trajectory]] = defaultdict(list)
        for t in trajs:
            if t.metadata.get(key) is not None:
                buckets[str(t.metadata[key])].append(t)
        for name, ts in sorted(buckets.items()):
            out[f"search_calls/{key}={name}"] = sum(t.num_search_calls for t in ts) / len(ts)
            if key == "hops":
                out[f"em/hops={name}"] = sum(float(t.verdict.get("em", 0.0)) for t in ts) / len(ts)
    for reason, c in Counter(t.stop_reason for t in trajs).items():
        out[f"stop/{reason or 'unknown'}"] = c / n
    return out


@dataclass
class Alarms:
    """Training-health alarms, checked once per step on the step's record.

    * threshold alarms: ``format_ok`` or ``entropy`` below its threshold for ``patience`` consecutive steps;
    * search-depth plateau (``search_flat``): over the last ``window`` steps, the mean searches per episode
      of the hop classes (``search_calls/hops=<h>``) lie within ``search_flat`` of each other while their EM
      (``em/hops=<h>``) spans more than ``em_gap``: the policy searches as much for a 3-hop question as for
      a 1-hop one although the classes do not succeed alike (the "one or two searches whatever the question"
      failure of GRPO search agents); needs two classes or more and a full window, then ``patience``
      consecutive steps;
    * collapse (``collapse_drop``): the held-out metric ``collapse_metric`` (``eval_em`` by default; any
      record key, e.g. a held-out reward) falls more than ``collapse_drop`` below its best so far; checked on
      the steps that carry it (evaluations are already averages over held-out questions: no patience).

    ``check(step, record)`` returns the messages raised this step (each also a ``RuntimeWarning``) and adds
    the watched signals to ``record``: ``alarm/hop_search_spread``, ``alarm/hop_em_spread`` (window means)
    and ``alarm/collapse_gap`` (best - current). ``should_stop`` is True once an alarm fired with
    ``action="stop"``. :meth:`state` / :meth:`restore` carry the patience counts, and :meth:`signal_state` /
    :meth:`restore_signals` the window and the best metric, over a resume.
    """

    min_format_ok: float | None = None
    min_entropy: float | None = None
    patience: int = 2
    action: str = "warn"
    search_flat: float | None = None
    em_gap: float = 0.2
    window: int = 10
    collapse_drop: float | None = None
    collapse_metric: str = "eval_em"
    _below: dict[str, int] = field(default_factory=dict)
    _hops: list[dict[str, list[float]]] = field(default_factory=list)
    _best: list[float] = field(default_factory=list)  # [best value, its step] once seen
    should_stop: bool = False

    @classmethod
    def from_config(cls, tc: Any) -> Alarms:
        """The alarms of a :class:`training.config.TrainConfig` (its ``monitoring.alarms`` section, whose
        fields have this class's names)."""
        return cls(**tc.monitoring.alarms.model_dump())

    def _fire(self, msg: str, fired: list[str]) -> None:
        warnings.warn(f"training-health alarm: {msg}", RuntimeWarning, stacklevel=3)
        fired.append(msg)
        if self.action == "stop":
            self.should_stop = True

    def _patient(self, key: str, bad: bool) -> bool:
        self._below[key] = self._below.get(key, 0) + 1 if bad else 0
        return self._below[key] >= self.patience

    def check(self, step: int, record: dict[str, Any]) -> list[str]:
        fired: list[str] = []
        for key, thr in (("format_ok", self.min_format_ok), ("entropy", self.min_entropy)):
            v = record.get(key)
            if thr is None or v is None or not math.isfinite(v):
                continue
            if self._patient(key, v < thr):
                self._fire(f"step {step}: {key} {v:.3f} below {thr} for {self._below[key]} steps", fired)
        self._check_plateau(step, record, fired)
        self._check_collapse(step, record, fired)
        return fired

    def _check_plateau(self, step: int, record: dict[str, Any], fired: list[str]) -> None:
        per = {k.split("=", 1)[1]: [v, record.get(f"em/hops={k.split('=', 1)[1]}", float("nan"))]
               for k, v in record.items() if k.startswith("search_calls/hops=")}
        self._hops = [*self._hops, per][-self.window :]
        classes = sorted({h for p in self._hops for h in p})
        if len(classes) < 2 or len(self._hops) < self.window:
            return
        means = {}
        for h in classes:
            vals = [p[h] for p in self._hops if h in p and all(math.isfinite(x) for x in p[h])]
            if vals:
                means[h] = (sum(v[0] for v in vals) / len(vals), sum(v[1] for v in vals) / len(vals))
        if len(means) < 2:
            return
        s_lo, s_hi = min(m[0] for m in means.values()), max(m[0] for m in means.values())
        e_lo, e_hi = min(m[1] for m in means.values()), max(m[1] for m in means.values())
        record["alarm/hop_search_spread"], record["alarm/hop_em_spread"] = s_hi - s_lo, e_hi - e_lo
        if self.search_flat is None:
            return
        if self._patient("search_plateau", s_hi - s_lo < self.search_flat and e_hi - e_lo > self.em_gap):
            cls = "/".join(means)
            self._fire(f"step {step}: search plateau: searches per episode {s_lo:.2f}-{s_hi:.2f} across hop classes "
                       f"{cls} while their EM spans {e_lo:.2f}-{e_hi:.2f} (last {len(self._hops)} steps)", fired)

    def _check_collapse(self, step: int, record: dict[str, Any], fired: list[str]) -> None:
        v = record.get(self.collapse_metric)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            return
        if not self._best or v > self._best[0]:
            self._best = [float(v), float(step)]
        gap = self._best[0] - v
        record["alarm/collapse_gap"] = gap
        if self.collapse_drop is not None and gap > self.collapse_drop:
            self._fire(f"step {step}: collapse: {self.collapse_metric} {v:.3f} is {gap:.3f} below its best "
                       f"{self._best[0]:.3f} (step {int(self._best[1])})", fired)

    def state(self) -> dict[str, int]:
        """``{key: consecutive steps below its threshold}``, for a checkpoint (so a resumed run keeps its count)."""
        return dict(self._below)

    def restore(self, below: dict[str, int]) -> None:
        """Continue from a :meth:`state` saved in a checkpoint."""
        self._below = {str(k): int(v) for k, v in below.items()}

    def signal_state(self) -> dict[str, Any]:
        """The plateau window and the best held-out metric, for a checkpoint (JSON-serialisable)."""
        return {"hops": self._hops, "best": self._best}

    def restore_signals(self, saved: dict[str, Any]) -> None:
        """Continue from a :meth:`signal_state` saved in a checkpoint (an older checkpoint has none: empty)."""
        self._hops = [dict(p) for p in saved.get("hops", [])][-self.window :]
        self._best = [float(x) for x in saved.get("best", [])]


# -- the metrics log ----------------------------------------------------------------------------------
#: the phases of a training step in the order they run; each is timed as ``timing/<phase>_s`` in the step's
#: record (:func:`marked_timer`; ``eval`` only on the steps that evaluate)
PHASES = ("rollout", "score", "advantages", "update", "sync", "eval", "log", "checkpoint")


@contextmanager
def marked_timer(phase: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``timing["timing/<phase>_s"]`` (seconds; a phase timed in
    several blocks adds up), as verl's ``marked_timer``; the time is added however the block ends."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{phase}_s"
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


def drop_steps_after(path: Path, step: int, step_of: Callable[[dict], int]) -> None:
    """Keep only the records of ``path`` (JSONL) whose ``step_of(record)`` is at most ``step``: a resumed run
    rewrites the steps after its checkpoint, so their records from before the interruption must go. Records
    are split at ``\n`` only (a record may hold raw U+2028 or U+0085). A last line without its newline that
    is not JSON (a kill mid-append) is dropped with a warning; any other line that is not JSON raises
    ``json.JSONDecodeError`` before anything is written (the file is left as it was). The file is rewritten
    through a temporary file renamed into place, so an interruption leaves the old or the new records."""
    if not path.exists():
        return

    def torn(line: str) -> None:
        warnings.warn(f"{path}: dropping a torn last line of {len(line)} characters (interrupted write)",
                      stacklevel=5)  # the caller of drop_steps_after

    keep = [ln for ln, rec in json_records(path, on_torn=torn) if step_of(rec) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Appends one JSON record per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    ``truncate_after`` drops records of steps after it (a resumed run rewrites the steps it redoes), in
    ``metrics.jsonl`` and in TensorBoard (``SummaryWriter``'s ``purge_step``: TensorBoard hides the earlier
    events of those steps, so a redone step is not plotted twice)."""

    def __init__(self, run_dir: Path, truncate_after: int | None = None, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        if truncate_after is not None:
            drop_steps_after(self.path, truncate_after, lambda r: r.get("step", 0))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if truncate_after is None else truncate_after + 1
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge)
            except Exception:  # noqa: BLE001 - TensorBoard is optional at run time
                self.tb = None

    def steps(self) -> set[int]:
        """The steps ``metrics.jsonl`` holds a record of."""
        if not self.path.exists():
            return set()
        return {int(rec.get("step", 0)) for _, rec in json_records(self.path)}

    def log(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, one per step (the last record wins for a repeated step,
    as after a resume). A last line without its newline that is not JSON (a run writing it, or killed
    mid-write) is skipped. Raises ``FileNotFoundError`` when the run has no metrics, ``json.JSONDecodeError``
    for any other line that is not JSON."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        inner = sorted(p.parent for p in Path(run_dir).glob("*/metrics.jsonl"))  # runs/quickstart -> its grpo/
        hint = (f"; its training metrics are in {inner[0]}: sleuth dashboard {inner[0]}" if inner
                else " (is it a training run directory?)")
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}{hint}")
    by_step = {int(rec["step"]): rec for _, rec in json_records(path)}  # a torn last line is skipped
    return [by_step[s] for s in sorted(by_step)]


DASHBOARD_PANELS = (
    ("reward / EM", ("reward", "em", "eval_em")),
    ("format validity", ("format_ok",)),
    ("degeneracy", ("degeneracy",)),
    ("search calls per episode", ("search_calls", "search_calls/hops=*", "search_calls/dataset=*",
                                  "eval_search_hops*")),
    ("EM by hop class", ("em/hops=*", "eval_em_hops*")),
    ("search-depth plateau: spread across hop classes", ("alarm/hop_search_spread", "alarm/hop_em_spread")),
    ("collapse: held-out metric and its best", ("alarm/collapse_gap",)),
    ("response tokens", ("response_tokens",)),
    ("policy entropy", ("entropy",)),
    ("clip fraction", ("clip_frac",)),
    ("KL", ("kl", "approx_kl")),
    ("time per phase (s)", tuple(f"timing/{p}_s" for p in PHASES)),
)
#: alarm kinds by the word after "step N: " of their message, and the colour that marks them on every panel
ALARM_COLOURS = {"search plateau": "orange", "collapse": "red"}


def alarm_kind(msg: str) -> str:
    """``"search plateau"``, ``"collapse"`` or ``"threshold"`` for an :class:`Alarms` message."""
    body = msg.split(": ", 1)[-1]
    return next((k for k in ALARM_COLOURS if body.startswith(k)), "threshold")


def plot_dashboard(run_dir: str | Path, out: str | Path | None = None, collapse_metric: str = "eval_em") -> Path:
    """Draw a run's health metrics as one PNG (matplotlib, Agg): reward/EM, validity, degeneracy, searches
    and EM per hop class, the plateau signal (spread of searches and of EM across hop classes), the held-out
    metric ``collapse_metric`` with its best so far (the collapse signal), response length, entropy, clip
    fraction, KL, the time of each phase of a step (``timing/<phase>_s``) and the list of alarms; each alarm is
    a vertical line on every panel (orange: search
    plateau, red: collapse, grey: thresholds). Returns the PNG path (default ``run_dir/dashboard.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "dashboard.png"
    keys = sorted({k for r in recs for k in r})
    fig, axes = plt.subplots(3, 5, figsize=(24, 11))
    alarms = [(r["step"], m) for r in recs for m in r.get("alarms") or []]
    for ax, (title, patterns) in zip(axes.flat, DASHBOARD_PANELS, strict=False):
        for pat in patterns:
            names = [k for k in keys if (k == pat or (pat.endswith("*") and k.startswith(pat[:-1])))]
            for k in names:
                pts = [(r["step"], r[k]) for r in recs if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
                if pts:
                    ax.plot(*zip(*pts), marker="." if len(pts) < 40 else None, label=k)
        if title.startswith("collapse"):
            pts = [(r["step"], r[collapse_metric]) for r in recs
                   if isinstance(r.get(collapse_metric), (int, float)) and math.isfinite(r[collapse_metric])]
            if pts:
                best = [max(v for _, v in pts[: i + 1]) for i in range(len(pts))]
                ax.plot(*zip(*pts), marker=".", label=collapse_metric)
                ax.plot([s for s, _ in pts], best, ls="--", label="best so far")
        for step, msg in alarms:
            ax.axvline(step, color=ALARM_COLOURS.get(alarm_kind(msg), "grey"), alpha=0.35)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    text_ax = axes.flat[len(DASHBOARD_PANELS)]
    for ax in axes.flat[len(DASHBOARD_PANELS):]:
        ax.axis("off")
    lines = [m for _, m in alarms]
    shown = lines[:14] + ([f"... and {len(lines) - 14} more"] if len(lines) > 14 else [])
    text_ax.text(0, 1, "alarms:\n" + ("\n".join(m[:90] for m in shown) if shown else "none"), va="top", fontsize=7,
                 family="monospace")
    fig.suptitle(f"training health: {Path(run_dir).name}")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
