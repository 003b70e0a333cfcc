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
- ``optim.gradient_accumulation_fusion``: megatron-core's own fused path (the weight-gradient GEMM adds into
  the fp32 buffer, a dummy gradient goes to the DDP hook), with ``kernels.wgrad_fusion`` in apex's place.
- ``get_megatron_optimizer`` builds Float16OptimizerWithFloat16Params (bf16; fp32 main params),
  FP32Optimizer (fp32) or DistributedOptimizer (``optim.use_distributed_optimizer``); its inner Adam is
  TE/apex FusedAdam when importable, else torch AdamW, which we switch to ``fused=True`` on GPU.
  ``config_overrides={}``: weight decay applies to every parameter, as in the local backend
  (megatron-core's default would exempt biases and norms).
- ``optim.optimizer_cpu_offload``: megatron-core's HybridDeviceOptimizer inside the distributed optimizer
  keeps ``optim.optimizer_offload_fraction`` of this rank's fp32 main params and Adam moments on the host
  and steps them there with torch's CPU AdamW (gradients go down, updated params come back up; with
  ``optim.overlap_cpu_optimizer_d2h_h2d`` per-parameter CPU optimizers overlap those copies). It runs on
  megatron-core's precision-aware code path (``use_precision_aware_optimizer``; main params held by the
  hybrid optimizer, gradients in ``decoupled_grad``), which is why it needs the distributed optimizer.
- One step: ``finalize_model_grads`` (DP all-reduce or reduce-scatter of the buffers, TP sum of the q/k
  layernorm and sequence-parallel norm grads, tied-embedding sum over the PP embedding group), then
  megatron-core's ``prepare_grads`` / ``get_grad_norm`` / clip / ``step_with_ready_grads`` (the
  distributed optimizer all-gathers the updated params there). That is ``ChainedOptimizer.step`` except
  that a non-finite grad norm skips the update, as the local backend does (bf16 has no loss scaler to
  catch it). Then the grad buffers are zeroed.
- LR: torch ``LambdaLR`` with ``schedule.lr_lambda`` over the inner optimizer's param groups, the same
  warmup/decay as the local backend, advanced once per training step (``step_lr``).
- Checkpoints: ``sharded_state_dict`` is megatron-core's. Every optimizer tensor is tied to its model
  parameter's ShardedTensor, so it reshards across TP/PP/DP like the weights; the distributed optimizer
  uses the ``fully_reshardable`` format (its shards are all-gathered over DP into whole per-param tensors
  at save, held in CPU memory on every rank for the write: 12 bytes per parameter of this stage). The
  hybrid optimizer's checkpoint has the same layout; ``megatron_rl.optim.hybrid`` says what it adds (at DP=1
  the tensors are written from and read into the live state, without that gather).
"""

from __future__ import annotations

import gc
import math

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import clip_grads as mcore_clip_grads
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from megatron_rl.config.schema import OptimConfig
from megatron_rl.kernels import wgrad_fusion
from megatron_rl.models import unwrap
from megatron_rl.optim import hybrid
from megatron_rl.optim.base import Optimizer, OptimizerKind, ensure_adam_state
from megatron_rl.optim.schedule import build_scheduler

# The distributed optimizer's checkpoint format: gathered over DP at save into one tensor per (param, state)
# with the param's ShardedTensor metadata, so it reshards across TP/PP/DP. (megatron-core 0.16's default,
# fully_sharded_model_space, needs flattened ShardedTensors, which its dist_checkpointing no longer takes;
# dp_reshardable reshards across DP only.)
DIST_OPT_SHARDING = "fully_reshardable"


def _torch_adam(inner) -> bool:
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def mcore_optimizer_config(cfg: OptimConfig, bf16: bool) -> OptimizerConfig:
    """megatron-core's OptimizerConfig for ``cfg`` (weights in bf16 or fp32)."""
    hybrid = bool(cfg.optimizer_cpu_offload)
    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.lr * cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        adam_beta1=float(cfg.betas[0]),
        adam_beta2=float(cfg.betas[1]),
        adam_eps=cfg.eps,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=bool(cfg.use_distributed_optimizer),
        clip_grad=cfg.clip_grad,
        optimizer_cpu_offload=hybrid,
        optimizer_offload_fraction=float(cfg.optimizer_offload_fraction) if hybrid else 0.0,
        overlap_cpu_optimizer_d2h_h2d=bool(cfg.overlap_cpu_optimizer_d2h_h2d) if hybrid else False,
    )
    if hybrid:
        # The hybrid optimizer runs on the precision-aware code path (Megatron-LM's arguments require the
        # pair). OptimizerConfig.__post_init__ would ask Transformer Engine's version for it, which fails
        # when TE is absent; with cpu offload it does nothing else, so the flags are set as it would set them
        # without TE (store_param_remainders is a TE FusedAdam option).
        config.use_precision_aware_optimizer = True
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        config.store_param_remainders = False
    return config


class MegatronOptimizer(Optimizer):
    """megatron-core DDP wrapper + MegatronOptimizer of one trained model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
        core = unwrap(model)
        params = [p for p in core.parameters() if p.requires_grad]
        if not params:
            raise ValueError("optim.backend=megatron: the model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if not dtypes <= {torch.float32, torch.bfloat16}:
            raise ValueError(f"optim.backend=megatron supports float32/bfloat16 params, got {dtypes}")
        if cfg.optimizer_cpu_offload and dtypes != {torch.bfloat16}:
            raise ValueError(
                "optim.optimizer_cpu_offload=true needs bf16 weights (megatron-core's hybrid optimizer keeps "
                f"their fp32 main params itself), got {dtypes}; set model.dtype=bfloat16"
            )
        self.cfg, self.params = cfg, params
        self.kind = OptimizerKind("megatron", bool(cfg.use_distributed_optimizer))
        config = core.config
        config.calculate_per_token_loss = True  # DP sum: gradient_scaling_factor 1.0
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=self.kind.use_distributed_optimizer,
        )
        self.ddp = DistributedDataParallel(config, ddp_config, core)
        fused = wgrad_fusion.resolve(cfg.gradient_accumulation_fusion, core)
        if fused:  # weight-gradient GEMMs accumulate into the DDP's fp32 buffers (kernels.wgrad_fusion)
            wgrad_fusion.enable(fused)
        self.fused = bool(fused)
        self.config = mcore_optimizer_config(cfg, torch.bfloat16 in dtypes)
        self.opt = get_megatron_optimizer(self.config, [self.ddp], config_overrides={})
        if cfg.optimizer_cpu_offload:
            # megatron-core first builds a hybrid optimizer over the whole bf16 model (host copies of the
            # offloaded fraction, fp32 copies of all of it), then the distributed optimizer replaces it with
            # one over this rank's shards; the first one sits in a reference cycle (its step hooks), so
            # collect it now rather than at some later GC pass.
            gc.collect()
        subs = getattr(self.opt, "chained_optimizers", [self.opt])
        if len(subs) != 1:
            raise ValueError(
                f"optim.backend=megatron expects one optimizer (no expert params), got {len(subs)}"
            )
        self.inner = subs[0].optimizer  # the torch / TE / apex / hybrid Adam that holds the param groups
        self.on_cuda = params[0].is_cuda
        self._fuse()
        self.scheduler = build_scheduler(self.inner, cfg, total_steps)

    def _fuse(self) -> None:
        """megatron-core's torch fallback builds a plain (foreach) AdamW; use the fused kernel on GPU. Set
        before the first step (its state is created for it) and again after a load (groups come from the
        checkpoint)."""
        if _torch_adam(self.inner):
            for group in self.inner.param_groups:
                group["fused"], group["foreach"] = self.on_cuda, None
            self.inner.defaults["fused"] = self.on_cuda

    def _adams(self) -> list[torch.optim.Optimizer]:
        """The optimizers that hold Adam state: the inner one, or the hybrid optimizer's CPU and GPU parts."""
        if isinstance(self.inner, HybridDeviceOptimizer):
            return list(self.inner.sub_optimizers)
        return [self.inner]

    @property
    def adam_class(self) -> str:
        kind = type(self.inner)
        fused = " (fused)" if self.inner.param_groups[0].get("fused") else ""
        return f"{kind.__module__}.{kind.__name__}{fused}"

    def step(self) -> dict[str, torch.Tensor]:
        """Reduce, clip and apply the gradients in the DDP buffers; zero the buffers (the LR: ``step_lr``)."""
        finalize_model_grads([self.ddp])
        opt = self.opt
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        lr = self.inner.param_groups[0]["lr"]
        if not found_inf and math.isfinite(grad_norm):
            if self.cfg.clip_grad > 0:
                for sub in getattr(opt, "chained_optimizers", [opt]):
                    params = sub.get_parameters()
                    if params:
                        mcore_clip_grads.clip_grad_by_total_norm_fp32(
                            params,
                            max_norm=self.cfg.clip_grad,
                            total_norm=grad_norm,
                            use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                        )
            opt.step_with_ready_grads()
        self.zero_grad()
        return {"grad_norm": torch.tensor(grad_norm), "lr": torch.tensor(lr)}

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad(set_to_none=True)

    # --- checkpoints -------------------------------------------------------------------------------

    @property
    def hybrid(self) -> HybridDeviceOptimizer | None:
        return self.inner if isinstance(self.inner, HybridDeviceOptimizer) else None

    def _ensure_state(self) -> None:
        """Adam's lazily created state (zeros, step 0), exactly what its first step would create:
        megatron-core's state dicts assume it exists (the distributed optimizer reads one common step)."""
        if self.hybrid is not None:
            hybrid.ensure_state(self.hybrid)
        elif _torch_adam(self.inner):
            ensure_adam_state(self.inner)

    def _in_place(self) -> bool:
        """The hybrid optimizer's checkpoint is written from and read into its live tensors when this rank
        holds whole params (``optim.hybrid``)."""
        return self.hybrid is not None and hybrid.whole_params(self.opt.chained_optimizers[0])

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """megatron-core's optimizer ShardedStateDict, tied to ``model_sharded_state_dict``'s tensors."""
        self._ensure_state()
        if self._in_place():
            return hybrid.in_place_state(self.opt.chained_optimizers[0], model_sharded_state_dict)
        metadata = {"distrib_optim_sharding_type": DIST_OPT_SHARDING}
        if self.hybrid is not None:  # gathered over gloo into DP rank 0's host memory: no device memory
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        sd = self.opt.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)
        if self.hybrid is None:
            return sd
        if sd["param_state"] is None:  # not DP rank 0 (megatron-core would report it as common state)
            del sd["param_state"]
        return hybrid.strip_groups(sd)

    def load_sharded_state_dict(self, loaded: dict) -> None:
        if self._in_place():
            hybrid.load_in_place(self.opt.chained_optimizers[0], loaded)
            return
        if self.kind.use_distributed_optimizer and "param_state" in loaded:
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
        if self.hybrid is not None:
            hybrid.restore_groups(self.hybrid)
            hybrid.release_loaded(self.hybrid)
            gc.collect()  # the sub-optimizers megatron-core's load replaced sit in reference cycles
            return  # the step: load_host_state
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
        steps = set()
        for adam in self._adams():
            if _torch_adam(adam):
                steps |= {float(s["step"]) for s in adam.state.values() if "step" in s}
            else:  # TE / apex FusedAdam keep it per param group
                steps |= {float(g["step"]) for g in adam.param_groups if g.get("step") is not None}
        if len(steps) > 1:
            raise RuntimeError(f"Adam params are at different steps {sorted(steps)}; a checkpoint stores one")
        return int(steps.pop()) if steps else 0

    def host_state(self) -> dict:
        """lr, initial_lr and the step also travel in megatron-core's common state (``sharded_state_dict``)."""
        return {
            **self.kind.to_json(),
            "adam_step": self.adam_step(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_host_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.hybrid is not None:
            hybrid.set_step(self.hybrid, int(state["adam_step"]))

    # --- offload -------------------------------------------------------------------------------------

    def offload_tensors(self) -> dict[str, list[torch.Tensor]]:
        sub = getattr(self.opt, "chained_optimizers", [self.opt])[0]
        # fp32 main params: Float16Optimizer's fp32_from_float16_groups, the distributed optimizer's
        # shard_fp32_from_float16_groups (fp32 weights have none: the weights are the main params)
        groups = getattr(sub, "shard_fp32_from_float16_groups", None) or getattr(
            sub, "fp32_from_float16_groups", []
        )
        mains = [t for g in groups for t in g if t is not None]
        moments = [t for adam in self._adams() for st in adam.state.values()
                   for k, t in st.items() if torch.is_tensor(t) and k != "step"]  # fmt: skip
        grads = [b.grad_data for b in (*self.ddp.buffers, *self.ddp.expert_parallel_buffers)]
        return {"param": mains, "optimizer": moments, "grad": grads}

    def model_storages(self) -> set[int]:
        weights = [p for p in self.params] + [
            b.param_data
            for b in (*self.ddp.buffers, *self.ddp.expert_parallel_buffers)
            if b.param_data is not None
        ]
        return {t.untyped_storage().data_ptr() for t in weights}
