"""``rollout.decode_parts`` on the GPU: the decode step's rows as 1, 2, 3 or 4 parts, each on its own stream
inside the CUDA graph, so that one part's attention (HBM-bound) runs beside another's GEMMs (tensor-core-bound).

Builds the engine at ``profile_decode_step``'s shape (Qwen2.5-0.5B, random bf16, 512 rows, 256-token prompts,
512 new tokens) and times whole generate calls' decode steps with every setting in one process, in the order
1 2 3 4 4 3 2 1 after a warm-up of each (graphs captured per setting), for two workloads: 512 distinct prompts,
and 64 prompts x 8 samples (GRPO's shape: ``rollout.prompt_kv_sharing`` reads a prompt from its lead slot,
which may lie in another part). Then profiles a short call at 1 and at 2 parts: the graph's span against
the sum of its kernels' times (above the span where parts overlap).

Run: ``python benchmarks/bench_decode_parts.py --out $OUT/decode_parts.json`` (CUDA, ~2 min).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_gaps import split_steps  # noqa: E402
from profile_decode_step import build_engine, engine_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_args(ap)
    ap.add_argument("--parts", default="1,2,3,4")
    ap.add_argument("--profiled-tokens", type=int, default=48)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_parts.json"))
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    engine, _, prompts, sampling = build_engine(a)
    settings = [int(p) for p in a.parts.split(",")]
    res = {"config": vars(a), "gpu": torch.cuda.get_device_name(), "runs": {}}
    workloads = {
        "distinct": (prompts, sampling),
        "shared": (prompts[: len(prompts) // 8], dataclasses.replace(sampling, n=8)),
    }

    def run(work: str, parts: int, label: str) -> None:
        ps, sp = workloads[work]
        engine.config = dataclasses.replace(engine.config, decode_parts=parts)  # a new state's
        if engine._state is not None:  # the kept one's (keep_cache)
            engine._state.parts = parts
        engine.generate(ps, sp)
        st = engine.last_stats
        row = {"parts": parts, "steps": st.decode_steps, "ms_per_step": 1e3 * st.decode_s / st.decode_steps}
        res["runs"].setdefault(work, {}).setdefault(label, []).append(row)
        print(work, label, row, flush=True)

    for work in workloads:
        for p in settings:  # warm-up: each setting's graphs captured, kernels' trials run
            run(work, p, "warmup")
        for p in settings + settings[::-1]:
            run(work, p, f"parts_{p}")
    from torch.profiler import ProfilerActivity, profile

    ps, sp = workloads["shared"]
    short = dataclasses.replace(sp, max_new_tokens=a.profiled_tokens)
    for p in (1, 2):
        engine._state.parts = p
        engine.config = dataclasses.replace(engine.config, decode_parts=p)
        engine.generate(ps, short)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(ps, short)
            torch.cuda.synchronize()
        trace = a.out.replace(".json", f"_trace{p}.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        os.remove(trace)
        parts = split_steps(events)
        res[f"profiled_parts_{p}"] = {
            "median": parts["median"],
            "graph_kernels_us": parts["graph_kernels_us"],
        }
        print(f"profiled parts={p}", json.dumps(parts["median"]), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
