"""``trainer.collector``: Python's garbage collector around the training loop (``trainer.gc_freeze``,
``trainer.manual_gc_interval``), and the interpreter left as it was found."""

import gc
import weakref

import pytest

from megatron_rl.trainer.collector import Collector


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def _restore_gc():
    """Whatever a test does, the worker's collector is as it was after it."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if gc.get_freeze_count() != frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_freeze_moves_the_setup_objects_out_of_the_collector_and_close_restores_it():
    assert gc.get_freeze_count() == 0
    setup = [_Cycle() for _ in range(100)]  # what setup built and keeps (tracked, in cycles)
    garbage = weakref.ref(_Cycle())  # setup's cyclic garbage
    with Collector(freeze=True, interval=0) as c:
        c.settle()
        assert garbage() is None  # collected before the freeze, not frozen for the run
        assert not any(o is setup[0] for o in gc.get_objects())  # frozen: later collections do not walk it
        assert gc.isenabled() and c.take_pause_s() == 0.0  # setup's collection is not a step's
        gc.collect()  # a collection during a step is timed
        assert c.take_pause_s() > 0.0 and c.take_pause_s() == 0.0
        c.settle()  # again (its own freeze found): still the owner of the freeze
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert any(o is setup[0] for o in gc.get_objects())  # walked again
    assert c._timed not in gc.callbacks


def test_manual_interval_turns_automatic_collection_off_and_collects_every_n_steps():
    collected = []

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            collected.append(info)

    gc.callbacks.append(count)
    try:
        with Collector(freeze=False, interval=3) as c:
            c.settle()
            assert not gc.isenabled() and gc.get_freeze_count() == 0
            for step in range(1, 7):
                collected.clear()
                c.after_step(step)
                assert bool(collected) == (step % 3 == 0), step
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)


def test_close_undoes_only_what_settle_did():
    """No settle: close changes nothing. Another party's freeze and a collector switched off before stay so;
    settle still freezes what came after that freeze (on the device something froze a few hundred objects
    before the trainer's setup, and the runs went unfrozen: session 41); nested collectors: the inner one's
    close leaves the outer one's state."""
    mine = _Cycle()
    gc.freeze()  # someone else's freeze
    gc.disable()
    with Collector(freeze=True, interval=2):
        pass  # never settled
    assert gc.get_freeze_count() > 0 and not gc.isenabled()
    before = gc.get_freeze_count()
    later = [_Cycle() for _ in range(20)]  # setup's objects, after the other party's freeze
    with Collector(freeze=True, interval=2) as c:
        c.settle()  # the switch was off already: not its own
        assert gc.get_freeze_count() >= before + 20 and not any(o is later[0] for o in gc.get_objects())
        first = [_Cycle() for _ in range(20)]
        c.after_first_step()
        assert not any(o is first[0] for o in gc.get_objects())
    assert gc.get_freeze_count() >= before + 40 and not gc.isenabled()  # close cannot unfreeze its part alone
    gc.unfreeze()
    gc.enable()
    with Collector(freeze=True, interval=2) as outer:
        outer.settle()
        with Collector(freeze=True, interval=2) as inner:
            inner.settle()
        assert gc.get_freeze_count() > 0 and not gc.isenabled()  # still the outer one's
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    del mine


def test_the_default_freezes_and_collects_automatically():
    from megatron_rl.config.schema import JobConfig

    tr = JobConfig().trainer
    assert tr.gc_freeze is True and tr.manual_gc_interval == 0


def test_after_the_first_step_what_it_built_is_frozen_too_and_its_garbage_collected():
    """The first step builds what the run keeps (on a GPU: compiled kernels, graphs, caches); with gc_freeze
    it is frozen after that step (its cyclic garbage collected first, between steps: not in timing_s/gc),
    once settle froze; without gc_freeze nothing is frozen; close unfreezes both."""
    with Collector(freeze=True, interval=0) as c:
        c.settle()
        after_setup = gc.get_freeze_count()
        kept = [_Cycle() for _ in range(50)]  # the first step's caches
        garbage = weakref.ref(_Cycle())
        gc.collect()  # a collection inside the step: timed
        step_pause = c.pause_s
        c.after_first_step()
        assert garbage() is None and gc.get_freeze_count() >= after_setup + 50
        assert step_pause > 0 and c.take_pause_s() == step_pause  # its own collection is in no step's time
        assert not any(o is kept[0] for o in gc.get_objects())
    assert gc.get_freeze_count() == 0 and any(o is kept[0] for o in gc.get_objects())
    with Collector(freeze=False, interval=0) as c:
        c.settle()
        c.after_first_step()
        assert gc.get_freeze_count() == 0
