"""The spread-length workload of issue 16: response lengths drawn from a fixed-seed log-normal, and EOS
forced at exactly those lengths in our engine and in HF ``generate`` (TRL), so both do the same work.

Lengths: step ``s`` of a run with ``P`` prompts x ``n`` samples and a response cap ``R`` gets
``spread_lengths(P * n, R, seed=s)``; sequence ``p * n + i`` (prompt ``p`` of the step, sample ``i``)
stops at ``lengths[p * n + i]`` tokens, EOS included. The log-normal has sigma ``SIGMA`` and mean
``MEAN_FRACTION * R`` before clipping to [1, R] (clipping makes the drawn mean a little lower; the
benchmark JSON records the real one).

Forcing works on one logits column per step (no [B, V] pass, no host sync): the EOS logit is -inf
before a sequence's length and +1e4 at it, so the sampler picks EOS with probability 1 there and never
before. Benchmark-only: ``install_engine_hook`` wraps the engine's per-step sampling on the class, and
``ForcedEosProcessor`` is an HF ``LogitsProcessor`` handed to ``generate`` by ``bench_trl_grpo.py``.

    python benchmarks/spread_lengths.py --cap 512 --prompt-len 256 --budget 66048 --budget 19200
prints the padded fraction of the update's tokens for these lengths under the trainer's split
(``rollout.batch.token_budget_groups``), today and with packing.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, for megatron_rl (no install)
from megatron_rl.rollout.batch import packed_groups, padded_fraction, token_budget_groups  # noqa: E402

MEAN_FRACTION = 0.4  # mean response length / cap, before clipping
SIGMA = 0.8  # log-normal shape: median ~0.29 cap, ~6% of responses reach the cap
FORCE_LOGIT = 1e4  # an EOS logit no other logit of a bf16 model comes near: probability 1 after softmax
KEY_STRIDE = 65537  # the engine's sequence key: prompt key * KEY_STRIDE + sample index


def spread_lengths(count: int, cap: int, seed: int) -> list[int]:
    """``count`` response lengths in [1, cap] from a log-normal of mean ``MEAN_FRACTION * cap``."""
    rng = random.Random(seed)
    mu = math.log(MEAN_FRACTION * cap) - SIGMA**2 / 2  # mean of a log-normal: exp(mu + sigma^2 / 2)
    return [min(cap, max(1, round(rng.lognormvariate(mu, SIGMA)))) for _ in range(count)]


def length_table(steps: int, prompts: int, n: int, cap: int) -> torch.Tensor:
    """[steps * prompts * n] lengths of a whole run: row ``(s * prompts + p) * n + i`` = step s, prompt p,
    sample i (the global prompt key of the trainer is ``s * prompts + p``)."""
    return torch.tensor([x for s in range(steps) for x in spread_lengths(prompts * n, cap, seed=s)])


def force_eos_column(logits: torch.Tensor, generated: torch.Tensor, lengths: torch.Tensor, eos: int) -> None:
    """In place: logits [B, V] of the next token of rows that hold ``generated`` [B] tokens so far and
    must stop at ``lengths`` [B] -> EOS impossible before the last token, certain at it."""
    last = generated + 1 == lengths  # [B] the next token is the last one
    col = logits[:, eos]
    early = torch.full_like(col, -math.inf)
    logits[:, eos] = torch.where(
        last, torch.full_like(col, FORCE_LOGIT), torch.where(generated + 1 < lengths, early, col)
    )


def install_engine_hook(table: torch.Tensor, n: int, eos: int) -> None:
    """Force our engine's responses to ``table`` (``length_table``): every sampling step of every
    ``RolloutEngine`` reads each slot's length from its sequence key (prompt key, sample index)."""
    from megatron_rl.rollout import engine

    runner = engine._Runner
    # device -> the table there, copied once: a copy from pageable host memory in every step would make the
    # host wait for the GPU each step (session 12 had one: 3.13 ms a decode step at 0.5B spread, 254 rows on
    # average, against 2.84 ms for 512 rows on the fixed workload)
    runner._forced_on = {}
    if getattr(runner, "_forced_lengths", None) is not None:
        runner._forced_lengths = table
        return
    sample = runner._sample
    runner._forced_lengths = table

    def forced_sample(self, logits, rows, *extra):
        keys = self.seq_keys[rows]  # the sequences' own keys (``keys`` holds them mixed with the seed)
        tab = runner._forced_on.get(keys.device)
        if tab is None:
            tab = runner._forced_on[keys.device] = runner._forced_lengths.to(keys.device)
        index = ((keys // KEY_STRIDE) * n + keys % KEY_STRIDE).clamp(0, len(tab) - 1)  # idle rows: any
        force_eos_column(logits, self.count[rows], tab[index], eos)
        return sample(self, logits, rows, *extra)

    runner._sample = forced_sample


class ForcedEosProcessor:
    """HF ``LogitsProcessor``: call ``k`` of ``generate`` (one TRL generation batch: step k's prompts x n,
    prompt-major) stops row i at ``table[k * rows + i]``. ``prompt_len``: the padded prompt width of
    the call, read from the first call's ``input_ids``."""

    def __init__(self, table: torch.Tensor, eos: int):
        self.table, self.eos, self.call, self.start, self.rows = table, eos, -1, 0, None

    def new_call(self, input_ids: torch.Tensor) -> None:
        self.call += 1
        self.start = input_ids.shape[1]
        b = input_ids.shape[0]
        lo = self.call * b
        self.rows = self.table[lo : lo + b].to(input_ids.device)
        if len(self.rows) < b:
            raise ValueError(f"spread lengths: generate call {self.call} needs {b} lengths past {lo}; the "
                             f"table holds {len(self.table)} (raise its steps)")  # fmt: skip

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = torch.full_like(self.rows, input_ids.shape[1] - self.start)
        force_eos_column(scores, generated, self.rows, self.eos)
        return scores


def pad_report(cap: int, prompt_len: int, budgets: list[int], prompts: int, n: int, steps: int) -> dict:
    """Padded fraction of the update's tokens per step for the spread lengths: the trainer's split
    today (sorted, padded to each micro-batch's longest) and packed (``packed_groups``)."""
    out = {"cap": cap, "prompt_len": prompt_len, "sequences_per_step": prompts * n, "by_budget": {}}
    lengths = [spread_lengths(prompts * n, cap, seed=s) for s in range(steps)]
    out["mean_response_fraction"] = sum(map(sum, lengths)) / (steps * prompts * n * cap)
    for budget in budgets:
        padded, packed, micro = [], [], []
        for resp in lengths:
            seq = [prompt_len + x for x in resp]
            groups = token_budget_groups(seq, budget)
            padded.append(padded_fraction(seq, groups))
            packed.append(padded_fraction(seq, packed_groups(seq, budget), packed=True))
            micro.append((len(groups), len(packed_groups(seq, budget))))
        out["by_budget"][budget] = {"pad_frac_padded": padded, "pad_frac_packed": packed,
                                    "micro_batches_padded_packed": micro}  # fmt: skip
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=int, default=512, help="response cap (rollout.max_new_tokens)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--budget", type=int, action="append", help="actor.ppo_max_token_len_per_gpu (repeat)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    report = pad_report(a.cap, a.prompt_len, a.budget or [66048, 19200], a.prompts, a.n, a.steps)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
