"""``rollout.exact_logprobs`` at TP=2 and TP=4 under torchrun (CPU, gloo, world = TP): rollout log-probs
equal the trainer's recompute bit for bit (fp32 and bf16), the exact layers' gradients equal the default
layers' up to rounding, and the log-probs differ with the mode off."""

import pytest

from tests.distributed.launch import run_torchrun


@pytest.mark.parametrize("tp", [2, 4])
def test_exact_rollout_logprobs_equal_the_training_recompute_at_tp(tmp_path, tp):
    proc = run_torchrun("exact_logprobs_tp.py", tp, str(tmp_path / "hf"), timeout=600)
    for what in ("exact TP={} torch.float32", "grads TP={}", "exact TP={} torch.bfloat16", "control TP={}"):
        assert proc.stdout.count("ok " + what.format(tp)) == tp, proc.stdout
