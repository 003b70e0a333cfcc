"""The update's log-prob and RMSNorm kernels at the GRPO step's shapes (issue 16): milliseconds per call
and the HBM bytes per second they reach, new against what they replace, in one process.

- log-probs + entropy (``algos.vocab_parallel_log_probs_and_entropy``), forward and forward + backward:
  ``kernels.logprob``'s Triton passes against the compiled passes (``MEGATRON_RL_TRITON_LOGPROB`` off),
  bf16 logits of R response rows x 151,936 ids; the largest gap between the two in log-prob, entropy and
  gradient.
- RMSNorm forward + backward against torch's ``F.rms_norm``, bf16 [N, H]: compiled (``compile_rows_dynamic``
  of the fp32 formula; tried in session 18 for the trainer's norm, measured 3.3x slower, not landed) and
  ``kernels.rmsnorm``'s Triton backward (torch's forward; off by default until measured here).

Run: ``python benchmarks/bench_update_kernels.py --out $OUT/update_kernels.json`` (CUDA).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _timing import timed_us  # benchmarks/, the script's folder

from megatron_rl.algos import vocab_parallel as vp
from megatron_rl.kernels import logprob as logprob_kernel
from megatron_rl.kernels import rmsnorm as rmsnorm_kernel
from megatron_rl.kernels.compile import compile_rows_dynamic

HBM = 4.8e12


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


_RMS_COMPILED = compile_rows_dynamic(_rms_norm)


def _logprob_variant(logits: torch.Tensor, target: torch.Tensor, g_lp: torch.Tensor, on: bool) -> tuple:
    """(lp, ent, grad) and the forward / forward + backward milliseconds with the Triton kernels on or off."""
    logprob_kernel.ON_CUDA = on
    x = logits.clone().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return vp.vocab_parallel_log_probs_and_entropy(x[None], target[None])

    def fwd_bwd():
        x.grad = None
        lp, ent = vp.vocab_parallel_log_probs_and_entropy(x[None], target[None])
        (lp[0] * g_lp).sum().backward()
        return lp.detach(), ent.detach()

    lp, ent = fwd_bwd()
    got = (lp, ent, x.grad.detach().clone())
    f_ms, fb_ms = timed_us(fwd, n=5, warmup=2) / 1e3, timed_us(fwd_bwd, n=5, warmup=2) / 1e3
    logprob_kernel.ON_CUDA = True
    return got, f_ms, fb_ms


def logprob_case(rows: int, vocab: int = 151936) -> dict:
    torch.manual_seed(0)
    logits = (2 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    g_lp = torch.randn(rows, device="cuda")
    out, res, nbytes = {}, {"rows": rows, "vocab": vocab}, rows * vocab * 2
    for name, on in (("triton", True), ("compiled", False)):
        out[name], f_ms, fb_ms = _logprob_variant(logits, target, g_lp, on)
        res[name] = {"fwd_ms": round(f_ms, 3), "fwd_bwd_ms": round(fb_ms, 3), "bwd_ms": round(fb_ms - f_ms, 3),
                     "fwd_fraction_of_hbm": round(nbytes / (f_ms / 1e3) / HBM, 3),
                     "bwd_fraction_of_hbm": round(2 * nbytes / ((fb_ms - f_ms) / 1e3) / HBM, 3)}  # fmt: skip
    (a_lp, a_ent, a_g), (b_lp, b_ent, b_g) = out["triton"], out["compiled"]
    res["max_abs_diff"] = {"logprob": float((a_lp - b_lp).abs().max()), "entropy": float((a_ent - b_ent).abs().max()),
                           "grad": float((a_g.float() - b_g.float()).abs().max())}  # fmt: skip
    res["speedup_fwd_bwd"] = round(res["compiled"]["fwd_bwd_ms"] / res["triton"]["fwd_bwd_ms"], 3)
    return res


def _rmsnorm_variant(fn, x0: torch.Tensor, g: torch.Tensor) -> tuple:
    x = x0.clone().requires_grad_(True)
    w = torch.ones(x0.shape[-1], device=x0.device, dtype=x0.dtype).requires_grad_(True)

    def run():
        x.grad, w.grad = None, None
        fn(x, w).backward(g)

    run()
    return (fn(x, w).detach(), x.grad.clone(), w.grad.clone()), timed_us(run, n=20, warmup=3)


def rmsnorm_case(rows: int, hidden: int) -> dict:
    torch.manual_seed(0)
    x0 = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    res, outs = {"rows": rows, "hidden": hidden}, {}
    fns = {"compiled": lambda x, w: _RMS_COMPILED(x, w, 1e-6),
           "triton_backward": lambda x, w: rmsnorm_kernel._RMSNorm.apply(x, w, 1e-6),
           "torch": lambda x, w: torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6)}  # fmt: skip
    for name, fn in fns.items():
        outs[name], us = _rmsnorm_variant(fn, x0, g)
        res[name] = {"fwd_bwd_us": round(us, 1),
                     "fraction_of_hbm": round(5 * rows * hidden * 2 / (us / 1e6) / HBM, 3)}  # fmt: skip
    b, bx, bw = outs["torch"]
    for name in ("compiled", "triton_backward"):
        a, ax, aw = outs[name]
        res[name]["max_abs_diff"] = {"out": float((a.float() - b.float()).abs().max()),
                                     "dx": float((ax.float() - bx.float()).abs().max()),
                                     "dw_rel": float((aw.float() - bw.float()).abs().max() / bw.float().abs().max())}  # fmt: skip
        res[name]["speedup"] = round(res["torch"]["fwd_bwd_us"] / res[name]["fwd_bwd_us"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "update_kernels.json"))
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "logprob": [], "rmsnorm": []}
    for rows in (32768, 8192):  # the 0.5B update's 64 sequences x 512 responses; a smaller micro-batch
        res["logprob"].append(logprob_case(rows))
        print(json.dumps(res["logprob"][-1]), flush=True)
    for rows, hidden in ((34816, 896), (34816, 2048)):  # 0.5B and 3B hidden sizes
        res["rmsnorm"].append(rmsnorm_case(rows, hidden))
        print(json.dumps(res["rmsnorm"][-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
