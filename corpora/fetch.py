"""``sleuth data get``: a data set's files downloaded from the Hugging Face Hub (:func:`corpora.hub.fetch`:
resumable, checked), converted into what Sleuth reads, and recorded in ``<data dir>/<name>/manifest.json``.

Conversions (:data:`corpora.catalog.DataSet.convert`):

* ``qa``: a FlashRAG benchmark file read by :func:`corpora.qa.read_qa` (every record checked, blank answers left
  out, hops derived where the file allows) and written as Sleuth's QA JSONL;
* ``search_r1``: Search-R1's training and test parquet files likewise, each id prefixed with its source
  (``nq_0``, ``hotpotqa_0``: every source is numbered from 0);
* ``wiki18``: the passages as Sleuth's corpus JSONL (:func:`corpora.wiki18.convert_wiki18`, ids and rows kept);
* ``concat``: the index parts joined, in order, into one file (``cat part_* > e5_Flat.index``).

Outputs are written to a temporary file and renamed, and the manifest is written last, so an interrupted
``get`` leaves no output that :func:`corpora.catalog.status` counts as present.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from corpora.catalog import MANIFEST, get_dataset, hub_path, resolve_data_dir, status
from corpora.hub import HubOfflineError, fetch, hub_offline, record_path


def get(name: str, data_dir: str | Path | None = None, *, revision: str | None = None, force: bool = False,
        keep_downloads: bool = False, log: Callable[[str], None] = print) -> dict:
    """Fetch the data set ``name`` into the data dir unless it is there already (``force`` fetches it anew;
    a ``revision`` other than the one recorded does too). Returns a summary: ``name``, ``fetched`` (whether
    anything was downloaded), ``files`` (the readable files), ``commit`` and ``stats`` of the conversion.

    ``log`` receives one line per step. Raises :class:`corpora.catalog.UnknownDataSetError`,
    :class:`corpora.hub.HubOfflineError` (``HF_HUB_OFFLINE=1`` and the set missing),
    :class:`corpora.hub.HubError` (not found, interrupted: run again to resume, checksum mismatch) and
    :class:`corpora.formats.DataFormatError` (a download that is not what its converter reads; nothing written).
    """
    ds = get_dataset(name)
    root = resolve_data_dir(data_dir)
    st = status(ds, root)
    same_revision = revision is None or (st.manifest or {}).get("revision") == revision
    if st.present and not force and same_revision:
        return {"name": ds.name, "fetched": False, "files": [str(f) for f in st.files],
                "commit": (st.manifest or {}).get("commit"), "stats": (st.manifest or {}).get("stats", {})}
    rev = revision or ds.revision
    if hub_offline():
        raise HubOfflineError(f"{ds.name} is not in {root} and HF_HUB_OFFLINE=1 forbids downloading it: "
                              "unset HF_HUB_OFFLINE, or set SLEUTH_DATA_DIR (or --data-dir) to a folder holding it")
    raws = [hub_path(root, ds.repo, f) for f in ds.files]
    got = []
    for f, raw in zip(ds.files, raws):
        log(f"{ds.name}: {f} from {ds.repo} at {rev}")
        got.append(fetch(ds.repo, f, rev, raw, label=ds.name, force=force))
        if got[-1].resumed_from:
            log(f"  resumed after {got[-1].resumed_from:,} bytes")
    outs = [root / o for o in ds.outputs]
    log(f"{ds.name}: converting into {', '.join(str(o) for o in outs)}")
    stats = CONVERTERS[ds.convert](raws, outs, log)
    commit = got[0].commit
    manifest = {
        "name": ds.name, "repo": ds.repo, "revision": rev, "commit": commit,
        "files": {g.path: {"sha256": g.sha256, "size": g.size, "hub_etag": g.etag} for g in got},
        "outputs": {o: (root / o).stat().st_size for o in ds.outputs},
        "stats": stats, "licence": ds.licence, "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_json(root / ds.name / MANIFEST, manifest)
    if not (ds.keep or keep_downloads):
        for raw in raws:
            raw.unlink(missing_ok=True)
            record_path(raw).unlink(missing_ok=True)
    return {"name": ds.name, "fetched": True, "files": [str(o) for o in outs], "commit": commit, "stats": stats}


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def convert_qa(raws: list[Path], outs: list[Path], log: Callable[[str], None],
               source_ids: bool = False) -> dict:
    """Each QA download read and rewritten as QA JSONL (``source_ids``: ids prefixed with their source)."""
    from corpora.formats import write_jsonl
    from corpora.qa import read_qa

    stats = {}
    for raw, out in zip(raws, outs):
        dataset = None if source_ids else out.parent.name
        examples = read_qa(raw, dataset=dataset, split=out.stem, source_ids=source_ids)
        stats[out.name] = write_jsonl(out, examples)
        log(f"  {stats[out.name]:,} questions -> {out}")
    return {"questions": stats}


def convert_search_r1(raws: list[Path], outs: list[Path], log: Callable[[str], None]) -> dict:
    """Search-R1's parquet files as QA JSONL, each id prefixed with its source (``nq_0``, ``hotpotqa_0``)."""
    return convert_qa(raws, outs, log, source_ids=True)


def convert_wiki18_download(raws: list[Path], outs: list[Path], log: Callable[[str], None]) -> dict:
    """The passages as Sleuth's corpus JSONL, ids and rows kept."""
    from corpora.wiki18 import WIKI18_PASSAGES, convert_wiki18

    stats = convert_wiki18(raws[0], outs[0],
                           progress=lambda n: log(f"  {n:,} of ~{WIKI18_PASSAGES:,} passages"))
    log(f"  {stats['passages']:,} passages -> {outs[0]}")
    return dict(stats)


def concat_parts(raws: list[Path], outs: list[Path], log: Callable[[str], None]) -> dict:
    """The parts joined in order into the one output, through a temporary file renamed when complete."""
    from tqdm.auto import tqdm

    out = outs[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    total = sum(p.stat().st_size for p in raws)
    try:
        with open(tmp, "wb") as w, tqdm(total=total, unit="B", unit_scale=True, desc=f"joining {out.name}",
                                        disable=total < 1 << 30) as bar:
            for part in raws:
                with open(part, "rb") as r:
                    while block := r.read(1 << 24):
                        w.write(block)
                        bar.update(len(block))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"  {len(raws)} parts, {total:,} bytes -> {out}")
    return {"bytes": total, "parts": len(raws)}


CONVERTERS: dict[str, Callable[[list[Path], list[Path], Callable[[str], None]], dict]] = {
    "qa": convert_qa,
    "search_r1": convert_search_r1,
    "wiki18": convert_wiki18_download,
    "concat": concat_parts,
}

