"""CUDA-event timing shared by the kernel benchmarks."""

from __future__ import annotations

import torch


def timed_us(fn, n: int = 20, warmup: int = 3) -> float:
    """Mean microseconds per call of ``fn`` over ``n`` calls after ``warmup`` untimed ones (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return 1e3 * a.elapsed_time(b) / n
