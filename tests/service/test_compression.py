"""Compression at rest (``gc(compress=True)``) on SQLite and PostgreSQL, with a real client, real
models and AdamW: every version loads bit for bit afterwards, in less room; delta chains stay
within their bound; collections keep what deltas decode from and reclaim it once nothing does;
saves dedup against encoded tensors; a load that located tensors before compression still reads
them; a corrupt payload fails a load by name, never with wrong data.

Time is injected (versions aged by moving ``created_at`` back), never waited for.
"""

from __future__ import annotations

import json
import random
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from compression_kit import (
    LARGE_KEYS,
    WEIGHT_KEYS,
    FineTune,
    blob_bytes,
    dangling_needs,
    deltas,
    keyed_digests,
    large_digests,
    make_model,
    need_rows,
    open_client,
    shard_ids,
    uncompressed_versions,
)
from shardkit import Ingest, RawTensor, body, chunked_entry, entry, raw
from sqlalchemy import select
from typer.testing import CliRunner

import ckptstore.client.progress  # noqa: F401  (binds client.progress for the name below)
from ckptstore import client
from ckptstore.client.cli import app
from ckptstore.service.db.models import Shard, Version
from ckptstore.service.errors import IntegrityError, NotFoundError
from ckptstore.service.format.encoded_reads import chain_of, read_tensor
from ckptstore.service.format.encoding import head_bytes
from ckptstore.service.reclaim import compression
from ckptstore.service.reclaim import compression_buffers as compression_memory
from ckptstore.service.store import Store
from tests.client.models import tensors_equal


def encodings(store: Store, run: str, version: int) -> dict[str, tuple[str, int]]:
    """Key -> (encoding, deltas in its chain) of the large tensors of ``run@version``."""
    digests = large_digests(store, run, version)
    locations = store.locate(digests.values())
    return {key: (locations[d].encoding, deltas(locations, d)) for key, d in digests.items()}


# -- a fine-tune, compressed ------------------------------------------------------------------


def test_a_fine_tune_loads_bit_for_bit_after_compression_in_far_less_room(store: Store, ckpt: client.Client) -> None:
    tunes = {"bf16": FineTune(torch.bfloat16), "fp32": FineTune(torch.float32)}
    for _ in range(4):
        for run, tune in tunes.items():
            tune.save(ckpt, run)
    large = {d for run in tunes for v in range(1, 5) for d in large_digests(store, run, v).values()}
    assert len(large) == 2 * 4 * len(LARGE_KEYS)  # every weight and moment moved at every save
    before = blob_bytes(store.blobs)

    report = ckpt.gc(compress=True, grace_seconds=0)

    assert report.versions_compressed == 8 and uncompressed_versions(store) == []
    assert report.tensors_compressed == len(large)
    assert 0 < report.tensors_as_deltas < report.tensors_compressed
    # The report's figures are those of what is now stored.
    where = store.locate(large)
    assert all(location.encoded for location in where.values())
    assert report.tensors_as_deltas == sum(1 for loc in where.values() if loc.base is not None)
    assert report.bytes_before_compression == sum(loc.nbytes for loc in where.values())
    assert report.bytes_after_compression == sum(loc.length for loc in where.values())
    assert report.bytes_after_compression < report.bytes_before_compression / 2
    # With no grace the raw copies went at once: the store shrank by what compression saved.
    after = blob_bytes(store.blobs)
    saved = report.bytes_before_compression - report.bytes_after_compression
    assert report.shards_swept > 0 and after < before - 0.9 * saved
    assert set(store.blobs.list_ids()) == shard_ids(store)
    for run, tune in tunes.items():
        assert tune.wrong_loads(ckpt, run) == {}, run
        for version in range(2, 5):
            # Every weight moved a few units in its last place: a difference from its keyframe. The
            # fp32 linear layers' differences (lr 1e-3) may take more than DELTA_AT_MOST of their
            # whole size: those are stored whole, and the embedding's sparse updates never are.
            found = {key: encodings(store, run, version)[key] for key in WEIGHT_KEYS}
            deltas = {key for key in WEIGHT_KEYS if found[key] == ("diff-grouped-zstd", 1)}
            whole = {key for key in WEIGHT_KEYS if found[key] == ("grouped-zstd", 0)}
            assert deltas | whole == set(WEIGHT_KEYS) and "model/0.weight" in deltas, (run, version, found)
            assert deltas == set(WEIGHT_KEYS) or run == "fp32", (run, version, found)

    # A load without a model returns the decoded state; one of some keys reads only those.
    state = ckpt.load("bf16", 4).state_dict
    expected = tunes["bf16"].saved[("bf16", 4)].model
    assert state is not None and all(tensors_equal(state[key], value) for key, value in expected.items())
    part, untouched = make_model(torch.float32, seed=7), make_model(torch.float32, seed=7).state_dict()
    ckpt.load("fp32", 4, model=part, keys=["1.*"])
    expected = tunes["fp32"].saved[("fp32", 4)].model
    for key, value in part.state_dict().items():
        assert tensors_equal(value, expected[key] if key.startswith("1.") else untouched[key]), key

    again = ckpt.gc(compress=True, grace_seconds=0)

    assert (again.versions_compressed, again.tensors_compressed, again.shards_swept) == (0, 0, 0)
    assert (again.shards_compacted, again.orphan_blobs) == (0, 0)
    assert blob_bytes(store.blobs) == after

    # Only the versions saved since are visited, however long the history.
    for run, tune in tunes.items():
        tune.save(ckpt, run)
    later = ckpt.gc(compress=True, grace_seconds=0)
    assert later.versions_compressed == 2 and later.tensors_compressed == 2 * len(LARGE_KEYS)
    assert later.tensors_as_deltas >= len(WEIGHT_KEYS) + 1
    assert not any(tune.wrong_loads(ckpt, run) for run, tune in tunes.items())
    assert dangling_needs(store) == []


def test_a_compressing_collection_tells_the_bytes_it_visits_and_the_client_shows_them_on_a_bar(
    store: Store, ckpt: client.Client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 2)
    large = {d for version in (1, 2) for d in large_digests(store, "run", version).values()}
    told: list[int] = []

    report = store.gc(compress=True, grace_seconds=0, on_bytes=told.append)

    assert report.tensors_compressed == len(large) == len(told)
    assert sum(told) == report.bytes_before_compression == sum(store.locate(large)[d].nbytes for d in large)
    tune.save(ckpt, "run")
    monkeypatch.setattr(client.progress, "bars_enabled", lambda: True)  # as on a terminal
    capsys.readouterr()
    assert ckpt.gc(compress=True, grace_seconds=0).versions_compressed == 1
    assert "compress: " in capsys.readouterr().err
    assert ckpt.gc(grace_seconds=0).versions_compressed == 0
    assert "compress" not in capsys.readouterr().err  # a collection that compresses nothing shows no bar


def test_a_collection_reads_later_versions_into_the_buffers_earlier_ones_handed_back(
    store: Store, ckpt: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the first two versions (one being encoded, one kept as its delta bases), a collection
    reads each tensor into a buffer a version before it handed back, not into fresh memory."""
    handed_out: dict[int, bytearray] = {}  # every buffer the pass was given, by identity

    class CountingPool(compression_memory.BufferPool):
        def take(self, nbytes: int) -> bytearray:
            buffer = super().take(nbytes)
            handed_out.setdefault(id(buffer), buffer)
            return buffer

    monkeypatch.setattr(compression, "BufferPool", CountingPool)
    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 6)
    first = large_digests(store, "run", 1).values()
    version_bytes = sum(location.nbytes for location in store.locate(first).values())

    report = store.gc(compress=True, grace_seconds=0)

    assert report.versions_compressed == 6 and report.bytes_before_compression == 6 * version_bytes
    fresh = sum(map(len, handed_out.values()))
    # Without reuse: six versions' worth, and the keyframes read again besides.
    assert 2 * version_bytes <= fresh <= 3 * version_bytes, (fresh, version_bytes)
    assert tune.wrong_loads(ckpt) == {}


@pytest.mark.parametrize("per_keyframe", [0, 1, 2])
def test_each_keyframe_serves_at_most_the_set_number_of_deltas_each_one_link_deep(
    store: Store, home: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, per_keyframe: int
) -> None:
    monkeypatch.setenv("CKPTSTORE_DELTAS_PER_KEYFRAME", str(per_keyframe))
    tune = FineTune(torch.bfloat16)
    versions = range(1, 2 * (per_keyframe + 1) + 2)
    with open_client(store, home, request, monkeypatch) as ckpt:
        assert isinstance(ckpt.transport, Store) and ckpt.transport.deltas_per_keyframe == per_keyframe
        for version in versions:
            tune.save(ckpt, "run")
            if version == 3:  # one collection part-way, one at the end: keyframes serve across them
                ckpt.gc(compress=True, grace_seconds=0)
        report = ckpt.gc(compress=True, grace_seconds=0)
        assert report.versions_compressed == len(versions) - 3
        chains = {v: encodings(store, "run", v) for v in versions}
        assert max(d for found in chains.values() for _, d in found.values()) <= min(per_keyframe, 1)
        keyed = {v: keyed_digests(store, "run", v) for v in versions}
        for version, found in chains.items():
            keyframe = version - (version - 1) % (per_keyframe + 1)  # a keyframe, then its deltas, then a keyframe
            for key in WEIGHT_KEYS:
                encoding, chained = found[key]
                assert chained == (0 if version == keyframe else 1), (version, key, found[key])
                assert encoding == ("grouped-zstd" if version == keyframe else "diff-grouped-zstd"), (version, key)
                if version != keyframe:  # every delta decodes from its keyframe, not from its parent
                    digest = keyed[version][key]
                    assert store.locate([digest])[digest].base == keyed[keyframe][key], (version, key)
        if per_keyframe == 0:
            assert report.tensors_as_deltas == 0 and need_rows(store) == 0
        assert tune.wrong_loads(ckpt) == {}


def test_each_version_is_stored_in_its_manifests_order_so_a_load_reads_every_shard_front_to_back(
    store: Store, ckpt: client.Client
) -> None:
    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 3)
    ckpt.gc(compress=True, grace_seconds=0)
    for version in (1, 3):
        large = large_digests(store, "run", version)
        assert list(large) == [key for key in keyed_digests(store, "run", version) if key in large]
        where = store.locate(large.values())
        assert all(location.encoded for location in where.values())
        # The tensors' payloads, and the keyframes their deltas decode from, in the manifest's
        # order: each shard's offsets only ever grow (a version's digests sort in no such order).
        for links in ([where[d] for d in large.values()], [chain_of(where, d)[-1] for d in large.values()]):
            for shard in {link.shard_id for link in links}:
                offsets = [link.offset for link in links if link.shard_id == shard]
                assert offsets == sorted(offsets), version
        if version == 3:
            assert {key for key, d in large.items() if where[d].base is not None} >= set(WEIGHT_KEYS)
    assert tune.wrong_loads(ckpt) == {}


def test_deltas_whose_bases_are_stored_raw_and_chunked_tensors_decode_and_keep_their_bases(
    store: Store, ingest: Ingest
) -> None:
    """Random bytes do not compress, so the first version stays raw and the next are deltas on it;
    chunks are matched with the parent's chunk at the same offsets. Compaction carries the raw
    bases along once their version is gone."""
    rng = random.Random(7)

    def nudged(tensor: RawTensor, seed: int) -> RawTensor:
        data = bytearray(tensor.data)
        for index in random.Random(seed).sample(range(len(data)), len(data) // 500):
            data[index] ^= 1 << rng.randrange(8)
        return RawTensor(tensor.dtype, tensor.shape, bytes(data))

    whole = [raw("F32", (1281, 1023), 1)]  # 5 MiB and a bit: chosen from samples, decoded in 6 blocks
    halves = [[raw("BF16", (128, 256), 2), raw("BF16", (128, 256), 3)]]
    for version in range(2, 5):
        whole.append(nudged(whole[-1], version))
        halves.append([nudged(half, 10 * version + i) for i, half in enumerate(halves[-1])])
    dead = raw("F32", (1024, 256), 9)  # only version 1 lists it: its shard is mostly dead once that goes
    for version in range(4):
        ingest(whole[version])
        ingest(*halves[version], *([dead] if version == 0 else []))
        pieces = [([0, 0], halves[version][0]), ([128, 0], halves[version][1])]
        entries = [entry("model/w", whole[version]), chunked_entry("model/e", "BF16", [256, 256], pieces)]
        store.commit("run", body(*entries, *([entry("model/dead", dead)] if version == 0 else [])))

    report = store.gc(compress=True, grace_seconds=0)

    tensors = [whole, [h[0] for h in halves], [h[1] for h in halves]]
    where = store.locate(t.digest for series in tensors for t in series)
    for series in tensors:
        assert not where[series[0].digest].encoded  # no gain: kept raw, where it was
        assert [deltas(where, t.digest) for t in series] == [0, 1, 1, 1]
        assert [where[t.digest].base for t in series[1:]] == [series[0].digest] * 3  # all on the keyframe
    assert report.tensors_compressed == report.tensors_as_deltas == 9
    assert report.bytes_after_compression < report.bytes_before_compression / 10
    assert all(store.read_tensor(t.digest) == t.data for series in tensors for t in series)

    first = where[halves[0][0].digest].shard_id
    store.delete_version("run", 1)
    store.delete_version("run", 2)
    compacted = [store.gc(grace_seconds=0, compact_below=0.5).shards_compacted for _ in range(3)]

    assert compacted[0] == 1 and first not in shard_ids(store)  # the bases moved, the dead tensor went
    assert all(store.locate([series[0].digest]) for series in tensors)  # still needed by the deltas left
    assert all(store.read_tensor(t.digest) == t.data for series in tensors for t in series[2:])


def test_a_tensor_a_delta_already_decodes_from_is_only_ever_stored_whole(store: Store, ingest: Ingest) -> None:
    """Run "a" stores ``t`` then a delta on it; run "b" (visited after) adds ``t`` after a
    near copy of it, which would make ``t`` a delta too, deepening the chain of "a"'s delta."""
    t = raw("F32", (128, 256), 1)

    def near_copy(every: int) -> RawTensor:
        data = bytearray(t.data)
        data[::every] = bytes(len(data[::every]))
        return RawTensor(t.dtype, t.shape, bytes(data))

    later, nudged = near_copy(1000), near_copy(997)
    for tensor in (t, later, nudged):
        ingest(tensor)
    store.commit("a", body(entry("model/w", t)))
    store.commit("a", body(entry("model/w", later)))
    store.commit("b", body(entry("model/w", nudged)))
    store.commit("b", body(entry("model/w", t)))

    store.gc(compress=True, grace_seconds=0)

    where = store.locate([t.digest, later.digest, nudged.digest])
    assert where[later.digest].base == t.digest and deltas(where, later.digest) == 1
    assert not where[t.digest].encoded and where[t.digest].base is None  # random bytes: whole is raw here
    assert not where[nudged.digest].encoded
    assert all(store.read_tensor(x.digest) == x.data for x in (t, later, nudged))


# -- collections with deltas ------------------------------------------------------------------


def test_collections_keep_what_deltas_decode_from_and_reclaim_it_once_no_delta_does(
    store: Store, ckpt: client.Client
) -> None:
    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 5)
    ckpt.gc(compress=True, grace_seconds=0)  # version 1 whole; the weights of 2 to 5 deltas on it
    holding = {v: {store.locate([d])[d].shard_id for d in large_digests(store, "run", v).values()} for v in range(1, 6)}
    assert all(len(shards) == 1 for shards in holding.values())  # one encoded shard per version

    def needed() -> set[str]:
        """The shards the versions still kept decode from: their own, and their deltas' keyframes'."""
        found: set[str] = set()
        for run, version in tune.saved:
            digests = list(large_digests(store, run, version).values())
            where = store.locate(digests)  # a delta's base is located with it
            found |= {link.shard_id for digest in digests for link in chain_of(where, digest)}
        return found

    # Deleting the versions the later deltas decode from: their bytes stay, the rest goes, all loads.
    for version in (1, 2):
        ckpt.delete("run", version)
    tune.forget("run", [1, 2])
    for _ in range(3):
        ckpt.gc(grace_seconds=0)
    left = shard_ids(store)
    assert holding[1] <= needed() <= left  # version 1's keyframes outlive it
    assert all(holding[v].isdisjoint(left) for v in (1, 2) if holding[v].isdisjoint(needed()))
    assert tune.wrong_loads(ckpt) == {}

    # Retention removes version 3 (keep the last two); deleting the newest keeps the older ones.
    ckpt.set_retention("run", keep_last=2)
    assert ckpt.apply_retention("run") == [3]
    ckpt.delete("run", 5)
    tune.forget("run", [3, 5])
    swept = [ckpt.gc(grace_seconds=0).shards_swept for _ in range(3)]
    left = shard_ids(store)
    assert swept[0] > 0 and holding[5].isdisjoint(left)  # no delta decodes from version 5
    assert holding[1] | holding[4] <= needed() <= left  # version 4 still does from version 1
    assert tune.wrong_loads(ckpt) == {} and list(tune.saved) == [("run", 4)]

    # Once the last delta needing them goes, one collection reclaims the whole chain.
    ckpt.set_retention("run")  # no policy
    tune.save(ckpt, "run")  # version 6, raw
    ckpt.delete("run", 4)
    tune.forget("run", [4])
    assert ckpt.gc(grace_seconds=0).shards_swept > 0
    assert ckpt.gc(grace_seconds=0).shards_swept == 0
    left = shard_ids(store)
    assert all(shards.isdisjoint(left) for shards in holding.values())
    assert need_rows(store) == 0 and dangling_needs(store) == []
    latest = keyed_digests(store, "run", 6)
    assert left == {location.shard_id for location in store.locate(latest.values()).values()}
    assert set(store.blobs.list_ids()) == left
    assert tune.wrong_loads(ckpt) == {}


# -- saves and loads around a compression -----------------------------------------------------


def test_a_save_after_compression_dedups_against_the_encoded_tensors(
    store: Store, home: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, ckpt: client.Client
) -> None:
    tune = FineTune(torch.float32)
    tune.save_versions(ckpt, "run", 2)
    ckpt.gc(compress=True, grace_seconds=0)
    digests = set(keyed_digests(store, "run", 2).values())
    assert any(location.encoded for location in store.locate(digests).values())
    blobs = set(store.blobs.list_ids())

    assert store.missing(digests) == []
    with open_client(store, home, request, monkeypatch) as fresh:  # knows nothing of what it saved before
        version = fresh.save("run", tune.model, tune.optim)

    assert (version.version, version.bytes_new, version.bytes_stored, version.shards) == (3, 0, 0, 0)
    assert set(store.blobs.list_ids()) == blobs
    assert set(keyed_digests(store, "run", 3).values()) == digests
    tune.saved[("run", 3)] = tune.saved[("run", 2)]
    report = ckpt.gc(compress=True, grace_seconds=0)
    assert (report.versions_compressed, report.tensors_compressed) == (1, 0)
    assert tune.wrong_loads(ckpt) == {}


def age(store: Store, seconds: float) -> None:
    """Pretend every version and shard was committed ``seconds`` earlier than it was."""
    with store.db.transaction() as session:
        for row in [*session.scalars(select(Version)), *session.scalars(select(Shard))]:
            row.created_at = row.created_at - timedelta(seconds=seconds)


def test_a_load_that_located_tensors_before_compression_still_reads_them(store: Store, ckpt: client.Client) -> None:
    ckpt.shard_bytes = 1  # a shard per tensor: compression leaves the large tensors' shards unreferenced
    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 3)
    digests = {d for v in (1, 2, 3) for d in keyed_digests(store, "run", v).values()}
    located = store.locate(digests)  # a load has located its tensors, and not read them yet
    assert not any(location.encoded for location in located.values())
    age(store, 2 * 3600)

    report = store.gc(compress=True)  # the default grace of an hour: the versions are older

    assert report.versions_compressed == 3 and report.tensors_compressed == 3 * len(LARGE_KEYS)
    now = store.locate(digests)
    moved = {d for d in digests if now[d].encoded}
    assert len(moved) == report.tensors_compressed
    # The shards they left are unreferenced now, yet wait out the grace period from the move.
    assert report.shards_swept == 0 and report.shards_in_grace == len(moved)
    assert all(read_tensor(store.read_into, located, d) for d in digests)  # the old raw copies, checked
    assert tune.wrong_loads(ckpt) == {}

    store.gc(grace_seconds=0)  # once the grace period is over, they go

    gone = next(iter(moved))
    with pytest.raises(NotFoundError):
        read_tensor(store.read_into, located, gone)
    assert tune.wrong_loads(ckpt) == {}


# -- hostile bytes ----------------------------------------------------------------------------


def _flip(path: Path, position: int) -> bytes:
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[position] ^= 0x5A
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return original


def _verify(store: Store, home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """``ckptstore verify --json`` on the store, as its JSON answer."""
    env = {"CKPTSTORE_URL": None, "CKPTSTORE_HOME": str(home), "CKPTSTORE_TOKEN": None}
    result = CliRunner().invoke(app, ["verify", "--json"], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    answer: dict[str, object] = json.loads(result.stdout)
    assert (result.exit_code == 0) == answer["ok"]
    return answer


@pytest.mark.parametrize("where", ["payload-header", "frame-table", "frame", "base-frame"])
def test_a_corrupt_payload_fails_the_load_and_verify_by_name_never_with_wrong_data(
    store: Store, ckpt: client.Client, home: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 2)
    ckpt.gc(compress=True, grace_seconds=0)
    key = "model/1.weight"
    digest, base = (large_digests(store, "run", v)[key] for v in (2, 1))
    locations = store.locate([digest])
    assert locations[digest].base == base and locations[base].encoded  # a delta on a compressed base
    assert _verify(store, home, monkeypatch)["ok"] is True
    target = locations[base if where == "base-frame" else digest]
    frames = head_bytes(1)
    offset = {"payload-header": 0, "frame-table": frames - 2, "frame": frames + 40, "base-frame": frames + 40}[where]
    path = store.blobs._path(target.shard_id)  # type: ignore[attr-defined]
    original = _flip(path, target.offset + offset)

    with pytest.raises(IntegrityError, match="1.weight"):
        ckpt.load("run", 2, model=FineTune(torch.bfloat16, seed=5).model)
    answer = _verify(store, home, monkeypatch)
    problems = answer["problems"]
    assert isinstance(problems, list) and problems, answer
    assert {(p["version"], p["key"]) for p in problems} >= {(2, key)}
    if where == "base-frame":
        assert {(p["version"], p["key"]) for p in problems} >= {(1, key)}

    path.write_bytes(original)
    assert tune.wrong_loads(ckpt) == {}


def test_a_version_deleted_and_collected_while_the_pass_visits_it_is_skipped(
    store: Store, ckpt: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another collection removes version 2 (its parts and tensors) after this pass listed it: the
    pass goes on with version 3 rather than failing."""
    from ckptstore.service.reclaim import compression

    tune = FineTune(torch.bfloat16)
    tune.save_versions(ckpt, "run", 3)
    real = compression._encode_version
    visited: list[list[int]] = []

    def meanwhile(db, blobs, parts, parent_parts, *rest):  # type: ignore[no-untyped-def]
        visited.append(parts)
        if len(visited) == 2:  # version 2, listed before it went
            store.delete_version("run", 2)
            store.gc(grace_seconds=0)
        return real(db, blobs, parts, parent_parts, *rest)

    monkeypatch.setattr(compression, "_encode_version", meanwhile)
    report = store.gc(compress=True, grace_seconds=0)
    assert len(visited) == 3 and report.versions_compressed == 3
    tune.forget("run", [2])
    assert [v.version for v in store.versions("run")] == [1, 3]
    assert uncompressed_versions(store) == []
    assert all(location.encoded for location in store.locate(large_digests(store, "run", 3).values()).values())
    assert tune.wrong_loads(ckpt) == {}
