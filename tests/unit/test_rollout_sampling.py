"""Sampling: allowed sets of top-k / top-p, seeded reproducibility, greedy, the log-prob convention."""

import pytest
import torch

from megatron_rl.rollout.sampling import SamplingParams, sample, token_logprobs, truncate_logits

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 (then tiny mass)
PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01])
LOGITS = PROBS.log()[None].repeat(4000, 1)  # [B, V]


def draw(params: SamplingParams, seed: int = 0) -> torch.Tensor:
    return sample(LOGITS, params, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "top_k,top_p,allowed",
    [(2, 1.0, {0, 1}), (-1, 0.7, {0, 1}), (-1, 0.71, {0, 1, 2}), (3, 0.5, {0, 1}), (1, 1.0, {0})],
)
def test_top_k_top_p_never_emit_outside_the_allowed_set(top_k, top_p, allowed):
    tokens = draw(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
    assert set(tokens.tolist()) == allowed  # all allowed tokens show up in 4000 draws, nothing else
    kept = torch.isfinite(truncate_logits(LOGITS[:1], top_k, top_p))[0]
    assert set(kept.nonzero()[:, 0].tolist()) == allowed


def test_sampling_follows_the_distribution_and_temperature():
    freq = torch.bincount(draw(SamplingParams(temperature=1.0)), minlength=6).float() / 4000
    assert torch.allclose(freq, PROBS, atol=0.03)
    hot = torch.bincount(draw(SamplingParams(temperature=3.0)), minlength=6).float() / 4000
    assert hot[0] < freq[0] and hot[5] > freq[5]


def test_fixed_seed_is_reproducible_and_seeds_differ():
    p = SamplingParams(temperature=0.8, top_p=0.9)
    assert torch.equal(draw(p, seed=5), draw(p, seed=5))
    assert not torch.equal(draw(p, seed=5), draw(p, seed=6))


def test_greedy_is_argmax():
    logits = torch.randn(7, 50)
    assert torch.equal(sample(logits, SamplingParams(temperature=0), None), logits.argmax(-1))


def test_logprob_is_the_temperature_scaled_full_softmax():
    logits = torch.randn(3, 11)
    tokens = torch.tensor([0, 5, 10])
    want = torch.log_softmax(logits / 0.5, -1)[torch.arange(3), tokens]
    assert torch.allclose(token_logprobs(logits, tokens, 0.5), want)
    assert torch.allclose(
        token_logprobs(logits, tokens, 0.0), torch.log_softmax(logits, -1)[torch.arange(3), tokens]
    )


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "rollout.n"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_sampling_params_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_k,top_p,temperature", [(-1, 1.0, 1.0), (-1, 1.0, 0.7), (20, 0.9, 1.3)])
def test_log_domain_race_equals_the_softmax_race_with_the_same_noise(top_k, top_p, temperature):
    """The fast path (no softmax, no sort without top-k/top-p) draws what argmax(p / E) draws."""
    logits = 3 * torch.randn(64, 1000)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(truncate_logits(logits / temperature, top_k, top_p), dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(3))
    plain = (probs / noise).argmax(dim=-1)
    assert torch.equal(sample(logits, params, torch.Generator().manual_seed(3)), plain)


def test_logprob_at_temperature_one_needs_no_scaled_copy():
    logits = torch.randn(5, 40)
    tokens = torch.randint(0, 40, (5,))
    want = torch.log_softmax(logits, -1)[torch.arange(5), tokens]
    assert torch.allclose(token_logprobs(logits, tokens, 1.0), want, atol=1e-6)


@pytest.fixture
def fused(monkeypatch):
    """The compiled sampler (what runs on GPU), through inductor's CPU backend."""
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "1")


@pytest.mark.parametrize("temperature,vocab", [(0.0, 500), (0.7, 500), (1.0, 500), (0.7, 3000)])
def test_fused_sampler_equals_the_eager_one_with_the_same_counter_noise(monkeypatch, temperature, vocab):
    """Compiled (inductor's CPU backend) and eager draws: the same tokens and log-probs, with one block of
    the two-level draw (500 ids) and with three (3,000: the block race decides)."""
    from megatron_rl.rollout.sampling import sample_with_logprobs

    logits = (3 * torch.randn(33, vocab)).to(torch.bfloat16)
    keys = torch.randint(-(2**40), 2**40, (33,))
    params = SamplingParams(temperature=temperature)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MEGATRON_RL_COMPILE", flag)
        runs[flag] = sample_with_logprobs(logits, params, None, keys if temperature else None)
    (t0, lp0), (t1, lp1) = runs["0"], runs["1"]
    assert torch.equal(t0, t1)
    want = torch.log_softmax(logits.float() / (temperature or 1.0), -1).gather(-1, t1[:, None])[:, 0]
    torch.testing.assert_close(lp1, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp0, want, rtol=1e-5, atol=1e-5)


def test_fused_sampler_follows_the_distribution_and_its_seed(fused):
    from megatron_rl.rollout.sampling import sample_with_logprobs

    def draw_fused(params, seed=0):
        return sample_with_logprobs(LOGITS, params, torch.Generator().manual_seed(seed))[0]

    freq = torch.bincount(draw_fused(SamplingParams(temperature=1.0)), minlength=6).float() / 4000
    assert torch.allclose(freq, PROBS, atol=0.03)
    hot = torch.bincount(draw_fused(SamplingParams(temperature=3.0)), minlength=6).float() / 4000
    assert hot[0] < freq[0] and hot[5] > freq[5]
    p = SamplingParams(temperature=1.0)
    assert torch.equal(draw_fused(p, 5), draw_fused(p, 5)) and not torch.equal(
        draw_fused(p, 5), draw_fused(p, 6)
    )
    # top-p needs the sort: the eager path, still within the allowed set
    assert set(draw_fused(SamplingParams(temperature=1.0, top_p=0.7)).tolist()) == {0, 1}


@pytest.mark.parametrize("vocab,block", [(40, 8), (37, 8), (37, 64)])
def test_the_block_race_follows_the_distribution(vocab, block):
    """``block_race`` draws token i with probability softmax(z)_i: 40,000 keys over one row of logits spread
    over 8 orders of magnitude, blocks full, the last one partial, or one block for the whole row. With one
    block it is the per-token race (same keys, same tokens); with several the block noise decides first."""
    from megatron_rl.rollout.sampling import block_race, counter_log_exponential

    torch.manual_seed(0)
    z = (2 * torch.randn(vocab)).expand(40000, vocab)
    keys = torch.arange(40000) * 7919 - 123456789
    freq = torch.bincount(block_race(z, keys, block), minlength=vocab).double() / 40000
    p = torch.softmax(z[0].double(), -1)
    assert (freq - p).abs().max() < 4 * (p * (1 - p) / 40000).sqrt().max() + 1e-4
    chi2 = ((freq - p) ** 2 / p).sum() * 40000  # vocab - 1 degrees of freedom: mean 36-39, sd ~9
    assert chi2 < vocab + 40
    per_token = (z - counter_log_exponential(keys, vocab)).argmax(-1)
    differ = (block_race(z, keys, block) != per_token).float().mean()
    assert differ == 0 if vocab <= block else differ > 0.3


def test_counter_noise_is_exponential():
    from megatron_rl.rollout.sampling import counter_log_exponential

    e = counter_log_exponential(torch.arange(64), 4096).exp()  # [64, 4096] Exp(1) draws
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.03
    assert (e[0] != e[1]).float().mean() > 0.99  # rows get different noise
