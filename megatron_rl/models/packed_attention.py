"""Causal attention over packed sequences (THD): no query attends across a sequence boundary.

Two paths with one contract: torch's ``varlen_attn`` (flash attention over ``cu_seqlens``, CUDA only) and
a plain per-segment SDPA loop (any device; the reference the tests compare against). The varlen path is
used where a small forward/backward trial on the device matches the loop; its keyword arguments changed
between torch releases (``is_causal`` then ``window_size``; ``enable_gqa`` and ``scale`` added later),
so they are read from its signature.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

_VARLEN_OK: dict[tuple, bool] = {}  # (device, dtype) -> whether varlen_attn matched the loop there


def segment_attention(q, k, v, cu_seqlens: torch.Tensor, scale: float, window: int | None = None):
    """q [S, H, D], k/v [S, G, D] (H a multiple of G), cu_seqlens [N + 1] segment starts -> [S, H, D]:
    causal SDPA inside each segment (``window``: also at most that many positions back)."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, L, D]
        mask = None
        if window is not None and b - a > window:
            idx = torch.arange(b - a, device=q.device)
            mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] <= window)  # [L, L]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=scale
        )  # [1, H, L, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


def _varlen_kwargs(params, scale: float, d: int) -> tuple[dict, float]:
    """The causal/GQA/scale keywords this torch's ``varlen_attn`` takes, and the factor q must be scaled
    by where it has no ``scale`` (its default is 1/sqrt(D))."""
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        return kwargs | {"scale": scale}, 1.0
    return kwargs, scale * d**0.5


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float):
    """``segment_attention`` through torch's ``varlen_attn`` (CUDA, fp16/bf16)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs, q_factor = _varlen_kwargs(params, scale, q.shape[-1])
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # query head h reads kv head h // (H / G)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [S, H, D]
    if q_factor != 1.0:
        q = q * q_factor
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _trial(device: torch.device, dtype: torch.dtype) -> bool:
    """varlen_attn on a small GQA input, forward and backward, against the per-segment loop."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = dict(device=device, dtype=dtype)
    q = torch.randn(24, 4, 64, generator=g, **shape).requires_grad_()
    k = torch.randn(24, 2, 64, generator=g, **shape).requires_grad_()
    v = torch.randn(24, 2, 64, generator=g, **shape).requires_grad_()
    cu = torch.tensor([0, 5, 17, 24], device=device, dtype=torch.int32)
    outs = []
    for fn in (lambda: varlen_attention(q, k, v, cu, 12, 0.1), lambda: segment_attention(q, k, v, cu, 0.1)):
        o = fn()
        (dq, dk) = torch.autograd.grad(o.float().square().sum(), (q, k))
        outs.append((o.float(), dq.float(), dk.float()))
    return all(torch.allclose(a, b, atol=3e-2, rtol=3e-2) for a, b in zip(*outs))


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``varlen_attention`` runs and matches the loop on ``device`` at ``dtype`` (tried once)."""
    key = (str(device), dtype)
    if key not in _VARLEN_OK:
        ok, why = False, "not a CUDA fp16/bf16 tensor"
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            try:
                ok = _trial(device, dtype)
                why = "its result differs from per-segment SDPA"
            except Exception as exc:  # noqa: BLE001 - any failure: the loop is exact, only slower
                why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if not ok:
                warnings.warn(f"torch varlen_attn unusable ({why}); packed attention runs per sequence "
                              "(exact, slower)", stacklevel=2)  # fmt: skip
        _VARLEN_OK[key] = ok
    return _VARLEN_OK[key]


def packed_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float, window: int | None):
    """q [S, H, D], k/v [S, G, D] of packed sequences -> [S, H, D], causal within each sequence."""
    if window is None and varlen_available(q.device, q.dtype):
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return segment_attention(q, k, v, cu_seqlens, scale, window)


def varlen_status() -> dict[str, bool]:
    """Where ``varlen_attn`` was tried so far and whether it is used there ("cuda:0 torch.bfloat16": True)."""
    return {f"{dev} {dtype}": ok for (dev, dtype), ok in _VARLEN_OK.items()}
