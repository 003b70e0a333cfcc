"""kernels/sampler.py (run by Triton's interpreter on CPU, fp32 logits) against the eager draw: the same
tokens as ``argmax(z - counter_log_exponential)`` (ties to the lowest id), the log-sum-exp, greedy, and
``sample_with_logprobs`` choosing it or falling back when it fails."""

import warnings

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.kernels import sampler as kernel  # noqa: E402
from megatron_rl.rollout import sampling  # noqa: E402
from megatron_rl.rollout.sampling import (  # noqa: E402
    SamplingParams,
    _draw,
    counter_log_exponential,
    mix64,
    sample_with_logprobs,
)


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})


def _reference(logits, keys, inv_temp, noisy):
    return _draw(logits, keys, torch.arange(logits.shape[-1])[None], inv_temp, noisy)


def _kernel(logits, keys, inv_temp, noisy, **kw):
    return kernel.draw(logits, mix64(keys) & 0xFFFFFFFF, inv_temp, noisy, **kw)


@pytest.mark.parametrize(
    "rows,vocab,splits,block",
    [
        (37, 3001, None, 2048),
        (1, 3001, None, 256),
        (8, 1000, 1, 256),
        (6, 5000, 4, 512),
        (9, 3001, 4, None),
    ],
)
def test_tokens_and_lse_equal_the_eager_draw(rows, vocab, splits, block, monkeypatch):
    """B = 37 and 1 with the splits chosen from B (many empty ones for B = 1), one split, several; V not a
    multiple of the block; masked (-inf) columns as in a padded vocab; the tile chosen from B (``tile_for``:
    1024 / 4 from 256 rows, here from 9 to keep the interpreter quick)."""
    if block is None:
        assert kernel.tile_for(256) == (1024, 4) and kernel.tile_for(255) == (2048, 8)
        monkeypatch.setattr(kernel, "SMALL_TILE_FROM_ROWS", rows)
        asked, tile_for = [], kernel.tile_for
        monkeypatch.setattr(kernel, "tile_for", lambda b: asked.append(b) or tile_for(b))
        assert tile_for(rows) == (1024, 4)
    torch.manual_seed(rows)
    logits = 4 * torch.randn(rows, vocab)
    logits[:, -7:] = float("-inf")
    for inv_temp, noisy in [(1 / 0.7, True), (1.0, True), (1.0, False)]:
        keys = torch.randint(-(2**62), 2**62, (rows,))
        want, want_lse = _reference(logits, keys, inv_temp, noisy)
        for filtered, skip in ((True, False), (False, False), (True, True)):
            tokens, lse = _kernel(
                logits, keys, inv_temp, noisy, splits=splits, block=block, filtered=filtered, block_skip=skip
            )
            assert torch.equal(tokens, want), (filtered, skip)
            torch.testing.assert_close(lse, torch.logsumexp(logits * inv_temp, -1), rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)
    if block is None:
        assert asked and set(asked) == {rows}  # the draw took its tile from the rows


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keys_mixed_and_log_probs_read_in_the_kernel_are_the_eager_bits(splits, dtype):
    """``mix=True``: the raw int64 row keys go through ``mix64`` inside the kernel (the same tokens as mixing
    them in torch); ``logprobs=True``: the tokens' log-probs equal the eager ``gather * inv_temp - lse`` bit
    for bit, in both store branches (one split: the partial kernel; several: the combine kernel)."""
    torch.manual_seed(5)
    logits = (3 * torch.randn(11, 1500)).to(dtype)
    keys = torch.randint(-(2**63), 2**63 - 1, (11,))
    keys[:3] = torch.tensor([0, -1, -(2**63)])  # all bits set, sign bit alone: the shifts must be logical
    for noisy in (True, False):
        want_tok, want_lse = _kernel(logits, keys, 1 / 0.7, noisy, splits=splits, block=256)
        tok, lse, lp = kernel.draw(
            logits, keys, 1 / 0.7, noisy, splits=splits, block=256, mix=True, logprobs=True
        )
        assert torch.equal(tok, want_tok) and torch.equal(lse, want_lse)
        assert torch.equal(tok, _reference(logits.float(), keys, 1 / 0.7, noisy)[0])
        assert torch.equal(lp, logits.gather(-1, tok[:, None])[:, 0].float() * (1 / 0.7) - lse)


@pytest.mark.parametrize("kind", ["peaked", "huge", "flat", "near_ties"])
def test_the_filtered_draw_gives_the_eager_tokens_on_hard_rows(kind):
    """The noise filter skips only blocks that provably cannot beat the best score so far. Rows where it
    skips most (one peaked token, as trained models give), logits in the thousands (the margin's relative
    part), all-equal logits (every block may win: the noise alone decides) and pairs of logits a rounding
    apart across blocks, over many keys."""
    torch.manual_seed(3)
    rows, vocab = 48, 4000
    if kind == "peaked":
        logits = torch.randn(rows, vocab)
        logits[torch.arange(rows), torch.randint(0, vocab, (rows,))] += 25.0
    elif kind == "huge":
        logits = 3000.0 + 2 * torch.randn(rows, vocab)
    elif kind == "flat":
        logits = torch.zeros(rows, vocab)
    else:
        logits = torch.randn(rows, vocab).round()  # many exact ties of z; scores differ by the noise only
        logits[:, ::7] = torch.nextafter(logits[:, ::7], torch.tensor(float("inf")))
    keys = torch.randint(-(2**62), 2**62, (rows,))
    want, want_lse = _reference(logits, keys, 1.0, True)
    for skip in (False, True):  # block skip (default on): whole blocks whose max logit cannot reach the best
        tokens, lse = _kernel(logits, keys, 1.0, True, splits=2, block=256, filtered=True, block_skip=skip)
        assert torch.equal(tokens, want), skip
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-4 if kind == "huge" else 1e-5)


def test_the_noise_lower_bound_never_exceeds_the_noise():
    """``_exp_noise_lower_bound`` <= -log(u) for every id (u from the same 24 hashed bits, in float64), and
    close to it where u is near 1 (the large noise that wins)."""
    import triton
    import triton.language as tl

    @triton.jit
    def bound_kernel(key, out_ptr, n, block: tl.constexpr):
        ids = tl.program_id(0) * block + tl.arange(0, block)
        tl.store(out_ptr + ids, kernel._exp_noise_lower_bound(key.to(tl.uint32), ids), mask=ids < n)

    n = 1 << 16
    for key in (0, 12345, 0xFFFFFFFF):
        out = torch.empty(n)
        bound_kernel[(n // 1024,)](key, out, n, block=1024)
        x = (key + torch.arange(n, dtype=torch.int64) * 0x9E3779B9) & 0xFFFFFFFF
        for mul, shift in ((0x7FEB352D, 16), (0x846CA68B, 15), (None, 16)):
            x = x ^ (x >> shift)
            x = (x * mul) & 0xFFFFFFFF if mul else x
        u = ((x >> 9).double() + 0.5) / 2**23
        e = -torch.log(u)
        assert bool((out.double() <= e * (1 + 2**-20)).all())  # fp32 rounding of the series: the margin's
        assert bool((out >= 2**-24).all())
        near = u > 0.999
        assert bool((out.double()[near] >= e[near] * 0.999).all())


def test_the_noise_is_finite_so_every_token_follows_its_logit():
    """The uniform u must stay below 1: with 24 noise bits, (2^24 - 1 + 0.5) rounded to 2^24 in fp32, u = 1,
    the noise was -inf and that token won whatever its logit (~0.9% of rows at Qwen's vocab; raw key 2078 at
    id 2209 of 4096). Now u has 23 bits, exact. A row whose best logit is 150 above the rest draws it, in the
    eager draw and the kernel, filtered or not, with the other ids at -1e4 or the hit id at -inf."""
    key = torch.tensor([2078])
    assert bool(torch.isfinite(counter_log_exponential(key, 4096)).all())
    keys = torch.randint(-(2**62), 2**62, (512,))
    assert bool(torch.isfinite(counter_log_exponential(keys, 4096)).all())
    torch.manual_seed(0)
    for rest in (-150.0, -1e4):
        logits = rest + torch.randn(1, 4096)
        logits[0, 5] = 0.0
        logits[0, 2209] = float("-inf")
        assert _reference(logits, key, 1.0, True)[0].item() == 5
        for filtered, skip in ((True, False), (False, False), (True, True)):
            for splits in (1, 2):
                tok, _ = _kernel(
                    logits, key, 1.0, True, splits=splits, block=256, filtered=filtered, block_skip=skip
                )
                assert tok.item() == 5, (rest, filtered, skip, splits)


def test_many_keys_on_one_row_give_the_reference_tokens():
    """64 keys over one row of logits (a row repeated): each key's token is the reference's, and they
    spread over the likely tokens."""
    logits = torch.randn(1, 700).repeat(64, 1)
    keys = mix64(torch.arange(64)) + 12345
    tokens, _ = _kernel(logits, keys, 1.0, True, splits=4, block=128)
    assert torch.equal(tokens, _reference(logits, keys, 1.0, True)[0])
    assert len(set(tokens.tolist())) > 16


def test_greedy_ties_go_to_the_lowest_id_across_splits():
    """Integer logits from {0, 1, 2}: the maximum repeats within lanes, blocks and splits."""
    torch.manual_seed(0)
    logits = torch.randint(0, 3, (5, 2000)).float()
    logits[1, :1500] = 0.0  # the first 2 sits in the last split
    logits[2] = 1.0  # all tied: id 0
    tokens, lse = _kernel(logits, torch.zeros(5, dtype=torch.long), 1.0, False, splits=4, block=128)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-5)


def test_noisy_ties_go_to_the_lowest_id():
    """Two ids whose 24 noise bits collide get the same (top) logit: their scores tie exactly, and the
    lower id wins, as in torch.argmax, with the pair in different splits."""
    vocab = 20000
    key = torch.tensor([7])
    noise = counter_log_exponential(key, vocab)[0]
    values, order = noise.sort()
    same = (values[1:] == values[:-1]).nonzero()[:, 0]
    pairs = sorted((order[i].item(), order[i + 1].item()) for i in same)
    lo, hi = min(pairs, key=lambda p: -abs(p[0] - p[1]))  # the pair farthest apart
    lo, hi = min(lo, hi), max(lo, hi)
    logits = torch.full((1, vocab), -20.0)
    logits[0, [lo, hi]] = 20.0
    tokens, _ = _kernel(logits, key, 1.0, True, splits=8, block=512)
    assert tokens.item() == lo == _reference(logits, key, 1.0, True)[0].item()


def test_splits_depend_on_the_batch_only():
    assert kernel.splits_for(1) == 64 and kernel.splits_for(64) == 16 and kernel.splits_for(512) == 2
    assert kernel.splits_for(1024) == 1 and kernel.splits_for(37) == 32


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sample_with_logprobs_runs_the_kernel_with_the_eager_tokens(monkeypatch, temperature):
    torch.manual_seed(1)
    logits = 3 * torch.randn(9, 1500)
    keys = torch.randint(-(2**40), 2**40, (9,))
    params = SamplingParams(temperature=temperature)
    calls = []
    draw = kernel.draw
    monkeypatch.setattr(kernel, "draw", lambda *a, **k: calls.append(1) or draw(*a, **k))
    tokens, lps = sample_with_logprobs(logits, params, None, keys if temperature else None)
    assert calls and sampling._KERNEL in kc._PROBED
    monkeypatch.setattr(kernel, "RUN_ON_CPU", False)
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "0")
    want, want_lps = sample_with_logprobs(logits, params, None, keys if temperature else None)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(lps, want_lps, rtol=1e-5, atol=1e-5)


def test_a_failing_kernel_falls_back_to_the_eager_draw_with_a_warning(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "0")
    logits = torch.randn(5, 300)
    keys = torch.randint(-(2**40), 2**40, (5,))
    params = SamplingParams(temperature=1.0)
    want = sample_with_logprobs(logits, params, None, keys)  # RUN_ON_CPU on: the kernel, probed fine

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kernel, "draw", broken)
    with pytest.warns(UserWarning, match="Triton sampler failed its trial.*no kernel today"):
        got = sample_with_logprobs(logits, params, None, keys)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; the kernel is not tried again
        assert torch.equal(sample_with_logprobs(logits, params, None, keys)[0], want[0])
