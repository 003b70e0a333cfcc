"""HF checkpoint directories: sliced safetensors reads, safetensors/config/tokenizer writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
MAX_SHARD_BYTES = 5 * 2**30


class SafetensorsReader:
    """Reads slices of tensors from an HF directory (``model.safetensors`` or a sharded index).

    ``reader(name, rows=slice, cols=slice)`` reads only that slice from disk (``safe_open.get_slice``), so
    each rank touches just its TP/PP part of a large checkpoint.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            self.files = {k: self.dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"no HF weights in {self.dir}: expected {SINGLE_FILE} or {INDEX_FILE}. Point --hf-path / "
                f"model.path at a directory written by transformers' save_pretrained(safe_serialization=True)."
            )
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def __call__(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(
                f"tensor {name!r} not found in {self.dir} (checked {INDEX_FILE if len(set(self.files.values())) > 1 else SINGLE_FILE}); "
                f"the checkpoint does not match its config.json architecture"
            )
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        sl = self._handles[path].get_slice(name)
        if cols is not None:
            return sl[rows or slice(None), cols]
        return sl[rows] if rows is not None else sl[:]


def write_safetensors(
    state: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> int:
    """Write ``state`` as ``model.safetensors`` or as shards plus an index; returns the byte count."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    total = sum(t.numel() * t.element_size() for t in state.values())
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out_dir / SINGLE_FILE, metadata=meta)
        return total
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / fname, metadata=meta)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return total


def copy_hf_side_files(src: Path | None, dst: Path, *, with_config: bool = True) -> list[str]:
    """Copy config.json (optionally) and tokenizer files that exist in ``src``; returns the copied names."""
    if src is None:
        return []
    dst.mkdir(parents=True, exist_ok=True)
    names = (("config.json",) if with_config else ()) + TOKENIZER_FILES
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)
            copied.append(name)
    return copied
