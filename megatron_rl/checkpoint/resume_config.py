"""What a resumed run does with a setting that differs from the checkpointed run's (``state.json["config"]``).

Every changed key is either applied and logged, or refused with the key, both values and what to do; none
is ignored silently. Most keys are read from the config at every step, so the new value simply applies.
The exceptions are values the checkpoint restores over the config:

- the LR schedule (``*.optim.lr``, warmup, decay style, min ratio): applied; the peak LR stored with the
  scheduler is replaced (``apply_schedule``) and the LR is recomputed for the resumed step. A checkpoint
  written before the schedule counted training steps has its position converted (``schedule_position``);
- AdamW's betas / eps / weight decay: refused (the moments were accumulated with the old values, and the
  megatron backend restores its param groups from the checkpoint);
- the KL controller: refused (its current coefficient is training state).

Some changes are refused further on with their own message: the data order and batch size (the data
loader), the optimizer kind (``check_optimizer_backend``), a role the checkpoint lacks. The applied
changes are logged only once the checkpoint has loaded, so a refused resume prints no "applied" line.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.checkpoint.layout import CheckpointError

# In each optimizer's state.json entry: the LR scheduler's position counts training steps (updates).
# Entries without it were written when the scheduler stepped once per optimizer step (mini-batch).
SCHEDULE_UNIT_KEY, SCHEDULE_UNIT = "lr_schedule_unit", "training_step"
SCHEDULE = ("optim.lr", "optim.lr_warmup_steps", "optim.lr_decay_style", "optim.min_lr_ratio")
REFUSED = {
    "optim.betas": "AdamW's moments were accumulated with the old betas",
    "optim.eps": "AdamW's state was built with the old eps",
    "optim.weight_decay": "the megatron backend restores weight decay from the checkpoint's param groups",
    "algorithm.kl_ctrl.": "the KL controller's coefficient is training state restored from the checkpoint",
}


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object

    def show(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def flatten(cfg: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def changes(saved: dict, now: dict) -> list[Change]:
    """Keys whose value differs (keys only one side has count too: a key added or removed since)."""
    old, new = flatten(saved), flatten(now)
    missing = "<absent>"
    return [
        Change(k, old.get(k, missing), new.get(k, missing))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, missing) != new.get(k, missing)
    ]


def _matches(key: str, pattern: str) -> bool:
    return (
        key == pattern or key.endswith("." + pattern) or (pattern.endswith(".") and key.startswith(pattern))
    )


def is_schedule(key: str) -> bool:
    return any(_matches(key, p) for p in SCHEDULE)


def review(found: list[Change], path) -> list[str]:
    """Raise ``CheckpointError`` for refused changes; return one log line per applied change."""
    refused = [(c, why) for c in found for p, why in REFUSED.items() if _matches(c.key, p)]
    if refused:
        lines = "; ".join(f"{c.show()} ({why})" for c, why in refused)
        raise CheckpointError(
            f"{path} was written with other settings that a resume cannot honour: {lines}. Set them back to the "
            "checkpoint's values to resume, or start over on purpose with trainer.resume_mode=disable"
        )
    notes = []
    for c in found:
        how = "applied to the LR schedule from the resumed step" if is_schedule(c.key) else "applied"
        notes.append(f"megatron-rl: resume: {c.show()} since the checkpoint; {how}")
    return notes


def schedule_peak(found: list[Change], role: str) -> float | None:
    """The new peak LR of ``role`` when ``<role>.optim.lr`` changed, else None."""
    for c in found:
        if c.key == f"{role}.optim.lr":
            return float(c.new)
    return None


def apply_schedule(sched, peak_lr: float | None) -> None:
    """Make a loaded ``LambdaLR`` follow this run's schedule: a new peak LR if given, and the LR of its
    current step recomputed (the multiplier function already is this run's). Writes through the
    scheduler's own param groups, as its ``step()`` does."""
    if peak_lr is not None:
        sched.base_lrs = [peak_lr] * len(sched.base_lrs)
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, base, lr in zip(sched.optimizer.param_groups, sched.base_lrs, lrs):
        group["initial_lr"], group["lr"] = base, lr
    sched._last_lr = lrs


def schedule_position(sched, saved_opt: dict, role: str, step: int, saved_config: dict) -> str | None:
    """Move a loaded ``LambdaLR`` written by the old per-optimizer-step convention (``saved_opt``, the role's
    ``state.json["optimizers"]`` entry, has no ``lr_schedule_unit``) to this role's count of updates after
    ``step`` training steps: every step for the critic, the steps from ``trainer.critic_warmup`` on for the
    actor (``saved_config``: the checkpointed run's). Returns the log line, or None when nothing changed."""
    if saved_opt.get(SCHEDULE_UNIT_KEY) == SCHEDULE_UNIT:
        return None
    warmup = int(saved_config.get("trainer", {}).get("critic_warmup", 0)) if role == "actor" else 0
    was, sched.last_epoch = sched.last_epoch, max(0, step - warmup)
    apply_schedule(sched, None)
    return (
        f"megatron-rl: resume: {role} LR schedule position {was} (optimizer steps, a checkpoint from before "
        f"the schedule counted training steps) -> {sched.last_epoch} training steps"
    )
