"""``ckptstore gc`` and ``Client.gc`` end to end: embedded, HTTP on SQLite, HTTP on PostgreSQL + S3."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ckptstore import client
from ckptstore.service.db.holds import SAVE_LEASE_SECONDS
from ckptstore.service.db.models import utcnow
from ckptstore.service.store import Store
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, tensors_equal


def blob_sizes(cli: Cli) -> dict[str, int]:
    assert cli.backend is not None
    blobs = cli.backend.blobs
    return {blob_id: blobs.size(blob_id) or 0 for blob_id in blobs.list_ids()}


def test_gc_after_deleting_a_version_reclaims_its_shards_and_the_rest_loads_bit_exact(any_cli: Cli) -> None:
    ckpt = any_cli.client
    ckpt.shard_bytes = 1  # every tensor in a shard of its own, so sharing is per tensor
    first, second = TinyNet(seed=1), TinyNet(seed=2)
    with torch.no_grad():
        second.embed.weight.copy_(first.embed.weight)  # shared by both versions (and tied to head)
    ckpt.save("run", first, step=1)
    ckpt.save("run", second, step=2, tags=["best"])
    digests = [{e.digest for e in ckpt.transport.manifest("run", v).tensors if e.digest and e.nbytes} for v in (1, 2)]
    only_first = digests[0] - digests[1]
    assert len(only_first) == 4 and digests[0] & digests[1]  # the two Linear layers differ
    assert "deleted run@1" in any_cli.ok("rm", "run@1", "-y")
    before = blob_sizes(any_cli)

    in_grace = json.loads(any_cli.ok("gc", "--dry-run", "--json"))  # the default grace: one hour
    assert (in_grace["shards_swept"], in_grace["shards_in_grace"]) == (0, len(only_first))
    dry = json.loads(any_cli.ok("gc", "--dry-run", "--grace", "0", "--json"))
    assert dry["dry_run"] is True and dry["grace_seconds"] == 0
    assert (dry["shards_swept"], dry["tensors_swept"]) == (len(only_first), len(only_first))
    assert blob_sizes(any_cli) == before

    text = any_cli.ok("gc", "--grace", "0")

    assert text.startswith(f"swept {len(only_first)} shards ({len(only_first)} tensors, ")
    after = blob_sizes(any_cli)
    gone = set(before) - set(after)
    assert len(gone) == len(only_first) and set(after) <= set(before)
    assert sum(before[b] for b in gone) == dry["bytes_swept"]
    loaded = TinyNet(seed=3)
    ckpt.load("run", "best", model=loaded)
    expected = second.state_dict()
    assert all(tensors_equal(value, expected[key]) for key, value in loaded.state_dict().items())
    assert any_cli.ok("verify").startswith("verified 1 version: ")
    again = json.loads(any_cli.ok("gc", "--grace", "0", "--json"))
    assert (again["shards_swept"], again["orphan_blobs"]) == (0, 0)


def test_a_collection_before_a_saves_commit_keeps_what_the_save_was_told_is_stored(
    ckpt: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = TinyNet(seed=4)
    ckpt.save("run", model)
    ckpt.delete("run", 1)
    commit = ckpt.transport.commit
    swept = []

    def collect_then_commit(*args: object, **kwargs: object) -> object:
        # Told everything is stored (no version references it now), the save is overtaken by a
        # collection with no grace: the save holds it all, so nothing goes.
        swept.append(ckpt.gc(grace_seconds=0).shards_swept)
        return commit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt.transport, "commit", collect_then_commit)
    result = ckpt.save("run", model)

    assert swept == [0] and result.version == 2  # one commit, nothing taken
    assert (result.bytes_sent, result.bytes_stored) == (0, 0)  # nothing sent again
    # What it added is what its record says: the deleted version referenced its tensors no more.
    assert result.tensors_new == ckpt.versions("run")[-1].tensors_new
    loaded = TinyNet(seed=5)
    ckpt.load("run", model=loaded)
    assert all(tensors_equal(value, model.state_dict()[key]) for key, value in loaded.state_dict().items())


def test_a_save_silent_past_its_lease_sends_what_was_swept_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with client.Client(home=tmp_path / "home") as ckpt:
        model = TinyNet(seed=4)
        first = ckpt.save("run", model)
        ckpt.delete("run", 1)
        store = ckpt.transport
        assert isinstance(store, Store)
        commit = store.commit
        calls = []

        def lapse_then_commit(*args: object, **kwargs: object) -> object:
            calls.append(1)
            if len(calls) == 1:  # a collection once the save's lease has lapsed: its holds keep nothing
                later = utcnow() + timedelta(seconds=SAVE_LEASE_SECONDS + 1)
                assert store.gc(grace_seconds=0, now=later).shards_swept == first.shards
            return commit(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "commit", lapse_then_commit)
        result = ckpt.save("run", model)

        assert len(calls) == 2 and result.version == 2
        assert (result.tensors_new, result.bytes_stored) == (first.tensors_new, first.bytes_stored)  # all sent again
        loaded = TinyNet(seed=5)
        ckpt.load("run", model=loaded)
        assert all(tensors_equal(value, model.state_dict()[key]) for key, value in loaded.state_dict().items())


@pytest.mark.parametrize("grace", ["soon", "-5", "1w", "", "99999d"])
def test_a_bad_grace_is_a_usage_error(cli: Cli, grace: str) -> None:
    result = cli("gc", "--grace", grace)
    assert result.exit_code == 2 and result.stdout == "" and result.stderr.startswith("error: duration")


def test_grace_units(cli: Cli) -> None:
    cli.client.save("run", TinyNet())
    cli.ok("rm", "run", "-y")
    for grace, seconds in (("0", 0), ("90", 90), ("90s", 90), ("30m", 1800), ("1.5h", 5400), ("2d", 172800)):
        report = json.loads(cli.ok("gc", "--dry-run", "--grace", grace, "--json"))
        assert report["grace_seconds"] == seconds
        assert report["shards_swept"] == (2 if seconds == 0 else 0)  # TinyNet's trainable tensors and buffers


def test_gc_reports_orphan_blobs_and_deletes_them_when_asked(cli: Cli) -> None:
    cli.client.save("run", TinyNet())
    store = cli.client.transport
    orphan = store.staging_dir / "orphan"  # type: ignore[attr-defined]
    orphan.write_bytes(b"x" * 100)
    store.blobs.put_file("ab" * 32, orphan)  # type: ignore[attr-defined]

    text = cli.ok("gc")
    assert "swept 0 shards" in text and "1 blob (100 B) has no shard record" in text and "--orphans" in text
    assert "deleted 1" in cli.ok("gc", "--orphans")
    assert "no shard record" not in cli.ok("gc")
    assert cli.ok("verify").startswith("verified 1 version: ")


def test_gc_compacts_a_shard_whose_live_bytes_fell_below_the_threshold(any_cli: Cli) -> None:
    ckpt = any_cli.client
    first, second = TinyNet(seed=1, width=256), TinyNet(seed=2, width=256)
    with torch.no_grad():
        second.body[3].weight.copy_(first.body[3].weight)  # the one tensor both versions share: half a shard
    ckpt.save("run", first, step=1)
    ckpt.save("run", second, step=2, tags=["best"])
    any_cli.ok("rm", "run@1", "-y")
    swept = json.loads(any_cli.ok("gc", "--grace", "0", "--json"))  # version 1's dead shards, not the shared one
    before = sum(blob_sizes(any_cli).values())

    above = json.loads(any_cli.ok("gc", "--grace", "0", "--compact-below", "0.01", "--json"))
    assert above["shards_compacted"] == 0
    dry = json.loads(any_cli.ok("gc", "--grace", "0", "--compact-below", "0.6", "--dry-run", "--json"))
    # The shared weight's shard, and (on an embedded store, which packs a first save's large new
    # tensors apart from the small ones) the small tensors' shard kept by equal batch-norm buffers.
    assert dry["shards_compacted"] >= 1 and sum(blob_sizes(any_cli).values()) == before
    done = json.loads(any_cli.ok("gc", "--grace", "0", "--compact-below", "0.6", "--json"))

    assert done["shards_compacted"] == dry["shards_compacted"] and done["bytes_compacted"] > 0
    after = sum(blob_sizes(any_cli).values())
    assert after == before - done["bytes_compacted"], (before, after, done, swept)
    loaded = TinyNet(seed=3, width=256)
    ckpt.load("run", "best", model=loaded)
    expected = second.state_dict()
    assert all(tensors_equal(value, expected[key]) for key, value in loaded.state_dict().items())
    assert any_cli.ok("verify").startswith("verified 1 version: ")
