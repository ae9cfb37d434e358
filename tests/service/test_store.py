"""The engine on an embedded home: missing digests, ingest, commit, resolve, tags, figures, reads."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from shardkit import Ingest, RawTensor, body, build_shard, chunked_entry, entry, raw

from ckptstore.service.errors import (
    IntegrityError,
    InvalidInputError,
    InvalidManifestError,
    InvalidNameError,
    InvalidShardError,
    MissingTensorsError,
    NotFoundError,
)
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.records import ShardReceipt
from ckptstore.service.format.safetensors_header import encode_header
from ckptstore.service.store import Store

RUN = "run-1"


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def tensors() -> list[RawTensor]:
    return [raw("F32", (4, 3), 1), raw("BF16", (5,), 2), raw("I64", (), 3)]


# -- missing ------------------------------------------------------------------------------------


def test_missing_lists_absent_digests_in_input_order(store: Store, ingest: Ingest) -> None:
    a, b, c, d = (raw("F32", (2,), seed) for seed in range(4))
    ingest(b, d)
    assert store.missing([c.digest, a.digest, b.digest, d.digest]) == [c.digest, a.digest]
    assert store.missing([a.digest, a.digest]) == [a.digest]
    assert store.missing([b.digest]) == []
    assert store.missing([]) == []


@pytest.mark.parametrize("bad", ["A" * 64, "a" * 63, "a" * 65, "../etc", "", "z" * 64, 123, None])
def test_missing_rejects_malformed_digests(store: Store, bad: object) -> None:
    good = raw("F32", (2,), 0).digest
    with pytest.raises(InvalidInputError, match="not a digest"):
        store.missing([good, bad])  # type: ignore[list-item]


# -- ingest -------------------------------------------------------------------------------------


def test_ingest_records_tensors_and_consumes_the_file(store: Store, tensors: list[RawTensor]) -> None:
    shard = build_shard(tensors)
    path = shard.write(store.staging_path())
    digests = [t.digest for t in tensors]
    assert store.missing(digests) == digests

    receipt = store.ingest_file(path)

    assert receipt == ShardReceipt(shard_id=shard.shard_id, size=len(shard.data), tensors=3, created=True)
    assert not path.exists()
    assert store.missing(digests) == []
    assert store.blobs.size(shard.shard_id) == len(shard.data)
    assert list(store.blobs.list_ids()) == [shard.shard_id]
    assert files_under(store.staging_dir) == []


def test_ingest_is_idempotent(store: Store, tensors: list[RawTensor], tmp_path: Path) -> None:
    shard = build_shard(tensors)
    first = store.ingest_file(shard.write(store.staging_path()))
    again = shard.write(tmp_path / "again.safetensors")

    second = store.ingest_file(again)

    assert first.created is True
    assert second == first.model_copy(update={"created": False})
    assert not again.exists()
    assert list(store.blobs.list_ids()) == [shard.shard_id]
    assert files_under(store.staging_dir) == []


def test_ingest_of_a_shard_sharing_a_stored_tensor_keeps_the_first_location(store: Store, ingest: Ingest) -> None:
    a, b = raw("F32", (8,), 1), raw("F16", (3, 3), 2)
    first, _ = ingest(a)
    second, receipt = ingest(b, a)
    assert receipt.created is True and receipt.tensors == 2
    locations = store.locate([a.digest, b.digest])
    assert locations[a.digest].shard_id == first.shard_id
    assert locations[a.digest].offset == first.offsets[a.digest]
    assert locations[b.digest].shard_id == second.shard_id
    assert locations[b.digest].offset == second.offsets[b.digest]


def test_ingest_after_a_crash_between_blob_and_record_recovers(store: Store, tensors: list[RawTensor]) -> None:
    # The blob reached the blob store but the process died before its tensors were recorded.
    shard = build_shard(tensors)
    store.blobs.put_file(shard.shard_id, shard.write(store.staging_dir / "orphan"))
    assert store.missing([t.digest for t in tensors]) == [t.digest for t in tensors]

    receipt = store.ingest_file(shard.write(store.staging_path()))

    assert receipt.created is True
    assert store.missing([t.digest for t in tensors]) == []
    assert files_under(store.staging_dir) == []
    where = store.locate([tensors[0].digest])[tensors[0].digest]
    buffer = bytearray(where.nbytes)
    store.read_into(where.shard_id, where.offset, memoryview(buffer))
    assert bytes(buffer) == tensors[0].data


def assert_nothing_stored(store: Store, home: Path, digests: list[str]) -> None:
    assert store.missing(digests) == digests
    assert list(store.blobs.list_ids()) == []
    assert files_under(home / "blobs") == []
    assert files_under(store.staging_dir) == []


@pytest.mark.parametrize("which", [0, 1, 2])
def test_flipped_data_byte_is_refused_and_nothing_stored(
    store: Store, home: Path, tensors: list[RawTensor], which: int
) -> None:
    shard = build_shard(tensors)
    data = bytearray(shard.data)
    position = shard.offsets[tensors[which].digest] + tensors[which].nbytes - 1
    data[position] ^= 0x01
    path = store.staging_path()
    path.write_bytes(bytes(data))

    with pytest.raises(IntegrityError, match=tensors[which].digest[:16]):
        store.ingest_file(path)

    assert not path.exists()
    assert_nothing_stored(store, home, [t.digest for t in tensors])


def _truncated(data: bytes) -> bytes:
    return data[:-1]


def _trailing(data: bytes) -> bytes:
    return data + b"\0"


def _header_length_too_big(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data[8:]


def _not_json(data: bytes) -> bytes:
    return data[:8] + b"[" + data[9:]


def _named_by_path(data: bytes) -> bytes:
    payload = b"\x01\x02\x03\x04"
    header, _ = encode_header([("a" * 64, "F32", [1])])
    return header.replace(b"a" * 64, b"../../x".ljust(64, b"a")) + payload


@pytest.mark.parametrize("damage", [_truncated, _trailing, _header_length_too_big, _not_json, _named_by_path])
def test_bad_shard_is_refused_and_nothing_stored(
    store: Store, home: Path, tensors: list[RawTensor], damage: Callable[[bytes], bytes]
) -> None:
    path = store.staging_path()
    path.write_bytes(damage(build_shard(tensors).data))

    with pytest.raises(InvalidShardError):
        store.ingest_file(path)

    assert not path.exists()
    assert_nothing_stored(store, home, [t.digest for t in tensors])


def test_empty_file_is_refused(store: Store, home: Path) -> None:
    path = store.staging_path()
    path.write_bytes(b"")
    with pytest.raises(InvalidShardError):
        store.ingest_file(path)
    assert not path.exists()
    assert files_under(home / "blobs") == []


# -- commit and numbering -----------------------------------------------------------------------


def test_commit_with_unknown_digests_lists_them_and_creates_nothing(store: Store, ingest: Ingest) -> None:
    known, unknown_a, unknown_b = raw("F32", (2,), 1), raw("F32", (2,), 2), raw("F32", (3,), 3)
    ingest(known)
    manifest = body(entry("model/a", unknown_a), entry("model/k", known), entry("optim/state/a/exp_avg", unknown_b))

    with pytest.raises(MissingTensorsError) as caught:
        store.commit(RUN, manifest, tags=["best"])

    assert caught.value.digests == [unknown_a.digest, unknown_b.digest]
    assert unknown_a.digest in str(caught.value)
    assert store.runs() == []
    with pytest.raises(NotFoundError, match=RUN):
        store.versions(RUN)


def test_versions_are_numbered_with_parents(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    infos = [store.commit(RUN, body(entry("model/w", t), step=step)) for step in (10, 20, 30)]
    assert [(i.version, i.parent, i.step) for i in infos] == [(1, None, 10), (2, 1, 20), (3, 2, 30)]
    listed = store.versions(RUN)
    assert [(v.version, v.parent, v.step) for v in listed] == [(1, None, 10), (2, 1, 20), (3, 2, 30)]
    assert [v.created_at for v in listed] == sorted(v.created_at for v in listed)
    assert all(v.created_at.tzinfo is not None for v in listed)


def test_runs_are_numbered_independently(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    assert store.commit("a", body(entry("model/w", t))).version == 1
    assert store.commit("a", body(entry("model/w", t))).version == 2
    assert store.commit("b", body(entry("model/w", t))).version == 1
    assert store.resolve("a") == 2
    assert store.resolve("b") == 1


def test_numbers_are_not_reused_after_deleting_the_latest(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    store.commit(RUN, body(entry("model/w", t)))
    store.commit(RUN, body(entry("model/w", t)))
    store.delete_version(RUN, 2)
    third = store.commit(RUN, body(entry("model/w", t)))
    assert (third.version, third.parent) == (3, 1)
    assert [v.version for v in store.versions(RUN)] == [1, 3]


# -- resolve and tags ---------------------------------------------------------------------------


@pytest.fixture
def three_versions(store: Store, ingest: Ingest) -> Store:
    t = raw("F32", (4,), 1)
    ingest(t)
    store.commit(RUN, body(entry("model/w", t)), tags=["first"])
    store.commit(RUN, body(entry("model/w", t)), tags=["best", "best"])
    store.commit(RUN, body(entry("model/w", t)))
    return store


def test_resolve_by_number_latest_and_tag(three_versions: Store) -> None:
    store = three_versions
    assert store.resolve(RUN, 2) == 2
    assert store.resolve(RUN, "2") == 2
    assert store.resolve(RUN) == 3
    assert store.resolve(RUN, "latest") == 3
    assert store.resolve(RUN, "first") == 1
    assert store.resolve(RUN, "best") == 2


def test_commit_tags_appear_on_the_version(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    info = store.commit(RUN, body(entry("model/w", t)), tags=["zeta", "alpha", "zeta"])
    assert info.tags == ["alpha", "zeta"]
    assert store.versions(RUN)[0].tags == ["alpha", "zeta"]


def test_commit_tag_moves_an_existing_tag(three_versions: Store) -> None:
    store = three_versions
    t = raw("F32", (4,), 1)
    store.commit(RUN, body(entry("model/w", t)), tags=["best"])
    assert store.resolve(RUN, "best") == 4
    assert {v.version: v.tags for v in store.versions(RUN)} == {1: ["first"], 2: [], 3: [], 4: ["best"]}


def test_tags_belong_to_their_run(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    store.commit("a", body(entry("model/w", t)), tags=["best"])
    store.commit("a", body(entry("model/w", t)))
    store.commit("b", body(entry("model/w", t)), tags=["best"])
    assert (store.resolve("a", "best"), store.resolve("b", "best")) == (1, 1)
    store.tag("a", 2, "best")
    store.untag("b", "best")
    assert store.resolve("a", "best") == 2
    with pytest.raises(NotFoundError, match="'b'"):
        store.resolve("b", "best")


def test_tag_and_untag(three_versions: Store) -> None:
    store = three_versions
    assert store.tag(RUN, "latest", "release") == 3
    assert store.resolve(RUN, "release") == 3
    assert store.tag(RUN, "first", "release") == 1  # moves it
    assert store.resolve(RUN, "release") == 1
    assert store.versions(RUN)[0].tags == ["first", "release"]
    store.untag(RUN, "release")
    with pytest.raises(NotFoundError, match="release"):
        store.resolve(RUN, "release")
    with pytest.raises(NotFoundError, match="release"):
        store.untag(RUN, "release")
    assert store.versions(RUN)[0].tags == ["first"]


def test_not_found_messages_name_what_is_missing(three_versions: Store) -> None:
    store = three_versions
    with pytest.raises(NotFoundError, match="'nope'"):
        store.resolve("nope")
    with pytest.raises(NotFoundError, match="'nope'"):
        store.versions("nope")
    with pytest.raises(NotFoundError, match="'nope'"):
        store.manifest("nope", 1)
    with pytest.raises(NotFoundError, match="'nope'"):
        store.tag("nope", 1, "best")
    with pytest.raises(NotFoundError, match="version 7"):
        store.resolve(RUN, 7)
    with pytest.raises(NotFoundError, match="version 7"):
        store.manifest(RUN, 7)
    with pytest.raises(NotFoundError, match="version 7"):
        store.tag(RUN, 7, "best")
    with pytest.raises(NotFoundError, match="'missing-tag'"):
        store.resolve(RUN, "missing-tag")
    with pytest.raises(NotFoundError, match="'missing-tag'"):
        store.delete_version(RUN, "missing-tag")
    with pytest.raises(NotFoundError, match="'missing-tag'"):
        store.untag(RUN, "missing-tag")
    assert [v.version for v in store.versions(RUN)] == [1, 2, 3]


def test_not_found_is_a_lookup_error(store: Store) -> None:
    with pytest.raises(LookupError):
        store.resolve("never")


BAD_RUN_IDS = ["", "../x", "a/b", "a..b", "-lead", ".hidden", "with space", "x" * 129, "naïve", "a\nb", "run\n"]
BAD_TAGS = ["", "latest", "1abc", "../x", "with space", "t" * 65, "_x", "a/b", "best\n"]


@pytest.mark.parametrize("bad", BAD_RUN_IDS)
def test_bad_run_ids_are_refused(store: Store, ingest: Ingest, bad: str) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    with pytest.raises(InvalidNameError, match="invalid run id"):
        store.commit(bad, body(entry("model/w", t)))
    for call in (lambda: store.resolve(bad), lambda: store.versions(bad), lambda: store.manifest(bad)):
        with pytest.raises(InvalidNameError):
            call()
    assert store.runs() == []


@pytest.mark.parametrize("bad", BAD_TAGS)
def test_bad_tags_are_refused(store: Store, ingest: Ingest, bad: str) -> None:
    t = raw("F32", (4,), 1)
    ingest(t)
    with pytest.raises(InvalidNameError):
        store.commit(RUN, body(entry("model/w", t)), tags=["good", bad])
    assert store.runs() == []
    store.commit(RUN, body(entry("model/w", t)))
    with pytest.raises(InvalidNameError):
        store.tag(RUN, 1, bad)
    with pytest.raises(InvalidNameError):
        store.untag(RUN, bad)
    assert store.versions(RUN)[0].tags == []


@pytest.mark.parametrize("bad", [0, -1, True, "0", "01", "1.0", "../1", "", "2\n"])
def test_bad_version_references_are_refused(three_versions: Store, bad: object) -> None:
    with pytest.raises(InvalidNameError):
        three_versions.resolve(RUN, bad)  # type: ignore[arg-type]


# -- figures ------------------------------------------------------------------------------------


def test_version_figures_count_new_and_trainable_bytes(store: Store, ingest: Ingest) -> None:
    lora = raw("F32", (4, 2), 1)  # 32 bytes, trainable
    base = raw("BF16", (16, 8), 2)  # 256 bytes, frozen
    exp_avg = raw("F32", (4, 2), 3)  # 32 bytes, optimizer state
    newer = raw("F32", (4, 2), 4)  # 32 bytes
    ingest(lora, base, exp_avg)
    ingest(newer)
    tensors = [
        entry("model/lora_A", lora, trainable=True),
        entry("model/base", base, trainable=False),
        entry("optim/state/lora_A/exp_avg", exp_avg),
    ]

    first = store.commit(RUN, body(*tensors))
    same = store.commit(RUN, body(*tensors))
    grown = store.commit(RUN, body(*tensors, entry("optim/state/lora_A/exp_avg_sq", newer)))

    assert (first.bytes_total, first.bytes_new, first.tensors_total, first.tensors_new) == (320, 320, 3, 3)
    assert first.bytes_trainable == 32
    assert (same.bytes_total, same.bytes_new, same.tensors_total, same.tensors_new) == (320, 0, 3, 0)
    assert same.dedup_ratio == 1.0
    assert (grown.bytes_total, grown.bytes_new, grown.tensors_total, grown.tensors_new) == (352, 32, 4, 1)
    assert grown.bytes_trainable == 32
    assert [v.model_dump() for v in store.versions(RUN)] == [first.model_dump(), same.model_dump(), grown.model_dump()]


def test_new_bytes_are_counted_across_runs(store: Store, ingest: Ingest) -> None:
    shared, own = raw("F32", (10,), 1), raw("F32", (3,), 2)
    ingest(shared, own)
    store.commit("a", body(entry("model/w", shared)))
    other = store.commit("b", body(entry("model/w", shared), entry("model/v", own)))
    assert (other.bytes_total, other.bytes_new, other.tensors_new) == (52, 12, 1)


def test_a_tensor_referenced_twice_is_new_once(store: Store, ingest: Ingest) -> None:
    tied = raw("F32", (6,), 1)
    ingest(tied)
    info = store.commit(RUN, body(entry("model/embed", tied), entry("model/lm_head", tied, trainable=False)))
    assert (info.bytes_total, info.bytes_new, info.tensors_total, info.tensors_new) == (48, 24, 2, 1)
    assert info.bytes_trainable == 24


def test_deleting_the_only_reference_makes_bytes_new_again(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (6,), 1)
    ingest(t)
    store.commit(RUN, body(entry("model/w", t)))
    store.delete_version(RUN, 1)
    assert store.commit(RUN, body(entry("model/w", t))).bytes_new == 24


def test_runs_totals(store: Store, ingest: Ingest) -> None:
    a, b = raw("F32", (10,), 1), raw("F32", (5,), 2)
    ingest(a, b)
    store.commit("alpha", body(entry("model/a", a)))
    store.commit("alpha", body(entry("model/a", a), entry("model/b", b)))
    store.commit("beta", body(entry("model/a", a)))

    runs = store.runs()

    assert [r.run_id for r in runs] == ["beta", "alpha"]  # most recently updated first
    totals = {r.run_id: (r.versions, r.latest_version, r.bytes_total, r.bytes_new) for r in runs}
    assert totals == {"alpha": (2, 2, 40 + 60, 40 + 20), "beta": (1, 1, 40, 0)}
    store.commit("alpha", body(entry("model/a", a)))
    assert [r.run_id for r in store.runs()] == ["alpha", "beta"]


def test_runs_lists_a_run_whose_versions_were_all_deleted(store: Store, ingest: Ingest) -> None:
    t = raw("F32", (2,), 1)
    ingest(t)
    store.commit(RUN, body(entry("model/w", t)))
    store.delete_version(RUN, 1)
    [run] = store.runs()
    assert (run.run_id, run.versions, run.latest_version, run.bytes_total) == (RUN, 0, None, 0)
    with pytest.raises(NotFoundError, match="no versions"):
        store.resolve(RUN)


# -- manifests, locations and reads -------------------------------------------------------------


def test_manifest_round_trips_tensors_and_state(store: Store, ingest: Ingest) -> None:
    weight, step, exp_avg = raw("F32", (3, 2), 1), raw("F32", (), 2), raw("F32", (3, 2), 3)
    ingest(weight, step, exp_avg)
    sent = body(
        entry("model/layer.weight", weight),
        entry("optim/state/layer.weight/step", step),
        entry("optim/state/layer.weight/exp_avg", exp_avg),
        state={
            "optim": {
                "state": {
                    "layer.weight": {
                        "step": {"__tensor__": "optim/state/layer.weight/step"},
                        "exp_avg": {"__tensor__": "optim/state/layer.weight/exp_avg"},
                    }
                },
                "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": ["layer.weight"], "fused": None}],
            },
            "scheduler": {"last_epoch": 7},
        },
        step=7,
        metrics={"loss": 0.25},
        library={"torch": "2.4.0"},
    )
    store.commit(RUN, sent, tags=["best"])
    store.commit(RUN, sent)

    got = store.manifest(RUN, "best")

    assert (got.run_id, got.version, got.parent) == (RUN, 1, None)
    assert got.tensors == sent.tensors
    assert got.state == sent.state
    assert (got.step, got.metrics, got.library) == (7, {"loss": 0.25}, {"torch": "2.4.0"})
    assert got.created_at == store.versions(RUN)[0].created_at
    assert store.manifest(RUN).version == 2 and store.manifest(RUN).parent == 1


def test_locate_gives_offsets_that_read_back_the_tensor_bytes(store: Store, ingest: Ingest) -> None:
    tensors = [raw("F32", (7, 3), 1), raw("U8", (5,), 2), raw("F64", (2, 2), 3), raw("BOOL", (3,), 4)]
    first, _ = ingest(*tensors[:2])
    second, _ = ingest(*tensors[2:])

    locations = store.locate([t.digest for t in tensors])

    assert set(locations) == {t.digest for t in tensors}
    for tensor in tensors:
        where = locations[tensor.digest]
        assert (where.dtype, tuple(where.shape), where.nbytes) == (tensor.dtype, tensor.shape, tensor.nbytes)
        assert where.shard_id == (first if tensor in tensors[:2] else second).shard_id
        buffer = bytearray(where.nbytes)
        store.read_into(where.shard_id, where.offset, memoryview(buffer))
        assert bytes(buffer) == tensor.data
        assert tensor_digest(where.dtype, where.shape, buffer) == tensor.digest


def test_locate_names_missing_digests(store: Store, ingest: Ingest) -> None:
    present, absent = raw("F32", (2,), 1), raw("F32", (2,), 2)
    ingest(present)
    with pytest.raises(NotFoundError, match=absent.digest):
        store.locate([present.digest, absent.digest])
    with pytest.raises(InvalidInputError):
        store.locate(["../etc"])


def test_read_into_refuses_a_bad_shard_id(store: Store) -> None:
    with pytest.raises(InvalidInputError):
        store.read_into("../metadata.db", 0, memoryview(bytearray(1)))


def test_read_past_the_end_of_a_shard(store: Store, ingest: Ingest) -> None:
    shard, _ = ingest(raw("F32", (2,), 1))
    with pytest.raises(IntegrityError):
        store.read_into(shard.shard_id, len(shard.data) - 1, memoryview(bytearray(2)))


# -- deletion -----------------------------------------------------------------------------------


def test_delete_version_removes_it_and_its_tags_but_keeps_blobs(three_versions: Store) -> None:
    store = three_versions
    t = raw("F32", (4,), 1)
    store.tag(RUN, 3, "release")
    shard_ids = list(store.blobs.list_ids())

    assert store.delete_version(RUN, "best") == 2

    assert [v.version for v in store.versions(RUN)] == [1, 3]
    with pytest.raises(NotFoundError, match="'best'"):
        store.resolve(RUN, "best")
    with pytest.raises(NotFoundError, match="version 2"):
        store.manifest(RUN, 2)
    assert store.resolve(RUN, "release") == 3
    assert store.resolve(RUN, "first") == 1
    assert list(store.blobs.list_ids()) == shard_ids
    assert store.missing([t.digest]) == []
    where = store.locate([t.digest])[t.digest]
    buffer = bytearray(where.nbytes)
    store.read_into(where.shard_id, where.offset, memoryview(buffer))
    assert bytes(buffer) == t.data
    assert store.delete_version(RUN, "latest") == 3
    assert store.resolve(RUN) == 1


# -- manifest checks against stored tensors -----------------------------------------------------


@pytest.mark.parametrize(("dtype", "shape"), [("F32", (0,)), ("BF16", (3, 0)), ("I64", (0, 0, 2))])
def test_empty_tensor_needs_no_shard(store: Store, dtype: str, shape: tuple[int, ...]) -> None:
    empty = RawTensor(dtype, shape, b"")
    info = store.commit(RUN, body(entry("model/empty", empty)))
    assert (info.version, info.bytes_total, info.bytes_new) == (1, 0, 0)
    assert list(store.blobs.list_ids()) == []
    assert store.manifest(RUN).tensors[0].digest == tensor_digest(dtype, shape, b"")


def test_empty_tensors_count_as_new_until_a_version_references_them(store: Store, ingest: Ingest) -> None:
    empty, weight = RawTensor("F32", (0,), b""), raw("F32", (6,), 1)
    ingest(weight)
    tensors = [entry("model/empty", empty), entry("model/w", weight)]
    first = store.commit(RUN, body(*tensors))
    again = store.commit(RUN, body(*tensors))
    other = store.commit("other", body(entry("model/e", empty)))
    assert [(v.tensors_new, v.bytes_new) for v in (first, again, other)] == [(2, 24), (0, 0), (0, 0)]
    store.delete_version(RUN, 1)
    store.delete_version(RUN, 2)
    store.delete_version("other", 1)
    assert store.commit(RUN, body(*tensors)).tensors_new == 2


@pytest.mark.parametrize(
    "wrong",
    [
        tensor_digest("F32", (0,), b"\0\0\0\0"),
        tensor_digest("F16", (0,), b""),
        tensor_digest("F32", (1, 0), b""),
        "0" * 64,
    ],
)
def test_empty_tensor_with_a_wrong_digest_is_refused(store: Store, wrong: str) -> None:
    bad = entry("model/empty", RawTensor("F32", (0,), b"")).model_copy(update={"digest": wrong})
    with pytest.raises(InvalidManifestError, match="model/empty"):
        store.commit(RUN, body(bad))
    assert store.runs() == []


def test_entry_disagreeing_with_the_stored_tensor_is_refused(store: Store, ingest: Ingest) -> None:
    stored = raw("F32", (2, 3), 1)
    ingest(stored)
    good = entry("model/w", stored)
    for update in ({"dtype": "I32", "dtype_class": "integer"}, {"shape": [3, 2]}, {"shape": [6]}):
        claimed = good.model_copy(update=update)
        with pytest.raises(InvalidManifestError, match="model/w"):
            store.commit(RUN, body(claimed))
    assert store.runs() == []
    assert store.commit(RUN, body(good)).version == 1


def test_chunked_tensor_commits_when_every_chunk_is_stored(store: Store, ingest: Ingest) -> None:
    top, bottom = raw("F32", (2, 3), 1), raw("F32", (2, 3), 2)
    ingest(top)
    whole = chunked_entry("model/w", "F32", (4, 3), [([0, 0], top), ([2, 0], bottom)])
    with pytest.raises(MissingTensorsError) as caught:
        store.commit(RUN, body(whole))
    assert caught.value.digests == [bottom.digest]
    ingest(bottom)
    info = store.commit(RUN, body(whole))
    assert (info.bytes_total, info.bytes_new, info.tensors_total, info.tensors_new) == (48, 48, 1, 2)
    assert store.manifest(RUN).tensors == [whole]


def test_chunk_disagreeing_with_the_stored_tensor_is_refused(store: Store, ingest: Ingest) -> None:
    piece = raw("F32", (2, 3), 1)
    ingest(piece)
    lying = chunked_entry("model/w", "F32", (3, 2), [([0, 0], RawTensor("F32", (3, 2), piece.data))])
    lying = lying.model_copy(update={"chunks": [lying.chunks[0].model_copy(update={"digest": piece.digest})]})
    with pytest.raises(InvalidManifestError, match="model/w"):
        store.commit(RUN, body(lying))


def test_every_entry_sharing_a_digest_is_checked(store: Store, ingest: Ingest) -> None:
    stored = raw("F32", (2, 3), 1)
    ingest(stored)
    honest = entry("model/embed", stored)
    for update in ({"dtype": "I32", "dtype_class": "integer"}, {"shape": [6]}):
        lying = entry("model/lm_head", stored).model_copy(update=update)
        with pytest.raises(InvalidManifestError, match="model/lm_head"):
            store.commit(RUN, body(honest, lying))
    assert store.runs() == []


def test_shapes_are_checked_per_stored_tensor_when_many_share_them(store: Store, ingest: Ingest) -> None:
    # Stored shapes are parsed once per distinct text: each claim is still held to its own row.
    same = [raw("F32", (2, 3), seed) for seed in (1, 2, 3)]
    other = raw("F32", (3, 2), 4)
    for tensor in (*same, other):
        ingest(tensor)
    honest = [entry(f"model/w{i}", tensor) for i, tensor in enumerate(same)]
    lying = entry("model/other", other).model_copy(update={"shape": [2, 3]})
    with pytest.raises(InvalidManifestError, match=r"model/other: manifest says F32\[2, 3\] .* stored as F32\[3, 2\]"):
        store.commit(RUN, body(*honest, lying))
    assert store.runs() == []
    assert store.commit(RUN, body(*honest, entry("model/other", other))).tensors_new == 4
