"""torchrun worker (world 2 or 4, TP = world): ``rollout.exact_logprobs`` across tensor-parallel shards.

A tiny random Qwen2 (qkv bias, tied embeddings; 4 heads / 2 KV heads, 8 / 4 at TP=4) loaded from HF
safetensors at TP = world size; vocab 320 padded to 512: at TP=2 rank 1's shard is 64 real columns and 192
of padding, at TP=4 rank 2's is 64 real columns and rank 3's padding only. The engine generates at the same
TP with continuous batching (10 sequences through 3 slots, top-k/top-p sampling, uneven response lengths):
- exact, fp32 and bf16: the engine's log-probs equal the trainer's forward-only recompute (micro-batches of
  2) and the update's forward (train mode, whole batch, with backward) bit for bit, on every rank; the
  top-k/top-p renormalised log-probs likewise; the backward gives finite, nonzero gradients;
- the exact model's gradients (the ordered reduction's identity backward, the column-parallel input
  gradients all-reduced) equal the default model's up to rounding (fp32, same batch and loss: at most
  1e-5 of each tensor's largest gradient);
- off (fp32): the same comparison differs on some tokens (by < 1e-5): what the mode removes.
The log-softmax's vocab block is narrowed to 96 columns, so that it neither divides a shard (256 or 128
columns) nor is wider than one (as 1024-column blocks and Qwen2.5's 75,968-column shards at TP=2): the
engine's gathered row must be split at the shard boundaries to give the trainer's bits.
Prints ``ok exact TP=<tp> <dtype>``, ``ok grads TP=<tp>`` and ``ok control TP=<tp>`` per rank.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from rollout_common import random_prompts, spec_of, tiny_hf  # noqa: E402

from megatron_rl.algos.rollout_correction import rollout_gap_metrics  # noqa: E402
from megatron_rl.config.schema import ActorConfig  # noqa: E402
from megatron_rl.distributed import init_distributed  # noqa: E402
from megatron_rl.kernels import batch_invariant  # noqa: E402
from megatron_rl.models import build_model, load_hf_weights  # noqa: E402
from megatron_rl.models.pipeline import run_micro_batches  # noqa: E402
from megatron_rl.rollout.batch import build_batch  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402
from megatron_rl.trainer.workers import PolicyWorker, response_log_probs  # noqa: E402

T, R = 0.8, 8  # sampling temperature, max new tokens
TP = int(os.environ["WORLD_SIZE"])


def rollout(model, args, exact: bool):
    prompts = random_prompts(5, seed=3)
    cfg = EngineConfig(max_num_seqs=3, max_prefill_tokens=40, exact_logprobs=exact)
    stops = tuple(range(100, 130))  # ~9% of the vocabulary: responses end at uneven lengths
    sp = SamplingParams(
        temperature=T, top_k=40, top_p=0.9, n=2, max_new_tokens=R, seed=5, stop_token_ids=stops
    )
    done = RolloutEngine(model, args, cfg).generate(prompts, sp)
    assert len({len(c.response_ids) for c in done}) >= 3, [len(c.response_ids) for c in done]
    return build_batch(done, [None] * len(prompts), 0, R, 0, torch.device("cpu"))


def check(model, args, exact: bool) -> dict:
    """Rollout, forward-only recompute, then the update's forward (with backward where ``exact``)."""
    batch = rollout(model, args, exact)
    mask = batch.response_mask.bool()
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=2)
    worker = PolicyWorker(
        model, cfg, T, args.vocab_size, 1, R, trainable=False, exact=exact, truncation=(40, 0.9)
    )
    recomputed = worker.log_probs(batch)  # [B, R]
    gap = rollout_gap_metrics(batch.rollout_log_probs, recomputed, batch.response_mask)
    model.train(exact)

    def loss_fn(mb, logits):
        lp, _ = response_log_probs(logits, mb, T, args.vocab_size, with_entropy=True, exact=exact)
        return (lp * mb.response_mask).sum(), {"lp": lp.detach(), **worker.truncated_gap(logits, mb)}

    out = run_micro_batches(model, [batch], loss_fn, forward_only=not exact, response_logits=True)[0]
    model.eval()
    return {"batch": batch, "mask": mask, "recomputed": recomputed, "gap": gap, "out": out}


def check_exact(model, args, dtype):
    """The exact comparisons; returns the batch (gradients of its update forward left on the model)."""
    r = check(model, args, exact=True)
    batch, mask, out = r["batch"], r["mask"], r["out"]
    assert torch.equal(batch.rollout_log_probs[mask], r["recomputed"][mask]), dtype
    assert r["gap"]["rollout_logprob_mismatch_frac"] == 0 and r["gap"]["rollout_logprob_abs_diff"] == 0
    assert torch.equal(out["lp"][mask], batch.rollout_log_probs[mask]), dtype
    assert out["rollout_truncated_logprob_mismatch_frac"] == 0, out
    assert (batch.rollout_truncated_log_probs[mask] > batch.rollout_log_probs[mask]).any()
    # both TP ranks hold the same responses and log-probs
    lp = batch.rollout_log_probs.contiguous()
    every = [torch.empty_like(lp) for _ in range(TP)]
    dist.all_gather(every, lp)
    assert all(torch.equal(every[0], e) for e in every[1:])
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    print(f"ok exact TP={TP} {dtype}", flush=True)
    return batch


def check_grads(exact_model, plain_model, args, batch) -> None:
    """The default model's gradients of the same update forward and loss: the exact model's up to rounding."""
    plain_model.train()

    def loss_fn(mb, logits):
        lp, _ = response_log_probs(logits, mb, T, args.vocab_size, with_entropy=False)
        return (lp * mb.response_mask).sum(), {}

    run_micro_batches(plain_model, [batch], loss_fn, forward_only=False, response_logits=True)
    plain_model.eval()
    want = dict(plain_model.named_parameters())
    for name, p in exact_model.named_parameters():
        ref = want[name].grad  # errors relative to the tensor's largest gradient (small entries round)
        assert (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max(), name
    exact_model.zero_grad(set_to_none=True)
    plain_model.zero_grad(set_to_none=True)
    print(f"ok grads TP={TP}", flush=True)


def check_control(model, args) -> None:
    r = check(model, args, exact=False)
    gap, out = r["gap"], r["out"]
    assert gap["rollout_logprob_abs_diff"] < 1e-5 and gap["rollout_logprob_mismatch_frac"] > 0, gap
    assert out["rollout_truncated_logprob_abs_diff"] < 1e-5, out
    print(f"ok control TP={TP} mismatch_frac={gap['rollout_logprob_mismatch_frac']:.3f}", flush=True)


def main() -> None:
    init_distributed(TP, 1, seed=0)
    batch_invariant.VOCAB_BLOCK = 96  # see the module docstring
    hf_dir = sys.argv[1]
    hf = tiny_hf("qwen2", heads=4 * TP // 2, kv_heads=2 * TP // 2)
    if dist.get_rank() == 0:
        hf.save_pretrained(hf_dir, safe_serialization=True)
    dist.barrier()
    args = spec_of(hf, tp=TP)

    def load(exact: bool, dtype):
        model = build_model(args, "actor", dtype, backend="local", exact=exact)
        load_hf_weights(model, hf_dir, args)
        return model.to(dtype)

    exact_fp32, plain_fp32 = load(True, torch.float32), load(False, torch.float32)
    check_grads(exact_fp32, plain_fp32, args, check_exact(exact_fp32, args, torch.float32))
    bf16 = load(True, torch.bfloat16)
    check_exact(bf16, args, torch.bfloat16)
    bf16.zero_grad(set_to_none=True)
    check_control(plain_fp32, args)


if __name__ == "__main__":
    main()
