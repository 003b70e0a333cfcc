"""The update's log-prob and RMSNorm kernels at the GRPO step's shapes (issue 16): milliseconds per call
and the HBM bytes per second they reach, new against what they replace, in one process.

- log-probs + entropy (``algos.vocab_parallel_log_probs_and_entropy``), forward and forward + backward:
  ``kernels.logprob``'s Triton passes against the compiled passes (``MEGATRON_RL_TRITON_LOGPROB`` off),
  bf16 logits of R response rows x 151,936 ids; the largest gap between the two in log-prob, entropy and
  gradient.
- RMSNorm forward + backward against torch's ``F.rms_norm``, bf16 [N, H]: compiled (``compile_rows_dynamic``
  of the fp32 formula; tried in session 18 for the trainer's norm, measured 3.3x slower, not landed) and
  ``kernels.rmsnorm``'s Triton backward (torch's forward; off by default until measured here).
- SwiGLU forward + backward: the compiled backward against ``kernels.swiglu``'s Triton one.
- A residual add and the RMSNorm after it, forward and forward + backward: torch's add and the trainer's
  norm apart against ``kernels.rmsnorm.add_rms_norm`` (one kernel each way).
- The shared-prompt K/V gather (``actor.share_prompts``) forward + backward: autograd's ``index_select``
  (its backward bf16 ``index_add_`` atomics) against ``kernels.gather_rows`` (a deterministic fp32 sum of
  each row's copies), at a micro-batch of GRPO groups; each one's largest gap to a float64 sum.

Run: ``python benchmarks/bench_update_kernels.py --out $OUT/update_kernels.json`` (CUDA).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _timing import timed_us  # benchmarks/, the script's folder

from megatron_rl.algos import vocab_parallel as vp
from megatron_rl.kernels import gather_rows
from megatron_rl.kernels import logprob as logprob_kernel
from megatron_rl.kernels import rmsnorm as rmsnorm_kernel
from megatron_rl.kernels import swiglu as swiglu_kernel
from megatron_rl.kernels.compile import compile_rows_dynamic
from megatron_rl.models.facts import hbm_bytes_per_s

HBM = hbm_bytes_per_s(torch.cuda.get_device_name()) if torch.cuda.is_available() else 4.8e12


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


_RMS_COMPILED = compile_rows_dynamic(_rms_norm)


def _logprob_variant(
    logits: torch.Tensor, target: torch.Tensor, g_lp: torch.Tensor, on: bool, one_exp: bool = True,
    temperature: float = 1.0,
) -> tuple:  # fmt: skip
    """(lp, ent, grad) and the forward / forward + backward milliseconds with the Triton kernels on or off,
    the statistics' one-exp or two-exp pass (``kernels.logprob.ONE_EXP``) and a temperature (1: no division)."""
    before = logprob_kernel.ON_CUDA, logprob_kernel.ONE_EXP
    logprob_kernel.ON_CUDA, logprob_kernel.ONE_EXP = on, one_exp
    x = logits.clone().requires_grad_(True)
    kw = {"temperature": temperature}

    def fwd():
        with torch.no_grad():
            return vp.vocab_parallel_log_probs_and_entropy(x[None], target[None], **kw)

    def fwd_bwd():
        x.grad = None
        lp, ent = vp.vocab_parallel_log_probs_and_entropy(x[None], target[None], **kw)
        (lp[0] * g_lp).sum().backward()
        return lp.detach(), ent.detach()

    f_ms, fb_ms = timed_us(fwd, n=5, warmup=2) / 1e3, timed_us(fwd_bwd, n=5, warmup=2) / 1e3
    lp, ent = fwd_bwd()
    got = (lp, ent, x.grad.detach())  # the last call's gradient (no copy: memory for 80 GB cards)
    logprob_kernel.ON_CUDA, logprob_kernel.ONE_EXP = before
    return got, f_ms, fb_ms


def logprob_case(rows: int, vocab: int = 151936) -> dict:
    torch.manual_seed(0)
    logits = (2 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    g_lp = torch.randn(rows, device="cuda")
    out, res, nbytes = {}, {"rows": rows, "vocab": vocab}, rows * vocab * 2
    # "triton_session29": the kernels as they were before session 30 (two exps an element in the statistics,
    # a division by the temperature in both passes: a temperature a hair above 1 keeps the division)
    variants = (("triton", True, True, 1.0), ("triton_two_exp", True, False, 1.0),
                ("triton_session29", True, False, 1.0 + 2**-20), ("compiled", False, True, 1.0))  # fmt: skip
    for name, on, one_exp, temperature in variants:
        out[name], f_ms, fb_ms = _logprob_variant(logits, target, g_lp, on, one_exp, temperature)
        if name.startswith("triton_"):  # gradients kept for the triton / compiled gap only (80 GB cards)
            out[name] = (*out[name][:2], None)
        res[name] = {"fwd_ms": round(f_ms, 3), "fwd_bwd_ms": round(fb_ms, 3), "bwd_ms": round(fb_ms - f_ms, 3),
                     "fwd_fraction_of_hbm": round(nbytes / (f_ms / 1e3) / HBM, 3),
                     "bwd_fraction_of_hbm": round(2 * nbytes / ((fb_ms - f_ms) / 1e3) / HBM, 3)}  # fmt: skip
    (a_lp, a_ent, a_g), (b_lp, b_ent, b_g) = out["triton"], out["compiled"]
    # the gradient gap a block of rows at a time: two fp32 copies of 32768 x 151936 do not fit an 80 GB card
    grad_gap = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(a_g.split(2048), b_g.split(2048))
    )
    res["max_abs_diff"] = {"logprob": float((a_lp - b_lp).abs().max()), "entropy": float((a_ent - b_ent).abs().max()),
                           "grad": grad_gap}  # fmt: skip
    res["speedup_fwd_bwd"] = round(res["compiled"]["fwd_bwd_ms"] / res["triton"]["fwd_bwd_ms"], 3)
    res["speedup_fwd_bwd_vs_session29"] = round(
        res["triton_session29"]["fwd_bwd_ms"] / res["triton"]["fwd_bwd_ms"], 3
    )
    res["max_abs_diff_one_vs_two_exp"] = {
        "logprob": float((out["triton"][0] - out["triton_two_exp"][0]).abs().max()),
        "entropy": float((out["triton"][1] - out["triton_two_exp"][1]).abs().max()),
    }
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
    # the Triton backward alone over tiles / warps / programs (the first is the default) against torch's
    # backward alone (autograd.grad of a kept forward); bytes: x, dy read and dx written
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xt = x0.clone().requires_grad_(True)
    out = torch.nn.functional.rms_norm(xt, (hidden,), w, 1e-6)
    res["torch_bwd_us"] = round(timed_us(lambda: torch.autograd.grad(out, (xt, w), g, retain_graph=True)), 1)
    _, tile0, warps0, programs0 = rmsnorm_kernel.blocks_for(hidden)
    res["triton_bwd"] = []
    for tile, warps, programs in ((tile0, warps0, programs0), (4, 8, 1024), (4, 4, 1024), (8, 8, 528), (16, 8, 1024),
                                  (2, 2, 2048), (1, 4, 4096), (8, 8, 264)):  # fmt: skip
        us = timed_us(lambda t=tile, nw=warps, p=programs: rmsnorm_kernel.backward(x0, w, g, 1e-6, p, t, nw))
        res["triton_bwd"].append({"tile": tile, "num_warps": warps, "programs": programs, "bwd_us": round(us, 1),
                                  "fraction_of_hbm": round(3 * rows * hidden * 2 / (us / 1e6) / HBM, 3)})  # fmt: skip
    return res


def _swiglu_variant(y0: torch.Tensor, g: torch.Tensor, on: bool) -> tuple:
    """(dy, forward + backward microseconds, whether the Triton backward served) of ``kernels.swiglu``'s
    autograd function with ``MEGATRON_RL_TRITON_SWIGLU`` on or off (the forward is compiled either way)."""
    before, swiglu_kernel.ON_CUDA = swiglu_kernel.ON_CUDA, on
    x = y0.clone().requires_grad_(True)

    def run():
        x.grad = None
        swiglu_kernel.swiglu(x).backward(g)

    run()
    used = on and swiglu_kernel.usable(y0)  # a failed trial falls back quietly but for its warning: say so
    us = timed_us(run, n=20, warmup=3)
    swiglu_kernel.ON_CUDA = before
    return x.grad, us, used


def swiglu_case(rows: int, ffn: int) -> dict:
    """The MLP's SwiGLU on a bf16 fc1 output y [rows, 2 ffn]: forward + backward through the autograd function
    with the compiled backward and with the Triton one, each backward alone, the Triton backward's block
    shapes, and the largest gap between the two dy. HBM bytes: backward reads y and the gradient and writes
    dy (5 rows ffn x 2), forward reads y and writes the output (3 rows ffn x 2)."""
    torch.manual_seed(0)
    y0 = (3 * torch.randn(rows, 2 * ffn, device="cuda")).to(torch.bfloat16)
    g = torch.randn(rows, ffn, device="cuda").to(torch.bfloat16)
    bwd_bytes, fwd_bytes = 5 * rows * ffn * 2, 3 * rows * ffn * 2
    res, dys = {"rows": rows, "ffn": ffn}, {}
    bwd = {"compiled": lambda: swiglu_kernel._COMPILED[1](g, y0),
           "triton": lambda: swiglu_kernel.triton_backward(g, y0)}  # fmt: skip
    for name, on in (("compiled", False), ("triton", True)):
        dys[name], fb_us, used = _swiglu_variant(y0, g, on)
        b_us = timed_us(bwd[name], n=20, warmup=3)
        res[name] = {"fwd_bwd_us": round(fb_us, 1), "bwd_us": round(b_us, 1),
                     "fwd_bwd_fraction_of_hbm": round((fwd_bytes + bwd_bytes) / (fb_us / 1e6) / HBM, 3),
                     "bwd_fraction_of_hbm": round(bwd_bytes / (b_us / 1e6) / HBM, 3)}  # fmt: skip
    res["triton"]["used_in_fwd_bwd"] = used
    res["triton_blocks"] = []  # (block_rows, block_cols, num_warps): the default is the first
    for br, bc, warps in ((8, 256, 4), (4, 256, 4), (16, 256, 8), (32, 128, 8), (2, 1024, 4)):
        us = timed_us(
            lambda blocks=(br, bc, warps): swiglu_kernel.triton_backward(g, y0, *blocks), n=20, warmup=3
        )
        res["triton_blocks"].append({"block_rows": br, "block_cols": bc, "num_warps": warps, "bwd_us": round(us, 1),
                                     "bwd_fraction_of_hbm": round(bwd_bytes / (us / 1e6) / HBM, 3)})  # fmt: skip
    a, b = dys["compiled"], dys["triton"]
    # a block of rows at a time: fp32 copies of the whole dy would double the case's memory
    res["max_abs_diff_dy"] = max(
        float((p.float() - q.float()).abs().max()) for p, q in zip(a.split(4096), b.split(4096))
    )
    res["dy_elements_differing"] = int((a != b).sum())
    res["speedup_fwd_bwd"] = round(res["compiled"]["fwd_bwd_us"] / res["triton"]["fwd_bwd_us"], 3)
    res["speedup_bwd"] = round(res["compiled"]["bwd_us"] / res["triton"]["bwd_us"], 3)
    return res


def gather_case(groups: int, n: int, prompt: int, response: int, kv_heads: int, dim: int) -> dict:
    """The shared-prompt K/V gather of one micro-batch of ``groups`` GRPO groups of ``n`` (a prompt's rows
    gathered once for its own segment and once per response, a response's once), bf16 K and V [S, G, D] as
    strided views of one buffer (megatron-core's split): forward + backward and the backward alone through
    autograd's index_select and through ``gather_rows.gather_kv``, each gradient's largest gap to a float64
    sum relative to the copies' absolute sum. HBM bytes of a backward: read the gathered gradients, write
    the rows'."""
    from megatron_rl.rollout.packing import ranges

    kv_s, kv_n, rows = [], [], 0
    for _ in range(groups):
        start_p = rows
        kv_s.append(start_p), kv_n.append(prompt)
        rows += prompt
        for _ in range(n):
            kv_s += [start_p, rows]
            kv_n += [prompt, response]
            rows += response
    index = ranges(kv_s, kv_n).cuda()
    torch.manual_seed(0)
    both = torch.randn(rows, kv_heads, 2, dim, device="cuda").to(torch.bfloat16).requires_grad_(True)
    k, v = both[:, :, 0], both[:, :, 1]
    gk, gv = (torch.randn(index.numel(), kv_heads, dim, device="cuda").to(torch.bfloat16) for _ in range(2))
    order, ptr = gather_rows.inverse(index, rows)
    bwd_bytes = 2 * (index.numel() + rows) * kv_heads * dim * 2
    res = {"rows": rows, "gathered": index.numel(), "kv_heads": kv_heads, "dim": dim}
    want = torch.zeros(rows, kv_heads, dim, dtype=torch.float64, device="cuda")
    scale = want.index_add(0, index, gk.double().abs()) + 1e-30
    want = want.index_add(0, index, gk.double())
    for name, lists in (("index_select", (None, None)), ("gather_rows", (order, ptr))):

        def run(lists=lists):
            both.grad = None
            ks, vs = gather_rows.gather_kv(k, v, index, *lists)
            torch.autograd.backward((ks, vs), (gk, gv))

        run()
        got = both.grad[:, :, 0]
        fb_us = timed_us(run, n=50, warmup=5)
        bwd = (
            (lambda: gather_rows.segment_sum(gk, gv, order, ptr))
            if lists[0] is not None
            else (
                lambda: (
                    torch.zeros_like(k).index_add_(0, index, gk),
                    torch.zeros_like(v).index_add_(0, index, gv),
                )
            )
        )
        b_us = timed_us(bwd, n=50, warmup=5)
        res[name] = {"fwd_bwd_us": round(fb_us, 1), "bwd_us": round(b_us, 1),
                     "bwd_fraction_of_hbm": round(bwd_bytes / (b_us / 1e6) / HBM, 3),
                     "max_gap_to_float64": float(((got.double() - want).abs() / scale).max())}  # fmt: skip
    res["gather_rows"]["used"] = gather_rows.usable(k, v)
    res["speedup_fwd_bwd"] = round(res["index_select"]["fwd_bwd_us"] / res["gather_rows"]["fwd_bwd_us"], 3)
    res["speedup_bwd"] = round(res["index_select"]["bwd_us"] / res["gather_rows"]["bwd_us"], 3)
    return res


def addnorm_case(rows: int, hidden: int) -> dict:
    """A residual add and the RMSNorm after it, forward and forward + backward, as a layer's site runs them
    (the sum goes on as the next residual and into the norm; both get a gradient): the trainer's path before
    (torch's add, ``kernels.rmsnorm._RMSNorm``, autograd adding the sum's two gradients) against
    ``kernels.rmsnorm.add_rms_norm``; each one's largest gap to a float64 reference."""
    torch.manual_seed(0)
    a0, r0, gs, gn = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    w = (0.5 + torch.rand(hidden, device="cuda")).to(torch.bfloat16).requires_grad_(True)
    a, r = a0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
    fns = {"apart": lambda: ((s := a + r), rmsnorm_kernel._RMSNorm.apply(s, w, 1e-6)),
           "fused": lambda: rmsnorm_kernel.add_rms_norm(a, r, w, 1e-6)}  # fmt: skip
    ref = [t.detach().double().requires_grad_(True) for t in (a0, r0, w)]
    s_ref = ref[0] + ref[1]
    n_ref = torch.nn.functional.rms_norm(s_ref, (hidden,), ref[2], 1e-6)
    torch.autograd.backward((s_ref, n_ref), (gs.double(), gn.double()))
    res = {"rows": rows, "hidden": hidden}
    for name, fn in fns.items():

        def run(fn=fn):
            a.grad = r.grad = w.grad = None
            torch.autograd.backward(fn(), (gs, gn))

        def fwd(fn=fn):
            with torch.no_grad():
                return fn()

        run()
        s, n = fwd()
        gaps = {"n": float((n.double() - n_ref.detach()).abs().max()), "da": float((a.grad.double() - ref[0].grad).abs().max()),
                "dw_rel": float((w.grad.double() - ref[2].grad).abs().max() / ref[2].grad.abs().max())}  # fmt: skip
        res[name] = {"fwd_us": round(timed_us(fwd, n=20, warmup=3), 1),
                     "fwd_bwd_us": round(timed_us(run, n=20, warmup=3), 1), "gap_to_float64": gaps}  # fmt: skip
    # the backward alone (one call of ``rmsnorm_kernel.backward`` with the residual gradient) over tiles / warps /
    # programs, the first ``blocks_for``'s default, against it without the residual gradient; bytes: the sum,
    # the norm's gradient and the residual gradient read, dx written
    s, _, rstd = rmsnorm_kernel.add_forward(a0, r0, w.detach(), 1e-6)
    res["bwd_alone_us"] = round(timed_us(lambda: rmsnorm_kernel.backward(s, w, gn, 1e-6, rstd=rstd)), 1)
    _, tile0, warps0, programs0 = rmsnorm_kernel.blocks_for(hidden)
    res["bwd_with_residual"] = []
    for tile, warps, programs in ((tile0, warps0, programs0), (2, 4, 2048), (4, 4, 1024), (4, 8, 1024), (1, 4, 4096),
                                  (1, 2, 4096), (2, 2, 4096), (8, 8, 528)):  # fmt: skip
        us = timed_us(lambda t=tile, nw=warps, p=programs: rmsnorm_kernel.backward(
            s, w, gn, 1e-6, p, t, nw, rstd=rstd, residual_grad=gs))  # fmt: skip
        res["bwd_with_residual"].append({"tile": tile, "num_warps": warps, "programs": programs, "bwd_us": round(us, 1),
                                         "fraction_of_hbm": round(4 * rows * hidden * 2 / (us / 1e6) / HBM, 3)})  # fmt: skip
    res["speedup_fwd"] = round(res["apart"]["fwd_us"] / res["fused"]["fwd_us"], 3)
    res["speedup_fwd_bwd"] = round(res["apart"]["fwd_bwd_us"] / res["fused"]["fwd_bwd_us"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "update_kernels.json"))
    ap.add_argument(
        "--cases",
        default="logprob,rmsnorm,swiglu,gather,addnorm",
        help="comma-separated: logprob, rmsnorm, swiglu, gather, addnorm",
    )
    a = ap.parse_args()
    cases = set(a.cases.split(","))
    res = {
        "device": torch.cuda.get_device_name(),
        "hbm_bytes_per_s": HBM,
        "torch": torch.__version__,
        "logprob": [],
        "rmsnorm": [],
    }
    for rows in (32768, 8192) if "logprob" in cases else ():  # 0.5B: 64 sequences x 512 responses; fewer
        res["logprob"].append(logprob_case(rows))
        print(json.dumps(res["logprob"][-1]), flush=True)
    for rows, hidden in ((34816, 896), (34816, 2048)) if "rmsnorm" in cases else ():  # 0.5B and 3B hidden
        res["rmsnorm"].append(rmsnorm_case(rows, hidden))
        print(json.dumps(res["rmsnorm"][-1]), flush=True)
    res["swiglu"] = []
    for rows, ffn in ((34816, 4864), (34816, 11008)) if "swiglu" in cases else ():  # 0.5B, 3B: y 0.7, 1.5 GB
        res["swiglu"].append(swiglu_case(rows, ffn))
        print(json.dumps(res["swiglu"][-1]), flush=True)
    res["gather"] = []
    for kv_heads, dim in ((2, 64), (2, 128)) if "gather" in cases else ():  # 0.5B and 3B KV heads
        res["gather"].append(
            gather_case(8, 8, 256, 512, kv_heads, dim)
        )  # a fixed-step micro-batch: 34,816 rows
        print(json.dumps(res["gather"][-1]), flush=True)
    res["addnorm"] = []
    for hidden in (896, 2048) if "addnorm" in cases else ():  # 0.5B and 3B hidden, a fixed-step micro-batch
        res["addnorm"].append(addnorm_case(34816, hidden))
        print(json.dumps(res["addnorm"][-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
