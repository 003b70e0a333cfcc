"""The session-4 size table from its three device calls (benchmarks/results/2026-12-01-h200-session4/):
the per-size parts that sizes_summary.py embedded in each call's sizes.json, plus the TRL rows of call 3.

    python3 benchmarks/combine_sizes.py benchmarks/results/2026-12-01-h200-session4
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes_summary import markdown, size_row  # noqa: E402

ORDER = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b"]


def main(folder: str) -> None:
    root = Path(folder)
    a = json.loads((root / "call1_sizes_small/sizes.json").read_text())
    b = json.loads((root / "call2_sizes_7b_8b/sizes.json").read_text())
    extra = {s: json.loads(p.read_text()) for s, p in (("qwen2.5-0.5b", root / "call3_trl_decode/trl_qwen2_5_0_5b.json"),
                                                     ("qwen2.5-7b", root / "call3_trl_decode/trl_qwen2_5_7b.json"))}  # fmt: skip
    parts = {**a["parts"], **b["parts"]}
    rows = []
    for shape in ORDER:
        p = parts[shape]
        rows.append(
            size_row(shape, p["ours"], p["trl"] or extra.get(shape)) | {"trl_same_call": p["trl"] is not None}
        )
    call2 = b["command"].replace("TRL_SIZES='qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b'", "TRL_SIZES=''")
    head = (f"{a['gpu']}, {a['date']}; " + ", ".join(f"{k} {v}" for k, v in a["versions"].items())
            + "\n\nThree device calls of one session, one H200 (calls 2 and 3 on the same machine, kept warm):\n"
            + f"1. `{a['command']}` (0.5B ours; 1.5B and 3B ours + TRL in the same run)\n"
            + f"2. `{call2}` (7B and 8B ours; TRL_SIZES was empty, the script records its default)\n"
            + "3. `python3 benchmarks/bench_trl_grpo.py --shape qwen2.5-0.5b --steps 2`, `python3 "
            + "benchmarks/bench_trl_grpo.py --shape qwen2.5-7b --steps 2 --gradient-checkpointing` (the TRL "
            + "numbers marked *: not the same run as ours), `python3 benchmarks/bench_decode.py`")  # fmt: skip
    text = markdown(rows, head)
    for r in rows:
        if not r["trl_same_call"] and "trl_step_s" in r:
            text = text.replace(f"| {r['trl_step_s']:.2f} (", f"| *{r['trl_step_s']:.2f} (")
    (root / "sizes.md").write_text(text)
    meta = {"gpu": a["gpu"], "date": a["date"], "versions": a["versions"], "calls": [a["command"], call2]}
    (root / "sizes.json").write_text(json.dumps(meta | {"rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main(sys.argv[1])
