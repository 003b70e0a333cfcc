from tests.distributed.launch import run_torchrun


def test_recompute_gradients_equal_at_tp2_pp2(tmp_path):
    out = run_torchrun("recompute_worker.py", 4, str(tmp_path))
    assert "recompute gradient checks passed: full_uniform_1, full_block_1" in out.stdout
