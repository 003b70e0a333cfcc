"""Causal attention over packed sequences (THD): no query attends across a sequence boundary.

Two paths with one contract: varlen flash attention over ``cu_seqlens`` (CUDA only) and a plain
per-segment SDPA loop (any device; the reference the tests compare against). The varlen path is used where
a small forward/backward trial on the device matches the loop. Its kernel, in order of preference:
FlashAttention-4 (the optional ``flash-attn-4`` package, Hopper and Blackwell) where importable; aten's
flash attention with GQA keys unrepeated; torch's ``varlen_attn``, whose keyword arguments changed between
torch releases (``is_causal`` then ``window_size``; ``enable_gqa`` and ``scale`` added later), so they are
read from its signature. A kernel that fails the trial is dropped on that device and the next one tried.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.kernels import gather_rows
from megatron_rl.kernels.compile import env_switch

_VARLEN_OK: dict[tuple, bool] = {}  # (device, dtype, shared) -> whether varlen attention matched the loop
_VARLEN_WHY: dict[tuple, str] = {}  # the same keys -> the trial's errors, or why it did not run
# GQA keys/values straight into flash attention where torch's varlen_attn has no ``enable_gqa`` (torch 2.11):
# its fallback repeats K/V to every query head, a copy forward and a sum backward per layer (H100, 0.5B
# update: 7.4 ms per 64 sequences). Flash attention's varlen kernels take fewer K/V heads as they are.
# Off after a failed trial on that device (then the repeat serves); MEGATRON_RL_FLASH_GQA=0 turns it off.
GQA_DIRECT = env_switch("MEGATRON_RL_FLASH_GQA", True)
_GQA_DIRECT_FAILED: set[str] = set()  # devices where the direct path failed its trial
# FlashAttention-4 (``pip install flash-attn-4``: CuTe DSL kernels, forward and backward on SM90/SM100) where
# it imports: an optional acceleration, never required. Off after a failed trial on that device (the next
# kernel serves); MEGATRON_RL_FA4=0 turns it off.
FA4 = env_switch("MEGATRON_RL_FA4", True)
_FA4_FAILED: set[str] = set()  # devices where FA4 failed its trial
# (device, dtype, query heads, KV heads, head dim) -> whether FA4 passed its trial at that head layout (its
# kernels specialise on head dim and heads per KV head; the device's trial runs one small layout)
_FA4_LAYOUTS: dict[tuple, bool] = {}


@dataclass
class SegmentSeqParams(PackedSeqParams):
    """``PackedSeqParams`` of a packed row for our core attention. megatron-core reads only the RoPE fields:
    they describe the row as ONE segment (``cu_seqlens_q`` [0, S]) whose per-token rotary table the model's
    rotary module returns at each token's own position (``models.head.set_rope_positions``; megatron-core's
    per-segment THD RoPE reads every segment's offset with a host sync); ``max_seqlen_q`` sizes that
    table (the largest position + 1). Our attention reads the real segments: queries ``segments_q``
    [N + 1], and for shared prompts the key rows ``kv_index`` [Sk] in ``segments_k`` [N + 1] (and the
    copies of each row, ``kernels.gather_rows.inverse``'s ``kv_order`` / ``kv_ptr``, for their gradient)."""

    segments_q: torch.Tensor = None
    max_q: int = 0
    kv_index: torch.Tensor | None = None
    segments_k: torch.Tensor | None = None
    max_k: int = 0
    kv_order: torch.Tensor | None = None
    kv_ptr: torch.Tensor | None = None


def segment_attention(q, k, v, cu_seqlens: torch.Tensor, scale: float, window: int | None = None, *,
                      kv_index: torch.Tensor | None = None, cu_k: torch.Tensor | None = None):  # fmt: skip
    """q [S, H, D], k/v [S, G, D] (H a multiple of G), cu_seqlens [N + 1] segment starts -> [S, H, D]:
    causal SDPA inside each segment (``window``: also at most that many positions back). Per-segment
    SDPA: any device, the reference of the varlen path.

    Shared prompts: query segment i attends to the keys at ``kv_index[cu_k[i]:cu_k[i+1]]`` instead of its
    own rows, causally aligned at the end (its last query sees every key, its query j the first
    Lk - Lq + j + 1)."""
    out = torch.empty_like(q)
    bq = cu_seqlens.tolist()
    bk = bq if cu_k is None else cu_k.tolist()
    for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        qs = q[a:b].transpose(0, 1)[None]  # [1, H, Lq, D]
        if kv_index is None:
            ks, vs = (t[c:d].transpose(0, 1)[None] for t in (k, v))  # [1, G, Lk, D]
        else:
            ks, vs = (t.index_select(0, kv_index[c:d]).transpose(0, 1)[None] for t in (k, v))
        lq, lk = b - a, d - c
        mask = None  # plain causal unless the keys run ahead of the queries or the window cuts them
        if lq != lk or (window is not None and lk > window):
            iq = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # each query's own key position
            ik = torch.arange(lk, device=q.device)[None, :]
            mask = ik <= iq  # [Lq, Lk]
            if window is not None:
                mask &= iq - ik <= window
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=scale
        )  # [1, H, Lq, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


def _varlen_kwargs(params, scale: float, d: int) -> tuple[dict, float]:
    """The causal/GQA/scale keywords this torch's ``varlen_attn`` takes, and the factor q must be scaled
    by where it has no ``scale`` (its default is 1/sqrt(D))."""
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        return kwargs | {"scale": scale}, 1.0
    return kwargs, scale * d**0.5


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
    """aten's flash-attention forward, causal, varlen, no dropout -> (out, lse, rng_state, unused)."""
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    return out, lse, rng, unused


def _flash_backward(g, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, rng, unused, scale: float):
    """aten's flash-attention backward matching ``_flash_forward`` -> (dq, dk, dv), dk/dv with k's heads."""
    return torch.ops.aten._flash_attention_backward(
        g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale
    )


class _FlashVarlenGQA(torch.autograd.Function):
    """Causal varlen flash attention with q [S, H, D] and k/v [Sk, G, D], G dividing H, K/V not repeated:
    query head h reads K/V head h // (H / G) inside the kernel, and its backward sums the G groups' key
    gradients itself (``varlen_attn`` of torch 2.11 has no ``enable_gqa``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        out, lse, rng, unused = _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.sizes = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, scale = ctx.sizes
        dq, dk, dv = _flash_backward(
            g.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, rng, unused, scale
        )
        return dq, dk, dv, None, None, None, None, None


def _gqa_direct(device: torch.device) -> bool:
    return GQA_DIRECT and str(device) not in _GQA_DIRECT_FAILED


@functools.cache
def _fa4_varlen():
    """FlashAttention-4's ``flash_attn_varlen_func``, or None where ``flash_attn.cute`` does not import."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - missing, or its CUDA libraries are: the other kernels serve
        return None
    return flash_attn_varlen_func


@functools.cache
def _fa4_arch_ok(device: torch.device) -> bool:
    """FA4 has forward and backward kernels for compute capability 9.x (Hopper) and 10.x/11.x (Blackwell).
    No CUDA call unless the device is CUDA and this torch has it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.get_device_capability(device)[0] in (9, 10, 11)
    except (AssertionError, RuntimeError):  # a torch without CUDA that was told otherwise (tests)
        return False


def _use_fa4(device: torch.device) -> bool:
    """FA4 on: not switched off, not failed on ``device``, a GPU it has kernels for, and it imports (checked
    in that order, so a CPU tensor never imports it)."""
    return FA4 and str(device) not in _FA4_FAILED and _fa4_arch_ok(device) and _fa4_varlen() is not None


def _fa4_for(q: torch.Tensor, k: torch.Tensor) -> bool:
    """``_use_fa4`` and FA4 passed its trial at this head layout (q [S, H, D], k [Sk, G, D]): the first call
    at a new layout runs the trial there (forward and backward against the float32 loop); a failure warns
    once and leaves that layout to the next kernel."""
    if not _use_fa4(q.device):
        return False
    key = (str(q.device), q.dtype, q.shape[1], k.shape[1], q.shape[2])
    if key not in _FA4_LAYOUTS:
        _FA4_LAYOUTS[key] = True  # the trial below runs through this path
        ok, why = _guarded_trial(q.device, q.dtype, True, heads=key[2], groups=key[3], dim=key[4])
        _FA4_LAYOUTS[key] = ok
        if not ok:
            h, g, d = key[2:]
            warnings.warn(f"flash-attn-4 failed its trial at {h} query heads, {g} KV heads, head dim {d} "
                          f"({why}); attention at that layout runs on the next kernel", stacklevel=2)  # fmt: skip
    return _FA4_LAYOUTS[key]


_ATEN_GQA = "aten flash (GQA unrepeated)"


def _gqa_kernel(device: torch.device, params) -> str:
    """The kernel after FA4 for GQA inputs on ``device`` (``params``: ``varlen_attn``'s signature parameters):
    torch's ``varlen_attn`` where it takes ``enable_gqa``, else aten's flash attention with K/V unrepeated
    unless that failed its trial there, else ``varlen_attn`` on repeated K/V."""
    return _ATEN_GQA if "enable_gqa" not in params and _gqa_direct(device) else "torch varlen_attn"


def varlen_kernel(device: torch.device, layout: tuple | None = None) -> str:
    """Which kernel ``varlen_attention`` runs GQA inputs through on ``device`` now: "flash-attn-4",
    "aten flash (GQA unrepeated)" or "torch varlen_attn"; ``layout`` (dtype, query heads, KV heads, head dim):
    at that head layout (FA4 may have failed its trial there)."""
    from torch.nn.attention.varlen import varlen_attn

    if _use_fa4(device) and (layout is None or _FA4_LAYOUTS.get((str(device), *layout), True)):
        return "flash-attn-4"
    return _gqa_kernel(device, inspect.signature(varlen_attn).parameters)


# The kernels a failed trial drops, in the order ``varlen_kernel`` prefers them: the set it marks the device in.
_DROPPABLE = {"flash-attn-4": _FA4_FAILED, _ATEN_GQA: _GQA_DIRECT_FAILED}


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                     cu_k: torch.Tensor | None = None, max_k: int | None = None):  # fmt: skip
    """``segment_attention`` through a varlen flash-attention kernel (CUDA, fp16/bf16; FA4, aten's flash
    attention or torch's ``varlen_attn``: module docstring); with ``cu_k`` / ``max_k`` the key segments differ
    from the query ones (causal aligned at the end, flash attention's rule)."""
    cu = cu_seqlens.to(torch.int32)
    cu_k = cu if cu_k is None else cu_k.to(torch.int32)
    max_k = max_seqlen if max_k is None else max_k
    if _fa4_for(q, k):  # GQA inside the kernel; deterministic backward where torch is asked for it
        out = _fa4_varlen()(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen, max_seqlen_k=max_k,
            softmax_scale=scale, causal=True, deterministic=torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out  # (out, lse)
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs, q_factor = _varlen_kwargs(params, scale, q.shape[-1])
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif _gqa_kernel(q.device, params) == _ATEN_GQA:  # flash attention's own GQA: no repeated K/V
            return _FlashVarlenGQA.apply(q, k, v, cu, cu_k, max_seqlen, max_k, scale)
        else:  # query head h reads kv head h // (H / G)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [S, H, D]
    if q_factor != 1.0:
        q = q * q_factor
    return varlen_attn(q, k, v, cu, cu_k, max_seqlen, max_k, **kwargs)


def _trial(device: torch.device, dtype: torch.dtype, shared: bool, heads: int = 4, groups: int = 2,
           dim: int = 64) -> tuple[bool, str]:  # fmt: skip
    """``varlen_attention`` (its kernel now: ``varlen_kernel``) on a small GQA input (``heads`` query heads,
    ``groups`` KV heads, head dim ``dim``), forward and backward, against the per-segment loop; ``shared``:
    with key segments longer than the query ones (a prompt of 5, responses of 3 and 4). Both run at
    ``dtype`` and are measured against the loop in float32 on the same inputs: the kernel passes when its
    largest relative error (output, dq, dk) is within twice the loop's, or 2e-2. Gradients are on whatever
    context the first packed forward runs in (a no-grad log-prob pass, say); the errors cover the output and
    the q, k and v gradients. Returns (ok, the errors)."""
    with torch.inference_mode(False), torch.enable_grad():
        g = torch.Generator(device=device).manual_seed(0)
        base = [torch.randn(24, h, dim, generator=g, device=device) for h in (heads, groups, groups)]
        cu = torch.tensor([0, 5, 17, 24], device=device, dtype=torch.int32)
        idx = torch.tensor([*range(5), *range(5), 5, 6, 7, *range(5), 8, 9, 10, 11], device=device)
        cq, ck = (torch.tensor(c, device=device, dtype=torch.int32) for c in ([0, 5, 8, 12], [0, 5, 13, 22]))

        def run(at: torch.dtype, varlen: bool) -> list[torch.Tensor]:
            q, k, v = (x.to(at).requires_grad_() for x in base)
            if shared:
                o = (shared_attention(q[:12], k[:12], v[:12], cq, idx, ck, 5, 9, 0.1, None, varlen=True) if varlen
                     else segment_attention(q[:12], k[:12], v[:12], cq, 0.1, kv_index=idx, cu_k=ck))  # fmt: skip
            else:
                o = varlen_attention(q, k, v, cu, 12, 0.1) if varlen else segment_attention(q, k, v, cu, 0.1)
            dq, dk, dv = torch.autograd.grad(o.float().square().sum(), (q, k, v))
            return [o.float(), dq.float(), dk.float(), dv.float()]

        ref = run(torch.float32, False)

        @torch.no_grad()
        def err(outs: list[torch.Tensor]) -> float:
            return max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(outs, ref))

        e_varlen, e_loop = err(run(dtype, True)), err(run(dtype, False))
    kernel = varlen_kernel(device, (dtype, heads, groups, dim))
    why = f"largest relative error vs float32: {kernel} {e_varlen:.1e}, per-segment SDPA {e_loop:.1e}"
    return e_varlen <= max(2 * e_loop, 2e-2), why


def _guarded_trial(device: torch.device, dtype: torch.dtype, shared: bool, **layout) -> tuple[bool, str]:
    try:
        return _trial(device, dtype, shared, **layout)
    except Exception as exc:  # noqa: BLE001 - any failure: the loop is exact, only slower
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0]


def varlen_available(device: torch.device, dtype: torch.dtype, shared: bool = False) -> bool:
    """Whether ``varlen_attention`` runs and matches the loop on ``device`` at ``dtype`` (tried once; for
    shared-prompt key segments separately; ``varlen_notes`` says why)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # the key tensors' devices give
    key = (str(device), dtype, shared)
    if key not in _VARLEN_OK:
        ok, why = False, "not a CUDA fp16/bf16 tensor"
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            ok, why = _guarded_trial(device, dtype, shared)
            dropped = []
            while not ok and (kernel := varlen_kernel(device)) in _DROPPABLE:  # again with the next kernel
                _DROPPABLE[kernel].add(str(device))
                dropped.append(f"{kernel} failed it ({why})")
                ok, why = _guarded_trial(device, dtype, shared)
                if varlen_kernel(device) == kernel:  # not dropped after all (the sets were replaced): stop
                    break
            if dropped:
                why = f"{why}; before that " + "; ".join(dropped)
                for other in [k for k, on in _VARLEN_OK.items() if k[0] == str(device) and on]:
                    del _VARLEN_OK[other], _VARLEN_WHY[other]  # passed with a dropped kernel: asked again
                if ok:
                    warnings.warn(f"packed attention: {why}: {varlen_kernel(device)} on this device from now "
                                  "on", stacklevel=2)  # fmt: skip
            if not ok:
                warnings.warn(f"varlen flash attention unusable ({why}); packed attention runs per sequence "
                              "(exact, slower)", stacklevel=2)  # fmt: skip
        _VARLEN_OK[key], _VARLEN_WHY[key] = ok, why
    return _VARLEN_OK[key]


def agree_on_varlen(device: torch.device, dtype: torch.dtype, shared: bool, group=None) -> bool:
    """``varlen_available`` agreed by every rank of ``group`` (default: the world): false everywhere if any
    rank's trial failed. The shared-prompt choice (``share_prompts=auto``) follows it, so every rank of a
    TP/PP group builds the same micro-batch layout (a disagreement would hang the pipeline's collectives)."""
    ok = varlen_available(device, dtype, shared)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        flag = torch.tensor([int(ok)], device=device if device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        if ok and not bool(flag):
            key = (str(device), dtype, shared)
            _VARLEN_OK[key], _VARLEN_WHY[key] = (
                False,
                f"another rank's trial failed (this rank's: {_VARLEN_WHY[key]})",
            )
            ok = False
    return ok


def packed_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float, window: int | None):
    """q [S, H, D], k/v [S, G, D] of packed sequences -> [S, H, D], causal within each sequence."""
    if window is None and varlen_available(q.device, q.dtype):
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return segment_attention(q, k, v, cu_seqlens, scale, window)


def shared_attention(q, k, v, cu_q, kv_index, cu_k, max_q: int, max_k: int, scale: float, window: int | None,
                     varlen: bool | None = None, kv_order=None, kv_ptr=None):  # fmt: skip
    """Shared-prompt attention (``SegmentSeqParams`` with ``kv_index``): q [S, H, D], k/v [S, G, D] -> [S, H, D]. On the GPU
    one varlen call over the gathered key segments (a prompt's keys repeat once per response: G/H of the
    query bytes, small with GQA). Their gradients are summed back into the one prompt copy by
    ``kernels.gather_rows`` where ``kv_order`` / ``kv_ptr`` are given and its kernel serves (in a fixed
    order), else by autograd's ``index_add_``."""
    if varlen is None:
        varlen = window is None and varlen_available(q.device, q.dtype, shared=True)
    if not varlen:
        return segment_attention(q, k, v, cu_q, scale, window, kv_index=kv_index, cu_k=cu_k)
    ks, vs = gather_rows.gather_kv(k, v, kv_index, kv_order, kv_ptr)  # [Sk, G, D]
    return varlen_attention(q, ks, vs, cu_q, max_q, scale, cu_k=cu_k, max_k=max_k)


def segment_params_attention(q, k, v, p: SegmentSeqParams, scale: float, window: int | None):
    """q [S, H, D], k/v [S, G, D] of a packed row described by ``p`` -> [S, H, D]: ``shared_attention``
    where ``p`` has shared-prompt key segments, else ``packed_attention``."""
    if p.kv_index is not None:
        return shared_attention(q, k, v, p.segments_q, p.kv_index, p.segments_k, p.max_q, p.max_k, scale, window,
                                kv_order=p.kv_order, kv_ptr=p.kv_ptr)  # fmt: skip
    return packed_attention(q, k, v, p.segments_q, p.max_q, scale, window)


def varlen_status() -> dict[str, bool]:
    """Where varlen flash attention was tried so far and whether it is used there ("cuda:0 torch.bfloat16":
    True, "... shared" for shared-prompt key segments)."""
    return {f"{dev} {dtype}{' shared' if sh else ''}": ok for (dev, dtype, sh), ok in _VARLEN_OK.items()}


def varlen_notes() -> dict[str, str]:
    """``varlen_status``'s keys -> the trial's measured errors (or the exception that stopped it)."""
    return {f"{dev} {dtype}{' shared' if sh else ''}": why for (dev, dtype, sh), why in _VARLEN_WHY.items()}


def fa4_layout_status() -> dict[str, bool]:
    """Where FA4 ran its head-layout trial and whether it passed ("cuda:0 torch.bfloat16 14/2/64": True)."""
    return {f"{dev} {dtype} {h}/{g}/{d}": ok for (dev, dtype, h, g, d), ok in _FA4_LAYOUTS.items()}
