"""Optimizers of the trained models: one interface (``base.Optimizer``), two backends.

``local`` (``local.LocalOptimizer``): torch AdamW on fp32 main params, any device. ``megatron``
(``megatron.MegatronOptimizer``): megatron-core's DDP + optimizer (optionally distributed, optionally the
hybrid CPU/GPU optimizer). Both own their LR schedule (``schedule``) and accumulate gradients in fp32.
"""

from __future__ import annotations

import torch

from megatron_rl.config.schema import OptimConfig
from megatron_rl.optim.base import Optimizer, OptimizerKind, OptimizerKindError
from megatron_rl.optim.local import LocalOptimizer
from megatron_rl.optim.megatron import MegatronOptimizer
from megatron_rl.optim.schedule import lr_lambda

BACKENDS: dict[str, type[Optimizer]] = {"local": LocalOptimizer, "megatron": MegatronOptimizer}


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int) -> Optimizer:
    """The ``cfg.backend`` optimizer of ``model``. Its LR schedule spans ``total_steps`` training steps and
    advances by ``Optimizer.step_lr`` (once per update), not by the optimizer steps of an update."""
    if cfg.backend not in BACKENDS:
        raise ValueError(f"optim.backend={cfg.backend!r}; use one of: {' | '.join(BACKENDS)}")
    return BACKENDS[cfg.backend](model, cfg, total_steps)


__all__ = [
    "BACKENDS",
    "LocalOptimizer",
    "MegatronOptimizer",
    "Optimizer",
    "OptimizerKind",
    "OptimizerKindError",
    "build_optimizer",
    "lr_lambda",
]
