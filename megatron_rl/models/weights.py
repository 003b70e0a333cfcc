"""Load HF weights into a live (TP/PP-sharded) GPTModel and gather it back to HF naming on rank 0."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.models.args import ModelArgs
from megatron_rl.models.builder import ValueModel
from megatron_rl.models.hf_io import SafetensorsReader
from megatron_rl.models.hf_mapping import (
    VALUE_HEAD,
    canonical_names,
    hf_from_megatron_shards,
    layer_range,
    megatron_shard_from_hf,
)
from megatron_rl.models.lora import is_adapter


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_role(model: torch.nn.Module) -> str:
    """ "critic" for a value-head model, "actor" for an LM-head one (names the HF layout on export)."""
    return "critic" if isinstance(unwrap(model), ValueModel) else "actor"


def parallel_ranks() -> tuple[int, int, int, int]:
    """(tp, tp_rank, pp, pp_rank) of this process under megatron-core's parallel_state."""
    ps = parallel_state
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
    )


def tensor_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without ``_extra_state`` entries and LoRA adapters (``lora.adapter_state``), in
    local-spec names (tensors share storage with the parameters)."""
    sd = unwrap(model).state_dict(keep_vars=False)
    return canonical_names({k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not is_adapter(k)})


def check_layer_offsets(model: torch.nn.Module, args: ModelArgs, pp: int, pp_rank: int) -> None:
    expected = list(layer_range(args.num_layers, pp, pp_rank))
    got = [layer.layer_number - 1 for layer in unwrap(model).decoder.layers]
    if got != expected:
        raise ValueError(
            f"PP stage {pp_rank} holds global layers {got}, the weight mapping expects {expected}; "
            f"uneven pipeline splits are not supported: use a PP size that divides num_layers"
        )


def copy_into_model(
    model: torch.nn.Module, shard: dict[str, torch.Tensor], source: str, allow_missing: tuple[str, ...] = ()
) -> list[str]:
    """Copy ``shard`` (local-spec names) into the model's parameters; returns the keys left untouched.

    Raises on a key the model lacks, a shape mismatch, or a model tensor missing from ``shard`` that is
    not in ``allow_missing``.
    """
    state = tensor_state(model)
    unknown = sorted(set(shard) - set(state))
    if unknown:
        raise KeyError(
            f"{source}: model has no parameter(s) {unknown[:5]}; was it built with the same ModelArgs?"
        )
    missing = [k for k in state if k not in shard]
    if any(k not in allow_missing for k in missing):
        raise KeyError(
            f"{source}: no value for model parameter(s) {missing[:5]}; the checkpoint is incomplete"
        )
    with torch.no_grad():
        for name, src in shard.items():
            dst = state[name]
            if dst.shape != src.shape:
                raise ValueError(
                    f"{source}: {name} has shape {tuple(src.shape)} in the checkpoint but {tuple(dst.shape)} "
                    f"in the model; check TP/PP sizes and padded_vocab_size"
                )
            dst.copy_(src)
    return missing


def load_hf_weights(
    model: torch.nn.Module, hf_dir: str | Path, args: ModelArgs, role: str | None = None
) -> list[str]:
    """Fill this rank's TP/PP shard of ``model`` from an HF safetensors directory, reading only its slice.

    ``role`` defaults to the model's (value-head models -> "critic"). A critic/reward loads ``score.weight``
    from a SequenceClassification checkpoint when present, else keeps its initialised head (returned in
    the list of untouched keys, which is empty otherwise).
    """
    role = role or model_role(model)
    tp, tp_rank, pp, pp_rank = parallel_ranks()
    check_layer_offsets(model, args, pp, pp_rank)
    reader = SafetensorsReader(hf_dir)
    needs_head = role in ("actor", "ref") and not args.tie_word_embeddings and pp_rank == pp - 1
    if needs_head and not reader.has("lm_head.weight"):
        raise KeyError(
            f"{hf_dir}: lm_head.weight is missing and tie_word_embeddings is false; this checkpoint has no "
            f"LM head (a SequenceClassification checkpoint?). Load it with role='critic' or 'reward'."
        )
    shard = megatron_shard_from_hf(
        reader,
        args,
        tp=tp,
        tp_rank=tp_rank,
        pp=pp,
        pp_rank=pp_rank,
        role=role,
        has_value_head=reader.has(VALUE_HEAD),
    )
    missing = copy_into_model(model, shard, str(hf_dir), allow_missing=("output_layer.weight",))
    if missing and role in ("actor", "ref"):
        raise KeyError(f"{hf_dir}: no value for {missing}")
    return missing


def gather_shards(
    model: torch.nn.Module, state=tensor_state
) -> dict[tuple[int, int], dict[str, torch.Tensor]] | None:
    """Every (tp_rank, pp_rank) shard of ``state(model)`` (default: the base weights; ``lora.adapter_state``:
    the adapters) on global rank 0 (CPU tensors); None on other ranks.

    Collective over the world; only data-parallel rank 0 of each shard sends.
    """
    tp, tp_rank, pp, pp_rank = parallel_ranks()
    local = {k: v.detach().cpu() for k, v in state(model).items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {(tp_rank, pp_rank): local}
    sends = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    payload = ((tp_rank, pp_rank), local) if sends else None
    received = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(payload, received, dst=0)
    if dist.get_rank() != 0:
        return None
    return dict(p for p in received if p is not None)


def export_hf_state_dict(model: torch.nn.Module, args: ModelArgs) -> dict[str, torch.Tensor] | None:
    """The whole model in HF naming (padding rows removed) on global rank 0; None on the other ranks.

    Actor/ref models give ``model.*`` + ``lm_head.weight`` (absent when tied); value models give
    ``model.*`` + ``score.weight``. Collective: every rank must call it.
    """
    shards = gather_shards(model)
    if shards is None:
        return None
    return hf_from_megatron_shards(shards, args, role=model_role(model))
