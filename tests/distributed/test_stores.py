"""Sharded saves through a real server on PostgreSQL, and a rank killed in the middle of a save."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptstore import client
from ckptstore.client.distributed import writer
from ckptstore.service.api.app import create_app
from ckptstore.service.db import Database
from ckptstore.service.db.holds import SAVE_LEASE_SECONDS
from ckptstore.service.db.models import utcnow
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.backends import empty_tables
from tests.distributed.fsdp_model import open_client, sharded, train
from tests.distributed.ranks import RANK_TIMEOUT, run_ranks, start_ranks
from tests.distributed.test_fsdp import STEPS, _resume, _train_save_continue
from tests.servers import running_server


@pytest.fixture
def server(pg_url: str, tmp_path: Path) -> Iterator[str]:
    """A uvicorn server on an emptied PostgreSQL database (blobs in a folder); yields its URL."""
    database = Database(pg_url)
    empty_tables(database)
    database.dispose()
    settings = Settings(home=tmp_path / "server", database_url=pg_url)
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings)) as url:
            yield url
    finally:
        store.close()


@pytest.mark.slow
def test_fsdp_resume_through_the_http_server_on_postgres(server: str, tmp_path: Path) -> None:
    """Both ranks upload their shards to the server at once; the coordinator commits; fresh
    ranks resume from it bit for bit."""
    uninterrupted = run_ranks(2, tmp_path, _train_save_continue, server)
    resumed = run_ranks(2, tmp_path, _resume, server)
    for rank in range(2):
        assert resumed[rank]["version"] == 1
        for key, tensor in uninterrupted[rank]["final"].items():
            assert resumed[rank]["final"][key].equal(tensor), key
    with client.Client(server) as remote:
        (version,) = remote.versions("fsdp")
        assert version.step == STEPS


def _save_and_pause(rank: int, world: int, home: str, events: Any) -> str:
    net, optim = sharded(world)
    train(net, optim, rank, range(1))

    def pause(paused_rank: int) -> None:
        if paused_rank == 1:
            events.put(os.getpid())
            threading.Event().wait()  # until the test kills this process

    writer.after_write_hook = pause
    try:
        open_client(home).save("crash", net, optim, step=1)
    except BaseException as exc:  # the coordinator loses its peer
        return f"failed: {type(exc).__name__}"
    return "saved"


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_no_version(tmp_path: Path) -> None:
    """Rank 1 stores its shards, then is killed before reporting them: the coordinator's save
    fails, no version exists, and the shards stored are unreferenced (garbage collection takes
    them once the save's lease has lapsed). A new save then commits version 1."""
    home = tmp_path / "store"
    started = start_ranks(2, tmp_path, _save_and_pause, str(home), extra_queue=True)
    pid = started.events.get(timeout=RANK_TIMEOUT)
    os.kill(pid, signal.SIGKILL)
    coordinator = started.result(0)
    started.join()
    assert coordinator.startswith("failed")
    with client.Client(home=home) as store:
        assert store.runs() == []
        engine = store.transport
        assert isinstance(engine, Store)
        later = utcnow() + timedelta(seconds=SAVE_LEASE_SECONDS + 1)
        assert engine.gc(grace_seconds=0, dry_run=True, now=later).shards_swept > 0
    run_ranks(2, tmp_path, _train_save_continue, str(home))
    with client.Client(home=home) as store:
        assert [v.version for v in store.versions("fsdp")] == [1]
