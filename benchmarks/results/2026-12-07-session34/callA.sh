#!/usr/bin/env bash
# Session 34, call A (carry `.whl`): the LM head fused with the draw against cuBLAS + the sampler; PDL between the decode step's small kernels (probe), the sampler's tile
# at 512 rows below today's 1024 / 4 warps, then the fixed 0.5B step profiled (the H200's decode kernel table).
set -u
O=$OUT/cA; mkdir -p "$O"; T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 170 python3 benchmarks/bench_head_sampler.py --out "$O/head.json" > "$O/head.log" 2>&1; echo "head rc=$? $((SECONDS - T0))s"
grep -E "^(896|2048) |Error|error" "$O/head.log" | head -20
timeout 60 python3 benchmarks/probe_pdl.py --out "$O/pdl.json" > "$O/pdl.log" 2>&1; echo "pdl rc=$? $((SECONDS - T0))s"
grep -E "_us\"|error" "$O/pdl.log" | head -20
timeout 90 python3 - "$O" > "$O/sampler_tiles.log" 2>&1 <<'PY'
import json, sys, torch
sys.path.insert(0, "benchmarks")
from _timing import graphed_us
from megatron_rl.kernels import sampler as k
from megatron_rl.rollout.sampling import _draw
rows, vocab = 512, 151936
torch.manual_seed(0)
flat = (4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
peaked = flat.clone(); peaked[torch.arange(rows, device="cuda"), torch.randint(0, vocab, (rows,), device="cuda")] += 20
keys = torch.randint(-(2**62), 2**62, (rows,), device="cuda")
ids = torch.arange(vocab, device="cuda")[None]
res = {}
for tag, x in (("flat", flat),):
    want = _draw(x, keys, ids, 1 / 0.7, True)[0]
    for splits in (2, 8):
        for block, warps in ((1024, 4), (512, 2), (256, 1)):
            fn = lambda: k.draw(x, keys, 1 / 0.7, True, splits=splits, block=block, num_warps=warps, mix=True, logprobs=True)
            name = f"{tag}_s{splits}_b{block}_w{warps}"
            try:
                res[name] = round(graphed_us(fn, n=10, replays=10), 1)
                res[name + "_mismatch"] = int((fn()[0] != want).sum())
            except Exception as e:
                res[name] = str(e)[:100]
res["read_logits_us"] = round(graphed_us(lambda: flat.amax(-1), n=10, replays=10), 1)
print(json.dumps(res, indent=0))
json.dump(res, open(sys.argv[1] + "/sampler_tiles.json", "w"), indent=1)
PY
echo "sampler rc=$? $((SECONDS - T0))s"
python3 -c "
import json; d=json.load(open('$O/sampler_tiles.json'))
for t in ('flat',):
    r=sorted((v,k) for k,v in d.items() if k.startswith(t) and not k.endswith('mismatch') and isinstance(v,float)); print(t, r[:6], 'mismatches', sum(v for k,v in d.items() if k.startswith(t) and k.endswith('mismatch')))
"
if [ -n "${PROF:-}" ]; then
K=(actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=auto rollout.max_num_seqs=auto)
timeout 200 python3 benchmarks/bench_rl_step.py --steps 2 --shape qwen2.5-0.5b --out "$O/fixed_prof.json" \
  --profile "$O/prof_fixed" "${K[@]}" > "$O/fixed_prof.log" 2>&1; echo "prof rc=$? $((SECONDS - T0))s"
head -30 "$O/prof_fixed/generate_ops.txt" | cut -c1-100,180-260
fi
