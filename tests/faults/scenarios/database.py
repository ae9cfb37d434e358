"""PostgreSQL stopped for a few seconds mid-run and started again, under saving clients.

The scenario runs a PostgreSQL cluster of its own (``initdb`` and ``pg_ctl`` in a temporary
folder on a free port, as the ``postgres`` user when run as root), never the machine's shared
one, and a real uvicorn server whose metadata lives in it. The clients' requests fail while
the database is down (503 answers, counted) and are retried; every save must commit once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from ckptstore.service.db import Database, schema
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import saved_through_outages
from tests.stress.procs import free_port

SAVERS = 3
SAVES = 3
#: How long the database stays down once the clients have felt it go: the fault's length.
OUTAGE_SECONDS = 3.0


def postgres_bin() -> Path:
    """The newest PostgreSQL server binaries installed (``/usr/lib/postgresql/<major>/bin``)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    if not found:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin: install postgresql")
    return found[-1].parent


class PrivateCluster:
    """A PostgreSQL cluster in ``folder`` on ``port``, trusting loopback connections."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.bin = postgres_bin()
        self.data = folder / "data"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/ckptstore"

    def _run(self, *args: str) -> None:
        user = "postgres" if os.geteuid() == 0 else None  # PostgreSQL refuses to run as root
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            cwd=self.folder,
            user=user,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stdout[-600:]}{done.stderr[-600:]}")

    def init(self) -> None:
        """Create the cluster and start it."""
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        self.start()
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as db:
            db.execute("CREATE DATABASE ckptstore")

    def start(self) -> None:
        """Start the server and return once it accepts connections (``pg_ctl -w``)."""
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o", options, "-w", "start")

    def stop(self) -> None:
        """Stop the server, ending every session (``pg_ctl -m fast``)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")


@contextmanager
def private_cluster() -> Iterator[PrivateCluster]:
    """A fresh cluster in a temporary folder the ``postgres`` user owns; stopped and removed after."""
    folder = Path(tempfile.mkdtemp(prefix="ckptstore-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
    cluster = PrivateCluster(folder, free_port())
    try:
        cluster.init()
        yield cluster
    finally:
        try:
            cluster._run("pg_ctl", "-D", str(cluster.data), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(folder, ignore_errors=True)


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Stop the database ``scale`` times under saving clients, each time until they feel it."""
    home = workdir / "home"
    tally = Tally()
    with private_cluster() as cluster:
        database = Database(cluster.url)
        try:
            schema.upgrade(database)
        finally:
            database.dispose()
        settings = Settings(home=home, database_url=cluster.url)
        store = open_store(settings)
        try:

            def outages() -> None:
                for _ in range(scale):
                    _outage(cluster, tally)

            findings = saved_through_outages(store, settings, tally, seed, SAVERS, SAVES, outages)
        finally:
            store.close()
    return ScenarioResult.of("database", seed, scale, tally, findings, outages=scale)


def _outage(cluster: PrivateCluster, tally: Tally) -> None:
    """Stop the database once saves are committing, hold it down, start it, wait for commits."""
    committed = len(tally.acknowledged)
    tally.wait_for(lambda t: len(t.acknowledged) >= committed + SAVERS, "saves before the outage")
    mark = tally.mark()
    cluster.stop()
    tally.wait_for(lambda t: t.outage_felt(mark), "a client to meet the stopped database")
    time.sleep(OUTAGE_SECONDS)  # the length of the outage, not a wait for anything
    cluster.start()
    after = len(tally.acknowledged)
    tally.wait_for(lambda t: len(t.acknowledged) >= after + SAVERS, "saves after the database came back")
