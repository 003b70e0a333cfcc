"""Save and resume a training run: ``save_checkpoint(components, step)``, ``resume(components)``.

Collective: every rank calls both. Writes go to ``.tmp_global_step_<N>/`` and are renamed into place
once every rank has finished; the pointer file is written after the rename, so a process killed at any
moment leaves the previous checkpoint intact and loadable (see ``layout.py``).
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.checkpoint.layout import (
    DIST,
    HF,
    RNG,
    STATE,
    TMP_PREFIX,
    CheckpointError,
    ckpt_root,
    newest_complete,
    publish,
    remove_stale_tmp,
    resolve_resume_path,
    rotate,
    step_dir_name,
    truncate_metrics,
    write_json_atomic,
    write_manifest,
    write_pointer,
)
from megatron_rl.checkpoint.state import (
    apply_loaded_optim,
    capture_rng,
    check_optimizer_backend,
    load_optimizer_json,
    optimizer_json,
    restore_rng,
    role_sharded_state,
)
from megatron_rl.models.hf_io import copy_hf_side_files

FORMAT_VERSION = 1
# Test hook: SIGKILL rank 0 in the middle of writing the checkpoint of this step (after the tensors are
# written, before the directory is published), as a preempted or OOM-killed job would be.
KILL_ENV = "MEGATRON_RL_TEST_KILL_IN_SAVE"
RESUME_MODES = ("auto", "disable", "path")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _trained(c) -> dict:
    """role -> worker for the models whose weights and optimizer a checkpoint holds."""
    out = {"actor": c.actor}
    if c.critic is not None:
        out["critic"] = c.critic
    return out


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _sharded(c, is_loading: bool = False) -> dict:
    return {
        role: role_sharded_state(role, _unwrap(w.model), w.opt, is_loading) for role, w in _trained(c).items()
    }


def _layout(c) -> dict:
    d = c.dims
    return {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "dp": d.dp}


def _host_state(c, step: int) -> dict:
    data = c.train_loader.state_dict()
    # The loop reads batches by step (random access), so the position is derived from the step.
    data["epoch"], data["offset"] = divmod(step, c.train_loader.steps_per_epoch)
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "layout": _layout(c),
        "roles": list(_trained(c)),
        "data": data,
        "kl_ctrl": c.kl_ctrl.state_dict(),
        "optimizers": {role: optimizer_json(w.opt, w.sched) for role, w in _trained(c).items()},
    }


def _hf_source_dir(c) -> Path | None:
    """The HF directory the run was built from (config.json + tokenizer), via the tokenizer's origin."""
    from megatron_rl.models.args import find_hf_config

    found = find_hf_config(Path(getattr(c.tokenizer, "name_or_path", "") or "."))
    return None if found is None else found.parent


def save_hf(c, out_dir: Path) -> None:
    """HF export of the actor (safetensors + config.json + tokenizer) on rank 0. Collective."""
    from megatron_rl.models import export_hf_state_dict
    from megatron_rl.models.hf_io import write_safetensors

    state = export_hf_state_dict(c.actor.model, c.args)
    if _rank() != 0:
        return
    write_safetensors({k: v.contiguous() for k, v in state.items()}, out_dir)
    copy_hf_side_files(_hf_source_dir(c), out_dir)
    c.tokenizer.save_pretrained(str(out_dir))


MODEL_SIDE = "hf_config"  # config.json + tokenizer, so a checkpoint alone can be converted or sampled


def _write_model_side(c, step_dir: Path, step: int) -> None:
    """The actor's HF config + tokenizer and its ModelArgs next to the weights (rank 0): what
    ``megatron_to_hf`` and ``megatron-rl generate model.path=<global_step_N>`` need to read it at any TP/PP."""
    from megatron_rl.checkpoint.convert import META_FILE

    side = step_dir / MODEL_SIDE
    side.mkdir(parents=True, exist_ok=True)
    copy_hf_side_files(_hf_source_dir(c), side)
    c.tokenizer.save_pretrained(str(side))
    meta = {"format": "trainer", "tp": c.dims.tp, "pp": c.dims.pp, "role": "actor", "iteration": step,
            "model_args": c.args.to_dict()}  # fmt: skip
    write_json_atomic(step_dir / META_FILE, meta)


def _maybe_test_kill(step: int) -> None:
    if os.environ.get(KILL_ENV) == str(step) and _rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def _require_psutil() -> None:
    try:
        import psutil  # noqa: F401
    except ImportError as err:
        raise CheckpointError(
            "trainer.save_freq > 0 needs psutil: megatron-core's checkpoint writer processes fail without it "
            "and the save would hang. Install it (pip install psutil) or set trainer.save_freq=-1"
        ) from err


def save_checkpoint(c, step: int) -> Path:
    """Write ``<output_dir>/checkpoints/global_step_<step>/`` atomically; keep the newest
    ``trainer.max_ckpt_to_keep``. Collective. Returns the checkpoint directory."""
    _require_psutil()
    tr = c.cfg.trainer
    root = ckpt_root(tr.output_dir)
    final = root / step_dir_name(step)
    tmp = root / (TMP_PREFIX + final.name)
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(root)
        (tmp / DIST).mkdir(parents=True)
        (tmp / RNG).mkdir()
    _barrier()
    dist_checkpointing.save(_sharded(c), str(tmp / DIST))
    torch.save(capture_rng(), tmp / RNG / f"rank_{rank:05d}.pt")
    if tr.save_hf:
        save_hf(c, tmp / HF)
    if rank == 0:
        write_json_atomic(tmp / STATE, _host_state(c, step))
        _write_model_side(c, tmp, step)
    _barrier()
    _maybe_test_kill(step)
    if rank == 0:
        write_manifest(tmp, step)
        publish(tmp, final)
        write_pointer(root, step)
        rotate(root, tr.max_ckpt_to_keep)
    _barrier()
    return final


def _broadcast(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def find_checkpoint(cfg) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` selects (decided on rank 0, the same on every rank)."""
    tr = cfg.trainer
    if tr.resume_mode not in RESUME_MODES:
        raise CheckpointError(f"trainer.resume_mode={tr.resume_mode!r}; use one of {', '.join(RESUME_MODES)}")
    if tr.resume_mode == "path" and not tr.resume_from_path:
        raise CheckpointError("trainer.resume_mode=path needs trainer.resume_from_path=<global_step_N dir>")
    found: Path | str | None = None
    if _rank() == 0:
        try:
            if tr.resume_mode == "auto":
                found = newest_complete(ckpt_root(tr.output_dir))
            elif tr.resume_mode == "path":
                found = resolve_resume_path(tr.resume_from_path)
        except CheckpointError as err:
            found = f"error: {err}"
    found = _broadcast(None if found is None else str(found))
    if found is not None and found.startswith("error: "):
        raise CheckpointError(found[len("error: ") :])
    return None if found is None else Path(found)


def _check_roles(c, state: dict, path: Path) -> None:
    for role in _trained(c):
        if role not in state["roles"]:
            raise CheckpointError(
                f"{path} has no {role} (it holds {state['roles']}); the checkpointed run used another "
                "algorithm.adv_estimator. Resume with the same algorithm, or trainer.resume_mode=disable"
            )


def _restore_rng(c, path: Path, state: dict, step: int) -> None:
    rng_file = path / RNG / f"rank_{_rank():05d}.pt"
    if state["layout"] == _layout(c) and rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=True))
        return
    from megatron_rl.distributed import seed_everything

    if _rank() == 0:
        warnings.warn(f"{path} was saved with layout {state['layout']}, this run is {_layout(c)}: weights and "
                      "optimizer state are resharded, RNG streams are re-seeded from trainer.seed + step",
                      stacklevel=2)  # fmt: skip
    seed_everything(c.cfg.trainer.seed + step)


def load_checkpoint(c, path: Path) -> int:
    """Load weights, optimizer, scheduler, data position, KL controller and RNG from ``path``. Collective.
    Returns the step the checkpoint was taken after."""
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / STATE} is unreadable ({err}); pick another checkpoint") from err
    _check_roles(c, state, path)
    for role, w in _trained(c).items():
        check_optimizer_backend(role, state["optimizers"][role], w.opt, path)
    sharded = _sharded(c, is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(path / DIST))
    for role, w in _trained(c).items():
        prefix = f"{role}."
        model_sd = {k[len(prefix) :]: v for k, v in loaded[role]["model"].items()}
        _unwrap(w.model).load_state_dict(model_sd)
        apply_loaded_optim(w.opt, loaded[role]["optim"])
        load_optimizer_json(w.opt, w.sched, state["optimizers"][role])
    step = int(state["step"])
    c.train_loader.load_state_dict(state["data"])
    c.kl_ctrl.load_state_dict(state["kl_ctrl"])
    _restore_rng(c, path, state, step)
    return step


def resume(c) -> int:
    """Apply ``trainer.resume_mode`` and return the step to continue from (0 = fresh start).

    Also cuts ``metrics.jsonl`` back to that step, so a resumed run's file reads like an uninterrupted
    one. Collective.
    """
    tr = c.cfg.trainer
    path = find_checkpoint(c.cfg)
    step = 0 if path is None else load_checkpoint(c, path)
    if _rank() == 0:
        dropped = truncate_metrics(tr.output_dir, step)
        if path is not None:
            print(f"megatron-rl: resumed from {path} (step {step}); {dropped} metric lines after it dropped",
                  flush=True)  # fmt: skip
        elif dropped:
            print(
                f"megatron-rl: starting fresh; {dropped} old metric lines in {tr.output_dir} dropped",
                flush=True,
            )
        if step >= c.total_steps:
            print(f"megatron-rl: the checkpoint at step {step} already reached the last step ({c.total_steps}); "
                  "nothing to train. Raise trainer.total_training_steps (or trainer.total_epochs) to "
                  "continue", flush=True)  # fmt: skip
    _barrier()
    return step


def load_model_weights(model, path: str | Path, role: str = "actor") -> None:
    """Load one model's weights from a ``global_step_<N>`` checkpoint at this run's TP/PP (resharded by
    dist_checkpointing). Collective; for evaluation and generation from a training checkpoint."""
    core = _unwrap(model)
    loaded = dist_checkpointing.load(
        {role: {"model": core.sharded_state_dict(prefix=f"{role}.")}}, str(Path(path) / DIST)
    )
    prefix = f"{role}."
    core.load_state_dict({k[len(prefix) :]: v for k, v in loaded[role]["model"].items()})
