"""A gate in front of the moto S3 server that refuses presigned URLs past their expiry, as S3 does.

moto serves presigned URLs without checking ``X-Amz-Date`` + ``X-Amz-Expires``; real S3 answers
such a request ``403 AccessDenied`` ("Request has expired"). Clients are handed URLs signed for
the gate's address (the server's own requests still go to moto directly); the gate checks the
expiry, forwards everything else to moto byte for byte, and counts what it saw. It can also hold
each part upload for a while, so a test can kill a client in the middle of one.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

EXPIRED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Request has expired</Message></Error>"
)


@dataclass
class GateLog:
    """What the gate saw: every request's method and path, and how many it refused as expired."""

    requests: list[tuple[str, str]] = field(default_factory=list)
    expired: int = 0
    #: Seconds each PUT is held before it is forwarded.
    put_delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def puts(self) -> int:
        """How many PUTs arrived."""
        with self.lock:
            return sum(method == "PUT" for method, _ in self.requests)


def _expired(query: str, now: datetime) -> bool:
    fields = parse_qs(query)
    if "X-Amz-Date" not in fields or "X-Amz-Expires" not in fields:
        return False
    signed = datetime.strptime(fields["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    return (now - signed).total_seconds() > int(fields["X-Amz-Expires"][0])


@contextmanager
def s3_gate(moto_url: str) -> Iterator[tuple[str, GateLog]]:
    """Run a gate in front of ``moto_url`` on a free loopback port; yields its URL and its log."""
    upstream = urlsplit(moto_url)
    log = GateLog()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet: the URLs hold signatures
            pass

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with log.lock:
                log.requests.append((self.command, urlsplit(self.path).path))
            if _expired(urlsplit(self.path).query, datetime.now(timezone.utc)):
                with log.lock:
                    log.expired += 1
                self._answer(403, {"Content-Type": "application/xml"}, EXPIRED)
                return
            if self.command == "PUT" and log.put_delay:
                time.sleep(log.put_delay)
            connection = http.client.HTTPConnection(upstream.hostname or "", upstream.port, timeout=60)
            try:
                headers = {name: value for name, value in self.headers.items() if name.lower() != "connection"}
                connection.request(self.command, self.path, body=body, headers=headers)
                answer = connection.getresponse()
                data = answer.read()
                kept = {n: v for n, v in answer.getheaders() if n.lower() not in ("connection", "transfer-encoding")}
                self._answer(answer.status, kept, data)
            finally:
                connection.close()

        def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
            self.send_response(status)
            for name, value in headers.items():
                if name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
