"""The trainer offloads the actor's and critic's optimizer state around generation
(``{actor,critic}.optim.{param,optimizer,grad}_offload``): same metrics as without, bit for bit, and the
transfer time per step is reported (CPU, PPO, bf16 weights so that fp32 main params exist). Both runs
fuse the weight-gradient accumulation (``optim.gradient_accumulation_fusion=true``): the fused weights'
``main_grad`` is allocated at each update's first forward, and with ``grad_offload`` the megatron-core grad
buffers it writes into are freed and rebuilt around generation."""

from __future__ import annotations

from tests.integration.cli import metrics, train
from tests.integration.test_checkpoint_resume import SMALL, _comparable

PPO = ["algorithm=ppo", "model.dtype=bfloat16", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4", "trainer.save_freq=-1",
       "trainer.total_training_steps=2", "actor.optim.gradient_accumulation_fusion=true",
       "critic.optim.gradient_accumulation_fusion=true"]  # fmt: skip
OFFLOAD = [f"{role}.optim.{key}=true" for role in ("actor", "critic")
           for key in ("param_offload", "optimizer_offload", "grad_offload")]  # fmt: skip


def test_offload_while_generating_is_bit_identical_and_timed(tmp_path):
    plain, offloaded = tmp_path / "plain", tmp_path / "offload"
    for out, extra in ((plain, []), (offloaded, OFFLOAD)):
        proc = train(out, *SMALL, *PPO, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "gradient accumulation fusion: actor on, critic on" in proc.stdout
    ref, got = metrics(plain), metrics(offloaded)
    assert _comparable(got) == _comparable(ref) and sorted(_comparable(got)) == [1, 2]
    for row in got:
        assert row["timing_s/offload"] >= 0 and row["timing_s/reload"] >= 0, row
    assert all("timing_s/offload" not in row for row in ref)


HYBRID = ["actor.optim.backend=megatron", "actor.optim.use_distributed_optimizer=true",
          "actor.optim.optimizer_cpu_offload=true", "actor.optim.optimizer_offload_fraction=0.5"]  # fmt: skip


def test_grad_offload_with_the_hybrid_device_optimizer_is_bit_identical(tmp_path):
    """The 7B/8B benchmark rows: megatron-core's hybrid optimizer holds part of its state on the host, and the
    gradient buffers are freed while generating (``actor.optim.grad_offload``) to give the KV cache room."""
    runs = {}
    for name, extra in (("plain", []), ("offload", ["actor.optim.grad_offload=true"])):
        proc = train(tmp_path / name, *SMALL, *PPO, *HYBRID, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "gradient accumulation fusion: actor on, critic on" in proc.stdout
        runs[name] = metrics(tmp_path / name)
    assert _comparable(runs["offload"]) == _comparable(runs["plain"])
    assert all(row["timing_s/offload"] >= 0 for row in runs["offload"])
