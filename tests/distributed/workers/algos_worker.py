"""Distributed checks of megatron_rl.algos at world size 4 on CPU/gloo (run by test_algos_dist.py).

1. Advantages: DP=1, 2, 4 (and an uneven DP=2 split) give the pure estimator's values on the global
   batch, including GRPO groups with one sample on each of four ranks.
2. Gradients: a tiny float64 policy/value model trained on the same global batch at DP=1/2/4 with 1 or 4
   micro-batches (grads summed over DP) gets the single-process gradients, for every aggregation mode.
3. Vocab-parallel log-probs and entropy at TP=2 equal the full-vocabulary values, gradients too (the fused
   function also with the Triton kernels of kernels.logprob, under the interpreter).
4. Metrics reduced across DP: weighted mean, sum, max, min.
5. DAPO dynamic sampling: the group filter with groups straddling ranks equals the single-process one;
   a DP=2 fill where one rank needs an extra round runs that round on both ranks (SPMD), each rank
   ends with its full share, and the metrics are global.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.algos import (
    LOSS_AGG_MODES,
    all_reduce_metrics,
    compute_advantages_dp,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    get_advantage_estimator,
    global_loss_denominators,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from megatron_rl.algos.collective import informative_groups_dp
from megatron_rl.algos.dapo import informative_groups
from megatron_rl.kernels import logprob as logprob_kernel
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.trainer.dynamic_sampling import fill_with_informative_groups

B, T, V, D = 16, 6, 13, 8
# With contiguous DP shards of 4 rows, DP=4 puts one sample of "g0" (and of "g1") on each rank.
GROUPS = ["g0", "g1", "g2", "g3", "g0", "g1", "g2", "g4", "g0", "g1", "g5", "g4", "g0", "g1", "g5", "g6"]
ESTIMATOR_KWARGS = dict(gamma=0.95, lam=0.9, epsilon=1e-6, norm_adv_by_std=True)
ATOL = 1e-6


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None


def make_global_batch() -> dict[str, torch.Tensor]:
    """The same global batch on every rank (fixed seed), float64."""
    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[[6, 11]] = 0  # empty responses
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    scores[[1, 5, 9, 13]] = 1.0  # group "g1": all-equal rewards
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), (lengths - 1).clamp(min=0)] = scores
    return {
        "inputs": torch.randint(0, V, (B, T), generator=gen),
        "targets": torch.randint(0, V, (B, T), generator=gen),
        "mask": mask,
        "rewards": rewards,
        "values": torch.randn(B, T, generator=gen, dtype=torch.float64),
        "old_noise": 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "ref_noise": 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "rollout_noise": 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "group_codes": torch.tensor([int(g[1:]) for g in GROUPS]),
    }


class TinyPolicy(nn.Module):
    """Embedding -> running mean over time -> vocab logits and a value head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)
        self.value_head = nn.Linear(D, 1)

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs`` [B, T] -> (logits [B, T, V], values [B, T])."""
        h = torch.tanh(self.embed(inputs)).cumsum(1) / torch.arange(1, inputs.shape[1] + 1)[None, :, None]
        return self.head(h), self.value_head(h).squeeze(-1)


def make_groups(world: int) -> dict[int, list]:
    """Process groups for DP sizes 1, 2, 4 (contiguous ranks); every rank creates all of them."""
    return {
        dp: [dist.new_group(list(range(g * dp, (g + 1) * dp))) for g in range(world // dp)]
        for dp in (1, 2, 4)
    }


def layouts(groups, rank: int):
    """(name, dp_group, this rank's rows of the global batch)."""
    for dp in (1, 2, 4):
        local = B // dp
        yield f"dp{dp}", groups[dp][rank // dp], slice((rank % dp) * local, (rank % dp + 1) * local)
    yield "dp2-uneven", groups[2][rank // 2], slice(0, 6) if rank % 2 == 0 else slice(6, B)


def index_for(name: str, batch, rows: slice):
    if name == "rloo":  # int-tensor group ids take the tensor all-gather path
        return batch["group_codes"][rows]
    return GROUPS[rows]  # strings take the all_gather_object path


def check_advantages(batch, groups, rank: int) -> None:
    """Every estimator, on a mask with interior gaps (multi-turn tool tokens) in the rows long enough."""
    mask = batch["mask"].clone()
    mask[batch["mask"].sum(-1) > 3, 1] = 0.0
    baselines = 0.1 * torch.arange(B, dtype=torch.float64)  # ReMax greedy-sample scores
    for name in (
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "opo",
        "gpg",
        "remax",
    ):
        want_adv, want_ret = get_advantage_estimator(name)(
            token_level_rewards=batch["rewards"],
            response_mask=mask,
            values=batch["values"],
            index=index_for(name, batch, slice(0, B)),
            reward_baselines=baselines,
            **ESTIMATOR_KWARGS,
        )
        for layout, dp_group, rows in layouts(groups, rank):
            adv, ret = compute_advantages_dp(
                name,
                dp_group=dp_group,
                token_level_rewards=batch["rewards"][rows],
                response_mask=mask[rows],
                values=batch["values"][rows],
                index=index_for(name, batch, rows),
                reward_baselines=baselines[rows],
                **ESTIMATOR_KWARGS,
            )
            msg = f"{name} {layout} rank {rank}"
            assert_close(adv, want_adv[rows], ATOL, f"{msg} adv")
            assert_close(ret, want_ret[rows], ATOL, f"{msg} ret")


def micro_batch_loss(model, mb, *, policy_loss, mode, num_tokens, num_seqs):
    """Actor + critic loss of one micro-batch ``mb`` (dict of [b, T] tensors) with global denominators."""
    logits, vpreds = model(mb["inputs"])
    log_prob = vocab_parallel_log_probs(logits, mb["targets"])
    entropy = vocab_parallel_entropy(logits)
    agg = dict(
        response_mask=mb["mask"],
        loss_agg_mode=mode,
        global_num_tokens=num_tokens,
        global_num_seqs=num_seqs,
        seq_len_norm=T,
    )
    tis_mode = "sequence" if policy_loss == "gspo" else "token"
    pg, _ = compute_policy_loss(
        policy_loss,
        old_log_prob=mb["old_log_prob"],
        log_prob=log_prob,
        advantages=mb["advantages"],
        rollout_log_prob=mb["rollout_log_prob"],
        tis_mode=tis_mode,
        tis_cap=1.3,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        **agg,
    )
    kl, _ = compute_kl_loss(logprob=log_prob, ref_logprob=mb["ref_log_prob"], kind="k3", **agg)
    ent, _ = compute_entropy_loss(entropy=entropy, **agg)
    vf, _ = compute_value_loss(
        vpreds=vpreds, values=mb["values"], returns=mb["returns"], cliprange_value=0.2, **agg
    )
    return pg + 0.1 * kl - 0.01 * ent + 0.5 * vf


def train_step_grads(model, batch, rows, dp_group, n_micro, policy_loss, mode) -> list[torch.Tensor]:
    """Gradients of one optimizer step on this rank's ``rows``, summed over micro-batches and DP."""
    local = {k: v[rows] for k, v in batch.items() if k != "group_codes"}
    local["advantages"], _ = compute_advantages_dp(
        "grpo",
        dp_group=dp_group,
        token_level_rewards=local["rewards"],
        response_mask=local["mask"],
        index=GROUPS[rows],
        **ESTIMATOR_KWARGS,
    )
    _, local["returns"] = compute_advantages_dp(
        "gae",
        dp_group=dp_group,
        token_level_rewards=local["rewards"],
        response_mask=local["mask"],
        values=local["values"],
        **ESTIMATOR_KWARGS,
    )
    chunks = [{k: v.tensor_split(n_micro)[i] for k, v in local.items()} for i in range(n_micro)]
    num_tokens, num_seqs = global_loss_denominators([c["mask"] for c in chunks], dp_group)
    model.zero_grad(set_to_none=True)
    for mb in chunks:
        micro_batch_loss(
            model, mb, policy_loss=policy_loss, mode=mode, num_tokens=num_tokens, num_seqs=num_seqs
        ).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g, group=dp_group)
    return grads


def reference_grads(model, batch, policy_loss, mode) -> list[torch.Tensor]:
    """Single-process reference: pure estimators on the global batch, local denominators."""
    full = dict(batch)
    full["advantages"], _ = get_advantage_estimator("grpo")(
        token_level_rewards=batch["rewards"], response_mask=batch["mask"], index=GROUPS, **ESTIMATOR_KWARGS
    )
    _, full["returns"] = get_advantage_estimator("gae")(
        token_level_rewards=batch["rewards"],
        response_mask=batch["mask"],
        values=batch["values"],
        **ESTIMATOR_KWARGS,
    )
    model.zero_grad(set_to_none=True)
    micro_batch_loss(
        model, full, policy_loss=policy_loss, mode=mode, num_tokens=None, num_seqs=None
    ).backward()
    return [p.grad.clone() for p in model.parameters()]


def check_gradients(batch, groups, rank: int) -> None:
    torch.manual_seed(0)
    model = TinyPolicy().double()
    with torch.no_grad():
        log_prob = vocab_parallel_log_probs(model(batch["inputs"])[0], batch["targets"])
    batch = dict(
        batch, old_log_prob=log_prob + batch["old_noise"], ref_log_prob=log_prob + batch["ref_noise"]
    )
    batch["rollout_log_prob"] = batch["old_log_prob"] + batch["rollout_noise"]
    configs = [("vanilla", mode) for mode in LOSS_AGG_MODES] + [("gspo", "seq-mean-token-mean")]
    for policy_loss, mode in configs:
        want = reference_grads(model, batch, policy_loss, mode)
        assert all(w.abs().sum() > 0 for w in want), f"{policy_loss}/{mode}: a reference gradient is zero"
        for layout, dp_group, rows in layouts(groups, rank):
            for n_micro in (1, 4):
                got = train_step_grads(model, batch, rows, dp_group, n_micro, policy_loss, mode)
                for (name, _), g, w in zip(model.named_parameters(), got, want):
                    assert_close(
                        g, w, ATOL, f"{policy_loss}/{mode} {layout} x{n_micro} rank {rank} grad {name}"
                    )


def check_vocab_parallel(tp_group, tp_rank: int, tp: int) -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = 12
    for dtype, atol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        logits = (2 * torch.randn(3, 5, vocab, generator=gen)).to(dtype)
        targets = torch.randint(0, vocab, (3, 5), generator=gen)
        weights = torch.randn(2, 3, 5, generator=gen).to(dtype)
        for temperature in (1.0, 0.7):
            full = logits.clone().requires_grad_(True)
            log_softmax = torch.log_softmax(full / temperature, -1)
            want_logp = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            want_ent = -(log_softmax.exp() * log_softmax).sum(-1)
            (weights[0] * want_logp + weights[1] * want_ent).sum().backward()

            shard = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)  # [B, T, V/tp]
            logp = vocab_parallel_log_probs(shard, targets, tp_group=tp_group, temperature=temperature)
            ent = vocab_parallel_entropy(shard, tp_group=tp_group, temperature=temperature)
            (weights[0] * logp + weights[1] * ent).sum().backward()
            msg = f"TP={tp} rank {tp_rank} {dtype} T={temperature}"
            assert_close(logp, want_logp, atol, f"{msg} logp")
            assert_close(ent, want_ent, atol, f"{msg} entropy")
            assert_close(shard.grad, full.grad.chunk(tp, -1)[tp_rank], atol, f"{msg} grad")

            # the fused function, eager passes and (fp32: what the kernels take) kernels.logprob's Triton
            # kernels under the interpreter: each shard's statistics combined over the TP ranks
            for triton_on in (False, True) if dtype == torch.float32 else (False,):
                logprob_kernel.RUN_ON_CPU = triton_on
                fused = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
                logp, ent = vocab_parallel_log_probs_and_entropy(
                    fused, targets, tp_group=tp_group, temperature=temperature, chunk_tokens=4
                )
                (weights[0] * logp + weights[1] * ent).sum().backward()
                m = f"{msg} fused{' triton' if triton_on else ''}"
                assert_close(logp, want_logp, atol * (10 if triton_on else 1), f"{m} logp")
                assert_close(ent, want_ent, atol * (10 if triton_on else 1), f"{m} entropy")
                assert_close(fused.grad, full.grad.chunk(tp, -1)[tp_rank], atol, f"{m} grad")
            logprob_kernel.RUN_ON_CPU = False
        if dtype == torch.float32:  # vocab padding: rank 0's shard partly valid, the last rank's not at all
            check_padded_vocab(logits, weights, tp_group, tp_rank, tp, vocab - vocab // tp - 1, gen)


def check_padded_vocab(logits, weights, tp_group, tp_rank: int, tp: int, valid: int, gen) -> None:
    """The fused function over a padded vocabulary (ids >= valid) at TP, eager passes and Triton kernels:
    the full softmax over the valid ids, gradient 0 on the padding."""
    targets = torch.randint(0, valid, logits.shape[:2], generator=gen)
    full = logits[..., :valid].clone().requires_grad_(True)
    log_softmax = torch.log_softmax(full / 0.7, -1)
    want_logp = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    (weights[0] * want_logp + weights[1] * want_ent).sum().backward()
    want_grad = torch.nn.functional.pad(full.grad, (0, logits.shape[-1] - valid)).chunk(tp, -1)[tp_rank]
    for triton_on in (False, True):
        logprob_kernel.RUN_ON_CPU = triton_on
        shard = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        logp, ent = vocab_parallel_log_probs_and_entropy(
            shard, targets, tp_group=tp_group, temperature=0.7, vocab_size=valid
        )
        (weights[0] * logp + weights[1] * ent).sum().backward()
        msg = f"TP={tp} rank {tp_rank} padded to {valid}{' triton' if triton_on else ''}"
        assert_close(logp, want_logp, 1e-5, f"{msg} logp")
        assert_close(ent, want_ent, 1e-5, f"{msg} entropy")
        assert_close(shard.grad, want_grad, 1e-6, f"{msg} grad")
    logprob_kernel.RUN_ON_CPU = False


def check_metrics(rank: int, world: int) -> None:
    metrics = {
        "clipfrac": torch.tensor(float(rank)),
        "n": torch.tensor(1.0),
        "hi": torch.tensor(float(rank)),
        "lo": torch.tensor(float(rank)),
    }
    weight = torch.tensor(float(rank + 1))  # e.g. local token counts 1, 2, 3, 4
    out = all_reduce_metrics(
        metrics,
        None if world == 1 else dist.group.WORLD,
        weight=weight,
        reduce_ops={"n": "sum", "hi": "max", "lo": "min"},
    )
    weights = range(1, world + 1)
    assert (
        abs(out["clipfrac"].item() - sum(r * w for r, w in zip(range(world), weights)) / sum(weights)) < 1e-12
    )
    assert out["n"].item() == world and out["hi"].item() == world - 1 and out["lo"].item() == 0, out


def scored_batch(scores: list[float], first_group: int, n: int = 2) -> RolloutBatch:
    """A minimal scored batch: groups of ``n`` rows, the score on the first response token."""
    b, r = len(scores), 3
    tls = torch.zeros(b, r)
    tls[:, 0] = torch.tensor(scores)
    return RolloutBatch(
        input_ids=torch.zeros(b, 4, dtype=torch.long),
        responses=torch.ones(b, r, dtype=torch.long),
        response_mask=torch.ones(b, r),
        score_pos=torch.zeros(b, r, dtype=torch.long),
        prompt_lens=torch.ones(b, dtype=torch.long),
        response_lens=torch.full((b,), r),
        group_index=torch.tensor([first_group + i // n for i in range(b)]),
        rollout_log_probs=torch.zeros(b, r),
        finish_reasons=["stop"] * b,
        rows=[None] * b,
        token_level_scores=tls,
    )


def check_dynamic_sampling(groups, rank: int) -> None:
    scores = torch.tensor([1.0 if g in ("g0", "g2") and i % 3 else 0.0 for i, g in enumerate(GROUPS)])
    scores[GROUPS.index("g1")] = 1.0  # g1 (one sample on each of four ranks at DP=4) differs on rank 0 only
    want, want_metrics = informative_groups(scores, GROUPS)
    assert want.any() and not want.all()
    for layout, dp_group, rows in layouts(groups, rank):
        keep, metrics = informative_groups_dp(scores[rows], GROUPS[rows], dp_group)
        assert keep.tolist() == want[rows].tolist(), f"group filter {layout} rank {rank}"
        assert metrics["dynamic_sampling/kept_groups"] == want_metrics["dynamic_sampling/kept_groups"], layout
    dp_group, dp_rank = groups[2][rank // 2], rank % 2
    # rank 0: both groups informative; rank 1: one flat group, replaced from the second round
    first = scored_batch([1, 0, 0, 1] if dp_rank == 0 else [1, 1, 1, 0], 10 * dp_rank)
    calls = []

    def next_round(r: int) -> RolloutBatch:
        calls.append(r)
        return scored_batch([0, 1, 0, 0], 100 + 10 * dp_rank)

    out, metrics = fill_with_informative_groups(first, next_round, 3, 0, dp_group)
    assert calls == [1], f"rank {rank}: every rank runs the extra round once, got {calls}"
    assert len(out) == 4 and len(set(out.group_index.tolist())) == 2
    want_groups = [0, 1] if dp_rank == 0 else [11, 110]
    assert sorted(set(out.group_index.tolist())) == want_groups, (rank, out.group_index.tolist())
    assert metrics["dynamic_sampling/groups"] == 8 and metrics["dynamic_sampling/kept_groups"] == 5, metrics
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/padded_groups"] == 0


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, f"algos_worker.py expects 4 processes, got {world}"
    groups = make_groups(world)
    batch = make_global_batch()
    check_advantages(batch, groups, rank)
    check_gradients(batch, groups, rank)
    check_vocab_parallel(groups[2][rank // 2], rank % 2, 2)
    check_metrics(rank, world)
    check_dynamic_sampling(groups, rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("algos_worker: all checks passed")


if __name__ == "__main__":
    main()
