"""Training efficiency of issue 8 (part 2): our actor update alone vs a plain HF forward/backward/AdamW loop,
same model and same tokens, as MFU against 790 TFLOP/s bf16 (one GPU).

Tokens: B sequences x T tokens (default 8 x 1024; prompt 256 + response 768 for our RL loss). FLOPs per
step = 6 N x tokens with N the parameter count with the tied embedding counted once as the LM head
(attention's T^2 term left out, as in ``perf/mfu``), so both sides are scored the same way.

- ``ours``: ``PolicyWorker.update`` (the trainer's actor update: megatron-core schedule, PPO-clip loss on
  the response tokens with entropy, fp32 main-param AdamW, global grad-norm clip) on a synthetic rollout
  batch; one optimizer step per call, ``--mini`` sequences per step in micro-batches of ``--micro``.
- ``hf_plain``: ``Qwen2ForCausalLM`` (sdpa) bf16, next-token cross-entropy over all T tokens, backward,
  fused ``torch.optim.AdamW`` on the bf16 parameters, every micro-batch of ``--micro`` sequences.

    python benchmarks/bench_update_mfu.py --out $OUT/update_mfu.json
    python benchmarks/bench_update_mfu.py --tiny --seq-len 64 --prompt-len 16 --micro 2 --mini 4 --iters 2  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl_step import PEAK_BF16_FLOPS, prepare  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def param_count(cfg) -> int:
    """N for 6N per token: every matrix and bias, the (tied) embedding once as the LM head."""
    h, f, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    d = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    attn = h * (q + 2 * kv) + (q + 2 * kv) + q * h
    return L * (attn + 3 * h * f + 2 * h) + h + v * h


def synthetic_batch(n: int, seq_len: int, prompt_len: int, vocab: int, device):
    """A RolloutBatch of ``n`` full-length sequences (prompt_len + response) with random ids/advantages."""
    from megatron_rl.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    r = seq_len - prompt_len
    ids = torch.randint(1, vocab, (n, seq_len), generator=g)  # [B, T]
    j = torch.arange(r)
    return RolloutBatch(
        input_ids=ids.to(device),
        responses=ids[:, prompt_len:].to(device),  # [B, R]
        response_mask=torch.ones(n, r, device=device),
        score_pos=(prompt_len - 1 + j).expand(n, r).to(device),  # [B, R]
        prompt_lens=torch.full((n,), prompt_len, device=device),
        response_lens=torch.full((n,), r, device=device),
        group_index=(torch.arange(n) // 8).to(device),
        rollout_log_probs=torch.zeros(n, r, device=device),
        finish_reasons=["length"] * n,
        rows=[None] * n,
        advantages=torch.randn(n, r, generator=g).to(device),
    )


def profile_step(fn, path: str | None, label: str) -> None:
    """One call of ``fn`` under torch.profiler; the top kernels/ops by device time go to ``path``."""
    if not path:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        sync()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"==== {label}\n{table}\n")


def run_ours(a, model_dir: str, dtype) -> dict:
    from megatron_rl.config.schema import ActorConfig, OptimConfig
    from megatron_rl.distributed import device, init_distributed
    from megatron_rl.models import ModelArgs, build_model, load_hf_weights
    from megatron_rl.trainer.workers import PolicyWorker

    init_distributed(1, 1, seed=0)
    args = ModelArgs.from_hf_config(model_dir, tp=1)
    model = build_model(args, "actor", dtype)
    load_hf_weights(model, model_dir, args)
    model = model.to(dtype)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-6), ppo_micro_batch_size_per_gpu=a.micro, use_kl_loss=False,
                      use_dynamic_bsz=a.dynamic_tokens > 0, ppo_max_token_len_per_gpu=max(a.dynamic_tokens, 1))  # fmt: skip
    worker = PolicyWorker(model, cfg, 1.0, args.vocab_size, 1000, a.seq_len - a.prompt_len)
    batch = synthetic_batch(a.mini, a.seq_len, a.prompt_len, args.vocab_size, device())
    batch.old_log_probs = worker.log_probs(batch)
    times = timed(lambda: worker.update(batch, a.mini), a.warmup, a.iters)
    profile_step(lambda: worker.update(batch, a.mini), a.profile, f"ours, {a.mini} seqs per optimizer step")
    return {"seconds": times, "tokens_per_step": a.mini * a.seq_len}


def run_hf(a, model_dir: str, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev == "cuda")
    g = torch.Generator().manual_seed(0)
    micro = a.hf_micro or a.micro
    ids = torch.randint(1, model.config.vocab_size, (micro, a.seq_len), generator=g).to(dev)  # [B, T]

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = timed(step, a.warmup, a.iters)
    profile_step(step, a.profile, "hf_plain, one micro-batch per step")
    n = param_count(model.config)
    return {"seconds": times, "tokens_per_step": micro * a.seq_len, "params": n}


def summary(res: dict, n_params: int) -> dict:
    s = statistics.median(res["seconds"])
    flops = 6 * n_params * res["tokens_per_step"]
    return res | {
        "median_s": s,
        "tok_per_s": res["tokens_per_step"] / s,
        "tflops": flops / s / 1e12,
        "mfu": flops / s / PEAK_BF16_FLOPS,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--mini", type=int, default=64, help="ours: sequences per optimizer step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--dynamic-tokens", type=int, default=0,
                   help="ours: micro-batches by token budget (actor.use_dynamic_bsz) of this many tokens")  # fmt: skip
    p.add_argument("--hf-micro", type=int, default=None, help="HF loop sequences per step (default --micro)")
    p.add_argument("--profile", default=None, help="write torch.profiler tables of one step of each here")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_update_mfu.json"))
    a = p.parse_args(argv)
    tag = "tiny" if a.tiny else "qwen2_5_0_5b"
    model_dir = a.model_dir or f"/tmp/bench_{tag}_random"
    prepare(model_dir, f"/tmp/bench_{tag}_prompts256", a.tiny, 512, 256)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    hf = run_hf(a, model_dir, dtype)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the HF model and its optimizer are gone
    n = hf["params"]
    results = {"hf_plain": summary(hf, n)}
    ours_one = summary(run_ours(argparse.Namespace(**(vars(a) | {"mini": a.micro})), model_dir, dtype), n)
    results["ours_one_micro_per_step"] = ours_one
    if a.mini != a.micro:
        results["ours"] = summary(run_ours(a, model_dir, dtype), n)
    out = {
        "config": vars(a) | {"model": f"{tag}, random", "dtype": str(dtype), "params_6N": n},
        "peak_flops": PEAK_BF16_FLOPS,
        "results": results,
        "ratio_mfu_ours_over_hf": {k: v["mfu"] / results["hf_plain"]["mfu"] for k, v in results.items()},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    for k, v in results.items():
        print(f"{k:26} {v['median_s'] * 1e3:9.1f} ms/step {v['tok_per_s']:10.0f} tok/s MFU {v['mfu']:.3f}")
    return out


if __name__ == "__main__":
    main()
