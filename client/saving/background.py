"""Where one client's background saves run: one at a time, in order, on its thread or in a save process.

``save(..., blocking=False)`` snapshots the state (:mod:`client.saving.snapshot`, or into a
shared file for a save process: :mod:`client.saving.shared_staging`), then hands the rest to
the client's one background thread. With a save process (:mod:`client.saving.save_process`)
that thread only passes the save on and waits for its answer; it saves itself when the process
cannot (a snapshot that does not fit a shared file, or a tensor only the live model holds).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from client.results import SaveResult
from client.saving.hashing import DigestCache
from client.saving.save_process import SaveProcess
from client.saving.saver import Snapshot
from client.saving.shared_staging import DoesNotFit, SharedSnapshot, SharedStaging
from client.saving.snapshot import SaveHandle, Staging
from client.state import FlatState


class BackgroundSaves:
    """One client's staging buffers, background thread, save process (if any) and running save."""

    def __init__(self, process: SaveProcess | None = None) -> None:
        #: Staging buffers of saves on this process's thread (and of blocking saves from a GPU).
        self.staging = Staging()
        #: The shared file of saves a save process makes.
        self.shared = SharedStaging() if process is not None else None
        self.process = process
        self._worker: ThreadPoolExecutor | None = None
        self._pending: SaveHandle | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the staging holds (the shared file included)."""
        return self.staging.nbytes + (self.shared.nbytes if self.shared is not None else 0)

    def start(
        self,
        flat: FlatState,
        cache: DigestCache | None,
        here: Callable[[Snapshot], SaveResult],
        elsewhere: Callable[[SaveProcess, SharedSnapshot], SaveResult | None],
    ) -> SaveHandle:
        """Snapshot ``flat`` now, then save it in the background: ``elsewhere`` (by the save
        process) where there is one and it can, else ``here`` (on the background thread)."""
        shared = None
        if self.shared is not None:
            try:
                shared = self.shared.snapshot(flat, cache)
            except DoesNotFit:  # accelerator tensors on several devices, or too many bytes of them
                self.shared.release()
        snapshot = shared.snapshot if shared is not None else self.staging.snapshot(flat, cache)
        process = self.process

        def save() -> SaveResult:
            if shared is not None and process is not None:
                done = elsewhere(process, shared)
                if done is not None:
                    return done
            return here(snapshot)

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-save")
        self._pending = SaveHandle(self._worker.submit(save), snapshot.staged_bytes)
        return self._pending

    def wait(self, *, report: bool) -> None:
        """Wait for the running save, if any. With ``report``, raise its error if the save failed
        and no ``result()`` call has raised it yet."""
        handle = self._pending
        if handle is None:
            return
        handle.wait()
        error = handle.error()
        if error is None or handle.observed:
            self._pending = None
        elif report:
            self._pending, handle.observed = None, True
            raise error

    def close(self) -> None:
        """Wait for the running save, then stop the thread and the save process and free the staging."""
        self.wait(report=False)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self.process is not None:
            self.process.close()
        self.staging.release()
        if self.shared is not None:
            self.shared.release()
