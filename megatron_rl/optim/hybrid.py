"""Checkpoints of megatron-core 0.16.1's HybridDeviceOptimizer (``optim.optimizer_cpu_offload``).

Inside the distributed optimizer the hybrid optimizer keeps, per param shard of this rank, an fp32 master
copy (on the host for the offloaded fraction, on the device otherwise) and the Adam moments of the
sub-optimizer that steps it: torch's CPU AdamW for the host part, the GPU Adam (TE FusedAdam, else torch
AdamW) for the rest. Its ``state`` mirrors the sub-optimizers' (``master_param`` is the fp32 copy itself).

The checkpoint is megatron-core's ``fully_reshardable`` one: per model param its fp32 ``param``,
``exp_avg`` and ``exp_avg_sq`` in the param's shape and sharding, the same keys as the plain distributed
optimizer's. Nothing in it depends on the host/device split, so a resume may change
``optimizer_offload_fraction`` (or ``overlap_cpu_optimizer_d2h_h2d``): the state is split anew by this
run's settings. What this module adds to megatron-core's path:

- ``ensure_state``: zero state (step 0) before anything is saved or loaded, exactly what the first step
  creates (megatron-core would take a ``dummy_step`` with random gradients instead).
- ``GROUP_KEYS``: the hybrid optimizer copies its own settings, two optimizer *classes* among them, into
  every param group; they describe this run, not training state, and a ``weights_only`` load refuses
  classes, so they are not saved and are put back from this run's optimizer after a load.
- ``in_place_state`` / ``load_in_place``: when this rank's shards are whole params (data-parallel size 1,
  the one-GPU 7B-8B case) the same checkpoint is written from and read into the live state tensors.
  megatron-core's exchange would first gather everything into new host tensors (12 bytes per param, plus
  as much again while it gathers), which the host that holds the offloaded state does not have room for.
- At DP>1 megatron-core's exchange runs in its memory-efficient form (``MegatronOptimizer``): gathered
  over gloo into DP rank 0's host memory instead of an all-gather through device memory.
- ``set_step``: the Adam step from ``host_state``; megatron-core copies the hybrid optimizer's param-group
  keys onto its sub-optimizers before every step, so a loaded group ``step`` would pin TE FusedAdam's
  (per-group) step at the loaded value.
- ``release_loaded``: after megatron-core's load the host part's state tensors are views into the whole
  loaded tensors, and ``master_param`` is a second fp32 copy beside the master param; both are let go.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from megatron_rl.optim.base import ensure_adam_state

# HybridDeviceOptimizer.__init__'s own arguments (offload_fraction .. overlap_cpu_optimizer_d2h_h2d)
GROUP_KEYS = tuple(inspect.signature(HybridDeviceOptimizer.__init__).parameters)[2:-1]
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # megatron-core's fully_reshardable tensors per param
FORMAT = "fully_reshardable"


def _torch_adam(opt) -> bool:
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


def ensure_state(hdo: HybridDeviceOptimizer) -> None:
    """Zero Adam state (step 0) for every param that has none, as each sub-optimizer's first step makes it."""
    for sub in hdo.sub_optimizers:
        if _torch_adam(sub):
            ensure_adam_state(sub)
        elif hasattr(sub, "initialize_state"):  # TE FusedAdam: zero moments, its step lives in the group
            for group in sub.param_groups:
                for p in group["params"]:
                    if not sub.state[p]:
                        sub.initialize_state(p, False)
    hdo._sync_sub_optimizers_state_to_hdo()


def strip_groups(state: dict) -> dict:
    """Drop ``GROUP_KEYS`` from the param groups of a distributed optimizer's (sharded) state dict."""
    for group in state["optimizer"]["param_groups"]:
        for key in GROUP_KEYS:
            group.pop(key, None)
    return state


def restore_groups(hdo: HybridDeviceOptimizer) -> None:
    for group in hdo.param_groups:
        group.update({k: hdo.defaults[k] for k in GROUP_KEYS})


def whole_params(dist_opt) -> bool:
    """Whether this rank's optimizer shards are whole params (data-parallel size 1)."""
    return dist_opt.data_parallel_group.size() == 1


def _live_tensors(dist_opt):
    """(model param, {key: its live fp32 state tensor [numel]}) in ``fully_reshardable`` order."""
    for buffer in dist_opt.buffers:
        for model_param in buffer.param_index_map:
            tensors = dist_opt._get_main_param_and_optimizer_states(model_param)
            yield model_param, {key: tensors[key] for key in STATE_KEYS}


def in_place_state(dist_opt, model_sharded_state_dict: dict) -> dict:
    """megatron-core's ``fully_reshardable`` sharded state dict with the live state tensors as data (no
    gather, no copy): for ``dist_checkpointing.save`` and, as the target it fills, for ``load``. Needs
    ``whole_params``; keys and order are ``DistributedOptimizer.sharded_param_state_fully_reshardable``'s."""
    model_sd, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    meta = {sh.data: sh for sh in nested_values(model_sd)}
    param_state = {}
    for idx, (model_param, live) in enumerate(_live_tensors(dist_opt)):
        sh, entry = meta[model_param], {}
        for key, tensor in live.items():
            data = tensor.view(sh.data.shape)  # [numel] -> the param's shape, same storage
            kwargs = dict(key=f"optimizer.state.{key}.{sh.key}", data=data, dtype=data.dtype,
                          replica_id=sh.replica_id)  # fmt: skip
            if isinstance(sh, ShardedTensorFactory):
                kwargs.pop("dtype")
            entry[key] = replace(sh, **kwargs)
            entry[key].validate_metadata_integrity()
        param_state[idx] = entry
    return {
        **strip_groups(dist_opt.state_dict()),
        "param_state": param_state,
        "param_state_sharding_type": FORMAT,
    }


def load_in_place(dist_opt, loaded: dict) -> None:
    """Apply what ``dist_checkpointing.load`` returned for ``in_place_state``: tensors it loaded into the
    live ones need nothing (a factory's merged tensor, e.g. a TP-split GLU weight, is copied over); the
    param groups' hyperparameters (lr, betas, eps, weight decay) come from the checkpoint."""
    for idx, (_, live) in enumerate(_live_tensors(dist_opt)):
        for key, tensor in live.items():
            got = loaded["param_state"][idx][key]
            if got.data_ptr() != tensor.data_ptr():
                tensor.copy_(got.reshape(-1))
    hdo = dist_opt.optimizer
    saved = {_group_id(g): g for g in loaded["optimizer"]["param_groups"]}
    for group in hdo.param_groups:
        group.update(
            {k: v for k, v in saved[_group_id(group)].items() if k not in ("params", "step", *GROUP_KEYS)}
        )


def _group_id(group: dict) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def release_loaded(hdo: HybridDeviceOptimizer) -> None:
    """After megatron-core's load: own storage for every state tensor, ``master_param`` = the fp32 param."""
    for sub in hdo.sub_optimizers:
        for st in sub.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.untyped_storage().nbytes() > v.numel() * v.element_size():
                    st[k] = v.clone()
    hdo._sync_sub_optimizers_state_to_hdo()


def set_step(hdo: HybridDeviceOptimizer, step: int) -> None:
    """Every sub-optimizer at Adam step ``step``: torch Adam per param (a tensor of its own), others
    (TE FusedAdam) per group; the hybrid optimizer's own groups carry none."""
    for group in hdo.param_groups:
        group.pop("step", None)
    for sub in hdo.sub_optimizers:
        for group in sub.param_groups:
            if not _torch_adam(sub):
                group["step"] = step
                continue
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                device = p.device if on_device else "cpu"
                sub.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
