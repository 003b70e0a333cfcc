"""Where a decode step's time goes at the GRPO benchmark's shape (issue 8): the engine on the
Qwen2.5-0.5B shape (random bf16) with B prompts x prompt_len, new tokens at temperature 1.

Reports ms per decode step for the whole step, for the model's graph replay alone and for the sampling
part alone (timed with CUDA events over many replays), plus a kernel table of a short profiled call.
Run: ``python benchmarks/profile_decode_step.py --out $OUT/decode_step.json`` (CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import EOS, build_hf, mcore_params, spec_of, sync  # noqa: E402

from megatron_rl.rollout import decoder, reshard  # noqa: E402
from megatron_rl.rollout import engine as eng  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from megatron_rl.rollout.sampling import (  # noqa: E402
    SamplingParams,
    sample,
    sample_with_logprobs,
    token_logprobs,
)


def cuda_ms(fn, n: int) -> float:
    fn()
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    sync()
    return a.elapsed_time(b) / n


def _attn_sdpa(q, k, v, mask, positions, prefix=None):  # SDPA reads each slot's own prompt copy
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


ATTENTION = {"default": decoder.decode_attention, "sdpa": _attn_sdpa}


def engine_args(ap: argparse.ArgumentParser) -> None:
    """The arguments ``build_engine`` reads."""
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="a name in megatron_rl.models.shapes.SHAPES")


def build_engine(a) -> tuple[RolloutEngine, object, list[list[int]], SamplingParams]:
    """The engine at ``a.shape`` (random bf16 weights, graphs kept), ``a.prompts`` random prompts of
    ``a.prompt_len`` tokens and temperature-1 sampling of ``a.new_tokens``: (engine, spec, prompts, sampling)."""
    if a.shape == "qwen2.5-0.5b":
        hf = build_hf(24, "cuda")
    else:  # another shape, random bf16 weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from megatron_rl.models.shapes import hf_config

        cfg = dict(hf_config(a.shape, eos_token_id=EOS, pad_token_id=0, bos_token_id=0))
        cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    spec = spec_of(hf.config)
    params = mcore_params(hf, spec)
    del hf
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 150000, (a.prompts, a.prompt_len), generator=g).tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, stop_token_ids=(EOS,), seed=0)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=a.prompts, keep_cache=True))
    return engine, spec, prompts, sampling


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_args(ap)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_step.json"))
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    engine, spec, prompts, sampling = build_engine(a)
    res = {"config": vars(a)}
    for label in ("first", "second"):
        engine.generate(prompts, sampling)
        st = engine.last_stats
        res[label] = {"decode_s": st.decode_s, "prefill_s": st.prefill_s, "steps": st.decode_steps,
                      "ms_per_step": 1e3 * st.decode_s / st.decode_steps}  # fmt: skip
        print(label, res[label], flush=True)
    state = engine._state
    state.bind(reshard.gather_weights(engine._params(), spec, reshard.build_layout(1)))
    b, full = a.prompts, state.cache.plan.max_len
    for kv in sorted({min(full, k) for k in (256, 384, 512, 640, 768)} | {full}):
        state.pos[:b] = kv - 1
        res[f"model_replay_ms_kv{kv}"] = cuda_ms(lambda kv=kv: state.decode(b, kv), 50)
    logits = state.decode(b, full)  # [B, V] bf16
    gen = torch.Generator(device="cuda").manual_seed(0)
    res["eager_sample_ms"] = cuda_ms(lambda: sample(logits.float(), sampling, gen), 50)
    tok = sample(logits.float(), sampling, gen)
    res["eager_logprob_ms"] = cuda_ms(lambda: token_logprobs(logits.float(), tok, 1.0), 50)
    res["fused_sample_and_logprob_ms"] = cuda_ms(lambda: sample_with_logprobs(logits, sampling, gen), 50)
    for name, attn in ATTENTION.items():  # decode attention variants: recapture, time the replay
        decoder.decode_attention = attn
        state.graphs, state.pool = {}, None
        state.pos[:b] = full - 1
        res[f"model_replay_ms_kv{full}_{name}"] = cuda_ms(lambda: state.decode(b, full), 50)
    decoder.decode_attention = ATTENTION["default"]
    state.graphs, state.pool = {}, None
    print(json.dumps(res, indent=1), flush=True)
    from torch.profiler import ProfilerActivity, profile

    state.pos[:b] = 383
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # eager: every op of 5 decode steps
        for _ in range(5):
            state._eager(b, 384)
        sync()
    eager_table = prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70
    )
    print(eager_table)
    with open(a.out.replace(".json", "_eager_ops.txt"), "w") as f:
        f.write(f"5 eager decode steps, B={b}, kv=384\n" + eager_table)

    short = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=(EOS,), seed=0)
    engine.generate(prompts, short)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, short)
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out.replace(".json", "_profile.txt"), "w") as f:
        f.write(table)
    print(table)
    res["kv_bucket"] = eng._KV_BUCKET
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
