"""``benchmarks/sync_audit.py``: torch's sync-debug warnings counted by the project line that made them and
by the phase of the training step (CPU: the warnings are raised here as torch raises them on CUDA)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sync_audit  # noqa: E402
from sync_audit import SYNC_MESSAGE, SyncAudit  # noqa: E402


@pytest.fixture(autouse=True)
def _project_at_repo(monkeypatch):
    monkeypatch.setattr(sync_audit, "PROJECT_DIR", "/repo/megatron_rl")


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


def test_other_warnings_keep_the_runs_filters_and_the_hooks_come_back():
    ns = _load()
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the run's filters: show everything ...
        warnings.filterwarnings("ignore", message="muted")  # ... but this
        before = warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
        with SyncAudit() as audit:
            warnings.warn("something else", stacklevel=1)
            warnings.warn("muted here", stacklevel=1)
            ns["sync"]()
        assert warnings.showwarning is before
    assert shown == ["something else"] and audit.report()["syncs"] == 1


def test_a_warning_raised_in_torchs_cpp_is_counted_at_its_python_caller(monkeypatch):
    """The sync-debug warning comes from C++ (``TORCH_WARN``); a C++ warning that runs on the CPU stands in
    for it: counted once per call, at the line that called the op, even under an "error" filter."""
    monkeypatch.setattr(sync_audit, "SYNC_MESSAGE", "An output with one or more elements was resized")
    src = "def op(out):\n    torch.add(torch.ones(3), 1, out=out)\n"
    ns = {"torch": torch}
    exec(compile(src, "/repo/megatron_rl/kernels/fake.py", "exec"), ns)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with SyncAudit() as audit:
            for _ in range(3):
                ns["op"](torch.empty(5))
    assert audit.report()["sites"] == {"megatron_rl/kernels/fake.py:2 op": 3}


def test_wrapped_synchronize_counts_its_caller_and_is_restored():
    """``torch.cuda.synchronize`` does not warn in the sync-debug mode: the audit wraps it (here a stand-in,
    since this machine has no CUDA) and puts the original back."""
    calls = []
    owner = SimpleNamespace(synchronize=lambda: calls.append(1))
    original = owner.synchronize
    ns = {"owner": owner}
    exec(compile("def wait():\n    owner.synchronize()\n", "/repo/megatron_rl/rollout/engine.py", "exec"), ns)
    with SyncAudit() as audit:
        audit._wrap(owner, "synchronize")
        ns["wait"]()
    assert calls == [1] and owner.synchronize is original
    assert audit.report()["sites"] == {"megatron_rl/rollout/engine.py:2 wait": 1}


def test_the_audit_step_keeps_the_timed_results_and_reports_its_failure(tmp_path, monkeypatch):
    """``bench_rl_step --sync-audit``: the timed results are on disk before the audited step runs; a step that
    raises leaves them there, writes no audit, and says why in the result; one that runs writes the audit."""
    import json
    from argparse import Namespace

    import bench_rl_step
    import torch.distributed as dist

    from megatron_rl.trainer import run

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    a = Namespace(out=str(tmp_path / "out" / "bench.json"), sync_audit=str(tmp_path / "syncs.json"))

    def boom(c, step, timer):
        raise RuntimeError("out of memory in the audited step")

    monkeypatch.setattr(run, "train_step", boom)
    got = bench_rl_step.sync_audit_step(None, 3, a, {"steps": [1, 2]}, False)
    assert got == "failed: RuntimeError: out of memory in the audited step"
    assert json.loads(Path(a.out).read_text()) == {"steps": [1, 2]} and not Path(a.sync_audit).exists()
    monkeypatch.setattr(run, "train_step", lambda c, step, timer: None)
    assert bench_rl_step.sync_audit_step(None, 3, a, {"steps": [1, 2]}, False) == "written"
    assert json.loads(Path(a.sync_audit).read_text()) == {
        "syncs": 0,
        "sites": {},
        "phases": {},
        "cuda": False,
        "step": 3,
    }
