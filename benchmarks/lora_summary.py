"""lora_8b.json (bench_rl_step's record of the LoRA run) -> a Markdown table next to full fine-tuning at the
same shape and workload (issue 15's 8B run, benchmarks/results/2026-12-01-h200-session4/sizes.md).

Usage: python benchmarks/lora_summary.py lora_8b.json lora_8b.md
"""

from __future__ import annotations

import json
import sys

# Full fine-tuning, Llama-3.1-8B shape, same workload, one H200 (hybrid CPU optimizer, fraction 0.5)
FULL_FT = {"step_s": 55.68, "peak_gen_gib": 111.7, "peak_update_gib": 127.0,
           "source": "benchmarks/results/2026-12-01-h200-session4/sizes.md"}  # fmt: skip
H200_GB = 141.0


def main(src: str, dst: str) -> None:
    r = json.load(open(src))
    med = r["median_after_warmup"]
    peaks = r.get("peak_allocated_gib_by_phase", {})
    peak = r.get("peak_allocated_gib", float("nan"))
    full_peak = max(FULL_FT["peak_gen_gib"], FULL_FT["peak_update_gib"])
    lines = [
        "| run | step s | peak GiB | peak by phase (GiB) | dry run by phase (GiB) |",
        "| --- | ---: | ---: | --- | --- |",
        f"| LoRA r=32 all linear | {med['step_s']:.2f} | {peak:.1f} | "
        + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items())
        + " | "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["dry_run_gib_by_phase"].items())
        + " |",
        f"| full fine-tuning ({FULL_FT['source']}) | {FULL_FT['step_s']:.2f} | {full_peak:.1f} | "
        f"generation {FULL_FT['peak_gen_gib']}, actor_update {FULL_FT['peak_update_gib']} | |",
        "",
        f"LoRA peak / full fine-tuning peak: {peak / full_peak:.2f} (target < 0.5); "
        f"step time ratio LoRA / full: {med['step_s'] / FULL_FT['step_s']:.2f}.",
        f"Phases (median s): {json.dumps({k: round(v, 2) for k, v in med['timing_s'].items()})}",
        f"Workload: {json.dumps(r['workload'])}",
        f"Overrides: {' '.join(r['overrides'])}",
    ]
    open(dst, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
