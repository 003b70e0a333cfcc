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


def test_the_exact_rope_rounding_keeps_nan_and_inf_as_the_eager_ops_do():
    """NaN, inf and values past bf16's range through the exact kernel: the same NaN positions and the same
    bits elsewhere as the eager ``apply_rope`` (overflow to inf included)."""
    bsz, groups, rep, dim = 2, 1, 1, 16
    qkv = torch.ones(bsz, groups, rep + 2, dim, dtype=torch.bfloat16)
    qkv[0, 0, 0, :4] = float("nan")
    qkv[0, 0, 0, 4] = float("inf")
    qkv[1, 0, 0, :] = torch.finfo(torch.bfloat16).max
    qkv[1, 0, 1, 3] = -float("nan")
    pos = torch.tensor([1, 2])
    cos, sin = rope_cos_sin(pos[:, None], dim, 1e6, torch.bfloat16)
    cos, sin = cos[:, 0, 0, 0], sin[:, 0, 0, 0]
    cache = torch.zeros(2, bsz, groups, 4, dim, dtype=torch.bfloat16)
    ref = cache.clone()
    q = fused.rope_kv_write(qkv, cos, sin, pos, cache[0], cache[1], exact=True)
    want = fused.rope_kv_write_reference(qkv, cos, sin, pos, ref[0], ref[1], exact=True)
    assert torch.isnan(want).any() and torch.isinf(want).any()
    assert torch.equal(torch.isnan(q), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(q[finite], want[finite])  # inf, -inf and the finite values the same bits
    assert torch.equal(torch.isnan(cache), torch.isnan(ref)) and torch.equal(
        cache.nan_to_num(), ref.nan_to_num()
    )


def test_bf16_rounding_by_bits_keeps_every_nan_a_nan():
    """``_round_to`` adds to the bits: a NaN whose low mantissa bits are all set would carry into the sign
    (-0.0) or wrap to 0 without its guard. Rounded values equal torch's cast; NaNs of any payload stay NaN."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_kernel(x_ptr, out_ptr, n: tl.constexpr):
        i = tl.arange(0, n)
        tl.store(out_ptr + i, fused._round_to(tl.load(x_ptr + i), tl.bfloat16))

    nan_bits = torch.tensor(
        [0x7FFFFFFF, -1, 0x7FC00000, 0x7F80FFFF], dtype=torch.int32
    )  # -1: 0xFFFFFFFF; 32 in all
    g = torch.Generator().manual_seed(0)
    finite = torch.cat([torch.randn(24, generator=g) * 10.0 ** torch.randint(-30, 30, (24,), generator=g),
                        torch.tensor([3.4e38, -3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8])])  # fmt: skip
    x = torch.cat([nan_bits.view(torch.float32), finite])
    out = torch.empty_like(x)
    round_kernel[(1,)](x, out, n=x.numel())
    assert torch.isnan(out[:4]).all()
    assert torch.equal(out[4:], finite.to(torch.bfloat16).float())  # ties to even, overflow to inf


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


def test_pdl_launch_options_only_on_cuda_when_switched_on(monkeypatch):
    """``MEGATRON_RL_DECODE_PDL``: off by default; on, the CUDA launches get the kernels' PDL flag and
    ``launch_pdl`` (where Triton has ``gdc_wait``) on compute capability 9.0+, CPU launches (the interpreter)
    and older GPUs nothing."""
    assert fused.pdl(torch.device("cuda")) == {} or fused.PDL
    monkeypatch.setattr(fused, "PDL", True)
    assert fused.pdl(torch.device("cpu")) == {}
    for major, on in ((8, False), (9, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        want = {"PDL": True, "launch_pdl": True} if fused.HAVE_GDC and on else {}
        assert fused.pdl(torch.device("cuda")) == want
