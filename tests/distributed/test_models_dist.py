"""Models on megatron-core under torchrun (CPU, gloo, world 4): parity with transformers at every TP/PP
layout, exact HF export, critic gradients, checkpoint formats and resharding."""

from tests.distributed.launch import run_torchrun


def test_logits_parity_export_and_critic(tmp_path):
    out = run_torchrun("models_parity.py", 4, str(tmp_path)).stdout
    for kind in ("llama", "qwen2", "qwen3"):
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            assert f"parity {kind} tp={tp} pp={pp}" in out
        assert f"export {kind} tp=2 pp=2" in out
    assert "critic values [B, T] ok" in out
    assert "fusions tp=2" in out


def test_checkpoint_round_trips_and_resharding(tmp_path):
    out = run_torchrun("models_ckpt.py", 4, str(tmp_path)).stdout
    for kind in ("llama", "qwen2"):
        for fmt in ("torch_dist", "legacy"):
            assert f"roundtrip {kind} {fmt} tp=2 pp=2" in out
        assert f"reshard {kind} (2, 2)->(1, 1)" in out and f"reshard {kind} (1, 1)->(2, 2)" in out
