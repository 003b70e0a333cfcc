"""Decode attention for the rollout engine: one Triton program per (sequence, KV group), the group's
query heads packed as the rows of one small tile, reading each sequence's keys and values only up to
its own position.

Why not SDPA: with the query heads of a group as the query axis (7 rows for Qwen2.5-0.5B) the flash
kernels behind SDPA compute 64- or 128-row tiles, and with a per-sequence mask they read the whole
attended length; measured on an H200 they ran at 1.7 TB/s. Here a 16-row tile holds the group's heads,
the loop stops at the sequence's length, and the softmax runs online in fp32 with the probabilities
rounded to bf16 for the value product (as flash attention does).

Runs on CUDA where Triton is installed (it comes with torch's CUDA builds); tests run it on CPU under
Triton's interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: SDPA serves
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, out_ptr, scale,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_g, so_r,
        groups: tl.constexpr, rep: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr, block: tl.constexpr,
        shared: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = pid // groups
        g = pid % groups
        n_kv = tl.load(pos_ptr + b) + 1  # keys 0..position
        if shared:  # keys before plen from the lead slot's copy of the prompt (the same values)
            lead = tl.load(lead_ptr + b).to(tl.int64)
            plen = tl.load(plen_ptr + b)
        r = tl.arange(0, rows)
        d = tl.arange(0, dim)
        q = tl.load(
            q_ptr + b * sq_b + g * sq_g + r[:, None] * sq_r + d[None, :], mask=r[:, None] < rep, other=0.0
        )
        m_i = tl.full([rows], float("-inf"), tl.float32)
        l_i = tl.zeros([rows], tl.float32)
        acc = tl.zeros([rows, dim], tl.float32)
        k_base = k_ptr + g * sk_g
        v_base = v_ptr + g * sv_g
        for start in range(0, n_kv, block):
            t = start + tl.arange(0, block)
            live = t < n_kv
            if shared:
                src = tl.where(t < plen, lead, b.to(tl.int64))[:, None]  # [block, 1] each key's slot
                k_rows, v_rows = k_base + src * sk_b, v_base + src * sv_b
            else:  # int64: slot x (groups x T x D) passes 2^31 in a long cache (8B at T = 8192: from slot 256)
                k_rows, v_rows = k_base + b.to(tl.int64) * sk_b, v_base + b.to(tl.int64) * sv_b
            k = tl.load(
                k_rows + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0
            )  # [block, dim]
            s = tl.dot(q, tl.trans(k)) * scale  # [rows, block] fp32
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_rows + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0
            )  # [block, dim]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * so_b + g * so_g + r[:, None] * so_r + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r[:, None] < rep)


# Tests run the kernel on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False


def serves(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the Triton kernel runs for this device, dtype and head dim: Triton importable, bf16/fp16 on
    CUDA (or any float on CPU with ``RUN_ON_CPU``), head dim a power of two >= 16."""
    on_gpu = torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    on_cpu = RUN_ON_CPU and torch.device(device).type == "cpu"
    return HAVE_TRITON and (on_gpu or on_cpu) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def usable(q: torch.Tensor) -> bool:
    """``serves`` for q [..., D] with unit stride in D."""
    return serves(q.device, q.dtype, q.shape[-1]) and q.stride(-1) == 1


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float | None = None, block: int = 64, num_warps: int = 4,
                     num_stages: int | None = None, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                     ) -> torch.Tensor:  # fmt: skip
    """q [B, G, rep, D] (a group's query heads), k / v [B, G, T, D] (unit stride in D), positions [B]:
    sequence b attends to keys 0..positions[b] (< T) -> [B, G, rep, D] in q's dtype.

    ``prefix`` (lead [B], plen [B], int64; ``rollout.prompt_kv_sharing``): sequence b reads its keys and
    values before position plen[b] from row lead[b] (< B) instead of its own. The samples of one prompt
    point at one slot's copy of it: the GPU reads it from HBM once and the others hit the L2 cache; every
    slot still holds its own copy, so the values and the result are the same bits either way."""
    bsz, groups, rep, dim = q.shape
    out = torch.empty(bsz, groups, rep, dim, dtype=q.dtype, device=q.device)
    rows = max(16, triton.next_power_of_2(rep))
    lead, plen = prefix if prefix is not None else (positions, positions)  # unused when not shared
    _decode_attention_kernel[(bsz * groups,)](
        q, k, v, positions, lead, plen, out, dim**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        groups=groups, rep=rep, rows=rows, dim=dim, block=block, shared=prefix is not None, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return out
