"""The LR schedule counts training steps (verl's convention), on both optimizer backends, actor and critic.

A training step updates each model with (train_batch_size / ppo_mini_batch_size) x ppo_epochs optimizer
steps; the schedule (``optim.lr_warmup_steps``, ``lr_decay_style``, ``min_lr_ratio``) spans the run's
training steps and advances once per update, so every optimizer step of one update uses the same LR. Here
2 mini-batches x 2 epochs = 4 optimizer steps per update; the LR each optimizer step used is compared with
an independent evaluation of the documented schedule at that training step. (The old code advanced it per
optimizer step over a span of training steps, so a cosine schedule ended after a quarter of the run.)
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config.schema import ActorConfig, CriticConfig, OptimConfig
from megatron_rl.distributed.runtime import destroy_distributed, init_distributed
from megatron_rl.models import ModelArgs, build_model
from megatron_rl.models.shapes import tiny_hf_config
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.trainer.workers import CriticWorker, PolicyWorker

TOTAL, WARMUP, LR, MIN_RATIO = 7, 2, 1e-2, 0.1  # training steps, warmup training steps, peak LR, floor
SEQS, MINI, EPOCHS, P, R, VOCAB = 8, 4, 2, 3, 4, 64  # sequences, per mini-batch, epochs, prompt/response len


def expected_lr(step: int, style: str) -> float:
    """The documented schedule at training step ``step`` (0-based update count)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    frac = min(1.0, (step - WARMUP) / (TOTAL - WARMUP))
    decay = {"constant": 1.0, "linear": 1.0 - frac, "cosine": 0.5 * (1.0 + math.cos(math.pi * frac))}[style]
    if style == "constant":
        return LR
    return LR * (MIN_RATIO + (1.0 - MIN_RATIO) * decay)


@pytest.fixture(scope="module")
def args():
    init_distributed(1, 1, seed=0)
    yield ModelArgs.from_hf_config(tiny_hf_config("qwen2", vocab_size=VOCAB, num_hidden_layers=1), tp=1)
    destroy_distributed()


def _batch(step: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (SEQS, P + R), generator=g)  # [B, T]
    return RolloutBatch(
        input_ids=ids,
        responses=ids[:, P:],
        response_mask=torch.ones(SEQS, R),
        score_pos=(P - 1 + torch.arange(R)).expand(SEQS, R),
        prompt_lens=torch.full((SEQS,), P),
        response_lens=torch.full((SEQS,), R),
        group_index=torch.arange(SEQS) // 2,
        rollout_log_probs=torch.zeros(SEQS, R),
        finish_reasons=["length"] * SEQS,
        rows=[None] * SEQS,
        old_log_probs=torch.zeros(SEQS, R),
        values=torch.zeros(SEQS, R),
        advantages=torch.randn(SEQS, R, generator=g),
        returns=torch.randn(SEQS, R, generator=g),
    )


def _worker(args, role: str, backend: str, style: str):
    optim = OptimConfig(lr=LR, lr_warmup_steps=WARMUP, lr_decay_style=style, min_lr_ratio=MIN_RATIO,
                        backend=backend)  # fmt: skip
    keys = dict(optim=optim, ppo_epochs=EPOCHS, ppo_micro_batch_size_per_gpu=2)
    model = build_model(args, role, torch.float32, backend="local")
    if role == "critic":
        return CriticWorker(model, CriticConfig(**keys), total_steps=TOTAL, response_len=R)
    return PolicyWorker(model, ActorConfig(**keys), 1.0, args.vocab_size, total_steps=TOTAL, response_len=R)


@pytest.mark.parametrize("backend", ["local", "megatron"])
@pytest.mark.parametrize("style, role", [("cosine", "actor"), ("linear", "actor"), ("cosine", "critic")])
def test_lr_follows_the_schedule_per_training_step(args, backend, style, role):
    worker = _worker(args, role, backend, style)
    used, step_of = [], worker.opt.step

    def recording_step():
        out = step_of()
        used.append(float(out["lr"]))
        return out

    worker.opt.step = recording_step
    per_update = SEQS // MINI * EPOCHS
    for step in range(TOTAL + 1):  # one more than the schedule's span: it stays at the floor
        metrics = worker.update(_batch(step), MINI)
        want = expected_lr(step, style)
        got = used[step * per_update :]
        assert len(got) == per_update, f"{len(got)} optimizer steps in update {step}, expected {per_update}"
        assert got == pytest.approx([want] * per_update, rel=1e-6, abs=0), (
            f"{backend} {role} {style}: update {step} used LRs {got}, the schedule says {want}"
        )
        assert metrics[f"{role}/lr"] == pytest.approx(want, rel=1e-6, abs=0)
    assert used[-1] == pytest.approx(LR * MIN_RATIO), "the decay ends at min_lr_ratio * lr after TOTAL steps"
