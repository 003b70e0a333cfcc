"""Does one strided-batched cuBLAS call give the bits of the separate 512-row calls, on every input?

``batch_invariant.fixed_rows_matmul`` runs many whole 512-row calls as one batched call once trials on
the first inputs agreed (``_batched_trial``). Session 13's GPU run had the exact mode's log-probs equal at
step 0 and ~all different afterwards, with every trial agreeing. This checks, at the Qwen2.5-0.5B layer
shapes, whether agreement on one input carries over to others, whether repeated batched calls are
deterministic, and which kernels the two paths launch. Session 14 found the weight with a bias (qkv:
``baddbmm`` against ``addmm``) differing on most inputs; session 15 found an fp32-result ``bmm`` plus the bias
in fp32 equal to the ``addmm`` calls on every input, which ``fixed_rows_matmul`` now batches on CUDA; this
still times the ``baddbmm`` it no longer uses, to show why.

    python benchmarks/diag_batched_gemm.py --out diag.json
"""

from __future__ import annotations

import argparse
import json

import torch

from megatron_rl.kernels import batch_invariant as bi

SHAPES = {  # name: (N, K, bias)
    "qkv": (1152, 896, True),
    "proj": (896, 896, False),
    "fc1": (9728, 896, False),
    "fc2": (896, 4864, False),
    "head": (151936, 896, False),
}


def separate(x, w, bias, rows):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for i in range(0, len(x), rows):
        if bias is None:
            torch.mm(x[i : i + rows], w.t(), out=out[i : i + rows])
        else:
            torch.addmm(bias, x[i : i + rows], w.t(), out=out[i : i + rows])
    return out


def batched(x, w, bias, calls):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if bias is None:
        bi._batched_gemm(x, w.t(), out, None, calls)
    else:  # what fixed_rows_matmul did before session 14 (it now batches a bias through batched_fp32)
        o3 = out.view(calls, -1, out.shape[-1])
        torch.baddbmm(
            bias.expand_as(o3), x.view(calls, -1, x.shape[-1]), w.t().expand(calls, *w.t().shape), out=o3
        )
    return out


def separate_fp32(x, w, bias, rows):
    """512-row ``mm`` calls with an fp32 result, the bias added in fp32, rounded once to x's dtype."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for i in range(0, len(x), rows):
        out[i : i + rows] = torch.mm(x[i : i + rows], w.t(), out_dtype=torch.float32).add_(bias.float())
    return out


def batched_fp32(x, w, bias, calls):
    """One strided-batched ``bmm`` with an fp32 result, the bias added in fp32, rounded once."""
    acc = torch.bmm(
        x.view(calls, -1, x.shape[-1]), w.t().expand(calls, *w.t().shape), out_dtype=torch.float32
    )
    return acc.add_(bias.float()).view(x.shape[0], -1).to(x.dtype)


def fp32_variant(w, bias, rows, inputs) -> list[dict]:
    """The weight with a bias through fp32-result GEMMs: does the batched call equal the separate ones (on
    every input), does either equal ``addmm``, and what does each take (CUDA events, median of 5)."""
    recs = []
    for calls in (2, 8, 24, 32):
        xs = [torch.randn(calls * rows, w.shape[1], device="cuda").bfloat16() for _ in range(inputs)]
        rec = {"shape": "qkv_fp32_result", "calls": calls, "batched_eq_separate": [], "separate_eq_addmm": []}
        for x in xs:
            s = separate_fp32(x, w, bias, rows)
            rec["batched_eq_separate"].append(bool(torch.equal(s, batched_fp32(x, w, bias, calls))))
            rec["separate_eq_addmm"].append(bool(torch.equal(s, separate(x, w, bias, rows))))
        for name, fn, arg in (("addmm_separate", separate, rows), ("fp32_separate", separate_fp32, rows),
                              ("fp32_batched", batched_fp32, calls), ("baddbmm", batched, calls)):  # fmt: skip
            times = []
            for _ in range(6):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(xs[0], w, bias, arg)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            rec[f"ms_{name}"] = sorted(times[1:])[2]
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    return recs


def kernels(fn, *args) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--inputs", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows, results = bi.GEMM_ROWS, []
    for name, (n, k, has_bias) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        bias = (torch.randn(n, device="cuda") * 0.02).bfloat16() if has_bias else None
        for calls in (2, 8, 21, 31, 32) if name != "head" else (2, 8):
            xs = [torch.randn(calls * rows, k, device="cuda").bfloat16() for _ in range(args.inputs)]
            xs.append(xs[0].abs())  # all-positive rows (post-activation-like)
            rec = {"shape": name, "calls": calls, "equal_per_input": [], "differing_elems": [],
                   "batched_deterministic": None}  # fmt: skip
            for x in xs:
                s, b = separate(x, w, bias, rows), batched(x, w, bias, calls)
                rec["equal_per_input"].append(bool(torch.equal(s, b)))
                rec["differing_elems"].append(int((s != b).sum()))
            b1, b2 = batched(xs[0], w, bias, calls), batched(xs[0], w, bias, calls)
            rec["batched_deterministic"] = bool(torch.equal(b1, b2))
            if calls == 8:
                rec["kernels_separate"] = kernels(separate, xs[0], w, bias, rows)
                rec["kernels_batched"] = kernels(batched, xs[0], w, bias, calls)
            print(json.dumps({k: v for k, v in rec.items() if not k.startswith("kernels")}), flush=True)
            results.append(rec)
            del xs
        if has_bias:
            results += fp32_variant(w, bias, rows, args.inputs)
        torch.cuda.empty_cache()
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
            "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "rows": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
