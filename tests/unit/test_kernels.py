"""kernels/: the compile switch and its fallback, and the fused RoPE against megatron-core's own."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_rl.kernels import compile as kc
from megatron_rl.kernels.rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    rope_reference,
)


def _freqs(s: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(s).float()[:, None] * inv  # [S, D/2]
    return torch.cat((f, f), -1)[:, None, None, :]  # [S, 1, 1, D]


@pytest.mark.parametrize("flag", ["0", "1"])
def test_rope_equals_megatron_core_unfused_values_and_grads(monkeypatch, flag):
    monkeypatch.setenv("MEGATRON_RL_COMPILE", flag)
    torch.manual_seed(0)
    t = torch.randn(7, 2, 3, 16, requires_grad=True)
    t_ref = t.detach().clone().requires_grad_(True)
    freqs, g = _freqs(7, 16), torch.randn(7, 2, 3, 16)
    fn = fused_apply_rotary_pos_emb if flag == "1" else rope_reference
    out = fn(t, freqs)
    ref = rope_utils._apply_rotary_pos_emb_bshd(t_ref, freqs)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t.grad, t_ref.grad, rtol=1e-6, atol=1e-6)
    # bf16: one rounding instead of one per product, so within a bf16 ulp of the unfused result
    tb = t.detach().to(torch.bfloat16)
    diff = (fn(tb, freqs).float() - rope_utils._apply_rotary_pos_emb_bshd(tb, freqs).float()).abs()
    assert diff.max() <= 2 * 2**-8 * tb.float().abs().max()
    # bf16 gradient (the compiled path's own backward: the gradient rotated back by -angle) against autograd
    # through the fp32 reference: one rounding each, so at most a bf16 ulp apart
    tb.requires_grad_(True)
    tr = tb.detach().clone().requires_grad_(True)
    gb = g.to(torch.bfloat16)
    (fn(tb, freqs).float() * gb.float()).sum().backward()
    (rope_reference(tr, freqs).float() * gb.float()).sum().backward()
    assert tb.grad.dtype == torch.bfloat16
    assert (tb.grad.float() - tr.grad.float()).abs().max() <= 2**-8 * tr.grad.float().abs().max()


def test_rope_partial_or_interleaved_uses_megatron_core_path():
    t, freqs = torch.randn(5, 1, 2, 16), _freqs(5, 8)
    want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    assert torch.equal(fused_apply_rotary_pos_emb(t, freqs), want)


def test_kernel_env_switches_keep_their_default_unless_set_to_the_other_word(monkeypatch):
    for value, on_default, off_default in (("0", False, False), ("off", False, False), ("1", True, True),
                                           ("yes", True, True), ("2", True, False), (None, True, False)):  # fmt: skip
        if value is None:
            monkeypatch.delenv("MEGATRON_RL_TEST_SWITCH", raising=False)
        else:
            monkeypatch.setenv("MEGATRON_RL_TEST_SWITCH", value)
        assert kc.env_switch("MEGATRON_RL_TEST_SWITCH", True) is on_default, value
        assert kc.env_switch("MEGATRON_RL_TEST_SWITCH", False) is off_default, value


def test_compile_switch_rejects_unknown_values_and_probe_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "yes")
    with pytest.raises(ValueError, match="MEGATRON_RL_COMPILE='yes'"):
        kc.compile_enabled("cpu")
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "auto")
    assert not kc.compile_enabled("cpu") and kc.compile_enabled("cuda")
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "1")

    def broken():
        raise RuntimeError("no Triton here")

    with pytest.warns(UserWarning, match="k1 failed.*no Triton here"):
        assert not kc.probe("k1", "cpu", broken)
    assert not kc.probe("k1", "cpu", lambda: None)  # a failed kernel stays eager
    assert kc.probe("k2", "cpu", lambda: None) and kc.probe("k2", "cpu", broken)  # probed once


@pytest.mark.parametrize("flag", ["0", "1"])
def test_swiglu_equals_silu_times_up_values_and_grads(monkeypatch, flag):
    from megatron_rl.kernels import swiglu as sw

    monkeypatch.setenv("MEGATRON_RL_COMPILE", flag)
    torch.manual_seed(0)
    for rows in (5, 9):  # a second row count reuses the rows-dynamic compile
        y = torch.randn(rows, 3, 16, requires_grad=True)
        y_ref = y.detach().clone().requires_grad_(True)
        g = torch.randn(rows, 3, 8)
        out = sw.SwiGLU()(y)
        gate, up = y_ref.chunk(2, -1)
        ref = torch.nn.functional.silu(gate) * up
        (out * g).sum().backward()
        (ref * g).sum().backward()
        assert out.shape == (rows, 3, 8)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y.grad, y_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [False, True], ids=["eager", "triton"])
def test_exact_swiglu_rows_are_batch_invariant_and_its_grads_are_the_fused_ones(monkeypatch, kernel):
    """``kernels.swiglu.exact_forward`` (the exact mode's SwiGLU on both sides; with ``kernel`` the Triton
    kernel under the interpreter): a row's bits do not depend on the batch it is in or its place there,
    values are silu(gate) * up in fp32 rounded once, and ``ExactSwiGLU``'s backward is the fused one."""
    from megatron_rl.kernels import decode_fused
    from megatron_rl.kernels import swiglu as sw

    if kernel:
        pytest.importorskip("triton", reason="triton is in the dev extras")
        monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    calls = []
    original = decode_fused.swiglu
    monkeypatch.setattr(decode_fused, "swiglu", lambda y: calls.append(len(y)) or original(y))
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(37, 2 * 48, generator=g) * 3).to(torch.bfloat16)
    whole = sw.exact_forward(y)
    assert bool(calls) == kernel
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37)):
        assert torch.equal(sw.exact_forward(y[rows].clone()), whole[rows])  # alone, at row 0 of its batch
    gate, up = y.float().chunk(2, -1)
    torch.testing.assert_close(
        whole, (torch.nn.functional.silu(gate) * up).to(torch.bfloat16), rtol=1e-2, atol=1e-2
    )
    x = y.view(37, 1, -1).requires_grad_(True)
    x_ref = y.float().view(37, 1, -1).requires_grad_(True)
    grad = torch.randn(37, 1, 48, generator=g).to(torch.bfloat16)
    out = sw.ExactSwiGLU()(x)
    assert torch.equal(out.view(37, -1), whole)  # the module is exact_forward
    (out * grad).sum().backward()
    gate, up = x_ref.chunk(2, -1)
    ((torch.nn.functional.silu(gate) * up) * grad.float()).sum().backward()
    torch.testing.assert_close(x.grad.float(), x_ref.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("groups,rep,dim", [(2, 7, 64), (3, 1, 16), (1, 4, 32)])
def test_decode_attention_kernel_equals_masked_sdpa(monkeypatch, groups, rep, dim):
    """The Triton decode kernel (run by Triton's interpreter on CPU) against SDPA with the engine's
    additive mask: strided q (a slice of the qkv rows), a cache view shorter than its buffer, positions
    from 0 (one key) to the last cache row, GQA and MHA."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.kernels.decode_attention import decode_attention, usable

    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)

    torch.manual_seed(0)
    b, t = 5, 70
    cache = torch.randn(2, 2, 8, groups, 96, dim)  # [L, 2, S, G, Tmax, D]
    k, v = cache[1, 0, :b, :, :t], cache[1, 1, :b, :, :t]
    q = torch.randn(b, groups, rep + 2, dim)[:, :, :rep]
    pos = torch.tensor([0, 5, t - 1, 17, 64])
    assert usable(q)
    mask = torch.zeros(b, 1, 1, t).masked_fill(
        ~(torch.arange(t)[None] <= pos[:, None])[:, None, None], float("-inf")
    )
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(decode_attention(q, k, v, pos), want, rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_each_prompt_from_its_lead_slot(monkeypatch):
    """``prefix`` (rollout.prompt_kv_sharing): keys and values before plen come from the lead slot. With
    the other slots' prompt rows overwritten by noise, the result equals attention over the lead's prompt
    and the slot's own response keys; with every copy intact it is the unshared kernel's, bit for bit."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.kernels.decode_attention import decode_attention

    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    g = torch.Generator().manual_seed(1)
    b, groups, rep, dim, t = 6, 2, 7, 64, 150
    cache = torch.randn(2, 8, groups, 160, dim, generator=g)  # [2, S, G, Tmax, D]
    lead = torch.tensor([0, 0, 0, 3, 3, 5])  # prompts of 70 and 45 tokens; slot 5 alone
    plen = torch.tensor([70, 70, 70, 45, 45, 0])
    for slot in range(b):  # every slot holds a copy of its lead's prompt, as the engine's prefill leaves it
        cache[:, slot, :, : plen[slot]] = cache[:, lead[slot], :, : plen[slot]]
    k, v = cache[0, :b, :, :t], cache[1, :b, :, :t]
    q = torch.randn(b, groups, rep, dim, generator=g)
    pos = torch.tensor([69, 100, 149, 44, 80, 30])  # the last prompt position, inside and past one block
    unshared = decode_attention(q, k, v, pos)
    shared = decode_attention(q, k, v, pos, prefix=(lead, plen))
    assert torch.equal(shared, unshared)
    noisy = cache.clone()
    for slot in (1, 2, 4):  # the members' own copies of the prompt are gone
        noisy[:, slot, :, : plen[slot]] = torch.randn(2, groups, int(plen[slot]), dim, generator=g)
    got = decode_attention(q, noisy[0, :b, :, :t], noisy[1, :b, :, :t], pos, prefix=(lead, plen))
    assert torch.equal(got, unshared)
    assert not torch.equal(decode_attention(q, noisy[0, :b, :, :t], noisy[1, :b, :, :t], pos), unshared)


@pytest.mark.parametrize(
    "groups,rep,dim,dtype",
    [(2, 7, 64, torch.bfloat16), (1, 14, 32, torch.float32), (3, 1, 16, torch.bfloat16)],
)
def test_rope_in_attention_equals_rope_kv_write_then_attention(monkeypatch, groups, rep, dim, dtype):
    """``rope_decode_attention`` (``MEGATRON_RL_DECODE_ROPE_IN_ATTENTION``): one kernel for the step's RoPE,
    its KV-cache write and attention gives ``decode_fused.rope_kv_write`` then ``decode_attention`` bit for
    bit: the output and the whole cache (this step's key and value at each row's position, nothing else
    written), with and without prompt KV sharing, positions 0, at and past a key block's end."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.kernels import decode_fused
    from megatron_rl.kernels.rope import rope_cos_sin

    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    g = torch.Generator().manual_seed(3)
    b, t = 6, 150
    cache = torch.randn(2, b + 1, groups, 160, dim, generator=g).to(dtype)  # [2, S, G, Tmax, D]
    qkv = torch.randn(b, groups, rep + 2, dim, generator=g).to(dtype)
    pos = torch.tensor([0, 63, 64, 149, 100, 70])
    lead, plen = torch.tensor([0, 1, 1, 1, 4, 4]), torch.tensor([0, 50, 50, 50, 60, 60])
    for slot in range(b):
        cache[:, slot, :, : plen[slot]] = cache[:, lead[slot], :, : plen[slot]]
    cos, sin = rope_cos_sin(pos[:, None], dim, 10000.0, dtype)
    cos, sin = cos[:, 0, 0, 0], sin[:, 0, 0, 0]  # [B, D]
    for prefix in (None, (lead, plen)):
        two, one = cache.clone(), cache.clone()
        q = decode_fused.rope_kv_write(qkv, cos, sin, pos, two[0, :b, :, :t], two[1, :b, :, :t])
        want = kernel.decode_attention(q, two[0, :b, :, :t], two[1, :b, :, :t], pos, prefix=prefix)
        got = kernel.rope_decode_attention(qkv, cos, sin, one[0, :b, :, :t], one[1, :b, :, :t], pos, prefix)
        assert torch.equal(got, want)
        assert torch.equal(one, two)
        assert not torch.equal(one, cache)  # the step's keys and values were written


def test_rope_in_attention_that_fails_its_trial_warns_and_the_two_kernels_serve(monkeypatch):
    """``rope_usable``: a fused kernel that raises in its start-up trial is reported once in a warning that
    says what runs instead, and the decoder keeps ``rope_kv_write`` then ``decode_attention``."""
    pytest.importorskip("triton", reason="triton is in the dev extras")
    from megatron_rl.kernels import compile as kc
    from megatron_rl.kernels import decode_attention as kernel
    from megatron_rl.kernels import decode_fused

    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(decode_fused, "RUN_ON_CPU", True)
    monkeypatch.setattr(kernel, "ROPE_IN_ATTENTION", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})

    def broken(*a, **k):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(kernel, "rope_decode_attention", broken)
    qkv = torch.randn(3, 2, 9, 64)
    with pytest.warns(
        UserWarning, match="RoPE and the KV write run in their own kernel.*no kernel for this GPU"
    ):
        assert not kernel.rope_usable(qkv)
    assert not kernel.rope_usable(qkv)  # remembered: no second trial


def test_rope_tables_are_computed_once_per_angle_tensor_and_never_served_stale(monkeypatch):
    """kernels.rope keeps the cos / sin of the last angles: q and k of every layer of a forward reuse them
    (one gather and one sin / cos per forward); other angles, another segment layout, an angle tensor that
    died (even if a new one got its id) or a switch into inference mode compute them again."""
    from megatron_rl.kernels import rope

    made = []
    real = rope._tables

    def counting(key, per_row):
        return real(key, lambda: made.append(1) or per_row())

    monkeypatch.setattr(rope, "_tables", counting)
    monkeypatch.setattr(rope, "_TABLES", [])
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    freqs = torch.randn(5, 1, 1, 4, generator=g).repeat(
        1, 1, 1, 2
    )  # halves repeated, as megatron-core's table
    q, k = (
        torch.randn(7, 4, 8, generator=g, requires_grad=True),
        torch.randn(7, 2, 8, generator=g, requires_grad=True),
    )
    outs = [fused_apply_rotary_pos_emb_thd(t, cu, freqs) for t in (q, k, q, k)]  # two layers
    assert len(made) == 1
    want = torch.cat(
        [rope_reference(q[:3, None], freqs[:3])[:, 0], rope_reference(q[3:, None], freqs[:4])[:, 0]]
    )
    torch.testing.assert_close(outs[2], want, rtol=0, atol=1e-6)
    (outs[0] * 2 + outs[2]).sum().backward()  # the backward rotates back with the saved tables
    fresh = q.detach().clone().requires_grad_(True)
    ref = torch.cat(
        [rope_reference(fresh[:3, None], freqs[:3])[:, 0], rope_reference(fresh[3:, None], freqs[:4])[:, 0]]
    )
    (3 * ref).sum().backward()
    torch.testing.assert_close(q.grad, fresh.grad, rtol=1e-6, atol=1e-6)
    fused_apply_rotary_pos_emb_thd(q, torch.tensor([0, 4, 7], dtype=torch.int32), freqs)  # another layout
    freqs2 = freqs.clone()
    fused_apply_rotary_pos_emb_thd(q, cu, freqs2)  # other angles
    assert len(made) == 3
    with torch.inference_mode():
        fused_apply_rotary_pos_emb_thd(q.detach(), cu, freqs2)
    assert len(made) == 4
    fused_apply_rotary_pos_emb_thd(q, cu, freqs2)
    freqs2.mul_(2)  # written in place: other angles
    fused_apply_rotary_pos_emb_thd(q, cu, freqs2)
    assert len(made) == 6
    del freqs2
    assert rope._TABLES[0][0][0]() is None  # the cache holds its angles weakly: it sees them die
    # (CPython may give the next tensor the dead one's id: a key by id alone would match it)
    freqs3 = torch.zeros(5, 1, 1, 8)
    got = fused_apply_rotary_pos_emb_thd(q, cu, freqs3)
    assert len(made) == 7 and torch.equal(got, q)  # new tables: angle 0, no rotation
    rope.release_tables()
    assert not rope._TABLES
