"""``trainer.collector``: Python's garbage collector around the training loop (``trainer.gc_freeze``,
``trainer.manual_gc_interval``), and the interpreter left as it was found."""

import gc

from megatron_rl.trainer.collector import Collector


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_moves_the_setup_objects_out_of_the_collector_and_close_restores_it():
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    setup = [{"layer": i} for i in range(1000)]  # what setup built, still referenced
    _Cycle()  # setup's cyclic garbage: settle collects it before freezing
    with Collector(freeze=True, interval=0) as c:
        c.settle()
        assert gc.get_freeze_count() >= len(setup)  # frozen: later collections do not walk them
        assert gc.isenabled() and c.take_pause_s() == 0.0  # setup's collection is not a step's
        gc.collect()  # an automatic-like collection during a step is timed
        assert c.take_pause_s() > 0.0 and c.take_pause_s() == 0.0
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert all(cb.__self__ is not c for cb in gc.callbacks if hasattr(cb, "__self__"))


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


def test_the_default_freezes_and_collects_automatically():
    from megatron_rl.config.schema import JobConfig

    tr = JobConfig().trainer
    assert tr.gc_freeze is True and tr.manual_gc_interval == 0
