"""The rollout engine's per-slot bookkeeping around a decode step, one Triton launch each.

After each graph replay the engine ran, in eager torch on [B] tensors: the step's noise keys
(``sampling.sample_row_keys``: three splitmix64 finalisers, ~37 small kernels) and ``_record`` (append the drawn
token and its log-prob at each slot's count, count += live, the stop test, the next token and position: ~15
small kernels). Each small kernel costs the device a launch (~2 us) for almost no work. Here:

- ``row_keys``: ``mix64(seeded + count)`` [B] from the slots' seeded keys (``sampling.seeded_key``: the
  seed and the sequence key mixed once, when the slot is filled) and their token counts: the bits of
  ``sample_row_keys``;
- ``record``: ``_record``'s updates for slots 0..B-1 (the decode step's rows) in one pass, with the bits and
  the writes of the torch ops (finished and idle slots write into their count's column as there).

Runs on CUDA where Triton is installed, after a one-time trial against the torch ops on the device
(``usable``; a failure warns and the torch ops serve; ``MEGATRON_RL_SLOT_KERNELS=0`` turns it off); tests run
it on CPU under Triton's interpreter (``RUN_ON_CPU``).
"""

from __future__ import annotations

import torch

from megatron_rl.kernels.compile import env_switch, trial_once

try:
    import triton
    import triton.language as tl

    from megatron_rl.kernels.sampler import _mix64

    HAVE_TRITON = True
except ImportError:  # CPU-only installs without triton: the torch ops serve
    HAVE_TRITON = False

RUN_ON_CPU = False  # tests: the kernels under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)
ON_CUDA = env_switch("MEGATRON_RL_SLOT_KERNELS", True)
BLOCK = 512


if HAVE_TRITON:

    @triton.jit
    def _row_keys_kernel(seeded_ptr, count_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        s = tl.load(seeded_ptr + i, mask=m, other=0).to(tl.uint64, bitcast=True)
        c = tl.load(count_ptr + i, mask=m, other=0).to(tl.uint64, bitcast=True)
        tl.store(out_ptr + i, _mix64(s + c).to(tl.int64, bitcast=True), mask=m)  # int64 wraps as uint64 does

    @triton.jit
    def _record_kernel(
        tok_ptr, lp_ptr, live_ptr, count_ptr, out_tok_ptr, out_lp_ptr, next_tok_ptr, pos_ptr, stop_ptr,
        n, n_stop, max_new, s_tok, s_lp, BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tok = tl.load(tok_ptr + i, mask=m, other=0)
        lp = tl.load(lp_ptr + i, mask=m, other=0.0)
        live = tl.load(live_ptr + i, mask=m, other=0) != 0
        cnt = tl.load(count_ptr + i, mask=m, other=0)
        # cnt <= max_new: the engine retires a slot before its count passes the last column
        row = i.to(tl.int64)
        tl.store(out_tok_ptr + row * s_tok + cnt, tok, mask=m)
        tl.store(out_lp_ptr + row * s_lp + cnt, lp, mask=m)
        cnt = cnt + live.to(tl.int64)
        tl.store(count_ptr + i, cnt, mask=m)
        stopped = tok != tok  # all false, tok's shape
        for j in range(n_stop):
            stopped = stopped | (tok == tl.load(stop_ptr + j))
        still = live & (stopped == 0) & (cnt < max_new)
        tl.store(live_ptr + i, still.to(tl.int8), mask=m)
        tl.store(next_tok_ptr + i, tok, mask=m)
        pos = tl.load(pos_ptr + i, mask=m, other=0)
        tl.store(pos_ptr + i, tl.where(live, pos + 1, pos), mask=m)


def serves(t: torch.Tensor) -> bool:
    """Whether the kernels run for tensors on ``t``'s device: Triton importable and CUDA with ``ON_CUDA``, or
    CPU with ``RUN_ON_CPU``."""
    dev = t.device.type
    return HAVE_TRITON and ((ON_CUDA and dev == "cuda") or (RUN_ON_CPU and dev == "cpu"))


def usable(t: torch.Tensor) -> bool:
    """``serves`` and both kernels passed their one-time trial on ``t``'s device type (``_trial``: the torch ops'
    results on a small random state, bit for bit), else a warning once and False."""
    return serves(t) and trial_once(
        f"the decode step's slot kernels ({t.device.type})",
        lambda: _trial(t.device),
        "The decode step's slot kernels (kernels.slot_state) failed their trial; the torch ops keep the "
        "row keys and the bookkeeping (the same results, ~50 small kernels a step more).",
    )


def record_reference(
    tokens, lps, live, count, out_tok, out_lp, next_tok, pos, stop_ids, max_new: int
) -> None:
    """``record`` in torch ops (the decode step's bookkeeping where the kernel does not serve, and its trial's
    reference): ``_Runner._record``'s updates for rows 0..B-1, read and written as views."""
    b = tokens.shape[0]
    rows = torch.arange(b, device=tokens.device)
    was = live.clone()
    n = count.clone()
    out_tok[rows, n] = tokens
    out_lp[rows, n] = lps
    count.copy_(n + was)
    live.copy_(was & ~torch.isin(tokens, stop_ids) & (count < max_new))
    next_tok.copy_(tokens)
    pos.copy_(torch.where(was, pos + 1, pos))


def _trial(device: torch.device) -> None:
    """Both kernels against the torch ops on 64 of 72 slots (some finished, some drawing a stop token), with
    one stop id and with none (the engine's launches: rows a multiple of 16, usually one stop id, 512 new
    tokens); raises on any difference."""
    from megatron_rl.rollout.sampling import step_row_keys  # not at import: sampling imports the kernels

    g = torch.Generator().manual_seed(0)
    slots, b, max_new = 72, 64, 512
    seeded = torch.randint(-(2**63), 2**63 - 1, (slots,), generator=g).to(device)
    count = torch.randint(max_new - 9, max_new, (slots,), generator=g).to(device)  # some reach max_new
    if not torch.equal(row_keys(seeded[:b], count[:b]), step_row_keys(seeded[:b], count[:b])):
        raise RuntimeError("row_keys differs from sampling.step_row_keys")
    state = [
        torch.rand(slots, generator=g) < 0.8,  # live
        count.cpu(),
        torch.randint(0, 9, (slots, max_new + 1), generator=g),  # out_tok
        torch.randn(slots, max_new + 1, generator=g),  # out_lp
        torch.randint(0, 9, (slots,), generator=g),  # next_tok
        torch.randint(0, 99, (slots,), generator=g),  # pos
    ]
    tokens, lps = torch.randint(0, 9, (b,), generator=g).to(device), torch.randn(b, generator=g).to(device)
    for stops in ([3], []):
        stops = torch.tensor(stops, dtype=torch.long, device=device)
        got, want = ([t.to(device).clone() for t in state] for _ in range(2))
        for side, fn in ((got, record), (want, record_reference)):
            live, cnt, out_tok, out_lp, next_tok, pos = side
            fn(tokens, lps, live[:b], cnt[:b], out_tok, out_lp, next_tok[:b], pos[:b], stops, max_new)
        for name, x, y in zip(("live", "count", "out_tok", "out_lp", "next_tok", "pos"), got, want):
            if not torch.equal(x, y):
                raise RuntimeError(f"record differs from the torch ops in {name} ({len(stops)} stop ids)")


def row_keys(seeded: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``mix64(seeded + count)`` for int64 [B] views with unit stride -> [B] int64 (``sampling.step_row_keys``)."""
    n = seeded.shape[0]
    out = torch.empty_like(seeded)
    _row_keys_kernel[(triton.cdiv(n, BLOCK),)](seeded, count, out, n, BLOCK=BLOCK)
    return out


def record(tokens, lps, live, count, out_tok, out_lp, next_tok, pos, stop_ids, max_new: int) -> None:
    """In place, for slots 0..B-1 (B = tokens.shape[0]; every [S] tensor is read from its start): write
    tokens [B] int64 and lps [B] fp32 at column count[i] of out_tok / out_lp [S, N+1]; count += live; live =
    live and the token not in stop_ids and count < max_new; next_tok = tokens; pos += 1 where live was set."""
    n = tokens.shape[0]
    _record_kernel[(triton.cdiv(n, BLOCK),)](
        tokens, lps, live.view(torch.int8), count, out_tok, out_lp, next_tok, pos, stop_ids,
        n, stop_ids.numel(), max_new, out_tok.stride(0), out_lp.stride(0), BLOCK=BLOCK,
    )  # fmt: skip


def record_fits(tokens, lps, live, count, out_tok, out_lp, next_tok, pos, stop_ids) -> bool:
    """Whether ``record`` takes these: ``usable``, the dtypes it writes (int64 tokens, counts, positions;
    fp32 log-probs; bool live) and unit strides over slots and columns."""
    longs = (tokens, count, out_tok, next_tok, pos, stop_ids)
    return (
        all(t.dtype == torch.long for t in longs)
        and lps.dtype == out_lp.dtype == torch.float32
        and live.dtype == torch.bool
        and all(t.stride(-1) == 1 for t in (tokens, lps, live, count, out_tok, out_lp, next_tok, pos))
        and usable(tokens)
    )
