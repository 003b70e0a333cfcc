"""Decode ms a step of each named bench_rl_step JSON in a folder: ``python decode_ms.py FOLDER NAME...``."""

import json
import sys

for name in sys.argv[2:]:
    try:
        d = json.load(open(f"{sys.argv[1]}/{name}.json"))
        print(name, "decode ms", [round(s["decode"]["ms_per_decode_step"], 4) for s in d["steps"]],
              "hbm %", d["median_after_warmup"].get("decode_fraction_of_hbm_floor_this_gpu"))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a summary: say which file could not be read
        print(name, "unreadable", e)
