"""A LoRA run's checkpoint holds the adapters and their optimizer state (no base weight), names its base
model with a digest, resumes to the next step; the generation weights never drift from the base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.checkpoint.safe_load import read_metadata_file
from tests.distributed.launch import REPO, cpu_env
from tests.integration.cli import metrics
from tests.integration.test_checkpoint_resume import SMALL, train

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2", "actor.use_kl_loss=true"]


def test_lora_checkpoint_is_adapters_only_and_resumes(tmp_path):
    out = tmp_path / "run"
    first = train(out, *SMALL, *LORA, "trainer.total_training_steps=2", "trainer.save_freq=2")
    assert first.returncode == 0, first.stderr[-3000:]
    step = out / "checkpoints" / "global_step_2"
    keys = list(read_metadata_file(step / "dist" / ".metadata").state_dict_metadata)
    actor = [k for k in keys if k.startswith("actor.")]
    assert actor and all(k.endswith((".lora_A", ".lora_B")) for k in actor), actor[:5]
    optim = [k for k in keys if k.startswith("optim.")]
    assert optim and all(".lora_" in k for k in optim), optim[:5]
    state = json.loads((step / "state.json").read_text())
    base = state["lora_base"]["actor"]
    assert base["digests"] and all(len(d) > 16 for d in base["digests"].values())
    rows = metrics(out)
    assert rows[0]["actor/kl_loss"] == 0.0  # reference = adapters off; B = 0 at step 0
    assert all(r["rollout/logprob_abs_diff"] < 1e-5 for r in rows)  # merged generation weights == training
    resumed = train(out, *SMALL, *LORA, "trainer.total_training_steps=3", "trainer.save_freq=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    check_exports(tmp_path, out / "checkpoints" / "global_step_3", Path(base["path"]))


def check_exports(tmp_path: Path, step: Path, base: Path) -> None:
    """megatron_to_hf on the LoRA checkpoint: the PEFT folder on the base == the merged full model."""
    import torch
    import transformers as tf
    from peft import PeftModel

    tool = [sys.executable, str(REPO / "checkpoints_tools" / "megatron_to_hf.py"), "--checkpoint", str(step)]
    for name, extra in (("peft", []), ("merged", ["--merged"])):
        proc = subprocess.run([*tool, "--output", str(tmp_path / name), *extra], capture_output=True, text=True,
                              env=cpu_env(), timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    peft_model = PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft"
    ).eval()
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    plain = tf.AutoModelForCausalLM.from_pretrained(base).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = peft_model(ids).logits, merged(ids).logits, plain(ids).logits
    assert (a - b).abs().max() < 1e-4 * a.abs().max(), "PEFT folder on the base != merged export"
    assert (a - c).abs().max() > 1e-3, "the trained adapters should change the logits"
