"""Decode attention (issue 16): the rollout engine's Triton kernel (``kernels.decode_attention``) over a
sweep of key blocks, warps and pipeline stages at a model's decode shape (batch 512, a KV cache of
prompt + response = 768 positions, each row at a position drawn uniformly from the response range, as in
the middle of a GRPO rollout), timed per call replayed from a CUDA graph, with the live-KV bandwidth it
reaches and its largest difference from SDPA. Then ``rollout.prompt_kv_sharing`` at the default config:
groups of ``--samples`` slots holding copies of one prompt, read from each group's lead slot or each from its
own, with the group's slots adjacent (as the engine admits them) and scattered over the batch.

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
    ap.add_argument("--default-only", action="store_true", help="time the default config only (no sweep)")
    ap.add_argument("--samples", type=int, default=8, help="slots per prompt for the prompt_kv_sharing rows")
    ap.add_argument("--equal-positions", default="",
                    help="comma-separated positions: instead of the sweep, every row at each position in turn (the "
                         "fixed-length workload's decode), timed at a few configs: the time against the live KV")  # fmt: skip
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
    if a.equal_positions:
        out["by_position"] = by_position(q, cache, [int(p) for p in a.equal_positions.split(",")])
        print(json.dumps(out["by_position"]), flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return
    sweep = itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 2, 3, 4))
    for block, warps, stages in [(64, 4, 3)] if a.default_only else sweep:
        try:
            got = decode_attention(
                q, cache[0], cache[1], pos, block=block, num_warps=warps, num_stages=stages
            )
            us = graphed_us(lambda b=block, w=warps, st=stages, at=pos: decode_attention(
                q, cache[0], cache[1], at, block=b, num_warps=w, num_stages=st))  # fmt: skip
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
    out["prompt_kv_sharing"] = sharing(cache, q, pos, a.prompt_len, a.samples, live_bytes)
    keys = ("shape", "live_kv_gb", "best", "current_default", "prompt_kv_sharing")
    print(json.dumps({k: out[k] for k in keys}), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


EQUAL_CONFIGS = ((64, 4, 3), (32, 2, 3), (64, 2, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2))


def by_position(q, cache, positions: list[int]) -> list[dict]:
    """Every row at one position (as in a fixed-length rollout, where all rows decode in step): the kernel's
    time per call at ``EQUAL_CONFIGS`` (block, warps, stages) for each position, with the live-KV rate; the
    time's intercept over the positions is the kernel's cost that does not scale with the keys read."""
    rows = []
    for p in positions:
        pos = torch.full((q.shape[0],), p, device=q.device, dtype=torch.long)
        live = 2 * cache.shape[2] * cache.shape[4] * 2 * (p + 1) * q.shape[0]
        for block, warps, stages in EQUAL_CONFIGS:
            us = graphed_us(lambda b=block, w=warps, st=stages, at=pos: decode_attention(
                q, cache[0], cache[1], at, block=b, num_warps=w, num_stages=st))  # fmt: skip
            rows.append({"position": p, "block": block, "warps": warps, "stages": stages, "us": us,
                         "tb_s": live / us / 1e6})  # fmt: skip
    return rows


def sharing(cache, q, pos, prompt_len: int, samples: int, live_bytes: float) -> dict:
    """The default kernel with and without ``prefix`` over a cache whose groups of ``samples`` slots hold
    one prompt's copy each (adjacent slots, then a random permutation of them); the outputs must agree bit
    for bit, and the time shows what reading each prompt once from HBM saves."""
    batch = cache.shape[1]
    res = {"samples": samples, "unique_live_kv_gb": None}
    for layout in ("adjacent", "scattered"):
        order = torch.arange(batch, device=cache.device)
        if layout == "scattered":
            order = order[torch.randperm(batch, generator=torch.Generator().manual_seed(0)).to(cache.device)]
        group = torch.empty_like(order)
        group[order] = torch.arange(batch, device=cache.device) // samples  # slot -> its prompt
        first = torch.full((batch // samples + 1,), batch, device=cache.device, dtype=torch.long)
        first.scatter_reduce_(0, group, torch.arange(batch, device=cache.device), "amin")
        lead = first[group]  # [B] the lowest slot of each slot's group
        c = cache.clone()
        c[:, :, :, :prompt_len] = c[:, lead, :, :prompt_len]  # every slot a copy of its lead's prompt
        plen = torch.full_like(pos, prompt_len)
        plain = decode_attention(q, c[0], c[1], pos)
        shared = decode_attention(q, c[0], c[1], pos, prefix=(lead, plen))
        us_plain = graphed_us(lambda c=c: decode_attention(q, c[0], c[1], pos))
        us_shared = graphed_us(
            lambda c=c, lead=lead, plen=plen: decode_attention(q, c[0], c[1], pos, prefix=(lead, plen))
        )
        n_prompts = int(group.max()) + 1
        unique = live_bytes - (batch - n_prompts) * prompt_len * c.shape[2] * c.shape[4] * 2 * 2
        res["unique_live_kv_gb"] = unique / 1e9
        res[layout] = {"us_own_copies": us_plain, "us_shared": us_shared, "speedup": us_plain / us_shared,
                       "equal_bits": bool(torch.equal(plain, shared)),
                       "unique_kv_tb_s_shared": unique / us_shared / 1e6}  # fmt: skip
        del c
    return res


if __name__ == "__main__":
    main()
