"""Export a LoRA model's adapters as an HF PEFT adapter folder, or its merged weights as a full HF model.

``adapter_config.json`` + ``adapter_model.safetensors`` load with ``peft.PeftModel.from_pretrained`` onto
the HF base model (``lora_hf`` has the name and layout mapping). Collective: every rank calls it, rank 0
writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.args import ModelArgs
from megatron_rl.models.hf_mapping import hf_from_megatron_shards
from megatron_rl.models.lora import adapter_state, merged_params
from megatron_rl.models.lora_hf import adapter_config, peft_from_adapter_shards
from megatron_rl.models.weights import gather_shards, model_role, tensor_state

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def peft_state_dict(
    model: torch.nn.Module, args: ModelArgs, lora: LoRAConfig
) -> dict[str, torch.Tensor] | None:
    """The adapters in PEFT naming on global rank 0 (None elsewhere)."""
    shards = gather_shards(model, adapter_state)
    return None if shards is None else peft_from_adapter_shards(shards, args, lora.target_modules)


def save_peft_adapter(
    model: torch.nn.Module, args: ModelArgs, lora: LoRAConfig, out_dir: str | Path, base_path: str | None
) -> Path:
    """Write ``out_dir/adapter_config.json`` + ``adapter_model.safetensors`` (rank 0)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    state = peft_state_dict(model, args, lora)
    if _rank0():
        out.mkdir(parents=True, exist_ok=True)
        cfg = adapter_config(lora.target_modules, lora.rank, lora.alpha, lora.dropout, base_path)
        (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def merged_hf_state_dict(model: torch.nn.Module, args: ModelArgs) -> dict[str, torch.Tensor] | None:
    """The whole model with the adapters merged into the weights, in HF naming, on rank 0 (None elsewhere)."""

    def merged_state(m):
        state = tensor_state(m)
        merged = merged_params(m, state)
        return {k: merged[k] for k in state}

    shards = gather_shards(model, merged_state)
    return None if shards is None else hf_from_megatron_shards(shards, args, role=model_role(model))
