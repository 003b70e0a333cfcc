"""The shared-prompt key/value gather of the update (``models.packed_attention.shared_attention``) with a
deterministic backward: each source row's gradient is the fp32 sum of its copies' gradients in a fixed
order, rounded once.

With ``actor.share_prompts`` a response segment's keys are its prompt's rows followed by its own, so the
attention's K and V are ``index_select``-ed rows of the packed row's K and V, a prompt row repeated once per
response of its group (9 copies at GRPO's n = 8). Autograd's backward of ``index_select`` is a zero-filled
buffer and ``index_add_``: on CUDA bf16 atomics, one rounding per add, in whatever order the atomics land
(not the same bits from run to run), and slow where many copies hit one row (session 26's profile: 52-67
us a call at the 0.5B micro-batch, 51,200 gathered rows of 2 KV heads x 64, where the bytes take ~7 us).

Here the copies of every source row are listed once per micro-batch (``inverse``: a stable sort of the
gather index on the device, no host sync), and one kernel walks a tile of source rows, adds each row's
copies in that order in fp32 for K and V together, and writes the sums. The forward stays
``index_select``. Measured (session 31, H100, ``benchmarks/results/2026-12-06-session31``): gaps to a float64
sum 0.0038 against the atomics' 0.0123; in the 0.5B update's profile the kernel is not among the top
kernels (``index_add_``: 20 ms a step); with the two changes below (``kernels.bias``, ``kernels.rope``'s
tables) the 0.5B fixed step ran 3.0% faster. Runs on CUDA where Triton is installed, after a trial against a float64 sum;
``MEGATRON_RL_TRITON_GATHER=0`` keeps autograd's ``index_add_``. Tests run it on CPU under Triton's
interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megatron_rl.kernels.compile import env_switch, trial_once

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: autograd's index_add_ serves
    HAVE_TRITON = False


if HAVE_TRITON:
    from megatron_rl.kernels.decode_fused import _round_to  # noqa: E402 (the interpreter truncates bf16 casts)

    @triton.jit(do_not_specialize=["rows"])  # one kernel for every micro-batch's row count
    def _segment_sum_kernel(
        gk_ptr, gv_ptr, order_ptr, ptr_ptr, dk_ptr, dv_ptr, rows, s_gk_r, s_gk_g, s_gv_r, s_gv_g,
        s_dk_r, s_dk_g, s_dv_r, s_dv_g, groups: tl.constexpr, dim: tl.constexpr, tile: tl.constexpr,
        block: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * tile + tl.arange(0, tile)  # [tile] source rows
        live_r = r < rows
        c = tl.arange(0, block)  # (group, dim) flattened
        live_c = c < groups * dim
        grp, d = c // dim, c % dim
        lo = tl.load(ptr_ptr + r, mask=live_r, other=0)
        n = tl.load(ptr_ptr + r + 1, mask=live_r, other=0) - lo  # copies of each row
        acc_k = tl.zeros([tile, block], tl.float32)
        acc_v = tl.zeros([tile, block], tl.float32)
        for j in range(0, tl.max(n, 0)):  # copy j of every row of the tile, in gather order
            take = live_r & (j < n)
            src = tl.load(order_ptr + lo + j, mask=take, other=0).to(tl.int64)[:, None]  # its gathered row
            m = take[:, None] & live_c[None, :]
            acc_k += tl.load(gk_ptr + src * s_gk_r + (grp * s_gk_g + d)[None, :], mask=m, other=0.0).to(
                tl.float32
            )
            acc_v += tl.load(gv_ptr + src * s_gv_r + (grp * s_gv_g + d)[None, :], mask=m, other=0.0).to(
                tl.float32
            )
        out = live_r[:, None] & live_c[None, :]
        rr = r.to(tl.int64)[:, None]
        dt: tl.constexpr = dk_ptr.dtype.element_ty
        tl.store(dk_ptr + rr * s_dk_r + (grp * s_dk_g + d)[None, :], _round_to(acc_k, dt).to(dt), mask=out)
        tl.store(dv_ptr + rr * s_dv_r + (grp * s_dv_g + d)[None, :], _round_to(acc_v, dt).to(dt), mask=out)


RUN_ON_CPU = False  # tests: the kernel under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)
ON_CUDA = env_switch("MEGATRON_RL_TRITON_GATHER", True)
PROBE = "the deterministic shared-prompt gather backward"


def inverse(index: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """index [Sk] (rows 0..rows-1, any repeats) -> (order [Sk], ptr [rows + 1]): the copies of source row s
    are ``order[ptr[s]:ptr[s + 1]]``, in increasing gather position. On index's device, no host sync."""
    ordered, order = torch.sort(index, stable=True)
    return order, torch.searchsorted(
        ordered, torch.arange(rows + 1, device=index.device, dtype=ordered.dtype)
    )


def runs_on(device: torch.device) -> bool:
    """Whether the kernel may run on ``device`` at all: Triton importable, CUDA with ``ON_CUDA`` (or CPU with
    ``RUN_ON_CPU``). Where it may not, layouts skip listing the copies (``rollout.packing``)."""
    dev = torch.device(device).type
    return HAVE_TRITON and ((ON_CUDA and dev == "cuda") or (RUN_ON_CPU and dev == "cpu"))


def usable(k: Tensor, v: Tensor) -> bool:
    """Whether the kernel serves the gradients of k / v [S, G, D]: ``runs_on`` their device, a float dtype,
    and a trial at that device, dtype and (G, D) that agreed with a float64 sum (a failure warns once;
    autograd's ``index_add_`` serves from then on)."""
    return (
        runs_on(k.device)
        and k.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and k.dim() == 3
        and k.shape == v.shape
        and trial_once(
            f"{PROBE} ({k.device.type}, {k.dtype}, {k.shape[1]}x{k.shape[2]})",
            lambda: _trial(k.device, k.dtype, k.shape[1], k.shape[2]),
            "The deterministic shared-prompt gather backward failed its trial; autograd's index_add_ serves "
            "(atomics: slower, not the same bits from run to run).",
        )
    )


def tile_for(groups: int, dim: int) -> int:
    """Source rows a program sums: ~4k fp32 lanes for each of K and V (a power of two)."""
    return max(1, 4096 // triton.next_power_of_2(groups * dim))


def segment_sum(
    gk: Tensor, gv: Tensor, order: Tensor, ptr: Tensor, tile: int | None = None
) -> tuple[Tensor, Tensor]:
    """gk / gv [Sk, G, D] (the gathered rows' gradients), ``inverse``'s order / ptr -> dk / dv [rows, G, D]
    in gk's dtype: row s is the fp32 sum of gk[order[ptr[s]:ptr[s + 1]]] in that order, rounded once.
    ``tile``: source rows a program (``tile_for``'s unless given)."""
    rows = ptr.numel() - 1
    _, groups, dim = gk.shape
    gk, gv = (g if g.stride(-1) == 1 else g.contiguous() for g in (gk, gv))
    dk = torch.empty(rows, groups, dim, dtype=gk.dtype, device=gk.device)
    dv = torch.empty_like(dk)
    block = triton.next_power_of_2(groups * dim)
    tile = tile or tile_for(groups, dim)
    _segment_sum_kernel[(triton.cdiv(rows, tile),)](
        gk, gv, order, ptr, dk, dv, rows, gk.stride(0), gk.stride(1), gv.stride(0), gv.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), groups=groups, dim=dim, tile=tile, block=block,
        num_warps=4,
    )  # fmt: skip
    return dk, dv


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, index, order, ptr):
        ctx.save_for_backward(order, ptr)
        return k.index_select(0, index), v.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, gk, gv):
        order, ptr = ctx.saved_tensors
        dk, dv = segment_sum(gk, gv, order, ptr)
        return dk, dv, None, None, None


def gather_kv(k: Tensor, v: Tensor, index: Tensor, order: Tensor | None = None, ptr: Tensor | None = None):
    """(k[index], v[index]) for k / v [S, G, D]; with ``inverse(index, S)``'s order / ptr and where
    ``usable``, the backward is ``segment_sum`` (deterministic), else autograd's ``index_add_``."""
    if order is None or not (k.requires_grad or v.requires_grad) or not usable(k, v):
        return k.index_select(0, index), v.index_select(0, index)
    if ptr.numel() != k.shape[0] + 1:
        raise ValueError(
            f"copy lists for {ptr.numel() - 1} rows, keys have {k.shape[0]}: inverse(index, rows)"
        )
    return _GatherKV.apply(k, v, index, order, ptr)


def _trial(device, dtype, groups: int, dim: int) -> None:
    """The kernel at the real (G, D) on two and a half tiles of source rows (three programs, the last ragged),
    rows repeated 0 to 9 times in a shuffled gather, against a float64 ``index_add_``; the gradients as
    strided views of one buffer."""
    g = torch.Generator().manual_seed(0)  # not the device's generator: the trial runs mid-training
    tile = tile_for(groups, dim)
    rows = 2 * tile + tile // 2 + 1
    index = torch.repeat_interleave(torch.arange(rows), torch.randint(0, 10, (rows,), generator=g))
    index = index[torch.randperm(index.numel(), generator=g)].to(device)
    both = torch.randn(index.numel(), groups, 2, dim, generator=g).to(device, dtype)
    gk, gv = both[:, :, 0], both[:, :, 1]
    dk, dv = segment_sum(gk, gv, *inverse(index, rows))
    for got, grad in ((dk, gk), (dv, gv)):
        zeros = torch.zeros(rows, groups, dim, dtype=torch.float64, device=device)
        want = zeros.index_add(0, index, grad.double())
        scale = zeros.index_add(0, index, grad.double().abs()) + 1e-30  # the rounding scale of each sum
        tol = {torch.float32: 2e-6, torch.float16: 1e-3}.get(dtype, 8e-3)  # fp32 adds; one rounding to dtype
        gap = float(((got.double() - want).abs() / scale).max())
        if not gap <= tol:  # nan fails too
            raise RuntimeError(f"largest gap to a float64 sum {gap:.3g} of the copies' absolute sum")
