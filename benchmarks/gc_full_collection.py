"""What one full collection of Python's garbage collector costs in a trainer process, with and without
``trainer.gc_freeze`` (CPU is enough: the collector walks host objects).

Runs ``megatron-rl train`` for one step with the given overrides, and at the point where the trainer settles the
collector (after setup, resume and the logger) times a full ``gc.collect()`` before and after ``settle``, with the
number of objects the collector tracks.

Run: ``python benchmarks/gc_full_collection.py --out $OUT/gc.json [overrides...]`` (e.g. ``trainer.gc_freeze=false``)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import megatron_rl.trainer.run as run
from megatron_rl.cli import main as cli


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("override", nargs="*")
    a = ap.parse_args()
    res = {"overrides": a.override}

    def full_collection_ms() -> float:
        t = time.perf_counter()
        gc.collect()
        return 1e3 * (time.perf_counter() - t)

    class Timed(run.Collector):
        def settle(self) -> None:
            before = full_collection_ms()
            res.update({"tracked_objects": len(gc.get_objects()), "full_collection_ms_before": before})
            super().settle()
            res.update({"gc_freeze": self.freeze, "full_collection_ms_after": full_collection_ms()})

    run.Collector = Timed
    with tempfile.TemporaryDirectory() as out:
        sys.argv = ["megatron-rl", "train", "trainer.total_training_steps=1", f"trainer.output_dir={out}",
                    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_final=false", *a.override]  # fmt: skip
        cli()
    print(json.dumps(res), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
