"""Choosing, per disk, between direct (``O_DIRECT``) and buffered writes for shards, by measuring.

Which is faster depends on the machine: on a VM whose fresh memory is slow to touch, a
buffered write + fsync of 1 GiB took 2.6-3.2 s where ``O_DIRECT`` took 0.44-0.64 s; on another
machine direct writes lost to buffered ones by a third. So unless ``CKPTSTORE_DIRECT_WRITES``
says which, the store measures both on its own staging folder before its first shard is
written: ``PROBE_ROUNDS`` rounds, alternating, of ``PROBE_BYTES`` written the way a shard is
(:class:`service.intake.direct_file.DirectFileWriter`, then fsync), about a quarter of a second in
all. Each way costs its time plus the CPU time it takes: a save hashes and sends meanwhile,
and a buffered write copies every byte into the page cache (2-3 times the CPU of a direct
write). On a 2-core VM where buffered writes of 32 MiB finished 5-25 % sooner, a 512 MiB save
took 0.28 s with them against 0.21 s direct, and an HTTP save 0.53 s against 0.42 s. The
cheaper way wins, and the figures are kept in ``write-mode.json`` in the staging folder, so
later processes on the same store read the choice instead of measuring again (delete the file
to measure anew, e.g. after moving the store to another disk: a cache made on another device,
or one without CPU figures, is ignored).
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ckptstore.service.blobs.held_file import hold_new
from ckptstore.service.intake.direct_file import DEFAULT_IN_FLIGHT, DirectFileWriter

#: Bytes written per measurement: enough to get past the device's own write cache.
PROBE_BYTES = 32 << 20
#: Measurements of each way, alternating (the median counts).
PROBE_ROUNDS = 3
CACHE_NAME = "write-mode.json"
#: Held by the process measuring (see :func:`choose_direct_writes`).
LOCK_NAME = "write-mode.lock"
#: Bytes handed to each write() of the probe, as a shard's tensors are.
_PIECE = 4 << 20


@dataclass(frozen=True)
class WriteChoice:
    """What the probe found: whether to write directly, the median seconds of each way and the
    median CPU seconds they took (None: not measured)."""

    direct: bool
    direct_seconds: float | None
    buffered_seconds: float | None
    device: int
    direct_cpu_seconds: float | None = None
    buffered_cpu_seconds: float | None = None

    @staticmethod
    def cost(seconds: float, cpu_seconds: float) -> float:
        """What a way of writing costs a save: its time, plus the CPU time it takes from the save's
        hashing and sending (counted whole: a buffered write's writeback and reclaim take more,
        in kernel threads the measurement does not see)."""
        return seconds + cpu_seconds


def choose_direct_writes(staging_dir: Path) -> WriteChoice:
    """The write mode for shards staged in ``staging_dir``: read from its cache, else measured and cached.

    One process measures at a time (the workers of a server start together): the others wait
    for its figures rather than measure beside it, where each would slow the other's writes
    down and the choice would follow the contention, not the disk.

    A disk that fails the measurement (full, read-only) gets direct writes, uncached: the write of
    the shard itself then reports the problem, as it would have without a probe.
    """
    device = os.stat(staging_dir).st_dev
    cached = _read_cache(staging_dir / CACHE_NAME, device)
    if cached is not None:
        return cached
    with _measuring_alone(staging_dir):
        cached = _read_cache(staging_dir / CACHE_NAME, device)  # measured while this process waited
        if cached is not None:
            return cached
        try:
            choice = measure(staging_dir)
        except OSError:
            return WriteChoice(True, None, None, device)
        _write_cache(staging_dir / CACHE_NAME, choice)
        return choice


@contextmanager
def _measuring_alone(staging_dir: Path) -> Iterator[None]:
    """Hold ``LOCK_NAME`` in ``staging_dir`` (an exclusive ``flock``) for the ``with`` block.

    The file is removed on the way out, after the cache is written: a process still waiting on
    it finds the cache once it holds it, and one arriving later finds the cache first. A folder
    where the file cannot be made (read-only) measures without it.
    """
    path = staging_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)  # releases the lock


def measure(staging_dir: Path) -> WriteChoice:
    """Time durable writes of ``PROBE_BYTES`` both ways in ``staging_dir``, alternating; the cheaper
    (:meth:`WriteChoice.cost`) wins.

    A file system that refuses ``O_DIRECT`` gets buffered writes without a contest.
    """
    device = os.stat(staging_dir).st_dev
    data = memoryview(os.urandom(_PIECE))
    direct: list[tuple[float, float]] = []
    buffered: list[tuple[float, float]] = []
    for _ in range(PROBE_ROUNDS):
        seconds, cpu, was_direct = _timed_write(staging_dir, data, direct=True)
        if not was_direct:
            return WriteChoice(False, None, seconds, device, None, cpu)
        direct.append((seconds, cpu))
        buffered.append(_timed_write(staging_dir, data, direct=False)[:2])
    (direct_s, direct_cpu), (buffered_s, buffered_cpu) = _medians(direct), _medians(buffered)
    chosen = WriteChoice.cost(direct_s, direct_cpu) <= WriteChoice.cost(buffered_s, buffered_cpu)
    return WriteChoice(chosen, direct_s, buffered_s, device, direct_cpu, buffered_cpu)


def _medians(found: list[tuple[float, float]]) -> tuple[float, float]:
    """The median seconds and the median CPU seconds of the measurements."""
    return statistics.median(seconds for seconds, _ in found), statistics.median(cpu for _, cpu in found)


def _timed_write(staging_dir: Path, data: memoryview, *, direct: bool) -> tuple[float, float, bool]:
    """Seconds and CPU seconds (of this process, its writing threads included) to write and fsync
    ``PROBE_BYTES`` as a shard is written, and whether it went direct."""
    held = hold_new(staging_dir / f"probe-{uuid.uuid4().hex}.incomplete")  # swept like any staging file if left
    path = held.path
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        writer = DirectFileWriter(path, direct=direct, in_flight=DEFAULT_IN_FLIGHT, exists=True)
        try:
            for _ in range(PROBE_BYTES // data.nbytes):
                writer.write(data)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - started, time.process_time() - cpu_started, writer.direct
    finally:
        held.remove()


def _read_cache(path: Path, device: int) -> WriteChoice | None:
    """The cached choice, unless absent, unreadable or measured on another device."""
    try:
        fields = json.loads(path.read_text())
        seconds = {
            name: None if fields[name] is None else float(fields[name])
            for name in ("direct_seconds", "buffered_seconds", "direct_cpu_seconds", "buffered_cpu_seconds")
        }  # a cache without CPU figures was chosen by time alone: measured again
        choice = WriteChoice(direct=bool(fields["direct"]), device=int(fields["device"]), **seconds)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return choice if choice.device == device else None


def _write_cache(path: Path, choice: WriteChoice) -> None:
    """Keep ``choice`` for later processes; a store that cannot write it just measures again next time."""
    try:
        with hold_new(path.with_name(f"{path.name}.{uuid.uuid4().hex}.incomplete")) as temporary:
            temporary.path.write_text(json.dumps(asdict(choice)))
            os.replace(temporary.path, path)
    except OSError:
        pass
