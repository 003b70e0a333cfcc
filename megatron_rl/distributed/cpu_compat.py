"""Make megatron-core's CUDA-assuming calls work on CPU with gloo.

megatron-core assumes a GPU in a handful of places that the CPU path (tests, CI, the embedded default
task) runs through. This module patches exactly those, and only when CUDA is absent:

1. ``torch.cuda.current_device()`` answers the CPU device: layers, rotary embeddings and the pipeline
   p2p code allocate buffers with ``device=torch.cuda.current_device()``.
2. The model-parallel RNG tracker (``tensor_parallel.random``) keeps per-TP-rank generator states and
   swaps them in and out of the CUDA generator. On CPU the ops it wraps (weight init, dropout) draw from
   the CPU default generator, so the tracker swaps that one instead.
3. ``torch.cuda.synchronize`` becomes a no-op.
4. The pipeline schedules create a few tensors with a literal ``device="cuda"``; in their module those
   land on the CPU.
5. ``LanguageModule.setup_embeddings_and_output_layer`` moves the last stage's copy of a tied embedding
   with ``weight.data.cuda()`` before all-reducing it over the embedding group (tied embeddings at PP>1);
   while that method runs, ``Tensor.cuda`` returns the tensor itself.
6. megatron-core's optimizer modules (``optimizer.optimizer``, ``optimizer.clip_grads``,
   ``optimizer.distrib_optimizer``) and ``megatron.core.utils`` (its apex-less ``multi_tensor_l2norm``
   fallback) create small tensors with a literal ``device='cuda'`` (the unit loss scale, overflow buffers,
   the grad norm); in those modules they land on the CPU, as in 4.
7. ``Float16OptimizerWithFloat16Params.__init__``, ``DistributedOptimizer.__init__`` and
   ``clip_grad_by_total_norm_fp32`` sort parameters (or assert on grads) by ``tensor.type()`` strings
   such as ``'torch.cuda.BFloat16Tensor'``; while they run, ``Tensor.type()`` (no arguments) names a CPU
   tensor by its CUDA type. With 6 and 7, megatron-core's ``DistributedDataParallel`` +
   ``get_megatron_optimizer`` (torch AdamW fallback, with and without the distributed optimizer, fp32 or
   bf16) run on CPU/gloo: ``optim.backend=megatron`` is tested on CPU against ``optim.backend=local``.
8. ``DistributedOptimizer.get_parameter_state_dp_zero`` (behind the ``fully_reshardable`` checkpoint
   format) moves its shards with ``Tensor.cuda()`` for the all-gather; while it runs, as in 5,
   ``Tensor.cuda`` returns the tensor itself.

9. megatron-core's hybrid-device optimizer (``optimizer.cpu_offloading.hybrid_optimizer``,
   ``optim.optimizer_cpu_offload``) orders its copies with CUDA streams and events and allocates pinned
   grad buffers; in that module the streams and events are no-ops and ``pin_memory`` is dropped (CPU
   memory is the host). It decides which params to offload by ``param.is_cuda`` and offloads with
   ``.cpu().pin_memory()``; while ``_get_sub_optimizer_param_groups`` runs, ``Tensor.is_cuda`` answers
   False for those pinned copies (and tensors derived from them by detach/clone/float/cpu) and True for
   every other tensor, so the CPU part and the "device" part are split as on a GPU, and the same
   arithmetic runs on both sides.

What is *not* patched, by design: the stock ``DotProductAttention`` (our ModuleSpec uses SDPA core
attention instead), fp16 loss scaling (``grad_scaler``; the trainer has no fp16 mode), overlapped grad
reduce / param gather (CUDA streams).

Checked against megatron-core ``SUPPORTED_MCORE_VERSION``; ``apply()`` refuses other versions so an
upgrade fails loudly instead of silently mis-patching. ``tests/unit/test_cpu_compat.py`` holds one test
per patched behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

SUPPORTED_MCORE_VERSION = "0.16.1"
_applied = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _cuda_to_cpu(device):
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _TorchWithCudaOnCpu(types.ModuleType):
    """Stand-in for the ``torch`` module inside one megatron-core module: tensor factories that are
    given ``device="cuda"`` allocate on the CPU; everything else is plain torch."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_cuda_to_cpu(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_cuda_to_cpu(device), **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_cuda_to_cpu(device), **kwargs)


def _without_tensor_cuda(fn):
    """Run ``fn`` with ``Tensor.cuda`` as the identity (restored afterwards)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return wrapper


def _cuda_type_names(fn):
    """Run ``fn`` with ``Tensor.type()`` (no arguments) answering ``'torch.cuda.<T>'`` for CPU tensors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.type
        shadowed = "type" in torch.Tensor.__dict__

        def type_(self, *a, **k):
            name = original(self, *a, **k)
            if a or k or self.is_cuda:
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = type_
        try:
            return fn(*args, **kwargs)
        finally:
            if shadowed:
                torch.Tensor.type = original
            else:
                del torch.Tensor.type

    return wrapper


class _NoStream:
    """A CUDA stream / event stand-in: ordering is trivial on one CPU thread."""

    def wait_stream(self, *_a) -> None:
        pass

    def record_event(self, *_a):
        return self

    def wait(self, *_a) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuStreams:
    """``torch.cuda`` as the hybrid optimizer uses it: streams and ``torch.cuda.stream(s)``."""

    Stream = _NoStream

    @staticmethod
    def current_stream(*_a):
        return _NoStream()

    @staticmethod
    def stream(*_a):
        return contextlib.nullcontext()


class _TorchForHybridOnCpu(_TorchWithCudaOnCpu):
    """Item 9: ``torch`` inside the hybrid optimizer's module."""

    cuda = _CpuStreams()

    @staticmethod
    def empty(*args, device=None, pin_memory=False, **kwargs):
        return torch.empty(*args, device=_cuda_to_cpu(device), **kwargs)


_HOST = "_cpu_compat_host_copy"
_DERIVING = ("detach", "clone", "float", "cpu")


def _host_copies_not_cuda(fn):
    """Run ``fn`` with ``Tensor.is_cuda`` False only for ``pin_memory()`` copies and what derives from them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        names = (*_DERIVING, "pin_memory", "is_cuda")
        originals = {name: getattr(torch.Tensor, name) for name in names}
        shadowed = {name: torch.Tensor.__dict__[name] for name in names if name in torch.Tensor.__dict__}

        def deriving(name):
            def method(self, *a, **k):
                out = originals[name](self, *a, **k)
                if getattr(self, _HOST, False):
                    setattr(out, _HOST, True)
                return out

            return method

        def pin(self, *a, **k):
            out = self.clone() if getattr(self, _HOST, False) else self
            setattr(out, _HOST, True)
            return out

        for name in _DERIVING:
            setattr(torch.Tensor, name, deriving(name))
        torch.Tensor.pin_memory = pin
        torch.Tensor.is_cuda = property(lambda self: not getattr(self, _HOST, False))
        try:
            return fn(*args, **kwargs)
        finally:
            for name in names:
                if name in shadowed:
                    setattr(torch.Tensor, name, shadowed[name])
                else:
                    delattr(torch.Tensor, name)

    return wrapper


def _patch_hybrid_optimizer() -> None:
    """Item 9 of the module docstring."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    hybrid_optimizer.torch = _TorchForHybridOnCpu()
    hdo = hybrid_optimizer.HybridDeviceOptimizer
    hdo._get_sub_optimizer_param_groups = _host_copies_not_cuda(hdo._get_sub_optimizer_param_groups)


def _patch_optimizers() -> None:
    """Items 6 to 8 of the module docstring."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for module in (mcore_optimizer, clip_grads, distrib_optimizer, mcore_utils):
        module.torch = _TorchWithCudaOnCpu()
    fp16 = mcore_optimizer.Float16OptimizerWithFloat16Params
    fp16.__init__ = _cuda_type_names(fp16.__init__)
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt.__init__ = _cuda_type_names(dist_opt.__init__)
    dist_opt.get_parameter_state_dp_zero = _without_tensor_cuda(dist_opt.get_parameter_state_dp_zero)
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip  # imported by name there (ChainedOptimizer.step)


def needed() -> bool:
    """True when no usable CUDA device is present (the only case in which we patch)."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch megatron-core for CPU/gloo if CUDA is absent. Idempotent; returns whether it patched."""
    global _applied
    if _applied or not needed():
        return _applied
    import megatron.core
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    version = megatron.core.__version__
    if version != SUPPORTED_MCORE_VERSION:
        raise RuntimeError(
            f"megatron_rl's CPU compatibility layer was checked against megatron-core "
            f"{SUPPORTED_MCORE_VERSION}, but {version} is installed. Install megatron-core=="
            f"{SUPPORTED_MCORE_VERSION} for CPU runs, or re-check megatron_rl/distributed/cpu_compat.py."
        )
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    schedules.torch = _TorchWithCudaOnCpu()
    LanguageModule.setup_embeddings_and_output_layer = _without_tensor_cuda(
        LanguageModule.setup_embeddings_and_output_layer
    )
    _patch_optimizers()
    _patch_hybrid_optimizer()
    _applied = True
    return True
