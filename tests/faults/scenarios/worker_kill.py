"""The server process SIGKILLed mid-save and started again, while clients save through it.

The server is the crash test's instrumented ``ckptstore serve`` (:class:`tests.stress.procs.Server`,
a fork per start), which announces each step of its write path. Each kill lands at a seeded
step count after the last start: receiving a shard, verifying, storing or recording it,
committing. The clients ride out the restart with their retry budget (a save's commit is
repeated under its Idempotency-Key), so every save must commit, exactly once.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

from ckptstore.client.api import Client
from tests.faults.scenarios.checks import check_store
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import Savers, state_hash
from tests.stress.procs import Server, child_env, free_port

KILLS = 4
SAVERS = 2
#: A kill lands at one of the first this many write steps the server announces after a start.
STEPS_BEFORE_KILL = 30


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Kill and restart the server ``KILLS * scale`` times under saving clients; check the store."""
    home, tmp = workdir / "home", workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tally = Tally()
    stop = threading.Event()
    server = Server(child_env(home, tmp), free_port(), workdir / "server.log", wait=False)
    kills = 0
    try:
        savers = Savers(tally, seed, SAVERS, 2, url=server.url, until=stop, retry_seconds=60).start()
        try:
            for _ in range(KILLS * scale):
                _kill_at_step(server, rng.randint(1, STEPS_BEFORE_KILL))
                kills += 1
                # Started again at once: the clients find it through their retries.
                server.peer.reset_in_flight()
                server.peer.send("start")
                server.peer.expect("started ")
        finally:
            stop.set()
            savers.join()
        with Client(server.url) as ckpt:
            findings = check_store(ckpt, savers.runs, tally.acknowledged, lambda r, s: state_hash(seed, r, s))
    finally:
        server.stop()
    return ScenarioResult.of("worker-kill", seed, scale, tally, findings, kills=kills)


def _kill_at_step(server: Server, step: int) -> None:
    """SIGKILL the server at the ``step``-th write step it announces; return once it is gone."""
    seen = 0
    lock = threading.Lock()

    def on_phase(phase: str) -> None:
        nonlocal seen
        with lock:
            seen += 1
            if seen == step:
                server.kill()

    server.peer.on_phase = on_phase
    ended = server.wait_exit()
    server.peer.on_phase = lambda phase: None
    assert ended == "signal:9", f"the server ended with {ended}, not by SIGKILL; see {server.log}"
