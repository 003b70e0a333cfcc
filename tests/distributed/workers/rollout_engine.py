"""torchrun worker (world 4): the in-place resharded engine on megatron-core GPTModels.

For (TP_t, PP_t) in (1,1), (2,1), (1,2), (2,2) and every TP_g dividing TP_t, on tiny random Llama and
Qwen2 models built with ``megatron_rl.models`` and loaded from HF safetensors, and for (4,1) with TP_g in
4, 2, 1 on 8-head / 4-KV-head variants (TP_g = 2 merges pairs of training shards into two replicas; the
vocab, padded to 512 at TP=4, leaves training rank 3 a shard of padding rows only):
- greedy outputs equal HF ``generate`` of each prompt alone, token for token (32 prompts, 16 at TP=4;
  12 new tokens);
- every TP/PP rank of a DP replica returns the same full list for its DP rank;
- sampled (T=0.7, top-k) rollout log-probs equal a fresh training-layout forward (max abs diff < 1e-5);
- the training-layout parameters are bit-identical before and after generation.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from rollout_common import hf_greedy, random_prompts, tiny_hf  # noqa: E402

from megatron_rl.distributed import init_distributed  # noqa: E402
from megatron_rl.models import ModelArgs, build_model, load_hf_weights  # noqa: E402
from megatron_rl.rollout.decoder import DecoderSpec  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from megatron_rl.rollout.reshard import model_params  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402
from tests.reference_forward import forward_pipeline  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# family, attention heads, KV heads, layouts, prompts, KV-cache slots (TP=4 has DP=1: its rank sees 16
# prompts, as a DP rank of TP=2 does, decoded 8 at a time to keep the slow 4-way gloo decode steps few)
MODELS = [
    ("llama", 4, 2, LAYOUTS, 32, 5),
    ("qwen2", 4, 2, LAYOUTS, 32, 5),
    ("llama", 8, 4, [(4, 1)], 16, 8),
    ("qwen2", 8, 4, [(4, 1)], 16, 8),
]
NEW = 12


def save_model(family: str, root: str, heads: int, kv_heads: int) -> tuple[str, object]:
    hf = tiny_hf(family, heads=heads, kv_heads=kv_heads)
    path = os.path.join(root, f"{family}_{heads}_{kv_heads}")
    if dist.get_rank() == 0:
        hf.save_pretrained(path)
    dist.barrier()
    return path, hf


def hf_refs(hf, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy continuations of every prompt, each rank computing a strided share (gathered)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: hf_greedy(hf, prompts[i], NEW) for i in range(rank, len(prompts), world)}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return [next(part[i] for part in every if i in part) for i in range(len(prompts))]


@torch.no_grad()
def training_logprobs(model, completions, temperature: float, vocab: int) -> list[torch.Tensor]:
    """Log-probs of each response under a fresh training-layout forward (TP-gathered logits)."""
    from megatron.core import parallel_state as ps

    seqs = [c.prompt_ids + c.response_ids for c in completions]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # [B, T] right-padded
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    local = forward_pipeline(model, ids).float()  # [B, T, V/tp]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    logp = torch.log_softmax(torch.cat(parts, -1)[..., :vocab] / temperature, -1)  # [B, T, V]
    out = []
    for i, c in enumerate(completions):
        p, r = len(c.prompt_ids), torch.tensor(c.response_ids)
        out.append(logp[i, p - 1 : p - 1 + len(r)].gather(-1, r[:, None])[:, 0])
    return out


def check_layout(path, hf, tp, pp, prompts, refs, slots):
    dims = init_distributed(tp, pp, seed=0, num_layers=hf.config.num_hidden_layers)
    args = ModelArgs.from_hf_config(path, tp=tp)
    model = build_model(args, role="actor")
    load_hf_weights(model, path, args)
    spec = DecoderSpec.from_args(args)
    before = {k: p.detach().clone() for k, p in model_params(model).items()}
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank()
    mine = list(range(dp_rank, len(prompts), dims.dp))
    for tp_g in [d for d in range(1, tp + 1) if tp % d == 0]:
        engine = RolloutEngine(model, spec, EngineConfig(tensor_model_parallel_size=tp_g, max_num_seqs=slots))
        out = engine.generate([prompts[i] for i in mine], SamplingParams(temperature=0, max_new_tokens=NEW))
        got = [c.response_ids for c in out]
        want = [refs[i] for i in mine]
        assert got == want, f"TP={tp} PP={pp} TP_g={tp_g}: greedy differs from HF\n{got}\n{want}"
        assert all(c.finish_reason == "length" for c in out)
        params = SamplingParams(temperature=0.7, top_k=40, n=2, max_new_tokens=NEW, seed=3)
        sampled = engine.generate([prompts[i] for i in mine[:4]], params)
        assert [(c.prompt_index, c.sample_index) for c in sampled] == [
            (i, s) for i in range(4) for s in range(2)
        ]
        ref_lp = training_logprobs(model, sampled, 0.7, spec.vocab_size)
        err = max((torch.tensor(c.logprobs) - r).abs().max().item() for c, r in zip(sampled, ref_lp))
        assert err < 1e-5, f"TP={tp} PP={pp} TP_g={tp_g}: rollout log-probs off by {err}"
        mp = [None] * dist.get_world_size(ps.get_model_parallel_group())
        dist.all_gather_object(mp, [c.response_ids for c in sampled], group=ps.get_model_parallel_group())
        assert all(x == mp[0] for x in mp), "ranks of one DP replica disagree on the sampled batch"
        stats = engine.last_stats
        assert (stats.gathered_weight_bytes > 0) == (pp > 1 or tp_g < tp), stats
        for k, p in model_params(model).items():
            assert torch.equal(p.detach(), before[k]), f"parameter {k} changed by generation"
    if dist.get_rank() == 0:
        print(f"ok TP={tp} PP={pp} {spec.qkv_bias=}", flush=True)


def main():
    init_distributed(1, 1, seed=0)
    prompts = random_prompts(32, seed=7)
    with tempfile.TemporaryDirectory() as root:
        root_list = [root]
        dist.broadcast_object_list(root_list, src=0)
        for family, heads, kv_heads, layouts, count, slots in MODELS:
            path, hf = save_model(family, root_list[0], heads, kv_heads)
            refs = hf_refs(hf, prompts[:count])
            for tp, pp in layouts:
                check_layout(path, hf, tp, pp, prompts[:count], refs, slots)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
