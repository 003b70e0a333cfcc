"""DAPO dynamic sampling on every DP rank: keep prompt groups whose rewards differ, generate more rounds
until the batch is full.

Each DP rank fills its own share (``data.train_batch_size / DP`` prompts, ``rollout.n`` samples each),
so the update's mini-batch split stays the same on every rank without moving samples between ranks. Which
groups are informative is decided on the scores of the whole DP group (``informative_groups_dp``), so a
group whose samples sit on several ranks is judged once. A round runs on every rank (the engine is SPMD)
until the rank with the fewest kept groups has its share, at most ``max_num_gen_batches`` rounds; a share
still short then is topped up with the dropped groups of the first round (zero GRPO advantage), counted in
``dynamic_sampling/padded_groups``. Extra rounds draw fresh prompts from the training set, seeded by
``(data.seed, step, round)``, so a resumed run draws the same ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import numpy as np
import torch

from megatron_rl.algos.collective import all_reduce_max, all_reduce_sum, informative_groups_dp
from megatron_rl.distributed.transfer import host_copy, host_values, keep_host
from megatron_rl.rollout.batch import RolloutBatch

ROUND_KEY_STRIDE = 1 << 40  # group ids of round r start at r * stride: unique within a step


def extra_prompt_indices(num_rows: int, batch_size: int, seed: int, step: int, round_: int) -> list[int]:
    """Dataset rows for extra round ``round_`` (>= 1) of ``step``: ``batch_size`` distinct rows."""
    rng = np.random.default_rng([seed, 0xDA90, step, round_])
    return rng.choice(num_rows, size=min(batch_size, num_rows), replace=False).tolist()


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rows of ``batches`` in order; ``input_ids`` right-padded with ``pad_id`` to the longest."""
    width = max(b.seq_len for b in batches)
    out = {}

    def cat(name: str, values: list[torch.Tensor]) -> torch.Tensor:
        if name == "input_ids":
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=pad_id) for v in values]
        return torch.cat(values)

    for f in fields(RolloutBatch):
        values = [getattr(b, f.name) for b in batches]
        if all(isinstance(v, torch.Tensor) for v in values):
            kept = [host_copy(v) for v in values]  # the rounds' host copies (build_batch's) go along
            out[f.name] = keep_host(
                cat(f.name, values), cat(f.name, kept) if all(k is not None for k in kept) else None
            )
        elif all(isinstance(v, list) for v in values):
            out[f.name] = [x for v in values for x in v]
        elif all(v is None for v in values):
            out[f.name] = None
        else:
            raise ValueError(f"cannot concatenate RolloutBatch.{f.name}: set in some rounds only")
    return RolloutBatch(**out)


def _first_groups(batch: RolloutBatch, keep: torch.Tensor, quota: int) -> tuple[list[int], int]:
    """Rows of the first ``quota`` groups (in row order) among rows with ``keep``; and how many groups."""
    chosen, rows = [], []
    # the group ids from their kept host copy (build_batch's; no sync); ``keep`` is computed on the device
    for i, (k, g) in enumerate(zip(keep.tolist(), host_values(batch.group_index).tolist())):
        if not k:
            continue
        if g not in chosen:
            if len(chosen) == quota:
                continue
            chosen.append(g)
        rows.append(i)
    return rows, len(chosen)


def _scores(batch: RolloutBatch) -> torch.Tensor:
    return batch.token_level_scores.sum(-1)  # [B]


def fill_with_informative_groups(
    first: RolloutBatch, next_round: Callable[[int], RolloutBatch], max_rounds: int, pad_id: int, dp_group
) -> tuple[RolloutBatch, dict[str, float]]:
    """The scored batch ``first`` (this rank's share) with its uninformative groups replaced by
    informative ones from ``next_round(r)`` (a scored batch of the same size), r = 1, 2, ...;
    see the module doc. Returns the batch (as many groups as ``first``) and metrics over ``dp_group``
    (None: this process alone)."""
    quota = int(torch.unique(host_values(first.group_index)).numel())
    kept_parts, have, batch, totals = [], 0, first, torch.zeros(4, dtype=torch.float64)
    first_keep = None
    for round_ in range(max_rounds):
        if round_ > 0:
            batch = next_round(round_)
        keep, metrics = informative_groups_dp(_scores(batch), batch.group_index, dp_group)
        first_keep = keep if first_keep is None else first_keep
        rows, got = _first_groups(batch, keep, quota - have)
        kept_parts.append(batch.select(rows))
        have += got
        counts = torch.stack([metrics["dynamic_sampling/groups"], metrics["dynamic_sampling/kept_groups"]])
        totals[:2] += counts.double().cpu()
        totals[2] = round_ + 1
        short = torch.tensor([float(quota - have)], dtype=torch.float64, device=first.response_mask.device)
        if float(all_reduce_max(short, dp_group)) <= 0:  # every rank has its share
            break
    padded = quota - have
    if padded > 0:  # still short after max_rounds: top up with dropped groups of the first round
        rows, _ = _first_groups(first, ~first_keep, padded)
        kept_parts.append(first.select(rows))
    device = first.response_mask.device
    padded_total = all_reduce_sum(torch.tensor([float(padded)], dtype=torch.float64, device=device), dp_group)
    out = concat_batches([p for p in kept_parts if len(p)], pad_id)
    metrics = {
        "dynamic_sampling/groups": float(totals[0]),
        "dynamic_sampling/kept_groups": float(totals[1]),
        "dynamic_sampling/dropped_groups": float(totals[0] - totals[1]),
        "dynamic_sampling/rounds": float(totals[2]),
        "dynamic_sampling/padded_groups": float(padded_total[0]),
    }
    return out, metrics
