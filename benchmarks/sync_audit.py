"""Where a training step makes the host wait for the GPU (issue 16): every synchronizing CUDA call of one step,
counted by the project's code that made it.

A sync (``.item()``, ``.tolist()``, ``.cpu()`` of a device tensor, a boolean-mask index, ``nonzero``, an
explicit ``torch.cuda.synchronize``) drains the device's queue; the device then idles until the host has
launched the next kernel. ``device_gaps.py`` says how long the device idled and in which host phase; this
says which lines asked for it. ``SyncAudit`` turns on ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA
only), takes each of its warnings with the Python stack of the call, and counts them by the innermost
frame in ``megatron_rl`` (``site``) and by the phase of the step they fall in (``train_step``'s line and the
project's functions below it: ``scored_rollout > rollout``, ``update > _update``...).

    python benchmarks/bench_rl_step.py ... --sync-audit $OUT/syncs.json   # one more step, not timed
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's text for set_sync_debug_mode("warn")
PROJECT = "megatron_rl"
STEP_FN = "train_step"


def _ours(frame: traceback.FrameSummary) -> bool:
    return f"/{PROJECT}/" in frame.filename.replace("\\", "/")


def _where(frame: traceback.FrameSummary) -> str:
    path = frame.filename.replace("\\", "/")
    short = path[path.rfind(f"/{PROJECT}/") + 1 :] if f"/{PROJECT}/" in path else path
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

    def record(self, stack: list[traceback.FrameSummary]) -> None:
        site, phase = classify(stack)
        self.by_site[site] += 1
        self.by_phase[phase] += 1
        self.pairs[(phase, site)] += 1

    def __enter__(self) -> SyncAudit:
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")  # every sync, not the first per line
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                stack = traceback.extract_stack()[:-1]
                while len(stack) > 1 and stack[-1].filename == warnings.__file__:
                    stack.pop()  # the warnings module's own frames: the call that warned is the one before
                self.record(stack)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

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
