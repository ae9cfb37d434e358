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

from ckptstore.client.saving.hashing import DigestCache
from ckptstore.client.saving.packed_staging import LIMIT_BYTES, gather_and_transfer, places, views
from ckptstore.client.saving.saver import Snapshot
from ckptstore.client.saving.snapshot import check_shape, to_stage
from ckptstore.client.state import FlatState

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
        plan = to_stage(flat, cache)
        # Accelerator tensors first: their copies fill one stretch of the file, in one transfer.
        chosen = sorted(plan.tensors.values(), key=lambda item: not item[1].is_cuda)
        copies, copied = self._stage(chosen)
        by_id = {id(tensor): copy for (_, tensor), copy in zip(chosen, copies, strict=True)}
        at = {id(tensor): offset for (_, tensor), offset in zip(chosen, self._offsets, strict=True)}
        offsets = [
            at[id(record.tensor)] if digest is None else None
            for record, digest in zip(flat.records, plan.known, strict=True)
        ]
        assert self._path is not None
        return SharedSnapshot(plan.snapshot(flat, by_id, copied), str(self._path), self.nbytes, offsets)

    def release(self) -> None:
        """Let go of the file and the device buffer."""
        if self._pinned and self._host is not None:
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
        if self._remove is not None:
            self._remove()
        self._layout, self._path, self._host, self._pinned, self._device = None, None, None, False, None
        self._remove = None
        self._offsets, self._host_views, self._device_views, self._on_device_bytes = [], [], [], 0

    def _stage(self, chosen: list[tuple[str, torch.Tensor]]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Copy the ``chosen`` (key, tensor) pairs, accelerator ones first, into the file; returns
        their copies there and, if any came from an accelerator, the event done once their
        transfer is. Returns once the live tensors may change (the gather on the device is done)."""
        tensors = [tensor for _, tensor in chosen]
        layout = [(t.dtype, t.shape, t.is_cuda) for t in tensors]
        on_device = [t for t in tensors if t.is_cuda]
        if layout != self._layout:
            for key, tensor in chosen:
                check_shape(key, tensor)
            self._allocate(layout, {t.device for t in on_device})
        on_host = tensors[len(on_device) :]
        with torch.no_grad():
            if on_host:
                torch._foreach_copy_(self._host_views[len(on_device) :], on_host)
        if not on_device:
            return list(self._host_views), None
        assert self._host is not None and self._device is not None
        gathered, copied = gather_and_transfer(
            self._device_views, on_device, self._device, self._host[: self._on_device_bytes]
        )
        gathered.synchronize()
        return list(self._host_views), copied

    def _allocate(self, layout: list[tuple[torch.dtype, torch.Size, bool]], devices: set[torch.device]) -> None:
        """A new file (and device buffer) for ``layout``, the old ones removed.

        Raises:
            DoesNotFit: the accelerator tensors are on several devices, or take more than
                :data:`~client.saving.packed_staging.LIMIT_BYTES` (or more than the device has free).
        """
        self.release()
        shapes = [(dtype, shape) for dtype, shape, _ in layout]
        offsets, total = places(shapes)
        cuda_count = sum(is_cuda for _, _, is_cuda in layout)  # they come first
        on_device = places(shapes[:cuda_count])[1]
        if len(devices) > 1 or on_device > LIMIT_BYTES:
            raise DoesNotFit(f"{len(devices)} devices, {on_device} bytes on them")
        device_buffer = None
        if devices:
            try:
                device_buffer = torch.empty(on_device, dtype=torch.uint8, device=next(iter(devices)))
            except torch.OutOfMemoryError as exc:
                raise DoesNotFit("no room for the gather buffer") from exc
        path = self._folder / f"{PREFIX}{os.getpid()}-{next(_numbers)}"
        reserve(path, max(total, 1))
        self._remove = weakref.finalize(self, path.unlink, missing_ok=True)
        host = torch.from_file(str(path), shared=True, size=max(total, 1), dtype=torch.uint8)
        self._path, self._host, self._layout, self._offsets = path, host, layout, offsets
        if device_buffer is not None:
            torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
            self._pinned, self._device, self._on_device_bytes = True, device_buffer, on_device
        self._host_views = views(host, shapes, offsets)
        if device_buffer is not None:
            self._device_views = views(device_buffer, shapes[:cuda_count], offsets[:cuda_count])


def reserve(path: Path, size: int) -> None:
    """Create ``path`` readable by this user alone, with ``size`` bytes allocated: a memory-backed
    folder without room for them (a container's small ``/dev/shm``) refuses here, rather than
    killing the process with SIGBUS when the copy first touches a page it cannot back.

    Raises:
        DoesNotFit: the folder has no room for ``size`` bytes (the file is removed).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:  # no way to reserve the pages: at least the size
            os.ftruncate(fd, size)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise DoesNotFit(f"no room for {size} bytes in {path.parent}: {exc.strerror}") from exc
    finally:
        os.close(fd)


class DoesNotFit(Exception):
    """This save's staging cannot go through a shared file: it runs on the client's own thread."""
