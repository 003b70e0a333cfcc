"""Fused elementwise kernels for the rollout decode step (one token per sequence).

Between the GEMMs and the attention a decode step ran, per layer: RoPE as a batched matmul with a
[B, D, D] rotation matrix, two indexed KV-cache writes, two residual adds and RMSNorms, and SwiGLU as
two GEMMs plus SiLU and product kernels. Here:

- ``rope_kv_write``: rotates q and k of one step, writes rotated k and raw v into the cache at each
  row's position and returns the rotated q (one kernel for the bmm and both cache writes);
- ``swiglu``: silu(gate) * up on ONE fc1 output (fp32 inside, one rounding: ``kernels.swiglu``);
- ``add_rms_norm``: x + y rounded to x's dtype, then RMSNorm of it (fp32 statistics, one rounding after
  the weight, as ``F.rms_norm``), both returned.

Each kernel is tried once on a small input against its reference ops (``usable``): one that raises or
disagrees is reported in a warning and the decoder keeps its reference ops. Runs on CUDA with bf16/fp16
where Triton is installed; tests run it on CPU under Triton's interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_rl.kernels.compile import env_switch
from megatron_rl.kernels.rope import apply_rope

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the reference ops serve
    HAVE_TRITON = False


if HAVE_TRITON:
    try:  # programmatic dependent launch (``PDL``): Triton >= 3.4 on sm90+
        from triton.language.extra.cuda import gdc_wait

        HAVE_GDC = True
    except ImportError:
        HAVE_GDC = False

        @triton.jit
        def gdc_wait():
            pass

    @triton.jit
    def _round_to(x, dt: tl.constexpr):
        """fp32 x rounded to dtype ``dt`` to nearest, ties to even (as torch's casts), kept in fp32. bf16 by
        its bits: Triton's interpreter truncates a bf16 cast, the GPU rounds, and both sides must agree. A NaN
        stays itself (adding to its bits could carry into the sign and exponent: -0.0 or inf); a finite value
        past bf16's largest rounds to inf, as the cast does."""
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        else:
            return x.to(dt).to(tl.float32)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
        s_b, s_g, s_r, s_d, sc_b, sc_d, sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t,
        groups: tl.constexpr, rep: tl.constexpr, rows: tl.constexpr, dim: tl.constexpr, exact: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        if PDL:  # launched before the kernel ahead of it finished: its writes are visible from here
            gdc_wait()
        pid = tl.program_id(0).to(tl.int64)  # slot x (groups x T x D) passes 2^31 in a long cache
        b = pid // groups
        g = pid % groups
        r = tl.arange(0, rows)
        d = tl.arange(0, dim)
        rolled = (d + dim // 2) % dim  # out[j] = x[j] cos[j] + x[(j + D/2) % D] signed_sin[j]
        base = qkv_ptr + b * s_b + g * s_g + r[:, None] * s_r
        live = r[:, None] < rep + 2
        x = tl.load(base + d[None, :] * s_d, mask=live, other=0.0)  # [rows, dim]
        xr = tl.load(base + rolled[None, :] * s_d, mask=live, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + b * sc_b + d * sc_d).to(tl.float32)
        sin = tl.load(sin_ptr + b * sc_b + d * sc_d).to(tl.float32)
        if exact:  # each product and the sum rounded, as the eager ``x * cos + x.roll(D/2) * sin``
            dt: tl.constexpr = q_ptr.dtype.element_ty
            p_cos = _round_to(x.to(tl.float32) * cos[None, :], dt)
            p_sin = _round_to(xr * sin[None, :], dt)
            rot = _round_to(p_cos + p_sin, dt).to(dt)
        else:
            rot = (x.to(tl.float32) * cos[None, :] + xr * sin[None, :]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + b * sq_b + g * sq_g + r[:, None] * sq_r + d[None, :], rot, mask=r[:, None] < rep)
        pos = tl.load(pos_ptr + b)
        k_at = k_ptr + b * sk_b + g * sk_g + pos * sk_t + d[None, :] + r[:, None] * 0
        tl.store(k_at, rot.to(k_ptr.dtype.element_ty), mask=r[:, None] == rep)
        v_at = v_ptr + b * sv_b + g * sv_g + pos * sv_t + d[None, :] + r[:, None] * 0
        tl.store(v_at, x.to(v_ptr.dtype.element_ty), mask=r[:, None] == rep + 1)

    @triton.jit
    def _swiglu_kernel(y_ptr, out_ptr, s_y, s_o, ffn, block: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:
            gdc_wait()
        row = tl.program_id(0)
        f = tl.program_id(1) * block + tl.arange(0, block)
        live = f < ffn
        gate = tl.load(y_ptr + row * s_y + f, mask=live, other=0.0).to(tl.float32)
        up = tl.load(y_ptr + row * s_y + ffn + f, mask=live, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * s_o + f, out.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, y_ptr, w_ptr, x_out_ptr, h_ptr, S, s_ys, s_x, s_y, s_xo, s_h, hidden, eps, block: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        if PDL:
            gdc_wait()
        # y: S summands in order (one for ``add_rms_norm``; ``decode_gemm``'s split-K partials, fp32), their sum
        # rounded to the activation dtype as a GEMM's output is
        row = tl.program_id(0)
        c = tl.arange(0, block)
        live = c < hidden
        dt: tl.constexpr = x_out_ptr.dtype.element_ty
        y = tl.zeros([block], tl.float32)
        for s in range(0, S):
            y += tl.load(y_ptr + s * s_ys + row * s_y + c, mask=live, other=0.0).to(tl.float32)
        y = _round_to(y, dt)
        x = tl.load(x_ptr + row * s_x + c, mask=live, other=0.0).to(tl.float32)
        xf = _round_to(x + y, dt)  # rounded as ``x = x + y`` is
        tl.store(x_out_ptr + row * s_xo + c, xf.to(dt), mask=live)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
        w = tl.load(w_ptr + c, mask=live, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * s_h + c, (xf * rstd * w).to(h_ptr.dtype.element_ty), mask=live)


# Tests run the kernels on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
# On by default on CUDA: measured on one H200 (session 9, ``benchmarks/profile_decode_step.py``, batch 512,
# CUDA graphs) the decode step takes 3.95 -> 3.06 ms at the Qwen2.5-0.5B shape and 10.20 -> 8.97 ms at 3B;
# MEGATRON_RL_FUSED_DECODE=0 (or false/off/no) keeps the reference ops (each kernel also runs only after its trial passes).
ON_CUDA = env_switch("MEGATRON_RL_FUSED_DECODE", True)
# MEGATRON_RL_DECODE_PDL=1: the decode step's Triton kernels (RoPE + KV write, attention, SwiGLU, add + RMSNorm)
# launch with programmatic dependent launch, so each may start while the kernel ahead of it drains (it waits
# for that kernel's writes first). Off until measured on a GPU (``benchmarks/probe_pdl.py``).
PDL = env_switch("MEGATRON_RL_DECODE_PDL", False)


def pdl(device: torch.device) -> dict:
    """Launch options of a decode kernel: with ``PDL`` on a CUDA GPU of compute capability 9.0+ (and a Triton
    that has it) the kernel's ``PDL`` flag and ``launch_pdl``; else none."""
    if (
        PDL
        and HAVE_TRITON
        and HAVE_GDC
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
    ):
        return {"PDL": True, "launch_pdl": True}
    return {}


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, exact: bool = False) -> torch.Tensor:  # fmt: skip
    """One decode step's RoPE and KV-cache write.

    qkv [B, G, rep+2, D] (per group rep query heads, then k, then v; any strides), cos / signed sin [B, D]
    (``kernels.rope.rope_cos_sin``; unit stride not needed), positions [B], k_cache / v_cache [B, G, T, D]
    (unit stride in D). Writes rotated k and raw v at each row's position; returns rotated q
    [B, G, rep, D] (contiguous, qkv's dtype). Products and the sum in fp32, one rounding (as the bmm with
    ``kernels.rope.rope_matrix``); ``exact`` (``rollout.exact_logprobs``): each product and the sum rounded to
    qkv's dtype, the same bits as the eager ``kernels.rope.apply_rope`` the trainer's exact path computes."""
    bsz, groups, rows2, dim = qkv.shape
    rep = rows2 - 2
    q = torch.empty(bsz, groups, rep, dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(bsz * groups,)](
        qkv, cos, sin, positions, q, k_cache, v_cache,
        qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3), cos.stride(0), cos.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        groups=groups, rep=rep, rows=triton.next_power_of_2(rows2), dim=dim, exact=exact,
        num_warps=1 if dim <= 64 else 2, **pdl(qkv.device),
    )  # fmt: skip
    return q


def swiglu(y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """y [N, 2F] (gate half, then up half; unit stride in the last dim) -> silu(gate) * up [N, F] in y's
    dtype, fp32 inside (``kernels.swiglu.swiglu_forward``)."""
    rows, two_f = y.shape
    ffn = two_f // 2
    out = torch.empty(rows, ffn, dtype=y.dtype, device=y.device)
    _swiglu_kernel[(rows, triton.cdiv(ffn, block))](
        y, out, y.stride(0), out.stride(0), ffn, block=block, **pdl(y.device)
    )
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, y [N, h] (unit stride in h), weight [h] -> (x + y [N, h] in x's dtype, rms_norm of it [N, h]):
    fp32 statistics, one rounding after the weight (as ``F.rms_norm``). y may also be [S, N, h]: S summands
    added in order and rounded to x's dtype first (``decode_gemm.add_rms_norm_parts``)."""
    rows, hidden = x.shape
    ys = y if y.dim() == 3 else y[None]
    x_new = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x_new)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](
        x, ys, weight, x_new, h, ys.shape[0], ys.stride(0), x.stride(0), ys.stride(1), x_new.stride(0),
        h.stride(0), hidden, eps, block=block, num_warps=4 if block <= 2048 else 8, **pdl(x.device),
    )  # fmt: skip
    return x_new, h


# --- references (the ops each kernel replaces) and the one-time trial -------------------------------


def rope_kv_write_reference(qkv, cos, sin, positions, k_cache, v_cache, exact: bool = False) -> torch.Tensor:
    """What ``rope_kv_write`` replaces: the decoder's rotation (a bmm with ``kernels.rope.rope_matrix``: both
    products and their sum in fp32, one rounding; ``exact``: the exact path's eager ``kernels.rope.apply_rope``,
    each op rounded to qkv's dtype) and two indexed cache writes."""
    bsz, _, rows2, dim = qkv.shape
    batch = torch.arange(bsz, device=qkv.device)
    if exact:
        rot = apply_rope(qkv, cos[:, None, None], sin[:, None, None])
    else:
        x = qkv.float()
        rot = (x * cos.float()[:, None, None] + x.roll(dim // 2, dims=-1) * sin.float()[:, None, None]).to(
            qkv.dtype
        )
    k_cache[batch, :, positions] = rot[:, :, rows2 - 2]
    v_cache[batch, :, positions] = qkv[:, :, rows2 - 1]
    return rot[:, :, : rows2 - 2]


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


def add_rms_norm_reference(x, y, weight, eps):
    x_new = x + y
    return x_new, F.rms_norm(x_new, (x.shape[-1],), weight, eps)


def _trial_rope(t: torch.Tensor, exact: bool = False):
    """At ``t``'s groups, heads per group and head dim (qkv [B, G, rep+2, D]): the real launch config."""
    g = torch.Generator().manual_seed(0)
    device, dtype = t.device, t.dtype
    bsz, (groups, rows2, dim), steps = 3, t.shape[1:], 8
    qkv = torch.randn(bsz, groups, rows2, dim, generator=g).to(device, dtype)
    pos = torch.tensor([0, 5, 7], device=device)
    freqs = pos[:, None].float() / 1e4 ** (torch.arange(0, dim, 2, device=device).float() / dim)  # [B, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [B, D], as kernels.rope.rope_cos_sin
    sign = torch.cat((-torch.ones(dim // 2, device=device), torch.ones(dim // 2, device=device)))
    cos, sin = angles.cos().to(dtype), (angles.sin() * sign).to(dtype)  # cos, signed sin [B, D]
    caches = [torch.randn(bsz, groups, steps, dim, generator=g).to(device, dtype) for _ in range(2)]
    ref_k, ref_v, k, v = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    want = rope_kv_write_reference(qkv, cos, sin, pos, ref_k, ref_v, exact=exact)
    return (rope_kv_write(qkv, cos, sin, pos, k, v, exact=exact), k, v), (want, ref_k, ref_v)


def _trial_swiglu(t: torch.Tensor):
    """At ``t``'s width (y [N, 2F]) and the default block: the real launch config."""
    y = torch.randn(3, t.shape[-1], generator=torch.Generator().manual_seed(0)).to(t.device, t.dtype)
    return (swiglu(y),), (swiglu_reference(y),)


def _trial_add_rms_norm(t: torch.Tensor):
    """At ``t``'s hidden size (x [B, h]): the real launch config."""
    g = torch.Generator().manual_seed(0)
    h = t.shape[-1]
    x, y, w = (torch.randn(s, generator=g).to(t.device, t.dtype) for s in ((3, h), (3, h), (h,)))
    return add_rms_norm(x, y, w, 1e-6), add_rms_norm_reference(x, y, w, 1e-6)


_TRIALS: dict[str, Callable] = {
    "rope_kv_write": _trial_rope,
    "rope_kv_write_exact": lambda t: _trial_rope(t, exact=True),  # must equal its reference bit for bit
    "swiglu": _trial_swiglu,
    "add_rms_norm": _trial_add_rms_norm,
}
_FAILED: dict[str, str] = {}  # kernel name -> why its trial failed
_PASSED: set[tuple] = set()  # (name, device type, dtype, trailing dims): the launch configs that passed


def enabled(t: torch.Tensor) -> bool:
    """Whether the decode step should try the fused kernels for tensors like ``t`` (``ON_CUDA`` /
    ``RUN_ON_CPU``, Triton importable, bf16/fp16 on CUDA); each kernel still passes its trial first."""
    return _serves(t)


def _serves(t: torch.Tensor) -> bool:
    on_gpu = ON_CUDA and t.device.type == "cuda" and t.dtype in (torch.bfloat16, torch.float16)
    on_cpu = RUN_ON_CPU and t.device.type == "cpu"
    return HAVE_TRITON and (on_gpu or on_cpu)


def _close(got, want, dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in zip(got, want))


def usable(name: str, t: torch.Tensor) -> bool:
    """Whether fused kernel ``name`` runs for tensors like ``t``: Triton importable, bf16/fp16 on CUDA
    (any float on CPU with ``RUN_ON_CPU``), and its one-time trial against the reference ops passed.

    The trial runs eagerly on the first call for each trailing shape (hidden size, head layout, fc1
    width: what the kernel's block sizes and warps follow), so every launch configuration the model uses
    compiles and is checked once (the engine's warm-up step precedes every CUDA-graph capture); a kernel
    not yet tried while a graph is being captured is not used in that graph."""
    if name in _FAILED or not _serves(t):
        return False
    if name.startswith("rope_kv_write") and t.shape[-1] & (t.shape[-1] - 1):  # tl.arange over the head dim
        return False
    key = (name, t.device.type, t.dtype, tuple(t.shape[1:]))
    if key in _PASSED:
        return True
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    try:
        got, want = _TRIALS[name](t)
        if name.endswith("_exact") and not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise ValueError("result is not the same bits as the reference ops")
        if not _close(got, want, t.dtype):
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            raise ValueError(f"result differs from the reference ops by up to {err:.3g}")
    except Exception as exc:  # noqa: BLE001 - any failure: keep the reference ops, loudly
        _FAILED[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        warnings.warn(
            f"The fused decode kernel {name} failed its trial; the decoder runs the reference ops instead "
            f"(slower, same results). Cause: {_FAILED[name]}",
            stacklevel=2,
        )
        return False
    _PASSED.add(key)
    return True
