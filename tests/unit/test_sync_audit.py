"""``benchmarks/sync_audit.py``: torch's sync-debug warnings counted by the project line that made them and
by the phase of the training step (CPU: the warnings are raised here as torch raises them on CUDA)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sync_audit import SYNC_MESSAGE, SyncAudit  # noqa: E402

# functions whose code lives at project paths, as the trainer's do: train_step -> scored_rollout -> rollout
# -> a sync two frames down (a helper outside the project, as torch's own Python would be)
_SRC = {
    "/repo/megatron_rl/trainer/run.py": (
        "def train_step(k):\n"
        "    scored_rollout(k)\n"
        "    update(k)\n"
        "def scored_rollout(k):\n"
        "    rollout(k)\n"
        "def update(k):\n"
        "    for _ in range(k):\n"
        "        sync()\n"
    ),
    "/repo/megatron_rl/rollout/engine.py": "def rollout(k):\n    sync()\n    sync()\n",
    "/site-packages/torch/fake.py": "def sync():\n    warn(MESSAGE, UserWarning)\n",
}


def _load() -> dict:
    ns = {"warn": warnings.warn, "MESSAGE": SYNC_MESSAGE}
    for path, src in _SRC.items():
        exec(compile(src, path, "exec"), ns)
    return ns


def test_syncs_are_counted_by_project_line_and_step_phase():
    ns = _load()
    with SyncAudit() as audit:
        ns["train_step"](3)
        ns["sync"]()  # outside a step
    rep = audit.report()
    assert rep["syncs"] == 6
    # the innermost project frame, not torch's: two calls on two lines of rollout, three on one of update
    assert rep["sites"] == {
        "megatron_rl/trainer/run.py:8 update": 3,
        "megatron_rl/rollout/engine.py:2 rollout": 1,
        "megatron_rl/rollout/engine.py:3 rollout": 1,
        "/site-packages/torch/fake.py:2 sync": 1,
    }
    phases = rep["phases"]
    assert phases["train_step:2 > scored_rollout > rollout"]["syncs"] == 2
    assert phases["train_step:3 > update"] == {
        "syncs": 3,
        "sites": {"megatron_rl/trainer/run.py:8 update": 3},
    }
    assert phases["outside a step"]["syncs"] == 1


def test_other_warnings_still_show_and_the_filters_come_back():
    ns = _load()
    shown = []
    before = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
    try:
        with SyncAudit() as audit:
            warnings.warn("something else", stacklevel=1)
            ns["sync"]()
    finally:
        warnings.showwarning = before
    assert shown == ["something else"] and audit.report()["syncs"] == 1
    assert warnings.showwarning is before
