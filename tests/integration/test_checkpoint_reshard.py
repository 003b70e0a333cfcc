"""A checkpoint saved at TP=2 x PP=2 (world 4) resumes at TP=1 x PP=1 (world 1): the weights load
identical (resharded by dist_checkpointing) and training continues from the saved step.

Run as a script, this file is the world-1 weight check: ``python test_checkpoint_reshard.py CKPT MODEL``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import cpu_env
from tests.integration.cli import metrics
from tests.integration.test_checkpoint_resume import SMALL, train

TP2_PP2 = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]
# GRPO's first step can have all-zero advantages; the entropy bonus makes sure the weights move.
MOVE = "actor.entropy_coeff=0.01"


def _check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def test_tp2_pp2_checkpoint_resumes_at_tp1_pp1(tmp_path):
    out = tmp_path / "run"
    _check(
        train(out, *SMALL, MOVE, *TP2_PP2, "trainer.total_training_steps=1", "trainer.save_hf=true", nproc=4)
    )
    ckpt = out / "checkpoints" / "global_step_1"
    model_dir = out / "builtin_task" / "model"
    check = subprocess.run([sys.executable, __file__, str(ckpt), str(model_dir)], capture_output=True, text=True,
                           timeout=300, env=cpu_env())  # fmt: skip
    assert "WEIGHTS_IDENTICAL" in _check(check)

    log = _check(train(out, *SMALL, MOVE, "trainer.total_training_steps=2"))
    assert f"resumed from {ckpt} (step 1)" in log and "resharded" in log
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["actor/lr"] > 0 and rows[1]["actor/grad_norm"] == rows[1]["actor/grad_norm"]
    assert (out / "checkpoints" / "global_step_2" / "complete.json").is_file()


def _check_weights(ckpt: Path, model_dir: Path) -> None:
    """World 1: load the actor from ``ckpt`` and compare its HF export with the one saved at TP=2 x PP=2."""
    import torch
    from safetensors.torch import load_file

    from megatron_rl.checkpoint import load_model_weights
    from megatron_rl.distributed import init_distributed
    from megatron_rl.models import ModelArgs, build_model, export_hf_state_dict

    init_distributed(1, 1)
    args = ModelArgs.from_hf_config(str(model_dir), tp=1)
    model = build_model(args, "actor")
    load_model_weights(model, ckpt, "actor")
    got = export_hf_state_dict(model, args)
    saved = load_file(str(ckpt / "hf" / "model.safetensors"))
    initial = load_file(str(model_dir / "model.safetensors"))
    assert sorted(got) == sorted(saved), (sorted(got), sorted(saved))
    for name, t in got.items():
        assert torch.equal(t, saved[name]), f"{name} differs after resharding"
    assert any(not torch.equal(got[k], initial[k]) for k in got), "the checkpoint holds the untrained weights"
    print("WEIGHTS_IDENTICAL", len(got))


if __name__ == "__main__":
    _check_weights(Path(sys.argv[1]), Path(sys.argv[2]))
