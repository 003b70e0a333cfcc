"""Python's cyclic garbage collector in the training loop (``trainer.gc_freeze``, ``trainer.manual_gc_interval``).

A trainer process holds hundreds of thousands of objects the collector tracks (modules, parameters' Python
wrappers, configs, the tokenizer, the dataset rows): a full collection walks all of them (the default config on
a 2-core CPU: ~554k tracked objects after setup, a full collection 390-410 ms; 0.01 ms once they are frozen
(benchmarks/gc_full_collection.py)), and the allocations of the steps trigger one now and then at an unplanned
point. Under SPMD a pause on one rank holds every other rank at its next collective. ``gc_freeze`` moves what
exists after setup (built, resumed) into the collector's permanent generation (``gc.freeze``), and again what
the first step left (``after_first_step``), so later collections walk only what the steps create. Objects still
go when their last reference does (reference counting is untouched); what the collector no longer frees is a
reference cycle that reaches a frozen object (with whatever hangs on it), so setup and the first step must not
build objects in cycles that later steps drop (the garbage of each is collected just before its freeze).
``manual_gc_interval`` > 0 turns automatic collection off and collects at the end of every that many steps, on
every rank at the same point (as Megatron-LM's ``--manual-gc``).
"""

from __future__ import annotations

import gc
import time


class Collector:
    """The policy of one run: ``settle`` after setup, ``after_step`` at each step's end, ``after_first_step``
    once after the first; ``take_pause_s`` gives the time the collector ran in the steps (every collection,
    automatic or manual, through ``gc.callbacks``; not those of ``settle`` and ``after_first_step``) since
    ``settle`` or the last call. ``close`` (or leaving the ``with`` block) undoes only what these did, and of
    the freezes only those made into an empty permanent generation (see ``settle``)."""

    def __init__(self, freeze: bool, interval: int):
        self.freeze, self.interval = freeze, interval
        self.pause_s, self._t0 = 0.0, None
        self._froze = self._disabled = False  # what settle changed, for close to undo
        self._owned = False  # the permanent generation was empty before settle's freeze
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pause_s += time.perf_counter() - self._t0
            self._t0 = None

    def settle(self) -> None:
        """After setup: collect what setup left, then freeze the rest (``gc_freeze``); manual mode turns the
        automatic collector off. Where something else froze objects first this freezes as well, and
        ``close`` then leaves everything frozen (the interpreter cannot unfreeze one party's objects apart
        from another's). On the benchmark device 375 objects were frozen by the time
        ``megatron_rl.trainer.run`` is imported (which import froze them is not known; none does on the CPU
        machines); settle skipped its freeze there until session 41, so every device run walked ~700k
        objects in its full collections (355 ms inside a 3B step's update:
        benchmarks/results/2026-12-07-session41)."""
        if self.freeze:
            if not self._froze:  # a second settle keeps what the first found
                self._owned = gc.get_freeze_count() == 0
            gc.collect()
            gc.freeze()
            self._froze = True
        if self.interval > 0 and gc.isenabled():
            gc.disable()
            self._disabled = True
        self.pause_s = 0.0  # the steps' time from here (not setup's collections)

    def after_first_step(self) -> None:
        """The process's first step ended and its batch was dropped: with ``gc_freeze`` (frozen by ``settle``)
        collect and freeze again. The first step builds what the run keeps (compiled kernels, CUDA graphs,
        caches: on a GPU far more than the later steps), and at the 3B benchmark shape a full collection walking
        it took 369-394 ms inside the next steps' update (benchmarks/results/2026-12-07-session39)."""
        if self._froze:
            pause = self.pause_s
            gc.collect()
            gc.freeze()
            self.pause_s = pause  # between steps: in no step's timing_s/gc

    def after_step(self, step: int) -> None:
        """``step`` (1-based) ended: a full collection every ``interval`` steps in manual mode."""
        if self.interval > 0 and step % self.interval == 0:
            gc.collect()

    def take_pause_s(self) -> float:
        """Seconds the collector ran since the last call (or ``settle``)."""
        pause, self.pause_s = self.pause_s, 0.0
        return pause

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Leave the interpreter's collector as ``settle`` found it (tests run several trainers in one process),
        but for a freeze made where something else had frozen objects first: those stay frozen until the
        process ends (so would a later trainer's cyclic garbage that reaches them)."""
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self._froze and self._owned:
            gc.unfreeze()
        self._froze = self._owned = False
        if self._disabled:
            gc.enable()
            self._disabled = False
