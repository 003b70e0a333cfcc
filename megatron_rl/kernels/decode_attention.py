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
        cascade: tl.constexpr = False, start_ptr=None, part_ptr=None,
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
        first = 0
        if cascade:  # keys before start[b] were attended by _prefix_attention_kernel: go on from its state
            first = tl.load(start_ptr + b)
            head = (b * groups + g) * rep + r  # [rows] this row's heads in the partial state
            part = (r < rep) & (r * 0 + first > 0)  # [rows] (a scalar's mask is not the interpreter's)
            m_i = tl.load(part_ptr + head * (dim + 2), mask=part, other=float("-inf"))
            l_i = tl.load(part_ptr + head * (dim + 2) + 1, mask=part, other=0.0)
            acc = tl.load(
                part_ptr + head[:, None] * (dim + 2) + 2 + d[None, :], mask=part[:, None], other=0.0
            )
        k_base = k_ptr + g * sk_g
        v_base = v_ptr + g * sv_g
        for start in range(first, n_kv, block):
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
    def _prefix_attention_kernel(
        q_ptr, k_ptr, v_ptr, members_ptr, plen_ptr, part_ptr, scale, n_rows, sq_b, sq_g, sq_r, sk_b, sk_g, sk_t,
        sv_b, sv_g, sv_t, groups: tl.constexpr, rep: tl.constexpr, per_tile: tl.constexpr, rows: tl.constexpr,
        dim: tl.constexpr, block: tl.constexpr,
    ):  # fmt: skip
        # program (slot s, KV group g): the query heads of every row whose prompt is read from slot s (``members``
        # row s, -1 padded; none: no work) as the rows of one tile, over the prompt's keys 0..plen-1 in slot s;
        # writes each row's online-softmax state (max, sum, unnormalised output) for the decode kernel to go on
        pid = tl.program_id(0)
        s = pid // groups
        g = pid % groups
        i = tl.arange(0, rows)
        d = tl.arange(0, dim)
        k_of = i // rep  # [rows] member of the tile, head of that member
        mem = tl.load(members_ptr + s * per_tile + k_of, mask=k_of < per_tile, other=-1)
        valid = (mem >= 0) & (mem < n_rows)
        row = tl.where(valid, mem, 0).to(tl.int64)
        first = tl.load(members_ptr + s * per_tile)
        n_keys = tl.where(first >= 0, tl.load(plen_ptr + s), 0)  # the members' prompt is the slot's own
        q = tl.load(q_ptr + row[:, None] * sq_b + g * sq_g + (i % rep)[:, None] * sq_r + d[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        m_i = tl.full([rows], float("-inf"), tl.float32)
        l_i = tl.zeros([rows], tl.float32)
        acc = tl.zeros([rows, dim], tl.float32)
        k_rows = k_ptr + s.to(tl.int64) * sk_b + g * sk_g
        v_rows = v_ptr + s.to(tl.int64) * sv_b + g * sv_g
        for start in range(0, n_keys, block):
            t = start + tl.arange(0, block)
            live = t < n_keys
            k = tl.load(k_rows + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(live[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_rows + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        head = (row * groups + g) * rep + i % rep  # [rows] this row's heads in the partial state
        tl.store(part_ptr + head * (dim + 2), m_i, mask=valid)
        tl.store(part_ptr + head * (dim + 2) + 1, l_i, mask=valid)
        tl.store(part_ptr + head[:, None] * (dim + 2) + 2 + d[None, :], acc, mask=valid[:, None])


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
    slot still holds its own copy, so the values and the result are the same bits either way.

    ``prefix`` (lead, plen, members, start) (``rollout.cascade_attention``; ``prompt_tiles`` builds the last
    two from lead and plen): first ``_prefix_attention_kernel`` runs the query heads of the rows listed in
    ``members[s]`` together over the prompt in slot s (read once for all of them, as the rows of one tile),
    then each row goes on from that softmax state over its own keys from ``start[b]`` (0: all its keys, as
    without tiles). The same values, other rounding than the one pass."""
    if prefix is not None and len(prefix) == 4:
        lead, plen, members, start = prefix
        part = _prefix_state(q, k, v, members, plen, scale, *PREFIX_CONFIG)
        return _launch(q, q.shape[2], k, v, positions, scale, block, num_warps, num_stages, (lead, plen),
                       cascade=(start, part))  # fmt: skip
    return _launch(q, q.shape[2], k, v, positions, scale, block, num_warps, num_stages, prefix)


PREFIX_CONFIG = (64, 4, None)  # _prefix_attention_kernel's key block, warps and stages (None: Triton's)
TILE_ROWS = 64  # query rows (a member's heads x members) of one _prefix_attention_kernel tile


def tile_members(rep: int) -> int:
    """Rows whose prompt heads one prefix tile holds: as many as ``TILE_ROWS`` query rows take (at least 1)."""
    return max(1, TILE_ROWS // rep)


def prompt_tiles(lead: torch.Tensor, plen: torch.Tensor, per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From lead [S] / plen [S] (``decode_attention``'s prefix): (members [S, per_tile], start [S]). members[s]
    lists (ascending, -1 padded) the rows with plen > 0 whose lead is s, the first ``per_tile`` of them; start[b]
    is plen[b] for a listed row (its prompt attended in s's tile), 0 for any other (all its keys itself). Device
    ops only (no host sync), for the engine to rebuild when leads change."""
    slots = lead.shape[0]
    rows = torch.arange(slots, device=lead.device)
    owner = torch.where(plen > 0, lead, slots)  # slots: not in any tile
    key, order = torch.sort(owner * slots + rows)
    owner = key // slots
    rank = rows - torch.searchsorted(owner, owner)  # place among the rows of its owner, in row order
    # (a row listed under slot s has s's prompt length: the tile reads plen[s] keys)
    listed = (owner < slots) & (rank < per_tile) & (plen[order] == plen[owner.clamp(max=slots - 1)])
    members = torch.full((slots + 1, per_tile), -1, dtype=torch.long, device=lead.device)
    members.index_put_((torch.where(listed, owner, slots), torch.where(listed, rank, 0)),
                       torch.where(listed, order, -1))  # fmt: skip
    start = torch.zeros_like(plen)
    start[order] = torch.where(listed, plen[order], 0)
    return members[:slots], start


def _prefix_state(q, k, v, members, plen, scale, block, num_warps, num_stages) -> torch.Tensor:
    """``_prefix_attention_kernel`` over every slot's tile: [B, G, rep, D + 2] fp32 (max, sum, output sum)."""
    bsz, groups, rep, dim = q.shape
    part = torch.empty(bsz, groups, rep, dim + 2, dtype=torch.float32, device=q.device)
    per_tile = members.shape[1]
    _prefix_attention_kernel[(bsz * groups,)](
        q, k, v, members, plen, part, dim**-0.5 if scale is None else scale, bsz, q.stride(0), q.stride(1),
        q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), groups=groups,
        rep=rep, per_tile=per_tile, rows=max(16, triton.next_power_of_2(per_tile * rep)), dim=dim, block=block,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    return part


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, positions: torch.Tensor, prefix=None) -> torch.Tensor:  # fmt: skip
    """``decode_fused.rope_kv_write`` and ``decode_attention`` in one kernel: qkv [B, G, rep+2, D] (per group
    rep query heads, then k, then v; unit stride in D), cos / signed sin [B, D], k / v [B, G, T, D] (the
    cache; this step's rotated key and raw value are written at each row's position), positions [B] ->
    [B, G, rep, D]. The same rotation and rounding as ``rope_kv_write``, so the cache and the result hold the
    two kernels' bits; one launch per layer fewer in the decode step (``ROPE_IN_ATTENTION``)."""
    return _launch(qkv, qkv.shape[2] - 2, k, v, positions, None, 64, 4, None, prefix, (cos, sin))


def _launch(
    q, rep: int, k, v, positions, scale, block, num_warps, num_stages, prefix, rope=None, cascade=None
):
    """One ``_decode_attention_kernel`` launch over the [B x G] (slot, KV group) programs; q holds rep query
    rows per group (with ``rope`` = (cos, sin): the step's qkv, rep + 2 rows; with ``cascade`` = (start,
    the prefix state): each row's keys from start on)."""
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
        **({} if cascade is None else {"cascade": True, "start_ptr": cascade[0], "part_ptr": cascade[1]}),
    )  # fmt: skip
    return out


def cascade_usable(q: torch.Tensor) -> bool:
    """Whether ``decode_attention`` runs the prompt tiles (``rollout.cascade_attention``) for q [B, G, rep, D]:
    the kernel serves it and a trial for that head layout gave the one-pass kernel's results (else it warns
    once and the one pass serves). Not tried inside a CUDA-graph capture (the engine's eager warm-up step
    tries it first)."""
    if not usable(q):
        return False
    key = f"the cascade decode attention ({q.device.type}, {q.dtype}, {tuple(q.shape[1:])})"
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing() and not trial_passed(key):
        return False
    return trial_once(
        key,
        lambda: _cascade_trial(q.device, q.dtype, *q.shape[1:]),
        "The cascade decode attention failed its trial; each row attends its prompt itself (the one-pass "
        "kernel: same values, a prompt read once per row).",
    )


def _cascade_trial(device, dtype, groups: int, rep: int, dim: int) -> None:
    """The prompt tiles against the one-pass kernel on 6 slots of this head layout (a group of 3, one of 2 past
    a key block, a row on its own)."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs in the engine's step
    cache = torch.randn(2, 6, groups, 160, dim, generator=g).to(device, dtype)
    q = torch.randn(6, groups, rep, dim, generator=g).to(device, dtype)
    lead = torch.tensor([0, 0, 0, 4, 4, 5], device=device)
    plen = torch.tensor([30, 30, 30, 70, 70, 0], device=device)
    pos = torch.tensor([30, 90, 64, 70, 150, 20], device=device)
    cache[:, 1:3, :, :30] = cache[:, :1, :, :30]
    cache[:, 3, :, :70] = cache[:, 4, :, :70]
    want = decode_attention(q, cache[0], cache[1], pos, prefix=(lead, plen))
    members, start = prompt_tiles(lead, plen, tile_members(rep))
    got = decode_attention(q, cache[0], cache[1], pos, prefix=(lead, plen, members, start))
    gap = float((got.float() - want.float()).abs().max())
    if not gap <= 2e-2:  # nan fails too
        raise RuntimeError(f"largest gap to the one-pass kernel {gap:.3g}")


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
