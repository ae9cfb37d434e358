"""The HTTP transport retries only what is safe to repeat, under one policy for JSON calls and
shard bytes alike, and reports an unreachable server."""

from __future__ import annotations

import os
import socket
import ssl
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptstore import client
from ckptstore.client.http.retry import MAX_RETRY_AFTER_SECONDS, RetryPolicy
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.api import create_app
from ckptstore.service.db import Database
from ckptstore.service.factory import open_store
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from tests.backends import empty_tables
from tests.client.models import TinyNet
from tests.servers import running_server
from tests.service.shardkit import RawTensor, build_shard


class Flaky:
    """ASGI wrapper answering 503 to the first ``failures`` requests of each (method, route kind)."""

    def __init__(self, app: Any, failures: int) -> None:
        self.app = app
        self.failures = failures
        self.seen: Counter[tuple[str, str]] = Counter()

    @staticmethod
    def kind(path: str) -> str:
        parts = path.strip("/").split("/")
        return "/".join(parts[:2]) if parts[1:2] != ["runs"] else "runs/" + (parts[3] if len(parts) > 3 else "")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = (scope["method"], self.kind(scope["path"]))
        self.seen[key] += 1
        if self.seen[key] <= self.failures:
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


def flaky_client(tmp_path: Path, failures: int) -> tuple[Any, Flaky]:
    settings = Settings(home=tmp_path / "server")
    flaky = Flaky(create_app(open_store(settings), settings), failures)
    return flaky, flaky


def test_idempotent_requests_are_retried_through_503s(tmp_path: Path) -> None:
    app, flaky = flaky_client(tmp_path, failures=0)
    with running_server(app) as url:  # type: ignore[arg-type]
        with client.Client(url) as ckpt:
            ckpt.transport = HttpTransport(url, backoff_seconds=0.001)
            ckpt.save("run", TinyNet())
            flaky.failures = 2
            flaky.seen.clear()
            model = TinyNet(seed=1)
            result = ckpt.load("run", model=model)
    assert result.version == 1
    assert flaky.seen[("GET", "runs/versions")] == 3, flaky.seen  # two 503s, then the manifest
    assert flaky.seen[("POST", "v1/tensors")] == 3
    # Shard bytes come by ranged GETs or, for ranges of several shards, a batched POST: retried alike.
    assert flaky.seen[("GET", "v1/shards")] + flaky.seen[("POST", "v1/shards")] >= 3


def test_a_save_commit_is_retried_under_its_key_and_a_commit_without_one_is_not(tmp_path: Path) -> None:
    app, flaky = flaky_client(tmp_path, failures=0)
    with running_server(app) as url:  # type: ignore[arg-type]
        with client.Client(url) as ckpt:
            ckpt.transport = HttpTransport(url, backoff_seconds=0.001)
            flaky.failures = 1
            # The save's commit carries an Idempotency-Key: answered 503 once, it is sent again.
            assert ckpt.save("run", TinyNet()).version == 1
            assert flaky.seen[("POST", "runs/versions")] == 2
            # Two shards (the buffers saved with trainable False apart), the first sent twice.
            assert flaky.seen[("PUT", "v1/shards")] == 3, "a shard upload is idempotent and retried"
            # A commit without a key is not: its outcome after a 503 would be unknown.
            stored = ckpt.transport.manifest("run", 1)
            body = ManifestBody.model_validate(stored.model_dump(include=set(ManifestBody.model_fields)))
            flaky.seen.clear()
            with pytest.raises(client.StorageError):
                ckpt.transport.commit("run", body)
            assert flaky.seen[("POST", "runs/versions")] == 1, "a commit without a key must not be sent twice"
            assert [v.version for v in ckpt.versions("run")] == [1]
            assert ckpt.transport.commit("run", body).version == 2


def test_an_unreachable_server_is_a_storage_error_naming_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound but not listening: connections are refused
        with client.Client(f"http://127.0.0.1:{port}") as ckpt:
            ckpt.transport = HttpTransport(f"http://127.0.0.1:{port}", retries=1, backoff_seconds=0.001)
            with pytest.raises(client.StorageError, match=f"127.0.0.1:{port}"):
                ckpt.runs()


def test_a_bad_url_is_refused() -> None:
    with pytest.raises(client.InvalidInputError, match="http://"):
        client.Client("ftp://example.invalid")


PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def test_a_plain_http_client_builds_no_tls_context_unless_https_or_a_proxy_may_use_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    built: list[object] = []
    real = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    HttpTransport("http://127.0.0.1:9").close()
    assert built == []  # never used: loading the CA bundle cost 35-95 ms per client
    HttpTransport("https://127.0.0.1:9").close()
    assert built  # certificates are still verified over TLS
    built.clear()
    monkeypatch.setenv("HTTPS_PROXY", "https://proxy.invalid:3128")
    HttpTransport("http://127.0.0.1:9").close()
    assert built  # a proxy from the environment may be reached over TLS


@pytest.fixture
def flaky_pg(pg_url: str, tmp_path: Path) -> Any:
    """A server on PostgreSQL answering 503 to the first ``failures`` requests of each kind (none yet)."""
    database = Database(pg_url)
    empty_tables(database)
    database.dispose()
    settings = Settings(home=tmp_path / "server", database_url=pg_url)
    store = open_store(settings)
    flaky = Flaky(create_app(store, settings), failures=0)
    try:
        with running_server(flaky) as url:  # type: ignore[arg-type]
            yield url, flaky
    finally:
        store.close()


def test_json_calls_shard_uploads_and_ranged_reads_share_one_retry_policy(
    flaky_pg: tuple[str, Flaky], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, flaky = flaky_pg
    shard = build_shard([RawTensor("F32", (256,), os.urandom(1024))])
    header, tensors = shard.data[: shard.header_length], memoryview(shard.data)[shard.header_length :]
    kinds = [("GET", "runs/"), ("PUT", "v1/shards"), ("GET", "v1/shards")]

    def calls(transport: HttpTransport) -> list[Callable[[], object]]:
        """A JSON call, a shard upload (bulk) and a ranged shard read (bulk)."""
        return [
            transport.runs,
            lambda: transport.put_shard(header, [tensors]),
            lambda: transport.read_into(shard.shard_id, shard.header_length, memoryview(bytearray(1024))),
        ]

    transport = HttpTransport(url, retries=2, backoff_seconds=0.001)
    assert transport.session.policy is transport.policy == RetryPolicy(transport.retry_seconds, 2, 0.001)
    flaky.failures = 2
    for call in calls(transport):
        call()
    assert [flaky.seen[kind] for kind in kinds] == [3, 3, 3]  # two 503s each, then the answer

    flaky.failures, flaky.seen = 3, Counter()
    for call in calls(transport):
        with pytest.raises(client.StorageError, match="503"):
            call()
    assert [flaky.seen[kind] for kind in kinds] == [3, 3, 3]  # three tries each, then given up
    transport.close()

    monkeypatch.setenv("CKPTSTORE_RETRY_SECONDS", "0")  # the budget from the environment, for every path
    transport = HttpTransport(url, backoff_seconds=0.001)
    flaky.failures, flaky.seen = 1, Counter()
    for call in calls(transport):
        with pytest.raises(client.StorageError, match="503"):
            call()
    assert [flaky.seen[kind] for kind in kinds] == [1, 1, 1]
    transport.close()


@pytest.mark.parametrize(
    ("method", "path", "safe"),
    [
        ("POST", "/v1/runs/run-1/versions", False),
        ("post", "/v1/runs/run%2F1/versions?x=1", False),
        ("GET", "/v1/runs/run-1/versions", True),
        ("DELETE", "/v1/runs/run-1/versions/3", True),
        ("POST", "/v1/tensors/missing", True),
        ("POST", "/v1/runs/run-1/retention/apply", True),
        ("PUT", "/v1/shards/" + "ab" * 32, True),
        ("GET", "/v1/shards/" + "ab" * 32, True),
    ],
)
def test_only_a_commit_is_unsafe_to_repeat(method: str, path: str, safe: bool) -> None:
    assert RetryPolicy.safe_to_repeat(method, path) is safe


def test_pauses_back_off_with_jitter_and_follow_retry_after_within_limits() -> None:
    policy = RetryPolicy(seconds=60, backoff_seconds=0.5)
    pauses = [policy.pause(attempt, left=60) for attempt in range(8) for _ in range(20)]
    for attempt in range(8):
        full = min(4.0, 0.5 * 2**attempt)
        assert all(full / 2 <= pause <= full for pause in pauses[attempt * 20 : attempt * 20 + 20])
    assert len(set(pauses)) > 100  # jitter: tries of many clients do not line up
    assert policy.pause(0, left=60, retry_after="7") == 7.0
    assert policy.pause(0, left=60, retry_after="600") == MAX_RETRY_AFTER_SECONDS
    assert policy.pause(0, left=2.5, retry_after="7") == 2.5  # never past the budget
    assert 0.25 <= policy.pause(0, left=60, retry_after="Wed, 21 Oct 2099 07:28:00 GMT") <= 0.5
