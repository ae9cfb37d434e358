"""Garbage collection at grace 0, in a loop, beside clients saving through a server.

A grace of 0 lets gc delete any shard no committed version references yet, including one a
save has just sent and is about to commit. The scenario counts the saves that fail beside it
and checks that nothing acknowledged is lost.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ckptstore.client.api import Client
from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.faults.scenarios.checks import check_store
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import Savers, state_hash
from tests.servers import running_server

SAVERS = 3
SAVES = 6


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Save ``SAVES * scale`` versions from each of the clients while gc loops; check the store."""
    home = workdir / "home"
    tally = Tally()
    store = Store.open_home(home)
    passes, gc_errors = 0, []
    try:
        with running_server(create_app(store, Settings(home=home))) as url:
            savers = Savers(tally, seed, SAVERS, SAVES * scale, url=url)
            done = threading.Event()

            def collect() -> None:
                nonlocal passes
                while not done.is_set():
                    try:
                        store.gc(grace_seconds=0)
                    except Exception as exc:  # reported with the result: gc itself must not fail
                        gc_errors.append(exc)
                        tally.fail(exc)
                    passes += 1

            collector = threading.Thread(target=collect, name="scenario-gc", daemon=True)
            collector.start()
            savers.start()
            try:
                savers.join()
            finally:
                done.set()
                collector.join(timeout=120)
            with Client(url) as ckpt:
                findings = check_store(ckpt, savers.runs, tally.acknowledged, lambda r, s: state_hash(seed, r, s))
    finally:
        store.close()
    return ScenarioResult.of("gc-loop", seed, scale, tally, findings, gc_passes=passes, gc_errors=len(gc_errors))
