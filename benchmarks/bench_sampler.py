"""The sampler's draw (tokens + log-sum-exp of one decode step) at Qwen2.5's vocab in bf16: the Triton kernel
(``kernels.sampler``: the engine's call, a few split / warp / pipelining settings, greedy), eager ``_draw`` and
the compiled ``_FUSED_DRAW``, against the time to read the logits once; on flat rows and on rows with one
peaked token (a trained model's shape). Tokens are compared with the eager draw's over several key sets
(mismatch counts: the kernel sums each block's log-sum-exp in its own order, so a near-tie of two blocks may
differ; 0 expected in practice), and the log-sum-exp's largest difference.

``--old FILE``: also time another version of ``kernels/sampler.py`` (e.g. the per-token draw before session
37, ``git show 3729cad:megatron_rl/kernels/sampler.py > old_sampler.py``) with its engine call, in the same
process (A B B A over the rows' timings); its tokens follow its own rule, so they are not compared.

Run: ``python benchmarks/bench_sampler.py --out $OUT/bench_sampler.json [--old old_sampler.py]`` (CUDA, ~1 min).
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch
from _timing import timed_us  # benchmarks/, the script's folder

from megatron_rl.kernels import sampler as kernel
from megatron_rl.rollout.sampling import _FUSED_DRAW, _draw, _token_ids


def _load(path: str):
    spec = importlib.util.spec_from_file_location("old_sampler", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench(rows: int, vocab: int, key_sets: int, old=None) -> dict:
    torch.manual_seed(rows)
    flat = (4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    peaked = flat.clone()
    peaked[torch.arange(rows, device="cuda"), torch.randint(0, vocab, (rows,), device="cuda")] += 20
    ids = _token_ids(flat)
    keys = torch.randint(-(2**62), 2**62, (rows,), device="cuda")
    inv_temp = 1 / 0.7
    out = {"rows": rows, "vocab": vocab, "splits_default": kernel.splits_for(rows)}
    out["read_logits_us"] = timed_us(lambda: flat.amax(-1), n=200, warmup=5)

    def engine(x, k, mod=kernel, **kw):  # the engine's call: raw keys mixed and log-probs read in the kernel
        return mod.draw(x, k, inv_temp, kw.pop("noisy", True), mix=True, logprobs=True, **kw)

    ways = {
        "triton": lambda x, k: engine(x, k),
        "triton_greedy": lambda x, k: engine(x, k, noisy=False),
        "eager": lambda x, k: _draw(x, k, ids, inv_temp, True),
        "compiled": lambda x, k: _FUSED_DRAW(x, k, ids, inv_temp, True),
    }
    for stages in (1, 2, 4):
        ways[f"triton_stages{stages}"] = lambda x, k, n=stages: engine(x, k, num_stages=n)
    d = kernel.splits_for(rows)
    for splits in sorted({max(1, d // 2), 2 * d}):
        ways[f"triton_s{splits}"] = lambda x, k, s=splits: engine(x, k, splits=s)
    ways["triton_w8"] = lambda x, k: engine(x, k, num_warps=8)
    for unroll in (2, 4):  # blocks a loop step
        ways[f"triton_u{unroll}"] = lambda x, k, u=unroll: engine(x, k, unroll=u)
        ways[f"triton_u{unroll}_w8"] = lambda x, k, u=unroll: engine(x, k, unroll=u, num_warps=8)
    order = list(ways)
    if old is not None:  # A B B A: the new engine call and the old one's
        ways["old_triton"] = lambda x, k: engine(x, k, mod=old)
        order = ["triton", "old_triton", *order[1:], "old_triton", "triton"]
    for tag, x in (("", flat), ("peaked_", peaked)):
        times: dict[str, list[float]] = {}
        for name in order:
            times.setdefault(name, []).append(timed_us(lambda f=ways[name], x=x: f(x, keys), n=200, warmup=5))
        for name, t in times.items():
            out[f"{tag}{name}_us"] = min(t)
            if len(t) > 1:
                out[f"{tag}{name}_us_runs"] = t
        key_batches = [torch.randint(-(2**62), 2**62, (rows,), device="cuda") for _ in range(key_sets)]
        want = [_draw(x, k, ids, inv_temp, True) for k in key_batches]
        for name in ("triton", "compiled", *(n for n in ways if n.startswith(("triton_s", "triton_u")))):
            got = [ways[name](x, k) for k in key_batches]
            out[f"{tag}{name}_token_mismatches"] = sum(int((g[0] != w[0]).sum()) for g, w in zip(got, want))
            out[f"{tag}{name}_lse_max_abs_diff"] = max(
                float((g[1] - w[1]).abs().max()) for g, w in zip(got, want)
            )
        g = ways["triton_greedy"](x, keys)
        greedy = _draw(x, keys, ids, inv_temp, False)
        out[f"{tag}triton_greedy_token_mismatches"] = int((g[0] != greedy[0]).sum())
    out["rows_compared"] = rows * key_sets
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--key-sets", type=int, default=16)
    ap.add_argument("--rows", default="64,128,256,512", help="comma-separated batch sizes")
    ap.add_argument("--old", default=None, help="another kernels/sampler.py to time beside this one")
    args = ap.parse_args()
    old = _load(args.old) if args.old else None
    results = [bench(rows, args.vocab, args.key_sets, old) for rows in map(int, args.rows.split(","))]
    for r in results:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
