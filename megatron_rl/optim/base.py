"""The interface every optimizer backend implements, modelled on megatron-core's ``MegatronOptimizer``.

An optimizer here owns the whole update of one trained model: gradient reduction across the parallel
layout, global-norm clipping, the parameter update, the LR schedule and zeroing the gradients, so the
trainer calls ``step()`` and reads back metrics. Checkpoint code sees only ``sharded_state_dict`` /
``load_sharded_state_dict`` (tensors, resharded by dist_checkpointing), ``host_state`` / ``load_host_state``
(JSON: kind, Adam step, param groups, LR scheduler) and ``check_compatible`` (refuse another kind's state);
it never asks which backend it holds. ``offload`` / ``reload`` move the state the generation phase does not
need to host memory and back (``optim.param_offload`` / ``optimizer_offload`` / ``grad_offload``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from megatron_rl.config.schema import OptimConfig
from megatron_rl.optim.offload import ParkedStorages


class OptimizerKindError(ValueError):
    """Optimizer state written by another optimizer kind; ``was`` / ``now`` are the two kinds."""

    def __init__(self, message: str, was: OptimizerKind, now: OptimizerKind):
        super().__init__(message)
        self.was, self.now = was, now


@dataclass(frozen=True)
class OptimizerKind:
    """What wrote an optimizer state. States of different kinds have different keys and layouts."""

    backend: str
    use_distributed_optimizer: bool = False

    def to_json(self) -> dict:
        return {"backend": self.backend, "use_distributed_optimizer": self.use_distributed_optimizer}

    @classmethod
    def from_json(cls, saved: dict) -> OptimizerKind:
        """Checkpoints written before the megatron backend existed have no ``backend`` key: local."""
        return cls(saved.get("backend", "local"), bool(saved.get("use_distributed_optimizer", False)))

    def flags(self, role: str) -> str:
        """The config keys that choose this kind, as overrides."""
        distopt = str(self.use_distributed_optimizer).lower()
        return f"{role}.optim.backend={self.backend} {role}.optim.use_distributed_optimizer={distopt}"


class Optimizer(abc.ABC):
    """One trained model's optimizer (see the module docstring). Subclasses set ``kind``, ``cfg`` and
    ``scheduler`` (a torch LR scheduler over the param groups that apply the update)."""

    kind: OptimizerKind
    cfg: OptimConfig
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @abc.abstractmethod
    def step(self) -> dict[str, torch.Tensor]:
        """Reduce the accumulated gradients, clip them to ``cfg.clip_grad``, update (skipped when the grad
        norm is not finite) and zero the gradients. Returns ``grad_norm`` and the ``lr`` the update used
        (0-dim tensors). The LR schedule does not move here: see ``step_lr``."""

    def step_lr(self) -> None:
        """Advance the LR schedule by one *training* step. The trainer calls it once per update, after all
        the optimizer steps of that update (its mini-batches times ``ppo_epochs``), so they share one LR and
        ``lr_warmup_steps`` / the decay span count training steps whatever the mini-batch count (verl's
        convention: its workers step their LR scheduler once per ``update_policy``)."""
        self.scheduler.step()

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    @abc.abstractmethod
    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The optimizer tensors as ShardedTensors tied to ``model_sharded_state_dict``'s params, so they
        reshard across TP/PP/DP like the weights. ``is_loading``: for ``dist_checkpointing.load``."""

    @abc.abstractmethod
    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Apply what ``dist_checkpointing.load`` returned for ``sharded_state_dict(..., is_loading=True)``."""

    @abc.abstractmethod
    def host_state(self) -> dict:
        """JSON-able state: the kind's keys, ``adam_step``, the LR scheduler (and what else the backend
        keeps outside its tensors)."""

    @abc.abstractmethod
    def load_host_state(self, state: dict) -> None:
        """Inverse of ``host_state`` (after ``load_sharded_state_dict``)."""

    @abc.abstractmethod
    def offload_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors by offload key: ``param`` (fp32 main params distinct from the model's weights),
        ``optimizer`` (Adam moments), ``grad`` (gradient buffers, zero between steps)."""

    @abc.abstractmethod
    def model_storages(self) -> set[int]:
        """Data pointers of the model weights' storages: never offloaded (generation reads them)."""

    def check_compatible(self, saved: dict, role: str) -> None:
        """Raise ``OptimizerKindError`` if ``saved`` (a ``host_state()``) was written by another kind."""
        was = OptimizerKind.from_json(saved)
        if was != self.kind:
            raise OptimizerKindError(
                f"{role} optimizer state written with {was.flags(role)}, but this run has {self.kind.flags(role)}; "
                "optimizer state does not convert between optimizer kinds (it does reshard across TP/PP/DP)",
                was, self.kind,
            )  # fmt: skip

    # --- offload while generating ---------------------------------------------------------------

    _parked: list[ParkedStorages] | None = None

    @property
    def offload_enabled(self) -> bool:
        """Whether any of ``cfg.param_offload`` / ``optimizer_offload`` / ``grad_offload`` is set."""
        return bool(self.cfg.param_offload or self.cfg.optimizer_offload or self.cfg.grad_offload)

    def offload(self) -> int:
        """Move what ``cfg.param_offload`` / ``optimizer_offload`` / ``grad_offload`` select to host memory.
        Returns the bytes released on the device (0 when nothing is selected or it is already offloaded)."""
        if self._parked is not None:
            return 0
        keys = {"param": self.cfg.param_offload, "optimizer": self.cfg.optimizer_offload,
                "grad": self.cfg.grad_offload}  # fmt: skip
        tensors, keep = self.offload_tensors(), self.model_storages()
        self._parked = []
        for key, on in keys.items():
            if on:
                parked = ParkedStorages(tensors[key], copy=key != "grad", keep=keep)
                keep |= {s.data_ptr() for s in parked.storages}  # a storage is parked once
                parked.park()
                self._parked.append(parked)
        return sum(p.nbytes for p in self._parked)

    def reload(self) -> None:
        """Bring back what ``offload`` moved; a no-op when nothing is offloaded."""
        for parked in self._parked or ():
            parked.restore()
        self._parked = None

    @property
    def offloaded(self) -> bool:
        return self._parked is not None


def ensure_adam_state(opt: torch.optim.Optimizer) -> None:
    """Create torch Adam's lazily-initialised state (zeros, step 0) for params that have none yet: identical
    to what the first ``opt.step()`` would create, so saving or loading before any update is exact."""
    for group in opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            st = opt.state[p]
            if st:
                continue
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
