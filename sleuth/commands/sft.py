"""``sleuth sft``: the SFT warm start on oracle trajectories."""

from __future__ import annotations

from sleuth.commands.common import add_config_arguments, config_from_args

HELP = "SFT warm start of the policy on oracle trajectories of the training questions"


def add_arguments(p) -> None:
    add_config_arguments(p)


def run(args) -> int:
    from sleuth.pipeline import check_index_corpus, open_retriever, run_sft_stage, save_run_config

    cfg = config_from_args(args)
    save_run_config(cfg)
    check_index_corpus(cfg)
    print(f"SFT model: {run_sft_stage(cfg, open_retriever(cfg))}")
    return 0
