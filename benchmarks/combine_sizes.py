"""One size table from the device calls of a session: ``FOLDER/call*/`` each hold one run_sizes.sh call's
output (sizes.json with the per-size parts it embedded) or TRL runs made apart (trl_<tag>.json from
bench_trl_grpo.py). A size's TRL numbers come from its own call when that call ran TRL for it, else from a
TRL-only folder (marked * in the table: not the same run). Writes FOLDER/sizes.md and FOLDER/sizes.json.

    python3 benchmarks/combine_sizes.py benchmarks/results/2026-12-02-h200-session5
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes_summary import markdown, size_row  # noqa: E402

ORDER = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b"]


def _tag(shape: str) -> str:
    return shape.replace(".", "_").replace("-", "_")


def _trl_command(shape: str, part: dict) -> str:
    gc = " --gradient-checkpointing" if part["workload"].get("gradient_checkpointing") else ""
    return f"python3 benchmarks/bench_trl_grpo.py --shape {shape} --steps {len(part['steps'])}{gc}"


def collect(root: Path) -> tuple[list[dict], list[str], dict]:
    """(rows in size order, one line per call, the first call's sizes.json for the header)."""
    parts, apart, calls, first = {}, {}, [], None
    for call in sorted(p for p in root.glob("call*") if p.is_dir()):
        summary = call / "sizes.json"
        if summary.exists():
            d = json.loads(summary.read_text())
            first = first or d
            parts |= d["parts"]
            # a TRL run of an earlier call stays as the fallback (marked *) for a later call without one
            apart |= {s: p["trl"] for s, p in d["parts"].items() if p.get("trl") is not None}
            calls.append(f"{len(calls) + 1}. `{d['command']}` ({call.name}: {', '.join(d['parts'])})")
            continue
        trl = {s: json.loads((call / f"trl_{_tag(s)}.json").read_text())
               for s in ORDER if (call / f"trl_{_tag(s)}.json").exists()}  # fmt: skip
        apart |= trl
        if trl:
            cmds = ", ".join(f"`{_trl_command(s, p)}`" for s, p in trl.items())
            calls.append(f"{len(calls) + 1}. {cmds} ({call.name}: TRL apart, marked *)")
    if first is None:
        raise SystemExit(
            f"no call*/sizes.json under {root}: run benchmarks/run_sizes.sh with OUT there first"
        )
    rows = []
    for shape in (s for s in ORDER if s in parts):
        p = parts[shape]
        row = size_row(shape, p["ours"], p["trl"] or apart.get(shape))
        rows.append(row | {"trl_same_call": p["trl"] is not None})
    return rows, calls, first


def main(folder: str) -> None:
    root = Path(folder)
    rows, calls, a = collect(root)
    head = (f"{a['gpu']}, {a['date']}; " + ", ".join(f"{k} {v}" for k, v in a["versions"].items())
            + f"\n\n{len(calls)} device calls, one H200:\n" + "\n".join(calls))  # fmt: skip
    text = markdown(rows, head)
    for r in rows:
        if not r["trl_same_call"] and "trl_step_s" in r:
            text = text.replace(f"| {r['trl_step_s']:.2f} (", f"| *{r['trl_step_s']:.2f} (")
    (root / "sizes.md").write_text(text)
    meta = {"gpu": a["gpu"], "date": a["date"], "versions": a["versions"], "calls": calls}
    (root / "sizes.json").write_text(json.dumps(meta | {"rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main(sys.argv[1])
