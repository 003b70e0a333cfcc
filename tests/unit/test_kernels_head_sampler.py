"""kernels/head_sampler.py (Triton's interpreter on CPU): the LM head and the draw in one GEMM give the tokens,
log-sum-exp and log-probs of ``kernels.sampler.draw`` on the logits the kernel computed, and those logits are
``h @ W.T`` rounded to the activation dtype; padded vocab rows and a row count that is not a tile multiple.
fp16 / fp32 only: this Triton's interpreter computes bf16 ``tl.dot`` wrongly (a 16 x 16 bf16 dot off by ~1e10),
so the bf16 path (``_round_to``'s bit rounding inside the kernel) is checked on a GPU by the engine's trial and
``benchmarks/bench_head_sampler.py``."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")

from megatron_rl.kernels import (
    decode_fused,  # noqa: E402
    sampler,  # noqa: E402
)
from megatron_rl.kernels import head_sampler as head  # noqa: E402
from megatron_rl.rollout.sampling import _draw  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(head, "RUN_ON_CPU", True)
    monkeypatch.setattr(sampler, "RUN_ON_CPU", True)
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)


def _inputs(rows, hidden, padded, scale, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(torch.float16)
    w = (scale * torch.randn(padded, hidden, generator=g)).to(torch.float16)
    keys = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    return h, w, keys


# rows, vocab, padded vocab, hidden, tile, weight scale:
# - rows below one row tile, the vocab not a tile multiple, padded ids;
# - three row tiles (the last partial), a one-column last tile, hidden not a multiple of BK;
# - flat logits: many near scores in every tile
CASES = [
    (5, 300, 320, 64, (16, 32, 32, 4, 1), 0.3),
    (40, 257, 257, 80, (16, 64, 32, 4, 1), 1.0),
    (9, 200, 256, 64, (32, 32, 64, 4, 1), 0.05),
]


@pytest.mark.parametrize("noisy", [True, False])
@pytest.mark.parametrize("rows,vocab,padded,hidden,tile,scale", CASES)
def test_equals_the_sampler_on_its_own_logits(rows, vocab, padded, hidden, tile, scale, noisy):
    h, w, keys = _inputs(rows, hidden, padded, scale, rows)
    logits = torch.full((rows, padded), float("nan"), dtype=torch.float16)
    tok, lse, lp = head.draw(h, w, vocab, keys, 0.7, noisy, tile=tile, logits_out=logits)
    assert torch.isnan(logits[:, vocab:].float()).all()  # columns past the vocab are not written
    logits = logits[:, :vocab]
    want_logits = (h.float() @ w[:vocab].float().T).to(torch.float16)
    torch.testing.assert_close(logits.float(), want_logits.float(), rtol=1e-2, atol=1e-2)
    want_tok, want_lse, want_lp = sampler.draw(
        logits, keys, 0.7, noisy, mix=True, logprobs=True, splits=1, block=256
    )
    ref_tok, _ = _draw(logits, keys, torch.arange(vocab)[None], 0.7, noisy)
    assert torch.equal(want_tok, ref_tok)
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    picked = logits.gather(-1, tok[:, None])[:, 0].float() * 0.7
    torch.testing.assert_close(lp, picked - lse, rtol=0, atol=1e-6)


def test_the_fast_score_is_within_its_bound_of_the_exact_one():
    """The tile kernel's fast noisy score (interpreter: tl.log, the series below w = 1/64) against the exact
    one, over ids whose u covers both branches; the combine rescoring needs |error| well under the gap that
    would put three scores of a tile in a tie."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(out_exact, out_fast, key, n, BLOCK: tl.constexpr):
        ids = tl.arange(0, BLOCK)
        z = ids.to(tl.float32) * 0.0
        tl.store(out_fast + ids, head._fast_score(z, key, ids, False), mask=ids < n)
        tl.store(out_exact + ids, z - sampler._hash_log_noise(key, ids, False), mask=ids < n)

    n = 4096
    exact, fast = torch.empty(n), torch.empty(n)
    k[(1,)](exact, fast, 12345, n, BLOCK=n)
    assert torch.isfinite(exact).all() and torch.isfinite(fast).all()
    assert (fast - exact).abs().max() < 2e-5


def test_the_tile_setting_is_checked(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_HEAD_SAMPLER_TILE", "64,256,64,8,3")
    assert head._tile_from_env((1, 2, 3, 4, 5)) == (64, 256, 64, 8, 3)
    monkeypatch.delenv("MEGATRON_RL_HEAD_SAMPLER_TILE")
    assert head._tile_from_env((1, 2, 3, 4, 5)) == (1, 2, 3, 4, 5)
    for bad in ("128,128,64,8", "128,96,64,8,3", "a,b,c,d,e", "128,128,64,0,3", "128,128,64,6,3"):
        monkeypatch.setenv("MEGATRON_RL_HEAD_SAMPLER_TILE", bad)
        with pytest.raises(ValueError, match="MEGATRON_RL_HEAD_SAMPLER_TILE.*BM,BN,BK,num_warps,num_stages"):
            head._tile_from_env((1, 2, 3, 4, 5))
        with pytest.raises(ValueError, match="MEGATRON_RL_HEAD_SAMPLER_TILE"):  # where the engine asks
            head.serves("cpu", torch.float32)
    monkeypatch.setattr(head, "RUN_ON_CPU", False)
    assert not head.serves("cpu", torch.float32)  # off: the setting is not read
