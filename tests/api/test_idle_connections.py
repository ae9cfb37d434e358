"""A client whose pooled connections the server closed (its keep-alive timeout) sends on new ones.

A training loop saves every few minutes; uvicorn closes a connection left idle for 5 s. The
bulk connections (shard bytes) are checked before reuse, so the next save neither sends into a
closed connection nor waits out a retry: a real server with a short keep-alive timeout, a
client that saves, waits until the server has closed its idle connections, and saves again.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from client import Client
from client.http.bulk import BulkHttp, still_open
from client.http.transport import HttpTransport
from service.api import create_app
from service.settings import Settings
from service.store import Store
from tests.api.kit import eventually
from tests.servers import running_server


def test_a_socket_is_open_until_its_peer_closes_it_or_sends_unasked() -> None:
    assert not still_open(None)
    for close_how in ("close", "send"):
        mine, peer = socket.socketpair()
        with mine:
            assert still_open(mine)
            if close_how == "close":
                peer.close()
            else:
                peer.sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
            assert not still_open(mine)
            peer.close()
    mine, peer = socket.socketpair()
    peer.close()
    mine.close()
    assert not still_open(mine)  # closed here already


def bulk_of(client: Client) -> BulkHttp:
    transport = client.transport
    assert isinstance(transport, HttpTransport)
    bulk = transport.session.bulk
    assert isinstance(bulk, BulkHttp)
    return bulk


def test_a_save_after_the_server_closed_the_idle_connections_goes_on_new_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    store = Store.open_home(home)
    settings = Settings(home=home, keep_alive_timeout=0.2)
    app = create_app(store, settings)
    uploads: list[str] = []

    async def counting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/shards"):
            uploads.append(f"{scope['method']} {scope['path']}")
        await app(scope, receive, send)

    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 300))
    loaded = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 300))
    try:
        with running_server(counting, settings) as url, Client(url) as client:  # type: ignore[arg-type]
            client.save("run", model)
            idle = list(bulk_of(client)._idle)
            assert idle, "the save's upload left its connection in the pool"
            # The server closes them once they have been idle for its keep-alive timeout.
            assert eventually(lambda: not any(still_open(connection.sock) for connection in idle))
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)
            uploads.clear()
            with caplog.at_level(logging.INFO, logger="ckptstore.client"):
                client.save("run", model)
            assert not [record for record in caplog.records if "retrying" in record.getMessage()]
            assert len(uploads) == len(set(uploads)) > 0  # each shard sent once
            assert all(connection.sock is None for connection in idle)  # the closed ones were let go
            client.load("run", model=loaded)
    finally:
        store.close()
    assert all(map(torch.equal, model.state_dict().values(), loaded.state_dict().values()))
