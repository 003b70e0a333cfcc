"""Host time of a GRPO step's completions -> batch tensors (CPU, no model): the engine's single-turn results
as listed completions (``tolist`` of each row's ids and log-probs, as the engine did before session 39) against
``Completion.set_arrays`` (listed only when read), then ``build_batch`` and the completions' release.

    python benchmarks/bench_build_batch.py --out benchmarks/results/2026-12-07-session39/build_batch_cpu.json

Rows: ``--rows`` sequences of ``--prompt-len`` + ``--response-len`` tokens, ``--n`` samples a prompt (the 0.5B
benchmark's 512 x (256 + 512) by default); medians of ``--repeats`` after one warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from megatron_rl.rollout.batch import build_batch
from megatron_rl.rollout.engine import Completion


def completions(tok: np.ndarray, lp: np.ndarray, prompts: list[list[int]], n: int, listed: bool):
    out = []
    for i in range(tok.shape[0]):
        c = Completion(i // n, i % n, prompts[i // n], finish_reason="length")
        if listed:  # the engine before session 39: both lists made at the retire, the arrays beside them
            c.response_ids, c.logprobs = tok[i].tolist(), lp[i].tolist()
            c.arrays = (tok[i], lp[i])
        else:
            c.set_arrays(tok[i], lp[i])
        out.append(c)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "build_batch_cpu.json"))
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, a.prompt_len).tolist() for _ in range(a.rows // a.n)]
    rows = [SimpleNamespace() for _ in prompts]
    result = {"args": vars(a), "cpu_count": os.cpu_count()}
    for listed in (True, False):
        times = {"make_ms": [], "build_ms": [], "free_ms": []}
        for rep in range(a.repeats + 1):
            tok = rng.integers(0, 150_000, (a.rows, a.response_len))
            lp = rng.standard_normal((a.rows, a.response_len)).astype(np.float32)
            gc.collect()
            t0 = time.perf_counter()
            cs = completions(tok, lp, prompts, a.n, listed)
            t1 = time.perf_counter()
            batch = build_batch(cs, rows, 0, a.response_len, 0, torch.device("cpu"))
            t2 = time.perf_counter()
            del cs, tok, lp
            t3 = time.perf_counter()
            assert batch.responses.shape == (a.rows, a.response_len)
            if rep:  # the first is a warm-up
                for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[k].append(v * 1e3)
        result["listed" if listed else "set_arrays"] = {k: statistics.median(v) for k, v in times.items()} | {
            "runs": times
        }
    print(json.dumps({k: v for k, v in result.items() if k in ("listed", "set_arrays")}, indent=1)[:1500])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
