"""A client whose pooled connections the server closed (its keep-alive timeout) sends on new ones.

A training loop saves every few minutes; uvicorn closes a connection left idle for 5 s. The
bulk connections (shard bytes) are checked before reuse, so the next save neither sends into a
closed connection nor waits out a retry: a real server with a short keep-alive timeout, a
client that saves, waits until the server has closed its idle connections, and saves again.
And neither pool reuses a connection idle past ``IDLE_REUSE_SECONDS`` (well under the server's
timeout), so no request is sent just as the server closes it (and sent again after a pause).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.client import Client
from ckptstore.client.http import bulk as bulk_wire
from ckptstore.client.http.bulk import BulkHttp, still_open
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
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


def json_connections(client: Client) -> list[Any]:
    """The connections of the client's httpx pool (JSON calls), as httpcore holds them."""
    transport = client.transport
    assert isinstance(transport, HttpTransport)
    return list(transport.session._http._transport._pool.connections)  # type: ignore[attr-defined]


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
            idle = [connection for connection, _ in bulk_of(client)._idle]
            assert idle, "the save's upload left its connection in the pool"
            # The server closes them once they have been idle for its keep-alive timeout: the
            # bulk ones, and the JSON calls' (which the pool drops once they read as closed).
            assert eventually(lambda: not any(still_open(connection.sock) for connection in idle))
            assert eventually(lambda: all(connection.has_expired() for connection in json_connections(client)))
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


def client_ports(scopes: list[dict[str, Any]]) -> list[int]:
    return [scope["client"][1] for scope in scopes]


@pytest.mark.parametrize("idle_reuse_seconds", [0.0, 60.0])
def test_a_connection_idle_past_the_reuse_limit_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_reuse_seconds: float
) -> None:
    """Every request a client sends, on the port its connection came from: with no idle time
    allowed, no two requests share a connection; with a minute, the second save reuses them."""
    monkeypatch.setattr(bulk_wire, "IDLE_REUSE_SECONDS", idle_reuse_seconds)
    home = tmp_path / "home"
    store = Store.open_home(home)
    settings = Settings(home=home)
    app = create_app(store, settings)
    requests: list[list[dict[str, Any]]] = []  # each save's

    async def recording(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and requests:
            requests[-1].append(scope)
        await app(scope, receive, send)

    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 300))
    try:
        with running_server(recording, settings) as url, Client(url) as client:  # type: ignore[arg-type]
            for _ in range(2):
                requests.append([])
                client.save("run", model)
                with torch.no_grad():
                    model[0].bias.add_(1.0)
    finally:
        store.close()
    first, second = map(client_ports, requests)
    assert any(scope["method"] == "POST" and scope["path"].endswith("/versions") for scope in requests[1])
    if idle_reuse_seconds == 0:
        assert len(set(first + second)) == len(first) + len(second)  # a new connection for every request
    else:
        assert set(second) <= set(first)  # every request of the second save on a connection of the first
