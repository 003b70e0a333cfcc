"""The in-place resharded rollout engine under torchrun (CPU, gloo, world 4)."""

from tests.distributed.launch import run_torchrun


def test_engine_matches_hf_greedy_and_training_logprobs_in_every_layout():
    proc = run_torchrun("rollout_engine.py", 4, timeout=900)
    for layout in ("TP=1 PP=1", "TP=2 PP=1", "TP=1 PP=2", "TP=2 PP=2", "TP=4 PP=1"):
        assert proc.stdout.count(f"ok {layout}") == 2, proc.stdout


def test_generate_job_writes_completions_of_every_dp_rank():
    proc = run_torchrun("rollout_generate_job.py", 2, timeout=600)
    assert "ok generate_job" in proc.stdout, proc.stdout


def test_multi_turn_tool_answers_agree_across_generation_tp_ranks():
    proc = run_torchrun("rollout_multi_turn.py", 2, timeout=600)
    assert "ok multi_turn TP=2" in proc.stdout, proc.stdout
