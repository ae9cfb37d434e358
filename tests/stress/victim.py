"""The process the kill tests SIGKILL: saves the deterministic model step after step.

``python -m tests.stress.victim`` starts a fork server: it imports torch and the client once,
prints ``ready``, then for each JSON job line on stdin forks a child that runs the job (so a
kill costs a fork, not a 3-second interpreter start) and prints ``exit <pid> <how>`` when
the child ends. A job's child prints, all on stdout:

- ``started <pid>`` first;
- ``phase <name>`` before each step of a save (and, when the job says ``wait``, blocks until
  a line ``go`` arrives): ``hash``, ``missing``, ``ingest`` (handing a shard to the store or server),
  ``tensor`` (after each tensor's bytes are written into the store's staging file; over HTTP,
  once the whole shard is sent),
  ``commit``, ``committed``; an embedded store adds its own (see :mod:`tests.stress.phases`);
- ``saved <json>`` after each save: version, step, state hash, what ``missing()`` returned and
  what the shards handed over actually held;
- ``error <class> <message>`` and exit code 3 when a save fails with a CheckpointError;
- ``done`` when every save of the job succeeded.

Job keys: ``home`` (embedded) or ``url``; ``run``, ``seed``, ``start``, ``count``, ``wait``,
``shard_bytes``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import sqlalchemy.dialects.sqlite  # noqa: F401  (imported before forking, not in every child)
import torch

import ckptstore.client.saving.saver  # noqa: F401  (binds client.saving.saver for the name below)
from ckptstore import client
from ckptstore.client.api import Client
from ckptstore.client.http.transport import HttpTransport
from ckptstore.service.errors import CheckpointError
from ckptstore.service.format.safetensors_header import parse_header
from tests.stress.checks import digest_set_hash
from tests.stress.model import StressNet, state_sha
from tests.stress.phases import Phases, die_with_parent, install_store_hooks, read_line, say

EXIT_CHECKPOINT_ERROR = 3
EXIT_CRASH = 4


class Recorder:
    """What one save asked the store for and what it handed over."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.missing: list[str] = []
        self.sent: list[tuple[str, int]] = []

    def reset(self) -> None:
        self.missing, self.sent = [], []

    def report(self) -> dict[str, Any]:
        return {
            "missing": digest_set_hash(self.missing),
            "missing_count": len(set(self.missing)),
            "sent": digest_set_hash([d for d, _ in self.sent]),
            "sent_count": len(self.sent),
            "sent_bytes": sum(n for _, n in self.sent),
        }


def install_client_hooks(ckpt: Client, phases: Phases) -> Recorder:
    """Announce the client's save steps and record what it asks for and sends."""
    recorder = Recorder()
    transport: Any = ckpt.transport
    digest_all = client.saving.saver.digest_all
    missing, put_shard, commit = transport.missing, transport.put_shard, transport.commit
    put_tensors = transport.put_tensors

    def hashed(*args: Any, **kwargs: Any) -> Any:
        phases("hash")
        return digest_all(*args, **kwargs)

    def asked(digests: Any, **keys: Any) -> list[str]:
        phases("missing")
        answer = list(missing(digests, **keys))
        recorder.missing += answer  # a save asks once per group of tensors it hashes
        return answer

    def put(header: bytes, pieces: Any, on_bytes: Callable[[int], object] | None = None, **keys: Any) -> Any:
        with recorder.lock:
            recorder.sent += [(e.digest, e.end - e.begin) for e in parse_header(header).entries]
        phases("ingest")

        def counted(count: int) -> None:
            if on_bytes is not None:
                on_bytes(count)
            phases("tensor")

        return put_shard(header, pieces, counted, **keys)

    def put_unhashed(tensors: Any, on_bytes: Callable[[int], object] | None = None, **keys: Any) -> Any:
        # Tensors of a size the store held none of go unhashed: never asked about, they were
        # missing when the save planned, so they count as asked for and as sent.
        phases("ingest")

        def counted(count: int) -> None:
            if on_bytes is not None:
                on_bytes(count)
            phases("tensor")

        receipt, digests = put_tensors(tensors, counted, **keys)
        with recorder.lock:
            recorder.missing += digests
            recorder.sent += [(d, t.data.nbytes) for d, t in dict(zip(digests, tensors, strict=True)).items()]
        return receipt, digests

    def committed(*args: Any, **kwargs: Any) -> Any:
        phases("commit")
        info = commit(*args, **kwargs)
        phases("committed")
        return info

    client.saving.saver.digest_all = hashed
    transport.missing, transport.put_shard, transport.commit = asked, put, committed
    transport.put_tensors = put_unhashed
    return recorder


def run_job(job: dict[str, Any]) -> int:
    """Run one job in this (forked) process; returns the exit code."""
    say(f"started {os.getpid()}")
    torch.set_num_threads(1)
    phases = Phases(bool(job["wait"]))
    if job.get("home"):
        install_store_hooks(phases, entry_points=False)
    try:
        with Client(job.get("url"), home=job.get("home"), shard_bytes=int(job["shard_bytes"])) as ckpt:
            if isinstance(ckpt.transport, HttpTransport):
                # A killed server should fail the save quickly, not after a minute of backoff.
                ckpt.transport.retries, ckpt.transport.backoff_seconds = 2, 0.02
            recorder = install_client_hooks(ckpt, phases)
            for step in range(int(job["start"]), int(job["start"]) + int(job["count"])):
                model = StressNet(int(job["seed"]), step)
                recorder.reset()
                result = ckpt.save(job["run"], model, step=step)
                report = {
                    "version": result.version,
                    "step": step,
                    "sha": state_sha(model.state_dict()),
                    "bytes_sent": result.bytes_sent,
                    **recorder.report(),
                }
                say("saved " + json.dumps(report))
    except CheckpointError as exc:
        say(f"error {type(exc).__name__} {' '.join(str(exc).split())}")
        return EXIT_CHECKPOINT_ERROR
    say("done")
    return 0


def serve_forks() -> None:
    """The fork server loop: one child per job line, one ``exit`` line per child."""
    die_with_parent()
    say("ready")
    while True:
        line = read_line()
        if line is None or line == "quit":
            return
        if not line.startswith("{"):
            continue  # a 'go' meant for a child that was killed before reading it
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            die_with_parent()
            code = EXIT_CRASH
            try:
                code = run_job(job)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        how = f"signal:{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"code:{os.WEXITSTATUS(status)}"
        say(f"exit {pid} {how}")


if __name__ == "__main__":
    serve_forks()
