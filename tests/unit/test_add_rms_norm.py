"""``kernels.rmsnorm.add_rms_norm`` (Triton's interpreter on CPU) and ``models.spec.AddNormBDA``: the residual add
fused with the RMSNorm after it. The kernel against ``a + r`` and ``F.rms_norm`` with autograd (the sum's bits,
both outputs' gradients, either output unused); the model's logits and every gradient against megatron-core's
bias-dropout-add with the norms apart (``MEGATRON_RL_FUSED_ADD_NORM`` off), every site linked and fused; and a
kernel that fails its trial falls back with a warning."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is in the dev extras")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import spec_of, tiny_hf  # noqa: E402

from megatron_rl.distributed.runtime import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.kernels import compile as kc  # noqa: E402
from megatron_rl.kernels import rmsnorm as kernel  # noqa: E402
from megatron_rl.models import spec as spec_mod  # noqa: E402
from megatron_rl.models.builder import build_model  # noqa: E402
from megatron_rl.models.weights import load_hf_weights  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(kernel, "RUN_ON_CPU", True)
    monkeypatch.setattr(kc, "_PROBED", set())
    monkeypatch.setattr(kc, "_FAILED", {})


def _reference(a, r, w, ds, dn):
    leaves = [t.detach().double().requires_grad_(True) for t in (a, r, w)]
    s = leaves[0] + leaves[1]
    n = F.rms_norm(s, (s.shape[-1],), leaves[2], 1e-6)
    torch.autograd.backward(
        [t for t, g in ((s, ds), (n, dn)) if g is not None], [g.double() for g in (ds, dn) if g is not None]
    )
    return s, n, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("used", ["both", "sum", "norm"])
def test_the_fused_add_and_norm_equal_autograd_through_the_two_ops(dtype, tol, used):
    """Hidden 40 (block 64: 64 rows a program) over 70 rows (two programs, the second ragged); the sum's own
    gradient, the norm's, or both."""
    g = torch.Generator().manual_seed(0)
    a, r, ds, dn = ((2 * torch.randn(7, 10, 40, generator=g)).to(dtype) for _ in range(4))
    w = (0.5 + torch.rand(40, generator=g)).to(dtype)
    ds, dn = (ds if used != "norm" else None), (dn if used != "sum" else None)
    leaves = [t.clone().requires_grad_(True) for t in (a, r, w)]
    s, n = kernel.add_rms_norm(*leaves, 1e-6)
    assert torch.equal(s, a + r)  # the sum rounds as torch's add
    s_ref, n_ref, grads = _reference(a, r, w, ds, dn)
    torch.testing.assert_close(n.double(), n_ref, rtol=tol, atol=tol)
    # the norm of the rounded sum, within one rounding of its own dtype (not the norm of the unrounded sum)
    on_sum = F.rms_norm(s.detach().double(), (40,), w.double(), 1e-6)
    ulp = 2e-7 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(n.detach().double(), on_sum, rtol=ulp, atol=ulp)
    torch.autograd.backward(
        [t for t, x in ((s, ds), (n, dn)) if x is not None], [x for x in (ds, dn) if x is not None]
    )
    for got, want in zip((t.grad for t in leaves), grads):
        if want is None:
            assert got is None
            continue
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max())))
    assert torch.equal(leaves[0].grad, leaves[1].grad)  # d(a + r)/da = d(a + r)/dr


def test_without_autograd_the_kernel_runs_alone():
    a, r = torch.randn(5, 24), torch.randn(5, 24)
    w = torch.rand(24) + 0.5
    with torch.no_grad():
        s, n = kernel.add_rms_norm(a.requires_grad_(True), r, w, 1e-6)
    assert s.grad_fn is None and torch.equal(s, a.detach() + r)
    torch.testing.assert_close(n, F.rms_norm(a.detach() + r, (24,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_the_stash_goes_only_to_its_norm_only_once_and_only_with_the_graph_it_needs():
    x = torch.randn(3, 8)
    norm_a, norm_b = (spec_mod.RMSNorm(_cfg(torch.float32), 8) for _ in range(2))
    with torch.no_grad():
        kernel.stash_normed(x, norm_a, torch.zeros(3, 8))
        assert kernel.take_normed(x, norm_b) is None  # another norm: refused (and the stash dropped)
        assert kernel.take_normed(x, norm_a) is None
        kernel.stash_normed(x, norm_a, torch.zeros(3, 8))
        assert torch.equal(norm_a(x), torch.zeros(3, 8))  # the module returns the stashed output...
        torch.testing.assert_close(norm_a(x), F.rms_norm(x, (8,), norm_a.weight, norm_a.eps))  # ...once
    # with gradients on, the trainable weight needs a graph the stashed output (made without one) lacks
    kernel.stash_normed(x, norm_a, torch.zeros(3, 8))
    assert kernel.take_normed(x, norm_a) is None
    # an output of another autograd node than x's (as a sum re-wrapped by a checkpoint): refused
    a, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    s, n = kernel.add_rms_norm(a, r, norm_a.weight, norm_a.eps)
    assert kernel.take_normed(kernel.stash_normed(s, norm_a, n), norm_a) is n
    moved = s * 1.0
    assert kernel.take_normed(kernel.stash_normed(moved, norm_a, n), norm_a) is None


def _cfg(dtype):
    from types import SimpleNamespace

    return SimpleNamespace(params_dtype=dtype, sequence_parallel=False)


def test_a_fused_add_that_fails_its_trial_warns_and_the_two_ops_serve(monkeypatch):
    monkeypatch.setattr(kernel, "add_forward", lambda a, r, w, eps: (a + r, a + r, None))
    a, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    with pytest.warns(UserWarning, match="fused residual add.*failed"):
        assert not kernel.fusable(a, r, w)
    assert not kernel.fusable(a, r, w)  # remembered


def test_the_trial_passes_without_warnings():
    """The one-time trial measures its gaps on detached tensors: no "requires_grad ... to a scalar" warning in a
    run's log (the device's logs had one per process until session 41)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel._add_trial(torch.device("cpu"), torch.float32, 64)


def test_tensors_the_kernel_cannot_take_go_apart():
    a, w = torch.randn(4, 16), torch.ones(16)
    assert kernel.fusable(a, torch.randn(4, 16), w)
    assert not kernel.fusable(a, torch.randn(4, 16).double(), w)  # mixed dtypes
    assert not kernel.fusable(a, torch.randn(16, 4).t(), w)  # not contiguous
    assert not kernel.fusable(a, torch.randn(2, 16), w)  # shapes differ


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_distributed(1, 1, seed=0)
    hf = tiny_hf("qwen2")
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out, safe_serialization=True)
    yield out, spec_of(hf)
    destroy_distributed()


def _inputs(args):
    ids = torch.randint(0, args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(9)[None].expand(2, 9)


def _logits_and_grads(setup, fused: bool, monkeypatch, calls: list, recompute: dict | None = None):
    path, args = setup
    monkeypatch.setattr(kernel, "ADD_NORM_ON_CUDA", fused)
    monkeypatch.setattr(kernel, "RUN_ON_CPU", fused)  # off: neither the fused add nor the norm's backward
    real = kernel.add_forward
    monkeypatch.setattr(kernel, "add_forward", lambda *a: calls.append(a[0].shape) or real(*a))
    model = build_model(args, "actor", torch.float32, backend="local", recompute=recompute)
    load_hf_weights(model, path, args)
    logits = model(*_inputs(args), None)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, logits.detach(), grads


def _assert_same(got, want, got_grads, want_grads):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:  # fp32 sums in another order: gaps of a few ulps of the largest entry
        scale = float(want_grads[n].abs().max())
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=0, atol=3e-6 * scale, msg=n)


def test_the_model_with_fused_adds_gives_megatron_cores_logits_and_gradients(setup, monkeypatch):
    calls: list = []
    taken = []
    real_take = kernel.take_normed
    monkeypatch.setattr(kernel, "take_normed", lambda x, norm: taken.append(real_take(x, norm)) or taken[-1])
    model, got, got_grads = _logits_and_grads(setup, True, monkeypatch, calls)
    assert sum(t is not None for t in taken) == 2 * len(model.decoder.layers)  # every stash taken in training
    layers = model.decoder.layers
    assert spec_mod.link_add_norms(model) == 2 * len(
        layers
    )  # every layer's two sums, the last to the final norm
    trial = 1
    assert len(calls) == trial + 2 * len(layers)  # every site ran the kernel
    calls.clear()
    _, want, want_grads = _logits_and_grads(setup, False, monkeypatch, calls)
    assert not calls  # off: megatron-core's bias-dropout-add and the norms apart
    assert any("pre_mlp_layernorm" in n for n in got_grads)
    _assert_same(got, want, got_grads, want_grads)


@pytest.mark.parametrize("method,layers", [("uniform", 1), ("uniform", 2), ("block", 2)])
def test_full_recompute_with_fused_adds_gives_the_same_gradients(setup, monkeypatch, method, layers):
    """megatron-core runs the bias-dropout-add slot with gradients on, also inside a checkpointed chunk's first
    (no-grad) forward, and a sum leaving the chunk is re-wrapped by the checkpoint: the norm after it must not
    take an output stashed inside (its graph would skip the chunk; session 32's review found it did)."""
    rc = dict(
        recompute_granularity="full",
        recompute_method=method,
        recompute_num_layers=layers,
        recompute_modules=[],
    )
    calls: list = []
    _, got, got_grads = _logits_and_grads(setup, True, monkeypatch, calls, rc)
    assert calls  # the fused kernel ran
    _, want, want_grads = _logits_and_grads(setup, False, monkeypatch, [], rc)
    _assert_same(got, want, got_grads, want_grads)


def test_no_grad_and_inference_mode_forwards_keep_no_graph(setup, monkeypatch):
    """A no-grad pass (old log-probs, the critic's values) builds no autograd node for the fused pair although
    megatron-core runs the slot with gradients on and the norm weights are trainable; inference mode runs too,
    its first trial included."""
    path, args = setup
    model = build_model(args, "actor", torch.float32, backend="local")
    load_hf_weights(model, path, args)
    applied = []
    real = kernel._AddRMSNorm.apply
    monkeypatch.setattr(kernel._AddRMSNorm, "apply", lambda *a: applied.append(1) or real(*a))
    with torch.inference_mode():
        first = model(*_inputs(args), None)
    with torch.no_grad():
        second = model(*_inputs(args), None)
    assert len(applied) == 1 and not kc._FAILED and kc._PROBED  # the trial's call only
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_live_dropout_or_a_hooked_norm_takes_megatron_cores_add(setup, monkeypatch):
    path, args = setup
    model = build_model(args, "actor", torch.float32, backend="local")
    calls: list = []
    real = kernel.add_forward
    monkeypatch.setattr(kernel, "add_forward", lambda *a: calls.append(1) or real(*a))
    ids, pos = _inputs(args)
    layer, sites = model.decoder.layers[0], 2 * len(model.decoder.layers)
    layer.hidden_dropout = 0.1  # live dropout in training: both of layer 0's sites run megatron-core's add
    model.train()
    model(ids, pos, None)
    assert len(calls) - 1 == sites - 2  # the trial's call, then the other layers' sites
    layer.hidden_dropout = 0.0
    calls.clear()
    handle = layer.pre_mlp_layernorm.register_forward_pre_hook(lambda m, a: None)
    model(ids, pos, None)
    assert len(calls) == sites - 1  # all but the hooked norm's site
    handle.remove()


def test_a_norm_that_recomputes_is_not_linked(setup, monkeypatch):
    path, args = setup
    model = build_model(args, "actor", torch.float32, backend="local")
    first, second = model.decoder.layers[0], model.decoder.layers[1]
    for layer in model.decoder.layers:
        layer.self_attn_bda.norm = layer.mlp_bda.norm = None
    second.recompute_input_layernorm = True
    first.recompute_pre_mlp_layernorm = True
    assert spec_mod.link_add_norms(model) == 2 * len(model.decoder.layers) - 2
    assert first.self_attn_bda.norm is None and first.mlp_bda.norm is None
