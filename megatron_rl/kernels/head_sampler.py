"""The decode step's output layer and sampler in one GEMM (issue 16): logits are never written.

Today a decode step at 512 rows runs the LM head on cuBLAS (bf16 logits [B, V], ~0.2 ms at Qwen2.5's 151,936
ids) and then ``kernels.sampler``'s pass over those logits (~0.21 ms), which is bound by its per-element work
(the noise hash, exponentials, logarithms) and by the chain of its vocab loop, not by the bytes it reads.
Here each program computes one [BM, BN] tile of ``h @ W.T`` and, in the same kernel, that tile's share of the
draw:

- ``z = bf16(acc) * inv_temp`` (the logits as the GEMM would write them, scaled as the sampler scales them);
- the tile's max of z and sum of exp(z - max) (the log-sum-exp's partial);
- the tile's two best noisy scores ``z - log(E)``, E = -log(u) of ``sampling.counter_log_exponential``'s u,
  computed with fast logarithms (``lg2.approx``; below w = 1 - u < 1/64 a series for -log(1 - w)): within
  ~2e-5 of the exact score. Their ids and z are kept.

A second small kernel combines a row's tiles: the log-sum-exp, the exact score (the sampler's libdevice
logarithms, no fused multiply-adds: the eager reference's bits) of every kept candidate, and the best of
them (ties to the lowest id), its log-prob ``z - lse``. The exact winner of a row is among the candidates
unless three scores of one tile lie within ~4e-5 plus one fp32 ulp of the score of each other (the fast
scores' error twice, and the rounding of ``z - log E``: 1.5e-5 at |z| >= 128, more at low temperatures): then
the token may differ from the reference draw on these logits. Greedy (``noisy`` off) ranks z itself: exact.
The fast score's error (session 34's review, numpy over all 2^23 values of u with the worst ``lg2.approx``
error in both logarithms): at most 7.5e-6 at PTX's 2^-22.6, 1.1e-5 at 2^-22; the series within 7e-8.

The logits differ from cuBLAS's in accumulation order only (fp32 sums, rounded to bf16 as cuBLAS rounds), so
this serves the non-exact decode path (as ``decode_gemm`` does); ``rollout.exact_logprobs`` keeps cuBLAS's
batch-invariant path. Runs on CUDA where Triton is installed; tests run it on CPU under Triton's interpreter
(``RUN_ON_CPU``).
"""

from __future__ import annotations

import os

import torch

from megatron_rl.kernels.compile import env_switch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the decoder's LM head and the sampler serve
    HAVE_TRITON = False


if HAVE_TRITON:
    from megatron_rl.kernels.decode_fused import _round_to  # noqa: E402
    from megatron_rl.kernels.sampler import _hash_bits, _hash_log_noise, _row_key  # noqa: E402

    @triton.jit
    def _fast_ln(x, approx: tl.constexpr):
        """ln(x) from the SFU's ``lg2.approx`` (absolute error ~2^-22 in log2); ``approx`` off: ``tl.log``
        (Triton's interpreter runs no inline assembly)."""
        if approx:
            l2 = tl.inline_asm_elementwise(
                "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )
            return l2 * 0.6931471805599453
        return tl.log(x)

    @triton.jit
    def _fast_score(z, key, ids, approx: tl.constexpr):
        """z - log(E) with E = -log(u), u as ``sampler._hash_log_noise`` makes it, to ~2e-5: below w = 1 - u
        < 1/64 E is the series w + w^2/2 + w^3/3 + w^4/4 (w exact: u's 23 bits as a mantissa, see
        ``sampler._exp_noise_lower_bound``), else -ln(u) from ``lg2.approx``."""
        x = _hash_bits(key, ids)
        m = x >> 9
        u = (m.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        f = (m | 0x3F800000).to(tl.float32, bitcast=True)
        w = (2.0 - f) - 5.9604644775390625e-08
        series = w + w * w * (0.5 + w * (0.3333333333 + w * 0.25))
        e = tl.where(w < 0.015625, series, -_fast_ln(u, approx))
        return z - _fast_ln(e, approx)

    @triton.jit
    def _head_draw_tile_kernel(
        x_ptr, w_ptr, keys_ptr, m_ptr, l_ptr, z_ptr, id_ptr, logits_ptr, inv_temp, M, V, K, n_tiles,
        sxm, swn, sp, spb, s_lg,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, noisy: tl.constexpr, mix: tl.constexpr,
        approx: tl.constexpr, write_logits: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        pid_m = pid % num_m  # the row tiles of one column tile run together: its weights read once from HBM
        pid_n = pid // num_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        row_live = rm < M
        col_live = rn < V
        acc = tl.zeros([BM, BN], tl.float32)
        x_rows = x_ptr + rm[:, None].to(tl.int64) * sxm
        w_cols = w_ptr + rn[None, :].to(tl.int64) * swn
        for k0 in range(0, K, BK):
            kk = k0 + rk
            if EVEN_K:  # no mask along K
                x = tl.load(x_rows + kk[None, :], mask=row_live[:, None], other=0.0)
                w = tl.load(w_cols + kk[:, None], mask=col_live[None, :], other=0.0)
            else:
                x = tl.load(x_rows + kk[None, :], mask=row_live[:, None] & (kk[None, :] < K), other=0.0)
                w = tl.load(w_cols + kk[:, None], mask=col_live[None, :] & (kk[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc)
        dt: tl.constexpr = x_ptr.dtype.element_ty
        logit = _round_to(acc, dt)  # the logits as the GEMM writes them
        if write_logits:  # tests: the logits this kernel drew from
            tl.store(logits_ptr + rm[:, None].to(tl.int64) * s_lg + rn[None, :], logit.to(dt),
                     mask=row_live[:, None] & col_live[None, :])  # fmt: skip
        z = tl.where(col_live[None, :], logit * inv_temp, float("-inf"))
        ids = rn[None, :] + tl.zeros([BM, BN], tl.int32)
        # the log-sum-exp's partial (every tile holds a live column: -inf - -inf cannot happen)
        zmax = tl.max(z, 1)
        lsum = tl.sum(tl.exp(z - zmax[:, None]), 1)
        if noisy:
            key = _row_key(keys_ptr, tl.where(row_live, rm, 0), mix)
            score = tl.where(col_live[None, :], _fast_score(z, key[:, None], ids, approx), float("-inf"))
        else:
            score = z
        # the two best scores of each row (ties: the lowest id), their ids and z
        s1 = tl.max(score, 1)
        id1 = tl.min(tl.where(score == s1[:, None], ids, 2147483647), 1)
        z1 = tl.max(tl.where(ids == id1[:, None], z, float("-inf")), 1)
        rest = tl.where(ids == id1[:, None], float("-inf"), score)
        s2 = tl.max(rest, 1)
        id2 = tl.min(tl.where(rest == s2[:, None], ids, 2147483647), 1)
        id2 = tl.where(s2 == float("-inf"), -1, id2)  # a tile with one live column: no second candidate
        z2 = tl.max(tl.where(ids == id2[:, None], z, float("-inf")), 1)
        at = rm * spb + pid_n
        tl.store(m_ptr + at, zmax, mask=row_live)
        tl.store(l_ptr + at, lsum, mask=row_live)
        tl.store(z_ptr + at, z1, mask=row_live)
        tl.store(z_ptr + sp + at, z2, mask=row_live)
        tl.store(id_ptr + at, id1, mask=row_live)
        tl.store(id_ptr + sp + at, id2, mask=row_live)

    @triton.jit
    def _head_draw_combine_kernel(
        keys_ptr, m_ptr, l_ptr, z_ptr, id_ptr, tok_ptr, lse_ptr, lp_ptr, n_tiles, sp, spb,
        CHUNK: tl.constexpr, noisy: tl.constexpr, mix: tl.constexpr, libdevice_log: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        key = _row_key(keys_ptr, b, mix)
        t = tl.arange(0, CHUNK)
        # the log-sum-exp over the row's tiles
        mx = tl.full([CHUNK], float("-inf"), tl.float32)
        for c0 in range(0, n_tiles, CHUNK):
            mx = tl.maximum(mx, tl.load(m_ptr + b * spb + c0 + t, mask=c0 + t < n_tiles, other=float("-inf")))
        top_m = tl.max(mx, 0)
        lsum = tl.zeros([CHUNK], tl.float32)
        best = tl.full([CHUNK], float("-inf"), tl.float32)
        best_id = tl.full([CHUNK], 2147483647, tl.int32)
        best_z = tl.zeros([CHUNK], tl.float32)
        for c0 in range(0, n_tiles, CHUNK):
            live = c0 + t < n_tiles
            at = b * spb + c0 + t
            m = tl.load(m_ptr + at, mask=live, other=float("-inf"))
            lsum += tl.where(live, tl.load(l_ptr + at, mask=live, other=0.0) * tl.exp(m - top_m), 0.0)
            for j in tl.static_range(2):  # each tile's two candidates, scored exactly
                z = tl.load(z_ptr + j * sp + at, mask=live, other=float("-inf"))
                i = tl.load(id_ptr + j * sp + at, mask=live, other=-1)
                ok = live & (i >= 0)
                if noisy:
                    s = z - _hash_log_noise(key, tl.where(ok, i, 0), libdevice_log)
                else:
                    s = z
                s = tl.where(ok, s, float("-inf"))
                take = ok & ((s > best) | ((s == best) & (i < best_id)))
                best = tl.where(take, s, best)
                best_id = tl.where(take, i, best_id)
                best_z = tl.where(take, z, best_z)
        lse = top_m + tl.log(tl.sum(lsum, 0))
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, best_id, 2147483647), 0)
        z_tok = tl.max(tl.where((best == top) & (best_id == tok), best_z, float("-inf")), 0)
        tl.store(tok_ptr + b, tok.to(tl.int64))
        tl.store(lse_ptr + b, lse)
        tl.store(lp_ptr + b, z_tok - lse)


# Tests run the kernels on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is
# first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
# Off until measured on a GPU (session 34 wrote it while no device came): MEGATRON_RL_HEAD_SAMPLER=1 turns it
# on; off, the decode step keeps cuBLAS's LM head and the sampler kernel.
ON_CUDA = env_switch("MEGATRON_RL_HEAD_SAMPLER", False)


def _tile_from_env(default: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) of the tile kernel: ``default``, or MEGATRON_RL_HEAD_SAMPLER_TILE
    ("128,128,64,8,3": five positive integers, BM / BN / BK powers of two >= 16, num_warps a power of two)."""
    raw = os.environ.get("MEGATRON_RL_HEAD_SAMPLER_TILE", "").strip()
    if not raw:
        return default
    try:
        tile = tuple(int(v) for v in raw.split(","))
    except ValueError:
        tile = ()
    bad_warps = len(tile) == 5 and tile[3] & (tile[3] - 1)
    if len(tile) != 5 or min(tile) < 1 or bad_warps or any(t < 16 or t & (t - 1) for t in tile[:3]):
        raise ValueError(
            f"MEGATRON_RL_HEAD_SAMPLER_TILE={raw!r}: give BM,BN,BK,num_warps,num_stages as five positive "
            f"integers with BM, BN, BK powers of two >= 16 and num_warps a power of two (e.g. 128,128,64,8,3), "
            f"or unset it"
        )
    return tile


# (BM, BN, BK, num_warps, num_stages) of the tile kernel unless MEGATRON_RL_HEAD_SAMPLER_TILE says otherwise
TILE = (128, 128, 64, 8, 3)


def current_tile() -> tuple[int, int, int, int, int]:
    """The tile the kernel runs: ``TILE`` or the environment's (read when the fused head is used, so a bad
    value stops the engine where it would run, not every import)."""
    return _tile_from_env(TILE)


def serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the kernel runs for activations of ``dtype`` on ``device``: Triton importable, bf16 / fp16 on
    CUDA with ``ON_CUDA``, or on CPU with ``RUN_ON_CPU`` (fp32 too: the interpreter's dot is exact fp32). Raises
    the tile setting's error where it would serve."""
    dev = torch.device(device).type
    half = dtype in (torch.bfloat16, torch.float16)
    ok = HAVE_TRITON and (
        (ON_CUDA and dev == "cuda" and half)
        or (RUN_ON_CPU and dev == "cpu" and (half or dtype == torch.float32))
    )
    if ok:
        current_tile()  # a malformed MEGATRON_RL_HEAD_SAMPLER_TILE stops here, naming the variable
    return ok


def usable(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused head and draw serves h [B, hidden] against weight [Vp, hidden]: ``serves`` their
    device and dtype (one dtype), contiguous rows."""
    return (
        serves(h.device, h.dtype)
        and weight.dtype == h.dtype
        and h.dim() == 2
        and weight.dim() == 2
        and h.shape[1] == weight.shape[1]
        and h.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def draw(
    h: torch.Tensor, weight: torch.Tensor, vocab: int, keys: torch.Tensor, inv_temp: float, noisy: bool,
    mix: bool = True, tile: tuple[int, int, int, int, int] | None = None, logits_out: torch.Tensor | None = None,
    approx: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """h [B, hidden] (final-normed), weight [Vp, hidden] (the output layer), the first ``vocab`` ids drawn
    from -> tokens [B] int64, the log-sum-exp [B] of ``logits * inv_temp`` and the tokens' log-probs [B]
    (fp32), as ``kernels.sampler.draw(h @ weight[:vocab].T, keys, inv_temp, noisy, mix=mix, logprobs=True)``
    on this kernel's logits (see the module docstring for the one way a token may differ). ``keys`` [B]
    int64: raw row keys with ``mix`` (mixed here as ``sampling.mix64``), else ``mix64(k) & 0xFFFFFFFF``.
    ``logits_out`` [B, >= vocab] (tests): also write the logits. ``approx``: the SFU logarithms (default:
    on the GPU)."""
    rows, hidden = h.shape
    bm, bn, bk, warps, stages = tile or current_tile()
    n_tiles = triton.cdiv(vocab, bn)
    dev = h.device
    on_gpu = dev.type != "cpu"
    approx = on_gpu if approx is None else approx
    part = torch.empty(4, rows, n_tiles, dtype=torch.float32, device=dev)  # m, l, z1, z2
    ids = torch.empty(2, rows, n_tiles, dtype=torch.int32, device=dev)
    z_parts = part[2:]
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    out = torch.empty(2, rows, dtype=torch.float32, device=dev)  # lse, log-probs
    write = logits_out is not None
    lg = logits_out if write else part
    opts = {"enable_fp_fusion": False, "num_stages": stages} if on_gpu else {}
    grid = (triton.cdiv(rows, bm) * n_tiles,)
    _head_draw_tile_kernel[grid](
        h, weight, keys, part[0], part[1], z_parts, ids, lg, float(inv_temp), rows, vocab, hidden, n_tiles,
        h.stride(0), weight.stride(0), rows * n_tiles, n_tiles, lg.stride(0) if write else 0,
        BM=bm, BN=bn, BK=bk, noisy=noisy, mix=mix, approx=approx, write_logits=write, EVEN_K=hidden % bk == 0,
        num_warps=warps, **opts,
    )  # fmt: skip
    _head_draw_combine_kernel[(rows,)](
        keys, part[0], part[1], z_parts, ids, tokens, out[0], out[1], n_tiles, rows * n_tiles, n_tiles,
        CHUNK=256, noisy=noisy, mix=mix, libdevice_log=on_gpu, num_warps=4,
        **({"enable_fp_fusion": False} if on_gpu else {}),
    )  # fmt: skip
    return tokens, out[0], out[1]
