"""Clients that ask for large answers and never read them: the server's memory and /healthz.

Starts ``ckptstore serve`` (one worker, embedded store) holding one shard, opens ``--clients``
connections that each send ``POST /v1/shards/ranges`` for ``--batch-mib`` of it and never read
a byte, then reports the server's resident memory (``/proc/<pid>/status``) idle and with the
clients stalled, ``/healthz`` latency meanwhile (fresh connections, median and worst), and how
long the server kept the stalled connections open (it closes them with a reset, which the
clients see without reading).

    .venv/bin/python bench/slow_readers.py                          # 100 clients, 256 MiB each
    .venv/bin/python bench/slow_readers.py --set WRITE_TIMEOUT=5    # any CKPTSTORE_<NAME>=value
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckptstore.service.format.digest import shard_id, tensor_digest  # noqa: E402
from ckptstore.service.format.safetensors_header import encode_header  # noqa: E402


def shard(nbytes: int) -> tuple[str, bytes]:
    """A valid shard of one U8 tensor of ``nbytes`` random bytes: its id and its bytes."""
    data = os.urandom(nbytes)
    header, _ = encode_header([(tensor_digest("U8", (nbytes,), data), "U8", (nbytes,))])
    return shard_id(header), header + data


def rss(pid: int, field: str = "VmRSS") -> int:
    """A ``kB`` field of the process's ``/proc/<pid>/status``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise KeyError(field)


def serve(home: Path, settings: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """``ckptstore serve`` on a free loopback port; returns the process and the port once /healthz answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {name: value for name, value in os.environ.items() if not name.startswith("CKPTSTORE_")}
    env.update(CKPTSTORE_HOME=str(home), CKPTSTORE_PORT=str(port), CKPTSTORE_HOST="127.0.0.1")
    env.update({f"CKPTSTORE_{name.upper()}": value for name, value in settings.items()})
    server = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.client.cli", "serve"],
        cwd=ROOT,
        env=env,
        stdout=open(home / "serve.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            request("GET", port, "/healthz")
            return server, port
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"ckptstore serve did not start: {(home / 'serve.log').read_text()}") from None
            time.sleep(0.05)


def request(
    method: str, port: int, path: str, body: bytes | None = None, kind: str = "octet-stream"
) -> tuple[int, bytes]:
    """One request on a fresh connection: the status and the whole body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": f"application/{kind}"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def healthz_ms(port: int, count: int) -> list[float]:
    """``count`` timings of /healthz, one after the other, each on a new connection."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        status, _ = request("GET", port, "/healthz")
        times.append((time.perf_counter() - started) * 1000)
        assert status == 200, status
    return times


def stalled_client(port: int, body: bytes) -> socket.socket:
    """A connection that asks for the batch and will never read the answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/shards/ranges HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def settled_rss(pid: int, seconds: float) -> int:
    """The server's RSS once it has not grown for ``seconds`` (at most a minute of watching)."""
    deadline = time.monotonic() + 60
    last, since = rss(pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < seconds:
        time.sleep(0.2)
        now = rss(pid)
        if now > last + (1 << 20):
            last, since = now, time.monotonic()
    return rss(pid)


def closed_after(socks: list[socket.socket], started: float, limit: float) -> list[float]:
    """Seconds from ``started`` until the server closed each connection (POLLRDHUP or an error,
    seen without reading); connections still open at ``limit`` seconds are left out."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLRDHUP)
    closed = []
    while by_fd and (left := started + limit - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            if fd in by_fd:
                poller.unregister(fd)
                del by_fd[fd]
                closed.append(time.monotonic() - started)
    return closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--batch-mib", type=int, default=256, help="bytes each client asks for")
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--watch", type=float, default=90.0, help="seconds to wait for the server to close them")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a CKPTSTORE_ setting")
    args = parser.parse_args()
    settings = dict(item.split("=", 1) for item in args.set)
    with tempfile.TemporaryDirectory(prefix="slow-readers-") as folder:
        home = Path(folder)
        server, port = serve(home, settings)
        try:
            digest, data = shard(args.shard_mib << 20)
            status, _ = request("PUT", port, f"/v1/shards/{digest}", data)
            assert status in (200, 201), status
            whole = len(data)
            ranges, left = [], args.batch_mib << 20
            while left > 0:
                ranges.append({"shard_id": digest, "offset": 0, "length": min(whole, left)})
                left -= ranges[-1]["length"]
            body = json.dumps({"ranges": ranges}).encode()
            status, answer = request("POST", port, "/v1/shards/ranges", body, "json")  # warm up: one read in full
            assert status == 200 and len(answer) == args.batch_mib << 20, status
            del answer
            idle_rss = settled_rss(server.pid, 1.0)
            idle_ms = healthz_ms(port, 15)
            started = time.monotonic()
            socks = [stalled_client(port, body) for _ in range(args.clients)]
            ramp_ms = healthz_ms(port, 15)  # while the server takes the requests in
            stalled_rss = settled_rss(server.pid, 3.0)
            stalled_ms = healthz_ms(port, 15)
            peak_rss = rss(server.pid, "VmHWM")
            closed = closed_after(socks, started, args.watch)
            for sock in socks:
                sock.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(
        json.dumps(
            {
                "clients": args.clients,
                "batch_mib": args.batch_mib,
                "settings": settings,
                "idle_rss_mb": round(idle_rss / 1e6),
                "stalled_rss_mb": round(stalled_rss / 1e6),
                "peak_rss_mb": round(peak_rss / 1e6),
                "healthz_idle_ms": {"median": round(statistics.median(idle_ms), 1), "max": round(max(idle_ms), 1)},
                "healthz_ramp_ms": {"median": round(statistics.median(ramp_ms), 1), "max": round(max(ramp_ms), 1)},
                "healthz_stalled_ms": {
                    "median": round(statistics.median(stalled_ms), 1),
                    "max": round(max(stalled_ms), 1),
                },
                "closed_by_server": len(closed),
                "closed_within_s": round(max(closed), 1) if closed else None,
                "watched_s": args.watch,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
