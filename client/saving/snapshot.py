"""Saves that run in the background: a snapshot taken while the caller waits, the rest later.

The caller waits only while :class:`Staging` snapshots the state: every tensor the digest
cache does not know unchanged is copied into a staging buffer this client reuses from save
to save (pinned host memory when the tensor is on an accelerator); a tensor the cache knows
is not copied at all, since its digest is all the save needs unless the store lacks it. So
once the frozen weights are known (after a first save, or a load), staging holds the
trainable state: trainable weights, buffers, optimizer, scheduler and extra tensors.

Hashing, writing and the commit then run on one background thread per client, one save after
another, so versions stay in order; a blocking save first waits for them, and a background one
for all but the last when its snapshot is small (:mod:`client.saving.background`).
"""

from __future__ import annotations

import atexit
import operator
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.client.results import SaveResult
from ckptstore.client.saving.hashing import DigestCache, Taken, marks_of
from ckptstore.client.saving.packed_staging import PackedStaging
from ckptstore.client.saving.saver import Snapshot
from ckptstore.client.state import FlatState
from ckptstore.client.tensors import dtype_name
from ckptstore.service.errors import InvalidManifestError
from ckptstore.service.format.dtypes import shape_problem


class SaveHandle:
    """A save running in the background (from ``Client.save(..., blocking=False)``).

    The state was snapshotted before the handle was returned: the caller may change the
    model and optimizer at once.
    """

    def __init__(self, future: Future[SaveResult], staged_bytes: int) -> None:
        self._future = future
        #: Bytes the snapshot copied into staging buffers while the caller waited.
        self.staged_bytes = staged_bytes
        #: Whether the save's outcome reached the caller (result() returned or raised).
        self.observed = False
        _wait_at_exit(self)

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the save and return its SaveResult, or raise the save's error.

        Raises:
            TimeoutError: the save did not finish within ``timeout`` seconds.
        """
        try:
            outcome = self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self.observed = True
            raise
        self.observed = True
        return outcome

    def done(self) -> bool:
        """Whether the save has finished (committed, or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save to finish, without raising its error; returns whether it finished."""
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return True

    def error(self) -> BaseException | None:
        """The save's error once it has finished (None if it succeeded or is still running)."""
        return self._future.exception() if self._future.done() else None


@dataclass
class ToStage:
    """What a snapshot copies, and what it takes as it is (:func:`to_stage`)."""

    #: Each record's digest where the digest cache knew it unchanged (that tensor is not copied).
    known: list[str | None]
    #: For cacheable tensors that are copied: the live tensor and what the cache must know of it.
    teach: dict[int, tuple[torch.Tensor, Taken | None]]
    #: The device type each record's live tensor is on.
    devices: list[str]
    #: The tensors to copy, by id, each once (a tied tensor stays tied), with the first key naming it.
    tensors: dict[int, tuple[str, torch.Tensor]]
    #: The ledger's marks of the tensors to copy, read before they are copied.
    marks: dict[int, Any]

    def snapshot(self, flat: FlatState, copies: dict[int, torch.Tensor], copied: torch.cuda.Event | None) -> Snapshot:
        """The snapshot once ``copies`` (by id of the live tensor) hold the tensors to copy."""
        tensors = [copies.get(id(record.tensor), record.tensor) for record in flat.records]
        staged_bytes = sum(copy.nbytes for copy in copies.values())
        return Snapshot(tensors, self.known, self.teach, staged_bytes, self.devices, copied, self.marks)


def to_stage(flat: FlatState, cache: DigestCache | None, *, host_too: bool = True) -> ToStage:
    """Which of ``flat``'s tensors a snapshot copies: every one the digest cache does not know
    unchanged (only accelerator ones without ``host_too``). What the cache must learn of a
    cacheable tensor is read now, before its bytes are copied."""
    records = flat.records
    cacheable = [record.trainable is False for record in records]
    tensors = [record.tensor for record in records]
    known: list[str | None] = [None] * len(records)
    if cache is not None:
        answers = iter(cache.get_many([t for t, ok in zip(tensors, cacheable, strict=True) if ok]))
        known = [next(answers) if ok else None for ok in cacheable]
    devices = ["cpu" if t.is_cpu else t.device.type for t in tensors]  # is_cpu: a sixth of the time
    teach: dict[int, tuple[torch.Tensor, Taken | None]] = {}
    chosen: dict[int, tuple[str, torch.Tensor]] = {}
    for index, (record, digest) in enumerate(zip(records, known, strict=True)):
        if digest is not None:
            continue
        if cache is not None and cacheable[index]:
            teach[index] = (record.tensor, cache.take(record.tensor))
        if host_too or devices[index] != "cpu":
            chosen.setdefault(id(record.tensor), (record.key, record.tensor))
    return ToStage(known, teach, devices, chosen, marks_of(tensor for _, tensor in chosen.values()))


def check_shape(key: str, tensor: torch.Tensor) -> None:
    """Refuse, as the manifest check will, a shape no staging buffer can take: a zero-size view
    can have one no contiguous tensor can (its strides overflow 64 bits), where torch.empty
    would fail bare."""
    problem = shape_problem(dtype_name(tensor, key), tensor.shape)
    if problem is not None:
        raise InvalidManifestError(f"{key}: {problem}")


#: What a staging buffer must share with its tensor.
_LAYOUT = operator.attrgetter("shape", "dtype")


class Staging:
    """Staging buffers reused across one client's background saves, by record key."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._packed = PackedStaging()
        #: The last snapshot's host copies: keys, each buffer's shape and dtype, the buffers.
        self._last: tuple[list[str], list[tuple[torch.Size, torch.dtype]], list[torch.Tensor]] = ([], [], [])

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values()) + self._packed.nbytes

    def release(self) -> None:
        """Let go of every staging buffer (host, pinned and device memory); later saves allocate anew."""
        self._buffers = {}
        self._last = ([], [], [])
        self._packed.release()

    def snapshot(self, flat: FlatState, cache: DigestCache | None, *, host_too: bool = True) -> Snapshot:
        """Copy what the background save must not read live; returns the snapshot.

        Without ``host_too`` only accelerator tensors are copied (a blocking save, which may read
        host tensors live): CPU tensors stay in the snapshot as they are.
        """
        plan = to_stage(flat, cache, host_too=host_too)
        copies: dict[int, torch.Tensor] = {}
        on_cuda = [(key, tensor) for key, tensor in plan.tensors.values() if tensor.is_cuda]
        elsewhere = [(key, tensor) for key, tensor in plan.tensors.values() if not tensor.is_cuda]
        buffers = self._host_buffers(elsewhere)
        with torch.no_grad():  # a copy of a parameter must not join its autograd graph
            if buffers:  # one call for all: a third less time than a copy_ each
                torch._foreach_copy_(buffers, [tensor for _, tensor in elsewhere])
        copies.update((id(tensor), buffer) for (_, tensor), buffer in zip(elsewhere, buffers, strict=True))
        copied = self._stage_cuda(on_cuda, copies) if on_cuda else None
        if not on_cuda:
            self._packed.release()
        if len(self._buffers) != len(elsewhere):  # a buffer no tensor used this time is let go
            used = {key for key, _ in elsewhere}
            self._buffers = {key: buffer for key, buffer in self._buffers.items() if key in used}
        return plan.snapshot(flat, copies, copied)

    def _stage_cuda(self, tensors: list[tuple[str, torch.Tensor]], copies: dict[int, torch.Tensor]) -> torch.cuda.Event:
        """Copy CUDA ``tensors`` (key, tensor) to pinned host memory, into ``copies`` by id.

        Returns once the live tensors may change: the event says when the host copies are
        complete. Gathered on the device and moved in one transfer where they fit
        (:class:`PackedStaging`); else one transfer each, waited for here.
        """
        packed = self._packed.stage([tensor for _, tensor in tensors])
        if packed is not None:
            for (_, tensor), host in zip(tensors, packed.host, strict=True):
                copies[id(tensor)] = host
            packed.gathered.synchronize()
            return packed.copied
        buffers = [self._buffer(key, tensor) for key, tensor in tensors]
        with torch.no_grad():
            torch._foreach_copy_(buffers, [tensor for _, tensor in tensors], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tensors[0][1].device))
        copied.synchronize()  # the copies read the live tensors: wait for them here
        for (_, tensor), buffer in zip(tensors, buffers, strict=True):
            copies[id(tensor)] = buffer
        return copied

    def _host_buffers(self, tensors: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The staging buffers of ``tensors`` (key, tensor) that are not on a CUDA device: the last
        snapshot's list as it is when the keys, shapes and dtypes are the same (a loop saving
        every step asks for the same ones), else one by one."""
        keys = [key for key, _ in tensors]
        layouts = list(map(_LAYOUT, [tensor for _, tensor in tensors]))
        last_keys, last_layouts, last_buffers = self._last
        if keys == last_keys and layouts == last_layouts:
            return last_buffers
        buffers = [self._buffer(key, tensor) for key, tensor in tensors]
        self._last = (keys, layouts, buffers)
        return buffers

    def _buffer(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """This key's staging buffer, shaped for ``tensor`` (on the host, pinned for a CUDA tensor)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            check_shape(key, tensor)
            pinned = not (tensor.is_cpu or tensor.is_meta) and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers[key] = buffer
        return buffer


_running: set[SaveHandle] = set()
_running_lock = threading.Lock()
_hooked = False


def _wait_at_exit(handle: SaveHandle) -> None:
    """Make the interpreter wait for ``handle`` before it exits."""
    global _hooked
    with _running_lock:
        _running.add(handle)
        if not _hooked:
            # threading's exit hooks run before concurrent.futures refuses new work (its own hook,
            # registered earlier, runs after ours): a save still running at exit must be able to
            # start its upload threads. atexit would be too late for that.
            register = getattr(threading, "_register_atexit", atexit.register)
            register(_wait_for_running_saves)
            _hooked = True
    handle._future.add_done_callback(lambda _: _forget(handle))


def _forget(handle: SaveHandle) -> None:
    with _running_lock:
        _running.discard(handle)


def _wait_for_running_saves() -> None:
    """Wait for every background save still running (at interpreter exit)."""
    with _running_lock:
        running = list(_running)
    for handle in running:
        handle.wait()
