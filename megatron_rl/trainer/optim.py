"""Optimizer step for a TP/PP-sharded model on any device: DP grad reduction, tied-embedding sync,
a layout-aware global grad norm for clipping, AdamW and the LR schedule.

This is ``optim.backend=local`` (the default): torch AdamW (fused on GPU) on any device. The losses are
normalised by global token/sequence counts, so DP gradients are *summed*, not averaged.
``optim.backend=megatron`` (megatron-core DDP + optimizer) lives in ``mcore_optim``; ``build_optimizer``
and ``optimizer_step`` dispatch on it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_rl.config.schema import OptimConfig
from megatron_rl.models import unwrap


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at optimizer step ``s``: linear warmup, then constant/linear/cosine."""

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


class MainParamsAdamW:
    """AdamW on fp32 main copies of low-precision (bf16) model parameters, as megatron-core's mixed-precision
    optimizer does: updates of lr ~1e-6 would vanish if applied to bf16 weights directly. With fp32
    parameters it is plain AdamW on the parameters themselves."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimConfig):
        self.model_params = params
        self.main = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in params]
        fused = bool(params) and params[0].is_cuda
        self.opt = torch.optim.AdamW(
            self.main,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=fused,
        )
        self.param_groups = self.opt.param_groups

    def step(self) -> None:
        for p, m in zip(self.model_params, self.main):
            if m is not p:
                m.grad = p.grad.float()
        self.opt.step()
        pairs = [(p, m) for p, m in zip(self.model_params, self.main) if m is not p]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in zip(self.model_params, self.main):
            p.grad = None
            if m is not p:
                m.grad = None

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "main": [m.detach() for m in self.main]}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])
        with torch.no_grad():
            for p, m, saved in zip(self.model_params, self.main, state["main"]):
                m.copy_(saved)
                if m is not p:
                    p.copy_(m)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
    """(optimizer, LR scheduler) for ``cfg.backend``: ``MainParamsAdamW`` (local) or
    ``mcore_optim.MegatronCoreOptimizer`` (megatron-core DDP + optimizer); ``optimizer_step`` takes either."""
    if cfg.backend == "megatron":
        from megatron_rl.trainer.mcore_optim import build_mcore_optimizer

        return build_mcore_optimizer(model, cfg, total_steps)
    if cfg.backend != "local":
        raise ValueError(f"optim.backend={cfg.backend!r}; use local or megatron")
    opt = MainParamsAdamW([p for p in model.parameters() if p.requires_grad], cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.opt, lr_lambda(cfg, total_steps))
    return opt, sched


def _by_dtype(tensors) -> dict[torch.dtype, list[torch.Tensor]]:
    """Tensors grouped by dtype (multi-tensor ops and flattened buffers need one dtype)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def _shared_embedding(model: torch.nn.Module) -> torch.nn.Parameter | None:
    core = unwrap(model)
    if ps.get_pipeline_model_parallel_world_size() == 1 or not core.share_embeddings_and_output_weights:
        return None
    if core.pre_process or core.post_process:
        return core.shared_embedding_or_output_weight()
    return None


def _tp_partial(name: str, p: torch.nn.Parameter) -> bool:
    """TP-replicated weights whose gradient each TP rank sees only part of: norms under sequence
    parallelism (each rank holds part of the sequence) and q/k norms (each rank holds some heads).
    megatron-core's finalize_model_grads sums the same set over TP."""
    return getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name


def reduce_gradients(model: torch.nn.Module) -> None:
    """Sum grads over DP; sum partial grads of replicated weights over TP; sum the tied embedding's grad
    between the first and last PP stage."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for grads in _by_dtype(p.grad for _, p in named).values():
        _all_reduce_coalesced(grads, ps.get_data_parallel_group())
    _all_reduce_coalesced(
        [p.grad for n, p in named if _tp_partial(n, p)], ps.get_tensor_model_parallel_group()
    )
    shared = _shared_embedding(model)
    if shared is not None:
        dist.all_reduce(shared.grad, group=ps.get_embedding_group())


def _counts_once(p: torch.nn.Parameter, model: torch.nn.Module, shared) -> bool:
    """Whether this rank counts ``p`` in the global norm (TP-replicated params only on TP rank 0; the tied
    embedding only on the first stage)."""
    if shared is not None and p is shared and not unwrap(model).pre_process:
        return False
    sharded = getattr(p, "tensor_model_parallel", False)
    return sharded or ps.get_tensor_model_parallel_rank() == 0


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the full (unsharded) gradient over TP x PP; scale grads if above ``max_norm``."""
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    shared = _shared_embedding(model)
    dev = params[0].grad.device if params else torch.device("cpu")
    counted = _by_dtype(p.grad.detach() for p in params if _counts_once(p, model, shared))
    # per-tensor norms in one multi-tensor kernel per dtype (fp32 at least), their squares summed in fp64
    norms = [
        torch.stack(torch._foreach_norm(grads, 2, dtype=torch.promote_types(dtype, torch.float32))).double()
        for dtype, grads in counted.items()
    ]
    sq = torch.cat(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64, device=dev)
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for dtype, grads in _by_dtype(p.grad for p in params).items():
            torch._foreach_mul_(grads, coef.to(dtype))
    return norm.float()


def optimizer_step(model, opt, sched, clip_grad: float) -> dict[str, torch.Tensor]:
    """Reduce, clip and apply the accumulated gradients; returns grad_norm and the LR used."""
    if getattr(opt, "backend", "local") == "megatron":
        return opt.step(sched, clip_grad)
    reduce_gradients(model)
    grad_norm = clip_grad_norm(model, clip_grad)
    lr = opt.param_groups[0]["lr"]
    if torch.isfinite(grad_norm):
        opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": torch.tensor(lr)}
