from tests.distributed.launch import run_torchrun


def test_reward_model_scores_match_transformers(tmp_path):
    out = run_torchrun("reward_model_worker.py", 2, str(tmp_path / "rm"))
    assert "reward model checks passed" in out.stdout
