"""The public data sets ``sleuth data`` fetches from the Hugging Face Hub, and the data directory holding them.

* The seven QA benchmarks of search-agent papers (Search-R1, Jin et al. 2025, Table 2): NQ, TriviaQA, PopQA,
  HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle, from FlashRAG's collection (Jin et al. 2024,
  ``RUC-NLPIR/FlashRAG_datasets``: ``<set>/<split>.jsonl``, the split Search-R1 evaluates: test where the set
  has one, else dev), the source Search-R1's own data scripts read;
* Search-R1's training set ``nq_hotpotqa_train`` (NQ + HotpotQA train, and the seven test sets merged);
* wiki-18, Search-R1's 21,015,324 Wikipedia passages (DPR's December 2018 dump in 100-word passages);
* Search-R1's published e5-base-v2 flat FAISS index over wiki-18 (its rows are the passages' rows).

The data directory is ``data_dir`` when given, else ``$SLEUTH_DATA_DIR`` (an offline mirror, a shared disk),
else ``sleuth/data`` under the user's cache directory (platformdirs: ``~/.cache/sleuth/data`` on Linux)::

    <data dir>/<name>/...              the files Sleuth reads (DataSet.outputs)
    <data dir>/<name>/manifest.json    what was fetched: repository, revision, commit, each file's sha256
    <data dir>/.hub/<repo>/<file>      the downloads, each with a .hub.json record; partial downloads end in
                                       .incomplete. The QA files stay; the corpus and the index parts are
                                       deleted once converted (unless kept).

A benchmark is also read from the other published exports a data dir may hold instead (``DataSet.also``):
Search-R1's verl exports (``*.searchr1.jsonl`` / ``.parquet``) and FlashRAG's 1,000-question subsamples.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
SEARCH_R1_QA = "PeterJinGo/nq_hotpotqa_train"
WIKI18 = "PeterJinGo/wiki-18-corpus"
WIKI18_E5 = "PeterJinGo/wiki-18-e5-index"

# The revision each repository is read at (``sleuth data get --revision`` overrides it). The hub could not be
# reached from where these were written, so none was checked here: two are the commits that public Search-R1
# reproductions pin (several for the training set, two for the corpus); the others are the branch ``main``,
# resolved when downloading. Every download records the commit it got (manifest.json, ``sleuth data list``)
# and checks each file against the hub's content hash at that commit.
REVISIONS: dict[str, str] = {
    FLASHRAG: "main",
    SEARCH_R1_QA: "b7d80abfee334a7a91cb377544f09180d58b34f6",
    WIKI18: "69c1c00ffe7c5554c68d8548355cb22e46aabc51",
    WIKI18_E5: "main",
}
MANIFEST = "manifest.json"
HUB_DIR = ".hub"


@dataclass(frozen=True)
class DataSet:
    """One fetchable data set. ``files``: paths in ``repo``; ``outputs``: what ``sleuth data get`` writes,
    relative to the data dir (the first is the file a benchmark is read from); ``also``: other files a data dir
    may hold the same set in; ``convert``: how downloads become outputs (``qa``: read and rewritten as QA
    JSONL, ``search_r1``: the same with ids made unique per source, ``wiki18``: the corpus JSONL, ``concat``:
    the parts joined); ``keep``: whether the downloads stay once converted; ``size``: what the download holds
    (records, bytes where known)."""

    name: str
    title: str
    kind: str  # benchmark | train | corpus | index
    repo: str
    files: tuple[str, ...]
    outputs: tuple[str, ...]
    convert: str
    licence: str
    size: str
    also: tuple[str, ...] = ()
    keep: bool = True

    @property
    def revision(self) -> str:
        """The revision ``sleuth data get`` reads ``repo`` at (:data:`REVISIONS`)."""
        return REVISIONS[self.repo]


def _benchmark(name: str, title: str, split: str, licence: str, questions: int, *also: str) -> DataSet:
    return DataSet(name, title, "benchmark", FLASHRAG, (f"{name}/{split}.jsonl",), (f"{name}/{split}.jsonl",),
                   "qa", licence, f"{questions:,} questions ({split})", also)


DATASETS: dict[str, DataSet] = {d.name: d for d in [
    _benchmark("nq", "Natural Questions (open)", "test", "CC BY-SA 3.0", 3610, "nq/test.searchr1.jsonl"),
    _benchmark("triviaqa", "TriviaQA", "test", "Apache-2.0", 11313, "triviaqa/test_subsample.jsonl"),
    _benchmark("popqa", "PopQA", "test", "MIT", 14267, "popqa/test_subsample.jsonl"),
    _benchmark("hotpotqa", "HotpotQA (distractor)", "dev", "CC BY-SA 4.0", 7405, "hotpotqa/dev.searchr1.jsonl"),
    _benchmark("2wikimultihopqa", "2WikiMultihopQA", "dev", "Apache-2.0", 12576,
               "2wikimultihopqa/dev.searchr1.parquet"),
    _benchmark("musique", "MuSiQue (answerable)", "dev", "CC BY 4.0", 2417, "musique/dev.searchr1.jsonl"),
    _benchmark("bamboogle", "Bamboogle", "test", "MIT", 125, "bamboogle/test.searchr1.jsonl"),
    DataSet("nq_hotpotqa_train", "Search-R1 training set: NQ + HotpotQA train; test: the seven merged", "train",
            SEARCH_R1_QA, ("train.parquet", "test.parquet"),
            ("nq_hotpotqa_train/train.jsonl", "nq_hotpotqa_train/test.jsonl"), "search_r1",
            "CC BY-SA 3.0 (NQ), CC BY-SA 4.0 (HotpotQA)", "169,615 + 51,713 questions (~430 MB)"),
    DataSet("wiki18", "wiki-18: Wikipedia (Dec. 2018) in 21,015,324 passages of 100 words", "corpus", WIKI18,
            ("wiki-18.jsonl.gz",), ("wiki18/corpus.jsonl",), "wiki18", "CC BY-SA 3.0 (Wikipedia)",
            "21,015,324 passages (14.4 GB)", keep=False),
    DataSet("wiki18_e5_index", "e5-base-v2 flat FAISS index of wiki-18 (Search-R1's e5_Flat.index)", "index",
            WIKI18_E5, ("part_aa", "part_ab"), ("wiki18_e5_index/e5_Flat.index",), "concat",
            "CC BY-SA 3.0 (from wiki-18)", "64.6 GB (twice that free to join its 2 parts)", keep=False),
]}
BENCHMARKS = tuple(n for n, d in DATASETS.items() if d.kind == "benchmark")
GROUPS = {"benchmarks": BENCHMARKS, "all": tuple(DATASETS)}
ALIASES = {"2wiki": "2wikimultihopqa", "hotpot": "hotpotqa", "tqa": "triviaqa", "natural_questions": "nq",
           "e5_index": "wiki18_e5_index", "wiki-18": "wiki18"}


class UnknownDataSetError(ValueError):
    """A name is neither a data set nor a group; the message lists the known names."""


def default_data_dir() -> Path:
    """``sleuth/data`` under the user's cache directory (``~/.cache/sleuth/data`` on Linux, honouring
    ``XDG_CACHE_HOME``)."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("sleuth", appauthor=False)) / "data"


def resolve_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` if given, else ``$SLEUTH_DATA_DIR``, else :func:`default_data_dir`."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get("SLEUTH_DATA_DIR")
    return Path(env).expanduser() if env else default_data_dir()


def get_dataset(name: str) -> DataSet:
    """The entry of ``name`` (case-insensitive; aliases accepted). Raises :class:`UnknownDataSetError`."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DATASETS:
        raise UnknownDataSetError(f"unknown data set {name!r}; known: {', '.join(DATASETS)} (or the groups "
                                  f"{', '.join(GROUPS)})")
    return DATASETS[key]


def expand_names(names: list[str]) -> list[str]:
    """Data set names with the groups (``benchmarks``: the seven, ``all``) expanded, deduplicated in order."""
    out: list[str] = []
    for name in names:
        group = GROUPS.get(name.strip().lower())
        for n in group or (get_dataset(name).name,):
            if n not in out:
                out.append(n)
    return out


def hub_path(data_dir: Path, repo: str, filename: str) -> Path:
    """Where a download of ``filename`` of ``repo`` lands in the data dir."""
    return data_dir / HUB_DIR / repo / filename


def read_manifest(ds: DataSet, data_dir: Path) -> dict | None:
    """The manifest ``sleuth data get`` wrote for ``ds``, or ``None`` (never fetched, or unreadable)."""
    try:
        m = json.loads((data_dir / ds.name / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


@dataclass(frozen=True)
class Status:
    """Where a data set stands in a data dir: ``files`` the readable files found (outputs, else ``also``),
    ``bytes`` their size, ``manifest`` what ``sleuth data get`` recorded (``None`` for files put there another
    way), ``partial`` the bytes of unfinished downloads."""

    present: bool
    files: tuple[Path, ...]
    bytes: int
    manifest: dict | None
    partial: int


def status(ds: DataSet, data_dir: str | Path | None = None) -> Status:
    """Whether ``ds`` is in the data dir: all its outputs exist (as the manifest recorded them, when there is
    one), or, for a benchmark, one of its other readable files (``also``) does."""
    from corpora.hub import partial_files

    root = resolve_data_dir(data_dir)
    manifest = read_manifest(ds, root)
    outs = [root / p for p in ds.outputs]
    sizes = (manifest or {}).get("outputs", {})
    complete = all(p.is_file() and sizes.get(rel, p.stat().st_size) == p.stat().st_size
                   for p, rel in zip(outs, ds.outputs))
    if complete:
        files = tuple(outs)
    else:
        files = tuple(p for p in (root / a for a in ds.also) if p.is_file())[:1]
        manifest = None
    partial = sum(f.stat().st_size for name in ds.files
                  for f in partial_files(hub_path(root, ds.repo, name)))
    return Status(bool(files), files, sum(f.stat().st_size for f in files), manifest, partial)


def readable_file(name: str, data_dir: str | Path | None = None) -> Path | None:
    """The file a benchmark is read from in the data dir (what ``sleuth data get`` wrote, else another export
    of it found there), or ``None``."""
    st = status(get_dataset(name), data_dir)
    return st.files[0] if st.present else None


def get_command(names: list[str]) -> str:
    """The command that fetches ``names``: ``sleuth data get nq bamboogle``."""
    return "sleuth data get " + " ".join(names)
