"""Loading a torch_dist checkpoint never runs code from it.

A checkpoint may come from someone else. torch.distributed.checkpoint reads two pickles on the load path
that ``weights_only`` does not cover (checked against torch 2.13 and megatron-core 0.16.1):

- ``FileSystemReader.read_metadata`` unpickles ``<dir>/.metadata`` with plain ``pickle.load``;
- ``DefaultLoadPlanner.load_bytes`` (megatron-core's ``MCoreLoadPlanner`` inherits it) reads every
  non-tensor item (``_extra_state``, megatron-core's optimizer common state) with
  ``torch.load(weights_only=False)``.

megatron-core builds its reader and planner inside ``TorchDistLoadShardedStrategy.load`` with no argument to
pass others, so ``install()`` replaces those two methods, once, with versions that admit only what such
files contain: the metadata classes of ``torch.distributed.checkpoint`` (``METADATA_GLOBALS``) and,
for byte items, torch's own ``weights_only`` unpickler. Anything else is refused (``load_dist`` raises
``UnsafeCheckpointError`` naming the file). ``tests/unit/test_checkpoint_trust.py`` pins the replaced methods' source, so a torch
that changes them fails that test instead of silently bypassing this module. megatron-core's other reads
(``common.pt``, sharded-object ``.pt`` files) use ``torch.load``'s default, ``weights_only=True``, unless
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set: ``install()`` refuses to load then.

Every torch_dist load of this package goes through ``load_dist``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from megatron_rl.checkpoint.layout import CheckpointError

_DCP = "torch.distributed.checkpoint"
# (module, name) a torch_dist .metadata file legitimately holds: the metadata dataclasses and enums,
# torch.Size, dtypes (checked below: any torch.<name> that is a torch.dtype) and the layout lookup.
METADATA_GLOBALS = frozenset(
    [(f"{_DCP}.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                         "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                        "LoadPlan", "ReadItem", "LoadItemType")]
    + [(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("torch", "memory_format"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]  # StorageMeta.checkpoint_id may be a path
)  # fmt: skip


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something other than data: it is refused before anything in it runs."""


class RefusedPickle(BaseException):
    """Raised inside torch's reader: a BaseException, so torch's ``except Exception`` fallbacks (it retries a
    failed global metadata read with per-rank metadata) cannot turn the refusal into another error.
    ``load_dist`` turns it back into ``UnsafeCheckpointError``."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only the globals in ``METADATA_GLOBALS`` and torch dtypes; ``path`` names the file."""

    def __init__(self, file, path: str | Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path} refers to {module}.{name}, which a torch_dist metadata file never holds: the file was "
            "made to run code when loaded (or by an incompatible writer) and is refused; nothing in it ran. "
            "Use a checkpoint from a source you trust, or re-create it from HF weights "
            "(checkpoints_tools/hf_to_megatron.py)"
        )


def read_metadata_file(path: str | Path):
    with open(path, "rb") as f:
        return RestrictedUnpickler(f, path).load()


def _safe_read_metadata(self, *args, **kwargs):
    """``FileSystemReader.read_metadata`` with the restricted unpickler (same result on good files)."""
    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as f:
        try:
            metadata = RestrictedUnpickler(f, path).load()
        except UnsafeCheckpointError as err:
            raise RefusedPickle(str(err)) from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _safe_load_bytes(self, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (tensors, containers, numbers)."""
    fqn = read_item.dest_index.fqn
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise RefusedPickle(
            f"the checkpoint item {fqn!r} holds a pickle that does more than rebuild data ({err}); it is "
            "refused and nothing in it ran. Use a checkpoint from a source you trust"
        ) from None
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[fqn], obj)
    else:
        self.state_dict[fqn] = obj


PATCHED = {(FileSystemReader, "read_metadata"): _safe_read_metadata,
           (DefaultLoadPlanner, "load_bytes"): _safe_load_bytes}  # fmt: skip
ORIGINALS = {key: getattr(*key) for key in PATCHED}
# sha256[:16] of the replaced methods' source in torch 2.13: a test compares, so a torch that changes them
# (and could read those files some other way) is noticed before this module's guarantee silently lapses.
PINNED_SOURCE = {"read_metadata": "8586ce344a523602", "load_bytes": "666701f9808c4bc2"}


def install() -> None:
    """Replace the two unsafe readers (idempotent); refuse when torch is told to unpickle everything."""
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in ("", "0", "false"):
        raise CheckpointError(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch would unpickle checkpoint files with full pickle, "
            "which runs any code a checkpoint carries. Unset it to load checkpoints"
        )
    for (cls, name), fn in PATCHED.items():
        setattr(cls, name, fn)


def _unwrap(err: BaseException) -> BaseException:
    """The first underlying error of torch's ``CheckpointException`` (it wraps every rank's failure)."""
    if isinstance(err, CheckpointException):
        for exc, _tb in err.failures.values():
            return exc
    return err


def load_dist(sharded_state_dict: dict, ckpt_dir: str | Path) -> dict:
    """``dist_checkpointing.load`` with the safe readers; an unsafe file raises ``UnsafeCheckpointError``
    naming the checkpoint directory (megatron-core's errors, which derive from BaseException, included)."""
    from megatron.core import dist_checkpointing

    install()
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir))
    except (Exception, CheckpointException, RefusedPickle) as err:
        inner = _unwrap(err)
        if isinstance(inner, (RefusedPickle, UnsafeCheckpointError)):
            raise UnsafeCheckpointError(f"{ckpt_dir}: {inner}") from None
        if inner is not err:
            raise CheckpointError(f"loading {ckpt_dir} failed: {type(inner).__name__}: {inner}") from inner
        raise
