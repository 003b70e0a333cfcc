"""Session 30's host-path timings on this machine's CPU (2 cores), best of 5, the GRPO benchmark's shapes:
the last retire's listing of 512 finished rows of 512 tokens (whole rows listed and cut, as before, against
each row's first n values through numpy), ``build_batch`` from the completions' lists against from their
arrays (64 prompts of 256 tokens x 8 samples, responses of 1-512 tokens), and the split's ``ranges`` in torch
(as before) against numpy (24 calls of 64 ranges of 512). Run from the repo root:
``.venv/bin/python benchmarks/results/2026-12-06-session30/cpu_host_path.py > .../cpu_host_path.txt``."""

import random
import time

import numpy as np
import torch

from megatron_rl.rollout.batch import build_batch
from megatron_rl.rollout.engine import Completion
from megatron_rl.rollout.shared_prompts import ranges


def best(fn, n=5):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
    return min(out)


tok, lp, count = torch.randint(0, 151000, (512, 513)), torch.randn(512, 513), [512] * 512


def lists_then_cut():
    a, b = tok.tolist(), lp.tolist()
    return [(x[:n], y[:n]) for x, y, n in zip(a, b, count)]


def numpy_rows():
    t, p = tok.numpy(), lp.numpy()
    return [(t[i, :n].tolist(), p[i, :n].tolist()) for i, n in enumerate(count)]


print(
    f"retire listing, 512 x 512: whole rows then cut {best(lists_then_cut):.1f} ms, numpy rows {best(numpy_rows):.1f} ms"
)

random.seed(0)
comps = []
for g in range(64):
    prompt = [random.randrange(151000) for _ in range(256)]
    for s in range(8):
        r = random.randrange(1, 513)
        ids = np.array([random.randrange(151000) for _ in range(r)], dtype=np.int64)
        lps = np.random.randn(r).astype(np.float32)
        comps.append(Completion(g, s, list(prompt), ids.tolist(), lps.tolist(), "length", arrays=(ids, lps)))
with_arrays = best(lambda: build_batch(comps, [None] * 64, 0, 512, 0, torch.device("cpu")))
for c in comps:
    c.arrays = None
with_lists = best(lambda: build_batch(comps, [None] * 64, 0, 512, 0, torch.device("cpu")))
print(f"build_batch, 512 completions: lists {with_lists:.1f} ms, arrays {with_arrays:.1f} ms")


def torch_ranges(starts, lens):
    n = torch.tensor(lens, dtype=torch.long)
    off = torch.cumsum(n, 0) - n
    return torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - off, n) + torch.arange(
        int(n.sum())
    )


starts, lens = list(range(0, 64 * 768, 768)), [512] * 64
assert torch.equal(torch_ranges(starts, lens), ranges(starts, lens))
t_torch = best(lambda: [torch_ranges(starts, lens) for _ in range(24)])
t_numpy = best(lambda: [ranges(starts, lens) for _ in range(24)])
print(f"ranges, 24 calls of 64 x 512: torch {t_torch:.2f} ms, numpy {t_numpy:.2f} ms")
