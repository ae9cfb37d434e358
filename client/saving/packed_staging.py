"""A background save's accelerator tensors, staged in one transfer instead of one per tensor.

A LoRA or adapter save stages a few hundred small tensors (adapters, optimizer moments) every
step. Copied to pinned host memory one by one, each is a transfer of its own (a few
microseconds of driver time and an allocator event each), and the caller then waited for all
of them. :class:`PackedStaging` instead gathers them on their device into one buffer, in one
copy kernel per dtype, and moves that buffer to one pinned host buffer in a single transfer.
The caller waits only for the gather (after which the live tensors may change on any stream);
the transfer to the host runs on while the caller goes on, and the save's background thread
waits for it (:attr:`Packed.copied`) before it reads a byte.

Both buffers are kept from save to save while the tensors keep their dtypes and shapes, so
each save reuses them; the device buffer is bounded (:data:`LIMIT_BYTES`), and a save that
would need more stages tensor by tensor as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: The most device memory the gather buffer may take; a larger state is staged tensor by tensor.
LIMIT_BYTES = 256 << 20
#: Each tensor's place in the buffers starts at a multiple of this (every dtype's alignment divides it).
ALIGN = 64


def places(layout: Sequence[tuple[torch.dtype, torch.Size]]) -> tuple[list[int], int]:
    """Where each tensor of ``layout`` (dtype, shape) starts in one buffer holding them all, each
    at a multiple of :data:`ALIGN`, and the buffer's size in bytes."""
    offsets, total = [], 0
    for dtype, shape in layout:
        offsets.append(total)
        total += -(-(shape.numel() * dtype.itemsize) // ALIGN) * ALIGN
    return offsets, total


def views(
    buffer: torch.Tensor, layout: Sequence[tuple[torch.dtype, torch.Size]], offsets: list[int]
) -> list[torch.Tensor]:
    """Each tensor of ``layout`` as a view into the uint8 ``buffer`` at its offset (:func:`places`)."""
    found = []
    for (dtype, shape), offset in zip(layout, offsets, strict=True):
        found.append(buffer[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape))
    return found


def gather(targets: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy each of ``tensors`` into its target (on the same device): one copy kernel per dtype
    where they are contiguous, not one per tensor."""
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, tensor in zip(targets, tensors, strict=True):
        into, out_of = by_dtype.setdefault(tensor.dtype, ([], []))
        into.append(target)
        out_of.append(tensor)
    for into, out_of in by_dtype.values():
        torch._foreach_copy_(into, out_of)


def gather_and_transfer(
    targets: list[torch.Tensor], tensors: list[torch.Tensor], device_buffer: torch.Tensor, host: torch.Tensor
) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """On the current stream of ``tensors``' device: :func:`gather` them into ``targets`` (views
    of ``device_buffer``), then queue the copy of ``device_buffer`` into ``host`` (pinned memory
    of its size). Returns the events recorded after each: once the first is done the live
    tensors may change; once the second is, ``host`` holds the bytes."""
    device = tensors[0].device
    stream = torch.cuda.current_stream(device)
    with torch.no_grad(), torch.cuda.device(device):
        gather(targets, tensors)
        gathered = torch.cuda.Event()
        gathered.record(stream)
        host.copy_(device_buffer, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    return gathered, copied


@dataclass(frozen=True)
class Packed:
    """Host copies of staged tensors, and the events that say when they are safe to use."""

    #: Each staged tensor's host copy (a view into one pinned buffer), in the order given.
    host: list[torch.Tensor]
    #: Recorded after the gather on the device: once done, the live tensors may change.
    gathered: torch.cuda.Event
    #: Recorded after the transfer to the host: once done, :attr:`host` holds the bytes.
    copied: torch.cuda.Event


class PackedStaging:
    """One device buffer and one pinned host buffer, reused by one client's background saves."""

    def __init__(self) -> None:
        self._layout: list[tuple[torch.dtype, torch.Size]] | None = None
        self._device_buffer: torch.Tensor | None = None
        self._host_buffer: torch.Tensor | None = None
        self._device_views: list[torch.Tensor] = []
        self._host_views: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes of pinned host memory held."""
        return 0 if self._host_buffer is None else self._host_buffer.numel()

    def stage(self, tensors: list[torch.Tensor]) -> Packed | None:
        """Queue the gather of ``tensors`` (all on one CUDA device) and its transfer to the host.

        Returns None, queueing nothing, where they are on several devices or would take more
        than :data:`LIMIT_BYTES` (or more than the device has free): the caller stages them
        one by one.
        """
        device = tensors[0].device
        if any(tensor.device != device for tensor in tensors):
            return None
        layout = [(tensor.dtype, tensor.shape) for tensor in tensors]
        if layout != self._layout and not self._allocate(layout, device):
            return None
        assert self._host_buffer is not None and self._device_buffer is not None
        gathered, copied = gather_and_transfer(self._device_views, tensors, self._device_buffer, self._host_buffer)
        return Packed(list(self._host_views), gathered, copied)

    def release(self) -> None:
        """Let go of both buffers."""
        self._layout, self._device_buffer, self._host_buffer = None, None, None
        self._device_views, self._host_views = [], []

    def _allocate(self, layout: list[tuple[torch.dtype, torch.Size]], device: torch.device) -> bool:
        """Buffers and views for ``layout``; False (holding nothing) if it does not fit."""
        self.release()
        offsets, total = places(layout)
        if total > LIMIT_BYTES:
            return False
        try:
            device_buffer = torch.empty(total, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            return False
        host_buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self._device_views = views(device_buffer, layout, offsets)
        self._host_views = views(host_buffer, layout, offsets)
        self._layout, self._device_buffer, self._host_buffer = layout, device_buffer, host_buffer
        return True
