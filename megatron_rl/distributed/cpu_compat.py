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

What is *not* patched, by design: megatron-core's optimizers (they assert CUDA grads; the CPU path uses
torch AdamW) and the stock ``DotProductAttention`` (our ModuleSpec uses SDPA core attention instead).

Checked against megatron-core ``SUPPORTED_MCORE_VERSION``; ``apply()`` refuses other versions so an
upgrade fails loudly instead of silently mis-patching. ``tests/unit/test_cpu_compat.py`` holds one test
per patched behaviour.
"""

from __future__ import annotations

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
    _applied = True
    return True
