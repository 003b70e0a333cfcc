"""Layout invariance of megatron_rl.algos under torchrun on CPU (4 processes, gloo)."""

from tests.distributed.launch import run_torchrun


def test_algos_layout_invariance():
    proc = run_torchrun("algos_worker.py", 4)
    assert "algos_worker: all checks passed" in proc.stdout
