"""World-1 worker for tests/integration/test_checkpoint_trust.py: builds the trainer's components once, then
runs each scenario against a copy of a real run's checkpoints and prints one JSON line of results.

    python ckpt_trust_worker.py BASE_RUN WORK_DIR OVERRIDE...
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import shutil
import sys
import warnings
from pathlib import Path

import torch

from megatron_rl.checkpoint import Checkpointer, CheckpointError, check_complete
from megatron_rl.checkpoint.layout import write_manifest


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from megatron_rl.config.entry import checked_layout
    from megatron_rl.config.store import CONFIG_DIR, to_job_config

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = to_job_config(hydra_compose("config", overrides=overrides))
    return cfg, checked_layout(cfg)


def checkpointer(c, out: Path, config: dict | None = None, **trainer) -> Checkpointer:
    ck = c.checkpointer
    tr = dataclasses.replace(c.cfg.trainer, output_dir=str(out), **trainer)
    return Checkpointer(tr, ck.roles, data_loader=c.train_loader, kl_ctrl=c.kl_ctrl, side=ck.side,
                        config=config or ck.config, total_steps=c.total_steps)  # fmt: skip


def copy_run(base: Path, work: Path, name: str) -> Path:
    out = work / name
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("builtin_task", "*.lock"))
    return out


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"global_step_{step}"


def error_of(fn) -> str | None:
    try:
        fn()
    except (Exception, BaseException) as err:  # noqa: B036 - torch's CheckpointException is a BaseException
        return f"{type(err).__name__}: {err}"
    return None


def resume_with_warnings(ck: Checkpointer) -> tuple[int | str, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = ck.resume()
        except CheckpointError as err:
            step = f"{type(err).__name__}: {err}"
    return step, [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]


def fallback_on_same_size_corruption(c, base, work) -> dict:
    out = copy_run(base, work, "corrupt")
    shard = next(iter(sorted((step_dir(out, 2) / "dist").glob("*.distcp"))))
    shard.write_bytes(os.urandom(shard.stat().st_size))
    step, skipped = resume_with_warnings(checkpointer(c, out))
    return {"step": step, "skipped": skipped, "shard": shard.name}


def stop_when_every_checkpoint_is_unusable(c, base, work) -> dict:
    out = copy_run(base, work, "unusable")
    (step_dir(out, 2) / "state.json").write_text("{")  # unreadable, though the manifest agrees (rewritten)
    write_manifest(step_dir(out, 2), 2)
    (step_dir(out, 1) / "rng" / "rank_00000.pt").write_bytes(b"not a torch file")
    write_manifest(step_dir(out, 1), 1)
    before = (out / "metrics.jsonl").read_text()
    step, skipped = resume_with_warnings(checkpointer(c, out))
    return {"error": step, "skipped": skipped, "metrics_kept": (out / "metrics.jsonl").read_text() == before}


def refuse_malicious_metadata(c, base, work) -> dict:
    from megatron_rl.apps.generate_job import generate_from_config
    from megatron_rl.checkpoint import load_model_weights

    out = copy_run(base, work, "malicious")
    marker = work / "PWNED"
    ckpt = step_dir(out, 2)
    (ckpt / "dist" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(ckpt, 2)  # a crafted checkpoint is self-consistent
    ck = checkpointer(c, out, resume_mode="path", resume_from_path=str(ckpt))
    return {
        "resume": error_of(ck.resume),
        "weights": error_of(lambda: load_model_weights(c.actor.model, ckpt)),
        "generate": error_of(lambda: generate_from_config(str(ckpt), ["1+1="], c.cfg.rollout)),
        "marker": marker.exists(),
        "checkpoint": str(ckpt),
    }


def _save_on_a_full_disk(c, base, work, name: str, module, attr: str) -> dict:
    """Save step 3 with ``module.attr`` raising ENOSPC; what is left and whether step 2 still verifies."""
    out = copy_run(base, work, name)
    ck = checkpointer(c, out)
    original = getattr(module, attr)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    setattr(module, attr, no_space)
    try:
        err = error_of(lambda: ck.save(3))
    finally:
        setattr(module, attr, original)
    root = out / "checkpoints"
    return {"error": err, "left": sorted(p.name for p in root.iterdir()),
            "previous_ok": check_complete(step_dir(out, 2)) is None}  # fmt: skip


def disk_full_during_save(c, base, work) -> dict:
    """A shard write fails: megatron-core's writer processes are forked after the patch, they see it too."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return _save_on_a_full_disk(c, base, work, "diskfull", filesystem_async, "_write_item")


def disk_full_at_the_manifest(c, base, work) -> dict:
    """The disk fills up only when rank 0 writes the manifest, after every shard is written."""
    from megatron_rl.checkpoint import checkpointer as module

    return _save_on_a_full_disk(c, base, work, "diskfull_manifest", module, "write_manifest")


def refuse_nonfinite_save(c, base, work) -> dict:
    out = copy_run(base, work, "nansave")
    ck = checkpointer(c, out)
    p = next(c.actor.model.parameters())
    keep = p.detach().clone()
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    try:
        err = error_of(lambda: ck.save(3))
    finally:
        with torch.no_grad():
            p.copy_(keep)
    return {"error": err, "left": sorted(x.name for x in (out / "checkpoints").iterdir())}


def refuse_changed_betas(c, base, work) -> dict:
    out = copy_run(base, work, "betas")
    config = json.loads(json.dumps(c.checkpointer.config))
    config["actor"]["optim"]["betas"] = [0.5, 0.999]
    step, _ = resume_with_warnings(checkpointer(c, out, config=config))
    return {"error": step}


def apply_changed_lr(c, base, work) -> dict:
    """A new actor.optim.lr on resume is applied to the LR schedule and said so."""
    import contextlib
    import io

    out = copy_run(base, work, "lr")
    config = json.loads(json.dumps(c.checkpointer.config))
    old = config["actor"]["optim"]["lr"]
    config["actor"]["optim"]["lr"] = old * 0.5
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        step = checkpointer(c, out, config=config).resume()
    sched = c.checkpointer.roles["actor"].opt.scheduler
    return {"step": step, "old": old, "lr": sched.optimizer.param_groups[0]["lr"], "base": sched.base_lrs[0],
            "log": log.getvalue()}  # fmt: skip


def nonfinite_gradient_stops_or_skips(c) -> dict:
    """A gradient hook turns the actor's gradients NaN: the step stops naming step and phase, or with
    trainer.skip_nonfinite_steps the update is skipped (weights unchanged) and counted."""
    from megatron_rl.logging.timer import PhaseTimer
    from megatron_rl.trainer.run import train_step
    from megatron_rl.trainer.workers import at_step

    p = next(c.actor.model.parameters())
    hook = p.register_hook(lambda g: g * float("nan"))

    def step_3():
        with at_step(3):
            train_step(c, 2, PhaseTimer(5))

    try:
        err = error_of(step_3)
        c.actor.skip_nonfinite = True
        before = p.detach().clone()
        metrics, _ = train_step(c, 2, PhaseTimer(5))
        unchanged = torch.equal(before, p.detach())
    finally:
        hook.remove()
        c.actor.skip_nonfinite = False
    return {"error": err, "skipped": metrics.get("actor/nonfinite_skipped"), "unchanged": unchanged}


def main() -> None:
    base, work, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    from megatron_rl.distributed import init_distributed
    from megatron_rl.trainer.build import build_components

    cfg, dims = compose([f"trainer.output_dir={work / 'build'}", *overrides])
    init_distributed(1, 1, seed=cfg.trainer.seed)
    c = build_components(cfg, dims)
    results = {
        "fallback": fallback_on_same_size_corruption(c, base, work),
        "unusable": stop_when_every_checkpoint_is_unusable(c, base, work),
        "malicious": refuse_malicious_metadata(c, base, work),
        "disk_full": disk_full_during_save(c, base, work),
        "disk_full_manifest": disk_full_at_the_manifest(c, base, work),
        "nan_save": refuse_nonfinite_save(c, base, work),
        "betas": refuse_changed_betas(c, base, work),
        "lr": apply_changed_lr(c, base, work),
        "nonfinite": nonfinite_gradient_stops_or_skips(c),
    }
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
