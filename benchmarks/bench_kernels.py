"""Fused-kernel micro-benchmark (issue 8): each of our compiled kernels against the eager ops it replaces,
at the Qwen2.5-0.5B update's shapes (bf16, 16k-token micro-batches), with its compile mode:
``rows``: only dim 0 dynamic (what the code uses), ``all``: ``dynamic=True``.

Reports microseconds per call (forward + backward where there is one) and the effective bandwidth.
Run: ``python benchmarks/bench_kernels.py --out $OUT/bench_kernels.json`` (CUDA).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from _timing import timed_us  # benchmarks/, the script's folder
from megatron.core.models.common.embeddings import rope_utils

from megatron_rl.algos import vocab_parallel as vp
from megatron_rl.kernels.compile import compile_rows_dynamic
from megatron_rl.kernels.rope import compiled_rope, rope_reference
from megatron_rl.kernels.swiglu import swiglu, swiglu_backward, swiglu_forward


def fwd_bwd(fn, x, g):
    def run():
        x.grad = None
        fn(x).backward(g)

    return run


def decode_attention_case(t: int, d: int, bsz: int = 512, groups: int = 2, rep: int = 7) -> dict:
    """Decode attention at the GRPO rollout's shape, cache length t: the Triton kernel (block sizes and
    warps) against SDPA with the engine's additive mask: max error and microseconds per call."""
    from megatron_rl.kernels.decode_attention import decode_attention

    dev, bf, res = "cuda", torch.bfloat16, {}
    cache = torch.randn(2, bsz, groups, t, d, device=dev, dtype=bf)
    qd = torch.randn(bsz, groups, rep + 2, d, device=dev, dtype=bf)[:, :, :rep]
    pos = torch.randint(0, t, (bsz,), device=dev)
    pos[0] = t - 1
    mask = torch.zeros(bsz, 1, 1, t, device=dev, dtype=bf)
    mask.masked_fill_(~(torch.arange(t, device=dev)[None] <= pos[:, None])[:, None, None], float("-inf"))
    want = F.scaled_dot_product_attention(qd, cache[0], cache[1], attn_mask=mask)
    res[f"decode_attn_t{t}_sdpa_us"] = timed_us(lambda: F.scaled_dot_product_attention(qd, cache[0], cache[1], attn_mask=mask))  # fmt: skip
    res[f"decode_attn_t{t}_live_kv_gb"] = 2 * bsz * groups * d * 2 * (pos + 1).sum().item() / bsz / 1e9
    for blk, warps in ((32, 2), (64, 4), (64, 8), (128, 4), (128, 8)):
        got = decode_attention(qd, cache[0], cache[1], pos, block=blk, num_warps=warps)
        res[f"decode_attn_t{t}_triton_b{blk}_w{warps}_max_err"] = (
            (got.float() - want.float()).abs().max().item()
        )
        res[f"decode_attn_t{t}_triton_b{blk}_w{warps}_us"] = timed_us(
            lambda blk=blk, warps=warps: decode_attention(qd, cache[0], cache[1], pos, block=blk, num_warps=warps))  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"))
    a = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    n, ffn, heads, d, vocab = a.tokens, 4864, 14, 64, 151936
    res = {"tokens": n}

    # SwiGLU fwd+bwd on the fc1 output [n, 2F]
    y = torch.randn(n, 2 * ffn, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(n, ffn, device=dev, dtype=bf)

    def eager_glu(x):
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    class AllDyn(torch.autograd.Function):
        fwd, bwd = torch.compile(swiglu_forward, dynamic=True), torch.compile(swiglu_backward, dynamic=True)

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return AllDyn.fwd(x)

        @staticmethod
        def backward(ctx, grad):
            return AllDyn.bwd(grad, ctx.saved_tensors[0])

    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    sw_bytes = 2 * (2 * n * 2 * ffn + 2 * n * ffn)  # fwd reads y writes out; bwd reads y, g writes dy
    for name, fn in (("eager", eager_glu), ("ours_rows", swiglu), ("all_dynamic", AllDyn.apply),
                     ("mcore_bias_activation_fusion", lambda x: bias_swiglu_impl(x, None))):  # fmt: skip
        for m in (n - 1024, n):  # a second size: compiles turn dynamic as in training
            fn(y[:m]).backward(g[:m])
        us = timed_us(fwd_bwd(fn, y, g))
        res[f"swiglu_{name}_us"] = us
        res[f"swiglu_{name}_tb_s"] = sw_bytes / us / 1e6
    # RoPE fwd+bwd on q [S, B, H, D]
    s, b = n // 16, 16
    q = torch.randn(s, b, heads, d, device=dev, dtype=bf, requires_grad=True)
    gq = torch.randn_like(q)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    f = torch.arange(s, device=dev).float()[:, None] * inv
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    all_dyn = torch.compile(rope_reference, dynamic=True)
    for name, fn in (("mcore_unfused", lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs[: len(x)])),
                     ("ours_rows", lambda x: compiled_rope(x, freqs[: len(x)])),
                     ("all_dynamic", lambda x: all_dyn(x, freqs[: len(x)]))):  # fmt: skip
        fn(q[: s - 8]).backward(gq[: s - 8])
        res[f"rope_{name}_us"] = timed_us(fwd_bwd(fn, q, gq))
    # log-prob gradient pass over response logits [rows, V] (3/4 of the tokens are response)
    rows = 3 * n // 4
    x = torch.randn(rows, vocab, device=dev, dtype=bf)
    stats = [torch.randn(rows, device=dev) for _ in range(3)]
    idx = torch.randint(0, vocab, (rows,), device=dev)
    inside = torch.ones(rows, dtype=torch.bool, device=dev)
    for name, k in (("ours_rows", compile_rows_dynamic(vp._pass_grad)),
                    ("all_dynamic", torch.compile(vp._pass_grad, dynamic=True))):  # fmt: skip
        for m in (rows - 64, rows):
            k(x[:m], *(t[:m] for t in stats), idx[:m], inside[:m], *(t[:m] for t in stats[:2]), 1.0, vocab)
        us = timed_us(lambda k=k: k(x, *stats, idx, inside, *stats[:2], 1.0, vocab))
        res[f"logprob_grad_{name}_us"] = us
        res[f"logprob_grad_{name}_tb_s"] = 2 * 2 * rows * vocab / us / 1e6
    for t in (384, 768):
        res.update(decode_attention_case(t, d))
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
