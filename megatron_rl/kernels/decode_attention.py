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
    def _attend(q, m_i, l_i, acc, k_rows, v_rows, lo, hi, sk_t, sv_t, scale, d, block: tl.constexpr):
        """The online softmax of q [rows, dim] over keys lo..hi-1 at k_rows / v_rows (a slot's [T, D] rows),
        in blocks of ``block`` from lo, continuing from (m_i, l_i, acc)."""
        for start in range(lo, hi, block):
            t = start + tl.arange(0, block)
            live = t < hi
            k = tl.load(k_rows + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0)  # [block, dim]
            s = tl.dot(q, tl.trans(k)) * scale  # [rows, block] fp32
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_rows + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0)  # [block, dim]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _prefix_kernel(
        q_ptr, k_ptr, v_ptr, plen_ptr, mem_ptr, m_ptr, l_ptr, acc_ptr, scale,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, ss_b, ss_g, sa_b, sa_g, sa_r,
        groups: tl.constexpr, rep: tl.constexpr, width: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr,
        block: tl.constexpr,
    ):  # fmt: skip
        # one program per (lead slot, KV group): the prompt's keys 0..plen-1, read once from the lead's copy,
        # against the query heads of all its members (row = member x rep + head); each member's softmax
        # state (max, sum, unnormalised output) goes to m / l / acc for _decode_attention_kernel to finish
        pid = tl.program_id(0)
        lead = pid // groups
        g = pid % groups
        plen = tl.load(plen_ptr + lead)
        first = tl.load(mem_ptr + lead * width)
        if (first >= 0) & (plen > 0):
            i = tl.arange(0, rows)
            member, head = i // rep, i % rep
            slot = tl.load(mem_ptr + lead * width + member, mask=member < width, other=-1)
            on = slot >= 0
            slot = tl.where(on, slot, 0).to(tl.int64)
            d = tl.arange(0, dim)
            q = tl.load(q_ptr + slot[:, None] * sq_b + g * sq_g + head[:, None] * sq_r + d[None, :],
                        mask=on[:, None], other=0.0)  # fmt: skip
            m_i = tl.full([rows], float("-inf"), tl.float32)
            l_i = tl.zeros([rows], tl.float32)
            acc = tl.zeros([rows, dim], tl.float32)
            own = lead.to(tl.int64)
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_ptr + g * sk_g + own * sk_b, v_ptr + g * sv_g + own * sv_b,
                                    0, plen, sk_t, sv_t, scale, d, block)  # fmt: skip
            st = slot * ss_b + g * ss_g + head
            tl.store(m_ptr + st, m_i, mask=on)
            tl.store(l_ptr + st, l_i, mask=on)
            tl.store(acc_ptr + (slot * sa_b + g * sa_g + head * sa_r)[:, None] + d[None, :], acc, mask=on[:, None])

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, out_ptr, cos_ptr, sin_ptr, scale,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_g, so_r, sc_b, sc_d,
        cov_ptr, m_ptr, l_ptr, acc_ptr, ss_b, ss_g, sa_b, sa_g, sa_r,
        groups: tl.constexpr, rep: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr, block: tl.constexpr,
        shared: tl.constexpr, rope: tl.constexpr, cascade: tl.constexpr,
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
        if cascade:  # keys split at plen: the prompt's (the prefix kernel's state, else here from the lead's
            # copy), then the slot's own from plen (the same block boundaries either way)
            own = b.to(tl.int64)
            if tl.load(cov_ptr + b) != 0:
                st = own * ss_b + g * ss_g + r
                m_i = tl.load(m_ptr + st, mask=r < rep, other=float("-inf"))
                l_i = tl.load(l_ptr + st, mask=r < rep, other=0.0)
                acc = tl.load(acc_ptr + (own * sa_b + g * sa_g + r * sa_r)[:, None] + d[None, :],
                              mask=(r < rep)[:, None], other=0.0)  # fmt: skip
            else:
                m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_base + lead * sk_b, v_base + lead * sv_b, 0, plen,
                                        sk_t, sv_t, scale, d, block)  # fmt: skip
            m_i, l_i, acc = _attend(q, m_i, l_i, acc, k_base + own * sk_b, v_base + own * sv_b, plen, n_kv,
                                    sk_t, sv_t, scale, d, block)  # fmt: skip
        else:
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
# Cascade decode attention (with ``rollout.prompt_kv_sharing``'s lead slots and ``group_table``): one program
# per (prompt, KV group) reads the prompt's keys and values once against the query heads of all the samples
# decoding it (up to ``CASCADE_WIDTH``, as one tile), and each sample's program goes on from that softmax
# state over its own response keys. MEGATRON_RL_DECODE_CASCADE=0: one program per sample reads the whole
# attended length (the prompt from its lead's copy, shared through the L2 cache at best).
CASCADE = env_switch("MEGATRON_RL_DECODE_CASCADE", True)
CASCADE_WIDTH = 8  # members per group the prefix program takes (a GRPO group of 8); more go the long way


def group_table(
    lead: torch.Tensor, plen: torch.Tensor, width: int = CASCADE_WIDTH
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cascade's groups from the slots' lead [S] and prompt length plen [S] (0: no prompt, an idle slot):
    members [S, width] int32 (row L: the slots reading their prompt from lead slot L, ascending, -1 past
    them) and covered [S] int32 (1: the slot's prompt part is its group's prefix program's: among the first
    ``width`` of its group, with its lead's prompt length). Device ops only (no host sync)."""
    s = lead.numel()
    ar = torch.arange(s, device=lead.device)
    lead = torch.where(plen > 0, lead, ar)  # idle slots are no one's members
    order = torch.argsort(lead * s + ar)  # slots by lead, then slot
    by_lead = lead[order]
    rank = ar - torch.searchsorted(by_lead, by_lead)  # place within its group
    ok = rank < width
    flat = torch.full((s * width + 1,), -1, dtype=torch.int32, device=lead.device)
    flat.scatter_(0, torch.where(ok, by_lead * width + rank, s * width), order.to(torch.int32))
    covered = torch.zeros(s, dtype=torch.int32, device=lead.device)
    covered[order] = (ok & (plen[order] > 0) & (plen[by_lead] == plen[order])).to(torch.int32)
    return flat[:-1].view(s, width), covered


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
                     groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """q [B, G, rep, D] (a group's query heads), k / v [B, G, T, D] (unit stride in D), positions [B]:
    sequence b attends to keys 0..positions[b] (< T) -> [B, G, rep, D] in q's dtype.

    ``prefix`` (lead [B], plen [B], int64; ``rollout.prompt_kv_sharing``): sequence b reads its keys and
    values before position plen[b] from row lead[b] (< B) instead of its own. The samples of one prompt
    point at one slot's copy of it; every slot still holds its own copy, so the values are the same either
    way. ``groups`` (``group_table(lead, plen)`` [:B] rows; with ``prefix`` and ``CASCADE``): the cascade, a
    prefix program per lead reading the prompt once for all its members; the result does not depend on
    which slots share (the keys split at plen the same way for every slot), only on ``CASCADE``."""
    cascade = groups if CASCADE and prefix is not None else None
    return _launch(q, q.shape[2], k, v, positions, scale, block, num_warps, num_stages, prefix, cascade=cascade)


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, positions: torch.Tensor, prefix=None) -> torch.Tensor:  # fmt: skip
    """``decode_fused.rope_kv_write`` and ``decode_attention`` in one kernel: qkv [B, G, rep+2, D] (per group
    rep query heads, then k, then v; unit stride in D), cos / signed sin [B, D], k / v [B, G, T, D] (the
    cache; this step's rotated key and raw value are written at each row's position), positions [B] ->
    [B, G, rep, D]. The same rotation and rounding as ``rope_kv_write``, so the cache and the result hold the
    two kernels' bits; one launch per layer fewer in the decode step (``ROPE_IN_ATTENTION``)."""
    return _launch(qkv, qkv.shape[2] - 2, k, v, positions, None, 64, 4, None, prefix, (cos, sin))


def _launch(q, rep: int, k, v, positions, scale, block, num_warps, num_stages, prefix, rope=None, cascade=None):
    """One ``_decode_attention_kernel`` launch over the [B x G] (slot, KV group) programs; q holds rep query
    rows per group (with ``rope`` = (cos, sin): the step's qkv, rep + 2 rows). ``cascade`` (members [B, W],
    covered [B]; not with ``rope``): ``_prefix_kernel`` first, its softmax states in fp32 scratch."""
    bsz, groups, _, dim = q.shape
    out = torch.empty(bsz, groups, rep, dim, dtype=q.dtype, device=q.device)
    rows = max(16, triton.next_power_of_2(rep + 2 if rope is not None else rep))
    lead, plen = prefix if prefix is not None else (positions, positions)  # unused when not shared
    cos, sin = rope if rope is not None else (q, q)  # unused without rope
    scale = dim**-0.5 if scale is None else scale
    opts = {} if num_stages is None else {"num_stages": num_stages}
    if cascade is not None:
        members, covered = cascade
        width = members.shape[1]
        m = torch.empty(bsz, groups, rep, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(bsz, groups, rep, dim, dtype=torch.float32, device=q.device)
        _prefix_kernel[(bsz * groups,)](
            q, k, v, plen, members, m, l, acc, scale, q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), m.stride(0), m.stride(1),
            acc.stride(0), acc.stride(1), acc.stride(2), groups=groups, rep=rep, width=width,
            rows=max(16, triton.next_power_of_2(width * rep)), dim=dim, block=block, num_warps=num_warps, **opts,
        )  # fmt: skip
    else:
        covered = m = l = acc = q  # unused
    _decode_attention_kernel[(bsz * groups,)](
        q, k, v, positions, lead, plen, out, cos, sin, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), cos.stride(-1), covered, m, l, acc, m.stride(0), m.stride(1), acc.stride(0),
        acc.stride(1), acc.stride(2), groups=groups, rep=rep, rows=rows, dim=dim, block=block,
        shared=prefix is not None, rope=rope is not None, cascade=cascade is not None, num_warps=num_warps, **opts,
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
