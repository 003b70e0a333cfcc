"""CUDA-event timing shared by the kernel benchmarks."""

from __future__ import annotations

import time

import torch


def seconds_for(fn, n: int, cuda: bool = True, while_running=None) -> float:
    """Seconds ``n`` calls of ``fn`` take: between two CUDA events (the host clock where ``cuda`` is off).
    ``while_running``: called once the calls are queued, before waiting for them (on CUDA while they run)."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if while_running is not None:
            while_running()
        return time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    if while_running is not None:
        while_running()
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
    return 1e6 * seconds_for(graph.replay, replays) / (n * replays)


# nvidia-smi's fields read while the GEMMs run, and the names ``machine_rates`` gives them
SMI_FIELDS = {"clocks.sm": "sm_clock_mhz", "power.draw": "power_w", "power.limit": "power_limit_w",
              "temperature.gpu": "temperature_c", "clocks_event_reasons.active": "clocks_event_reasons"}  # fmt: skip


def parse_smi(line: str) -> dict:
    """One line of ``nvidia-smi --query-gpu=uuid,<SMI_FIELDS> --format=csv,noheader,nounits`` -> {"uuid": ...,
    name: value}: numbers as floats, the clock-event mask as nvidia-smi writes it (0x4: the power cap),
    fields it reports as N/A left out."""
    values = [v.strip() for v in line.split(",")]
    out = {"uuid": values[0]}
    for (field, name), v in zip(SMI_FIELDS.items(), values[1:]):
        if "N/A" in v or not v:
            continue
        if field == "clocks_event_reasons.active":
            out[name] = v
            continue
        try:
            out[name] = float(v)
        except ValueError:  # an unexpected unit or text: left out
            continue
    return out


def _smi_start():
    """``nvidia-smi`` queried in the background for every GPU (its sample lands while the GEMMs run), or None."""
    import subprocess

    query = ",".join(("uuid", *SMI_FIELDS))
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    except OSError:  # no nvidia-smi: the rates alone
        return None


def _smi_finish(proc, device) -> dict:
    """This GPU's line of ``_smi_start``'s query (matched by UUID; the only line on a one-GPU machine)."""
    import subprocess

    if proc is None:
        return {}
    try:
        lines = [parse_smi(x) for x in proc.communicate(timeout=10)[0].splitlines() if x.strip()]
    except subprocess.SubprocessError:
        proc.kill()
        return {}
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    mine = [x for x in lines if uuid and uuid in x["uuid"]] or (lines if len(lines) == 1 else [])
    return {k: v for k, v in mine[0].items() if k != "uuid"} if mine else {}


def machine_rates(device: str = "cuda", seconds: float = 1.5, n: int = 8192, copy_mib: int = 1024) -> dict:
    """What this machine sustains now: bf16 GEMMs of n x n x n for about ``seconds`` (TFLOP/s) and one copy
    of ``copy_mib`` MiB on the device (bytes read plus written per second), timed with CUDA events (the host
    clock on CPU), plus ``nvidia-smi``'s SM clock, power draw and limit, temperature and clock-event reasons
    sampled while the GEMMs run (where it runs). Machines of one kind differ: session 27's H100s ran the same
    3B update at MFU 0.61-0.64 on one and 0.78-0.84 on another, so a benchmark records these before and after
    its steps and its ratios can be read against them."""
    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def gemms() -> tuple[int, float, dict]:
        """(calls, seconds, nvidia-smi's reading taken while they ran)."""
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        y = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        seconds_for(lambda: x @ y, 1, cuda)  # warm-up
        probe = seconds_for(lambda: x @ y, 3, cuda)  # the rate's first estimate
        iters = max(3, int(seconds / max(probe / 3, 1e-9)))
        proc = []
        took = seconds_for(lambda: x @ y, iters, cuda, while_running=lambda: proc.append(_smi_start()))
        return iters, took, _smi_finish(proc[0], device) if cuda else {}

    iters, gemm_s, smi = gemms()
    out = {"gemm_iters": iters, "gemm_s": gemm_s, "gemm_tflops": 2 * n**3 * iters / gemm_s / 1e12}

    def copies() -> float:
        src = torch.empty(copy_mib * 2**20 // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        seconds_for(lambda: dst.copy_(src), 2, cuda)
        return seconds_for(lambda: dst.copy_(src), 5, cuda) / 5

    copy_s = copies()
    copy_bytes = 2 * copy_mib * 2**20  # read once, written once
    out.update(copy_bytes=copy_bytes, copy_s=copy_s, copy_tb_s=copy_bytes / copy_s / 1e12)
    if cuda:
        torch.cuda.empty_cache()  # the buffers' ~2.4 GiB back to the driver before the run's build
    return out | smi
