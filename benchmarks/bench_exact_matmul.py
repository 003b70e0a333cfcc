"""Issue 18's cost: the batch-invariant matmul (``kernels.batch_invariant_triton.matmul``) at the linear
layers' shapes, decode rows (M = 512, the GRPO rollout's batch) and a training micro-batch (M = 16384), for
its default tile and a sweep of others, and the fixed-shape cuBLAS path (``batch_invariant.fixed_rows_matmul``:
calls of exactly 512 rows), against plain cuBLAS (``F.linear``) in the same run. Each candidate is checked
for batch invariance on the device: rows 0..63 of the M = 512 and M = 16384 results (same inputs), a
single row at M = 1 and rows 37.. at shifted positions must be the same bits; one that fails is marked and
never a candidate. Times are per call replayed from a CUDA graph (``--timing graph``, as in the engine's
captured decode step; ``events`` times eager launches, which at decode rows mostly measures the launch).

    python3 benchmarks/bench_exact_matmul.py --shape qwen2.5-0.5b --out $OUT/exact_matmul_0.5b.json   (CUDA)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from _timing import graphed_us, timed_us  # benchmarks/, the script's folder

from megatron_rl.kernels import batch_invariant as bi
from megatron_rl.kernels import batch_invariant_triton as tri
from megatron_rl.models.shapes import SHAPES


def linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the model's linear layers at TP=1 (the LM head over the padded vocab)."""
    s = SHAPES[shape]
    h, f, heads, groups = (
        s["hidden_size"],
        s["intermediate_size"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
    )
    d = h // heads
    vocab = -(-s["vocab_size"] // 128) * 128
    return {"qkv": ((heads + 2 * groups) * d, h), "proj": (h, heads * d), "fc1": (2 * f, h), "fc2": (h, f),
            "lm_head": (vocab, h)}  # fmt: skip


def configs() -> list[tuple[int, int, int, int, int] | None]:
    """None (the default tile) then (BM, BN, BK, warps, stages) candidates."""
    sweep = itertools.product((64, 128), (64, 128, 256), (64,), (4, 8), (3, 4))
    return [None] + [c for c in sweep if not (c[0] == 128 and c[1] == 256 and c[3] == 4)]


def candidate(config):
    """config -> fn(x, w): a Triton tile (None: the default) or "fixed_rows" (cuBLAS in 512-row calls)."""
    if config == "fixed_rows":
        return lambda x, w: bi.fixed_rows_matmul(x, w)
    return lambda x, w: tri.matmul(x, w, None, config)


def invariant(w: torch.Tensor, x: torch.Tensor, fn) -> bool:
    """Rows of a 512-row and a 16384-row product, one row alone and rows at shifted positions are the
    same bits."""
    small, big, one = fn(x[:512], w), fn(x, w), fn(x[:1], w)
    shifted = fn(x[37:1337], w)
    return bool(torch.equal(small[:64], big[:64]) and torch.equal(one[0], big[0])
                and torch.equal(shifted, big[37:1337]))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="512,16384", help="M values to time")
    ap.add_argument("--timing", choices=["graph", "events"], default="graph")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="time the Triton tile sweep too (else the default tile, fixed_rows and cuBLAS)")  # fmt: skip
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    timer = graphed_us if a.timing == "graph" else timed_us
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    rows = [int(r) for r in a.rows.split(",")]
    out = {"device": torch.cuda.get_device_name(), "shape": a.shape, "layers": {}}
    for name, (n, k) in linear_shapes(a.shape).items():
        w = torch.randn(n, k, device=dev, dtype=bf) / k**0.5
        x = torch.randn(max(rows + [16384]), k, device=dev, dtype=bf)
        res = {
            "N": n,
            "K": k,
            "cublas_us": {m: timer(lambda m=m, x=x, w=w: F.linear(x[:m], w)) for m in rows},
            "configs": [],
        }
        for cfg in ["fixed_rows"] + (configs() if a.sweep else [None]):
            fn = candidate(cfg)
            try:
                ok = invariant(w, x, fn)
                us = {m: timer(lambda m=m, x=x, w=w, fn=fn: fn(x[:m], w)) for m in rows}
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported
                res["configs"].append(
                    {"config": cfg, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                )
                continue
            res["configs"].append({"config": cfg or "default", "invariant": ok, "us": us})
        ok = [c for c in res["configs"] if c.get("invariant")]
        res["best"] = {m: min(ok, key=lambda c: c["us"][m])["config"] for m in rows} if ok else None
        out["layers"][name] = res
        print(json.dumps({name: {"cublas_us": res["cublas_us"], "best": res["best"],
                                 "fixed_rows": res["configs"][0], "default_us": res["configs"][1].get("us")}}), flush=True)  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
