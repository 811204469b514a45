"""The seven QA benchmarks of search-agent papers: where their files are, and how many questions of each.

Benchmarks (Search-R1, Jin et al. 2025, Table 2; FlashRAG, Jin et al. 2024): general QA NQ, TriviaQA,
PopQA; multi-hop QA HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle. :data:`REGISTRY` maps each name to its
split and to the file ``sleuth data get NAME`` writes under the data directory (:mod:`corpora.catalog`: an
explicit ``data_dir``, else ``$SLEUTH_DATA_DIR``, else ``sleuth/data`` under the user's cache directory), or
another export of it found there (Search-R1's ``*.searchr1.jsonl``, FlashRAG's subsamples); a missing one's
error names the ``sleuth data get`` command that fetches it. ``sample`` is the shipped HotpotQA test sample
(``corpora/sample/test.jsonl``), whose questions carry corpus ids of their supporting paragraphs.

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

from corpora import catalog
from corpora.catalog import resolve_data_dir
from corpora.formats import QAExample
from corpora.qa import read_qa

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_TEST = PROJECT_ROOT / "corpora" / "sample" / "test.jsonl"


class UnknownBenchmarkError(ValueError):
    """A benchmark name is not in the registry; the message lists the known names."""


class MissingBenchmarkError(FileNotFoundError):
    """Benchmarks absent from the data dir; the message names the data dir and the ``sleuth data get`` command
    that fetches them. ``names``: the missing benchmarks."""

    def __init__(self, names: list[str], data_dir: Path):
        self.names = names
        files = ", ".join(catalog.DATASETS[n].outputs[0] for n in names)
        s, them = ("s", "them") if len(names) > 1 else ("", "it")
        super().__init__(
            f"benchmark{s} {', '.join(names)} not found in the data dir {data_dir} (looked for {files}); fetch "
            f"{them} with `{catalog.get_command(names)}`, or point SLEUTH_DATA_DIR (or --data-dir) at a folder "
            f"holding {them}")


@dataclass(frozen=True)
class Benchmark:
    """One registry entry: ``path`` is relative to the data dir (the file ``sleuth data get`` writes; absolute
    for ``sample``); ``hops`` is the fixed hop count of every question when the dataset has one (else derived
    per question or ``None``)."""

    name: str
    path: str
    split: str
    multihop: bool
    hops: int | None = None
    fmt: str = "auto"


def _fetched(name: str) -> str:
    return catalog.DATASETS[name].outputs[0]


REGISTRY: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("nq", _fetched("nq"), "test", multihop=False),
        Benchmark("triviaqa", _fetched("triviaqa"), "test", multihop=False),
        Benchmark("popqa", _fetched("popqa"), "test", multihop=False),
        Benchmark("hotpotqa", _fetched("hotpotqa"), "dev", multihop=True, hops=2),
        Benchmark("2wikimultihopqa", _fetched("2wikimultihopqa"), "dev", multihop=True),
        Benchmark("musique", _fetched("musique"), "dev", multihop=True),
        Benchmark("bamboogle", _fetched("bamboogle"), "test", multihop=True, hops=2),
        Benchmark("sample", str(SAMPLE_TEST), "test", multihop=True, hops=2, fmt="flashrag"),
    ]
}
ALIASES = {"2wiki": "2wikimultihopqa", "hotpot": "hotpotqa", "tqa": "triviaqa", "natural_questions": "nq"}
ALL = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def known_benchmarks() -> list[str]:
    """Registry names, then ``all`` (the seven benchmarks) and aliases."""
    return [*REGISTRY, "all", *ALIASES]


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
    """The file a registry name (or alias) reads: the one found in the data dir (what ``sleuth data get``
    wrote, else another export of the set), else the one ``sleuth data get`` would write."""
    b = get_benchmark(name)
    p = Path(b.path)
    if p.is_absolute():
        return p
    return catalog.readable_file(b.name, data_dir) or resolve_data_dir(data_dir) / p


def locate_benchmark(name: str, data_dir: str | Path | None = None) -> tuple[Path, Benchmark | None]:
    """The existing QA file of a registry name (or alias), or of a path, and its registry entry (``None`` for
    a path); cheap, so callers can check every benchmark before loading anything.

    Raises :class:`UnknownBenchmarkError` (lists the known names), :class:`MissingBenchmarkError` (a
    ``FileNotFoundError`` naming the data dir and the ``sleuth data get`` command) and ``FileNotFoundError``
    for a missing QA file given by path.
    """
    if _is_file_name(name):
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(f"QA file not found: {path}")
        return path, None
    b = get_benchmark(name)
    path = benchmark_path(name, data_dir)
    if not path.exists():
        raise MissingBenchmarkError([b.name], resolve_data_dir(data_dir))
    return path, b


def locate_benchmarks(names: list[str], data_dir: str | Path | None = None) -> None:
    """Check that every benchmark (or QA file) of ``names`` exists. Raises :class:`MissingBenchmarkError`
    naming all the missing benchmarks and the one command that fetches them, else the first error of
    :func:`locate_benchmark`."""
    missing = []
    for name in names:
        try:
            locate_benchmark(name, data_dir)
        except MissingBenchmarkError as e:
            missing += e.names
    if missing:
        raise MissingBenchmarkError(missing, resolve_data_dir(data_dir))


def load_benchmark(
    name: str, data_dir: str | Path | None = None, limit: int | None = None, seed: int = 0
) -> list[QAExample]:
    """Load a benchmark by registry name (or a QA file by path), optionally sub-sampled (:func:`subsample`).

    Raises :class:`UnknownBenchmarkError` (lists the known names), ``FileNotFoundError``
    (:class:`MissingBenchmarkError` names the command that fetches a benchmark) and :class:`DataFormatError`
    (file, line, field).
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
