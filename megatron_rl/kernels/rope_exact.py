"""The exact mode's training RoPE (``rollout.exact_logprobs``): megatron-core's unfused rotation, bit for bit,
as one kernel per direction and without host syncs.

megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) computes
``t * cos_ + rotate_half(t) * sin_`` in t's dtype, each product and the sum rounded (``cos_``, ``sin_``:
``cos(freqs) * mscale`` rounded to t's dtype); the engine's exact decode step rounds the same way
(``kernels.decode_fused.rope_kv_write(exact=True)``), which is why the exact mode cannot take the fused RoPE
(fp32, one rounding). Unfused it is about ten kernels per tensor and direction, and for packed rows
(``SegmentSeqParams``: one THD segment with a per-token table) its THD entry point reads the segment
offsets on the host (``tolist``, ``item``): three syncs per call, two calls per layer.

``apply`` serves megatron-core's ``apply_rotary_pos_emb`` for models whose config carries ``exact_rope``
(``install`` wraps the name ``megatron.core.transformer.attention`` calls; other models go to megatron-core's
own function untouched): the forward is a Triton kernel that rounds each product and the sum by bits as the
eager ops do (tried against them bit for bit once per device, dtype, heads and head dim), else those eager
ops themselves; a single THD segment is the same rotation of the whole row, with no host sync. The backward
is the transpose rotation in fp32, rounded once (a gradient carries no log-prob).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from megatron_rl.kernels import decode_fused
from megatron_rl.kernels.compile import env_switch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the eager ops serve
    HAVE_TRITON = False


if HAVE_TRITON:
    _round_to = decode_fused._round_to

    @triton.jit
    def _exact_rope_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr, n, heads, per_freq, sx_r, sx_h, sc_r, so_r, so_h,
        dim: tl.constexpr, block: tl.constexpr, backward: tl.constexpr,
    ):  # fmt: skip
        """``block`` (token, head) rows of D each: row i of the n = tokens x heads is head i % heads of token
        i // heads, whose angles are row (i // heads) // per_freq of cos/sin."""
        i = tl.program_id(0).to(tl.int64) * block + tl.arange(0, block)
        live = (i < n)[:, None]
        token, h = i // heads, i % heads
        d = tl.arange(0, dim)
        half: tl.constexpr = dim // 2
        partner = (d + half) % dim  # rotate_half(x)[j] = -x[j + D/2] (j < D/2), x[j - D/2] (j >= D/2)
        base = x_ptr + (token * sx_r + h * sx_h)[:, None]
        x = tl.load(base + d[None, :], mask=live, other=0.0)
        xp = tl.load(base + partner[None, :], mask=live, other=0.0).to(tl.float32)
        f = (token // per_freq)[:, None] * sc_r  # bshd rows are (s, b) pairs sharing freqs[s]
        c = tl.load(cos_ptr + f + d[None, :], mask=live, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)[None, :]
        if backward:  # d/dx of x c + R x s is g c + R^T (g s): (R^T y)[j] = y[j + D/2] (j < D/2), -y[j - D/2]
            s_p = tl.load(sin_ptr + f + partner[None, :], mask=live, other=0.0).to(tl.float32)
            out = x.to(tl.float32) * c - sign * xp * s_p
        else:  # each product and the sum rounded to the output dtype, as the eager ops round
            dt: tl.constexpr = out_ptr.dtype.element_ty
            s = tl.load(sin_ptr + f + d[None, :], mask=live, other=0.0).to(tl.float32)
            p_cos = _round_to(x.to(tl.float32) * c, dt)
            p_sin = _round_to((sign * xp) * s, dt)
            out = _round_to(p_cos + p_sin, dt)
        o = out_ptr + (token * so_r + h * so_h)[:, None] + d[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=live)


BLOCK = 64  # (token, head) rows per program on CUDA
RUN_ON_CPU = False  # tests: the kernel under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)
# MEGATRON_RL_EXACT_ROPE=0 (or false/off/no) keeps the eager ops on CUDA too (same bits; for A/B timing)
ON_CUDA = env_switch("MEGATRON_RL_EXACT_ROPE", True)
_TRIED: dict[tuple, bool] = {}  # (device, dtype, heads, head dim) -> the kernel matched the eager ops


def reference(t: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """megatron-core's ``_apply_rotary_pos_emb_bshd`` for full, non-interleaved rotary: t [S, B, H, D],
    freqs [S, 1, 1, D] fp32 angles -> t rotated, in t's dtype, every op rounded as the eager ops round."""
    cos_, sin_ = _cos_sin(freqs, mscale, t.dtype)
    half = t.shape[-1] // 2
    return t * cos_ + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin_


def _cos_sin(freqs: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def _launch(x: Tensor, cos_: Tensor, sin_: Tensor, backward: bool) -> Tensor:
    """x [R, H, D] (unit stride in D), cos_/sin_ [R / per_freq, D] -> [R, H, D] contiguous."""
    rows, heads, dim = x.shape
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    per_freq = rows // cos_.shape[0]
    n = rows * heads
    block = BLOCK if x.is_cuda else max(BLOCK, triton.next_power_of_2(n))  # the interpreter: one program
    _exact_rope_kernel[(triton.cdiv(n, block),)](
        x, cos_, sin_, out, n, heads, per_freq, x.stride(0), x.stride(1), cos_.stride(0), out.stride(0),
        out.stride(1), dim=dim, block=block, backward=backward,
        enable_fp_fusion=False,  # no multiply-add contraction: in fp32 the eager ops round the product first
    )  # fmt: skip
    return out


def _rows(t: Tensor) -> Tensor:
    """t [S, B, H, D] or [S, H, D] -> [R, H, D] rows, unit stride in D (a view where the layout allows)."""
    rows = t.reshape(-1, t.shape[-2], t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _ExactRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, cos_: Tensor, sin_: Tensor) -> Tensor:
        ctx.save_for_backward(cos_, sin_)
        ctx.shape = t.shape
        return _launch(_rows(t), cos_, sin_, backward=False).view(t.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos_, sin_ = ctx.saved_tensors
        return _launch(_rows(grad), cos_, sin_, backward=True).view(ctx.shape), None, None


def serves(t: Tensor) -> bool:
    """Whether the kernel runs for t [..., H, D]: Triton, CUDA (or ``RUN_ON_CPU``), an even power-of-two
    head dim, and its bit-for-bit trial against ``reference`` passed at t's device, dtype, heads and dim."""
    dim = t.shape[-1]
    device_ok = (t.is_cuda and ON_CUDA) or (RUN_ON_CPU and t.device.type == "cpu")
    if not (HAVE_TRITON and device_ok and dim >= 2 and dim & (dim - 1) == 0):
        return False
    key = (str(t.device), t.dtype, t.shape[-2], dim)
    if key not in _TRIED:
        _TRIED[key] = _trial(t.device, t.dtype, t.shape[-2], dim)
    return _TRIED[key]


def _trial(device, dtype, heads: int, dim: int) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    t = (4 * torch.randn(5, 3, heads, dim, generator=g)).to(device, dtype).requires_grad_(True)
    freqs = (torch.rand(5, 1, 1, dim, generator=g) * 300).to(device)
    try:
        with torch.enable_grad():  # the first call may come from a forward-only pass
            got = apply_bshd(t, freqs)
            want = reference(t, freqs)
            grad = torch.randn(got.shape, generator=g).to(device, dtype)
            (g_got,) = torch.autograd.grad(got, t, grad)
            (g_want,) = torch.autograd.grad(want, t, grad)
        ok = torch.equal(got, want) and torch.allclose(g_got.float(), g_want.float(), rtol=2e-2, atol=2e-2)
        why = "" if ok else "its output differs from the eager rotation"
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run is reported, not raised
        ok, why = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not ok:
        warnings.warn(
            f"rollout.exact_logprobs: the exact RoPE kernel failed its trial on {device} ({dtype}, {heads} heads, "
            f"dim {dim}): {why}; megatron-core's unfused ops serve there (same values, slower)",
            stacklevel=3,
        )
    return ok


def apply_bshd(t: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """``reference``'s bits: t [S, B, H, D], freqs [S, 1, 1, D]; the kernel where it was tried."""
    cos_, sin_ = _cos_sin(freqs.reshape(freqs.shape[0], -1), mscale, t.dtype)  # [S, D]
    return _ExactRope.apply(t, cos_, sin_)


def apply(t: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """megatron-core's unfused ``apply_rotary_pos_emb`` with the same bits: bshd t [S, B, H, D], or one THD
    segment t [S, H, D] whose table has a row per token (``SegmentSeqParams``; megatron-core rotates that
    as one bshd row)."""
    x = t.unsqueeze(1) if t.dim() == 3 else t  # [S, B, H, D]
    out = apply_bshd(x, freqs, mscale) if serves(x) else reference(x, freqs, mscale)
    return out.squeeze(1) if t.dim() == 3 else out


def handles(t: Tensor, freqs: Tensor, config, cu_seqlens: Tensor | None) -> bool:
    """Whether ``apply`` stands in for megatron-core here: an exact model (``config.exact_rope``), full
    non-interleaved rotary (freqs as wide as the head), bshd or a single THD segment with a table row per
    token (metadata only: no host sync)."""
    if not getattr(config, "exact_rope", False) or config.rotary_interleaved:
        return False
    if getattr(config, "multi_latent_attention", False):  # megatron-core reorders t first there
        return False
    if freqs.dim() != 4 or freqs.shape[1:3] != (1, 1):  # one angle row per position (no batch axis: mRoPE)
        return False
    if freqs.shape[-1] != t.shape[-1] or freqs.shape[0] != t.shape[0]:
        return False
    return cu_seqlens is None or cu_seqlens.numel() == 2


def install() -> None:
    """Wrap the ``apply_rotary_pos_emb`` that megatron-core's attention calls (once): exact models' calls go
    to ``apply``, every other call to megatron-core's function unchanged."""
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb
    if getattr(original, "_megatron_rl_exact", False):
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if handles(t, freqs, config, cu_seqlens) and (cp_group is None or cp_group.size() == 1):
            return apply(t, freqs, mscale)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)

    apply_rotary_pos_emb._megatron_rl_exact = True
    apply_rotary_pos_emb.__wrapped__ = original
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
