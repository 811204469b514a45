"""SFT warm start on oracle trajectories, with the same tool-token loss mask as RL.

The loss is the token-mean negative log-likelihood of the policy tokens only: the retrieved documents in
an oracle trajectory are context, never targets (as in Search-R1's masking).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from agent.loop.batch import run_episodes
from agent.trajectory import Trajectory
from corpora.formats import QAExample
from retrieval.base import Retriever
from training.batch import collate
from training.model.forward import policy_logprobs
from training.rollout.oracle import ChainOracleLLM, OracleLLM


def oracle_trajectories(examples: list[QAExample], tokenizer: Any, retriever: Retriever, agent_cfg: Any,
                        titles_by_id: dict[str, str], top_k: int) -> list[Trajectory]:
    """Roll out the scripted oracle through the real agent loop (see
    :class:`training.rollout.oracle.OracleLLM`; :class:`~training.rollout.oracle.ChainOracleLLM` when every
    example carries a synthetic ``chain``: it searches each link of the chain in turn).

    Raises ``ValueError`` under ``agent.protocol=function_call``: the oracle writes Search-R1 tags and reads
    the question after ``Question:``, so it would answer 'unknown' to every question without searching."""
    if getattr(agent_cfg, "protocol", "search_r1") != "search_r1":
        raise ValueError(
            f"the SFT oracle writes Search-R1 tags (<search>, <answer>) and cannot act under "
            f"agent.protocol={agent_cfg.protocol}: it would teach the policy to answer 'unknown'; "
            "use agent.protocol=search_r1 or sft.enabled=false")
    chains = bool(examples) and all("chain" in e.metadata for e in examples)  # the synthetic task: its chain
    oracle = ChainOracleLLM(tokenizer, examples) if chains else OracleLLM(tokenizer, examples, titles_by_id)
    return run_episodes(examples, oracle, retriever, agent_cfg, top_k=top_k, temperature=0.0)


def external_oracle_trajectories(examples: list[QAExample], tokenizer: Any, agent_cfg: Any,
                                 titles_by_id: dict[str, str] | None = None) -> list[Trajectory]:
    """Oracle episodes of the external agent ``agent_cfg.entry`` (``agent.kind: external``) for its SFT warm
    start: the agent runs unchanged over the training proxy (:class:`agent.external.runner.ExternalRunner`),
    whose backend is :class:`training.rollout.oracle.ToolCallOracleLLM` writing tool calls in the chat template
    the proxy renders with (the tokenizer's, else Sleuth's ChatML); the proxy records the ids as it records the
    policy's, so the tool results and the template's frames are masked tool tokens.

    Returns the training sequences of the episodes the oracle answered right (EM 1). Raises ``ValueError``
    when none is (the agent never searched with a ``search(query)`` tool, or its episodes failed: the first
    error is named) and what :func:`agent.external.runner.runner_for` raises for a bad ``agent.entry``."""
    from agent.external.chat_template import CHATML_TOOLS
    from agent.external.runner import ExternalRunner, load_entry
    from training.rollout.oracle import ToolCallOracleLLM

    if not agent_cfg.entry:
        raise ValueError("agent.kind=external needs agent.entry=module:function for its SFT warm start")
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TOOLS  # the proxy's choice
    oracle = ToolCallOracleLLM(tokenizer, examples, titles_by_id, chat_template=template)
    with ExternalRunner(oracle, load_entry(agent_cfg.entry), agent_cfg, temperature=0.0, reruns=0,
                        timeout_s=agent_cfg.external_timeout_s) as runner:
        trajs = runner.run_episodes(examples)
    good = [t for t in trajs if t.stop_reason != "error" and t.verdict.get("em") == 1.0]
    if not good:
        errors = [t.metadata["error"] for t in trajs if t.metadata.get("error")]
        raise ValueError(f"the oracle solved none of {len(examples)} questions through agent.entry "
                         f"{agent_cfg.entry!r}" + (f" (first error: {errors[0]})" if errors else
                                                   "; does the agent search with a tool search(query)?"))
    return good


def sft_train(model: Any, tokenizer: Any, trajs: list[Trajectory], cfg: Any, seed: int = 0,
              max_len: int | None = None, progress: Any = None) -> list[dict[str, float]]:
    """Train ``model`` in place on ``trajs`` for ``cfg.epochs`` epochs (AdamW, ``cfg.batch_size`` trajectories
    per step; the learning rate warms up linearly to ``cfg.lr`` over 10 steps, then decays linearly to 10% of
    it at the last step). A batch without policy tokens is skipped (the schedule still advances). Returns
    per-epoch ``{"epoch", "loss", "tokens"}`` (tokens: policy tokens trained on); raises ``FloatingPointError``
    on a non-finite loss or gradient norm, before that step changes any weight."""
    if not trajs:
        raise ValueError("SFT needs at least one trajectory")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    total_steps = cfg.epochs * ((len(trajs) + cfg.batch_size - 1) // cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - 0.9 * s / max(total_steps - 1, 1)))
    rng = random.Random(seed)
    history = []
    model.train()
    for epoch in range(cfg.epochs):
        order = list(range(len(trajs)))
        rng.shuffle(order)
        tot, ntok = 0.0, 0.0
        for i in range(0, len(order), cfg.batch_size):
            batch = collate([trajs[j] for j in order[i : i + cfg.batch_size]], tokenizer.pad_token_id, max_len)
            lp, _ = policy_logprobs(model, batch, with_entropy=False)
            mask = batch.loss_mask.to(lp.device)
            n = mask.sum()
            if not n:  # no policy token: no data behind a step (AdamW's momentum alone would move weights)
                sched.step()
                continue
            loss = -(lp * mask).sum() / n
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite SFT loss at epoch {epoch}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(grad_norm):  # clipping an inf norm leaves NaN gradients: do not step on them
                raise FloatingPointError(
                    f"non-finite SFT gradient norm at epoch {epoch}; the weights were not updated")
            opt.step()
            sched.step()
            tot += float(loss.detach()) * float(n)
            ntok += float(n)
            if progress is not None:
                progress(epoch, float(loss.detach()))
        history.append({"epoch": epoch + 1, "loss": tot / max(ntok, 1), "tokens": ntok})
    model.eval()
    return history
