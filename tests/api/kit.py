"""Helpers for the HTTP API tests: shards built by hand (no torch), commit bodies, raw HTTP.

A tensor is raw little-endian bytes plus a dtype name and a shape; its digest comes from the
format's own :func:`tensor_digest`, and a shard is :func:`encode_header` followed by the bytes.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ckptstore.service.format.digest import shard_id
from ckptstore.service.format.dtypes import dtype_class
from ckptstore.service.format.safetensors_header import encode_header
from tests.service.shardkit import RawTensor as Tensor
from tests.service.shardkit import raw


def tensor(seed: int, dtype: str = "F32", shape: Sequence[int] = (4, 4)) -> Tensor:
    """A tensor whose bytes are drawn from ``seed`` (distinct seeds give distinct digests)."""
    return raw(dtype, list(shape), seed)


@dataclass(frozen=True)
class Shard:
    """A shard's bytes, its id and the tensors it holds."""

    data: bytes
    shard_id: str
    header_length: int
    tensors: tuple[Tensor, ...]

    @property
    def digests(self) -> list[str]:
        """The digests of the shard's tensors."""
        return [t.digest for t in self.tensors]


def build_shard(*tensors: Tensor) -> Shard:
    """A valid shard holding ``tensors`` in the order given."""
    header, _entries = encode_header([(t.digest, t.dtype, t.shape) for t in tensors])
    return Shard(header + b"".join(t.data for t in tensors), shard_id(header), len(header), tuple(tensors))


def entry(key: str, t: Tensor, **overrides: Any) -> dict[str, Any]:
    """A manifest entry (as JSON) storing ``t`` whole under ``key``."""
    item: dict[str, Any] = {
        "key": key,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "dtype_class": dtype_class(t.dtype),
        "digest": t.digest,
        "placement": "target",
        "device_type": "cpu",
    }
    if key.startswith("model/"):
        item["trainable"] = True
    item.update(overrides)
    return item


def commit_body(*entries: dict[str, Any], step: int | None = None, tags: Sequence[str] = ()) -> dict[str, Any]:
    """A commit request body (as JSON) for ``entries``."""
    manifest: dict[str, Any] = {"tensors": list(entries)}
    if step is not None:
        manifest["step"] = step
    return {"manifest": manifest, "tags": list(tags)}


def files_under(root: Path) -> set[str]:
    """Every file and folder below ``root``, as paths relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def stored_blobs(home: Path) -> list[Path]:
    """The shard files in ``<home>/blobs`` (the ``.incoming`` folder is not a blob)."""
    root = home / "blobs"
    return [p for p in root.rglob("*") if p.is_file() and ".incoming" not in p.parts] if root.exists() else []


def staged(home: Path) -> list[Path]:
    """Files left in ``<home>/staging`` or in the blob store's ``.incoming`` folder."""
    found = [p for p in (home / "staging").rglob("*") if p.is_file()] if (home / "staging").exists() else []
    incoming = home / "blobs" / ".incoming"
    return found + ([p for p in incoming.rglob("*") if p.is_file()] if incoming.exists() else [])


class Finished:
    """An ASGI wrapper that reports each HTTP request the app has finished with.

    A test that cuts a connection cannot read a response; it waits on :meth:`wait` instead,
    which returns once the app's handler (and its cleanup) has run to the end.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._done: queue.Queue[tuple[str, str]] = queue.Queue()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                self._done.put((scope["method"], scope["path"]))

    def wait(self, method: str, path: str, timeout: float = 30.0) -> None:
        """Block until the app has finished a ``method`` request to ``path``."""
        while True:
            if self._done.get(timeout=timeout) == (method, path):
                return


@dataclass
class Served:
    """A real server: its base URL and a hook that reports finished requests."""

    url: str
    finished: Finished

    def client(self, **kwargs: Any) -> httpx.Client:
        """A new httpx client for this server."""
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)


def raw_request(base_url: str, request: bytes, *, close_after_send: bool = False) -> bytes:
    """Send ``request`` verbatim over a new connection; return everything the server answers.

    With ``close_after_send`` the socket is closed right after sending (a client that vanished
    mid-upload) and nothing is read. Requests should say ``Connection: close`` so the server
    ends the exchange.
    """
    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(request)
        if close_after_send:
            return b""
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response."""
    return int(response.split(b" ", 2)[1])


#: Tokens of each scope (CKPTSTORE_TOKENS wants 16-512 characters).
READ_TOKEN = "read-token-0f3a9c2e71b4d85a"
WRITE_TOKEN = "write-token-6be1d04c93f27a18"
ADMIN_TOKEN = "admin-token-c58f2a7e01d96b34"
TOKENS = f"read:{READ_TOKEN},write:{WRITE_TOKEN},admin:{ADMIN_TOKEN}"
TOKEN_OF = {"read": READ_TOKEN, "write": WRITE_TOKEN, "admin": ADMIN_TOKEN}


def bearer(scope: str) -> dict[str, str]:
    """The Authorization header for a token of ``scope``."""
    return {"Authorization": f"Bearer {TOKEN_OF[scope]}"}


def is_json_error(response: Any) -> bool:
    """True if an httpx response is a ckptstore error: JSON {code, message} and a matching X-Error-Code."""
    try:
        body = response.json()
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and isinstance(body.get("code"), str)
        and isinstance(body.get("message"), str)
        and response.headers.get("x-error-code") == body["code"]
    )


def eventually(condition: Callable[[], bool], seconds: float = 30.0) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
