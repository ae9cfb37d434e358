"""The kill loop shared by tests/stress/test_kill.py and bench/stress.py.

Three modes, each on a fresh store:

- ``embedded``: the victim saves into ``home`` in-process and is killed at one of its own or
  the engine's phases;
- ``http-client``: the victim saves through a long-lived server and is killed at one of its
  phases (the server lives on and must clean up after it);
- ``http-server``: the server is killed at one of its phases while the victim saves through
  it; the victim must fail with StorageError, and the server restarts on the same home.

Each kill picks a phase, which occurrence of it, and a style: ``exact`` kills the process
while it waits at that phase; ``racing`` lets it go on and kills it a random moment (0-20 ms)
later, inside whatever comes next. After each job the driver counts temporary files, cleans
them, checks none remain, checks the store (:mod:`tests.stress.checks`) and starts the next
job at the step after the last committed one, first asking the store what that save must send
so the victim's report of what it sent can be checked against it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ckptstore.client.api import Client
from ckptstore.client.http.transport import remove_stale_staging
from ckptstore.service.format.safetensors_header import parse_header
from ckptstore.service.store import Store
from tests.stress.checks import RUN, Census, Expectation, StoreChecker, census, digest_set_hash
from tests.stress.model import StressNet
from tests.stress.procs import STEP_TIMEOUT, Server, Stuck, child_env, free_port, start_victims
from tests.stress.report import ModeReport

SHARD_BYTES = 192 << 10
JOB_SAVES = 4
AGED_SECONDS = 2 * 3600
MODES = ("embedded", "http-client", "http-server")

# Phase -> the highest occurrence a kill may target (per job): per-save phases come once per
# save, per-shard ones several times, "tensor" after every tensor written.
_PER_SAVE, _PER_SHARD, _PER_TENSOR = 2, 8, 12
PHASES: dict[str, dict[str, int]] = {
    "embedded": {
        "hash": _PER_SAVE,
        "missing": _PER_SAVE,
        "ingest": _PER_SHARD,
        "tensor": _PER_TENSOR,
        "verify": _PER_SHARD,
        "store-blob": _PER_SHARD,
        "record": _PER_SHARD,
        "recorded": _PER_SHARD,
        "commit": _PER_SAVE,
        "commit-flushed": _PER_SAVE,
        "committed": _PER_SAVE,
    },
    "http-client": {
        "hash": _PER_SAVE,
        "missing": _PER_SAVE,
        "ingest": _PER_SHARD,
        "tensor": _PER_TENSOR,
        "commit": _PER_SAVE,
        "committed": _PER_SAVE,
    },
    "http-server": {
        "receive": _PER_SHARD,
        "verify": _PER_SHARD,
        "store-blob": _PER_SHARD,
        "record": _PER_SHARD,
        "recorded": _PER_SHARD,
        "commit": _PER_SAVE,
        "commit-flushed": _PER_SAVE,
        "committed": _PER_SAVE,
    },
}


@dataclass(frozen=True)
class Target:
    """Where to kill: the ``occurrence``-th ``phase`` of a job, ``exact`` or ``racing``."""

    phase: str
    occurrence: int
    style: str
    delay: float


def choose_target(rng: random.Random, mode: str) -> Target:
    """A random kill point for ``mode``."""
    phase = rng.choice(sorted(PHASES[mode]))
    style = rng.choice(("exact", "racing"))
    return Target(phase, rng.randint(1, PHASES[mode][phase]), style, rng.uniform(0.0, 0.02) if style == "racing" else 0)


class KillSwitch:
    """A peer's phase handler: answers ``go`` until the target phase, then kills."""

    def __init__(self, target: Target, answer: Callable[[str], None], kill: Callable[[], None]) -> None:
        self.target, self.answer, self.kill = target, answer, kill
        self.seen: Counter[str] = Counter()
        self.fired = False

    def __call__(self, phase: str) -> None:
        self.seen[phase] += 1
        if self.fired:
            return  # the process is being killed: leave it waiting
        if phase == self.target.phase and self.seen[phase] == self.target.occurrence:
            self.fired = True
            if self.target.style == "racing":
                self.answer("go")
                time.sleep(self.target.delay)  # the randomisation itself: where in the next step it dies
            self.kill()
            return
        self.answer("go")


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone: _judge sees how it ended
        os.kill(pid, signal.SIGKILL)


class ModeRun:
    """One mode's processes, store and counters."""

    def __init__(self, mode: str, seed: int, workdir: Path) -> None:
        self.mode, self.seed = mode, seed
        self.rng = random.Random(seed)
        self.home, self.tmp, self.logs = workdir / "home", workdir / "tmp", workdir / "logs"
        for folder in (self.home, self.tmp, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self.report = ModeReport(mode, seed, phases=sorted(PHASES[mode]))
        self.checker = StoreChecker(self.home, self.tmp, seed, self.violation)
        self.store = Store.open_home(self.home)  # the driver's own view: files and rows
        self.env = child_env(self.home, self.tmp)
        self.port = free_port()
        self.server: Server | None = None
        self.victims = start_victims(self.env, self.logs / "victims.log")
        if mode != "embedded":
            self.server = Server(self.env, self.port, self.logs / "server.log", wait=mode == "http-server")
        self.job = 0

    def violation(self, message: str) -> None:
        self.report.violations.append(f"[{self.mode} seed={self.seed} job={self.job}] {message}")

    @property
    def url(self) -> str | None:
        return None if self.mode == "embedded" else f"http://127.0.0.1:{self.port}"

    def client(self) -> Client:
        return Client(self.url, home=self.home, shard_bytes=SHARD_BYTES)

    # -- one job ---------------------------------------------------------------------------

    def run_job(self) -> None:
        self.job += 1
        self.report.jobs += 1
        with self.client() as ckpt:
            expected = self.checker.expectation(ckpt, self.checker.next_step)
        target = choose_target(self.rng, self.mode)
        if self.mode == "http-server":
            assert self.server is not None
            switch = KillSwitch(target, self.server.peer.send, self.server.kill)
            self.server.peer.on_phase = switch
        else:
            victims = self.victims
            switch = KillSwitch(target, victims.send, lambda: _kill(victims.child_pid))
            victims.on_phase = switch
        job = {
            "run": RUN,
            "seed": self.seed,
            "start": expected.step,
            "count": JOB_SAVES,
            "wait": self.mode != "http-server",
            "shard_bytes": SHARD_BYTES,
            "home": str(self.home) if self.mode == "embedded" else None,
            "url": self.url,
        }
        self.victims.send(json.dumps(job))
        how, error = self._follow(expected)
        self._judge(switch, how, error)
        self._clean(server_killed=switch.fired and self.mode == "http-server")
        with self.client() as ckpt:
            self.checker.check_versions(ckpt)
        self._check_blobs()

    def _check_blobs(self) -> None:
        self.report.orphan_blobs_end = self.checker.check_blobs(self.store)
        self.report.orphan_blobs_seen = len(self.checker.orphans_seen)

    def _follow(self, expected: Expectation) -> tuple[str, str | None]:
        """Read the job's lines until its process ends; returns how it ended and its error line."""
        error = None
        first = True
        while True:
            line = self.victims.next_line()
            if line is None:
                raise Stuck("the victim fork server died")
            if line.startswith("saved "):
                self._check_save(json.loads(line[len("saved ") :]), expected if first else None)
                first = False
            elif line.startswith("error "):
                error = line[len("error ") :]
            elif line.startswith("exit "):
                return line.split()[2], error

    def _check_save(self, saved: dict[str, Any], expected: Expectation | None) -> None:
        self.report.saves_reported += 1
        version, step = int(saved["version"]), int(saved["step"])
        self.checker.acknowledged[version] = (step, str(saved["sha"]))
        if saved["sent"] != saved["missing"] or saved["sent_count"] != saved["missing_count"]:
            self.violation(f"version {version}: the shards sent hold other tensors than the store said it lacks")
        if saved["sent_bytes"] != saved["bytes_sent"]:
            self.violation(f"version {version}: sent {saved['sent_bytes']} bytes, the save says {saved['bytes_sent']}")
        if expected is None:
            return
        self.report.resave_checks += 1
        self.report.resave_bytes_sent += int(saved["bytes_sent"])
        self.report.resave_bytes_expected += expected.bytes_missing
        self.report.resave_bytes_reused += expected.bytes_reused
        if step != expected.step:
            self.violation(f"the job started at step {expected.step} but first saved step {step}")
        if saved["missing"] != expected.missing_hash or saved["bytes_sent"] != expected.bytes_missing:
            self.violation(
                f"re-save of step {step} sent {saved['bytes_sent']} bytes ({saved['missing_count']} tensors); "
                f"the store lacked {expected.bytes_missing} bytes ({len(expected.missing)} tensors)"
            )

    def _judge(self, switch: KillSwitch, how: str, error: str | None) -> None:
        target = switch.target
        if switch.fired and target.style == "racing" and how == "code:0":
            switch.fired = False  # let go, it finished its job before the signal landed: no kill
        if not switch.fired:
            if how != "code:0":
                self.violation(f"a job nobody killed ended with {how}: {error}")
            return
        self.report.kills += 1
        self.report.kills_by_phase[(target.phase, target.style)] += 1
        if self.mode == "http-server":
            assert self.server is not None
            ended = self.server.wait_exit()
            if ended != f"signal:{signal.SIGKILL.value}":
                self.violation(f"the server ended with {ended}, not by SIGKILL")
            if how != "code:3" or not (error or "").startswith("StorageError "):
                self.violation(f"with the server killed at {target.phase}, the save ended {how}: {error}")
        elif how != f"signal:{signal.SIGKILL.value}":
            self.violation(f"the victim killed at {target.phase} ended with {how}: {error}")

    # -- after a job -----------------------------------------------------------------------

    def _clean(self, *, server_killed: bool) -> None:
        if self.server is not None and not server_killed:
            # Done with the killed client's requests: idle, then a request on a new connection
            # (behind anything the dead client had already sent), then idle again.
            self.server.peer.wait_idle()
            httpx.get(f"{self.server.url}/healthz", timeout=STEP_TIMEOUT).raise_for_status()
            self.server.peer.wait_idle()
        before = census(self.home, self.tmp)
        self._count(before)
        if self.mode == "http-client" and before.staging:
            self.violation(f"the running server left {before.staging} staging files of a killed client")
        if server_killed:
            # The restarted server's own start-up cleanup must remove them once they are stale.
            for path in (self.home / "staging").glob("*"):
                stamp = path.stat().st_mtime - AGED_SECONDS
                os.utime(path, (stamp, stamp))
            assert self.server is not None
            self.server.start()
        else:
            cleaned = self.store.clean_staging(0)
            if cleaned.removed != before.staging + before.incoming or cleaned.failed:
                self.violation(f"clean_staging removed {cleaned.removed} of {before.staging + before.incoming} files")
        removed = remove_stale_staging(self.tmp, older_than_seconds=0)
        if removed != before.client_dirs:
            self.violation(f"removed {removed} of {before.client_dirs} stale client upload folders")
        after = census(self.home, self.tmp)
        self.report.temp_after += after.total
        if after.total or after.unexpected:
            self.violation(f"after cleanup: {after}")

    def _count(self, found: Census) -> None:
        self.report.store_temp_before += found.staging + found.incoming
        self.report.client_temp_before += found.client_dirs + found.client_files
        for name in found.unexpected:
            self.violation(f"unexpected file in the store's folder: {name}")

    # -- the end ---------------------------------------------------------------------------

    def finish(self) -> None:
        """A fresh client re-saves the last interrupted step; then every version is loaded again."""
        if self.server is not None:
            peer = self.server.peer
            peer.on_phase = lambda phase: peer.send("go")
        with self.client() as ckpt:
            expected = self.checker.expectation(ckpt, self.checker.next_step)
            sent: list[tuple[str, int]] = []
            transport: Any = ckpt.transport
            put_shard = transport.put_shard

            def recorded(header: bytes, *args: Any, **kwargs: Any) -> Any:
                sent.extend((e.digest, e.end - e.begin) for e in parse_header(header).entries)
                return put_shard(header, *args, **kwargs)

            transport.put_shard = recorded
            result = ckpt.save(RUN, StressNet(self.seed, expected.step), step=expected.step)
            self.report.resave_checks += 1
            self.report.resave_bytes_sent += result.bytes_sent
            self.report.resave_bytes_expected += expected.bytes_missing
            self.report.resave_bytes_reused += expected.bytes_reused
            if result.bytes_sent != expected.bytes_missing or digest_set_hash(d for d, _ in sent) != digest_set_hash(
                expected.missing
            ):
                self.violation(
                    f"final re-save sent {len(sent)} tensors, {result.bytes_sent} bytes; expected {expected}"
                )
            if sum(n for _, n in sent) != expected.bytes_missing or len(sent) != len(expected.missing):
                self.violation("final re-save sent a tensor twice or one the store had")
            self.checker.acknowledged[result.version] = (expected.step, self.checker.sha(expected.step))
            self.checker.check_versions(ckpt, reload_all=True)
            self.report.versions = len(self.checker.verified)
        self._check_blobs()
        self.report.loads_verified = self.checker.loads

    def close(self) -> None:
        self.victims.stop()
        if self.server is not None:
            self.server.stop()
        self.store.close()


def run_mode(mode: str, kills: int, seed: int, workdir: Path) -> ModeReport:
    """Kill ``kills`` times in ``mode`` and check the store after each; the report lists any violation."""
    started = time.perf_counter()
    run = ModeRun(mode, seed, workdir)
    try:
        while run.report.kills < kills and len(run.report.violations) < 20:
            run.run_job()
        run.finish()
    except Stuck as exc:
        run.violation(f"stuck: {exc}; logs in {run.logs}")
    finally:
        run.close()
    run.report.seconds = time.perf_counter() - started
    return run.report
