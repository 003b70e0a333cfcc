"""The in-place resharded rollout engine under torchrun (CPU, gloo, world 4)."""

from tests.distributed.launch import run_torchrun


def test_engine_matches_hf_greedy_and_training_logprobs_in_every_layout():
    proc = run_torchrun("rollout_engine.py", 4, timeout=300)
    for layout in ("TP=1 PP=1", "TP=2 PP=1", "TP=1 PP=2", "TP=2 PP=2"):
        assert proc.stdout.count(f"ok {layout}") == 2, proc.stdout
