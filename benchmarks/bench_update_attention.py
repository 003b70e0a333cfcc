"""The update's attention on one micro-batch's packed row (issue 16): the path the trainer runs
(``models.packed_attention.segment_params_attention``: shared-prompt keys gathered per response, a varlen
flash-attention kernel with its own GQA, autograd's index_add back into the prompt's one copy), in
milliseconds for the forward and for forward + backward (CUDA events, after warm-up) and the TFLOP/s that
makes of the attention's causal FLOPs (4 x head dim x heads per (query, key) pair the mask allows, 2.5x that
for the backward); its largest difference from the float32 per-segment reference in output and gradients on
a small row; and the flash-attention implementations this torch registers
(``torch.nn.attention.list_flash_attention_impls``, where it exists). The kernel is the one the trainer picks
(``packed_attention.varlen_kernel``: FlashAttention-4 where ``flash-attn-4`` imports); with FA4 in use the
row is also timed without it (``without_fa4``: aten's flash attention, FA2's kernels).

Session 28 also timed FlexAttention over the same rows (a block-sparse mask of the row's segments, each
response reading its prompt's keys in place, GQA in the kernel): 2x slower on an H100 (its code and this
script's flex variant are in commit 0edbd5b; results in ``results/2026-12-06-session28``).

Rows: ``fixed`` (8 groups of 8 responses of 512 tokens after a 256-token prompt: the 0.5B fixed step's
micro-batch, 34,816 tokens) and ``spread`` (responses drawn by ``spread_lengths`` to fill the same budget).

Run: ``python benchmarks/bench_update_attention.py --out $OUT/update_attention.json`` (CUDA; ``--shape 3b``
for Qwen2.5-3B's heads on the same rows: the 3B update's own micro-batches are smaller).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _timing import timed_us  # benchmarks/, the script's folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spread_lengths import spread_lengths  # noqa: E402

from megatron_rl.models import packed_attention as pa  # noqa: E402
from megatron_rl.rollout.shared_prompts import shared_layout  # noqa: E402

HEADS = {"0.5b": (14, 2, 64), "3b": (16, 2, 128)}  # query heads, KV heads, head dim


def packed_row(groups: int, n: int, prompt: int, responses: list[int]):
    """The shared-prompt layout of ``groups`` prompts of ``prompt`` tokens with ``n`` responses each of the
    given lengths (prompts differ between groups, so each is its own copy)."""
    b = groups * n
    t = prompt + max(responses)
    ids = torch.zeros(b, t, dtype=torch.long)
    for row in range(b):
        ids[row, :prompt] = 1 + row // n  # one distinct prompt a group
        ids[row, prompt : prompt + responses[row]] = 7
    p_lens = torch.full((b,), prompt)
    r_lens = torch.tensor(responses)
    score = torch.zeros(b, max(responses), dtype=torch.long)
    return shared_layout(ids, p_lens, r_lens, score)


def pairs(p: pa.SegmentSeqParams) -> int:
    """(query, key) pairs the causal, end-aligned mask allows."""
    lq = (p.segments_q[1:] - p.segments_q[:-1]).long()
    lk = (p.segments_k[1:] - p.segments_k[:-1]).long()
    return int((lq * (lk - lq) + lq * (lq + 1) // 2).sum())


def run_varlen(q, k, v, p, scale: float, reps: int) -> dict:
    def fn():
        return pa.segment_params_attention(q, k, v, p, scale, None)

    g = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        torch.autograd.grad(fn(), (q, k, v), g)  # no accumulation into .grad: as the trainer's layers

    out = {"fwd_ms": timed_us(fwd, reps, warmup=3) / 1e3}
    out["fwd_bwd_ms"] = timed_us(fwd_bwd, reps, warmup=3) / 1e3
    return out


def accuracy(device, dtype, heads: int, groups: int, dim: int) -> float:
    """Largest relative difference of output and q/k/v gradients from the float32 per-segment loop, on a
    small shared row (2 groups of 3 responses of 5-40 tokens after 24-token prompts) at the shape's heads."""
    torch.manual_seed(0)
    layout = packed_row(2, 3, 24, [5, 40, 17, 33, 9, 26])
    p = layout.seq_params()
    s = layout.input_ids.shape[1]
    base = [torch.randn(s, x, dim, device=device) for x in (heads, groups, groups)]

    def grads(at, loop):
        q, k, v = (x.to(at).requires_grad_() for x in base)
        if loop:
            o = pa.segment_attention(q, k, v, p.segments_q, dim**-0.5, kv_index=p.kv_index, cu_k=p.segments_k)
        else:
            o = pa.shared_attention(q, k, v, p.segments_q, p.kv_index, p.segments_k, p.max_q, p.max_k, dim**-0.5,
                                    None, varlen=True)  # fmt: skip
        return [o, *torch.autograd.grad(o.float().square().sum(), (q, k, v))]

    p.segments_q, p.segments_k, p.kv_index = (x.to(device) for x in (p.segments_q, p.segments_k, p.kv_index))
    ref = grads(torch.float32, True)
    got = grads(dtype, False)
    return max(float((a.detach().float() - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(HEADS), default="0.5b")
    ap.add_argument("--rows", default="fixed,spread")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, g, d = HEADS[args.shape]
    result = {"shape": args.shape, "heads": [h, g, d], "device": torch.cuda.get_device_name(), "rows": {}}
    impls = getattr(torch.nn.attention, "list_flash_attention_impls", None)
    result["flash_attention_impls"] = impls() if impls is not None else "no list_flash_attention_impls"
    cur = torch.device("cuda", torch.cuda.current_device())
    # the kernel the trainer runs here first; with FlashAttention-4 in use, also the kernel it would run without
    variants = (
        {"varlen": pa.FA4, "without_fa4": False}
        if pa.varlen_kernel(cur) == "flash-attn-4"
        else {"varlen": pa.FA4}
    )
    result["accuracy_vs_fp32_loop"], result["kernel"] = {}, {}
    for name, fa4 in variants.items():
        pa.FA4 = fa4
        try:
            result["accuracy_vs_fp32_loop"][name] = accuracy(dev, dtype, h, g, d)
        except Exception as exc:  # noqa: BLE001 - recorded; the timing below says whether it runs at all
            result["accuracy_vs_fp32_loop"][name] = f"{type(exc).__name__}: {exc}"[:300]
    for row in args.rows.split(","):
        if row == "fixed":
            responses = [512] * 64
        else:  # spread responses up to the fixed row's 34,816 tokens, the last group completed past it
            lengths = spread_lengths(512, 512, seed=1)
            responses, used = [], 0
            while len(responses) % 8 or used + 256 // 8 + lengths[len(responses)] <= 34816:
                used += 256 // 8 + lengths[len(responses)]
                responses.append(lengths[len(responses)])
        layout = packed_row(len(responses) // 8, 8, 256, responses)
        p = layout.seq_params()
        p.segments_q, p.segments_k, p.kv_index = (x.to(dev) for x in (p.segments_q, p.segments_k, p.kv_index))
        s = layout.input_ids.shape[1]
        q, k, v = (torch.randn(s, x, d, device=dev, dtype=dtype, requires_grad=True) for x in (h, g, g))
        flop = 4 * d * h * pairs(p)
        entry = {"tokens": s, "responses": len(responses), "attention_gflop_fwd": flop / 1e9}
        for name, fa4 in variants.items():
            pa.FA4 = fa4
            try:
                r = run_varlen(q, k, v, p, d**-0.5, args.reps)
                r["fwd_tflops"] = flop / r["fwd_ms"] / 1e9
                r["fwd_bwd_tflops"] = 3.5 * flop / r["fwd_bwd_ms"] / 1e9
                entry[name] = r
            except Exception as exc:  # noqa: BLE001
                entry[name] = f"{type(exc).__name__}: {exc}"[:500]
        result["rows"][row] = entry
        print(row, json.dumps(entry), flush=True)
    for name, fa4 in variants.items():  # after the runs: each kernel's trials (device, head layout) are done
        pa.FA4 = fa4
        result["kernel"][name] = pa.varlen_kernel(cur, (dtype, h, g, d))
    pa.FA4 = variants["varlen"]
    result["varlen_status"], result["varlen_notes"] = pa.varlen_status(), pa.varlen_notes()  # which path ran
    result["gqa_direct"] = pa.GQA_DIRECT
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
