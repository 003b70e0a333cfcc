"""``optim.gradient_accumulation_fusion`` (``kernels.wgrad_fusion``) in one process on CPU: megatron-core's
fused weight-gradient path with our stand-in for apex's kernel, under both optimizer backends and the exact
layers. Every linear weight's gradient goes through the fused GEMM (counted), the tied embedding gets its
LM-head part fused and its lookup part through the hook (neither lost nor doubled), the sums equal the
unfused ones up to the bf16 rounding the fusion removes, and ``main_grad`` is allocated only for passes
with gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import spec_of, tiny_hf  # noqa: E402

from megatron_rl.config.schema import JobConfig, OptimConfig  # noqa: E402
from megatron_rl.config.validate import ConfigError, validate_job  # noqa: E402
from megatron_rl.distributed.grads import grad_of  # noqa: E402
from megatron_rl.distributed.runtime import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.kernels import wgrad_fusion  # noqa: E402
from megatron_rl.models.builder import build_model  # noqa: E402
from megatron_rl.models.weights import load_hf_weights  # noqa: E402
from megatron_rl.optim import build_optimizer  # noqa: E402
from tests.reference_forward import forward_logits  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_distributed(1, 1, seed=0)
    hf = tiny_hf("qwen2")  # qkv bias, tied embeddings
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out, safe_serialization=True)
    yield out, spec_of(hf)
    destroy_distributed()


def _micro_batches(vocab: int, n: int = 3):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (2, 12), generator=g) for _ in range(n)]


def _accumulate(setup, backend: str, fusion, exact: bool = False, dtype=torch.bfloat16):
    """main grads (fp32 copies, by name) after three micro-batches' backward, and the fused GEMM calls."""
    path, args = setup
    model = build_model(args, "actor", dtype, backend="local", exact=exact)
    load_hf_weights(model, path, args)
    model = model.to(dtype)
    opt = build_optimizer(model, OptimConfig(backend=backend, gradient_accumulation_fusion=fusion), 1)
    calls = []
    original = wgrad_fusion.wgrad_gemm_accum_fp32

    def spy(total_input, grad_output, main_grad):
        calls.append(tuple(main_grad.shape))
        return original(total_input, grad_output, main_grad)

    wgrad_fusion.wgrad_gemm_accum_fp32 = spy
    try:
        for ids in _micro_batches(args.vocab_size):
            logits = forward_logits(model, ids[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
    finally:
        wgrad_fusion.wgrad_gemm_accum_fp32 = original
    grads = {n: grad_of(p).float().clone() for n, p in model.named_parameters()}
    return grads, calls, model, opt


@pytest.mark.parametrize("backend", ["local", "megatron"])
@pytest.mark.parametrize("exact", [False, True])
def test_fused_weight_gradients_equal_the_unfused_sums(setup, backend, exact):
    fused, calls, model, _ = _accumulate(setup, backend, True, exact)
    plain, no_calls, _, _ = _accumulate(setup, backend, False, exact)
    layers = wgrad_fusion.fusable(model)
    n_layers = model.config.num_layers
    assert len(layers) == 4 * n_layers + 1  # qkv, proj, fc1, fc2 per layer, and the tied LM head
    assert len(calls) == 3 * len(layers) and not no_calls  # every fused weight, every micro-batch
    assert fused.keys() == plain.keys()
    changed = 0
    for name in plain:
        f, p = fused[name], plain[name]
        rel = float((f - p).norm() / p.norm())
        # bf16 weight gradients summed unrounded: within a few bf16 ulps of the unfused sum, never a
        # missing or doubled micro-batch (rel ~0.3-1) or an uninitialized dummy added (huge or NaN)
        assert rel < 2e-2, (name, rel)
        changed += not torch.equal(f, p)
    assert changed >= 4 * n_layers  # the linears' sums differ by the roundings that fusion removed


def test_tied_embedding_gets_both_its_parts(setup):
    """The tied embedding's LM-head gradient is fused, its lookup gradient comes through the hook: rows of
    looked-up tokens (both parts) and rows of the others (the LM head's only) each equal the unfused sums."""
    fused, _, _, _ = _accumulate(setup, "local", True)
    plain, _, _, _ = _accumulate(setup, "local", False)
    name = next(n for n in plain if "word_embeddings" in n)
    looked_up = torch.zeros(plain[name].shape[0], dtype=torch.bool)
    looked_up[torch.cat([b[:, :-1].flatten() for b in _micro_batches(setup[1].vocab_size)])] = True
    for rows in (looked_up, ~looked_up):
        f, p = fused[name][rows], plain[name][rows]
        assert p.norm() > 0 and (f - p).norm() < 2e-2 * p.norm()


def test_main_grad_only_for_passes_with_gradients_and_freed_by_the_step(setup):
    _, _, model, opt = _accumulate(setup, "local", True)
    weights = [w for _, w in wgrad_fusion.fusable(model)]
    assert all(w.main_grad is not None for w in weights)
    opt.step()
    assert all(w.main_grad is None for w in weights)  # between updates no gradient memory is held
    ids = _micro_batches(setup[1].vocab_size, 1)[0]
    with torch.no_grad():
        forward_logits(model, ids)
    assert all(w.main_grad is None for w in weights)
    forward_logits(model, ids).float().sum().backward()
    assert all(w.main_grad is not None and w.main_grad.abs().sum() > 0 for w in weights)


def test_auto_and_false_keep_the_unfused_path_on_cpu(setup):
    for setting in ("auto", False):
        _, calls, model, opt = _accumulate(setup, "local", setting)
        assert not calls and not opt.fused
        assert not any(m.gradient_accumulation_fusion for m, _ in wgrad_fusion.fusable(model))


def test_fp32_models_have_nothing_to_fuse(setup):
    _, calls, _, opt = _accumulate(setup, "local", True, dtype=torch.float32)
    assert not calls and not opt.fused


def test_cpu_kernel_is_the_fp32_product_and_megatron_core_finds_it():
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(9, 5, generator=g).bfloat16(), torch.randn(9, 3, generator=g).bfloat16()
    main = torch.randn(3, 5, generator=g)
    want = main + dy.float().t() @ x.float()
    wgrad_fusion.wgrad_gemm_accum_fp32(x, dy, main)
    assert torch.allclose(main, want, rtol=0, atol=1e-5)
    wgrad_fusion.install()
    from megatron.core.tensor_parallel import layers

    assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is not None


def test_bad_setting_is_refused_by_validation():
    cfg = JobConfig()
    cfg.actor.optim.gradient_accumulation_fusion = "yes"
    with pytest.raises(
        ConfigError, match=r"actor\.optim\.gradient_accumulation_fusion='yes': use true, false or auto"
    ):
        validate_job(cfg, world_size=1)
