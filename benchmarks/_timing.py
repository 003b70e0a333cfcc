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


def graphed_us(fn, n: int = 20, replays: int = 5) -> float:
    """Mean microseconds per call of ``fn`` replayed from one CUDA graph of ``n`` calls (no launch overhead:
    what a call costs inside the engine's captured decode step); ``fn`` must be capturable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return 1e3 * a.elapsed_time(b) / (n * replays)
