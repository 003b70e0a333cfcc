"""A trainer checkpoint (global_step_<N>) is self-contained: megatron_to_hf converts it to an HF model
equal to the trainer's own HF export, and `megatron-rl generate` samples from it directly."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from tests.distributed.launch import REPO, cpu_env
from tests.integration.cli import train


def _run(args, cwd):
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=cpu_env(), cwd=cwd, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_trainer_checkpoint_converts_and_generates(tmp_path):
    run = tmp_path / "run"
    proc = train(run, "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.save_hf=true",
                 "trainer.test_freq=-1", "trainer.val_before_train=false")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = run / "checkpoints" / "global_step_2"
    assert (step / "hf_config" / "config.json").is_file()

    out = tmp_path / "hf"
    _run([str(REPO / "checkpoints_tools" / "megatron_to_hf.py"), "--checkpoint", str(step), "--output", str(out)],
         tmp_path)  # fmt: skip
    converted, exported = load_file(out / "model.safetensors"), load_file(step / "hf" / "model.safetensors")
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[k], exported[k]) for k in exported)
    tokenizer_trained = json.loads((out / "config.json").read_text())["vocab_size"]
    assert tokenizer_trained == json.loads((step / "hf" / "config.json").read_text())["vocab_size"]

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "123="}\n{"prompt": "98="}\n')
    for model_path, name in ((step, "from_ckpt.jsonl"), (out, "from_hf.jsonl")):
        _run(["-m", "megatron_rl.cli", "generate", f"model.path={model_path}", f"generate.prompts={prompts}",
              f"generate.output={tmp_path / name}", "generate.max_new_tokens=4", "generate.n=1",
              f"trainer.output_dir={tmp_path / 'gen'}"], tmp_path)  # fmt: skip
    rows = [(tmp_path / n).read_text().splitlines() for n in ("from_ckpt.jsonl", "from_hf.jsonl")]
    assert [json.loads(r)["response_ids"] for r in rows[0]] == [
        json.loads(r)["response_ids"] for r in rows[1]
    ]
    assert len(rows[0]) == 2
