"""kernels/sampler.py (run by Triton's interpreter on CPU, fp32 logits) against the eager draw: the same
tokens as ``block_race`` (the block by its log-sum-exp and noise, then the id inside it; ties to the lowest),
the log-sum-exp, greedy, and ``sample_with_logprobs`` choosing it or falling back when it fails."""

import warnings

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.kernels import sampler as kernel  # noqa: E402
from megatron_rl.rollout import sampling  # noqa: E402
from megatron_rl.rollout.sampling import (  # noqa: E402
    SamplingParams,
    block_race,
    counter_log_exponential,
    mix64,
    sample_with_logprobs,
)


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})


def _reference(logits, keys, inv_temp, noisy, block=1024):
    """The eager draw (``_draw``'s ops) with blocks of ``block`` ids: tokens, log-sum-exp."""
    z = logits.float() * inv_temp
    return (block_race(z, keys, block) if noisy else z.argmax(-1)), torch.logsumexp(z, -1)


def _kernel(logits, keys, inv_temp, noisy, **kw):
    return kernel.draw(logits, mix64(keys) & 0xFFFFFFFF, inv_temp, noisy, **kw)


def test_the_reference_is_the_samplers_eager_draw():
    """``_reference`` at the default block is ``sampling._draw`` (what the engine's fallback and the kernel's
    trial compare against), noisy and greedy."""
    logits = 3 * torch.randn(6, 2500)
    keys = torch.randint(-(2**62), 2**62, (6,))
    for noisy in (True, False):
        want = sampling._draw(logits, keys, sampling._token_ids(logits), 0.8, noisy)
        got = _reference(logits, keys, 0.8, noisy)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "rows,vocab,splits,block,unroll",
    [
        (37, 3001, None, 1024, 1),
        (1, 3001, None, 256, 2),
        (8, 1000, 1, 256, 1),
        (6, 5000, 4, 512, 2),
        (9, 3001, 4, 128, 4),
        (5, 2000, 1, 128, 4),
    ],
)
def test_tokens_and_lse_equal_the_eager_draw(rows, vocab, splits, block, unroll):
    """B = 37 and 1 with the splits chosen from B (many empty ones for B = 1), one split, several; V not a
    multiple of the block; masked (-inf) columns as in a padded vocab; 1, 2 or 4 blocks a loop step (a
    split's last step reaching past its end, or past the vocab)."""
    torch.manual_seed(rows)
    logits = 4 * torch.randn(rows, vocab)
    logits[:, -7:] = float("-inf")
    for inv_temp, noisy in [(1 / 0.7, True), (1.0, True), (1.0, False)]:
        keys = torch.randint(-(2**62), 2**62, (rows,))
        want, want_lse = _reference(logits, keys, inv_temp, noisy, block)
        tokens, lse = _kernel(logits, keys, inv_temp, noisy, splits=splits, block=block, unroll=unroll)
        assert torch.equal(tokens, want), (inv_temp, noisy)
        torch.testing.assert_close(lse, torch.logsumexp(logits * inv_temp, -1), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)


def test_a_rows_token_does_not_depend_on_its_batch():
    """Layout invariance: a row's token is the same drawn alone, in a batch of 12 (64 splits a row: the
    combine kernel draws) or with one split a row (what ``splits_for`` gives from 1,024 rows: the partial
    kernel draws), with its key; its log-sum-exp equal up to the rounding of combining splits."""
    torch.manual_seed(9)
    logits = 3 * torch.randn(12, 2000)
    keys = torch.randint(-(2**62), 2**62, (12,))
    assert kernel.splits_for(12) == 64 and kernel.splits_for(1027) == 1
    full = _kernel(logits, keys, 1.0, True, block=256)
    one = _kernel(logits, keys, 1.0, True, block=256, splits=1)
    assert torch.equal(full[0], one[0])
    torch.testing.assert_close(full[1], one[1], rtol=1e-6, atol=1e-6)
    for i in range(0, 12, 5):
        alone = _kernel(logits[i : i + 1], keys[i : i + 1], 1.0, True, block=256)
        assert alone[0].item() == full[0][i].item()
        torch.testing.assert_close(alone[1][0], full[1][i], rtol=1e-6, atol=1e-6)


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
        assert torch.equal(tok, _reference(logits.float(), keys, 1 / 0.7, noisy, 256)[0])
        assert torch.equal(lp, logits.gather(-1, tok[:, None])[:, 0].float() * (1 / 0.7) - lse)


@pytest.mark.parametrize("kind", ["peaked", "huge", "flat", "near_ties"])
def test_the_two_level_draw_gives_the_eager_tokens_on_hard_rows(kind):
    """Rows with one peaked token (as trained models give), logits in the thousands (block sums far from
    their max), all-equal logits (every block has the same mass: the block noise alone decides) and many
    exact ties of z, over many keys: the kernel's tokens are ``block_race``'s."""
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
    want, want_lse = _reference(logits, keys, 1.0, True, 256)
    tokens, lse = _kernel(logits, keys, 1.0, True, splits=2, block=256)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-4 if kind == "huge" else 1e-5)


def test_the_noise_is_finite_so_every_token_follows_its_logit():
    """The uniform u must stay below 1: with 24 noise bits, (2^24 - 1 + 0.5) rounded to 2^24 in fp32, u = 1,
    the noise was -inf and that token won whatever its logit (~0.9% of rows at Qwen's vocab; raw key 2078 at
    id 2209 of 4096). Now u has 23 bits, exact. A row whose best logit is 150 above the rest draws it, in the
    eager draw and the kernel, with the other ids at -1e4 or the hit id at -inf."""
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
        for splits in (1, 2):
            tok, _ = _kernel(logits, key, 1.0, True, splits=splits, block=256)
            assert tok.item() == 5, (rest, splits)


def test_many_keys_on_one_row_give_the_reference_tokens():
    """64 keys over one row of logits (a row repeated): each key's token is the reference's, and they
    spread over the likely tokens."""
    logits = torch.randn(1, 700).repeat(64, 1)
    keys = mix64(torch.arange(64)) + 12345
    tokens, _ = _kernel(logits, keys, 1.0, True, splits=4, block=128)
    assert torch.equal(tokens, _reference(logits, keys, 1.0, True, 128)[0])
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


def _colliding_pair(n: int, counters, tries: int):
    """(key [1], lo, hi): the first key below ``tries`` whose noise at two of the n counters (``counters`` [1, n])
    is the same float, and those two counters' indices."""
    for k in range(tries):
        key = torch.tensor([k])
        values, order = counter_log_exponential(key, n, counters)[0].sort()
        same = (values[1:] == values[:-1]).nonzero()[:, 0]
        if len(same):
            return key, *sorted((order[same[0]].item(), order[same[0] + 1].item()))
    raise AssertionError(f"no key below {tries} with colliding noise among {n} counters")


def test_noisy_ties_go_to_the_lowest_id():
    """Two ids of one block whose 23 noise bits collide get the same (top) logit and the rest -inf: their
    scores tie exactly and the lower id wins, as in torch.argmax; likewise two blocks whose noise collides,
    holding the same logits: the lower block wins."""
    block, vocab = 512, 4096
    key, lo, hi = _colliding_pair(block, torch.arange(block)[None], 1000)  # ~1.6% of keys
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, [lo, hi]] = 20.0
    tokens, _ = _kernel(logits, key, 1.0, True, splits=8, block=block)
    assert tokens.item() == lo == _reference(logits, key, 1.0, True, block)[0].item()
    blocks = 64  # block counters 2^31 + k: collisions among 64 blocks of 8 ids, same logits in each block
    key, lo, hi = _colliding_pair(blocks, (1 << 31) + torch.arange(blocks)[None], 20000)
    logits = torch.full((1, blocks * 8), float("-inf"))
    logits[0, lo * 8 : lo * 8 + 8] = logits[0, hi * 8 : hi * 8 + 8] = torch.arange(8.0)
    want = _reference(logits, key, 1.0, True, 8)[0].item()
    assert want // 8 == lo
    assert _kernel(logits, key, 1.0, True, splits=4, block=8)[0].item() == want


def test_splits_depend_on_the_batch_only():
    assert kernel.splits_for(1) == 64 and kernel.splits_for(64) == 32 and kernel.splits_for(512) == 4
    assert kernel.splits_for(2048) == 1 and kernel.splits_for(37) == 64 and kernel.splits_for(1024) == 2


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


def test_the_trial_allows_another_block_only_where_two_blocks_nearly_tie():
    """``_near_tied_blocks`` (the start-up trial's allowance for a kernel that sums a block's log-sum-exp in
    its own fp32 order): a token from a block whose score is within 1e-6 of the best passes, if it is that
    block's own inside draw; a token from a block far behind fails, as does another id of the near block."""
    block = sampling.SAMPLE_BLOCK
    key = torch.tensor([12345])
    z = torch.full((1, 3 * block), -30.0)
    z[0, :block] = 0.0  # block 0: log-sum-exp log(1024)
    ids = (1 << 31) + torch.arange(3)[None]
    noise = counter_log_exponential(key, 3, ids)[0].double()
    # block 1 at a constant c: its score log(1024) + c - noise_1, 1e-6 above block 0's
    z[0, block : 2 * block] = float(noise[1] - noise[0] + 1e-6)
    scores = sampling.block_scores(z, key)[0]
    assert abs(float(scores[1] - scores[0])) < 1e-5 and float(scores[2]) < float(scores[0]) - 10
    inside = [sampling.race_inside(z, key, torch.tensor([k]))[0].item() for k in range(3)]
    assert inside[0] // block == 0 and inside[1] // block == 1
    for k in (0, 1):  # either near block's own draw passes
        assert sampling._near_tied_blocks(z, key, torch.tensor([inside[k]]))
    assert not sampling._near_tied_blocks(z, key, torch.tensor([inside[2]]))  # a block far behind
    other = inside[1] + 1 if inside[1] + 1 < 2 * block else inside[1] - 1
    assert not sampling._near_tied_blocks(z, key, torch.tensor([other]))  # not the block's own draw


def test_nan_logits_give_a_token_inside_the_vocab():
    """A row of NaN logits (a diverged model) draws an id < V in every branch (one split and several, the
    draw inside a block finding no score equal to its NaN max), not ``vocab + block``; noisy and greedy."""
    logits = torch.randn(3, 3000)
    logits[0] = float("nan")
    logits[1, 100] = float("nan")
    keys = torch.randint(-(2**62), 2**62, (3,))
    for noisy in (True, False):
        for splits in (1, 4):
            tokens, _ = _kernel(logits, keys, 1.0, noisy, splits=splits, block=256)
            assert bool((tokens >= 0).all() and (tokens < 3000).all()), (noisy, splits, tokens.tolist())


def test_the_engine_draws_with_the_kernel_the_eager_tokens(monkeypatch):
    """The engine's decode steps with the Triton sampler (under the interpreter: the path a GPU runs, keys
    mixed and log-probs read in the kernel) give the eager draw's completions and log-probs with
    layout-invariant keys (the generator's keys feed the kernel, while the eager fallback draws its own
    exponentials); the kernel serves every step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
    from rollout_common import hf_to_mcore, random_prompts, spec_of, tiny_hf

    from megatron_rl.rollout.engine import EngineConfig, RolloutEngine

    monkeypatch.setenv("MEGATRON_RL_COMPILE", "0")
    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(5, seed=2)
    sp = SamplingParams(temperature=0.9, n=2, max_new_tokens=10, seed=4, layout_invariant_sampling=True)
    calls = []
    draw = kernel.draw
    monkeypatch.setattr(kernel, "draw", lambda *a, **k: calls.append(a[0].shape[0]) or draw(*a, **k))
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(kernel, "RUN_ON_CPU", on)
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=10))
        runs[on] = (engine.generate(prompts, sp), engine.last_stats)
        if not on:
            assert calls == []
    (a, _), (b, stats) = runs[False], runs[True]
    assert len(calls) >= stats.decode_steps > 0
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=1e-5, atol=1e-5)


def test_an_infinite_logit_is_drawn_on_every_path():
    """A +inf logit (an fp16 overflow) is the token, in the kernel (one split and several, one block a step
    and two) as in the eager draw: its block's sum is inf - inf, so its score is set to +inf, not NaN."""
    torch.manual_seed(4)
    logits = torch.randn(2, 3000)
    logits[0, 2500] = float("inf")
    keys = torch.randint(-(2**62), 2**62, (2,))
    assert _reference(logits, keys, 1.0, True, 256)[0][0].item() == 2500
    assert block_race(logits, keys)[0].item() == 2500
    for splits in (1, 4):
        for unroll in (1, 2):
            tok, _ = _kernel(logits, keys, 1.0, True, splits=splits, block=256, unroll=unroll)
            assert tok[0].item() == 2500, (splits, unroll)


def test_the_trial_rejects_tokens_outside_the_vocab_before_reading_them():
    """A broken kernel's out-of-range token fails the trial with an error naming it (on a GPU a gather at
    that id would be a device-side assert, which no fallback survives)."""
    logits = torch.randn(2, 300)
    keys = torch.tensor([1, 2])
    lse = torch.logsumexp(logits * 0.7, -1)
    for bad in (300, -1):
        with pytest.raises(RuntimeError, match="outside the vocab of 300"):
            sampling._check_draw(logits, keys, True, torch.tensor([0, bad]), lse, lse, 0.0)
