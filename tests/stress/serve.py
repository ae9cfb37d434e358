"""``python -m tests.stress.serve --port N [--wait]``: ``ckptstore serve`` announcing its phases.

A fork server like :mod:`tests.stress.victim`: it imports the service once and prints
``ready``; each ``start`` line on stdin forks a child that prints ``started <pid>`` and runs the
real command (:func:`client.cli.serve`, hence the real :func:`service.api.server.app_from_env`
with its start-up cleanup of stale staging files), and ``exit <pid> <how>`` follows when the
child ends, so a killed server restarts in a fork instead of a 2-second interpreter start.

The child announces the engine's write steps (see :mod:`tests.stress.phases`) plus ``phase
receive`` when a shard upload arrives, and reports every HTTP request as ``event start`` /
``event end``, so the driver knows when the server has finished with a client it killed.
Without ``--wait`` phases are only announced.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

import ckptstore.service.api.server  # noqa: F401  (binds service.api.server for the name below)
from ckptstore import service
from ckptstore.client.cli import serve
from tests.stress.phases import Phases, die_with_parent, install_store_hooks, read_line, say


class Tracked:
    """ASGI middleware reporting each HTTP request's start and end."""

    def __init__(self, app: Any, phases: Phases) -> None:
        self.app = app
        self.phases = phases

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        say("event start")
        try:
            if scope["method"] == "PUT" and scope["path"].startswith("/v1/shards/"):
                self.phases("receive")  # before the body is read
            await self.app(scope, receive, send)
        finally:
            say("event end")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--wait", action="store_true", help="block after each phase until 'go' arrives")
    args = parser.parse_args()
    die_with_parent()
    phases = Phases(args.wait)
    install_store_hooks(phases, entry_points=True)
    build = service.api.server.app_from_env
    service.api.server.app_from_env = lambda: Tracked(build(), phases)  # type: ignore[assignment,return-value]
    say("ready")
    while True:
        line = read_line()
        if line is None or line == "quit":
            return
        if line != "start":
            continue  # a 'go' meant for a server that was killed before reading it
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            code = 0
            try:
                say(f"started {os.getpid()}")
                serve(host="127.0.0.1", port=args.port, workers=1)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        how = f"signal:{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"code:{os.WEXITSTATUS(status)}"
        say(f"exit {pid} {how}")


if __name__ == "__main__":
    main()
