"""``optim.backend=megatron``: the update through megatron-core's DistributedDataParallel and optimizer.

- The model chunk is wrapped in megatron-core ``DistributedDataParallel`` (contiguous fp32 grad buffers,
  ``grad_reduce_in_fp32``; no overlap of grad reduce / param gather). The worker keeps calling the bare
  GPTModel: the wrapper's backward hooks sit on the parameters' grad accumulators, so gradients land in
  the buffers whichever object the schedule calls. ``megatron_rl.models.unwrap`` sees through the wrapper.
- DP reduction is a *sum*: our losses are already normalised by the global token/sequence count of the
  optimizer step. megatron-core's DDP divides by the DP size unless the model config says
  ``calculate_per_token_loss`` (then its gradient scaling factor is 1.0); we set that flag on the
  trained model's config before wrapping. The schedule only reads it for 3-tuple loss functions (ours
  return 2-tuples) and for MoE/MTP auxiliary losses (unused), so nothing else changes.
- ``get_megatron_optimizer`` builds Float16OptimizerWithFloat16Params (bf16; fp32 main params),
  FP32Optimizer (fp32) or DistributedOptimizer (``optim.use_distributed_optimizer``); its inner Adam is
  TE/apex FusedAdam when importable, else torch AdamW, which we switch to ``fused=True`` on GPU.
  ``config_overrides={}``: weight decay applies to every parameter, as in the local backend
  (megatron-core's default would exempt biases and norms).
- One step: ``finalize_model_grads`` (DP all-reduce or reduce-scatter of the buffers, TP sum of the q/k
  layernorm and sequence-parallel norm grads, tied-embedding sum over the PP embedding group), then
  megatron-core's ``prepare_grads`` / ``get_grad_norm`` / clip / ``step_with_ready_grads`` (the
  distributed optimizer all-gathers the updated params there). That is ``ChainedOptimizer.step`` except
  that a non-finite grad norm skips the update, as the local backend does (bf16 has no loss scaler to
  catch it). Then the grad buffers are zeroed.
- LR: torch ``LambdaLR`` with ``optim.lr_lambda`` over the inner optimizer's param groups, the same
  warmup/decay as the local backend.
- Checkpoints: ``sharded_state_dict`` is megatron-core's. Every optimizer tensor is tied to its model
  parameter's ShardedTensor, so it reshards across TP/PP/DP like the weights; the distributed optimizer
  uses the ``fully_reshardable`` format (its shards are all-gathered over DP into whole per-param tensors
  at save, held in CPU memory on every rank for the write: 12 bytes per parameter of this stage).
"""

from __future__ import annotations

import math

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import clip_grads as mcore_clip_grads

from megatron_rl.config.schema import OptimConfig
from megatron_rl.models import unwrap

# The distributed optimizer's checkpoint format: gathered over DP at save into one tensor per (param, state)
# with the param's ShardedTensor metadata, so it reshards across TP/PP/DP. (megatron-core 0.16's default,
# fully_sharded_model_space, needs flattened ShardedTensors, which its dist_checkpointing no longer takes;
# dp_reshardable reshards across DP only.)
DIST_OPT_SHARDING = "fully_reshardable"


def _torch_adam(inner) -> bool:
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


class MegatronCoreOptimizer:
    """megatron-core DDP wrapper + MegatronOptimizer of one trained model (see the module docstring)."""

    backend = "megatron"

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        core = unwrap(model)
        params = [p for p in core.parameters() if p.requires_grad]
        if not params:
            raise ValueError("optim.backend=megatron: the model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if not dtypes <= {torch.float32, torch.bfloat16}:
            raise ValueError(f"optim.backend=megatron supports float32/bfloat16 params, got {dtypes}")
        bf16 = torch.bfloat16 in dtypes
        self.use_distributed_optimizer = bool(cfg.use_distributed_optimizer)
        config = core.config
        config.calculate_per_token_loss = True  # DP sum: gradient_scaling_factor 1.0
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        self.ddp = DistributedDataParallel(config, ddp_config, core)
        self.config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.lr * cfg.min_lr_ratio,
            weight_decay=cfg.weight_decay,
            adam_beta1=float(cfg.betas[0]),
            adam_beta2=float(cfg.betas[1]),
            adam_eps=cfg.eps,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=self.use_distributed_optimizer,
            clip_grad=cfg.clip_grad,
        )
        self.opt = get_megatron_optimizer(self.config, [self.ddp], config_overrides={})
        subs = getattr(self.opt, "chained_optimizers", [self.opt])
        if len(subs) != 1:
            raise ValueError(
                f"optim.backend=megatron expects one optimizer (no expert params), got {len(subs)}"
            )
        self.inner = subs[0].optimizer  # the torch / TE / apex Adam that holds the param groups
        self.on_cuda = params[0].is_cuda
        self._fuse()
        self.param_groups = self.inner.param_groups

    def _fuse(self) -> None:
        """megatron-core's torch fallback builds a plain (foreach) AdamW; use the fused kernel on GPU. Set
        before the first step (its state is created for it) and again after a load (groups come from the
        checkpoint)."""
        if _torch_adam(self.inner):
            for group in self.inner.param_groups:
                group["fused"], group["foreach"] = self.on_cuda, None
            self.inner.defaults["fused"] = self.on_cuda

    @property
    def adam_class(self) -> str:
        kind = type(self.inner)
        fused = " (fused)" if self.inner.param_groups[0].get("fused") else ""
        return f"{kind.__module__}.{kind.__name__}{fused}"

    def step(self, sched, clip_grad: float) -> dict[str, torch.Tensor]:
        """Reduce, clip and apply the gradients in the DDP buffers; step the LR; zero the buffers."""
        finalize_model_grads([self.ddp])
        opt = self.opt
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        lr = self.param_groups[0]["lr"]
        if not found_inf and math.isfinite(grad_norm):
            if clip_grad > 0:
                for sub in getattr(opt, "chained_optimizers", [opt]):
                    params = sub.get_parameters()
                    if params:
                        mcore_clip_grads.clip_grad_by_total_norm_fp32(
                            params,
                            max_norm=clip_grad,
                            total_norm=grad_norm,
                            use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                        )
            opt.step_with_ready_grads()
        sched.step()
        self.zero_grad()
        return {"grad_norm": torch.tensor(grad_norm), "lr": torch.tensor(lr)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad(set_to_none=set_to_none)

    # --- checkpoints -------------------------------------------------------------------------------

    def _ensure_state(self) -> None:
        """torch Adam's lazily created state (zeros, step 0), exactly what its first step would create:
        megatron-core's state dicts assume it exists (the distributed optimizer reads one common step)."""
        if _torch_adam(self.inner):
            from megatron_rl.checkpoint.state import ensure_adam_state

            ensure_adam_state(self.inner)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """megatron-core's optimizer ShardedStateDict, tied to ``model_sharded_state_dict``'s tensors."""
        self._ensure_state()
        metadata = {"distrib_optim_sharding_type": DIST_OPT_SHARDING}
        return self.opt.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, loaded: dict) -> None:
        """Apply what ``dist_checkpointing.load`` returned for ``sharded_state_dict(..., is_loading=True)``."""
        if self.use_distributed_optimizer and "param_state" in loaded:
            # megatron-core 0.16.1 copies *every* state key of a param from the checkpoint's tensors, which
            # have no per-param "step" (torch Adam keeps one; TE/apex FusedAdam do not): KeyError. So the
            # param state is applied with the steps set aside (they come from the common param_groups).
            loaded = dict(loaded)
            param_state = loaded.pop("param_state")
            kind = loaded.pop("param_state_sharding_type")
            if kind != DIST_OPT_SHARDING:
                raise RuntimeError(
                    f"distributed-optimizer state of format {kind!r}; expected {DIST_OPT_SHARDING!r}"
                )
            self.opt.load_state_dict(loaded)
            held = {p: st.pop("step") for p, st in self.inner.state.items() if "step" in st}
            try:
                self.opt.chained_optimizers[0].load_parameter_state_from_fully_reshardable(param_state)
            finally:
                for p, step in held.items():
                    self.inner.state[p]["step"] = step
        else:
            self.opt.load_state_dict(loaded)
        self._fuse()
        if _torch_adam(self.inner):
            # megatron-core hands every param the same 0-dim step tensor (distributed optimizer) or none
            # (a step-0 save); torch Adam increments each param's step in place, so each needs its own.
            for group in self.inner.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    st = self.inner.state[p]
                    step = st.get("step", torch.zeros((), dtype=torch.float32))
                    st["step"] = (
                        step.detach().to(dtype=torch.float32, device=p.device if on_device else "cpu").clone()
                    )

    def adam_step(self) -> int:
        """The optimizer's step count (every param shares it)."""
        if _torch_adam(self.inner):
            steps = {float(s["step"]) for s in self.inner.state.values() if "step" in s}
        else:  # TE / apex FusedAdam keep it per param group
            steps = {float(g["step"]) for g in self.inner.param_groups if g.get("step") is not None}
        if len(steps) > 1:
            raise RuntimeError(f"Adam params are at different steps {sorted(steps)}; a checkpoint stores one")
        return int(steps.pop()) if steps else 0


def build_mcore_optimizer(model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
    from megatron_rl.trainer.optim import lr_lambda

    opt = MegatronCoreOptimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lr_lambda(cfg, total_steps))
    return opt, sched
