"""Decode attention (issue 16): the rollout engine's Triton kernel (``kernels.decode_attention``) over a
sweep of key blocks, warps and pipeline stages at a model's decode shape (batch 512, a KV cache of
prompt + response = 768 positions, each row at a position drawn uniformly from the response range, as in
the middle of a GRPO rollout), timed per call replayed from a CUDA graph, with the live-KV bandwidth it
reaches and its largest difference from SDPA.

    python3 benchmarks/bench_decode_attention.py --shape qwen2.5-0.5b --out $OUT/decode_attention_0.5b.json  (CUDA)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from _timing import graphed_us  # benchmarks/, the script's folder

from megatron_rl.kernels.decode_attention import decode_attention
from megatron_rl.models.shapes import SHAPES

HBM_TB_S = 4.8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--cache", type=int, default=768)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    groups, heads = s["num_key_value_heads"], s["num_attention_heads"]
    d, rep = s["hidden_size"] // heads, heads // groups
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    cache = torch.randn(2, a.batch, groups, a.cache, d, device=dev, dtype=bf)
    q = torch.randn(a.batch, groups, rep + 2, d, device=dev, dtype=bf)[:, :, :rep]  # the engine's qkv view
    pos = torch.randint(a.prompt_len, a.cache, (a.batch,), device=dev)
    live_bytes = 2 * groups * d * 2 * (pos + 1).sum().item()  # K and V, bf16, keys 0..pos per row
    mask = torch.zeros(a.batch, 1, 1, a.cache, device=dev, dtype=bf)
    mask.masked_fill_(
        ~(torch.arange(a.cache, device=dev)[None] <= pos[:, None])[:, None, None], float("-inf")
    )
    want = F.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=mask)
    out = {"device": torch.cuda.get_device_name(), "shape": a.shape, "batch": a.batch, "cache": a.cache,
           "groups": groups, "rep": rep, "head_dim": d, "live_kv_gb": live_bytes / 1e9, "configs": []}  # fmt: skip
    for block, warps, stages in itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 2, 3, 4)):
        try:
            got = decode_attention(
                q, cache[0], cache[1], pos, block=block, num_warps=warps, num_stages=stages
            )
            us = graphed_us(lambda b=block, w=warps, st=stages: decode_attention(
                q, cache[0], cache[1], pos, block=b, num_warps=w, num_stages=st))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported
            out["configs"].append({"block": block, "warps": warps, "stages": stages,
                                   "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]})  # fmt: skip
            continue
        err = (got.float() - want.float()).abs().max().item()
        tb_s = live_bytes / us / 1e6
        out["configs"].append({"block": block, "warps": warps, "stages": stages, "us": us, "tb_s": tb_s,
                               "fraction_of_hbm": tb_s / HBM_TB_S, "max_err_vs_sdpa": err})  # fmt: skip
    ok = [c for c in out["configs"] if "us" in c and c["max_err_vs_sdpa"] < 2e-2]
    out["best"] = min(ok, key=lambda c: c["us"]) if ok else None
    out["current_default"] = next(
        (c for c in ok if (c["block"], c["warps"], c["stages"]) == (64, 4, 3)), None
    )
    print(json.dumps({k: out[k] for k in ("shape", "live_kv_gb", "best", "current_default")}), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
