"""``POST /v1/gc``: admin scope, a strict body, the report as JSON."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.format.records import GcReport
from ckptstore.service.store import Store
from tests.api.kit import bearer, build_shard, commit_body, entry, is_json_error, tensor


def test_gc_sweeps_a_deleted_versions_shard_and_reports_it(client: TestClient, store: Store) -> None:
    kept, dropped = build_shard(tensor(1)), build_shard(tensor(2))
    for shard in (kept, dropped):
        assert (
            client.put(f"/v1/shards/{shard.shard_id}", content=shard.data, headers=bearer("write")).status_code == 201
        )
    for shard in (kept, dropped):
        body = commit_body(entry("model/w", shard.tensors[0]))
        assert client.post("/v1/runs/run/versions", json=body, headers=bearer("write")).status_code == 201
    assert client.delete("/v1/runs/run/versions/2", headers=bearer("admin")).status_code == 200

    dry = client.post("/v1/gc", json={"dry_run": True, "grace_seconds": 0}, headers=bearer("admin"))
    assert dry.status_code == 200
    assert GcReport.model_validate(dry.json()).shards_swept == 1 and store.blobs.size(dropped.shard_id)
    default = client.post("/v1/gc", json={}, headers=bearer("admin")).json()
    assert (default["grace_seconds"], default["shards_swept"], default["shards_in_grace"]) == (3600, 0, 1)

    done = GcReport.model_validate(client.post("/v1/gc", json={"grace_seconds": 0}, headers=bearer("admin")).json())

    assert (done.dry_run, done.shards_swept, done.bytes_swept) == (False, 1, len(dropped.data))
    assert store.blobs.size(dropped.shard_id) is None and store.blobs.size(kept.shard_id) == len(kept.data)


@pytest.mark.parametrize(
    "body",
    [
        {"grace_seconds": -1},
        {"grace_seconds": 10**12},
        {"grace_seconds": 1.5},
        {"grace_seconds": "3600"},
        {"dry_run": "yes"},
        {"orphans": 1},
        {"sweep": True},
    ],
)
def test_a_malformed_gc_request_is_refused(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/v1/gc", json=body, headers=bearer("admin"))
    assert response.status_code == 422 and is_json_error(response)


def test_gc_needs_an_admin_token(client: TestClient) -> None:
    response = client.post("/v1/gc", json={"dry_run": True}, headers=bearer("write"))
    assert response.status_code == 403 and response.headers["x-error-code"] == "forbidden"
