from tests.distributed.launch import run_torchrun


def test_packed_micro_batches_equal_padded_ones_at_tp1_and_tp2(tmp_path):
    out = run_torchrun("packing_worker.py", 2, str(tmp_path))
    assert "packing checks passed" in out.stdout
