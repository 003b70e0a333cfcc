"""Moving optimizer-owned tensors to host memory and back, in place (issue 15: offload while generating).

A tensor is parked by copying its *storage* to a host buffer (pinned when CUDA is present) and resizing the
device storage to zero bytes, so its memory goes back to the allocator while every view of it (megatron-core
``main_grad`` views into a contiguous grad buffer, optimizer state keyed by parameter objects) stays the same
Python object. Bringing it back resizes the storage and copies the bytes in: bit-identical by construction.
Storages are handled once each, however many tensors view them. Gradient buffers are zero between
optimizer steps, so they are freed and re-zeroed instead of copied (``copy=False``).

On a machine without CUDA the same code runs with the host buffer in ordinary CPU memory: the storage of the
original is still released (``nbytes() == 0`` while parked), which is what the CPU tests assert.
"""

from __future__ import annotations

import torch


def _storage_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ParkedStorages:
    """The unique storages behind some tensors, moved to the host by ``park`` and back by ``restore``."""

    def __init__(self, tensors, copy: bool = True, keep: set[int] | None = None):
        """``keep``: data pointers of storages that must stay (the model's own weights)."""
        seen, self.storages = set(keep or ()), []
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            if torch.cuda.is_available() and not t.is_cuda:
                continue  # already on the host (megatron-core's hybrid optimizer keeps its CPU part there)
            s = t.untyped_storage()
            if s.data_ptr() in seen or s.nbytes() == 0:
                continue
            seen.add(s.data_ptr())
            self.storages.append(s)
        self.copy = copy
        self.host: list[torch.Tensor | None] = []
        self.sizes: list[int] = []

    @property
    def nbytes(self) -> int:
        """Bytes these storages hold on the device when resident."""
        return sum(self.sizes) if self.sizes else sum(s.nbytes() for s in self.storages)

    def park(self) -> None:
        pin = torch.cuda.is_available()
        self.sizes = [s.nbytes() for s in self.storages]
        self.host = []
        for s, n in zip(self.storages, self.sizes):
            if self.copy:
                buf = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin)
                buf.copy_(_storage_view(s), non_blocking=pin)
                self.host.append(buf)
            else:
                self.host.append(None)
        if pin:
            torch.cuda.synchronize()  # the copies must land before the device memory is reused
        for s in self.storages:
            s.resize_(0)

    def restore(self) -> None:
        pin = torch.cuda.is_available()
        for s, n, buf in zip(self.storages, self.sizes, self.host):
            s.resize_(n)
            view = _storage_view(s)
            if buf is None:
                view.zero_()
            else:
                view.copy_(buf, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()  # host buffers are freed next; also makes timing_s/reload honest
        self.host = []
