"""The seven QA benchmarks of search-agent papers: where their files are, and how many questions of each.

Benchmarks (Search-R1, Jin et al. 2025, Table 2; FlashRAG, Jin et al. 2024): general QA NQ, TriviaQA,
PopQA; multi-hop QA HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle. :data:`REGISTRY` maps each name to a file
and split under a data directory (default ``../shared/data`` relative to the project root, overridden by
the ``SLEUTH_DATA_DIR`` environment variable or an explicit ``data_dir``); ``sample`` is the shipped
HotpotQA test sample (``corpora/sample/test.jsonl``), whose questions carry corpus ids of their supporting
paragraphs.

The files are read by :func:`corpora.qa.read_qa`, which reads every format they ship in.

Every loader returns :class:`corpora.formats.QAExample` with ``metadata["dataset"]``, ``metadata["hops"]``
(int where derivable: HotpotQA and Bamboogle 2; MuSiQue from the official id prefix ``2hop__``/``3hop1__``
or the number of decomposition steps; 2Wiki from its question type; only the official MuSiQue JSONL and 2Wiki
JSON carry these: the registered Search-R1 exports of both have neither (their ids are ``<split>_<index>``),
so their hops are ``None`` and EM by hops skips them) and, where the source has them,
``metadata["supporting_titles"]``. A malformed record raises :class:`corpora.formats.DataFormatError` naming
the file, line (or row) and field.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

from corpora.formats import QAExample
from corpora.qa import read_qa

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = PROJECT_ROOT.parent / "shared" / "data"
SAMPLE_TEST = PROJECT_ROOT / "corpora" / "sample" / "test.jsonl"


class UnknownBenchmarkError(ValueError):
    """A benchmark name is not in the registry; the message lists the known names."""


@dataclass(frozen=True)
class Benchmark:
    """One registry entry: ``path`` is relative to the data dir (absolute for ``sample``); ``hops`` is the
    fixed hop count of every question when the dataset has one (else derived per question or ``None``)."""

    name: str
    path: str
    split: str
    multihop: bool
    hops: int | None = None
    fmt: str = "auto"


REGISTRY: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("nq", "nq/test.searchr1.jsonl", "test", multihop=False),
        Benchmark("triviaqa", "triviaqa/test_subsample.jsonl", "test", multihop=False),
        Benchmark("popqa", "popqa/test_subsample.jsonl", "test", multihop=False),
        Benchmark("hotpotqa", "hotpotqa/dev.searchr1.jsonl", "dev", multihop=True, hops=2),
        Benchmark("2wikimultihopqa", "2wikimultihopqa/dev.searchr1.parquet", "dev", multihop=True),
        Benchmark("musique", "musique/dev.searchr1.jsonl", "dev", multihop=True),
        Benchmark("bamboogle", "bamboogle/test.searchr1.jsonl", "test", multihop=True, hops=2),
        Benchmark("sample", str(SAMPLE_TEST), "test", multihop=True, hops=2, fmt="flashrag"),
    ]
}
ALIASES = {"2wiki": "2wikimultihopqa", "hotpot": "hotpotqa", "tqa": "triviaqa", "natural_questions": "nq"}
ALL = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def known_benchmarks() -> list[str]:
    """Registry names, then ``all`` (the seven benchmarks) and aliases."""
    return [*REGISTRY, "all", *ALIASES]


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` if given, else ``$SLEUTH_DATA_DIR``, else ``<project root>/../shared/data``."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get("SLEUTH_DATA_DIR")
    return Path(env) if env else DEFAULT_DATA_DIR


def get_benchmark(name: str) -> Benchmark:
    """Registry entry of ``name`` (case-insensitive, aliases accepted). Raises
    :class:`UnknownBenchmarkError` listing the known names."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in REGISTRY:
        raise UnknownBenchmarkError(f"unknown benchmark {name!r}; known: {', '.join(known_benchmarks())}")
    return REGISTRY[key]


def expand_benchmarks(names: list[str] | str) -> list[str]:
    """Expand ``"all"`` and comma-separated lists into registry names (or QA file paths, kept as given),
    deduplicated in order. Raises :class:`UnknownBenchmarkError` for an unknown name."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for item in names:
        for n in (p.strip() for p in item.split(",")):
            if not n:
                continue
            if _is_file_name(n):
                resolved = [n]
            elif n.lower() == "all":
                resolved = list(ALL)
            else:
                resolved = [get_benchmark(n).name]
            out.extend(r for r in resolved if r not in out)
    return out


def _is_file_name(name: str) -> bool:
    return name.endswith((".jsonl", ".json", ".parquet")) or os.sep in name


def benchmark_path(name: str, data_dir: str | Path | None = None) -> Path:
    """The file a registry name (or alias) reads."""
    b = get_benchmark(name)
    p = Path(b.path)
    return p if p.is_absolute() else resolve_data_dir(data_dir) / p


def locate_benchmark(name: str, data_dir: str | Path | None = None) -> tuple[Path, Benchmark | None]:
    """The existing QA file of a registry name (or alias), or of a path, and its registry entry (``None`` for
    a path); cheap, so callers can check every benchmark before loading anything.

    Raises :class:`UnknownBenchmarkError` (lists the known names) and ``FileNotFoundError`` (says where the
    data dir is and how to change it).
    """
    if _is_file_name(name):
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"QA file not found: {path}")
        return path, None
    b = get_benchmark(name)
    path = benchmark_path(name, data_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"benchmark {b.name!r}: file not found: {path} (data dir {resolve_data_dir(data_dir)}; set "
            "SLEUTH_DATA_DIR or --data-dir to the folder holding the benchmark files)"
        )
    return path, b


def load_benchmark(
    name: str, data_dir: str | Path | None = None, limit: int | None = None, seed: int = 0
) -> list[QAExample]:
    """Load a benchmark by registry name (or a QA file by path), optionally sub-sampled (:func:`subsample`).

    Raises :class:`UnknownBenchmarkError` (lists the known names), ``FileNotFoundError`` (says where the
    data dir is and how to change it) and :class:`DataFormatError` (file, line, field).
    """
    path, b = locate_benchmark(name, data_dir)
    examples = read_qa(
        path,
        fmt=b.fmt if b else "auto",
        dataset=b.name if b else path.stem,
        split=b.split if b else None,
        hops=b.hops if b else None,
    )
    return subsample(examples, limit, seed)


def subsample(examples: list[QAExample], limit: int | None, seed: int = 0) -> list[QAExample]:
    """A deterministic random subset of ``limit`` examples, kept in file order.

    The subset is the first ``limit`` of a seeded permutation, so a larger ``limit`` with the same seed
    contains the smaller one (extending a cached run computes only the new questions). ``limit=None`` or
    ``limit >= len(examples)`` returns all. Raises ``ValueError`` for ``limit < 1``.
    """
    if limit is None or limit >= len(examples):
        return list(examples)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return [examples[i] for i in sorted(order[:limit])]
