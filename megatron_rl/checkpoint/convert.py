"""HF <-> Megatron checkpoint conversion: megatron-core ``torch_dist`` (loadable at any TP/PP) and the legacy
Megatron-LM layout (``iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt``).

The directories written here are listed in ``names.py``. ``inspect_checkpoint`` recognises them, a trainer's
``global_step_<N>`` and torch_dist directories; ``load_checkpoint_weights`` fills a model from any of
them but legacy ones (read whole by ``read_legacy``). Every torch_dist read goes through
``safe_load.load_dist``. The CLIs in ``checkpoints_tools/`` are thin wrappers around ``hf_to_megatron`` / ``megatron_to_hf``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl.checkpoint.names import (
    DIST,
    HF,
    LEGACY_FILE,
    LEGACY_RANK_DIR,
    MCORE_METADATA,
    META_FILE,
    MODEL_SIDE,
    POINTER,
    iter_dir_name,
    legacy_rank_dir,
)
from megatron_rl.checkpoint.safe_load import load_dist
from megatron_rl.models.args import ModelArgs
from megatron_rl.models.hf_io import SafetensorsReader, copy_hf_side_files, write_safetensors
from megatron_rl.models.hf_mapping import VALUE_HEAD, hf_from_megatron_shards, megatron_shard_from_hf

FORMATS = ("torch_dist", "legacy")


@dataclass
class CheckpointInfo:
    """What a reader found: format, iteration directory, model args, and the HF side files (if any)."""

    root: Path
    iter_dir: Path
    format: str
    args: ModelArgs
    tp: int
    pp: int
    role: str
    hf_side: Path | None


@dataclass
class ConversionReport:
    arch: str
    layout: str
    tensors: int
    bytes: int
    output: Path

    def line(self, verb: str) -> str:
        return (
            f"{verb}: {self.arch} -> {self.layout}: {self.tensors} tensors, {self.bytes / 2**20:.2f} MiB "
            f"in {self.output}"
        )


def role_of_hf(args: ModelArgs) -> str:
    """A SequenceClassification checkpoint converts as a critic (trunk + score head)."""
    return "critic" if any(a.endswith("SequenceClassification") for a in args.architectures) else "actor"


def write_metadata(
    root: Path, args: ModelArgs, fmt: str, tp: int, pp: int, role: str, iteration: int, hf_src: Path | None
) -> None:
    """The reader-side files: iteration marker, ModelArgs/layout JSON, HF config + tokenizer copy."""
    root.mkdir(parents=True, exist_ok=True)
    (root / POINTER).write_text(str(iteration))
    meta = {
        "format": fmt,
        "tp": tp,
        "pp": pp,
        "role": role,
        "iteration": iteration,
        "model_args": args.to_dict(),
    }
    (root / META_FILE).write_text(json.dumps(meta, indent=2))
    copy_hf_side_files(hf_src, root / HF)


def _legacy_args(args: ModelArgs, tp: int, pp: int) -> dict:
    """Megatron-LM-style ``args`` as a plain dict (so ``torch.load(weights_only=True)`` can read it)."""
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "ffn_hidden_size": args.ffn_hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "num_query_groups": args.num_query_groups,
        "group_query_attention": args.num_query_groups != args.num_attention_heads,
        "kv_channels": args.head_dim,
        "padded_vocab_size": args.padded_vocab_size,
        "untie_embeddings_and_output_weights": not args.tie_word_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": args.rope_theta,
        "normalization": "RMSNorm",
        "norm_epsilon": args.norm_eps,
        "swiglu": True,
        "add_qkv_bias": args.qkv_bias,
        "qk_layernorm": args.qk_norm,
        "megatron_rl_model_args": args.to_dict(),
    }


def write_legacy(
    hf_dir: Path,
    args: ModelArgs,
    iter_dir: Path,
    tp: int,
    pp: int,
    role: str,
    iteration: int,
    rank: int = 0,
    world: int = 1,
) -> int:
    """Write the legacy files of the (tp_rank, pp_rank) shards assigned to ``rank`` (round robin over
    ``world`` writers); no process group needed. Returns the number of files written."""
    read = SafetensorsReader(hf_dir)
    layout = [(t, p) for p in range(pp) for t in range(tp)]
    written = 0
    for t, p in layout[rank::world]:
        shard = megatron_shard_from_hf(
            read, args, tp=tp, tp_rank=t, pp=pp, pp_rank=p, role=role, has_value_head=read.has(VALUE_HEAD)
        )
        payload = {
            "model": shard,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "args": _legacy_args(args, tp, pp),
        }
        out = iter_dir / legacy_rank_dir(t, p, pp)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(payload, out / LEGACY_FILE)
        written += 1
    return written


def read_legacy(iter_dir: Path) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], dict]:
    """All shards of a legacy checkpoint as {(tp_rank, pp_rank): megatron state dict}, plus its ``args``."""
    shards, meta_args = {}, {}
    for sub in sorted(iter_dir.iterdir()):
        m = LEGACY_RANK_DIR.match(sub.name)
        if not m:
            continue
        path = sub / LEGACY_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; the legacy checkpoint in {iter_dir} is incomplete")
        with torch.serialization.safe_globals([argparse.Namespace]):
            payload = torch.load(path, map_location="cpu", weights_only=True)
        args = payload.get("args") or {}
        meta_args = vars(args) if isinstance(args, argparse.Namespace) else args
        tensors = {k: v for k, v in payload["model"].items() if isinstance(v, torch.Tensor)}
        shards[(int(m.group(1)), int(m.group(2) or 0))] = tensors
    if not shards:
        raise FileNotFoundError(f"no mp_rank_XX[_YYY]/{LEGACY_FILE} under {iter_dir}")
    return shards, meta_args


def save_torch_dist(model: torch.nn.Module, iter_dir: Path) -> None:
    """megatron-core distributed checkpoint of the model (collective; the caller's entry point must be
    guarded by ``if __name__ == "__main__":`` because the writer starts a spawn-context Manager)."""
    import importlib.util

    from megatron.core import dist_checkpointing

    from megatron_rl.models.weights import unwrap

    if importlib.util.find_spec("psutil") is None:  # its forked writers die without it and save() hangs
        raise ImportError(
            "saving a torch_dist checkpoint needs psutil (megatron-core's writer uses it): pip install psutil"
        )
    iter_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(unwrap(model).sharded_state_dict(), str(iter_dir))


def load_torch_dist(model: torch.nn.Module, iter_dir: Path) -> None:
    """Load a torch_dist checkpoint saved at any TP/PP into this rank's shard of ``model`` (collective)."""
    from megatron_rl.models.weights import unwrap

    core = unwrap(model)
    state = load_dist(core.sharded_state_dict(), iter_dir)
    core.load_state_dict(state, strict=True)


def inspect_checkpoint(path: str | Path, hf_config: str | Path | None = None) -> CheckpointInfo:
    """Locate and auto-detect a checkpoint: a root with ``latest_checkpointed_iteration.txt``, or an
    iteration / torch_dist directory. Model args come from ``hf_config``, else the saved metadata."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist; pass --checkpoint DIR")
    if (path / DIST / MCORE_METADATA).is_file() and (path / META_FILE).is_file():
        return _trainer_checkpoint(path, hf_config)  # a trainer's global_step_<N>
    if (path / POINTER).is_file():
        root, iter_dir = path, path / iter_dir_name(int((path / POINTER).read_text().strip()))
    else:
        iter_dir = path
        root = path.parent if (path.parent / META_FILE).is_file() else path
    if (iter_dir / MCORE_METADATA).is_file():
        fmt = "torch_dist"
    elif iter_dir.is_dir() and any(LEGACY_RANK_DIR.match(p.name) for p in iter_dir.iterdir()):
        fmt = "legacy"
    else:
        raise FileNotFoundError(
            f"{iter_dir} holds neither a torch_dist checkpoint (metadata.json) nor legacy mp_rank_XX "
            f"directories; pass the checkpoint root written by hf_to_megatron"
        )
    meta = json.loads((root / META_FILE).read_text()) if (root / META_FILE).is_file() else {}
    side = root / HF if (root / HF / "config.json").is_file() else None
    if hf_config is not None:
        args = ModelArgs.from_hf_config(hf_config)
        side = Path(hf_config) if Path(hf_config).is_dir() else Path(hf_config).parent
        if "model_args" in meta:  # keep the saved vocab padding: the weights were written with it
            args = _with_padding(args, meta["model_args"]["padded_vocab_size"])
    elif "model_args" in meta:
        args = ModelArgs.from_dict(meta["model_args"])
    else:
        raise FileNotFoundError(
            f"{root} has no {META_FILE} (not written by megatron_rl); pass --hf-config DIR with the model's "
            f"HF config.json"
        )
    return CheckpointInfo(
        root,
        iter_dir,
        fmt,
        args,
        meta.get("tp", 1),
        meta.get("pp", 1),
        meta.get("role", role_of_hf(args)),
        side,
    )


def _trainer_checkpoint(step_dir: Path, hf_config: str | Path | None) -> CheckpointInfo:
    """A training checkpoint: torch_dist under ``dist/`` (keys prefixed by role), ModelArgs in META_FILE,
    config + tokenizer in ``hf_config/``."""
    meta = json.loads((step_dir / META_FILE).read_text())
    args = ModelArgs.from_dict(meta["model_args"])
    side = step_dir / MODEL_SIDE
    if hf_config is not None:
        side = Path(hf_config) if Path(hf_config).is_dir() else Path(hf_config).parent
    return CheckpointInfo(step_dir, step_dir, "trainer", args, meta["tp"], meta["pp"], meta["role"], side)


def load_checkpoint_weights(model: torch.nn.Module, info: CheckpointInfo) -> None:
    """Fill ``model`` (built at this run's TP/PP) from any checkpoint ``inspect_checkpoint`` recognised
    except legacy (read whole by ``read_legacy``)."""
    if info.format == "trainer":
        load_model_weights(model, info.iter_dir, info.role)
    else:
        load_torch_dist(model, info.iter_dir)


def load_model_weights(model: torch.nn.Module, step_dir: str | Path, role: str = "actor") -> None:
    """Load one model's weights from a trainer's ``global_step_<N>`` at this run's TP/PP (resharded by
    dist_checkpointing; keys prefixed by role). Collective; for evaluation, conversion and generation."""
    from megatron_rl.models.weights import unwrap

    core = unwrap(model)
    prefix = f"{role}."
    loaded = load_dist({role: {"model": core.sharded_state_dict(prefix=prefix)}}, Path(step_dir) / DIST)
    core.load_state_dict({k[len(prefix) :]: v for k, v in loaded[role]["model"].items()})


def _with_padding(args: ModelArgs, padded: int) -> ModelArgs:
    import dataclasses

    return dataclasses.replace(args, padded_vocab_size=padded)


def write_hf_dir(state: dict[str, torch.Tensor], args: ModelArgs, out: Path, side: Path | None) -> int:
    """safetensors + config.json (the original one when available) + tokenizer files; returns bytes."""
    nbytes = write_safetensors(state, out)
    copied = copy_hf_side_files(side, out)
    if "config.json" not in copied:
        (out / "config.json").write_text(json.dumps(args.hf_config_dict(), indent=2))
    return nbytes


def launch_rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_for_conversion(tp: int, pp: int, num_layers: int) -> tuple[int, int]:
    """Process groups for a torch_dist conversion: (tp, pp) under torchrun when the world fits, (1, 1) in a
    single process (torch_dist is layout-free, so the result loads at any TP/PP either way)."""
    from megatron_rl.distributed import init_distributed

    rank, world = launch_rank_world()
    if world == 1:
        tp = pp = 1  # a lone process picks a free rendezvous port (distributed.runtime.read_launch_env)
    init_distributed(tp, pp, seed=0, num_layers=num_layers)
    return tp, pp


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def hf_to_megatron(
    hf_dir: str | Path,
    output: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    fmt: str = "torch_dist",
    iteration: int = 1,
) -> ConversionReport | None:
    """Convert an HF directory into a Megatron checkpoint under ``output``; the report on rank 0, else None.

    legacy: files for all TP x PP shards, split over however many processes run (no process group).
    torch_dist: built and saved at (tp, pp) under torchrun, at (1, 1) in a single process.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not supported; use one of {FORMATS}")
    hf_dir, root = Path(hf_dir), Path(output)
    args = ModelArgs.from_hf_config(hf_dir, tp=tp)
    reader = SafetensorsReader(hf_dir)  # fails early on missing weights
    role = role_of_hf(args)
    rank, world = launch_rank_world()
    iter_dir = root / iter_dir_name(iteration)
    if fmt == "legacy":
        write_legacy(hf_dir, args, iter_dir, tp, pp, role, iteration, rank, world)
    else:
        from megatron_rl.models import build_model, load_hf_weights

        tp, pp = init_for_conversion(tp, pp, args.num_layers)
        model = build_model(args, role=role)
        load_hf_weights(model, hf_dir, args, role=role)
        save_torch_dist(model, iter_dir)
    if rank != 0:
        return None
    write_metadata(root, args, fmt, tp, pp, role, iteration, hf_dir)
    layout = f"{fmt} TP={tp} PP={pp} ({role})"
    arch = f"{','.join(args.architectures) or args.model_type} ({args.arch})"
    return ConversionReport(arch, layout, len(reader.files), _disk_bytes(iter_dir), iter_dir)


def megatron_to_hf(
    checkpoint: str | Path,
    output: str | Path,
    *,
    hf_config: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    merged: bool = False,
) -> ConversionReport | None:
    """Convert a Megatron checkpoint (format auto-detected) to an HF directory; report on rank 0, else None.

    legacy: read by rank 0 alone. torch_dist: loaded at (tp, pp) under torchrun, (1, 1) in one process.
    A LoRA training checkpoint gives a PEFT adapter folder for its base model, or with ``merged`` the full
    model with the adapters merged in.
    """
    info = inspect_checkpoint(checkpoint, hf_config)
    rank, _ = launch_rank_world()
    if info.format == "trainer" and lora_of(info) is not None:
        return _lora_to_hf(info, Path(output), tp, pp, merged)
    if info.format == "legacy":
        if rank != 0:
            return None
        shards, _ = read_legacy(info.iter_dir)
        state = hf_from_megatron_shards(shards, info.args, role=info.role)
        tp_read, pp_read = 1 + max(t for t, _ in shards), 1 + max(p for _, p in shards)
    else:
        from megatron_rl.models import build_model, export_hf_state_dict

        tp_read, pp_read = init_for_conversion(tp, pp, info.args.num_layers)
        args = info.args.with_tp(tp_read)
        if args.padded_vocab_size != info.args.padded_vocab_size:
            raise ValueError(
                f"{info.root}: saved padded_vocab_size={info.args.padded_vocab_size} does not split over "
                f"TP={tp_read}; read it with a TP that divides it"
            )
        model = build_model(args, role=info.role)
        load_checkpoint_weights(model, info)
        state = export_hf_state_dict(model, args)
        if rank != 0:
            return None
    out = Path(output)
    nbytes = write_hf_dir(state, info.args, out, info.hf_side)
    arch = f"{','.join(info.args.architectures) or info.args.model_type} ({info.args.arch})"
    layout = f"{info.format} TP={tp_read} PP={pp_read} ({info.role}) -> HF safetensors"
    return ConversionReport(arch, layout, len(state), nbytes, out)


def lora_of(info: CheckpointInfo):
    """(LoRAConfig, base HF dir) of a LoRA training checkpoint's role, else None."""
    from megatron_rl.config.schema import LoRAConfig

    state = json.loads((info.iter_dir / "state.json").read_text())
    base = (state.get("lora_base") or {}).get(info.role)
    if base is None:
        return None
    return LoRAConfig(**state["config"][info.role]["lora"]), Path(base["path"])


def _lora_to_hf(info: CheckpointInfo, out: Path, tp: int, pp: int, merged: bool) -> ConversionReport | None:
    """Base weights from the base model the checkpoint names (digest-checked), adapters from the checkpoint."""
    from megatron_rl.checkpoint.lora_base import check_base, load_trainable
    from megatron_rl.models import build_model, load_hf_weights
    from megatron_rl.models.lora_export import merged_hf_state_dict, save_peft_adapter

    lora, base_dir = lora_of(info)
    state = json.loads((info.iter_dir / "state.json").read_text())
    tp_read, pp_read = init_for_conversion(tp, pp, info.args.num_layers)
    args = info.args.with_tp(tp_read)
    model = build_model(args, role=info.role, lora=lora)
    check_base(info.role, state["lora_base"][info.role], _base_now(base_dir), info.iter_dir)
    load_hf_weights(model, base_dir, args, role=info.role)
    prefix = f"{info.role}."
    from megatron_rl.checkpoint.state import role_sharded_state

    loaded = load_dist(
        {info.role: role_sharded_state(info.role, model, None, is_loading=True)}, info.iter_dir / DIST
    )
    load_trainable(
        model, {k[len(prefix) :]: v for k, v in loaded[info.role]["model"].items()}, info.role, info.iter_dir
    )
    layout = f"trainer LoRA TP={tp_read} PP={pp_read} ({info.role}) -> "
    if merged:
        hf = merged_hf_state_dict(model, args)
        if launch_rank_world()[0] != 0:
            return None
        nbytes = write_hf_dir(hf, info.args, out, info.hf_side)
        return ConversionReport(info.args.arch, layout + "HF safetensors (merged)", len(hf), nbytes, out)
    save_peft_adapter(model, args, lora, out, str(base_dir))
    if launch_rank_world()[0] != 0:
        return None
    copy_hf_side_files(info.hf_side, out, with_config=False)
    n = len(list(out.glob("*.safetensors")))
    return ConversionReport(info.args.arch, layout + "PEFT adapter", n, _disk_bytes(out), out)


def _base_now(base_dir: Path) -> dict:
    from megatron_rl.checkpoint.lora_base import _digests

    return {"path": str(base_dir), "digests": dict(_digests(str(base_dir.resolve())))}
