"""How a decode step's time grows with its rows, and what the decode GEMMs could gain (issue 16).

1. The engine's decode graph (Qwen2.5-0.5B shape or another, random bf16) replayed at batch sizes that are
   not only powers of two, with the sampler on its logits: the curve that tells what finer batch buckets
   (fewer padding rows once sequences finish) would save, and the per-step cost that does not shrink.
2. The per-layer decode GEMMs at those rows: cuBLAS (``F.linear``, as the decoder calls it) against
   Inductor's max-autotune choice (Triton templates and cuBLAS), each timed as 24 calls on 24 distinct
   weights inside one CUDA graph (the weights do not stay in L2, as in a real step).

Run: ``python benchmarks/bench_decode_rows.py --out $OUT/decode_rows.json`` (CUDA).
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
from _timing import graphed_us  # noqa: E402
from bench_decode import sync  # noqa: E402
from profile_decode_step import build_engine, engine_args  # noqa: E402

from megatron_rl.rollout import reshard  # noqa: E402
from megatron_rl.rollout.sampling import sample_with_logprobs  # noqa: E402


def step_curve(a, rows: list[int]) -> dict:
    engine, spec, prompts, sampling = build_engine(a)
    engine.generate(prompts, sampling)
    state = engine._state
    state.bind(reshard.gather_weights(engine._params(), spec, reshard.build_layout(1)))
    state.bucket = lambda b: b  # any row count gets its own graph here
    full = state.cache.plan.max_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for b in rows:
        state.pos.fill_(a.position)
        t0 = time.perf_counter()
        state.decode(b, full)  # capture
        sync()
        cap = time.perf_counter() - t0
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(30):
            state.graphs[b, full][0].replay()
        ev[1].record()
        sync()
        logits = state.graphs[b, full][1]
        sample_with_logprobs(logits, sampling, gen)
        sync()
        ev2 = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev2[0].record()
        for _ in range(30):
            sample_with_logprobs(logits, sampling, gen)
        ev2[1].record()
        sync()
        out[b] = {"model_ms": ev[0].elapsed_time(ev[1]) / 30, "sampler_ms": ev2[0].elapsed_time(ev2[1]) / 30,
                  "capture_s": cap}  # fmt: skip
        print("rows", b, out[b], flush=True)
    del engine, state
    torch.cuda.empty_cache()
    return out


def gemm_table(rows: list[int], shapes: dict, autotune: bool, res: dict, save=lambda: None) -> dict:
    import torch._dynamo
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = "TRITON,ATEN"
    for name, (k, n, bias) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(24)]
        bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None for _ in range(24)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * m * k * n * 24
            row = {
                "cublas_us": graphed_us(
                    lambda x=x, ws=ws, bs=bs: [F.linear(x, w, b_) for w, b_ in zip(ws, bs)], 1, 20
                )
                / 24
            }
            if autotune:
                torch._dynamo.reset()
                lin = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                t0 = time.perf_counter()
                try:
                    lin(x, ws[0], bs[0])
                    row["autotune_s"] = time.perf_counter() - t0
                    row["inductor_us"] = (
                        graphed_us(
                            lambda x=x, ws=ws, bs=bs, lin=lin: [lin(x, w, b_) for w, b_ in zip(ws, bs)], 1, 20
                        )
                        / 24
                    )
                except Exception as e:  # noqa: BLE001 - a failed compile is a result here
                    row["inductor_error"] = repr(e)[:300]
            for key in ("cublas_us", "inductor_us"):
                if key in row:
                    row[key.replace("_us", "_tflops")] = flops / 24 / (row[key] * 1e-6) / 1e12
            res[f"{name} m={m}"] = row
            print(name, m, row, flush=True)
            save()  # a run cut by its time limit keeps the rows measured so far
    return res


def attention_check() -> dict:
    """The update's causal GQA attention (16 rows x 768, 14 heads over 2 groups, head dim 64), forward +
    backward, through each SDPA backend that takes it: is cuDNN's faster than flash attention here?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(16, 14, 768, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(16, 2, 768, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(16, 2, 768, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    res = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(7, 1), v.repeat_interleave(7, 1))

            def run(kk=kk, vv=vv, gqa=gqa):
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                o.sum().backward()

            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    run()
                    sync()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(10):
                        run()
                    b.record()
                    sync()
                res[f"{name} gqa={gqa}"] = a.elapsed_time(b) / 10
            except Exception as e:  # noqa: BLE001 - a backend that refuses is a result here
                res[f"{name} gqa={gqa}"] = repr(e)[:200]
            print(name, gqa, res[f"{name} gqa={gqa}"], flush=True)
    return res


def layer_gemms(shape: str) -> dict[str, tuple[int, int, bool]]:
    """A decoder layer's GEMMs at ``shape``: name -> (K, N, bias), as the decode step calls them (qkv fused,
    fc1 = gate and up together)."""
    from megatron_rl.models.shapes import hf_config

    c = dict(hf_config(shape))
    h, heads, groups = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    f = c["intermediate_size"]
    bias = c["model_type"] == "qwen2"  # Qwen2's q/k/v projections carry a bias
    return {"qkv": (h, (heads + 2 * groups) * d, bias), "proj": (heads * d, h, False), "fc1": (h, 2 * f, False),
            "fc2": (f, h, False)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_args(ap)
    ap.add_argument("--position", type=int, default=383, help="every row's position in the timed steps")
    ap.add_argument("--rows", default="8,16,32,64,96,128,160,192,256,320,384,448,512")
    ap.add_argument("--gemm-rows", default="32,64,128,256,384,512")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_rows.json"))
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    res = {"config": vars(a), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not a.no_attention:
        res["attention"] = attention_check()
    res["steps"] = step_curve(a, [int(r) for r in a.rows.split(",")])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    shapes = layer_gemms(a.shape)
    res["gemms"] = {}

    def save():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    gemm_table([int(r) for r in a.gemm_rows.split(",")], shapes, not a.no_autotune, res["gemms"], save)
    save()


if __name__ == "__main__":
    main()
