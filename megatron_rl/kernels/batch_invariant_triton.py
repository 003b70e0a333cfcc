"""The Triton paths of ``kernels.batch_invariant``: one fixed tile configuration per op (no autotuning, no
split-K), so each output element is reduced in the same order whatever the row count or the row's place.

Callers go through ``kernels.batch_invariant`` (shapes and contracts are documented there).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the torch references serve
    HAVE_TRITON = False

if HAVE_TRITON:
    from megatron_rl.kernels.decode_fused import _round_to

# matmul tile: one configuration for every M (decode's few rows and training's many run the same code).
# The column tile may follow N (a property of the weight, the same in decode and training): narrower
# tiles give the small projections more programs in a decode step, where few rows leave one row tile.
BM, BK, MM_STAGES = 128, 64, 3


def _column_tile(n: int) -> tuple[int, int]:
    """(BN, num_warps) for a weight of ``n`` output rows."""
    return (128, 8) if n >= 8192 else (64, 4)


LSE_WARPS = 8


if HAVE_TRITON:

    @triton.jit
    def _matmul_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        # int64 offsets: a training LM head writes tokens x vocab (e.g. 84480 x 151936) > 2**31 elements
        pid_m, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):  # K from 0 upwards, one block at a time: no split
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # fmt: skip
            w = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # fmt: skip
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None] * som + rn[None, :] * son,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip

    @triton.jit
    def _rms_row(x, w_ptr, cols, live, H, eps):
        """One row's RMSNorm in fp32 (x [BLOCK] fp32, zero past H): the one reduction both kernels run."""
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        return x * rstd * w

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, sx, so, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=live, other=0.0).to(tl.float32)
        out = _rms_row(x, w_ptr, cols, live, H, eps)
        tl.store(out_ptr + row * so + cols, out.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, y_ptr, w_ptr, s_ptr, out_ptr, H, sx, sy, ss, so, eps, BLOCK: tl.constexpr
    ):
        """s = x + y rounded to s's dtype (as the eager add rounds), then ``_rms_norm_kernel`` of s."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=live, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * sy + cols, mask=live, other=0.0).to(tl.float32)
        s = _round_to(x + y, s_ptr.dtype.element_ty)  # by bits: the interpreter truncates a bf16 cast
        tl.store(s_ptr + row * ss + cols, s.to(s_ptr.dtype.element_ty), mask=live)
        out = _rms_row(s, w_ptr, cols, live, H, eps)
        tl.store(out_ptr + row * so + cols, out.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _row_max(base, V, temp, BLOCK: tl.constexpr):
        """max over the row's first V columns of z / temp, in BLOCK-wide lanes (exact in any order)."""
        cols = tl.arange(0, BLOCK)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            z = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            run_max = tl.maximum(run_max, z / temp)
        return tl.max(run_max, 0)

    @triton.jit
    def _row_exp_sum(base, V, temp, zmax, BLOCK: tl.constexpr):
        """sum of exp(z / temp - zmax) over the row's first V columns: each lane adds its column of every
        block in block order, then the lanes are summed."""
        cols = tl.arange(0, BLOCK)
        lanes = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            z = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            lanes += tl.exp(z / temp - zmax)
        return tl.sum(lanes, 0)

    @triton.jit
    def _lse_kernel(x_ptr, max_ptr, lse_ptr, V, sx, temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * sx passes 2**31 for a training batch's logits
        base = x_ptr + row * sx
        zmax = _row_max(base, V, temp, BLOCK)
        tl.store(max_ptr + row, zmax)
        tl.store(lse_ptr + row, tl.log(_row_exp_sum(base, V, temp, zmax, BLOCK)))

    @triton.jit
    def _shard_max_kernel(x_ptr, max_ptr, V, sx, temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tl.store(max_ptr + row, _row_max(x_ptr + row * sx, V, temp, BLOCK))

    @triton.jit
    def _exp_sum_kernel(x_ptr, max_ptr, sum_ptr, V, sx, temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        zmax = tl.load(max_ptr + row)
        tl.store(sum_ptr + row, _row_exp_sum(x_ptr + row * sx, V, temp, zmax, BLOCK))

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, lead_ptr, plen_ptr, out_ptr, scale, R,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, so_b, so_g, so_r, sp_b,
        groups: tl.constexpr, dim: tl.constexpr, block: tl.constexpr, tile: tl.constexpr,
        shared: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        b, g = pid // groups, pid % groups
        r = tl.program_id(1) * tile + tl.arange(0, tile)
        live_r = r < R
        d = tl.arange(0, dim)
        pos = tl.load(pos_ptr + b * sp_b + r, mask=live_r, other=0)  # [tile] each row's last key
        q = tl.load(q_ptr + b * sq_b + g * sq_g + r[:, None] * sq_r + d[None, :], mask=live_r[:, None],
                    other=0.0)  # fmt: skip
        m_i = tl.full([tile], float("-inf"), tl.float32)
        l_i = tl.zeros([tile], tl.float32)
        acc = tl.zeros([tile, dim], tl.float32)
        if shared:  # keys before plen from the lead slot's copy of the prompt (the same values)
            lead = tl.load(lead_ptr + b).to(tl.int64)
            plen = tl.load(plen_ptr + b)
        k_base = k_ptr + g * sk_g
        v_base = v_ptr + g * sv_g
        n_kv = tl.max(pos, 0) + 1
        for start in range(0, n_kv, block):  # keys from 0 in fixed blocks, one online update each
            t = start + tl.arange(0, block)
            if shared:
                src = tl.where(t < plen, lead, b)[:, None]  # [block, 1] each key's slot
                k_rows, v_rows = k_base + src * sk_b, v_base + src * sv_b
            else:
                k_rows, v_rows = k_base + b * sk_b, v_base + b * sv_b
            k = tl.load(k_rows + t[:, None] * sk_t + d[None, :], mask=(t < n_kv)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [tile, block] fp32
            s = tl.where(t[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_rows + t[:, None] * sv_t + d[None, :], mask=(t < n_kv)[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * so_b + g * so_g + r[:, None] * so_r + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=live_r[:, None])


def matmul(
    x: Tensor, w: Tensor, bias: Tensor | None, config: tuple[int, int, int, int, int] | None = None
) -> Tensor:
    """x [M, K], w [N, K], bias [N] or None -> [M, N] in x's dtype. ``config`` (BM, BN, BK, warps, stages)
    replaces the fixed tile (``benchmarks/bench_exact_matmul.py`` compares them; any one config used for
    every M is batch-invariant, two configs need not agree with each other)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bk, stages = BM, BK, MM_STAGES
    bn, warps = _column_tile(n)
    if config is not None:
        bm, bn, bk, warps, stages = config
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](
        x, w, w if bias is None else bias, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        out.stride(0), out.stride(1), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [M, H] (unit stride in H), weight [H] -> [M, H]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.shape[1], x.stride(0), out.stride(0), eps, BLOCK=block)
    return out


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, y [M, H] (unit stride in H), weight [H] -> (x + y [M, H], ``rms_norm`` of it [M, H]), one launch."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    s, out = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](x, y, weight, s, out, x.shape[1], x.stride(0), y.stride(0), s.stride(0),
                                        out.stride(0), eps, BLOCK=block)  # fmt: skip
    return s, out


def log_softmax_stats(logits: Tensor, temperature: float, valid: int, block: int) -> tuple[Tensor, Tensor]:
    """logits [N, V] (unit stride in V) -> max [N] and log-sum-exp minus max [N] of the first ``valid``
    columns divided by ``temperature`` (fp32), summed in blocks of ``block`` columns."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n = logits.shape[0]
    zmax = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(zmax)
    _lse_kernel[(n,)](logits, zmax, lse, valid, logits.stride(0), float(temperature), BLOCK=block,
                      num_warps=LSE_WARPS)  # fmt: skip
    return zmax, lse


def shard_max(logits: Tensor, temperature: float, valid: int, block: int) -> Tensor:
    """logits [N, Vs] (unit stride in Vs) -> max of the first ``valid`` columns / ``temperature`` [N] fp32."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    zmax = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _shard_max_kernel[(logits.shape[0],)](logits, zmax, valid, logits.stride(0), float(temperature),
                                          BLOCK=block, num_warps=LSE_WARPS)  # fmt: skip
    return zmax


def shard_exp_sum(logits: Tensor, temperature: float, valid: int, zmax: Tensor, block: int) -> Tensor:
    """logits [N, Vs], zmax [N] fp32 -> sum of exp(z / temperature - zmax) over the first ``valid`` columns
    [N] fp32, in blocks of ``block`` columns."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _exp_sum_kernel[(logits.shape[0],)](logits, zmax.float().contiguous(), out, valid, logits.stride(0),
                                        float(temperature), BLOCK=block, num_warps=LSE_WARPS)  # fmt: skip
    return out


def attention(
    q: Tensor, k: Tensor, v: Tensor, row_pos: Tensor, scale: float, block: int, tile: int,
    prefix: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """See ``batch_invariant.attention``; q, k, v with unit stride in D."""
    bsz, groups, rows, dim = q.shape
    row_pos = row_pos.contiguous()
    out = torch.empty(bsz, groups, rows, dim, dtype=q.dtype, device=q.device)
    grid = (bsz * groups, triton.cdiv(rows, tile))
    lead, plen = prefix if prefix is not None else (row_pos, row_pos)  # unused when not shared
    _attention_kernel[grid](
        q, k, v, row_pos, lead, plen, out, scale, rows,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), row_pos.stride(0),
        groups=groups, dim=dim, block=block, tile=tile, shared=prefix is not None, num_warps=4,
    )  # fmt: skip
    return out
