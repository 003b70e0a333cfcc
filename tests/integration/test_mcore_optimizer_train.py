"""The trainer with ``optim.backend=megatron`` + the distributed optimizer (PPO: actor and critic, CPU, world 2):
a run stopped after its checkpoint at step 2 (a copy of the uninterrupted run's directory, cut back to
that checkpoint) and restarted with the same command reproduces the uninterrupted run's metrics
bit for bit; restarted at TP=2 it reshards the distributed optimizer's state and continues (that the
resharded state is exact is tests/distributed/test_mcore_optim_dist.py); restarted with the local backend it
stops before reading any tensor, naming the keys."""

from __future__ import annotations

from tests.integration.cli import metrics
from tests.integration.test_checkpoint_resume import SMALL, _check, _comparable, cut_back, train

MEGATRON = [
    "algorithm=ppo", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
    "actor.ppo_micro_batch_size_per_gpu=2", "actor.entropy_coeff=0.01", "trainer.save_freq=2",
    "actor.optim.backend=megatron", "actor.optim.use_distributed_optimizer=true",
    "critic.optim.backend=megatron", "critic.optim.use_distributed_optimizer=true",
]  # fmt: skip


def test_megatron_distributed_optimizer_resume_reshard_and_backend_switch(tmp_path):
    ref_out, out, tp2_out = tmp_path / "ref", tmp_path / "run", tmp_path / "tp2"
    _check(train(ref_out, *SMALL, *MEGATRON, "trainer.total_training_steps=4", nproc=2))  # saves at 2 and 4
    cut_back(ref_out, out, 2)  # the uninterrupted run as it stood after checkpoint 2, twice
    cut_back(ref_out, tp2_out, 2)
    ckpt = out / "checkpoints" / "global_step_2"

    switched = train(out, *SMALL, *MEGATRON, "trainer.total_training_steps=4", "actor.optim.backend=local",
                     "actor.optim.use_distributed_optimizer=false", nproc=2)  # fmt: skip
    assert switched.returncode != 0
    err = switched.stderr
    assert "CheckpointError" in err and str(ckpt) in err, err[-3000:]
    assert "actor.optim.backend=megatron actor.optim.use_distributed_optimizer=true" in err
    assert "this run has actor.optim.backend=local" in err

    resumed = train(out, *SMALL, *MEGATRON, "trainer.total_training_steps=4", nproc=2)
    _check(resumed)
    assert f"resumed from {ckpt} (step 2)" in resumed.stdout + resumed.stderr
    ref, got = _comparable(metrics(ref_out)), _comparable(metrics(out))
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == ref[step], f"step {step} differs after resume:\n{got[step]}\n{ref[step]}"

    tp2 = train(tp2_out, *SMALL, *MEGATRON, "trainer.total_training_steps=4",
                "parallel.tensor_model_parallel_size=2", nproc=2)  # fmt: skip
    log = _check_log(tp2)
    assert f"resumed from {tp2_out / 'checkpoints' / 'global_step_2'} (step 2)" in log and "resharded" in log
    got = _comparable(metrics(tp2_out))  # new RNG streams after a layout change: other samples than ref
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert 0 < got[step][key] < 1e3, (step, key, got[step][key])
        assert got[step]["actor/lr"] == ref[step]["actor/lr"]


def _check_log(proc) -> str:
    _check(proc)
    return proc.stdout + proc.stderr
