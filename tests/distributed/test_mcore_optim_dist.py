from tests.distributed.launch import run_torchrun


def test_megatron_optimizer_matches_local_and_its_checkpoint_reshards(tmp_path):
    """optim.backend=megatron (with and without the distributed optimizer) == optim.backend=local at DP=2,
    TP=2, PP=2; bf16 smoke; a DP=2 checkpoint resumes at TP=2 to the uninterrupted run's weights."""
    out = run_torchrun("mcore_optim_worker.py", 2, str(tmp_path))
    assert "mcore optimizer checks passed" in out.stdout
