"""Checkpoints of LoRA models: the adapters (and any other trainable tensor, e.g. a critic's value head)
with their optimizer state, not the frozen base weights. The base is named by its HF directory and checked
by a content digest per weight file on resume, so adapters are never resumed onto another base model.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from megatron_rl.checkpoint.layout import CheckpointError, file_digest
from megatron_rl.models.lora import has_adapters


def trainable_only(model: torch.nn.Module, model_sd: dict) -> dict:
    """``model.sharded_state_dict()`` reduced to the tensors that train, when ``model`` has adapters."""
    if not has_adapters(model):
        return model_sd
    return {k: v for k, v in model_sd.items() if getattr(getattr(v, "data", None), "requires_grad", False)}


@cache
def _digests(hf_dir: str) -> tuple[tuple[str, str], ...]:
    files = sorted(Path(hf_dir).glob("*.safetensors")) + sorted(Path(hf_dir).glob("*.bin"))
    return tuple((f.name, file_digest(f)) for f in files)


def base_record(model: torch.nn.Module, hf_dir: Path | None) -> dict | None:
    """``{"path", "digests"}`` of the base weights a LoRA model was built from (None without adapters)."""
    if not has_adapters(model):
        return None
    if hf_dir is None:
        raise CheckpointError(
            "a LoRA checkpoint names its base model, but this run's HF directory is unknown"
        )
    return {"path": str(hf_dir), "digests": dict(_digests(str(Path(hf_dir).resolve())))}


def check_base(role: str, saved: dict | None, now: dict | None, path: Path) -> None:
    """Refuse to resume adapters onto a base model other than the one they were trained on (``saved`` /
    ``now``: ``base_record`` of the checkpoint and of this run)."""
    if (saved is None) != (now is None):
        was, is_ = ("LoRA adapters" if saved else "full weights"), ("LoRA" if now else "full fine-tuning")
        raise CheckpointError(
            f"{path} holds {role} {was} but this run uses {is_}; resume with the same {role}.lora.rank, or keep "
            "only the weights (checkpoints_tools/megatron_to_hf.py) and start a new run from them"
        )
    if saved is not None and saved["digests"] != now["digests"]:
        raise CheckpointError(
            f"{path}: the {role} adapters were trained on the base model in {saved['path']}, but the weight files "
            f"in {now['path']} differ from it (digests {saved['digests']} vs {now['digests']}); resume with "
            "model.path set to that base model"
        )


def load_trainable(model: torch.nn.Module, state: dict, role: str, path: Path) -> None:
    """``load_state_dict`` of what ``trainable_only`` saved; with adapters every frozen tensor stays as built."""
    if not has_adapters(model):
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lost = [k for k in missing if k in trainable]
    if unexpected or lost:
        raise CheckpointError(
            f"{path}: {role} adapters do not match this model (unexpected {unexpected[:4]}, missing {lost[:4]}); "
            f"resume with the checkpointed run's {role}.lora settings"
        )
