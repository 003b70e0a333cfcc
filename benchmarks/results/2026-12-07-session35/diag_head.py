"""Session 35: where the fused LM head + draw (``kernels.head_sampler``) loses its time at 512 rows (0.5B
shape). Times, each replayed from a CUDA graph: cuBLAS's LM head GEMM, the sampler on its logits, the fused
kernel drawing (noisy) and greedy (no hash, no logarithms: the GEMM, the log-sum-exp partials and the top-2),
at the tile session 35's call C found best and at the default tile. noisy - greedy is the noise's cost in the
epilogue; greedy - cuBLAS is what the Triton GEMM and the rest of the epilogue cost over cuBLAS.

    PYTHONPATH=$PWD python3 benchmarks/results/2026-12-07-session35/diag_head.py --out $OUT/diag_head.json
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from _timing import graphed_us  # noqa: E402  benchmarks/

from megatron_rl.kernels import head_sampler as head  # noqa: E402
from megatron_rl.kernels import sampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--tiles", default="128,128,64,8,4;128,128,64,8,3;64,128,64,4,3")
    a = ap.parse_args()
    vocab = 151936
    torch.manual_seed(0)
    h = torch.randn(a.rows, a.hidden, device="cuda").to(torch.bfloat16)
    w = (0.02 * torch.randn(vocab, a.hidden, device="cuda")).to(torch.bfloat16)
    keys = torch.randint(-(2**62), 2**62, (a.rows,), device="cuda")
    buf = torch.empty(a.rows, vocab, device="cuda", dtype=torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(), "rows": a.rows, "hidden": a.hidden, "vocab": vocab}
    res["cublas_mm_us"] = graphed_us(lambda: torch.mm(h, w.t(), out=buf), n=10, replays=10)
    res["sampler_us"] = graphed_us(
        lambda: sampler.draw(buf, keys, 1.0, True, mix=True, logprobs=True), n=10, replays=10
    )
    res["sampler_greedy_us"] = graphed_us(
        lambda: sampler.draw(buf, keys, 1.0, False, mix=True, logprobs=True), n=10, replays=10
    )
    res["read_logits_amax_us"] = graphed_us(lambda: buf.amax(-1), n=10, replays=10)
    for spec in a.tiles.split(";"):
        tile = tuple(int(x) for x in spec.split(","))
        name = "_".join(map(str, tile))
        for noisy in (True, False):
            key = f"fused_{name}_{'noisy' if noisy else 'greedy'}_us"
            try:
                res[key] = graphed_us(
                    lambda t=tile, n=noisy: head.draw(h, w, vocab, keys, 1.0, n, tile=t), n=10, replays=10
                )
            except Exception as e:  # noqa: BLE001 - a tile that fails is reported
                res[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
            print(key, res[key], flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
