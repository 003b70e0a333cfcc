"""Per-phase wall-clock timing for one training step, reported as ``timing_s/<phase>``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megatron_rl.logging.metric_names import timing_key


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
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}`` for the phases timed since the last reset."""
        out = {timing_key(phase): s for phase, s in self.seconds.items()}
        if reset:
            self.seconds = {}
        return out
