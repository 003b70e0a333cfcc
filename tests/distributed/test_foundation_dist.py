from tests.distributed.launch import run_torchrun


def test_layouts_and_parallel_linear_world4():
    out = run_torchrun("foundation_worker.py", 4)
    assert "foundation checks passed" in out.stdout
