"""A Triton backward for the trainer's RMSNorm (``models.spec.RMSNorm``); the forward is torch's fused kernel
(``aten._fused_rms_norm``, what ``F.rms_norm`` runs on the GPU: the same bits as before), whose saved 1/rms
per row the backward reads.

Why: torch's backward reduces the weight gradient in its own kernel (``GammaBetaBackward``): measured on an
H200 in the 0.5B GRPO update (session 18, ``results/2026-12-04-h200-session18/cA/prof``) 187 us per call at
34,816 x 896 bf16, where reading x and the incoming gradient and writing dx takes ~40 us at the HBM rate;
inductor's compiled norm was slower still (3.3x torch's, ``bench_update_kernels.py``). Here each program
walks a run of rows in tiles: it writes dx and adds dy * x_hat into an fp32 partial weight gradient it keeps
for all its rows; one sum over the programs' partials gives the weight gradient.

Measured (session 20, H100, ``results/2026-12-05-h200-session20``): the backward alone 112 against torch's 197
us at 34,816 x 896 and 200 against 300 us at 34,816 x 2,048 (call G's sweep); in the 0.5B GRPO step the update
2.146 s against 2.177 s (call H, three timed steps each: 2.135-2.151 against 2.176-2.178). On by default up to
2,048 columns (the widths measured); ``MEGATRON_RL_TRITON_RMSNORM=1`` takes it at every width up to 16,384,
``=0`` turns it off. Tests run it on CPU under Triton's interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from megatron_rl.kernels.compile import env_switch, trial_once

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

if HAVE_TRITON:
    from megatron_rl.kernels.decode_fused import _round_to


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["rows", "rows_per"])  # one kernel for every micro-batch's row count
    def _backward_kernel(x_ptr, dy_ptr, w_ptr, dx_ptr, dw_ptr, rstd_ptr, dres_ptr, rows, hidden, stride_x,
                         stride_dy, stride_dx, stride_dres, eps, rows_per, tile: tl.constexpr, block: tl.constexpr,
                         saved_rstd: tl.constexpr, add_res: tl.constexpr):  # fmt: skip
        # rows_per is a runtime value: it follows the row count, which changes with every token-budgeted
        # micro-batch, and as a constexpr each new value would compile the kernel again. Rows go in tiles
        # of ``tile`` (one load of [tile, block] each): one row at a time, each with two reductions across
        # the program's warps before its stores, kept too few loads in flight.
        pid = tl.program_id(0)
        cols = tl.arange(0, block)
        live_c = cols < hidden
        w = tl.load(w_ptr + cols, mask=live_c, other=0.0).to(tl.float32)
        dw = tl.zeros([tile, block], tl.float32)
        first = pid * rows_per
        for i in range(0, rows_per, tile):
            k = i + tl.arange(0, tile)
            r = first + k  # [tile]
            m = ((r < rows) & (k < rows_per))[:, None] & live_c[None, :]  # [tile, block]
            rr = r.to(tl.int64)[:, None]
            x = tl.load(x_ptr + rr * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rr * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if saved_rstd:  # the forward's (torch's fused kernel): one row reduction fewer
                rstd = tl.load(rstd_ptr + r, mask=(r < rows) & (k < rows_per), other=0.0)  # [tile]
            else:
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / hidden + eps)  # [tile]
            xhat = x * rstd[:, None]
            wdy = w[None, :] * dy
            dx = rstd[:, None] * (wdy - xhat * (tl.sum(wdy * xhat, 1) / hidden)[:, None])
            # ``add_rms_norm``: the sum's own gradient (its residual uses) joins dx before one rounding
            if add_res:
                dx += tl.load(dres_ptr + rr * stride_dres + cols[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + rr * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
            dw += dy * xhat  # 0 outside the live rows and columns (loads filled with 0)
        tl.store(dw_ptr + pid * hidden + cols, tl.sum(dw, 0), mask=live_c)

    @triton.jit(do_not_specialize=["rows"])
    def _add_forward_kernel(a_ptr, r_ptr, w_ptr, s_ptr, n_ptr, rstd_ptr, rows, hidden, eps, tile: tl.constexpr,
                            block: tl.constexpr):  # fmt: skip
        # a, r, s, n: contiguous [rows, hidden]. s = a + r rounded to the activations' dtype (as torch's add),
        # then RMSNorm of the rounded s: fp32 statistics, one rounding after the weight; 1/rms per row kept
        # for the backward.
        pid = tl.program_id(0)
        cols = tl.arange(0, block)
        live_c = cols < hidden
        r = pid * tile + tl.arange(0, tile)
        live_r = r < rows
        m = live_r[:, None] & live_c[None, :]
        at = r.to(tl.int64)[:, None] * hidden + cols[None, :]
        dt: tl.constexpr = s_ptr.dtype.element_ty
        x = tl.load(a_ptr + at, mask=m, other=0.0).to(tl.float32)
        x = _round_to(x + tl.load(r_ptr + at, mask=m, other=0.0).to(tl.float32), dt)
        tl.store(s_ptr + at, x.to(dt), mask=m)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / hidden + eps)
        tl.store(rstd_ptr + r, rstd, mask=live_r)
        w = tl.load(w_ptr + cols, mask=live_c, other=0.0).to(tl.float32)
        tl.store(n_ptr + at, _round_to(x * rstd[:, None] * w[None, :], dt).to(dt), mask=m)


RUN_ON_CPU = False
ON_CUDA = env_switch("MEGATRON_RL_TRITON_RMSNORM", True)
# widest rows taken by default (the widths measured); set to 1, the switch takes every width up to 16,384
MEASURED_HIDDEN = 16384 if env_switch("MEGATRON_RL_TRITON_RMSNORM", False) else 2048
PROBE = "the Triton RMSNorm backward"


def usable(x: Tensor) -> bool:
    """Whether ``rms_norm`` takes the Triton backward for x [..., H]: Triton importable, on CUDA with
    ``ON_CUDA`` and H <= ``MEASURED_HIDDEN`` (or CPU with ``RUN_ON_CPU``, H <= 16384), bf16/fp16/fp32, and a
    trial at that device, dtype and H agreed with autograd (a failure warns once; torch's backward serves
    from then on)."""
    dev = x.device.type
    return (
        HAVE_TRITON
        and ((ON_CUDA and dev == "cuda") or (RUN_ON_CPU and dev == "cpu"))
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.shape[-1] <= (16384 if dev == "cpu" else MEASURED_HIDDEN)
        and trial_once(
            f"{PROBE} ({dev}, {x.dtype}, H={x.shape[-1]})",
            lambda: _trial(x.device, x.dtype, x.shape[-1]),
            "The Triton RMSNorm backward failed its trial; torch's backward serves (slower, same results).",
        )
    )


def _trial(device, dtype, hidden: int) -> None:
    """The kernel at the real width (its block and tile are compile-time constants of it) on 37 rows in 3
    programs (a multi-tile, ragged run) against autograd through torch's ``F.rms_norm`` in fp32."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs mid-training
    with torch.inference_mode(False), torch.enable_grad():  # the first call may come inside either
        x, dy = (torch.randn(37, hidden, generator=g).to(device, dtype) for _ in range(2))
        w = (0.5 + torch.rand(hidden, generator=g)).to(device, dtype)
        dx, dw = backward(x, w, dy, 1e-6, programs=3, rstd=_forward(x, w, 1e-6)[1])
        xr, wr = x.float().requires_grad_(True), w.float().requires_grad_(True)
        F.rms_norm(xr, (hidden,), wr, 1e-6).backward(dy.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    gap = max(
        float((dx.float() - xr.grad).abs().max()),
        float((dw.float() - wr.grad).abs().max() / wr.grad.abs().max()),
    )
    if not gap <= tol:  # nan fails too
        raise RuntimeError(f"largest gap to autograd through F.rms_norm {gap:.3g}")


def blocks_for(hidden: int) -> tuple[int, int, int, int]:
    """(block, tile, num_warps, programs) for rows of ``hidden``, from the sweep of session 20 (H100,
    34,816 rows, ``bench_update_kernels.py``; backward alone, torch's 197 / 300 us): 896 columns 2 rows x
    2 warps over 2048 programs 112 us (8 x 8 over 1024: 138 us; 1 x 4 over 4096: 109 us), 2048 columns
    4 x 4 over 1024 programs 200 us. Wider rows (not swept): one row over 8 warps."""
    block = triton.next_power_of_2(hidden)
    if block <= 1024:
        return block, 2, 2, 2048
    if block <= 2048:
        return block, 4, 4, 1024
    return block, 1, 8, 1024


def backward(
    x: Tensor, weight: Tensor, dy: Tensor, eps: float, programs: int | None = None,
    tile: int | None = None, num_warps: int | None = None, rstd: Tensor | None = None,
    residual_grad: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """x, dy [N, H], weight [H] -> (dx [N, H] in x's dtype, dweight [H] in weight's dtype). ``programs`` /
    ``tile`` / ``num_warps``: ``blocks_for``'s unless given (the benchmark's sweep). ``rstd`` [N] fp32: the
    forward's 1/rms per row (else recomputed from x). ``residual_grad`` [N, H]: added to dx in fp32 before
    its one rounding (``add_rms_norm``: x's gradient from its other uses)."""
    rows, hidden = x.shape
    x, dy = x if x.stride(-1) == 1 else x.contiguous(), dy if dy.stride(-1) == 1 else dy.contiguous()
    res = residual_grad
    if res is not None and res.stride(-1) != 1:
        res = res.contiguous()
    block, tile0, warps0, programs0 = blocks_for(hidden)
    tile, num_warps, programs = tile or tile0, num_warps or warps0, programs or programs0
    rows_per = max(1, triton.cdiv(rows, programs))
    n = max(1, triton.cdiv(rows, rows_per))
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    part = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    saved = rstd is not None
    _backward_kernel[(n,)](x, dy, weight, dx, part, rstd.reshape(rows).float() if saved else part,
                           dx if res is None else res, rows, hidden, x.stride(0), dy.stride(0), dx.stride(0),
                           dx.stride(0) if res is None else res.stride(0), float(eps), rows_per=rows_per,
                           tile=tile, block=block, saved_rstd=saved, add_res=res is not None,
                           num_warps=num_warps)  # fmt: skip
    return dx, part.sum(0).to(weight.dtype)


def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    """torch's fused RMSNorm forward and its per-row 1/rms where this torch has the op: inside an autograd
    Function (grad off) ``F.rms_norm`` took a composite path of several kernels (H100, 34,816 x 896: the
    Triton backward's forward + backward 622 us against torch's 251, its backward alone 138 us)."""
    op = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if op is not None and weight.dtype == x.dtype:  # F.rms_norm's own condition for its fused kernel
        try:
            out, rstd = op(x, [x.shape[-1]], weight, eps)
            return out, rstd
        except (RuntimeError, NotImplementedError):  # a build without the kernel on this device
            pass
    return F.rms_norm(x, (x.shape[-1],), weight, eps), None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, *(() if rstd is None else (rstd,)))
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, *rstd = ctx.saved_tensors
        dx, dw = backward(x, weight, dy, ctx.eps, rstd=rstd[0] if rstd else None)
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of x [..., H]: torch's forward; the Triton backward where ``usable``."""
    if not (weight.requires_grad or x.requires_grad) or torch.is_inference_mode_enabled() or not usable(x):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    lead = x.shape[:-1]
    return _RMSNorm.apply(x.reshape(-1, x.shape[-1]), weight, eps).view(*lead, x.shape[-1])


# --- the residual add fused with the RMSNorm after it (``models.spec.AddNormBDA``) ---------------------
# MEGATRON_RL_FUSED_ADD_NORM=0 (or false/off/no) turns it off: megatron-core's bias-dropout-add and the norm run
# as before. Measured: see ``add_rms_norm``.
ADD_NORM_ON_CUDA = env_switch("MEGATRON_RL_FUSED_ADD_NORM", True)
ADD_NORM_PROBE = "the fused residual add + RMSNorm"


def forward_tile(hidden: int) -> tuple[int, int, int]:
    """(block, rows a program, num_warps) of ``_add_forward_kernel`` for rows of ``hidden``: ~4,096 elements a
    program (hidden 896: 4 rows of 1,024 lanes over 4 warps), 8 warps from 4,096 columns."""
    block = triton.next_power_of_2(hidden)
    return block, max(1, 4096 // block), 4 if block <= 2048 else 8


def add_forward(a: Tensor, r: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """a, r [..., H] (contiguous, one dtype), weight [H] -> (s = a + r, rms_norm(s) * weight, 1/rms [N] fp32):
    one read of each summand, one write of each output."""
    hidden = a.shape[-1]
    rows = a.numel() // hidden
    s, n = torch.empty_like(a), torch.empty_like(a)
    rstd = torch.empty(rows, dtype=torch.float32, device=a.device)
    block, tile, warps = forward_tile(hidden)
    _add_forward_kernel[(triton.cdiv(rows, tile),)](a, r, weight, s, n, rstd, rows, hidden, float(eps), tile=tile,
                                                    block=block, num_warps=warps)  # fmt: skip
    return s, n, rstd


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, r, weight, eps):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero-filled tensor
        s, n, rstd = add_forward(a, r, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        ctx.eps = eps
        return s, n

    @staticmethod
    @once_differentiable
    def backward(ctx, ds, dn):
        s, weight, rstd = ctx.saved_tensors
        if dn is None:  # the norm's output went unused: the sum's gradient passes to both summands
            return ds, ds, None, None
        hidden = s.shape[-1]
        dx, dw = backward(s.reshape(-1, hidden), weight, dn.reshape(-1, hidden), ctx.eps, rstd=rstd,
                          residual_grad=None if ds is None else ds.reshape(-1, hidden))  # fmt: skip
        dx = dx.view(s.shape)
        return dx, dx, dw if ctx.needs_input_grad[2] else None, None


def add_rms_norm(a: Tensor, r: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, n): s = a + r (a residual add), n = RMSNorm(s) * weight, in one kernel (``fusable`` first). Backward:
    one kernel writes s's gradient, its residual part added inside the norm's backward, where autograd would
    add the two in a kernel of its own; the weight gradient as ``backward``'s.

    Bytes a call at N x H (bf16): the forward reads 2 and writes 2 (the add and the norm apart: 3 + 2); the
    backward reads 3 and writes 1 (apart: 3 + 3). Measured (session 32, H100, 34,816 x 896 bf16): the forward
    90 against 116 us apart; the backward 121 against 89 us for the norm's alone, where autograd's add of the
    two gradients (~59 us) goes; the 0.5B GRPO step 1.0% faster.

    Autograd records the pair only where a summand needs a gradient (as it would for the add). megatron-core
    runs its bias-dropout-add slot with gradients on even inside no-grad passes, so the weight's own
    ``requires_grad`` does not count: where only the weight needs one, ``take_normed`` refuses the output and
    the norm runs itself."""
    if (
        torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and (a.requires_grad or r.requires_grad)
    ):
        return _AddRMSNorm.apply(a, r, weight, eps)
    return add_forward(a, r, weight, eps)[:2]


def fusable(a: Tensor, r: Tensor, weight: Tensor) -> bool:
    """Whether ``add_rms_norm`` takes a and r: ``ADD_NORM_ON_CUDA`` on CUDA; a, r and the weight of one dtype and
    device, a and r contiguous of one shape; ``usable(a)`` (its backward is this module's Triton backward: that
    kernel's switches, widths, dtypes and trial); and a trial of the pair at that device, dtype and H against
    autograd through ``F.rms_norm`` (a failure warns once; the add and the norm run apart from then on)."""
    return (
        (ADD_NORM_ON_CUDA or a.device.type != "cuda")
        and a.dtype == r.dtype == weight.dtype
        and a.shape == r.shape
        and a.device == r.device == weight.device
        and a.is_contiguous()
        and r.is_contiguous()
        and usable(a)
        and trial_once(
            f"{ADD_NORM_PROBE} ({a.device.type}, {a.dtype}, H={a.shape[-1]})",
            lambda: _add_trial(a.device, a.dtype, a.shape[-1]),
            "The fused residual add + RMSNorm failed its trial; the add and the norm run apart (same math).",
        )
    )


def _add_trial(device, dtype, hidden: int) -> None:
    """The fused forward and backward at the real width on 37 rows (several programs, a ragged last one)
    against autograd through ``a + r`` and ``F.rms_norm`` in fp32: both outputs, both summands' gradients
    (the norm's and the sum's own, added) and the weight's."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs mid-training
    with torch.inference_mode(False), torch.enable_grad():  # the first call may come inside either
        a, r, ds, dn = (torch.randn(37, hidden, generator=g).to(device, dtype) for _ in range(4))
        w = (0.5 + torch.rand(hidden, generator=g)).to(device, dtype)
        leaves = [t.detach().clone().requires_grad_(True) for t in (a, r, w)]
        s, n = _AddRMSNorm.apply(*leaves, 1e-6)
        torch.autograd.backward((s, n), (ds, dn))
        refs = [t.detach().float().requires_grad_(True) for t in (a, r, w)]
        s_ref = refs[0] + refs[1]
        n_ref = F.rms_norm(s_ref, (hidden,), refs[2], 1e-6)
        torch.autograd.backward((s_ref, n_ref), (ds.float(), dn.float()))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    pairs = [(s, s_ref), (n, n_ref)] + [(t.grad, ref.grad) for t, ref in zip(leaves, refs)]
    gap = max(  # all detached: a float() of a tensor that requires grad warns in the run's log
        float((x.detach().float() - y.detach()).abs().max() / y.detach().abs().max().clamp(min=1.0))
        for x, y in pairs
    )
    if not gap <= tol:  # nan fails too
        raise RuntimeError(f"largest gap to autograd through a + r and F.rms_norm {gap:.3g}")


def stash_normed(s: Tensor, norm: torch.nn.Module, n: Tensor) -> Tensor:
    """Marks the sum s as already normalised by ``norm`` (n): ``take_normed`` returns n when that norm gets s."""
    s._megatron_rl_normed = (weakref.ref(norm), n)
    return s


def take_normed(x: Tensor, norm: torch.nn.Module) -> Tensor | None:
    """The output ``stash_normed`` left on x for ``norm`` (removed from x), or None. Refused (None: the norm runs
    itself) where this call needs a graph the output does not carry: with gradients on and x or the weight
    needing one, the output must come from the very autograd node that made x. Not so for a sum that left a
    recomputed (checkpointed) chunk of layers, which autograd re-wraps, nor for one made without a graph."""
    stash = x.__dict__.pop("_megatron_rl_normed", None)
    if stash is None or stash[0]() is not norm:
        return None
    n = stash[1]
    if torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad):
        if n.grad_fn is None or n.grad_fn is not x.grad_fn:
            return None
    return n
