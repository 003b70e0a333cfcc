"""Where one decode step's device time goes, split at the CUDA graph's edge (issue 16's decode target).

The engine's decode step is a graph replay (the model up to the logits) followed by eager kernels launched
from Python: the row keys of the layout-invariant noise, the draw, and the bookkeeping of ``_record``. This
builds the engine at ``profile_decode_step``'s shape (Qwen2.5-0.5B, random bf16, 512 prompts x 256 tokens),
times whole decode steps with the per-slot bookkeeping in torch ops and in ``kernels.slot_state``'s two
launches (A B B A in one process, with the generator's noise keys and with ``layout_invariant_sampling``'s),
then profiles (layout-invariant) a short generate call each way and splits its chrome trace by launch: kernels
whose correlation id is a ``cudaGraphLaunch``'s are the graph's, the rest eager. Per steady-state step (medians
over the decode steps of the profiled call) it reports the graph's span and busy time, the eager kernels
between two replays (count, busy time, the gap they and the idle device fill) and both kernel lists by name.

``--old-sampler FILE`` (another ``kernels/sampler.py``, e.g. the per-token draw before session 37): the A B B A
and the profiles compare the engine's draw by that file's kernel ("off") and by this tree's ("on"), the slot
kernels on in both, instead of the slot kernels off and on.

Run: ``python benchmarks/decode_step_parts.py --out $OUT/decode_parts.json`` (CUDA, ~1 min).
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

from megatron_rl.kernels import slot_state  # noqa: E402
from megatron_rl.kernels.compile import trial_passed  # noqa: E402
from megatron_rl.rollout import sampling as rollout_sampling  # noqa: E402


def _switch(old_sampler: str | None):
    """on(flag): with ``old_sampler`` the engine's draw by that file's kernel (off) or this tree's (on), else
    ``kernels.slot_state`` off / on."""
    if old_sampler is None:
        return lambda on: setattr(slot_state, "ON_CUDA", on)
    import importlib.util

    spec = importlib.util.spec_from_file_location("old_sampler", old_sampler)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    new_draw = rollout_sampling._kernel_draw

    def old_draw(logits, keys, ids, inv_temp, noisy):  # the engine's call, that file's kernel and rule
        return old.draw(logits, keys, inv_temp, noisy, mix=True, logprobs=True)

    return lambda on: setattr(rollout_sampling, "_kernel_draw", new_draw if on else old_draw)


def main() -> None:
    ap = argparse.ArgumentParser()
    engine_args(ap)
    ap.add_argument("--profiled-tokens", type=int, default=48)
    ap.add_argument("--old-sampler", default=None, help="A/B the draw against this kernels/sampler.py")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_parts.json"))
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    engine, _, prompts, sampling = build_engine(a)
    res = {"config": vars(a), "gpu": torch.cuda.get_device_name()}
    invariant = dataclasses.replace(sampling, layout_invariant_sampling=True)
    switch = _switch(a.old_sampler)
    res["ab"] = "sampler (off: --old-sampler)" if a.old_sampler else "slot kernels"
    # A B B A: the decode step with the torch bookkeeping (off) and with kernels.slot_state's (on), with the
    # generator's noise keys (the benchmarks' default) and with rollout.layout_invariant_sampling's
    for mode, sp in (("default", sampling), ("invariant", invariant)):
        # warm-up, each way: graphs captured, kernels compiled and their trials run; this tree's way first, so
        # that --old-sampler's kernel (another rule) never meets the sampler's start-up trial
        for on in (True, False):
            switch(on)
            engine.generate(prompts, sp)
        for label, on in (("off", False), ("on", True), ("on_2", True), ("off_2", False)):
            switch(on)
            engine.generate(prompts, sp)
            st = engine.last_stats
            res[f"{mode}_{label}"] = {
                "decode_s": st.decode_s,
                "steps": st.decode_steps,
                "ms_per_step": 1e3 * st.decode_s / st.decode_steps,
            }
            print(f"{mode}_{label}", res[f"{mode}_{label}"], flush=True)
    res["slot_kernels_trial_passed"] = trial_passed("the decode step's slot kernels (cuda)")
    print("slot kernels' trial passed:", res["slot_kernels_trial_passed"], flush=True)
    from torch.profiler import ProfilerActivity, profile

    short = dataclasses.replace(invariant, max_new_tokens=a.profiled_tokens)  # both tails: keys, bookkeeping
    for label, on in (("profiled_off", False), ("profiled_on", True)):
        switch(on)
        engine.generate(prompts, short)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, short)
            torch.cuda.synchronize()
        trace = a.out.replace(".json", "_trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        os.remove(trace)
        res[label] = split_steps(events)
        print(label, json.dumps(res[label]["median"]), flush=True)
        for part in ("graph_kernels_us", "tail_kernels_us"):
            print(" ", part)
            for name, us in list(res[label][part].items())[:25]:
                print(f"  {us:9.2f}  {name}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
