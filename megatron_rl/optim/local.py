"""``optim.backend=local`` (the default): torch AdamW on fp32 main copies of the weights, on any device.

- Gradients accumulate over micro-batches in an fp32 ``main_grad`` per parameter, as megatron-core's DDP
  buffers do: a post-accumulate-grad hook adds each micro-batch's (bf16) ``.grad`` into it and frees the
  ``.grad``. Summing dozens of micro-batches in bf16 would lose precision (issue 19). ``main_grad`` is
  freed after each step, so between updates (generation) no gradient memory is held. With
  ``gradient_accumulation_fusion`` the linear layers' weight-gradient GEMMs accumulate into it directly
  (``kernels.wgrad_fusion``; each fused weight's ``main_grad`` is allocated at its layer's first forward
  with gradients on), and the hook adds only the other parameters' gradients.
- Reduction over DP/TP/the tied-embedding group and the global-norm clip: ``distributed.grads``.
- AdamW updates fp32 main params (bf16 updates of lr ~1e-6 would vanish), then copies them into the
  weights; with fp32 weights the main params are the weights themselves. Fused kernel on GPU.
- Checkpoints: one ShardedTensor per (param, moment) with the *param's* sharding
  (``make_sharded_optimizer_tensor``), so the state reshards exactly like the weights; the per-param AdamW
  ``step`` is the same for every param (every param gets a grad each step), so it is one integer in JSON.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)

from megatron_rl.config.schema import OptimConfig
from megatron_rl.distributed.grads import clip_grad_norm, reduce_gradients
from megatron_rl.kernels import wgrad_fusion
from megatron_rl.optim.base import Optimizer, OptimizerKind, ensure_adam_state
from megatron_rl.optim.schedule import build_scheduler

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _accumulate_main_grad(p: torch.nn.Parameter) -> None:
    """Post-accumulate-grad hook: add this backward's ``p.grad`` into the fp32 ``p.main_grad``. A fused
    weight (``gradient_accumulation_fusion``) is already in ``main_grad``: autograd got None, the hook
    still runs."""
    if p.grad is None:
        return
    if p.main_grad is None:
        p.main_grad = p.grad.float()  # a copy for bf16; the grad tensor itself for fp32 params
    else:
        p.main_grad.add_(p.grad)
    p.grad = None


class LocalOptimizer(Optimizer):
    """AdamW on fp32 main params with fp32 gradient accumulation (see the module docstring)."""

    kind = OptimizerKind("local", False)

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
        self.model, self.cfg = model, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in self.params]
        self.adam = torch.optim.AdamW(
            self.main,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=bool(self.params) and self.params[0].is_cuda,
        )
        self.scheduler = build_scheduler(self.adam, cfg, total_steps)
        for p in self.params:
            p.main_grad = None
            p.register_post_accumulate_grad_hook(_accumulate_main_grad)
        fused = wgrad_fusion.resolve(cfg.gradient_accumulation_fusion, model)
        if fused:  # the linears' weight gradients go straight into main_grad (kernels.wgrad_fusion)
            wgrad_fusion.allocate_on_forward(wgrad_fusion.enable(fused))
        self.fused = bool(fused)

    def step(self) -> dict[str, torch.Tensor]:
        reduce_gradients(self.model)
        grad_norm = clip_grad_norm(self.model, self.cfg.clip_grad)
        lr = self.adam.param_groups[0]["lr"]
        if torch.isfinite(grad_norm):
            for p, m in zip(self.params, self.main):
                m.grad = p.main_grad
            self.adam.step()
            pairs = [(p, m) for p, m in zip(self.params, self.main) if m is not p]
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        self.zero_grad()
        return {"grad_norm": grad_norm, "lr": torch.tensor(lr)}

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.main):
            p.grad, p.main_grad, m.grad = None, None, None

    # --- checkpoints -------------------------------------------------------------------------------

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """``{name: {i: ShardedTensor}}``: Adam moments (and fp32 main params of bf16 weights), each with
        the sharding of the model param it belongs to; they point at the live tensors."""
        ensure_adam_state(self.adam)
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        missing = [i for i in range(len(self.params)) if i not in id_map]
        if missing:
            raise RuntimeError(
                f"{len(missing)} optimizer params have no sharded key in model.sharded_state_dict(); "
                "the model's sharded_state_dict must be built with keep_vars=True (megatron-core does this)"
            )
        moments = ADAM_MOMENTS + (("max_exp_avg_sq",) if self.adam.param_groups[0].get("amsgrad") else ())
        tensors = {m: [self.adam.state[main][m] for main in self.main] for m in moments}
        if any(main is not p for main, p in zip(self.main, self.params)):
            tensors["main_param"] = self.main
        return {
            name: {str(i): make_sharded_optimizer_tensor(id_map[i], t, prefix=f"optim.{name}")
                   for i, t in enumerate(ts)}
            for name, ts in tensors.items()
        }  # fmt: skip

    def load_sharded_state_dict(self, loaded: dict) -> None:
        with torch.no_grad():
            for name, per_param in loaded.items():
                for i, main in enumerate(self.main):
                    dst = main if name == "main_param" else self.adam.state[main][name]
                    dst.copy_(per_param[str(i)])

    def host_state(self) -> dict:
        steps = {float(self.adam.state[p]["step"]) for p in self.main if "step" in self.adam.state[p]}
        if len(steps) > 1:
            raise RuntimeError(
                f"AdamW params are at different steps {sorted(steps)}; a checkpoint stores one"
            )
        groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in self.adam.param_groups]
        return {
            **self.kind.to_json(),
            "adam_step": int(steps.pop()) if steps else 0,
            "param_groups": groups,
            "scheduler": self.scheduler.state_dict(),
        }

    def load_host_state(self, state: dict) -> None:
        ensure_adam_state(self.adam)
        for p in self.main:
            self.adam.state[p]["step"].fill_(float(state["adam_step"]))
        if len(state["param_groups"]) != len(self.adam.param_groups):
            raise RuntimeError(
                f"the checkpoint has {len(state['param_groups'])} optimizer param groups, this run has "
                f"{len(self.adam.param_groups)}; resume with the optimizer settings of the checkpointed run"
            )
        for g, saved in zip(self.adam.param_groups, state["param_groups"]):
            g.update(saved)
        self.scheduler.load_state_dict(state["scheduler"])

    # --- offload -------------------------------------------------------------------------------------

    def offload_tensors(self) -> dict[str, list[torch.Tensor]]:
        moments = [t for st in self.adam.state.values() for k, t in st.items() if k != "step"]
        return {
            "param": [m for m, p in zip(self.main, self.params) if m is not p],
            "optimizer": moments,
            "grad": [p.main_grad for p in self.params],  # None between steps: nothing to move
        }

    def model_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.params}
