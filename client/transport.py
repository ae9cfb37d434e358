"""How the client reaches a store: in-process (embedded) or, later, over HTTP.

Both speak the same protocol, so save and load run one code path. The embedded
transport *is* the engine's :class:`service.store.Store`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from service.format.manifest import Manifest, ManifestBody
from service.records import RunInfo, ShardReceipt, TensorLocation, VersionInfo


class Transport(Protocol):
    """The operations a client needs from a store, in the order a save or load calls them."""

    def missing(self, digests: Iterable[str]) -> list[str]:
        """Digests the store lacks."""

    def staging_path(self) -> Path:
        """A local path to write the next shard to."""

    def ingest_file(self, path: Path) -> ShardReceipt:
        """Send the shard at ``path`` to the store (the file is consumed)."""

    def commit(self, run_id: str, body: ManifestBody, *, tags: Sequence[str] = ()) -> VersionInfo:
        """Commit a version."""

    def resolve(self, run_id: str, ref: int | str = "latest") -> int:
        """The version number a reference names."""

    def manifest(self, run_id: str, ref: int | str = "latest") -> Manifest:
        """A version's manifest."""

    def locate(self, digests: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each digest's bytes are."""

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        """Read a byte range of a shard."""

    def runs(self) -> list[RunInfo]:
        """Every run."""

    def versions(self, run_id: str) -> list[VersionInfo]:
        """Every version of a run."""

    def tag(self, run_id: str, ref: int | str, name: str) -> int:
        """Tag a version."""

    def untag(self, run_id: str, name: str) -> None:
        """Remove a tag."""

    def delete_version(self, run_id: str, ref: int | str) -> int:
        """Delete a version."""

    def close(self) -> None:
        """Release resources."""
