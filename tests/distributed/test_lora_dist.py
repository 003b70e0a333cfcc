"""LoRA on the TP=2 x PP=2 actor (with and without sequence parallelism) against HF PEFT: logits, adapter
gradients, adapters-off reference, merged generation weights, PEFT export, optimizer backends."""

from tests.distributed.launch import run_torchrun


def test_lora_matches_peft_at_tp2_pp2(tmp_path):
    out = run_torchrun("lora_worker.py", 4, str(tmp_path)).stdout
    for sp in (False, True):
        assert f"parity tp=2 pp=2 sp={sp}: logits and 56 adapter grads match PEFT" in out
        assert f"adapters off = base, merged = LoRA tp=2 pp=2 sp={sp}" in out
    assert "export peft adapter tp=2 pp=2: 56 tensors bit-exact" in out
    for backend in ("local", "megatron"):
        assert f"optimizer {backend}: holds 16 adapter tensors only; base unchanged" in out
