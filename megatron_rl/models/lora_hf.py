"""Pure PEFT <-> megatron-core mapping of LoRA adapters (no process groups), one (TP, PP) shard at a time.

HF PEFT puts one adapter on each projection; ours sit on megatron-core's fused layers. Our adapter on
``linear_qkv`` is PEFT's q_proj/k_proj/v_proj adapters with one shared A: B's rows are packed exactly
as the qkv weight's (per query group: q heads, k, v; a plain TP chunk), so ``hf_mapping``'s qkv packing
applies to B with the rank in place of the hidden size. Likewise ``linear_fc1`` is gate_proj/up_proj
with a shared A and B = cat(gate_B_i, up_B_i) at TP rank i; ``linear_proj`` / ``linear_fc2`` are
o_proj / down_proj one to one (A split on its columns like W, B whole).
"""

from __future__ import annotations

import torch

from megatron_rl.models.args import ModelArgs
from megatron_rl.models.hf_mapping import _qkv_shard, _split_qkv, layer_range

PEFT_PREFIX = "base_model.model."
HF_MODULES = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", ("down_proj",)),
}
MCORE_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp",
                "linear_fc2": "mlp"}  # fmt: skip


def peft_target_modules(targets: list[str]) -> list[str]:
    """PEFT ``target_modules`` for our ``lora.target_modules``."""
    return [hf for t in targets for hf in HF_MODULES[t][1]]


def _peft(i: int, target: str, hf: str, ab: str) -> str:
    return f"{PEFT_PREFIX}model.layers.{i}.{HF_MODULES[target][0]}.{hf}.lora_{ab}.weight"


def _shared_a(peft: dict[str, torch.Tensor], i: int, target: str) -> torch.Tensor:
    """The one A of a fused layer; PEFT adapters whose A differ between q/k/v (gate/up) cannot fuse."""
    names = [_peft(i, target, hf, "A") for hf in HF_MODULES[target][1]]
    first = peft[names[0]]
    if any(not torch.equal(peft[n], first) for n in names[1:]):
        raise ValueError(
            f"layer {i}: PEFT adapters {names} have different lora_A; a fused megatron-core {target} adapter "
            "has one A (train them with this trainer, or merge the adapter into the model instead)"
        )
    return first


def adapters_from_peft(
    peft: dict[str, torch.Tensor], args: ModelArgs, targets: list[str], *, tp: int, tp_rank: int, pp: int,
    pp_rank: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """This shard's adapters (local layer names ``decoder.layers.{j}.<parent>.<target>.lora_A|B``) from a
    PEFT state dict (``base_model.model.model.layers.{i}...lora_A.weight`` names)."""
    ffn = args.ffn_hidden_size // tp
    attn = args.num_attention_heads * args.head_dim // tp
    out = {}
    for local, i in enumerate(layer_range(args.num_layers, pp, pp_rank)):
        pre = f"decoder.layers.{local}."
        for t in targets:
            name = f"{pre}{MCORE_PARENT[t]}.{t}"
            if t == "linear_qkv":
                a = _shared_a(peft, i, t)

                def read(n, rows=None, cols=None):
                    return peft[n][rows if rows is not None else slice(None)]

                b = _qkv_shard(read, args, f"{PEFT_PREFIX}model.layers.{i}.", "lora_B.weight", tp, tp_rank)
            elif t == "linear_fc1":
                a = _shared_a(peft, i, t)
                rows = slice(tp_rank * ffn, (tp_rank + 1) * ffn)
                b = torch.cat(
                    [peft[_peft(i, t, hf, "B")][rows] for hf in ("gate_proj", "up_proj")]
                )  # [2ffn/tp, r]
            else:
                width = attn if t == "linear_proj" else ffn
                hf = HF_MODULES[t][1][0]
                a = peft[_peft(i, t, hf, "A")][:, tp_rank * width : (tp_rank + 1) * width]  # [r, in/tp]
                b = peft[_peft(i, t, hf, "B")]  # [out, r]
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, b
    return out


def peft_from_adapter_shards(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], args: ModelArgs, targets: list[str]
) -> dict[str, torch.Tensor]:
    """PEFT state dict from every (tp_rank, pp_rank) -> adapter tensors (local layer names); the shared A
    of a fused layer is written to each of its projections."""
    tp, pp = 1 + max(t for t, _ in shards), 1 + max(p for _, p in shards)
    out: dict[str, torch.Tensor] = {}
    for p in range(pp):
        for local, i in enumerate(layer_range(args.num_layers, pp, p)):
            for t in targets:
                name = f"decoder.layers.{local}.{MCORE_PARENT[t]}.{t}"
                a_parts = [shards[(r, p)][f"{name}.lora_A"] for r in range(tp)]
                b_parts = [shards[(r, p)][f"{name}.lora_B"] for r in range(tp)]
                if t == "linear_qkv":
                    for hf, b in zip(HF_MODULES[t][1], _split_qkv(torch.cat(b_parts), args)):
                        out[_peft(i, t, hf, "A")], out[_peft(i, t, hf, "B")] = a_parts[0], b
                elif t == "linear_fc1":
                    halves = [b.chunk(2, dim=0) for b in b_parts]  # (gate_i, up_i) per TP rank
                    for k, hf in enumerate(("gate_proj", "up_proj")):
                        out[_peft(i, t, hf, "A")] = a_parts[0]
                        out[_peft(i, t, hf, "B")] = torch.cat([h[k] for h in halves])
                else:
                    hf = HF_MODULES[t][1][0]
                    out[_peft(i, t, hf, "A")], out[_peft(i, t, hf, "B")] = (
                        torch.cat(a_parts, dim=1),
                        b_parts[0],
                    )
    return {k: v.contiguous().clone() for k, v in out.items()}


def adapter_config(targets: list[str], rank: int, alpha: float, dropout: float, base: str | None) -> dict:
    """``adapter_config.json`` for ``peft.PeftModel.from_pretrained``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": peft_target_modules(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def adapter_params_per_layer(args: ModelArgs, targets: list[str], rank: int, tp: int = 1) -> dict[str, int]:
    """Per target: (adapter parameters, adapted base-weight parameters) of one layer on one TP rank, as
    ``{"adapters": n, "adapted": m}`` (the memory model's one source for LoRA sizes)."""
    h, ffn = args.hidden_size, args.ffn_hidden_size // tp
    attn = args.num_attention_heads * args.head_dim // tp
    qkv = (args.num_attention_heads + 2 * args.num_query_groups) * args.head_dim // tp
    shapes = {
        "linear_qkv": (h, qkv),
        "linear_proj": (attn, h),
        "linear_fc1": (h, 2 * ffn),
        "linear_fc2": (ffn, h),
    }  # fmt: skip  (local in, local out) of W
    full_in = {"linear_qkv": h, "linear_proj": attn, "linear_fc1": h, "linear_fc2": ffn}
    adapters = adapted = 0
    for t in targets:
        n_in, n_out = shapes[t]
        adapters += rank * (full_in[t] + n_out)  # A [r, in(/tp)] + B [out(/tp), r]
        adapted += n_in * n_out
    return {"adapters": adapters, "adapted": adapted}
