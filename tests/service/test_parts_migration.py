"""Revision 0003 carries a store with whole manifests and per-version references over to manifest
parts: every version loads bit for bit afterwards, garbage collection keeps all of it, and new
commits share parts with the migrated versions.

The store at revision 0002 is written as the code of that revision wrote it: whole manifest text
in ``versions.manifest`` and one ``version_refs`` row per digest per version, inserted with raw
SQL, next to shards and tensor rows ingested through the store.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import text

from ckptstore.service.blobs import LocalBlobStore
from ckptstore.service.db import Database
from ckptstore.service.db.schema import alembic_config, current_revision, head_revision, upgrade
from ckptstore.service.format.manifest import ManifestBody, TensorEntry, manifest_to_json, stamp
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.store import Store


@pytest.fixture(params=["sqlite", "postgresql"])
def database_at_0002(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = Database(f"sqlite:///{tmp_path / 'metadata.db'}")
    else:
        database = Database(request.getfixturevalue("postgres_databases").create())
    with database.engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0002")
    try:
        yield database
    finally:
        database.dispose()


def entries_for(digests: list[str], prefix: str) -> list[TensorEntry]:
    return [
        TensorEntry(
            key=f"model/{prefix}.{index}.weight",
            dtype="F32",
            shape=[2],
            dtype_class="floating",
            digest=digest,
            placement="target",
            device_type="cpu",
            trainable=index % 2 == 0,
        )
        for index, digest in enumerate(digests)
    ]


def write_old_version(database: Database, run_id: str, number: int, body: ManifestBody) -> None:
    """One version as revision 0002's commit wrote it."""
    created = datetime(2026, 12, 1, tzinfo=timezone.utc)
    parent = number - 1 if number > 1 else None
    manifest = stamp(body, run_id=run_id, version=number, parent=parent, created_at=created)
    nbytes = sum(e.nbytes for e in body.tensors)
    with database.engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO runs (id, created_at, updated_at, version_counter) VALUES (:id, :t, :t, :n) "
                "ON CONFLICT (id) DO UPDATE SET version_counter = :n"
            ),
            {"id": run_id, "t": created, "n": number},
        )
        connection.execute(
            text(
                "INSERT INTO versions (run_id, version, parent, created_at, step, metrics, tensors_total, "
                "tensors_new, bytes_total, bytes_new, bytes_trainable, manifest) VALUES (:run, :v, :parent, :t, "
                ":step, '{}', :count, 0, :nbytes, 0, 0, :manifest)"
            ),
            {
                "run": run_id,
                "v": number,
                "parent": parent,
                "t": created,
                "step": number,
                "count": len(body.tensors),
                "nbytes": nbytes,
                "manifest": manifest_to_json(manifest),
            },
        )
        connection.execute(
            text("INSERT INTO version_refs (run_id, version, digest) VALUES (:run, :v, :d)"),
            [{"run": run_id, "v": number, "d": d} for d in sorted(body.digests())],
        )


def test_an_old_store_upgrades_loads_bit_for_bit_and_keeps_everything_live(
    database_at_0002: Database, tmp_path: Path
) -> None:
    # Shards through the store's own path at 0002 (ingesting touches shards and tensors only).
    store = Store(database_at_0002, LocalBlobStore(tmp_path / "blobs"), tmp_path / "staging")
    rng = random.Random(5)
    data = [rng.randbytes(8) for _ in range(700)]
    _receipt, digests = store.put_tensors([UnhashedTensor("F32", (2,), memoryview(d)) for d in data])
    by_digest = dict(zip(digests, data, strict=True))
    bodies = {
        ("run-a", 1): ManifestBody(tensors=entries_for(digests[:600], "layers"), step=1),
        ("run-a", 2): ManifestBody(tensors=entries_for(digests[:599] + digests[650:651], "layers"), step=2),
        ("run-b", 1): ManifestBody(tensors=entries_for(digests[600:700], "head"), state={"extra": {"lr": 0.1}}),
    }
    for (run_id, number), body in bodies.items():
        write_old_version(database_at_0002, run_id, number, body)

    upgrade(database_at_0002)

    assert current_revision(database_at_0002) == head_revision()
    for (run_id, number), body in bodies.items():
        manifest = store.manifest(run_id, number)
        assert manifest.tensors == body.tensors and manifest.state == body.state
        locations = store.locate(manifest.digests())
        for digest, location in locations.items():
            buffer = bytearray(location.nbytes)
            store.read_into(location.shard_id, location.offset, memoryview(buffer))
            assert bytes(buffer) == by_digest[digest]
    report = store.gc(grace_seconds=0)
    assert (report.shards_swept, report.tensors_swept) == (0, 0)
    assert store.missing(digests) == []
    # A commit after the upgrade shares the migrated version's parts: one changed tensor, one new part.
    changed = ManifestBody(tensors=entries_for(digests[:599] + digests[652:653], "layers"), step=3)
    info = store.commit("run-a", changed)
    assert (info.version, info.parent, info.tensors_new) == (3, 2, 0)  # run-b's migrated refs count
    with database_at_0002.engine.connect() as connection:
        listed = connection.execute(text("SELECT count(*) FROM manifest_parts WHERE versions = 3")).scalar_one()
    assert listed > 0
    store.close()
