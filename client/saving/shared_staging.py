"""Staging for saves another process writes: the snapshot's copies in one shared-memory file.

A background save in a save process (``Client(background="process")``, see
:mod:`client.saving.save_process`) cannot read the training process's staging buffers, so its
snapshot copies into one file both processes map (in ``/dev/shm`` where there is one): the
copies of accelerator tensors first (gathered on their device into one buffer, moved to the
file, registered as pinned memory, in one transfer, as :mod:`client.saving.packed_staging`
does), then those of host tensors. The file is kept, and reused, while the staged tensors keep
their dtypes and shapes; a new layout gets a new file and the old one is removed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from client.saving.hashing import DigestCache, Taken
from client.saving.packed_staging import ALIGN, LIMIT_BYTES, gather
from client.saving.saver import Snapshot
from client.state import FlatState
from client.tensors import dtype_name
from service.errors import InvalidManifestError
from service.format.dtypes import shape_problem

_numbers = itertools.count()


def shared_folder() -> Path:
    """Where the shared files go: memory-backed ``/dev/shm`` where there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class SharedSnapshot:
    """A snapshot whose staged copies live in a shared file, and where each record's copy is."""

    snapshot: Snapshot
    #: The shared file's path and size in bytes.
    path: str
    size: int
    #: Per record: the byte offset of its copy in the file, or None (not staged: its digest is known).
    offsets: list[int | None]


PREFIX = "ckptstore-staging-"


def sweep_stale(folder: Path) -> None:
    """Remove the shared files of processes that no longer run (killed before they removed them)."""
    for path in folder.glob(f"{PREFIX}*"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(path.name[len(PREFIX) :].split("-")[0])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                path.unlink()


class SharedStaging:
    """One shared file (and, for accelerator tensors, one device buffer) reused from save to save.

    The file is removed when the staging is released, when the client is closed or collected,
    at the process's exit, and, for a process killed before that, by the next client in that
    folder (:func:`sweep_stale`).
    """

    def __init__(self, folder: Path | None = None) -> None:
        self._folder = folder if folder is not None else shared_folder()
        sweep_stale(self._folder)
        self._remove: weakref.finalize | None = None
        self._layout: list[tuple[torch.dtype, torch.Size, bool]] | None = None
        self._path: Path | None = None
        self._host: torch.Tensor | None = None
        self._pinned = False
        self._device: torch.Tensor | None = None
        self._offsets: list[int] = []
        self._host_views: list[torch.Tensor] = []
        self._device_views: list[torch.Tensor] = []
        self._on_device_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the shared file."""
        return 0 if self._host is None else self._host.numel()

    def snapshot(self, flat: FlatState, cache: DigestCache | None) -> SharedSnapshot:
        """Copy what the save must not read live into the shared file; returns the snapshot.

        As :meth:`client.saving.snapshot.Staging.snapshot`: a tensor the digest cache knows
        unchanged is not copied (its digest is all the save needs), every other one is.
        """
        records = flat.records
        cacheable = [record.trainable is False for record in records]
        tensors = [record.tensor for record in records]
        known: list[str | None] = [None] * len(records)
        if cache is not None:
            answers = iter(cache.get_many([t for t, ok in zip(tensors, cacheable, strict=True) if ok]))
            known = [next(answers) if ok else None for ok in cacheable]
        devices = ["cpu" if t.is_cpu else t.device.type for t in tensors]
        teach: dict[int, tuple[torch.Tensor, Taken | None]] = {}
        unique: dict[int, int] = {}  # id(tensor) -> its place among the staged (a tied tensor once)
        staged: list[torch.Tensor] = []
        for index, (tensor, digest) in enumerate(zip(tensors, known, strict=True)):
            if digest is not None:
                continue
            if cache is not None and cacheable[index]:
                teach[index] = (tensor, cache.take(tensor))  # read before the bytes are copied
            if id(tensor) not in unique:
                problem = shape_problem(dtype_name(tensor, records[index].key), tensor.shape)
                if problem is not None:
                    raise InvalidManifestError(f"{records[index].key}: {problem}")
                unique[id(tensor)] = len(staged)
                staged.append(tensor)
        # Accelerator tensors first: their copies fill one stretch of the file, in one transfer.
        order = sorted(range(len(staged)), key=lambda i: not staged[i].is_cuda)
        copies, copied = self._stage([staged[i] for i in order])
        place = {order[k]: k for k in range(len(order))}
        result: list[torch.Tensor] = []
        offsets: list[int | None] = []
        for tensor, digest in zip(tensors, known, strict=True):
            if digest is not None:
                result.append(tensor)
                offsets.append(None)
            else:
                slot = place[unique[id(tensor)]]
                result.append(copies[slot])
                offsets.append(self._offsets[slot])
        staged_bytes = sum(copy.nbytes for copy in copies)
        snapshot = Snapshot(result, known, teach, staged_bytes, devices, copied)
        assert self._path is not None
        return SharedSnapshot(snapshot, str(self._path), self.nbytes, offsets)

    def release(self) -> None:
        """Let go of the file and the device buffer."""
        if self._pinned and self._host is not None:
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
        if self._remove is not None:
            self._remove()
        self._layout, self._path, self._host, self._pinned, self._device = None, None, None, False, None
        self._remove = None
        self._offsets, self._host_views, self._device_views, self._on_device_bytes = [], [], [], 0

    def _stage(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Copy ``tensors`` (accelerator ones first) into the file; returns their copies there and,
        if any came from an accelerator, the event done once their transfer is. Returns once the
        live tensors may change (the gather on the device is done)."""
        layout = [(t.dtype, t.shape, t.is_cuda) for t in tensors]
        on_device = [t for t in tensors if t.is_cuda]
        if layout != self._layout:
            self._allocate(layout, {t.device for t in on_device})
        on_host = tensors[len(on_device) :]
        with torch.no_grad():
            if on_host:
                torch._foreach_copy_(self._host_views[len(on_device) :], on_host)
            if not on_device:
                return list(self._host_views), None
            device = on_device[0].device
            stream = torch.cuda.current_stream(device)
            with torch.cuda.device(device):
                gather(self._device_views, on_device)
                gathered = torch.cuda.Event()
                gathered.record(stream)
                assert self._host is not None and self._device is not None
                self._host[: self._on_device_bytes].copy_(self._device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            gathered.synchronize()
        return list(self._host_views), copied

    def _allocate(self, layout: list[tuple[torch.dtype, torch.Size, bool]], devices: set[torch.device]) -> None:
        """A new file (and device buffer) for ``layout``, the old ones removed.

        Raises:
            DoesNotFit: the accelerator tensors are on several devices, or take more than
                :data:`~client.saving.packed_staging.LIMIT_BYTES` (or more than the device has free).
        """
        self.release()
        offsets, total, on_device = [], 0, 0
        for dtype, shape, is_cuda in layout:
            offsets.append(total)
            total += -(-(shape.numel() * dtype.itemsize) // ALIGN) * ALIGN
            if is_cuda:
                on_device = total
        if len(devices) > 1 or on_device > LIMIT_BYTES:
            raise DoesNotFit(f"{len(devices)} devices, {on_device} bytes on them")
        device_buffer = None
        if devices:
            try:
                device_buffer = torch.empty(on_device, dtype=torch.uint8, device=next(iter(devices)))
            except torch.OutOfMemoryError as exc:
                raise DoesNotFit("no room for the gather buffer") from exc
        path = self._folder / f"{PREFIX}{os.getpid()}-{next(_numbers)}"
        host = torch.from_file(str(path), shared=True, size=max(total, 1), dtype=torch.uint8)
        self._remove = weakref.finalize(self, path.unlink, missing_ok=True)
        self._path, self._host, self._layout, self._offsets = path, host, layout, offsets
        if device_buffer is not None:
            torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            self._pinned, self._device, self._on_device_bytes = True, device_buffer, on_device
        for (dtype, shape, is_cuda), offset in zip(layout, offsets, strict=True):
            size = shape.numel() * dtype.itemsize
            self._host_views.append(host[offset : offset + size].view(dtype).view(shape))
            if is_cuda:
                assert self._device is not None
                self._device_views.append(self._device[offset : offset + size].view(dtype).view(shape))


class DoesNotFit(Exception):
    """This save's staging cannot go through a shared file: it runs on the client's own thread."""
