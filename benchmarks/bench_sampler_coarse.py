"""The sampler's coarse noise filter (``kernels.sampler``, ``coarse``: one noise bound a block) against the
per-element filter it may replace, as the engine calls the draw (keys mixed in the kernel, log-probs read, block
skip on, the tile chosen from the rows), at Qwen2.5's vocab in bf16: A B B A timings on flat rows (4 x randn,
as random weights give) and on rows with one token 20 above the rest (a trained model's shape), token mismatches
against the eager draw over several key sets (0 expected), and the greedy draw for scale.

Run: ``python benchmarks/bench_sampler_coarse.py --out $OUT/sampler_coarse.json`` (CUDA, ~20 s).
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import timed_us  # benchmarks/, the script's folder

from megatron_rl.kernels import sampler as kernel
from megatron_rl.rollout.sampling import _draw


def bench(rows: int, vocab: int, key_sets: int) -> dict:
    torch.manual_seed(rows)
    flat = (4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    peaked = flat.clone()
    peaked[torch.arange(rows, device="cuda"), torch.randint(0, vocab, (rows,), device="cuda")] += 20
    ids = torch.arange(vocab, device="cuda")[None]
    inv_temp = 1 / 0.7
    keys = torch.randint(-(2**62), 2**62, (rows,), device="cuda")
    out = {"rows": rows, "vocab": vocab}
    for tag, logits in (("flat", flat), ("peaked", peaked)):
        ways = {
            c: (lambda k, c=c, x=logits: kernel.draw(x, k, inv_temp, True, mix=True, logprobs=True, coarse=c))
            for c in (False, True)
        }
        for i, c in enumerate((False, True, True, False)):  # A B B A
            out[f"{tag}_{'coarse' if c else 'per_element'}_us_{i}"] = timed_us(
                lambda fn=ways[c]: fn(keys), n=200, warmup=5
            )
        out[f"{tag}_greedy_us"] = timed_us(
            lambda x=logits: kernel.draw(x, keys, inv_temp, False, mix=True, logprobs=True), n=200, warmup=5
        )
        batches = [torch.randint(-(2**62), 2**62, (rows,), device="cuda") for _ in range(key_sets)]
        for c in (False, True):
            got = [ways[c](k)[0] for k in batches]
            want = [_draw(logits, k, ids, inv_temp, True)[0] for k in batches]  # raw keys: mixed inside both
            out[f"{tag}_{'coarse' if c else 'per_element'}_token_mismatches"] = sum(
                int((g != w).sum()) for g, w in zip(got, want)
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--key-sets", type=int, default=8)
    ap.add_argument("--rows", default="256,512")
    a = ap.parse_args()
    res = {
        "gpu": torch.cuda.get_device_name(),
        "runs": [bench(int(r), a.vocab, a.key_sets) for r in a.rows.split(",")],
    }
    for r in res["runs"]:
        print(json.dumps(r), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
