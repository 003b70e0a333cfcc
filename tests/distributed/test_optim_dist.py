import pytest

from tests.distributed.launch import run_torchrun


@pytest.fixture(scope="module")
def optim_worker_out(tmp_path_factory) -> str:
    """One world-2 launch of optim_worker.py runs the sections of both tests (each section initializes its
    own layout, seed and models), in the order of the two launches it replaces: one launch fewer."""
    root = tmp_path_factory.mktemp("optim")
    sections = ("hybrid", "fp32_accumulation", "offload", "hybrid_checkpoint")
    return run_torchrun("optim_worker.py", 2, str(root), *sections).stdout


def test_optimizer_package_at_dp2(optim_worker_out):
    """At DP=2 (see optim_worker.py): megatron-core's hybrid-device optimizer == the distributed optimizer;
    the local backend accumulates 32 bf16 micro-batch grads in fp32 exactly; offloading optimizer state
    around every update trains bit-identically on both backends and frees its storages."""
    out = optim_worker_out
    for line in (
        "ok hybrid torch.bfloat16 fraction=0.5",
        "ok fp32 accumulation",
        "ok offload megatron distopt=True",
    ):
        assert line in out, out
    assert "optimizer checks passed" in out


def test_hybrid_optimizer_checkpoint_resumes_bit_for_bit_and_reshards(optim_worker_out):
    """megatron-core's hybrid-device optimizer saved at DP=2 resumes bit for bit with another offload fraction,
    reshards to TP=2 (DP=1, in place) and back, and is read by the plain distributed optimizer."""
    out = optim_worker_out
    for line in (
        "ok hybrid resume at DP=2, fraction 0.5 -> 1.0 with overlap: bit-identical",
        "ok hybrid DP=2 checkpoint resumed at TP=2 DP=1 (in place)",
        "ok hybrid checkpoint written in place at DP=1 resumes at DP=1 and DP=2: bit-identical",
        "ok hybrid checkpoint resumed by the plain distributed optimizer",
    ):
        assert line in out, out
