"""The benchmark scripts' own logic (bench/*.py), without running a benchmark: what they time and what their
tables and JSON report."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    # bench/retrieval.py shares its name with the retrieval package: load it under another name
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rb():
    return _load("retrieval")


def test_retrieval_quality_search_time_excludes_the_first_call(rb, monkeypatch):
    calls = []

    class SlowFirst:  # the first search compiles (numba) / warms the encoder
        def search(self, queries, k):
            calls.append(len(queries))
            if len(calls) == 1:
                time.sleep(0.5)
            return [[] for _ in queries]

    monkeypatch.setattr(rb, "build_index", lambda *a, **kw: {"num_passages": 3, "dense": None})
    monkeypatch.setattr(rb, "load_retriever", lambda *a, **kw: SlowFirst())
    out: dict = {}
    rb.quality(argparse.Namespace(no_dense=True), out, None)
    assert calls[-1] == out["quality"]["questions"] == 400
    assert out["quality"]["bm25"]["search_s_all_questions"] < 0.4


def test_retrieval_latency_reports_its_sample_size(rb):
    s = rb._lat([0.01] * 39 + [0.5], 40 * 256)
    assert s["calls"] == 40 and s["p99_ms"] > 300  # of 40 calls, the p99 is (nearly) the slowest one
    row = {"passages": 10_000, "sleuth-maxscore_inproc_b1": rb._lat([0.001] * 200, 200),
           "sleuth-maxscore_inproc_b256": s}
    text = rb.table({"speed": [row]})
    assert "| 10,000 | sleuth-maxscore | inproc |" in text
    assert "200 calls at batch 1 and 40 at batch 256" in text and "fewer than 100" in text


def _learning_with_a_checkpoint_at_step_10(tmp_path, monkeypatch):
    """bench/learning.py writing under ``tmp_path``, with evaluation and model loading faked, and a checkpoint
    of step 10 that ``latest_checkpoint`` finds once ``have_ckpt["v"]`` is set. Returns (module, have_ckpt)."""
    import agent.backends.hf
    import training.infra.checkpoint

    lb = _load("learning")
    monkeypatch.setattr(lb, "WORK", tmp_path / "work")
    monkeypatch.setattr(lb, "JSON_PATH", tmp_path / "learning.json")
    monkeypatch.setattr(lb, "RESULTS", tmp_path)
    monkeypatch.setattr(lb, "evaluate", lambda *a, **kw: {"em": 0.5, "search_calls": 1.0})
    monkeypatch.setattr(agent.backends.hf, "load_model_and_tokenizer", lambda *a, **kw: (None, None))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"step": 10}')
    have_ckpt = {"v": False}
    monkeypatch.setattr(training.infra.checkpoint, "latest_checkpoint",
                        lambda d: ckpt if have_ckpt["v"] else None)
    return lb, have_ckpt


def test_learning_resumed_run_counts_the_time_before_the_interruption(tmp_path, monkeypatch):
    import training.trainer

    lb, have_ckpt = _learning_with_a_checkpoint_at_step_10(tmp_path, monkeypatch)

    def first_session(tc, agent_cfg, model, tok, retriever, train, run_dir, *, resume, on_step, evaluate, **kw):
        time.sleep(0.4)  # steps 1-10
        have_ckpt["v"] = True  # checkpoint of step 10, saved with its evaluation
        on_step(10, {"eval_em": 0.4, "reward": 0.1, "eval_search_calls": 1.0})
        raise KeyboardInterrupt  # the sweep is stopped

    res = {"runs": {}, "sft": {"em": 0.2}}
    monkeypatch.setattr(training.trainer, "rl_train", first_session)
    with pytest.raises(KeyboardInterrupt):
        lb.run_one("grpo_s0", None, [], [], res)
    monkeypatch.setattr(training.trainer, "rl_train", lambda *a, **kw: {"best_eval_em": 0.5})
    lb.run_one("grpo_s0", None, [], [], lb.load_results() | {"sft": {"em": 0.2}})
    done = lb.load_results()["runs"]["grpo_s0"]
    assert done["wall_s"] >= 0.4 and [c["step"] for c in done["curve"]] == [10]


def _rollout_result(**kw) -> dict:
    tp = {"episodes_per_s": 1.0, "gen_tokens_per_s": 100.0, "pooled_gen_tokens_per_s": 100.0, "backend_calls": 4}
    return {"date": "d", "machine": "m", "threads": 1, "model": "tiny", "questions": 8, "repeats": 3,
            "agent": {"max_turns": 4, "max_new_tokens": 8, "max_total_tokens": 160, "max_obs_tokens": 40},
            "identical": True, "throughput": {"handwritten": tp, "langgraph": tp}, "ratio": 1.0, "ratios": [1.0],
            "pooled_ratio": 1.0, "serving": {"1": {"requests": 4, "p50_ms": 1, "p99_ms": 2, "requests_per_s": 1}},
            "handwritten_main_thread": None, "overhead": {"langgraph_s": 0.2, "handwritten_s": 0.1}, **kw}


def test_rollout_markdown_names_the_command_that_was_run(tmp_path, monkeypatch):
    ro = _load("rollout")
    monkeypatch.setattr(ro, "ROOT", tmp_path)
    (tmp_path / "bench").mkdir()
    ro.update_markdown(_rollout_result(argv=["--questions", "8", "--repeats", "3", "--concurrency", "1"]))
    text = (tmp_path / "bench/RESULTS.md").read_text()
    assert "`python bench/rollout.py --questions 8 --repeats 3 --concurrency 1`" in text
    ro.update_markdown(_rollout_result())  # a result written before argv was recorded
    text = (tmp_path / "bench/RESULTS.md").read_text()
    assert "--main-thread" not in text and text.count("## Rollout") == 1
    assert "raw numbers in `bench/results/rollout.json`" in text
    ro.update_markdown(_rollout_result(argv=["--out", "runs/r.json"], json="runs/r.json"))  # --out elsewhere
    assert "raw numbers in `runs/r.json`" in (tmp_path / "bench/RESULTS.md").read_text()


def _fail_if_called(*a, **kw):
    raise AssertionError("the benchmark started before its arguments were checked")


def test_learning_unknown_run_name_is_a_usage_error_before_any_work(monkeypatch, capsys):
    lb = _load("learning")
    monkeypatch.setattr(lb, "prepare", _fail_if_called)
    monkeypatch.setattr(lb, "load_results", lambda: {"runs": {}})
    monkeypatch.setattr("sys.argv", ["learning.py", "--only", "grpo_s9"])
    with pytest.raises(SystemExit) as e:
        lb.main()
    assert e.value.code == 2 and "grpo_s9" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--questions", "0"], ["--repeats", "0"], ["--concurrency", "0"],
                                  ["--per-client", "-1"]])
def test_rollout_counts_must_be_positive(argv, tmp_path, monkeypatch, capsys):
    ro = _load("rollout")
    monkeypatch.setattr(ro, "load_policy", _fail_if_called)
    monkeypatch.setattr("sys.argv", ["rollout.py", "--tmp", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as e:
        ro.main()
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--chunk", "0"], ["--row-block", "-4"]])
def test_kernels_counts_must_be_positive(argv, capsys):
    kb = _load("kernels")
    with pytest.raises(SystemExit) as e:
        kb.main([*argv, "--cpu-smoke"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--n-single", "0"], ["--n-batches", "-1"], ["--rounds", "0"]])
def test_retrieval_counts_must_be_positive(rb, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rb, "WORK", tmp_path / "work")
    monkeypatch.setattr(rb, "RESULTS", tmp_path / "retrieval.json")
    monkeypatch.setattr(rb, "quality", _fail_if_called)
    monkeypatch.setattr(rb, "speed", _fail_if_called)
    with pytest.raises(SystemExit) as e:
        rb.main([*argv, "--no-lucene", "--no-dense"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_kernels_table_names_the_method_that_ran_out_of_memory(capsys):
    kb = _load("kernels")
    ok = {"ms": 10.0, "peak_gib": 1.0, "tflops": 100.0}
    row = {"H": 896, "N": 16384, "tool_frac": 0.3, "floor_ms": 1.0, "naive": ok, "sleuth": ok, "liger": {"oom": True}}
    kb.print_table({"gpu": "g", "matmul_tflops": 700.0, "chunk": 8192, "date": "d", "rows": [row]},
                   ["naive", "sleuth", "liger"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "liger OOM" in line and "naive OOM" not in line


@pytest.mark.parametrize("point", ["2048:65536", "x:1:0.3", "0:65536:0.4", "2048:-1:0.4", "2048:65536:1.0",
                                   "2048:65536:-0.1", "2048:65536:nan"])
def test_kernels_bad_grid_point_is_a_usage_error_before_any_work(point, monkeypatch, capsys):
    kb = _load("kernels")
    monkeypatch.setattr(kb, "run_gpu", _fail_if_called)
    monkeypatch.setattr(kb.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        kb.main(["--points", point])
    assert e.value.code == 2 and "H:N:tool_frac" in capsys.readouterr().err


def test_learning_resumed_hotpot_run_keeps_the_curve_and_time_before_the_interruption(tmp_path, monkeypatch):
    import corpora
    import sleuth.pipeline
    import training.trainer

    lb, have_ckpt = _learning_with_a_checkpoint_at_step_10(tmp_path, monkeypatch)
    for f in ("ensure_index", "run_sft_stage", "open_retriever"):
        monkeypatch.setattr(sleuth.pipeline, f, lambda *a, **kw: None)
    monkeypatch.setattr(sleuth.pipeline, "data_paths", lambda cfg: {"train": "t", "test": "t"})
    monkeypatch.setattr(corpora, "read_qa", lambda p: [])

    def first_session(tc, agent_cfg, model, tok, retriever, train, run_dir, *, resume, on_step, evaluate, **kw):
        for step in range(1, 13):
            time.sleep(0.02)
            on_step(step, {"reward": 0.1, "f1": 0.2, **({"eval_em": 0.4} if step == 10 else {})})
            if step == 10:
                have_ckpt["v"] = True  # checkpoint of step 10
        raise KeyboardInterrupt  # stopped in step 13: steps 11-12 are redone

    def second_session(tc, agent_cfg, model, tok, retriever, train, run_dir, *, resume, on_step, evaluate, **kw):
        assert resume
        for step in range(11, 31):
            on_step(step, {"reward": 0.3, "f1": 0.4, **({"eval_em": 0.6} if step % 10 == 0 else {})})
        return {"best_eval_em": 0.6}

    monkeypatch.setattr(training.trainer, "rl_train", first_session)
    with pytest.raises(KeyboardInterrupt):
        lb.run_hotpot({"runs": {}})
    monkeypatch.setattr(training.trainer, "rl_train", second_session)
    lb.run_hotpot(lb.load_results())
    h = lb.load_results()["hotpot"]
    assert [c["step"] for c in h["curve"]] == list(range(31))
    assert h["curve"][10]["em"] == 0.4 and h["wall_s"] >= 0.2


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_learning_threads_must_be_positive(threads, monkeypatch, capsys):
    lb = _load("learning")
    monkeypatch.setattr(lb, "prepare", _fail_if_called)
    monkeypatch.setattr(lb, "load_results", lambda: {"runs": {}})
    monkeypatch.setattr("sys.argv", ["learning.py", "--threads", threads])
    with pytest.raises(SystemExit) as e:
        lb.main()
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_retrieval_markdown_keeps_backslashes_of_the_notes(rb, tmp_path, monkeypatch):
    monkeypatch.setattr(rb, "RESULTS_MD", tmp_path / "RESULTS.md")
    (tmp_path / "RESULTS.md").write_text("# Benchmark results\n\n## Retrieval\n\nold\n\n## Rollout\n\nkept\n")
    note = r"pyserini comparison skipped: JVMNotFoundException: no JVM in C:\java\bin (\1 \g<0>)"
    rb.write_markdown({"date": "d", "machine": "m", "argv": ["--no-dense"], "notes": [note]}, "table")
    text = (tmp_path / "RESULTS.md").read_text()
    assert note in text and "old" not in text and "## Rollout\n\nkept" in text


def test_retrieval_blocks_give_every_path_the_same_batches(rb):
    """time_blocks numbered batches across paths, so in-process and server searched different queries (of
    different cost) in the steady and gapped comparisons the server-overhead target is judged on."""
    seen: dict[str, list[list[str]]] = {"a": [], "b": []}
    queries = [f"q{i}" for i in range(7)]
    stats = rb.time_blocks([lambda qs, k: seen["a"].append(qs), lambda qs, k: seen["b"].append(qs)],
                           queries, 3, 10, rounds=2, block=4, warmup=1)
    assert seen["a"] == seen["b"] and len(seen["a"]) == 8 and len({tuple(x) for x in seen["a"]}) > 1
    assert [s["calls"] for s in stats] == [2 * 3, 2 * 3]  # rounds x (block - warmup) timed calls per path


def test_kernels_bench_runs_without_the_config_stack():
    """bench/kernels.py runs on GPU machines that have torch but not Sleuth's other dependencies (no pydantic,
    no OmegaConf): its argument types must not pull in the config module."""
    import subprocess
    import sys

    block = "import sys; sys.modules.update(pydantic=None, omegaconf=None); sys.argv = ['kernels.py', '--cpu-smoke']"
    run = f"{block}; import runpy; runpy.run_path({str(BENCH / 'kernels.py')!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", run], check=False, capture_output=True, text=True,
                         cwd=BENCH.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "grads match" in out.stdout


def test_gpu_scale_cpu_smoke_runs_without_the_config_stack(tmp_path):
    """bench/gpu_scale.py --cpu-smoke: a tiny policy's rollout and update, with and without LoRA, on a Python
    without the modules GPU images lack (pydantic, LangGraph, FastAPI, bm25s, FAISS)."""
    import json
    import subprocess
    import sys

    out_json = tmp_path / "gpu_scale.json"
    block = ("import sys; sys.modules.update(pydantic=None, langgraph=None, fastapi=None, bm25s=None, faiss=None); "
             f"sys.argv = ['gpu_scale.py', '--cpu-smoke', '--out', {str(out_json)!r}]")
    run = f"{block}; import runpy; runpy.run_path({str(BENCH / 'gpu_scale.py')!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", run], check=False, capture_output=True, text=True,
                         cwd=BENCH.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out_json.read_text())["shapes"]["tiny"]
    for phase in ("rollout", "rollout_lora"):
        assert res[phase]["gen_tokens"] == 4 * 8 and res[phase]["gen_tokens_per_s"] > 0  # the full budget
    assert res["update"]["trainable_params"] == res["params"]
    assert 0 < res["update_lora"]["trainable_params"] < res["params"] / 10  # the adapters alone
    assert res["update"]["policy_tokens"] < res["update"]["tokens"]
    assert "| tiny |" in out.stdout and out.stdout.count("| update |") == 2


def test_gpu_scale_batch_masks_policy_turns_and_picks_the_largest_fitting_shape():
    gs = _load("gpu_scale")
    b = gs.synthetic_batch(rows=6, seq_len=400, prompt_len=100, policy_span=40, tool_span=60, vocab=1000)
    roles = b.roles[:, 1:]
    assert bool((b.loss_mask.bool() == (roles == 1)).all()) and int(b.loss_mask.sum()) > 0
    assert bool((b.roles[:, :100] == 0).all())  # the prompt
    real = b.attention_mask.sum(-1)
    assert bool((real >= 300).all()) and bool((b.roles[b.attention_mask == 0] == -1).all())
    fit = {"fits_80gb": True}
    shapes = {"0.5b": {"params": 5, "rollout": fit, "update": fit},
              "3b": {"params": 30, "rollout": fit, "update": {"oom": True}},
              "1.5b": {"params": 15, "rollout": fit, "update": fit}}
    assert gs.largest_fitting(shapes, "update") == "1.5b"
    assert gs.largest_fitting(shapes, "update_lora") is None


def test_index_plan_extrapolates_by_its_cost_model():
    ip = _load("index_plan")
    gib = 1024**3
    measured = {"flat_fp32": {"bytes": 4 * 768 * 10**6, "build_s": 10.0, "search_s": 6.4},
                "flat_fp16": {"bytes": 2 * 768 * 10**6, "build_s": 5.0, "search_s": 3.2},
                "ivfpq": {"train_s": 100.0, "add_s": 50.0, "search_s": 0.64, "nlist": 1024, "train_size": 39 * 1024,
                          "nprobe": 32}}
    x = ip.extrapolate(measured, 10**6, 21 * 10**6, 3, 64)
    assert abs(x["flat_fp32"]["gib"] - 21 * 4 * 768 * 10**6 / gib) < 1e-6  # linear in N
    assert abs(x["flat_fp32"]["ms_per_query"] - 21 * 100.0) < 1e-6  # 6.4 s / 64 queries, times 21
    iv = x["ivfpq"]
    assert iv["shards"] == 3 and iv["nlist_per_shard"] == int(4 * (7 * 10**6) ** 0.5)  # Sleuth's defaults
    assert iv["train_s"] > 100.0 * 3 * 10 and iv["add_s"] > 50.0 * 21  # more points x more lists per shard
    assert x["gpu_sharded"]["8 GPUs"]["fp16_gib_per_gpu"] * 8 == x["gpu_sharded"]["1 GPU"]["fp16_gib_per_gpu"]


@pytest.mark.slow
def test_index_plan_cpu_smoke(tmp_path):
    import json

    ip = _load("index_plan")
    ip.main(["--cpu-smoke", "--encode-passages", "16", "--out", str(tmp_path / "plan.json"),
             "--work", str(tmp_path / "work")])
    res = json.loads((tmp_path / "plan.json").read_text())
    m = res["measured"]
    assert m["flat_fp32"]["recall"] == 1.0 and m["flat_fp16"]["recall"] > 0.9
    assert m["flat_fp16"]["bytes"] * 2 == m["flat_fp32"]["bytes"] - 45  # the flat file's 45-byte header
    assert m["ivfpq"]["bytes"] < m["flat_fp16"]["bytes"] and res["encoding"]["minilm_cpu_passages_per_s"] > 0
    assert not (tmp_path / "work").exists()


def test_serve_load_cpu_smoke_loads_both_servers(tiny_data, tiny_policy_dir, tmp_path, capsys):
    """bench/serve_load.py --smoke: both servers started as their commands start them, loaded by 1 and 2
    clients; every request answered, the table printed and the JSON written with latency and memory."""
    import json

    sl = _load("serve_load")
    out = tmp_path / "serve_load.json"
    assert sl.main(["--smoke", "--corpus", str(tiny_data / "corpus.jsonl"), "--qa", str(tiny_data / "test.jsonl"),
                    "--model", str(tiny_policy_dir), "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name, per_client in (("serve-retrieval", 3), ("serve", 1)):
        rows = res["servers"][name]
        assert list(rows) == ["1", "2"]
        for c, r in rows.items():
            assert r["requests"] == int(c) * per_client and r["errors"] == {}, (name, r)
            assert 0 < r["p50_ms"] <= r["p99_ms"] and r["requests_per_s"] > 0
            assert 0 < r["rss_mb_before"] <= r["rss_mb_peak"]
    assert res["passages"] == 6
    text = capsys.readouterr().out
    assert "| serve-retrieval | POST /retrieve | 2 | 6 | 0 |" in text and "| serve | POST /ask | 1 | 1 | 0 |" in text


def test_serve_load_percentiles_and_counts_must_be_positive(capsys):
    sl = _load("serve_load")
    assert sl.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and sl.percentile([1.0] * 98 + [9.0] * 2, 0.99) == 9.0
    with pytest.raises(SystemExit) as e:
        sl.main(["--clients", "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_learning_runs_of_one_task_side_by_side_keep_each_others_records(tmp_path, monkeypatch):
    """Two processes of one task (each its own module state) save to the same JSON: neither loses the
    other's runs, and each reads the other's back on its next save."""
    a, b = _load("learning"), _load("learning")
    for lb in (a, b):
        monkeypatch.setattr(lb, "RESULTS", tmp_path)
        monkeypatch.setattr(lb, "JSON_PATH", tmp_path / "learning.json")
    res_a, res_b = a.load_results(), b.load_results()  # both start from the same (empty) file
    a._OWN_RUNS.add("grpo-s0")
    res_a["runs"]["grpo-s0"] = {"rl_em": 0.5}
    a.save_results(res_a)
    b._OWN_RUNS.add("ppo-s0")
    res_b["runs"]["ppo-s0"] = {"rl_em": 0.6}
    res_b["sft"] = {"em": 0.3}
    b.save_results(res_b)
    res_a["runs"]["grpo-s0"]["rl_em"] = 0.55  # a's own run, updated after b saved
    a.save_results(res_a)
    on_disk = a.load_results()
    assert on_disk["runs"] == {"grpo-s0": {"rl_em": 0.55}, "ppo-s0": {"rl_em": 0.6}}
    assert on_disk["sft"] == {"em": 0.3} and res_a["runs"]["ppo-s0"] == {"rl_em": 0.6}


def test_learning_long_budget_run_names():
    lb = _load("learning")
    algo, seed, extra = lb.run_spec("evidence_igpo-long-s2")
    assert (algo, seed) == ("evidence_igpo", 2) and extra["steps"] == lb.LONG_BUDGET["steps"] > lb.COMPARE["steps"]
    assert lb.run_spec("gspo-long-s0")[2]["algorithm.policy_loss"] == "gspo"  # the estimator's own overrides kept
    with pytest.raises(KeyError):
        lb.run_spec("nonesuch-long-s0")


def test_scale_sim_times_one_episode_exactly_in_each_mode():
    """bench/scale_sim.py on one engine and one episode (prompt 3, turns (10 generated, 5 observed), (4, 0)):
    continuous batching prefills only the new tokens; static calls prefill the whole context; the update and
    the sync follow the rollout (sync), overlap it (async) or run beside the engines (fleet)."""
    import sys

    sys.path.insert(0, str(BENCH))
    sim = importlib.import_module("scale_sim")
    prof = sim.Profile("t", "continuous", iter_fixed_s=1.0, iter_per_seq_s=0.0, call_fixed_s=0.0,
                       prefill_per_token_s=0.1, max_batch=8, tool_s=2.0, update_fixed_s=3.0, update_per_token_s=0.0,
                       sync_s=0.5, push_s=0.25, shared_device=True)
    eps = [[3, [(10, 5), (4, 0)]]]
    one = sim.simulate("colocated-sync", prof, eps, questions=1, group_size=1, gpus=1, steps=3)
    rollout = 3 * 0.1 + 10 + 2 + 5 * 0.1 + 4  # 16.8 s
    assert one["step_s"] == pytest.approx(rollout + 3.0 + 0.5)
    static = sim.simulate("colocated-sync", sim.replace(prof, kind="static", call_fixed_s=0.2), eps, 1, 1, 1, steps=3)
    assert static["step_s"] == pytest.approx((0.2 + 0.3 + 10) + 2 + (0.2 + 1.8 + 4) + 3.5)  # context 3, then 18
    # fleet: the engine generates the next group while the trainer updates (3 s) and pushes (engines paused)
    fleet = sim.simulate("fleet-async", prof, eps, questions=1, group_size=1, gpus=2, engine_gpus=1, steps=6)
    assert fleet["step_s"] == pytest.approx(rollout + 0.25, rel=0.01)
    assert set(fleet["staleness"]) == {"0", "1"} and fleet["staleness"]["1"] >= 4


def test_learning_method_presets_and_the_short_budget_against_grpo():
    lb = _load("learning")
    assert lb.run_spec("egrpo-s1") == ("grpo", 1, {**lb.COMPARE, "algorithm.reward": "egrpo"})
    algo, seed, extra = lb.run_spec("aepo-short-s2")
    assert (algo, seed, extra["steps"]) == ("aepo", 2, lb.SHORT_BUDGET["steps"]) and extra["steps"] < lb.COMPARE["steps"]
    assert extra["algorithm.options"] == {"reinforce_samples": 4} and extra["algorithm.ppo_epochs"] == 2
    assert lb.compare_names([0, 1], ["ikea"], "short") == ["grpo-short-s0", "ikea-short-s0", "grpo-short-s1",
                                                           "ikea-short-s1"]
    for name in lb.compare_names(lb.SEEDS, list(lb.METHODS)):  # every preset is a config that validates
        algo, seed, extra = lb.run_spec(name)
        lb.base_config(seed, algo, extra)


def test_learning_report_compares_the_short_budget_with_grpo_at_that_budget():
    rep = _load("learning_report")
    run = lambda em, pq: {"rl_em": em, "sft_em": 0.2, "steps": 50, "wall_s": 60.0, "curve": [{"step": 50, "em": em}],
                          "final": {"per_question": pq, "em_hops1": em, "search_hops1": 1.0}}
    res = {"sft": {"em": 0.2, "em_hops1": 0.2, "search_hops1": 1.0},
           "runs": {"grpo-s0": run(0.9, [1, 1]), "grpo-short-s0": run(0.5, [1, 0]), "ikea-short-s0": run(0.5, [0, 1])}}
    rows = rep.task_table("v1", res, {"grpo": None, "ikea": None}, (1,))
    (ikea,) = [r for r in rows if r.startswith("| ikea, 50 steps")]
    assert "| +0.0 [" in ikea  # against grpo-short (0.5), not the 200-step grpo (0.9)
    assert [r.split(" |")[0] for r in rows[5:]] == ["| grpo", "| grpo, 50 steps", "| ikea, 50 steps"]
