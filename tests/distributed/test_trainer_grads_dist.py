from tests.distributed.launch import run_torchrun


def test_tp2_gradients_equal_tp1_including_qk_norms(tmp_path):
    out = run_torchrun("trainer_grads_worker.py", 2, str(tmp_path))
    assert "trainer gradient checks passed" in out.stdout
