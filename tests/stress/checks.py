"""The invariants checked after every kill, on the store's files, its database and its API.

- Versions: numbered 1..n with no gap (the counter and the row commit together), steps
  strictly increasing, every version a client was told about still listed with its step, and
  every listed version loads bit-exactly as the state its step stands for.
- Blobs: every blob file verifies against its name (header hash and every tensor digest),
  every recorded shard has its blob with the recorded size; blobs with no row (a kill between
  storing a blob and recording it) are counted, not failed: garbage collection owns them.
- Files: nothing in the store's folder but the database, blobs and temporary files; the
  temporary files a kill left are counted, and none remain after cleanup.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from ckptstore.client.api import Client
from ckptstore.client.http.transport import STAGING_PREFIX
from ckptstore.client.saving.hashing import digest_all
from ckptstore.client.state import flatten
from ckptstore.service.db.models import Shard
from ckptstore.service.errors import CheckpointError, NotFoundError
from ckptstore.service.format.digest import is_digest
from ckptstore.service.intake.ingest import verify_shard_file
from ckptstore.service.store import Store
from tests.client.models import tensors_equal
from tests.stress.model import StressNet, expected_state, state_sha

RUN = "stress"


def digest_set_hash(digests: Iterable[str]) -> str:
    """A short name for a set of digests (the victim reports sets this way)."""
    return hashlib.sha256(",".join(sorted(set(digests))).encode()).hexdigest()[:16]


@dataclass
class Census:
    """Temporary files in the store's folder and the clients' temp folder."""

    staging: int = 0
    incoming: int = 0
    client_dirs: int = 0
    client_files: int = 0
    unexpected: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.staging + self.incoming + self.client_dirs + self.client_files


def census(home: Path, tmp: Path) -> Census:
    """Classify every file under ``home`` and every upload folder under ``tmp``."""
    found = Census()
    for path in sorted(home.rglob("*")):
        if not path.is_file():
            continue
        parts = path.relative_to(home).parts
        if len(parts) == 1 and (parts[0].startswith("metadata.db") or parts[0] == "reserve"):
            continue  # the database and the disk space it keeps for cleanup (service.db.reserve)
        if parts[0] == "staging":
            found.staging += 1
        elif parts[:2] == ("blobs", ".incoming"):
            found.incoming += 1
        elif len(parts) == 3 and parts[0] == "blobs" and is_digest(parts[2]) and parts[2][:2] == parts[1]:
            continue
        else:
            found.unexpected.append("/".join(parts))
    for entry in sorted(tmp.iterdir()) if tmp.exists() else []:
        if entry.name.startswith(STAGING_PREFIX):
            found.client_dirs += 1
            found.client_files += sum(1 for p in entry.rglob("*") if p.is_file())
    return found


@dataclass(frozen=True)
class Expectation:
    """What a save of ``step`` must send, asked of the store before the save starts."""

    step: int
    missing: frozenset[str]
    bytes_missing: int
    #: Bytes stored but referenced by no version: left by a killed save, reused by this one.
    bytes_reused: int

    @property
    def missing_hash(self) -> str:
        return digest_set_hash(self.missing)


class StoreChecker:
    """Checks one store across kills, remembering what it has already verified."""

    def __init__(self, home: Path, tmp: Path, seed: int, violation: Callable[[str], None]) -> None:
        self.home, self.tmp, self.seed = home, tmp, seed
        self.violation = violation
        self.verified: dict[int, int] = {}  # version -> step, loaded and compared
        self.acknowledged: dict[int, tuple[int, str]] = {}  # version -> (step, sha) a client reported
        self.referenced: set[str] = set()
        self.good_blobs: set[str] = set()
        self.orphans_seen: set[str] = set()
        self.loads = 0
        self.next_step = 0
        self._shas: dict[int, str] = {}

    def sha(self, step: int) -> str:
        """The state hash of ``step``, computed here independently of the victim."""
        if step not in self._shas:
            self._shas[step] = state_sha(expected_state(self.seed, step))
        return self._shas[step]

    # -- versions --------------------------------------------------------------------------

    def check_versions(self, ckpt: Client, *, reload_all: bool = False) -> None:
        """Check the run's version list and load every version not verified yet."""
        try:
            versions = ckpt.versions(RUN)
        except NotFoundError:
            versions = []
        listed = {v.version: v.step for v in versions}
        numbers = [v.version for v in versions]
        if numbers != list(range(1, len(numbers) + 1)):
            self.violation(f"version numbers are not 1..{len(numbers)}: {numbers}")
        steps = [v.step for v in versions]
        if any(s is None for s in steps) or steps != sorted(set(steps)):  # type: ignore[type-var]
            self.violation(f"steps are not strictly increasing with versions: {steps}")
        for version, step in self.verified.items():
            if listed.get(version) != step:
                self.violation(f"version {version} (step {step}) was verified before and is now {listed.get(version)}")
        for version, (step, sha) in self.acknowledged.items():
            if listed.get(version) != step:
                self.violation(f"version {version} was reported saved at step {step}, listed: {listed.get(version)}")
            if sha != self.sha(step):
                self.violation(f"version {version}: the saving client's state hash differs from step {step}'s")
        if reload_all:
            self.verified.clear()
        for version, listed_step in listed.items():
            if version not in self.verified and listed_step is not None:
                self._load_and_compare(ckpt, version, listed_step)
        self.next_step = max((s for s in listed.values() if s is not None), default=-1) + 1

    def _load_and_compare(self, ckpt: Client, version: int, step: int) -> None:
        try:
            loaded = ckpt.load(RUN, version).state_dict or {}
            manifest = ckpt.transport.manifest(RUN, version)
        except CheckpointError as exc:
            self.violation(f"version {version} is listed but does not load: {type(exc).__name__}: {exc}")
            return
        self.loads += 1
        expected = expected_state(self.seed, step)
        if set(loaded) != set(expected):
            self.violation(f"version {version}: keys {sorted(set(loaded) ^ set(expected))} differ from step {step}")
        differing = [k for k in expected if k in loaded and not tensors_equal(loaded[k], expected[k])]
        if differing:
            self.violation(f"version {version}: tensors {differing} are not bit-identical to step {step}")
        self.referenced.update(e.digest for e in manifest.tensors if e.digest is not None)
        self.verified[version] = step

    # -- blobs -----------------------------------------------------------------------------

    def check_blobs(self, store: Store) -> int:
        """Verify blobs not verified yet and match them with shard rows; returns orphan blobs."""
        files: dict[str, Path] = {}
        root = self.home / "blobs"
        for folder in sorted(root.iterdir()) if root.exists() else []:
            if folder.is_dir() and len(folder.name) == 2:
                files.update((p.name, p) for p in folder.iterdir() if is_digest(p.name))
        for name, path in files.items():
            if name in self.good_blobs:
                continue
            try:
                header = verify_shard_file(path)
            except CheckpointError as exc:
                self.violation(f"blob {name} is corrupt: {type(exc).__name__}: {exc}")
                continue
            if header.shard_id != name or header.file_size != path.stat().st_size:
                self.violation(f"blob {name} holds shard {header.shard_id} of {header.file_size} bytes")
                continue
            self.good_blobs.add(name)
        with store.db.transaction() as session:
            rows = {shard_id: size for shard_id, size in session.execute(select(Shard.id, Shard.size))}
        for shard_id, size in rows.items():
            if shard_id not in files:
                self.violation(f"shard {shard_id} is recorded but its blob is missing")
            elif files[shard_id].stat().st_size != size:
                self.violation(f"shard {shard_id} is recorded as {size} bytes, its blob has another size")
        orphans = set(files) - set(rows)
        self.orphans_seen |= orphans
        return len(orphans)

    # -- what a save must send -------------------------------------------------------------

    def expectation(self, ckpt: Client, step: int) -> Expectation:
        """Ask the store which of ``step``'s tensors it lacks."""
        records = flatten(StressNet(self.seed, step)).records
        digests = digest_all([(r.key, r.tensor) for r in records], None)
        sizes = {d: r.tensor.numel() * r.tensor.element_size() for r, d in zip(records, digests, strict=True)}
        missing = frozenset(ckpt.transport.missing(list(sizes)))
        reused = sum(n for d, n in sizes.items() if d not in missing and d not in self.referenced)
        return Expectation(step, missing, sum(sizes[d] for d in missing), reused)
