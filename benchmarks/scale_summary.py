"""Summarise scale_run.sh: steady-state tokens/s/GPU (steps after the first), scaling efficiency against the
1- and 2-GPU runs (same per-GPU batch), resharding time and peak memory per GPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean


def steady(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
    return mean(vals) if vals else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--ngpus", type=int, nargs="+", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs = {}
    for n in a.ngpus:
        f = Path(a.work) / f"run_{n}" / "metrics.jsonl"
        rows = [json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else []
        runs[n] = {
            "steps": len(rows),
            "tok_per_s_per_gpu": steady(rows, "perf/throughput"),
            "step_s": steady(rows, "timing_s/step"),
            "reshard_s": steady(rows, "timing_s/reshard"),
            "peak_memory_gb": max((r.get("perf/max_memory_allocated_gb", 0.0) for r in rows), default=None),
        }
    for base in (1, 2):
        ref = runs.get(base, {}).get("tok_per_s_per_gpu")
        for r in runs.values():
            if ref and r["tok_per_s_per_gpu"]:
                r[f"scaling_efficiency_vs_{base}gpu"] = r["tok_per_s_per_gpu"] / ref
    Path(a.out).write_text(json.dumps({"runs": runs}, indent=1))
    print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
