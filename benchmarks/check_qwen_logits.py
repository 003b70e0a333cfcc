"""GPU check (issue: models): the Qwen2.5-0.5B shape with random weights, loaded at TP=2 through our HF
loader, gives the transformers logits (bf16 within bf16 tolerance; fp32 tightly).

    torchrun --nproc-per-node=2 benchmarks/check_qwen_logits.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from bench_rl_step import QWEN2_5_0_5B  # noqa: E402  (the shape, defined once for the benchmarks)

from megatron_rl.distributed import init_distributed
from megatron_rl.models import ModelArgs, build_model, load_hf_weights
from tests.reference_forward import forward_logits


def make_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2_5_0_5B)).save_pretrained(path)  # fp32 master copy


def ours(path: str, tp: int, dtype, ids, sequence_parallel: bool = False) -> torch.Tensor:
    args = ModelArgs.from_hf_config(path, tp=tp)
    model = build_model(args, "actor", dtype, sequence_parallel=sequence_parallel)
    load_hf_weights(model, path, args)
    model = model.to(dtype)  # megatron-core creates norm weights in fp32; cast all, as the trainer does
    with torch.no_grad():
        local = forward_logits(model, ids).float()  # [B, T, V/tp]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local)
    return torch.cat(parts, -1)[..., : args.vocab_size]


def reference(path: str, dtype, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).cuda().eval()
    with torch.no_grad():
        return hf(ids).logits.float()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {
        "max_abs_diff": float((a - b).abs().max()),
        "rel_err_fro": float((a - b).norm() / b.norm()),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--path", default="/tmp/qwen2_5_0_5b_random")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dims = init_distributed(tp=2, pp=1, seed=0)
    if dist.get_rank() == 0:
        make_model(a.path)
    dist.barrier()
    ids = torch.randint(
        0, QWEN2_5_0_5B["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(1)
    ).cuda()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tp": dims.tp,
        "shape": "Qwen2.5-0.5B",
        "batch": list(ids.shape),
    }
    mine = {n: ours(a.path, dims.tp, d, ids) for n, d in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    sp32 = ours(a.path, dims.tp, torch.float32, ids, sequence_parallel=True)
    if dist.get_rank() == 0:
        ref32, ref16 = reference(a.path, torch.float32, ids), reference(a.path, torch.bfloat16, ids)
        result["fp32_ours_vs_hf_fp32"] = compare(mine["fp32"], ref32)
        result["bf16_ours_vs_hf_bf16"] = compare(mine["bf16"], ref16)
        # bf16 tolerance = how far HF's own bf16 run is from fp32; ours must be no further
        result["bf16_ours_vs_hf_fp32"] = compare(mine["bf16"], ref32)
        result["bf16_hf_vs_hf_fp32"] = compare(ref16, ref32)
        result["fp32_sequence_parallel_vs_hf_fp32"] = compare(sp32, ref32)
        result["pass"] = (
            result["fp32_ours_vs_hf_fp32"]["rel_err_fro"] < 1e-4
            and result["fp32_sequence_parallel_vs_hf_fp32"]["rel_err_fro"] < 1e-4
            and result["bf16_ours_vs_hf_fp32"]["rel_err_fro"]
            <= 1.5 * result["bf16_hf_vs_hf_fp32"]["rel_err_fro"]
        )
        print(json.dumps(result, indent=1))
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
