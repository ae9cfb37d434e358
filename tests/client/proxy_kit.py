"""A real forwarding HTTP proxy on loopback, certificates for TLS on 127.0.0.1, and a server that
records which connection each request came in on.

The proxy takes absolute-form requests (``GET http://host:port/path``), forwarding each on a
new connection to the server, and ``CONNECT host:port`` tunnels; it may itself listen behind
TLS (an ``https://`` proxy). It records every request it is asked for and the local port of
every connection it opens to a server, so a test can tell which of the server's requests came
through it.
"""

from __future__ import annotations

import datetime
import ipaddress
import select
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ckptstore.service.api.server import http_protocol, tune_uvicorn

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Asked:
    """One request the proxy was asked for."""

    method: str
    target: str
    range: str | None
    proxy_authorization: str | None


class ForwardProxy:
    """A threaded forwarding proxy on 127.0.0.1 (behind TLS when ``tls`` is a server context)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.asked: list[Asked] = []
        #: Local ports of the connections the proxy opened to servers.
        self.upstream_ports: set[int] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._thread.join(timeout=10)
        with self._lock:
            for sock in self._open:
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._open.append(sock)
        return sock

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self._track(conn)
            reader = conn.makefile("rb")
            while True:
                head = read_head(reader)
                if head is None:
                    return
                method, target, _ = head[0].split(" ", 2)
                headers = dict(parse_headers(head[1:]))
                self.asked.append(Asked(method, target, headers.get("range"), headers.get("proxy-authorization")))
                if method == "CONNECT":
                    self._tunnel(conn, target)
                    return
                self._forward(conn, reader, method, target, head[1:])
                return  # the answer said Connection: close
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def _upstream(self, host: str, port: int) -> socket.socket:
        upstream = self._track(socket.create_connection((host, port)))
        self.upstream_ports.add(upstream.getsockname()[1])
        return upstream

    def _tunnel(self, conn: socket.socket, target: str) -> None:
        host, _, port = target.rpartition(":")
        upstream = self._upstream(host.strip("[]"), int(port))
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        pipe(conn, upstream)

    def _forward(self, conn: socket.socket, reader: BinaryIO, method: str, target: str, lines: list[str]) -> None:
        url = urlsplit(target)
        assert url.scheme == "http" and url.hostname, f"not an absolute http URL: {target}"
        upstream = self._upstream(url.hostname, url.port or 80)
        kept = [line for line in lines if line.split(":", 1)[0].strip().lower() not in HOP_BY_HOP]
        path = url.path + (f"?{url.query}" if url.query else "")
        upstream.sendall(message_head(f"{method} {path} HTTP/1.1", kept))
        left = int(dict(parse_headers(lines)).get("content-length", "0"))
        while left:
            chunk = reader.read(min(left, 1 << 20))
            if not chunk:
                raise OSError("the client hung up mid-body")
            upstream.sendall(chunk)
            left -= len(chunk)
        answer = upstream.makefile("rb")
        head = read_head(answer)
        assert head is not None, "the server sent no answer"
        kept = [line for line in head[1:] if line.split(":", 1)[0].strip().lower() not in HOP_BY_HOP]
        conn.sendall(message_head(head[0], kept))
        while chunk := answer.read1(1 << 20):
            conn.sendall(chunk)


def message_head(first: str, lines: list[str]) -> bytes:
    """A message head of ``first`` and header ``lines``, saying the connection closes after it."""
    return "".join(f"{line}\r\n" for line in [first, *lines, "Connection: close", ""]).encode("latin-1")


def read_head(reader: BinaryIO) -> list[str] | None:
    """The request or status line and header lines of the next message; None at end of stream."""
    lines: list[str] = []
    while True:
        line = reader.readline(65536)
        if not line:
            return None if not lines else lines
        text = line.decode("latin-1").rstrip("\r\n")
        if not text:
            return lines if lines else None
        lines.append(text)


def parse_headers(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(lower-cased name, value) of each header line."""
    for line in lines:
        name, _, value = line.partition(":")
        yield name.strip().lower(), value.strip()


def pipe(one: socket.socket, other: socket.socket) -> None:
    """Copy bytes both ways until either side closes (one thread: safe for TLS sockets)."""
    while True:
        pending = isinstance(one, ssl.SSLSocket) and one.pending()
        ready = [one] if pending else select.select([one, other], [], [], 60)[0]
        if not ready:
            return
        for sock in ready:
            data = sock.recv(1 << 20)
            if not data:
                return
            (other if sock is one else one).sendall(data)


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and a certificate for 127.0.0.1 it signed (PEM files)."""

    ca: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        return context


def make_tls_files(folder: Path) -> TlsFiles:
    """Write a fresh CA and a server certificate for IP 127.0.0.1 into ``folder``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ckptstore test CA")])
    signs = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(signs, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


class ClientPorts:
    """ASGI wrapper recording (method, path, Range header, the client's port) of every HTTP request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, str, str | None, int]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            ranged = headers.get(b"range")
            self.requests.append(
                (scope["method"], scope["path"], ranged.decode() if ranged else None, scope["client"][1])
            )
        await self.app(scope, receive, send)


@contextmanager
def serving(app: Any, tls: TlsFiles | None = None) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port (over TLS with ``tls``); yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    tune_uvicorn()
    options: dict[str, Any] = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)} if tls else {}
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, http=http_protocol(), **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
