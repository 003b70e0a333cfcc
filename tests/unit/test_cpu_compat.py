"""One test per behaviour patched by megatron_rl.distributed.cpu_compat (fails loudly on an mcore upgrade)."""

import megatron.core
import pytest
import torch

from megatron_rl.distributed import cpu_compat

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the compat layer only applies without CUDA"
)


@pytest.fixture(scope="module", autouse=True)
def _patched():
    assert cpu_compat.apply()


def test_pinned_version_matches_installed():
    assert megatron.core.__version__ == cpu_compat.SUPPORTED_MCORE_VERSION


def test_version_mismatch_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_applied", False)
    monkeypatch.setattr(megatron.core, "__version__", "9.9.9")
    with pytest.raises(RuntimeError, match="checked against megatron-core 0.16.1, but 9.9.9"):
        cpu_compat.apply()


def test_current_device_is_cpu():
    assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
    torch.cuda.synchronize()  # a no-op, not an error


def test_rng_tracker_forks_the_cpu_generator():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    assert not parallel_state.model_parallel_is_initialized()
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("stream", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("stream"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(3)), "the forked stream draws from its own seed"
    tracker.reset()
    del model_parallel_cuda_manual_seed


def test_schedules_literal_cuda_tensors_land_on_cpu():
    from megatron.core.pipeline_parallel import schedules

    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu"
    assert schedules.torch.float32 is torch.float32


def test_tied_embedding_setup_runs_without_tensor_cuda():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    assert hasattr(LanguageModule.setup_embeddings_and_output_layer, "__wrapped__")
    original = torch.Tensor.cuda
    seen = cpu_compat._without_tensor_cuda(lambda: torch.ones(2).cuda().device)()
    assert seen.type == "cpu"
    assert torch.Tensor.cuda is original, "Tensor.cuda must be restored after the wrapped call"


def test_optimizer_modules_literal_cuda_tensors_land_on_cpu():
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for module in (mcore_optimizer, clip_grads, distrib_optimizer, mcore_utils):
        assert module.torch.tensor([1.0], device="cuda").device.type == "cpu", module.__name__
    norm, _ = mcore_utils.local_multi_tensor_l2_norm(1, None, [[torch.ones(4), torch.ones(5)]], False)
    assert norm.device.type == "cpu" and torch.allclose(norm, torch.tensor([3.0]))


def test_optimizer_type_checks_see_cuda_type_names():
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    bf16, fp32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    names = cpu_compat._cuda_type_names(lambda: (bf16.type(), fp32.type(), fp32.type(torch.float64).dtype))()
    assert names == ("torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor", torch.float64)
    assert "type" not in torch.Tensor.__dict__ and fp32.type() == "torch.FloatTensor", "Tensor.type restored"
    for fn in (
        mcore_optimizer.Float16OptimizerWithFloat16Params.__init__,
        distrib_optimizer.DistributedOptimizer.__init__,
        clip_grads.clip_grad_by_total_norm_fp32,
        mcore_optimizer.clip_grad_by_total_norm_fp32,
    ):
        assert hasattr(fn, "__wrapped__"), fn


def test_clip_grad_by_total_norm_scales_cpu_grads():
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)


def test_distributed_optimizer_dp_zero_gather_runs_without_tensor_cuda():
    from megatron.core.optimizer import distrib_optimizer

    assert hasattr(distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero, "__wrapped__")


def test_hybrid_optimizer_streams_are_no_ops_and_pinned_buffers_plain():
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    shim = hybrid_optimizer.torch
    stream = shim.cuda.Stream()
    stream.wait_stream(shim.cuda.current_stream())
    with shim.cuda.stream(stream):
        buf = shim.empty((3,), dtype=torch.float32, pin_memory=True, device="cpu")
    stream.record_event().synchronize()
    assert buf.device.type == "cpu" and buf.shape == (3,)


def test_hybrid_optimizer_splits_params_by_host_copies():
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    split = HybridDeviceOptimizer._get_sub_optimizer_param_groups
    assert hasattr(split, "__wrapped__")
    params = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)) for _ in range(4)]
    before = dict(torch.Tensor.__dict__)
    opt = HybridDeviceOptimizer(params, offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW,
                                gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True, lr=0.1)  # fmt: skip
    on_host = [p for o in opt.cpu_optimizers for g in o.param_groups for p in g["params"]]
    on_device = [p for g in opt.gpu_optimizer.param_groups for p in g["params"]]
    assert len(on_host) == len(on_device) == 2, "half the params on each side"
    assert all(p.dtype == torch.float32 for p in on_host + on_device), "fp32 copies of bf16 params"
    assert not set(map(id, on_host)) & set(map(id, params)), "the host part holds copies"
    assert dict(torch.Tensor.__dict__) == before, "Tensor methods restored after the split"
    assert not torch.ones(1).is_cuda
    for p in params:
        p.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    opt.step()
    assert all(torch.all(p < 1) for p in params), "both parts stepped and copied back"
