"""Decode-step GEMMs with their neighbours fused in, for the few rows of a decode step (issue 16).

At decode row counts the MLP and the attention output projection run at the GEMM's latency floor, not its
FLOPs or its weight bytes (session 22: ~4-9 us a call whatever the rows up to ~128), and each is followed by
a small elementwise kernel (~2-2.5 us). Here:

- ``swiglu_gemm``: fc1 and SwiGLU in one kernel. Each program computes the same column tile of the gate
  half and of the up half (two accumulators over one read of the rows), rounds each to the activation
  dtype (as the GEMM's output would be) and writes silu(gate) * up: the [rows, 2F] fc1 output is never
  written, and the SwiGLU kernel goes.
- ``splitk_gemm``: y = x @ w.T left as ``splits`` fp32 partial sums over slices of K (no atomics: each
  program writes its own slice's tile), so a narrow output (the hidden size) still fills the GPU.
- ``add_rms_norm_parts``: the sum of those partials in a fixed order, rounded to the activation dtype (the
  GEMM's output), then the residual add and the RMSNorm after it (``decode_fused.add_rms_norm``'s kernel,
  which takes the summands): the split-K reduction costs no kernel of its own.

Results are deterministic (a fixed reduction order for a given launch configuration); they are not the
bits of cuBLAS (another order), so these serve the non-exact decode path only, as ``decode_fused`` does.
Tests run them on CPU under Triton's interpreter (``decode_fused.RUN_ON_CPU``).
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.nn.functional as F

from megatron_rl.kernels import decode_fused
from megatron_rl.kernels.compile import env_switch, trial_once, trial_passed

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the decoder keeps its reference ops
    HAVE_TRITON = False


if HAVE_TRITON:
    from megatron_rl.kernels.decode_fused import _round_to  # noqa: E402

    @triton.jit
    def _swiglu_gemm_kernel(
        x_ptr, w_ptr, out_ptr, M, F, K, sxm, swn, som,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        w_rows = w_ptr + rn[None, :].to(tl.int64) * swn
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)  # fmt: skip
            live = (rn[None, :] < F) & (kk[:, None] < K)
            wg = tl.load(w_rows + kk[:, None], mask=live, other=0.0)  # [BK, BN]: rows rn of the gate half
            wu = tl.load(w_rows + F * swn + kk[:, None], mask=live, other=0.0)  # the same rows of the up half
            gate = tl.dot(x, wg, gate)
            up = tl.dot(x, wu, up)
        dt: tl.constexpr = out_ptr.dtype.element_ty
        g = _round_to(gate, dt)  # fc1's output as the GEMM would write it, then SwiGLU in fp32, one rounding
        u = _round_to(up, dt)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(
            out_ptr + rm[:, None] * som + rn[None, :], act.to(dt), mask=(rm[:, None] < M) & (rn[None, :] < F)
        )

    @triton.jit
    def _splitk_kernel(
        x_ptr, w_ptr, p_ptr, M, N, K, k_split, sxm, swn, sps, spm,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_m, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        w_rows = w_ptr + rn[None, :].to(tl.int64) * swn
        k_end = tl.minimum(K, (s + 1) * k_split)
        for k0 in range(s * k_split, k_end, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < k_end),
                        other=0.0)  # fmt: skip
            w = tl.load(w_rows + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)
            acc = tl.dot(x, w, acc)
        tl.store(
            p_ptr + s * sps + rm[:, None] * spm + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N)
        )

    @triton.jit
    def _qkv_rope_kernel(
        x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, M, K, sxm, swn, sc_b, sc_d,
        sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t,
        rep: tl.constexpr, dim: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr,
    ):  # fmt: skip
        # program (head, column slice j of it, row tile): the head's columns j*BN.. and, for RoPE, the columns
        # half a head away (x @ w.T at the rolled rows of w: a second dot on weight rows this program reads anyway)
        pid, pid_m = tl.program_id(0), tl.program_id(1)
        per_head: tl.constexpr = dim // BN
        head, j = pid // per_head, pid % per_head
        g, r = (
            (head // (rep + 2)).to(tl.int64),
            head % (rep + 2),
        )  # megatron-core's layout: per group rep q, k, v
        rm = pid_m * BM + tl.arange(0, BM)
        cols = j * BN + tl.arange(0, BN)  # within the head
        rolled = (cols + dim // 2) % dim
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        acc_r = tl.zeros([BM, BN], tl.float32)
        rows_w = w_ptr + (head * dim + cols)[None, :].to(tl.int64) * swn
        rows_r = w_ptr + (head * dim + rolled)[None, :].to(tl.int64) * swn
        for k0 in range(0, K, BK):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)  # fmt: skip
            acc = tl.dot(x, tl.load(rows_w + kk[:, None], mask=kk[:, None] < K, other=0.0), acc)
            # (v's programs need no rolled columns; one loop for every head keeps the pipeline simple)
            acc_r = tl.dot(x, tl.load(rows_r + kk[:, None], mask=kk[:, None] < K, other=0.0), acc_r)
        dt: tl.constexpr = q_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + head * dim + cols).to(tl.float32)[None, :]
            acc_r += tl.load(b_ptr + head * dim + rolled).to(tl.float32)[None, :]
        val = _round_to(acc, dt)  # the qkv GEMM's output as F.linear writes it
        live = rm[:, None] < M
        b = rm.to(tl.int64)
        if r == rep + 1:
            pos = tl.load(pos_ptr + rm, mask=rm < M, other=0)
            at = v_ptr + b[:, None] * sv_b + g * sv_g + pos[:, None] * sv_t + cols[None, :]
            tl.store(at, val.to(v_ptr.dtype.element_ty), mask=live)
        else:  # decode_fused.rope_kv_write's formula and rounding
            cos = tl.load(cos_ptr + b[:, None] * sc_b + cols[None, :] * sc_d, mask=live, other=0.0).to(
                tl.float32
            )
            sin = tl.load(sin_ptr + b[:, None] * sc_b + cols[None, :] * sc_d, mask=live, other=0.0).to(
                tl.float32
            )
            rot = (val * cos + _round_to(acc_r, dt) * sin).to(dt)
            if r == rep:
                pos = tl.load(pos_ptr + rm, mask=rm < M, other=0)
                at = k_ptr + b[:, None] * sk_b + g * sk_g + pos[:, None] * sk_t + cols[None, :]
                tl.store(at, rot.to(k_ptr.dtype.element_ty), mask=live)
            else:
                at = q_ptr + b[:, None] * sq_b + g * sq_g + r * sq_r + cols[None, :]
                tl.store(at, rot, mask=live)


def row_tile(rows: int) -> int:
    """The row tile for ``rows`` rows: a power of two from 16 (``tl.dot``'s least) to 64."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def swiglu_gemm(x: torch.Tensor, w: torch.Tensor, bn: int = 64, bk: int = 64, num_warps: int = 4,
                num_stages: int = 3) -> torch.Tensor:  # fmt: skip
    """x [M, K], w [2F, K] (gate rows, then up rows; unit stride in K for both) -> silu(x @ gate.T) *
    (x @ up.T) [M, F] in x's dtype, each GEMM output rounded to that dtype first (as ``F.linear`` then
    ``decode_fused.swiglu``)."""
    rows, k = x.shape
    ffn = w.shape[0] // 2
    out = torch.empty(rows, ffn, dtype=x.dtype, device=x.device)
    bm = row_tile(rows)
    _swiglu_gemm_kernel[(triton.cdiv(ffn, bn), triton.cdiv(rows, bm))](
        x, w, out, rows, ffn, k, x.stride(0), w.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def splitk_gemm(x: torch.Tensor, w: torch.Tensor, splits: int, bn: int = 64, bk: int = 64, num_warps: int = 4,
                num_stages: int = 3) -> torch.Tensor:  # fmt: skip
    """x [M, K], w [N, K] (unit stride in K) -> fp32 partial products [splits, M, N] over ``splits`` slices
    of K (each a multiple of ``bk``; a slice past K writes zeros): their sum is x @ w.T."""
    rows, k = x.shape
    n = w.shape[0]
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    parts = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    bm = row_tile(rows)
    _splitk_kernel[(triton.cdiv(n, bn), triton.cdiv(rows, bm), splits)](
        x, w, parts, rows, n, k, k_split, x.stride(0), w.stride(0), parts.stride(0), parts.stride(1),
        BM=bm, BN=bn, BK=bk, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return parts


def splitk_cublas(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """``splitk_gemm``'s partials [splits, M, N] (fp32) from cuBLAS: one strided-batched GEMM over ``splits``
    equal slices of K (K % splits == 0), each slice's product written in fp32 (``torch.bmm``'s
    ``out_dtype``). cuBLAS picks its own tiles for each slice, which at decode rows fill the GPU where the
    whole-K GEMM's narrow output (the hidden size) leaves most SMs idle. On CPU (tests) the same slices in
    fp32 (``bmm``'s out_dtype has no CPU kernel); ``out_dtype`` needs torch >= 2.8 (older: the setting's trial
    fails, with a warning, and cuBLAS's whole-K GEMM serves)."""
    rows, k = x.shape
    if k % splits:
        raise ValueError(f"splits {splits} does not divide K = {k}")
    xs = x.view(rows, splits, k // splits).transpose(0, 1)  # [S, M, K/S], views of x
    ws = w.view(w.shape[0], splits, k // splits).permute(1, 2, 0)  # [S, K/S, N], views of w
    if x.device.type == "cpu":
        return torch.bmm(xs.float(), ws.float())
    return torch.bmm(xs, ws, out_dtype=torch.float32)


def partials(x: torch.Tensor, w: torch.Tensor, s: dict) -> torch.Tensor:
    """The fp32 split-K partials [S, M, N] of x @ w.T for a split-K part's setting ``s``: cuBLAS's
    (``splitk_cublas``) where ``s`` says ``"cublas": 1``, else ``splitk_gemm``'s Triton kernel."""
    s = dict(s)
    splits = s.pop("splits")
    if s.pop("cublas", 0):
        return splitk_cublas(x, w, splits)
    return splitk_gemm(x, w, splits, **s)


def qkv_rope(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rep: int, dim: int,
             bn: int | None = None, bk: int = 64, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:  # fmt: skip
    """The decode step's qkv GEMM, RoPE and KV-cache write in one kernel: x [B, h], w [G*(rep+2)*D, h] (per
    group rep query heads, then k, then v), bias [G*(rep+2)*D] or None, cos / signed sin [B, D], positions [B],
    k_cache / v_cache [B, G, T, D] (unit stride in D) -> rotated q [B, G, rep, D]; rotated k and raw v written
    at each row's position. ``F.linear`` (rounded to x's dtype) then ``decode_fused.rope_kv_write``'s formula.
    ``bn``: columns of a head per program (D, D/2, D/4: more programs for few rows)."""
    rows, k = x.shape
    heads = w.shape[0] // dim
    groups = heads // (rep + 2)
    bn = dim if bn is None else bn
    q = torch.empty(rows, groups, rep, dim, dtype=x.dtype, device=x.device)
    bm = row_tile(rows)
    _qkv_rope_kernel[(heads * (dim // bn), triton.cdiv(rows, bm))](
        x, w, w if bias is None else bias, cos, sin, positions, q, k_cache, v_cache, rows, k, x.stride(0),
        w.stride(0), cos.stride(0), cos.stride(1), q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), rep=rep, dim=dim, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return q


def add_rms_norm_parts(x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float):
    """x [M, h] (unit stride in h), parts [S, M, h] fp32 (``splitk_gemm``), weight [h] -> (x + y, rms_norm of
    it), y the partials' sum rounded to x's dtype: ``decode_fused.add_rms_norm(x, F.linear(...), ...)``, by
    the same kernel (which sums the partials in order)."""
    return decode_fused.add_rms_norm(x, parts, weight, eps)


# --- where the decoder uses them -------------------------------------------------------------------------
# MEGATRON_RL_DECODE_GEMM=0 (or false/off/no) keeps cuBLAS and the separate elementwise kernels everywhere.
ON_CUDA = env_switch("MEGATRON_RL_DECODE_GEMM", True)
# qkv + RoPE + the KV write; fc1 + SwiGLU; fc2 / the attention output projection + add + RMSNorm
PARTS = ("qkv", "fc1", "fc2", "proj")
SPLIT_K = ("fc2", "proj")
_KEYS = {"bn", "bk", "num_warps", "num_stages", "splits", "cublas"}
# Per part, per weight shape [N, K] measured (None: any): per decode row count, the launch setting for a step
# of up to that many rows (the smallest entry >= the rows serves; null or past the last entry: cuBLAS). Empty
# until measured on a GPU: benchmarks/bench_decode_gemm.py writes a table (JSON: {"device": name, "parts":
# {part: {"weight": [N, K], "rows": {rows: setting or null}}}}, a part's value also a list of such objects),
# MEGATRON_RL_DECODE_GEMM_TABLE=FILE puts one in force.
TABLE: dict[str, list[dict]] = {}
TABLE_ENV = "MEGATRON_RL_DECODE_GEMM_TABLE"
_LOADED: list = []  # the table in force, read once
_FROM_ENV: list = []  # [True] once ``table()`` has read MEGATRON_RL_DECODE_GEMM_TABLE's file


def _setting_problem(part: str, s: object, weight: list | None = None) -> str | None:
    """Why ``s`` is not a launch setting of ``part`` for a weight of shape ``weight`` ([N, K]; None: any) (None:
    it is one, or null)."""
    if s is None:
        return None
    if not isinstance(s, dict) or not set(s) <= _KEYS:
        return f"expected null or an object with keys among {sorted(_KEYS)}"
    if "cublas" in s:  # cuBLAS's split-K partials (``splitk_cublas``): no Triton tile to set
        if part not in SPLIT_K or s["cublas"] != 1 or set(s) != {"cublas", "splits"}:
            return f'"cublas": 1 is for {" / ".join(SPLIT_K)} only, with "splits" and no other key'
    elif not {"bn", "bk"} <= set(s):
        return "bn and bk are required"
    if not all(type(v) is int and v > 0 for v in s.values()):
        return "every value must be a positive integer"
    if not all(s[k] & (s[k] - 1) == 0 and s[k] >= 16 for k in ("bn", "bk") if k in s):
        return "bn and bk must be powers of two >= 16"
    if s.get("num_warps", 4) not in (1, 2, 4, 8, 16):
        return "num_warps must be 1, 2, 4, 8 or 16"
    if (part in SPLIT_K) != ("splits" in s):
        return f"splits is required for {' / '.join(SPLIT_K)} and taken by them only"
    if "cublas" in s and weight is not None and weight[1] % s["splits"]:  # equal K slices (``splitk_cublas``)
        return f"splits {s['splits']} does not divide the weight's K = {weight[1]}"
    return None


def parse_table(raw: object, source: str) -> dict[str, list[dict]]:
    """A table as ``TABLE``'s type ({part: [{"weight": (N, K) or None, "rows": {rows: setting or None}}, ...]})
    from its JSON form (a part's value one such object or a list of them, one per weight shape: the sizes and
    TP degrees measured); anything else raises a ValueError naming ``source``, the key and what is expected."""
    if (
        not isinstance(raw, dict)
        or not set(raw) <= {"device", "parts"}
        or not isinstance(raw.get("parts"), dict)
    ):
        raise ValueError(f'{source}: expected {{"device": ..., "parts": {{part: ...}}}}, got {raw!r:.200}')
    out = {}
    for part, entries in raw["parts"].items():
        if part not in PARTS:
            raise ValueError(f"{source}: part {part!r} is not one of {PARTS}")
        out[part] = []
        for entry in entries if isinstance(entries, list) else [entries]:
            if (
                not isinstance(entry, dict)
                or not set(entry) <= {"weight", "rows"}
                or not isinstance(entry.get("rows"), dict)
            ):
                raise ValueError(
                    f'{source}: {part} must be {{"weight": [N, K], "rows": {{...}}}} or a list of them, got {entry!r:.200}'
                )
            weight = entry.get("weight")
            if weight is not None and not (
                isinstance(weight, list) and len(weight) == 2 and all(type(v) is int for v in weight)
            ):
                raise ValueError(f"{source}: {part}: weight {weight!r} is not [N, K]")
            rows = {}
            for r, st in entry["rows"].items():
                if not (str(r).isascii() and str(r).isdigit()) or int(r) < 1 or int(r) in rows:
                    raise ValueError(
                        f"{source}: {part}: row count {r!r} is not a positive integer, or repeats one"
                    )
                problem = _setting_problem(part, st, weight)
                if problem:
                    raise ValueError(f"{source}: {part} at {r} rows: {st!r}: {problem}")
                rows[int(r)] = st
            out[part].append({"weight": None if weight is None else tuple(weight), "rows": rows})
        shapes = [e["weight"] for e in out[part]]
        if len(set(shapes)) != len(shapes):
            raise ValueError(f"{source}: {part}: a weight shape has two entries ({shapes})")
    return out


def _no_repeats(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key repeats: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    return dict(pairs)


def table() -> dict[str, list[dict]]:
    """The table in force: ``MEGATRON_RL_DECODE_GEMM_TABLE``'s file where set (read once, JSON only: no code
    runs), else ``TABLE``. A file that cannot be read or parsed raises a ValueError naming the variable and
    the file; the engine reads it when it is built, before any GPU work."""
    if not _LOADED:
        path = os.environ.get(TABLE_ENV)
        if path:
            source = f"{TABLE_ENV}={path}"
            try:
                with open(path) as f:
                    raw = json.load(f, object_pairs_hook=_no_repeats)
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"{source}: {type(exc).__name__}: {exc} (a JSON table from benchmarks/bench_decode_gemm.py "
                    f"--table; unset {TABLE_ENV} to run without one)"
                ) from exc
            _LOADED.append(parse_table(raw, source))
            _FROM_ENV.append(True)
        else:
            _LOADED.append(TABLE)
    return _LOADED[0]


_UNMATCHED: set[tuple] = set()  # (part, weight shape) told once that the table has no entry for it


def setting(part: str, rows: int, weight: tuple | None = None) -> dict | None:
    """The launch setting of ``part`` for a decode step of ``rows`` rows with a weight of shape ``weight``
    (None: any), or None (cuBLAS serves). The entry measured at that weight shape serves (else one without a
    shape); where the part has entries for other shapes only, cuBLAS serves, and for a table read from
    ``MEGATRON_RL_DECODE_GEMM_TABLE`` a warning says so once (entries in the built-in ``TABLE``, empty today,
    would name the shapes measured for this repository's benchmarks; other models keep cuBLAS without a word)."""
    entries = table().get(part, [])
    entry = next((e for e in entries if weight is not None and e["weight"] == tuple(weight)), None)
    entry = entry or next((e for e in entries if e["weight"] is None), None)
    if entry is None:
        if entries and _FROM_ENV and (part, weight) not in _UNMATCHED:
            _UNMATCHED.add((part, weight))
            warnings.warn(
                f"{TABLE_ENV}: the {part} entries were measured at weights {[e['weight'] for e in entries]}, not "
                f"{weight}; cuBLAS serves it (run benchmarks/bench_decode_gemm.py at this model's shape and TP)",
                stacklevel=3,
            )
        return None
    fit = [r for r in entry["rows"] if r >= rows]
    return entry["rows"][min(fit)] if fit else None


def usable(part: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, rep: int = 0,
           dim: int = 0) -> dict | None:  # fmt: skip
    """The setting ``part`` runs with for input x [rows, K] and weight w (``setting``; for ``qkv`` also its bias,
    the query heads per group and the head dim), where the kernels serve x's device and dtype
    (``decode_fused``'s rule and switches, and ``ON_CUDA``) and a one-time trial of that launch (x's rows,
    the weight's shape) against cuBLAS and the unfused kernels passed; else None. The trial runs eagerly (the
    engine's warm-up step precedes each capture); not yet tried while a graph is captured, the part keeps
    cuBLAS in that graph. A failed trial warns once and keeps cuBLAS."""
    if not HAVE_TRITON or not decode_fused.enabled(x) or (x.device.type == "cuda" and not ON_CUDA):
        return None
    s = setting(part, x.shape[0], tuple(w.shape))
    if s is None or x.stride(-1) != 1 or w.stride(-1) != 1 or (bias is not None and bias.stride(-1) != 1):
        return None  # (the kernels read rows with unit stride in K)
    # per row count, not per row tile: Triton compiles M == 1 and M % 16 == 0 apart, and each compile is tried
    key = (
        f"the fused decode GEMM {part} {s} ({x.device.type}, {x.dtype}, {x.shape[0]} rows, weight "
        f"{tuple(w.shape)}{', bias' if bias is not None else ''}{f', {rep} heads a group of dim {dim}' if rep else ''})"
    )
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing() and not trial_passed(key):
        return None
    ok = trial_once(
        key,
        lambda: _trial(part, s, x, w, bias, rep, dim),
        f"The fused decode GEMM {part} {s} failed its trial at {x.shape[0]} rows; cuBLAS and the separate "
        "kernels serve instead (slower, same results up to rounding).",
    )
    return s if ok else None


def _trial(part: str, s: dict, x: torch.Tensor, w: torch.Tensor, bias, rep: int, dim: int) -> None:
    g = torch.Generator().manual_seed(0)
    rows, dev, dt = x.shape[0], x.device, x.dtype
    xt = torch.randn(x.shape, generator=g).to(dev, dt)
    if part == "qkv":
        if dim % s["bn"]:
            raise ValueError(f"bn {s['bn']} does not divide the head dim {dim}")
        groups = w.shape[0] // ((rep + 2) * dim)
        pos = torch.randint(0, 8, (rows,), generator=g).to(dev)
        cos, sin = (torch.randn(rows, dim, generator=g).to(dev, dt) for _ in range(2))
        caches = torch.randn(2, rows, groups, 8, dim, generator=g).to(dev, dt)
        ref = caches.clone()
        qkv = F.linear(xt, w, bias).view(rows, groups, rep + 2, dim)
        want = [decode_fused.rope_kv_write_reference(qkv, cos, sin, pos, ref[0], ref[1]), ref]
        got = [qkv_rope(xt, w, bias, cos, sin, pos, caches[0], caches[1], rep, dim, **s), caches]
    elif part == "fc1":
        got, want = [swiglu_gemm(xt, w, **s)], [decode_fused.swiglu_reference(F.linear(xt, w))]
    else:
        resid = torch.randn(rows, w.shape[0], generator=g).to(dev, dt)
        norm = torch.ones(w.shape[0], device=dev, dtype=dt)
        parts = partials(xt, w, s)
        got = list(add_rms_norm_parts(resid, parts, norm, 1e-6))  # the sum x + y and its norm
        want = list(decode_fused.add_rms_norm_reference(resid, F.linear(xt, w), norm, 1e-6))
    for a, b in zip(got, want):
        scale = float(b.float().abs().max())
        gap = float((a.float() - b.float()).abs().max())
        if not gap <= 2e-2 * max(scale, 1e-6):  # nan fails too
            raise ValueError(
                f"result differs from cuBLAS and the unfused kernels by {gap:.3g} (largest value {scale:.3g})"
            )
