"""One actor update (``PolicyWorker.update``, one micro-batch) with LoRA (rank 32 on all four linear layers)
vs full fine-tuning on the same random model and the same synthetic batch: seconds per update, GEMM FLOPs
by op (``FlopCounterMode``: a ``bmm`` here means a frozen weight ran as batched GEMVs), optionally the
profiler's top ops. Default shape: hidden 1024, ffn 2816, 4 layers, 16 heads / 4 KV groups, vocab 32000
(CPU, a few seconds per update); ``--shape`` takes a named shape for GPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_lora_update.py --iters 3
    python benchmarks/bench_lora_update.py --shape llama-3.1-8b --dtype bf16 --seqs 10 --seq-len 768 --prompt 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_update_mfu import profile_step, synthetic_batch, timed  # noqa: E402

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def hf_shape(name: str | None) -> dict:
    from megatron_rl.models.shapes import hf_config, tiny_hf_config

    if name:
        return hf_config(name)
    return tiny_hf_config("llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                          tie_word_embeddings=False, max_position_embeddings=4096)  # fmt: skip


def run(mode: str, a, args, dtype, dev) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_rl.config.schema import ActorConfig, LoRAConfig, OptimConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.trainer.workers import PolicyWorker

    lora = LoRAConfig(rank=a.rank, alpha=2 * a.rank, target_modules=TARGETS) if mode == "lora" else None
    torch.manual_seed(0)
    model = build_model(args, "actor", dtype, lora=lora).to(dtype)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-6), ppo_micro_batch_size_per_gpu=a.seqs, use_kl_loss=False)
    worker = PolicyWorker(model, cfg, 1.0, args.vocab_size, 1000, a.seq_len - a.prompt)
    batch = synthetic_batch(a.seqs, a.seq_len, a.prompt, args.vocab_size, dev)
    secs = timed(lambda: worker.update(batch, a.seqs), 1, a.iters)
    with FlopCounterMode(display=False) as fc:
        worker.update(batch, a.seqs)
    profile_step(lambda: worker.update(batch, a.seqs), a.profile, f"{mode}, one update")
    by_op = {str(k): v for k, v in fc.get_flop_counts().get("Global", {}).items()}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"median_s": statistics.median(secs), "seconds": secs, "flops": fc.get_total_flops(),
            "flops_by_op": by_op, "trainable_params": trainable}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default=None, help="a name of models.shapes.SHAPES (default: the CPU shape)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--seqs", type=int, default=4, help="sequences in the one micro-batch")
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", default=None, help="append torch.profiler tables of one update of each here")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from megatron_rl.distributed import device
    from megatron_rl.distributed.runtime import destroy_distributed, init_distributed
    from megatron_rl.models.args import ModelArgs

    init_distributed(1, 1, seed=0)
    args = ModelArgs.from_hf_config(hf_shape(a.shape))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    res = {m: run(m, a, args, dtype, device()) for m in ("lora", "full")}
    destroy_distributed()
    out = {"config": vars(a), "results": res,
           "time_lora_over_full": res["lora"]["median_s"] / res["full"]["median_s"],
           "flops_lora_over_full": res["lora"]["flops"] / res["full"]["flops"]}  # fmt: skip
    for m, r in res.items():
        ops = {k: round(v / 1e9, 2) for k, v in r["flops_by_op"].items()}
        print(f"{m:5} {r['median_s']:8.3f} s/update  GFLOP by op {ops}")
    print(f"LoRA / full: time {out['time_lora_over_full']:.2f}, FLOPs {out['flops_lora_over_full']:.2f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
