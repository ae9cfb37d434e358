"""Saves that run in the background: a snapshot taken while the caller waits, the rest later.

The caller waits only while :class:`Staging` snapshots the state: every tensor the digest
cache does not know unchanged is copied into a staging buffer this client reuses from save
to save (pinned host memory when the tensor is on an accelerator); a tensor the cache knows
is not copied at all, since its digest is all the save needs unless the store lacks it. So
once the frozen weights are known (after a first save, or a load), staging holds the
trainable state: trainable weights, buffers, optimizer, scheduler and extra tensors.

Hashing, writing and the commit then run on one background thread per client: versions stay
in order, since the next save (blocking or not) first waits for the one before it.
"""

from __future__ import annotations

import atexit
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from client.hashing import DigestCache, Taken
from client.results import SaveResult
from client.state import FlatState, TensorRecord


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
class Snapshot:
    """A save's state as it was when snapshotted: records over staged copies or known tensors."""

    flat: FlatState
    #: Each record's digest where the cache knew it (that tensor was not copied), else None.
    known: list[str | None]
    #: For staged copies of cacheable tensors: the live tensor and what the cache must know
    #: of it as it was copied, so it learns the copy's digest once it is hashed.
    teach: dict[int, tuple[torch.Tensor, Taken | None]]
    #: Bytes copied into staging buffers.
    staged_bytes: int


class Staging:
    """Staging buffers reused across one client's background saves, by record key."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def snapshot(self, flat: FlatState, cache: DigestCache | None) -> Snapshot:
        """Copy what the background save must not read live; returns the snapshot."""
        records = flat.records
        cacheable = [record.trainable is False for record in records]
        tensors = [record.tensor for record in records]
        known: list[str | None] = [None] * len(records)
        if cache is not None:
            asked = [t for t, ok in zip(tensors, cacheable, strict=True) if ok]
            answers = iter(cache.get_many(asked))
            known = [next(answers) if ok else None for ok in cacheable]
        staged: list[torch.Tensor] = []
        copies: dict[int, torch.Tensor] = {}  # a tied tensor is copied once and stays tied
        teach: dict[int, tuple[torch.Tensor, Taken | None]] = {}
        staged_bytes = 0
        used: set[str] = set()
        for index, (record, digest) in enumerate(zip(records, known, strict=True)):
            tensor = record.tensor
            if digest is not None:
                staged.append(tensor)
                continue
            if cache is not None and cacheable[index]:
                teach[index] = (tensor, cache.take(tensor))
            copy = copies.get(id(tensor))
            if copy is None:
                copy = self._copy(record.key, tensor)
                copies[id(tensor)] = copy
                staged_bytes += copy.numel() * copy.element_size()
            used.add(record.key)
            staged.append(copy)
        self._synchronize(tensors)
        for key in list(self._buffers):  # a buffer no record used this time is let go
            if key not in used:
                del self._buffers[key]
        records = [
            TensorRecord(r.key, t, r.placement, r.param, r.trainable) for r, t in zip(records, staged, strict=True)
        ]
        return Snapshot(FlatState(records=records, state=flat.state), known, teach, staged_bytes)

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in this key's staging buffer (row-major, on the host)."""
        source = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pinned = source.device.type not in ("cpu", "meta") and torch.cuda.is_available()
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
            self._buffers[key] = buffer
        buffer.copy_(source, non_blocking=buffer.is_pinned())
        return buffer

    @staticmethod
    def _synchronize(tensors: list[torch.Tensor]) -> None:
        """Wait for copies started without blocking from accelerator memory."""
        if any(t.device.type == "cuda" for t in tensors):
            torch.cuda.synchronize()


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
