"""Where one client's background saves run: in order, on its thread or in a save process.

``save(..., blocking=False)`` snapshots the state (:mod:`client.saving.snapshot`, or into a
shared file for a save process: :mod:`client.saving.shared_staging`), then hands the rest to
the client's one background thread. With a save process (:mod:`client.saving.save_process`)
that thread only passes the save on and waits for its answer; it saves itself when the process
cannot (a snapshot that does not fit a shared file, or a tensor only the live model holds).

A save may be snapshotted while the one before it still runs (hashing, writing, committing),
into a second set of staging buffers, when the snapshots are small (:data:`OVERLAP_BYTES`): a
loop that saves every step then waits for its snapshot alone as long as saves keep pace with
steps on average. The saves still run one after another, in order. A larger snapshot waits for
the save before it, so staging never holds two copies of a large state.

With ``background="auto"`` the saves start on the thread, and a save process is started once the
saves come often (:mod:`client.saving.cadence`): on a thread of its own, while the saves go on on
the client's thread until it has opened the store (a few seconds: it imports torch), so that the
loop never waits for its start. A process that cannot start (or ends before it ever answered) is
given up, with a warning, and the saves go on on the thread.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptstore.client.results import SaveResult
from ckptstore.client.saving.cadence import Background, SaveCadence
from ckptstore.client.saving.hashing import DigestCache
from ckptstore.client.saving.save_process import SaveProcess
from ckptstore.client.saving.saver import Snapshot
from ckptstore.client.saving.shared_staging import DoesNotFit, SharedSnapshot, SharedStaging
from ckptstore.client.saving.snapshot import SaveHandle, Staging
from ckptstore.client.state import FlatState
from ckptstore.service.errors import StorageError

#: Snapshots of at most this many staged bytes may be taken while the save before them runs.
OVERLAP_BYTES = 256 * 2**20


@dataclass
class _Slot:
    """One set of staging buffers, and the save reading them (if any)."""

    staging: Staging = field(default_factory=Staging)
    shared: SharedStaging | None = None
    handle: SaveHandle | None = None

    @property
    def free(self) -> bool:
        return self.handle is None or self.handle.done()

    @property
    def nbytes(self) -> int:
        return self.staging.nbytes + (self.shared.nbytes if self.shared is not None else 0)

    def release(self) -> None:
        self.staging.release()
        if self.shared is not None:
            self.shared.release()


class BackgroundSaves:
    """One client's staging buffers, background thread, save process (if any) and running saves."""

    def __init__(self, process: SaveProcess | None = None, *, starter: Callable[[], SaveProcess] | None = None) -> None:
        """``process``: the save process saves go to; ``starter`` (``auto``): makes one once the
        saves come often (:class:`SaveCadence`)."""
        self.process = process
        self._starter = starter
        self._cadence = SaveCadence()
        #: The save process ``auto`` is starting, until it is ready (or could not start).
        self._starting: SaveProcess | None = None
        #: Set by the background thread when the process ``auto`` started ended before it answered.
        self._failed_start: BaseException | None = None
        self._slots = [self._slot()]
        self._worker: ThreadPoolExecutor | None = None
        self._pending: list[SaveHandle] = []  # started, not yet retired, in order
        self._failed: list[SaveHandle] = []  # finished with an error nobody has seen yet
        self._last_staged = 0

    @classmethod
    def of_mode(cls, mode: Background, make: Callable[[], SaveProcess]) -> BackgroundSaves:
        """A client's background saves in ``mode`` (:func:`client.saving.cadence.background_mode`),
        ``make`` making its save process."""
        if mode == "process":
            return cls(make())
        return cls(starter=make if mode == "auto" else None)

    @property
    def staging(self) -> Staging:
        """The first slot's staging buffers (blocking saves from a GPU use them once no save runs)."""
        return self._slots[0].staging

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the staging holds (shared files included)."""
        return sum(slot.nbytes for slot in self._slots)

    @property
    def overlap(self) -> int:
        """How many saves may still run when the next background save snapshots: 1 while the
        snapshots are small (:data:`OVERLAP_BYTES`), else 0."""
        return 1 if self._last_staged <= OVERLAP_BYTES else 0

    def start(
        self,
        flat: FlatState,
        cache: DigestCache | None,
        here: Callable[[Snapshot], SaveResult],
        elsewhere: Callable[[SaveProcess, SharedSnapshot], SaveResult | None],
    ) -> SaveHandle:
        """Snapshot ``flat`` now, then save it in the background once the saves before it are
        done: ``elsewhere`` (by the save process) where there is one and it can, else ``here``
        (on the background thread). Call :meth:`wait` first: it leaves a slot free."""
        self._follow_cadence()
        slot = self._free_slot()
        shared = None
        if slot.shared is not None and self.process is not None:
            try:
                shared = slot.shared.snapshot(flat, cache)
            except DoesNotFit:  # accelerator tensors on several devices or too many of them, or no room
                slot.shared.release()
            else:  # the thread's buffers (auto's saves before the process) need not stay beside the file
                slot.staging.release()
        snapshot = shared.snapshot if shared is not None else slot.staging.snapshot(flat, cache)
        process = self.process
        started_here = self._starter is not None  # auto: a process that never answered is given up

        def save() -> SaveResult:
            # Not to a process given up, or one a save before found dead before it ever answered.
            if shared is not None and process is not None and self.process is process and self._failed_start is None:
                try:
                    done = elsewhere(process, shared)
                except (OSError, StorageError) as exc:
                    if not started_here or process.answered:
                        raise
                    self._failed_start = exc  # it never answered: this save, and the next ones, run here
                    done = None
                if done is not None:
                    return done
            return here(snapshot)

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-save")
        slot.handle = SaveHandle(self._worker.submit(save), snapshot.staged_bytes)
        self._pending.append(slot.handle)
        self._last_staged = snapshot.staged_bytes
        if not self.overlap:  # a large state: one copy of it is enough
            for other in self._slots[1:]:
                if other is not slot and other.free:
                    other.release()
        return slot.handle

    def wait(self, *, report: bool, keep: int = 0) -> None:
        """Wait until at most ``keep`` saves run. With ``report``, raise the error of a save that
        failed and whose error no ``result()`` call (nor an earlier report) has raised."""
        while len(self._pending) > keep:
            self._pending[0].wait()
            self._retire(self._pending.pop(0))
        while self._pending and self._pending[0].done():
            self._retire(self._pending.pop(0))
        while report and self._failed:
            handle = self._failed.pop(0)
            error = handle.error()
            if error is not None and not handle.observed:
                handle.observed = True
                raise error

    def close(self) -> None:
        """Wait for the running saves, then stop the thread and the save process and free the staging."""
        self.wait(report=False)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for process in (self.process, self._starting):
            if process is not None:
                process.close()
        for slot in self._slots:
            slot.release()
        del self._slots[1:]

    def _follow_cadence(self) -> None:
        """With ``auto``: start a save process once saves come often, and send saves to it once it
        is ready; give it up (back to the thread, with a warning) if it could not start."""
        if self._starter is None:
            return
        often = self._cadence.often()
        starting = self._starting
        if starting is not None and starting.started.is_set():
            self._starting = None
            if starting.start_error is not None:
                self._give_up(starting, starting.start_error)
                return
            self.process = starting
            for slot in self._slots:
                if slot.shared is None:
                    slot.shared = SharedStaging()
        elif self._failed_start is not None and self.process is not None:
            self._give_up(self.process, self._failed_start)
        elif often and self.process is None and starting is None:
            self._starting = self._starter()
            self._starting.start()

    def _give_up(self, process: SaveProcess, why: BaseException) -> None:
        """Stop using (and end) the save process ``auto`` started: the saves stay on the thread."""
        self.process, self._starter = None, None
        process.close()
        message = f"the save process did not start ({why}); background saves run on this thread"
        warnings.warn(message, RuntimeWarning, stacklevel=_callers_level())
        for slot in self._slots:
            if slot.free and slot.shared is not None:
                slot.shared.release()
                slot.shared = None

    def _retire(self, handle: SaveHandle) -> None:
        if handle.error() is not None and not handle.observed:
            self._failed.append(handle)

    def _slot(self) -> _Slot:
        return _Slot(shared=SharedStaging() if self.process is not None else None)

    def _free_slot(self) -> _Slot:
        """A slot no running save reads: the first free one, a new second one, or the oldest
        save's once it is done."""
        for slot in self._slots:
            if slot.free:
                return slot
        if len(self._slots) < 2:
            self._slots.append(self._slot())
            return self._slots[-1]
        self.wait(report=False, keep=len(self._pending) - 1)
        return self._free_slot()


#: The top-level modules whose frames a warning skips: this package, and contextlib's decorators.
_OURS = ("ckptstore", "contextlib")


def _callers_level() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller of this function name the
    first frame outside this package (and the decorators around its methods): the line of the
    user's code that called ``save``."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _OURS:
        frame, level = frame.f_back, level + 1
    return level
