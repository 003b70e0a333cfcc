"""What goes into a checkpoint, in layout-independent form.

- Weights: ``model.sharded_state_dict()`` (megatron-core ShardedTensors carry global shapes and offsets,
  so torch_dist reshards them on load at any TP/PP).
- Optimizer state: the optimizer's own ``sharded_state_dict`` (``megatron_rl.optim``: every tensor tied to
  its param's ShardedTensor, so it reshards like the weights) and ``host_state`` (JSON: kind, Adam step,
  param groups, LR scheduler); states of different optimizer kinds are not interchangeable, and a resume
  says so (``check_optimizer_backend``). Nothing here asks which optimizer kind it holds.
- The data position and the KL controller: JSON.
- RNG states: per rank (``torch.save`` of tensors and plain Python types, read with weights_only=True).
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch

from megatron_rl.checkpoint.layout import CheckpointError
from megatron_rl.checkpoint.lora_base import trainable_only
from megatron_rl.optim import Optimizer, OptimizerKindError


def role_sharded_state(
    role: str, model: torch.nn.Module, opt: Optimizer | None, is_loading: bool = False
) -> dict:
    """``{"model": ShardedStateDict, "optim": ...}`` of one trained model.

    Keys are prefixed with ``role`` (``actor.decoder.layers...``), so actor and critic share one
    dist checkpoint. The optimizer's tensors take the sharding of the model params they belong to
    (``Optimizer.sharded_state_dict``); the ShardedTensors point at the live tensors. ``is_loading``: the
    dict is for ``dist_checkpointing.load``.
    """
    model_sd = trainable_only(model, model.sharded_state_dict(prefix=f"{role}."))  # LoRA: adapters only
    out = {"model": model_sd}
    if opt is not None:
        out["optim"] = opt.sharded_state_dict(model_sd, is_loading=is_loading)
    return out


def check_optimizer_backend(role: str, saved: dict, opt: Optimizer, path) -> None:
    """Refuse, before any tensor is read, optimizer state written by another optimizer kind.

    ``saved``: the role's entry of ``state.json["optimizers"]``. Each kind's state reshards across
    TP/PP/DP; across kinds the keys and layouts differ (local ``optim.*``; megatron-core
    ``optimizer.state.*``, whose distributed optimizer stores ``param`` and a different common state than
    its non-distributed one's ``fp32_param``), so switching ``optim.backend`` or
    ``optim.use_distributed_optimizer`` cannot resume."""
    try:
        opt.check_compatible(saved, role)
    except OptimizerKindError as err:
        was = err.was.flags(role)
        raise CheckpointError(
            f"{path} holds {err}. Resume with {was}, or keep only the weights: checkpoints_tools/"
            f"megatron_to_hf.py --checkpoint {path} --output DIR, then model.path=DIR trainer.resume_mode=disable."
        ) from err


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
