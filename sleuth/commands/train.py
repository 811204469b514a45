"""``sleuth train``: SFT warm start (if enabled) then multi-turn RL (``train.algorithm.adv_estimator``: GRPO,
PPO, RLOO, ...) with tool-token masking, into ``<out_dir>/<estimator>``.

Under ``torchrun --nproc_per_node N -m sleuth.cli train ...`` rank 0 alone writes the run config, builds
the index and the tiny policy and runs the SFT warm start while the other ranks wait (a failure there
stops every rank); then all ranks train with FSDP2 (:func:`training.trainer.rl_train`), rank 0 alone logs
and checkpoints, and the process group ends with a barrier. Collectives time out after
``train.dist_timeout_s`` seconds, so a rank that died makes the others fail rather than hang.

One training at a time per ``out_dir``: rank 0 holds it (:func:`training.infra.checkpoint.run_dir_lock`) from
before it writes the run config to the end, and a second ``sleuth train`` there is refused at once
(:class:`training.infra.checkpoint.RunDirBusyError`, one line from the CLI).

Ctrl-C (SIGINT) and SIGTERM (a job scheduler's stop, ``kill``) end the run the same way: the checkpoint being
written is either committed or left out (writes are atomic), and the last complete checkpoint and the
command that resumes from it are printed (:func:`interrupted_message`); the exit status is 130 or 143.
"""

from __future__ import annotations

import contextlib

from sleuth.commands.common import add_config_arguments

HELP = ("train the policy: SFT warm start, then multi-turn RL (train.algorithm.adv_estimator; metrics, "
        "checkpoints, --resume; torchrun)")


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is (as Ctrl-C raises ``KeyboardInterrupt``), so that the run
    unwinds: the proxy, the engines and the run-directory lock are released, and the way back is printed."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped()


def resume_command(args) -> str:
    """The ``sleuth train`` command line of ``args`` with ``--resume`` (what continues an interrupted run)."""
    import shlex

    words = ["sleuth", "train"] + (["--config", args.config] if args.config else []) + list(args.overrides or [])
    return shlex.join([*words, "--resume"])


def interrupted_message(cfg, args, signal_name: str) -> str:
    """What ``sleuth train`` prints when ``signal_name`` stops it: the run's last complete checkpoint (or that
    there is none yet) and the command that resumes it."""
    from sleuth.pipeline import rl_run_dir
    from training.infra.checkpoint import latest_checkpoint

    run_dir = rl_run_dir(cfg)
    ckpt = latest_checkpoint(run_dir)
    head = f"sleuth train: stopped by {signal_name}"
    if ckpt is None:
        return (f"{head} before the first checkpoint of {run_dir}; run it again (the index, the tiny policy and the "
                f"SFT model are reused): {resume_command(args)}")
    import json

    step = json.loads((ckpt / "trainer_state.json").read_text()).get("step")
    return f"{head}; the last checkpoint is {ckpt} (step {step}); resume from it with: {resume_command(args)}"


def run(args) -> int:
    import os
    import signal
    import sys

    cfg = None
    try:  # (the main thread alone may set a handler: called from another thread, SIGTERM keeps its own)
        previous = signal.signal(signal.SIGTERM, _raise_stopped)
    except ValueError:
        previous = None
    try:
        from sleuth.commands.common import config_from_args

        cfg = config_from_args(args)
        return _train(cfg, args)
    except KeyboardInterrupt as e:
        if cfg is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:  # torchrun signals every rank; rank 0 speaks
            print(interrupted_message(cfg, args, "SIGTERM" if isinstance(e, Stopped) else "Ctrl-C (SIGINT)"),
                  file=sys.stderr)
        return 143 if isinstance(e, Stopped) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _train(cfg, args) -> int:
    from sleuth.pipeline import (
        check_rollout_backend,
        ensure_index,
        open_retriever,
        policy_vocab_size,
        resolve_model_path,
        rl_run_dir,
        run_rl_stage,
        run_sft_stage,
        save_run_config,
        tiny_policy_path,
    )
    from training.infra.checkpoint import run_dir_lock
    from training.infra.distributed import init_from_env, run_on_rank0, shutdown

    check_rollout_backend(cfg)  # before minutes of SFT
    vocab = policy_vocab_size(cfg)
    if vocab is not None:  # the options that need the policy (AEPO's entropy target below log V), before SFT
        cfg.train.check_model(vocab)
    rank, _W = init_from_env(timeout_s=cfg.train.dist_timeout_s)  # torchrun: the process group; else a no-op
    ok = False
    held = contextlib.ExitStack()
    opened: dict = {}
    try:
        def setup() -> str:  # writes files: rank 0 only, the others wait for its result
            # out_dir for the whole command (config.yaml, index, SFT, RL run): a second training there is refused
            held.enter_context(run_dir_lock(cfg.out_dir))  # before it writes anything (RunDirBusyError)
            save_run_config(cfg)
            opened["retriever"] = retriever = ensure_index(cfg)  # opened once, for SFT and RL
            if cfg.sft.enabled:
                return str(run_sft_stage(cfg, retriever))
            return str(resolve_model_path(cfg.policy.model or tiny_policy_path(cfg)))

        init = run_on_rank0(setup)
        retriever = opened.get("retriever") or open_retriever(cfg)  # the other ranks open their own
        final = run_rl_stage(cfg, init, retriever, resume=args.resume)
        ok = True
    finally:
        held.close()
        shutdown(barrier=ok)  # no barrier on an error path: the other ranks may be gone
    if rank == 0:
        print(f"final checkpoint: {final}\nmetrics: {rl_run_dir(cfg) / 'metrics.jsonl'}")
    return 0
