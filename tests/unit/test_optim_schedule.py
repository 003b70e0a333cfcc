"""The LR schedule counts training steps (verl's convention), on both optimizer backends, actor and critic.

A training step updates each model with (train_batch_size / ppo_mini_batch_size) x ppo_epochs optimizer
steps; the schedule (``optim.lr_warmup_steps``, ``lr_decay_style``, ``min_lr_ratio``) spans the run's
training steps and advances once per update, so every optimizer step of one update uses the same LR. Here
2 mini-batches x 2 epochs = 4 optimizer steps per update; the LR each optimizer step used is compared with
an independent evaluation of the documented schedule at that training step. (The old code advanced it per
optimizer step over a span of training steps, so a cosine schedule ended after a quarter of the run.)
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_rl.config.schema import ActorConfig, CriticConfig, OptimConfig
from megatron_rl.distributed.runtime import destroy_distributed, init_distributed
from megatron_rl.models import ModelArgs, build_model
from megatron_rl.models.shapes import tiny_hf_config
from megatron_rl.optim import lr_lambda
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


def _lrs_and_weights(worker, steps: range) -> tuple[list[float], dict]:
    """The LR of every optimizer step of updates ``steps``, and the weights after them."""
    used, step_of = [], worker.opt.step

    def recording_step():
        out = step_of()
        used.append(float(out["lr"]))
        return out

    worker.opt.step = recording_step
    for step in steps:
        worker.update(_batch(step), MINI)
    worker.opt.step = step_of
    return used, {k: v.detach().clone() for k, v in worker.model.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("backend", ["local", "megatron"])
def test_resumed_schedule_is_bit_exact(args, backend, tmp_path):
    """Save after 3 updates (the optimizer's sharded state and its state.json entry, as the Checkpointer
    writes them), load into a fresh worker, finish: LRs and weights equal the uninterrupted run's bit for bit."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.safe_load import load_dist
    from megatron_rl.checkpoint.state import role_sharded_state

    def fresh():
        torch.manual_seed(0)
        return _worker(args, "actor", backend, "cosine")

    ref_lrs, ref_weights = _lrs_and_weights(fresh(), range(TOTAL))
    first = fresh()
    lrs, _ = _lrs_and_weights(first, range(3))
    dist_checkpointing.save(role_sharded_state("actor", first.model, first.opt), str(tmp_path))
    host = json.loads(json.dumps(first.opt.host_state()))
    resumed = fresh()
    loaded = load_dist(role_sharded_state("actor", resumed.model, resumed.opt, is_loading=True), tmp_path)
    resumed.model.load_state_dict({k[len("actor.") :]: v for k, v in loaded["model"].items()})
    resumed.opt.load_sharded_state_dict(loaded["optim"])
    resumed.opt.load_host_state(host)
    assert resumed.opt.scheduler.state_dict() == first.opt.scheduler.state_dict()
    more, weights = _lrs_and_weights(resumed, range(3, TOTAL))
    assert lrs + more == ref_lrs
    assert len(ref_lrs) == TOTAL * SEQS // MINI * EPOCHS
    assert len(set(ref_lrs)) == TOTAL - 1, (
        "one LR per training step (the peak at warmup's end and decay's start)"
    )
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.parametrize("role, warmup, want", [("actor", 0, 3), ("critic", 2, 3), ("actor", 2, 1)])
def test_checkpoint_of_the_old_convention_resumes_at_the_training_step(role, warmup, want):
    """A state.json entry without lr_schedule_unit counted optimizer steps (4 per update here): the loaded
    scheduler moves to the role's update count (the actor skips trainer.critic_warmup steps) and its LR
    is the schedule's there; an entry with the unit is left as loaded."""
    from megatron_rl.checkpoint import resume_config

    cfg = OptimConfig(lr=LR, lr_warmup_steps=WARMUP, lr_decay_style="cosine", min_lr_ratio=MIN_RATIO)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, TOTAL))
    for _ in range(12):  # 3 updates of 4 optimizer steps, stepped per optimizer step
        sched.step()
    config = {"trainer": {"critic_warmup": warmup}}
    note = resume_config.schedule_position(sched, {"backend": "local"}, role, 3, config)
    assert (
        sched.last_epoch == want and "position 12 (optimizer steps" in note and f"-> {want} training" in note
    )
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == pytest.approx(expected_lr(want, "cosine"))
    kept = {"backend": "local", resume_config.SCHEDULE_UNIT_KEY: resume_config.SCHEDULE_UNIT}
    assert resume_config.schedule_position(sched, kept, role, 5, config) is None and sched.last_epoch == want
