"""``ckptstore serve`` in a child process, started as an operator starts it.

For what only a process of its own shows: the memory the server uses (``/proc/<pid>/status``)
and the log it writes with the logging set-up of the real command. The server binds port 0
and the test reads the port from uvicorn's start-up line; everything it prints goes to a file.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Bound on the server's start-up: far above what it takes, only so a hung child fails the test.
START_TIMEOUT = 120.0
_RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class ServedProcess:
    """A running ``ckptstore serve``: its URL, process id and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path
    reader: threading.Thread = field(repr=False)

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.process.pid

    def stop(self) -> None:
        """Stop the server (SIGTERM, as an operator would) and wait until its log is complete."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.reader.join(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def status_bytes(self, field: str) -> int:
        """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024
        raise KeyError(field)

    def reset_peak(self) -> int:
        """Reset the process's peak resident memory to its current size, which is returned."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.status_bytes("VmHWM")


@contextmanager
def serve_process(home: Path, **settings: str) -> Iterator[ServedProcess]:
    """Run ``python -m client.cli serve`` with ``CKPTSTORE_<NAME>`` set from ``settings``.

    The child gets a clean environment for the service (no CKPTSTORE_* of the caller), its home
    in ``home`` and port 0 on loopback. It is terminated when the block ends; its output, up to
    then, is in ``<home>/serve.log``.
    """
    home.mkdir(parents=True, exist_ok=True)
    env = {name: value for name, value in os.environ.items() if not name.startswith("CKPTSTORE_")}
    env.update(
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        CKPTSTORE_HOME=str(home),
        CKPTSTORE_HOST="127.0.0.1",
        CKPTSTORE_PORT="0",
        CKPTSTORE_DISABLE_PROGRESS_BARS="1",
    )
    env.update({f"CKPTSTORE_{name.upper()}": value for name, value in settings.items()})
    log = home / "serve.log"
    ports: queue.Queue[int | None] = queue.Queue()
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.client.cli", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    def copy_output() -> None:
        assert process.stdout is not None
        with open(log, "wb") as out:
            for line in process.stdout:
                out.write(line)
                out.flush()
                found = _RUNNING.search(line.decode(errors="replace"))
                if found:
                    ports.put(int(found.group(1)))
        ports.put(None)

    reader = threading.Thread(target=copy_output, name="serve-output", daemon=True)
    reader.start()
    try:
        try:
            port = ports.get(timeout=START_TIMEOUT)
        except queue.Empty:
            port = None
        if port is None:
            raise RuntimeError(f"ckptstore serve did not start; its output:\n{log.read_text(errors='replace')}")
        yield ServedProcess(f"http://127.0.0.1:{port}", process, log, reader)
    finally:
        ServedProcess("", process, log, reader).stop()
