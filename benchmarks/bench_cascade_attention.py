"""``rollout.cascade_attention`` in the engine: the decode step with each shared prompt attended once per group
(its samples' query heads as one tile) against the one-pass kernel reading it per row from the lead slot.

Two engines at ``profile_decode_step``'s shape (Qwen2.5-0.5B by default, random bf16 weights, graphs kept), GRPO's
batch (``--prompts`` / 8 prompts x 8 samples, 256-token prompts, 512 new tokens, temperature 1): whole generate
calls timed per decode step in the order off on on off after a warm-up of each, the tokens of the two compared
(the same seed: they differ only where a rounding flips a near-tie), then a short call of each profiled (the
graph's kernels by name).

Run: ``python benchmarks/bench_cascade_attention.py --out $OUT/cascade.json`` (CUDA, ~1 min).
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

from megatron_rl.rollout.engine import RolloutEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_args(ap)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--profiled-tokens", type=int, default=48)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cascade.json"))
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    off, spec, prompts, sampling = build_engine(a)
    on = RolloutEngine(off.model, spec, dataclasses.replace(off.config, cascade_attention=True))
    engines = {"off": off, "on": on}
    prompts = prompts[: a.prompts // a.samples]
    sp = dataclasses.replace(sampling, n=a.samples)
    res = {"config": vars(a), "gpu": torch.cuda.get_device_name(), "runs": []}
    outs = {}
    for label in ("off", "on", "off", "on", "on", "off"):  # a warm-up each, then A B B A
        outs[label] = engines[label].generate(prompts, sp)
        st = engines[label].last_stats
        row = {"cascade": label, "steps": st.decode_steps, "ms_per_step": 1e3 * st.decode_s / st.decode_steps}
        res["runs"].append(row)
        print(row, flush=True)
    same = sum(x.response_ids == y.response_ids for x, y in zip(outs["off"], outs["on"]))
    res["equal_completions"] = f"{same}/{len(outs['off'])}"
    print("completions equal:", res["equal_completions"], flush=True)
    from torch.profiler import ProfilerActivity, profile

    short = dataclasses.replace(sp, max_new_tokens=a.profiled_tokens)
    for label, engine in engines.items():
        engine.generate(prompts, short)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, short)
            torch.cuda.synchronize()
        trace = a.out.replace(".json", f"_{label}_trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        os.remove(trace)
        parts = split_steps(events)
        res[f"profiled_{label}"] = {"median": parts["median"], "graph_kernels_us": parts["graph_kernels_us"]}
        print(f"profiled {label}", json.dumps(parts["median"]), flush=True)
        for name, us in list(parts["graph_kernels_us"].items())[:6]:
            print(f"  {us:9.1f}  {name[:90]}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
