"""World 2: the trainer's gradient reduction gives TP=2 the same gradients as TP=1 (x DP=2), including the
q/k norms of Qwen3 (each TP rank holds only some heads) and the tied embedding of Qwen2 at PP=2."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.algos import vocab_parallel_log_probs_and_entropy
from megatron_rl.distributed import init_distributed
from megatron_rl.models import ModelArgs, build_model, forward_logits, load_hf_weights
from megatron_rl.trainer.optim import reduce_gradients
from tests.distributed.workers.models_tiny import make_tiny_hf

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
    if dist.get_rank() == 0:
        print("trainer gradient checks passed")
