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

from megatron_rl.kernels.compile import env_switch, trial_once

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: SDPA serves
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr, scale,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_g, so_r,
        groups: tl.constexpr, rep: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr, block: tl.constexpr,
        shared: tl.constexpr, split: tl.constexpr,
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
        begin = n_kv * 0  # the loop's first key (int64, as plen)
        if split:  # the prompt's keys were done by _prefix_kernel: go on from its partial softmax state
            had = (r < rep) & (plen + 0 * r > 0)  # [rows] (plen 0: no shared prompt, start from key 0)
            part = (b * groups + g) * rep + r  # [rows] row of the partial buffers
            m_i = tl.load(pm_ptr + part, mask=had, other=float("-inf"))
            l_i = tl.load(pl_ptr + part, mask=had, other=0.0)
            acc = tl.load(pacc_ptr + part[:, None] * dim + d[None, :], mask=had[:, None], other=0.0)
            begin = plen
        k_base = k_ptr + g * sk_g
        v_base = v_ptr + g * sv_g
        for start in range(begin, n_kv, block):
            t = start + tl.arange(0, block)
            live = t < n_kv
            if shared and not split:
                src = tl.where(t < plen, lead, b.to(tl.int64))[:, None]  # [block, 1] each key's slot
                k_rows, v_rows = k_base + src * sk_b, v_base + src * sv_b
            else:  # int64: slot x (groups x T x D) passes 2^31 in a long cache
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

    @triton.jit
    def _prefix_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, mem_ptr, pm_ptr, pl_ptr, pacc_ptr, scale,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t,
        groups: tl.constexpr, rep: tl.constexpr, members: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr,
        block: tl.constexpr,
    ):  # fmt: skip
        """One program per (slot, KV group); the slots that head a share group (``share_table``) run the
        prompt's keys once for the query heads of all its members (rows: member j's head h at j * rep + h)
        and leave each row's softmax state (max, sum, unnormalised output) for _decode_attention_kernel."""
        pid = tl.program_id(0)
        head = pid // groups
        g = pid % groups
        first = tl.load(mem_ptr + head * members)
        if first >= 0:
            r = tl.arange(0, rows)
            j = r // rep
            slot = tl.load(mem_ptr + head * members + j, mask=j < members, other=-1).to(tl.int64)  # [rows]
            real = slot >= 0
            slot = tl.where(real, slot, 0)
            h = r % rep
            d = tl.arange(0, dim)
            q = tl.load(q_ptr + slot[:, None] * sq_b + g * sq_g + h[:, None] * sq_r + d[None, :],
                        mask=real[:, None], other=0.0)  # fmt: skip
            last = tl.load(pos_ptr + slot, mask=real, other=0)  # [rows] each row's own position
            lead = tl.load(lead_ptr + first).to(tl.int64)  # the members' one lead (the same prompt)
            plen = tl.load(plen_ptr + first)
            m_i = tl.full([rows], float("-inf"), tl.float32)
            l_i = tl.zeros([rows], tl.float32)
            acc = tl.zeros([rows, dim], tl.float32)
            k_rows = k_ptr + g * sk_g + lead * sk_b
            v_rows = v_ptr + g * sv_g + lead * sv_b
            for start in range(0, plen, block):
                t = start + tl.arange(0, block)
                live = t < plen
                k = tl.load(k_rows + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k)) * scale  # [rows, block] fp32
                s = tl.where(live[None, :] & (t[None, :] <= last[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row sees no key
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_rows + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            part = (slot * groups + g) * rep + h  # [rows]
            tl.store(pm_ptr + part, m_i, mask=real)
            tl.store(pl_ptr + part, l_i, mask=real)
            tl.store(pacc_ptr + part[:, None] * dim + d[None, :], acc, mask=real[:, None])


# the engine's default decode kernel runs each shared prompt once per group of its samples (``share_table``);
# MEGATRON_RL_DECODE_PROMPT_ONCE=0: once per sample (each sample's prompt read from the lead's copy)
PROMPT_ONCE = env_switch("MEGATRON_RL_DECODE_PROMPT_ONCE", True)

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
                     num_stages: int | None = None, prefix: tuple[torch.Tensor, ...] | None = None,
                     ) -> torch.Tensor:  # fmt: skip
    """q [B, G, rep, D] (a group's query heads), k / v [B, G, T, D] (unit stride in D), positions [B]:
    sequence b attends to keys 0..positions[b] (< T) -> [B, G, rep, D] in q's dtype.

    ``prefix`` (lead [B], plen [B], int64; ``rollout.prompt_kv_sharing``): sequence b reads its keys and
    values before position plen[b] from row lead[b] (< B) instead of its own. The samples of one prompt
    point at one slot's copy of it: the GPU reads it from HBM once and the others hit the L2 cache; every
    slot still holds its own copy, so the values and the result are the same bits either way.

    ``prefix`` (lead, plen, members [B, C] int32 from ``share_table``): the prompt is read once per share
    group, not once per sample: a first kernel runs the prompt's keys for the query heads of up to C
    samples in one tile (their rows of one matrix product) and leaves each row's softmax state, the second
    goes on over each sample's own keys from plen. The same attention to fp32 rounding (the softmax sums
    run in another grouping), not the same bits as without the table."""
    bsz, groups, rep, dim = q.shape
    out = torch.empty(bsz, groups, rep, dim, dtype=q.dtype, device=q.device)
    rows = max(16, triton.next_power_of_2(rep))
    lead, plen = prefix[:2] if prefix is not None else (positions, positions)  # unused when not shared
    split = prefix is not None and len(prefix) > 2
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))  # fmt: skip
    scale = dim**-0.5 if scale is None else scale
    opts = {} if num_stages is None else {"num_stages": num_stages}
    pm = pl = pacc = out  # unused without the split
    if split:
        members = prefix[2]
        pm = torch.empty(bsz, groups, rep, dtype=torch.float32, device=q.device)  # [B, G, rep]
        pl = torch.empty_like(pm)
        pacc = torch.empty(bsz, groups, rep, dim, dtype=torch.float32, device=q.device)  # [B, G, rep, D]
        tile = max(16, triton.next_power_of_2(members.shape[1] * rep))
        _prefix_kernel[(bsz * groups,)](q, k, v, positions, lead, plen, members, pm, pl, pacc, scale, *strides,
                                        groups=groups, rep=rep, members=members.shape[1], rows=tile, dim=dim,
                                        block=block, num_warps=num_warps, **opts)  # fmt: skip
    _decode_attention_kernel[(bsz * groups,)](
        q, k, v, positions, lead, plen, out, pm, pl, pacc, scale, *strides,
        out.stride(0), out.stride(1), out.stride(2),
        groups=groups, rep=rep, rows=rows, dim=dim, block=block, shared=prefix is not None, split=split,
        num_warps=num_warps, **opts,
    )  # fmt: skip
    return out


def share_table(lead: torch.Tensor, plen: torch.Tensor, rep: int, tile: int = 64) -> torch.Tensor:
    """lead, plen [S] (``rollout.prompt_kv_sharing``'s: slot s reads its plen[s] prompt positions from slot
    lead[s]) -> members [S, C] int32, C = tile // rep (at least 1), -1 padded: the share groups of
    ``decode_attention``. The slots with plen > 0 are grouped by (lead, plen), in slot order, C to a group; row s
    lists its group's slots where s is the group's first (lowest) slot, else it is all -1. A group's slots
    are never below its first, so the rows of a decode batch over slots 0..B-1 hold every group of it."""
    S = lead.shape[0]
    C = max(1, tile // rep)
    # one group per (lead, plen): the prefix kernel runs its first slot's plen keys for all of them
    key = torch.where(plen > 0, lead * (1 << 32) + plen, S * (1 << 32))  # no shared prompt: last, no group
    order = torch.argsort(key, stable=True)  # [S] by lead and plen, then slot
    skey = key[order]
    first = torch.searchsorted(skey, skey)  # [S] sorted index of the first slot of its (lead, plen)
    rank = torch.arange(S, device=lead.device) - first  # [S] place among the slots of its (lead, plen)
    head = order[first + rank // C * C]  # [S] the first slot of its group of C
    members = torch.full((S, C), -1, dtype=torch.int32, device=lead.device)
    grouped = skey < S * (1 << 32)
    members[head[grouped], (rank % C)[grouped]] = order[grouped].to(torch.int32)
    return members


def prompt_once_serves(device: torch.device | str, dtype: torch.dtype, head_dim: int, rep: int) -> bool:
    """``PROMPT_ONCE`` and a trial of the split kernels on this device, dtype and head shape: a small batch
    of two share groups (one split at its C members) and a slot without a shared prompt against the one-pass
    kernel; a failure or a gap over bf16 rounding warns once and the one-pass kernel serves."""
    return PROMPT_ONCE and trial_once(
        f"the decode kernel's prompt once per share group ({torch.device(device).type}, {dtype}, D={head_dim}, rep={rep})",
        lambda: _prompt_once_trial(device, dtype, head_dim, rep),
        "The decode kernel with each prompt once per share group failed its trial; each sample reads its "
        "prompt from the lead's copy instead (same results, slower).",
    )


def _prompt_once_trial(device, dtype, head_dim: int, rep: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    C = max(1, 64 // rep)
    b, groups, t, plen = C + 3, 2, 200, 70
    lead = torch.tensor([0] * (C + 1) + [C + 1, b - 1])  # C + 1 samples of one prompt (two groups), ...
    lens = torch.tensor([plen] * (C + 1) + [plen, 0])  # ... one alone, one slot without a shared prompt
    k, v = (torch.randn(b, groups, t, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k[:, :, :plen], v[:, :, :plen] = k[0, :, :plen], v[0, :, :plen]  # every slot holds the prompt's copy
    q = torch.randn(b, groups, rep, head_dim, generator=g).to(device, dtype)
    pos = torch.randint(plen - 5, t, (b,), generator=g)
    lead, lens, pos = lead.to(device), lens.to(device), pos.to(device)
    want = decode_attention(q, k, v, pos, prefix=(lead, lens)).float()
    got = decode_attention(q, k, v, pos, prefix=(lead, lens, share_table(lead, lens, rep))).float()
    gap = float((got - want).abs().max())
    if not gap <= 2e-2:  # nan fails too
        raise RuntimeError(f"largest gap to the one-pass kernel {gap}")
