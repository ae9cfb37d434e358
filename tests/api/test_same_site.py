"""What a web page can make a server do: DNS rebinding against a server with no tokens, cross-site writes.

A real uvicorn server on loopback over a store holding one run. Requests are sent by hand with the
headers a browser would send: a rebinding page's ``Host: attacker.example``, a cross-site form's
``Origin`` and ``Sec-Fetch-Site``, a ``no-cors`` ``POST`` typed ``text/plain`` with no body.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.service.api import create_app
from ckptstore.service.api.http.same_site import host_name, is_loopback_name
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer
from tests.servers import running_server

FOREIGN = "attacker.example"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., tuple[str, Store]]]:
    """Serve a store holding run ``r`` (one version) with ``Settings(**overrides)``; its URL and store."""
    with ExitStack() as stack:

        def start(**overrides: Any) -> tuple[str, Store]:
            home = tmp_path / f"home{len(stack._exit_callbacks)}"
            with client.Client(home=home) as embedded:
                embedded.save("r", torch.nn.Linear(4, 4))
            store = Store.open_home(home)
            stack.callback(store.close)
            served = Settings(home=home, **overrides)
            return stack.enter_context(running_server(create_app(store, served), served)), store

        yield start


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _reads_and_writes(store: Store) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """What a rebinding page would do: list, read a manifest, download shard bytes, delete, open a page."""
    shard_id = next(iter(store.blobs.list_ids()))
    return {
        "list runs": ("GET", "/v1/runs", {}),
        "read a manifest": ("GET", "/v1/runs/r/versions/latest", {}),
        "download a shard": ("GET", f"/v1/shards/{shard_id}", {}),
        "open a page": ("GET", "/", {}),
        "delete a version": ("DELETE", "/v1/runs/r/versions/1", {}),
        "collect garbage": ("POST", "/v1/gc", {"json": {}}),
    }


def test_a_server_with_no_tokens_answers_no_foreign_host(serve: Callable[..., tuple[str, Store]]) -> None:
    url, store = serve()
    actions = _reads_and_writes(store)
    for what, (method, path, body) in actions.items():
        answer = httpx.request(method, f"{url}{path}", headers={"Host": f"{FOREIGN}:{_port(url)}"}, timeout=30, **body)
        assert answer.status_code == 403, f"{what}: {answer.status_code} {answer.text[:200]}"
        assert answer.json()["code"] == "forbidden" and "CKPTSTORE_ALLOWED_HOSTS" in answer.json()["message"]
    assert [v.version for v in store.versions("r")] == [1]  # nothing was deleted
    for host in (f"127.0.0.1:{_port(url)}", f"localhost:{_port(url)}", "127.0.0.2", "[::1]:8000", "LOCALHOST"):
        assert httpx.get(f"{url}/v1/runs", headers={"Host": host}, timeout=30).status_code == 200, host


def test_a_listed_host_name_is_answered(serve: Callable[..., tuple[str, Store]]) -> None:
    url, _ = serve(allowed_hosts="ckpt.internal, other.internal:9000")
    for host in ("ckpt.internal", "CKPT.internal:8000", "other.internal"):
        assert httpx.get(f"{url}/v1/runs", headers={"Host": host}, timeout=30).status_code == 200, host
    assert httpx.get(f"{url}/v1/runs", headers={"Host": FOREIGN}, timeout=30).status_code == 403


def test_with_tokens_any_host_is_answered_but_cross_site_writes_are_not(
    serve: Callable[..., tuple[str, Store]],
) -> None:
    url, store = serve(tokens=TOKENS)
    assert httpx.get(f"{url}/v1/runs", headers={"Host": FOREIGN, **bearer("read")}, timeout=30).status_code == 200
    cross = {"Origin": "https://attacker.example", "Sec-Fetch-Site": "cross-site", **bearer("admin")}
    refused = httpx.delete(f"{url}/v1/runs/r/versions/1", headers=cross, timeout=30)
    assert refused.status_code == 403 and "another site" in refused.json()["message"]
    assert [v.version for v in store.versions("r")] == [1]


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "https://attacker.example", "Sec-Fetch-Site": "cross-site"},
        {"Origin": "http://localhost:3000", "Sec-Fetch-Site": "same-site"},  # another app on this machine
        {"Origin": "https://attacker.example"},  # a browser that sends no Sec-Fetch-Site
        {"Origin": "null"},  # a sandboxed frame or a file:// page
    ],
    ids=["cross-site", "same-site-other-port", "origin-only", "null-origin"],
)
def test_a_cross_site_post_does_not_run_gc_or_delete(
    serve: Callable[..., tuple[str, Store]], headers: dict[str, str]
) -> None:
    url, store = serve()
    for method, path, body in (("POST", "/v1/gc", {"json": {}}), ("DELETE", "/v1/runs/r/versions/1", {})):
        answer = httpx.request(method, f"{url}{path}", headers=headers, timeout=30, **body)
        assert answer.status_code == 403 and answer.json()["code"] == "forbidden", answer.text
    assert [v.version for v in store.versions("r")] == [1]


def test_a_simple_cross_site_post_with_no_body_is_refused_even_without_browser_headers(
    serve: Callable[..., tuple[str, Store]],
) -> None:
    """A form or ``no-cors`` fetch may only send text/plain, a form type or none: never application/json."""
    url, _ = serve()
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        headers = {"Content-Type": content_type} if content_type else {}
        answer = httpx.post(f"{url}/v1/gc", headers=headers, timeout=30)
        assert answer.status_code == 415 and answer.json()["code"] == "unsupported_media_type", answer.text


def test_the_server_s_own_pages_and_scripts_still_write(serve: Callable[..., tuple[str, Store]]) -> None:
    url, store = serve()
    same = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
    assert httpx.post(f"{url}/v1/gc", json={"dry_run": True}, headers=same, timeout=30).status_code == 200
    assert httpx.post(f"{url}/v1/gc", json={"dry_run": True}, headers={"Origin": url}, timeout=30).status_code == 200
    assert httpx.delete(f"{url}/v1/runs/r/versions/1", timeout=30).status_code in (200, 204)  # a script: no headers
    assert store.versions("r") == []


HOST_CHARS = string.ascii_letters + string.digits + ".-:[]"


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server with no tokens over an empty store, for the many requests of a property."""
    home = tmp_path_factory.mktemp("open")
    store = Store.open_home(home)
    served = Settings(home=home)
    try:
        with running_server(create_app(store, served), served) as url:
            yield url
    finally:
        store.close()


@settings(max_examples=200, deadline=None)
@given(host=st.text(HOST_CHARS, min_size=1, max_size=40) | st.sampled_from(["127.0.0.1", "[::1]", "localhost:1"]))
def test_any_host_is_answered_exactly_when_it_names_loopback(open_server: str, host: str) -> None:
    url = open_server
    answer = httpx.get(f"{url}/healthz", headers={"Host": host}, timeout=30)
    if answer.status_code == 400:
        return  # the HTTP parser refused a malformed Host before the app saw it
    loopback = is_loopback_name(host_name(host))
    assert answer.status_code == (200 if loopback else 403), (host, answer.status_code, answer.text[:200])
