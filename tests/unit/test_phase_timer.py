"""PhaseTimer (moved to logging): times phases, bounds each through the phase watchdog with a description
of its work; step_perf's throughput per GPU."""

from __future__ import annotations

import torch

from megatron_rl.distributed import phase_watchdog
from megatron_rl.logging.perf import step_perf
from megatron_rl.logging.timer import PHASE_WORK, PhaseTimer


def test_phase_timer_times_and_bounds_each_phase_with_what_it_runs():
    timer = PhaseTimer(timeout_minutes=7.0)
    with timer.bounded("val"):
        with timer("reward"):
            assert phase_watchdog._state["stack"][-2:] == [("val", 7.0, PHASE_WORK["val"]),
                                                          ("reward", 7.0, PHASE_WORK["reward"])]  # fmt: skip
    assert phase_watchdog._state["stack"] == []
    out = timer.metrics()
    assert set(out) == {"timing_s/reward"} and out["timing_s/reward"] >= 0  # "val" only groups phases
    assert "reward function" in PHASE_WORK["reward"] and timer.metrics() == {}


def test_step_perf_throughput_per_gpu():
    out = step_perf(torch.tensor(1200.0), 2.0, 1.0, world_size=4, num_params=10, epochs=1)
    assert out["perf/throughput"] == 150.0
    assert ("perf/mfu" in out) == torch.cuda.is_available()
