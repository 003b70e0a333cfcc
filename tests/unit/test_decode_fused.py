"""The fused decode kernels (Triton, interpreted on CPU in fp32) against the reference ops they replace."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")
from megatron_rl.kernels import decode_fused as fused  # noqa: E402
from megatron_rl.kernels.rope import rope_cos_sin  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(fused, "RUN_ON_CPU", True)


@pytest.mark.parametrize("rep,dim", [(7, 64), (8, 128)])
def test_rope_kv_write_equals_bmm_and_index_writes_on_strided_cache_views(rep, dim):
    g = torch.Generator().manual_seed(0)
    bsz, groups, t = 5, 2, 12
    qkv = torch.randn(bsz, 1, groups * (rep + 2) * dim, generator=g).view(bsz, 1, groups, rep + 2, dim)[:, 0]
    pos = torch.tensor([0, 3, 11, 7, 5])
    cos, sin = rope_cos_sin(pos[:, None], dim, 1e6, torch.float32)
    cos, sin = cos[:, 0, 0, 0], sin[:, 0, 0, 0]
    cache = torch.randn(2, bsz + 1, groups, t + 4, dim, generator=g)  # views: slots and T cut
    ref = cache.clone()
    q = fused.rope_kv_write(qkv, cos, sin, pos, cache[0, :bsz, :, :t], cache[1, :bsz, :, :t])
    want = fused.rope_kv_write_reference(qkv, cos, sin, pos, ref[0, :bsz, :, :t], ref[1, :bsz, :, :t])
    assert torch.allclose(q, want, atol=1e-5)
    assert torch.allclose(cache, ref, atol=1e-5)  # written positions equal, the rest untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_exact_rope_kv_write_is_the_eager_rotation_bit_for_bit(dtype):
    """``exact=True`` (rollout.exact_logprobs): each product and the sum rounded as the eager ops round,
    so rotated q, the cache's k and v are the same bits as ``decoder.apply_rope`` and the indexed writes;
    the one-rounding kernel is not (the reason the exact path needs its own)."""
    g = torch.Generator().manual_seed(2)
    bsz, groups, rep, dim, t = 4, 2, 7, 64, 9
    qkv = (3 * torch.randn(bsz, groups, rep + 2, dim, generator=g)).to(dtype)
    pos = torch.tensor([0, 8, 3, 5])
    cos, sin = rope_cos_sin(pos[:, None], dim, 1e6, dtype)
    cos, sin = cos[:, 0, 0, 0], sin[:, 0, 0, 0]
    cache = torch.randn(2, bsz, groups, t, dim, generator=g).to(dtype)
    ref, plain = cache.clone(), cache.clone()
    q = fused.rope_kv_write(qkv, cos, sin, pos, cache[0], cache[1], exact=True)
    want = fused.rope_kv_write_reference(qkv, cos, sin, pos, ref[0], ref[1], exact=True)
    assert torch.equal(q, want) and torch.equal(cache, ref)
    if dtype == torch.bfloat16:
        one_rounding = fused.rope_kv_write(qkv, cos, sin, pos, plain[0], plain[1])
        assert not torch.equal(one_rounding, want)
    assert fused.usable("rope_kv_write_exact", qkv)


def test_swiglu_and_add_rms_norm_equal_reference():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 2 * 100, generator=g)
    assert torch.allclose(fused.swiglu(y, block=32), fused.swiglu_reference(y), atol=1e-6)
    x, r, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    for got, want in zip(fused.add_rms_norm(x, r, w, 1e-6), fused.add_rms_norm_reference(x, r, w, 1e-6)):
        assert torch.allclose(got, want, atol=1e-5)


def test_a_broken_kernel_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(fused, "_FAILED", {})
    monkeypatch.setattr(fused, "_PASSED", set())
    monkeypatch.setattr(fused, "swiglu", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken")))
    x = torch.zeros(2, 4)
    with pytest.warns(UserWarning, match="swiglu.*broken"):
        assert not fused.usable("swiglu", x)
    qkv = torch.zeros(2, 2, 5, 16)  # [B, G, rep + 2, D]: each trial runs at the caller's trailing dims
    assert fused.usable("add_rms_norm", x) and fused.usable("rope_kv_write", qkv)
    assert ("add_rms_norm", "cpu", x.dtype, (4,)) in fused._PASSED
