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

import os

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

    @triton.jit
    def _online_block(q, k, v, live, scale, m_i, l_i, acc):
        """One key block of the online softmax: q [rows, D], k / v [block, D] (masked keys: ``live`` off) ->
        the state (m_i, l_i, acc) updated, as ``_decode_attention_kernel``'s loop body computes it."""
        s = tl.dot(q, tl.trans(k)) * scale  # [rows, block] fp32
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _decode_attention_window_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, out_ptr, ms_ptr, ls_ptr, accs_ptr, scale, B,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_g, so_r,
        groups: tl.constexpr, rep: tl.constexpr, rows: tl.constexpr, wide: tl.constexpr, dim: tl.constexpr,
        block: tl.constexpr, members: tl.constexpr, batched: tl.constexpr = False,
    ):  # fmt: skip
        # One program per (window of ``members`` adjacent slots, KV group). Where the window's slots share one
        # prompt copy (the same lead and prompt length), its first P keys (the prompt rounded down to whole key
        # blocks) are read once for all of them, with their query heads as one [wide, D] tile; each slot's
        # state goes through fp32 scratch (L2) and the slot's own loop goes on from key P. Elsewhere P = 0 and
        # every slot runs ``_decode_attention_kernel``'s loop. The key blocks are the same either way.
        pid = tl.program_id(0)
        w = pid // groups
        g = pid % groups
        b0 = w * members
        j = tl.arange(0, members)
        in_batch = b0 + j < B
        jb = tl.minimum(b0 + j, B - 1)
        lead_j = tl.load(lead_ptr + jb)
        plen_j = tl.load(plen_ptr + jb)
        pos_j = tl.load(pos_ptr + jb)
        lead0 = tl.load(lead_ptr + b0)
        plen0 = tl.load(plen_ptr + b0)
        P = (plen0 // block) * block
        odd = in_batch & ((lead_j != lead0) | (plen_j != plen0) | (pos_j + 1 < P))
        n_in = tl.sum(in_batch.to(tl.int32), 0)
        P = tl.where((tl.sum(odd.to(tl.int32), 0) == 0) & (n_in > 1), P, 0)
        d = tl.arange(0, dim)
        # the window's query heads as one tile: row R is slot b0 + R // rep, head R % rep
        R = tl.arange(0, wide)
        rj = R // rep
        rr = R % rep
        r_live = (R < members * rep) & (b0 + rj < B)
        rb = tl.minimum(b0 + rj, B - 1)
        qw = tl.load(q_ptr + rb[:, None] * sq_b + g * sq_g + rr[:, None] * sq_r + d[None, :], mask=r_live[:, None],
                     other=0.0)  # fmt: skip
        m_w = tl.full([wide], float("-inf"), tl.float32)
        l_w = tl.zeros([wide], tl.float32)
        acc_w = tl.zeros([wide, dim], tl.float32)
        k_lead = k_ptr + g * sk_g + lead0.to(tl.int64) * sk_b
        v_lead = v_ptr + g * sv_g + lead0.to(tl.int64) * sv_b
        for start in range(0, P, block):
            t = start + tl.arange(0, block)
            live = t < P
            k = tl.load(k_lead + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0)
            v = tl.load(v_lead + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0)
            m_w, l_w, acc_w = _online_block(qw, k, v, live, scale, m_w, l_w, acc_w)
        st = (rb * groups + g) * rep + rr  # [wide] the state's scratch row of (slot, head)
        tl.store(ms_ptr + st, m_w, mask=r_live)
        tl.store(ls_ptr + st, l_w, mask=r_live)
        tl.store(accs_ptr + st[:, None] * dim + d[None, :], acc_w, mask=r_live[:, None])
        tl.debug_barrier()  # the CTA's scratch writes are visible to all its threads
        r = tl.arange(0, rows)
        if batched:  # the slots' own keys together: [members, rows] states, one batched dot a key block
            jm = tl.arange(0, members)
            bm = tl.minimum(b0 + jm, B - 1)  # [members]
            n_m = tl.load(pos_ptr + bm) + 1
            lead_m = tl.load(lead_ptr + bm).to(tl.int64)
            plen_m = tl.load(plen_ptr + bm)
            ok3 = (r[None, :] < rep) & (b0 + jm[:, None] < B)  # [members, rows]
            q3 = tl.load(q_ptr + bm[:, None, None] * sq_b + g * sq_g + r[None, :, None] * sq_r + d[None, None, :],
                         mask=ok3[:, :, None], other=0.0)  # fmt: skip
            s3 = (bm[:, None] * groups + g) * rep + r[None, :]  # [members, rows] scratch rows
            m3 = tl.load(ms_ptr + s3, mask=ok3, other=float("-inf"))
            l3 = tl.load(ls_ptr + s3, mask=ok3, other=0.0)
            acc3 = tl.load(
                accs_ptr + s3[:, :, None] * dim + d[None, None, :], mask=ok3[:, :, None], other=0.0
            )
            for start in range(P, tl.max(n_m, 0), block):
                t = start + tl.arange(0, block)
                live = t[None, :] < n_m[:, None]  # [members, block]
                src = tl.where(t[None, :] < plen_m[:, None], lead_m[:, None], bm[:, None].to(tl.int64))
                kp = g * sk_g + src[:, :, None] * sk_b + t[None, :, None] * sk_t + d[None, None, :]
                k3 = tl.load(k_ptr + kp, mask=live[:, :, None], other=0.0)  # [members, block, dim]
                vp = g * sv_g + src[:, :, None] * sv_b + t[None, :, None] * sv_t + d[None, None, :]
                v3 = tl.load(v_ptr + vp, mask=live[:, :, None], other=0.0)
                sc = tl.dot(q3, tl.permute(k3, (0, 2, 1))) * scale  # [members, rows, block]
                sc = tl.where(live[:, None, :], sc, float("-inf"))
                m_new = tl.maximum(m3, tl.max(sc, 2))
                p3 = tl.exp(sc - m_new[:, :, None])
                alpha = tl.exp(m3 - m_new)
                l3 = l3 * alpha + tl.sum(p3, 2)
                acc3 = acc3 * alpha[:, :, None] + tl.dot(p3.to(v3.dtype), v3)
                m3 = m_new
            o3 = acc3 / l3[:, :, None]
            op = out_ptr + bm[:, None, None] * so_b + g * so_g + r[None, :, None] * so_r + d[None, None, :]
            tl.store(op, o3.to(out_ptr.dtype.element_ty), mask=ok3[:, :, None])
        for jj in tl.static_range(0 if batched else members):
            b = tl.minimum(b0 + jj, B - 1)
            n_kv = tl.load(pos_ptr + b) + 1
            lead = tl.load(lead_ptr + b).to(tl.int64)
            plen = tl.load(plen_ptr + b)
            row_ok = (r < rep) & (b0 + jj + r * 0 < B)  # [rows] (a scalar mask the interpreter refuses)
            q = tl.load(
                q_ptr + b * sq_b + g * sq_g + r[:, None] * sq_r + d[None, :], mask=row_ok[:, None], other=0.0
            )
            sr = (b * groups + g) * rep + r
            m_i = tl.load(ms_ptr + sr, mask=row_ok, other=float("-inf"))
            l_i = tl.load(ls_ptr + sr, mask=row_ok, other=0.0)
            acc = tl.load(accs_ptr + sr[:, None] * dim + d[None, :], mask=row_ok[:, None], other=0.0)
            k_base = k_ptr + g * sk_g
            v_base = v_ptr + g * sv_g
            for start in range(P, n_kv, block):
                t = start + tl.arange(0, block)
                live = t < n_kv
                src = tl.where(t < plen, lead, b.to(tl.int64))[:, None]  # [block, 1] each key's slot
                k = tl.load(
                    k_base + src * sk_b + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0
                )
                v = tl.load(
                    v_base + src * sv_b + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0
                )
                m_i, l_i, acc = _online_block(q, k, v, live, scale, m_i, l_i, acc)
            out = acc / l_i[:, None]
            tl.store(out_ptr + b * so_b + g * so_g + r[:, None] * so_r + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])  # fmt: skip


# Tests run the kernel on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
# MEGATRON_RL_DECODE_ROPE_IN_ATTENTION=1: the decode step's RoPE and KV-cache write run inside the attention
# kernel (``rope_decode_attention``: one launch per layer fewer; off until measured on a GPU)
ROPE_IN_ATTENTION = env_switch("MEGATRON_RL_DECODE_ROPE_IN_ATTENTION", False)


def _window_setting_from_env() -> tuple[int, bool]:
    """``MEGATRON_RL_DECODE_WINDOWS``: 0 (default: off) or the slots of a window of ``decode_attention_windows``
    (2, 4 or 8), with a ``b`` after 2 or 4 for its ``batched`` loop (8 would need more shared memory than an
    H100 block has) -> (members, batched); anything else stops the run with the variable named, before any GPU
    time is spent."""
    raw = os.environ.get("MEGATRON_RL_DECODE_WINDOWS", "0").strip().lower() or "0"
    if raw not in ("0", "2", "4", "8", "2b", "4b"):
        raise ValueError(
            f"MEGATRON_RL_DECODE_WINDOWS={raw!r}: expected 0 (off), 2, 4 or 8 (the slots of a window that read "
            "their shared prompt once), or 2b / 4b (their own keys in one batched loop); unset it or pick one "
            "of those"
        )
    return int(raw.rstrip("b")), raw.endswith("b")


# MEGATRON_RL_DECODE_WINDOWS=2|4|8|2b|4b: with prompt KV sharing the decode step's attention reads each prompt once
# per window of that many adjacent slots (``decode_attention_windows``; opt-in until measured on a GPU)
try:  # a bad value stops the launch in ``config.entry.checked_layout``; here it stops the first use
    WINDOW_MEMBERS, WINDOW_BATCHED = _window_setting_from_env()
    _WINDOW_ERROR = None
except ValueError as _err:
    WINDOW_MEMBERS, WINDOW_BATCHED, _WINDOW_ERROR = 0, False, str(_err)


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


def decode_attention_windows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             prefix: tuple[torch.Tensor, torch.Tensor], members: int = 2, block: int = 64,
                             num_warps: int = 4, num_stages: int | None = None, batched: bool = False,
                             state: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``decode_attention(q, k, v, positions, prefix=prefix)`` with the prompt read once per window of
    ``members`` adjacent slots that share it (the same lead and prompt length, as the engine admits a prompt's
    samples): its whole key blocks attend the window's query heads as one tile, and each slot goes on from its
    softmax state over its own keys. The same key blocks in the same order as ``decode_attention``; windows
    whose slots do not share a prompt run its per-slot loop. ``batched``: the slots' own keys in one loop of
    batched dots ([members, rows] states, each step a key block of every slot) instead of one slot after the
    other. q [B, G, rep, D] -> [B, G, rep, D]. ``state`` (tests): the fp32 scratch to use, B x G x rep x
    (D + 2) elements (m, then l, then acc); after the call its first B x G x rep hold each (slot, group, head)'s
    running max after the shared prompt blocks, -inf where the slot's window shared none."""
    if members < 1 or members & (members - 1):
        raise ValueError(f"decode_attention_windows: members={members} must be a power of two (2, 4 or 8)")
    bsz, groups, rep, dim = q.shape
    lead, plen = prefix
    out = torch.empty(bsz, groups, rep, dim, dtype=q.dtype, device=q.device)
    if state is None:
        state = torch.empty(bsz * groups * rep * (dim + 2), dtype=torch.float32, device=q.device)
    n = bsz * groups * rep
    m_s, l_s, acc_s = state[:n], state[n : 2 * n], state[2 * n :]
    rows = max(16, triton.next_power_of_2(rep))
    wide = max(16, triton.next_power_of_2(members * rep))
    _decode_attention_window_kernel[(triton.cdiv(bsz, members) * groups,)](
        q, k, v, positions, lead, plen, out, m_s, l_s, acc_s, dim**-0.5, bsz,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        groups=groups, rep=rep, rows=rows, wide=wide, dim=dim, block=block, members=members, batched=batched,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
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


def windows_usable(q: torch.Tensor, prefix) -> bool:
    """Whether the decoder runs ``decode_attention_windows`` for q [B, G, rep, D]: ``WINDOW_MEMBERS`` set,
    prompt KV sharing on (``prefix``), the kernel serves q, and a trial at this head layout matched
    ``decode_attention`` (else it warns once and the per-slot kernel serves). Not tried inside a CUDA-graph
    capture (the engine's eager warm-up step tries it first)."""
    if _WINDOW_ERROR is not None:
        raise ValueError(_WINDOW_ERROR)
    if not (WINDOW_MEMBERS and prefix is not None and usable(q)):
        return False
    kind = f"{WINDOW_MEMBERS}{' (batched)' if WINDOW_BATCHED else ''}"
    key = f"decode attention in windows of {kind} ({q.device.type}, {q.dtype}, {tuple(q.shape[1:])})"
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing() and not trial_passed(key):
        return False
    return trial_once(
        key,
        lambda: _windows_trial(q.device, q.dtype, *q.shape[1:]),
        "Decode attention in windows of slots sharing a prompt failed its trial; the per-slot kernel serves "
        "(same results).",
    )


def _windows_trial(device, dtype, groups: int, rep: int, dim: int) -> None:
    """``decode_attention_windows`` against ``decode_attention`` on 17 slots of this head layout: prompts of 70
    (eight slots: a shared window at every width), 130 (three) and 100 (five) tokens, windows that split a
    prompt's slots, a last window cut short."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs in the engine's step
    lead = torch.tensor([0] * 8 + [8] * 3 + [11] * 5 + [16])
    plen = torch.tensor([70] * 8 + [130] * 3 + [100] * 5 + [0])
    pos = torch.tensor([69, 75, 90, 110, 130, 150, 170, 199, 129, 140, 160, 99, 120, 140, 160, 180, 20])
    cache = torch.randn(2, len(lead), groups, 200, dim, generator=g)
    for slot in range(len(lead)):
        cache[:, slot, :, : plen[slot]] = cache[:, lead[slot], :, : plen[slot]]
    cache = cache.to(device, dtype)
    q = torch.randn(len(lead), groups, rep, dim, generator=g).to(device, dtype)
    prefix = (lead.to(device), plen.to(device))
    pos = pos.to(device)
    want = decode_attention(q, cache[0], cache[1], pos, prefix=prefix)
    got = decode_attention_windows(q, cache[0], cache[1], pos, prefix, WINDOW_MEMBERS, batched=WINDOW_BATCHED)
    gap = float((got.float() - want.float()).abs().max())
    if not gap <= 2e-2:  # nan fails too
        raise RuntimeError(f"largest gap to the per-slot kernel {gap:.3g}")
