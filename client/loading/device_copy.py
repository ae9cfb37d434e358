"""Moving verified tensors from host memory to an accelerator while the next reads go on.

A load reads each tensor into host memory and hashes it there before anything uses it; a
tensor bound for a GPU then goes to the device. Done with a plain ``copy_`` from pageable
memory, each copy held up the loop until it finished (a cold 2 GiB load onto an H100 spent
0.32 s copying after 1.12 s of reads, one after the other). A :class:`DeviceCopier` instead:

- gives the reader pinned host memory for tensors bound for a CUDA device
  (:meth:`DeviceCopier.host_empty`), from PyTorch's caching host allocator. A block is handed
  out again only once the copies reading it have finished (the allocator records an event on
  the copying stream), so pinned memory stays bounded by the copies in flight, and blocks are
  reused from one tensor to the next rather than pinned anew;
- queues each copy on a side stream of the target's device (``non_blocking``), after the
  caller's stream's work so far (the target's memory may have been in use there), and returns
  at once, so hashing and reading the next tensors overlap the copy;
- on leaving its ``with`` block, however it is left, makes each caller's stream wait for its side
  stream: a kernel launched next on that stream reads the loaded values, and no target's memory
  is freed while a copy into it is pending.

For a CPU, ``meta`` or other target it copies as ``Tensor.copy_`` and ``Tensor.to`` do.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch


class DeviceCopier:
    """Host-to-device copies for one load, queued on side streams; use as a context manager.

    Args:
        devices: the devices the load writes to; pinned host memory and side streams are used
            only where one of them is a CUDA device (and CUDA is available).
    """

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.pinned = torch.cuda.is_available() and any(device.type == "cuda" for device in devices)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __enter__(self) -> DeviceCopier:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.finish()

    def host_empty(self, shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised host memory for a tensor the reader fills: pinned when copies go to a GPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy host tensor ``source`` into ``target`` (cast if the dtypes differ); queued, for a CUDA target."""
        stream = self._side_stream(target.device)
        with torch.no_grad():
            if stream is None:
                target.copy_(source)
                return
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=source.is_pinned())

    def to(self, source: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Host tensor ``source`` as a new tensor on ``device`` (of ``dtype`` if given); queued, for a CUDA device."""
        want = dtype if dtype is not None else source.dtype
        if self._side_stream(device) is None:
            return source.to(device=device, dtype=want)
        # Allocated on the caller's stream, the one that uses it from now on.
        result = torch.empty(source.shape, dtype=want, device=device)
        self.copy(result, source)
        return result

    def finish(self) -> None:
        """Make each caller's stream wait for the copies queued so far (called on leaving the ``with``)."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream for copies to ``device``, after the caller's work so far; None off CUDA."""
        if device.type != "cuda" or not self.pinned:
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream
