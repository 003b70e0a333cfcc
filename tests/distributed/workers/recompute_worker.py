"""World 4, TP=2 x PP=2: megatron-core's activation recomputation (actor.recompute_* keys) gives the same
loss and gradients as no recomputation through the trainer's pipeline schedule: full (uniform and block)
and selective (core_attn, mlp), float64, two micro-batches, on CPU (CheckpointFunction with the RNG
tracker)."""

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mcore_random

from megatron_rl.config.schema import ActorConfig
from megatron_rl.distributed import init_distributed
from megatron_rl.models import ModelArgs, build_model, load_hf_weights
from megatron_rl.models.pipeline import run_micro_batches
from megatron_rl.trainer.workers import PolicyWorker
from tests.distributed.workers.models_tiny import make_tiny_hf
from tests.distributed.workers.trainer_grads_worker import ragged_batch

SETTINGS = {
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective_attn_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}


CALLS = {"checkpoint": 0}


def _counted(fn):
    def wrapped(*args, **kwargs):
        CALLS["checkpoint"] += 1
        return fn(*args, **kwargs)

    return wrapped


# every recomputation path of megatron-core goes through one of these two: count that they ran
mcore_random.CheckpointFunction.forward = staticmethod(_counted(mcore_random.CheckpointFunction.forward))
mcore_random.CheckpointWithoutOutput.checkpoint = _counted(mcore_random.CheckpointWithoutOutput.checkpoint)


def loss_and_grads(path: Path, keys: dict) -> tuple[float | None, dict[str, torch.Tensor]]:
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=3, entropy_coeff=0.01, **keys)
    args = ModelArgs.from_hf_config(path, tp=2)
    model = build_model(args, "actor", torch.float64, recompute=cfg.recompute_kwargs())
    load_hf_weights(model, path, args)
    model = model.double()
    assert model.config.recompute_granularity == keys.get("recompute_granularity")
    worker = PolicyWorker(model, cfg, 0.7, args.vocab_size, 10, 4, trainable=False)
    batch = ragged_batch(args.vocab_size, (2, 5, 3, 4, 2, 3), (4, 2, 4, 1, 3, 2))
    mbs, _ = worker._split(batch)
    assert len(mbs) == 2
    model.train()
    model.zero_grad(set_to_none=True)
    CALLS["checkpoint"] = 0
    outs = run_micro_batches(model, mbs, partial(worker._loss, (14, 6)), False, True)
    loss = sum(float(o["pg_loss"]) for o in outs) if outs else None
    assert (CALLS["checkpoint"] > 0) == bool(keys), (keys, CALLS)  # recomputation ran (only) when asked
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


if __name__ == "__main__":
    root = Path(sys.argv[1])
    init_distributed(2, 2, seed=0)
    path = root / "qwen2"
    if dist.get_rank() == 0:
        make_tiny_hf("qwen2", path)
    dist.barrier()
    ref_loss, ref = loss_and_grads(path, {})
    assert all(g.abs().sum() > 0 for g in ref.values())
    for name, keys in SETTINGS.items():
        loss, got = loss_and_grads(path, keys)
        assert (loss is None) == (ref_loss is None) and (loss is None or abs(loss - ref_loss) < 1e-12), name
        for p, g in got.items():
            assert torch.allclose(g, ref[p], rtol=0, atol=1e-12), (name, p, (g - ref[p]).abs().max())
    if dist.get_rank() == 0:
        print("recompute gradient checks passed:", ", ".join(SETTINGS))
