"""CUDA-event timing shared by the kernel benchmarks."""

from __future__ import annotations

import time

import torch


def seconds_for(fn, n: int, cuda: bool = True) -> float:
    """Seconds ``n`` calls of ``fn`` take: between two CUDA events (the host clock where ``cuda`` is off)."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def timed_us(fn, n: int = 20, warmup: int = 3) -> float:
    """Mean microseconds per call of ``fn`` over ``n`` calls after ``warmup`` untimed ones (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return 1e6 * seconds_for(fn, n) / n


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


def machine_rates(device: str = "cuda", seconds: float = 1.5, n: int = 8192, copy_mib: int = 1024) -> dict:
    """What this machine sustains now: bf16 GEMMs of n x n x n for about ``seconds`` (TFLOP/s) and one copy
    of ``copy_mib`` MiB on the device (bytes read plus written per second), timed with CUDA events (the host
    clock on CPU), plus the SM clock, power draw and power limit ``nvidia-smi`` reports right after the
    GEMMs (where it runs). Machines of one kind differ: session 27's H100s ran the same 3B update at MFU
    0.57-0.64 on one and 0.78-0.84 on another (the second drew ~675 W of its 700 W limit at ~1700 MHz), so a
    benchmark records these before and after its steps and its ratios can be read against them."""
    import subprocess

    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def run(fn, iters: int) -> float:
        return seconds_for(fn, iters, cuda)

    def gemms() -> tuple[int, float]:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        y = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        run(lambda: x @ y, 1)  # warm-up
        probe = run(lambda: x @ y, 3)  # the rate's first estimate
        iters = max(3, int(seconds / max(probe / 3, 1e-9)))
        return iters, run(lambda: x @ y, iters)

    iters, gemm_s = gemms()
    out = {"gemm_iters": iters, "gemm_s": gemm_s, "gemm_tflops": 2 * n**3 * iters / gemm_s / 1e12}
    src = torch.empty(copy_mib * 2**20 // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    run(lambda: dst.copy_(src), 2)
    copy_s = run(lambda: dst.copy_(src), 5) / 5
    copy_bytes = 2 * src.numel() * src.element_size()  # read once, written once
    out.update(copy_bytes=copy_bytes, copy_s=copy_s, copy_tb_s=copy_bytes / copy_s / 1e12)
    if cuda:
        query = "clocks.sm,power.draw,power.limit,temperature.gpu"
        try:
            line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                   "-i", str(torch.cuda.current_device())], capture_output=True, text=True,
                                  timeout=10).stdout.strip()  # fmt: skip
            out.update(zip(("sm_clock_mhz", "power_w", "power_limit_w", "temperature_c"),
                           (float(v) for v in line.split(", "))))  # fmt: skip
        except (OSError, ValueError, subprocess.SubprocessError):  # no nvidia-smi: the rates alone
            pass
    return out
