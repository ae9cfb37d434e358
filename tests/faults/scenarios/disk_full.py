"""An embedded store on a small tmpfs, saved into until the disk is full.

Each save brings about 1 MiB of new tensors; saving goes on until several saves in a row
fail. Every failure must be a clean error of the store's error tree, and every version
acknowledged before (or between) the failures must still load bit for bit. Then the older
half of the versions is deleted and collected at grace 0, on the full disk, and one more save
must commit. What a full disk leaves behind and how it is freed through the CLI and a server
is tested apart (tests/faults/test_full_disk.py).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ckptstore.client.api import Client
from tests.faults.scenarios.checks import check_store
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import Savers, state_hash

DISK_MIB = 32
FRESH_KIB = 1024
#: The reserve the store keeps for its own cleanup, in proportion to the small disk (the
#: default's 64 MiB would refuse every save on a disk with less than 128 MiB free).
RESERVE_BYTES = 2 << 20
#: Saving stops after this many failures in a row: the disk is full, not briefly short.
FAILURES_IN_A_ROW = 3


@contextmanager
def small_disk(folder: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB mounted on ``folder`` (root only); unmounted afterwards."""
    if os.geteuid() != 0:
        raise RuntimeError("the disk-full scenario mounts a tmpfs: run it as root")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(folder)], check=True, timeout=30)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True, timeout=30)


@contextmanager
def reserve_of(size: int) -> Iterator[None]:
    """Stores opened meanwhile keep a reserve of ``size`` bytes (``CKPTSTORE_RESERVE_BYTES``)."""
    before = os.environ.get("CKPTSTORE_RESERVE_BYTES")
    os.environ["CKPTSTORE_RESERVE_BYTES"] = str(size)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CKPTSTORE_RESERVE_BYTES"]
        else:
            os.environ["CKPTSTORE_RESERVE_BYTES"] = before


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Fill a ``DISK_MIB * scale`` MiB disk with saves; check what was acknowledged."""
    tally = Tally()
    with small_disk(workdir / "disk", DISK_MIB * scale) as disk, reserve_of(RESERVE_BYTES):
        home = disk / "home"
        savers = Savers(tally, seed, 1, 0, home=home, fresh_kib=FRESH_KIB)
        (run_id,) = savers.runs
        in_a_row = step = 0
        with Client(home=home) as ckpt:
            while in_a_row < FAILURES_IN_A_ROW and step < 4 * DISK_MIB * scale:
                saved = savers.save_one(ckpt, run_id, step)
                in_a_row = 0 if saved is not None else in_a_row + 1
                step += 1
        freed, deleted = free_half(home, tally, run_id)
        with Client(home=home) as ckpt:
            saved_after = int(savers.save_one(ckpt, run_id, step) is not None)
        with Client(home=home) as ckpt:
            findings = check_store(
                ckpt, savers.runs, tally.acknowledged, lambda r, s: state_hash(seed, r, s, FRESH_KIB), deleted
            )
    return ScenarioResult.of(
        "disk-full", seed, scale, tally, findings, disk_mib=DISK_MIB * scale, freed_mib=freed >> 20,
        saved_after_freeing=saved_after,
    )  # fmt: skip


def free_half(home: Path, tally: Tally, run_id: str) -> tuple[int, list[tuple[str, int]]]:
    """What an operator does next, on the full disk: delete the older half of the versions and
    collect at grace 0 (a fresh client, as the CLI's). Returns the bytes swept and what went."""
    deleted = []
    with Client(home=home) as ckpt:
        listed = sorted(info.version for info in ckpt.versions(run_id))
        for version in listed[: len(listed) // 2]:
            ckpt.delete(run_id, version)
            tally.acknowledged.pop((run_id, version), None)  # deleted on purpose: not lost
            deleted.append((run_id, version))
        report = ckpt.gc(grace_seconds=0)
    return report.bytes_swept, deleted
