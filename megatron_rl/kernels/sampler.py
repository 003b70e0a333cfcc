"""The sampler's draw as one Triton pass over the logits: per row the log-sum-exp of the scaled logits and
the token ``argmax(z - log(-log(u)))``, with u the counter noise of ``rollout.sampling.counter_log_exponential``.

Why not the compiled ``_draw``: inductor writes the noise hash in int64 (the reference's dtype), and 64-bit
multiplies are emulated on the GPU; measured on an H200 at B=512, V=151936 it took 0.52 ms, 16x the time
to read the logits. Here the per-element hash runs in uint32 (the same bits: the reference masks every
product to 32 bits), and only the per-row key mixing (``mix64``, [B]) stays in torch.

Noise bits: ``libdevice.log`` (the CUDA math library's ``logf``, which eager torch calls) and no fused
multiply-adds (``enable_fp_fusion=False``), so ``z`` and ``z - noise`` round as in the eager reference.
Ties go to the lowest token id (``torch.argmax``'s rule).

Parallelism: a row's vocab is split over ``splits`` programs (chosen from B alone, so a call is CUDA-graph
capturable: no host syncs, allocations sized by B), each writing a partial (max, sum-exp, best score,
best id); a small second kernel combines them. Runs on CUDA where Triton is installed; tests run it on
CPU under Triton's interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import torch

from megatron_rl.kernels.compile import env_switch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the compiled or eager draw serves
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _hash_bits(key, ids):
        """The 32 hashed bits of (uint32 row key, int32 token id): ``counter_log_exponential``'s."""
        x = key + ids.to(tl.uint32) * 0x9E3779B9
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _hash_log_noise(key, ids, libdevice_log: tl.constexpr):
        """log(-log(u)) for uint32 row keys and int32 token ids: ``counter_log_exponential``'s bits.
        ``libdevice_log`` off: ``tl.log`` (Triton's interpreter has no libdevice)."""
        x = _hash_bits(key, ids)
        u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 uniform bits -> (0, 1), exact
        if libdevice_log:
            return libdevice.log(-libdevice.log(u))
        return tl.log(-tl.log(u))

    @triton.jit
    def _exp_noise_lower_bound(key, ids):
        """A lower bound of E = -log(u) (u as in ``_hash_log_noise``) without a logarithm or an int-to-float
        conversion: u's 23 bits as the mantissa of f in [1, 2) give u = f - 1 + 2^-24, so w = (2 - f) - 2^-24
        is 1 - u exactly (multiples of 2^-24 in (0, 1)), and -log(1 - w) = w + w^2/2 + w^3/3 + ... >=
        w + w^2/2 + w^3/3 (up to fp32 rounding, inside the filter's margin). Tight where the noise is large
        (u near 1: the draws that win), loose where it is small; never below 2^-24."""
        x = _hash_bits(key, ids)
        f = ((x >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
        w = (2.0 - f) - 5.9604644775390625e-08
        return w + w * w * (0.5 + w * 0.3333333)

    @triton.jit
    def _mix64(x):
        """``sampling.mix64`` on uint64 (splitmix64's finaliser: logical shifts, products mod 2^64)."""
        x = x ^ (x >> 30)
        x = x * 0xBF58476D1CE4E5B9
        x = x ^ (x >> 27)
        x = x * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _row_key(keys_ptr, b, mix: tl.constexpr):
        """Row b's uint32 noise key: with ``mix`` the raw int64 key through ``_mix64`` and its low 32 bits,
        else the key as given."""
        if mix:
            return _mix64(tl.load(keys_ptr + b).to(tl.uint64, bitcast=True)).to(tl.uint32)
        return tl.load(keys_ptr + b).to(tl.uint32)

    @triton.jit
    def _store_logprob(logits_ptr, lp_ptr, b, stride_b, tok, lse, inv_temp):
        """The drawn token's log-prob: its scaled logit minus the log-sum-exp, the fp32 ops of the eager
        ``logits.gather(tok).float() * inv_temp - lse``."""
        z = tl.load(logits_ptr + b.to(tl.int64) * stride_b + tok).to(tl.float32) * inv_temp
        tl.store(lp_ptr + b, z - lse)

    @triton.jit
    def _margin(top):
        """The filter's slack on the best score so far: covers every fp32 rounding of the bound and the score."""
        return 0.01 + tl.abs(top) * 0.0009765625

    @triton.jit
    def _filtered_block(key, ids, z, live, best, best_id, top, libdevice_log: tl.constexpr):
        """One block of the filtered noisy draw -> (best, best_id, top) updated.

        z - log(E) > top needs E < exp(z - top), so E's cheap lower bound decides whether any element of the
        block may beat the best score so far; only then the block pays for the two exact logarithms. The margin
        (0.01 + |top| / 1024) covers every rounding of both sides. Later ids lose ties, so a skipped element
        that could only equal top changes nothing. Masked lanes: exp(-inf) = 0 < the bound (>= 2^-24); "<="
        also keeps an underflowed exp safe."""
        maybe = _exp_noise_lower_bound(key, ids) <= tl.exp(z - top + _margin(top))
        if tl.max(maybe.to(tl.int32), 0) > 0:
            score = z - _hash_log_noise(key, ids, libdevice_log)
            take = live & (score > best)  # strict: a lane's earlier (lower) id keeps a tie
            best = tl.where(take, score, best)
            best_id = tl.where(take, ids, best_id)
            top = tl.max(best, 0)
        return best, best_id, top

    @triton.jit
    def _draw_partial_kernel(
        logits_ptr, keys_ptr, m_ptr, l_ptr, best_ptr, idx_ptr, tok_ptr, lse_ptr, lp_ptr, inv_temp, stride_b,
        vocab, chunk, splits: tl.constexpr, noisy: tl.constexpr, block: tl.constexpr, libdevice_log: tl.constexpr,
        filtered: tl.constexpr, mix: tl.constexpr, logprobs: tl.constexpr, block_skip: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        s = tl.program_id(1)
        row = logits_ptr + b.to(tl.int64) * stride_b
        key = _row_key(keys_ptr, b, mix)
        lane = tl.arange(0, block)
        m = tl.full([block], float("-inf"), tl.float32)  # per lane: running max of z
        lsum = tl.zeros([block], tl.float32)  # per lane: sum of exp(z - m)
        best = tl.full([block], float("-inf"), tl.float32)  # per lane: best score, its (lowest) id
        best_id = tl.zeros([block], tl.int32)
        top = float("-inf")  # filtered: the program's best score so far (the max over lanes of best)
        big = float("-inf")  # block_skip: the program's running max of z (one for all lanes)
        start = s * chunk
        end = tl.minimum(start + chunk, vocab)
        for off in range(start, end, block):
            ids = off + lane
            live = ids < end
            z = tl.load(row + ids, mask=live, other=float("-inf")).to(tl.float32) * inv_temp
            if block_skip:  # the block's max (one reduction) as every lane's base: one exp per element
                zmax = tl.max(z, 0)
                big_new = tl.maximum(big, zmax)
                big_safe = tl.where(big_new == float("-inf"), 0.0, big_new)  # no -inf - -inf
                lsum = lsum * tl.exp(big - big_safe) + tl.exp(z - big_safe)
                big = big_new
            elif filtered:  # one exp per element: exp(-|z - m|) rescales the sum or is the new term
                up = z > m
                d = tl.where(up, m - z, z - m)
                e = tl.exp(tl.where(z == float("-inf"), float("-inf"), d))  # no -inf - -inf
                lsum = tl.where(up, lsum * e + 1.0, lsum + e)
                m = tl.where(up, z, m)
            else:
                m_new = tl.maximum(m, z)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf before a live value
                lsum = lsum * tl.exp(m - m_safe) + tl.exp(z - m_safe)
                m = m_new
            if noisy and filtered:
                # block_skip: the noise is at most 16.6355 (u <= 1 - 2^-24), so no hash where zmax + that < top
                if not block_skip or zmax + (16.64 + _margin(top)) >= top:
                    best, best_id, top = _filtered_block(key, ids, z, live, best, best_id, top, libdevice_log)
            else:  # no cross-lane reduction (and barrier) inside the loop
                if noisy:
                    score = z - _hash_log_noise(key, ids, libdevice_log)
                else:
                    score = z
                take = live & (score > best)  # strict: a lane's earlier (lower) id keeps a tie
                best = tl.where(take, score, best)
                best_id = tl.where(take, ids, best_id)
        if block_skip:  # every lane's sum is on the one base
            m = tl.where(lane >= 0, big, m)
        row_m = tl.max(m, 0)
        m_safe = tl.where(row_m == float("-inf"), 0.0, row_m)
        lsum = tl.sum(lsum * tl.exp(m - m_safe), 0)  # lanes that saw no live value hold lsum = 0
        m = row_m
        top = tl.max(best, 0)
        # lowest id among the tied lanes; all -inf: 0, as torch.argmax (lanes that never took hold id 0)
        top_id = tl.min(tl.where(best == top, best_id, vocab), 0)
        if splits == 1:
            tl.store(tok_ptr + b, top_id.to(tl.int64))
            tl.store(lse_ptr + b, m + tl.log(lsum))
            if logprobs:
                _store_logprob(logits_ptr, lp_ptr, b, stride_b, top_id, m + tl.log(lsum), inv_temp)
        else:
            p = b * splits + s
            tl.store(m_ptr + p, m)
            tl.store(l_ptr + p, lsum)
            tl.store(best_ptr + p, top)
            tl.store(idx_ptr + p, top_id)

    @triton.jit
    def _draw_combine_kernel(m_ptr, l_ptr, best_ptr, idx_ptr, tok_ptr, lse_ptr, logits_ptr, lp_ptr, inv_temp,
                             stride_b, splits: tl.constexpr, logprobs: tl.constexpr):  # fmt: skip
        b = tl.program_id(0)
        s = tl.arange(0, splits)
        m = tl.load(m_ptr + b * splits + s)
        lsum = tl.load(l_ptr + b * splits + s)
        best = tl.load(best_ptr + b * splits + s)
        idx = tl.load(idx_ptr + b * splits + s)
        top_m = tl.max(m, 0)
        m_safe = tl.where(top_m == float("-inf"), 0.0, top_m)
        lse = m_safe + tl.log(tl.sum(lsum * tl.exp(m - m_safe), 0))
        tl.store(lse_ptr + b, lse)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, s, splits), 0)  # splits are in id order: lowest split wins
        tok = tl.sum(tl.where(s == first, idx, 0), 0)
        tl.store(tok_ptr + b, tok.to(tl.int64))
        if logprobs:
            _store_logprob(logits_ptr, lp_ptr, b, stride_b, tok, lse, inv_temp)


# Tests run the kernel on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
# On CUDA from CUDA_MIN_ROWS rows. Session 9 (H200, ``benchmarks/bench_sampler.py``, bf16 logits over
# 151,936 ids) measured it slower than the compiled draw below 512 rows (195-370 us at 64 rows against 152
# us) and set 512. Session 22 (H100, the kernel as it is now: mixed keys, log-probs, block skip) measured it
# faster at every row count: 74 / 95 / 111 / 127 / 139 / 249 us at 16 / 32 / 64 / 128 / 256 / 512 rows
# against the compiled draw's 107 / 114 / 127 / 150 / 257 / 485 (``results/2026-12-05-h200-session22/cN``),
# so it now serves every row count (the decode's finer batch buckets run 320-448 rows, where the compiled
# draw took 0.4-0.5 ms a step). Layout-invariant sampling asks for it at every row count
# (``usable(..., any_rows=True)``, which matters only if this threshold rises again): the kernel rounds as
# the eager draw does, while inductor may fuse a multiply-add, so one path for every decode bucket keeps a
# near-tie's token the same. (Session 22's numbers are from an H100, in a folder named for the H200 kind
# asked for.)
# MEGATRON_RL_TRITON_SAMPLER=0 (or false/off/no) turns it off.
ON_CUDA = env_switch("MEGATRON_RL_TRITON_SAMPLER", True)
CUDA_MIN_ROWS = 1
# The noisy draw computes the two exact logarithms of an element's noise only in blocks where a cheap lower
# bound of the noise says some element may beat the best score so far (the same tokens: only provable losers
# are skipped), and the log-sum-exp with one exp per element. Measured (session 20, H100, bf16 [512, 151936]):
# 299 -> 265 us, not the ~2.5x the logarithms' share suggested: the per-element hash, bound and softmax bound
# the kernel now. MEGATRON_RL_SAMPLER_FILTER=0: every element.
FILTERED = env_switch("MEGATRON_RL_SAMPLER_FILTER", True)
# Block skip: each block's max logit (one reduction) first; a block whose max plus the largest possible noise
# (16.64) cannot reach the best score so far skips the hash and the bound too (most blocks of a trained
# model's peaked rows), and the log-sum-exp runs on the one running max (one exp per element). Measured
# (session 21 call I, H100, bf16 [512, 151936], 0 token mismatches): flat rows 248.5 against 248.6 us,
# peaked 275.7 against 278.7, peaked +40 284.3 against 344.5. On by default (with the filter);
# MEGATRON_RL_SAMPLER_BLOCK_SKIP=0 turns it off.
BLOCK_SKIP = env_switch("MEGATRON_RL_SAMPLER_BLOCK_SKIP", True)


def usable(logits: torch.Tensor, any_rows: bool = False) -> bool:
    """Whether the kernel runs for logits [B, V]: Triton importable, bf16/fp16/fp32 on CUDA with ``ON_CUDA``
    and at least ``CUDA_MIN_ROWS`` rows unless ``any_rows`` (or CPU with ``RUN_ON_CPU``), unit stride over
    the vocab."""
    dev = logits.device.type
    rows_ok = any_rows or logits.shape[0] >= CUDA_MIN_ROWS
    return (
        HAVE_TRITON
        and ((ON_CUDA and dev == "cuda" and rows_ok) or (RUN_ON_CPU and dev == "cpu"))
        and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and logits.dim() == 2
        and logits.stride(-1) == 1
    )


# The vocab loop's tile (elements a block, warps a program) by rows. Measured (session 26, H100, bf16 [rows,
# 151936], the engine's call: mixed keys, log-probs, block skip; 0 token mismatches): at 512 rows 1024 / 4 took
# 207.7-213.5 us against 2048 / 8's 246.3-250.5 on flat rows, 251.0 against 273.1 on peaked ones, 242.5 against
# 263.2 on very peaked ones; at 256 rows 113.4 against 136.7 (flat); below 256 rows the two time alike (launch
# bound there: ~80-90 us). Software pipelining depth (num_stages 1, 2, 4) changed nothing.
# ``benchmarks/results/2026-12-06-session26/`` (calls U-W).
SMALL_TILE_FROM_ROWS = 256


def tile_for(rows: int) -> tuple[int, int]:
    """(block, num_warps) of the draw for ``rows`` rows: 1024 / 4 from ``SMALL_TILE_FROM_ROWS`` rows, else 2048 / 8."""
    return (1024, 4) if rows >= SMALL_TILE_FROM_ROWS else (2048, 8)


def splits_for(rows: int, target_programs: int = 1024, most: int = 64) -> int:
    """Programs per row (a power of two): about ``target_programs`` in all (an H200 has 132 SMs), one per
    row once B reaches it. A function of B only, so the launch shape is fixed for a captured batch."""
    return max(1, min(most, triton.next_power_of_2(max(1, target_programs // rows))))


def draw(
    logits: torch.Tensor, row_keys32: torch.Tensor, inv_temp: float, noisy: bool,
    splits: int | None = None, block: int | None = None, num_warps: int | None = None, filtered: bool | None = None,
    mix: bool = False, logprobs: bool = False, block_skip: bool | None = None, num_stages: int | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """logits [B, V], row_keys32 [B] int64 (``mix64(row_keys) & 0xFFFFFFFF``; with ``mix`` the raw row keys,
    mixed in the kernel) -> tokens [B] int64 (the argmax of ``logits * inv_temp`` minus the counter noise,
    or without it when not ``noisy``) and the log-sum-exp [B] (fp32) of ``logits * inv_temp``; with
    ``logprobs`` also the tokens' log-probs [B] (fp32, ``logits[b, token] * inv_temp - lse``, the eager
    ops). ``filtered`` / ``block_skip``: ``FILTERED`` / ``BLOCK_SKIP`` when None (the skip only with the
    filter). ``block`` / ``num_warps``: ``tile_for(rows)`` when both are None (one given: the other 2048 / 8).
    ``num_stages``: Triton's launch option (None: its default), swept by ``benchmarks/bench_sampler.py``. Mixing
    the keys and reading the log-probs here saves the decode step ~16 small kernels (``mix64``'s eleven, the
    gather, the cast, the scale, the difference)."""
    rows, vocab = logits.shape
    filtered = FILTERED if filtered is None else filtered
    block_skip = filtered and (BLOCK_SKIP if block_skip is None else block_skip)  # the skip needs the filter
    splits = splits_for(rows) if splits is None else splits
    if block is None and num_warps is None:
        block, num_warps = tile_for(rows)
    block, num_warps = block or 2048, num_warps or 8  # one given: the other at its earlier default
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block  # each split starts on a block boundary
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    out = torch.empty(2 if logprobs else 1, rows, dtype=torch.float32, device=dev)  # lse (and log-probs)
    lse, lp = out[0], out[-1]  # without logprobs lp is lse's row, never written
    part = torch.empty(4, rows * splits if splits > 1 else 1, dtype=torch.float32, device=dev)
    part_idx = part[3].view(torch.int32)  # [B * splits] best ids, sharing the one allocation
    on_gpu = dev.type != "cpu"
    opts = {"enable_fp_fusion": False} if on_gpu else {}
    if num_stages is not None and on_gpu:  # the loop's software pipelining depth (Triton's default otherwise)
        opts["num_stages"] = num_stages
    _draw_partial_kernel[(rows, splits)](
        logits, row_keys32, part[0], part[1], part[2], part_idx, tokens, lse, lp, float(inv_temp),
        logits.stride(0), vocab, chunk, splits=splits, noisy=noisy, block=block, libdevice_log=on_gpu,
        filtered=filtered, mix=mix, logprobs=logprobs, block_skip=block_skip, num_warps=num_warps, **opts,
    )  # fmt: skip
    if splits > 1:
        _draw_combine_kernel[(rows,)](
            part[0], part[1], part[2], part_idx, tokens, lse, logits, lp, float(inv_temp), logits.stride(0),
            splits=splits, logprobs=logprobs, **opts,
        )  # fmt: skip
    return (tokens, lse, lp) if logprobs else (tokens, lse)
