"""Per-phase wall-clock timing for one training step, reported as ``timing_s/<phase>``; ``PhaseTimer`` also
bounds each phase by ``trainer.timeout_minutes`` and records its peak GPU memory."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from megatron_rl.distributed.phase_watchdog import phase
from megatron_rl.logging.metric_names import timing_key


def annotate(name: str):
    """``torch.profiler.record_function(name)`` while a profiler runs, else a no-op context: host phases
    named in a trace (``benchmarks/device_gaps.py`` sums the device's idle gaps by them) at no cost in hot
    loops otherwise. A phase entered before the profiler started is not named in its trace."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):  # a private flag: name when unsure
        return torch.profiler.record_function(name)
    return nullcontext()


def _cuda_ready() -> bool:
    # Never initialise CUDA just to time something.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class Timer:
    """Accumulates seconds per phase: ``with timer("gen"): ...``; ``timer.metrics()`` -> ``timing_s/gen``.

    GPU work is asynchronous, so with ``cuda_sync`` (default: when CUDA is in use) the device is
    synchronised at both ends of a phase; otherwise a phase would be charged for work queued before it.
    A phase entered several times in one step adds up.
    """

    def __init__(self, cuda_sync: bool | None = None) -> None:
        self.cuda_sync = cuda_sync
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda_sync or (self.cuda_sync is None and _cuda_ready()):
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not phase or "/" in phase:
            raise ValueError(f"timer phase {phase!r} must be a non-empty name without '/', e.g. 'gen'")
        self._sync()
        start = time.perf_counter()
        try:
            with annotate(f"phase.{phase}"):
                yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        """Charge ``seconds`` measured elsewhere (host time of work that overlaps the device's, unsynced) to ``phase``."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}`` for the phases timed since the last reset."""
        out = {timing_key(phase): s for phase, s in self.seconds.items()}
        if reset:
            self.seconds = {}
        return out


# What each trainer phase runs, for the error when one outlives trainer.timeout_minutes.
PHASE_WORK = {
    "gen": "generation with the rollout engine",
    "old_log_prob": "the actor's log-prob recompute",
    "ref": "the reference model's log-probs",
    "values": "the critic's values",
    "reward": "scoring: the reward function (reward.reward_fn, reward.custom_reward_function) or reward model",
    "adv": "advantage estimation",
    "update_critic": "the critic update (with reward.overlap it may include scoring, see reward)",
    "update_actor": "the actor update (with reward.overlap it may include scoring, see reward)",
    "val": "validation (generation and scoring on data.val_files)",
    "save_checkpoint": "a checkpoint write",
}


class PhaseTimer(Timer):
    """Times each phase (``timing_s/<phase>``) and bounds it: a phase running longer than
    ``timeout_minutes`` (and a collective timeout inside it) becomes an error naming the phase and the
    rank instead of a silent hang. On GPU it also records each phase's peak allocated memory
    (``perf/max_memory_allocated_gb/<phase>``, GiB, this rank)."""

    def __init__(self, timeout_minutes: float):
        super().__init__()
        self.timeout_minutes = timeout_minutes
        self.peak_gib: dict[str, float] = {}
        self.peak_outside_gib = 0.0  # peaks between phases (each phase resets the allocator's counter)

    @contextmanager
    def __call__(self, name: str):
        cuda = _cuda_ready()
        if cuda:
            outside = torch.cuda.max_memory_allocated() / 2**30
            self.peak_outside_gib = max(self.peak_outside_gib, outside)
            torch.cuda.reset_peak_memory_stats()
        with super().__call__(name), phase(name, self.timeout_minutes, PHASE_WORK.get(name)):
            yield
        if cuda:
            peak = torch.cuda.max_memory_allocated() / 2**30
            self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), peak)

    def bounded(self, name: str):
        """A named, bounded phase without a timing metric (it only groups the phases inside it)."""
        return phase(name, self.timeout_minutes, PHASE_WORK.get(name))

    def metrics(self, reset: bool = True) -> dict[str, float]:
        out = super().metrics(reset)
        out |= {f"perf/max_memory_allocated_gb/{k}": v for k, v in self.peak_gib.items()}
        if self.peak_gib and torch.cuda.is_available():
            now = torch.cuda.max_memory_allocated() / 2**30
            out["perf/max_memory_allocated_gb"] = max(now, self.peak_outside_gib, *self.peak_gib.values())
        if reset:
            self.peak_gib, self.peak_outside_gib = {}, 0.0
        return out
