"""The sampler's draw (tokens + log-sum-exp of one decode step) three ways, at Qwen2.5's vocab in bf16: eager
``_draw``, the compiled ``_FUSED_DRAW`` and the Triton kernel (``kernels.sampler``, a few split / block
settings, with and without the noise filter), against the time to read the logits once; and the kernel on
logits with one peaked token per row, where the filter skips nearly every block. Tokens are compared with the eager draw's over
several key sets (mismatch counts; 0 expected for the kernel, which rounds as eager does), and the
log-sum-exp's largest difference.

Run: ``python benchmarks/bench_sampler.py --out $OUT/bench_sampler.json`` (CUDA, under a minute).
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import timed_us  # benchmarks/, the script's folder

from megatron_rl.kernels import sampler as kernel
from megatron_rl.rollout.sampling import _FUSED_DRAW, _M32, _draw, mix64


def bench(rows: int, vocab: int, key_sets: int) -> dict:
    torch.manual_seed(rows)
    logits = (4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    ids = torch.arange(vocab, device="cuda")[None]
    keys = torch.randint(-(2**62), 2**62, (rows,), device="cuda")
    inv_temp = 1 / 0.7
    ways = {
        "eager": lambda k: _draw(logits, k, ids, inv_temp, True),
        "compiled": lambda k: _FUSED_DRAW(logits, k, ids, inv_temp, True),
        "triton": lambda k: kernel.draw(logits, mix64(k) & _M32, inv_temp, True, block_skip=False),
        "triton_unfiltered": lambda k: kernel.draw(logits, mix64(k) & _M32, inv_temp, True, filtered=False),
        # what the engine calls: keys mixed and the tokens' log-probs read in the kernel (block skip: its default)
        "triton_fused": lambda k: kernel.draw(
            logits, k, inv_temp, True, mix=True, logprobs=True, block_skip=False
        ),
        "triton_block_skip": lambda k: kernel.draw(
            logits, k, inv_temp, True, mix=True, logprobs=True, block_skip=True
        ),
    }
    # the engine's call at other software-pipelining depths of the vocab loop (session 26: is the loop latency-bound?),
    # at the draw's own tile ("") and at 1024-element blocks with 4 warps
    for stages in (1, 2, 4):
        for tag, tile in (("", {}), ("_b1024_w4", {"block": 1024, "num_warps": 4})):
            ways[f"triton_block_skip{tag}_stages{stages}"] = lambda k, n=stages, t=tile: kernel.draw(
                logits, k, inv_temp, True, mix=True, logprobs=True, block_skip=True, num_stages=n, **t
            )
    d = kernel.splits_for(rows)
    for splits in sorted({max(1, d // 4), d, min(64, 4 * d)}):
        for block, warps in ((1024, 4), (4096, 8)):
            ways[f"triton_s{splits}_b{block}_w{warps}"] = lambda k, s=splits, b=block, w=warps: kernel.draw(
                logits, mix64(k) & _M32, inv_temp, True, splits=s, block=b, num_warps=w
            )
    out = {"rows": rows, "vocab": vocab, "splits_default": kernel.splits_for(rows)}
    out["read_logits_us"] = timed_us(lambda: logits.amax(-1), n=200, warmup=5)
    for name, fn in ways.items():
        out[f"{name}_us"] = timed_us(lambda fn=fn: fn(keys), n=200, warmup=5)
    key_batches = [torch.randint(-(2**62), 2**62, (rows,), device="cuda") for _ in range(key_sets)]
    want = [_draw(logits, k, ids, inv_temp, True) for k in key_batches]
    greedy_want = _draw(logits, keys, ids, inv_temp, False)
    for name, fn in ways.items():
        got = [fn(k) for k in key_batches]
        out[f"{name}_token_mismatches"] = sum(int((g[0] != w[0]).sum()) for g, w in zip(got, want))
        out[f"{name}_lse_max_abs_diff"] = max(float((g[1] - w[1]).abs().max()) for g, w in zip(got, want))
    g_tok, g_lse = kernel.draw(logits, mix64(keys) & _M32, inv_temp, False)
    out["triton_greedy_token_mismatches"] = int((g_tok != greedy_want[0]).sum())
    out["triton_greedy_lse_max_abs_diff"] = float((g_lse - greedy_want[1]).abs().max())
    out["rows_compared"] = rows * key_sets
    # one token 20 (and 40) above the rest per row, a trained model's shape: the noise filter skips the exact
    # logarithms in nearly every block; the block skip (on by default) also the hash where a block's max + 16.64 < best
    hot = torch.randint(0, vocab, (rows,), device="cuda")
    for tag, peak in (("peaked", 20), ("peaked40", 40)):
        peaked = logits.clone()
        peaked[torch.arange(rows, device="cuda"), hot] += peak
        for name, filt, skip, tile in ((f"{tag}_triton", True, False, ()), (f"{tag}_triton_unfiltered", False, False, ()),
                                       (f"{tag}_triton_block_skip", True, True, ()),
                                       (f"{tag}_triton_block_skip_b1024_w4", True, True, (1024, 4))):  # fmt: skip

            def fn(k, f=filt, b=skip, x=peaked, tile=tile):
                shape = dict(zip(("block", "num_warps"), tile))
                return kernel.draw(x, mix64(k) & _M32, inv_temp, True, filtered=f, block_skip=b, **shape)

            out[f"{name}_us"] = timed_us(lambda fn=fn: fn(keys), n=200, warmup=5)
            want_p = [_draw(peaked, k, ids, inv_temp, True) for k in key_batches]
            out[f"{name}_token_mismatches"] = sum(
                int((fn(k)[0] != w[0]).sum()) for k, w in zip(key_batches, want_p)
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--key-sets", type=int, default=16)
    ap.add_argument("--rows", default="64,128,256,512", help="comma-separated batch sizes")
    args = ap.parse_args()
    results = [bench(rows, args.vocab, args.key_sets) for rows in map(int, args.rows.split(","))]
    for r in results:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
