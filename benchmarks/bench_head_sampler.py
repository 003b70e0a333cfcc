"""The decode step's LM head and draw: today's cuBLAS GEMM (bf16 logits) then ``kernels.sampler.draw`` against
``kernels.head_sampler.draw`` (one GEMM with the draw in its epilogue, logits never written), at the 0.5B
shape (hidden 896, 151,936 ids; weights padded to 151,936 rows as Qwen2.5's embedding is) and the 3B one
(hidden 2048), timed inside CUDA graphs (as the engine replays them), several tiles of the fused kernel.

Correctness on the GPU: the fused kernel's tokens against ``sampler.draw`` on the logits the fused kernel
computed (``logits_out``; 0 mismatches expected unless three scores of a tile tie within ~4e-5), and against
today's path on cuBLAS's logits (a different accumulation order: a few near-tie rows may differ).

Run: ``python benchmarks/bench_head_sampler.py --out $OUT/head_sampler.json`` (CUDA, ~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import graphed_us  # noqa: E402

from megatron_rl.kernels import head_sampler as head  # noqa: E402
from megatron_rl.kernels import sampler  # noqa: E402

TILES = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (64, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 64, 64, 8, 3),
    (64, 64, 64, 4, 3),
    (256, 128, 64, 8, 3),
]


def bench(rows: int, hidden: int, vocab: int, scale: float, tiles, dump=lambda out: None) -> dict:
    """One shape's timings and checks; ``dump(partial)`` after each tile (a timeout keeps what finished)."""
    torch.manual_seed(rows + hidden)
    h = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    w = (scale * torch.randn(vocab, hidden, device="cuda")).to(torch.bfloat16)
    keys = torch.randint(-(2**62), 2**62, (rows,), device="cuda")
    buf = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
    out: dict = {"rows": rows, "hidden": hidden, "vocab": vocab, "weight_std": scale}

    def today():
        torch.mm(h, w.t(), out=buf)
        return sampler.draw(buf, keys, 1.0, True, mix=True, logprobs=True)

    out["cublas_mm_us"] = graphed_us(lambda: torch.mm(h, w.t(), out=buf), n=10, replays=10)
    torch.mm(h, w.t(), out=buf)
    out["sampler_us"] = graphed_us(
        lambda: sampler.draw(buf, keys, 1.0, True, mix=True, logprobs=True), n=10, replays=10
    )
    out["today_us"] = graphed_us(today, n=10, replays=10)
    t_tok, t_lse, t_lp = today()
    flops = 2 * rows * hidden * vocab
    out["cublas_tflops"] = flops / out["cublas_mm_us"] / 1e6
    logits = torch.empty_like(buf)
    for tile in tiles:
        name = "fused_" + "_".join(map(str, tile))
        try:
            out[name + "_us"] = graphed_us(
                lambda t=tile: head.draw(h, w, vocab, keys, 1.0, True, tile=t), n=10, replays=10
            )
            tok, lse, lp = head.draw(h, w, vocab, keys, 1.0, True, tile=tile, logits_out=logits)
            s_tok, s_lse, s_lp = sampler.draw(logits, keys, 1.0, True, mix=True, logprobs=True)
            out[name + "_mismatch_own_logits"] = int((tok != s_tok).sum())
            out[name + "_lp_max_diff_own"] = float((lp - s_lp).abs().max())
            out[name + "_mismatch_vs_today"] = int((tok != t_tok).sum())
            out[name + "_logits_max_diff_vs_cublas"] = float((logits.float() - buf.float()).abs().max())
            out[name + "_lse_max_diff_vs_today"] = float((lse - t_lse).abs().max())
            if tile == tiles[0]:  # greedy: one more compile, so once
                g_tok, _, _ = head.draw(h, w, vocab, keys, 1.0, False, tile=tile, logits_out=logits)
                out[name + "_greedy_mismatch_own"] = int((g_tok != logits.float().argmax(-1)).sum())
        except Exception as e:  # noqa: BLE001 - a sweep: record why a tile failed
            out[name + "_us"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        dump(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="512,256")
    ap.add_argument("--shapes", default="896,2048", help="hidden sizes (0.5B: 896, 3B: 2048)")
    ap.add_argument("--tiles", default="", help="BM,BN,BK,warps,stages;... (default: the built-in sweep)")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "results": []}
    sweep = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";") if t] or TILES
    for hidden in map(int, a.shapes.split(",")):
        for rows in map(int, a.rows.split(",")):
            if hidden != 896 and rows != 512:
                continue
            # the 0.5B shape at 512 rows gets the whole sweep; the others its first tile and the 64 x 128 ones
            main_shape = hidden == 896 and rows == 512
            tiles = sweep if main_shape else sweep[:1] + [t for t in sweep if t[:2] == (64, 128)]
            res["results"].append({})

            def dump(partial):
                res["results"][-1] = partial
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)

            r = bench(rows, hidden, 151936, 0.02, tiles, dump)
            timed = [
                (v, k)
                for k, v in r.items()
                if k.startswith("fused_") and k.endswith("_us") and isinstance(v, float)
            ]
            best = min(timed, default=(float("nan"), "none"))
            print(hidden, rows, "today", round(r["today_us"], 1), "(mm", round(r["cublas_mm_us"], 1), "+ draw",
                  round(r["sampler_us"], 1), ") best fused", round(best[0], 1), best[1], flush=True)  # fmt: skip
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
