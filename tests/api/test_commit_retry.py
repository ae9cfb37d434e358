"""A save's commit whose answer is lost is sent again and commits once.

A client names each commit by a random ``Idempotency-Key``, so a commit that failed after the
server may have seen it (its connection cut, a gateway's 502, a server restarting) is retried
like any other request: the server answers the repeat with the version the key made. Here a
real uvicorn server commits the first try but its answer never reaches the client (the
connection is cut, or a 503 stands in for it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptstore.client import Client
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.servers import running_server


class LosesFirstCommitAnswer:
    """An ASGI app in front of ``app`` that lets the first commit through and then, instead of
    its answer, cuts the connection (``how="cut"``) or answers 503 (``how="503"``)."""

    def __init__(self, app: Any, how: str) -> None:
        self.app, self.how = app, how
        self.commits: list[str | None] = []  # each commit's Idempotency-Key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        commit = scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/versions")
        if not commit:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.commits.append(headers.get(b"idempotency-key", b"").decode() or None)
        if len(self.commits) > 1:
            await self.app(scope, receive, send)
            return

        async def swallow(message: dict[str, Any]) -> None:
            pass  # the committed version's answer goes nowhere

        await self.app(scope, receive, swallow)
        if self.how == "cut":
            raise ConnectionResetError("the answer was lost")  # uvicorn drops the connection unanswered
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("how", ["cut", "503"])
def test_a_commit_whose_answer_was_lost_is_retried_and_commits_once(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    settings = Settings(home=home)
    front = LosesFirstCommitAnswer(create_app(store, settings), how)
    model = torch.nn.Linear(16, 8)
    loaded = torch.nn.Linear(16, 8)
    try:
        with running_server(front, settings) as url, Client(url, retry_seconds=30) as client:  # type: ignore[arg-type]
            with caplog.at_level(logging.WARNING, logger="ckptstore.client"):
                result = client.save("run", model, step=7)
            assert result.version == 1
            assert [v.version for v in client.versions("run")] == [1]
            client.load("run", model=loaded)
    finally:
        store.close()
    assert len(front.commits) == 2 and front.commits[0] is not None
    assert front.commits[0] == front.commits[1]  # the same commit, sent again
    assert any("retrying" in record.getMessage() for record in caplog.records)
    assert all(map(torch.equal, model.state_dict().values(), loaded.state_dict().values()))


def test_a_bad_idempotency_key_is_refused_naming_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    settings = Settings(home=home)
    try:
        with running_server(create_app(store, settings), settings) as url:
            body = {"manifest": {"tensors": []}, "tags": []}
            for key, status, problem in (
                ("short", 400, "invalid commit key 'short'"),
                ("k" * 15 + "!", 400, "invalid commit key"),
                ("k" * 65, 422, "Idempotency-Key"),
            ):
                answer = httpx.post(f"{url}/v1/runs/run/versions", json=body, headers={"Idempotency-Key": key})
                assert answer.status_code == status, answer.text
                assert problem in json.dumps(answer.json())
            assert store.runs() == []
    finally:
        store.close()
