"""What goes into a checkpoint, in layout-independent form.

- Weights: ``model.sharded_state_dict()`` (megatron-core ShardedTensors carry global shapes and offsets,
  so torch_dist reshards them on load at any TP/PP).
- AdamW moments: one ShardedTensor per (param, moment) with the *param's* sharding
  (``make_sharded_optimizer_tensor``), so optimizer state reshards exactly like the weights. The per-param
  AdamW ``step`` is the same for every param (every param gets a grad each step), so it is one integer.
  With ``optim.backend=megatron`` the optimizer's own ``sharded_state_dict`` is used instead (megatron-core
  keys ``optimizer.state.*``, also tied to the params' ShardedTensors, so they reshard too); states of
  different optimizer kinds are not interchangeable, and a resume says so (``check_optimizer_backend``).
- LR scheduler and optimizer hyper-parameters, the data position and the KL controller: JSON.
- RNG states: per rank (``torch.save`` of tensors and plain Python types, read with weights_only=True).
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)

from megatron_rl.checkpoint.layout import CheckpointError

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def ensure_adam_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's lazily-initialised state (zeros, step 0) for params that have none yet: identical
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


def _parts(opt) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], list[torch.Tensor]]:
    """(inner torch optimizer, model params, the params it updates). ``MainParamsAdamW`` (trainer.optim)
    updates fp32 main copies of bf16 params; a plain torch optimizer updates the model params."""
    if hasattr(opt, "opt") and hasattr(opt, "main"):
        return opt.opt, list(opt.model_params), list(opt.main)
    params = [p for g in opt.param_groups for p in g["params"]]
    return opt, params, params


def _is_megatron(opt) -> bool:
    return getattr(opt, "backend", "local") == "megatron"


def role_sharded_state(role: str, model: torch.nn.Module, opt, is_loading: bool = False) -> dict:
    """``{"model": ShardedStateDict, "optim": {name: {i: ShardedTensor}}}`` of one trained model.

    Keys are prefixed with ``role`` (``actor.decoder.layers...``), so actor and critic share one
    dist checkpoint. Optimizer tensors (AdamW moments, fp32 main params of bf16 weights) take the
    sharding of the model param they belong to. The ShardedTensors point at the live tensors.
    ``is_loading``: the dict is for ``dist_checkpointing.load`` (megatron-core's optimizers allocate
    their state for it).
    """
    model_sd = model.sharded_state_dict(prefix=f"{role}.")
    out = {"model": model_sd}
    if opt is None:
        return out
    if _is_megatron(opt):
        out["optim"] = opt.sharded_state_dict(model_sd, is_loading=is_loading)
        return out
    inner, params, mains = _parts(opt)
    ensure_adam_state(inner)
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    missing = [i for i in range(len(params)) if i not in id_map]
    if missing:
        raise RuntimeError(
            f"{role}: {len(missing)} optimizer params have no sharded key in model.sharded_state_dict(); "
            "the model's sharded_state_dict must be built with keep_vars=True (megatron-core does this)"
        )
    moments = ADAM_MOMENTS + (("max_exp_avg_sq",) if inner.param_groups[0].get("amsgrad") else ())
    tensors = {m: [inner.state[main][m] for main in mains] for m in moments}
    if any(main is not p for main, p in zip(mains, params)):
        tensors["main_param"] = mains
    out["optim"] = {
        name: {str(i): make_sharded_optimizer_tensor(id_map[i], t, prefix=f"optim.{name}") for i, t in enumerate(ts)}
        for name, ts in tensors.items()
    }  # fmt: skip
    return out


def apply_loaded_optim(opt, loaded: dict) -> None:
    """Copy the tensors returned by ``dist_checkpointing.load`` into the optimizer's state."""
    if _is_megatron(opt):
        opt.load_state_dict(loaded)
        return
    inner, _, mains = _parts(opt)
    with torch.no_grad():
        for name, per_param in loaded.items():
            for i, main in enumerate(mains):
                dst = main if name == "main_param" else inner.state[main][name]
                dst.copy_(per_param[str(i)])


def optimizer_kind(opt) -> dict:
    """What wrote an optimizer state: ``{"backend", "use_distributed_optimizer"}``."""
    if _is_megatron(opt):
        return {"backend": "megatron", "use_distributed_optimizer": opt.use_distributed_optimizer}
    return {"backend": "local", "use_distributed_optimizer": False}


def check_optimizer_backend(role: str, saved: dict, opt, path) -> None:
    """Refuse, before any tensor is read, optimizer state written by another optimizer kind.

    ``saved``: the role's entry of ``state.json["optimizers"]`` (checkpoints written before the megatron
    backend existed have no ``backend`` key: local). Each kind's state reshards across TP/PP/DP; across
    kinds the keys and layouts differ (local ``optim.*``; megatron-core ``optimizer.state.*``, whose
    distributed optimizer stores ``param`` and a different common state than its non-distributed one's
    ``fp32_param``), so switching ``optim.backend`` or ``optim.use_distributed_optimizer`` cannot resume."""
    was = {"backend": saved.get("backend", "local"),
           "use_distributed_optimizer": bool(saved.get("use_distributed_optimizer", False))}  # fmt: skip
    now = optimizer_kind(opt)
    if was == now:
        return

    def show(kind: dict) -> str:
        return (f"{role}.optim.backend={kind['backend']} "
                f"{role}.optim.use_distributed_optimizer={str(kind['use_distributed_optimizer']).lower()}")  # fmt: skip

    raise CheckpointError(
        f"{path} holds {role} optimizer state written with {show(was)}, but this run has {show(now)}; optimizer "
        f"state does not convert between optimizer kinds (it does reshard across TP/PP/DP). Resume with "
        f"{show(was)}, or keep only the weights: checkpoints_tools/megatron_to_hf.py --checkpoint {path} "
        "--output DIR, then model.path=DIR trainer.resume_mode=disable."
    )


def optimizer_json(opt, sched) -> dict:
    """Host-side optimizer state: the shared AdamW step, per-group lr/initial_lr, the LR scheduler."""
    if _is_megatron(opt):  # lr, initial_lr and the step travel in megatron-core's common state
        return {**optimizer_kind(opt), "adam_step": opt.adam_step(), "scheduler": sched.state_dict()}
    kind = optimizer_kind(opt)
    opt, _, mains = _parts(opt)
    steps = {float(opt.state[p]["step"]) for p in mains if "step" in opt.state[p]}
    if len(steps) > 1:
        raise RuntimeError(f"AdamW params are at different steps {sorted(steps)}; a checkpoint stores one")
    groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in opt.param_groups]
    return {
        **kind,
        "adam_step": int(steps.pop()) if steps else 0,
        "param_groups": groups,
        "scheduler": sched.state_dict(),
    }


def load_optimizer_json(opt, sched, state: dict) -> None:
    if _is_megatron(opt):
        sched.load_state_dict(state["scheduler"])
        return
    opt, _, mains = _parts(opt)
    ensure_adam_state(opt)
    for p in mains:
        opt.state[p]["step"].fill_(float(state["adam_step"]))
    if len(state["param_groups"]) != len(opt.param_groups):
        raise RuntimeError(
            f"the checkpoint has {len(state['param_groups'])} optimizer param groups, this run has "
            f"{len(opt.param_groups)}; resume with the optimizer settings of the checkpointed run"
        )
    for g, saved in zip(opt.param_groups, state["param_groups"]):
        g.update(saved)
    sched.load_state_dict(state["scheduler"])


def capture_rng() -> dict:
    """This rank's RNG states as tensors and plain Python values (loadable with weights_only=True)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    return state


def restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(_tuplify(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    elif state["cuda"]:
        warnings.warn(
            "the checkpoint has CUDA RNG states but CUDA is absent; they are not restored", stacklevel=2
        )
    if state["tracker"]:
        get_cuda_rng_tracker().set_states(state["tracker"])


def _tuplify(x):
    """torch.load may hand back lists where random.getstate() had tuples."""
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
