"""Child processes for the kill tests: the fork server of victims and the instrumented server.

A :class:`Peer` reads its process's stdout on a thread. ``phase`` lines go to the peer's
``on_phase`` callback on that thread (which answers ``go`` or kills), ``event start`` and
``event end`` lines count the server's requests in flight, and every other line is queued
for the driver. No step waits on a timer except the bounded readiness poll of a server.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[2]
#: Bound on any single wait for a child: far above what a step takes, there only so a hung
#: child fails the run instead of hanging CI.
STEP_TIMEOUT = 120.0
PROTOCOL_LINES = frozenset({"ready", "started", "saved", "error", "done", "exit"})


class Stuck(Exception):
    """A child did not answer within :data:`STEP_TIMEOUT`."""


class Peer:
    """A child process speaking the phase protocol."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log: IO[bytes] = open(log, "ab")  # closed in stop()
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.on_phase: Callable[[str], None] = lambda phase: self.send("go")
        self._send_lock = threading.Lock()
        self._idle = threading.Condition()
        self.in_flight = 0
        self.child_pid = 0
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("phase "):
                self.on_phase(line[len("phase ") :])
            elif line.startswith("started "):
                # Set here, on the reader thread, before any phase of that child is handled.
                self.child_pid = int(line.split()[1])
                self.lines.put(line)
            elif line in ("event start", "event end"):
                with self._idle:
                    self.in_flight += 1 if line == "event start" else -1
                    self._idle.notify_all()
            elif line.split(" ", 1)[0] in PROTOCOL_LINES:
                self.lines.put(line)
            # Anything else (a server's start-up banner) is not for the driver.
        self.lines.put(None)

    def send(self, line: str) -> None:
        """Write a line to the child's stdin (ignored if it has died)."""
        assert self.proc.stdin is not None
        with self._send_lock:
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def next_line(self) -> str | None:
        """The next non-protocol line; None once the process closed its stdout."""
        try:
            return self.lines.get(timeout=STEP_TIMEOUT)
        except queue.Empty as exc:
            raise Stuck(f"{self.name} printed nothing for {STEP_TIMEOUT:.0f} s") from exc

    def expect(self, prefix: str) -> str:
        """The next line, which must start with ``prefix``."""
        line = self.next_line()
        if line is None or not line.startswith(prefix):
            raise Stuck(f"{self.name}: expected {prefix!r}, got {line!r}")
        return line

    def reset_in_flight(self) -> None:
        """Forget requests a killed process will never finish."""
        with self._idle:
            self.in_flight = 0

    def wait_idle(self) -> None:
        """Block until the server is handling no request."""
        with self._idle:
            if not self._idle.wait_for(lambda: self.in_flight == 0, timeout=STEP_TIMEOUT):
                raise Stuck(f"{self.name} still has {self.in_flight} requests in flight")

    def kill(self) -> None:
        """SIGKILL the process itself."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self) -> int:
        """Wait for the process to end; its return code."""
        try:
            code = self.proc.wait(timeout=STEP_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise Stuck(f"{self.name} did not exit") from exc
        self._reader.join(timeout=STEP_TIMEOUT)
        return code

    def stop(self) -> None:
        """End the fork server (children already ended) and release its pipes."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.send("quit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self._reader.join(timeout=STEP_TIMEOUT)
        self.proc.stdout.close()
        self._log.close()


def child_env(home: Path, tmp: Path) -> dict[str, str]:
    """The environment of every child: the store's home, a private temp folder, no progress bars,
    a 3 s retry budget."""
    env = dict(os.environ)
    env.update(
        CKPTSTORE_HOME=str(home),
        CKPTSTORE_DISABLE_PROGRESS_BARS="1",
        TMPDIR=str(tmp),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        # A killed server stays down until the save gives up: a short retry budget, not the
        # default that rides out a restart.
        CKPTSTORE_RETRY_SECONDS="3",
    )
    for name in ("CKPTSTORE_URL", "CKPTSTORE_DATABASE_URL", "CKPTSTORE_BLOBS", "CKPTSTORE_TOKENS"):
        env.pop(name, None)
    return env


def start_victims(env: dict[str, str], log: Path) -> Peer:
    """The fork server of saving clients, ready for jobs."""
    peer = Peer("victim", [sys.executable, "-m", "tests.stress.victim"], env, log)
    peer.expect("ready")
    return peer


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """The instrumented ``ckptstore serve`` on ``port``: children of a fork server, one at a time."""

    def __init__(self, env: dict[str, str], port: int, log: Path, *, wait: bool) -> None:
        argv = [sys.executable, "-m", "tests.stress.serve", "--port", str(port)] + (["--wait"] if wait else [])
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.peer = Peer("server", argv, env, log)
        self.peer.expect("ready")
        self.start()

    def start(self) -> None:
        """Start a server process and return once /healthz answers."""
        self.peer.reset_in_flight()  # a killed server never reports the end of its requests
        self.peer.send("start")
        self.peer.expect("started ")
        # Readiness: a bounded poll with short pauses; start-up work has no signal of its own.
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            if not self.peer.lines.empty():
                raise Stuck(f"the server ended before answering: {self.peer.lines.get()}; see {self.log}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise Stuck(f"the server did not answer {self.url}/healthz; see {self.log}")
            time.sleep(0.02)
        self.peer.wait_idle()  # the health checks themselves

    def kill(self) -> None:
        """SIGKILL the server process."""
        os.kill(self.peer.child_pid, signal.SIGKILL)

    def wait_exit(self) -> str:
        """Wait for the server process to end; how it ended (``signal:9``, ``code:0``)."""
        return self.peer.expect("exit ").split()[2]

    def stop(self) -> None:
        """Shut the running server down (SIGTERM), then the fork server."""
        try:
            os.kill(self.peer.child_pid, signal.SIGTERM)
            self.wait_exit()
        except (ProcessLookupError, Stuck):
            pass
        self.peer.stop()
