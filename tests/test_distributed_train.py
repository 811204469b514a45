"""A full RL run under ``torchrun --nproc_per_node 2`` (FSDP2, gloo on CPU): 2 steps with checkpoints, then a
resume for a third step, on the tiny policy and the BM25 fixture.

Checked: both ranks hold identical full (rollout) parameters and the same merged step record after every
step; only rank 0 writes checkpoints, once per step; the checkpoint holds the full optimizer state and a
resumed run restores it exactly (AdamW moments of every parameter); 2 steps + resume + 1 step equals 3
steps straight; the same checkpoint also resumes on one process (another world size); DAPO's dynamic
sampling refills per rank from disjoint questions with the data stream in step on both ranks; LoRA
adapters train and are saved under FSDP2; a NaN loss on one rank skips the step on both; a failed setup
on rank 0 fails rank 1 too, and a rank that never arrives makes the others time out instead of hanging.

As a script (run by torchrun): ``python tests/test_distributed_train.py PHASE POLICY_DIR INDEX_DIR OUT`` with
PHASE ``train`` (the refill check, then a 3-step run, a 2-step run and a 2-step LoRA run), ``resume`` or
``failure``. Each rank writes a ``done`` marker after :func:`training.infra.distributed.shutdown` returns: a
non-zero exit *after* every rank wrote it is a known abort of gloo's teardown and only warns;
a missing marker or any mismatch fails.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import run_rl

ROOT = Path(__file__).resolve().parent.parent


def state_hash(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def cfg_for(steps: int, *extra: str):
    from tests.test_trainer import make_cfg

    return make_cfg(f"train.steps={steps}", "train.optim.lr_warmup_steps=2", "train.dist_timeout_s=120",
                    "train.optim.micro_batch_tokens=250", *extra)


# -- the worker (one per rank, under torchrun) --------------------------------------------------------
def worker(phase: str, policy_dir: str, index_dir: str, out_dir: str) -> None:
    import training.run_state as RS
    from retrieval.index import load_retriever
    from tests.conftest import QUESTIONS
    from tests.test_trainer import SeededLLM, load, varying_judge
    from training.infra import distributed as D

    out = Path(out_dir)
    if phase == "failure":
        return failure_worker(out)
    if phase == "extras":
        return extras_worker(policy_dir, index_dir, out)
    if phase == "ppo":
        return ppo_worker(policy_dir, index_dir, out)
    rank, W = D.init_from_env("gloo", timeout_s=120)
    assert W == 2
    torch.set_num_threads(1)
    retriever = load_retriever(index_dir, "bm25")

    real_save, real_load = RS.save_checkpoint, RS.load_full_optimizer_state

    def logged_save(run_dir, step, *a, **kw):  # who writes checkpoints, and how often
        with open(out / f"saves.rank{rank}.txt", "a") as f:
            f.write(f"{Path(run_dir).name} {step}\n")
        return real_save(run_dir, step, *a, **kw)

    def recorded_load(module, optimizer, state):  # the optimizer state right after the resume loaded it
        real_load(module, optimizer, state)
        full = D.full_optimizer_state(module, optimizer)
        if rank == 0:
            torch.save(full, out / "loaded_optimizer.pt")

    RS.save_checkpoint, RS.load_full_optimizer_state = logged_save, recorded_load

    def run(name: str, steps: int, resume: bool = False, *extra: str) -> None:
        held = {}

        def factory(model, tok):
            held["model"] = model
            return SeededLLM(model, tok)

        def on_step(step, record):
            with open(out / f"steps.{name}.rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "params": state_hash(held["model"]),
                                    "record": json.dumps(record, sort_keys=True)}) + "\n")

        model, tok = load(policy_dir)
        if resume:
            from agent.backends.hf import load_model_and_tokenizer
            from training.infra.checkpoint import latest_checkpoint

            model, tok = load_model_and_tokenizer(str(latest_checkpoint(out / name)), device="cpu")
        run_rl(cfg_for(steps, "train.rollout.dynamic_sampling=true", *extra), model, tok, retriever, QUESTIONS, out / name,
                   resume=resume, judge=varying_judge, llm_factory=factory, on_step=on_step)
        if rank == 0:
            torch.save({k: v.clone() for k, v in held["model"].state_dict().items()}, out / f"final.{name}.pt")

    if phase == "train":
        refill_check(rank, policy_dir, retriever, out)
        run("straight", 3)
        run("split", 2)
        run("lora", 2, False, "train.optim.lora=true", "train.optim.lr=1e-2")
    else:
        run("split", 3, resume=True)
        nan_on_one_rank(rank, policy_dir, out)
    D.shutdown()
    (out / f"done.{phase}.rank{rank}").touch()


def failure_worker(out: Path) -> None:
    """A setup failure on rank 0 fails rank 1 too, as does a result rank 0 cannot send; then rank 1 never
    arrives and rank 0 times out."""
    import time

    from training.infra import distributed as D

    rank, _W = D.init_from_env("gloo", timeout_s=3)

    def setup():
        raise FileNotFoundError("no corpus here")

    try:
        D.run_on_rank0(setup)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        (out / f"setup_error.rank{rank}").write_text(f"{type(e).__name__}: {e}")
    try:  # a result that cannot be pickled (sent to the other ranks) fails them at once too
        D.run_on_rank0(lambda: {"score": lambda: 0.5}, timeout_s=8)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        (out / f"unpicklable.rank{rank}").write_text(f"{type(e).__name__}: {e}")
    if rank == 1:
        time.sleep(60)  # hangs (killed by torchrun once rank 0 exits)
    t0 = time.time()
    try:
        D.barrier()
    except Exception as e:  # recorded, then the rank fails as a training run would
        (out / "timeout.rank0").write_text(f"{time.time() - t0:.1f} {type(e).__name__}")
        raise SystemExit(3) from e


def extras_worker(policy_dir: str, index_dir: str, out: Path) -> None:
    """With a custom ``sync_weights`` the checkpoint holds the trained weights (not the initial ones) and
    ``adv_abs_mean`` is the mean over both ranks' policy tokens; then an evaluation on rank 0 that takes
    and a checkpoint write longer than the collective timeout (10 s) do not time the other rank out; a resume
    where the ranks see different checkpoints fails on every rank."""
    import time

    import training.algos.estimators as E
    import training.run_state as RS
    from retrieval.index import load_retriever
    from tests.conftest import QUESTIONS
    from tests.test_trainer import SeededLLM, load, varying_judge
    from training.infra import distributed as D

    rank, _W = D.init_from_env("gloo", timeout_s=10)
    torch.set_num_threads(1)
    retriever = load_retriever(index_dir, "bm25")
    pushed: dict[str, torch.Tensor] = {}

    def sync(llm, state):  # a backend that holds its own weights (as vLLM does)
        pushed.clear()
        pushed.update({k: v.clone() for k, v in state.items()})

    real_adv = E.compute_advantages

    def recorded_adv(tc, inp):
        adv = real_adv(tc, inp)
        torch.save((adv["advantages"], inp.mask), out / f"adv.rank{rank}.pt")
        return adv

    def on_step(step, record):
        (out / f"record.rank{rank}.json").write_text(json.dumps(record))

    E.compute_advantages = recorded_adv
    try:
        model, tok = load(policy_dir)
        run_rl(cfg_for(1), model, tok, retriever, QUESTIONS, out / "sync", judge=varying_judge,
                   llm_factory=SeededLLM, sync_weights=sync, on_step=on_step)
    finally:
        E.compute_advantages = real_adv
    if rank == 0:
        torch.save(pushed, out / "pushed.pt")

    def slow_eval(model):
        time.sleep(14)
        return {"em": 0.5}

    real_save = RS.save_checkpoint

    def slow_save(*a, **kw):  # a large checkpoint: the write takes longer than the collective timeout
        time.sleep(12)
        return real_save(*a, **kw)

    model, tok = load(policy_dir)
    RS.save_checkpoint = slow_save
    try:
        res = run_rl(cfg_for(1, "train.monitoring.eval_every=1"), model, tok, retriever, QUESTIONS, out / "eval",
                         judge=varying_judge, llm_factory=SeededLLM, evaluate=slow_eval)
        result = f"ok {res['last'].get('eval_em')}"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = f"{type(e).__name__}: {e}"[:300]
    finally:
        RS.save_checkpoint = real_save
    (out / f"eval.rank{rank}.txt").write_text(result)

    # a resume where the ranks do not see the same checkpoints (a run directory that is not shared)
    model, tok = load(policy_dir)
    try:
        run_rl(cfg_for(2), model, tok, retriever, QUESTIONS, out / ("sync" if rank == 0 else "not_shared"),
                   resume=True, judge=varying_judge, llm_factory=SeededLLM)
        result = "no error"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = f"{type(e).__name__}: {e}"[:300]
    (out / f"not_shared.rank{rank}.txt").write_text(result)
    D.shutdown()
    (out / f"done.extras.rank{rank}").touch()


def ppo_worker(policy_dir: str, index_dir: str, out: Path) -> None:
    """PPO with a separate critic on 2 ranks: 3 steps straight, and 2 steps + a resume for the third. Each
    rank records its full policy and critic weights and the record after every step, and rank 0 the critic's
    optimizer state right after the resume loaded it."""
    import training.algos.estimators as E
    import training.run_state as RS
    from agent.backends.hf import load_model_and_tokenizer
    from retrieval.index import load_retriever
    from tests.conftest import QUESTIONS
    from tests.test_trainer import SeededLLM, load, varying_judge
    from training.infra import distributed as D
    from training.infra.checkpoint import latest_checkpoint

    rank, _W = D.init_from_env("gloo", timeout_s=120)
    torch.set_num_threads(1)
    retriever = load_retriever(index_dir, "bm25")
    made, real_value_model = {}, None

    def remember(*a, **kw):  # the critic rl_train builds (the full weights are gathered after each step)
        made["critic"] = real_value_model(*a, **kw)
        return made["critic"]

    real_load = RS.load_critic_optimizer

    def recorded_load(critic, optimizer, state, r, W):
        real_load(critic, optimizer, state, r, W)
        full = D.full_optimizer_state(critic, optimizer)
        if r == 0:
            torch.save(full, out / "ppo_loaded_critic_optimizer.pt")

    real_whiten = E.batch_masked_whiten

    def recorded_whiten(values, mask):  # PPO's advantages of the first step, before and after whitening
        res = real_whiten(values, mask)
        if not (out / f"whiten.rank{rank}.pt").exists():
            torch.save((values, mask, res), out / f"whiten.rank{rank}.pt")
        return res

    real_value_model = RS.ValueModel
    RS.ValueModel, RS.load_critic_optimizer, E.batch_masked_whiten = remember, recorded_load, recorded_whiten
    try:
        for name, steps, resume in (("ppo_straight", 3, False), ("ppo_split", 2, False), ("ppo_split", 3, True)):
            held = {}

            def factory(model, tok, held=held):
                held["model"] = model
                return SeededLLM(model, tok)

            def on_step(step, record, name=name, held=held):
                critic = D.full_state_dict(made["critic"])  # a collective: every rank
                with open(out / f"steps.{name}.rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "params": state_hash(held["model"]),
                                        "critic": hashlib.sha256(b"".join(
                                            v.float().contiguous().numpy().tobytes() for _, v in sorted(critic.items())
                                        )).hexdigest(), "record": json.dumps(record, sort_keys=True)}) + "\n")
                if rank == 0 and step == 3:
                    torch.save({"policy": {k: v.clone() for k, v in held["model"].state_dict().items()},
                                "critic": critic}, out / f"final.{name}.pt")

            model, tok = (load_model_and_tokenizer(str(latest_checkpoint(out / name)), device="cpu") if resume
                          else load(policy_dir))
            run_rl(cfg_for(steps, "train.algorithm.adv_estimator=ppo", "train.algorithm.critic=separate", "train.optim.critic_lr=1e-2"), model,
                       tok, retriever, QUESTIONS, out / name, resume=resume, judge=varying_judge, llm_factory=factory,
                       on_step=on_step)
    finally:
        RS.ValueModel, RS.load_critic_optimizer = real_value_model, real_load
        E.batch_masked_whiten = real_whiten
    D.shutdown()
    (out / f"done.ppo.rank{rank}").touch()


def nan_on_one_rank(rank: int, policy_dir: str, out: Path) -> None:
    """A non-finite loss on rank 1 only: both ranks skip the step (FloatingPointError), none hangs."""
    import training.model.actor as ACT
    from tests.test_fsdp import build, train_cfg
    from training.infra import distributed as D
    from training.model.actor import update_policy
    from training.model.forward import LogprobModule
    from training.model.fsdp import shard

    model, batch = build()
    fwd = shard(LogprobModule(model))
    opt = torch.optim.AdamW(fwd.parameters(), lr=1e-2)
    before = D.full_state_dict(fwd)
    real = ACT.policy_loss

    def loss_fn(*a, **kw):
        loss, stats = real(*a, **kw)
        return (loss * float("nan") if rank == 1 else loss), stats

    ACT.policy_loss = loss_fn
    try:
        update_policy(fwd, None, opt, batch.select(torch.arange(len(batch))[rank::2]), train_cfg())
        result = "no error"
    except FloatingPointError as e:
        result = f"FloatingPointError: {e}"
    finally:
        ACT.policy_loss = real
    after = D.full_state_dict(fwd)
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    (out / f"nan.rank{rank}.txt").write_text(f"{result}|moved={moved}")


def refill_check(rank: int, policy_dir: str, retriever, out: Path) -> None:
    """DAPO refill on 2 ranks: only the Germany questions ever get varying rewards."""
    from agent.backends.hf import TransformersLLM
    from tests.conftest import QUESTIONS
    from tests.test_trainer import load
    from training.rollout.worker import DataStream, RolloutWorker, rollout

    def judge(traj):
        r = float(len(traj.token_ids) % 2) if "Germany" in traj.question else 0.0
        return r, {"em": r}

    model, tok = load(policy_dir)
    torch.manual_seed(rank)
    data = DataStream(QUESTIONS, 0)
    cfg = cfg_for(1, "train.rollout.dynamic_sampling=true", "train.rollout.dynamic_sampling_max_tries=3", "train.rollout.group_size=4")
    first = data.next(2)
    worker = RolloutWorker(TransformersLLM(model, tok), retriever, cfg.agent, cfg.retrieval.top_k, judge)
    trajs, stats = rollout(worker, first[rank::2], cfg.train, data)
    (out / f"refill.rank{rank}.json").write_text(json.dumps({
        "position": data.position, "stats": stats, "groups": sorted({t.group for t in trajs}),
        "n": len(trajs), "questions": sorted({t.question for t in trajs}),
        "varying": all(max(r) > min(r) for r in
                       [[t.reward for t in trajs if t.group == g] for g in {t.group for t in trajs}])}))


# -- the test -----------------------------------------------------------------------------------------
def torchrun(phase: str, tiny_policy_dir, bm25_index, out: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with socket.socket() as sock:  # a free port (torchrun's --master_port 0 hangs with the static rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([exe, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                           str(Path(__file__)), phase, str(tiny_policy_dir), str(bm25_index), str(out)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if phase == "failure":
        return proc
    done = [(out / f"done.{phase}.rank{r}").exists() for r in (0, 1)]
    assert all(done), f"torchrun {phase}: ranks done {done}, exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    if proc.returncode != 0:  # every rank got past shutdown(): the gloo teardown abort, not a training failure
        warnings.warn(f"torchrun {phase} exited {proc.returncode} after every rank finished", stacklevel=1)
    return proc


def read_steps(out: Path, name: str, rank: int) -> list[dict]:
    return [json.loads(x) for x in (out / f"steps.{name}.rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_train_checkpoint_resume(tiny_policy_dir, bm25_index, retriever, tmp_path):
    import training.run_state as RS
    from agent.backends.hf import load_model_and_tokenizer
    from tests.conftest import QUESTIONS
    from tests.test_trainer import SeededLLM, varying_judge
    from training.infra.checkpoint import latest_checkpoint

    out = tmp_path
    torchrun("train", tiny_policy_dir, bm25_index, out)

    # dynamic sampling per rank: disjoint refill questions, the stream in step, as many groups on each rank
    r0, r1 = (json.loads((out / f"refill.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["position"] == r1["position"] > 2 and r0["stats"]["ds_rounds"] == r1["stats"]["ds_rounds"] >= 1
    assert r0["n"] == r1["n"] and r0["groups"] == r1["groups"] == list(range(len(r0["groups"])))
    assert not set(r0["questions"]) & set(r1["questions"])
    assert r0["varying"] or r0["stats"]["ds_kept_groups"] == 0

    ckpt2 = out / "split" / "checkpoints" / "step_000002"
    saved_opt = torch.load(ckpt2 / "optimizer.pt")
    assert saved_opt["state"] and all("exp_avg" in s for s in saved_opt["state"].values())
    assert json.loads((ckpt2 / "trainer_state.json").read_text())["world_size"] == 2
    assert len(torch.load(ckpt2 / "trainer.pt", weights_only=False)["rng_per_rank"]) == 2
    shutil.copytree(out / "split", out / "one_process")  # the step-2 run, resumed below on 1 process

    torchrun("resume", tiny_policy_dir, bm25_index, out)

    # only rank 0 wrote checkpoints, once per step
    assert not (out / "saves.rank1.txt").exists()
    assert (out / "saves.rank0.txt").read_text().split("\n")[:-1] == [
        "straight 1", "straight 2", "straight 3", "split 1", "split 2", "lora 1", "lora 2", "split 3"]
    # both ranks hold the same full parameters and the same merged record after every step
    for name, steps in (("straight", [1, 2, 3]), ("split", [1, 2, 3]), ("lora", [1, 2])):
        a, b = read_steps(out, name, 0), read_steps(out, name, 1)
        assert [x["step"] for x in a] == [x["step"] for x in b] == steps
        assert [x["params"] for x in a] == [x["params"] for x in b], f"{name}: ranks differ"
        assert [x["record"] for x in a] == [x["record"] for x in b]
        assert len({x["params"] for x in a}) == len(steps)  # and the parameters moved every step
    lora = torch.load(out / "lora" / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)["extra"]["lora"]
    assert lora and any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # adapters trained, saved
    # a NaN loss on one rank: every rank skips the step, no parameter moves
    for r in (0, 1):
        assert (out / f"nan.rank{r}.txt").read_text() == "FloatingPointError: non-finite gradient norm|moved=False"
    # the resumed run restored the saved optimizer state exactly
    loaded = torch.load(out / "loaded_optimizer.pt")
    assert set(loaded["state"]) == set(saved_opt["state"])
    for k, s in saved_opt["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][k][key], s[key]), f"{k}.{key} not restored"
    assert loaded["param_groups"][0]["lr"] == saved_opt["param_groups"][0]["lr"]
    # 2 steps + resume + 1 step == 3 steps straight
    straight, split = torch.load(out / "final.straight.pt"), torch.load(out / "final.split.pt")
    for k, v in straight.items():
        torch.testing.assert_close(split[k], v, rtol=0, atol=1e-6, msg=f"{k}: resumed run differs")
    steps = [json.loads(x)["step"] for x in (out / "split" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]

    # the 2-rank checkpoint resumes on one process (another world size: same state, warned)
    real_load = RS.load_full_optimizer_state
    seen = {}

    def recorded_load(module, optimizer, state):
        real_load(module, optimizer, state)
        from training.infra.distributed import full_optimizer_state

        seen.update(copy.deepcopy(full_optimizer_state(module, optimizer)))  # one process: live tensors

    RS.load_full_optimizer_state = recorded_load
    try:
        model, tok = load_model_and_tokenizer(str(latest_checkpoint(out / "one_process")), device="cpu")
        with pytest.warns(UserWarning, match="saved on 2 ranks on 1"):
            res = run_rl(cfg_for(3, "train.rollout.dynamic_sampling=true"), model, tok, retriever, QUESTIONS,
                             out / "one_process", resume=True, judge=varying_judge, llm_factory=SeededLLM)
    finally:
        RS.load_full_optimizer_state = real_load
    assert res["start_step"] == 2 and latest_checkpoint(out / "one_process").name == "step_000003"
    for k, s in saved_opt["state"].items():
        assert torch.equal(seen["state"][k]["exp_avg"], s["exp_avg"])
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


@pytest.mark.slow
def test_ppo_with_a_separate_critic_under_torchrun(tiny_policy_dir, bm25_index, tmp_path):
    """PPO's critic is sharded with FSDP2 on its own: both ranks hold the same policy and critic after every
    step and both move; the checkpoint holds the full critic and its name-keyed optimizer state, which a
    resume restores exactly; 2 steps + resume + 1 step == 3 steps straight, critic included."""
    out = tmp_path
    torchrun("ppo", tiny_policy_dir, bm25_index, out)
    for name, steps in (("ppo_straight", [1, 2, 3]), ("ppo_split", [1, 2, 3])):
        a, b = read_steps(out, name, 0), read_steps(out, name, 1)
        assert [x["step"] for x in a] == [x["step"] for x in b] == steps
        assert [(x["params"], x["critic"], x["record"]) for x in a] == [(x["params"], x["critic"], x["record"])
                                                                       for x in b], f"{name}: ranks differ"
        assert len({x["params"] for x in a}) == len({x["critic"] for x in a}) == 3  # both models moved every step
        assert all(json.loads(x["record"])["vf_loss"] > 0 for x in a)
    ckpt2 = torch.load(out / "ppo_split" / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)["extra"]
    saved = ckpt2["critic_optimizer"]
    assert saved["state"] and all(isinstance(k, str) and "exp_avg" in v for k, v in saved["state"].items())
    assert "head.weight" in ckpt2["critic"] and not any(k.startswith("_fsdp") for k in ckpt2["critic"])
    loaded = torch.load(out / "ppo_loaded_critic_optimizer.pt")
    assert set(loaded["state"]) == set(saved["state"])
    for k, s in saved["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][k][key], s[key]), f"critic {k}.{key} not restored"
    # the advantages are whitened over both ranks' tokens, as one process whitens the whole batch
    from training.algos.advantages import masked_whiten

    (v0, m0, w0), (v1, m1, w1) = (torch.load(out / f"whiten.rank{r}.pt") for r in (0, 1))
    T = max(v0.shape[1], v1.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, T - x.shape[1]))
    whole = masked_whiten(torch.cat([pad(v0), pad(v1)]), torch.cat([pad(m0), pad(m1)]))
    torch.testing.assert_close(torch.cat([pad(w0), pad(w1)]), whole, rtol=1e-5, atol=1e-5)
    assert abs(float((w0 * m0).sum() / m0.sum())) > 1e-3  # not each rank's own whitening
    straight, split = torch.load(out / "final.ppo_straight.pt"), torch.load(out / "final.ppo_split.pt")
    for part in ("policy", "critic"):
        for k, v in straight[part].items():
            torch.testing.assert_close(split[part][k], v, rtol=0, atol=1e-6, msg=f"{part} {k}: resumed run differs")


@pytest.mark.slow
def test_a_failing_or_missing_rank_does_not_hang_the_others(tmp_path):
    proc = torchrun("failure", "-", "-", tmp_path)
    assert proc.returncode != 0
    assert (tmp_path / "setup_error.rank0").read_text() == "FileNotFoundError: no corpus here"
    assert (tmp_path / "setup_error.rank1").read_text() == "RuntimeError: rank 0 failed: FileNotFoundError: no corpus here"
    msg = (tmp_path / "unpicklable.rank1").read_text()
    assert msg.startswith("RuntimeError: rank 0 failed: ") and "pickle" in msg, msg
    assert "pickle" in (tmp_path / "unpicklable.rank0").read_text()
    waited = float((tmp_path / "timeout.rank0").read_text().split()[0])
    assert 2.0 < waited < 30.0  # the collective timed out (3 s) instead of waiting for the sleeping rank


def test_merged_stop_rates_count_ranks_without_the_reason_as_zero():
    from training.trainer import merge_rank_records

    a = ({"reward": 1.0, "stop/answer": 1.0}, 4)  # rank 0: every episode answered
    b = ({"reward": 0.0, "stop/max_turns": 1.0}, 4)  # rank 1: every episode ran out of turns
    rec = merge_rank_records([a, b], set())
    assert rec["reward"] == 0.5
    assert rec["stop/answer"] == rec["stop/max_turns"] == 0.5  # rates over all 8 episodes, summing to 1


@pytest.mark.slow
def test_custom_weight_sync_slow_eval_and_token_means_under_torchrun(tiny_policy_dir, bm25_index, tmp_path):
    from safetensors.torch import load_file

    torchrun("extras", tiny_policy_dir, bm25_index, tmp_path)
    # the checkpoint holds the weights pushed to the rollout backend after the update, not the initial ones
    pushed = torch.load(tmp_path / "pushed.pt")
    saved = load_file(str(tmp_path / "sync" / "checkpoints" / "step_000001" / "model.safetensors"))
    assert pushed and set(saved) <= set(pushed)
    for k, v in saved.items():
        assert torch.equal(v, pushed[k]), f"{k}: the checkpoint is not the trained weights"
    # adv_abs_mean: the mean |advantage| over the policy tokens of both ranks (as on one process)
    parts = [torch.load(tmp_path / f"adv.rank{r}.pt") for r in (0, 1)]
    want = sum(float((a.abs() * m).sum()) for a, m in parts) / sum(float(m.sum()) for _, m in parts)
    for r in (0, 1):
        rec = json.loads((tmp_path / f"record.rank{r}.json").read_text())
        assert rec["adv_abs_mean"] == pytest.approx(want, rel=1e-6)
    # an evaluation and a checkpoint write longer than the collective timeout: both ranks finish
    for r in (0, 1):
        assert (tmp_path / f"eval.rank{r}.txt").read_text() == "ok 0.5"
    # ranks that see different checkpoints of the run directory refuse to resume, all of them, at once
    for r in (0, 1):
        msg = (tmp_path / f"not_shared.rank{r}.txt").read_text()
        assert msg.startswith("ValueError: ") and "step_000001" in msg and "file system" in msg, msg
    best = tmp_path / "eval" / "checkpoints" / "best"
    assert json.loads((best / "best.json").read_text()) == {"from": "step_000001", "metric": 0.5}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(*sys.argv[1:5])


@pytest.mark.parametrize("env, arg", [("10m", None), (None, float("inf")), ("nan", None)])
def test_a_bad_collective_timeout_is_refused_with_its_name(monkeypatch, env, arg):
    """SLEUTH_DIST_TIMEOUT_S=10m raised float()'s bare 'could not convert string to float', and an infinite
    train.dist_timeout_s timedelta's OverflowError; both are a ValueError naming the setting, raised
    before any process group exists."""
    import torch.distributed as dist

    from training.infra.distributed import init_from_env

    monkeypatch.setenv("WORLD_SIZE", "2")
    if env is None:
        monkeypatch.delenv("SLEUTH_DIST_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("SLEUTH_DIST_TIMEOUT_S", env)
    with pytest.raises(ValueError, match="SLEUTH_DIST_TIMEOUT_S|dist_timeout_s"):
        init_from_env("gloo", timeout_s=arg)
    assert not dist.is_initialized()
