"""Would FP8 GEMMs shorten the decode step? (issue 16's decode target: a measurement before any build.)

At 512 decode rows the 0.5B step's bf16 GEMMs cost ~1.09 ms of ~2.5 (H200, session 38's profile) and run at
a fifth to three quarters of the tensor cores' bf16 peak. This times, per decode GEMM of a model shape, the bf16
``F.linear`` (cuBLAS, what the engine runs) against ``torch._scaled_mm`` on float8 e4m3 operands with a scale per
row of the activations and per output channel of the weights (bf16 out; with and without fast accumulation),
each over 24 distinct weight copies in turn (one a layer: the weights come from HBM, not L2, as in the step),
replayed from one CUDA graph (``_timing.graphed_us``). "quant" adds quantising the activations with torch ops
(abs-max a row, scale, cast: what a fused kernel would hide in the norm or SwiGLU before the GEMM), an upper
bound of that cost. It reports the output's error against bf16 too (max abs over the output's largest).

Run: ``python benchmarks/bench_fp8_decode_gemm.py --out $OUT/fp8_gemm.json`` (CUDA, sm_89+; ~1 min).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _timing import graphed_us  # benchmarks/, the script's folder

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LAYERS = 24
SHAPES = {  # name -> [(gemm, N, K, bias)]
    "qwen2.5-0.5b": [("qkv", 1152, 896, True), ("proj", 896, 896, False), ("fc1", 9728, 896, False),
                     ("fc2", 896, 4864, False), ("head", 151936, 896, False)],
    "qwen2.5-3b": [("qkv", 2560, 2048, True), ("proj", 2048, 2048, False), ("fc1", 22016, 2048, False),
                   ("fc2", 2048, 11008, False), ("head", 151936, 2048, False)],
}  # fmt: skip


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]): x = q * scale per row."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def time_gemm(x, w, wq, ws, bias) -> dict:
    """us a call (graph replays over the weight copies in turn) and error against bf16 for each way."""
    bf, copies = torch.bfloat16, len(w)
    xq, xs = quant_rows(x)
    calls = iter(range(10**9))

    def bf16():
        j = next(calls) % copies
        return F.linear(x, w[j], bias)

    def fp8(fast: bool, quant: bool = False):
        def run():
            j = next(calls) % copies
            q, s = quant_rows(x) if quant else (xq, xs)
            return torch._scaled_mm(q, wq[j].t(), s, ws[j], bias=bias, out_dtype=bf, use_fast_accum=fast)

        return run

    ref = F.linear(x, w[0], bias).float()
    row = {"us_bf16": graphed_us(bf16, n=copies, replays=10)}
    for label, fn in (("fp8", fp8(False)), ("fp8_fast", fp8(True)), ("fp8_fast_quant", fp8(True, True))):
        try:
            out = torch._scaled_mm(xq, wq[0].t(), xs, ws[0], bias=bias, out_dtype=bf,
                                   use_fast_accum=label != "fp8").float()  # fmt: skip
            row[f"us_{label}"] = graphed_us(fn, n=copies, replays=10)
            row[f"err_{label}"] = float((out - ref).abs().max() / ref.abs().max())
        except Exception as exc:  # noqa: BLE001 - an unsupported path is reported, not fatal
            row[f"us_{label}"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,256,128")
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-3b")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    res = {"device": torch.cuda.get_device_name(), "rows": {}, "note": __doc__.split("\n\n")[1]}
    for shape in a.shapes.split(","):
        for name, n, k, has_bias in SHAPES[shape]:
            copies = 1 if name == "head" else LAYERS  # one LM head a step
            g = torch.Generator(device=dev).manual_seed(0)
            w = [torch.randn(n, k, device=dev, dtype=bf, generator=g) * k**-0.5 for _ in range(copies)]
            bias = torch.randn(n, device=dev, dtype=bf, generator=g) * 0.1 if has_bias else None
            wq, ws = [], []
            for m in w:
                s = m.abs().amax(1).float().clamp(min=1e-12) / FP8_MAX  # [N] a scale per output channel
                wq.append((m.float() / s[:, None]).to(FP8))
                ws.append(s[None, :])  # [1, N]
            for rows in (int(r) for r in a.rows.split(",")):
                x = torch.randn(rows, k, device=dev, dtype=bf, generator=g)
                row = {"shape": shape, "gemm": name, "rows": rows, "n": n, "k": k} | time_gemm(
                    x, w, wq, ws, bias
                )
                row["tflops_bf16"] = 2 * rows * n * k / row["us_bf16"] / 1e6
                if isinstance(row.get("us_fp8_fast"), float):
                    row["speedup_fast"] = row["us_bf16"] / row["us_fp8_fast"]
                res["rows"].setdefault(shape, []).append(row)
                print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()}),
                      flush=True)  # fmt: skip
            del w, wq, ws
    for shape, rows in res["rows"].items():  # a decode step's GEMMs: 24 layers' worth plus one LM head
        for r in sorted({row["rows"] for row in rows}):
            part = [row for row in rows if row["rows"] == r]
            tot = {}
            for key in ("us_bf16", "us_fp8_fast", "us_fp8_fast_quant"):
                if all(isinstance(row.get(key), float) for row in part):
                    tot[key] = sum(row[key] * (1 if row["gemm"] == "head" else LAYERS) for row in part)
            res.setdefault("step_totals_us", {})[f"{shape} rows {r}"] = tot
            print(shape, r, {k2: round(v, 1) for k2, v in tot.items()}, flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
