"""Batch-invariant kernels: every output row is computed in an order that depends only on that row's data,
never on how many rows share the call or where the row sits among them (``rollout.exact_logprobs``).

The engine's decode/prefill and the trainer's forward call these same functions, so a token's log-prob is
the same bits in both. Each op has two paths that are each batch-invariant (they are not equal to each
other, and need not be: both sides of a run take the same one):

- Triton (``kernels.batch_invariant_triton``) on CUDA for bf16/fp16/fp32, or on CPU under Triton's
  interpreter with ``RUN_ON_CPU``: one fixed tile configuration per op, reductions in fixed blocks from
  index 0, no split-K and no choice of kernel that depends on the row count.
- A pure-torch reference on CPU: reductions are explicit pairwise trees over zero-padded power-of-two
  widths and matmuls a sequential loop over K of elementwise multiply-adds, so no library heuristic can
  reorder a sum. Transcendentals (exp, log, rsqrt) are evaluated in float64 and rounded to fp32: torch's
  CPU vector and scalar-tail code paths differ in the last fp32 bit, and which path an element takes
  depends on its index in the flattened tensor; their float64 results round to the same fp32.

What is reduced how (both paths):
- ``matmul``: per output element, fp32 accumulation over K in one fixed order; bias added in fp32, one
  rounding.
- ``rms_norm``: fp32 sum of squares over the row, ``x * rstd * w`` in fp32, one rounding.
- ``token_logprobs``: exact max over the row, then the sum of ``exp(z - max)`` in fixed blocks of
  ``VOCAB_BLOCK`` columns from column 0. Over TP vocab shards (``shard``): the max of the shard maxes
  (exact in any order), each shard's sum of ``exp(z - max)`` in its own blocks, the shard sums added in
  rank order in fp32 (``combine_exp_sums``), then the log. The engine splits its gathered row at the
  training shard boundaries; the trainer computes the same pieces on its local shard and exchanges them
  (``kernels.batch_invariant_tp``), never through an all-reduce sum (NCCL's order follows the message size).
- ``ordered_sum``: TP partial outputs of a row-parallel linear added in rank order in fp32, one rounding.
- ``attention``: row r of (batch b, KV group g) attends keys ``0..row_pos[b, r]`` in blocks of
  ``KEY_BLOCK`` from key 0 with one online-softmax update per block. A block wholly past a row's
  position leaves that row's state unchanged bit for bit (its weights are exactly 0 and its rescale
  exactly 1), so decode (one query over the cache) and training (all queries of a sequence) agree.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from megatron_rl.kernels import batch_invariant_triton as tri

KEY_BLOCK = 64  # keys per online-softmax step (attention)
ROW_TILE = 16  # query rows per attention program (the decode path's padded group of query heads)
VOCAB_BLOCK = 1024  # vocab columns per block of the log-softmax sum

# Tests run the Triton paths on CPU under the interpreter (TRITON_INTERPRET=1 before triton's import).
RUN_ON_CPU = False
# The matmul on CUDA: "fixed_rows" (default: cuBLAS in calls of GEMM_ROWS rows, for each weight only after
# ``fixed_rows_invariant`` passed on it) or "triton" (the fixed-tile Triton kernel). Measured on one H200
# (session 10, benchmarks/bench_exact_matmul.py, CUDA-graph replays, Qwen2.5-0.5B layers): at 512 decode
# rows fixed_rows equals plain cuBLAS (qkv 4.4 us, fc1 17.8, fc2 11.9, LM head 199) where the Triton tile
# took 6.9 / 23.5 / 27.7 / 299 us; over a 16384-row training micro-batch the two are about equal in sum.
EXACT_GEMM_CHOICES = ("fixed_rows", "triton")


def exact_gemm_choice(value: str | None = None) -> str:
    """``MEGATRON_RL_EXACT_GEMM`` (or ``value``) normalised; an unknown value raises ``ValueError`` naming
    the choices (validation turns it into a start-up error)."""
    got = (os.environ.get("MEGATRON_RL_EXACT_GEMM", "fixed_rows") if value is None else value).strip().lower()
    if got not in EXACT_GEMM_CHOICES:
        raise ValueError(
            f"MEGATRON_RL_EXACT_GEMM={got!r}: use fixed_rows (cuBLAS in fixed-size calls, the default) or "
            "triton (the fixed-tile Triton matmul), or unset it"
        )
    return got


EXACT_GEMM = os.environ.get("MEGATRON_RL_EXACT_GEMM", "fixed_rows").strip().lower()
EXACT_BATCHED_CHOICES = ("trial", "off", "verify")  # MEGATRON_RL_EXACT_BATCHED (``fixed_rows_matmul``)


def exact_batched_choice() -> str:
    """``MEGATRON_RL_EXACT_BATCHED`` normalised; an unknown value raises ``ValueError`` naming the choices."""
    got = os.environ.get("MEGATRON_RL_EXACT_BATCHED", "trial").strip().lower()
    if got not in EXACT_BATCHED_CHOICES:
        raise ValueError(
            f"MEGATRON_RL_EXACT_BATCHED={got!r}: use trial (the default), off (whole 512-row calls one by one) "
            "or verify (every batched call checked against the separate calls), or unset it"
        )
    return got


FIXED_ROWS_ON_CPU = False  # tests: the fixed-rows path on the CPU's BLAS (its trial runs there too)
_FIXED_ROWS: dict[tuple, bool] = {}  # (device type, dtype, weight shape, strides, alignment, bias?) -> passed


def use_triton(x: Tensor) -> bool:
    """Whether the Triton path serves ``x``'s device: CUDA with Triton, or CPU with ``RUN_ON_CPU``."""
    if not tri.HAVE_TRITON:
        return False
    return x.device.type == "cuda" or (RUN_ON_CPU and x.device.type == "cpu")


# ---------------------------------------------------------------------------------------------- reference


def tree_sum(x: Tensor) -> Tensor:
    """Sum over the last dim as a pairwise tree over the width zero-padded to a power of two: x [..., n]
    -> [...]. Only elementwise adds, so each output depends on its own row alone."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _exp(x: Tensor) -> Tensor:
    return x.double().exp().float()


def matmul_reference(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; fp32 sums over k = 0, 1, ..., K-1."""
    xf, wt = x.float(), w.float().t().contiguous()  # [M, K], [K, N]
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)  # [M, N]
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wt[k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [M, H], weight [H] -> [M, H] in x's dtype."""
    xf = x.float()
    mean_sq = tree_sum(xf * xf) / x.shape[-1]  # [M]
    rstd = (mean_sq.double() + eps).rsqrt().float()  # [M]
    return (xf * rstd[:, None] * weight.float()).to(x.dtype)


def log_softmax_stats_reference(z: Tensor) -> tuple[Tensor, Tensor]:
    """z [N, V] fp32 (-inf where excluded) -> row max [N] and log of the sum of exp(z - max) [N]."""
    zmax = z.amax(dim=-1)  # [N] exact in any order
    return zmax, exp_sum_reference(z, zmax).double().log().float()


def exp_sum_reference(z: Tensor, zmax: Tensor) -> Tensor:
    """z [N, V] fp32, zmax [N] -> the sum of exp(z - zmax) [N] fp32 in blocks of ``VOCAB_BLOCK`` columns."""
    n, v = z.shape
    blocks = -(-v // VOCAB_BLOCK)
    z = torch.nn.functional.pad(z, (0, blocks * VOCAB_BLOCK - v), value=float("-inf"))
    e = _exp(z - zmax[:, None]).view(n, blocks, VOCAB_BLOCK)  # [N, nb, VB]
    lanes = torch.zeros(n, VOCAB_BLOCK, dtype=torch.float32, device=z.device)
    for b in range(blocks):  # each lane sums its column of every block, in block order
        lanes = lanes + e[:, b]
    return tree_sum(lanes)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, row_pos: Tensor, scale: float) -> Tensor:
    """q [B, G, R, D], k / v [B, G, Tk, D], row_pos [B, R] -> [B, G, R, D] in q's dtype (see module doc)."""
    bsz, groups, rows, dim = q.shape
    qf = q.float()
    m = torch.full((bsz, groups, rows), float("-inf"), device=q.device)
    l_sum = torch.zeros(bsz, groups, rows, device=q.device)
    acc = torch.zeros(bsz, groups, rows, dim, device=q.device)
    n_kv = int(row_pos.max()) + 1
    for start in range(0, n_kv, KEY_BLOCK):
        kb, vb = (_key_block(t, start) for t in (k, v))  # [B, G, KB, D]
        s = tree_sum(qf[:, :, :, None, :] * kb.float()[:, :, None]) * scale  # [B, G, R, KB]
        keys = torch.arange(start, start + KEY_BLOCK, device=q.device)
        live = keys[None, None, :] <= row_pos[:, :, None]  # [B, R, KB]
        s = s.masked_fill(~live[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        p = _exp(s - m_new[..., None])  # [B, G, R, KB]
        alpha = _exp(m - m_new)
        l_sum = l_sum * alpha + tree_sum(p)
        pv = p.to(v.dtype).float()[..., None] * vb.float()[:, :, None]  # [B, G, R, KB, D]
        acc = acc * alpha[..., None] + tree_sum(pv.transpose(-1, -2))
        m = m_new
    return (acc / l_sum[..., None]).to(q.dtype)


def _key_block(t: Tensor, start: int) -> Tensor:
    """t [B, G, Tk, D] -> keys start..start+KEY_BLOCK-1 [B, G, KEY_BLOCK, D], zero past Tk."""
    block = t[:, :, start : start + KEY_BLOCK]
    return torch.nn.functional.pad(block, (0, 0, 0, KEY_BLOCK - block.shape[2]))


# ------------------------------------------------------------------------------------------------ the ops


GEMM_ROWS = 512  # rows of every library GEMM call on the fixed-shape path (``fixed_rows_matmul``)


def fixed_rows_matmul(x: Tensor, w: Tensor, bias: Tensor | None = None, rows: int | None = None) -> Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] as ceil(M / rows) library GEMM calls (cuBLAS on CUDA) of
    exactly ``rows`` rows each, the last zero-padded.

    A GEMM library picks its kernel (tile, split-K) from the problem's shape, strides and alignment; with
    M, N, K and the layout fixed every call runs the same kernel, whose per-element reduction over K does
    not depend on the other rows. So a row's result is the same bits whatever M the caller had and
    wherever the row sits, provided the kernel treats all tile positions alike: ``fixed_rows_serves``
    has ``fixed_rows_invariant`` check that on the device once per weight before it serves (an observed property
    of the library's kernels, not a documented one).

    Many whole calls (a training micro-batch: 16384 rows are 32) run as one strided-batched call where that
    gave the separate calls' bits on the first ``BATCHED_TRIALS_NEEDED`` such inputs (``_batched_trial``,
    per weight and number of calls; none may differ): one launch instead of dozens (session 12's profile of
    the exact update had 9x the default update's GEMM calls, and more host time than device time). A weight
    with a bias (qkv) is batched only on CUDA in bf16/fp16, as an fp32-result ``bmm`` plus the bias in fp32,
    rounded once (``_batched_gemm``): on the H200 that equalled the 512-row ``addmm`` calls (whose bias is
    cuBLASLt's fp32 epilogue) on every input tried (session 15), while ``baddbmm`` (a bf16 result, then the
    bias) differed on most inputs and equalled them on some (session 14: one agreeing trial let it serve,
    and the log-probs differed from step 1 on). Elsewhere a weight with a bias takes the separate calls."""
    rows = rows or GEMM_ROWS
    m = x.shape[0]
    x = x.contiguous()
    if x.data_ptr() % 16:  # every call's operands 16-byte aligned, as in the trial
        x = x.clone()
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    wt = w.t()

    def gemm(a: Tensor, into: Tensor) -> None:
        if bias is None:
            torch.mm(a, wt, out=into)
        else:
            torch.addmm(bias, a, wt, out=into)

    full = m - m % rows
    calls = full // rows
    key = _batched_key(x, w, bias, calls, rows)
    if key is not None and (key not in _BATCHED or EXACT_BATCHED == "verify"):  # ``out``: the separate calls
        agreed = _batched_trial(x[:full], wt, out[:full], bias, calls, rows, gemm)
        verdicts = _BATCHED_TRIALS.setdefault(key, [0, 0])
        verdicts[0 if agreed else 1] += 1
        if not agreed or verdicts[0] >= BATCHED_TRIALS_NEEDED:
            _BATCHED.setdefault(key, verdicts[1] == 0)
    elif key is not None and _BATCHED[key]:
        _batched_gemm(x[:full], wt, out[:full], bias, calls)
    else:
        _each_call(x[:full], out[:full], rows, gemm)
    if full < m:  # the tail zero-padded to a whole call
        tail = torch.empty(rows, w.shape[0], dtype=x.dtype, device=x.device)
        gemm(torch.nn.functional.pad(x[full:], (0, 0, 0, rows - (m - full))), tail)
        out[full:] = tail[: m - full]
    return out


_BATCHED: dict[tuple, bool] = {}  # (weight key, x alignment, calls, rows) -> the batched call serves
_BATCHED_TRIALS: dict[tuple, list[int]] = {}  # the same keys -> [trials that agreed, trials that did not]
BATCHED_TRIALS_NEEDED = 2  # agreeing trials (and none that disagreed) before the batched call serves
# MEGATRON_RL_EXACT_BATCHED: "trial" (default: batched after BATCHED_TRIALS_NEEDED agreeing trials per key),
# "off" (the whole calls always one by one), "verify" (every batched call checked against the separate
# calls, which serve; ``_BATCHED_TRIALS`` counts the verdicts: a diagnostic, slower than either)
BIAS_BATCHED_ON = ("cuda",)  # devices where a weight with a bias runs batched (fp32-result bmm: CUDA only)
_HALF = (torch.bfloat16, torch.float16)
EXACT_BATCHED = os.environ.get("MEGATRON_RL_EXACT_BATCHED", "trial").strip().lower()


def _batched_key(x: Tensor, w: Tensor, bias: Tensor | None, calls: int, rows: int) -> tuple | None:
    """The key of ``_BATCHED`` for ``calls`` whole calls of x with weight w, or None where they are not
    batched: fewer than two calls, a weight with a bias off CUDA or outside bf16/fp16 (``fixed_rows_matmul``
    says why), batching off, or while a CUDA graph is captured (the trial's comparison cannot run there; the
    engine's decode steps, which it captures, have at most one whole call)."""
    if calls < 2 or EXACT_BATCHED == "off":
        return None
    if bias is not None and (w.device.type not in BIAS_BATCHED_ON or x.dtype not in _HALF):
        return None
    if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return (*_weight_key(w, bias), _alignment(x), calls, rows)


def _weight_key(w: Tensor, bias: Tensor | None) -> tuple:
    """What a GEMM library may pick its kernel by, of the weight and bias: device, dtype, shape, strides,
    address alignment."""
    return (w.device.type, w.dtype, tuple(w.shape), tuple(w.stride()), _alignment(w),
            None if bias is None else _alignment(bias))  # fmt: skip


def _each_call(x: Tensor, into: Tensor, rows: int, gemm) -> None:
    """The whole calls of x [calls * rows, K] one by one into ``into``."""
    for i in range(0, len(x), rows):
        gemm(x[i : i + rows], into[i : i + rows])


def _batched_gemm(x: Tensor, wt: Tensor, into: Tensor, bias: Tensor | None, calls: int) -> None:
    """The ``calls`` GEMMs of ``rows`` rows each as ONE strided-batched library call (the weight's batch
    stride 0: no copies): x [calls * rows, K], wt [K, N] (+ bias [N]) -> into [calls * rows, N]. With a
    bias the product is kept in fp32, the bias added in fp32 and the sum rounded once to x's dtype, as
    cuBLASLt's bias epilogue does in the separate ``addmm`` calls (a [calls * rows, N] fp32 temporary)."""
    x3 = x.view(calls, -1, x.shape[-1])  # [calls, rows, K]
    o3 = into.view(calls, -1, into.shape[-1])  # [calls, rows, N]
    w3 = wt.expand(calls, *wt.shape)
    if bias is None:
        torch.bmm(x3, w3, out=o3)
    else:
        o3.copy_(_fp32_bmm(x3, w3).add_(bias.float()))


def _fp32_bmm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (batched) with an fp32 result: the library's fp32-output kernel on CUDA; elsewhere (no such
    operator on the CPU) the operands upcast."""
    if a.device.type == "cuda":
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _batched_trial(
    x: Tensor, wt: Tensor, out: Tensor, bias: Tensor | None, calls: int, rows: int, gemm
) -> bool:
    """The batched call, then ``_separate_calls_agree``; a batched call that raises counts as a
    disagreement (the separate calls serve, reported once)."""
    try:
        _batched_gemm(x, wt, out, bias, calls)
    except RuntimeError as exc:
        warnings.warn(f"rollout.exact_logprobs: one batched GEMM of {calls} x {rows} rows failed ({exc}); "
                      "the separate calls serve", stacklevel=3)  # fmt: skip
        _each_call(x, out, rows, gemm)
        return False
    return _separate_calls_agree(x, out, rows, gemm)


def _separate_calls_agree(x: Tensor, out: Tensor, rows: int, gemm) -> bool:
    """The trial of one strided-batched call (its result in ``out``): the separate calls again, one at a
    time through one [rows, N] buffer (no second output-sized tensor: the LM head's is the largest of the
    update), each compared with the batched rows and then written over them, so ``out`` ends as the
    separate calls' result whatever the verdict; one host sync. A library may pick another kernel for the
    batched problem, so this runs once per weight and number of calls, on the real operands."""
    one = torch.empty(rows, out.shape[1], dtype=out.dtype, device=out.device)
    differ = torch.zeros((), dtype=torch.bool, device=out.device)
    for i in range(0, len(x), rows):
        gemm(x[i : i + rows], one)
        differ |= (one != out[i : i + rows]).any()
        out[i : i + rows] = one
    return not bool(differ)


def fixed_rows_invariant(
    w: Tensor, bias: Tensor | None = None, rows: int | None = None, seed: int = 0
) -> bool:
    """Whether ``fixed_rows_matmul`` with weight ``w`` gives each row the same bits at every position of a
    call and in calls of different M (random inputs in ``w``'s dtype): 1 row, a part of one call, and
    rows spread over several calls at shifted positions."""
    rows = rows or GEMM_ROWS
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(2 * rows + 37, w.shape[1], generator=g).to(w.device, w.dtype)
    big = fixed_rows_matmul(x, w, bias, rows)
    checks = [(fixed_rows_matmul(x[:1], w, bias, rows), big[:1]),
              (fixed_rows_matmul(x[5 : 5 + rows // 3], w, bias, rows), big[5 : 5 + rows // 3]),
              (fixed_rows_matmul(x[rows - 3 :], w, bias, rows), big[rows - 3 :])]  # fmt: skip
    return all(torch.equal(a, b) for a, b in checks)


def _alignment(t: Tensor) -> int:
    """The largest power of two (up to 256 bytes) dividing ``t``'s address: torch's cuBLAS(Lt) calls tell
    the library the operands' alignment up to 256 bytes, and it may pick another kernel for another one."""
    ptr = t.data_ptr()
    return 256 if ptr % 256 == 0 else ptr & -ptr


def _canonical(t: Tensor | None) -> Tensor | None:
    """``t``, or a copy of it at a 256-byte boundary where it sits elsewhere (a view
    into a flat buffer, e.g. megatron-core's distributed-optimizer params). Every operand the fixed-rows
    path hands the library is then in one alignment class, so the trainer's copy of a weight and the
    engine's (its own buffer at PP>1) run the same kernel, not just each an invariant one."""
    if t is None or _alignment(t) == 256:
        return t
    size = t.element_size()
    flat = torch.empty(t.numel() + 256 // size, dtype=t.dtype, device=t.device)  # CPU allocations: 64 bytes
    start = (-flat.data_ptr() % 256) // size
    return flat[start : start + t.numel()].view(t.shape).copy_(t)


def _fixed_rows_enabled(w: Tensor) -> bool:
    if w.device.type == "cuda":
        return exact_gemm_choice(EXACT_GEMM) == "fixed_rows"
    return FIXED_ROWS_ON_CPU


def fixed_rows_serves(w: Tensor, bias: Tensor | None = None) -> bool:
    """Whether ``matmul`` takes the fixed-shape library path for weight ``w``: on CUDA with
    ``EXACT_GEMM == "fixed_rows"`` (on CPU only with ``FIXED_ROWS_ON_CPU``), and ``fixed_rows_invariant``
    passed for this weight's shape, strides, address alignment and dtype (``matmul`` hands it 256-byte
    aligned operands only: ``_canonical``). The trial runs on the first call; the engine's eager
    warm-up step precedes every CUDA-graph capture, and a weight not yet tried while a graph is captured
    is an error (taking the other path there would break the equality with the trainer)."""
    return _fixed_rows_enabled(w) and _fixed_rows_tried(w, bias)


def _fixed_rows_tried(w: Tensor, bias: Tensor | None) -> bool:
    """``fixed_rows_serves`` past its device/env check: the trial's cached result for this weight."""
    key = _weight_key(w, bias)
    if key not in _FIXED_ROWS:
        if w.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"rollout.exact_logprobs: the fixed-rows matmul's trial for a weight of shape {tuple(w.shape)} "
                "did not run before CUDA-graph capture; run one eager step first (the engine does), or set "
                "MEGATRON_RL_EXACT_GEMM=triton"
            )
        with torch.no_grad():
            ok = fixed_rows_invariant(w, bias)
        if not ok:
            warnings.warn(
                f"rollout.exact_logprobs: cuBLAS in {GEMM_ROWS}-row calls was not batch-invariant for a weight "
                f"of shape {tuple(w.shape)} ({w.dtype}); that layer uses the Triton matmul (slower, same "
                "equality)",
                stacklevel=2,
            )
        _FIXED_ROWS[key] = ok
    return _FIXED_ROWS[key]


def matmul(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, batch-invariant: the fixed-shape
    library path where it serves (``fixed_rows_serves``), else Triton, else the CPU reference."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    fixed = _fixed_rows_enabled(w)
    if fixed:
        w, bias = _canonical(w), _canonical(bias)
    if fixed and _fixed_rows_tried(w, bias):
        out = fixed_rows_matmul(x2, w, bias)
    elif use_triton(x):
        out = tri.matmul(x2, w, bias)
    else:
        out = matmul_reference(x2, w, bias)
    return out.view(*lead, w.shape[0])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H], weight [H] -> [..., H] in x's dtype, batch-invariant."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, H]
    out = tri.rms_norm(x2, weight, eps) if use_triton(x) else rms_norm_reference(x2, weight, eps)
    return out.view(x.shape)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + y, ``rms_norm(x + y)``) for x, y [..., H]: the same bits as the add (rounded to x's dtype) and then
    ``rms_norm``, as one Triton kernel where that kernel gave those bits in a trial on this device, dtype
    and H (the exact decode step: each residual add with the norm after it; the trainer runs them apart)."""
    lead = x.shape
    x2, y2 = x.reshape(-1, lead[-1]), y.reshape(-1, lead[-1])
    if use_triton(x) and x.dtype == y.dtype and _add_norm_tried(x, weight, eps):
        s, out = tri.add_rms_norm(x2, y2, weight, eps)
        return s.view(lead), out.view(lead)
    s = x + y
    return s, rms_norm(s, weight, eps)


_ADD_NORM: dict[tuple, bool] = {}  # (device, dtype, H) -> the fused add + RMSNorm gave the unfused bits


def _add_norm_tried(x: Tensor, weight: Tensor, eps: float) -> bool:
    """The fused add + RMSNorm's one-time bit-for-bit trial against the add and ``rms_norm`` at x's device,
    dtype and width (not while a CUDA graph is captured: the decode steps' warm-up runs it first)."""
    key = (str(x.device), x.dtype, x.shape[-1])
    if key not in _ADD_NORM:
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        g = torch.Generator().manual_seed(0)
        a, b = ((4 * torch.randn(37, x.shape[-1], generator=g)).to(x.device, x.dtype) for _ in range(2))
        w = weight.detach().clone()
        s, out = tri.add_rms_norm(a, b, w, eps)
        ok = torch.equal(s, a + b) and torch.equal(out, tri.rms_norm(a + b, w, eps))
        if not ok:
            warnings.warn(f"rollout.exact_logprobs: the fused add + RMSNorm did not give the unfused bits on "
                          f"{x.device} ({x.dtype}, width {x.shape[-1]}); the two kernels serve there", stacklevel=3)  # fmt: skip
        _ADD_NORM[key] = ok
    return _ADD_NORM[key]


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float, valid: int | None = None, shard: int | None = None
) -> Tensor:
    """logits [N, V], tokens [N] -> ``log_softmax(logits / temperature)[token]`` [N] fp32 over the first
    ``valid`` columns (default all; the rest is vocab padding), batch-invariant. ``shard``: the width of a
    TP vocab shard (V/tp of the padded vocab): the row is reduced as the trainer reduces its shards
    (``shard_max``, ``shard_exp_sum``, ``combine_exp_sums``), so a gathered row and the shards agree."""
    valid = logits.shape[-1] if valid is None else valid
    if shard is not None and shard < valid:
        chunks = [logits[:, s : min(s + shard, valid)] for s in range(0, valid, shard)]  # [N, <=shard] each
        zmax = torch.stack([shard_max(c, temperature, c.shape[-1]) for c in chunks]).amax(0)  # [N]
        sums = torch.stack([shard_exp_sum(c, temperature, c.shape[-1], zmax) for c in chunks])  # [P, N]
        lse = combine_exp_sums(sums)
    elif use_triton(logits):
        zmax, lse = tri.log_softmax_stats(logits, temperature, valid, VOCAB_BLOCK)
    else:
        z = logits[:, :valid].float() / temperature
        zmax, lse = log_softmax_stats_reference(z)
    picked = logits.gather(-1, tokens[:, None])[:, 0].float() / temperature
    return picked - zmax - lse


def shard_max(logits: Tensor, temperature: float, valid: int) -> Tensor:
    """logits [N, Vs] -> the max of the first ``valid`` columns divided by ``temperature`` [N] fp32 (-inf
    when ``valid`` is 0: a shard of vocab padding only)."""
    if valid == 0:
        return torch.full(logits.shape[:1], float("-inf"), dtype=torch.float32, device=logits.device)
    if use_triton(logits):
        return tri.shard_max(logits, temperature, valid, VOCAB_BLOCK)
    return (logits[:, :valid].float() / temperature).amax(dim=-1)


def shard_exp_sum(logits: Tensor, temperature: float, valid: int, zmax: Tensor) -> Tensor:
    """logits [N, Vs], zmax [N] (the whole row's max) -> the sum of ``exp(z / temperature - zmax)`` over the
    first ``valid`` columns [N] fp32, in blocks of ``VOCAB_BLOCK`` columns from this shard's column 0."""
    if valid == 0:
        return torch.zeros(logits.shape[:1], dtype=torch.float32, device=logits.device)
    if use_triton(logits):
        return tri.shard_exp_sum(logits, temperature, valid, zmax, VOCAB_BLOCK)
    return exp_sum_reference(logits[:, :valid].float() / temperature, zmax)


def combine_exp_sums(sums: Tensor) -> Tensor:
    """sums [P, N] fp32, one row per vocab shard in rank order -> log of their sum [N], added in rank order."""
    return ordered_sum(list(sums), torch.float32).double().log().float()


def ordered_sum(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Equal-shape partials in rank order -> their elementwise sum in ``dtype``: fp32 adds 0, 1, ..., P-1,
    one rounding (each element depends on its own partials alone, whatever the row count)."""
    acc = parts[0].float()
    for part in parts[1:]:
        acc = acc + part.float()
    return acc.to(dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, row_pos: Tensor, scale: float, prefix=None) -> Tensor:
    """q [B, G, R, D] (any strides with unit stride in D), k / v [B, G, Tk, D], row_pos [B, R] int64:
    row r attends keys 0..row_pos[b, r] of its group -> [B, G, R, D] in q's dtype, batch-invariant.
    ``prefix`` (lead [B], plen [B]; ``rollout.prompt_kv_sharing``): the Triton kernel reads sequence b's
    keys before plen[b] from row lead[b], a copy of the same values (the reference reads its own)."""
    if use_triton(q):
        return tri.attention(q, k, v, row_pos, scale, KEY_BLOCK, ROW_TILE, prefix)
    return attention_reference(q, k, v, row_pos, scale)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Training layout: q [B, H, T, D], k / v [B, G, T, D] (GQA: head h reads group h // (H/G)), causal
    -> [B, H, T, D]. The same per-row computation as the decode step's ``attention`` call."""
    bsz, heads, t_len, dim = q.shape
    groups = k.shape[1]
    rows = q.reshape(bsz, groups, heads // groups * t_len, dim)  # [B, G, rep*T, D]
    pos = torch.arange(t_len, device=q.device).repeat(heads // groups).expand(bsz, -1)  # [B, rep*T]
    return attention(rows, k, v, pos, scale).view(bsz, heads, t_len, dim)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, scale: float, prefix=None) -> Tensor:
    """Decode layout: q [B, G, rep, D] (a group's query heads), k / v [B, G, Tmax, D] cache, positions [B]
    -> [B, G, rep, D]; the same per-row computation as ``causal_attention``'s row at that position."""
    row_pos = positions[:, None].expand(-1, q.shape[2])  # [B, rep]
    return attention(q, k, v, row_pos, scale, prefix)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, scale: float, kv_index: Tensor | None = None,
                     cu_k: Tensor | None = None, max_q: int | None = None, max_k: int | None = None) -> Tensor:  # fmt: skip
    """Packed (THD) layout: q [S, H, D], k / v [S, G, D], query segments ``cu_q`` [N + 1] -> [S, H, D] (rows
    past the last segment are 0). Segment i's keys are its own rows, or for shared prompts the rows
    ``kv_index[cu_k[i]:cu_k[i+1]]`` (its prompt's, then its own); its query j sits at key position
    Lk - Lq + j and attends keys 0..that position. Each segment becomes one row of ``attention`` with its
    keys gathered in order, so every query runs the same per-row computation as ``causal_attention``'s
    row at that position in an unpacked sequence (key blocks from the segment's first key). ``max_q`` /
    ``max_k``: the longest query / key segment if known (else read from the device)."""
    rows_q, heads, dim = q.shape
    groups = k.shape[1]
    rep = heads // groups
    cu_q = cu_q.long()
    lq = cu_q[1:] - cu_q[:-1]  # [N]
    kstart, lk = (cu_q[:-1], lq) if cu_k is None else (cu_k[:-1].long(), (cu_k[1:] - cu_k[:-1]).long())
    n = lq.numel()
    max_q = int(lq.max()) if max_q is None else max_q
    max_k = (max_q if cu_k is None else int(lk.max())) if max_k is None else max_k
    tq = torch.arange(max_q, device=q.device)
    tk = torch.arange(max_k, device=q.device)
    # padding entries repeat a segment's last row: finite values that no live query attends
    kflat = kstart[:, None] + torch.minimum(tk[None, :], (lk[:, None] - 1).clamp(min=0))  # [N, max_k]
    krows = kflat if kv_index is None else kv_index[kflat]
    kd, vd = (
        t.index_select(0, krows.reshape(-1)).view(n, max_k, groups, dim).transpose(1, 2) for t in (k, v)
    )
    tq_live = torch.minimum(tq[None, :], (lq[:, None] - 1).clamp(min=0))  # [N, max_q]
    qd = q.index_select(0, (cu_q[:-1, None] + tq_live).reshape(-1).clamp(max=max(rows_q - 1, 0)))
    qd = (
        qd.view(n, max_q, heads, dim).transpose(1, 2).reshape(n, groups, rep * max_q, dim)
    )  # row = head * max_q + t
    pos = (lk - lq)[:, None] + tq_live  # [N, max_q] each query's key position
    out = attention(qd, kd, vd, pos.repeat(1, rep), scale)  # [N, G, rep * max_q, D]
    out = out.view(n, heads, max_q, dim).transpose(1, 2).reshape(n * max_q, heads, dim)
    # back to the packed rows: row s is segment i's query s - cu_q[i]
    s_idx = torch.arange(rows_q, device=q.device)
    seg = (torch.searchsorted(cu_q, s_idx, right=True) - 1).clamp(0, n - 1)  # [S]
    t_in = s_idx - cu_q[seg]
    inside = t_in < lq[seg]
    picked = out.index_select(0, seg * max_q + t_in.clamp(max=max_q - 1))  # [S, H, D]
    return torch.where(inside[:, None, None], picked, torch.zeros((), dtype=q.dtype, device=q.device))
