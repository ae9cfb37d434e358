"""The server's link to S3 cut for a few seconds and restored, under saving clients.

The blobs live in a bucket of a real moto server reached through a :class:`TcpGate`: while
the link is cut, every connection through it is reset and every new one is reset as soon as
it opens. The server's S3 requests fail (after botocore's own retries) with 503 answers, the
clients retry, and every save must commit once the link is back.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import uuid
from pathlib import Path

from ckptstore.service.blobs.s3 import S3BlobStore, make_client
from ckptstore.service.db import Database
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.backends import moto_server
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import saved_through_outages

SAVERS = 3
SAVES = 3
#: How long the link stays cut once the clients have felt it: the fault's length.
OUTAGE_SECONDS = 3.0


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset, waking any thread blocked on it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its peer
    sock.close()


class TcpGate:
    """Relays TCP connections from a loopback port to ``upstream`` (host, port), until cut."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = True
        self.cuts = 0
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="tcp-gate", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if not self.open:
                    _reset(inside)
                    continue
                try:
                    outside = socket.create_connection(self.upstream, timeout=10)
                except OSError:
                    _reset(inside)
                    continue
                outside.settimeout(None)
                self._live |= {inside, outside}
            for source, target in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                target.sendall(data)
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # cut, or closed by either end
        finally:
            with self._lock:
                self._live.discard(source)

    def cut(self) -> None:
        """Reset every connection through the gate, and every new one until :meth:`restore`."""
        self.cuts += 1
        self._reset_all()

    def _reset_all(self) -> None:
        with self._lock:
            self.open = False
            live, self._live = self._live, set()
        for sock in live:
            _reset(sock)

    def restore(self) -> None:
        """Let connections through again."""
        with self._lock:
            self.open = True

    def close(self) -> None:
        """Stop accepting and reset what is open."""
        self.listener.close()
        self._reset_all()


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Cut the link ``scale`` times under saving clients, each time until they feel it."""
    home = workdir / "home"
    tally = Tally()
    with moto_server(workdir / "aws") as endpoint:
        host, port = endpoint.removeprefix("http://").split(":")
        gate = TcpGate((host, int(port)))
        bucket = f"faults-{uuid.uuid4().hex[:16]}"
        make_client(endpoint).create_bucket(Bucket=bucket)
        blobs = S3BlobStore(bucket, "ckpt", client=make_client(gate.url))
        store = Store(Database.sqlite_file(home / "metadata.db"), blobs, home / "staging")
        try:

            def outages() -> None:
                for _ in range(scale):
                    _outage(gate, tally)

            findings = saved_through_outages(store, Settings(home=home), tally, seed, SAVERS, SAVES, outages)
        finally:
            store.close()
            gate.close()
    return ScenarioResult.of("s3-link", seed, scale, tally, findings, cuts=gate.cuts)


def _outage(gate: TcpGate, tally: Tally) -> None:
    """Cut the link once saves are committing, hold it cut, restore it, wait for commits."""
    committed = len(tally.acknowledged)
    tally.wait_for(lambda t: len(t.acknowledged) >= committed + SAVERS, "saves before the cut")
    mark = tally.mark()
    gate.cut()
    tally.wait_for(lambda t: t.outage_felt(mark), "a client to meet the cut link")
    time.sleep(OUTAGE_SECONDS)  # the length of the outage, not a wait for anything
    gate.restore()
    after = len(tally.acknowledged)
    tally.wait_for(lambda t: len(t.acknowledged) >= after + SAVERS, "saves after the link came back")
