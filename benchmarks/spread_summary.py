"""The table of ``run_spread.sh``: per size, ours at the defaults (prompts shared) / packed / padded (bench_rl_step.py --lengths spread)
and TRL (bench_trl_grpo.py --lengths spread) from PARTS -> OUT/spread.json (everything, part JSONs
included) and OUT/spread.md (the table, the roofline arithmetic, the padded-fraction arithmetic).

    python3 benchmarks/spread_summary.py PARTS OUT "qwen2.5-0.5b qwen2.5-3b"
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from spread_lengths import pad_report


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def variant_row(ours: dict, trl: dict | None) -> dict:
    """One run of ours against TRL's run on the same lengths."""
    m = ours["median_after_warmup"]
    row = {"step_s": m["step_s"], "tok_per_s_per_gpu": m["tok_per_s_per_gpu"], "timing_s": m["timing_s"],
           "update_pad_frac": m.get("update_pad_frac"), "update_shared_frac": m.get("update_shared_frac"),
           "step_over_roofline": m.get("step_over_roofline"),
           "roofline": ours["steps"][-1].get("roofline"), "update_mfu": m.get("actor_update_mfu"),
           "decode_fraction_of_hbm_floor": m.get("decode_fraction_of_hbm_floor"),
           "mean_response_len": ours["workload"].get("mean_response_len"),
           "lengths_as_forced": [r.get("lengths_as_forced") for r in ours["steps"]],
           "resolved": ours.get("resolved"), "packed_attention_varlen": ours.get("packed_attention_varlen")}  # fmt: skip
    if trl:
        row["ratio_to_trl"] = trl["median_after_warmup"]["step_s"] / m["step_s"]  # same tokens per step
    return row


def _median(values: list[float]) -> float:
    """Median of the timed steps' values (the first step is warm-up, as in the measured medians)."""
    v = sorted(values) or [0.0]
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def main(parts: str, out: str, sizes: str) -> None:
    rows, md = [], []
    for shape in sizes.split():
        tag = shape.replace(".", "_").replace("-", "_")
        trl = _load(Path(parts) / f"trl_{tag}.json")
        entry: dict = {"shape": shape, "trl": None}
        if trl and len(trl["steps"]) < 2:  # killed after its warm-up step: no timed step, no ratio
            entry["trl_warm_up_only_step_s"] = trl["steps"][0]["step_s"] if trl["steps"] else None
            trl = None
        if trl:
            t = trl["median_after_warmup"]
            entry["trl"] = {"step_s": t["step_s"], "timing_s": t["timing_s"],
                            "completion_mean_length_logged": trl.get("completion_mean_length_logged")}  # fmt: skip
        for variant in ("default", "packed", "padded"):
            ours = _load(Path(parts) / f"ours_{variant}_{tag}.json")
            if not ours:
                continue
            v = entry[variant] = variant_row(ours, trl)
            w = ours["workload"]
            budget = ours["resolved"]["actor.ppo_max_token_len_per_gpu"]
            cpu = pad_report(
                w["response_len"], w["prompt_len"], [budget], w["prompts"], w["n"], len(ours["steps"])
            )
            v["pad_frac_arithmetic"] = cpu["by_budget"][budget]
            r = v["roofline"] or {}
            md.append(f"| {shape} | {variant} | {v['step_s']:.2f} | {_f(entry['trl'] and entry['trl']['step_s'], '.2f')} "
                      f"| {_f(v.get('ratio_to_trl'), '.2f')} | {_f(v['update_pad_frac'], '.3f')} "
                      f"| {_median(v['pad_frac_arithmetic']['pad_frac_padded'][1:]):.3f} | {_f(r.get('total_s'), '.2f')} "
                      f"| {_f(v['step_over_roofline'], '.2f')} | {_f(v['decode_fraction_of_hbm_floor'], '.1%')} "
                      f"| {_f(v['mean_response_len'], '.0f')} |")  # fmt: skip
            if r and "roofline_written_out" not in entry:
                entry["roofline_written_out"] = (
                    f"{r['formula']} = {r['update_s']:.3f} + {r['prefill_s']:.3f} + {r['decode_s']:.3f} = {r['total_s']:.3f} s"
                )
        rows.append(entry)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"date": datetime.date.today().isoformat(), "gpu": gpu, "command": os.environ.get("RUN_SPREAD_COMMAND"),
              "rows": rows}  # fmt: skip
    Path(out, "spread.json").write_text(json.dumps(result, indent=2))
    head = [f"{gpu}, {result['date']}: `{result['command']}`", "",
            "| shape | micro-batches | step s | TRL s | x TRL | pad frac (measured) | pad frac today (arithmetic, padded rows) "
            "| roofline s | x roofline | decode % HBM floor | mean response |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    tail = ["", "Roofline (6N x trained tokens + 2N x prompt tokens at 790 TFLOP/s + decode bytes at 4.8 TB/s, "
            "real lengths):"] + [f"- {e['shape']}: {e.get('roofline_written_out', '—')}" for e in rows]  # fmt: skip
    text = "\n".join(head + md + tail) + "\n"
    Path(out, "spread.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(*sys.argv[1:4])
