"""The step's CPU-side pieces that session 10 sped up, at the GRPO benchmark shape (64 prompts x 8, 256 +
512 tokens), each against its version at commit 7dd795b in the same run (loaded from git): the shared-prompt
layout, ``build_batch``, and the reward phase's detokenization (transformers' ``batch_decode`` vs
``advantage.batch_decode``). Seconds, best of 3, on this machine's CPU.

    python benchmarks/bench_cpu_side.py --out benchmarks/results/<dir>/cpu_side.json   (CPU, a git checkout)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_synthetic_gsm8k import tokenizer as synthetic_tokenizer  # noqa: E402

from megatron_rl.rollout import batch as batch_mod  # noqa: E402
from megatron_rl.rollout import shared_prompts  # noqa: E402
from megatron_rl.rollout.batch import RolloutBatch  # noqa: E402
from megatron_rl.rollout.engine import Completion  # noqa: E402
from megatron_rl.trainer import advantage  # noqa: E402

BEFORE = "7dd795b"


def old_module(path: str, name: str):
    """``path`` as it was at BEFORE, as a module."""
    src = subprocess.run(
        ["git", "show", f"{BEFORE}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, path, "exec"), mod.__dict__)  # noqa: S102 - this repository's own code at an older commit
    return mod


def best(fn, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    groups, n, p, r = 64, 8, 256, 512
    b, t = groups * n, p + r
    rng = random.Random(0)
    ids = torch.randint(1, 1000, (b, t))
    for g in range(groups):
        ids[g * n : (g + 1) * n, :p] = ids[g * n, :p]
    batch = RolloutBatch(
        input_ids=ids, responses=ids[:, p:], response_mask=torch.ones(b, r), score_pos=(p - 1 + torch.arange(r)).expand(b, r),
        prompt_lens=torch.full((b,), p), response_lens=torch.full((b,), r), group_index=torch.arange(b) // n,
        rollout_log_probs=torch.zeros(b, r), finish_reasons=["length"] * b, rows=[None] * b,
    )  # fmt: skip
    budget = 73984  # the 0.5B shape's auto budget: 4 micro-batches
    old_shared = old_module("megatron_rl/rollout/shared_prompts.py", "old_shared_prompts")
    comps = [Completion(i // n, i % n, ids[i, :p].tolist(), ids[i, p:].tolist(), [rng.random() for _ in range(r)],
                        "length", truncated_logprobs=[rng.random() for _ in range(r)]) for i in range(b)]  # fmt: skip
    old_batch = old_module("megatron_rl/rollout/batch.py", "old_batch")
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        synthetic_tokenizer(151936).save_pretrained(d)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d)
    seqs = [[rng.randrange(151000) for _ in range(r)] for _ in range(b)]
    out = {
        "shape": {"sequences": b, "prompt": p, "response": r, "budget": budget},
        "cpu_count": os.cpu_count(),
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
        "shared_layout_split_s": {
            "before": best(lambda: old_shared.split_shared(batch, budget)),
            "after": best(lambda: shared_prompts.split_shared(batch, budget)),
        },
        "build_batch_s": {
            "before": best(lambda: old_batch.build_batch(comps, [None] * groups, 0, r, 0, cpu)),
            "after": best(lambda: batch_mod.build_batch(comps, [None] * groups, 0, r, 0, cpu)),
        },
        "detokenize_s": {
            "before": best(lambda: tok.batch_decode(seqs, skip_special_tokens=True)),
            "after": best(lambda: advantage.batch_decode(tok, seqs)),
        },
    }
    assert advantage.batch_decode(tok, seqs) == tok.batch_decode(seqs, skip_special_tokens=True)
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
