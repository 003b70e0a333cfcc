"""The trainer with megatron-core's hybrid-device optimizer (``actor.optim.optimizer_cpu_offload``; CPU, world 1,
where its state is written from and read into the live tensors): resumed from its step-2 checkpoint with
another ``optimizer_offload_fraction``, a 4-step run reproduces its steps 3 and 4 bit for bit (the state is
split anew; on CPU both parts step with the same AdamW kernel), and ``ckpt info`` describes the checkpoint.
DP=2 and resharding: ``tests/distributed/test_optim_dist.py``."""

from __future__ import annotations

import shutil

from megatron_rl.apps.ckpt_info import inspect_checkpoint
from tests.integration.cli import metrics
from tests.integration.test_checkpoint_resume import SMALL, _check, _comparable, train

HYBRID = [
    "model.dtype=bfloat16", "actor.optim.backend=megatron", "actor.optim.use_distributed_optimizer=true",
    "actor.optim.optimizer_cpu_offload=true", "trainer.save_freq=2", "trainer.total_training_steps=4",
]  # fmt: skip


def test_hybrid_optimizer_resumes_bit_for_bit_with_another_offload_fraction(tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "run"
    _check(train(ref_out, *SMALL, *HYBRID, "actor.optim.optimizer_offload_fraction=0.5"))
    ref = _comparable(metrics(ref_out))
    shutil.copytree(ref_out, out)
    ckpt = out / "checkpoints" / "global_step_2"
    info = inspect_checkpoint(ckpt)
    assert info.verified and info.step == 2 and info.contents["optimizer"], info

    resumed = train(out, *SMALL, *HYBRID, "actor.optim.optimizer_offload_fraction=1.0", "trainer.resume_mode=path",
                    f"trainer.resume_from_path={ckpt}")  # fmt: skip
    _check(resumed)
    log = resumed.stdout + resumed.stderr
    assert f"resumed from {ckpt} (step 2)" in log
    assert "actor.optim.optimizer_offload_fraction: 0.5 -> 1.0 since the checkpoint; applied" in log, log[
        -3000:
    ]
    got = _comparable(metrics(out))
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == ref[step], f"step {step} differs after resume:\n{got[step]}\n{ref[step]}"
