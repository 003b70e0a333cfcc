"""Session 23's CPU measurements of two host-only stretches of a GRPO step at the benchmark's batch shape
(64 prompts x 8, prompt 256, responses up to 512, spread lengths): ``right_padded`` as landed against the
version before it (one chained iterator into ``array.array``), and the update's ``split_shared``.

    python benchmarks/results/2026-12-05-h200-session23/host_costs.py
"""

from __future__ import annotations

import array
import itertools
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from spread_lengths import spread_lengths  # noqa: E402

from megatron_rl.rollout.batch import RolloutBatch, right_padded  # noqa: E402
from megatron_rl.rollout.shared_prompts import split_shared  # noqa: E402

B, N, P, R = 512, 8, 256, 512


def right_padded_before(seqs, width, dtype, fill=0):
    """``right_padded`` before session 23 (commit 9a0f304)."""
    lens = torch.tensor([len(q) for q in seqs], dtype=torch.long)
    out = torch.full((len(seqs), width), fill, dtype=dtype)
    if int(lens.sum()):
        code = {torch.long: "q", torch.float32: "f"}[dtype]
        flat = torch.frombuffer(array.array(code, itertools.chain.from_iterable(seqs)), dtype=dtype)
        out[torch.arange(width)[None, :] < lens[:, None]] = flat
    return out


def best_ms(fn, *args, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    rng = random.Random(0)
    lens = spread_lengths(B, R, seed=1)
    prompts = [[rng.randrange(151936) for _ in range(P)] for _ in range(B // N) for _ in range(N)]
    resps = [[rng.randrange(151936) for _ in range(n)] for n in lens]
    lps = [[rng.random() for _ in range(n)] for n in lens]
    full = [p + r for p, r in zip(prompts, resps)]
    parts = ((full, P + R, torch.long), (resps, R, torch.long), (lps, R, torch.float32))
    for seqs, width, dtype in parts:
        assert torch.equal(right_padded(seqs, width, dtype), right_padded_before(seqs, width, dtype))
    before = sum(best_ms(right_padded_before, *p) for p in parts)
    after = sum(best_ms(right_padded, *p) for p in parts)
    print(f"right_padded, the batch's three tensors: {before:.1f} ms before, {after:.1f} ms now")

    ids = right_padded(full, P + R, torch.long)
    n = torch.tensor(lens)
    j = torch.arange(R)
    score_pos = (torch.full((B,), P)[:, None] - 1 + j).clamp(max=P + R - 1)
    batch = RolloutBatch(
        input_ids=ids, responses=ids[:, P:], response_mask=(j < n[:, None]).float(), score_pos=score_pos,
        prompt_lens=torch.full((B,), P), response_lens=n, group_index=torch.arange(B) // N,
        rollout_log_probs=torch.zeros(B, R), finish_reasons=["stop"] * B, rows=[None] * B,
    )  # fmt: skip
    mbs, _ = split_shared(batch, 34816)
    ms = best_ms(lambda: split_shared(batch.select(range(B)), 34816), repeats=3)
    print(f"split_shared into {len(mbs)} micro-batches of <= 34,816 tokens: {ms:.1f} ms")


if __name__ == "__main__":
    main()
