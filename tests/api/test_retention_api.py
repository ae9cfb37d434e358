"""The retention routes: the JSON they take and give, and the bodies they refuse."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.format.manifest import validate_body
from ckptstore.service.store import Store
from tests.api.kit import bearer, build_shard, commit_body, entry, is_json_error, tensor

SHARD = build_shard(tensor(1))
ADMIN = bearer("admin")


def seed(store: Store, versions: int) -> None:
    """Run 'run' with ``versions`` versions of one tensor, losses versions, versions-1, …, 1."""
    path = store.staging_path()
    path.write_bytes(SHARD.data)
    store.ingest_file(path)
    for number in range(1, versions + 1):
        manifest = commit_body(entry("model/w", SHARD.tensors[0]))["manifest"]
        manifest["metrics"] = {"loss": float(versions + 1 - number)}
        store.commit("run", validate_body(manifest))


def test_put_get_apply_round_trip(client: TestClient, store: Store) -> None:
    seed(store, 5)
    put = client.put("/v1/runs/run/retention", json={"keep_last": 1, "keep_best": 1, "metric": "loss"}, headers=ADMIN)
    assert put.status_code == 200, put.text
    assert put.json() == {
        "run_id": "run",
        "keep_last": 1,
        "keep_best": 1,
        "metric": "loss",
        "mode": "min",
        "would_remove": [1, 2, 3, 4],  # version 5 is both the last and the lowest loss
    }
    assert client.get("/v1/runs/run/retention", headers=bearer("read")).json() == put.json()
    applied = client.post("/v1/runs/run/retention/apply", headers=ADMIN)
    assert applied.json() == {"run_id": "run", "removed": [1, 2, 3, 4]}
    cleared = client.put("/v1/runs/run/retention", json={}, headers=ADMIN).json()
    assert (cleared["keep_last"], cleared["keep_best"], cleared["would_remove"]) == (None, None, [])


@pytest.mark.parametrize(
    "body",
    [
        {"keep_last": 0},
        {"keep_last": "3"},
        {"keep_last": True},
        {"keep_last": 3.0},
        {"keep_last": 10**7},
        {"keep_best": 2},
        {"keep_best": 2, "metric": "loss", "mode": "lowest"},
        {"keep_best": 2, "metric": "<script>"},
        {"metric": "loss"},
        {"keep_last": 2, "extra": 1},
        [],
    ],
)
def test_bad_policies_are_refused_and_change_nothing(client: TestClient, store: Store, body: Any) -> None:
    seed(store, 2)
    client.put("/v1/runs/run/retention", json={"keep_last": 5}, headers=ADMIN)
    response = client.put("/v1/runs/run/retention", json=body, headers=ADMIN)
    assert response.status_code in (400, 422) and is_json_error(response), response.text
    assert response.headers["x-error-code"] == "invalid_input"
    assert client.get("/v1/runs/run/retention", headers=ADMIN).json()["keep_last"] == 5


def test_unknown_runs_and_bad_names(client: TestClient) -> None:
    missing = client.get("/v1/runs/nope/retention", headers=ADMIN)
    assert missing.status_code == 404 and missing.headers["x-error-code"] == "not_found"
    assert client.post("/v1/runs/nope/retention/apply", headers=ADMIN).status_code == 404
    bad = client.put("/v1/runs/..bad/retention", json={"keep_last": 1}, headers=ADMIN)
    assert bad.status_code == 400 and bad.headers["x-error-code"] == "invalid_name"
    unknown = client.put("/v1/runs/new-run/retention", json={"keep_last": 1}, headers=ADMIN)
    assert unknown.status_code == 404 and "'new-run'" in unknown.json()["message"]
    assert client.get("/v1/runs", headers=ADMIN).json() == []
    created = client.put("/v1/runs/new-run/retention?create=true", json={"keep_last": 1}, headers=ADMIN)
    assert created.status_code == 200 and created.json()["would_remove"] == []
    assert [r["run_id"] for r in client.get("/v1/runs", headers=ADMIN).json()] == ["new-run"]
