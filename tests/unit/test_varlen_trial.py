"""The start-up trial that decides whether packed (and shared-prompt) attention may use a varlen
flash-attention kernel on a GPU (FlashAttention-4, aten's flash attention, torch's varlen_attn), and the
order in which a failing kernel gives way to the next. On CPU those kernels do not run, so stand-ins take
their place: the same per-segment attention (right) or one with a 5% error (wrong). The trial must accept
the first in any grad context (its first call can come from a no-grad log-prob pass: it once failed there on
every call), refuse the second, and say why with the errors it measured."""

import pytest
import torch

import megatron_rl.models.packed_attention as pa


def _stand_in(scale_error: float):
    def varlen(q, k, v, cu, max_q, scale, cu_k=None, max_k=None):
        if cu_k is None:
            out = pa.segment_attention(q, k, v, cu, scale)
        else:  # k, v are the gathered key segments
            out = pa.segment_attention(q, k, v, cu, scale, kv_index=torch.arange(k.shape[0]), cu_k=cu_k)
        return out * (1 + scale_error)

    return varlen


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
def test_the_trial_accepts_a_right_kernel_in_any_grad_context(monkeypatch, shared, context):
    monkeypatch.setattr(pa, "varlen_attention", _stand_in(0.0))
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    with contexts[context]():
        ok, why = pa._trial(torch.device("cpu"), torch.bfloat16, shared)
    assert ok, why
    assert pa.varlen_kernel(torch.device("cpu")) in why and "per-segment SDPA" in why


@pytest.mark.parametrize("shared", [False, True])
def test_the_trial_refuses_a_wrong_kernel_and_says_by_how_much(monkeypatch, shared):
    monkeypatch.setattr(pa, "varlen_attention", _stand_in(0.05))
    ok, why = pa._trial(torch.device("cpu"), torch.bfloat16, shared)
    assert not ok
    err = float(why.split(", per-segment SDPA")[0].split()[-1])
    assert err >= 0.04, why  # the 5% it was given, measured against float32


def test_notes_say_why_varlen_is_off_on_cpu():
    assert not pa.varlen_available(torch.device("cpu"), torch.float32)
    assert pa.varlen_notes()["cpu torch.float32"] == "not a CUDA fp16/bf16 tensor"


def _fake_flash(seen: list):
    """CPU stand-ins for aten's flash-attention forward/backward (CUDA only) with their argument order: the
    per-segment SDPA, keys in segments ``cu_k`` (the gathered rows as they come)."""

    def attend(q, k, v, cu_q, cu_k, scale):
        return pa.segment_attention(q, k, v, cu_q, scale, kv_index=torch.arange(k.shape[0]), cu_k=cu_k)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        seen.append((k.shape[1], v.shape[1], max_q, max_k))
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        return (
            attend(q, k, v, cu_q, cu_k, scale),
            torch.zeros(q.shape[1], q.shape[0]),
            torch.zeros(2),
            torch.zeros(0),
        )

    def backward(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, rng, unused, scale):
        with torch.enable_grad():
            q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
            return torch.autograd.grad(attend(q2, k2, v2, cu_q, cu_k, scale), (q2, k2, v2), g)

    return forward, backward


def _row(shared: bool, dim: int = 16, seed: int = 1):
    """q/k/v (float64, 6 query heads, 2 KV heads) of a packed row and the call pair (got, want): varlen
    attention and the per-segment SDPA, on plain segments or a prompt of 5 shared by responses of 3 and 4."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(24, h, dim, generator=g, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2)
    )
    if shared:
        idx = torch.tensor([*range(5), *range(5), 5, 6, 7, *range(5), 8, 9, 10, 11])
        cq, ck = torch.tensor([0, 5, 8, 12]), torch.tensor([0, 5, 13, 22])
        got = pa.shared_attention(q[:12], k[:12], v[:12], cq, idx, ck, 5, 9, 0.3, None, varlen=True)
        want = pa.segment_attention(q[:12], k[:12], v[:12], cq, 0.3, kv_index=idx, cu_k=ck)
    else:
        cu = torch.tensor([0, 5, 17, 24])
        got, want = pa.varlen_attention(q, k, v, cu, 12, 0.3), pa.segment_attention(q, k, v, cu, 0.3)
    return (q, k, v), got, want


def _assert_same_with_grads(inputs, got, want, seed: int = 2):
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed), dtype=got.dtype)
    torch.testing.assert_close(got, want)
    for a, b in zip(
        torch.autograd.grad((got * w).sum(), inputs), torch.autograd.grad((want * w).sum(), inputs)
    ):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shared", [False, True])
def test_gqa_keys_go_to_flash_attention_unrepeated_where_varlen_attn_has_no_enable_gqa(monkeypatch, shared):
    """torch 2.11's varlen_attn has no ``enable_gqa``: K/V of G heads then go to aten's flash ops as they are
    (no repeat per query head), and the output and all three gradients are the per-segment SDPA's."""
    import torch.nn.attention.varlen as tv

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        raise AssertionError("the GQA call must not reach varlen_attn")

    seen: list = []
    fwd, bwd = _fake_flash(seen)
    monkeypatch.setattr(tv, "varlen_attn", varlen_attn)
    monkeypatch.setattr(pa, "_flash_forward", fwd)
    monkeypatch.setattr(pa, "_flash_backward", bwd)
    monkeypatch.setattr(pa, "GQA_DIRECT", True)
    inputs, got, want = _row(shared, seed=0)
    assert seen == [(2, 2, 5, 9) if shared else (2, 2, 12, 12)]
    _assert_same_with_grads(inputs, got, want)


def _fresh_kernel_state(monkeypatch, fa4=None):
    """Every optional kernel on, none failed yet, no trial run; ``fa4``: a stand-in for FA4's varlen function
    (None: FA4 absent, as on this machine)."""
    monkeypatch.setattr(pa, "GQA_DIRECT", True)
    monkeypatch.setattr(pa, "FA4", True)
    for name, empty in (("_GQA_DIRECT_FAILED", set()), ("_FA4_FAILED", set()), ("_VARLEN_OK", {}),
                        ("_VARLEN_WHY", {}), ("_FA4_LAYOUTS", {})):  # fmt: skip
        monkeypatch.setattr(pa, name, empty)
    monkeypatch.setattr(pa, "_DROPPABLE", {"flash-attn-4": pa._FA4_FAILED,
                                           "aten flash (GQA unrepeated)": pa._GQA_DIRECT_FAILED})  # fmt: skip
    monkeypatch.setattr(pa, "_fa4_varlen", lambda: fa4)
    monkeypatch.setattr(pa, "_fa4_arch_ok", lambda device: True)


def test_a_failing_direct_gqa_trial_falls_back_to_repeated_keys_and_says_so(monkeypatch):
    import torch.nn.attention.varlen as tv

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        raise AssertionError("the trial is a stand-in: varlen_attn is here for its signature (torch 2.11's)")

    monkeypatch.setattr(tv, "varlen_attn", varlen_attn)
    _fresh_kernel_state(monkeypatch)
    calls = []

    def trial(device, dtype, shared):
        calls.append(pa._gqa_direct(device))
        if calls[-1]:
            raise RuntimeError("flash GQA broken here")
        return True, "largest relative error vs float32: varlen_attn 1e-3, per-segment SDPA 1e-3"

    monkeypatch.setattr(pa, "_trial", trial)
    dev = torch.device("cuda", 0)  # only the device's name is used: the trial is the stand-in
    with pytest.warns(UserWarning, match=r"before that aten flash \(GQA unrepeated\) failed it"):
        assert pa.varlen_available(dev, torch.bfloat16)
    assert calls == [True, False] and not pa._gqa_direct(dev)
    assert "RuntimeError: flash GQA broken here" in pa.varlen_notes()["cuda:0 torch.bfloat16"]


def _fake_fa4(seen: list, scale_error: float = 0.0, head_dims=None):
    """A CPU stand-in for FlashAttention-4's ``flash_attn_varlen_func`` with its keywords (q, k, v,
    cu_seqlens_q/k, max_seqlen_q/k, softmax_scale, causal, deterministic) and its (out, lse) return: the
    per-segment SDPA over the key segments as they come, GQA inside (K/V of G heads, unrepeated), off by
    ``scale_error``; ``head_dims``: the only head dims it runs (others raise, as FA4 refuses a layout)."""

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, deterministic):  # fmt: skip
        assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert head_dims is None or q.shape[-1] in head_dims, f"head dim {q.shape[-1]} not supported"
        seen.append((k.shape[1], max_seqlen_q, max_seqlen_k, deterministic))
        out = pa.segment_attention(q, k, v, cu_seqlens_q, softmax_scale, kv_index=torch.arange(k.shape[0]),
                                   cu_k=cu_seqlens_k)  # fmt: skip
        return out * (1 + scale_error), torch.zeros(q.shape[1], q.shape[0])

    return flash_attn_varlen_func


@pytest.mark.parametrize("shared", [False, True])
def test_fa4_where_it_imports_gets_the_gqa_keys_unrepeated_and_the_right_segments(monkeypatch, shared):
    """With ``flash-attn-4`` importable on a Hopper/Blackwell GPU, varlen attention goes through it (neither
    aten's flash ops nor varlen_attn run), after its trial at the call's head layout; K/V of G heads as they
    are, the segment bounds and scale passed through, and its output and gradients are the per-segment
    SDPA's; deterministic follows torch's switch."""
    import torch.nn.attention.varlen as tv

    def no(*args, **kwargs):
        raise AssertionError("with FA4 in use no other kernel runs")

    seen: list = []
    _fresh_kernel_state(monkeypatch, fa4=_fake_fa4(seen))
    for mod, name in ((tv, "varlen_attn"), (pa, "_flash_forward"), (pa, "_flash_backward")):
        monkeypatch.setattr(mod, name, no)
    inputs, got, want = _row(shared)
    assert seen[-1] == ((2, 5, 9, False) if shared else (2, 12, 12, False))
    assert len(seen) == 2  # the layout's trial (one FA4 call), then this one
    assert pa._FA4_LAYOUTS == {("cpu", torch.float64, 6, 2, 16): True}
    _assert_same_with_grads(inputs, got, want)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    _row(shared)
    assert seen[-1][3] is True and len(seen) == 3  # no second trial at a known layout
    assert pa.varlen_kernel(torch.device("cuda", 0)) == "flash-attn-4"
    monkeypatch.setattr(pa, "FA4", False)  # MEGATRON_RL_FA4=0
    assert pa.varlen_kernel(torch.device("cuda", 0)) != "flash-attn-4"


@pytest.mark.parametrize("error, ok", [(0.0, True), (0.05, False)])
def test_the_real_trial_runs_fa4_and_names_it(monkeypatch, error, ok):
    """The trial itself (not a stand-in) through FA4's stand-in: passes a right kernel, refuses one 5% off,
    and names flash-attn-4 with the error it measured."""
    _fresh_kernel_state(monkeypatch, fa4=_fake_fa4([], scale_error=error))
    pa._FA4_LAYOUTS[("cpu", torch.bfloat16, 4, 2, 64)] = True  # this layout's own trial as passed (else it
    # would catch the 5% first and hand the call to aten's flash attention, which has no CPU kernel)
    got, why = pa._trial(torch.device("cpu"), torch.bfloat16, True)
    assert got is ok and "flash-attn-4" in why, why
    assert (float(why.split(", per-segment SDPA")[0].split()[-1]) >= 0.04) is (not ok)


def test_fa4_failing_at_a_head_layout_leaves_that_layout_to_the_next_kernel(monkeypatch):
    """FA4 refusing a head dim (as it does some on Blackwell): the first call at that layout runs FA4's trial
    there, which fails, warns once, and the call runs on aten's flash attention with the same result; a
    layout FA4 runs stays on FA4."""
    import torch.nn.attention.varlen as tv

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        raise AssertionError("torch 2.11's signature: GQA goes to aten's flash ops")

    seen, flash = [], []
    _fresh_kernel_state(monkeypatch, fa4=_fake_fa4(seen, head_dims=(16,)))
    fwd, bwd = _fake_flash(flash)
    monkeypatch.setattr(tv, "varlen_attn", varlen_attn)
    monkeypatch.setattr(pa, "_flash_forward", fwd)
    monkeypatch.setattr(pa, "_flash_backward", bwd)
    with pytest.warns(
        UserWarning, match=r"flash-attn-4 failed its trial at 6 query heads, 2 KV heads, head dim 32"
    ):
        inputs, got, want = _row(False, dim=32)
    _assert_same_with_grads(inputs, got, want)
    assert seen == [] and flash and pa._FA4_LAYOUTS[("cpu", torch.float64, 6, 2, 32)] is False
    n = len(flash)
    inputs, got, want = _row(False, dim=16)
    assert len(flash) == n and seen[-1] == (2, 12, 12, False)  # head dim 16: FA4
    assert pa.varlen_kernel(torch.device("cuda", 0)) == "flash-attn-4"  # the device keeps it


def test_fa4_failing_its_trial_is_dropped_for_the_next_kernel_and_earlier_verdicts_are_retried(monkeypatch):
    """FA4 failing the device's trial: the trial runs again with the next kernel, which passes; the warning
    and the note name FA4's error; a True verdict of the same device reached with FA4 (the unshared key) is
    asked again, an agreed False is kept."""
    _fresh_kernel_state(monkeypatch, fa4=_fake_fa4([]))
    kernels = []

    def trial(device, dtype, shared):
        kernels.append(pa.varlen_kernel(device))
        if kernels[-1] == "flash-attn-4":
            return False, "largest relative error vs float32: flash-attn-4 5.0e-02, per-segment SDPA 1.0e-03"
        return True, f"largest relative error vs float32: {kernels[-1]} 1.0e-03, per-segment SDPA 1.0e-03"

    monkeypatch.setattr(pa, "_trial", trial)
    dev = torch.device("cuda", 0)
    pa._VARLEN_OK[(str(dev), torch.bfloat16, False)] = True  # reached before FA4 failed on shared rows
    pa._VARLEN_WHY[(str(dev), torch.bfloat16, False)] = "largest relative error vs float32: flash-attn-4 1e-3"
    pa._VARLEN_OK[(str(dev), torch.float16, False)] = False  # another rank's failure, agreed
    pa._VARLEN_WHY[(str(dev), torch.float16, False)] = "another rank's trial failed"
    with pytest.warns(UserWarning, match=r"before that flash-attn-4 failed it \(largest relative error"):
        assert pa.varlen_available(dev, torch.bfloat16, shared=True)
    assert kernels[:2] == ["flash-attn-4", pa.varlen_kernel(dev)] and kernels[1] != "flash-attn-4"
    assert "flash-attn-4 5.0e-02" in pa.varlen_notes()["cuda:0 torch.bfloat16 shared"]
    assert (str(dev), torch.bfloat16, False) not in pa._VARLEN_OK
    assert pa._VARLEN_OK[(str(dev), torch.float16, False)] is False
    assert pa.varlen_available(dev, torch.bfloat16) and kernels[-1] != "flash-attn-4"


def test_every_kernel_failing_ends_in_the_loop_with_a_warning(monkeypatch):
    """Each kernel failing in turn: three trials (FA4, aten flash, varlen_attn), the verdict False, the
    per-segment loop announced; the loop over kernels ends."""
    import torch.nn.attention.varlen as tv

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        raise AssertionError("the trial is a stand-in")

    monkeypatch.setattr(tv, "varlen_attn", varlen_attn)
    _fresh_kernel_state(monkeypatch, fa4=_fake_fa4([]))
    kernels = []

    def trial(device, dtype, shared):
        kernels.append(pa.varlen_kernel(device))
        return False, f"largest relative error vs float32: {kernels[-1]} 1.0e-01, per-segment SDPA 1.0e-03"

    monkeypatch.setattr(pa, "_trial", trial)
    with pytest.warns(UserWarning, match=r"unusable .*before that flash-attn-4 failed it.*runs per sequence"):
        assert not pa.varlen_available(torch.device("cuda", 0), torch.bfloat16)
    assert kernels == ["flash-attn-4", "aten flash (GQA unrepeated)", "torch varlen_attn"]


def test_fa4_is_only_for_hopper_and_blackwell_and_never_touches_cuda_for_a_cpu_tensor(monkeypatch):
    def no_cuda(*args):
        raise AssertionError("no CUDA call for a CPU device")

    pa._fa4_arch_ok.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    assert not pa._fa4_arch_ok(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, ok in ((8, False), (9, True), (10, True), (11, True), (12, False)):
        pa._fa4_arch_ok.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert pa._fa4_arch_ok(torch.device("cuda", 0)) is ok, major
    pa._fa4_arch_ok.cache_clear()


def test_fa4_absent_leaves_the_other_kernels(monkeypatch):
    """``flash_attn.cute`` not importable (simulated, so the test holds where FA4 is installed): FA4 is never
    chosen, and nothing needs it."""
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    monkeypatch.setattr(pa, "_fa4_arch_ok", lambda device: True)
    pa._fa4_varlen.cache_clear()
    try:
        assert pa._fa4_varlen() is None
        assert pa.varlen_kernel(torch.device("cuda", 0)) != "flash-attn-4"
    finally:
        pa._fa4_varlen.cache_clear()
