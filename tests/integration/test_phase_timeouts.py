"""Every phase is bounded by trainer.timeout_minutes on every backend (here CPU/gloo, one process): a reward
function that never returns, during validation, ends the run quickly with an error naming the phase."""

from __future__ import annotations

import subprocess
import textwrap
import time

from megatron_rl.distributed.phase_watchdog import EXIT_STUCK
from tests.integration.cli import train

STUCK_REWARD = textwrap.dedent("""
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(3600)  # a reward function that never returns (a dead service, a deadlock)
""")


def test_reward_function_that_never_returns_ends_the_run_naming_the_phase(tmp_path):
    from megatron_rl.tasks.last_digit import _write_split

    (tmp_path / "reward.py").write_text(STUCK_REWARD)
    _write_split(tmp_path / "val.parquet", 2, seed=5)
    start = time.monotonic()
    try:
        proc = train(tmp_path / "run", "reward.reward_fn=custom", f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
                     f"data.val_files={tmp_path / 'val.parquet'}", "trainer.val_before_train=true",
                     "trainer.timeout_minutes=0.1", timeout=300)  # fmt: skip
    except subprocess.TimeoutExpired as err:
        raise AssertionError("the stuck reward function hung the run past trainer.timeout_minutes") from err
    assert proc.returncode == EXIT_STUCK, proc.stderr[-3000:]
    assert time.monotonic() - start < 240
    msg = [line for line in proc.stderr.splitlines() if "PhaseTimeout" in line]
    assert len(msg) == 1, proc.stderr[-3000:]
    assert "rank 0: phase 'reward' has not finished after 0.1 min (trainer.timeout_minutes)" in msg[0]
    assert "the reward function (reward.reward_fn, reward.custom_reward_function)" in msg[0]
    assert "inside phase 'val'" in msg[0] and "collective" in msg[0]  # a hint, not the diagnosis
    assert "phase 'reward'" in (tmp_path / "run" / "error_rank0.log").read_text()
