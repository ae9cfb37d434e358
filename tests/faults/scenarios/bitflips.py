"""Seeded bit flips in an embedded store's shard blobs and in its SQLite metadata file.

A few versions are saved, then one bit at a time is flipped behind the store's back: in a
random byte of a random shard blob, or in a random non-zero byte of ``metadata.db`` (most of
its pages are free space, zeros; no connection is open). After each
flip every acknowledged version is loaded by a fresh client and ``ckptstore verify`` runs.
Each flip must be detected (a load fails with a clean error of the store's error tree, or
verify exits 1) or harmless (every load is bit for bit what was saved and verify exits 0).
A load that returns other bytes without an error is a silent wrong load: counted as lost.
The bit is then restored (the metadata file from a copy, as a load may have written to it).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from typer.testing import CliRunner

from ckptstore.client.api import Client
from ckptstore.client.cli import app as cli_app
from ckptstore.service.errors import CheckpointError
from ckptstore.service.settings import METADATA_FILE
from tests.faults.scenarios.checks import check_store
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import Savers, state_hash
from tests.stress.model import state_sha

FLIPS = 30
SAVERS = 2
SAVES = 2
FRESH_KIB = 32


def _flip(path: Path, position: int, bit: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)[0]
        handle.seek(position)
        handle.write(bytes([byte ^ (1 << bit)]))


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Flip ``FLIPS * scale`` bits one at a time, judging each; then check the store is whole again."""
    home = workdir / "home"
    rng = random.Random(seed)
    tally = Tally()
    savers = Savers(tally, seed, SAVERS, SAVES, home=home, fresh_kib=FRESH_KIB)
    savers.start().join()
    metadata = home / METADATA_FILE
    pristine = metadata.read_bytes()
    blobs = sorted(p for p in (home / "blobs").glob("??/*") if p.is_file())
    used = [offset for offset, byte in enumerate(pristine) if byte]
    outcomes: Counter[str] = Counter()
    for index in range(FLIPS * scale):
        path = rng.choice(blobs) if index % 2 == 0 else metadata
        position = rng.randrange(path.stat().st_size) if path != metadata else rng.choice(used)
        bit = rng.randrange(8)
        _flip(path, position, bit)
        try:
            outcome = _judge(home, tally, f"{path.name} byte {position} bit {bit}")
        finally:
            if path == metadata:
                for extra in home.glob(METADATA_FILE + "-*"):  # a -wal or -shm file a client left
                    extra.unlink()
                metadata.write_bytes(pristine)
            else:
                _flip(path, position, bit)
        outcomes[("shard " if path != metadata else "metadata ") + outcome] += 1
    with Client(home=home) as ckpt:
        expected = lambda r, s: state_hash(seed, r, s, FRESH_KIB)  # noqa: E731
        findings = check_store(ckpt, savers.runs, tally.acknowledged, expected)
    wrong = sum(n for name, n in outcomes.items() if name.endswith("wrong"))
    findings.lost += wrong
    findings.problems += [f"{n} flips: {name}" for name, n in sorted(outcomes.items()) if name.endswith("wrong")]
    notes = {name.replace(" ", "_"): n for name, n in sorted(outcomes.items())}
    return ScenarioResult.of("bit-flips", seed, scale, tally, findings, flips=FLIPS * scale, **notes)


def _judge(home: Path, tally: Tally, where: str) -> str:
    """``detected``, ``harmless`` or ``wrong`` for the flip now on disk (``unclean`` errors go to the tally)."""
    detected = wrong = False
    try:
        with Client(home=home) as ckpt:
            for (run, version), sha in sorted(tally.acknowledged.items()):
                try:
                    loaded = ckpt.load(run, version).state_dict or {}
                except CheckpointError:
                    detected = True
                    continue
                wrong = wrong or state_sha(loaded) != sha
    except CheckpointError:
        detected = True  # the store would not open: a clean refusal
    except Exception as exc:  # anything else is an unclean failure, reported with the flip
        tally.failed_with(type(exc).__name__, f"{where}: {exc}", clean=False)
        return "unclean"
    env = {"CKPTSTORE_HOME": str(home), "CKPTSTORE_URL": None, "CKPTSTORE_DATABASE_URL": None, "CKPTSTORE_BLOBS": None}
    result = CliRunner().invoke(cli_app, ["verify"], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        tally.failed_with(type(result.exception).__name__, f"{where}: verify: {result.exception}", clean=False)
        return "unclean"
    detected = detected or result.exit_code == 1
    return "wrong" if wrong else "detected" if detected else "harmless"
