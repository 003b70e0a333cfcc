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

from megatron_rl.kernels import decode_fused
from megatron_rl.kernels.compile import env_switch, trial_once, trial_passed
from megatron_rl.kernels.rope import rope_cos_sin

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: SDPA serves
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, out_ptr, cos_ptr, sin_ptr, scale,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_g, so_r, sc_b, sc_d,
        groups: tl.constexpr, rep: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr, block: tl.constexpr,
        shared: tl.constexpr, rope: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        # PDL (``decode_fused.PDL``): launched before the kernel ahead of it finished; its writes from here on
        if PDL:
            decode_fused.gdc_wait()
        pid = tl.program_id(0)
        b = pid // groups
        g = pid % groups
        n_kv = tl.load(pos_ptr + b) + 1  # keys 0..position
        if shared:  # keys before plen from the lead slot's copy of the prompt (the same values)
            lead = tl.load(lead_ptr + b).to(tl.int64)
            plen = tl.load(plen_ptr + b)
        r = tl.arange(0, rows)
        d = tl.arange(0, dim)
        if rope:  # q_ptr is the step's qkv [B, G, rep+2, D]: rotate q and k here, write k and v to the cache
            at = q_ptr + b * sq_b + g * sq_g + r[:, None] * sq_r
            x = tl.load(at + d[None, :], mask=r[:, None] < rep + 2, other=0.0)  # [rows, dim]
            xr = tl.load(at + ((d + dim // 2) % dim)[None, :], mask=r[:, None] < rep + 2, other=0.0)
            cos = tl.load(cos_ptr + b * sc_b + d * sc_d).to(tl.float32)
            sin = tl.load(sin_ptr + b * sc_b + d * sc_d).to(tl.float32)  # signed: rotate_half's sign in it
            # decode_fused.rope_kv_write's formula and rounding, so the cache and q hold its bits
            rot = (x.to(tl.float32) * cos[None, :] + xr.to(tl.float32) * sin[None, :]).to(x.dtype)
            q = tl.where(r[:, None] < rep, rot, 0.0).to(x.dtype)
            k_new = tl.sum(tl.where(r[:, None] == rep, rot.to(tl.float32), 0.0), 0).to(x.dtype)  # [dim]
            v_new = tl.sum(tl.where(r[:, None] == rep + 1, x.to(tl.float32), 0.0), 0).to(x.dtype)
            own = b.to(tl.int64)
            tl.store(k_ptr + own * sk_b + g * sk_g + (n_kv - 1) * sk_t + d, k_new.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + own * sv_b + g * sv_g + (n_kv - 1) * sv_t + d, v_new.to(v_ptr.dtype.element_ty))
        else:
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
            if rope:  # this step's key from registers (its store above need not be visible yet)
                k = tl.where((t == n_kv - 1)[:, None], k_new[None, :], k)
            s = tl.dot(q, tl.trans(k)) * scale  # [rows, block] fp32
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_rows + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0
            )  # [block, dim]
            if rope:
                v = tl.where((t == n_kv - 1)[:, None], v_new[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * so_b + g * so_g + r[:, None] * so_r + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r[:, None] < rep)


# Tests run the kernel on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
# MEGATRON_RL_DECODE_ROPE_IN_ATTENTION=1: the decode step's RoPE and KV-cache write run inside the attention
# kernel (``rope_decode_attention``: one launch per layer fewer; off until measured on a GPU)
ROPE_IN_ATTENTION = env_switch("MEGATRON_RL_DECODE_ROPE_IN_ATTENTION", False)


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
    return _launch(q, q.shape[2], k, v, positions, scale, block, num_warps, num_stages, prefix)


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, positions: torch.Tensor, prefix=None) -> torch.Tensor:  # fmt: skip
    """``decode_fused.rope_kv_write`` and ``decode_attention`` in one kernel: qkv [B, G, rep+2, D] (per group
    rep query heads, then k, then v; unit stride in D), cos / signed sin [B, D], k / v [B, G, T, D] (the
    cache; this step's rotated key and raw value are written at each row's position), positions [B] ->
    [B, G, rep, D]. The same rotation and rounding as ``rope_kv_write``, so the cache and the result hold the
    two kernels' bits; one launch per layer fewer in the decode step (``ROPE_IN_ATTENTION``)."""
    return _launch(qkv, qkv.shape[2] - 2, k, v, positions, None, 64, 4, None, prefix, (cos, sin))


def _launch(q, rep: int, k, v, positions, scale, block, num_warps, num_stages, prefix, rope=None):
    """One ``_decode_attention_kernel`` launch over the [B x G] (slot, KV group) programs; q holds rep query
    rows per group (with ``rope`` = (cos, sin): the step's qkv, rep + 2 rows)."""
    bsz, groups, _, dim = q.shape
    out = torch.empty(bsz, groups, rep, dim, dtype=q.dtype, device=q.device)
    rows = max(16, triton.next_power_of_2(rep + 2 if rope is not None else rep))
    lead, plen = prefix if prefix is not None else (positions, positions)  # unused when not shared
    cos, sin = rope if rope is not None else (q, q)  # unused without rope
    _decode_attention_kernel[(bsz * groups,)](
        q, k, v, positions, lead, plen, out, cos, sin, dim**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), cos.stride(-1), groups=groups, rep=rep, rows=rows, dim=dim, block=block,
        shared=prefix is not None, rope=rope is not None, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **decode_fused.pdl(q.device),
    )  # fmt: skip
    return out


def rope_usable(qkv: torch.Tensor) -> bool:
    """Whether the decoder runs ``rope_decode_attention`` for qkv [B, G, rep+2, D]: ``ROPE_IN_ATTENTION``,
    the kernel serves qkv's device, dtype and head dim with unit stride in D, and a trial for that head
    layout gave ``rope_kv_write`` then ``decode_attention``'s results (else it warns once and the two
    kernels serve). Not tried inside a CUDA-graph capture (the engine's eager warm-up step tries it first)."""
    if not (ROPE_IN_ATTENTION and usable(qkv)):
        return False
    key = f"the decode kernel with RoPE inside ({qkv.device.type}, {qkv.dtype}, {tuple(qkv.shape[1:])})"
    if qkv.device.type == "cuda" and torch.cuda.is_current_stream_capturing() and not trial_passed(key):
        return False
    return trial_once(
        key,
        lambda: _rope_trial(qkv.device, qkv.dtype, *qkv.shape[1:]),
        "The decode-attention kernel with RoPE inside failed its trial; RoPE and the KV write run in their "
        "own kernel (same results, one launch more per layer).",
    )


def _rope_trial(device, dtype, groups: int, rows2: int, dim: int) -> None:
    """``rope_decode_attention`` against ``rope_kv_write`` then ``decode_attention`` on 5 slots of this head
    layout (positions 0 to past a key block, two slots sharing a prompt): output and cache."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs in the engine's step
    cache = torch.randn(2, 5, groups, 96, dim, generator=g).to(device, dtype)
    qkv = torch.randn(5, groups, rows2, dim, generator=g).to(device, dtype)
    pos = torch.tensor([0, 40, 63, 64, 90], device=device)
    lead, plen = torch.tensor([0, 1, 1, 3, 4], device=device), torch.tensor([0, 30, 30, 0, 0], device=device)
    cache[:, 2, :, :30] = cache[:, 1, :, :30]
    cos, sin = (c[:, 0, 0, 0] for c in rope_cos_sin(pos[:, None], dim, 10000.0, dtype))
    two, one = cache.clone(), cache.clone()
    q = decode_fused.rope_kv_write(qkv, cos, sin, pos, two[0], two[1])
    want = decode_attention(q, two[0], two[1], pos, prefix=(lead, plen))
    got = rope_decode_attention(qkv, cos, sin, one[0], one[1], pos, (lead, plen))
    gap = max(float((got.float() - want.float()).abs().max()), float((one.float() - two.float()).abs().max()))
    if not gap <= 2e-2:  # nan fails too
        raise RuntimeError(f"largest gap to rope_kv_write then decode_attention {gap:.3g}")
