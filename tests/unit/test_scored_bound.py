"""Micro-batches by token budget never score more LM-head rows than the memory plan sized the logits for.

The plan counts budget // (longest prompt + max_new_tokens) sequences of max_new_tokens scored rows each.
Shorter prompts fit more sequences into the same token budget, each scoring as many rows: without the
plan's bound the log-prob kernel would hold more logits than the plan said (an OOM at a setting the dry
run called safe). Padded, packed and shared splits all take the bound, and the worker passes it."""

import pytest
import torch

from megatron_rl.config.schema import JobConfig
from megatron_rl.rollout.batch import RolloutBatch, split_by_tokens
from megatron_rl.rollout.packing import split_packed
from megatron_rl.rollout.shared_prompts import split_shared
from megatron_rl.trainer.memory_model import micro_seqs, scored_rows
from megatron_rl.trainer.workers import PolicyWorker

P_PLAN, R, N, BUDGET = 28, 32, 4, 600  # the plan: 600 // 60 = 10 sequences, 320 LM-head rows


def _short_prompt_batch(groups: int = 4, p: int = 4) -> RolloutBatch:
    b, t = groups * N, p + R
    ids = torch.arange(b * t).reshape(b, t) % 50 + 1
    for g in range(groups):
        ids[g * N : (g + 1) * N, :p] = ids[g * N, :p]
    score_pos = (p - 1 + torch.arange(R)).expand(b, R)
    return RolloutBatch(
        input_ids=ids, responses=ids[:, p:], response_mask=torch.ones(b, R), score_pos=score_pos,
        prompt_lens=torch.full((b,), p), response_lens=torch.full((b,), R), group_index=torch.arange(b) // N,
        rollout_log_probs=torch.zeros(b, R), finish_reasons=["length"] * b, rows=[None] * b,
    )  # fmt: skip


def _cfg(share: bool = False) -> JobConfig:
    cfg = JobConfig()
    cfg.rollout.max_new_tokens, cfg.rollout.n = R, N
    cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu, cfg.actor.share_prompts = (
        True,
        BUDGET,
        share,
    )
    cfg.actor.ppo_mini_batch_size = 4
    return cfg


def test_the_plan_counts_ten_sequences_of_32_rows():
    assert micro_seqs(_cfg(), "actor", P_PLAN + R) == 10 and scored_rows(_cfg(), "actor", P_PLAN) == 320


@pytest.mark.parametrize("split", [split_by_tokens, split_packed])
def test_short_prompts_do_not_pass_the_plans_lm_head_rows(split):
    batch = _short_prompt_batch()
    unbounded, _ = split(batch, BUDGET)  # 600 // 36 = 16 sequences of 32 rows: 512 > 320
    assert max(len(mb) for mb in unbounded) * R > 320
    bounded, order = split(batch, BUDGET, scored_rows(_cfg(), "actor", P_PLAN))
    assert sorted(order) == list(range(len(batch)))
    assert max(len(mb) for mb in bounded) * R <= 320 and max(len(mb) for mb in bounded) == 10


def test_shared_split_takes_the_bound_too():
    bound = scored_rows(_cfg(share=True), "actor", P_PLAN)  # 600 // (28 + 4 x 32) = 3 whole groups of 4
    assert bound == 12 * R
    mbs, _ = split_shared(_short_prompt_batch(), BUDGET, bound)
    assert max(len(mb) for mb in mbs) * R <= bound


def test_the_worker_splits_with_its_plan_bound():
    worker = object.__new__(PolicyWorker)  # only the split is exercised: no model, no optimizer
    worker.cfg = _cfg().actor
    worker.max_scored = scored_rows(_cfg(), "actor", P_PLAN)
    mbs, _ = worker._split(_short_prompt_batch())
    assert max(len(mb) for mb in mbs) == 10


def test_short_responses_fill_no_more_shared_tokens_than_the_plan_counts():
    """A budget between two multiples of a group (600: 3 groups of 28 + 4 x 32 = 468 tokens): groups of
    8-token responses (60 tokens) would fit 10 to a micro-batch (600 tokens, under the 384-row bound); the
    worker splits within the plan's 468 tokens instead (reviewer's OOM scenario, session 8)."""
    from megatron_rl.trainer.memory_model import micro_shape

    batch = _short_prompt_batch(groups=12, p=P_PLAN)
    batch.response_lens[:] = 8
    batch.response_mask[:, 8:] = 0
    cfg = _cfg(share=True)
    seqs, tokens = micro_shape(cfg, "actor", P_PLAN)
    assert (seqs, tokens) == (12, 468)

    def cost(mb):  # the split's count: each group's prompt once plus its responses
        return len(mb) // N * P_PLAN + len(mb) * 8

    loose, _ = split_shared(batch, BUDGET, scored_rows(cfg, "actor", P_PLAN))
    assert max(cost(mb) for mb in loose) == 600 > tokens  # the budget alone lets 10 groups in
    worker = object.__new__(PolicyWorker)
    worker.cfg, worker.max_scored, worker.max_tokens = cfg.actor, scored_rows(cfg, "actor", P_PLAN), tokens
    mbs, order = worker._split(batch)
    assert sorted(order) == list(range(len(batch))) and max(cost(mb) for mb in mbs) <= tokens
