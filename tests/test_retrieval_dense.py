"""Dense retrieval internals: resumable embedding files, model fingerprints, shard sizing, GPU placement
and memory-mapped loading (all on CPU, with fake encoders and tiny random vectors)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from retrieval import dense, encoder
from retrieval.encoder import encode_to_memmap, model_fingerprint

N, DIM = 10, 3


class Interrupted(Exception):
    pass


def _texts(start):
    return (str(i) for i in range(start, N))


def _encoder(scale=1.0, fail_at_call=None):
    """Fake encoder: row i -> [scale * (i + 1)] * DIM; raises Interrupted at call number ``fail_at_call``."""
    calls = []

    def encode(batch):
        calls.append(len(batch))
        if fail_at_call is not None and len(calls) == fail_at_call:
            raise Interrupted
        return np.array([[scale * (int(t) + 1)] * DIM for t in batch], np.float32)

    return encode


def _want(scale=1.0):
    return np.repeat(scale * np.arange(1, N + 1, dtype=np.float32)[:, None], DIM, axis=1)


def _run(path, fingerprint, encode, chunk=4):
    return encode_to_memmap(
        encode, _texts, N, DIM, path, chunk=chunk, fingerprint=fingerprint, show_progress=False
    )


def test_other_fingerprint_interrupted_before_first_chunk_does_not_leave_stale_progress(tmp_path):
    path = tmp_path / "embeddings.npy"
    np.testing.assert_array_equal(_run(path, "A", _encoder()), _want())
    with pytest.raises(Interrupted):  # model B: same corpus and dim, stopped before its first chunk
        _run(path, "B", _encoder(2.0, fail_at_call=1))
    np.testing.assert_array_equal(_run(path, "A", _encoder()), _want())  # was: stale done=n, all rows zero


def test_resume_after_interruption_keeps_done_rows(tmp_path):
    path = tmp_path / "embeddings.npy"
    with pytest.raises(Interrupted):
        _run(path, "A", _encoder(fail_at_call=2))
    calls = []
    enc = _encoder()
    np.testing.assert_array_equal(_run(path, "A", lambda b: calls.append(len(b)) or enc(b)), _want())
    assert sum(calls) == N - 4  # the first chunk of 4 was not encoded again


def test_on_start_gets_the_texts_left_to_encode_before_the_first_one(tmp_path):
    """``sleuth index`` announces the embedding step from ``on_start``: called once, before any text is
    encoded, with what is left (all of them, then what an interrupted run left, then nothing at all)."""
    path, seen = tmp_path / "embeddings.npy", []
    enc = _encoder(fail_at_call=2)

    def encode(batch):
        seen.append(("encode", len(batch)))
        return enc(batch)

    def run(encode):
        return encode_to_memmap(encode, _texts, N, DIM, path, chunk=4, fingerprint="A", show_progress=False,
                                on_start=lambda todo: seen.append(("start", todo)))

    with pytest.raises(Interrupted):
        run(encode)
    assert seen == [("start", N), ("encode", 4), ("encode", 4)]
    seen.clear()
    np.testing.assert_array_equal(run(encode), _want())
    assert seen == [("start", N - 4), ("encode", 4), ("encode", 2)]
    seen.clear()
    np.testing.assert_array_equal(run(encode), _want())
    assert seen == []


def test_crash_while_writing_progress_keeps_the_last_good_one(tmp_path, monkeypatch):
    path = tmp_path / "embeddings.npy"
    real = Path.write_text
    writes = []

    def crashing_write(self, text, *a, **kw):
        writes.append(self)
        if len(writes) == 2:  # the second progress write dies half-way
            real(self, text[: len(text) // 2], *a, **kw)
            raise OSError("disk full")
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", crashing_write)
    with pytest.raises(OSError, match="disk full"):
        _run(path, "A", _encoder())
    monkeypatch.undo()
    state = json.loads(path.with_suffix(".progress.json").read_text())
    assert state["done"] == 4 and state["fingerprint"] == "A"
    assert [
        p.name for p in tmp_path.iterdir() if p.name not in ("embeddings.npy", "embeddings.progress.json")
    ] in (
        [],
        [writes[1].name],  # at most the half-written temporary file is left behind, never the real one
    )
    np.testing.assert_array_equal(_run(path, "A", _encoder()), _want())


@pytest.mark.parametrize(
    "content", ["", '{"fingerprint": "A", "n": 10, "di', "[1, 2]", '{"fingerprint": "A", "n": 10, "dim": 3}']
)
def test_unreadable_progress_starts_over_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "embeddings.npy"
    with pytest.raises(Interrupted):
        _run(path, "A", _encoder(fail_at_call=2))
    prog = path.with_suffix(".progress.json")
    prog.write_text(content)
    calls = []
    enc = _encoder()
    with caplog.at_level(logging.WARNING, logger="retrieval.encoder"):
        out = _run(path, "A", lambda b: calls.append(len(b)) or enc(b))
    np.testing.assert_array_equal(out, _want())
    assert sum(calls) == N  # started over
    assert str(prog) in caplog.text and "starting over" in caplog.text


def _fake_model(d: Path, weights: bytes = b"w" * 10):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"hidden_size": 3}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_model_fingerprint_changes_when_local_weights_change(tmp_path):
    d = _fake_model(tmp_path / "ckpt")
    fp = model_fingerprint(str(d))
    assert model_fingerprint(str(d)) == fp and str(d) in fp  # stable, and still names the model
    (d / "README.md").write_text("notes")  # not a weight or config file
    assert model_fingerprint(str(d)) == fp
    (d / "model.safetensors").write_bytes(b"v" * 11)  # re-trained in the same folder
    fp2 = model_fingerprint(str(d))
    assert fp2 != fp
    st = (d / "model.safetensors").stat()
    (d / "model.safetensors").write_bytes(b"u" * 11)  # same size, newer mtime
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_fingerprint(str(d)) != fp2
    other = _fake_model(tmp_path / "other")
    assert model_fingerprint(str(other)) != model_fingerprint(str(d))


def test_model_fingerprint_of_the_shipped_model():
    fp = model_fingerprint(encoder.DEFAULT_MODEL)
    assert fp.startswith(encoder.DEFAULT_MODEL) and fp == model_fingerprint(encoder.DEFAULT_MODEL)


def _unit(n, d, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_shards_are_split_equally():
    assert dense.shard_bounds(2000, 700) == [(0, 666), (666, 1333), (1333, 2000)]
    assert dense.shard_bounds(701, 700) == [(0, 350), (350, 701)]  # not 700 + 1
    assert dense.shard_bounds(700, 700) == [(0, 700)] and dense.shard_bounds(5, 700) == [(0, 5)]
    assert dense.shard_bounds(0, 700) == [(0, 0)]
    for n, size in [(10_000_001, 10_000_000), (12345, 1000), (99, 7)]:
        b = dense.shard_bounds(n, size)
        lens = [stop - start for start, stop in b]
        assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
        assert max(lens) <= size and max(lens) - min(lens) <= 1 and len(b) == -(-n // size)


def test_ivfpq_on_too_few_vectors_is_a_clear_error_before_any_training(tmp_path, monkeypatch):
    spec = dense.DenseIndexSpec(kind="ivfpq", nlist=4, pq_m=4)
    with pytest.raises(ValueError, match=r"ivfpq needs at least 256 vectors per shard.*100.*'flat'"):
        dense.check_dense_spec(spec, 100, 16)
    dense.check_dense_spec(spec, 256, 16)
    dense.check_dense_spec(dense.DenseIndexSpec(kind="flat"), 1, 16)
    with pytest.raises(ValueError, match="pq_m=5 must divide"):
        dense.check_dense_spec(dense.DenseIndexSpec(kind="ivfpq", pq_m=5), 1000, 16)
    monkeypatch.setattr(dense, "_new_index", lambda *a: pytest.fail("index made before the check"))
    with pytest.raises(ValueError, match="256"):
        dense.build_dense_shards(_unit(100, 16), tmp_path, spec, show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_spec_errors_at_construction():
    with pytest.raises(ValueError, match="unknown dense index kind 'ivf'"):
        dense.DenseIndexSpec(kind="ivf")
    with pytest.raises(ValueError, match=r"shard_size=100.*ivfpq needs at least 256"):
        dense.DenseIndexSpec(kind="ivfpq", shard_size=100)
    with pytest.raises(ValueError, match="shard_size"):
        dense.DenseIndexSpec(shard_size=0)


def test_ivfpq_with_a_small_last_shard_builds(tmp_path):
    import faiss

    faiss.omp_set_num_threads(1)
    emb = _unit(800, 16)
    spec = dense.DenseIndexSpec(kind="ivfpq", shard_size=700, nlist=4, pq_m=4, nprobe=4)
    names = dense.build_dense_shards(emb, tmp_path, spec, show_progress=False)  # was 700 + 100: faiss crash
    idx = dense.DenseIndex.load(tmp_path, names, spec)
    assert [s.ntotal for s in idx.shards] == [400, 400]
    rows, _ = idx.search_rows(emb[:20], 3)
    assert (rows[:, 0] == np.arange(20)).mean() >= 0.8


def _write_shards(tmp_path, emb):
    """flat, IVF (nprobe 1 in the file) and HNSW (efSearch 16 in the file) shards of ``emb``."""
    import faiss

    faiss.omp_set_num_threads(1)
    flat = faiss.IndexFlatIP(emb.shape[1])
    ivf = faiss.index_factory(emb.shape[1], "IVF4,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(emb)
    hnsw = faiss.IndexHNSWFlat(emb.shape[1], 8, faiss.METRIC_INNER_PRODUCT)
    for name, idx in [("flat", flat), ("ivf", ivf), ("hnsw", hnsw)]:
        idx.add(emb)
        faiss.write_index(idx, str(tmp_path / f"{name}.faiss"))
    return ["flat.faiss", "ivf.faiss", "hnsw.faiss"]


class FakeGpus:
    """Stands in for faiss.index_cpu_to_all_gpus: records what it got (and the search parameters set on it
    at clone time, which is all a GPU clone keeps) and returns a CPU copy."""

    def __init__(self):
        self.got = []

    def __call__(self, idx):
        import faiss

        try:
            nprobe = faiss.extract_index_ivf(idx).nprobe
        except RuntimeError:
            nprobe = None
        self.got.append((type(idx).__name__, nprobe))
        return faiss.clone_index(idx)


def test_search_params_are_set_before_cloning_to_gpu_and_hnsw_stays_on_cpu(tmp_path, caplog):
    spec = dense.DenseIndexSpec(nprobe=3, ef_search=77)
    fake = FakeGpus()
    with caplog.at_level(logging.INFO, logger="retrieval.dense"):
        placed = [dense.place_shard(idx, spec, fake) for idx in _load_raw(tmp_path)]
    assert fake.got == [("IndexFlatIP", None), ("IndexIVFFlat", 3)]  # was nprobe 1: the file's
    assert [gpu for _, gpu in placed] == [True, True, False]
    assert placed[2][0].hnsw.efSearch == 77 and "HNSW" in caplog.text and "CPU" in caplog.text
    cpu = [dense.place_shard(idx, spec, None) for idx in _load_raw(tmp_path)]
    assert [gpu for _, gpu in cpu] == [False] * 3 and cpu[2][0].hnsw.efSearch == 77
    import faiss

    assert faiss.extract_index_ivf(cpu[1][0]).nprobe == 3
    with pytest.raises(ValueError, match="nprobe=3000.*2048"):
        dense.place_shard(_load_raw(tmp_path)[1], dense.DenseIndexSpec(nprobe=3000), fake)


def _load_raw(tmp_path):
    import faiss

    names = _write_shards(tmp_path, _unit(2100, 8))
    return [faiss.read_index(str(tmp_path / n)) for n in names]


def test_gpu_load_and_the_k_limit(tmp_path, monkeypatch):
    import faiss

    emb = _unit(2100, 8)
    names = _write_shards(tmp_path, emb)
    fake = FakeGpus()
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", fake, raising=False)
    spec = dense.DenseIndexSpec(nprobe=4)
    idx = dense.DenseIndex.load(tmp_path, names[:2], spec, use_gpu=True)
    assert fake.got == [("IndexFlatIP", None), ("IndexIVFFlat", 4)]
    rows, _ = idx.search_rows(emb[:5], 2048)
    assert rows.shape == (5, 2048) and (rows[:, 0] == np.arange(5)).all()
    with pytest.raises(ValueError, match="k=2049.*GPU.*2048"):
        idx.search_rows(emb[:5], 2049)
    hnsw_only = dense.DenseIndex.load(tmp_path, names[2:], spec, use_gpu=True)  # stays on CPU: any k
    assert hnsw_only.search_rows(emb[:2], 2100)[0].shape == (2, 2100)
    cpu = dense.DenseIndex.load(tmp_path, names[:1], spec)
    assert cpu.search_rows(emb[:2], 2100)[0].shape == (2, 2100)


def test_use_gpu_without_a_gpu_says_it_searches_on_the_cpu(tmp_path, monkeypatch, caplog):
    """use_gpu=True where faiss sees no GPU (the CPU build, or no device) fell back to the CPU without a word."""
    import faiss

    names = _write_shards(tmp_path, _unit(2100, 8))
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0, raising=False)
    with caplog.at_level(logging.WARNING, logger="retrieval.dense"):
        idx = dense.DenseIndex.load(tmp_path, names[:1], dense.DenseIndexSpec(), use_gpu=True)
    assert not any(idx.on_gpu) and "use_gpu" in caplog.text and "CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="retrieval.dense"):
        dense.DenseIndex.load(tmp_path, names[:1], dense.DenseIndexSpec())
    assert caplog.text == ""


def _mapped(path):
    return any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_mmap_load_maps_flat_vectors_and_searches_the_same(tmp_path, kind):
    import faiss

    faiss.omp_set_num_threads(1)
    emb = _unit(1500, 16)
    spec = dense.DenseIndexSpec(kind=kind, shard_size=1000)
    names = dense.build_dense_shards(emb, tmp_path, spec, show_progress=False)
    q = emb[:30] + 0.05 * _unit(30, 16, seed=1)
    want = dense.DenseIndex.load(tmp_path, names, spec).search_rows(q, 7)
    idx = dense.DenseIndex.load(tmp_path, names, spec, mmap=True)
    got = idx.search_rows(q, 7)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    if Path("/proc/self/maps").exists() and hasattr(faiss, "IO_FLAG_MMAP_IFC"):
        assert all(_mapped((tmp_path / n).resolve()) for n in names)  # was: read into RAM


def test_mmap_load_without_mmap_ifc_reads_flat_into_memory(tmp_path, monkeypatch):
    import faiss

    emb = _unit(300, 16)
    names = dense.build_dense_shards(emb, tmp_path, dense.DenseIndexSpec(), show_progress=False)
    monkeypatch.delattr(faiss, "IO_FLAG_MMAP_IFC", raising=False)  # an older faiss
    rows, _ = dense.DenseIndex.load(tmp_path, names, mmap=True).search_rows(emb[:5], 3)
    assert (rows[:, 0] == np.arange(5)).all()


@pytest.mark.parametrize(
    "name, want",
    [
        ("intfloat/e5-base-v2", ("query: ", "passage: ")),
        ("/models/multilingual-e5-large", ("query: ", "passage: ")),
        ("intfloat/e5-mistral-7b-instruct", (encoder.E5_INSTRUCT_QUERY, "")),  # instruction on queries only
        ("intfloat/multilingual-e5-large-instruct", (encoder.E5_INSTRUCT_QUERY, "")),
        ("BAAI/bge-base-en-v1.5", (encoder.BGE_QUERY_INSTRUCTION, "")),
        ("BAAI/bge-m3", ("", "")),
        # family names inside other words or folder names are not the family
        ("/srv/bgeo-models/all-MiniLM-L6-v2", ("", "")),
        ("ckpt/minilm-lr2e5", ("", "")),
        ("/data/m3data/bge-small-en-v1.5", (encoder.BGE_QUERY_INSTRUCTION, "")),
    ],
)
def test_default_prefixes_match_family_names_not_substrings(name, want):
    assert encoder.default_prefixes(name) == want


@pytest.mark.parametrize("count", [N - 3, N + 3, 2 * N])
def test_a_corpus_of_another_length_than_n_is_a_clear_error(tmp_path, count):
    texts = lambda start: (str(i % N) for i in range(start, count))
    with pytest.raises(ValueError, match=f"expected {N} passages"):
        encode_to_memmap(_encoder(), texts, N, DIM, tmp_path / "e.npy", chunk=4, show_progress=False)


def _minilm_copy(tmp_path, st_config: dict, include_prompt: bool = True) -> Path:
    """The shipped MiniLM in ``tmp_path/m`` (weights linked) with its own sentence-transformers config."""
    src = encoder.resolve_model_path(encoder.DEFAULT_MODEL)
    dst = tmp_path / "m"
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            if f.name == "model.safetensors":
                (dst / f.relative_to(src)).symlink_to(f)
            else:
                (dst / f.relative_to(src)).write_bytes(f.read_bytes())
    (dst / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    pool = json.loads((dst / "1_Pooling" / "config.json").read_text())
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({**pool, "include_prompt": include_prompt}))
    return dst


def test_prefixes_go_through_sentence_transformers_prompts(tmp_path):
    # a model's default_prompt_name must not be added on top of the prefix (or to passages), and a pooling
    # config with include_prompt=false must pool without the prefix's tokens, as sentence-transformers does
    from sentence_transformers import SentenceTransformer

    path = _minilm_copy(tmp_path, {"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"},
                        include_prompt=False)
    enc = encoder.Encoder(str(path), device="cpu")
    assert (enc.query_prefix, enc.passage_prefix) == ("query: ", "")
    ref = SentenceTransformer(str(path), device="cpu")
    texts = ["Big Stone Gap film", "zebrafish"]
    for got, prompt in [(enc.encode_queries(texts), "query: "), (enc.encode_passages(texts), "")]:
        want = ref.encode(texts, prompt=prompt, normalize_embeddings=True, convert_to_numpy=True)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_ivfpq_trains_on_enough_points_for_its_lists():
    """IVF-PQ trained on at most 100k vectors while its lists grow as 4 sqrt(N) (18k lists for wiki-18's 21M
    passages, about 5 points per list; faiss asks for 39 and clusters badly below); an explicit nlist of 8k
    on a 4M shard got 12 points per list. The sample now holds 39 points per list, never more than the shard."""
    from retrieval.dense import DenseIndexSpec, ivf_nlist, ivf_train_size

    for spec, n in [(DenseIndexSpec(kind="ivfpq"), 21_000_000), (DenseIndexSpec(kind="ivfpq", nlist=8192), 4_000_000),
                    (DenseIndexSpec(kind="ivfpq"), 50_000), (DenseIndexSpec(kind="ivfpq", nlist=4096), 100_000)]:
        size = ivf_train_size(spec, n)
        assert size <= n and size >= min(n, 100_000)
        assert size >= 39 * ivf_nlist(spec, n)


@pytest.mark.parametrize("bad", [{"nprobe": 0}, {"ef_search": 0}, {"hnsw_m": 1}, {"nlist": -1}, {"pq_m": -8}])
def test_dense_search_parameters_out_of_range_are_rejected(bad):
    """``nprobe=0`` failed inside faiss at the first search and ``ef_search=0`` answered one hit of k (the
    rest -1); these and the other out-of-range values are ValueErrors naming the parameter when the spec
    is made."""
    from retrieval.dense import DenseIndexSpec

    with pytest.raises(ValueError, match=next(iter(bad))):
        DenseIndexSpec(kind="ivfpq", shard_size=1_000_000, **bad)


@pytest.mark.parametrize("shard_size", [10_000, 150, 100])
def test_tied_scores_rank_lower_rows_first_whatever_k_and_sharding(tmp_path, shard_size):
    """Duplicate passages (wiki-18 has many) have equal scores. faiss's flat search keeps the lowest ids of
    a tie at the cut but lists a tie highest id first (top-1 row 0, top-2 rows [2, 0]), so a passage's rank
    changed with k and with the sharding; ties now rank lower rows first, for any k and shard size."""
    base = _unit(100, 8, seed=3)
    emb = np.concatenate([base, base, base])  # rows i, i + 100 and i + 200 tie
    spec = dense.DenseIndexSpec(shard_size=shard_size)
    idx = dense.DenseIndex.load(tmp_path, dense.build_dense_shards(emb, tmp_path, spec, show_progress=False), spec)
    q = base[:25]  # >= 20 queries: faiss's BLAS path
    want = np.stack([np.arange(25), np.arange(25) + 100, np.arange(25) + 200], axis=1)
    for k in (1, 2, 3, 5):
        rows, scores = idx.search_rows(q, k)
        assert rows[:, :3].tolist() == want[:, :k].tolist()
        assert np.all(np.diff(scores, axis=1) <= 0)
    rows, scores = idx.search_rows(q, 300)
    assert rows.shape == (25, 300) and (np.sort(rows, axis=1) == np.arange(300)).all()
    assert np.all(np.diff(scores, axis=1) <= 0)


def _plain_bert(tmp_path, name: str, pooling_files: dict[str, dict] | None = None) -> Path:
    """A tiny random BERT saved with ``save_pretrained`` in ``tmp_path/name`` (no ``modules.json``: a plain
    Hugging Face encoder), with MiniLM's tokenizer files and ``pooling_files`` (relative path -> JSON)."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    src, dst = encoder.resolve_model_path(encoder.DEFAULT_MODEL), tmp_path / name
    dst.mkdir(parents=True)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, dst / f)
    torch.manual_seed(0)
    conf = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64)
    BertModel(conf).save_pretrained(dst)
    for rel, content in (pooling_files or {}).items():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_text(json.dumps(content))
    return dst


def _pooled(path: Path, texts: list[str]) -> dict[str, np.ndarray]:
    """``{"cls": ..., "mean": ...}``: the model's unit-norm [CLS] and masked-mean embeddings ``[n, d]``,
    computed with transformers directly."""
    import torch
    from transformers import AutoTokenizer, BertModel

    tok, model = AutoTokenizer.from_pretrained(path), BertModel.from_pretrained(path).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1).numpy()
    return {"cls": unit(h[:, 0]), "mean": unit((h * mask).sum(1) / mask.sum(1))}


_CLS_LEGACY = {"word_embedding_dimension": 16, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}


@pytest.mark.parametrize(
    ("name", "files", "pooling", "want"),
    [
        ("tiny-encoder", None, None, "mean"),  # says nothing, no family: mean (sentence-transformers' default)
        ("bge-tiny", None, None, "cls"),  # the family rule: bge pools [CLS]
        ("e5-tiny", None, None, "mean"),
        ("tiny-encoder", {"1_Pooling/config.json": _CLS_LEGACY}, None, "cls"),  # the pre-v6 format
        ("tiny-encoder", {"1_Pooling/config.json": {"embedding_dimension": 16, "pooling_mode": "cls"}}, None, "cls"),
        ("bge-tiny", {"1_Pooling/config.json": {"embedding_dimension": 16, "pooling_mode": "mean"}}, None, "mean"),
        ("tiny-encoder", {"1_Pooling/config.json": {"pooling_mode": "cls"}}, None, "cls"),  # no dimension given
        ("tiny-encoder", {"1_Pooling/config.json": _CLS_LEGACY}, "mean", "mean"),  # the argument wins
        ("bge-tiny", None, "mean", "mean"),
    ],
)
def test_plain_hf_pooling_is_what_the_model_says(tmp_path, name, files, pooling, want):
    """A plain HF encoder (no modules.json) chose CLS pooling when "bge" was a word of its path and mean
    otherwise, whatever its own 1_Pooling/config.json said. Now: the ``pooling=`` argument, else the
    model's pooling config (either sentence-transformers format), else the family rule."""
    path = _plain_bert(tmp_path, name, files)
    texts = ["Big Stone Gap film", "zebrafish"]
    enc = encoder.Encoder(str(path), device="cpu", pooling=pooling)
    ref = _pooled(path, [enc.passage_prefix + t for t in texts])  # e5: "passage: "
    assert np.abs(ref["cls"] - ref["mean"]).max() > 0.1  # the two poolings are told apart
    np.testing.assert_allclose(enc.encode_passages(texts), ref[want], atol=1e-5)


def test_a_bad_pooling_config_is_an_error_naming_the_file(tmp_path):
    path = _plain_bert(tmp_path, "tiny-encoder", {"1_Pooling/config.json": {"pooling_mode": "median"}})
    with pytest.raises(ValueError, match=r"1_Pooling.config\.json.*median"):
        encoder.Encoder(str(path), device="cpu")
    (path / "1_Pooling" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"1_Pooling.config\.json"):
        encoder.Encoder(str(path), device="cpu")


def _assert_cut_at_64_tokens(path, model_cls) -> None:
    """The plain HF encoder in ``path`` takes 64 tokens and embeds a long passage as transformers does with
    the input cut at 64 (mean pooling, L2-normalised)."""
    import torch
    from transformers import AutoTokenizer

    enc = encoder.Encoder(str(path), device="cpu")
    assert enc.model.max_seq_length == 64
    text = "zebrafish live in rivers " * 40
    tok, model = AutoTokenizer.from_pretrained(path), model_cls.from_pretrained(path).eval()
    batch = tok([text], truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        want = torch.nn.functional.normalize(model(**batch).last_hidden_state.mean(1), dim=-1).numpy()
    np.testing.assert_allclose(enc.encode_passages([text]), want, atol=1e-5)


def test_plain_hf_encoder_truncates_at_the_model_s_positions(tmp_path):
    """A plain HF encoder was given max_seq_length=512 whatever the model held, so a model with fewer
    positions (64 here) failed on a long passage with a bare tensor-size RuntimeError; inputs are now cut
    at min(512, the model's positions, the tokenizer's limit), as sentence-transformers cuts them."""
    from transformers import BertModel

    path = _plain_bert(tmp_path, "tiny-encoder")
    _assert_cut_at_64_tokens(path, BertModel)


def test_plain_hf_encoder_truncates_roberta_style_models_past_their_position_offset(tmp_path):
    """RoBERTa-family models (RoBERTa, XLM-R) number positions from padding_idx + 1, so a model with 66
    position embeddings and pad id 1 takes 64 tokens; the cut at max_position_embeddings (66) indexed past
    the table (IndexError) on a long passage. Inputs are now cut at the positions left after the offset."""
    import shutil

    import torch
    from transformers import RobertaConfig, RobertaModel

    src, path = encoder.resolve_model_path(encoder.DEFAULT_MODEL), tmp_path / "tiny-roberta"
    path.mkdir()
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, path / f)
    torch.manual_seed(0)
    conf = RobertaConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=66, pad_token_id=1)
    RobertaModel(conf).save_pretrained(path)
    _assert_cut_at_64_tokens(path, RobertaModel)


def test_normalisation_is_what_a_sentence_transformers_model_says(tmp_path):
    """Every embedding was L2-normalised, whatever the model: a sentence-transformers model trained for
    dot-product scoring (no ``Normalize`` module, e.g. msmarco-distilbert-base-tas-b) was searched by cosine.
    Now its modules decide: with ``Normalize`` the vectors are unit norm (MiniLM, as before, same
    fingerprint); without, they are the model's raw vectors (same directions), their fingerprint says so (a
    resumed encoding does not mix the two) and an index built with the model scores by inner product."""
    import shutil

    from retrieval.index import build_index, load_retriever
    from tests.test_retrieval import write_corpus

    src = encoder.resolve_model_path(encoder.DEFAULT_MODEL)
    dot = tmp_path / "minilm-dot"
    shutil.copytree(src, dot)
    modules = json.loads((dot / "modules.json").read_text())
    (dot / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    unit, raw = encoder.Encoder(encoder.DEFAULT_MODEL, device="cpu"), encoder.Encoder(str(dot), device="cpu")
    assert unit.normalized and not raw.normalized
    assert unit.fingerprint == model_fingerprint(encoder.DEFAULT_MODEL) and raw.fingerprint.endswith(":unnormalised")
    texts = ["Big Stone Gap film", "zebrafish", "the tallest mountain in the Himalayas"]
    e_unit, e_raw = unit.encode_passages(texts), raw.encode_passages(texts)
    norms = np.linalg.norm(e_raw, axis=1)
    np.testing.assert_allclose(np.linalg.norm(e_unit, axis=1), 1.0, atol=1e-5)
    assert np.abs(norms - 1).min() > 0.05  # not unit norm
    np.testing.assert_allclose(e_raw / norms[:, None], e_unit, atol=1e-5)  # the same directions

    build_index(write_corpus(tmp_path / "c.jsonl"), tmp_path / "idx", dense_model=str(dot), show_progress=False)
    r = load_retriever(tmp_path / "idx", "dense")  # the open-time model check compares directions (cosine)
    q = "highest mountain Himalayas"
    hit = r.search([q], 1)[0][0]
    want = float(raw.encode_queries([q])[0] @ raw.encode_passages([hit.contents])[0])
    assert hit.score == pytest.approx(want, rel=1e-4) and abs(want) > 1.5  # an inner product, not a cosine
