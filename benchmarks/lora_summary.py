"""lora_8b.json + full_8b.json (bench_rl_step's records of the LoRA and the full fine-tuning run of
bench_lora_8b.sh, same workload and memory keys) -> one Markdown table: step time, phases, peak allocated
memory per phase, the peak ratio against issue 22's target (< 0.5). A missing record is reported as such.

Usage: python benchmarks/lora_summary.py lora_8b.json full_8b.json lora_8b.md
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _load(path: str) -> dict | None:
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


def _row(name: str, r: dict | None) -> str:
    if r is None:
        return f"| {name} | not run (no record: see the log) | | | | |"
    med, peak = r["median_after_warmup"], r.get("peak_allocated_gib", float("nan"))  # none on CPU
    fmt = lambda d: ", ".join(f"{k} {v:.1f}" for k, v in d.items())  # noqa: E731
    phases = ", ".join(f"{k} {v:.2f}" for k, v in med["timing_s"].items())
    return (
        f"| {name} | {med['step_s']:.2f} | {phases} | {peak:.1f} | "
        f"{fmt(r.get('peak_allocated_gib_by_phase', {}))} | {fmt(r['dry_run_gib_by_phase'])} |"
    )


def main(lora_src: str, full_src: str, dst: str) -> None:
    lora, full = _load(lora_src), _load(full_src)
    lines = [
        "| run | step s | phases (median s) | peak GiB | peak by phase (GiB) | dry run by phase (GiB) |",
        "| --- | ---: | --- | ---: | --- | --- |",
        _row("LoRA r=32 all linear", lora),
        _row("full fine-tuning (hybrid CPU optimizer, fraction 0.5)", full),
        "",
    ]
    if lora and full and "peak_allocated_gib" in lora and "peak_allocated_gib" in full:
        ratio = lora["peak_allocated_gib"] / full["peak_allocated_gib"]
        step = lora["median_after_warmup"]["step_s"] / full["median_after_warmup"]["step_s"]
        verdict = "meets" if ratio < 0.5 else "misses"
        lines.append(f"LoRA peak / full fine-tuning peak: {ratio:.2f} (target < 0.5: {verdict}); "
                     f"step time LoRA / full: {step:.2f}.")  # fmt: skip
        for k in sorted(set(lora["peak_allocated_gib_by_phase"]) & set(full["peak_allocated_gib_by_phase"])):
            a, b = lora["peak_allocated_gib_by_phase"][k], full["peak_allocated_gib_by_phase"][k]
            lines.append(f"- {k}: LoRA {a:.1f} / full {b:.1f} GiB = {a / b:.2f}")
    for name, r in (("LoRA", lora), ("full", full)):
        if r is not None:
            lines.append(f"{name}: resolved {json.dumps(r['resolved'])}; build {r['build_s']:.0f} s; "
                         f"update MFU {r['median_after_warmup']['actor_update_mfu']:.3f}")  # fmt: skip
    rec = lora or full
    if rec is not None:
        lines.append(f"Workload: {json.dumps(rec['workload'])}")
    lines.append(f"Command: `{os.environ.get('LORA_8B_COMMAND', 'bash benchmarks/bench_lora_8b.sh')}`")
    for name, r in (("LoRA", lora), ("full", full)):
        if r is not None:
            lines.append(f"{name} overrides: {' '.join(r['overrides'])}")
    Path(dst).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:4])
