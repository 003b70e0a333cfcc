"""The exact mode's training RoPE (``kernels.rope_exact``): megatron-core's unfused rotation bit for bit, as a
Triton kernel (interpreted here) and as eager ops, with its gradient; and megatron-core's attention calls
it for exact models only, with no host sync on packed rows."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_rl.kernels import rope_exact

pytest.importorskip("triton", reason="triton is in the dev extras")


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(rope_exact, "RUN_ON_CPU", True)
    monkeypatch.setattr(rope_exact, "_TRIED", {})


def _inputs(dtype, s=9, b=3, heads=5, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = (4 * torch.randn(s, b, heads, dim, generator=g)).to(dtype)
    freqs = torch.rand(s, 1, 1, dim, generator=g) * 500  # fp32 angles, as megatron-core's table
    return t, freqs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_and_reference_are_megatron_cores_unfused_bits(on_cpu, dtype):
    t, freqs = _inputs(dtype)
    want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    assert torch.equal(rope_exact.reference(t, freqs), want)
    assert rope_exact.serves(t)  # its trial passed
    assert torch.equal(rope_exact.apply(t, freqs), want)
    packed = t[:, 0]  # [S, H, D]: one THD segment, a table row per token
    assert torch.equal(rope_exact.apply(packed, freqs), want[:, 0])
    if dtype == torch.bfloat16:  # the fused kernel's one rounding is not these bits
        from megatron_rl.kernels.rope import rope_reference

        assert not torch.equal(rope_reference(t, freqs), want)


def test_gradient_is_the_transpose_rotation(on_cpu):
    t, freqs = _inputs(torch.float32, seed=1)
    a, b = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
    g = torch.randn(t.shape, generator=torch.Generator().manual_seed(2))
    rope_exact.apply(a, freqs).backward(g)
    rope_utils._apply_rotary_pos_emb_bshd(b, freqs).backward(g)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_a_failed_trial_keeps_the_eager_ops_with_a_warning(on_cpu, monkeypatch):
    t, freqs = _inputs(torch.bfloat16)
    monkeypatch.setattr(rope_exact, "_launch", lambda x, c, s, backward: torch.zeros_like(x))
    with pytest.warns(UserWarning, match="exact RoPE kernel failed its trial"):
        assert not rope_exact.serves(t)
    assert torch.equal(rope_exact.apply(t, freqs), rope_utils._apply_rotary_pos_emb_bshd(t, freqs))


def test_attention_calls_it_for_exact_models_only_and_never_syncs_on_packed_rows(monkeypatch):
    from megatron.core.transformer import attention

    rope_exact.install()
    rope_exact.install()  # once: a second call does not wrap the wrapper
    assert attention.apply_rotary_pos_emb.__wrapped__ is rope_utils.apply_rotary_pos_emb
    t, freqs = _inputs(torch.bfloat16)
    packed, cu = t[:, 0], torch.tensor([0, t.shape[0]], dtype=torch.int32)
    exact_cfg = type(
        "Cfg", (), {"exact_rope": True, "rotary_interleaved": False, "apply_rope_fusion": False}
    )()
    plain_cfg = type("Cfg", (), {"rotary_interleaved": False, "apply_rope_fusion": False,
                                 "multi_latent_attention": False})()  # fmt: skip
    one_rank = type("Group", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("host sync on a packed row"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("host sync on a packed row"))
    got = attention.apply_rotary_pos_emb(packed, freqs, exact_cfg, cu_seqlens=cu)
    monkeypatch.undo()
    assert torch.equal(got, rope_utils._apply_rotary_pos_emb_bshd(t, freqs)[:, 0])
    calls = []
    monkeypatch.setattr(rope_exact, "apply", lambda *a, **k: calls.append(1))
    out = attention.apply_rotary_pos_emb(t, freqs, plain_cfg, cp_group=one_rank)
    assert not calls and torch.equal(
        out, rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    )  # megatron-core's own


def test_tables_with_a_batch_axis_and_mla_are_left_to_megatron_core():
    """``handles`` claims only one angle row per position (freqs [S, 1, 1, D]) of a non-MLA model; a
    per-row table ([S, B, 1, D], mRoPE) or multi-latent attention goes to megatron-core's own function."""
    t, freqs = _inputs(torch.bfloat16)
    cfg = type(
        "Cfg", (), {"exact_rope": True, "rotary_interleaved": False, "multi_latent_attention": False}
    )()
    assert rope_exact.handles(t, freqs, cfg, None)
    assert not rope_exact.handles(t, freqs.expand(-1, t.shape[1], -1, -1), cfg, None)
    cfg.multi_latent_attention = True
    assert not rope_exact.handles(t, freqs, cfg, None)
