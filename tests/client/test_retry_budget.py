"""The client rides out a server restart: requests safe to repeat are retried for a time budget
(``retry_seconds`` / ``CKPTSTORE_RETRY_SECONDS``), a commit only while its connection is refused,
and an unreachable server is an error naming it and what to check.

The server is a real uvicorn on PostgreSQL, stopped and started again on the same port; the
restart is driven by the client's own log of failed tries, not by timers.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from ckptstore import client
from ckptstore.client.http.retry import DEFAULT_RETRY_SECONDS, MAX_PAUSE_SECONDS
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.api.server import http_protocol, tune_uvicorn
from ckptstore.service.db import Database
from ckptstore.service.factory import open_store
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from tests.backends import empty_tables
from tests.client.models import TinyNet, tensors_equal


class RestartableServer:
    """uvicorn serving one app on one loopback port, which can be stopped and started again."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (on the same port as before, if any) and serve; connections queue at once."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        tune_uvicorn()
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False, http=http_protocol())
        self._server, self._sock = uvicorn.Server(config), sock
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket: connections are refused from now on."""
        assert self._server is not None and self._thread is not None and self._sock is not None
        self._server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()
        self._sock.close()


class FailedTries(logging.Handler):
    """Counts the client's logged retries after a connection error; ``reached`` is set at ``wanted``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.wanted = 3
        self.count = 0
        self.pauses: list[float] = []
        self.reached = threading.Event()

    def expect(self, wanted: int) -> None:
        """Count afresh; ``reached`` is set at the ``wanted``-th failure."""
        self.wanted, self.count, self.pauses = wanted, 0, []
        self.reached.clear()

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[1], Exception):
            self.count += 1
            self.pauses.append(float(args[2]))
            if self.count >= self.wanted:
                self.reached.set()


@pytest.fixture
def failed_tries() -> Iterator[FailedTries]:
    """Connection failures the client logs from now on."""
    logger = logging.getLogger("ckptstore.client")
    handler, level = FailedTries(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def server(pg_url: str, tmp_path: Path) -> Iterator[RestartableServer]:
    """A real server on PostgreSQL (blobs in a local folder), emptied, running."""
    database = Database(pg_url)
    empty_tables(database)
    database.dispose()
    settings = Settings(home=tmp_path / "server", database_url=pg_url)
    store = open_store(settings)
    served = RestartableServer(create_app(store, settings))
    served.start()
    try:
        yield served
    finally:
        served.stop()
        store.close()


def restart_after_failures(server: RestartableServer, failures: FailedTries, wanted: int) -> threading.Thread:
    """Stop the server now; start it again on the same port once the client has failed ``wanted`` times."""
    failures.expect(wanted)
    server.stop()

    def restart() -> None:
        if failures.reached.wait(timeout=60):
            server.start()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # waits out a server restart
def test_a_load_and_a_listing_ride_out_a_server_restart(server: RestartableServer, failed_tries: FailedTries) -> None:
    saved = TinyNet(seed=4)
    with client.Client(server.url) as ckpt:  # the default budget
        assert ckpt.transport.retry_seconds == DEFAULT_RETRY_SECONDS >= 30  # type: ignore[attr-defined]
        ckpt.save("run", saved, step=1)
        # Five failed tries: about 6-8 s down, longer than the 4 retries (~4 s) the client once allowed.
        restarter = restart_after_failures(server, failed_tries, 5)
        model = TinyNet(seed=5)
        result = ckpt.load("run", model=model)
        restarter.join(timeout=60)
        assert failed_tries.count >= 5 and result.version == 1
        assert all(0 < pause <= MAX_PAUSE_SECONDS for pause in failed_tries.pauses)
        expected = saved.state_dict()
        assert all(tensors_equal(value, expected[key]) for key, value in model.state_dict().items())

        restarter = restart_after_failures(server, failed_tries, 3)
        assert [run.run_id for run in ckpt.runs()] == ["run"]
        restarter.join(timeout=60)
        assert failed_tries.count >= 3


def test_a_commit_is_sent_again_only_while_its_connection_is_refused(
    server: RestartableServer, failed_tries: FailedTries
) -> None:
    with client.Client(server.url) as ckpt:
        ckpt.save("run", TinyNet(seed=6), step=1)
        manifest = ckpt.transport.manifest("run", 1)
        body = ManifestBody.model_validate({name: getattr(manifest, name) for name in ManifestBody.model_fields})
        restarter = restart_after_failures(server, failed_tries, 3)
        info = ckpt.transport.commit("run", body)  # refused connections never reached the server
        restarter.join(timeout=60)
        assert failed_tries.count >= 3 and info.version == 2
        assert [v.version for v in ckpt.versions("run")] == [1, 2]  # committed exactly once


@pytest.mark.slow  # retries until its budget runs out
def test_with_a_short_budget_an_unreachable_server_is_an_error_naming_it(server: RestartableServer) -> None:
    with client.Client(server.url, retry_seconds=1.0) as ckpt:
        assert ckpt.runs() == []
        server.stop()
        started = time.monotonic()
        with pytest.raises(client.StorageError) as caught:
            ckpt.runs()
        waited = time.monotonic() - started
        with pytest.raises(client.StorageError, match="Is the server running"):
            ckpt.load("run", 1)
        server.start()  # for the fixture's stop
    message = str(caught.value)
    assert f"cannot reach the ckptstore server at {server.url}" in message
    assert f"Is the server running at {server.url}? Check CKPTSTORE_URL" in message
    assert "CKPTSTORE_RETRY_SECONDS" in message
    assert 1.0 <= waited < 1.0 + MAX_PAUSE_SECONDS


def test_the_budget_comes_from_the_environment_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSTORE_RETRY_SECONDS", "7.5")
    assert HttpTransport("http://127.0.0.1:9").retry_seconds == 7.5
    assert HttpTransport("http://127.0.0.1:9", retry_seconds=2).retry_seconds == 2  # the argument wins
    monkeypatch.setenv("CKPTSTORE_RETRY_SECONDS", "")
    assert HttpTransport("http://127.0.0.1:9").retry_seconds == DEFAULT_RETRY_SECONDS
    for bad in ("soon", "-1", "nan", "1e9"):
        monkeypatch.setenv("CKPTSTORE_RETRY_SECONDS", bad)
        with pytest.raises(client.InvalidInputError, match="CKPTSTORE_RETRY_SECONDS"):
            client.Client("http://127.0.0.1:9")
    monkeypatch.delenv("CKPTSTORE_RETRY_SECONDS")
    with pytest.raises(client.InvalidInputError, match="retry_seconds"):
        client.Client("http://127.0.0.1:9", retry_seconds=-2)
