"""Decode throughput of the rollout engine vs HF transformers ``generate``, same run: one GPU, or TP=2.

Qwen2.5-0.5B shape (vocab 151936, hidden 896, ffn 4864, 24 layers, 14 heads / 2 KV groups, qkv bias, tied
embeddings, rope theta 1e6), random bf16 weights, 256 prompts x 128 tokens, 256 new tokens each, sampling
at temperature 1 (no top-k / top-p), EOS = 151645 (a random model practically never samples it; tokens
are counted up to and including any EOS). Reports new tokens/s of both, the ratio, ms per decode step,
the fraction of the HBM floor (weights + live KV read once per step at 4.8 TB/s), the train -> gen -> train
switch time and peak memory, for four engine calls: ``per_call_first`` / ``per_call`` (the trainer's
default: cache and CUDA graphs built in every call; the first pays one-time setup), ``keep_cache_first`` and
``keep_cache_next`` (``EngineConfig.keep_cache``:
the second call reuses cache and graphs after an in-place weight update). Writes
``$OUT/bench_decode.json`` (or ``--out``); ``--profile`` adds torch.profiler kernel tables beside it.

HF ``generate`` is timed three ways (``hf_variants``: keyword arguments, a ``GenerationConfig`` with
``disable_compile=True`` as TRL calls it, and that plus ``min_new_tokens``); ``hf_generate`` and every
"x HF" ratio are against the fastest, the others are kept under ``hf_generate.variants``.

Run: ``python benchmarks/bench_decode.py --profile`` (needs CUDA; no megatron-core on one GPU).

Tensor-parallel mode (``WORLD_SIZE`` > 1, megatron-core needed): on two GPUs of one host,

    torchrun --nproc-per-node=2 benchmarks/bench_decode.py --out $OUT/bench_decode_tp2.json

rank 0 saves the random HF model (same shape, same seed) to a temporary directory; every rank builds the
actor through ``megatron_rl.models`` at TP = WORLD_SIZE, PP = 1 (``ModelArgs.from_hf_config``,
``build_model``, ``load_hf_weights``, cast to bf16, as the trainer does; the vocab is padded to a multiple
of 128 x TP and the engine samples only the real ids) and runs the same four engine calls on the actor's
own shards (TP_g = TP_t). HF ``generate`` runs on rank 0 alone (one GPU) while the other ranks wait at a
barrier; ``speedup_new_tok_per_s`` is ours (WORLD_SIZE GPUs) over HF (one GPU), ``speedup_per_gpu`` divides
ours by WORLD_SIZE. The HBM floor per step is per GPU: this rank's weight shard (qkv / proj / fc1 / fc2
split by TP, the tied vocab-parallel embedding-output split by TP with its padded rows, norms replicated)
plus the live KV of its num_query_groups / TP groups, once per step at 4.8 TB/s; the two all-reduces per
layer, the logits all-gather and the token broadcast are not in it. ``peak_memory_gib_per_gpu`` lists
every rank's peak. CPU smoke of this mode (gloo):
``torchrun --nproc-per-node=2 benchmarks/bench_decode.py --device cpu --layers 2 --prompts 4 --prompt-len 8
--new-tokens 4 --out /tmp/bd2.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from megatron_rl.models.args import ModelArgs
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams

HBM_BYTES_PER_S = 4.8e12
EOS = 151645


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_hf(layers: int, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


def spec_of(cfg) -> ModelArgs:
    """The engine's view of an HF config: ``ModelArgs`` (vocab padded to a multiple of 128)."""
    return ModelArgs.from_hf_config(cfg.to_dict())


def mcore_params(hf, spec: ModelArgs) -> dict[str, torch.Tensor]:
    """HF weights under megatron-core local-spec names (TP=1): the actor layout the engine reads."""
    sd = hf.state_dict()
    G, D = spec.num_query_groups, spec.head_dim
    rep = spec.num_attention_heads // G
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"]}
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    for i in range(spec.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q = sd[f"{hp}self_attn.q_proj.{kind}"].reshape(G, rep * D, -1)  # [G, rep*D, (h)]
            k = sd[f"{hp}self_attn.k_proj.{kind}"].reshape(G, D, -1)
            v = sd[f"{hp}self_attn.v_proj.{kind}"].reshape(G, D, -1)
            qkv = torch.cat([q, k, v], dim=1).reshape(G * (rep + 2) * D, -1)  # [(nH+2G)*D, (h)]
            out[f"{mp}self_attention.linear_qkv.{kind}"] = qkv.squeeze(-1) if kind == "bias" else qkv
        out[f"{mp}input_layernorm.weight"] = sd[f"{hp}input_layernorm.weight"]
        out[f"{mp}self_attention.linear_proj.weight"] = sd[f"{hp}self_attn.o_proj.weight"]
        out[f"{mp}pre_mlp_layernorm.weight"] = sd[f"{hp}post_attention_layernorm.weight"]
        gate_up = [sd[f"{hp}mlp.gate_proj.weight"], sd[f"{hp}mlp.up_proj.weight"]]
        out[f"{mp}mlp.linear_fc1.weight"] = torch.cat(gate_up, dim=0)
        out[f"{mp}mlp.linear_fc2.weight"] = sd[f"{hp}mlp.down_proj.weight"]
    return out


def graphs_match_eager(params, spec, prompts) -> bool:
    """Greedy ids with the CUDA-graph decode equal the eager decode (same bucket, so same kernels)."""
    sp = SamplingParams(temperature=0, max_new_tokens=32)
    runs = [
        [
            c.response_ids
            for c in RolloutEngine(params, spec, EngineConfig(max_num_seqs=16, cuda_graphs=g)).generate(
                prompts[:16], sp
            )
        ]
        for g in (True, False)
    ]
    return runs[0] == runs[1]


def count_new(rows: list[list[int]]) -> int:
    return sum(r.index(EOS) + 1 if EOS in r else len(r) for r in rows)


def engine_numbers(engine, params, spec, prompts, sampling, tp: int = 1) -> dict:
    """One timed generate call: throughput, ms per decode step, fraction of the HBM floor, switch time.

    ``params``: this rank's weights (all of them on one GPU, its TP shard at ``tp`` > 1); the floor is
    per GPU (the KV of ``num_query_groups / tp`` groups)."""
    sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    sync()
    wall = time.perf_counter() - t0
    s = engine.last_stats
    new = sum(len(c.response_ids) for c in out)
    assert all(t < spec.vocab_size for c in out for t in c.response_ids), "sampled a padded vocab id"
    kv_per_token = 2 * spec.num_layers * (spec.num_query_groups // tp) * spec.head_dim * 2
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    mean_ctx = len(prompts[0]) + sampling.max_new_tokens / 2
    floor_s = (weight_bytes + len(prompts) * mean_ctx * kv_per_token) / HBM_BYTES_PER_S
    step_s = s.decode_s / max(s.decode_steps, 1)
    switch = s.reshard_s + s.gather_back_s
    return {
        "new_tokens": new,
        "wall_s": wall,
        "new_tok_per_s": new / wall,
        "decode_steps": s.decode_steps,
        "ms_per_decode_step": 1e3 * step_s,
        "hbm_floor_ms_per_step": 1e3 * floor_s,
        "fraction_of_hbm_floor": floor_s / step_s,
        "switch_train_gen_train_s": switch,
        "switch_over_generation": switch / s.generate_s,
        "reshard_s": s.reshard_s,
        "capture_s": s.capture_s,
        "gather_back_s": s.gather_back_s,
        "generate_s": s.generate_s,
        "prefill_s": s.prefill_s,
        "decode_s": s.decode_s,
        "peak_memory_gib": s.peak_memory_bytes / 2**30,
        "kv_cache_gib": s.kv_cache_bytes / 2**30,
        "slots": s.slots,
        "weight_gib": weight_bytes / 2**30,
    }


def run_ours(params, spec, prompts, new_tokens: int, actor=None, tp: int = 1) -> dict:
    """The trainer's default (cache and graphs built per call), then ``keep_cache`` (second call reuses).

    ``actor``: what the engine reads (the GPTModel at TP > 1, as in the trainer; default ``params``)."""
    actor = params if actor is None else actor
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=(EOS,), seed=0)
    warm = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    RolloutEngine(actor, spec, EngineConfig(max_num_seqs=8)).generate(prompts[:8], warm)  # library init
    fresh = RolloutEngine(actor, spec, EngineConfig(max_num_seqs=len(prompts)))
    kept = RolloutEngine(actor, spec, EngineConfig(max_num_seqs=len(prompts), keep_cache=True))
    # the process's first call at this shape also pays one-time library setup (cuDNN plans, cuBLAS)
    res = {"per_call_first": engine_numbers(fresh, params, spec, prompts, sampling, tp)}
    res["per_call"] = engine_numbers(fresh, params, spec, prompts, sampling, tp)
    res["keep_cache_first"] = engine_numbers(kept, params, spec, prompts, sampling, tp)
    for p in params.values():  # an optimizer step: in place, same storage
        p.data.mul_(1.0)
    res["keep_cache_next"] = engine_numbers(kept, params, spec, prompts, sampling, tp)
    return res


def profile_decode(params, spec, prompts, out_dir: str, write: bool = True, prefix: str = "") -> None:
    """Kernel table of a short generate call, with and without CUDA graphs (eager shows each op).
    Under TP every rank runs it (collectives); ``write`` on rank 0 only."""
    from torch.profiler import ProfilerActivity, profile

    sampling = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=(EOS,), seed=0)
    for graphs in (True, False):
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=len(prompts), cuda_graphs=graphs))
        engine.generate(prompts, sampling)  # capture outside the profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, sampling)
            sync()
        if not write:
            continue
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
        name = f"profile_{prefix}{'graphs' if graphs else 'eager'}.txt"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(f"decode_s={engine.last_stats.decode_s:.4f} steps={engine.last_stats.decode_steps}\n")
            f.write(table)
        print(name, f"decode ms/step {1e3 * engine.last_stats.decode_s / engine.last_stats.decode_steps:.3f}")
        print(table[:4000], flush=True)


def hf_variants(new_tokens: int) -> dict[str, dict]:
    """The ways to ask HF ``generate`` for the same sampling (temperature 1, no top-k / top-p, EOS =
    ``EOS``), timed side by side (issue 16): plain keyword arguments (this benchmark until now); a
    ``GenerationConfig`` with ``disable_compile=True``, as TRL's GRPOTrainer calls it; and that plus
    ``min_new_tokens`` (what TRL is given in bench_trl_grpo.py to keep every response at full length). The
    ratio is taken against the fastest."""
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=EOS, pad_token_id=0)
    return {
        "kwargs": dict(sampling),
        "generation_config": {"generation_config": GenerationConfig(**sampling), "disable_compile": True},
        "generation_config_min_new_tokens": {
            "generation_config": GenerationConfig(**sampling, min_new_tokens=new_tokens),
            "disable_compile": True,
        },
    }


@torch.no_grad()
def run_hf(hf, prompts, new_tokens: int) -> dict:
    """Every variant of ``hf_variants`` on the same prompts; ``best`` names the fastest."""
    ids = torch.tensor(prompts, device=hf.device)  # [B, T] equal lengths: no padding
    runs = {}
    for name, kwargs in hf_variants(new_tokens).items():
        warm = {**kwargs, "max_new_tokens": 8}
        if "generation_config" in kwargs:
            import copy

            gc = copy.deepcopy(kwargs["generation_config"])
            gc.min_new_tokens = min(gc.min_new_tokens or 0, 8) or None
            warm["generation_config"] = gc
        hf.generate(ids[:8], attention_mask=torch.ones_like(ids[:8]), **warm)  # warm-up
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **kwargs)
        sync()
        wall = time.perf_counter() - t0
        new = count_new(out[:, ids.shape[1] :].tolist())
        runs[name] = {"new_tokens": new, "wall_s": wall, "new_tok_per_s": new / wall}
        print("hf", name, json.dumps(runs[name]), flush=True)
    best = max(runs, key=lambda k: runs[k]["new_tok_per_s"])
    return runs[best] | {"best": best, "variants": runs}


def write_and_print(a, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    ours, ref = result["ours"], result["hf_generate"]
    print(f"{'run':18} {'tok/s':>9} {'x HF':>6} {'ms/step':>8} {'HBM frac':>8} {'switch s':>9} {'sw/gen':>7}")
    for k, v in ours.items():
        print(
            f"{k:18} {v['new_tok_per_s']:9.0f} {result['speedup_new_tok_per_s'][k]:6.2f} "
            f"{v['ms_per_decode_step']:8.3f} {v['fraction_of_hbm_floor']:8.3f} "
            f"{v['switch_train_gen_train_s']:9.3f} {v['switch_over_generation']:7.3f}"
        )
    for name, v in ref.get("variants", {}).items():
        print(
            f"{'hf ' + name:34} {v['new_tok_per_s']:9.0f}"
            + ("  (fastest: the x HF base)" if name == ref["best"] else "")
        )


def make_prompts(a) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 150000, (a.prompts, a.prompt_len), generator=g).tolist()


def main_single(a) -> None:
    import transformers

    hf = build_hf(a.layers, a.device)
    spec = spec_of(hf.config)
    params = mcore_params(hf, spec)
    prompts = make_prompts(a)
    graphs_ok = graphs_match_eager(params, spec, prompts)
    ours = run_ours(params, spec, prompts, a.new_tokens)
    print("ours", json.dumps(ours), flush=True)
    if a.profile and a.device == "cuda":
        profile_decode(params, spec, prompts, os.path.dirname(os.path.abspath(a.out)))
    ref = run_hf(hf, prompts, a.new_tokens)
    print("hf", json.dumps(ref), flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "config": vars(a) | {"model": "Qwen2.5-0.5B shape, random bf16", "temperature": 1.0, "eos": EOS},
        "ours": ours,
        "hf_generate": ref,
        "graph_decode_equals_eager_greedy": graphs_ok,
        "speedup_new_tok_per_s": {k: v["new_tok_per_s"] / ref["new_tok_per_s"] for k, v in ours.items()},
    }
    write_and_print(a, result)


def main_tp(a, world: int) -> None:
    """TP = ``world`` on one host: the actor built and loaded by ``megatron_rl.models``; HF on rank 0."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import transformers

    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.models import ModelArgs, build_model, load_hf_weights
    from megatron_rl.rollout.reshard import model_params

    if (a.device == "cuda") != torch.cuda.is_available():
        raise SystemExit(
            f"--device {a.device} but CUDA is {'' if torch.cuda.is_available() else 'not '}available; "
            f"the TP mode runs on the GPUs when there are any (CPU smoke: CUDA_VISIBLE_DEVICES='')."
        )
    init_distributed(tp=world, pp=1, seed=0, num_layers=a.layers)  # nccl on GPU, gloo on CPU
    rank = dist.get_rank()
    where = [tempfile.mkdtemp(prefix="bench_decode_tp_") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    hf = None
    if rank == 0:
        hf = build_hf(a.layers, a.device)  # the one-GPU mode's model: same shape, same seed
        hf.save_pretrained(where[0])
        hf = hf.to("cpu")  # parked off the GPU until the HF baseline
        if a.device == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    args = ModelArgs.from_hf_config(where[0], tp=world)  # padded_vocab_size: a multiple of 128 * TP
    model = build_model(args, "actor", torch.bfloat16)
    load_hf_weights(model, where[0], args)
    model = model.to(torch.bfloat16)  # the trainer's cast (megatron-core makes its norms in fp32)
    spec = args
    params = model_params(model)  # this rank's TP shard, what the engine reads from the actor
    prompts = make_prompts(a)
    graphs_ok = graphs_match_eager(model, spec, prompts)
    ours = run_ours(params, spec, prompts, a.new_tokens, actor=model, tp=world)
    peaks: list = [None] * world
    dist.all_gather_object(peaks, {k: v["peak_memory_gib"] for k, v in ours.items()})
    shards: list = [None] * world
    dist.all_gather_object(shards, ours["per_call"]["weight_gib"])
    for k, v in ours.items():
        v["peak_memory_gib_per_gpu"] = [p[k] for p in peaks]
    if rank == 0:
        print("ours", json.dumps(ours), flush=True)
    if a.profile and a.device == "cuda":
        profile_decode(
            params, spec, prompts, os.path.dirname(os.path.abspath(a.out)), rank == 0, f"tp{world}_"
        )
    dist.barrier()
    ref = None
    if rank == 0:  # HF on one GPU while the other ranks wait
        ref = run_hf(hf.to(a.device), prompts, a.new_tokens)
        print("hf", json.dumps(ref), flush=True)
        del hf
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
            "gpus": world,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": " ".join(["torchrun", f"--nproc-per-node={world}", *sys.argv]),
            "config": vars(a)
            | {
                "model": "Qwen2.5-0.5B shape, random bf16, megatron-core actor loaded from HF safetensors",
                "tensor_model_parallel_size": world,
                "generation_tp": world,
                "padded_vocab_size": spec.padded_vocab_size,
                "temperature": 1.0,
                "eos": EOS,
            },
            "hbm_floor": (
                "per GPU and step: this rank's weight shard (weight_gib: qkv/proj/fc1/fc2 and the tied "
                "vocab-parallel embedding split by TP, padded rows included, norms replicated) + the live KV "
                "of num_query_groups/TP groups (mean context prompt + new/2) at 4.8 TB/s; collectives excluded"
            ),
            "weight_gib_per_gpu": shards,
            "ours": ours,
            "hf_generate": ref,
            "hf_generate_gpus": 1,
            "graph_decode_equals_eager_greedy": graphs_ok,
            "speedup_new_tok_per_s": {k: v["new_tok_per_s"] / ref["new_tok_per_s"] for k, v in ours.items()},
            "speedup_per_gpu": {
                k: v["new_tok_per_s"] / world / ref["new_tok_per_s"] for k, v in ours.items()
            },
        }
        write_and_print(a, result)
    destroy_distributed()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--profile", action="store_true", help="also write torch.profiler kernel tables")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_decode.json"))
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        main_tp(a, world)
    else:
        main_single(a)


if __name__ == "__main__":
    main()
