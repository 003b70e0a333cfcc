"""Host <-> device copies that do not make the host wait for the work queued on the device.

A pageable copy waits for the stream (PyTorch synchronises after ``cudaMemcpyAsync`` from or to pageable
memory), so a copy issued while the device is busy stalls the host until that work is done. Through pinned
memory and ``non_blocking`` the copy is queued like a kernel: to the device it is simply in stream order; to
the host, an event recorded after it says when the host may read (``event.synchronize()`` waits for the copies
only, not for what was queued after them). Off CUDA both are plain copies.
"""

from __future__ import annotations

import torch

_HOST = "_megatron_rl_host"  # the attribute of a device tensor that holds (its host copy, its version then)


def to_device_async(t: torch.Tensor, device: torch.device, keep: bool = False) -> torch.Tensor:
    """Host tensor ``t`` on ``device``; to a GPU pinned and non-blocking (no host sync). ``keep``: the result
    keeps ``t`` as its host copy (``host_values``), so reading it back later needs no sync."""
    if device.type != "cuda":
        out = t if t.device == torch.device(device) else t.to(device)
    else:
        out = t.pin_memory().to(device, non_blocking=True)
    return keep_host(out, t) if keep and out is not t else out


def keep_host(t: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """``t`` (off the CPU) with ``host`` (its values on the host; None: none) as its host copy, which stands
    for ``t`` until ``t`` is changed in place (its version counter moves: the copy is then ignored). The
    per-row tensors of a rollout batch keep one (``rollout.batch.build_batch``; ``select``, ``trim`` and
    ``trainer.dynamic_sampling.concat_batches`` carry it to what they make)."""
    if host is not None and t.device.type != "cpu":
        setattr(t, _HOST, (host, t._version))
    return t


def host_copy(t: torch.Tensor) -> torch.Tensor | None:
    """The host copy ``t`` keeps (``keep_host``), None where it keeps none or was changed in place since."""
    kept = getattr(t, _HOST, None)
    return kept[0] if kept is not None and kept[1] == t._version else None


def kept_host(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` itself on the CPU, else its host copy (``host_copy``) or None."""
    return t if t.device.type == "cpu" else host_copy(t)


def host_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the host: its kept host copy (no sync) or a copy made now (on a GPU a host sync)."""
    h = kept_host(t)
    return h if h is not None else t.cpu()


def to_host_async(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Host copies of ``tensors`` (all on one device) as they are once the work queued so far has run, and on
    CUDA an event recorded on their device's current stream after the (pinned, non-blocking) copies: read the
    copies after ``event.synchronize()``. Off CUDA the copies are made now and the event is None."""
    cuda = tensors[0].device.type == "cuda"
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=cuda)
    if not cuda:
        return host, None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))  # the tensors' device, not the current one
    return host, event
