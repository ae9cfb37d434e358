"""Choosing, per disk, between direct (``O_DIRECT``) and buffered writes for shards, by measuring.

Which is faster depends on the machine: on a VM whose fresh memory is slow to touch, a
buffered write + fsync of 1 GiB took 2.6-3.2 s where ``O_DIRECT`` took 0.44-0.64 s; on another
machine direct writes lost to buffered ones by a third. So unless ``CKPTSTORE_DIRECT_WRITES``
says which, the store measures both on its own staging folder before its first shard is
written: ``PROBE_ROUNDS`` rounds, alternating, of ``PROBE_BYTES`` written the way a shard is
(:class:`service.direct_file.DirectFileWriter`, then fsync), about a quarter of a second in
all. The faster way wins, and the figures are kept in ``write-mode.json`` in the staging
folder, so later processes on the same store read the choice instead of measuring again
(delete the file to measure anew, e.g. after moving the store to another disk: a cache made
on another device is ignored).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from service.direct_file import DEFAULT_IN_FLIGHT, DirectFileWriter

#: Bytes written per measurement: enough to get past the device's own write cache.
PROBE_BYTES = 32 << 20
#: Measurements of each way, alternating (the median counts).
PROBE_ROUNDS = 3
CACHE_NAME = "write-mode.json"
#: Bytes handed to each write() of the probe, as a shard's tensors are.
_PIECE = 4 << 20


@dataclass(frozen=True)
class WriteChoice:
    """What the probe found: whether to write directly, and the median seconds of each way (None:
    not measured)."""

    direct: bool
    direct_seconds: float | None
    buffered_seconds: float | None
    device: int


def choose_direct_writes(staging_dir: Path) -> WriteChoice:
    """The write mode for shards staged in ``staging_dir``: read from its cache, else measured and cached.

    A disk that fails the measurement (full, read-only) gets direct writes, uncached: the write of
    the shard itself then reports the problem, as it would have without a probe.
    """
    device = os.stat(staging_dir).st_dev
    cached = _read_cache(staging_dir / CACHE_NAME, device)
    if cached is not None:
        return cached
    try:
        choice = measure(staging_dir)
    except OSError:
        return WriteChoice(True, None, None, device)
    _write_cache(staging_dir / CACHE_NAME, choice)
    return choice


def measure(staging_dir: Path) -> WriteChoice:
    """Time durable writes of ``PROBE_BYTES`` both ways in ``staging_dir``, alternating; the faster wins.

    A file system that refuses ``O_DIRECT`` gets buffered writes without a contest.
    """
    data = memoryview(os.urandom(_PIECE))
    direct: list[float] = []
    buffered: list[float] = []
    for _ in range(PROBE_ROUNDS):
        seconds, was_direct = _timed_write(staging_dir, data, direct=True)
        if not was_direct:
            buffered.append(seconds)
            return WriteChoice(False, None, statistics.median(buffered), os.stat(staging_dir).st_dev)
        direct.append(seconds)
        buffered.append(_timed_write(staging_dir, data, direct=False)[0])
    direct_median, buffered_median = statistics.median(direct), statistics.median(buffered)
    return WriteChoice(direct_median <= buffered_median, direct_median, buffered_median, os.stat(staging_dir).st_dev)


def _timed_write(staging_dir: Path, data: memoryview, *, direct: bool) -> tuple[float, bool]:
    """Seconds to write and fsync ``PROBE_BYTES`` as a shard is written, and whether it went direct."""
    path = staging_dir / f"probe-{uuid.uuid4().hex}.incomplete"  # swept like any staging file if left
    try:
        started = time.perf_counter()
        writer = DirectFileWriter(path, direct=direct, in_flight=DEFAULT_IN_FLIGHT)
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
        return time.perf_counter() - started, writer.direct
    finally:
        path.unlink(missing_ok=True)


def _read_cache(path: Path, device: int) -> WriteChoice | None:
    """The cached choice, unless absent, unreadable or measured on another device."""
    try:
        fields = json.loads(path.read_text())
        choice = WriteChoice(
            direct=bool(fields["direct"]),
            direct_seconds=None if fields["direct_seconds"] is None else float(fields["direct_seconds"]),
            buffered_seconds=None if fields["buffered_seconds"] is None else float(fields["buffered_seconds"]),
            device=int(fields["device"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return choice if choice.device == device else None


def _write_cache(path: Path, choice: WriteChoice) -> None:
    """Keep ``choice`` for later processes; a store that cannot write it just measures again next time."""
    temporary = path.with_name(f"{path.name}.{uuid.uuid4().hex}.incomplete")
    try:
        temporary.write_text(json.dumps(asdict(choice)))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
