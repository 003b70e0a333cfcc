"""Single-rank vocab-parallel log-probs and entropy: equal to plain log_softmax, correct gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos import vocab_parallel_entropy, vocab_parallel_log_probs

B, T, V = 3, 4, 11


def make_inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(B, T, V, generator=gen)).to(dtype)
    target = torch.randint(0, V, (B, T), generator=gen)
    return logits, target


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_equal_log_softmax(temperature):
    logits, target = make_inputs()
    leaf = logits.clone().requires_grad_(True)
    logp = vocab_parallel_log_probs(leaf, target, temperature=temperature)
    entropy = vocab_parallel_entropy(leaf, temperature=temperature)
    weights = torch.randn(2, B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (weights[0] * logp + weights[1] * entropy).sum().backward()

    plain = logits.clone().requires_grad_(True)
    log_softmax = torch.log_softmax(plain / temperature, dim=-1)
    want_logp = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    want_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (weights[0] * want_logp + weights[1] * want_entropy).sum().backward()

    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-12)
    torch.testing.assert_close(leaf.grad, plain.grad, rtol=0, atol=1e-12)


def test_gradcheck():
    logits, target = make_inputs()
    leaf = logits[:1, :2].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_log_probs(x, target[:1, :2], temperature=0.9), (leaf,)
    )
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_entropy(x, temperature=0.9), (leaf,))


def test_low_precision_logits_are_computed_in_fp32():
    logits, target = make_inputs(torch.bfloat16)
    logp = vocab_parallel_log_probs(logits, target)
    assert logp.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-6)


def test_fused_log_probs_and_entropy_equal_separate_functions_with_padding():
    from megatron_rl.algos import vocab_parallel_log_probs_and_entropy

    torch.manual_seed(0)
    vocab, padded = 33, 40
    for temperature in (1.0, 0.7):
        logits = torch.randn(3, 5, padded, dtype=torch.float64)
        targets = torch.randint(0, vocab, (3, 5))
        ref_in = logits[..., :vocab].clone().requires_grad_(True)  # the true vocabulary only
        want_lp = vocab_parallel_log_probs(ref_in, targets, temperature=temperature)
        want_ent = vocab_parallel_entropy(ref_in, temperature=temperature)
        (0.3 * want_lp.sum() + 0.7 * want_ent.sum()).backward()
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(
            x, targets, temperature=temperature, vocab_size=vocab, chunk_tokens=4
        )
        (0.3 * lp.sum() + 0.7 * ent.sum()).backward()
        assert torch.allclose(lp, want_lp, atol=1e-12) and torch.allclose(ent, want_ent, atol=1e-12)
        assert torch.allclose(x.grad[..., :vocab], ref_in.grad, atol=1e-12)
        assert torch.all(x.grad[..., vocab:] == 0)  # padding columns get no gradient
        x.grad = None
        lp, _ = vocab_parallel_log_probs_and_entropy(x, targets, temperature=temperature, vocab_size=vocab)
        lp.sum().backward()  # entropy unused: its gradient is skipped, the log-prob one is still exact
        ref_in.grad = None
        vocab_parallel_log_probs(ref_in, targets, temperature=temperature).sum().backward()
        assert torch.allclose(x.grad[..., :vocab], ref_in.grad, atol=1e-12)


def test_fused_kernel_compiled_equals_eager(monkeypatch):
    """The torch.compile'd passes (what runs on GPU) give the eager passes' log-probs, entropy and
    gradient; checked here with inductor's CPU backend on bf16 logits with vocab padding."""
    from megatron_rl.algos import vocab_parallel_log_probs_and_entropy

    torch.manual_seed(0)
    logits = (3 * torch.randn(37, 300)).to(torch.bfloat16)
    targets = torch.randint(0, 290, (37,))
    g_lp, g_ent = torch.randn(37), torch.randn(37)
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("MEGATRON_RL_COMPILE", flag)
        x = logits.clone()[None].requires_grad_(True)  # [1, N, V]
        lp, ent = vocab_parallel_log_probs_and_entropy(x, targets[None], temperature=0.8, vocab_size=290)
        ((lp[0] * g_lp).sum() + (ent[0] * g_ent).sum()).backward()
        results.append((lp, ent, x.grad))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1.float(), g0.float(), rtol=1e-2, atol=1e-4)  # bf16 gradient
    assert torch.all(g1[..., 290:] == 0) and g1.abs().sum() > 0
    want = torch.log_softmax(logits[:, :290].float() / 0.8, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp1[0], want, rtol=1e-5, atol=1e-5)


def test_a_failing_torch_compile_falls_back_to_the_eager_passes(monkeypatch):
    from megatron_rl.algos import vocab_parallel as vp

    monkeypatch.setenv("MEGATRON_RL_COMPILE", "1")
    from megatron_rl.kernels import compile as kc

    fresh = {n: kc.compile_rows_dynamic(f) for n, f in (("max", vp._pass_max), ("sums", vp._pass_sums),
                                                          ("grad", vp._pass_grad))}  # fmt: skip
    monkeypatch.setattr(vp, "_COMPILED", fresh)  # not compiled yet: they meet the broken compile below
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})

    def broken(fn, **_):
        def run(*a, **k):
            raise RuntimeError("no Triton here")

        return run

    monkeypatch.setattr(vp.torch, "compile", broken)
    logits = torch.randn(1, 6, 40, requires_grad=True)
    target = torch.randint(0, 40, (1, 6))
    with pytest.warns(UserWarning, match="no Triton here"):
        lp, _ = vp.vocab_parallel_log_probs_and_entropy(logits, target, chunk_tokens=4)
    lp.sum().backward()
    want = torch.log_softmax(logits.detach(), -1).gather(-1, target[..., None])[..., 0]
    torch.testing.assert_close(lp, want)
    assert vp._PROBE in kc._FAILED and not vp._compiled_ok(logits)
