"""How much programmatic dependent launch (PDL) saves between the small kernels of a captured decode step.

A decode step at 512 rows launches ~200 kernels inside one CUDA graph; the gaps between them were ~0.2 ms a
step on an H100 (session 26). With PDL a kernel launched with ``launch_pdl=True`` may start while the kernel
before it drains; it waits (``gdc_wait``) before it reads that kernel's output. The engine's kernels wait at
entry and never trigger early; this probe's kernel also calls ``gdc_launch_dependents`` after its load, so it
shows the most PDL could give (an upper bound for the engine's use). Here, inside one graph:

- ``triton``: a chain of N small Triton kernels (each reads the previous one's output), PDL off and on;
- ``mixed``: the decode step's pattern, a cuBLAS GEMM (512 x 896 -> 1152) then a Triton elementwise kernel,
  N times; PDL only on the Triton kernels (cuBLAS launches as it does);

microseconds a kernel. Run: ``python benchmarks/probe_pdl.py --out $OUT/pdl.json`` (CUDA, ~10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import seconds_for  # noqa: E402

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the PDL rows are reported as unavailable
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _step(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible from here
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + offs, (x * 0.999 + 0.001).to(y_ptr.dtype.element_ty), mask=live)


def graphed_us_per_kernel(body, kernels: int, replays: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    return 1e6 * seconds_for(g.replay, replays) / (replays * kernels)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    rows, hidden, width = 512, 896, 1152
    bufs = [torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16) / 30
    numel, block = bufs[0].numel(), 1024
    grid = (triton.cdiv(numel, block),)
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "n": a.n}

    def triton_chain(pdl: bool):
        def body():
            for i in range(a.n):
                src, dst = bufs[i % 2], bufs[(i + 1) % 2]
                _step[grid](src, dst, numel, BLOCK=block, PDL=pdl, **({"launch_pdl": True} if pdl else {}))

        return body

    def mixed(pdl: bool):
        def body():
            for _ in range(a.n // 2):
                torch.mm(x, w.t(), out=bufs[0])
                _step[grid](
                    bufs[0], bufs[1], numel, BLOCK=block, PDL=pdl, **({"launch_pdl": True} if pdl else {})
                )

        return body

    for name, make, kernels in (("triton", triton_chain, a.n), ("mixed", mixed, a.n)):
        for pdl in (False, True, False, True):
            key = f"{name}_{'pdl' if pdl else 'plain'}_us"
            if pdl and gdc_wait is None:
                res[key] = "no gdc_wait in this Triton"
                continue
            try:
                t = graphed_us_per_kernel(make(pdl), kernels)
            except Exception as e:  # noqa: BLE001 - a probe: record why
                res[key] = f"error: {type(e).__name__}: {e}"[:300]
                continue
            res.setdefault(key + "_runs", []).append(round(t, 3))
            res[key] = min(res[key + "_runs"])
    # a lone kernel's own time (one launch, no chain): what the gap is measured against
    res["mm_alone_us"] = graphed_us_per_kernel(lambda: torch.mm(x, w.t(), out=bufs[0]), 1, replays=200)
    res["step_alone_us"] = graphed_us_per_kernel(
        lambda: _step[grid](bufs[0], bufs[1], numel, BLOCK=block, PDL=False), 1, replays=200
    )
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
