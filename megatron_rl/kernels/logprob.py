"""The trainer's log-prob and entropy kernels over a vocab shard of logits [N, V/tp] as two Triton passes:
forward reads each row once for its statistics (max, sum of exps, sum of exp x shifted logit), backward
reads it once more and writes the gradient in the logits' dtype.

Why not the compiled passes of ``algos.vocab_parallel`` (which remain the fallback): a micro-batch's logits
hold more than 2^31 elements (32,768 response rows x 151,936 ids at 0.5B), so inductor indexes them in
int64, and the GPU emulates 64-bit integer division. Measured on an H200 (session 18, the update of 64
sequences of the 0.5B GRPO step): the compiled gradient took 13.7 ms where writing bf16 and reading bf16
takes ~4.2 ms at the HBM rate, and the forward read the logits twice (max, then sums: 5.8 ms). Here a row's
offset is int64 once and its columns int32. Measured there (``bench_update_kernels.py``, 32,768 rows):
forward + backward 18.4 -> 11.5 ms (backward 12.5 -> 6.1 ms, 69% of the HBM rate; forward 5.9 -> 5.4 ms, 38%:
two exps per element, the per-lane rescale, bound it). Session 30: the statistics with one exp per element
(``ONE_EXP``) and no division at temperature 1, in both passes (H100: forward + backward 12.7 -> 11.5 ms).
Logits are assumed finite (a live -inf column gives a nan entropy term, as the eager passes do).

Statistics per row, fp32, relative to the row's own max ``m`` over the valid columns (local index <
``valid``, the rest are vocab padding): ``s = sum exp(z - m)`` and ``t = sum exp(z - m) (z - m)`` with ``z =
x / temperature``. ``combine`` merges such triples over parts of a row (the vocab splits of one row here,
the TP ranks' shards in ``algos.vocab_parallel``) exactly as a softmax over the whole row would: the
entropy is ``log s - t / s`` and a log-prob ``z_target - m - log s``.

Runs on CUDA where Triton is installed (``MEGATRON_RL_TRITON_LOGPROB=0`` turns it off); tests run it on
CPU under Triton's interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.kernels.compile import env_switch, trial_once

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the compiled or eager passes serve
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _stats_kernel(x_ptr, m_ptr, s_ptr, t_ptr, stride, valid, chunk, temperature, splits: tl.constexpr,
                      block: tl.constexpr, scaled: tl.constexpr, one_exp: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        part = tl.program_id(1)
        base = x_ptr + row.to(tl.int64) * stride
        lane = tl.arange(0, block)
        m = tl.full([block], float("-inf"), tl.float32)  # per lane: running max of z (one_exp: unused)
        big = float("-inf")  # one_exp: the program's running max of z, every lane's base
        s = tl.zeros([block], tl.float32)  # per lane: sum of exp(z - base)
        t = tl.zeros([block], tl.float32)  # per lane: sum of exp(z - base) (z - base)
        start = part * chunk
        end = tl.minimum(start + chunk, valid)
        for off in range(start, end, block):
            cols = off + lane
            live = cols < end
            z = tl.load(base + cols, mask=live, other=float("-inf")).to(tl.float32)
            if scaled:  # temperature 1: z is the logit itself, no division
                z = z / temperature
            if one_exp:  # the block's max (one reduction) moves the base: one exp per element, one per block
                new = tl.maximum(big, tl.max(z, 0))
                new_safe = tl.where(new == float("-inf"), 0.0, new)  # no -inf - -inf before a live value
                shift = tl.where(big == float("-inf"), 0.0, big - new_safe)  # old base to new; 0 while empty
                scale = tl.exp(shift)
                d = z - new_safe
                e = tl.exp(d)
                t = scale * (t + s * shift) + e * tl.where(live, d, 0.0)  # a dead lane: 0 * 0, no nan
                s = scale * s + e
                big = new
            else:  # lanes only: no cross-lane reduction inside the loop, two exps per element
                m_new = tl.maximum(m, z)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                shift = tl.where(m == float("-inf"), 0.0, m - m_safe)  # old max to new; 0 for an empty lane
                scale = tl.exp(shift)
                e = tl.exp(z - m_safe)
                t = scale * (t + s * shift) + e * tl.where(live, z - m_safe, 0.0)  # a dead lane: no nan
                s = scale * s + e
                m = m_new
        if one_exp:  # every lane's sums are on the one base
            m = tl.where(lane >= 0, big, m)
        row_m = tl.max(m, 0)
        m_safe = tl.where(row_m == float("-inf"), 0.0, row_m)
        shift = tl.where(m == float("-inf"), 0.0, m - m_safe)
        scale = tl.exp(shift)  # lanes that saw no live value hold s = t = 0
        out = row * splits + part
        tl.store(m_ptr + out, row_m)
        tl.store(s_ptr + out, tl.sum(scale * s, 0))
        tl.store(t_ptr + out, tl.sum(scale * (t + s * shift), 0))

    @triton.jit
    def _grad_kernel(x_ptr, g_ptr, zmax_ptr, lse_ptr, exp_ptr, local_ptr, glp_ptr, gent_ptr, stride, g_stride,
                     width, valid, temperature, block: tl.constexpr, scaled: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * block + tl.arange(0, block)
        inside = cols < width
        live = cols < valid
        z = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=live, other=0.0).to(tl.float32)
        if scaled:  # temperature 1: no division (each is a reciprocal on the special-function units)
            z = z / temperature
        shifted = z - tl.load(zmax_ptr + row)
        p = tl.exp(shifted - tl.load(lse_ptr + row))
        g_lp = tl.load(glp_ptr + row)
        g = tl.where(live, p * ((tl.load(exp_ptr + row) - shifted) * tl.load(gent_ptr + row) - g_lp), 0.0)
        # the target's one-hot term, also on a padding column (as the eager passes); local = -1: another shard
        g = g + tl.where(cols == tl.load(local_ptr + row), g_lp, 0.0)
        if scaled:
            g = g / temperature
        tl.store(g_ptr + row.to(tl.int64) * g_stride + cols, g.to(g_ptr.dtype.element_ty), mask=inside)


# Tests run the kernels on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
ON_CUDA = env_switch("MEGATRON_RL_TRITON_LOGPROB", True)
# The row statistics with one exp per element (the block's max moves every lane's base; one more exp a block)
# against two (each lane its own running max). The special-function units bound the two-exp pass: at 0.5B's
# 32,768 x 151,936 logits per micro-batch, two exps and a division (a reciprocal) per element are ~4 ms of
# those units' rate on an H100, the pass took 5.4-5.6 ms and reading the logits takes ~3.3 ms. Measured
# (session 30, H100, ``bench_update_kernels.py``, 32,768 rows): forward 5.35 ms (session 29's kernels) ->
# 5.00 (no division at temperature 1) -> 4.44 (one exp); forward + backward 12.73 -> 11.50 ms; in the 0.5B
# fixed step's profile the statistics took 4.32 ms a micro-batch. MEGATRON_RL_LOGPROB_ONE_EXP=0: two exps.
ONE_EXP = env_switch("MEGATRON_RL_LOGPROB_ONE_EXP", True)


def usable(logits: Tensor) -> bool:
    """Whether the kernels run for logits [N, V]: Triton importable, bf16/fp16/fp32 on CUDA with ``ON_CUDA``
    (or CPU with ``RUN_ON_CPU``), unit stride over the vocab, and both kernels ran once on a small input of
    that device and dtype (a failure warns once and the compiled passes serve from then on)."""
    dev = logits.device.type
    return (
        HAVE_TRITON
        and ((ON_CUDA and dev == "cuda") or (RUN_ON_CPU and dev == "cpu"))
        and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and trial_once(
            f"{PROBE} ({dev}, {logits.dtype})",
            lambda: _trial(logits.device, logits.dtype),
            "The Triton log-prob kernels failed their trial; the update's log-probs run on the compiled "
            "passes (slower, same results).",
        )
    )


PROBE = "the Triton log-prob kernels"


def _trial(device, dtype) -> None:
    """Both kernels at widths divisible by 16 as real vocabularies are (Triton specialises on them), at
    temperature 1 (no division) and 0.7, against float64 sums of the same values: the statistics (fp32 in
    every dtype: relative gap <= 1e-4) and the gradient of ``lp . g_lp + ent . g_ent`` (written in the logits'
    dtype), padding columns 0. Two launches: 32 programs a row of one block each (a few rows), and one
    program a row looping over four blocks with a rising row, whose max moves at every block (a training
    micro-batch's launch). A gap raises (a miscompile on this GPU)."""
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # the gradient's rounding to the logits' dtype
    w_lp, w_ent = (
        torch.tensor([1.0, -0.5], dtype=torch.float64),
        torch.tensor([0.3, 0.7], dtype=torch.float64),
    )
    g_lp, g_ent, rows = w_lp.float().to(device), w_ent.float().to(device), torch.arange(2)
    for width, splits in ((4096, None), (8192, 1)):
        x = 3 * torch.randn(2, width, generator=gen)
        x[1] = torch.linspace(-8, 8, width)
        x = x.to(device, dtype)
        valid = width - 96
        target = torch.tensor([5, valid - 1])
        for temperature in (1.0, 0.7):
            m, s, t = row_stats(x, temperature, valid, splits=splits)
            g = grad(x, m, s.log(), t / s, target.to(device), g_lp, g_ent, temperature, valid)
            z = x[:, :valid].double().cpu() / temperature
            zm = z.amax(-1)
            shifted = z - zm[:, None]
            e = shifted.exp()
            p = e / e.sum(-1, keepdim=True)
            ref = p * (((p * shifted).sum(-1, keepdim=True) - shifted) * w_ent[:, None] - w_lp[:, None])
            ref[rows, target] += w_lp
            ref /= temperature

            def gap(got, want):
                return float((got.double().cpu() - want).abs().max() / want.abs().max())

            stats = max(gap(m, zm), gap(s, e.sum(-1)), gap(t, (e * shifted).sum(-1)))
            grads = max(gap(g[:, :valid], ref), float(g[:, valid:].double().abs().max()))
            if not (stats <= 1e-4 and grads <= tol):  # nan fails too
                raise RuntimeError(
                    f"width {width}, temperature {temperature}: largest relative gap to float64 {stats:.3g} "
                    f"(statistics), {grads:.3g} (gradient)"
                )


def combine(m: Tensor, s: Tensor, t: Tensor, top: Tensor) -> tuple[Tensor, Tensor]:
    """Parts' triples (``m``, ``s``, ``t``, each [..., parts]) -> ``s`` and ``t`` of the whole row relative
    to ``top`` [...], the max over all its parts (>= every part's ``m``). A part with no valid column has
    ``m = -inf`` and ``s = t = 0``."""
    shift = torch.where(m == float("-inf"), 0.0, m - top[..., None])
    scale = shift.exp()
    return (scale * s).sum(-1), (scale * (t + s * shift)).sum(-1)


def splits_for(rows: int, target_programs: int = 2048, most: int = 32) -> int:
    """Programs per row (a power of two) so that about ``target_programs`` run, one per row from there."""
    return max(1, min(most, triton.next_power_of_2(max(1, target_programs // max(rows, 1)))))


def row_stats(
    logits: Tensor, temperature: float, valid: int, block: int = 2048, num_warps: int = 8,
    one_exp: bool | None = None, splits: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """logits [N, V/tp] -> (m, s, t), each [N] fp32, over the columns < ``valid`` (see the module doc).
    ``one_exp``: the one-exp pass (``ONE_EXP`` when None); ``splits``: programs a row (``splits_for``'s)."""
    rows, width = logits.shape
    splits = splits_for(rows) if splits is None else splits
    chunk = triton.cdiv(triton.cdiv(max(valid, 1), splits), block) * block  # splits start on block bounds
    part = torch.empty(3, rows, splits, dtype=torch.float32, device=logits.device)
    if rows:
        _stats_kernel[(rows, splits)](logits, part[0], part[1], part[2], logits.stride(0), valid, chunk,
                                      float(temperature), splits=splits, block=block, num_warps=num_warps,
                                      scaled=float(temperature) != 1.0,
                                      one_exp=ONE_EXP if one_exp is None else one_exp)  # fmt: skip
    m = part[0].amax(-1)
    top = torch.where(m == float("-inf"), 0.0, m)
    s, t = combine(part[0], part[1], part[2], top)
    return m, s, t


def grad(
    logits: Tensor, zmax: Tensor, lse: Tensor, expected: Tensor, local: Tensor, g_lp: Tensor, g_ent: Tensor,
    temperature: float, valid: int, block: int = 2048, num_warps: int = 8,
) -> Tensor:  # fmt: skip
    """d(lp . g_lp + ent . g_ent) / d logits in the logits' dtype, from the row statistics relative to the
    global max ``zmax`` (``lse`` = log sum exp(z - zmax), ``expected`` = E_p[z - zmax]); ``local`` [N] the
    target's column in this shard or -1; all [N] fp32 except ``local`` (int64). Padding columns get 0."""
    rows, width = logits.shape
    out = torch.empty_like(logits)
    if rows:
        _grad_kernel[(rows, triton.cdiv(width, block))](
            logits, out, zmax, lse, expected, local, g_lp, g_ent, logits.stride(0), out.stride(0), width, valid,
            float(temperature), block=block, num_warps=num_warps, scaled=float(temperature) != 1.0,
        )  # fmt: skip
    return out
