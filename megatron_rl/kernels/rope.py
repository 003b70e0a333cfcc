"""Rotary position embedding as one fused kernel per direction (megatron-core's fused-RoPE slot).

megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) runs about ten kernels per
tensor and per direction: cos, sin, two products, the rotate-half ``cat``, the sum and a final ``cat``
with the empty pass-through part. Compiled, the function below is one kernel forward and one backward.
It computes in fp32 and rounds once (the unfused path rounds after every product: up to one bf16 ulp
apart). The per-row cos / sin tables are computed once per forward (``_tables``) and read by every layer's
query and key rotation, forward and backward.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from megatron_rl.kernels.compile import compile_rows_dynamic


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """t [..., D] -> ``t cos + rotate_half(t) sin`` in fp32 (cos / sin fp32, broadcast over the heads), rounded
    once to t's dtype; ``rotate_half(x) = [-x2, x1]``."""
    x = t.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(t.dtype)


def rope_reference(t: Tensor, freqs: Tensor) -> Tensor:
    """t [S, B, H, D] (or [S*B, H, D]); freqs [S, 1, 1, D] (or [S*B, 1, D]) fp32 angles, halves repeated,
    not interleaved -> rotated t in t's dtype: ``t cos + rotate_half(t) sin``."""
    return _rotate(t, freqs.cos(), freqs.sin())


def rope_transposed(g: Tensor, freqs: Tensor) -> Tensor:
    """The transpose of ``rope_reference``'s rotation (the rotation by -angle): ``g cos - rotate_half(g) sin``,
    in fp32, rounded once to g's dtype. RoPE's input gradient."""
    return _rotate(g, freqs.cos(), -freqs.sin())


def _rotate_back(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _rotate(g, cos, -sin)


_ROWS = compile_rows_dynamic(_rotate)
_ROWS_T = compile_rows_dynamic(_rotate_back)
# The cos / sin tables of the last angles seen: ((weak references to the angle tensor and its segment starts),
# (the other key values, inference mode, the tensors' versions), cos, sin). megatron-core rotates q and k of every
# layer of a forward by the same angle tensor, so the per-row gather and the trigonometry run once per forward
# instead of 2 x layers times. Session 30's H100 profile of the 0.5B update: the rows' gather ~24 us a call and
# the query rotation 87-94 us, where its bytes take ~40 us (the per-element sin / cos, evaluated again for each
# of 14 heads, bound it); session 31's: every q / k rotation, forward and backward, 30.9 us on average, 23.7 ms
# a step against ~41 ms.
_TABLES: list = []


def _tables(key: tuple, per_row) -> tuple[Tensor, Tensor]:
    """cos / sin [S, 1, D] fp32 of ``per_row()`` (the angles [S, 1, D]), from ``_TABLES`` when ``key`` (the
    tensors they come from, then other values) is the last call's: the same tensor objects, alive and not
    written to since (a weak reference per tensor: a new tensor that got a dead one's id is another key)."""
    tensors = tuple(k for k in key if isinstance(k, Tensor))
    rest = tuple(k for k in key if not isinstance(k, Tensor)) + (torch.is_inference_mode_enabled(),)
    rest += tuple(t._version for t in tensors)  # an in-place write makes them other angles
    if _TABLES:
        refs, other, cos, sin = _TABLES[0]
        if other == rest and len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors)):
            return cos, sin
    rows = per_row().float()
    cos, sin = rows.cos(), rows.sin()
    _TABLES[:] = [(tuple(weakref.ref(t) for t in tensors), rest, cos, sin)]
    return cos, sin


def release_tables() -> None:
    """Drop the cached tables (``models.pipeline.run_micro_batches`` does at the end of each pass, so they are
    not held on the GPU through generation)."""
    _TABLES.clear()


class _RopeRows(torch.autograd.Function):
    """t [S, H, D], per-row cos / sin [S, 1, D] -> rotated t; the backward rotates the gradient back with its own
    one-kernel compiled function. Autograd through the compiled forward gave a backward of two kernels per
    tensor at 2-3x the bytes' time (H100: 137 us for a [34816, 14, 64] query gradient, 80 us for the keys')."""

    @staticmethod
    def forward(ctx, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _ROWS(t, cos, sin)

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return _ROWS_T(g.contiguous(), cos, sin), None, None


def compiled_rope(t: Tensor, freqs: Tensor) -> Tensor:
    """rope_reference compiled with one dynamic size: t [S, B, H, D] is viewed as [S*B, H, D] rows with
    the angles repeated per row ([S*B, 1, D], small), since S and B both vary between micro-batches."""
    s, b, h, d = t.shape
    cos, sin = _tables((freqs, s, b), lambda: freqs.expand(s, b, 1, d).reshape(s * b, 1, d))
    return _RopeRows.apply(t.reshape(s * b, h, d), cos, sin).view(s, b, h, d)


def fused_apply_rotary_pos_emb(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """megatron-core's ``fused_apply_rotary_pos_emb(t, freqs, interleaved)`` contract: t [S, B, H, D],
    freqs [S, 1, 1, D_rot]. Interleaved or partial rotary falls back to megatron-core's unfused path."""
    if interleaved or freqs.shape[-1] != t.shape[-1]:
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return compiled_rope(t, freqs)


def fused_apply_rotary_pos_emb_thd(
    t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1, cp_rank: int = 0
) -> Tensor:
    """megatron-core's THD fused-RoPE slot: t [S, H, D] packed sequences (segment starts ``cu_seqlens``
    [N + 1]), freqs [max_len, 1, 1, D_rot] -> t rotated with positions restarting at 0 in every segment."""
    if cp_size != 1:
        raise NotImplementedError("packed sequences with context parallelism: RoPE positions per CP rank")
    s, h, d = t.shape

    def per_row():
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [N]
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=s)  # [S]
        positions = torch.arange(s, device=t.device) - starts  # [S] position inside its own segment
        return freqs[positions].reshape(s, 1, -1)  # [S, 1, D_rot]

    if freqs.shape[-1] != d:  # partial rotary: megatron-core's unfused path
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t[:, None], per_row()[:, None]).squeeze(1)
    cos, sin = _tables((freqs, cu_seqlens, s), per_row)
    return _RopeRows.apply(t, cos, sin)


# --- the inference engine's eager RoPE (rollout.decoder; the exact path's reference in kernels.decode_fused) ---


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, T] -> cos, signed sin [B, T, 1, 1, D] (HF convention: freqs repeated, not
    interleaved). The sin's first half is negated so that rotate-half is a plain ``roll`` (``apply_rope``)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    sin = emb.sin()
    sin[..., : head_dim // 2].neg_()
    return emb.cos().to(dtype)[:, :, None, None], sin.to(dtype)[:, :, None, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, ..., D]; cos / signed sin broadcastable to x (``rope_cos_sin``).

    ``roll(x, D/2) * signed_sin`` equals HF's ``rotate_half(x) * sin`` bit for bit ((-a) * b == a * (-b)).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos / signed sin [B, D] -> R [B, D, D] with ``x @ R == apply_rope(x, cos, sin)`` for x [B, n, D].

    The decode step rotates all heads of a token with one batched matmul (one kernel instead of four
    broadcasting elementwise ones): out[j] = x[j] cos[j] + x[(j + D/2) % D] sin[j].
    """
    rot = torch.diag_embed(sin)  # [B, D, D]
    return torch.diag_embed(cos) + rot.roll(cos.shape[-1] // 2, dims=-2)
