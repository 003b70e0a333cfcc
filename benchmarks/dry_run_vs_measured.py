"""Issue 6: the dry-run memory estimate next to the peaks a real run measured (same config, same GPU).

Reads ``dry_run.json`` (``trainer.dry_run=true``) and the run's ``metrics.jsonl`` (per-phase
``perf/max_memory_allocated_gb/<phase>``, GiB, rank 0) and writes, for training (the actor and critic
updates), generation and the whole step: estimate, measured maximum over the steps, and estimate /
measured. The target is |estimate / measured - 1| <= 0.2.

    python benchmarks/dry_run_vs_measured.py --dry RUN/dry_run.json --metrics RUN/metrics.jsonl --out X.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30
KEY = "perf/max_memory_allocated_gb"


def compare(dry: dict, rows: list[dict]) -> dict:
    mem = dry["memory"]
    phases: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith(KEY + "/"):
                name = k[len(KEY) + 1 :]
                phases[name] = max(phases.get(name, 0.0), float(v))
    overall = max((float(r[KEY]) for r in rows if KEY in r), default=None)
    train = max((phases[p] for p in ("update_actor", "update_critic") if p in phases), default=None)
    pairs = {
        "training (update phases)": (mem["peak_train"] / GIB, train),
        "generation (gen phase)": (mem["peak_generate"] / GIB, phases.get("gen")),
        "whole step": (max(mem["peak_train"], mem["peak_generate"]) / GIB, overall),
    }
    table = {}
    for name, (est, measured) in pairs.items():
        ratio = est / measured if measured else None
        table[name] = {"estimate_gib": est, "measured_gib": measured, "estimate_over_measured": ratio,
                       "within_20_percent": ratio is not None and abs(ratio - 1) <= 0.2}  # fmt: skip
    return {"comparison": table, "measured_phase_peaks_gib": phases, "estimate_bytes": mem["bytes"],
            "estimate_notes": mem["notes"], "prompt_length": dry.get("prompt_length"), "layout": dry["layout"],
            "steps": len(rows)}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = [json.loads(x) for x in Path(a.metrics).read_text().splitlines() if x.strip()]
    out = compare(json.loads(Path(a.dry).read_text()), rows)
    Path(a.out).write_text(json.dumps(out, indent=2))
    for name, r in out["comparison"].items():
        m = r["measured_gib"]
        print(f"{name:26} estimate {r['estimate_gib']:7.2f} GiB  measured "
              + (f"{m:7.2f} GiB  ratio {r['estimate_over_measured']:.3f}" if m else "n/a"))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
