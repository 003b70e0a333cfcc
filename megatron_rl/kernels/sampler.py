"""The sampler's draw as one Triton pass over the logits: per row the log-sum-exp of the scaled logits and
the token of ``rollout.sampling.block_race`` (the noise ``log(-log(u))``, u the counter noise of
``rollout.sampling.counter_log_exponential``): the pass keeps each block's log-sum-exp minus the block's
noise and the best block, and a last step draws the token inside that block (~1,024 + V / 1,024 hashes a
row, not V).

Why not the compiled ``_draw``: inductor writes the noise hash in int64 (the reference's dtype), and 64-bit
multiplies are emulated on the GPU (the per-token draw's compiled version took 0.52 ms on an H200 at B=512,
V=151936); with the two-level rule it hashes ~1,200 counters a row but still makes several passes: 345-385 us
against the kernel's 107 us on an H100 (session 37, calls C and E). Here the hash runs in uint32 (the same
bits: the reference masks every product to 32 bits), and only the per-row key mixing (``mix64``, [B]) stays
in torch.

Noise bits: ``libdevice.log`` (the CUDA math library's ``logf``, which eager torch calls) and no fused
multiply-adds (``enable_fp_fusion=False``), so ``z`` and ``z - noise`` round as in the eager reference:
inside the chosen block the token is the reference's bit for bit. A block's log-sum-exp is summed in fp32 in
the kernel's own order (the eager draw sums in fp64), a few 1e-6 apart at most, so where two blocks' scores
lie that close the block, and the token, may differ from the eager draw's (about one row in 10^6 on flat
rows; the start-up trial allows exactly that); one kernel setting at every batch size (``NUM_WARPS``,
``UNROLL``) keeps a row's token the same whatever the batch. Ties go to the lowest block, then the lowest
token id (``torch.argmax``'s rule). NaN logits still give a token id inside the vocab.

Parallelism: a row's vocab is split over ``splits`` programs (chosen from B alone, so a call is CUDA-graph
capturable: no host syncs, allocations sized by B), each writing a partial (max, sum-exp, best block score,
its block; greedy: best logit, its id); a small second kernel combines them and draws inside the block. Runs
on CUDA where Triton is installed; tests run it on CPU under Triton's interpreter (``RUN_ON_CPU``).
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
        return _log(-_log(u, libdevice_log), libdevice_log)

    @triton.jit
    def _log(x, libdevice_log: tl.constexpr):
        """``libdevice.log`` (the CUDA math library's ``logf``, which eager torch calls), or ``tl.log`` where
        there is no libdevice (Triton's interpreter)."""
        if libdevice_log:
            return libdevice.log(x)
        return tl.log(x)

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
    def _inside_block(row, key, k, vocab, inv_temp, block: tl.constexpr, libdevice_log: tl.constexpr):
        """``block_race``'s second level: the token of block k (scalar) with the largest z - log(E), ties to
        the lowest id (all -inf, or no score equal to the max as with NaN logits: the block's first id)."""
        ids = k * block + tl.arange(0, block)
        z = tl.load(row + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32) * inv_temp
        score = z - _hash_log_noise(key, ids, libdevice_log)
        top = tl.max(score, 0)
        tok = tl.min(tl.where(score == top, ids, vocab + block), 0)
        return tl.where(tok < vocab, tok, k * block)

    @triton.jit
    def _draw_partial_kernel(
        logits_ptr, keys_ptr, m_ptr, l_ptr, best_ptr, idx_ptr, tok_ptr, lse_ptr, lp_ptr, inv_temp, stride_b,
        vocab, chunk, splits: tl.constexpr, noisy: tl.constexpr, block: tl.constexpr, libdevice_log: tl.constexpr,
        mix: tl.constexpr, logprobs: tl.constexpr, unroll: tl.constexpr = 1,
    ):  # fmt: skip
        b = tl.program_id(0)
        s = tl.program_id(1)
        row = logits_ptr + b.to(tl.int64) * stride_b
        key = _row_key(keys_ptr, b, mix)
        lane = tl.arange(0, unroll * block)  # ``unroll`` blocks a loop step: more loads in flight a program
        big = float("-inf")  # the program's running max of z
        run = 0.0  # sum of exp(z - big) over the program's ids so far
        best = float("-inf")  # noisy: the best block score and its block (greedy: per lane, below)
        best_id = 0
        lane_best = tl.full([unroll * block], float("-inf"), tl.float32)
        lane_id = tl.zeros([unroll * block], tl.int32)
        start = s * chunk
        end = tl.minimum(start + chunk, vocab)
        # chunk is a multiple of block: off / block is a block's index; a step's blocks past ``end`` are all
        # masked (-inf: no mass, never the best block)
        for off in range(start, end, unroll * block):
            ids = off + lane
            z = tl.load(row + ids, mask=ids < end, other=float("-inf")).to(tl.float32) * inv_temp
            zb = tl.reshape(z, (unroll, block))
            zmax = tl.max(zb, 1)  # [unroll] each block's max
            z_safe = tl.where(zmax == float("-inf"), 0.0, zmax)  # no -inf - -inf
            bsum = tl.sum(tl.exp(zb - z_safe[:, None]), 1)  # [unroll] each block's sum of exp(z - its max)
            big_new = tl.maximum(big, tl.max(zmax, 0))
            big_safe = tl.where(big_new == float("-inf"), 0.0, big_new)
            run = run * tl.exp(big - big_safe) + tl.sum(bsum * tl.exp(zmax - big_safe), 0)
            big = big_new
            # noisy: each block's log-sum-exp minus its log-noise (counter 2^31 + block: key ^ 2^31, block)
            if noisy:
                blk = off // block + tl.arange(0, unroll)
                lse_b = z_safe + _log(bsum, libdevice_log)
                lse_b = tl.where(zmax == float("inf"), float("inf"), lse_b)  # inf - inf made its sum NaN
                score = lse_b - _hash_log_noise(key ^ 0x80000000, blk, libdevice_log)
                top = tl.max(score, 0)
                first = tl.min(tl.where(score == top, blk, 2147483647), 0)  # the step's earliest tied block
                take = top > best  # strict: an earlier block keeps a tie
                best = tl.where(take, top, best)
                best_id = tl.where(take, first, best_id)
            else:  # per lane, no cross-lane reduction for the argmax
                take = (ids < end) & (z > lane_best)  # strict: a lane's earlier (lower) id keeps a tie
                lane_best = tl.where(take, z, lane_best)
                lane_id = tl.where(take, ids, lane_id)
        # greedy: the lowest id among tied lanes; all -inf: 0, as torch.argmax (lanes never taken hold 0)
        if not noisy:
            best = tl.max(lane_best, 0)
            best_id = tl.min(tl.where(lane_best == best, lane_id, vocab), 0)
        if splits == 1:
            lse = big + tl.log(run)
            tok = best_id
            if noisy:
                tok = _inside_block(row, key, best_id, vocab, inv_temp, block, libdevice_log)
            tl.store(tok_ptr + b, tok.to(tl.int64))
            tl.store(lse_ptr + b, lse)
            if logprobs:
                _store_logprob(logits_ptr, lp_ptr, b, stride_b, tok, lse, inv_temp)
        else:
            p = b * splits + s
            tl.store(m_ptr + p, big)
            tl.store(l_ptr + p, run)
            tl.store(best_ptr + p, best)
            tl.store(idx_ptr + p, best_id)

    @triton.jit
    def _draw_combine_kernel(m_ptr, l_ptr, best_ptr, idx_ptr, tok_ptr, lse_ptr, logits_ptr, lp_ptr, keys_ptr,
                             inv_temp, stride_b, vocab, splits: tl.constexpr, noisy: tl.constexpr,
                             block: tl.constexpr, libdevice_log: tl.constexpr, mix: tl.constexpr,
                             logprobs: tl.constexpr):  # fmt: skip
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
        tok = tl.sum(tl.where(s == first, idx, 0), 0)  # noisy: the winning block; greedy: the token
        if noisy:
            row = logits_ptr + b.to(tl.int64) * stride_b
            tok = _inside_block(row, _row_key(keys_ptr, b, mix), tok, vocab, inv_temp, block, libdevice_log)
        tl.store(tok_ptr + b, tok.to(tl.int64))
        if logprobs:
            _store_logprob(logits_ptr, lp_ptr, b, stride_b, tok, lse, inv_temp)


# Tests run the kernel on CPU under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton
# is first imported (tests/conftest.py) and this flag turned on.
RUN_ON_CPU = False
# On CUDA from CUDA_MIN_ROWS rows. Session 9 (H200, ``benchmarks/bench_sampler.py``, bf16 logits over
# 151,936 ids) measured it slower than the compiled draw below 512 rows (195-370 us at 64 rows against 152
# us) and set 512. Session 22 (H100, the per-token kernel then: mixed keys, log-probs, block skip) measured it
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


# Warps a program. Session 26 (H100, bf16 [rows, 151936], the per-element draw before session 37) measured
# a 1024-id block with 4 warps faster than 2048 / 8 from 256 rows (207.7-213.5 against 246.3-250.5 us at 512)
# and alike below (launch bound, ~80-90 us). The block is ``rollout.sampling.SAMPLE_BLOCK``, the two-level draw's:
# one setting at every row count also keeps each block's log-sum-exp rounded alike whatever the batch.
NUM_WARPS = 4
# Blocks a program reads per loop step (``draw``'s ``unroll``). Session 37 call E (H100, bf16 [512, 151936]):
# 1 block 107.2 us, 2 blocks 139.3, 4 blocks 121.9 (110.6 with 8 warps); at 256 rows the runs spread too far
# to tell (82-129 us). So one block a step.
UNROLL = 1
# ``rollout.sampling.SAMPLE_BLOCK`` (that module imports this one): ids a block of the two-level draw
SAMPLE_BLOCK = 1024


def splits_for(rows: int, target_programs: int = 2048, most: int = 64) -> int:
    """Programs per row (a power of two): about ``target_programs`` in all (an H200 has 132 SMs), one per
    row once B reaches it. A function of B only, so the launch shape is fixed for a captured batch. 2,048
    since session 37 (1,024 before): with the two-level draw's lighter loop, 4 splits at 512 rows took 107.2
    against 2's 118.7 us on an H100 (call B, ``bench_sampler.py``)."""
    return max(1, min(most, triton.next_power_of_2(max(1, target_programs // rows))))


def draw(
    logits: torch.Tensor, row_keys32: torch.Tensor, inv_temp: float, noisy: bool, splits: int | None = None,
    block: int = SAMPLE_BLOCK, num_warps: int = NUM_WARPS, mix: bool = False, logprobs: bool = False,
    num_stages: int | None = None, unroll: int = UNROLL,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """logits [B, V], row_keys32 [B] int64 (``mix64(row_keys) & 0xFFFFFFFF``; with ``mix`` the raw row keys,
    mixed in the kernel) -> tokens [B] int64 (``rollout.sampling.block_race`` of ``logits * inv_temp`` with
    blocks of ``block`` ids, or its argmax when not ``noisy``) and the log-sum-exp [B] (fp32) of ``logits *
    inv_temp``; with ``logprobs`` also the tokens' log-probs [B] (fp32, ``logits[b, token] * inv_temp - lse``,
    the eager ops). ``block``: a power of two, ``SAMPLE_BLOCK`` (1024) for the sampler's tokens; ``unroll``:
    blocks a loop step (a power of two; the same tokens). ``num_stages``:
    Triton's launch option (None: its default), swept by ``benchmarks/bench_sampler.py``. Mixing the keys and
    reading the log-probs here saves the decode step ~16 small kernels (``mix64``'s eleven, the gather, the
    cast, the scale, the difference)."""
    rows, vocab = logits.shape
    splits = splits_for(rows) if splits is None else splits
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block  # each split starts on a block boundary
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    out = torch.empty(2 if logprobs else 1, rows, dtype=torch.float32, device=dev)  # lse (and log-probs)
    lse, lp = out[0], out[-1]  # without logprobs lp is lse's row, never written
    part = torch.empty(4, rows * splits if splits > 1 else 1, dtype=torch.float32, device=dev)
    part_idx = part[3].view(torch.int32)  # [B * splits] best blocks (greedy: ids), sharing the one allocation
    on_gpu = dev.type != "cpu"
    opts = {"enable_fp_fusion": False} if on_gpu else {}
    if num_stages is not None and on_gpu:  # the loop's software pipelining depth (Triton's default otherwise)
        opts["num_stages"] = num_stages
    _draw_partial_kernel[(rows, splits)](
        logits, row_keys32, part[0], part[1], part[2], part_idx, tokens, lse, lp, float(inv_temp),
        logits.stride(0), vocab, chunk, splits=splits, noisy=noisy, block=block, libdevice_log=on_gpu, mix=mix,
        logprobs=logprobs, unroll=unroll, num_warps=num_warps, **opts,
    )  # fmt: skip
    if splits > 1:
        _draw_combine_kernel[(rows,)](
            part[0], part[1], part[2], part_idx, tokens, lse, logits, lp, row_keys32, float(inv_temp),
            logits.stride(0), vocab, splits=splits, noisy=noisy, block=block, libdevice_log=on_gpu, mix=mix,
            logprobs=logprobs, num_warps=num_warps, **opts,
        )  # fmt: skip
    return (tokens, lse, lp) if logprobs else (tokens, lse)
