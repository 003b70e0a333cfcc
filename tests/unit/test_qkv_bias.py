"""``models.spec.QKVLinear``: the local linear_qkv adds Qwen2's query-key-value bias with ``kernels.bias``'s
compiled kernel (compiled on CPU here, ``MEGATRON_RL_COMPILE=1``): the model's logits and every gradient
equal those of megatron-core's own add (``MEGATRON_RL_COMPILED_BIAS`` off), the kernel ran in every layer,
and a kernel that fails its trial falls back to the eager add with a warning."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import spec_of, tiny_hf  # noqa: E402

from megatron_rl.distributed.runtime import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.kernels import bias as bias_kernel  # noqa: E402
from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.models.builder import build_model  # noqa: E402
from megatron_rl.models.spec import QKVLinear  # noqa: E402
from megatron_rl.models.weights import load_hf_weights  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_distributed(1, 1, seed=0)
    hf = tiny_hf("qwen2")  # qkv bias
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out, safe_serialization=True)
    yield out, spec_of(hf)
    destroy_distributed()


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_COMPILE", "1")
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})


def _logits_and_grads(setup, compiled: bool, monkeypatch):
    path, args = setup
    monkeypatch.setattr(bias_kernel, "ON", compiled)
    model = build_model(args, "actor", torch.float32, backend="local")
    load_hf_weights(model, path, args)
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)[None].expand(2, 9)
    logits = model(ids, pos, None)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return (
        model,
        logits.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def test_the_compiled_bias_add_gives_megatron_cores_logits_and_gradients(setup, monkeypatch):
    calls = []
    real = bias_kernel._COMPILED
    monkeypatch.setattr(bias_kernel, "_COMPILED", lambda x, b: calls.append(x.shape) or real(x, b))
    model, got, got_grads = _logits_and_grads(setup, True, monkeypatch)
    qkv = [m for m in model.modules() if isinstance(m, QKVLinear)]
    assert qkv and all(m.bias is not None for m in qkv)
    assert len(calls) == len(qkv) + 1  # the trial's call and one per layer
    _, want, want_grads = _logits_and_grads(setup, False, monkeypatch)
    assert len(calls) == len(qkv) + 1  # off: megatron-core's add
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and any("linear_qkv.bias" in n for n in got_grads)
    for n in got_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_bias_add_that_fails_its_trial_warns_and_the_eager_add_serves(monkeypatch):
    def broken(x, b):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(bias_kernel, "_COMPILED", broken)
    x, b = torch.randn(4, 3, 8), torch.randn(8, requires_grad=True)
    with pytest.warns(UserWarning, match="bias add.*failed.*no compiler here"):
        out = bias_kernel.add_bias(x, b)
    torch.testing.assert_close(out, x + b)
    out.sum().backward()
    torch.testing.assert_close(b.grad, torch.full((8,), 12.0))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_first_call_inside_a_no_grad_pass_still_passes_the_trial(mode):
    """The first bias add of an off-policy run comes in the old-log-prob pass (no grad); its trial takes
    gradients, so it runs with them on (it failed there and left the eager add for the whole run)."""
    x, b = torch.randn(5, 3, 8), torch.randn(8, requires_grad=True)
    with getattr(torch, mode)():
        out = bias_kernel.add_bias(x, b)
    torch.testing.assert_close(out, x + b.detach())
    assert not kc._FAILED and kc._PROBED
