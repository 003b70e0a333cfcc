"""The update's MLP as it runs today against quack's fused one (issue 16, a lever not built yet).

Today: fc1 on cuBLAS (``F.linear``), SwiGLU by ``kernels.swiglu`` (compiled forward, Triton backward), fc2 on
cuBLAS; the forward writes fc1's output and SwiGLU reads it back, the backward writes fc2's input gradient
and the SwiGLU backward reads it back. quack (``quack-kernels``, the CuTe-DSL kernels FlashAttention-4 ships
with; optional, like FA4) computes SwiGLU in fc1's GEMM epilogue and its gradient in the epilogue of fc2's
input-gradient GEMM (``quack.mlp.mlp_func``, megatron-core's [gate; up] weight through ``concat_layout``).
Timed at update rows (32,768 for 0.5B, 8,192 for 3B; forward, forward + backward) and at a decode step's
rows (forward), with the gap of quack's output and gradients to today's. Both write bf16 ``.grad``: the
trainer's fp32 ``main_grad`` accumulation (``kernels.wgrad_fusion``) is not part of either. ``first_calls_s``
is both sides' first call together (today's compile and quack's JIT). Nothing here is used by the trainer.

Run: ``PYTHONPATH=$PWD python benchmarks/bench_quack_mlp.py --out $OUT/quack_mlp.json`` (CUDA, quack
importable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_rl.kernels import swiglu  # noqa: E402

# hidden, ffn, update rows timed (0.5B: about an H100 micro-batch of the fixed workload; an H200 plans ~70k)
SHAPES = {"qwen2.5-0.5b": (896, 4864, 32768), "qwen2.5-3b": (2048, 11008, 8192)}


def ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls (CUDA events, after one untimed call)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-6)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-3b")
    p.add_argument("--decode-rows", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tuned", action="store_true", help="quack's autotuner (slow first calls)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from quack.mlp import mlp_func

    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "tuned": a.tuned, "shapes": {}}
    for shape in a.shapes.split(","):
        hidden, ffn, rows = SHAPES[shape]
        g = torch.Generator(device=dev).manual_seed(0)
        w1 = (torch.randn(2 * ffn, hidden, device=dev, generator=g) / hidden**0.5).bfloat16()
        w2 = (torch.randn(hidden, ffn, device=dev, generator=g) / ffn**0.5).bfloat16()
        row = {}
        for m, train in ((rows, True), (a.decode_rows, False)):
            x = torch.randn(m, hidden, device=dev, generator=g).bfloat16()
            dout = torch.randn(m, hidden, device=dev, generator=g).bfloat16()
            leaves = [t.detach().clone().requires_grad_(train) for t in (x, w1, w2)]

            def today(lv=leaves):
                return F.linear(swiglu.swiglu(F.linear(lv[0], lv[1])), lv[2])

            def fused(lv=leaves):
                return mlp_func(lv[0], lv[1], lv[2], "swiglu", tuned=a.tuned, concat_layout=True)

            t0 = time.time()
            want, got = today(), fused()
            torch.cuda.synchronize()
            entry = {"rows": m, "first_calls_s": time.time() - t0, "out_gap": rel_gap(got, want)}
            with torch.no_grad():
                entry["fwd_ms_today"] = ms(lambda: today(), a.reps)
                entry["fwd_ms_quack"] = ms(lambda: fused(), a.reps)
            if train:
                grads = []
                for fn in (today, fused):
                    for t in leaves:
                        t.grad = None
                    fn().backward(dout)
                    grads.append([t.grad.clone() for t in leaves])
                entry["grad_gaps"] = [rel_gap(q, t) for q, t in zip(grads[1], grads[0])]

                def step(fn, lv=leaves, dout=dout):
                    for t in lv:
                        t.grad = None
                    fn().backward(dout)

                entry["fwd_bwd_ms_today"] = ms(lambda: step(today), a.reps)
                entry["fwd_bwd_ms_quack"] = ms(lambda: step(fused), a.reps)
            row["update" if train else "decode"] = entry
            print(shape, json.dumps(entry), flush=True)
        res["shapes"][shape] = row
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
