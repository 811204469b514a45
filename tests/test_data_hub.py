"""`sleuth data`: the real download code (corpora.hub, corpora.fetch) against a hub served on 127.0.0.1
(tests/fake_hub.py, HF_ENDPOINT) that holds small files in the hub's layout under the catalogue's own
repositories: conversions, a resumed download, a corrupted file, a 404, offline runs, the command line."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from corpora import catalog
from corpora.catalog import FLASHRAG, SEARCH_R1_QA, WIKI18, WIKI18_E5, get_dataset, hub_path, status
from corpora.fetch import get
from corpora.formats import DataFormatError
from corpora.hub import ChecksumError, HubError, HubOfflineError, fetch, partial_files
from corpora.qa import read_qa
from tests.fake_hub import COMMIT, FakeHub, serve

ROOT = Path(__file__).resolve().parents[1]


def _flashrag(prefix: str, n: int, **meta) -> bytes:
    rows = [{"id": f"{prefix}_{i}", "question": f"Question {i} of {prefix}?", "golden_answers": [f"answer {i}"],
             "metadata": dict(meta)} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _wiki18_archive(passages: list[str]) -> bytes:
    """wiki-18 as published: a gzipped tar whose one member is the JSONL."""
    body = "".join(json.dumps({"id": str(i), "contents": p}) + "\n" for i, p in enumerate(passages)).encode()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("data00/x/flashrag_indexes/wiki_dpr_100w/wiki_dump.jsonl")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    return gzip.compress(raw.getvalue())


WIKI = ['"Paris"\nParis is the capital of France.', '"Dijon"\nDijon is famous for mustard.', "untitled text"]
TRAIN_ROWS = [{"id": f"train_{i}", "question": f"{src} question {i}?", "golden_answers": [f"a{i}"],
               "data_source": src, "metadata": {"type": None}} for src in ("nq", "hotpotqa") for i in range(3)]


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    """The catalogue's repositories on a local hub; SLEUTH_DATA_DIR an empty folder; downloads allowed."""
    from huggingface_hub import constants

    h = FakeHub()
    h.add(FLASHRAG, "bamboogle/test.jsonl", _flashrag("bamboogle", 3), lfs=False)  # a regular git file
    h.add(FLASHRAG, "nq/test.jsonl", _flashrag("nq", 4))
    h.add(FLASHRAG, "2wikimultihopqa/dev.jsonl",
          _flashrag("2wiki", 2, type="bridge_comparison", supporting_facts={"title": ["A", "B", "A"],
                                                                             "sent_id": [0, 1, 2]}))
    h.add(SEARCH_R1_QA, "train.parquet", _parquet(TRAIN_ROWS))
    h.add(SEARCH_R1_QA, "test.parquet", _parquet(TRAIN_ROWS[:1] + TRAIN_ROWS[3:4]))
    h.add(WIKI18, "wiki-18.jsonl.gz", _wiki18_archive(WIKI))
    h.add(WIKI18_E5, "part_aa", os.urandom(50_000))
    h.add(WIKI18_E5, "part_ab", os.urandom(20_000))
    servers = serve(h)
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # what HF_HUB_OFFLINE unset at import gives
    monkeypatch.setenv("SLEUTH_DATA_DIR", str(tmp_path / "data"))
    yield h
    for s in servers:
        s.shutdown()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_benchmarks_are_fetched_converted_and_recorded(hub, tmp_path):
    from eval.datasets import load_benchmark

    root = tmp_path / "data"
    for name in ("bamboogle", "nq", "2wiki"):
        assert get(name, log=lambda s: None)["fetched"]
    ex = load_benchmark("nq")
    assert [e.id for e in ex] == [f"nq_{i}" for i in range(4)] and ex[0].golden_answers == ["answer 0"]
    assert ex[0].metadata["dataset"] == "nq"
    wiki = read_qa(root / "2wikimultihopqa" / "dev.jsonl")
    assert [e.metadata["hops"] for e in wiki] == [4, 4] and wiki[0].metadata["supporting_titles"] == ["A", "B"]
    m = json.loads((root / "bamboogle" / "manifest.json").read_text())
    blob = hub.repos[FLASHRAG]["bamboogle/test.jsonl"]
    assert m["commit"] == COMMIT and m["revision"] == "main" and m["repo"] == FLASHRAG
    assert m["files"]["bamboogle/test.jsonl"] == {"sha256": hashlib.sha256(blob.content).hexdigest(),
                                                  "size": len(blob.content), "hub_etag": blob.git_blob}
    assert m["outputs"] == {"bamboogle/test.jsonl": (root / "bamboogle" / "test.jsonl").stat().st_size}
    assert hub_path(root, FLASHRAG, "nq/test.jsonl").read_bytes() == hub.repos[FLASHRAG]["nq/test.jsonl"].content
    st = status(get_dataset("nq"))
    assert st.present and st.manifest["commit"] == COMMIT and st.files == (root / "nq" / "test.jsonl",)
    n = len(hub.requests)
    again = get("nq", log=lambda s: None)  # present: no request at all
    assert not again["fetched"] and len(hub.requests) == n and again["commit"] == COMMIT
    assert get("nq", force=True, log=lambda s: None)["fetched"] and len(hub.byte_requests()) == 4  # anew


def test_an_interrupted_download_resumes_where_it_stopped(hub, tmp_path, monkeypatch):
    """The connection drops after 50,000 bytes and the retry fails: the error says the bytes are kept; the
    next run asks for the rest only (Range) and the file checks out."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    f = hub.add(FLASHRAG, "nq/test.jsonl", _flashrag("nq", 3000))
    f.faults = [("cut", 50_000), ("status", 500)]
    raw = hub_path(tmp_path / "data", FLASHRAG, "nq/test.jsonl")
    with pytest.raises(HubError, match="running the same command again resumes") as e:
        get("nq", log=lambda s: None)
    (partial,) = partial_files(raw)
    kept = partial.stat().st_size
    assert 16 * 1024 <= kept <= 50_000 and f"{kept:,} bytes are kept" in str(e.value)  # whole 16 KiB chunks
    assert f.content.startswith(partial.read_bytes())
    assert not (tmp_path / "data" / "nq").exists()  # no output, no manifest
    lines: list[str] = []
    assert get("nq", log=lines.append)["fetched"]
    assert hub.byte_requests()[-1][2] == f"bytes={kept}-" and f"  resumed after {kept:,} bytes" in lines
    assert raw.read_bytes() == f.content and partial_files(raw) == []
    assert len(read_qa(tmp_path / "data" / "nq" / "test.jsonl")) == 3000


def test_a_partial_file_of_another_version_is_not_continued(hub, tmp_path):
    f = hub.repos[FLASHRAG]["nq/test.jsonl"]
    raw = hub_path(tmp_path / "data", FLASHRAG, "nq/test.jsonl")
    raw.parent.mkdir(parents=True)
    (raw.parent / f"{raw.name}.{f.sha256[:16]}.incomplete").write_bytes(f.content[:20])  # this version's
    (raw.parent / f"{raw.name}.{'0' * 16}.incomplete").write_bytes(b"older bytes")  # another version's
    get("nq", log=lambda s: None)
    assert hub.byte_requests()[-1][2] == "bytes=20-" and raw.read_bytes() == f.content
    assert partial_files(raw) == []


def test_a_corrupted_download_is_deleted_and_named(hub, tmp_path):
    f = hub.repos[FLASHRAG]["nq/test.jsonl"]
    f.served = bytes([f.content[0] ^ 1]) + f.content[1:]  # the right length, one bit off
    with pytest.raises(ChecksumError) as e:
        get("nq", log=lambda s: None)
    msg = str(e.value)
    assert msg.startswith("nq: nq/test.jsonl of RUC-NLPIR/FlashRAG_datasets (revision main)")
    assert f"expected {f.sha256}" in msg and hashlib.sha256(f.served).hexdigest() in msg and "deleted" in msg
    assert _files(tmp_path / "data") == [] and not status(get_dataset("nq")).present
    f.served = None  # the next run downloads it anew
    assert get("nq", log=lambda s: None)["fetched"] and hub.byte_requests()[-1][2] is None


def test_a_regular_file_is_checked_against_its_git_blob_id(hub, tmp_path):
    f = hub.repos[FLASHRAG]["bamboogle/test.jsonl"]
    f.served = f.content.replace(b"Question", b"Qvestion")
    with pytest.raises(ChecksumError, match=f"git blob id is .* expected {f.git_blob}"):
        get("bamboogle", log=lambda s: None)
    assert _files(tmp_path / "data") == []


def test_a_pinned_sha256_is_checked_besides_the_hubs(hub, tmp_path):
    f = hub.repos[FLASHRAG]["nq/test.jsonl"]
    with pytest.raises(ChecksumError, match=r"sha256 \(pinned\) is .* expected 0{64}"):
        fetch(FLASHRAG, "nq/test.jsonl", "main", tmp_path / "x.jsonl", sha256="0" * 64)
    assert _files(tmp_path) == []
    got = fetch(FLASHRAG, "nq/test.jsonl", "main", tmp_path / "x.jsonl", sha256=f.sha256.upper())
    assert got.sha256 == f.sha256 and got.size == len(f.content) and got.resumed_from == 0


def test_a_missing_file_names_the_data_set_and_the_file(hub, tmp_path):
    with pytest.raises(HubError) as e:
        get("musique", log=lambda s: None)
    assert str(e.value).startswith("musique: musique/dev.jsonl of RUC-NLPIR/FlashRAG_datasets (revision main): "
                                   "no such file on the hub (HTTP 404")
    assert _files(tmp_path / "data") == []


def test_a_missing_revision_says_how_to_pick_another(hub):
    hub.revisions = {"main"}
    with pytest.raises(HubError, match=r"bamboogle: .*\(revision v9\): the repository has no such revision .*"
                       r"--revision"):
        get("bamboogle", revision="v9", log=lambda s: None)
    assert get("bamboogle", revision="main", log=lambda s: None)["fetched"]


def test_an_unreachable_hub_is_named(hub, tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(HubError, match=rf"bamboogle: .*: cannot reach 127\.0\.0\.1:{port} \(.*\); check the "
                       "connection, or HF_ENDPOINT"):
        get("bamboogle", log=lambda s: None)
    assert _files(tmp_path / "data") == []


def test_offline_a_missing_set_is_a_clear_error_and_a_fetched_one_works(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from eval.datasets import load_benchmark

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubOfflineError, match=r"nq is not in .* HF_HUB_OFFLINE=1 forbids downloading it"):
        get("nq", log=lambda s: None)
    assert hub.requests == [] and _files(tmp_path / "data") == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    get("nq", log=lambda s: None)
    n = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not get("nq", log=lambda s: None)["fetched"] and len(load_benchmark("nq")) == 4
    assert len(hub.requests) == n
    with pytest.raises(HubOfflineError, match="HF_HUB_OFFLINE"):  # the file level refuses too
        fetch(FLASHRAG, "bamboogle/test.jsonl", "main", tmp_path / "b.jsonl")


def test_search_r1_training_set_gets_one_id_per_source(hub, tmp_path):
    stats = get("nq_hotpotqa_train", log=lambda s: None)["stats"]
    assert stats["questions"] == {"train.jsonl": 6, "test.jsonl": 2}
    train = read_qa(tmp_path / "data" / "nq_hotpotqa_train" / "train.jsonl")
    assert [e.id for e in train] == [f"{s}_train_{i}" for s in ("nq", "hotpotqa") for i in range(3)]
    assert {e.metadata["dataset"] for e in train} == {"nq", "hotpotqa"} and train[0].golden_answers == ["a0"]
    with pytest.raises(DataFormatError, match="duplicate question id"):  # the ids without their source
        read_qa(hub_path(tmp_path / "data", SEARCH_R1_QA, "train.parquet"))


def test_wiki18_archive_becomes_the_corpus_and_the_download_goes(hub, tmp_path):
    from corpora.formats import read_corpus

    done = get("wiki18", log=lambda s: None)
    assert done["stats"] == {"passages": 3, "untitled": 1, "ids_are_rows": True}
    corpus = read_corpus(tmp_path / "data" / "wiki18" / "corpus.jsonl")
    assert [(p.id, p.title) for p in corpus] == [("0", "Paris"), ("1", "Dijon"), ("2", "untitled text")]
    assert not hub_path(tmp_path / "data", WIKI18, "wiki-18.jsonl.gz").exists()
    assert status(get_dataset("wiki18")).present


def test_the_index_parts_are_joined_in_order(hub, tmp_path):
    parts = hub.repos[WIKI18_E5]
    get("wiki18_e5_index", keep_downloads=True, log=lambda s: None)
    out = tmp_path / "data" / "wiki18_e5_index" / "e5_Flat.index"
    assert out.read_bytes() == parts["part_aa"].content + parts["part_ab"].content
    assert hub_path(tmp_path / "data", WIKI18_E5, "part_aa").exists()  # kept, as asked
    out.unlink()
    get("wiki18_e5_index", log=lambda s: None)  # the kept parts are reused, then deleted
    assert out.stat().st_size == 70_000 and len(hub.byte_requests()) == 2
    assert not hub_path(tmp_path / "data", WIKI18_E5, "part_aa").exists()


def test_other_exports_in_the_data_dir_count_as_present(hub, tmp_path):
    """A data dir holding Search-R1's export of a benchmark (no manifest) serves it; `get` downloads nothing."""
    from eval.datasets import load_benchmark

    src = tmp_path / "data" / "bamboogle" / "test.searchr1.jsonl"
    src.parent.mkdir(parents=True)
    src.write_text(json.dumps({"prompt": [{"content": "Who?"}], "reward_model": {"ground_truth": "Me"}}) + "\n")
    st = status(get_dataset("bamboogle"))
    assert st.present and st.manifest is None and st.files == (src,)
    assert get("bamboogle", log=lambda s: None) == {"name": "bamboogle", "fetched": False, "files": [str(src)],
                                                    "commit": None, "stats": {}}
    assert hub.requests == [] and load_benchmark("bamboogle")[0].golden_answers == ["Me"]


def test_names_groups_and_aliases():
    assert catalog.expand_names(["2wiki", "benchmarks", "nq"]) == [
        "2wikimultihopqa", "nq", "triviaqa", "popqa", "hotpotqa", "musique", "bamboogle"]
    assert catalog.expand_names(["all"]) == list(catalog.DATASETS)
    with pytest.raises(catalog.UnknownDataSetError, match="known: nq, triviaqa"):
        catalog.expand_names(["wikipedia"])


def test_the_data_dir_is_the_argument_the_variable_or_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("SLEUTH_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert catalog.resolve_data_dir() == tmp_path / "cache" / "sleuth" / "data"
    monkeypatch.setenv("SLEUTH_DATA_DIR", str(tmp_path / "mirror"))
    assert catalog.resolve_data_dir() == tmp_path / "mirror"
    assert catalog.resolve_data_dir(tmp_path / "x") == tmp_path / "x"


def test_eval_without_the_benchmarks_names_the_command_that_fetches_them(tmp_path, monkeypatch, capsys):
    from sleuth.cli import main

    monkeypatch.setenv("SLEUTH_DATA_DIR", str(tmp_path))
    assert main(["eval", "--benchmarks", "all", "--method", "rag", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "`sleuth data get nq triviaqa popqa hotpotqa 2wikimultihopqa musique bamboogle`" in err
    assert f"not found in the data dir {tmp_path} (looked for nq/test.jsonl, triviaqa/test.jsonl" in err
    assert main(["eval", "--benchmarks", "sample,musique", "--out", str(tmp_path / "out")]) == 2
    assert "benchmark musique not found" in capsys.readouterr().err


def test_data_commands_refuse_what_they_cannot_do(tmp_path, capsys):
    from sleuth.cli import main

    assert main(["data", "get", "wikipedia", "--data-dir", str(tmp_path)]) == 2
    assert "unknown data set 'wikipedia'" in capsys.readouterr().err
    assert main(["data", "get", "nq", "wiki18", "--revision", "abc", "--data-dir", str(tmp_path)]) == 2
    assert "--revision names one revision of one repository" in capsys.readouterr().err


def _sleuth(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "SLEUTH_DATA_DIR")}
    return subprocess.run([sys.executable, "-m", "sleuth.cli", *args], check=False, capture_output=True,
                          text=True, env={**full, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}, cwd=ROOT, timeout=120)


def test_the_command_line_downloads_lists_and_honours_offline(hub, tmp_path):
    """`sleuth data get/list` in a fresh process: HF_ENDPOINT read from the environment, downloads allowed
    (no HF_HUB_OFFLINE default for this command), HF_HUB_OFFLINE=1 refused with a clear message."""
    data = str(tmp_path / "cli")
    r = _sleuth(["data", "get", "bamboogle", "--data-dir", data], {"HF_ENDPOINT": hub.url})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"bamboogle: fetched (commit {COMMIT[:10]}): {data}/bamboogle/test.jsonl"
    assert f"  3 questions -> {data}/bamboogle/test.jsonl" in r.stderr
    r = _sleuth(["data", "list"], {"SLEUTH_DATA_DIR": data})
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert "yes: bamboogle/test.jsonl" in rows["bamboogle"] and f"commit {COMMIT[:10]}" in rows["bamboogle"]
    assert rows["nq"].rstrip().endswith("no") and f"data dir: {data}" in r.stdout
    r = _sleuth(["data", "get", "nq", "--data-dir", data], {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "nq is not in" in r.stderr and "HF_HUB_OFFLINE=1 forbids" in r.stderr


def test_nothing_a_user_reads_names_the_development_mirror():
    """README, docs, help texts, defaults and configs never point at the mirror beside the checkout."""
    code = ("sleuth", "eval", "corpora", "retrieval", "agent", "training")
    texts = [ROOT / "README.md", ROOT / "Makefile", ROOT / "corpora" / "sample" / "README.md",
             *ROOT.glob("docs/*.md"), *ROOT.glob("configs/*.yaml"), *(p for d in code for p in (ROOT / d).rglob("*.py"))]
    found = [str(p.relative_to(ROOT)) for p in texts if "shared/data" in p.read_text(encoding="utf-8")]
    assert found == []
