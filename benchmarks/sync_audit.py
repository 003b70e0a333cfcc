"""Where a training step makes the host wait for the GPU (issue 16): the synchronizing CUDA calls of one step,
counted by the project's code that made them.

A sync (``.item()``, ``.tolist()``, ``.cpu()`` of a device tensor, a boolean-mask index, ``nonzero``,
``torch.cuda.synchronize``) drains the device's queue; the device then idles until the host has launched the
next kernel. ``device_gaps.py`` says how long the device idled and in which host phase; this says which lines
asked for it. ``SyncAudit`` turns on ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA only: it warns at the
copies and stream waits that block) and, because that mode does not warn at a device-wide
``torch.cuda.synchronize`` or an ``Event.synchronize``, wraps those two while it is open. Each sync is counted
with the Python stack of its call, by the innermost frame in the ``megatron_rl`` package (``site``) and by the
phase of the step (``train_step``'s line and the project's functions below it: ``scored_rollout > rollout``,
``update > _update``...).

Not seen: syncs inside C++ extensions and torch.distributed (their warnings do not reach Python's warnings).
Attribution: a sync in a C++ backward is reported at the ``.backward()`` call; one in a Python
``autograd.Function.backward`` runs on the autograd thread and counts as "outside a step".

    python benchmarks/bench_rl_step.py ... --sync-audit $OUT/syncs.json   # one more step, not timed
"""

from __future__ import annotations

import os
import re
import traceback
import warnings
from collections import Counter
from pathlib import Path

import megatron_rl

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's text for set_sync_debug_mode("warn")
STEP_FN = "train_step"
# the imported package's folder: a frame is the project's when its file lies below it (tests point it elsewhere)
PROJECT_DIR = os.path.dirname(os.path.abspath(megatron_rl.__file__)).replace("\\", "/")


def _ours(frame: traceback.FrameSummary) -> bool:
    return frame.filename.replace("\\", "/").startswith(PROJECT_DIR + "/")


def _where(frame: traceback.FrameSummary) -> str:
    """``megatron_rl/<path>:<line> <function>`` for the project's frames, the full path for others."""
    path = frame.filename.replace("\\", "/")
    short = "megatron_rl/" + path[len(PROJECT_DIR) + 1 :] if _ours(frame) else path
    return f"{short}:{frame.lineno} {frame.name}"


def classify(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(site, phase) of a sync from its Python stack (outermost frame first): the innermost frame in
    ``megatron_rl`` (else the innermost frame), and ``train_step``'s line with the next two project
    functions below it, e.g. ``train_step:159 > scored_rollout > rollout`` (else "outside a step")."""
    ours = [f for f in stack if _ours(f)]
    site = _where(ours[-1] if ours else stack[-1])
    phase = "outside a step"
    for i, f in enumerate(ours):
        if f.name == STEP_FN:
            phase = " > ".join([f"{STEP_FN}:{f.lineno}"] + [g.name for g in ours[i + 1 : i + 3]])
    return site, phase


class SyncAudit:
    """``with SyncAudit() as audit:`` run code; ``audit.report()`` -> the syncs' counts by site and phase.

    On CUDA it sets the sync debug mode to "warn" inside and back to what it was after; the warnings it
    raises are counted, not shown. Warnings with other messages pass through as before."""

    def __init__(self) -> None:
        self.by_site: Counter[str] = Counter()
        self.by_phase: Counter[str] = Counter()
        self.pairs: Counter[tuple[str, str]] = Counter()
        self._catch = None
        self._mode = None
        self._wrapped: list = []

    def record(self, stack: list[traceback.FrameSummary]) -> None:
        site, phase = classify(stack)
        self.by_site[site] += 1
        self.by_phase[phase] += 1
        self.pairs[(phase, site)] += 1

    def _caller_stack(self) -> list[traceback.FrameSummary]:
        stack = traceback.extract_stack()[:-2]  # without this method and the hook that called it
        while len(stack) > 1 and stack[-1].filename == warnings.__file__:
            stack.pop()  # the warnings module's own frames: the call that warned is the one before
        return stack

    def __enter__(self) -> SyncAudit:
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        # every sync, not the first per line, whatever the run's filters say; other warnings as they were
        warnings.filterwarnings("always", message=re.escape(SYNC_MESSAGE))
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                self.record(self._caller_stack())
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._wrapped = []
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize")):
                self._wrap(owner, name)
        return self

    def _wrap(self, owner, name: str) -> None:
        """``owner.name`` records its caller's stack, then runs (the sync-debug mode does not warn there)."""
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.record(self._caller_stack())
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._wrapped.append((owner, name, original))

    def __exit__(self, *exc) -> None:
        import torch

        for owner, name, original in reversed(self._wrapped):
            setattr(owner, name, original)
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)

    def report(self, top: int = 40) -> dict:
        """Totals, the ``top`` sites, and the syncs per phase with each phase's sites."""
        phases = {
            phase: {"syncs": n, "sites": {s: c for (p, s), c in self.pairs.most_common() if p == phase}}
            for phase, n in self.by_phase.most_common()
        }
        return {
            "syncs": sum(self.by_site.values()),
            "sites": dict(self.by_site.most_common(top)),
            "phases": phases,
        }


def write(report: dict, path: str) -> None:
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))
