from tests.distributed.launch import run_torchrun


def test_optimizer_package_at_dp2(tmp_path):
    """At DP=2 (see optim_worker.py): megatron-core's hybrid-device optimizer == the distributed optimizer;
    the local backend accumulates 32 bf16 micro-batch grads in fp32 exactly; offloading optimizer state
    around every update trains bit-identically on both backends and frees its storages."""
    out = run_torchrun("optim_worker.py", 2, str(tmp_path))
    for line in (
        "ok hybrid torch.bfloat16 fraction=0.5",
        "ok fp32 accumulation",
        "ok offload megatron distopt=True",
    ):
        assert line in out.stdout, out.stdout
    assert "optimizer checks passed" in out.stdout
