"""Session 29, call 8: FlashAttention-4's SM90 forward as the decode step's attention, against the engine's
Triton decode kernel (``kernels.decode_attention``), at the 0.5B GRPO decode shape: 512 rows, 2 KV groups of 7
query heads, head dim 64, one query a row, the engine's cache layout [slot, group, T, D] (FA4 reads it as a
[B, T, G, D] view, no copy) with each row's keys 0..position. Rows all at one position (the fixed workload)
and at positions spread over 256..767; each kernel eager and replayed from a CUDA graph (the engine decodes
in graphs). Prints JSON: us per call, live-KV TB/s, largest difference from the Triton kernel."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from megatron_rl.kernels import decode_attention as dk  # noqa: E402

out = {"device": torch.cuda.get_device_name()}
try:
    from flash_attn.cute import flash_attn_varlen_func
except Exception as exc:  # noqa: BLE001
    print(json.dumps(out | {"import_error": f"{type(exc).__name__}: {exc}"[:500]}))
    sys.exit(0)
dev, dt = torch.device("cuda"), torch.bfloat16
B, G, REP, D, T = 512, 2, 7, 64, 1024
torch.manual_seed(0)
cache = torch.randn(2, B, G, T, D, device=dev, dtype=dt)
k, v = cache[0], cache[1]
q = torch.randn(B, G, REP, D, device=dev, dtype=dt)
cu_q = torch.arange(B + 1, device=dev, dtype=torch.int32)


def timed(fn, reps=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


for label, positions in (
    ("fixed_pos511", torch.full((B,), 511, device=dev)),
    ("fixed_pos767", torch.full((B,), 767, device=dev)),
    ("spread_256_767", torch.randint(256, 768, (B,), device=dev)),
):
    used = (positions + 1).to(torch.int32)
    live_bytes = float(used.sum()) * G * D * 2 * 2  # K and V, bf16
    res = {}

    def triton_call(positions=positions):
        return dk.decode_attention(q, k, v, positions)

    ref = triton_call().float()
    variants = {"triton": triton_call}
    for pack in (None, True):
        for splits in (1, 0):

            def fa4(pack=pack, splits=splits, used=used):
                o = flash_attn_varlen_func(
                    q.reshape(B, G * REP, D), k.transpose(1, 2), v.transpose(1, 2), cu_seqlens_q=cu_q,
                    max_seqlen_q=1, max_seqlen_k=T, seqused_k=used, softmax_scale=D**-0.5, causal=False,
                    pack_gqa=pack, num_splits=splits,
                )  # fmt: skip
                return (o[0] if isinstance(o, tuple) else o).view(B, G, REP, D)

            variants[f"fa4_pack{pack}_splits{splits}"] = fa4
    for name, fn in variants.items():
        try:
            with torch.no_grad():
                diff = float((fn().float() - ref).abs().max())
                eager = timed(fn)
                try:
                    graph_us = timed(graphed(fn))
                except Exception as exc:  # noqa: BLE001
                    graph_us = f"{type(exc).__name__}: {exc}"[:300]
            res[name] = {"eager_us": eager, "graph_us": graph_us, "max_abs_diff_vs_triton": diff}
            if isinstance(graph_us, float):
                res[name]["graph_tb_s"] = live_bytes / graph_us / 1e6
        except Exception as exc:  # noqa: BLE001
            res[name] = f"{type(exc).__name__}: {exc}"[:400]
    out[label] = res
    print(label, json.dumps(res), flush=True)
Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe_fa4_decode.json").write_text(json.dumps(out, indent=1))
