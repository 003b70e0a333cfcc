"""The start-up trial that decides whether packed (and shared-prompt) attention may use torch's varlen_attn
on a GPU. On CPU varlen_attn does not run, so a stand-in takes its place: the same per-segment attention
(right) or one with a 5% error (wrong). The trial must accept the first in any grad context (its first
call can come from a no-grad log-prob pass: it once failed there on every call), refuse the second, and
say why with the errors it measured."""

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
    assert "varlen_attn" in why and "per-segment SDPA" in why


@pytest.mark.parametrize("shared", [False, True])
def test_the_trial_refuses_a_wrong_kernel_and_says_by_how_much(monkeypatch, shared):
    monkeypatch.setattr(pa, "varlen_attention", _stand_in(0.05))
    ok, why = pa._trial(torch.device("cpu"), torch.bfloat16, shared)
    assert not ok
    err = float(why.split("varlen_attn ")[1].split(",")[0])
    assert err >= 0.04, why  # the 5% it was given, measured against float32


def test_notes_say_why_varlen_is_off_on_cpu():
    assert not pa.varlen_available(torch.device("cpu"), torch.float32)
    assert pa.varlen_notes()["cpu torch.float32"] == "not a CUDA fp16/bf16 tensor"
