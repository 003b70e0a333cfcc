"""World 2: the trainer's gradient reduction gives TP=2 the same gradients as TP=1 (x DP=2), including the
q/k norms of Qwen3 (each TP rank holds only some heads) and the tied embedding of Qwen2 at PP=2; and the
policy worker's LM head on response positions only gives the same log-probs, losses and gradients as the
full head (TP=1 and TP=2) and sequence parallelism's every-position head the same as without it; and
micro-batches by token budget equal fixed-size ones at PP=2."""

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.algos import vocab_parallel_log_probs_and_entropy
from megatron_rl.config.schema import ActorConfig
from megatron_rl.distributed import init_distributed
from megatron_rl.distributed.grads import reduce_gradients
from megatron_rl.models import ModelArgs, build_model, load_hf_weights, pipeline
from megatron_rl.models.pipeline import head_on_response, run_micro_batches
from megatron_rl.rollout.batch import RolloutBatch
from megatron_rl.trainer.workers import PolicyWorker
from tests.distributed.workers.models_tiny import make_tiny_hf
from tests.reference_forward import forward_logits

REPLICATED = ("layernorm", "final_layernorm")


def grads(path: Path, tp: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    init_distributed(tp, 1, seed=0)
    args = ModelArgs.from_hf_config(path, tp=tp)
    model = build_model(args, "actor", torch.float64)
    load_hf_weights(model, path, args)
    model = model.double()
    logits = forward_logits(model, ids[:, :-1])  # [B, T-1, V/tp]
    lp, ent = vocab_parallel_log_probs_and_entropy(
        logits, ids[:, 1:], tp_group=ps.get_tensor_model_parallel_group(), vocab_size=args.vocab_size
    )
    (-(lp.sum()) + 0.1 * ent.sum()).backward()
    reduce_gradients(model)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def ragged_batch(vocab: int, prompt_lens=(3, 5, 2), response_lens=(4, 2, 4)) -> RolloutBatch:
    """Right-padded prompt+response rows of different prompt and response lengths (R=4 < T)."""
    g = torch.Generator().manual_seed(1)
    prompt_lens, response_lens, r = torch.tensor(prompt_lens), torch.tensor(response_lens), 4
    t = int((prompt_lens + response_lens).max()) + 1  # one column of padding
    n = len(prompt_lens)
    ids = torch.randint(1, vocab, (n, t), generator=g)
    j = torch.arange(r)
    score_pos = (prompt_lens[:, None] - 1 + j).clamp(max=t - 1)  # [B, R]
    responses = ids.gather(1, (score_pos + 1).clamp(max=t - 1))
    return RolloutBatch(
        input_ids=ids, responses=responses, response_mask=(j < response_lens[:, None]).double(),
        score_pos=score_pos, prompt_lens=prompt_lens, response_lens=response_lens,
        group_index=torch.arange(n), rollout_log_probs=torch.zeros(n, r, dtype=torch.float64),
        finish_reasons=["length"] * n, rows=[None] * n,
        advantages=torch.randn(n, r, generator=g, dtype=torch.float64),
    )  # fmt: skip


def head_parity(path: Path, tp: int) -> None:
    """Response-only LM head == full head: log-probs, loss metrics and every gradient (float64)."""
    init_distributed(tp, 1, seed=0)
    args = ModelArgs.from_hf_config(path, tp=tp)
    model = build_model(args, "actor", torch.float64)
    load_hf_weights(model, path, args)
    model = model.double()
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=3, entropy_coeff=0.01)
    worker = PolicyWorker(model, cfg, 0.7, args.vocab_size, 10, 4, trainable=False)
    batch = ragged_batch(args.vocab_size)
    assert head_on_response(model, batch)
    results = []
    for at_response in (False, True):  # False: the full head, logits gathered at score_pos afterwards
        pipeline.head_on_response = head_on_response if at_response else (lambda model, mb: False)
        lp = worker.log_probs(batch)
        model.zero_grad(set_to_none=True)
        outs = run_micro_batches(model, [batch], partial(worker._loss, (10, 3)), False, True)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((lp, outs[0]["pg_loss"], grads))
    (lp0, loss0, g0), (lp1, loss1, g1) = results
    assert torch.allclose(lp0, lp1, atol=1e-12), (lp0 - lp1).abs().max()
    assert torch.allclose(loss0, loss1, atol=1e-12) and loss0 != 0
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-12), (tp, name, (g0[name] - g1[name]).abs().max())


def sequence_parallel_parity(path: Path) -> None:
    """TP=2 with sequence parallelism (the LM head over every position, the response tokens' rows taken
    out of its output: ``pipeline.ResponseLogits``) == without it, padded and packed micro-batches of
    uneven response lengths: log-probs, loss and every gradient after the trainer's reduction (float64)."""
    from megatron_rl.rollout.batch import trim
    from megatron_rl.rollout.packing import pack

    results = []
    for sp in (False, True):
        init_distributed(2, 1, seed=0)
        args = ModelArgs.from_hf_config(path, tp=2)
        model = build_model(args, "actor", torch.float64, sequence_parallel=sp)
        load_hf_weights(model, path, args)
        model = model.double()
        assert head_on_response(model, ragged_batch(args.vocab_size)) is not sp
        for packed in (False, True):
            cfg = ActorConfig(ppo_micro_batch_size_per_gpu=3, pack_sequences=packed)
            worker = PolicyWorker(model, cfg, 0.7, args.vocab_size, 10, 4, trainable=False)
            batch = ragged_batch(args.vocab_size, (3, 5, 2), (3, 1, 3))  # T = 7, packed S = 17: both padded
            mb = pack(trim(ragged_batch(args.vocab_size, (3, 5, 2), (3, 1, 3)))) if packed else batch
            assert (mb.packed.total if packed else mb.seq_len) % 2 == 1  # sequence parallelism pads to TP
            lp = worker.log_probs(batch) * batch.response_mask  # packed rows with pack_sequences
            model.zero_grad(set_to_none=True)
            outs = run_micro_batches(model, [mb], partial(worker._loss, (7, 3)), False, True)
            reduce_gradients(model)
            results.append((lp, outs[0]["pg_loss"], {n: p.grad.clone() for n, p in model.named_parameters()}))
    for (lp0, loss0, g0), (lp1, loss1, g1) in zip(results[:2], results[2:]):
        assert torch.allclose(lp0, lp1, atol=1e-12), (lp0 - lp1).abs().max()
        assert torch.allclose(loss0, loss1, atol=1e-12) and loss0 != 0
        for name in g0:
            assert torch.allclose(g0[name], g1[name], atol=1e-12), (name, (g0[name] - g1[name]).abs().max())


def dynamic_bsz_parity(path: Path) -> None:
    """PP=2: micro-batches by token budget (different shapes, reordered rows) give the fixed-size split's
    log-probs (back in batch order), loss and gradients (float64)."""
    init_distributed(1, 2, seed=0)
    args = ModelArgs.from_hf_config(path, tp=1)
    model = build_model(args, "actor", torch.float64)
    load_hf_weights(model, path, args)
    model = model.double()
    batch = ragged_batch(args.vocab_size, (2, 5, 3, 4, 2, 3), (4, 2, 4, 1, 3, 2))  # lengths 6 7 7 5 5 5
    results = []
    for dynamic in (False, True):
        cfg = ActorConfig(
            ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=14
        )
        worker = PolicyWorker(model, cfg, 1.0, args.vocab_size, 10, 4, trainable=False)
        mbs, order = worker._split(batch)
        if dynamic:
            assert order != list(range(6)) and len({mb.seq_len for mb in mbs}) > 1, order
            assert all(len(mb) * mb.seq_len <= 14 for mb in mbs)
        lp = worker.log_probs(batch) * batch.response_mask  # past a response: don't-care values
        model.zero_grad(set_to_none=True)
        outs = run_micro_batches(model, mbs, partial(worker._loss, (14, 6)), False, True)
        loss = sum(float(o["pg_loss"]) for o in outs) if outs else None
        results.append((lp, loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, loss0, g0), (lp1, loss1, g1) = results
    assert torch.allclose(lp0, lp1, atol=1e-12), (lp0 - lp1).abs().max()
    assert (loss0 is None and loss1 is None) or abs(loss0 - loss1) < 1e-12
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-12), (name, (g0[name] - g1[name]).abs().max())


if __name__ == "__main__":
    root = Path(sys.argv[1])
    init_distributed(1, 1)
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    for kind in ("qwen3", "qwen2"):
        path = root / kind
        if dist.get_rank() == 0:
            make_tiny_hf(kind, path)
        dist.barrier()
        ref = grads(path, 1, ids)  # DP=2, same data on both ranks: the DP sum doubles every gradient
        got = grads(path, 2, ids)
        tp_rank = ps.get_tensor_model_parallel_rank()
        for name, g in got.items():
            if any(key in name for key in REPLICATED):
                want = ref[name] / 2
            elif name == "embedding.word_embeddings.weight":
                want = ref[name].chunk(2, dim=0)[tp_rank] / 2
            else:
                continue
            assert torch.allclose(g, want, atol=1e-10), (kind, name, (g - want).abs().max())
        assert any("q_layernorm" in n for n in got) == (kind == "qwen3")
    for tp in (1, 2):
        head_parity(root / "qwen2", tp)
    sequence_parallel_parity(root / "qwen2")
    dynamic_bsz_parity(root / "qwen2")
    if dist.get_rank() == 0:
        print("trainer gradient checks passed")
