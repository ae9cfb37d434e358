"""Manifests stored as shared parts: a small change adds a part or two, not a manifest; a commit
never trusts a part no version lists; garbage collection removes unlisted parts and keeps
what any version lists."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardkit import body
from sqlalchemy import delete, func, select

from ckptstore.service.db.models import ManifestPart, PartBody, PartRef, Shard, Tensor, Version
from ckptstore.service.errors import MissingTensorsError
from ckptstore.service.format.manifest import TensorEntry, manifest_to_json
from ckptstore.service.format.parts import MAX_ENTRIES
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.store import Store

RUN = "run"


def small_model(store: Store, count: int, seed: int = 0, prefix: str = "layers") -> list[TensorEntry]:
    """``count`` stored four-byte tensors as manifest entries."""
    data = [(seed * 1_000_000 + index).to_bytes(4, "little") for index in range(count)]
    _receipt, digests = store.put_tensors([UnhashedTensor("F32", (1,), memoryview(d)) for d in data])
    return [
        TensorEntry(
            key=f"model/{prefix}.{index}.weight",
            dtype="F32",
            shape=[1],
            dtype_class="floating",
            digest=digest,
            placement="target",
            device_type="cpu",
            trainable=True,
        )
        for index, digest in enumerate(digests)
    ]


def rows(store: Store, model: type) -> int:
    with store.db.transaction() as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def test_a_version_changing_one_tensor_adds_one_part(store: Store) -> None:
    entries = small_model(store, 2000)
    first = store.commit(RUN, body(*entries, step=1))
    parts, refs = rows(store, ManifestPart), rows(store, PartRef)
    changed = small_model(store, 1, seed=7)[0].model_copy(update={"key": entries[500].key})
    second = store.commit(RUN, body(*entries[:500], changed, *entries[501:], step=2))

    assert rows(store, ManifestPart) == parts + 1
    assert 0 < rows(store, PartRef) - refs <= MAX_ENTRIES
    assert (first.tensors_new, second.tensors_new, second.bytes_new) == (2000, 1, 4)
    with store.db.transaction() as session:
        head = session.scalar(select(func.length(Version.manifest)).where(Version.version == 2))
    assert head is not None and head < 1000
    assert store.manifest(RUN, 2).tensors[500] == changed
    assert [e.digest for e in store.manifest(RUN, 1).tensors] == [e.digest for e in entries]


def test_the_manifest_read_back_is_the_text_committed(store: Store) -> None:
    entries = small_model(store, 300)
    store.commit(RUN, body(*entries, step=3, metrics={"loss": 0.25}, state={"extra": {"lr": 1e-3}}))
    manifest = store.manifest(RUN)
    assert manifest.tensors == entries
    assert (manifest.step, manifest.metrics, manifest.state) == (3, {"loss": 0.25}, {"extra": {"lr": 1e-3}})
    assert store.manifest(RUN) == manifest and manifest_to_json(manifest).count('"key"') == 300


def test_a_part_no_version_lists_is_checked_again_before_it_is_reused(store: Store) -> None:
    entries = small_model(store, 40)
    store.commit(RUN, body(*entries))
    store.delete_version(RUN, 1)
    # As a sweep leaves things between removing a shard and removing the parts: the part is
    # still stored, but nothing protects its tensors any more.
    with store.db.transaction() as session:
        session.execute(delete(Tensor))
        session.execute(delete(Shard))
    assert rows(store, ManifestPart) > 0

    with pytest.raises(MissingTensorsError, match="40 tensors"):
        store.commit(RUN, body(*entries))


def test_gc_removes_unlisted_parts_and_keeps_every_listed_one(store: Store, tmp_path: Path) -> None:
    base = small_model(store, 600)
    store.commit(RUN, body(*base))
    store.commit("other", body(*base, *small_model(store, 1, seed=3, prefix="head")))
    store.commit(RUN, body(*base[:100], *small_model(store, 1, seed=5, prefix="head")))
    listed_before = rows(store, ManifestPart)
    store.delete_version(RUN, 2)

    report = store.gc(grace_seconds=0)

    assert report.shards_swept == 1 and report.tensors_swept == 1  # the lone tensor of version 2
    assert 0 < rows(store, ManifestPart) < listed_before
    assert rows(store, PartBody) == rows(store, ManifestPart)
    with store.db.transaction() as session:
        assert session.scalar(select(func.min(ManifestPart.versions))) == 1
    assert [e.digest for e in store.manifest(RUN, 1).tensors] == [e.digest for e in base]
    assert len(store.manifest("other").tensors) == 601
    store.delete_version(RUN, 1)
    store.delete_version("other", 1)
    store.gc(grace_seconds=0)
    assert (rows(store, ManifestPart), rows(store, PartRef), rows(store, Tensor)) == (0, 0, 0)
