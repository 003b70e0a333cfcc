"""The learning-rate schedule both optimizer backends use: linear warmup, then constant, linear or cosine."""

from __future__ import annotations

import math

import torch

from megatron_rl.config.schema import OptimConfig


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at training step ``step`` (0-based count of this model's updates): linear
    warmup over ``cfg.lr_warmup_steps``, then constant/linear/cosine down to ``cfg.min_lr_ratio`` at
    ``total_steps``. Every optimizer step of one training step uses that step's LR."""

    def fn(step: int) -> float:
        if cfg.lr_warmup_steps > 0 and step < cfg.lr_warmup_steps:
            return (step + 1) / cfg.lr_warmup_steps
        if cfg.lr_decay_style == "constant":
            return 1.0
        span = max(1, total_steps - cfg.lr_warmup_steps)
        frac = min(1.0, (step - cfg.lr_warmup_steps) / span)
        decay = 1.0 - frac if cfg.lr_decay_style == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return fn


def build_scheduler(inner: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """torch ``LambdaLR`` over the param groups of the optimizer that applies the update."""
    return torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(cfg, total_steps))
