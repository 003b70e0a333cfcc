"""The size table of ``run_sizes.sh``: reads the per-size JSONs of bench_rl_step.py (ours_<tag>.json) and
bench_trl_grpo.py (trl_<tag>.json) from PARTS and writes OUT/sizes.json (everything, the part JSONs
included) and OUT/sizes.md (the table, the roofline arithmetic per size, the misses).

    python3 benchmarks/sizes_summary.py PARTS OUT "qwen2.5-0.5b qwen2.5-3b"
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _ver(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def size_row(shape: str, ours: dict | None, trl: dict | None) -> dict:
    """One size's numbers (None where a part did not finish)."""
    row: dict = {"shape": shape}
    if ours:
        m = ours["median_after_warmup"]
        last = ours["steps"][-1]
        measured = ours.get("peak_allocated_gib_by_phase", {})
        dry = ours.get("dry_run_gib_by_phase", {})
        row |= {"step_s": m["step_s"], "tok_per_s_per_gpu": m["tok_per_s_per_gpu"],
                "update_mfu": m["actor_update_mfu"], "timing_s": m["timing_s"],
                "decode_tok_per_s": m.get("decode_tok_per_s"),
                "decode_fraction_of_hbm_floor": m.get("decode_fraction_of_hbm_floor"),
                "roofline": last.get("roofline"), "step_over_roofline": m.get("step_over_roofline"),
                "resolved": ours.get("resolved"), "overrides": ours.get("overrides"),
                "kv_slots_per_step": [st.get("decode", {}).get("slots") for st in ours["steps"]],
                "peak_gib": {"generation": measured.get("generation"), "actor_update": measured.get("actor_update"),
                             "log_probs": measured.get("log_probs")},
                "dry_run_gib": {"generation": dry.get("generation"), "actor_update": dry.get("actor_update")}}  # fmt: skip
    if trl and len(trl["steps"]) < 2:  # killed after its warm-up step: no timed step, no ratio
        row["trl_warm_up_only_step_s"] = trl["steps"][0]["step_s"] if trl["steps"] else None
    elif trl:
        t = trl["median_after_warmup"]
        row |= {"trl_step_s": t["step_s"], "trl_tok_per_s_per_gpu": t["tok_per_s_per_gpu"],
                "trl_timing_s": t["timing_s"], "trl_gradient_checkpointing": trl["workload"].get("gradient_checkpointing"),
                "trl_timed_steps": len(trl["steps"]) - 1}  # fmt: skip
        if ours:
            row["ratio_to_trl"] = row["tok_per_s_per_gpu"] / row["trl_tok_per_s_per_gpu"]
    return row


def _f(v, fmt: str, none: str = "—") -> str:
    return none if v is None else format(v, fmt)


def markdown(rows: list[dict], head: str) -> str:
    lines = [head, "",
             "| shape | step s | tok/s/GPU | TRL s (tok/s/GPU) | x TRL | update MFU | decode tok/s | HBM floor | "
             "peak gen / update GiB | dry run gen / update GiB | roofline s | x roofline |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['shape']} | no result | | {_f(r.get('trl_step_s'), '.2f')} | | | | | | | | |")
            continue
        pk, dr, rf = r["peak_gib"], r["dry_run_gib"], r["roofline"] or {}
        trl = f"{r['trl_step_s']:.2f} ({r['trl_tok_per_s_per_gpu']:.0f})" if "trl_step_s" in r else "not run"
        if r.get("trl_warm_up_only_step_s"):
            trl = f"warm-up step only ({r['trl_warm_up_only_step_s']:.2f})"
        if r.get("trl_gradient_checkpointing"):
            trl += " GC"
        lines.append(
            f"| {r['shape']} | {r['step_s']:.2f} | {r['tok_per_s_per_gpu']:.0f} | {trl} | {_f(r.get('ratio_to_trl'), '.2f')} "
            f"| {r['update_mfu']:.3f} | {_f(r['decode_tok_per_s'], '.0f')} | {_f(r['decode_fraction_of_hbm_floor'], '.1%')} "
            f"| {_f(pk['generation'], '.1f')} / {_f(pk['actor_update'], '.1f')} "
            f"| {_f(dr['generation'], '.1f')} / {_f(dr['actor_update'], '.1f')} "
            f"| {_f(rf.get('total_s'), '.2f')} | {_f(r['step_over_roofline'], '.2f')} |"
        )  # fmt: skip
    lines += ["", "Roofline per size (update 6N x trained tokens + prefill 2N x prompt tokens at 790 TFLOP/s, "
              "decode bytes = weights + live KV per decode step at 4.8 TB/s):"]  # fmt: skip
    for r in rows:
        rf = r.get("roofline")
        if rf:
            lines.append(f"- {r['shape']}: {rf['formula']} = {rf['update_s']:.3f} + {rf['prefill_s']:.3f} + "
                         f"{rf['decode_s']:.3f} = {rf['total_s']:.3f} s; ours {r['step_s']:.2f} s = "
                         f"{r['step_over_roofline']:.2f}x")  # fmt: skip
    lines += ["", "Dry run (the memory model at the resolved values) vs measured peak allocated, per phase (target: "
              "within 15%):"]  # fmt: skip
    for r in rows:
        if "step_s" in r:
            lines.append(
                f"- {r['shape']}: " + "; ".join(_versus(r, ph) for ph in ("generation", "actor_update"))
            )
    lines += ["", "Resolved by the memory plan (auto), KV slots decoded together per step (first = warm-up) and "
              "phases (s):"]  # fmt: skip
    for r in rows:
        if "step_s" in r:
            lines.append(f"- {r['shape']}: {r['resolved']}; slots {r.get('kv_slots_per_step')}; ours {json.dumps({k: round(v, 2) for k, v in r['timing_s'].items()})}"
                         + (f"; TRL {json.dumps({k: round(v, 2) for k, v in r['trl_timing_s'].items()})}" if "trl_timing_s" in r else ""))  # fmt: skip
    return "\n".join(lines) + "\n"


def _versus(r: dict, phase: str) -> str:
    planned, measured = r["dry_run_gib"].get(phase), r["peak_gib"].get(phase)
    if planned is None or measured is None:
        return f"{phase} —"
    return f"{phase} {planned:.1f} planned vs {measured:.1f} GiB measured ({planned / measured - 1:+.1%})"


def main(parts: str, out: str, sizes: str) -> None:
    import torch

    rows, raw = [], {}
    order = ["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b"]
    for shape in sorted(sizes.split(), key=lambda s: order.index(s) if s in order else len(order)):
        tag = shape.replace(".", "_").replace("-", "_")
        ours, trl = _load(Path(parts) / f"ours_{tag}.json"), _load(Path(parts) / f"trl_{tag}.json")
        raw[shape] = {"ours": ours, "trl": trl}
        rows.append(size_row(shape, ours, trl))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    versions = {
        p: _ver(p) for p in ("torch", "transformers", "megatron-core", "trl", "datasets", "accelerate")
    }
    date = datetime.date.today().isoformat()
    command = os.environ.get("RUN_SIZES_COMMAND", "bash benchmarks/run_sizes.sh")
    head = (
        f"{gpu}, {date}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"\n\nCommand: `{command}`"
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    result = {"date": date, "gpu": gpu, "versions": versions, "command": command, "rows": rows, "parts": raw}
    (Path(out) / "sizes.json").write_text(json.dumps(result, indent=1))
    text = markdown(rows, head)
    (Path(out) / "sizes.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:4])
