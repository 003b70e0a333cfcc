"""Session 28, call E: can FlashAttention-4 (`flash-attn-4`, CuTe DSL, with an SM90 forward and backward) run the
update's attention on this GPU, and how fast against the trainer's varlen path? The 0.5B fixed micro-batch's
row (shared prompts: the trainer's gathered key segments), causal, GQA 14:2, head dim 64, bf16; forward and
forward + backward in ms (CUDA events), largest relative difference from the varlen path."""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_update_attention as bua  # noqa: E402
from _timing import timed_us  # noqa: E402

out = {"device": torch.cuda.get_device_name(), "torch_cuda": torch.version.cuda}
t0 = time.perf_counter()
try:
    from flash_attn.cute import flash_attn_varlen_func

    out["import_s"] = time.perf_counter() - t0
except Exception as exc:  # noqa: BLE001
    out["import_error"] = f"{type(exc).__name__}: {exc}"[:800]
    print(json.dumps(out))
    sys.exit(0)
dev, dt = torch.device("cuda"), torch.bfloat16
lay = bua.packed_row(8, 8, 256, [512] * 64)
p = lay.seq_params()
p.segments_q, p.segments_k, p.kv_index = (x.to(dev) for x in (p.segments_q, p.segments_k, p.kv_index))
s = lay.input_ids.shape[1]
q, k, v = (torch.randn(s, h, 64, device=dev, dtype=dt, requires_grad=True) for h in (14, 2, 2))
g = torch.randn_like(q)
flop = 4 * 64 * 14 * bua.pairs(p)


def fa4():
    ks, vs = k.index_select(0, p.kv_index), v.index_select(0, p.kv_index)
    o = flash_attn_varlen_func(
        q,
        ks,
        vs,
        cu_seqlens_q=p.segments_q,
        cu_seqlens_k=p.segments_k,
        max_seqlen_q=p.max_q,
        max_seqlen_k=p.max_k,
        softmax_scale=0.125,
        causal=True,
    )
    return o[0] if isinstance(o, tuple) else o


def varlen():
    return bua.pa.segment_params_attention(q, k, v, p, 0.125, None)


for name, fn in (("varlen", varlen), ("fa4", fa4)):
    try:
        t1 = time.perf_counter()
        o = fn()
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), g)
        torch.cuda.synchronize()
        r = {
            "first_call_s": time.perf_counter() - t1,
            "out": o.float(),
            "grads": [dq.float(), dk.float(), dv.float()],
        }

        def f(fn=fn):
            with torch.no_grad():
                fn()

        def fb(fn=fn):
            torch.autograd.grad(fn(), (q, k, v), g)

        r["fwd_ms"] = timed_us(f, 10) / 1e3
        r["fwd_bwd_ms"] = timed_us(fb, 10) / 1e3
        r["fwd_tflops"], r["fwd_bwd_tflops"] = flop / r["fwd_ms"] / 1e9, 3.5 * flop / r["fwd_bwd_ms"] / 1e9
        out[name] = r
    except Exception as exc:  # noqa: BLE001
        out[name] = f"{type(exc).__name__}: {exc}"[:800]
if isinstance(out.get("fa4"), dict) and isinstance(out.get("varlen"), dict):
    a, b = out["fa4"], out["varlen"]
    out["fa4_vs_varlen_rel"] = max(
        float((x - y).abs().max() / y.abs().max())
        for x, y in zip([a["out"], *a["grads"]], [b["out"], *b["grads"]])
    )
for name in ("varlen", "fa4"):
    if isinstance(out.get(name), dict):
        out[name] = {k2: v2 for k2, v2 in out[name].items() if k2 not in ("out", "grads")}
print(json.dumps(out))
