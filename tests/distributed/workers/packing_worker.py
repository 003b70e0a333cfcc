"""World 2: packed micro-batches (THD, ``pack_sequences``) give the padded micro-batches' log-probs, losses
and gradients (float64) at TP=1 (x DP=2) and TP=2: the actor by token budget and by fixed count, the
reference's forward, and the critic's values and value-loss gradients. Attention inside a packed row
must not cross sequences and RoPE positions must restart per sequence, or the numbers differ.
Shared prompts (``share_prompts``, GRPO groups holding one prompt copy) the same, also at PP=2: every
response must see its whole prompt at the right RoPE positions and the prompt's gradient is the sum
over its responses."""

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config.schema import ActorConfig, CriticConfig
from megatron_rl.distributed import init_distributed
from megatron_rl.models import ModelArgs, build_model, load_hf_weights
from megatron_rl.models.pipeline import broadcast_from_last_stage, run_micro_batches
from megatron_rl.trainer.workers import CriticWorker, PolicyWorker
from tests.distributed.workers.models_tiny import make_tiny_hf
from tests.distributed.workers.trainer_grads_worker import ragged_batch

PROMPTS, RESPONSES = (2, 5, 3, 4, 2, 3, 6), (4, 2, 4, 1, 3, 2, 4)  # lengths 6 7 7 5 5 5 10, R = 4


def _model(path: Path, tp: int, role: str):
    args = ModelArgs.from_hf_config(path, tp=tp)
    model = build_model(args, role, torch.float64)
    load_hf_weights(model, path, args)
    return model.double(), args


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-10), (what, name, (a[name] - b[name]).abs().max())


GROUP_PROMPTS, GROUP_OF = (3, 5, 2), (0, 0, 0, 1, 1, 2, 2)  # 3 groups: rows 0-2, 3-4, 5-6


def grouped_batch(vocab: int):
    """``ragged_batch`` rows whose groups share their prompt tokens (GRPO: n samples of one prompt)."""
    batch = ragged_batch(vocab, [GROUP_PROMPTS[g] for g in GROUP_OF], RESPONSES)
    first = {g: GROUP_OF.index(g) for g in set(GROUP_OF)}
    for row, g in enumerate(GROUP_OF):
        batch.input_ids[row, : GROUP_PROMPTS[g]] = batch.input_ids[first[g], : GROUP_PROMPTS[g]]
    batch.group_index = torch.tensor(GROUP_OF)
    return batch


LAYOUTS = {
    "padded": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24),
    "packed": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24, pack_sequences=True),
    "packed_fixed": dict(ppo_micro_batch_size_per_gpu=7, pack_sequences=True),
    "shared": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24, share_prompts=True),
    "shared_fixed": dict(ppo_micro_batch_size_per_gpu=7, share_prompts=True),
}


def _runs_real_tokens(name: str, mbs) -> bool:
    """One row per micro-batch of exactly the real tokens (shared: each prompt of a micro-batch once)."""
    if name.startswith("shared"):
        return all(mb.packed.shared and mb.packed.total < int((mb.prompt_lens + mb.response_lens).sum())
                   for mb in mbs if len(set(mb.group_index.tolist())) < len(mb))  # fmt: skip
    return all(mb.packed is not None and mb.packed.total == int((mb.prompt_lens + mb.response_lens).sum())
               for mb in mbs)  # fmt: skip


def policy_parity(path: Path, tp: int, pp: int = 1, names=tuple(LAYOUTS)) -> None:
    """Actor: padded rows vs packed rows and shared-prompt rows, by token budget and by fixed count."""
    init_distributed(tp, pp, seed=0, num_layers=2)
    model, args = _model(path, tp, "actor")
    batch = grouped_batch(args.vocab_size)
    results = {}
    for name in names:
        cfg = ActorConfig(entropy_coeff=0.01, **LAYOUTS[name])
        worker = PolicyWorker(model, cfg, 0.7, args.vocab_size, 10, 4, trainable=False)
        mbs, _ = worker._split(batch)
        if name != "padded":
            assert _runs_real_tokens(name, mbs), name
        lp = worker.log_probs(batch) * batch.response_mask
        model.zero_grad(set_to_none=True)
        outs = run_micro_batches(model, mbs, partial(worker._loss, (20, 7)), False, True)
        loss = broadcast_from_last_stage(sum(float(o["pg_loss"]) for o in outs))
        results[name] = (lp, loss, len(mbs), _grads(model))
    lp0, loss0, n0, g0 = results["padded"]
    assert n0 > 1 and loss0 != 0
    for name in names[1:]:
        lp, loss, _, g = results[name]
        assert torch.allclose(lp0, lp, atol=1e-12), (tp, name, (lp0 - lp).abs().max())
        assert abs(loss0 - loss) < 1e-12, (tp, name, loss0, loss)
        _same(g0, g, f"tp={tp} {name}")


def critic_parity(path: Path, tp: int, pp: int = 1) -> None:
    """Critic: values and value-loss gradients, padded vs packed vs shared prompts (the layout of the
    policy_parity call before it: TP ``tp``, PP ``pp``)."""
    model, args = _model(path, tp, "critic")
    batch = grouped_batch(args.vocab_size)
    g = torch.Generator().manual_seed(3)
    batch.values = torch.randn(batch.response_mask.shape, generator=g, dtype=torch.float64)
    batch.returns = torch.randn(batch.response_mask.shape, generator=g, dtype=torch.float64)
    results = []
    # no optimizer: its hooks would accumulate the float64 gradients in fp32 main_grad buffers
    worker = CriticWorker.__new__(CriticWorker)
    worker.model, worker.response_len = model, 4
    for packed, shared in ((False, False), (True, False), (False, True)):
        worker.cfg = CriticConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24, pack_sequences=packed,
                                  share_prompts=shared)  # fmt: skip
        values = worker.values(batch) * batch.response_mask
        mbs, _ = worker._split(batch)
        model.zero_grad(set_to_none=True)
        outs = run_micro_batches(model, mbs, partial(worker._loss, (20, 7)), False, False)
        loss = broadcast_from_last_stage(sum(float(o["vf_loss"]) for o in outs))
        results.append((values, loss, _grads(model)))
    v0, l0, g0 = results[0]
    assert l0 != 0
    for name, (v1, l1, g1) in zip(("packed", "shared"), results[1:]):
        assert torch.allclose(v0, v1, atol=1e-12), (tp, name, (v0 - v1).abs().max())
        assert abs(l0 - l1) < 1e-12, (name, l0, l1)
        _same(g0, g1, f"critic tp={tp} pp={pp} {name}")


def agreement() -> None:
    """agree_on_varlen: one rank's failed trial turns varlen (and so share_prompts=auto) off on every rank."""
    from megatron_rl.models import packed_attention as pa

    key, rank = ("cpu", torch.bfloat16, True), dist.get_rank()
    for local in ([True, True], [True, False]):
        pa._VARLEN_OK[key], pa._VARLEN_WHY[key] = local[rank], "set by the test"
        agreed = pa.agree_on_varlen(torch.device("cpu"), torch.bfloat16, True)
        assert agreed is all(local) and pa._VARLEN_OK[key] is all(local), (rank, local, agreed)
        assert ("another rank" in pa._VARLEN_WHY[key]) is (local[rank] and not all(local)), pa._VARLEN_WHY[
            key
        ]
    del pa._VARLEN_OK[key], pa._VARLEN_WHY[key]


if __name__ == "__main__":
    root = Path(sys.argv[1])
    init_distributed(1, 1)
    if dist.get_rank() == 0:
        make_tiny_hf("qwen2", root / "qwen2")
    dist.barrier()
    for tp in (1, 2):
        policy_parity(root / "qwen2", tp)
        critic_parity(root / "qwen2", tp)
    policy_parity(root / "qwen2", 1, 2, ("padded", "shared"))
    critic_parity(root / "qwen2", 1, 2)  # share_prompts=auto may turn it on for a PP critic too
    agreement()
    if dist.get_rank() == 0:
        print("packing checks passed")
